"""Parallel paths on GPUs with NCCL, and boundaries inside CUDA-graph capture.

The float64 linear stack must match the single-rank stack bit for bit (NCCL sums float64 exactly
for dyadic data). Qwen3 in bfloat16 is compared with the single-GPU model relative to the largest
|logit|: 0.03, the bf16 bound measured against transformers (test_qwen3_transformers.BF16_REL).
"""

from __future__ import annotations

import pytest
import torch

from layer_boundary_app.launch import spawn

import gpu_cases
from parallel_cases import HEADS_8, LINEAR_2, LINEAR_4, LINEAR_8, expected_collectives

pytestmark = pytest.mark.gpu

QWEN_NCCL = [
    dict(dp=1, policy="ar", sequences=[[1, 5, 9, 2, 77], [4]], dtype="bfloat16"),
    dict(dp=2, policy="rs", sequences=[[1, 5, 9, 4], [4, 8]], dtype="bfloat16"),
    dict(dp=2, policy="rsv", sequences=[[3, 3, 7]], dtype="bfloat16"),
    dict(dp=2, policy="ar", sequences=[[1], [2], [3]], dtype="bfloat16"),
    dict(dp=2, policy="rs+rsv", sequences=[[6, 2, 7, 1, 9, 9, 4]], dtype="float32"),
    dict(dp=1, policy="ar", sequences=[[1, 5, 9, 2, 77], [4]], dtype="bfloat16", scattered=True),
]


# The 4- and 8-GPU layouts (TP=4, TP=2 x DP=2; TP=8, TP=4 x DP=2, TP=2 x DP=4), eight heads so
# that TP=8 shards them; they run where that many GPUs are visible.
QWEN_NCCL_WIDE = [
    dict(dp=1, policy="ar", sequences=[[1, 5, 9, 2, 77], [4]], dtype="bfloat16", config=HEADS_8),
    dict(dp=2, policy="rs", sequences=[[1, 5, 9, 4], [4, 8], [3]], dtype="bfloat16", config=HEADS_8),
    dict(dp=2, policy="rs+rsv", sequences=[[6, 2, 7, 1, 9, 9, 4]], dtype="float32", config=HEADS_8),
    dict(dp=1, policy="ar", sequences=[[1, 5, 9, 2, 77], [4]], dtype="bfloat16", scattered=True, config=HEADS_8),
]
QWEN_NCCL_8 = QWEN_NCCL_WIDE + [
    dict(dp=4, policy="rsv", sequences=[[1, 5], [7], [9, 9, 9]], dtype="bfloat16", config=HEADS_8),
]
NCCL_MATRICES = {2: (LINEAR_2, QWEN_NCCL), 4: (LINEAR_4, QWEN_NCCL_WIDE), 8: (LINEAR_8, QWEN_NCCL_8)}


def _gpus(n: int):
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPUs; {torch.cuda.device_count()} visible")


def _two_gpus():
    _gpus(2)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_nccl_matrix_matches_one_gpu(world):
    _gpus(world)
    per_rank = spawn(gpu_cases.nccl_matrix, world, args=NCCL_MATRICES[world], backend="nccl", timeout_s=300)
    for rank, res in enumerate(per_rank):
        for r in res["linear"]:
            assert r["equal"], (rank, r)
            case = r["case"]
            want = expected_collectives(world, case["dp"], case["layers"], r["returns"],
                                        scattered=case.get("scattered", False))
            assert r["collectives"] == want, (rank, r)
        for r in res["qwen3"]:
            rel = 0.03 if r["case"]["dtype"] == "bfloat16" else 1e-5
            assert r["max_diff"] <= rel * max(1.0, r["scale"]), (rank, r)


def test_decode_step_replays_in_a_cuda_graph_one_gpu():
    out = gpu_cases.graph_decode(0, 1, 1, "ar", 8)
    assert out["equal"] and out["equal_after_new_inputs"], out


@pytest.mark.parametrize("dp,policy", [(1, "ar"), (2, "rs"), (2, "rsv"), (2, "ar")])
def test_decode_step_replays_in_a_cuda_graph_two_gpus(dp, policy):
    _two_gpus()
    per_rank = spawn(gpu_cases.graph_decode, 2, args=(dp, policy, 4), backend="nccl", timeout_s=300)
    for r in per_rank:
        assert r["equal"] and r["equal_after_new_inputs"], per_rank
