"""A broken plugin is reported and skipped, never the engine's crash: providers that lack the
interface, providers whose methods raise when the model is built, a hook that calls ``sys.exit``,
and two plugins offering one residual scheme. Found by a new-user trial (each of these once listed
the plugin ``active`` and then ended ``layer-boundary run`` with a traceback, or exited it)."""

from __future__ import annotations

import pytest
import torch

from helpers import make_norm
from layer_boundary import BoundaryContext, declare_attn, declare_ffn, make_stages
from layer_boundary._forward import ForwardBatch
from layer_boundary_app.models import Qwen3ForCausalLM, init_random_weights, small_random_config
from layer_boundary._plugins import PluginError, PluginRegistry, PluginStatus, discover
from layer_boundary._providers import NormRequest
from plugin_fixtures import PluginSite, plugin_site  # noqa: F401  (fixture)
from test_registry import InProcess


class NoMethods:
    name = "no-methods"


class RaisingNorm:
    name = "raising-norm"
    tolerance: dict = {}

    def refuse(self, request):
        raise RuntimeError("vendor probe crashed")

    def kernels(self, request):
        raise AssertionError("never chosen")


class BrokenKernels(RaisingNorm):
    name = "broken-kernels"

    def refuse(self, request):
        return None  # accepts ...

    def kernels(self, request):
        raise OSError("libvendor.so: cannot open shared object file")  # ... then cannot load


class RaisingFusion:
    name = "raising-fusion"

    def attention_input(self, plan):
        raise RuntimeError("fusion probe crashed")

    ffn_input = attention_input


def _registry(hooks: InProcess, name: str = "vendor") -> PluginRegistry:
    reg = PluginRegistry([])
    reg.register(hooks, name=name)
    return reg


def test_a_provider_without_its_interface_fails_its_plugin():
    for hooks, missing in ((InProcess('v', norms=[NoMethods()]), "refuse(), kernels()"),
                           (InProcess('v', semantics=[NoMethods()]), "stage(), exit()")):
        reg = PluginRegistry([])
        with pytest.raises(PluginError, match=f"lacks {missing.replace('(', '[(]').replace(')', '[)]')}"):
            reg.register(hooks, name="vendor")
        rec = next(r for r in reg.records if r.name == "vendor")
        assert rec.status is PluginStatus.FAILED and not reg.norm_kernels and not reg.residual_semantics


def _qwen3(ctx):
    model = Qwen3ForCausalLM(small_random_config(), context=ctx)
    init_random_weights(model, seed=0)
    return model.eval()


def _logits(model, n: int = 5):
    ids, pos = torch.arange(3, 3 + n), torch.arange(n)
    with torch.inference_mode():
        return model(ids, pos, ForwardBatch(num_tokens=n, positions=pos))


def test_providers_that_raise_while_the_model_is_built_are_skipped_with_the_reason():
    ctx = BoundaryContext(registry=_registry(InProcess('v', norms=[RaisingNorm(), BrokenKernels()],
                                                       fusions=[RaisingFusion()])))
    model = _qwen3(ctx)  # builds: the core kernels serve every read
    ctx.freeze()
    report = "\n".join(ctx.report.lines())
    assert "raising-norm (vendor): refuse() raised RuntimeError: vendor probe crashed" in report
    assert "broken-kernels (vendor): kernels() raised OSError: libvendor.so" in report
    assert "raising-fusion (vendor): attention_input() raised RuntimeError: fusion probe crashed" in report
    torch.testing.assert_close(_logits(model), _logits(_qwen3(BoundaryContext())), rtol=0, atol=0)


class FalseRefusal(BrokenKernels):
    name = "false-refusal"

    def refuse(self, request):
        return False  # neither None (serves) nor a reason


class JunkKernels(BrokenKernels):
    name = "junk-kernels"

    def kernels(self, request):
        return "not kernels"


class HollowKernels(BrokenKernels):
    name = "hollow-kernels"

    def kernels(self, request):
        from layer_boundary.residual._add_norm import NormKernels

        return NormKernels("hollow", None, None)  # a trial: accepted, then the first forward crashed


class JunkFusion:
    name = "junk-fusion"

    def attention_input(self, plan):
        return [object()]

    def ffn_input(self, plan):
        return "not a list"


def test_providers_that_return_the_wrong_thing_are_skipped_with_the_reason():
    """A refuse() that answers False, kernels() that are not NormKernels, and consumer candidates
    that are not candidates: each is refused in the report, and the model builds and runs on the
    core's kernels (a trial: the last two ended ``layer-boundary run`` with an AttributeError, the
    first vanished from the report)."""
    ctx = BoundaryContext(registry=_registry(InProcess('v', norms=[FalseRefusal(), JunkKernels(), HollowKernels()],
                                                       fusions=[JunkFusion()])))
    model = _qwen3(ctx)
    ctx.freeze()
    report = "\n".join(ctx.report.lines())
    assert "false-refusal (vendor): refuse() returned False: expected None (it serves) or a str" in report
    assert "junk-kernels (vendor): kernels() returned str: expected layer_boundary.residual._add_norm.NormKernels" \
        in report
    assert "hollow-kernels (vendor): kernels() returned a NormKernels whose rmsnorm is NoneType, not a callable" \
        in report
    assert "junk-fusion (vendor): attention_input() returned a object among its candidates" in report
    assert "junk-fusion (vendor): ffn_input() returned str: expected a list of consumer candidates" in report
    torch.testing.assert_close(_logits(model), _logits(_qwen3(BoundaryContext())), rtol=0, atol=0)


def test_the_report_is_the_same_whether_a_stage_was_peeked_at_first():
    # A stage's kernels may be looked up once for its neighbour (record=False) and then for itself.
    ctx = BoundaryContext(registry=_registry(InProcess('v', norms=[BrokenKernels()])))
    make_stages((declare_attn(), make_norm(64, torch.float32)), (declare_ffn(), make_norm(64, torch.float32)),
                context=ctx)
    rows = [s for s in ctx.report.selections if s.what == "norm kernels"]
    assert rows and all(r.chosen != "broken-kernels" for r in rows)


def test_a_hook_that_calls_sys_exit_fails_its_plugin_not_the_process(plugin_site: PluginSite):
    plugin_site.add("alpha")
    plugin_site.add("quitter", hooks_source='''
        import sys
        from layer_boundary.plugin_api import hookimpl

        @hookimpl
        def layer_boundary_fusion_providers():
            sys.exit("plugin hook decided to exit")
        ''')
    reg = discover()
    recs = {r.name: r for r in reg.records}
    assert recs["quitter"].status is PluginStatus.FAILED and "SystemExit" in recs["quitter"].reason
    assert recs["alpha"].status is PluginStatus.ACTIVE


def test_a_hook_must_return_a_list(plugin_site: PluginSite):
    plugin_site.add("single", hooks_source='''
        from layer_boundary.plugin_api import hookimpl

        class Fusion:
            name = "lonely"

        @hookimpl
        def layer_boundary_fusion_providers():
            return Fusion()  # not a list
        ''')
    rec = next(r for r in discover().records if r.name == "single")
    assert rec.status is PluginStatus.FAILED and "must return a list of providers" in rec.reason


def test_hooks_of_unknown_names_or_none_at_all_fail_the_plugin(plugin_site: PluginSite):
    # A misspelt hook once left its plugin listed active while it provided nothing (a trial).
    plugin_site.add("typo", hooks_source='''
        from layer_boundary.plugin_api import hookimpl

        @hookimpl
        def layer_boundary_norm_kernel():
            return []
        ''')
    plugin_site.add("bare", hooks_source="def layer_boundary_norm_kernels():\n    return []\n")
    recs = {r.name: r for r in discover().records}
    assert recs["typo"].status is PluginStatus.FAILED
    assert "implements layer_boundary_norm_kernel, not a hook of layer-boundary" in recs["typo"].reason
    assert recs["bare"].status is PluginStatus.FAILED and "implements none of the hooks" in recs["bare"].reason


def test_a_plugin_scheme_named_plain_is_ignored_and_not_listed():
    class Plain:
        name = "plain"

        def stage(self, *a, **k):
            raise AssertionError("never used")

        exit = stage

    reg = _registry(InProcess("v", semantics=[Plain()]))
    assert "plain" not in reg.residual_semantics
    with pytest.raises(PluginError, match=r"available: \['plain'\]\)"):
        reg.semantics("nope")


def test_the_plugins_listing_in_strict_mode_still_calls_the_hooks(plugin_site: PluginSite, monkeypatch, capsys):
    # Strict mode fails on the broken plugin, and the listing it still prints must show it failed
    # (it once showed discovery alone: "active").
    from layer_boundary._cli.main import main

    plugin_site.add("alpha")
    plugin_site.add("single", hooks_source='''
        from layer_boundary.plugin_api import hookimpl

        @hookimpl
        def layer_boundary_fusion_providers():
            raise ValueError("boom")
        ''')
    monkeypatch.setenv("LAYER_BOUNDARY_STRICT_PLUGINS", "1")
    assert main(["plugins", "--json"]) == 1
    import json

    listed = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert listed["single"]["status"] == "failed" and "boom" in listed["single"]["reason"]
    assert listed["alpha"]["status"] == "active"


@pytest.mark.parametrize("field", ["provides", "requires_distributions"])
def test_a_manifest_field_given_as_a_string_is_refused_with_the_fix(field):
    # It was read a character at a time ("t, o, r, c, h not installed").
    from layer_boundary._plugins import PluginManifest

    kw = dict(name="vendor", api_version=1, provides=("norm_kernels",), hooks="vendor.hooks")
    kw[field] = "norm_kernels" if field == "provides" else "torch"
    with pytest.raises(ValueError, match=f"{field} must be a tuple of names, got '.*' \\(for one name: \\('"):
        PluginManifest(**kw)


def test_a_residual_that_is_neither_a_name_nor_a_scheme_is_refused():
    from layer_boundary_app.models import small_random_config

    with pytest.raises(TypeError, match="residual must be a scheme's name .* got 42"):
        Qwen3ForCausalLM(small_random_config(), context=BoundaryContext(), residual=42)


def test_a_reason_of_several_lines_stays_on_its_row_of_the_listing(plugin_site: PluginSite, capsys):
    # A hook's exception text of several lines (as pluggy's are) once broke the table's rows.
    from layer_boundary._cli.main import main

    plugin_site.add("alpha")
    plugin_site.add("wordy", hooks_source='''
        from layer_boundary.plugin_api import hookimpl

        @hookimpl
        def layer_boundary_fusion_providers():
            raise ValueError("first line\\n  second line\\nthird")
        ''')
    main(["plugins"])
    lines = capsys.readouterr().out.splitlines()
    row = [ln for ln in lines if ln.startswith("wordy ")]
    assert len(row) == 1 and "first line second line third" in row[0], lines
    assert not any(ln.lstrip().startswith(("second line", "third")) for ln in lines), lines
    main(["plugins", "--check", "wordy"])
    err = capsys.readouterr().err
    assert "first line second line third" in err and len(err.strip().splitlines()) == 1, err


def test_strict_mode_refuses_a_provider_skipped_for_a_defect():
    """A trial: pinned and strict, a provider whose refuse() raised was skipped with one log line and
    the engine ran the torch reference: strict must make that an error when construction ends."""
    from layer_boundary._plugins.discovery import DiscoveryOptions

    reg = PluginRegistry([], DiscoveryOptions(strict=True))
    reg.register(InProcess('v', norms=[BrokenKernels()]), name="vendor")
    ctx = BoundaryContext(registry=reg)
    _qwen3(ctx)
    with pytest.raises(PluginError, match=r"providers skipped for a defect while the model was built: "
                                          r"broken-kernels: kernels\(\) raised .*\[strict plugin mode"):
        ctx.freeze()
    lenient = BoundaryContext(registry=_registry(InProcess('v', norms=[BrokenKernels()])))
    _qwen3(lenient)
    lenient.freeze()  # skipped with the reason, as before


def test_a_hook_that_returns_a_class_or_nothing_is_named():
    # A trial: a class passed (its unbound methods are callable) and failed at the first refuse();
    # a hook that returned None left the plugin active with nothing and no word.
    reg = PluginRegistry([])
    with pytest.raises(PluginError, match="returned the class BrokenKernels, not an instance of it"):
        reg.register(InProcess('v', norms=[BrokenKernels]), name="vendor")


class WrongShapeKernels(BrokenKernels):
    """Serves, and its kernels return one column short, float64, or raise at their first call: a
    trial's plugin crashed in the model's next matmul, with no word of the plugin."""

    name = "wrong-shape"

    def __init__(self, bad: str, quant: bool = False) -> None:
        self.bad = bad
        self.quant = quant

    def kernels(self, request):
        from layer_boundary._kernels.reference import fused_add_rmsnorm_ref, rmsnorm_ref
        from layer_boundary._quant import QuantizedRows
        from layer_boundary.residual._add_norm import NormKernels, reference_kernels

        ref = reference_kernels(request.quant)

        def spoil(y):
            if self.bad == "raises":
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            if isinstance(y, QuantizedRows):  # codes right, scales one per row short of [T, 1]
                return QuantizedRows(y.data, y.scale.view(-1))
            return y[:, :-1] if self.bad == "shape" else y.double()

        def norm(x, w, eps, *, weight_offset=0.0):
            y = ref.rmsnorm(x, w, eps, weight_offset=weight_offset)
            return y if self.bad == "fused_shape" else spoil(y)

        def fused(x, r, w, eps, *, weight_offset=0.0):
            r.add_(1.0)  # an in-place kernel that writes its residual before it fails
            y, s = ref.fused_add_rmsnorm(x, r, w, eps, weight_offset=weight_offset)
            return spoil(y) if self.bad != "fused_shape" else y[:, :-1], s

        return NormKernels(f"spoilt-{self.bad}", norm, fused, residual_in_place=True)


def _broken_layer(bad, *, strict=False, quant=None):
    from layer_boundary._plugins.discovery import DiscoveryOptions
    from layer_boundary.residual._add_norm import AddNormReadSpec

    reg = PluginRegistry([], DiscoveryOptions(strict=strict))
    reg.register(InProcess('v', norms=[WrongShapeKernels(bad)]), name="vendor")
    ctx = BoundaryContext(registry=reg)
    read = {"read": AddNormReadSpec(quant=quant)} if quant else {}
    attn, ffn = make_stages((declare_attn(**read), make_norm(64, torch.float32)),
                            (declare_ffn(**read), make_norm(64, torch.float32)), context=ctx)
    ctx.freeze()
    return ctx, attn, ffn


def _run_layer(attn, ffn, x, c):
    from layer_boundary.residual import batch as residual_batch

    fb = ForwardBatch.for_tokens(x.shape[0])
    residual_batch.start(fb)
    a = attn.prepare(x, fb)
    f = ffn.prepare(attn.finish(c, fb), fb)
    return a, f, fb.residual_stream.residual


SHOWN = {"shape": "rmsnorm returned y (5, 63) float32 for an input (5, 64) float32",
         "dtype": "rmsnorm returned y (5, 64) float64 for an input (5, 64) float32",
         "raises": "rmsnorm raised RuntimeError: CUDA error: an illegal memory access was encountered "
                   "(the torch reference runs this input)"}


@pytest.mark.parametrize("bad", sorted(SHOWN))
def test_kernels_defective_at_their_first_call_are_reported_and_replaced(bad, caplog):
    """Never a crash of the engine: the first call's check names the plugin, the next provider
    serves every stage from then on, and the forward's numbers are the reference's."""
    ctx, attn, ffn = _broken_layer(bad)
    _, want_attn, want_ffn = _broken_layer(bad)  # built for the reference below
    x, c = torch.randn(5, 64), torch.randn(5, 64)
    with caplog.at_level("WARNING", logger="layer_boundary"):
        got = _run_layer(attn, ffn, x, c)
    said = [r.getMessage() for r in caplog.records if "spoilt" in r.getMessage()]
    assert said == [f"provider wrong-shape skipped: its kernels 'spoilt-{bad}' (plugin vendor) are defective at "
                    f"their first call in attn #1: {SHOWN[bad]}; torch-reference serves instead, for every stage of "
                    "this model (run the plugin's conformance kit; LAYER_BOUNDARY_DISABLE=vendor leaves it out)"]
    from layer_boundary.residual._add_norm import REFERENCE_KERNELS

    # One warning: the FFN's read was switched before its first call, never running the kernels.
    for stage in (attn, ffn):
        assert stage.plan.read.kernels is REFERENCE_KERNELS  # core-triton refuses CPU
    report = "\n".join(ctx.report.lines())
    assert "norm kernels (after a defect) [rmsnorm cpu float32 H=64] -> torch-reference" in report
    assert "defective at a first call in this model" in report
    assert "-> wrong-shape" not in report  # the rows of the replaced choice are gone
    # The reference's numbers (the defective fused kernel's in-place write never happened).
    for stage in (want_attn, want_ffn):
        stage.plan.read._set_kernels(REFERENCE_KERNELS)
    for g, w in zip(got, _run_layer(want_attn, want_ffn, x, c)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_a_fused_kernel_defective_at_its_first_call_is_rerun_on_untouched_inputs():
    ctx, attn, ffn = _broken_layer("shape")
    ffn.plan.read._checked_read = True  # as if its rmsnorm had passed: the fused call is first
    x, c = torch.randn(5, 64), torch.randn(5, 64)
    from layer_boundary.residual import batch as residual_batch
    from layer_boundary.residual._add_norm import REFERENCE_KERNELS
    from layer_boundary._kernels.reference import fused_add_rmsnorm_ref

    fb = ForwardBatch.for_tokens(5)
    residual_batch.start(fb)
    attn.plan.read._set_kernels(REFERENCE_KERNELS)
    attn.prepare(x, fb)
    f = ffn.prepare(attn.finish(c, fb), fb)
    assert ffn.plan.read.kernels is REFERENCE_KERNELS
    # The defective kernel added 1.0 to the residual it was given before failing its check: a copy.
    want_y, want_r = fused_add_rmsnorm_ref(c, x, ffn.plan.read.weight, ffn.plan.read.eps)
    torch.testing.assert_close(fb.residual_stream.residual, want_r, rtol=0, atol=0)
    torch.testing.assert_close(f, want_y, rtol=0, atol=0)


def test_a_defective_kernel_in_strict_mode_or_given_to_the_read_is_an_error():
    from layer_boundary import BoundaryError

    _, attn, ffn = _broken_layer("shape", strict=True)
    with pytest.raises(BoundaryError, match=r"norm kernel provider wrong-shape: its kernels 'spoilt-shape' \(plugin "
                                            r"vendor\) are defective at their first call in attn #1: rmsnorm "
                                            r"returned y \(5, 63\) float32 .* \[strict plugin mode"):
        _run_layer(attn, ffn, torch.randn(5, 64), torch.randn(5, 64))
    from layer_boundary.residual._add_norm import AddNormReadSpec

    given = WrongShapeKernels("dtype").kernels(NormRequest("cpu", torch.float32, 64, 0.0, None))
    attn, ffn = make_stages((declare_attn(read=AddNormReadSpec(kernels=given)), make_norm(64, torch.float32)),
                            (declare_ffn(), make_norm(64, torch.float32)))
    with pytest.raises(BoundaryError, match=r"norm kernels 'spoilt-dtype': rmsnorm returned y \(5, 64\) float64 for "
                                            r"an input \(5, 64\) float32; the plugin that provides them is defective"):
        _run_layer(attn, ffn, torch.randn(5, 64), torch.randn(5, 64))


def test_an_input_the_reference_refuses_too_is_the_callers_error_not_a_defect(caplog):
    _, attn, ffn = _broken_layer("raises")
    from layer_boundary.residual import batch as residual_batch

    fb = ForwardBatch.for_tokens(5)
    residual_batch.start(fb)
    with caplog.at_level("WARNING", logger="layer_boundary"), \
            pytest.raises(ValueError, match="attn #1: hidden_states has 32 columns, but its norm is for hidden "
                                            "size 64"):
        attn.prepare(torch.randn(5, 32), fb)  # not the norm's width
    assert not any("defective" in r.getMessage() for r in caplog.records)


def test_a_quantized_read_is_checked_at_its_first_call_too(caplog):
    """Before, FP8 reads skipped the check: scales of the wrong shape reached the GEMM."""
    from layer_boundary.residual import batch as residual_batch
    from layer_boundary.residual._add_norm import REFERENCE_FP8_KERNELS

    _, attn, _ = _broken_layer("shape", quant="fp8_e4m3")
    fb = ForwardBatch.for_tokens(5)
    residual_batch.start(fb)
    with caplog.at_level("WARNING", logger="layer_boundary"):
        q = attn.prepare(torch.randn(5, 64), fb)
    assert attn.plan.read.kernels is REFERENCE_FP8_KERNELS and q.scale.shape == (5, 1)
    assert any("rmsnorm returned y scale (5,) float32 (want (5, 1) float32) for an input (5, 64) float32 "
               "(a fp8_e4m3 read)" in r.getMessage() for r in caplog.records)


def test_a_defect_found_at_a_later_path_replaces_the_kernels_of_reads_already_past_their_first_call(caplog):
    # A trial: the fused kernel failed at the FFN; the attention's read, whose rmsnorm had passed
    # its check, kept the defective provider's kernels while the warning said "every stage".
    from layer_boundary.residual._add_norm import REFERENCE_KERNELS

    ctx, attn, ffn = _broken_layer("fused_shape")
    x, c = torch.randn(5, 64), torch.randn(5, 64)
    with caplog.at_level("WARNING", logger="layer_boundary"):
        _run_layer(attn, ffn, x, c)
    assert attn.plan.read.kernels is REFERENCE_KERNELS and ffn.plan.read.kernels is REFERENCE_KERNELS
    assert [r.getMessage().split(": ", 1)[0] for r in caplog.records if "spoilt" in r.getMessage()] == [
        "provider wrong-shape skipped"]
    assert "defective at their first call in ffn #2: fused_add_rmsnorm returned y (5, 63) float32" in caplog.text
    assert sum("(after a defect)" in line for line in ctx.report.lines()) == 2
