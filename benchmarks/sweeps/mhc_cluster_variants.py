"""Variants of the MHC cluster kernels (``layer_boundary_mhc.cluster_ops``, CuTe DSL) on one GPU: for
each variant and T, whether update+read passes ``accuracy.compare``, and its CUDA-graph median with
its share of the byte roofline (``bench mhc``'s model, over the copy bandwidth of the same run),
beside the Triton kernels' two launches.

A variant is ``"cluster=16 cluster_block_tokens=32 cluster_warps=8 cluster_ctas=2"`` (fields of
``MhcKernelConfig``; ``""`` the defaults). Run:
python benchmarks/sweeps/mhc_cluster_variants.py "" "split_tokens=0 persistent_tokens=1" --tokens 1024 8192

The profiled variants (``--phases``: phase stamps and section clocks through a ``PROFILE`` tensor)
were deleted with the other forms measured and not kept (PERFORMANCE.md, "What stays, and why");
they are in git before that change. ncu (``--once``) profiles the kernels as they are.
"""

from __future__ import annotations

import argparse
import sys

import torch

from layer_boundary_app.bench.timing import TimingPlan, copy_bandwidth, time_call, time_eager
from layer_boundary_mhc import MhcKernelConfig, accuracy, bench, cluster_ops, triton_ops

N = 4


def _time(fn) -> float:
    return time_call(fn, "cuda", TimingPlan(replays=20, max_calls=50)).median_us


def measure(t: int, hidden: int, copy_gbps: float, triton_too: bool, config: MhcKernelConfig,
            eager_too: bool = False) -> str:
    i = bench._inputs(t, N, hidden, torch.bfloat16, "cuda")
    shape = cluster_ops._variant(t, N, hidden, True, 20, config)
    persistent = shape.persistent
    got = triton_ops.mhc_update_read_cluster(i.x, i.y, i.h_post, i.h_res, i.params, i.w, bench.EPS,
                                              config=config)
    devs = accuracy.compare("update+read", got, i.x, y=i.y, h_post=i.h_post, h_res=i.h_res, params=i.params,
                            norm_weight=i.w, norm_eps=bench.EPS)
    ok = all(d.ok for d in devs)
    outs = [torch.empty_like(g) for g in got]
    us = _time(lambda: triton_ops.mhc_update_read_cluster(i.x, i.y, i.h_post, i.h_res, i.params, i.w, bench.EPS,
                                                           streams_out=outs[0], out=outs[1], h_post_out=outs[2],
                                                           h_res_out=outs[3], config=config))
    roof = bench.bytes_moved("update+read", t, N, hidden, 2) / (copy_gbps * 1e3)
    eager = ""
    if eager_too:  # launched back to back without a graph: what a graph replay changes
        ea = time_eager(lambda: triton_ops.mhc_update_read_cluster(
            i.x, i.y, i.h_post, i.h_res, i.params, i.w, bench.EPS, streams_out=outs[0], out=outs[1],
            h_post_out=outs[2], h_res_out=outs[3], config=config), "cuda", TimingPlan(replays=20, max_calls=50)).median_us
        eager = f" eager {ea:7.1f}"
    line = (f"T={t:5d} {'ok  ' if ok else 'FAIL'} cluster {us:7.1f} ({100 * roof / us:4.1f} %){eager}  "
            f"[{'split ' if shape.split else 'persistent ' if persistent else ''}CL={shape.cl} BT={shape.bt} warps={shape.warps} "
            f"ctas={shape.ctas} stages={shape.stages} smem={shape.smem // 1024} KiB]")
    if triton_too:
        two = _time(lambda: triton_ops.mhc_update_read_triton(i.x, i.y, i.h_post, i.h_res, i.params, i.w, bench.EPS,
                                                              streams_out=outs[0], out=outs[1], h_post_out=outs[2],
                                                              h_res_out=outs[3], cooperative=False))
        line += f"  triton 2-launch {two:7.1f} ({100 * roof / two:4.1f} %)"
    if not ok:
        line += "  " + "; ".join(str(d) for d in devs if not d.ok)
    return line


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help='"NAME=VALUE ..." of MhcKernelConfig fields; "" = defaults')
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096])
    ap.add_argument("--once", action="store_true", help="one call of each variant and T, untimed (under ncu)")
    ap.add_argument("--eager", action="store_true", help="also time eager back-to-back launches")
    args = ap.parse_args(argv)
    copy = 0.0 if args.once else copy_bandwidth("cuda", 1 << 30)["gbps"]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, n={N}, bf16; copy {copy:.0f} GB/s")
    with torch.no_grad():
        for v in args.variants:
            try:
                config, _ = bench._apply_tuning(v.split())
            except ValueError as e:
                raise SystemExit(str(e).replace("--tune ", ""))
            print(f"variant {v or 'defaults'}", flush=True)
            for h in args.hidden:
                for t in args.tokens:
                    try:
                        if args.once:
                            i = bench._inputs(t, N, h, torch.bfloat16, "cuda")
                            triton_ops.mhc_update_read_cluster(i.x, i.y, i.h_post, i.h_res, i.params, i.w, bench.EPS,
                                                                config=config)
                            torch.cuda.synchronize()
                            continue
                        print(f"  H={h} " + measure(t, h, copy, not v, config, args.eager), flush=True)
                    except Exception as e:  # one variant that does not compile must not end the sweep
                        print(f"  H={h} T={t}: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
