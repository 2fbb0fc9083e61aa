"""Selection at construction: which norm kernels and fusion candidates each stage binds, the
report that says why, and that forward runs what was chosen."""

from __future__ import annotations

import logging
import re
from collections import Counter
from typing import Any, Optional

import pytest
import torch

from helpers import fake_topology, install_fake_dist, make_norm
from layer_boundary import BoundaryContext, declare_attn, declare_ffn, make_stages
from layer_boundary._forward import ForwardBatch
from layer_boundary._layout import BatchVariant
from layer_boundary_app.models import Qwen3ForCausalLM, init_random_weights, small_random_config
from plugin_fixtures import Candidate, Fusion, vendor_context

ORDINARY = BatchVariant.ORDINARY


def qwen3(context: Optional[BoundaryContext] = None) -> Qwen3ForCausalLM:
    model = Qwen3ForCausalLM(small_random_config(), context=context)
    init_random_weights(model, seed=0)
    return model.eval()


def logits(model: Qwen3ForCausalLM, n: int = 5) -> torch.Tensor:
    ids = torch.arange(3, 3 + n)
    pos = torch.arange(n)
    with torch.inference_mode():
        return model(ids, pos, ForwardBatch(num_tokens=n, positions=pos))


def cands(selection: Any) -> list[tuple[str, str, Optional[str]]]:
    return [(c.name, c.origin, c.refused) for c in selection.candidates]


def one(report: Any, stage: str, what: str) -> Any:
    found = [s for s in report.for_stage(stage) if s.what == what]
    assert len(found) == 1, (stage, what, report.to_json())
    return found[0]


# -- the report -------------------------------------------------------------------------------------


def test_qwen3_report_lists_candidates_choice_and_refusals():
    ctx, plugin = vendor_context()
    qwen3(ctx)
    report = ctx.freeze()
    assert report is ctx.report
    layers = small_random_config().num_hidden_layers
    stages = [f"{k} #{i + 1}" for i, k in enumerate(["attn", "ffn"] * layers)]
    assert sorted({s.stage for s in report.selections}) == sorted(stages + ["final norm"])
    assert {s.variant for s in report.selections} == {"ORDINARY"}

    norm_row = [
        ("wide-only-norm", "vendor", "hidden size 64 is not a multiple of 128"),
        ("counting-norm", "vendor", None),
        ("core-triton", "core", "counting-norm comes first (and it refuses: runs on CUDA devices only, not cpu)"),
        ("torch-reference", "core", "counting-norm comes first"),
    ]
    for stage in stages + ["final norm"]:
        s = one(report, stage, "norm kernels")
        assert (s.chosen, s.request) == ("counting-norm", "rmsnorm cpu float32 H=64")
        assert cands(s) == norm_row

    entry = one(report, "attn #1", "consumer fusion")  # stack entry: nothing owed, nothing to fuse
    assert entry.chosen is None and entry.request == "attention_input"
    assert cands(entry) == [
        ("attn-needs-tp8", "vendor", "needs an attention-TP group of 8"),
        ("attn-fused", "vendor", "stack entry: nothing is owed to this input"),
    ]
    for stage in stages[1:]:
        s = one(report, stage, "consumer fusion")
        if stage.startswith("attn"):
            assert (s.chosen, s.request) == ("attn-fused", "attention_input")
            assert cands(s) == [("attn-needs-tp8", "vendor", "needs an attention-TP group of 8"),
                                ("attn-fused", "vendor", None)]
        else:
            assert (s.chosen, s.request) == ("ffn-fused", "ffn_input")
            assert cands(s) == [("ffn-fused", "vendor", None),
                                ("ffn-fp8-only", "vendor", "FP8 activations only")]
    assert "final norm" not in {s.stage for s in report.selections if s.what == "consumer fusion"}
    # Each stage asked its provider once, at construction.
    assert plugin.fusion.offers == Counter({s: 1 for s in stages})

    # The readable form groups identical stages and keeps every refusal reason.
    text = "\n".join(report.lines())
    assert "attn ORDINARY x3: consumer fusion [attention_input] -> attn-fused" in text
    assert "ffn ORDINARY x4: consumer fusion [ffn_input] -> ffn-fused" in text
    assert "ffn-fp8-only (vendor): FP8 activations only" in text
    assert "wide-only-norm (vendor): hidden size 64 is not a multiple of 128" in text
    assert "attn-fused (vendor): stack entry" in text

    # The JSON form carries the same facts.
    rows = report.to_json()
    assert len(rows) == len(report.selections)
    row = next(r for r in rows if r["stage"] == "ffn #2" and r["what"] == "consumer fusion")
    assert row == {
        "stage": "ffn #2", "variant": "ORDINARY", "what": "consumer fusion", "request": "ffn_input",
        "chosen": "ffn-fused",
        "candidates": [{"name": "ffn-fused", "origin": "vendor", "refused": None, "off_device": False},
                       {"name": "ffn-fp8-only", "origin": "vendor", "refused": "FP8 activations only",
                        "off_device": False}],
    }


def test_bound_candidates_are_the_accepted_ones_in_order():
    ctx, _ = vendor_context()
    model = qwen3(ctx)
    layers = model.model.layers
    assert layers[0].attn_boundary.plan.entries[ORDINARY].candidates == ()
    for i, layer in enumerate(layers):
        if i:
            assert [c.name for c in layer.attn_boundary.plan.entries[ORDINARY].candidates] == ["attn-fused"]
        assert [c.name for c in layer.ffn_boundary.plan.entries[ORDINARY].candidates] == ["ffn-fused"]


def test_freeze_logs_the_report_once(caplog):
    ctx, _ = vendor_context()
    qwen3(ctx)
    with caplog.at_level(logging.INFO, logger="layer_boundary"):
        ctx.freeze()
        ctx.freeze()
    logged = [r for r in caplog.records if "selection report" in r.getMessage()]
    assert len(logged) == 1
    message = logged[0].getMessage()
    assert "counting-norm" in message and "attn-fused" in message and "FP8 activations only" in message
    assert ctx.registry.frozen


def test_frozen_context_builds_no_more_stages():
    ctx, _ = vendor_context()
    qwen3(ctx)
    ctx.freeze()
    with pytest.raises(RuntimeError, match="frozen"):
        make_stages((declare_attn(), make_norm(64, torch.float32)), context=ctx)


def test_chosen_norm_kernels_are_the_ones_forward_calls():
    ctx, plugin = vendor_context()
    model = qwen3(ctx)
    ctx.freeze()
    reference = qwen3(BoundaryContext())
    n_stages = 2 * small_random_config().num_hidden_layers
    assert plugin.counting.calls == Counter()  # selection calls no kernel
    out = logits(model)
    # Stack entry reads with rmsnorm; every later stage and the final norm add and read fused.
    assert plugin.counting.calls == Counter(rmsnorm=1, fused_add_rmsnorm=n_stages)
    assert plugin.wide.calls == Counter()
    torch.testing.assert_close(out, logits(reference), rtol=0, atol=0)
    logits(model, 3)
    assert plugin.counting.calls == Counter(rmsnorm=2, fused_add_rmsnorm=2 * n_stages)
    # The kernels were asked for once per norm, at construction.
    assert len(plugin.counting.requests) == n_stages + 1


def test_each_request_gets_its_own_choice():
    """Two stage sequences of different widths in one context: each takes the first provider
    that accepts its request."""
    ctx, plugin = vendor_context()
    make_stages((declare_attn(), make_norm(256, torch.float32)), (declare_ffn(), make_norm(256, torch.float32)),
                context=ctx)
    make_stages((declare_attn(), make_norm(96, torch.float32)), (declare_ffn(), make_norm(96, torch.float32)),
                previous=declare_ffn(), context=ctx)
    chosen = {s.stage: (s.request, s.chosen) for s in ctx.report.selections if s.what == "norm kernels"}
    assert chosen == {
        "attn #1": ("rmsnorm cpu float32 H=256", "wide-only-norm"),
        "ffn #2": ("rmsnorm cpu float32 H=256", "wide-only-norm"),
        "attn #3": ("rmsnorm cpu float32 H=96", "counting-norm"),
        "ffn #4": ("rmsnorm cpu float32 H=96", "counting-norm"),
    }
    wide = one(ctx.report, "attn #1", "norm kernels")
    assert cands(wide) == [("wide-only-norm", "vendor", None),
                           ("counting-norm", "vendor", "wide-only-norm comes first"),
                           ("core-triton", "core", "wide-only-norm comes first (and it refuses: runs on CUDA "
                                                   "devices only, not cpu)"),
                           ("torch-reference", "core", "wide-only-norm comes first")]


def test_context_device_and_gemma_reach_the_request():
    ctx, plugin = vendor_context()
    make_stages((declare_attn(), make_norm(64, torch.float32, gemma=True)), context=ctx)
    s = one(ctx.report, "attn #1", "norm kernels")
    assert s.request == "gemma_rmsnorm cpu float32 H=64"
    assert plugin.counting.requests[-1].weight_offset == 1.0


def test_without_plugins_the_torch_reference_is_chosen():
    ctx = BoundaryContext()
    qwen3(ctx)
    rows = ctx.freeze().selections
    assert "consumer fusion" not in {s.what for s in rows}  # no provider, no fusion rows
    norms = [s for s in rows if s.what == "norm kernels"]
    assert len(norms) == 2 * small_random_config().num_hidden_layers + 1
    assert {(s.chosen, tuple(cands(s))) for s in norms} == {
        ("torch-reference", (("core-triton", "core", "runs on CUDA devices only, not cpu"),
                             ("torch-reference", "core", None)))}


# -- explicit options -----------------------------------------------------------------------------


def _two_layers(ctx: BoundaryContext, attn_options: Optional[dict] = None, ffn_options: Optional[dict] = None):
    stages = []
    for layer in range(2):
        attn = (declare_attn(), make_norm(64, torch.float32, seed=2 * layer))
        ffn = (declare_ffn(), make_norm(64, torch.float32, seed=2 * layer + 1))
        if layer == 1 and attn_options is not None:
            attn = attn + (attn_options,)
        if layer == 1 and ffn_options is not None:
            ffn = ffn + (ffn_options,)
        stages += make_stages(attn, ffn, previous=declare_ffn() if layer else None, terminal=layer == 1,
                              context=ctx)
    return stages


def test_explicit_fusions_option_takes_precedence_over_the_registry():
    ctx, plugin = vendor_context()
    explicit = Fusion("model-fusion")
    explicit.attn = [Candidate("model-attn")]
    explicit.ffn = [Candidate("model-ffn-a", "not for this width"), Candidate("model-ffn-b")]
    stages = _two_layers(ctx, attn_options={"fusions": explicit}, ffn_options={"fusions": None})
    a0, f0, a1, f1 = stages
    assert a1.plan.fusions == (explicit,)
    assert f1.plan.fusions == ()  # None: no fusion provider at all for this stage
    # The registry's providers, then the core's own (after every plugin's).
    assert f0.plan.fusions[0] is plugin.fusion
    assert [type(p).__name__ for p in f0.plan.fusions[1:]] == ["SymmMemAllReduceNorm"]
    assert [c.name for c in a1.plan.entries[ORDINARY].candidates] == ["model-attn"]
    assert f1.plan.entries[ORDINARY].candidates == ()
    # The registry's provider was not even asked for the overridden stages.
    assert plugin.fusion.offers == Counter({"attn #1": 1, "ffn #2": 1})
    assert explicit.offers == Counter({"attn #3": 1})
    s = one(ctx.report, "attn #3", "consumer fusion")
    assert (s.chosen, cands(s)) == ("model-attn", [("model-attn", "model option", None)])
    assert "consumer fusion" not in [x.what for x in ctx.report.for_stage("ffn #4")]


def test_exit_decisions_come_from_the_stage_s_own_providers():
    ctx, plugin = vendor_context()
    explicit = Fusion("model-fusion")
    stages = _two_layers(ctx, ffn_options={"fusions": explicit})
    ctx.freeze()
    fb = ForwardBatch.for_tokens(4)
    from layer_boundary.residual import batch as residual_batch

    residual_batch.start(fb)
    h: Any = torch.randn(4, 64)
    for i, stage in enumerate(stages):
        x = stage.prepare(h, fb)
        if i % 2 == 0:
            h = stage.finish(x * 0.5, fb)
        else:
            with stage.exit(fb) as out:
                y = x * 0.25
            h = out.finish(y)
    # The layer-0 FFN asked the registry's provider, the layer-1 FFN its explicit one.
    assert plugin.fusion.asked["finalize"] == 1 and explicit.asked["finalize"] == 1


def test_chosen_candidate_runs_in_forward_and_its_decline_falls_back(monkeypatch):
    """Where a sum is owed (a TP group of two), forward tries the bound candidates in order."""
    install_fake_dist(monkeypatch)
    ctx, plugin = vendor_context(topology=fake_topology(tp=2))
    stages = _two_layers(ctx)
    ctx.freeze()
    fb = ForwardBatch.for_tokens(3)
    from layer_boundary.residual import batch as residual_batch

    residual_batch.start(fb)
    h: Any = torch.randn(3, 64)
    for i, stage in enumerate(stages):
        x = stage.prepare(h, fb)
        if i % 2 == 0:
            h = stage.finish(x * 0.5, fb)  # PARTIAL attention: its sum is owed to the FFN input
        else:
            with stage.exit(fb) as out:
                y = x * 0.25
            h = out.finish(y)
    attn_fused, ffn_fused = plugin.fusion.attn[1], plugin.fusion.ffn[0]
    refused = [plugin.fusion.attn[0], plugin.fusion.ffn[1]]
    assert ffn_fused.calls == 2  # both FFN inputs complete an attention sum
    assert all(c.calls == 0 for c in refused)  # refused at construction: never called
    assert attn_fused.calls == 0  # a dense FFN reduces its own output: nothing owed to attention
    assert plugin.counting.calls["fused_add_rmsnorm"] >= 2  # the fallback after the decline


def test_ranks_that_chose_differently_are_an_error_naming_the_difference(monkeypatch):
    """DESIGN: ranks verify they agree. A plugin available on one host only once gave rank 1 its
    kernels while rank 0's report said torch-reference, without a word (a trial). Decisions only one
    rank made (a pipeline stage's own layers) are not compared."""
    import torch.distributed as dist

    from layer_boundary import _ops as launch_module
    from layer_boundary._errors import DeclarationError

    ctx = BoundaryContext()
    qwen3(ctx)
    ctx.freeze()
    norm = next(s for s in ctx.report.selections if s.what == "norm kernels")
    tamper = []

    def gather(obj, group):
        # Rank 1: the same decisions, one more that only it made (a layer of its own), and, when
        # asked, another kernel for one of them.
        other = {**obj, ("layer 99", "ORDINARY", "norm kernels [only there]"): [("", "x")]}
        if tamper:
            key = next(k for k in obj if k[0] == norm.stage and k[2].startswith("norm kernels"))
            other[key] = [("", "vendor-norm")]
        return [obj, other]

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(launch_module, "gather_objects", gather)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, i: i)
    ctx.verify_agreement()  # one rank (this context's TP group): nothing to compare, no collective
    ctx.verify_agreement(group="tp")
    tamper.append(True)
    with pytest.raises(DeclarationError, match=rf"ranks decided differently for {re.escape(norm.stage)} .* rank 0 "
                       rf"{re.escape(str(norm.chosen))}, rank 1 vendor-norm; build the same stages"):
        ctx.verify_agreement(group="tp")


def test_ranks_of_the_tp_group_that_asked_or_built_differently_are_named():
    """A trial: ranks with another reduction policy, or another layer count, passed the check (only
    decisions both made with the same request were compared) and then aborted inside gloo. In the
    TP group every decision must be made everywhere, asked and answered alike."""
    from layer_boundary_app.launch import spawn

    texts = spawn(_disagreeing_job, 2, args=("policy",))
    assert all("ranks decided differently for" in t and "output return" in t for t in texts), texts
    assert "[policy ar] -> ar" in texts[0] and "[policy rs] -> rs" in texts[0]
    texts = spawn(_disagreeing_job, 2, args=("layers",))
    assert all("made no such decision (a stage it did not build)" in t for t in texts), texts
    assert spawn(_disagreeing_job, 2, args=("same",)) == ["agreed", "agreed"]


def _disagreeing_job(rank, world, how):
    from layer_boundary import Topology
    from layer_boundary._errors import DeclarationError

    import parallel_cases

    topo = parallel_cases.topology(world, 2)
    policy = "rs" if how == "policy" and rank == 1 else "ar"
    ctx = BoundaryContext(topo, reduction=policy)
    parallel_cases.LinearStack(3 if how == "layers" and rank == 1 else 2, ctx)
    ctx.freeze()
    try:
        ctx.verify_agreement()
    except DeclarationError as e:
        return str(e)
    return "agreed"


def test_selections_are_gathered_without_numpy():
    """The gather behind verify_agreement, on two gloo ranks: torch's all_gather_object needs NumPy,
    which a CPU install of torch lacks (a fresh-package test failed on it)."""
    from layer_boundary_app.launch import spawn

    got = spawn(_gather_job, 2)
    assert got == [[{"rank": 0, "x": "a" * 10}, {"rank": 1, "x": "a" * 11}]] * 2


def _gather_job(rank, world):
    import torch.distributed as dist

    from layer_boundary._ops import gather_objects

    def no_numpy(self):
        raise RuntimeError("Numpy is not available")  # as on a CPU torch install without NumPy

    torch.Tensor.numpy = no_numpy
    return gather_objects({"rank": rank, "x": "a" * (10 + rank)}, dist.group.WORLD)


def test_a_chosen_name_two_plugins_share_says_whose():
    from layer_boundary._selection import Candidate, Selection

    same = Selection("attn #1", "ORDINARY", "norm kernels", "rmsnorm cuda bfloat16 H=64", "fast-norm",
                     (Candidate("fast-norm", "vendor_a", "refuses H=64"), Candidate("fast-norm", "vendor_b"),
                      Candidate("core-triton", "core", "fast-norm comes first")))
    assert same.text().startswith("norm kernels [rmsnorm cuda bfloat16 H=64] -> fast-norm (vendor_b)   refused: "
                                  "fast-norm (vendor_a): refuses H=64")
    alone = Selection("attn #1", "ORDINARY", "norm kernels", "r", "fast-norm", (Candidate("fast-norm", "vendor_b"),))
    assert alone.text() == "norm kernels [r] -> fast-norm"


def test_a_candidate_that_raises_in_forward_is_named_in_the_error(monkeypatch):
    # A trial: a plugin's fused kernel raised through stage.prepare as a bare traceback, naming
    # neither the candidate nor where it came from.
    install_fake_dist(monkeypatch)
    ctx, plugin = vendor_context(topology=fake_topology(tp=2))
    stages = _two_layers(ctx)
    ctx.freeze()

    def boom(*args):
        raise RuntimeError("acme fused kernel: illegal address")

    monkeypatch.setattr(type(plugin.fusion.ffn[0]), "__call__", lambda self, *a: boom())
    fb = ForwardBatch.for_tokens(3)
    from layer_boundary.residual import batch as residual_batch

    residual_batch.start(fb)
    h = stages[0].finish(stages[0].prepare(torch.randn(3, 64), fb) * 0.5, fb)
    with pytest.raises(RuntimeError, match="illegal address") as info:
        stages[1].prepare(h, fb)
    assert info.value.__notes__ == [
        "raised by the consumer fusion candidate 'ffn-fused' (plugin_fixtures.Candidate); if its plugin is at "
        "fault, LAYER_BOUNDARY_DISABLE=<plugin> leaves it out (layer-boundary plugins lists them)"]
