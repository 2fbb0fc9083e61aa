"""Sequence parallel (``BatchVariant.SEQUENCE_PARALLEL``).

Between stages the residual is sharded over the TP group's rows (rank ``t`` holds rows
``[t*S, (t+1)*S)``, padded); before each column-parallel projection the normalized input is
all-gathered, after each row-parallel one the output is reduce-scattered back to the shard (the
attention's at the next input, the FFN's at its exit). Without attention DP these are the
input-scattered variant's moves; with attention DP or CP, sequence parallel is refused.

One process: which stages get the path and every refusal's text. Gloo with 2 and 4 ranks (the
spawns are shared with tests/multi_rank/test_cp.py): bitwise against one rank on the exactly summable
stack, each move exactly once, the Qwen3 reference within the float32 tolerance.
"""

from __future__ import annotations

import pytest
import torch

from layer_boundary import (BatchVariant, ForwardBatch, ProducerReduction, RMSNorm, declare_attn, declare_ffn,
                            make_stages)
from layer_boundary._errors import BoundaryError
from layer_boundary._scatter import ScatterRows
from layer_boundary.residual import batch as rb

import cp_cases
from cp_cases import fake_cp_topology
from helpers import fake_topology, raises_exact

H = 4
NO_PATH = "no stage boundary path for the active SEQUENCE_PARALLEL batch"


def layer(topology):
    return make_stages((declare_attn(), RMSNorm(H)), (declare_ffn(), RMSNorm(H)), topology=topology)


def notes_of(boundary, fb) -> list[str]:
    rb.start(fb)
    with raises_exact(BoundaryError, NO_PATH) as info:
        boundary.prepare(torch.randn(fb.num_tokens, H), fb)
    return info.value.__notes__


def test_sequence_parallel_paths_with_tp_and_no_attention_dp():
    a, f = layer(fake_topology(tp=2))
    assert BatchVariant.SEQUENCE_PARALLEL in a.plan.variants and BatchVariant.SEQUENCE_PARALLEL in f.plan.variants
    sp_a, sp_f = a.plan.entries[BatchVariant.SEQUENCE_PARALLEL], f.plan.entries[BatchVariant.SEQUENCE_PARALLEL]
    assert (sp_a.rows.input_move, sp_f.rows.input_move) == ("group", "all")  # all-gather before column-parallel
    assert f.plan.exits[BatchVariant.SEQUENCE_PARALLEL].rows.output_return == "scatter"  # reduce-scatter after row-parallel
    assert a.plan.exits[BatchVariant.SEQUENCE_PARALLEL].rows.output_return is None
    sp_exit = a.plan.exits[BatchVariant.SEQUENCE_PARALLEL]
    assert sp_exit.static_owed and sp_exit.static_owed[0].group.size == 2  # left to the next input
    one, _ = layer(None)
    assert BatchVariant.SEQUENCE_PARALLEL not in one.plan.variants
    assert notes_of(one, ForwardBatch(num_tokens=2, sequence_parallel=True))[0].startswith(
        one.plan.name + " has paths only")  # a size-one axis: nothing to refuse, just absent


def test_sequence_parallel_with_attention_dp_is_refused():
    a, _ = layer(fake_topology(tp=4, attn_dp=2))
    assert BatchVariant.INPUT_SCATTERED in a.plan.variants  # the DP-aware slice
    notes = notes_of(a, ForwardBatch(num_tokens=3, sequence_parallel=True, dp_num_tokens=(3, 2)))
    assert notes[0] == (
        f"{a.plan.name}: sequence parallel shards the residual over the whole TP group (4 ranks), "
        "but under attention DP (dp=2) each DP group holds its own rows; the input-scattered "
        "variant slices each group's rows over its attention-TP ranks instead")
    # Both flags set: sequence parallel has priority, and is refused (never run as input-scattered).
    notes = notes_of(a, ForwardBatch(num_tokens=3, sequence_parallel=True, input_scattered=True,
                                     dp_num_tokens=(3, 2)))
    assert "sequence parallel shards the residual" in notes[0]


def test_sequence_parallel_on_a_cp_topology_is_refused():
    a, _ = layer(fake_cp_topology(tp=4, cp=2))
    notes = notes_of(a, ForwardBatch(num_tokens=3, sequence_parallel=True))
    assert notes[0] == (
        f"{a.plan.name}: sequence parallel on a context-parallel topology (cp=2) is not supported: "
        "attention heads are sharded over the 2 ranks of one CP position and replicated over CP, "
        "so a row slice over attention TP (4 ranks) would sum each head's output once per CP rank; "
        "run the batch ordinary or as CP")


def test_a_mixer_that_does_not_gather_its_input_has_no_sequence_parallel_path():
    mixer = declare_attn(reduction=ProducerReduction.SCOPED, gathers_tp_input=False)
    m, = make_stages((mixer, RMSNorm(H)), following=declare_ffn(), topology=fake_topology(tp=2))
    notes = notes_of(m, ForwardBatch(num_tokens=2, sequence_parallel=True))
    assert notes[0] == (f"{m.plan.name}: a mixer that takes the whole sequence un-gathered "
                        "(gathers_tp_input=False, e.g. a recurrent scan) cannot run on a TP row slice")


def test_branch_stages_have_no_sequence_parallel_path():
    first, = make_stages((declare_ffn(), RMSNorm(H)), prepared_from=declare_ffn(sparse=True),
                         topology=fake_topology(tp=2))
    assert first.plan.variants == (BatchVariant.ORDINARY,)
    assert first.plan.refusals[BatchVariant.SEQUENCE_PARALLEL] == (
        "branch transport supports only ordinary token rows; a prepared_from stage has no "
        "sequence-parallel path")


def test_a_sequence_parallel_slice_does_not_cross_pipeline_stages():
    fb = ForwardBatch(num_tokens=2, sequence_parallel=True)
    stream = rb.start(fb)
    stream.rows = ScatterRows((2,), fake_topology(tp=2))  # what the batch's first prepare() leaves
    with raises_exact(BoundaryError, "to_pp(): an input-scattered (or sequence-parallel) batch holds a row "
                      "slice per attention-TP rank; these variants are not supported across pipeline "
                      "stages yet"):
        rb.to_pp(torch.randn(2, H), fb)


def test_fold_cannot_start_a_sequence_parallel_stack():
    fb = ForwardBatch(num_tokens=2, sequence_parallel=True)
    rb.start(fb)
    with pytest.raises(BoundaryError, match="fold\\(\\) on an initial stream of a sequence-parallel batch"):
        rb.fold(torch.randn(2, H), fb)


# -- gloo, 2 and 4 ranks ---------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def spawned(request):
    return request.param, cp_cases.results(request.param)


@pytest.mark.slow
def test_linear_stack_under_sequence_parallel_is_bitwise_one_rank(spawned):
    """Per layer: attention input gathered over TP, its partial sum reduce-scattered to the shard
    at the FFN input, FFN input gathered, FFN output reduce-scattered; the final norm gathers the
    output back once. A LOCAL_TAIL FFN sees mlp_reduce_scatter and never defers."""
    world, per_rank = spawned
    got = cp_cases.of_kind(per_rank, "sp_linear")
    assert len(got) == world * len([c for c in cp_cases.CASES[world] if c["kind"] == "sp_linear"])
    for rank, r in got:
        case, layers = r["case"], r["case"]["layers"]
        assert r["equal"] and r["shape"] == (case["tokens"], 8), (rank, case)
        assert r["collectives"] == {"all_gather": 2 * layers + 1, "reduce_scatter": 2 * layers}, (rank, r)
        assert r["tail_flags"] == ([(False, True)] * layers if case.get("tail") else []), (rank, r)
        assert r["released"]


@pytest.mark.slow
def test_qwen3_under_sequence_parallel_matches_one_rank(spawned):
    """Dense Qwen3, and Qwen3-MoE under two-batch overlap (each microbatch re-sliced over TP)."""
    from layer_boundary_app.cli.run import CHECK_REL

    world, per_rank = spawned
    got = cp_cases.of_kind(per_rank, "qwen3_sp")
    assert len(got) == world * len([c for c in cp_cases.CASES[world] if c["kind"] == "qwen3_sp"])
    for rank, r in got:
        assert r["max_diff"] <= CHECK_REL["float32"] * max(1.0, r["scale"]), (rank, r)
        if r["case"].get("tbo"):
            continue  # two microbatches: the moves run per microbatch (see tests/multi_rank/test_tbo.py)
        n = r["layers"]
        # + the embedding's sum, the final norm's gather and the LM head's vocabulary gather.
        assert r["collectives"] == {"all_reduce": 1, "all_gather": 2 * n + 2, "reduce_scatter": 2 * n}, (rank, r)


@pytest.mark.parametrize("shape, said", [
    ((12, H), "the stage input has 12 rows, but ForwardBatch.num_tokens is 14: pass the batch's rows, "
              "all of them on every attention-TP rank: the boundary scatters them"),
    ((1, 14, H), "the stage input has 1 rows (shape (1, 14, 4): boundaries move token rows, [tokens, hidden]; "
                 "flatten a [batch, seq, hidden] tensor with x.view(-1, x.shape[-1])), but "
                 "ForwardBatch.num_tokens is 14: pass the batch's rows, all of them on every attention-TP "
                 "rank: the boundary scatters them"),
])
def test_a_sequence_parallel_input_of_the_wrong_rows_is_refused_before_the_slice(shape, said):
    # Before: 12 rows were zero-padded to 14 and a [1, 14, H] tensor sliced as one padded row,
    # silently, on every rank.
    a, _ = layer(fake_topology(tp=2))
    fb = ForwardBatch(num_tokens=14, sequence_parallel=True)
    rb.start(fb)
    with raises_exact(BoundaryError, said):
        a.prepare(torch.randn(*shape), fb)


def test_an_input_scattered_group_of_the_wrong_rows_names_its_dp_group():
    a, _ = layer(fake_topology(tp=4, attn_dp=2))
    fb = ForwardBatch(num_tokens=3, input_scattered=True, dp_num_tokens=(3, 2))
    rb.start(fb)
    with raises_exact(BoundaryError, "the stage input has 2 rows, but ForwardBatch.dp_num_tokens gives this "
                                     "DP group (rank 0) 3: pass the group's own rows (num_tokens and "
                                     "dp_num_tokens count them)"):
        a.prepare(torch.randn(2, H), fb)
