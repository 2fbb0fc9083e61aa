"""MoE on gloo with 2, 4 and 8 ranks: every layout against the single-rank result.

One spawn per world size runs every case (process groups are created once per layout):

* The synthetic stack (``moe_cases.LinearMoeStack``: dense and sparse FFNs, dyadic float64 data)
  is bitwise equal to one rank on tp2, tp4, tp8, tp2 dp2, tp4 dp2, tp4 dp4, tp8 dp2, tp8 dp4
  and the input-scattered variant, with each reduction policy under DP; the collectives counted
  show each owed sum (routed experts and shared expert together) completed exactly once, and with
  ``defer_moe_finalize`` each handoff completed exactly once.
* The Qwen3-MoE reference (embedded random weights) on the same layouts: float64 within 1e-10,
  float32 within 1e-4 and bfloat16 within 0.03, each relative to the logits' scale (the
  tolerances of ``tests/multi_rank/test_parallel.py`` and ``layer-boundary run --check``: sums regrouped
  over ranks round differently).
* A transformers checkpoint folder on tp2, tp4 dp2 and tp8 dp2 against transformers itself
  (float32, ``test_moe_transformers.FP32_REL``).
"""

from __future__ import annotations

import pytest
import torch

from layer_boundary_app.launch import spawn

import moe_cases
from parallel_cases import expected_collectives

pytestmark = pytest.mark.slow

LINEAR_2 = [
    dict(dp=1, policy="ar", counts=(5,), kinds="SDS"),
    dict(dp=1, policy="ar", counts=(5,), kinds="SDS", defer=True),
    dict(dp=1, policy="ar", counts=(4,), kinds="DSS", defer=True, shared=True),  # terminal handoff
    dict(dp=1, policy="ar", counts=(0,), kinds="SS", defer=True),
    dict(dp=2, policy="ar", counts=(3, 5), kinds="SDS", defer=True),  # DP: the finalize stays in compute
    dict(dp=2, policy="rs", counts=(3, 5), kinds="SS", shared=True),
    dict(dp=2, policy="rsv", counts=(4, 1), kinds="DS"),
    dict(dp=2, policy="rs+rsv", counts=(0, 3), kinds="SD"),
    dict(dp=1, policy="ar", counts=(5,), kinds="SDS", scattered=True, defer=True),
]
LINEAR_4 = [
    dict(dp=1, policy="ar", counts=(6,), kinds="SDS", defer=True, shared=True),
    dict(dp=1, policy="ar", counts=(6,), kinds="DSS"),
    dict(dp=2, policy="ar", counts=(3, 4), kinds="SS", defer=True),
    dict(dp=2, policy="rs", counts=(5, 0), kinds="SDS", shared=True),
    dict(dp=2, policy="rs+rsv", counts=(2, 3), kinds="DS"),  # RSv refused: attention TP 2
    dict(dp=4, policy="rsv", counts=(1, 0, 3, 2), kinds="SS"),
    dict(dp=1, policy="ar", counts=(7,), kinds="SS", scattered=True, defer=True),
    dict(dp=2, policy="rs", counts=(3, 6), kinds="SD", scattered=True, shared=True),
]

# TP=8, TP=4 x DP=2, TP=2 x DP=4.
LINEAR_8 = [
    dict(dp=1, policy="ar", counts=(9,), kinds="SDS", defer=True, shared=True),
    dict(dp=2, policy="rs", counts=(5, 0), kinds="SDS", shared=True),
    dict(dp=2, policy="rs+rsv", counts=(2, 3), kinds="DS"),
    dict(dp=4, policy="rsv", counts=(1, 0, 3, 2), kinds="SS"),
    dict(dp=4, policy="ar", counts=(0, 0, 1, 0), kinds="SD", defer=True),
    dict(dp=1, policy="ar", counts=(7,), kinds="SS", scattered=True, defer=True),
]
SEQS = [[1, 5, 9, 300], [4, 77]]
QWEN_2 = [
    dict(dp=1, sequences=SEQS),
    dict(dp=1, sequences=SEQS, defer=True),
    dict(dp=1, sequences=SEQS, scattered=True),
    dict(dp=1, sequences=SEQS, dtype="float32", defer=True),
    *(dict(dp=2, policy=p, sequences=SEQS) for p in ("ar", "rs", "rsv", "rs+rsv")),
    dict(dp=2, policy="rs+rsv", sequences=[[3, 3, 7]], defer=True),  # DP group 1 gets nothing
    dict(dp=1, sequences=[[5, 17, 3, 88], [41, 2]], dtype="float32", hf=True),
]
QWEN_4 = [
    dict(dp=1, sequences=SEQS),
    dict(dp=1, sequences=SEQS, defer=True),
    # In bf16 a near-tie in the router's top-k can pick another expert on another layout (the
    # regrouped sums round differently): a discontinuity, not an error. Routing every token to
    # all 8 experts removes the choice, so only rounding is compared.
    dict(dp=1, sequences=SEQS, dtype="bfloat16", config=dict(num_experts_per_tok=8)),
    *(dict(dp=2, policy=p, sequences=[[1, 5, 9], [4, 8, 16, 2], [3]]) for p in ("ar", "rs", "rsv", "rs+rsv")),
    dict(dp=2, sequences=[[1, 5, 9], [4, 8, 16, 2], [3]], scattered=True),
    # tp2 x pp2: layer 1, the last of pipeline stage 0, is sparse and leaves a handoff to to_pp().
    dict(pp=2, sequences=SEQS, defer=True, config=dict(mlp_only_layers=(2,))),
    dict(dp=2, policy="rs+rsv", sequences=[[5, 17, 3, 88], [41, 2], [9, 60, 7]], dtype="float32", hf=True),
]

HEADS_8 = dict(num_attention_heads=8, num_key_value_heads=2)  # every 8-rank layout shards the heads
QWEN_8 = [
    dict(dp=1, sequences=SEQS, defer=True, config=HEADS_8),
    dict(dp=2, policy="rs", sequences=[[1, 5, 9], [4, 8, 16, 2], [3]], config=HEADS_8),
    dict(dp=4, policy="rsv", sequences=[[1, 5], [7], [9, 9, 9]], config=HEADS_8),  # DP group 3 empty
    dict(dp=2, policy="rs+rsv", sequences=[[5, 17, 3, 88], [41, 2], [9, 60, 7]], dtype="float32", hf=True),
]
REL = {"float64": 1e-10, "float32": 1e-4, "bfloat16": 0.03}
HF = dict(norm_topk_prob=True, mlp_only_layers=[1])


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from test_moe_transformers import save_hf_moe

    folder = tmp_path_factory.mktemp("qwen3-moe")
    return folder, save_hf_moe(folder, **HF)


@pytest.fixture(scope="module", params=[2, 4, 8], ids=["2ranks", "4ranks", "8ranks"])
def matrix(request, hf_folder):
    world = request.param
    linear, qwen = {2: (LINEAR_2, QWEN_2), 4: (LINEAR_4, QWEN_4), 8: (LINEAR_8, QWEN_8)}[world]
    return world, spawn(moe_cases.matrix, world, args=(linear, qwen, str(hf_folder[0])), timeout_s=300)


def test_linear_moe_stack_is_bitwise_equal_and_sums_once(matrix):
    world, per_rank = matrix
    for rank, results in enumerate(per_rank):
        for r in results["linear"]:
            case = r["case"]
            assert r["equal"], f"rank {rank} {case}: differs from the single-rank stack"
            d = rank // (world // case["dp"])
            assert r["rows"] == case["counts"][d]
            # Sparse or dense, each FFN owes one sum (routed and shared experts together).
            want = expected_collectives(world, case["dp"], len(case["kinds"]), r["returns"],
                                        scattered=case.get("scattered", False))
            assert r["collectives"] == want, (rank, case, r["collectives"])


def test_linear_moe_handoffs_complete_exactly_once(matrix):
    """With a provider that allows deferral, each sparse FFN returns one handoff and something
    downstream (the next attention input or the final norm) completes it once. Under attention
    DP and input scattering the boundary refuses deferral: compute finalizes, no handoff."""
    world, per_rank = matrix
    seen = 0
    for rank, results in enumerate(per_rank):
        for r in results["linear"]:
            case = r["case"]
            sparse = case["kinds"].count("S")
            allowed = case.get("defer") and case["dp"] == 1 and not case.get("scattered")
            want = sparse if allowed else 0
            assert r["handoffs"] == {"made": want, "completed": want}, (rank, case, r["handoffs"])
            # Every FFN exit asks its provider, dense ones too; attention stages never do.
            assert r["asked"] == (len(case["kinds"]) if case.get("defer") else 0), (rank, case)
            seen += bool(allowed)
    assert seen >= world


def test_qwen3_moe_on_every_layout(matrix):
    world, per_rank = matrix
    for rank, results in enumerate(per_rank):
        for r in results["qwen3_moe"]:
            case = r["case"]
            if case.get("hf"):
                continue  # compared with transformers below
            if r["rows"] == 0:
                assert case.get("pp", 1) > 1 or case.get("dp", 1) > 1, (rank, case)
                continue
            tol = REL[case.get("dtype", "float64")] * max(1.0, r["scale"])
            assert r["max_diff"] <= tol, (rank, case, r["max_diff"], tol)


def test_qwen3_moe_handoffs_on_the_reference(matrix):
    """The reference's sparse layers return handoffs exactly where deferral is allowed, and each
    is completed once: by the next attention input, by the final norm (layer 3), or by to_pp()
    at the end of a pipeline stage."""
    world, per_rank = matrix
    for rank, results in enumerate(per_rank):
        for r in results["qwen3_moe"]:
            case = r["case"]
            allowed = case.get("defer") and case.get("dp", 1) == 1 and not case.get("scattered")
            want = sum(r["sparse"]) if allowed else 0
            assert r["handoffs"] == {"made": want, "completed": want}, (rank, case, r["handoffs"])
            if case.get("pp", 1) > 1:
                assert r["sparse"] == ([True, True] if r["pp_rank"] == 0 else [False, True]), r
                assert r["layer_ids"] == ([0, 1] if r["pp_rank"] == 0 else [2, 3])


def test_hf_folder_on_layouts_matches_transformers(matrix, hf_folder):
    from test_moe_transformers import FP32_REL

    world, per_rank = matrix
    hf = hf_folder[1]
    checked = 0
    for rank, results in enumerate(per_rank):
        for r in results["qwen3_moe"]:
            case = r["case"]
            if not case.get("hf") or not r["rows"]:
                continue
            with torch.no_grad():
                want = torch.cat([hf(torch.tensor([s])).logits[0].float() for s in case["sequences"]])
            got, want = r["logits"], want[r["tokens"]]
            err = (got - want).abs().max().item()
            assert err <= FP32_REL * max(1.0, want.abs().max().item()), (rank, case, err)
            assert r["max_diff"] <= REL["float32"] * max(1.0, r["scale"]), (rank, case)
            checked += 1
    assert checked == world
