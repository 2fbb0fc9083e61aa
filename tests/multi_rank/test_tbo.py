"""Two-batch overlap: microbatch streams split with ``ResidualStream.arrive()`` and merged in token
order, the interleaved stage schedule, handoff rows from ``sparse``/``next_sparse``, the
operation-scheduled FFN (``postprocess()``) and ``layer-boundary run --tbo``.

Results equal the unsplit forward: bitwise on the dyadic float64 synthetic stack (one rank, and
gloo tp2 / tp2 dp2 / input-scattered in one spawn), bitwise per microbatch for dense Qwen3 in
float32 (each microbatch is exactly its own forward), and within the float tolerance of
``tests/multi_rank/test_parallel.py`` for the Qwen3 / Qwen3-MoE references against the single-rank model.
"""

from __future__ import annotations

import pytest
import torch

from helpers import counted_handoff, make_norm, raises_exact, rand, solo_sum
from layer_boundary import (
    BoundaryContext,
    BoundaryError,
    ForwardBatch,
    ResidualStream,
    Topology,
    declare_attn,
    declare_ffn,
    make_stages,
)
from layer_boundary._contracts import Owed, OwedKind
from layer_boundary._output import OwedOutput
from layer_boundary.residual._stream import StreamState
from layer_boundary._adapters.tbo import (TboRows, TboSplit, balanced_split, entry_rows, handoff_rows,
                                         interleave, merge_streams, plan_overlap, split_batch, split_stream)
from layer_boundary._cli.main import main
from layer_boundary._errors import FOREIGN_OUTPUT, START_FIRST
from layer_boundary_app.launch import spawn
from layer_boundary.residual import batch as rb

import tbo_cases

H = 8


# -- splitting a batch -----------------------------------------------------------------------------


@pytest.mark.parametrize("lens,k", [((), 0), ((4,), 1), ((3, 3), 1), ((1, 1, 4), 2), ((5, 1, 1), 1),
                                    ((2, 2, 2, 2), 2), ((1, 6), 1)])
def test_balanced_split_cuts_at_the_sequence_boundary_closest_to_half(lens, k):
    assert balanced_split(lens) == k


def test_split_batch_gives_each_microbatch_its_rows_and_dp_counts():
    fb = ForwardBatch(num_tokens=7, positions=torch.arange(7), seq_lens=(3, 1, 3), dp_num_tokens=(7, 2))
    a, b = split_batch(fb, TboSplit(2, ((4, 2), (3, 0))))
    assert (a.num_tokens, a.seq_lens, a.dp_num_tokens, a.positions.tolist()) == (4, (3, 1), (4, 2), [0, 1, 2, 3])
    assert (b.num_tokens, b.seq_lens, b.dp_num_tokens, b.positions.tolist()) == (3, (3,), (3, 0), [4, 5, 6])
    assert a.residual_stream is None and a.tbo_split is None
    empty, whole = split_batch(ForwardBatch.for_tokens(5), TboSplit(0))
    assert empty.num_tokens == 0 and empty.mode.value == "idle" and whole.num_tokens == 5
    with pytest.raises(ValueError, match="seq_index=4"):
        split_batch(fb, TboSplit(4, ((4, 2), (3, 0))))
    with pytest.raises(ValueError, match="do not add up"):
        split_batch(fb, TboSplit(2, ((4, 2), (3, 1))))
    with pytest.raises(ValueError, match="no dp_num_tokens"):
        split_batch(fb, TboSplit(2))
    with pytest.raises(ValueError):
        TboSplit(-1)


def test_balanced_split_of_every_dp_group():
    s = TboSplit.balanced([[3, 1, 3], [2], []], dp_rank=1)
    assert s.seq_index == 1 and s.dp_num_tokens == ((4, 2, 0), (3, 0, 0))
    assert TboSplit.balanced([[3, 1, 3]]).dp_num_tokens is None


# -- handoff rows ----------------------------------------------------------------------------------


@pytest.mark.parametrize("sparse,next_sparse,rows", [
    (False, False, TboRows.BATCH), (False, True, TboRows.SPLIT),
    (True, True, TboRows.MICROBATCH), (True, False, TboRows.MERGE)])
def test_handoff_rows_follow_from_sparse_and_next_sparse(sparse, next_sparse, rows):
    decl = declare_ffn(sparse=sparse, next_sparse=next_sparse)
    assert handoff_rows(decl) is rows
    assert handoff_rows(decl, overlap="all") is TboRows.MICROBATCH  # every layer overlaps


def test_a_terminal_producer_hands_on_the_batch_rows_and_entry_splits_for_an_overlapped_layer():
    import dataclasses

    last = dataclasses.replace(declare_ffn(sparse=True, next_sparse=True), terminal=True)
    assert handoff_rows(last) is TboRows.MERGE
    assert entry_rows(declare_ffn(sparse=True)) is TboRows.SPLIT
    assert entry_rows(declare_ffn()) is TboRows.BATCH
    with pytest.raises(ValueError, match="entry_rows"):
        handoff_rows(None)
    with pytest.raises(ValueError, match="overlap='any'"):
        handoff_rows(declare_ffn(), overlap="any")


def test_plan_of_the_embedded_moe_stack_splits_and_merges_around_its_dense_layer():
    stack = tbo_cases.TboStack("SDSS", BoundaryContext(Topology.single()))
    plan = plan_overlap(stack.layers)
    assert plan.overlapped == (True, False, True, True)
    assert [e.value for e in plan.edges] == ["split", "merge", "split", "microbatch", "merge"]
    assert plan_overlap(stack.layers, overlap="all").edges[1:-1] == (TboRows.MICROBATCH,) * 3


def test_plan_refuses_a_previous_whose_next_sparse_disagrees():
    class Layer:
        def __init__(self, attn, ffn):
            self.attn_boundary, self.ffn_boundary = attn, ffn

    ctx = BoundaryContext(Topology.single())
    first = make_stages((declare_attn(), make_norm(H, torch.float64)),
                        (declare_ffn(sparse=True, next_sparse=False), make_norm(H, torch.float64)),
                        context=ctx)
    # Layer 1 is sparse, but its previous= says the layer before announced a dense next FFN.
    second = make_stages((declare_attn(), make_norm(H, torch.float64)),
                         (declare_ffn(sparse=True), make_norm(H, torch.float64)),
                         previous=declare_ffn(sparse=True, next_sparse=False), terminal=True, context=ctx)
    with pytest.raises(ValueError, match="including next_sparse"):
        plan_overlap([Layer(*first), Layer(*second)])


# -- the synthetic stack on one rank -------------------------------------------------------------

# At most three layers: the dyadic values stay exact in float64 (``moe_cases``).
SINGLE = [
    dict(kinds="SDS", groups=[(2, 3, 1)]),
    dict(kinds="SSD", groups=[(2, 3, 1)]),
    dict(kinds="DD", groups=[(5,)], overlap="all"),  # one sequence: microbatch B is empty
    dict(kinds="SS", groups=[(1, 6)]),  # uneven: 1 + 6 rows
    dict(kinds="DSD", groups=[(3, 2)], plan="-o-"),
]


@pytest.mark.parametrize("case", SINGLE, ids=[c["kinds"] + c.get("plan", "") for c in SINGLE])
def test_tbo_equals_the_unsplit_stack_bitwise_on_one_rank(case):
    r = tbo_cases.synthetic_case(Topology.single(), case)
    assert r["equal"] and r["equal_layout"], r
    assert r["released"]  # the merged stream ended at the final norm


def test_the_schedule_alternates_the_microbatches_stage_by_stage():
    r = tbo_cases.synthetic_case(Topology.single(), dict(kinds="SDS", groups=[(2, 3, 1)]))
    trace = r["trace"]
    assert [m for m, _, _ in trace] == [0, 1] * (len(trace) // 2)
    stages = [(layer, label) for m, layer, label in trace if m == 0]
    assert stages == [(i, s) for i in (0, 2) for s in ("attn", "ffn_input", "ffn")]  # layer 1: whole batch
    assert [(layer, label) for m, layer, label in trace if m == 1] == stages


def test_interleave_keeps_stepping_the_longer_schedule():
    def gen(n, tag):
        for i in range(n):
            yield f"{tag}{i}"
        return tag

    trace = []
    assert interleave([gen(1, "a"), gen(3, "b")], trace) == ["a", "b"]
    assert trace == [(0, "a0"), (1, "b0"), (1, "b1"), (1, "b2")]


def test_a_stage_that_yields_inside_an_exit_scope_is_refused():
    from layer_boundary import get_forward
    from layer_boundary_app.models.moe import DeferFinalize

    ctx = BoundaryContext(Topology.single())
    a, f = make_stages((declare_attn(), make_norm(H, torch.float64)),
                       (declare_ffn(sparse=True), make_norm(H, torch.float64), {"fusions": DeferFinalize()}),
                       terminal=True, context=ctx)

    def stages(fb):
        rb.start(fb)
        h = a.finish(a.prepare(rand(2, H), fb), fb)
        x = f.prepare(h, fb)
        with f.exit(fb) as out:  # publishes defer_moe_finalize
            yield "ffn"
            y = x * 2
        return out.finish(y)

    with pytest.raises(BoundaryError, match="across a two-batch-overlap yield point"):
        interleave([stages(ForwardBatch.for_tokens(2)), stages(ForwardBatch.for_tokens(2))])
    assert get_forward().snapshot() == (False, False, False)  # closing the stages closed the scope
    assert get_forward().open_scopes == 0


def test_a_yield_inside_a_scope_whose_flags_are_all_false_is_refused_too():
    # A trial: an exit() scope that publishes nothing (one rank, no deferral) changed no flag, so
    # the yield inside it passed; on TP ranks the same code publishes flags the other microbatch
    # would compute under.
    from layer_boundary import get_forward

    a, f = make_stages((declare_attn(), make_norm(H, torch.float64)), (declare_ffn(), make_norm(H, torch.float64)),
                       terminal=True)

    def stages(fb):
        rb.start(fb)
        x = f.prepare(a.finish(a.prepare(rand(2, H), fb), fb), fb)
        with f.exit(fb) as out:
            assert get_forward().snapshot() == (False, False, False)
            yield "ffn"
            y = x * 2
        return out.finish(y)

    with pytest.raises(BoundaryError, match=r"microbatch 0 yielded at 'ffn' inside an exit\(\) scope"):
        interleave([stages(ForwardBatch.for_tokens(2)), stages(ForwardBatch.for_tokens(2))])
    assert get_forward().open_scopes == 0


# -- streams: identity, release, owed work --------------------------------------------------------


def _layer(ctx, i, layers=2):
    return make_stages((declare_attn(), make_norm(H, torch.float64, seed=2 * i)),
                       (declare_ffn(), make_norm(H, torch.float64, seed=2 * i + 1)),
                       previous=declare_ffn() if i else None, terminal=i == layers - 1, context=ctx)


def _split_after_first_layer():
    ctx = BoundaryContext(Topology.single())
    (a0, f0), (a1, f1) = _layer(ctx, 0), _layer(ctx, 1)
    fb = ForwardBatch(num_tokens=5, seq_lens=(2, 3))
    rb.start(fb)
    x = a0.prepare(rand(5, H), fb)
    h = a0.finish(x * 2, fb)
    x = f0.prepare(h, fb)
    h = f0.postprocess(x / 2, fb)
    children = split_batch(fb, TboSplit(1))
    return fb, children, split_stream(h, fb, children), (a1, f1)


def test_passing_one_microbatchs_output_to_the_others_stream_raises_the_spec_error():
    fb, (ca, cb), (ha, hb), (a1, f1) = _split_after_first_layer()
    assert ca.residual_stream is not cb.residual_stream
    xa = a1.prepare(ha, ca)
    ha = a1.finish(xa * 3, ca)
    with raises_exact(BoundaryError, FOREIGN_OUTPUT):
        a1.prepare(ha, cb)  # microbatch A's output into B's stream
    xb = a1.prepare(hb, cb)
    hb = a1.finish(xb * 3, cb)
    with raises_exact(BoundaryError, FOREIGN_OUTPUT):
        merge_streams((hb, ha), (ca, cb), fb)  # swapped at the merge


def test_the_batch_stream_is_released_between_split_and_merge():
    fb, children, handles, (a1, _) = _split_after_first_layer()
    with raises_exact(BoundaryError, START_FIRST):
        a1.prepare(handles[0], fb)
    merged = merge_streams(handles, children, fb)
    assert fb.residual_stream.state is StreamState.PENDING and merged.shape == (5, H)
    assert all(c.residual_stream.released for c in children)


def test_a_split_finalizes_a_handoff_once_and_keeps_its_sum_owed():
    r, v = rand(5, H), rand(5, H, seed=1)
    handoff, runs = counted_handoff(v)
    fb = ForwardBatch(num_tokens=5, seq_lens=(3, 2))
    sum_ = solo_sum(static=False)
    fb.residual_stream, h = ResidualStream.arrive(residual=r, output=handoff,
                                                  owed=(Owed(OwedKind.FINALIZE), sum_))
    children = split_batch(fb, TboSplit(1))
    ha, hb = split_stream(h, fb, children)
    assert runs == [1]
    for child, handle, rows in ((children[0], ha, slice(0, 3)), (children[1], hb, slice(3, 5))):
        c = child.residual_stream.pending
        assert isinstance(handle, OwedOutput) and c.owed == (sum_,)
        assert torch.equal(c.value, v[rows]) and torch.equal(child.residual_stream.residual, r[rows])
    merged = merge_streams((ha, hb), children, fb)
    c = fb.residual_stream.pending
    assert isinstance(merged, OwedOutput) and c.owed == (sum_,) and torch.equal(c.value, v)
    assert torch.equal(fb.residual_stream.residual, r) and runs == [1]


def test_split_of_an_initial_stream_starts_one_stream_per_microbatch():
    fb = ForwardBatch(num_tokens=4, seq_lens=(1, 3))
    rb.start(fb)
    x = rand(4, H)
    children = split_batch(fb, TboSplit(1))
    ha, hb = split_stream(x, fb, children)
    assert torch.equal(ha, x[:1]) and torch.equal(hb, x[1:])
    assert all(c.residual_stream.state is StreamState.INITIAL for c in children)


# -- the reference models and the command line ---------------------------------------------------


def test_dense_qwen3_microbatches_are_bitwise_their_own_forwards_in_float32():
    r = tbo_cases.qwen3_case(Topology.single(), dict(sequences=[[1, 5, 9, 300], [4, 77], [8], [3, 3]],
                                                     dtype="float32", per_microbatch=True))
    assert r["bitwise_per_microbatch"] and r["rel_diff"] <= 1e-5, r


def test_qwen3_moe_tbo_matches_the_unsplit_model():
    r = tbo_cases.qwen3_case(Topology.single(), dict(sequences=[[1, 5, 9, 300], [4, 77], [8]],
                                                     dtype="float64", moe=True))
    assert r["rel_diff"] <= 1e-12, r


def test_run_tbo_checks_against_the_unsplit_single_rank_model(capsys):
    rc = main(["run", "--tbo", "--moe", "--tp", "1", "--check", "--input-ids", "1,2,3;4,5;6,7,8,9"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "tbo:      layers 0,2,3 overlapped (sparse); handoff rows split > merge > split > microbatch > merge" in text
    assert "microbatches: 2 + 1 sequence(s), 5 + 4 tokens" in text and "check:    ok" in text


def test_run_tbo_refuses_what_it_cannot_split(capsys):
    assert main(["run", "--tbo", "--pattern", "M-*-", "--tp", "1"]) == 2
    assert "--tbo runs the Qwen3 and Qwen3-MoE references" in capsys.readouterr().err
    assert main(["run", "--tbo", "--moe", "--defer-moe-finalize", "--tp", "1"]) == 2
    assert "drop --defer-moe-finalize" in capsys.readouterr().err


# -- gloo: tp2, tp2 dp2 and pp2 in one spawn ----------------------------------------------------------

SYNTHETIC_2 = [
    dict(kinds="SDS", groups=[(2, 3, 1)]),
    dict(kinds="SSD", groups=[(1, 3, 1)]),
    dict(kinds="DD", groups=[(5,)], overlap="all"),  # microbatch B empty on every rank
    dict(kinds="SDS", groups=[(2, 3, 1)], plan="o-o", defer=True),  # split after a deferred sum... 
    dict(kinds="SDS", groups=[(3, 2)], plan="-oo", defer=True),  # ...and after a finalize handoff
    dict(kinds="DSD", groups=[(2, 1, 3)], scattered=True),  # input-scattered rows re-sliced
    dict(kinds="SDS", groups=[(2, 1), (3,)]),  # dp2: group 1's microbatch B is empty
    dict(kinds="DSS", groups=[(1, 4), ()], policy="rs"),  # dp2: group 1 has no tokens at all
    dict(kinds="DD", groups=[(3, 2), (1, 1)], policy="rsv", overlap="all"),
]
QWEN_2 = [
    dict(sequences=[[1, 5, 9, 300], [4, 77], [8]], dtype="float32", per_microbatch=True),
    dict(sequences=[[1, 5, 9, 300], [4, 77], [8]], moe=True),
    dict(sequences=[[1, 5, 9, 300], [4, 77], [8], [2, 2]], dp=2, dtype="float32"),
    dict(sequences=[[1, 5, 9, 300], [4, 77], [8]], dp=2, moe=True, policy="rs"),
    dict(sequences=[[1, 5, 9], [4, 77, 6]], moe=True, scattered=True),
    # pp2: each partition splits from and merges to the batch's rows (from_pp / to_pp).
    dict(sequences=[[1, 5, 9, 300], [4, 77], [8]], moe=True, pp=2),
]


@pytest.mark.slow
def test_tbo_on_gloo_tp2_tp2_dp2_and_pp2():
    out = spawn(tbo_cases.tbo_matrix, 2, args=(SYNTHETIC_2, QWEN_2))
    for rank, res in enumerate(out):
        for r in res["synthetic"]:
            assert r["equal"] and r["equal_layout"], (rank, r)
            assert [m for m, _, _ in r["trace"]] == [0, 1] * (len(r["trace"]) // 2), (rank, r["case"])
            assert r["handoffs"]["made"] == r["handoffs"]["completed"], (rank, r)
        defer_handoff = res["synthetic"][4]
        assert defer_handoff["handoffs"]["made"] >= 1  # layer 0 left a handoff that the split finalized
        for r in res["qwen3"]:
            tol = 1e-5 if r["case"].get("dtype") == "float32" else 1e-10
            assert r["rel_diff"] <= tol, (rank, r)
            assert r["rows"] > 0 or r["case"].get("pp") == 2 and rank == 0, (rank, r)
            if r["case"].get("per_microbatch"):
                assert r["bitwise_per_microbatch"], (rank, r)
