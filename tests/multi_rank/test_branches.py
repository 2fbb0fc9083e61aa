"""Branches (``prepared_from``, ``branch_input``, ``branch_output``, ``merge_branch``).

One process: the branch semantics against the layer written out (bitwise, float64), construction
(ordinary rows only, plain-add updates), the spec's errors and every misuse that would drop or
double a contribution. Multi-process (gloo, one spawn per world size): the synthetic branch stack
of ``branch_cases`` is bitwise equal to one rank on tp2, tp2 dp2, tp4, tp4 dp2 and tp4 dp4 with
each reduction policy, each owed sum and row move running exactly once; the LongCat-style
reference matches its single-rank model within the float64 tolerance of ``test_parallel``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import HalfSkip, exact, fake_topology, raises_exact
from layer_boundary import (BatchVariant, BoundaryContext, BoundaryError, DeclarationError, ForwardBatch,
                            Topology, declare_attn, declare_ffn, make_ffn_stage, make_stages)
from layer_boundary._adapters.branch import BranchOutput, branch_output, merge_branch
from layer_boundary._errors import BRANCH_ENTRY
from layer_boundary_app.launch import spawn
from layer_boundary.residual import batch as rb

import branch_cases

H, T = branch_cases.H, 5
NO_PATH = "no stage boundary path for the active {} batch"


def _stack(codes, defer=False):
    return branch_cases.BranchStack(codes, BoundaryContext(Topology.single()), defer=defer)


# -- semantics on one rank ----------------------------------------------------------------------


@pytest.mark.parametrize("codes", [["La", "Pa"], ["Lb", "Pb"], ["Pb", "La", "Lb", "Pa"]])
@pytest.mark.parametrize("defer", [False, True])
def test_branch_stack_is_the_written_out_layer(codes, defer):
    """The MoE (or attention) branch reads the input the source prepared, its output joins once at
    the end, and the chain's residual never sees it before: bitwise the plain formula, whichever
    branch finishes first and whether outputs arrive owing a finalize and a sum or not."""
    model = _stack(codes, defer)
    x = branch_cases.stack_input(T)
    fb = ForwardBatch(num_tokens=T)
    with branch_cases.count_handoffs() as handoffs:
        out = model(x.clone(), fb)
    assert torch.equal(out, model.plain(x.clone()))
    sparse = sum(c[0] == "L" for c in codes)
    assert handoffs == ({"made": sparse, "completed": sparse} if defer else {"made": 0, "completed": 0})
    assert fb.residual_stream.released


def test_longcat_reference_is_its_written_out_layer():
    from layer_boundary_app.models.longcat import (LongcatForCausalLM, init_random_longcat_weights,
                                               plain_forward, small_random_longcat_config)

    model = LongcatForCausalLM(small_random_longcat_config(), dtype=torch.float64)
    init_random_longcat_weights(model)
    model.eval().requires_grad_(False)
    ids, pos = torch.tensor([9, 41, 7, 300, 12, 5, 88]), torch.arange(7)
    with torch.inference_mode():
        got = model(ids, pos, ForwardBatch(num_tokens=7, positions=pos))
        want = plain_forward(model, ids, pos, ForwardBatch(num_tokens=7, positions=pos))
    assert torch.equal(got, want)



def test_longcat_refuses_a_two_batch_split_by_name():
    # LongcatModel has no two-batch-overlap schedule (tbo_overlap = None, no plan): a batch with a
    # tbo_split is refused naming that, not an AttributeError on the missing plan.
    from layer_boundary import TboSplit
    from layer_boundary_app.models.longcat import (LongcatForCausalLM, init_random_longcat_weights,
                                               small_random_longcat_config)

    model = LongcatForCausalLM(small_random_longcat_config())
    init_random_longcat_weights(model)
    pos = torch.arange(3)
    fb = ForwardBatch(num_tokens=3, positions=pos, tbo_split=TboSplit.balanced([[2, 1]], 0))
    with torch.inference_mode(), pytest.raises(ValueError, match="no two-batch-overlap schedule"):
        model.eval()(torch.tensor([7, 300, 12]), pos, fb)


# -- construction -------------------------------------------------------------------------------


def _moe_and_chain(ctx, *, chain=("ffn", "attn", "ffn")):
    norm = nn.Identity()
    a0, moe = make_stages((declare_attn(), norm), (declare_ffn(sparse=True), norm), context=ctx)
    decl = {"ffn": declare_ffn, "attn": declare_attn}
    stages = make_stages(*[(decl[k](), norm) for k in chain], prepared_from=moe.declaration,
                         terminal=True, context=ctx)
    return a0, moe, stages


def test_construction_leaves_branch_stages_on_ordinary_rows():
    """On a topology with the input-scattered (and sequence-parallel) variants, the source keeps
    them but no stage of the branch has them: construction refuses, and says why."""
    ctx = BoundaryContext(fake_topology(tp=2))
    _, moe, chain = _moe_and_chain(ctx)
    assert BatchVariant.INPUT_SCATTERED in moe.plan.variants
    for b in chain:
        assert b.plan.variants == (BatchVariant.ORDINARY,), b
    refused = [s for s in ctx.report.selections if s.what == "branch transport"]
    assert refused and all(s.chosen is None and "ordinary token rows" in s.text() for s in refused)
    assert {s.stage for s in refused} >= {b.plan.name for b in chain[1:]}
    for b in chain:  # the reason travels with the plan into the spec's error as a note
        assert all("ordinary token rows" in why for why in b.plan.refusals.values()), b
        assert set(b.plan.refusals) >= {BatchVariant.INPUT_SCATTERED, BatchVariant.SEQUENCE_PARALLEL}


def test_construction_leaves_branch_stages_out_of_context_parallel():
    from helpers import FAKE_GROUP
    from layer_boundary import GroupInfo

    pair, solo = GroupInfo((0, 1), 0, FAKE_GROUP), GroupInfo.solo()
    topo = Topology(tp=pair, attn_tp=pair, attn_dp=solo, attn_cp=pair, moe_out=pair, pp=solo,
                    attn_heads=solo)
    _, moe, chain = _moe_and_chain(BoundaryContext(topo))
    assert BatchVariant.CP in moe.plan.variants
    for b in chain:
        assert b.plan.variants == (BatchVariant.ORDINARY,)
        assert "ordinary token rows" in b.plan.refusals[BatchVariant.CP]


def test_construction_refuses_nonlinear_updates_in_a_branch():
    norm = nn.Identity()
    (src,) = make_stages((declare_ffn(), norm))
    with pytest.raises(DeclarationError, match="plain-add updates only"):
        make_stages((declare_ffn(), norm), (declare_attn(update=HalfSkip()), norm),
                    prepared_from=src.declaration)
    with pytest.raises(DeclarationError, match="its source"):
        make_stages((declare_attn(), norm), prepared_from=declare_ffn(update=HalfSkip()))
    # A single stage built with its own source fields is bound the same way.
    f = make_ffn_stage(declare_ffn(prepared_from=src.declaration), norm,
                       topology=fake_topology(tp=2))
    assert f.plan.variants == (BatchVariant.ORDINARY,)


# -- errors and misuse --------------------------------------------------------------------------


def _layer_at_moe_input(schedule="a"):
    model = _stack(["L" + schedule])
    layer = model.layers[0]
    fb = ForwardBatch(num_tokens=T)
    rb.start(fb)
    x = layer.a0.prepare(branch_cases.stack_input(T), fb)
    h = layer.a0.finish(layer.attn0(x), fb)
    return layer, fb, layer.s.prepare(h, fb)


def test_prepare_on_a_prepared_stage_raises_the_spec_error():
    layer, fb, x = _layer_at_moe_input()
    with raises_exact(BoundaryError, BRANCH_ENTRY):
        layer.f1.prepare(x, fb)


@pytest.mark.parametrize("flag,variant", [("input_scattered", "INPUT_SCATTERED"),
                                          ("context_parallel", "CP"),
                                          ("sequence_parallel", "SEQUENCE_PARALLEL")])
def test_other_variants_have_no_branch_path(flag, variant):
    """A batch in another variant reaching a branch gets the spec's text, before any row moves."""
    layer, fb, x = _layer_at_moe_input()
    setattr(fb, flag, True)
    with raises_exact(BoundaryError, NO_PATH.format(variant)):
        layer.f1.branch_input(layer.s, x, fb)
    setattr(fb, flag, False)
    with layer.s.exit(fb) as out:
        y = layer.moe(x)
    h = out.finish(y)
    setattr(fb, flag, True)
    with raises_exact(BoundaryError, NO_PATH.format(variant)) as info:
        branch_output(h, fb)
    assert any("ordinary token rows" in note for note in info.value.__notes__)
    setattr(fb, flag, False)
    side = branch_output(h, fb)
    h = layer.chain(x, fb)
    setattr(fb, flag, True)
    with raises_exact(BoundaryError, NO_PATH.format(variant)):
        merge_branch(h, fb, side)


def test_branch_input_refuses_what_is_not_a_source_read():
    layer, fb, x = _layer_at_moe_input()
    with pytest.raises(BoundaryError, match="not built with prepared_from"):
        layer.a1.branch_input(layer.s, x, fb)
    with pytest.raises(BoundaryError, match="prepared_from=.*but the source given"):
        layer.f1.branch_input(layer.a0, x, fb)
    with pytest.raises(ValueError, match="got 2 rows"):
        layer.f1.branch_input(layer.s, x[:2], fb)
    with layer.s.exit(fb) as out:
        y = layer.moe(x)
    h = out.finish(y)
    with pytest.raises(BoundaryError, match="set it aside with branch_output"):
        layer.f1.branch_input(layer.s, x, fb)
    h = rb.fold(h, fb)
    with pytest.raises(BoundaryError, match="right after the source stage's prepare"):
        layer.f1.branch_input(layer.s, x, fb)


def test_branch_output_and_merge_refuse_misuse():
    layer, fb, x = _layer_at_moe_input()
    with pytest.raises(BoundaryError, match=exact("output does not belong")):
        branch_output(x, fb)  # a compute input, not a layer output
    with layer.s.exit(fb) as out:
        y = layer.moe(x)
    side = branch_output(out.finish(y), fb)
    assert isinstance(side, BranchOutput) and not side.merged
    h = layer.chain(x, fb)
    with pytest.raises(TypeError, match="BranchOutput"):
        merge_branch(h, fb, torch.zeros(T, H, dtype=torch.float64))
    other = ForwardBatch(num_tokens=T)
    _, fb2, x2 = _layer_at_moe_input()
    with layer.s.exit(fb2) as out:
        y2 = layer.moe(x2)
    foreign = branch_output(out.finish(y2), fb2)
    with pytest.raises(BoundaryError, match="another residual stream"):
        merge_branch(h, fb, foreign)
    h = merge_branch(h, fb, side)
    assert side.merged
    with pytest.raises(BoundaryError, match="merged already"):
        merge_branch(h, fb, side)
    assert other.residual_stream is None
    out = rb.norm(h, fb, nn.Identity())
    assert out.shape == (T, H)


def test_written_stream_takes_the_branch_output_as_its_pending_contribution():
    """A chain whose last output was folded (written stream): the merge leaves the set-aside
    output pending on the residual, so it still reaches the residual once."""
    layer, fb, x = _layer_at_moe_input()
    with layer.s.exit(fb) as out:
        y = layer.moe(x)
    side = branch_output(out.finish(y), fb)
    h = rb.fold(layer.chain(x, fb), fb)
    want = h + layer.moe(x)
    h = merge_branch(h, fb, side)
    assert torch.equal(rb.norm(h, fb, nn.Identity()), want)


@pytest.mark.parametrize("leave", ["prepare", "norm", "to_pp", "take_output", "split_stream"])
def test_an_unmerged_branch_output_is_never_dropped(leave):
    """Reading or leaving the residual outside the branch while an output is set aside raises;
    the branch's own stages may read meanwhile."""
    model = _stack(["La", "Pa"])
    layer, nxt = model.layers
    fb = ForwardBatch(num_tokens=T)
    rb.start(fb)
    x = layer.a0.prepare(branch_cases.stack_input(T), fb)
    h = layer.a0.finish(layer.attn0(x), fb)
    x = layer.s.prepare(h, fb)
    with layer.s.exit(fb) as out:
        y = layer.moe(x)
    branch_output(out.finish(y), fb)
    h = layer.chain(x, fb)  # a1 and f2 prepare: members of the branch
    with pytest.raises(BoundaryError, match="not merged; call merge_branch"):
        if leave == "prepare":
            nxt.a.prepare(h, fb)
        elif leave == "norm":
            rb.norm(h, fb, nn.Identity())
        elif leave == "to_pp":
            rb.to_pp(h, fb)
        elif leave == "split_stream":
            from layer_boundary._adapters.tbo import split_stream

            split_stream(h, fb, [ForwardBatch(num_tokens=2), ForwardBatch(num_tokens=T - 2)])
        else:
            rb.take_output(h, fb)


def test_schedules_agree_and_the_run_spec_refuses_other_variants():
    x = branch_cases.stack_input(T)
    a = _stack(["La", "Pa"])(x.clone(), ForwardBatch(num_tokens=T))
    b = _stack(["Lb", "Pb"])(x.clone(), ForwardBatch(num_tokens=T))
    assert torch.equal(a, b)
    from layer_boundary_app.models.runner import RunSpec

    for kw, what in ((dict(input_scattered=True), "ordinary token rows only"), (dict(tbo=True), "--tbo"),
                     (dict(moe=True), "--moe"), (dict(residual="mhc"), "plain residual")):
        with pytest.raises(ValueError, match=what):
            RunSpec(sequences=((1, 2),), longcat=True, **kw)


# -- every layout on gloo -----------------------------------------------------------------------

CODES = ["La", "Pb", "Lb", "Pa"]
LINEAR_2 = [
    dict(dp=1, policy="ar", counts=(5,), codes=CODES),
    dict(dp=1, policy="ar", counts=(4,), codes=CODES, defer=True),
    dict(dp=1, policy="ar", counts=(0,), codes=["La", "Pb"], defer=True),
    dict(dp=2, policy="ar", counts=(3, 5), codes=CODES),
    dict(dp=2, policy="rs", counts=(3, 5), codes=CODES, defer=True),
    dict(dp=2, policy="rsv", counts=(4, 1), codes=CODES),
    dict(dp=2, policy="rs+rsv", counts=(0, 3), codes=["Pa", "Lb"]),
]
LINEAR_4 = [
    dict(dp=1, policy="ar", counts=(6,), codes=CODES, defer=True),
    dict(dp=2, policy="ar", counts=(3, 4), codes=CODES),
    dict(dp=2, policy="rs", counts=(5, 0), codes=CODES),
    dict(dp=2, policy="rs+rsv", counts=(2, 3), codes=["Lb", "Pa"]),  # RSv refused: attention TP 2
    dict(dp=4, policy="rsv", counts=(1, 0, 3, 2), codes=["Pb", "La"]),
    dict(dp=4, policy="rs", counts=(2, 2, 0, 1), codes=["La", "Pb"]),
]
# TP=8, TP=4 x DP=2, TP=2 x DP=4.
LINEAR_8 = [
    dict(dp=1, policy="ar", counts=(7,), codes=CODES, defer=True),
    dict(dp=2, policy="rs", counts=(5, 0), codes=CODES),
    dict(dp=2, policy="rs+rsv", counts=(2, 3), codes=["Lb", "Pa"]),
    dict(dp=4, policy="rsv", counts=(1, 0, 3, 2), codes=["Pb", "La"]),
    dict(dp=4, policy="ar", counts=(0, 2, 0, 1), codes=CODES),
]
SEQS = [[1, 5, 9, 2], [4, 8], [300, 7, 7]]
LONGCAT_2 = [
    dict(dp=1, policy="ar", sequences=SEQS),
    dict(dp=1, policy="ar", sequences=SEQS, defer=True),
    dict(dp=2, policy="ar", sequences=SEQS),
    dict(dp=2, policy="rs", sequences=SEQS),
    dict(dp=2, policy="rsv", sequences=SEQS),
    dict(dp=2, policy="rs+rsv", sequences=[[3, 3, 7]]),  # DP group 1 gets no sequence
]
LONGCAT_4 = [
    dict(dp=1, policy="ar", sequences=SEQS),
    dict(dp=2, policy="rs", sequences=SEQS),
    dict(dp=2, policy="rs+rsv", sequences=SEQS),
    dict(dp=4, policy="rsv", sequences=SEQS),
    dict(pp=2, dp=1, policy="ar", sequences=SEQS, defer=True),
]
HEADS_8 = dict(num_attention_heads=8, num_key_value_heads=2)  # every 8-rank layout shards the heads
LONGCAT_8 = [
    dict(dp=1, policy="ar", sequences=SEQS, defer=True, config=HEADS_8),
    dict(dp=2, policy="rs", sequences=SEQS, config=HEADS_8),
    dict(dp=4, policy="rsv", sequences=SEQS, config=HEADS_8),
    dict(pp=2, dp=1, policy="ar", sequences=SEQS, defer=True),  # TP 4: the four heads shard
]


@pytest.fixture(scope="module", params=[2, 4, 8], ids=["2ranks", "4ranks", "8ranks"])
def matrix(request):
    world = request.param
    linear, longcat = {2: (LINEAR_2, LONGCAT_2), 4: (LINEAR_4, LONGCAT_4), 8: (LINEAR_8, LONGCAT_8)}[world]
    return world, spawn(branch_cases.matrix, world, args=(linear, longcat), timeout_s=300)


def _expected_collectives(world: int, case: dict, returns: str) -> dict[str, int]:
    """Each owed sum and each row move once. Without attention DP: L = A0, S, F1, A1, F2 sums
    (5 all-reduces), P = A and F sums (2). Under DP each FFN returns its rows once by the policy's
    path; L joins A0's and A1's sums with the DP gather (2 all-reduces); P gathers A's input for F
    over DP (1 all-gather) and completes A's sum over attention TP (when it has ranks to sum)."""
    dp = case["dp"]
    attn_tp = world // dp
    n: dict[str, int] = {}

    def add(k: str, v: int = 1) -> None:
        if v:
            n[k] = n.get(k, 0) + v

    ret = returns.split("/")[0]
    for code in case["codes"]:
        ffns = 3 if code[0] == "L" else 1
        if dp == 1:
            add("all_reduce", 5 if code[0] == "L" else 2)
            continue
        if code[0] == "L":
            add("all_reduce", 2)
        else:
            add("all_gather")
            add("all_reduce", int(attn_tp > 1))
        if ret == "ar":
            add("all_reduce", ffns)
        elif ret == "rs":
            add("reduce_scatter", ffns)
            add("all_gather", ffns * int(attn_tp > 1))
        else:
            add("all_to_all", ffns)
    return n


@pytest.mark.slow
def test_branch_stack_is_bitwise_equal_and_completes_each_sum_once(matrix):
    world, per_rank = matrix
    for rank, results in enumerate(per_rank):
        for r in results["linear"]:
            case = r["case"]
            assert r["equal"], f"rank {rank} {case}: differs from the single-rank stack"
            assert r["largest"] < 2.0**30  # far inside float64's exact range
            d = rank // (world // case["dp"])
            assert r["rows"] == case["counts"][d]
            want = _expected_collectives(world, case, r["returns"][0])
            assert r["collectives"] == want, (rank, case, r["collectives"], want)
            # Deferral is refused under attention DP; elsewhere each MoE handoff completes once.
            made = sum(c[0] == "L" for c in case["codes"]) if case.get("defer") and case["dp"] == 1 else 0
            assert r["handoffs"] == {"made": made, "completed": made}, (rank, case)


@pytest.mark.slow
def test_branch_refuses_the_input_scattered_batch_with_the_spec_text(matrix):
    world, per_rank = matrix
    for results in per_rank:
        for code, err in results["refused"].items():
            assert err is not None and err.startswith(
                "BoundaryError: " + NO_PATH.format("INPUT_SCATTERED")), (code, err)


@pytest.mark.slow
def test_longcat_reference_matches_one_rank_on_every_layout(matrix):
    world, per_rank = matrix
    seen = 0
    for rank, results in enumerate(per_rank):
        for r in results["longcat"]:
            case = r["case"]
            if r["rows"] == 0:
                assert case.get("pp", 1) > 1 or case["dp"] > 1, (rank, case)
                continue
            seen += 1
            assert r["max_diff"] <= 1e-10 * max(1.0, r["scale"]), (rank, case, r["max_diff"])
            made = r["handoffs"]["made"]
            assert r["handoffs"]["completed"] == made, (rank, case)
            if case.get("defer") and case["dp"] == 1:
                assert made == len(r["layer_ids"]), (rank, case)  # one MoE handoff per layer
            else:
                assert made == 0
    assert seen >= world


# -- layer-boundary run --longcat --------------------------------------------------------------


def test_help_describes_longcat():
    from layer_boundary._cli.main import build_parser

    text = build_parser()._subparsers._group_actions[0].choices["run"].format_help()
    assert "--longcat" in text and "LongCat-style" in text and "branch_input" in text


def test_single_rank_longcat_run_is_bitwise_the_model(tmp_path, capsys):
    from layer_boundary._cli.main import main
    from layer_boundary_app.models.longcat import (LongcatForCausalLM, init_random_longcat_weights,
                                               small_random_longcat_config)

    out = tmp_path / "logits.pt"
    assert main(["run", "--longcat", "--tp", "1", "--input-ids", "7,300,12", "--save-logits", str(out)]) == 0
    assert "embedded random LongCat-style decoder" in capsys.readouterr().out
    model = LongcatForCausalLM(small_random_longcat_config())
    init_random_longcat_weights(model)
    pos = torch.arange(3)
    with torch.inference_mode():
        want = model.eval()(torch.tensor([7, 300, 12]), pos, ForwardBatch(num_tokens=3, positions=pos))
    assert torch.equal(torch.load(out), want)
    assert main(["run", "--longcat", "--moe", "--tp", "1"]) == 2
    assert "--longcat builds the embedded random LongCat-style model" in capsys.readouterr().err


@pytest.mark.slow
def test_longcat_runs_on_two_dp_groups_and_checks(capsys):
    from layer_boundary._cli.main import main

    rc = main(["run", "--longcat", "--check", "--dp", "2", "--reduction", "rsv", "--input-ids",
               "3,1,4;1,5;9,2,6"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "ranks: 2 (gloo)" in text and "check:    ok" in text
    assert "(ffn SCOPED sparse)" in text and "variants=['ORDINARY']" in text
