"""Parallel paths on GPUs with NCCL, and boundaries inside CUDA-graph capture.

The float64 linear stack must match the single-rank stack bit for bit (NCCL sums float64 exactly
for dyadic data). Qwen3 in bfloat16 is compared with the single-GPU model relative to the largest
|logit|: 0.03, the bf16 bound measured against transformers (test_qwen3_transformers.BF16_REL).
"""

from __future__ import annotations

import pytest
import torch

from layer_boundary.launch import spawn

import gpu_cases
from parallel_cases import expected_collectives
from test_parallel import LINEAR_2

pytestmark = pytest.mark.gpu

QWEN_NCCL = [
    dict(dp=1, policy="ar", sequences=[[1, 5, 9, 2, 77], [4]], dtype="bfloat16"),
    dict(dp=2, policy="rs", sequences=[[1, 5, 9, 4], [4, 8]], dtype="bfloat16"),
    dict(dp=2, policy="rsv", sequences=[[3, 3, 7]], dtype="bfloat16"),
    dict(dp=2, policy="ar", sequences=[[1], [2], [3]], dtype="bfloat16"),
    dict(dp=2, policy="rs+rsv", sequences=[[6, 2, 7, 1, 9, 9, 4]], dtype="float32"),
    dict(dp=1, policy="ar", sequences=[[1, 5, 9, 2, 77], [4]], dtype="bfloat16", scattered=True),
]


def _two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs; {torch.cuda.device_count()} visible")


def test_nccl_matrix_matches_one_gpu():
    _two_gpus()
    per_rank = spawn(gpu_cases.nccl_matrix, 2, args=(LINEAR_2, QWEN_NCCL), backend="nccl", timeout_s=300)
    for rank, res in enumerate(per_rank):
        for r in res["linear"]:
            assert r["equal"], (rank, r)
            case = r["case"]
            want = expected_collectives(2, case["dp"], case["layers"], r["returns"],
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
