"""Plugin discovery through real entry points: ``*.dist-info`` folders on ``sys.path``.

Each test installs its own small plugins (see ``plugin_fixtures``); plugins that this environment
really has installed may also be found, so assertions about "all" plugins filter to the test's own
(``site.mine``) or leave the others out with ``deny=site.foreign()``.
"""

from __future__ import annotations

import logging
import os
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from layer_boundary import BoundaryContext
from layer_boundary._plugins import HOOK_API_VERSION, PluginError, PluginStatus, discover
from plugin_fixtures import PluginSite, plugin_site  # noqa: F401  (fixture)

ACTIVE, FAILED, UNAVAILABLE = PluginStatus.ACTIVE, PluginStatus.FAILED, PluginStatus.UNAVAILABLE
DISABLED, INCOMPATIBLE = PluginStatus.DISABLED, PluginStatus.INCOMPATIBLE

# A hook module that must never be imported: it records the import (module marker) and raises,
# so an import would also turn the plugin's status into "failed".
NEVER_IMPORT = "raise RuntimeError('this hook module must never be imported')\n"


def by_name(registry):
    return {r.name: r for r in registry.records}


def names(records):
    return [r.name for r in records]


def origins(pairs):
    return [origin for origin, _ in pairs]


# -- order ------------------------------------------------------------------------------------


def test_order_is_sorted_by_name_whatever_the_install_order(plugin_site: PluginSite):
    for name in ("gamma", "alpha", "beta"):
        plugin_site.add(name)
    reg = discover()
    assert names(reg.records) == sorted(names(reg.records))
    assert names(plugin_site.mine(reg.records)) == ["alpha", "beta", "gamma"]
    assert [by_name(reg)[n].status for n in ("alpha", "beta", "gamma")] == [ACTIVE] * 3
    mine = [(o, p.name) for o, p in reg.fusion_providers if o in ("alpha", "beta", "gamma")]
    assert mine == [("alpha", "alpha-fusion"), ("beta", "beta-fusion"), ("gamma", "gamma-fusion")]
    # The record carries the distribution's metadata, read from the dist-info folder.
    rec = by_name(reg)["beta"]
    assert (rec.distribution, rec.version, rec.api_version) == ("lbt-beta", "1.0", HOOK_API_VERSION)
    assert rec.entry_point == "lbt_beta_manifest:MANIFEST"


def test_arguments_from_a_config_file_are_checked(plugin_site: PluginSite):
    # A trial: deny="acme" was read a character a name, strict="no" as on, autoload="false" as on.
    plugin_site.add("acme")
    for kwargs, text in ((dict(deny="acme"), r"deny=\.\.\.\) takes a list of plugin names, got 'acme'; write "
                                             r"deny=\['acme'\]"),
                         (dict(allow="acme"), r"allow=\['acme'\]"),
                         (dict(strict="no"), r"strict=\.\.\.\) takes True or False, got 'no'"),
                         (dict(autoload="false"), r"autoload=\.\.\.\) takes True or False")):
        with pytest.raises(TypeError, match=text):
            discover(**kwargs)
    assert by_name(discover(deny=["acme"]))["acme"].status is DISABLED


def test_a_deny_entry_that_names_no_plugin_warns(plugin_site: PluginSite, caplog):
    # A trial: LAYER_BOUNDARY_DISABLE=acmee, =Acme or ="acme;mhc" left acme running without a word.
    plugin_site.add("acme")
    for deny, hint in (("acmee", ""), ("Acme", "did you mean 'acme'"), ("acme;beta", "did you mean 'acme'")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="layer_boundary.plugins"):
            reg = discover(deny=[deny])
        assert by_name(reg)["acme"].status is ACTIVE
        assert f"deny names {deny!r}, which no installed plugin is called: nothing was disabled" in caplog.text
        assert hint in caplog.text


def test_a_deny_entry_with_dashes_or_the_distributions_name_hints_the_plugin(plugin_site: PluginSite, caplog):
    # A trial: LAYER_BOUNDARY_DISABLE=rocm-aiter (the plugin is rocm_aiter) warned with no hint.
    plugin_site.add("acme_gpu", dist="acme-boundary")
    for deny in ("acme-gpu", "ACME.GPU", "layer-boundary-acme-gpu", "layer_boundary_acme_gpu", "acme-boundary",
                 "acme_boundary"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="layer_boundary.plugins"):
            reg = discover(deny=[deny])
        assert by_name(reg)["acme_gpu"].status is ACTIVE
        assert f"deny names {deny!r}, which no installed plugin is called" in caplog.text
        assert "did you mean 'acme_gpu'" in caplog.text


def test_a_variable_nothing_reads_warns_with_the_likely_name(plugin_site: PluginSite, caplog):
    # An operator's finding: LAYER_BOUNDARY_PLUGIN=acme (one letter short) changed nothing, silently.
    plugin_site.add("acme")
    env = {"LAYER_BOUNDARY_PLUGIN": "acme", "LAYER_BOUNDARY_STRICT_PLUGIN": "1", "LAYER_BOUNDARY_FOO": "1",
           "LAYER_BOUNDARY_ACME_BLOCK": "8",  # a plugin's own variable: LAYER_BOUNDARY_<NAME>_*
           "LAYER_BOUNDARY_HANG_DUMP_S": "30", "LAYER_BOUNDARY_DISABLE": "", "OTHER_PLUGIN": "x"}
    with caplog.at_level(logging.WARNING, logger="layer_boundary.plugins"):
        discover(env=env)
    warned = [r.getMessage() for r in caplog.records if "nothing reads it" in r.getMessage()]
    assert len(warned) == 3, warned
    assert ("LAYER_BOUNDARY_PLUGIN is set, but nothing reads it, so it changes nothing: did you mean "
            "LAYER_BOUNDARY_PLUGINS?") in warned
    assert any(w.startswith("LAYER_BOUNDARY_STRICT_PLUGIN is set") and "LAYER_BOUNDARY_STRICT_PLUGINS?" in w
               for w in warned)
    assert any(w.startswith("LAYER_BOUNDARY_FOO is set") and "reads LAYER_BOUNDARY_PLUGINS," in w for w in warned)


def test_the_core_variables_list_names_every_variable_the_sources_read():
    import pathlib
    import re

    from layer_boundary._plugins.discovery import CORE_VARIABLES

    core = pathlib.Path(__file__).resolve().parents[2] / "core" / "layer_boundary"
    # every variable name the core spells as a whole string literal
    used = {m for f in core.rglob("*.py") for m in re.findall(r"[\"'](LAYER_BOUNDARY_[A-Z0-9_]+)[\"']", f.read_text())}
    assert used == set(CORE_VARIABLES), "add a new variable to discovery.CORE_VARIABLES"


def test_a_declared_hook_that_returns_nothing_warns(plugin_site: PluginSite, caplog):
    # A trial: a norm_kernels hook that returned None left the plugin active, offering nothing,
    # without a word.
    plugin_site.add("hollow", provides=("norm_kernels",), hooks_source="""
        from layer_boundary.plugin_api import hookimpl

        @hookimpl
        def layer_boundary_norm_kernels():
            return None
        """)
    with caplog.at_level(logging.WARNING, logger="layer_boundary.plugins"):
        reg = discover()
    assert by_name(reg)["hollow"].status is ACTIVE
    assert "plugin hollow declares it provides norm_kernels but its hook returned no provider" in caplog.text


def test_allowlist_order_decides_and_unlisted_plugins_are_not_even_imported(plugin_site: PluginSite):
    for name in ("alpha", "beta", "gamma"):
        plugin_site.add(name)
    reg = discover(allow=["gamma", "alpha"])
    assert names(reg.records)[:2] == ["gamma", "alpha"]
    assert origins(reg.fusion_providers) == ["gamma", "alpha"]
    assert origins(reg.norm_kernels) == ["gamma", "alpha"]
    beta = by_name(reg)["beta"]
    assert beta.status is DISABLED and "allowlist" in beta.reason
    assert not plugin_site.manifest_imported("beta") and not plugin_site.hooks_imported("beta")


# -- manifest before hooks ------------------------------------------------------------------------


@pytest.mark.parametrize("api_version", [HOOK_API_VERSION + 1, HOOK_API_VERSION - 1])
def test_other_hook_api_is_incompatible_and_its_hooks_are_never_imported(plugin_site: PluginSite, api_version):
    plugin_site.add(
        "future", api_version=api_version, hooks_source=NEVER_IMPORT,
        # The availability check also comes after the version check.
        manifest_extra="check=lambda: open(__file__ + '.checked', 'w').close(),",
    )
    plugin_site.add("good")
    reg = discover()
    rec = by_name(reg)["future"]
    assert rec.status is INCOMPATIBLE
    assert rec.api_version == api_version
    assert f"hook API {api_version}" in rec.reason and str(HOOK_API_VERSION) in rec.reason
    assert "lbt-future" in rec.reason  # what to reinstall
    assert plugin_site.manifest_imported("future")
    assert not plugin_site.hooks_imported("future")
    assert "lbt_future_hooks" not in sys.modules
    assert not (plugin_site.root / "lbt_future_manifest.py.checked").exists()
    assert rec.hooks is None and "future" not in origins(reg.fusion_providers)
    assert by_name(reg)["good"].status is ACTIVE


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import lbt_vendor_sdk_not_installed\n", "ModuleNotFoundError"),
        ("raise RuntimeError('manifest module exploded')\n", "manifest module exploded"),
        ("raise SystemExit(3)\n", "SystemExit"),
    ],
    ids=["import-error", "runtime-error", "system-exit"],
)
def test_manifest_that_cannot_be_imported_fails_with_its_reason(plugin_site: PluginSite, source, expected):
    plugin_site.add("broken", manifest_source=source, hooks_source=NEVER_IMPORT)
    plugin_site.add("good")
    reg = discover()
    rec = by_name(reg)["broken"]
    assert rec.status is FAILED
    assert "manifest" in rec.reason and expected in rec.reason
    assert not plugin_site.hooks_imported("broken")
    assert by_name(reg)["good"].status is ACTIVE


def test_hook_module_raising_on_import_fails_and_others_load(plugin_site: PluginSite):
    plugin_site.add("alpha")
    plugin_site.add("broken", hooks_source="raise ImportError('libvendor.so: cannot open shared object')\n")
    plugin_site.add("gamma")
    reg = discover()
    rec = by_name(reg)["broken"]
    assert rec.status is FAILED
    assert "lbt_broken_hooks" in rec.reason and "libvendor.so" in rec.reason
    assert plugin_site.hooks_imported("broken")  # it was attempted, after the manifest checks
    assert [by_name(reg)[n].status for n in ("alpha", "gamma")] == [ACTIVE, ACTIVE]
    assert [o for o in origins(reg.fusion_providers) if o in ("alpha", "broken", "gamma")] == ["alpha", "gamma"]


def test_hook_raising_fails_that_plugin_only(plugin_site: PluginSite):
    plugin_site.add("alpha")
    plugin_site.add("raiser", hooks_source='''
        from layer_boundary.plugin_api import hookimpl

        class Norm:
            name = "raiser-norm"

            def refuse(self, request):
                return "serves nothing"

            def kernels(self, request):
                raise AssertionError("never chosen")

        @hookimpl
        def layer_boundary_norm_kernels():
            return [Norm()]  # succeeds; must be discarded with the rest of the plugin

        @hookimpl
        def layer_boundary_fusion_providers():
            raise ValueError("boom inside the hook")
        ''')
    plugin_site.add("zulu")
    reg = discover()
    rec = by_name(reg)["raiser"]
    assert rec.status is FAILED
    assert "ValueError" in rec.reason and "boom inside the hook" in rec.reason
    # Nothing of the failed plugin is kept, not even what an earlier hook returned ...
    assert "raiser" not in origins(reg.norm_kernels) + origins(reg.fusion_providers)
    # ... and it is out of the plugin manager, so no later hook call reaches it.
    assert reg.pm.get_plugin("raiser") is None
    assert [by_name(reg)[n].status for n in ("alpha", "zulu")] == [ACTIVE, ACTIVE]
    assert [o for o in origins(reg.fusion_providers) if o in ("alpha", "zulu")] == ["alpha", "zulu"]
    assert [o for o in origins(reg.norm_kernels) if o in ("alpha", "zulu")] == ["alpha", "zulu"]


def test_provider_without_a_name_fails_the_plugin(plugin_site: PluginSite):
    plugin_site.add("nameless", hooks_source='''
        from layer_boundary.plugin_api import hookimpl

        @hookimpl
        def layer_boundary_fusion_providers():
            return [object()]
        ''')
    rec = by_name(discover())["nameless"]
    assert rec.status is FAILED and "no name" in rec.reason


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(manifest_source="MANIFEST = {'name': 'wrong'}\n"), "dict"),
        (dict(entry_point="lbt_wrong_manifest:NOT_THERE"), "NOT_THERE"),
        (dict(provides=("teleportation",)), "teleportation"),  # PluginManifest refuses it
    ],
    ids=["not-a-manifest", "missing-attribute", "invalid-manifest"],
)
def test_wrong_object_at_the_entry_point_fails(plugin_site: PluginSite, kwargs, expected):
    plugin_site.add("wrong", hooks_source=NEVER_IMPORT, **kwargs)
    rec = by_name(discover())["wrong"]
    assert rec.status is FAILED and expected in rec.reason
    assert not plugin_site.hooks_imported("wrong")


def test_manifest_name_must_match_the_entry_point_name(plugin_site: PluginSite):
    plugin_site.add("alias", manifest_name="someone_else", hooks_source=NEVER_IMPORT)
    rec = by_name(discover())["alias"]
    assert rec.status is FAILED
    assert "'someone_else'" in rec.reason and "'alias'" in rec.reason
    assert rec.reason.endswith("; make the two the same")
    assert not plugin_site.hooks_imported("alias")


def test_hooks_the_manifest_does_not_declare_warn(plugin_site: PluginSite, caplog):
    # A trial: the listing's provides column showed norm_kernels only, while the plugin's fusion
    # providers were chosen in the model.
    plugin_site.add("extra", provides=("norm_kernels",))
    with caplog.at_level(logging.WARNING, logger="layer_boundary.plugins"):
        reg = discover()
    assert by_name(reg)["extra"].status is ACTIVE
    assert "plugin extra implements fusion_providers, residual_semantics, which its manifest does not declare" \
        in caplog.text


def test_a_pin_in_another_case_gets_the_installed_name(plugin_site: PluginSite):
    plugin_site.add("acme")
    with pytest.raises(PluginError, match=r"plugin 'Acme' is asked for by name but no installed distribution "
                                          r"registers it .* \(did you mean 'acme'\?\)"):
        discover(allow=["Acme"])


def test_duplicate_name_fails_every_distribution(plugin_site: PluginSite):
    # Which of two plugins of one name the engine got once depended on the distributions' order
    # (a package sorted first shadowed the MHC plugin): now neither loads, and both say why.
    plugin_site.add("dup", dist="lbt-dup-a")
    plugin_site.distribution("lbt-dup-b", entry_points=[("dup", "lbt_dup_manifest:MANIFEST")])
    reg = discover()
    recs = [r for r in reg.records if r.name == "dup"]
    assert [(r.distribution, r.status) for r in recs] == [("lbt-dup-a", FAILED), ("lbt-dup-b", FAILED)]
    assert all("duplicate plugin name 'dup': registered by lbt-dup-a and lbt-dup-b" in r.reason for r in recs)
    assert origins(reg.fusion_providers).count("dup") == 0
    assert not plugin_site.hooks_imported("dup")


# -- availability ---------------------------------------------------------------------------------


def test_missing_distribution_is_unavailable_with_the_vendor_library_named(plugin_site: PluginSite):
    plugin_site.add(
        "needs_sdk", hooks_source=NEVER_IMPORT,
        manifest_extra="requires_distributions=('lbt-vendor-sdk-absent',), vendor_library='VendorSDK',",
    )
    rec = by_name(discover())["needs_sdk"]
    assert rec.status is UNAVAILABLE
    assert "VendorSDK not installed" in rec.reason and "lbt-vendor-sdk-absent" in rec.reason
    assert not plugin_site.hooks_imported("needs_sdk")


def test_present_distribution_is_found_through_metadata(plugin_site: PluginSite):
    plugin_site.distribution("lbt-vendor-sdk", "2.3")
    plugin_site.add("has_sdk", manifest_extra="requires_distributions=('lbt-vendor-sdk',),")
    assert by_name(discover())["has_sdk"].status is ACTIVE


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_plugin_is_unavailable_without_a_cuda_device(plugin_site: PluginSite):
    plugin_site.add("cuda_only", manifest_extra="requires_hardware='cuda',", hooks_source=NEVER_IMPORT)
    rec = by_name(discover())["cuda_only"]
    assert rec.status is UNAVAILABLE and "no CUDA device" in rec.reason
    assert not plugin_site.hooks_imported("cuda_only")


@pytest.mark.skipif(getattr(torch.version, "hip", None) is not None, reason="torch is a ROCm build here")
def test_rocm_plugin_is_unavailable_on_a_non_rocm_torch(plugin_site: PluginSite):
    plugin_site.add("rocm_only", manifest_extra="requires_hardware='rocm',", hooks_source=NEVER_IMPORT)
    rec = by_name(discover())["rocm_only"]
    assert rec.status is UNAVAILABLE and "not a ROCm build" in rec.reason


def test_check_returning_a_reason_makes_the_plugin_unavailable(plugin_site: PluginSite):
    plugin_site.add("picky", manifest_extra="check=lambda: 'needs a blue moon',", hooks_source=NEVER_IMPORT)
    plugin_site.add("easy", manifest_extra="check=lambda: None,")
    reg = discover()
    assert (by_name(reg)["picky"].status, by_name(reg)["picky"].reason) == (UNAVAILABLE, "needs a blue moon")
    assert by_name(reg)["easy"].status is ACTIVE
    assert not plugin_site.hooks_imported("picky")


def test_check_raising_fails_the_plugin(plugin_site: PluginSite):
    plugin_site.add("fragile", manifest_extra="check=lambda: 1 / 0,", hooks_source=NEVER_IMPORT)
    rec = by_name(discover())["fragile"]
    assert rec.status is FAILED and "ZeroDivisionError" in rec.reason
    assert not plugin_site.hooks_imported("fragile")


def test_check_returning_a_non_string_fails_the_plugin(plugin_site: PluginSite):
    plugin_site.add("sloppy", manifest_extra="check=lambda: False,", hooks_source=NEVER_IMPORT)
    rec = by_name(discover())["sloppy"]
    assert rec.status is FAILED and "False" in rec.reason


def test_check_reason_wins_over_a_failed_declaration(plugin_site: PluginSite):
    # The manifest documents this: the probe may know the precise reason.
    plugin_site.add(
        "precise", hooks_source=NEVER_IMPORT,
        manifest_extra="requires_distributions=('lbt-absent',), check=lambda: 'vendor module owned by lbt-other',",
    )
    rec = by_name(discover())["precise"]
    assert (rec.status, rec.reason) == (UNAVAILABLE, "vendor module owned by lbt-other")


def test_check_raising_outside_its_preconditions_keeps_the_declared_reason(plugin_site: PluginSite):
    plugin_site.add(
        "probe", hooks_source=NEVER_IMPORT,
        manifest_extra="requires_distributions=('lbt-absent',), check=lambda: 1 / 0,",
    )
    rec = by_name(discover())["probe"]
    assert rec.status is UNAVAILABLE and "lbt-absent" in rec.reason


def test_unavailable_is_not_an_error_even_in_strict_mode(plugin_site: PluginSite, caplog):
    # Hardware or a vendor library missing is the normal state of most machines, not a defect.
    plugin_site.add("picky", manifest_extra="check=lambda: 'needs a blue moon',")
    with caplog.at_level(logging.INFO, logger="layer_boundary.plugins"):
        reg = discover(strict=True, deny=plugin_site.foreign())
    assert by_name(reg)["picky"].status is UNAVAILABLE
    assert any("picky" in r.getMessage() and r.levelno < logging.WARNING for r in caplog.records)


# -- controls: allowlist, denylist, autoload, strict ----------------------------------------------


def test_env_allowlist_orders_and_api_argument_overrides_it(plugin_site: PluginSite, monkeypatch):
    for name in ("alpha", "beta", "gamma"):
        plugin_site.add(name)
    monkeypatch.setenv("LAYER_BOUNDARY_PLUGINS", " gamma ,beta")
    reg = discover()
    assert names(reg.records)[:2] == ["gamma", "beta"]
    assert origins(reg.fusion_providers) == ["gamma", "beta"]
    assert by_name(reg)["alpha"].status is DISABLED
    reg = discover(allow=["alpha"])
    assert origins(reg.fusion_providers) == ["alpha"]
    assert by_name(reg)["gamma"].status is DISABLED


def test_empty_allowlist_means_no_plugin_at_all(plugin_site: PluginSite, monkeypatch):
    for name in ("alpha", "beta"):
        plugin_site.add(name, hooks_source=NEVER_IMPORT)
    monkeypatch.setenv("LAYER_BOUNDARY_PLUGINS", "")
    reg = discover()
    assert {r.status for r in reg.records} <= {DISABLED}
    assert (reg.fusion_providers, reg.norm_kernels, reg.residual_semantics) == ([], [], {})
    assert not plugin_site.manifest_imported("alpha") and not plugin_site.manifest_imported("beta")
    # The API argument overrides a non-empty environment allowlist the same way.
    monkeypatch.setenv("LAYER_BOUNDARY_PLUGINS", "alpha,beta")
    reg = discover(allow=[])
    assert {r.status for r in reg.records} <= {DISABLED} and reg.fusion_providers == []


def test_env_denylist_and_api_override(plugin_site: PluginSite, monkeypatch):
    plugin_site.add("alpha")
    plugin_site.add("beta", hooks_source=NEVER_IMPORT)
    monkeypatch.setenv("LAYER_BOUNDARY_DISABLE", "beta,unrelated")
    reg = discover()
    beta = by_name(reg)["beta"]
    assert beta.status is DISABLED and "LAYER_BOUNDARY_DISABLE" in beta.reason
    assert not plugin_site.manifest_imported("beta") and not plugin_site.hooks_imported("beta")
    assert by_name(reg)["alpha"].status is ACTIVE
    reg = discover(deny=["alpha"])  # replaces the environment's list
    assert by_name(reg)["alpha"].status is DISABLED
    assert by_name(reg)["beta"].status is FAILED  # now loaded, and its hook module raises


def test_autoload_off_loads_only_named_plugins(plugin_site: PluginSite, monkeypatch):
    plugin_site.add("alpha", hooks_source=NEVER_IMPORT)
    plugin_site.add("beta")
    monkeypatch.setenv("LAYER_BOUNDARY_DISABLE_PLUGIN_AUTOLOAD", "1")
    reg = discover()
    assert [r.status for r in plugin_site.mine(reg.records)] == [DISABLED, DISABLED]
    assert "autoload" in by_name(reg)["alpha"].reason
    assert not plugin_site.manifest_imported("alpha") and not plugin_site.manifest_imported("beta")
    monkeypatch.setenv("LAYER_BOUNDARY_PLUGINS", "beta")
    reg = discover()
    assert (by_name(reg)["alpha"].status, by_name(reg)["beta"].status) == (DISABLED, ACTIVE)
    assert origins(reg.fusion_providers) == ["beta"]
    assert not plugin_site.manifest_imported("alpha")
    monkeypatch.delenv("LAYER_BOUNDARY_PLUGINS")
    reg = discover(autoload=True, deny=["alpha"])  # the API argument overrides the environment
    assert by_name(reg)["beta"].status is ACTIVE


def test_autoload_off_by_api_argument(plugin_site: PluginSite):
    plugin_site.add("alpha")
    reg = discover(autoload=False)
    assert by_name(reg)["alpha"].status is DISABLED
    assert by_name(discover(autoload=False, allow=["alpha"]))["alpha"].status is ACTIVE


@pytest.mark.parametrize("kind", ["failed", "incompatible"])
def test_strict_mode_turns_a_skipped_plugin_into_an_error(plugin_site: PluginSite, monkeypatch, caplog, kind):
    if kind == "failed":
        plugin_site.add("bad", hooks_source="raise RuntimeError('vendor init exploded')\n")
        why = "vendor init exploded"
    else:
        plugin_site.add("bad", api_version=HOOK_API_VERSION + 7, hooks_source=NEVER_IMPORT)
        why = f"hook API {HOOK_API_VERSION + 7}"
    plugin_site.add("good")
    deny = plugin_site.foreign()
    # Lenient by default: reported with its reason at warning level, and skipped.
    with caplog.at_level(logging.WARNING, logger="layer_boundary.plugins"):
        reg = discover(deny=deny)
    assert by_name(reg)["bad"].status.value == kind and by_name(reg)["good"].status is ACTIVE
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("bad" in m and why in m for m in warned)

    monkeypatch.setenv("LAYER_BOUNDARY_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match=f"bad.*{kind}.*{why}"):
        discover(deny=deny)
    assert by_name(discover(deny=deny, strict=False))["bad"].status.value == kind
    monkeypatch.delenv("LAYER_BOUNDARY_STRICT_PLUGINS")
    with pytest.raises(PluginError, match=why):
        discover(deny=deny, strict=True)


def _make(site: PluginSite, kind: str) -> str:
    """Install a plugin named ``wanted`` that ends in ``kind``; return the expected reason text."""
    if kind == "failed":
        site.add("wanted", hooks_source="raise RuntimeError('vendor init exploded')\n")
        return "failed: importing 'lbt_wanted_hooks' raised RuntimeError: vendor init exploded"
    if kind == "unavailable":
        site.add("wanted", manifest_extra="check=lambda: 'needs a blue moon',")
        return "unavailable: needs a blue moon"
    if kind == "incompatible":
        site.add("wanted", api_version=HOOK_API_VERSION + 1)
        return f"incompatible: built for hook API {HOOK_API_VERSION + 1}"
    assert kind == "not-installed"
    return "no installed distribution registers it"


@pytest.mark.parametrize("kind", ["failed", "unavailable", "incompatible", "not-installed"])
@pytest.mark.parametrize("how", ["env", "api"])
def test_plugin_asked_for_by_name_must_be_active(plugin_site: PluginSite, monkeypatch, kind, how):
    why = _make(plugin_site, kind)
    plugin_site.add("good")
    if how == "env":
        monkeypatch.setenv("LAYER_BOUNDARY_PLUGINS", "good,wanted")
        call = dict()
    else:
        call = dict(allow=["good", "wanted"])
    with pytest.raises(PluginError, match="'wanted'") as info:
        discover(**call)
    assert why in str(info.value)
    # Named alone it is fine to leave it out: the good one still loads.
    assert origins(discover(allow=["good"]).fusion_providers) == ["good"]


def test_plugin_asked_for_by_name_but_denied_fails(plugin_site: PluginSite):
    plugin_site.add("wanted")
    with pytest.raises(PluginError, match="'wanted'.*disabled"):
        discover(allow=["wanted"], deny=["wanted"])


def test_boundary_context_discover_passes_the_controls(plugin_site: PluginSite):
    plugin_site.add("alpha")
    plugin_site.add("beta")
    ctx = BoundaryContext.discover(allow=["beta"])
    assert [p.name for p in ctx.fusion_providers()] == ["beta-fusion", "core-symm-mem"]
    assert ctx.provider_origin(ctx.fusion_providers()[0]) == "beta"
    # Plugin norm providers come before the core's (Triton, then the torch reference).
    assert [o for o, _ in ctx.norm_candidates()] == ["beta", "core", "core"]


# -- nothing at import time -----------------------------------------------------------------------


def test_import_layer_boundary_discovers_nothing(plugin_site: PluginSite):
    """``import layer_boundary`` loads no entry point, imports no plugin module and no pluggy."""
    plugin_site.add("spy")
    script = textwrap.dedent(
        """
        import importlib.metadata as md, json, sys
        import torch  # what the core needs anyway; anything it imports is not ours to judge
        before = set(sys.modules)
        calls = []
        real_eps, real_load = md.entry_points, md.EntryPoint.load
        md.entry_points = lambda *a, **k: (calls.append(("entry_points", k.get("group"))), real_eps(*a, **k))[1]
        md.EntryPoint.load = lambda self: (calls.append(("load", self.name)), real_load(self))[1]

        import layer_boundary

        new = set(sys.modules) - before
        out = {
            "calls": list(calls),
            "plugins_module": "layer_boundary.plugins" in sys.modules,
            "pluggy": sorted(m for m in new if m == "pluggy" or m.startswith("pluggy.")),
            "spy": sorted(m for m in sys.modules if m.startswith("lbt_")),
        }
        # The control: discovery itself does find and load the plugin from this path.
        from layer_boundary._plugins import discover
        reg = discover(allow=["spy"])
        out["after"] = sorted(m for m in sys.modules if m.startswith("lbt_"))
        out["after_calls"] = [c[0] for c in calls]
        print(json.dumps(out))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYER_BOUNDARY_")}
    env["PYTHONPATH"] = os.pathsep.join([str(plugin_site.root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["calls"] == []
    assert out["plugins_module"] is False
    assert out["pluggy"] == []
    assert out["spy"] == []
    # The control shows the setup would have been seen.
    assert out["after"] == ["lbt_spy_hooks", "lbt_spy_manifest"]
    assert "entry_points" in out["after_calls"] and "load" in out["after_calls"]


def test_an_on_off_variable_with_another_word_warns_that_it_is_off(caplog):
    from layer_boundary._plugins.discovery import ENV_STRICT, DiscoveryOptions

    with caplog.at_level("WARNING", logger="layer_boundary.plugins"):
        assert not DiscoveryOptions.resolve(env={ENV_STRICT: "maybe"}).strict
    assert f"{ENV_STRICT}='maybe' is read as off" in caplog.text
    assert DiscoveryOptions.resolve(env={ENV_STRICT: "Yes"}).strict
