"""Find plugins through entry points and decide, for each, whether it takes part.

Order is deterministic: entry points sorted by name (then distribution), or the allowlist's
order when one is given. For each plugin, in this order:

1. the denylist and the allowlist decide ``disabled``;
2. the distribution's declared ``layer-boundary`` requirement (read from its metadata, before
   the manifest is loaded) decides ``incompatible``;
3. the entry point is loaded (a light module holding the manifest), and its hook-API version
   decides ``incompatible``;
4. declared hardware, then declared distributions, then the plugin's own check decide
   ``unavailable`` (the check's reason wins when it gives one);
5. the hook module is imported and registered: ``active``, or ``failed`` if anything raises.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as md
import logging
import os
import re
import time
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Mapping, Optional, Sequence

from .manifest import ENTRY_POINT_GROUP, HOOK_API_VERSION, PluginManifest, PluginStatus

log = logging.getLogger("layer_boundary.plugins")

__all__ = ["PluginRecord", "PluginError", "DiscoveryOptions", "find_plugins", "load_hooks", "warn_unknown_variables"]

ENV_ALLOW = "LAYER_BOUNDARY_PLUGINS"
ENV_DENY = "LAYER_BOUNDARY_DISABLE"
ENV_NO_AUTOLOAD = "LAYER_BOUNDARY_DISABLE_PLUGIN_AUTOLOAD"
ENV_STRICT = "LAYER_BOUNDARY_STRICT_PLUGINS"
# Every variable the core reads (tests/plugins/test_discovery.py checks the sources against this list). A
# plugin reads its own under LAYER_BOUNDARY_<NAME>_ (LAYER_BOUNDARY_FLASHINFER_MAX_TOKENS).
CORE_VARIABLES = (ENV_ALLOW, ENV_DENY, ENV_NO_AUTOLOAD, ENV_STRICT, "LAYER_BOUNDARY_CHECK_DP_COUNTS",
                  "LAYER_BOUNDARY_HANG_DUMP_S")


class PluginError(RuntimeError):
    """A plugin asked for by name is not active, or strict mode met a plugin warning."""


@dataclass
class PluginRecord:
    """What discovery found out about one plugin (the rows of ``layer-boundary plugins``)."""

    name: str
    distribution: Optional[str]
    version: Optional[str]
    api_version: Optional[int]
    provides: tuple[str, ...]
    status: PluginStatus
    reason: str
    entry_point: str
    manifest: Optional[PluginManifest] = field(default=None, repr=False)
    hooks: Any = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        # Not asdict(): it deep-copies every field, and ``hooks`` is often a module (unpicklable).
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("manifest", "hooks")}
        d["status"] = self.status.value
        d["provides"] = list(self.provides)
        return d


def _split(value: Optional[str], name: str = "") -> Optional[list[str]]:
    """A comma-separated list of plugin names; said when it names none although set (an allow
    list of none loads no plugin) or names one twice."""
    if value is None:
        return None
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names and value.strip():
        log.warning("%s=%r names no plugin%s", name, value,
                    ": no plugin is loaded (unset it to load every installed plugin)" if name == ENV_ALLOW else "")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        log.warning("%s names %s more than once; each is taken once, at its first place", name,
                    ", ".join(repr(n) for n in twice))
    return list(dict.fromkeys(names))


def _truthy(value: Optional[str], name: str = "") -> bool:
    """An on/off environment value; another word (``maybe``) warns that it is read as off."""
    v = (value or "").strip().lower()
    if v not in ("", "0", "false", "no", "off", "1", "true", "yes", "on"):
        log.warning("%s=%r is read as off; give 1 or 0 (true/false, yes/no, on/off)", name, value)
    return v in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class DiscoveryOptions:
    """Controls, from arguments or else from the environment.

    ``allow``: ordered allowlist (``[]`` means no plugin; ``None`` means every plugin).
    ``deny``: names never loaded. ``autoload=False``: only plugins named in ``allow`` load.
    ``strict``: every plugin warning (failed, incompatible, a requested plugin missing) raises.
    """

    allow: Optional[tuple[str, ...]] = None
    deny: tuple[str, ...] = ()
    autoload: bool = True
    strict: bool = False

    @classmethod
    def resolve(
        cls,
        *,
        allow: Optional[Sequence[str]] = None,
        deny: Optional[Sequence[str]] = None,
        autoload: Optional[bool] = None,
        strict: Optional[bool] = None,
        env: Optional[Mapping[str, str]] = None,
    ) -> "DiscoveryOptions":
        env = os.environ if env is None else env
        # Engines pass these from config files: a bare string would be read a character a name, and
        # any non-empty string ("no", "0") as on.
        for name, names in (("allow", allow), ("deny", deny)):
            if names is not None and (isinstance(names, (str, bytes)) or
                                      not all(isinstance(n, str) for n in names)):
                raise TypeError(f"discover({name}=...) takes a list of plugin names, got {names!r}; "
                                f"write {name}=[{names!r}] for one name" if isinstance(names, str) else
                                f"discover({name}=...) takes a list of plugin names (str), got {names!r}")
        for name, flag in (("autoload", autoload), ("strict", strict)):
            if flag is not None and not isinstance(flag, bool):
                raise TypeError(f"discover({name}=...) takes True or False, got {flag!r}")
        a = list(allow) if allow is not None else _split(env.get(ENV_ALLOW), ENV_ALLOW)
        d = list(deny) if deny is not None else (_split(env.get(ENV_DENY), ENV_DENY) or [])
        auto = autoload if autoload is not None else not _truthy(env.get(ENV_NO_AUTOLOAD), ENV_NO_AUTOLOAD)
        s = strict if strict is not None else _truthy(env.get(ENV_STRICT), ENV_STRICT)
        return cls(tuple(a) if a is not None else None, tuple(d), auto, s)


def _entry_points(group: str) -> list[md.EntryPoint]:
    eps = md.entry_points(group=group)
    return sorted(eps, key=lambda ep: (ep.name, _dist_name(ep) or ""))


def _dist_name(ep: md.EntryPoint) -> Optional[str]:
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else None


def _dist_version(ep: md.EntryPoint) -> Optional[str]:
    dist = getattr(ep, "dist", None)
    return dist.version if dist is not None else None


def _hardware_reason(hw: Optional[str]) -> Optional[str]:
    if hw is None:
        return None
    import torch

    if hw == "rocm":
        if getattr(torch.version, "hip", None) is None:
            return f"not a ROCm build of torch (torch {torch.__version__})"
        if not torch.cuda.is_available():
            return "no ROCm GPU visible"
        return None
    if getattr(torch.version, "hip", None) is not None:
        return f"needs CUDA, but torch {torch.__version__} is a ROCm build"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__} sees none)"
    return None


def _missing_distributions(names: Iterable[str]) -> list[str]:
    missing = []
    for n in names:
        try:
            md.version(n)
        except md.PackageNotFoundError:
            missing.append(n)
    return missing


def load_hooks(manifest: PluginManifest) -> Any:
    module, _, attr = manifest.hooks.partition(":")
    obj: Any = importlib.import_module(module)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj


def _describe_exc(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()


def find_plugins(options: DiscoveryOptions, group: str = ENTRY_POINT_GROUP) -> list[PluginRecord]:
    """Examine every entry point of ``group`` and import the hooks of those that qualify."""
    eps = _entry_points(group)
    if options.allow is not None:
        rank = {n: i for i, n in enumerate(options.allow)}
        eps.sort(key=lambda ep: rank.get(ep.name, len(rank)))
    records: list[PluginRecord] = []
    # Every distribution of a name offered twice fails: which one the engine gets must not depend
    # on the order distributions are listed in (a package sorted first once shadowed the MHC plugin).
    dists: dict[str, list[str]] = {}
    for ep in eps:
        if ep.name not in options.deny:
            # an entry point on sys.path without metadata has no distribution: name its target
            dists.setdefault(ep.name, []).append(_dist_name(ep) or f"{ep.value} (no distribution)")
    for ep in eps:
        rec = PluginRecord(
            name=ep.name, distribution=_dist_name(ep), version=_dist_version(ep), api_version=None,
            provides=(), status=PluginStatus.DISABLED, reason="", entry_point=ep.value,
        )
        records.append(rec)
        if ep.name in options.deny:  # a denied name is never examined, duplicates included
            rec.reason = f"disabled by {ENV_DENY} / deny"
            continue
        if len(dists[ep.name]) > 1:
            rec.status = PluginStatus.FAILED
            rec.reason = (f"duplicate plugin name {ep.name!r}: registered by {' and '.join(dists[ep.name])}; "
                          "uninstall all but one")
            continue
        if options.allow is not None and ep.name not in options.allow:
            rec.reason = f"not in the allowlist ({ENV_ALLOW} / allow)"
            continue
        if not options.autoload and (options.allow is None or ep.name not in options.allow):
            rec.reason = f"autoload is off ({ENV_NO_AUTOLOAD} / autoload=False); name it in {ENV_ALLOW} to load it"
            continue
        _examine(ep, rec)
    _warn_unknown_denied(options.deny, [ep.name for ep in eps],
                         {ep.name: _dist_name(ep) or "" for ep in eps})
    return records


def _loose(name: str) -> str:
    """A name as an operator may misremember it: any case, '-' or '_', or the distribution's name
    (layer-boundary-rocm-aiter for rocm_aiter)."""
    n = re.sub(r"[-_.]+", "-", name.strip().lower())
    return n[len("layer-boundary-"):] if n.startswith("layer-boundary-") else n


def _warn_unknown_denied(deny: Sequence[str], installed: list[str], dists: Optional[dict[str, str]] = None) -> None:
    """A deny entry that names no installed plugin (a typo, another case, ';' or ' ' between
    names) leaves the plugin it meant running: say so."""
    for name in deny:
        if name in installed:
            continue
        dist_of = dists or {}
        near = [n for n in installed if _loose(n) == _loose(name) or n in name.replace(";", " ").split()
                or (dist_of.get(n) and _loose(dist_of[n]) == _loose(name))]
        hint = f"; did you mean {', '.join(repr(n) for n in near)}? (names are separated by commas)" if near else ""
        log.warning("%s / deny names %r, which no installed plugin is called: nothing was disabled for it%s",
                    ENV_DENY, name, hint)


def _core_version() -> str:
    try:
        return md.version("layer-boundary")
    except md.PackageNotFoundError:  # run from a source tree without installing
        from .. import __version__

        return __version__


def _core_mismatch(ep: md.EntryPoint) -> Optional[str]:
    """Why the plugin's distribution cannot run on this core: its declared ``layer-boundary``
    requirement, which ``pip install --no-deps`` (or a constraints file) does not enforce. Read
    from the distribution's metadata, before its manifest is imported: a plugin built for a newer
    core may not even import here."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    for line in dist.requires or ():
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if canonicalize_name(req.name) != "layer-boundary" or not req.specifier:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        have = _core_version()
        if not req.specifier.contains(have, prereleases=True):
            return (f"{dist.metadata['Name']} {dist.version} needs layer-boundary{req.specifier}, and this is "
                    f"layer-boundary {have}; install a layer-boundary that meets it, or a "
                    f"version of {dist.metadata['Name']} built for {have}")
    return None


def warn_unknown_variables(env: Mapping[str, str], plugin_names: Iterable[str]) -> None:
    """A ``LAYER_BOUNDARY_*`` variable that nothing reads (``LAYER_BOUNDARY_PLUGIN``, one letter
    short) would leave the setting it meant unset without a word: say so, with the likely name."""
    prefixes = tuple(f"LAYER_BOUNDARY_{n.upper()}_" for n in plugin_names)
    for key in sorted(env):
        if not key.startswith("LAYER_BOUNDARY_") or key in CORE_VARIABLES or (prefixes and key.startswith(prefixes)):
            continue
        near = difflib.get_close_matches(key, CORE_VARIABLES, n=1, cutoff=0.8)
        hint = (f"did you mean {near[0]}?" if near else
                f"layer-boundary reads {', '.join(CORE_VARIABLES)}; an installed plugin NAME reads its "
                "own LAYER_BOUNDARY_NAME_* variables")
        log.warning("%s is set, but nothing reads it, so it changes nothing: %s", key, hint)


# A manifest import slower than this is said: a light module takes milliseconds.
MANIFEST_SLOW_S = 0.5


def _examine(ep: md.EntryPoint, rec: PluginRecord) -> None:
    try:
        mismatch = _core_mismatch(ep)
    except Exception as e:  # unreadable metadata: the manifest's hook-API version still decides
        log.debug("plugin %s: its layer-boundary requirement could not be read: %s", ep.name, _describe_exc(e))
        mismatch = None
    if mismatch:
        rec.status, rec.reason = PluginStatus.INCOMPATIBLE, mismatch
        return
    started = time.perf_counter()
    try:
        manifest = ep.load()
        took = time.perf_counter() - started
        if took > MANIFEST_SLOW_S:
            # Discovery reads every installed plugin's manifest at startup, usable or not.
            log.warning("plugin %s: importing its manifest (%s) took %.1f s; keep the manifest module light "
                        "(no torch or vendor imports: they belong in the hooks module, imported only when "
                        "the plugin is usable)", ep.name, ep.value, took)
    except BaseException as e:  # a plugin may raise anything, SystemExit included
        if isinstance(e, KeyboardInterrupt):
            raise
        rec.status, rec.reason = PluginStatus.FAILED, f"loading its manifest raised {_describe_exc(e)}"
        return
    if not isinstance(manifest, PluginManifest):
        rec.status = PluginStatus.FAILED
        rec.reason = (f"entry point {ep.value!r} gives a {type(manifest).__name__}, not a "
                      "layer_boundary._plugins.PluginManifest")
        return
    rec.manifest, rec.api_version, rec.provides = manifest, manifest.api_version, tuple(manifest.provides)
    if manifest.name != ep.name:
        rec.status = PluginStatus.FAILED
        fix = (f"rename the entry point to {manifest.name!r} (a manifest name is an identifier)"
               if not ep.name.isidentifier() else "make the two the same")
        rec.reason = f"manifest name {manifest.name!r} differs from its entry point name {ep.name!r}; {fix}"
        return
    if manifest.api_version != HOOK_API_VERSION:
        rec.status = PluginStatus.INCOMPATIBLE
        rec.reason = (f"built for hook API {manifest.api_version}, this layer-boundary speaks "
                      f"{HOOK_API_VERSION}; install a matching version of {rec.distribution or ep.name}")
        return
    try:
        # Most fundamental first: no pip install helps on the wrong hardware or torch build.
        declared = _hardware_reason(manifest.requires_hardware)
        missing = [] if declared else _missing_distributions(manifest.requires_distributions)
        if missing:
            lib = manifest.vendor_library or ", ".join(missing)
            declared = f"{lib} not installed (distribution {', '.join(missing)} not found)"
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        rec.status, rec.reason = PluginStatus.FAILED, f"its availability check raised {_describe_exc(e)}"
        return
    # The plugin's own probe is asked even when a declared requirement fails: it may know the
    # precise reason (an unrelated distribution owning the vendor's module name, say), and its
    # reason then wins. A probe that raises while a declared requirement fails was run outside its
    # preconditions, so the declared reason stands; with every declaration met it is a defect.
    own: Optional[str] = None
    if manifest.check is not None:
        try:
            own = manifest.check()
            if own is not None and not isinstance(own, str):
                raise TypeError(f"it returned {own!r}; return a reason string, or None when the "
                                "plugin can run here")
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            if declared is None:
                rec.status = PluginStatus.FAILED
                rec.reason = f"its availability check raised {_describe_exc(e)}"
                return
            own = None
    reason = own or declared
    if reason:
        rec.status, rec.reason = PluginStatus.UNAVAILABLE, str(reason)
        return
    try:
        rec.hooks = load_hooks(manifest)
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        rec.status, rec.reason = PluginStatus.FAILED, f"importing {manifest.hooks!r} raised {_describe_exc(e)}"
        return
    rec.status, rec.reason = PluginStatus.ACTIVE, ""
