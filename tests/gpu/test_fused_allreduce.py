"""Fused all-reduce + add + RMSNorm consumer candidates (``layer_boundary._fusion``).

On gloo, a provider built on the core's ``AllReduceNormProvider`` whose run is the all-reduce plus
the torch reference checks the shared contract through a real model: bitwise equal logits, one
call per owed sum, one workspace per group, declines over the token limit, a refusal on one rank
becoming every rank's, nothing offered where nothing is owed. On 2 GPUs the core's
symmetric-memory kernel is compared with NCCL + the torch reference, replayed in a CUDA graph
and run back to back without host syncs.
"""

from __future__ import annotations

import logging

import pytest
import torch

from layer_boundary import BoundaryContext, ForwardBatch, declare_attn, declare_ffn, make_stages
from layer_boundary._fusion import AllReduceNormCandidate, FusedSum
from layer_boundary_app.launch import spawn
from layer_boundary._layout import BatchVariant, SumGroup
from layer_boundary._norms import RMSNorm
from layer_boundary._topology import GroupInfo

import fused_cases


@pytest.fixture(scope="module")
def gloo2() -> list[dict]:
    return spawn(fused_cases.model_cases, 2, timeout_s=240)


def test_a_fused_ffn_input_sum_gives_the_unfused_logits(gloo2):
    for rank, res in enumerate(gloo2):
        r = res["attn_sum"]
        assert r["equal"], (rank, r)
        # Every FFN input completes its attention-TP sum through the candidate, once per layer;
        # the FFN sums its own output (nobody lets it defer), so attention inputs fuse nothing.
        assert r["calls"] == r["layers"], (rank, r)
        assert r["workspaces"] == 1, (rank, r)  # one per (group, hidden, dtype), shared by stages
        assert "echo all-reduce + add + rmsnorm" in r["chosen"]


def test_deferred_ffn_sums_are_completed_by_the_next_attention_input(gloo2):
    for rank, res in enumerate(gloo2):
        r = res["both_sums"]
        assert r["equal"], (rank, r)
        # The terminal FFN sums before the final norm; every other FFN output is owed to the
        # next attention input and fused there.
        assert r["calls"] == 2 * r["layers"] - 1, (rank, r)


def test_over_the_token_limit_every_rank_takes_the_unfused_path(gloo2):
    for rank, res in enumerate(gloo2):
        r = res["over_limit"]
        assert r["equal"] and r["calls"] == 0, (rank, r)


def test_a_refusal_on_one_rank_is_every_ranks(gloo2):
    r0, r1 = gloo2[0]["rank1_refuses"], gloo2[1]["rank1_refuses"]
    for rank, r in enumerate((r0, r1)):
        assert r["equal"] and r["calls"] == 0 and r["workspaces"] == 0, (rank, r)
        assert r["chosen"] == ["None"], (rank, r)
    assert r1["refusals"] == ["rank 1 lacks the library"]
    assert r0["refusals"] == ["another rank of the group refused it (its selection report says why); "
                              "every rank takes the same path or none does"]


def test_nothing_is_offered_where_attention_dp_leaves_nothing_owed(gloo2):
    for res in gloo2:
        assert res["dp"] == {"refusals": [], "workspaces": 0}


def test_the_core_candidate_refuses_gloo_with_a_reason(gloo2):
    # Through run's selection report (tests/plugins/test_plugin_packages.py checks the full line); here
    # the provider's own static check, without spawning.
    from layer_boundary._fusion.symm_mem import SymmMemAllReduceNorm

    group = GroupInfo(ranks=(0, 1), rank=0, group=object())
    why = SymmMemAllReduceNorm()._common_refusal(FusedSum(SumGroup.ATTN_TP, group, 64, torch.float32, 0.0, None))
    assert why == "needs a nccl group; attn_tp uses unknown"


def test_no_candidate_on_one_rank_and_no_report_row():
    ctx = BoundaryContext()
    attn, ffn = make_stages((declare_attn(), RMSNorm(16)), (declare_ffn(), RMSNorm(16)), previous=declare_ffn(),
                            context=ctx)
    assert ffn.plan.entries[BatchVariant.ORDINARY].candidates == ()
    assert not [s for s in ctx.freeze().selections if s.what == "consumer fusion"]


def test_candidate_declines_unexpected_inputs_once_loudly(caplog):
    group = GroupInfo(ranks=(0, 1), rank=0, group=object())
    calls = []
    cand = AllReduceNormCandidate("c", FusedSum(SumGroup.TP, group, 8, torch.float32, 0.0, None), 4,
                                  lambda x, r, read: calls.append(1) or (x, r))
    x, r = torch.zeros(2, 8), torch.zeros(2, 8)
    fb = ForwardBatch(num_tokens=2)
    assert cand(x, None, None, fb) is None  # stack entry: nothing to add to
    assert cand(torch.zeros(5, 8), torch.zeros(5, 8), None, fb) is None  # over the limit, quietly
    assert cand(torch.zeros(0, 8), torch.zeros(0, 8), None, fb) is None
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="layer_boundary"):
        assert cand(x.double(), r.double(), None, fb) is None
        assert cand(x.double(), r.double(), None, fb) is None
        assert cand(torch.zeros(8, 2).t(), r, None, fb) is None  # rows not contiguous
    assert len(caplog.records) == 2 and "unfused all-reduce path" in caplog.records[0].getMessage()
    assert cand(x, r, None, fb) == (x, r) and calls == [1]


SYMM_CASES = [
    dict(dtype="bfloat16", hidden=4096, tokens=[1, 3, 16, 128, 1000, 2048, 2049], graph=8, repeat=200),
    dict(dtype="float16", hidden=7168, tokens=[1, 64, 513]),
    dict(dtype="float32", hidden=1000, tokens=[1, 5, 300]),
    dict(dtype="bfloat16", hidden=2048, tokens=[1, 77], gemma=True),
]


@pytest.mark.gpu
def test_symm_mem_candidate_matches_nccl_and_the_reference_on_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs; {torch.cuda.device_count()} visible")
    per_rank = spawn(fused_cases.symm_mem_cases, 2, args=(SYMM_CASES,), backend="nccl", timeout_s=300)
    tol = {"bfloat16": 1.6e-2, "float16": 2e-3, "float32": 2e-5}
    for rank, rows in enumerate(per_rank):
        for row in rows:
            case = row["case"]
            assert row["candidates"] == ["symm-mem all-reduce + add + rmsnorm"], (rank, row)
            # The residual is the all-reduce output (rounded once) plus the residual: bitwise.
            assert row["residual_equal"], (rank, row)
            assert row["worst_y"] <= tol[case["dtype"]] * 8, (rank, row)  # |y| reaches about 8 here
            assert row["declined"] == [t for t in case["tokens"] if t > 2048], (rank, row)
            if "graph" in case:
                assert row["graph_equal"], (rank, row)
            if "repeat" in case:
                assert row["repeat_equal"], (rank, row)


def test_a_workspace_turned_down_on_one_rank_is_refused_by_every_rank():
    for rank, r in enumerate(spawn(fused_cases.late_refusal, 2, timeout_s=120)):
        # Rank 0 made its workspace once (then dropped it); no stage asks again.
        assert r["equal"] and r["calls"] == 0 and r["workspaces"] == (1 if rank == 0 else 0), (rank, r)
        want = "rank 1 could not map the peer buffers" if rank == 1 else \
            "another rank of the group refused it (its selection report says why); every rank takes the same path or none does"
        assert r["refusals"] == [want], (rank, r)
