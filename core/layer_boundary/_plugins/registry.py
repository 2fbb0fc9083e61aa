"""The plugin registry: pluggy's PluginManager, the providers collected from it, and freezing.

Hooks are called here, once, while the registry is built; each plugin is called through its own
subset caller so that one plugin raising marks only that plugin ``failed``. After ``freeze()``
nothing can be registered and no hook is called again.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import pluggy

from .discovery import DiscoveryOptions, PluginError, PluginRecord, find_plugins, warn_unknown_variables
from .hookspecs import PROJECT, LayerBoundarySpecs
from .manifest import ENTRY_POINT_GROUP, PluginStatus, Provides

if TYPE_CHECKING:
    from .._providers import NormKernelProvider, ResidualSemantics

__all__ = ["PluginRegistry", "discover"]

log = logging.getLogger("layer_boundary.plugins")

# Said after every error strict mode makes of a warning: where the mode comes from.
_STRICT = "[strict plugin mode: LAYER_BOUNDARY_STRICT_PLUGINS / strict=True]"

_HOOKS = (
    ("layer_boundary_norm_kernels", Provides.NORM_KERNELS),
    ("layer_boundary_fusion_providers", Provides.FUSION_PROVIDERS),
    ("layer_boundary_residual_semantics", Provides.RESIDUAL_SEMANTICS),
)


# What each hook's providers must have, callable (layer_boundary._providers' Protocols). A fusion
# provider's methods are all optional, but one it has must be callable.
_REQUIRED = {
    "layer_boundary_norm_kernels": ("refuse", "kernels"),
    "layer_boundary_fusion_providers": (),
    "layer_boundary_residual_semantics": ("stage", "exit"),
}
_OPTIONAL = ("attention_input", "ffn_input", "can_defer_finalize", "can_defer_all_reduce")


def _missing_methods(hook: str, provider: Any) -> str:
    """The methods ``provider`` lacks (or has but cannot call) for ``hook``: "" when none."""
    bad = [m for m in _REQUIRED[hook] if not callable(getattr(provider, m, None))]
    if hook == "layer_boundary_fusion_providers":
        bad += [m for m in _OPTIONAL if getattr(provider, m, None) is not None
                and not callable(getattr(provider, m))]
    return ", ".join(f"{m}()" for m in bad)


class PluginRegistry:
    """Active plugins and what they provide, in discovery order."""

    def __init__(self, records: Sequence[PluginRecord], options: Optional[DiscoveryOptions] = None) -> None:
        self.options = options or DiscoveryOptions()
        self.records = list(records)
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(LayerBoundarySpecs)
        self._frozen = False
        self.norm_kernels: list[tuple[str, NormKernelProvider]] = []
        # Any: a fusion provider implements only the FusionProvider methods it offers (all optional).
        self.fusion_providers: list[tuple[str, Any]] = []
        self.residual_semantics: dict[str, tuple[str, ResidualSemantics]] = {}
        self._clashes: dict[str, list[str]] = {}
        for rec in self.records:
            if rec.status is PluginStatus.ACTIVE:
                self._activate(rec)
        self._enforce()

    # -- building ----------------------------------------------------------------------------

    def _activate(self, rec: PluginRecord) -> None:
        try:
            self.pm.register(rec.hooks, name=rec.name)
        except (Exception, SystemExit) as e:  # a plugin's sys.exit() is its failure, not the engine's exit
            rec.status, rec.reason = PluginStatus.FAILED, f"its hooks do not match the specification: {e}"
            return
        # pluggy accepts hook implementations of names it has no spec for (pending ones): a typo then
        # left the plugin active while it provided nothing.
        implemented = {c.name: c.has_spec() for c in self.pm.get_hookcallers(rec.hooks) or []}
        unknown = sorted(name for name, known in implemented.items() if not known)
        if unknown:
            self.pm.unregister(rec.hooks)
            rec.status, rec.reason = PluginStatus.FAILED, (
                f"implements {', '.join(unknown)}, not a hook of layer-boundary (the hooks: "
                f"{', '.join(h for h, _ in _HOOKS)})")
            return
        if rec.provides and not implemented:
            self.pm.unregister(rec.hooks)
            rec.status, rec.reason = PluginStatus.FAILED, (
                f"declares it provides {', '.join(rec.provides)} but implements none of the hooks "
                f"({', '.join(h for h, _ in _HOOKS)}; each marked @hookimpl)")
            return
        undeclared = [p.value for h, p in _HOOKS if h in implemented and p.value not in rec.provides]
        if rec.provides and undeclared:
            # The listing shows the manifest's claim: say what the hooks add to it.
            log.warning("plugin %s implements %s, which its manifest does not declare in provides (%s); "
                        "declare it", rec.name, ", ".join(undeclared), ", ".join(rec.provides))
        unmet = [h for h, p in _HOOKS if p.value in rec.provides and h not in implemented]
        if unmet:
            log.warning("plugin %s declares it provides %s but implements no %s", rec.name,
                        ", ".join(p.value for h, p in _HOOKS if h in unmet), " or ".join(unmet))
        others = [p for p in self.pm.get_plugins() if p is not rec.hooks]
        collected: dict[str, list[Any]] = {}
        try:
            for hook, _ in _HOOKS:
                caller = self.pm.subset_hook_caller(hook, remove_plugins=others)
                results = caller()
                odd = [r for r in results if r is not None and not isinstance(r, (list, tuple))]
                if odd:
                    raise TypeError(f"{hook} must return a list of providers, got {odd[0]!r}")
                items = [x for r in results for x in (r or [])]
                for x in items:
                    if isinstance(x, type):
                        raise TypeError(f"{hook} returned the class {x.__name__}, not an instance of it")
                    if not getattr(x, "name", None):
                        raise TypeError(f"{hook} returned {x!r}, which has no name")
                    missing = _missing_methods(hook, x)
                    if missing:
                        raise TypeError(f"{hook} returned {x.name!r}, which lacks {missing} (see "
                                        "layer_boundary._providers for the interface)")
                collected[hook] = items
        except (Exception, SystemExit) as e:
            self.pm.unregister(rec.hooks)
            rec.status, rec.reason = PluginStatus.FAILED, f"a hook raised {type(e).__name__}: {e}"
            return
        empty = [p.value for h, p in _HOOKS if p.value in rec.provides and h in implemented and not collected[h]]
        if empty:
            log.warning("plugin %s declares it provides %s but its hook returned no provider", rec.name,
                        ", ".join(empty))
        self.norm_kernels += [(rec.name, x) for x in collected["layer_boundary_norm_kernels"]]
        self.fusion_providers += [(rec.name, x) for x in collected["layer_boundary_fusion_providers"]]
        for x in collected["layer_boundary_residual_semantics"]:
            if x.name == "plain":  # the core's own: semantics("plain") never looks here
                log.warning("plugin %s offers residual semantics 'plain', a name the core keeps for its "
                            "plain residual; the plugin's is ignored", rec.name)
                continue
            if x.name in self.residual_semantics:
                # Two schemes of one name: asking for it is an error naming both (never a silent pick).
                self._clashes.setdefault(x.name, [self.residual_semantics[x.name][0]]).append(rec.name)
                log.warning("residual semantics %r is provided by plugins %s", x.name,
                            " and ".join(self._clashes[x.name]))
                continue
            self.residual_semantics[x.name] = (rec.name, x)

    def _enforce(self) -> None:
        by_name = {r.name: r for r in self.records}
        if self.options.allow:
            for name in self.options.allow:
                rec = by_name.get(name)
                if rec is None:
                    near = [n for n in by_name if n.lower() == name.lower()]
                    # "mhc;flashinfer" or "mhc flashinfer" is one name: say how names are separated.
                    parts = [n for n in name.replace(";", " ").split() if n in by_name]
                    hint = (f" (did you mean {near[0]!r}?)" if near else
                            f" (did you mean {','.join(parts)}? names are separated by commas)" if parts else "")
                    raise PluginError(
                        f"plugin {name!r} is asked for by name but no installed distribution "
                        f"registers it in the entry-point group {ENTRY_POINT_GROUP!r}"
                        + hint
                        + "; install it or remove it from LAYER_BOUNDARY_PLUGINS / allow"
                    )
                if rec.status is not PluginStatus.ACTIVE:
                    raise PluginError(f"plugin {name!r} is asked for by name but is {rec.status.value}: {rec.reason}")
        for rec in self.records:
            if rec.status in (PluginStatus.FAILED, PluginStatus.INCOMPATIBLE):
                if self.options.strict:
                    raise PluginError(f"plugin {rec.name} ({rec.distribution}) is {rec.status.value}: "
                                      f"{rec.reason} {_STRICT}")
                log.warning("plugin %s (%s) is %s and skipped: %s", rec.name, rec.distribution, rec.status.value,
                            rec.reason)
            elif rec.status is PluginStatus.UNAVAILABLE:
                log.info("plugin %s is unavailable here: %s", rec.name, rec.reason)

    # -- use -----------------------------------------------------------------------------------

    @property
    def frozen(self) -> bool:
        return self._frozen

    def freeze(self) -> None:
        """No registration after this; the providers bound at construction are final. In strict
        mode a provider skipped for a defect during construction is an error here."""
        self._frozen = True
        if self.options.strict:
            from .._providers import defects_of

            names = {str(x.name) for _, x in self.norm_kernels + self.fusion_providers}
            defects = defects_of(names)
            if defects:
                raise PluginError(
                    "providers skipped for a defect while the model was built: "
                    + "; ".join(f"{name}: {why}" for name, why in defects)
                    + f" {_STRICT}"
                )

    def register(self, hooks: Any, *, name: str) -> None:
        """Register a plugin object directly (tests, engines with in-process providers)."""
        if self._frozen:
            raise PluginError(
                f"the plugin registry is frozen (model construction is over); register {name!r} "
                "before building the model"
            )
        if any(r.name == name and r.status is PluginStatus.ACTIVE for r in self.records):
            raise PluginError(f"a plugin named {name!r} is already registered; choose another name")
        rec = PluginRecord(name=name, distribution=None, version=None, api_version=None, provides=(),
                           status=PluginStatus.ACTIVE, reason="", entry_point="<registered in process>",
                           hooks=hooks)
        self.records.append(rec)
        self._activate(rec)
        if rec.status is not PluginStatus.ACTIVE:
            raise PluginError(f"plugin {name!r} could not be registered: {rec.reason}")

    def semantics(self, name: str) -> ResidualSemantics:
        """The residual scheme called ``name``; ``plain`` is always there."""
        if name == "plain":
            from ..residual._semantics import PLAIN_RESIDUAL

            return PLAIN_RESIDUAL
        found = self.residual_semantics.get(name)
        if name in self._clashes:
            owners = self._clashes[name]
            raise PluginError(
                f"residual semantics {name!r} is provided by plugins {', '.join(owners)}; disable all but "
                f"one (for example LAYER_BOUNDARY_DISABLE={','.join(o for o in owners if o != name) or owners[-1]})"
            )
        if found is None:
            known = ["plain", *sorted(self.residual_semantics)]
            near = [k for k in known if k.lower() == str(name).lower()]
            rec = next((r for r in self.records if r.name == name), None)
            if near:
                fix = f"names are case-sensitive: residual={near[0]!r}"
            elif rec is not None and rec.status is PluginStatus.ACTIVE:
                fix = f"plugin {name!r} is active but offers no residual semantics of that name"
            elif rec is not None:
                fix = f"plugin {name!r} is installed but {rec.status.value}: {rec.reason}"
            else:
                fix = "install the plugin that provides it (for MHC: pip install layer-boundary[mhc])"
            raise PluginError(f"no active plugin provides residual semantics {name!r} (available: {known}); {fix}")
        return found[1]

    def by_status(self) -> Mapping[str, list[str]]:
        out: dict[str, list[str]] = {}
        for r in self.records:
            out.setdefault(r.status.value, []).append(r.name)
        return out


def discover(
    *,
    allow: Optional[Sequence[str]] = None,
    deny: Optional[Sequence[str]] = None,
    autoload: Optional[bool] = None,
    strict: Optional[bool] = None,
    env: Optional[Mapping[str, str]] = None,
    group: str = ENTRY_POINT_GROUP,
) -> PluginRegistry:
    """Find, check and register plugins; arguments override the environment variables."""
    options = DiscoveryOptions.resolve(allow=allow, deny=deny, autoload=autoload, strict=strict, env=env)
    records = find_plugins(options, group)
    warn_unknown_variables(os.environ if env is None else env, [r.name for r in records])
    return PluginRegistry(records, options)
