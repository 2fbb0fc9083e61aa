"""The plugin registry: providers in discovery order with their origin, in-process registration,
freezing, and the residual-semantics lookup."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from layer_boundary import BoundaryContext
from layer_boundary._plugins import PluginError, PluginRegistry, PluginStatus, discover, hookimpl
from layer_boundary.residual._semantics import PLAIN_RESIDUAL
from plugin_fixtures import PluginSite, plugin_site  # noqa: F401  (fixture)

TWO_FUSIONS = '''
from layer_boundary.plugin_api import hookimpl


class P:
    def __init__(self, name):
        self.name = name


class S(P):
    def stage(self, hidden_size, *, dtype, device=None):
        raise AssertionError("never used")

    exit = stage


@hookimpl
def layer_boundary_fusion_providers():
    return [P(PLUGIN + "-first"), P(PLUGIN + "-second")]


@hookimpl
def layer_boundary_norm_kernels():
    return None  # "nothing" is allowed


@hookimpl
def layer_boundary_residual_semantics():
    return [S("shared"), S(PLUGIN + "-own")]
'''


def named(pairs, origins=None):
    return [(o, p.name) for o, p in pairs if origins is None or o in origins]


class InProcess:
    """A plugin object registered without a distribution (engines, tests)."""

    def __init__(self, tag: str, *, fusions=(), norms=(), semantics=()) -> None:
        self.tag = tag
        self._fusions, self._norms, self._semantics = list(fusions), list(norms), list(semantics)

    @hookimpl
    def layer_boundary_fusion_providers(self):
        return self._fusions

    @hookimpl
    def layer_boundary_norm_kernels(self):
        return self._norms

    @hookimpl
    def layer_boundary_residual_semantics(self):
        return self._semantics


def thing(name: str) -> SimpleNamespace:
    """A provider of any kind: a norm-kernel provider's and a residual scheme's methods (never called)."""
    def never(*args, **kwargs):
        raise AssertionError("never called")

    return SimpleNamespace(name=name, refuse=lambda request: "test provider serves nothing", kernels=never,
                           stage=never, exit=never)


# -- collection order --------------------------------------------------------------------------


def test_providers_are_collected_in_discovery_order_with_their_origin(plugin_site: PluginSite, caplog):
    plugin_site.add("beta", hooks_source=TWO_FUSIONS)
    plugin_site.add("alpha", hooks_source=TWO_FUSIONS)
    plugin_site.add("gamma")  # the default hooks: one provider of each kind
    with caplog.at_level(logging.WARNING, logger="layer_boundary.plugins"):
        reg = discover()
    ours = ("alpha", "beta", "gamma")
    assert named(reg.fusion_providers, ours) == [
        ("alpha", "alpha-first"), ("alpha", "alpha-second"),
        ("beta", "beta-first"), ("beta", "beta-second"),
        ("gamma", "gamma-fusion"),
    ]
    assert named(reg.norm_kernels, ours) == [("gamma", "gamma-norm")]
    # A semantics name provided twice: asking for it is an error naming both plugins (a third-party
    # plugin must not silently take over, say, "mhc"), with a warning at discovery.
    with pytest.raises(PluginError, match="'shared' is provided by plugins alpha, beta; disable all but one"):
        reg.semantics("shared")
    assert reg.semantics("beta-own").name == "beta-own"
    assert any("shared" in r.getMessage() and "beta" in r.getMessage() and "alpha" in r.getMessage()
               for r in caplog.records)

    # The allowlist order is the collection order.
    reg = discover(allow=["gamma", "beta", "alpha"])
    assert [o for o, _ in reg.fusion_providers] == ["gamma", "beta", "beta", "alpha", "alpha"]
    assert reg.residual_semantics["shared"][0] == "beta"


def test_in_process_registration_comes_after_discovered_plugins(plugin_site: PluginSite):
    plugin_site.add("alpha")
    reg = discover(allow=["alpha"])
    reg.register(InProcess("x", fusions=[thing("engine-fusion")], norms=[thing("engine-norm")]), name="engine")
    assert named(reg.fusion_providers) == [("alpha", "alpha-fusion"), ("engine", "engine-fusion")]
    assert named(reg.norm_kernels) == [("alpha", "alpha-norm"), ("engine", "engine-norm")]
    rec = reg.records[-1]
    assert (rec.name, rec.status, rec.distribution) == ("engine", PluginStatus.ACTIVE, None)
    assert reg.by_status()["active"] == ["alpha", "engine"]


def test_register_without_any_discovery():
    reg = PluginRegistry([])
    assert (reg.fusion_providers, reg.norm_kernels, reg.residual_semantics) == ([], [], {})
    a, b = thing("a"), thing("b")
    reg.register(InProcess("p", fusions=[a, b]), name="p")
    assert reg.fusion_providers == [("p", a), ("p", b)]


def test_register_refuses_a_plugin_whose_hook_raises_and_keeps_nothing_of_it():
    class Raiser(InProcess):
        @hookimpl
        def layer_boundary_residual_semantics(self):
            raise KeyError("no such vendor table")

    reg = PluginRegistry([])
    with pytest.raises(PluginError, match="'raiser'.*KeyError.*no such vendor table"):
        reg.register(Raiser("r", fusions=[thing("f")], norms=[thing("n")]), name="raiser")
    assert (reg.fusion_providers, reg.norm_kernels) == ([], [])
    assert reg.pm.get_plugin("raiser") is None
    assert reg.records[-1].status is PluginStatus.FAILED
    # The registry still works for the next plugin.
    reg.register(InProcess("ok", fusions=[thing("g")]), name="ok")
    assert named(reg.fusion_providers) == [("ok", "g")]


def test_register_refuses_hooks_that_do_not_match_the_specification():
    class WrongSignature:
        @hookimpl
        def layer_boundary_fusion_providers(self, plan):  # the spec takes no argument
            return []

    reg = PluginRegistry([])
    with pytest.raises(PluginError, match="'wrong'.*specification"):
        reg.register(WrongSignature(), name="wrong")


def test_register_refuses_a_name_already_taken():
    reg = PluginRegistry([])
    reg.register(InProcess("one", fusions=[thing("f1")]), name="same")
    with pytest.raises(PluginError, match="'same'"):
        reg.register(InProcess("two", fusions=[thing("f2")]), name="same")
    assert named(reg.fusion_providers) == [("same", "f1")]


# -- freezing ------------------------------------------------------------------------------------


def test_freeze_then_register_raises():
    reg = PluginRegistry([])
    reg.register(InProcess("early", fusions=[thing("f")]), name="early")
    assert not reg.frozen
    reg.freeze()
    assert reg.frozen
    with pytest.raises(PluginError, match="frozen.*'late'"):
        reg.register(InProcess("late", fusions=[thing("g")]), name="late")
    assert named(reg.fusion_providers) == [("early", "f")]
    assert reg.pm.get_plugin("late") is None


def test_context_freeze_freezes_its_registry():
    reg = PluginRegistry([])
    ctx = BoundaryContext(registry=reg)
    assert not ctx.frozen and not reg.frozen
    ctx.freeze()
    assert ctx.frozen and reg.frozen
    with pytest.raises(PluginError, match="frozen"):
        reg.register(InProcess("late"), name="late")


# -- residual semantics lookup -------------------------------------------------------------------------


def test_plain_semantics_is_built_in():
    assert PluginRegistry([]).semantics("plain") is PLAIN_RESIDUAL
    assert BoundaryContext().semantics("plain") is PLAIN_RESIDUAL
    assert BoundaryContext(registry=PluginRegistry([])).semantics("plain") is PLAIN_RESIDUAL


def test_unknown_semantics_names_what_is_available():
    reg = PluginRegistry([])
    mhc_like = thing("zigzag")
    reg.register(InProcess("p", semantics=[mhc_like]), name="p")
    assert reg.semantics("zigzag") is mhc_like
    assert BoundaryContext(registry=reg).semantics("zigzag") is mhc_like
    with pytest.raises(PluginError) as info:
        reg.semantics("spiral")
    text = str(info.value)
    assert "'spiral'" in text and "'plain'" in text and "'zigzag'" in text
    # Without a registry the context says how to get plugins.
    with pytest.raises(PluginError, match="'zigzag'.*discover"):
        BoundaryContext().semantics("zigzag")


def test_record_json_has_the_cli_fields(plugin_site: PluginSite):
    plugin_site.add("alpha")
    rec = next(r for r in discover(allow=["alpha"]).records if r.name == "alpha")
    row = rec.to_json()
    assert row == {
        "name": "alpha", "distribution": "lbt-alpha", "version": "1.0", "api_version": 1,
        "provides": ["fusion_providers", "norm_kernels", "residual_semantics"], "status": "active",
        "reason": "", "entry_point": "lbt_alpha_manifest:MANIFEST",
    }


def test_a_missing_scheme_says_why_it_is_missing(plugin_site: PluginSite):
    reg = PluginRegistry([])
    reg.register(InProcess("x", semantics=[thing("zigzag")]), name="engine")
    with pytest.raises(PluginError, match="case-sensitive: residual='zigzag'"):
        reg.semantics("ZigZag")
    plugin_site.add("gamma")  # its scheme is gamma-residual; the plugin itself is denied here
    with pytest.raises(PluginError, match="plugin 'gamma' is installed but disabled"):
        discover(deny=["gamma"]).semantics("gamma")
    with pytest.raises(PluginError, match="pip install"):
        discover().semantics("nowhere")


def test_residual_semantics_that_return_the_wrong_thing_are_named():
    # A trial: a scheme whose stage() returned a tuple failed as "'tuple' object has no attribute 'params'".
    from layer_boundary_app.models import Qwen3ForCausalLM, small_random_config

    class TupleScheme:
        name = "tuples"

        def stage(self, hidden_size, *, dtype, device=None):
            return (None, None, None)

        def exit(self, hidden_size, *, dtype, device=None):
            return (None, None, None)

    with pytest.raises(TypeError, match=r"residual semantics 'tuples': stage\(\) returned tuple, expected "
                                        r"layer_boundary.plugin_api.StageResidual"):
        Qwen3ForCausalLM(small_random_config(), context=BoundaryContext(), residual=TupleScheme())
