"""MoE finalize handoff: the fused finalize + all-reduce + add + Gemma RMSNorm against NCCL + separate kernels.

A sparse FFN exit that defers its finalize hands the next read its expert outputs ``expert_out
[T, k, H]`` and shared-expert output ``shared_out [T, H]`` (both partial over the TP group) and
the replicated router weights ``topk_weights [T, k]``. Completing it is the top-k combine, the
all-reduce, the residual add and the Gemma RMSNorm (weight offset 1). Methods, all in one run:

- ``fused triton finalize``: the core's Triton kernel, ``plugin_api.symm_mem_launch(...,
  topk_weights=, shared=)`` (what ``MoeFinalizeFusion`` launches), one launch; the peers' rows
  through symmetric memory.
- ``finalize (torch) + nccl + <kernel>``: ``models.moe.moe_finalize`` in torch ops as the
  reference model runs it, NCCL all-reduce, then the fastest separate add + Gemma RMSNorm of this
  shape (every norm-kernel provider and torch.compile, picked as ``bench allreduce`` picks it).
- ``torch.compile finalize + nccl + torch.compile``: torch.compile of ``moe_finalize``, NCCL
  all-reduce, torch.compile of the add + norm: the strongest "NCCL + separate kernels" peer.
- ``nccl all-reduce alone``: the all-reduce of the finalized ``[T, H]`` rows by itself (dashed).

On one GPU (``--world 1``) nothing is summed over ranks: the fused kernel's one-rank path against
the same baselines without the all-reduce; the compiled peer is then combine + add + norm
compiled as one graph (nothing splits it).

Bytes per rank (one figure per shape, what the fused kernel must move, the same for every
method): per token read ``expert_out`` k·H, ``shared_out`` H and the residual H, write the
residual H and the output H, times the element size; with ``world`` > 1 add 2·world·H for the
exchange (each rank's combined row lands in every rank's buffer, so ``world`` rows are written
into each rank's memory and read back from there). The router weights (k per token) are left
out. GB/s is that over the median; ``% copy`` compares it with a device-to-device copy measured
in the same run (``timing.copy_bandwidth``, as ``bench norm``).

``check``: each method's (output, residual) against the unfused torch path (``moe_finalize``,
the all-reduce, ``fused_add_rmsnorm_ref``): the largest |difference| within
``FINALIZE_TOLERANCE``'s atol times max(1, largest |value|), as the fused finalize's tests
compare. Times: median by CUDA-graph replay, the slowest rank's.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from layer_boundary.plugin_api import (FINALIZE_TOLERANCE, NormRequest, fused_add_rmsnorm_ref, make_symm_workspace,
                                       symm_mem_launch)

from . import report
from ..models.moe import moe_finalize
from .allreduce import best_separate, us_panels
from .norm import (
    COPY_BYTES,
    DTYPES,
    EPS,
    NormMethod,
    norm_methods,
    peer_methods,
    providers_for,
    torch_fused_add_rmsnorm,
)
from .timing import (TimingPlan, cuda_unavailable, max_over_group, reported_copy_bandwidth, slowest,
                     this_device, time_call)

__all__ = ["FIN_HIDDEN", "FIN_TOKENS", "Inputs", "bytes_moved", "make_inputs", "reference",
           "finalize_add_norm", "separate_call", "whole_call", "fused_call", "check_close", "finish_shape",
           "finalize_command"]

FIN_HIDDEN = (4096, 7168)
FIN_TOKENS = (1, 4, 16, 64, 128, 256, 512, 1024)
QUICK = ((1, 16, 128, 1024), (4096,))
GEMMA_OFFSET = 1.0
# As MoeFinalizeFusion's default: the buffers a deployed provider would hold.
WORKSPACE_BYTES = 256 << 20

AllReduce = Optional[Callable[[torch.Tensor], Any]]
Call = Callable[[], tuple[torch.Tensor, torch.Tensor]]


def bytes_moved(tokens: int, hidden: int, topk: int, world: int, itemsize: int, *, shared: bool = True) -> int:
    """The byte model of the module docstring, per rank and call."""
    per_token = (topk + int(shared) + 3) * hidden
    if world > 1:
        per_token += 2 * world * hidden
    return tokens * per_token * itemsize


@dataclass
class Inputs:
    expert_out: torch.Tensor  # [T, k, H], this rank's partial
    topk_weights: torch.Tensor  # [T, k], replicated
    shared_out: torch.Tensor  # [T, H], this rank's partial
    residual: torch.Tensor  # [T, H], replicated; methods update their own clones
    gamma: torch.Tensor  # [H], Gemma weight (the norm multiplies by 1 + gamma)


def make_inputs(tokens: int, hidden: int, topk: int, dtype: torch.dtype, device: str, rank: int = 0) -> Inputs:
    """Residual, router weights and norm weight from one seed on every rank (they are replicated
    in a model); expert and shared outputs from a seed of this rank (they are partial sums).
    Weights: a softmax over the k slots, in [0, 1] and summing to 1 per token."""
    g = torch.Generator(device=device).manual_seed(1000 * tokens + hidden)
    residual = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
    weights = torch.softmax(torch.randn(tokens, topk, generator=g, device=device), dim=-1).to(dtype)
    gamma = (0.1 * torch.randn(hidden, generator=g, device=device)).to(dtype)
    g.manual_seed(1000 * tokens + hidden + 7919 * (rank + 1))
    expert = torch.randn(tokens, topk, hidden, generator=g, device=device).to(dtype)
    shared = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
    return Inputs(expert, weights, shared, residual, gamma)


def reference(i: Inputs, allreduce: AllReduce) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, residual')`` of the unfused path in torch ops; ``i.residual`` is left as it is."""
    part = moe_finalize(i.expert_out, i.topk_weights, i.shared_out)
    if allreduce is not None:
        allreduce(part)
    return fused_add_rmsnorm_ref(part, i.residual, i.gamma, EPS, weight_offset=GEMMA_OFFSET)


def finalize_add_norm(expert_out: torch.Tensor, topk_weights: torch.Tensor, shared_out: torch.Tensor,
                      residual: torch.Tensor, gamma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's whole finalize in torch ops, residual in place: what the one-GPU compiled peer
    compiles as a single graph."""
    part = moe_finalize(expert_out, topk_weights, shared_out)
    return torch_fused_add_rmsnorm(part, residual, gamma, EPS, weight_offset=GEMMA_OFFSET)


def separate_call(i: Inputs, combine: Callable[..., torch.Tensor], allreduce: AllReduce, norm: NormMethod) -> Call:
    """Combine, all-reduce, then a separate add + norm, over a residual of its own (in place)."""
    r, y = i.residual.clone(), torch.empty_like(i.residual)

    def call() -> tuple[torch.Tensor, torch.Tensor]:
        part = combine(i.expert_out, i.topk_weights, i.shared_out)
        if allreduce is not None:
            allreduce(part)
        return norm.call(part, r, i.gamma, y)

    return call


def whole_call(i: Inputs, fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Call:
    """``fn`` with :func:`finalize_add_norm`'s signature, over a residual of its own."""
    r = i.residual.clone()
    return lambda: fn(i.expert_out, i.topk_weights, i.shared_out, r, i.gamma)


def fused_call(i: Inputs, ws: Any, launch: Callable[..., None] = symm_mem_launch) -> Call:
    """The core's fused kernel on ``ws`` (a ``make_symm_workspace`` of the group), over a residual
    of its own: ``(output, residual)`` as :func:`finalize_add_norm` returns them."""
    r, y = i.residual.clone(), torch.empty_like(i.residual)

    def call() -> tuple[torch.Tensor, torch.Tensor]:
        launch(ws, i.expert_out, r, i.gamma, y, EPS, GEMMA_OFFSET, topk_weights=i.topk_weights,
               shared=i.shared_out)
        return y, r

    return call


def check_close(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], dtype: torch.dtype) -> tuple[float, bool]:
    """``(max |difference|, within FINALIZE_TOLERANCE)``; a NaN anywhere fails."""
    atol, _ = FINALIZE_TOLERANCE[dtype]
    errs = [(g.float() - w.float()).abs().max().item() for g, w in zip(got, want)]
    err = max(errs, key=lambda e: (e != e, e))  # NaN first: max() alone may skip it
    scale = max(w.float().abs().max().item() for w in want)
    return err, err <= atol * max(1.0, scale)


def finish_shape(rows: list[dict[str, Any]], moved: int, copy_gbps: float) -> None:
    """Fill in one shape's bytes, GB/s, % copy, speedup over its fastest baseline and check text."""
    base = [r["us"] for r in rows if r["kind"] == "baseline" and "us" in r]
    best = min(base) if base else None
    for r in rows:
        r["bytes"] = moved
        if "us" in r:
            r["gbps"] = moved / r["us"] / 1e3
            r["pct_copy"] = 100.0 * r["gbps"] / copy_gbps
            if best is not None:
                r["speedup"] = best / r["us"]
        if "error" in r:
            r["check"] = "error"
        elif "check" not in r:
            r["check"] = {True: "ok", False: "FAIL", None: "-"}[r.get("ok")]


COLUMNS = [
    report.Column("method", "method", width=46),
    report.Column("H", "hidden", "d", 5),
    report.Column("T", "tokens", "d", 5),
    report.Column("µs", "us", report.sig, 8),
    report.Column("x best", "speedup", ".2f", 7),
    report.Column("KiB/rank", "bytes", lambda b: report.sig(b / 1024), 9),
    report.Column("GB/s", "gbps", report.sig, 7),
    report.Column("% copy", "pct_copy", ".1f", 7),
    report.Column("max err", "max_err", ".3g", 8),
    report.Column("check", "check", width=8),
]


@dataclass
class _Rank:
    """What every shape of one rank's run shares."""

    world: int
    rank: int
    device: str
    dtype: torch.dtype
    topk: int
    compile: bool
    plan: TimingPlan
    group: Any  # the torch.distributed handle (None: the default group, of one process)
    agree: Callable[[int], int]
    allreduce: AllReduce


def _measure(run: _Rank, row: dict[str, Any], call: Callable[[], Any],
             want: Optional[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """Check ``call`` once, then time it (the residual drifts over the replays; a sum's time does
    not depend on its values)."""
    try:
        got = call()
        if want is not None:
            row["max_err"], row["ok"] = check_close(got, want, run.dtype)
        m = time_call(call, run.device, run.plan, run.agree)
    except Exception as e:  # one failing method must not end the run
        row["error"] = f"{type(e).__name__}: {e}"
        return row
    row.update(us=slowest(m.median_us, run.group, run.device), min_us=m.min_us, calls=m.calls, replays=m.replays)
    return row


def _shape(run: _Rank, t: int, h: int, norms: list[NormMethod], ws: Any) -> list[dict[str, Any]]:
    i = make_inputs(t, h, run.topk, run.dtype, run.device, run.rank)
    want = reference(i, run.allreduce)
    part = moe_finalize(i.expert_out, i.topk_weights, i.shared_out)
    # peer_methods resets Dynamo (static shapes, one compile each): build it before this shape's
    # other compiled functions. No torch eager: it is written for weight offset 0.
    separate = norms + peer_methods(run.dtype, compile=run.compile, weight_offset=GEMMA_OFFSET)
    best, sep_us = best_separate(separate, part, i.residual, i.gamma, run.plan, run.group, run.device)
    nccl = " + nccl" if run.world > 1 else ""
    todo: list[tuple[dict[str, Any], Callable[[], Any], Any]] = [
        ({"method": f"finalize (torch){nccl} + {best.name}", "kind": "baseline", "separate_us": sep_us},
         separate_call(i, moe_finalize, run.allreduce, best), want)]
    compiled_norm = next((m for m in separate if m.origin == "peer" and m.name == "torch.compile"), None)
    if compiled_norm is not None and run.world > 1:
        combine = torch.compile(moe_finalize, fullgraph=True, dynamic=False)
        todo.append(({"method": "torch.compile finalize + nccl + torch.compile", "kind": "baseline"},
                     separate_call(i, combine, run.allreduce, compiled_norm), want))
    elif compiled_norm is not None:
        whole = torch.compile(finalize_add_norm, fullgraph=True, dynamic=False)
        todo.append(({"method": "torch.compile finalize + add + norm", "kind": "baseline"}, whole_call(i, whole), want))
    if run.allreduce is not None:
        # After the baselines, as in bench allreduce: the first graph holding an NCCL call of a
        # new size pays for warm-up effects.
        x, allreduce = part.clone(), run.allreduce
        todo.append(({"method": "nccl all-reduce alone", "kind": "reference"}, lambda: allreduce(x), None))
    fused = {"method": "fused triton finalize" + (" (symm-mem)" if run.world > 1 else " (1 rank)"), "kind": "fused"}
    rows = [_measure(run, row, call, w) for row, call, w in todo]
    if t > ws.max_tokens:  # the workspace budget holds fewer rows: a deployed provider declines too
        rows.append({**fused, "check": "declined"})
    else:
        rows.append(_measure(run, fused, fused_call(i, ws), want))
    common = {"hidden": h, "tokens": t, "topk": run.topk, "world": run.world,
              "dtype": str(run.dtype).replace("torch.", "")}
    return [{**common, **r} for r in rows]


def _rank(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from layer_boundary import Topology

    say: Callable[[str], None] = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    device = this_device("cuda")
    tp = Topology.from_sizes(tp=world).tp
    group = tp.group
    run = _Rank(world, tp.rank, device, DTYPES[spec["dtype"]], spec["topk"], spec["compile"],
                TimingPlan.for_run(spec["quick"], spec["replays"]), group, max_over_group(group, device),
                (lambda t: dist.all_reduce(t, group=group)) if world > 1 else None)
    copy = reported_copy_bandwidth(device, COPY_BYTES["cuda"][1 if spec["quick"] else 0], run.plan, say, group)
    providers = providers_for(device)
    table = report.Table(COLUMNS, say)
    rows: list[dict[str, Any]] = []
    refusals: list[dict[str, Any]] = []
    # no_grad rather than inference_mode: torch.compile and graph capture see ordinary tensors.
    with torch.no_grad():
        for h in spec["hidden"]:
            request = NormRequest(torch.device(device).type, run.dtype, h, weight_offset=GEMMA_OFFSET)
            norms, refused = norm_methods(providers, request)
            refusals += refused
            for r in refused:
                say(f"  separate kernel {r['method']} ({r['origin']}) refuses {request.describe()}: {r['refused']}")
            ws = make_symm_workspace(tp, h, run.dtype, max(spec["tokens"]), WORKSPACE_BYTES)
            table.header()
            for t in spec["tokens"]:
                mine = _shape(run, t, h, norms, ws)
                finish_shape(mine, bytes_moved(t, h, run.topk, world, run.dtype.itemsize), copy["gbps"])
                for row in mine:
                    table.row(row)
                    if "error" in row:
                        say(f"  {row['method']}: {row['error']}")
                rows += mine
            del ws
            say("")
    return {"rows": rows, "copy": copy, "refused": refusals}


def finalize_command(args: argparse.Namespace) -> int:
    world = args.world or (2 if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else 1)
    why = cuda_unavailable("finalize", world)
    if why:
        print(why, file=sys.stderr)
        return 2
    from ..launch import spawn

    dtype = DTYPES[args.dtype]
    spec = {"tokens": list(args.tokens or (QUICK[0] if args.quick else FIN_TOKENS)),
            "hidden": list(args.hidden or (QUICK[1] if args.quick else FIN_HIDDEN)), "dtype": args.dtype,
            "topk": args.topk, "quick": args.quick, "replays": args.replays, "compile": not args.no_compile}
    env = report.environment("cuda", world)
    plan = TimingPlan.for_run(args.quick, args.replays)
    e = dtype.itemsize
    exchange = f" + 2·{world}·H" if world > 1 else ""
    print(f"layer-boundary bench finalize: MoE finalize (k={args.topk} + shared) "
          f"{'+ all-reduce ' if world > 1 else ''}+ add + Gemma RMSNorm on {world} x {env['gpu']}"
          f"{' (NCCL)' if world > 1 else ''}, {args.dtype}, torch {env['torch']}, triton {env['triton']}, "
          f"{env['date']}\nmedian µs by CUDA-graph replay over {plan.replays} replays, slowest rank; x best: "
          f"speedup over the fastest baseline; bytes per rank = T·((k+4)·H{exchange})·{e}; check against "
          "the unfused torch path within FINALIZE_TOLERANCE\n", flush=True)
    # Generous collective timeout: the first calls JIT-build Triton kernels and Inductor graphs.
    res = spawn(_rank, world, args=(spec,), backend="nccl", timeout_s=1200)[0]
    rows = res["rows"]
    atol, rtol = FINALIZE_TOLERANCE[dtype]
    report.publish(args, "finalize", env, rows,
                   f"MoE finalize{' + all-reduce' if world > 1 else ''} + add + Gemma RMSNorm, k = {args.topk} "
                   f"+ shared, {world} GPU{'s' if world > 1 else ''}, {args.dtype}", us_panels(rows),
                   note="; dashed: NCCL alone" if world > 1 else "", world=world, topk=args.topk, copy=res["copy"],
                   refused=res["refused"], eps=EPS, weight_offset=GEMMA_OFFSET,
                   bytes_per_call=f"T*((k+4)*H{' + 2*world*H' if world > 1 else ''})*{e}",
                   tolerance={"atol": atol, "rtol": rtol, "rule": "max|diff| <= atol * max(1, max|want|)"},
                   timing="CUDA-graph replay, median, slowest rank", replays=plan.replays)
    return report.exit_status(rows, what="result(s)")
