"""Every parallel path against the single-rank result, on gloo with 2 and 4 ranks.

One spawn per world size runs a whole matrix of cases, so process groups are created once.
The synthetic linear stack uses dyadic float64 data: sums are exact, so the comparison is
bitwise. The Qwen3 reference runs the same layouts within the float64 tolerance (1e-10: the
norms and attention round differently when sums are regrouped).
"""

from __future__ import annotations

import pytest

from layer_boundary.launch import spawn

import parallel_cases

pytestmark = pytest.mark.slow

LINEAR_2 = [
    dict(dp=1, policy="ar", counts=(5,), layers=2),
    dict(dp=1, policy="rs+rsv", counts=(1,), layers=1),
    dict(dp=1, policy="ar", counts=(0,), layers=2),
    dict(dp=2, policy="ar", counts=(3, 5), layers=2),
    dict(dp=2, policy="rs", counts=(3, 5), layers=3),
    dict(dp=2, policy="rsv", counts=(4, 1), layers=2),
    dict(dp=2, policy="rs+rsv", counts=(0, 3), layers=2),
    dict(dp=2, policy="rs", counts=(0, 0), layers=1),
    dict(dp=2, policy="auto", counts=(2, 2), layers=2),
    dict(dp=1, policy="ar", counts=(5,), layers=2, scattered=True),
    dict(dp=1, policy="ar", counts=(0,), layers=1, scattered=True),
]
LINEAR_4 = [
    dict(dp=1, policy="ar", counts=(6,), layers=2),
    dict(dp=2, policy="ar", counts=(3, 4), layers=2),
    dict(dp=2, policy="rs", counts=(5, 0), layers=2),
    dict(dp=2, policy="rs+rsv", counts=(2, 3), layers=3),  # rsv refused: attention TP 2
    dict(dp=4, policy="rsv", counts=(1, 0, 3, 2), layers=2),
    dict(dp=4, policy="rs", counts=(2, 2, 2, 2), layers=1),
    dict(dp=4, policy="ar", counts=(0, 0, 1, 0), layers=2),
    dict(dp=1, policy="ar", counts=(7,), layers=3, scattered=True),
    dict(dp=2, policy="ar", counts=(3, 6), layers=2, scattered=True),
    dict(dp=2, policy="rs", counts=(0, 1), layers=2, scattered=True),
]


def _expected_collectives(world: int, case: dict) -> dict[str, int]:
    """Each owed sum and each row move exactly once per layer."""
    dp, layers = case["dp"], case["layers"]
    attn_tp = world // dp
    n: dict[str, int] = {}

    def add(k: str, v: int = 1) -> None:
        n[k] = n.get(k, 0) + v * layers

    if case.get("scattered"):
        # Each layer: attention input gathered over attention TP; its partial sum reduce-scattered
        # back to the slice; FFN input gathered over TP; FFN output reduce-scattered to the slice.
        add("all_gather", 2)
        add("reduce_scatter", 2)
        n["all_gather"] += 1  # the final norm's output back to the group's rows
        return n
    if dp == 1:
        add("all_reduce", 2)  # the attention sum at the FFN input, the FFN sum in compute
        return n
    add("all_reduce")  # joined: attention sum + residual add + DP gather in one all-reduce
    ret = case["returns"][0].split("/")[0]
    if ret == "ar":
        add("all_reduce")
    elif ret == "rs":
        add("reduce_scatter")
        if attn_tp > 1:
            add("all_gather")
    else:
        add("all_to_all")
    return n


QWEN_2 = [
    dict(dp=1, policy="ar", sequences=[[1, 5, 9], [4]]),
    dict(dp=2, policy="rs+rsv", sequences=[[1, 5, 9, 2], [4, 8]]),
    dict(dp=2, policy="rs", sequences=[[3, 3, 7]]),  # DP group 1 gets no sequence
    dict(dp=2, policy="ar", sequences=[[1], [2], [3]]),
    dict(dp=1, policy="ar", sequences=[[1, 5, 9], [4, 4]], scattered=True),
]
QWEN_4 = [
    dict(dp=1, policy="ar", sequences=[[1, 5, 9, 11, 30]]),
    dict(dp=2, policy="rs", sequences=[[1, 5, 9], [4, 8, 16, 2]]),
    dict(dp=4, policy="rsv", sequences=[[1, 5], [7], [9, 9, 9]]),
    dict(dp=4, policy="ar", sequences=[[6, 2, 7, 1]], dtype="float32"),
    dict(dp=2, policy="rs", sequences=[[1, 5, 9], [4, 8, 16, 2], [3]], scattered=True),
    dict(dp=1, policy="ar", sequences=[[2, 4, 6, 8, 10, 12, 14]], scattered=True),
]


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def matrix(request):
    world = request.param
    linear, qwen = (LINEAR_2, QWEN_2) if world == 2 else (LINEAR_4, QWEN_4)
    return world, spawn(parallel_cases.matrix, world, args=(linear, qwen), timeout_s=240)


def test_linear_stack_is_bitwise_equal_on_every_path(matrix):
    world, per_rank = matrix
    for rank, results in enumerate(per_rank):
        for r in results["linear"]:
            case = r["case"]
            assert r["equal"], f"rank {rank} {case}: differs from the single-rank stack"
            d = rank // (world // case["dp"])
            assert r["shape"][0] == case["counts"][d]
            case = {**case, "returns": r["returns"]}
            assert r["collectives"] == _expected_collectives(world, case), (rank, case, r["collectives"])


def test_policy_falls_back_and_reports_why(matrix):
    world, per_rank = matrix
    chosen = {(r["case"]["dp"], r["case"]["policy"]): r["returns"] for r in per_rank[0]["linear"]}
    if world == 4:
        assert chosen[(2, "rs+rsv")] == ["rs/ar"]  # RSv refused: attention TP 2
        assert chosen[(4, "rsv")] == ["rsv/ar"]
    else:
        assert chosen[(2, "rs+rsv")] == ["rsv/rs/ar"]
        assert chosen[(1, "rs+rsv")] == ["ar"]  # no DP: both scatters refused, all-reduce


def test_qwen3_on_every_layout(matrix):
    world, per_rank = matrix
    for rank, results in enumerate(per_rank):
        for r in results["qwen3"]:
            tol = 1e-10 if r["case"].get("dtype", "float64") == "float64" else 1e-4
            assert r["max_diff"] <= tol, (rank, r)
