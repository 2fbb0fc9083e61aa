"""The feature matrix on 2 ranks against the single-device model, on any device and backend.

Each case runs one feature on a parallel layout and compares every rank's output with the same
model on one device, same dtype: MoE (the Qwen3-MoE reference, tensor-parallel experts),
two-batch overlap, branches (the LongCat-style reference), a context-parallel prefill, sequence
parallel, and capture / snapshot / add_to_output (``capture_cases``' stack). ``feature_matrix``
takes the device, so the same functions run on NCCL with GPUs (tests/gpu/test_gpu_features.py,
benchmarks/gpu_feature_matrix.py) and on gloo with CPU ranks (in CI, about 10 s for the whole
matrix): CI runs the code paths the GPU run takes. ``verdicts`` turns the ranks' results into one
row per case with its tolerance and pass/fail, for the tests and the dated record alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import traceback
from typing import Any, Iterator

import torch

from layer_boundary_app.cli.run import CHECK_REL

import capture_cases
from moe_cases import count_handoffs
from parallel_cases import H, count_collectives, topology

__all__ = ["CASES", "REL", "feature_matrix", "verdicts", "select"]

# Relative to max(1, max |reference|): the table of `layer-boundary run --check`, which
# tests/gpu/test_gpu_parallel.py applies on NCCL too. bf16: the bound measured against transformers
# (test_qwen3_transformers.BF16_REL); float32: regrouped sums round a few ulps of the largest logit.
REL = CHECK_REL

# In bf16 the router's top-k can flip on a near-tie when the regrouped sums round differently
# (a discontinuity, not an error; see test_moe_parallel's 4-rank bf16 case). Every token routed
# to all 8 experts keeps the comparison continuous; the float32 cases keep top-2 routing.
ALL_EXPERTS = {"num_experts_per_tok": 8}
# Four sequences: two per DP group, so two-batch overlap has a split on every rank.
SEQS = [[1, 5, 9, 300, 2], [4, 77], [8, 3, 3, 61], [7, 12, 40]]

CASES: list[dict[str, Any]] = [
    dict(name="moe/tp2", feature="moe", moe=True, config=ALL_EXPERTS),
    dict(name="moe/tp2/defer", feature="moe", moe=True, defer=True, config=ALL_EXPERTS),
    dict(name="moe/dp2", feature="moe", moe=True, dp=2, policy="rs", config=ALL_EXPERTS),
    # Under attention DP the boundary refuses deferral: compute finalizes, no handoff.
    dict(name="moe/dp2/defer", feature="moe", moe=True, dp=2, policy="ar", defer=True, config=ALL_EXPERTS),
    dict(name="moe/tp2/defer/top2", feature="moe", moe=True, defer=True, dtype="float32"),
    dict(name="moe/dp2/top2", feature="moe", moe=True, dp=2, policy="rs+rsv", dtype="float32"),
    dict(name="tbo/moe/tp2", feature="tbo", moe=True, tbo=True, config=ALL_EXPERTS),
    dict(name="tbo/moe/dp2", feature="tbo", moe=True, tbo=True, dp=2, policy="rs", config=ALL_EXPERTS),
    dict(name="tbo/dense/dp2", feature="tbo", tbo=True, dp=2, policy="rsv"),
    dict(name="branch/longcat/tp2", feature="branch", longcat=True, config=ALL_EXPERTS),
    dict(name="branch/longcat/tp2/defer", feature="branch", longcat=True, defer=True, config=ALL_EXPERTS),
    dict(name="branch/longcat/dp2", feature="branch", longcat=True, dp=2, policy="rs", config=ALL_EXPERTS),
    dict(name="cp/dense", feature="cp", cp=2),
    dict(name="cp/moe", feature="cp", cp=2, moe=True, config=ALL_EXPERTS),
    dict(name="cp/dense/fp32", feature="cp", cp=2, dtype="float32"),
    dict(name="sp/dense", feature="sp", sp=True),
    dict(name="sp/moe/tbo", feature="sp", sp=True, moe=True, tbo=True, config=ALL_EXPERTS),
    # capture_cases' stack: capture_output / captured_last_layer_outputs at prepare, snapshot()
    # of a static and a deferred sum, capture_output() on a copy and on the main output,
    # add_to_output() of deepstack extras, complete_output(), fold() + written(), norm(capture).
    dict(name="capture/tp2/defer", feature="capture", counts=(5,), layers=3, deepstack=2, provider="defer"),
    dict(name="capture/dp2/rs", feature="capture", dp=2, policy="rs", counts=(3, 5), layers=3, deepstack=2),
    dict(name="capture/scattered", feature="capture", counts=(5,), layers=3, deepstack=2, scattered=True),
    # The consumer candidate that completes the sum and updates the residual in place (as the
    # NCCL all-reduce + add + norm kernels do): captures must not see the in-place update.
    dict(name="capture/tp2/fused/fp32", feature="capture", counts=(4,), layers=4, provider="fused",
         ops="snapshot", capture_every=2, dtype="float32"),
]


def select(names: Any) -> list[dict[str, Any]]:
    """The cases named, in matrix order; an unknown name is an error, not an empty run."""
    known = {c["name"] for c in CASES}
    unknown = sorted(set(names) - known)
    if unknown:
        raise ValueError(f"unknown feature case(s) {unknown}; known: {sorted(known)}")
    return [c for c in CASES if c["name"] in set(names)]


def _dtype(case: dict[str, Any]) -> str:
    return case.get("dtype", "bfloat16")


def layout(case: dict[str, Any], world: int = 2) -> str:
    if case.get("cp"):
        return f"tp{world} cp{case['cp']}"
    if case.get("sp"):
        return f"tp{world} sequence-parallel"
    dp = case.get("dp", 1)
    where = f"attn tp{world // dp} x dp{dp}, {case.get('policy', 'ar')}" if dp > 1 else f"tp{world}"
    return where + (", input-scattered" if case.get("scattered") else "")


# -- the reference decoders ------------------------------------------------------------------------


def _spec(world: int, case: dict[str, Any], device: str) -> Any:
    from layer_boundary_app.models.runner import RunSpec

    return RunSpec(sequences=tuple(tuple(s) for s in case.get("sequences", SEQS)), tp=world,
                   dp=case.get("dp", 1), cp=case.get("cp", 1), reduction=case.get("policy", "ar"),
                   dtype=_dtype(case), device=device, plugins=False, moe=case.get("moe", False),
                   longcat=case.get("longcat", False), tbo=case.get("tbo", False),
                   defer_moe_finalize=case.get("defer", False),
                   config_overrides=dict(case.get("config", {})))


_SINGLE: dict[str, torch.Tensor] = {}


def _single(spec: Any) -> torch.Tensor:
    """The single-device model: unsplit, undeferred (the model as written), once per model."""
    from layer_boundary_app.models.runner import single_rank_logits

    one = dataclasses.replace(spec, tp=1, dp=1, cp=1, reduction="auto", tbo=False, defer_moe_finalize=False)
    key = repr(one)
    if key not in _SINGLE:
        _SINGLE[key] = single_rank_logits(one).float()
    return _SINGLE[key]


def _sequence_parallel(model: Any, spec: Any, device: str) -> tuple[list[int], torch.Tensor]:
    """Every token on every rank, the residual sharded over TP rows between stages
    (``rank_forward`` has no sequence-parallel batch; cp_cases.qwen3_sp builds it on the CPU)."""
    from layer_boundary_app.models.runner import _batch, tbo_split

    ids, fb = _batch(spec.sequences, device, None)
    fb.sequence_parallel = True
    if spec.tbo:  # two microbatches, each re-sliced over TP
        fb.tbo_split = tbo_split(spec, 0)
    with torch.inference_mode():
        logits = model(ids, fb.positions, fb)
    return list(range(ids.shape[0])), logits.float().cpu()


def moe_layers(model: Any, spec: Any) -> int:
    """How many MoE blocks the model has: one finalize handoff each where deferral is allowed."""
    layers = model.model.layers
    return sum(layer.is_sparse for layer in layers) if spec.moe else len(layers) if spec.longcat else 0


def reference_case(world: int, case: dict[str, Any], device: str) -> dict[str, Any]:
    from layer_boundary_app.models.runner import build_model, rank_forward

    spec = _spec(world, case, device)
    model = build_model(spec, topology(world, spec.dp, 1, spec.cp), device)
    with count_collectives() as moves, count_handoffs() as handoffs:
        if case.get("sp"):
            idx, logits = _sequence_parallel(model, spec, device)
        else:
            idx, logits, _ = rank_forward(model, spec, device)
    want = _single(spec)[idx]
    scale = want.abs().max().item() if idx else 0.0
    return {"tokens": idx, "max_diff": (logits.float() - want).abs().max().item() if idx else 0.0,
            "scale": scale, "tol": REL[spec.dtype] * max(1.0, scale), "handoffs": handoffs,
            "moes": moe_layers(model, spec),
            "collectives": dict(moves), "total_tokens": sum(len(s) for s in spec.sequences)}


# -- capture ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def _capture_stack_on(device: str, dtype: torch.dtype) -> Iterator[None]:
    """``capture_cases.capture_forward`` builds its stack in float64 on the CPU. Wrapping its
    three constructors so that what they build moves to ``device`` and ``dtype`` gives the same
    stack there (the same dyadic values, rounded once to ``dtype``) and reuses its forward as is."""
    saved = {name: getattr(capture_cases, name) for name in ("dyadic", "CapLayer", "RMSNorm")}
    capture_cases.dyadic = lambda shape, seed: saved["dyadic"](shape, seed).to(device, dtype)
    capture_cases.CapLayer = lambda *a, **k: saved["CapLayer"](*a, **k).to(device, dtype)
    capture_cases.RMSNorm = lambda *a, **k: saved["RMSNorm"](*a, **k).to(device, dtype)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(capture_cases, name, value)


def capture_case(world: int, case: dict[str, Any], device: str) -> dict[str, Any]:
    """Every value the stack captured on this rank against the single-device run's rows; the
    worst key by relative difference is reported."""
    from layer_boundary import Topology
    from layer_boundary_app.models.runner import DTYPES

    dtype, counts = DTYPES[_dtype(case)], tuple(case["counts"])
    with _capture_stack_on(device, dtype):
        x_all = capture_cases.dyadic((sum(counts), H), 11)
        got = capture_cases.capture_forward(topology(world, case.get("dp", 1)), case, x_all, counts)
        want = capture_cases.capture_forward(Topology.single(), case, x_all, (sum(counts),), reference=True)
    lo, hi = got["rows"]
    worst = {"max_diff": 0.0, "scale": 0.0, "tol": REL[_dtype(case)], "key": None, "rel": -1.0}
    for key, value in got["values"].items():
        ref = want["values"][key][lo:hi].float()
        diff = (value.float() - ref).abs().max().item() if ref.numel() else 0.0
        scale = ref.abs().max().item() if ref.numel() else 0.0
        rel = diff / max(1.0, scale)
        if not rel <= worst["rel"]:  # NaN wins too
            worst = {"max_diff": diff, "scale": scale, "tol": REL[_dtype(case)] * max(1.0, scale),
                     "key": key, "rel": rel}
    first, last = got["layers"]
    missing = sorted(k for k in want["values"]
                     if k not in got["values"] and capture_cases._expected(k, first, last, case))
    return {**worst, "captured": sorted(got["values"]), "missing": missing, "released": got["released"],
            "runs": got["runs"]}


def feature_matrix(rank: int, world: int, cases: list[dict[str, Any]], device: str) -> list[dict[str, Any]]:
    """Every case on this rank (process groups shared through ``parallel_cases.topology``).

    A case that raises is recorded with its traceback's tail and the matrix goes on: device time
    is scarce, and a path that fails on one backend (the same code on every rank, so every rank
    raises alike) should not blank the record of the others."""
    out = []
    for case in cases:
        run = capture_case if case["feature"] == "capture" else reference_case
        try:
            out.append(run(world, case, device))
        except Exception as e:  # noqa: BLE001 - recorded, and fails the case in verdicts()
            tail = traceback.format_exc().strip().splitlines()[-6:]
            out.append({"error": f"{type(e).__name__}: {e}", "traceback": tail, "max_diff": math.nan,
                        "scale": 0.0, "tol": REL[_dtype(case)]})
    return out


# -- verdicts --------------------------------------------------------------------------------------


def _problems(case: dict[str, Any], results: list[dict[str, Any]]) -> list[str]:
    """Why a case fails beyond the tolerance: coverage, handoffs, captures, fused runs."""
    out = []
    if case["feature"] == "capture":
        for rank, r in enumerate(results):
            if r["missing"] or not r["released"] or not r["captured"]:
                out.append(f"rank {rank}: missing {r['missing']}, released {r['released']}")
        if case.get("provider") == "fused":
            # Every FFN input fuses its attention sum; an attention input after layer 0 fuses the
            # deferred FFN sum unless it captures (test_capture_parallel's count).
            n, every = case["layers"], case["capture_every"]
            want = n + sum(1 for i in range(1, n) if i % every)
            out += [f"rank {rank}: {r['runs']} fused runs, want {want}"
                    for rank, r in enumerate(results) if r["runs"] != want]
        return out
    # A rank without rows would compare nothing: together the ranks must cover every token.
    covered = sorted({t for r in results for t in r["tokens"]})
    if covered != list(range(results[0]["total_tokens"])):
        out.append(f"tokens covered {covered}")
    if case["feature"] in ("cp", "sp"):
        # Their row moves reduce-scatter; an ordinary TP forward would never.
        out += [f"rank {rank}: no reduce-scatter ({r['collectives']}): the {case['feature']} path did not run"
                for rank, r in enumerate(results) if not r["collectives"].get("reduce_scatter")]
    allowed = case.get("defer") and case.get("dp", 1) == 1
    for rank, r in enumerate(results):
        made, done = r["handoffs"]["made"], r["handoffs"]["completed"]
        want = r["moes"] if allowed else 0
        if (made, done) != (want, want):
            out.append(f"rank {rank}: handoffs made {made}, completed {done}, want {want}")
    return out


def _ratio(r: dict[str, Any]) -> float:
    """Difference over tolerance (the tolerance is never 0: REL x max(1, scale)); NaN (also a
    case that raised) is worst."""
    return float("inf") if math.isnan(r["max_diff"]) else r["max_diff"] / r["tol"]


def verdicts(cases: list[dict[str, Any]], per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per case: the worst rank's max |difference|, its tolerance, and pass/fail."""
    rows = []
    for i, case in enumerate(cases):
        results = [r[i] for r in per_rank]
        worst = max(range(len(results)), key=lambda k: _ratio(results[k]))
        w = results[worst]
        problems = [f"rank {k}: {r['error']}" for k, r in enumerate(results) if "error" in r]
        if not problems:
            problems = [f"rank {k}: max diff {r['max_diff']:.3g} > tolerance {r['tol']:.3g}"
                        for k, r in enumerate(results) if not r["max_diff"] <= r["tol"]]
            problems += _problems(case, results)
        rows.append({"case": case["name"], "feature": case["feature"], "layout": layout(case, len(per_rank)),
                     "dtype": _dtype(case), "max_diff": w["max_diff"], "scale": w["scale"],
                     "tolerance": w["tol"], "rel_tolerance": REL[_dtype(case)], "worst_rank": worst,
                     "pass": not problems, "problems": problems,
                     "detail": {k: v for k, v in w.items() if k in ("handoffs", "collectives", "key", "runs", "traceback")}})
    return rows
