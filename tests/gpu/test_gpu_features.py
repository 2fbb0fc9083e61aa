"""The features on 2 GPUs with NCCL against the single-GPU model (tests/support/gpu_feature_cases.py).

MoE (Qwen3-MoE reference, tensor-parallel experts; tp2 and attention tp1 x dp2, with and without
``defer_moe_finalize``), two-batch overlap, branches (LongCat-style), a CP=2 prefill, sequence
parallel, and capture / snapshot / add_to_output: bfloat16 within 0.03 and float32 within 1e-5 of
max |logit| (``gpu_feature_cases.REL``, the bounds of tests/gpu/test_gpu_parallel.py), one spawn for
the whole matrix. benchmarks/gpu_feature_matrix.py runs the same matrix and writes the dated record.

The GPU tests carry the ``gpu`` mark one by one rather than through ``pytestmark``: the same
module holds the gloo run of the same case functions on CPU ranks, which CI runs (it takes about
15 s on 2 cores), so the code paths the GPU run takes are proven where no GPU is.
"""

from __future__ import annotations

import pytest
import torch

from layer_boundary_app.launch import spawn

import gpu_feature_cases
from gpu_feature_cases import CASES, feature_matrix, verdicts

FEATURES = ("moe", "tbo", "branch", "cp", "sp", "capture")


def _failures(rows: list[dict]) -> list[tuple[str, list[str]]]:
    return [(r["case"], r["problems"]) for r in rows if not r["pass"]]


@pytest.fixture(scope="module")
def nccl_rows():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs; {torch.cuda.device_count()} visible")
    return verdicts(CASES, spawn(feature_matrix, 2, args=(CASES, "cuda"), backend="nccl", timeout_s=300))


@pytest.mark.gpu
@pytest.mark.parametrize("feature", FEATURES)
def test_feature_on_two_gpus_matches_one_gpu(nccl_rows, feature):
    rows = [r for r in nccl_rows if r["feature"] == feature]
    assert rows, feature
    assert _failures(rows) == [], rows


@pytest.mark.slow
def test_the_matrix_runs_on_gloo_cpu_ranks():
    """Every case, with the device a parameter: what the GPU run executes, on CPU ranks."""
    rows = verdicts(CASES, spawn(feature_matrix, 2, args=(CASES, "cpu"), backend="gloo", timeout_s=240))
    assert _failures(rows) == [], rows
    assert [r["case"] for r in rows] == [c["name"] for c in CASES]


def test_the_matrix_covers_every_feature_and_layout():
    """A guard on the matrix itself: each feature in bf16, MoE on both layouts with and without
    the handoff, and a float32 case."""
    defaults = {"dtype": "bfloat16", "dp": 1, "defer": False}

    def named(feature, **kw):
        return [c["name"] for c in CASES
                if c["feature"] == feature and all(c.get(k, defaults[k]) == v for k, v in kw.items())]

    for feature in FEATURES:
        assert named(feature, dtype="bfloat16"), feature
    for dp in (1, 2):
        for defer in (False, True):
            assert named("moe", dp=dp, defer=defer, dtype="bfloat16"), (dp, defer)
    assert any(named(feature, dtype="float32") for feature in FEATURES)
    assert len({c["name"] for c in CASES}) == len(CASES)
    with pytest.raises(ValueError, match="unknown feature case"):
        gpu_feature_cases.select(["moe/tp2", "moe/tp3"])


def _result(**kw):
    base = {"tokens": [0, 1], "total_tokens": 2, "max_diff": 0.01, "scale": 10.0, "tol": 0.3,
            "handoffs": {"made": 0, "completed": 0}, "moes": 3, "collectives": {"all_reduce": 4}}
    return {**base, **kw}


def test_verdicts_fail_what_they_should():
    """Each check can fail: tolerance (NaN too), token coverage, handoffs, the path's moves,
    capture's missing values and fused-run count."""
    moe = {"name": "m", "feature": "moe", "defer": True}
    ok = verdicts([moe], [[_result(handoffs={"made": 3, "completed": 3})]] * 2)[0]
    assert ok["pass"] and ok["tolerance"] == 0.3, ok

    def problems(case, *per_rank):
        return verdicts([case], [[r] for r in per_rank])[0]["problems"]

    done = {"made": 3, "completed": 3}
    assert problems(moe, _result(handoffs=done), _result(handoffs=done, max_diff=0.5)) == [
        "rank 1: max diff 0.5 > tolerance 0.3"]
    assert "nan" in problems(moe, _result(handoffs=done, max_diff=float("nan")), _result(handoffs=done))[0]
    assert problems(moe, _result(handoffs=done, tokens=[0]), _result(handoffs=done, tokens=[])) == [
        "tokens covered [0]"]
    assert problems(moe, _result(handoffs={"made": 3, "completed": 2}), _result(handoffs=done)) == [
        "rank 0: handoffs made 3, completed 2, want 3"]
    # Under attention DP deferral is refused: a handoff there is a failure.
    assert problems({**moe, "dp": 2}, _result(handoffs=done), _result()) == [
        "rank 0: handoffs made 3, completed 3, want 0"]
    assert "the sp path did not run" in problems({"name": "s", "feature": "sp"}, _result(), _result())[0]
    cap = {"name": "c", "feature": "capture", "provider": "fused", "layers": 4, "capture_every": 2}
    good = {"max_diff": 0.0, "scale": 1.0, "tol": 1e-5, "missing": [], "released": True,
            "captured": ["cap0"], "runs": 6}
    assert problems(cap, good, good) == []
    assert problems(cap, {**good, "missing": ["snapA1"]}, {**good, "runs": 4}) == [
        "rank 0: missing ['snapA1'], released True", "rank 1: 4 fused runs, want 6"]


def test_a_case_that_raises_is_recorded_and_fails():
    """The matrix goes on past a case that raises (here before any collective: --cp 3 does not
    divide tp 2); its row carries the error."""
    bad = {"name": "bad", "feature": "cp", "cp": 3}
    (got,) = feature_matrix(0, 2, [bad], "cpu")
    assert got["error"].startswith("ValueError: --cp 3 must divide"), got
    row = verdicts([bad], [[got], [got]])[0]
    assert not row["pass"] and row["problems"][0].startswith("rank 0: ValueError: --cp 3"), row
    assert row["detail"]["traceback"], row
