"""Every parallel path against the single-rank result, on gloo with 2, 4 and 8 ranks (8: the
layouts of the 4- and 8-GPU issue, TP=8, TP=4 x DP=2, TP=2 x DP=4 and PP=2 x TP=4, on CPU).

One spawn per world size runs a whole matrix of cases, so process groups are created once.
The synthetic linear stack uses dyadic float64 data: sums are exact, so the comparison is
bitwise. The Qwen3 reference runs the same layouts within the float64 tolerance (1e-10: the
norms and attention round differently when sums are regrouped).
"""

from __future__ import annotations

import pytest

from layer_boundary_app.launch import spawn

import parallel_cases
from parallel_cases import MATRICES

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module", params=[2, 4, 8], ids=["2ranks", "4ranks", "8ranks"])
def matrix(request):
    world = request.param
    return world, spawn(parallel_cases.matrix, world, args=MATRICES[world], timeout_s=300)


def test_linear_stack_is_bitwise_equal_on_every_path(matrix):
    world, per_rank = matrix
    for rank, results in enumerate(per_rank):
        for r in results["linear"]:
            case = r["case"]
            assert r["equal"], f"rank {rank} {case}: differs from the single-rank stack"
            d = rank // (world // case["dp"])
            assert r["shape"][0] == case["counts"][d]
            want = parallel_cases.expected_collectives(world, case["dp"], case["layers"], r["returns"],
                                                       scattered=case.get("scattered", False))
            assert r["collectives"] == want, (rank, case, r["returns"], r["collectives"])


def test_policy_falls_back_and_reports_why(matrix):
    world, per_rank = matrix
    chosen = {(r["case"]["dp"], r["case"]["policy"]): r["returns"] for r in per_rank[0]["linear"]}
    if world == 4:
        assert chosen[(2, "rs+rsv")] == ["rs/ar"]  # RSv refused: attention TP 2
        assert chosen[(4, "rsv")] == ["rsv/ar"]
    elif world == 8:
        assert chosen[(2, "rs+rsv")] == ["rs/ar"]  # RSv refused: attention TP 4
        assert chosen[(4, "rsv")] == ["ar"]  # RSv refused: attention TP 2, and nothing else allowed
    else:
        assert chosen[(2, "rs+rsv")] == ["rsv/rs/ar"]
        assert chosen[(1, "rs+rsv")] == ["ar"]  # no DP: both scatters refused, all-reduce


def test_local_tail_never_defers_and_honours_the_flags(matrix):
    """A LOCAL_TAIL FFN (its compute adds a replicated component after its sum) is bitwise equal
    to one rank on every path (checked with the others above); here: the flags its compute saw.
    Its exit is offered a provider that always asks to defer, and must never publish
    ``fuse_mlp_allreduce``; it publishes ``mlp_reduce_scatter`` exactly where the output returns by
    a reduce-scatter (``rs``/``rsv`` under DP, every input-scattered batch)."""
    world, per_rank = matrix
    seen = 0
    for rank, results in enumerate(per_rank):
        for r in results["linear"]:
            case = r["case"]
            if not case.get("tail"):
                assert r["tail_flags"] == []
                continue
            seen += 1
            ret = r["returns"][0].split("/")[0]
            scatter = case.get("scattered", False) or (case["dp"] > 1 and ret in ("rs", "rsv"))
            assert r["tail_flags"] == [(False, scatter)] * case["layers"], (rank, case, r["returns"])
    assert seen >= 5 * world


def test_qwen3_on_every_layout(matrix):
    world, per_rank = matrix
    for rank, results in enumerate(per_rank):
        for r in results["qwen3"]:
            tol = 1e-10 if r["case"].get("dtype", "float64") == "float64" else 1e-4
            assert r["max_diff"] <= tol, (rank, r)


def test_dp_ffn_input_read_order(matrix):
    """Under attention DP a plain add joins the attention sum and the gather in one all-reduce;
    a residual whose read must run before the gather (MHC) reads on the local rows and gathers
    the normalized input. The plan says which, and the forward ran exactly that, once per layer."""
    world, per_rank = matrix
    mhc_seen = 0
    for rank, results in enumerate(per_rank):
        for r in results["qwen3"]:
            case, n = r["case"], r["layers"]
            if case["dp"] == 1 or case.get("scattered"):
                assert r["dp_moves"] == {"gather": 0, "joined_sum": 0}, (rank, case)
                continue
            if case.get("residual") == "mhc":
                mhc_seen += 1
                assert r["dp_gather"] == ["read_first"] * n, (rank, case)
                assert r["dp_moves"] == {"gather": n, "joined_sum": 0}, (rank, case)
            else:
                assert r["dp_gather"] == ["join"] * n, (rank, case)
                assert r["dp_moves"] == {"gather": 0, "joined_sum": n}, (rank, case)
    assert mhc_seen >= world


def test_pipeline_qwen3_matches_single_rank(matrix):
    """tp x pp layouts: the logits come from the last stage and equal the single-rank model;
    each stage holds its own layers, and only the model's last layer is terminal."""
    world, per_rank = matrix
    seen = 0
    for rank, results in enumerate(per_rank):
        for r in results["pipeline"]:
            case = r["case"]
            if case["kind"] != "qwen3":
                continue
            pp, tp = case["pp"], world // case["pp"]
            assert r["pp_rank"] == rank // tp and r["pp_ranks"] == tuple(range(rank % tp, world, tp))
            layers = 4  # small_random_config
            per = layers // pp
            start = r["pp_rank"] * per
            assert r["layers"] == list(range(start, layers if r["pp_rank"] == pp - 1 else start + per))
            assert r["terminal"] == [i == layers - 1 for i in r["layers"]]
            if r["pp_rank"] == pp - 1:
                seen += 1
                assert r["rows"] > 0 or case.get("dp", 1) > 1
                assert r["max_diff"] <= 1e-10, (rank, r)
            else:
                assert r["rows"] == 0
    assert seen >= 1


def test_pipeline_static_partial_sum_crosses_once(matrix):
    """A PARTIAL attention ends the sender's partition: to_pp() sends its partial sum unreduced
    (the metadata says an attention-TP sum is owed) and the receiver completes it exactly once.
    Bitwise equal to one rank; all-reduces per rank: sender 2 (A0's sum, F0's sum), receiver 4
    (A2's partial, F3, A4, F5). A dynamically deferred FFN sum is completed by to_pp() instead."""
    world, per_rank = matrix
    if world != 4:
        pytest.skip("the synthetic pipeline cases run on 4 ranks (tp=2, pp=2)")
    seen = set()
    for rank, results in enumerate(per_rank):
        for r in results["pipeline"]:
            case = r["case"]
            if case["kind"] != "linear":
                continue
            defer = case.get("defer", False)
            if r["pp_rank"] == 0:
                assert r["released"]
                # [state pending, one static sum over ATTN_TP (code 0) of 2 ranks] / nothing owed
                assert r["sent_meta"] == ([2, 0] if defer else [2, 1, 0, 2]), (rank, r)
                assert r["all_reduce"] == 2, (rank, r)
                if defer:
                    assert r["deferred_asks"] >= 1
            else:
                assert r["equal"], (rank, r)
                assert r["received_meta"] == ([2, 0] if defer else [2, 1, 0, 2])
                assert r["all_reduce"] == 4, (rank, r)
                # previous= contradicts what arrived: refused, never a double or missing sum.
                assert len(r["errors"]) == 1 and "BoundaryError" in r["errors"][0], r["errors"]
                want = "a complete output" if defer else "a partial sum over ATTN_TP"
                assert want in r["errors"][0] and "previous=" in r["errors"][0], r["errors"]
            seen.add((r["pp_rank"], defer))
    assert seen == {(0, False), (1, False), (0, True), (1, True)}


def test_disagreeing_dp_counts_are_named_when_checked(monkeypatch):
    # Ranks that disagree about another group's row count failed inside gloo's gather with a size
    # mismatch; the opt-in check names both ranks' counts on every rank before the collective.
    from layer_boundary._rows import ENV_CHECK_DP_COUNTS

    monkeypatch.setenv(ENV_CHECK_DP_COUNTS, "1")
    texts = spawn(parallel_cases.disagreeing_dp_counts, 2, timeout_s=120)
    assert all("dp_num_tokens disagrees across the TP group" in t for t in texts), texts
    assert "rank 0 has (2, 3), rank 1 has (2, 4)" in texts[0]
    assert "rank 1 has (2, 4), rank 0 has (2, 3)" in texts[1]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["ordinary", "sequence-parallel"])
def test_tp_ranks_given_different_batches_are_named_when_checked(monkeypatch, sequence_parallel):
    from layer_boundary._rows import ENV_CHECK_DP_COUNTS

    monkeypatch.setenv(ENV_CHECK_DP_COUNTS, "1")
    texts = spawn(parallel_cases.disagreeing_tp_batches, 2, args=(sequence_parallel,), timeout_s=120)
    assert texts[0].startswith("ForwardBatch.num_tokens disagrees across the TP group: rank 0 has 6, rank 1 has 4; "
                               "without attention DP every rank of a TP group runs the same batch"), texts
    assert "rank 1 has 4, rank 0 has 6" in texts[1]
