"""All-reduce + add + RMSNorm on 2 (4, 8) GPUs: fused consumer candidates against NCCL + a separate kernel.

Each rank holds a partial sum ``c [T, H]`` and the replicated residual ``r``. The baseline is what
the boundary does without fusion: NCCL all-reduce of ``c``, then the fastest separate add+RMSNorm
of this run (every norm-kernel provider and torch.compile, timed on their own first; the slowest
rank's time decides). Each fused candidate that a TP=2 stage accepted at construction is called
directly, ``cand(c, r, read, forward_batch)``, as the boundary calls it.

Bus bandwidth follows nccl-tests: ``busbw = S * 2(n-1)/n / t`` for ``S = T * H * element_size``
bytes on ``n`` ranks, compared with the nominal NVLink bandwidth of an H200, 450 GB/s per
direction (a stated peak, not a measured one). Times are the slowest rank's median.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

import torch

from . import report
from .candidates import accepted_candidates, describe_candidates, two_stage_plan
from .norm import DTYPES, NormMethod, norm_methods, peer_methods
from .timing import TimingPlan, cuda_unavailable, max_over_group, slowest, this_device, time_call

__all__ = ["AR_HIDDEN", "AR_TOKENS", "NVLINK_GBPS", "allreduce_command", "best_separate", "bus_bandwidth",
           "us_panels"]

AR_HIDDEN = (4096, 7168)
AR_TOKENS = tuple(2**i for i in range(14))  # 1, 2, 4, ..., 8192
QUICK = ((1, 16, 128, 1024, 8192), (4096,))
NVLINK_GBPS = 450.0  # H200 NVLink 4, nominal, per direction
WORLD = 2


def bus_bandwidth(tokens: int, hidden: int, element_size: int, us: float, world: int = WORLD) -> float:
    """nccl-tests' all-reduce bus bandwidth in GB/s."""
    return tokens * hidden * element_size * 2 * (world - 1) / world / us / 1e3


COLUMNS = [
    report.Column("method", "method", width=34),
    report.Column("H", "hidden", "d", 6),
    report.Column("T", "tokens", "d", 6),
    report.Column("µs", "us", report.sig, 9),
    report.Column("speedup", "speedup", ".2f", 8),
    report.Column("busbw GB/s", "busbw", report.sig, 11),
    report.Column("% nominal", "pct_nominal", ".1f", 10),
    report.Column("check", "check", width=6),
]



def _check(got: Any, want: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, bool]:
    from layer_boundary.plugin_api import DEFAULT_TOLERANCE

    atol, rtol = DEFAULT_TOLERANCE[want[0].dtype]
    err = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))
    ok = all(torch.allclose(g.float(), w.float(), atol=atol, rtol=rtol) for g, w in zip(got, want))
    return err, ok


def best_separate(methods: list[NormMethod], c0: torch.Tensor, r0: torch.Tensor, w: torch.Tensor,
                  plan: TimingPlan, group: Any, device: str) -> tuple[NormMethod, dict[str, float]]:
    """Time each separate add+RMSNorm on this rank (no collective); every rank then picks the
    same fastest method by the slowest rank's time."""
    times: dict[str, float] = {}
    for m in methods:
        x, r, y = c0.clone(), r0.clone(), torch.empty_like(c0)
        try:
            us = time_call(lambda: m.call(x, r, w, y), device, plan).median_us
        except Exception:
            us = float("inf")
        times[m.name] = slowest(us, group, device)
    best = min(methods, key=lambda m: times[m.name])
    return best, times


def _rank(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from layer_boundary import ForwardBatch
    from layer_boundary.plugin_api import fused_add_rmsnorm_ref, NormRequest
    from layer_boundary import BoundaryContext, Topology

    say: Callable[[str], None] = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    # cuda (NCCL) for the benchmark; cpu (gloo) only exercises the harness.
    device = this_device(spec.get("device", "cuda"))
    dtype = DTYPES[spec["dtype"]]
    es = torch.empty((), dtype=dtype).element_size()
    plan = TimingPlan.for_run(spec["quick"], spec["replays"])
    topo = Topology.from_sizes(tp=world)
    group = topo.tp.group
    agree = max_over_group(group, device)
    table = report.Table(COLUMNS, say)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    # no_grad rather than inference_mode: the stages' norm parameters are built in here, and
    # torch.compile and graph capture see ordinary tensors.
    with torch.no_grad():
        for h in spec["hidden"]:
            ctx = BoundaryContext.discover(topo, device=device)
            attn, ffn = two_stage_plan(ctx, h, dtype, device)
            cands = accepted_candidates((ffn, attn))
            note = f"H={h}: " + describe_candidates(cands, ctx)
            notes.append(note)
            say(note)
            methods, refused = norm_methods(ctx.norm_candidates(), NormRequest(torch.device(device).type, dtype, h))
            for refusal in refused:
                say(f"  separate kernel {refusal['method']} ({refusal['origin']}) refuses: {refusal['refused']}")
            read = ffn.plan.read
            table.header()
            for t in spec["tokens"]:
                g = torch.Generator(device=device).manual_seed(1000 * t + h)
                r0 = torch.randn(t, h, generator=g, device=device).to(dtype)  # replicated
                g.manual_seed(1000 * t + h + 7919 * (rank + 1))
                c0 = torch.randn(t, h, generator=g, device=device).to(dtype)  # this rank's part
                total = c0.clone()
                dist.all_reduce(total, group=group)
                base_row = {"hidden": h, "tokens": t, "dtype": spec["dtype"]}

                def finish(row: dict[str, Any], us: float) -> dict[str, Any]:
                    row.update(us=us, busbw=bus_bandwidth(t, h, es, us, world))
                    row["pct_nominal"] = 100.0 * row["busbw"] / NVLINK_GBPS
                    rows.append(row)
                    return row

                separate = methods + [p for p in peer_methods(dtype, compile=spec["compile"])
                                      if p.name != "torch eager"]
                best, sep_times = best_separate(separate, c0, r0, read.weight, plan, group, device)
                x, r, y = c0.clone(), r0.clone(), torch.empty_like(c0)

                def unfused() -> Any:
                    dist.all_reduce(x, group=group)
                    return best.call(x, r, read.weight, y)

                err, ok = _check(unfused(), fused_add_rmsnorm_ref(total, r0, read.weight, read.eps))
                m = time_call(unfused, device, plan, agree)
                base_us = slowest(m.median_us, group, device)
                baseline = finish({**base_row, "method": f"nccl + {best.name}", "kind": "baseline",
                                   "separate_us": sep_times, "max_err": err, "ok": ok}, base_us)
                # Timed after the baseline: the first graph holding an NCCL call of a new size
                # paid for warm-up effects that made "alone" slower than "all-reduce + norm".
                x = c0.clone()
                m = time_call(lambda: dist.all_reduce(x, group=group), device, plan, agree)
                alone = finish({**base_row, "method": "nccl all-reduce alone", "kind": "reference"},
                               slowest(m.median_us, group, device))
                for row in (alone, baseline):
                    row["speedup"] = base_us / row["us"]
                    row["check"] = {True: "ok", False: "FAIL", None: "-"}[row.get("ok")]
                    table.row(row)

                fb = ForwardBatch(num_tokens=t)
                for ac in cands:
                    row = {**base_row, "method": ac.name, "kind": "fused", "stage": ac.stage}
                    x, r = c0.clone(), r0.clone()
                    got = ac.candidate(x, r, ac.read, fb)
                    if got is None:
                        row.update(check="declined")
                        rows.append(row)
                        table.row(row)
                        continue
                    row["max_err"], row["ok"] = _check(
                        got, fused_add_rmsnorm_ref(total, r0, ac.read.weight, ac.read.eps))
                    # The candidate may reduce c in place: its values grow over the replays,
                    # which changes nothing in the time of a sum.
                    m = time_call(lambda: ac.candidate(x, r, ac.read, fb), device, plan, agree)
                    row = finish(row, slowest(m.median_us, group, device))
                    row["speedup"] = base_us / row["us"]
                    row["check"] = "ok" if row["ok"] else "FAIL"
                    table.row(row)
                del r0, c0, total, x
            say("")
    return {"rows": rows, "notes": notes}


def us_panels(rows: list[dict[str, Any]]) -> list[report.Panel]:
    panels = []
    for h in sorted({r["hidden"] for r in rows}):
        mine = [r for r in rows if r["hidden"] == h and "us" in r]
        kinds = {r["method"]: r["kind"] for r in mine}
        series = tuple(report.Series(n, tuple((r["tokens"], r["us"]) for r in mine if r["method"] == n),
                                     dashed=kinds[n] == "reference")
                       for n in dict.fromkeys(r["method"] for r in mine))
        panels.append(report.Panel(f"H = {h}", "tokens", "µs (median)", series))
    return panels


def allreduce_command(args: argparse.Namespace) -> int:
    world = getattr(args, "world", None) or WORLD
    why = cuda_unavailable("allreduce", world)
    if why:
        print(why, file=sys.stderr)
        return 2
    from ..launch import spawn

    tokens = args.tokens or (QUICK[0] if args.quick else AR_TOKENS)
    hidden = args.hidden or (QUICK[1] if args.quick else AR_HIDDEN)
    spec = {"tokens": list(tokens), "hidden": list(hidden), "dtype": args.dtype, "quick": args.quick,
            "replays": args.replays, "compile": not args.no_compile}
    env = report.environment("cuda", world)
    plan = TimingPlan.for_run(args.quick, args.replays)
    print(f"layer-boundary bench allreduce: all-reduce + add + RMSNorm on {world} x {env['gpu']} (NCCL), "
          f"{args.dtype}, torch {env['torch']}, {env['date']}\nmedian µs by CUDA-graph replay over "
          f"{plan.replays} replays, slowest rank; speedup against NCCL + the best separate add+RMSNorm; "
          f"busbw = T·H·{torch.empty((), dtype=DTYPES[args.dtype]).element_size()}·2(n-1)/n / t against "
          f"{NVLINK_GBPS:.0f} GB/s, the NOMINAL NVLink bandwidth per direction of an H200\n", flush=True)
    # Generous collective timeout: a candidate's first call may JIT-build its kernels (minutes)
    # while the other rank waits in a collective.
    per_rank = spawn(_rank, world, args=(spec,), backend="nccl", timeout_s=1200)
    rows, notes = per_rank[0]["rows"], per_rank[0]["notes"]
    report.publish(args, "allreduce", env, rows, f"all-reduce + add + RMSNorm, {world} GPUs, {args.dtype}",
                   us_panels(rows), world=world, notes=notes, nominal_nvlink_gbps=NVLINK_GBPS,
                   busbw="T*H*element_size*2(n-1)/n/t (nccl-tests)",
                   timing="CUDA-graph replay, median, slowest rank", replays=plan.replays)
    failed = [r for r in rows if r.get("ok") is False]
    if failed:
        print(f"{len(failed)} result(s) differ from the reference beyond the bf16 tolerance: "
              + "; ".join(f"{r['method']} T={r['tokens']} H={r['hidden']} (max err {r['max_err']:.3g})"
                          for r in failed))
        return 1
    return 0
