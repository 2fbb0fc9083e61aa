"""Context-parallel prefill (``BatchVariant.CP``).

One process: the token mapping (zig-zag and contiguous ``CpSplit``), the head group a CP topology
shards attention over, which stages get a CP path, and every refused combination's error text.
Gloo with 2 and 4 ranks (one spawn per world size, shared with tests/multi_rank/test_sequence_parallel.py):
the exactly summable float64 stack is bitwise equal to one rank, each move runs exactly once per
layer, and the Qwen3 reference under CP (several uneven sequences) matches one rank in float32.
"""

from __future__ import annotations

import re

import pytest
import torch

from layer_boundary import (
    BatchVariant,
    DeclarationError,
    ForwardBatch,
    ForwardMode,
    GroupInfo,
    ProducerReduction,
    RMSNorm,
    Topology,
    declare_attn,
    declare_ffn,
    make_stages,
)
from layer_boundary._cli.main import main
from layer_boundary._cp import CpSplit, context_parallel_split
from layer_boundary._errors import BoundaryError
from layer_boundary.residual import batch as rb

import cp_cases
from cp_cases import fake_cp_topology
from helpers import FAKE_GROUP, raises_exact

H = 4


def layer(topology: Topology) -> tuple:
    return make_stages((declare_attn(), RMSNorm(H)), (declare_ffn(), RMSNorm(H)), topology=topology)


# -- the token mapping ---------------------------------------------------------------------------


def test_zigzag_pairs_an_early_and_a_late_chunk_per_sequence():
    topo = fake_cp_topology(tp=2, cp=2)
    split = CpSplit.zigzag((10, 3), topo)
    # Sequence 0 (10 tokens) in 4 chunks [0,3) [3,6) [6,8) [8,10); sequence 1 (3 tokens, from
    # packed index 10) in chunks of 1, 1, 1, 0.
    assert split.owners(0).tolist() == [0, 1, 2, 8, 9, 10]
    assert split.owners(1).tolist() == [3, 4, 5, 6, 7, 11, 12]
    assert split.counts == (6, 7) and split.local_rows == 6 and split.slot_rows == 7


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("lens", [(1,), (2, 1), (7, 8, 9), (16,), (3, 0, 5)])
def test_mappings_partition_every_sequence(cp, lens):
    topo = fake_cp_topology(tp=4, cp=cp)
    for make in (CpSplit.zigzag, CpSplit.contiguous):
        split = make(lens, topo)
        owned = sorted(i for r in range(cp) for i in split.owners(r).tolist())
        assert owned == list(range(sum(lens)))
        start = 0
        for n in lens:  # per sequence the ranks' shares differ by at most one token
            shares = [sum(start <= i < start + n for i in split.owners(r).tolist()) for r in range(cp)]
            assert max(shares) - min(shares) <= 1, (make.__name__, lens, shares)
            start += n


def test_causal_mask_is_the_block_causal_mask_of_the_local_queries():
    topo = fake_cp_topology(tp=2, cp=2)
    lens = (5, 1, 6)
    split = CpSplit.zigzag(lens, topo)
    full = cp_cases.block_causal(lens, sum(lens))
    assert torch.equal(split.causal_mask(), full[split.local_index])
    assert torch.equal(split.seq_ids(), torch.tensor([0] * 5 + [1] + [2] * 6))


def test_an_empty_cp_batch_moves_nothing():
    topo = fake_cp_topology(tp=2, cp=2)  # a collective on its fake groups would fail
    split = CpSplit.zigzag((), topo)
    assert split.local_rows == 0 and split.causal_mask().shape == (0, 0)
    assert split.gather(torch.zeros(0, H)).shape == (0, H)
    assert split.reduce_scatter(torch.zeros(0, H), topo.tp).shape == (0, H)


def test_a_split_must_partition_the_tokens():
    topo = fake_cp_topology(tp=2, cp=2)
    with pytest.raises(ValueError, match="every token 0..3 exactly once"):
        CpSplit((4,), [[0, 1], [1, 3]], topo)
    with pytest.raises(ValueError, match="3 owner lists for a CP group of 2 ranks"):
        CpSplit((4,), [[0], [1], [2, 3]], topo)


# -- topology: CP splits attention TP into CP ranks x head ranks ---------------------------------


def test_attention_sums_over_the_head_group():
    from layer_boundary._layout import SumGroup

    topo = fake_cp_topology(tp=4, cp=2)
    assert topo.attn_heads.ranks == (0, 2) and topo.attn_cp.ranks == (0, 1)
    assert topo.sum_group(SumGroup.ATTN_TP) is topo.attn_heads
    plain = Topology.single()
    assert plain.attn_heads is plain.attn_tp


def test_topology_refuses_cp_without_head_group_or_out_of_order():
    solo = GroupInfo.solo()
    pair = GroupInfo((0, 1), 0, FAKE_GROUP)
    with pytest.raises(ValueError, match="needs attn_heads"):
        Topology(tp=pair, attn_tp=pair, attn_dp=solo, attn_cp=pair, moe_out=pair, pp=solo)
    four = GroupInfo((0, 1, 2, 3), 0, FAKE_GROUP)
    with pytest.raises(ValueError, match="CP groups must be consecutive blocks"):
        Topology(tp=four, attn_tp=four, attn_dp=solo, attn_cp=GroupInfo((0, 2), 0, FAKE_GROUP),
                 moe_out=four, pp=solo, attn_heads=GroupInfo((0, 1), 0, FAKE_GROUP))


# -- which stages get a CP path ------------------------------------------------------------------


def test_cp_paths_exist_only_on_a_cp_topology():
    a, f = layer(fake_cp_topology(tp=2, cp=2))
    assert a.plan.variants == (BatchVariant.ORDINARY, BatchVariant.CP) == f.plan.variants
    assert a.plan.entries[BatchVariant.CP].rows.input_move == "local"
    assert f.plan.entries[BatchVariant.CP].rows.input_move == "gather"
    exit_ = f.plan.exits[BatchVariant.CP]
    assert exit_.rows.output_return == "cp" and exit_.rows.output_group.ranks == (0, 1)
    assert not exit_.may_defer_sum and not exit_.may_defer_finalize
    a1, _ = layer(fake_cp_topology(tp=2, cp=1))
    assert BatchVariant.CP not in a1.plan.variants


# -- refused combinations ------------------------------------------------------------------------


def started(**kw) -> ForwardBatch:
    fb = ForwardBatch(num_tokens=kw.pop("num_tokens", 3), **kw)
    rb.start(fb)
    return fb


def refusal(boundary, fb, variant: str) -> list[str]:
    with raises_exact(BoundaryError, f"no stage boundary path for the active {variant} batch") as info:
        boundary.prepare(torch.randn(fb.num_tokens, H), fb)
    return info.value.__notes__


def test_cp_with_attention_dp_is_refused_at_construction():
    text = ("context parallelism (cp=2) with attention DP (dp=2) is not supported: under attention DP "
            "the FFN input joins every DP group's rows in one all-reduce over TP, which needs each "
            "group's rows replicated over its attention-TP ranks, and CP ranks hold different tokens. "
            "Use cp=1 with attention DP, or dp=1 with CP")
    with raises_exact(DeclarationError, text):
        layer(fake_cp_topology(tp=4, cp=2, dp=2))


def test_cp_with_a_moe_output_group_other_than_tp_is_refused_at_construction():
    import dataclasses

    topo = fake_cp_topology(tp=2, cp=2)
    other = dataclasses.replace(topo, moe_out=GroupInfo.solo())
    with raises_exact(DeclarationError, "context parallelism (cp=2) with a MoE output group (0,) other "
                      "than TP (0, 1) is not supported: the CP reduce-scatter of an FFN output maps TP "
                      "ranks to CP partitions"):
        layer(other)


def test_input_scattered_on_a_cp_topology_is_refused_per_batch():
    a, _ = layer(fake_cp_topology(tp=4, cp=2))
    notes = refusal(a, started(input_scattered=True), "INPUT_SCATTERED")
    assert notes[0] == (
        f"{a.plan.name}: the input-scattered variant on a context-parallel topology (cp=2) is not "
        "supported: attention heads are sharded over the 2 ranks of one CP position and replicated "
        "over CP, so a row slice over attention TP (4 ranks) would sum each head's output once per "
        "CP rank; run the batch ordinary or as CP")
    # Flagged input-scattered and CP at once: the priority order runs input-scattered, refused.
    notes = refusal(a, started(input_scattered=True, context_parallel=True), "INPUT_SCATTERED")
    assert "the input-scattered variant on a context-parallel topology" in notes[0]


def test_sequence_parallel_on_a_cp_topology_is_refused():
    a, _ = layer(fake_cp_topology(tp=2, cp=2))
    notes = refusal(a, started(sequence_parallel=True, context_parallel=True), "SEQUENCE_PARALLEL")
    assert notes[0].startswith(f"{a.plan.name}: sequence parallel on a context-parallel topology (cp=2)")


def test_a_mixer_that_scans_whole_sequences_has_no_cp_path():
    mixer = declare_attn(reduction=ProducerReduction.SCOPED, gathers_tp_input=False)
    m, = make_stages((mixer, RMSNorm(H)), following=declare_ffn(), topology=fake_cp_topology())
    assert BatchVariant.CP not in m.plan.variants
    topo = m.plan.topology
    split = CpSplit.zigzag((6,), topo)
    notes = refusal(m, started(num_tokens=3, context_parallel=True, cp_split=split), "CP")
    assert notes[0] == (f"{m.plan.name}: a mixer that takes the whole sequence un-gathered "
                        "(gathers_tp_input=False, e.g. a recurrent scan) cannot run on a "
                        "context-parallel token partition")


def test_branch_stages_have_no_cp_path():
    moe = declare_ffn(sparse=True)
    first, = make_stages((declare_ffn(), RMSNorm(H)), prepared_from=moe, topology=fake_cp_topology())
    assert first.plan.variants == (BatchVariant.ORDINARY,)
    assert first.plan.refusals[BatchVariant.CP] == (
        "branch transport supports only ordinary token rows; a prepared_from stage has no "
        "context-parallel path")


def test_decode_batch_under_cp_is_refused_before_any_collective():
    a, _ = layer(fake_cp_topology())
    split = CpSplit.zigzag((1, 1, 1), a.plan.topology)
    fb = started(num_tokens=split.local_rows, mode=ForwardMode.DECODE, context_parallel=True, cp_split=split)
    text = (f"{a.plan.name}: a DECODE batch cannot run context parallel. CP partitions the tokens of "
            "each sequence's prefill over the CP group; a decode step has one token per sequence. "
            "Run decode batches ordinary (context_parallel=False); the CP ranks then compute the "
            "same rows with the same heads")
    with raises_exact(BoundaryError, text):
        a.prepare(torch.randn(split.local_rows, H), fb)


def test_cp_batch_needs_its_split_for_this_topology():
    a, _ = layer(fake_cp_topology())
    fb = started(context_parallel=True)
    with raises_exact(BoundaryError, "a context-parallel batch has no forward_batch.cp_split; build "
                      "the token mapping with layer_boundary._cp.CpSplit.zigzag(seq_lens, topology) "
                      "and give this rank its rows"):
        a.prepare(torch.randn(3, H), fb)
    other = fake_cp_topology(tp=4, cp=4)
    fb = started(num_tokens=1, context_parallel=True, cp_split=CpSplit.zigzag((4,), other))
    with pytest.raises(BoundaryError, match=r"was built for the CP group \(0, 1, 2, 3\), but this "
                       r"stage's CP group is \(0, 1\)"):
        a.prepare(torch.randn(1, H), fb)
    fb = started(num_tokens=5, context_parallel=True, cp_split=CpSplit.zigzag((6,), a.plan.topology))
    with pytest.raises(BoundaryError, match="num_tokens=5 but cp_split gives CP rank 0 3 rows"):
        a.prepare(torch.randn(5, H), fb)
    # A batch whose active variant is not CP has no split to hand the attention.
    assert context_parallel_split(ForwardBatch(num_tokens=1, context_parallel=True, input_scattered=True)) is None


def test_whole_sequences_given_as_a_cp_batchs_seq_lens_say_where_they_go():
    # A trial: ForwardBatch(num_tokens=3, seq_lens=(6,), context_parallel=True) said only that
    # the lengths must sum to num_tokens.
    with pytest.raises(ValueError, match=r"seq_lens \(6,\) must be non-negative and sum to num_tokens=3 \(under "
                                         r"context_parallel num_tokens counts this rank's rows: give the batch's "
                                         r"whole sequences to cp_split"):
        ForwardBatch(num_tokens=3, seq_lens=(6,), context_parallel=True)
    with pytest.raises(ValueError) as plain:
        ForwardBatch(num_tokens=3, seq_lens=(6,))
    assert "context_parallel" not in str(plain.value)


def test_two_batch_overlap_refuses_a_cp_batch():
    from layer_boundary._adapters.tbo import TboSplit, split_batch

    fb = ForwardBatch(num_tokens=4, context_parallel=True)
    with pytest.raises(ValueError, match="two-batch overlap with a context-parallel batch is not supported"):
        split_batch(fb, TboSplit(1))


def test_lora_rows_of_a_cp_ffn_are_refused():
    a, f = layer(fake_cp_topology())
    split = CpSplit.zigzag((6,), a.plan.topology)
    fb = ForwardBatch(num_tokens=3, context_parallel=True, cp_split=split)
    assert a.input_rows(fb).num_rows == 3  # attention reads on this rank's tokens
    with pytest.raises(BoundaryError, match="LoRA input rows of a context-parallel FFN are not supported"):
        f.input_rows(fb)


@pytest.mark.parametrize("kw,text", [
    (dict(tp=2, cp=3), "--cp 3 must divide the attention-TP size --tp 2 / --dp 1 = 2"),
    (dict(tp=4, dp=2, cp=2), "--cp 2 with --dp 2: context parallelism with attention DP is not supported"),
    (dict(tp=2, cp=2, tbo=True), "--cp with --tbo: two-batch overlap splits at sequence boundaries"),
    (dict(tp=2, cp=2, pattern="M-*-"), "--cp runs the Qwen3 and Qwen3-MoE references"),
    (dict(tp=2, cp=2, input_scattered=True), "--cp with the input-scattered variant is not supported"),
    (dict(tp=2, cp=0), "--cp 0 must be a positive integer"),
])
def test_run_spec_refuses_cp_combinations(kw, text):
    from layer_boundary_app.models.runner import RunSpec

    with pytest.raises(ValueError, match="^" + re.escape(text)):
        RunSpec(sequences=((1, 2),), **kw)


def test_cli_refuses_a_cp_that_does_not_fit(capsys):
    assert main(["run", "--tp", "2", "--cp", "4"]) == 2
    assert "--cp 4 must divide the attention-TP size --tp 2 / --dp 1 = 2" in capsys.readouterr().err


# -- gloo, 2 and 4 ranks ---------------------------------------------------------------------------

@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def spawned(request):
    return request.param, cp_cases.results(request.param)


@pytest.mark.slow
def test_linear_stack_under_cp_is_bitwise_one_rank(spawned):
    world, per_rank = spawned
    seen = 0
    for rank, r in cp_cases.of_kind(per_rank, "cp_linear"):
        case = r["case"]
        assert r["equal"], (rank, case)
        # The attention reads on this rank's tokens; the FFN sees every token of the batch.
        n, layers = sum(case["seqs"]), case["layers"]
        assert r["seen"] == [("attn", r["rows"]), ("ffn", n)] * layers, (rank, case)
        seen += 1
    assert seen == world * len([c for c in cp_cases.CASES[world] if c["kind"] == "cp_linear"])


@pytest.mark.slow
def test_every_token_is_on_exactly_one_cp_rank(spawned):
    world, per_rank = spawned
    for i, case in enumerate(cp_cases.CASES[world]):
        if case["kind"] != "cp_linear":
            continue
        cp = case["cp"]
        # Ranks 0..cp-1 form the first CP group (consecutive attention-TP ranks).
        owned = sorted(t for rank in range(cp) for t in per_rank[rank][i]["owners"])
        assert owned == list(range(sum(case["seqs"]))), case
        for rank in range(world):  # head ranks at one CP position hold the same tokens
            assert per_rank[rank][i]["owners"] == per_rank[rank % cp][i]["owners"]


@pytest.mark.slow
def test_cp_moves_run_exactly_once_per_layer(spawned):
    """Per layer: the attention's value gather over CP, the FFN input gather over CP, the FFN
    output reduce-scatter over TP, and (heads sharded over more than one rank) the attention's
    sum over the head group at the FFN input. Nothing else: the final norm is on local rows."""
    world, per_rank = spawned
    for rank, r in cp_cases.of_kind(per_rank, "cp_linear"):
        layers = r["case"]["layers"]
        want = {"all_gather": 2 * layers, "reduce_scatter": layers}
        if r["heads"] > 1:
            want["all_reduce"] = layers
        assert r["collectives"] == want, (rank, r["case"], r["collectives"])


@pytest.mark.slow
def test_local_tail_ffn_under_cp_adds_its_component_once(spawned):
    """LOCAL_TAIL under CP: never deferred, and its compute sees mlp_reduce_scatter (the CP return)
    and adds the replicated component on TP rank 0 only; bitwise equal above."""
    world, per_rank = spawned
    tails = [(rank, r) for rank, r in cp_cases.of_kind(per_rank, "cp_linear") if r["case"].get("tail")]
    assert tails
    for rank, r in tails:
        assert r["tail_flags"] == [(False, True)] * r["case"]["layers"], (rank, r["case"])


@pytest.mark.slow
def test_qwen3_under_cp_matches_one_rank(spawned):
    from layer_boundary_app.cli.run import CHECK_REL

    world, per_rank = spawned
    rows = {}
    for rank, r in cp_cases.of_kind(per_rank, "qwen3_cp"):
        case = r["case"]
        key = cp_cases.CASES[world].index(case)
        if case.get("pp", 1) > 1 and r["pp_rank"] == 0:
            assert r["rows"] == 0  # the first pipeline stage sends its output on
            continue
        if r["rows"]:
            tol = CHECK_REL[case.get("dtype", "float32")] * max(1.0, r["scale"])
            assert r["max_diff"] <= tol, (rank, case, r["max_diff"], tol)
        # Collectives of one forward: per layer the K/V gather and the FFN input gather over CP,
        # the FFN return reduce-scatter, and with heads over 2+ ranks the attention sum; the
        # embedding sum and the LM head gather over the head group.
        n = r["layers"]
        want = {"all_gather": 2 * n, "reduce_scatter": n}
        if r["heads"] > 1:
            want["all_reduce"] = n + 1
            want["all_gather"] += 1
        assert r["collectives"] == want, (rank, case, r["collectives"])
        if r["head_rank"] == 0:
            rows[key] = rows.get(key, 0) + r["rows"]
    for key, n in rows.items():  # each token's logits come from exactly one reporting rank
        assert n == sum(len(s) for s in cp_cases.CASES[world][key]["sequences"]), cp_cases.CASES[world][key]


@pytest.mark.slow
def test_decode_on_a_cp_topology_runs_ordinary_and_refuses_cp(spawned):
    world, per_rank = spawned
    got = cp_cases.of_kind(per_rank, "qwen3_decode_on_cp")
    if world == 2:
        assert not got
        return
    assert len(got) == world
    for rank, r in got:
        assert r["max_diff"] <= 1e-4, (rank, r)
        kind, text = r["refused"]
        assert kind == "BoundaryError" and "a DECODE batch cannot run context parallel" in text


@pytest.mark.slow
def test_run_cp_checks_against_one_rank(tmp_path, capsys):
    """``layer-boundary run --cp 2 --check``: the logits each CP rank reports for its tokens,
    assembled in input order, match the single-rank model."""
    out = tmp_path / "logits.pt"
    rc = main(["run", "--tp", "2", "--cp", "2", "--check", "--input-ids", "5,6,7,8,9;10;11,12,13",
               "--save-logits", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "topology: tp=2 attn_tp=2 attn_dp=1 cp=2 pp=1" in text and "check:    ok" in text
    assert "ffn CP x4: output return [CP token mapping] -> reduce-scatter" in text
    assert torch.load(out).shape == (9, 512)
