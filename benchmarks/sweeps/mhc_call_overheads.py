"""What an MHC split-variant call costs besides its kernel (H200 figures:
``benchmarks/results/2026-11-30-h200-session12/call-overheads.log``): the whole call, a memset of
its ready counts alone (what the kept counts save), and ``finish.sinkhorn_kernel`` alone (the
cluster kernel's Sinkhorn launch from ``sinkhorn_after_tokens``) for tokens a program x warps, at
T = 8192 and 32768 (n = 4, H = 4096, CUDA-graph medians). The split variant runs its Sinkhorn in
its producers since 42d9095; the session-12 log measured it launched after the kernel.
Run on a GPU with the CuTe DSL: python benchmarks/sweeps/mhc_call_overheads.py
"""

from __future__ import annotations

import torch
import triton

from layer_boundary_app.bench.timing import TimingPlan, time_call
from layer_boundary_mhc import MhcKernelConfig, bench, triton_ops
from layer_boundary_mhc.finish import sinkhorn_kernel


def _time(fn) -> float:
    return time_call(fn, "cuda", TimingPlan(replays=20, max_calls=50)).median_us


def main() -> None:
    config = MhcKernelConfig(split_tokens=512)
    for t in (8192, 32768):
        i = bench._inputs(t, 4, 4096, torch.bfloat16, "cuda")
        outs = [torch.empty_like(g) for g in
                triton_ops.mhc_update_read_cluster(i.x, i.y, i.h_post, i.h_res, i.params, i.w, bench.EPS,
                                                    config=config)]

        def call(i=i, outs=outs):
            return triton_ops.mhc_update_read_cluster(i.x, i.y, i.h_post, i.h_res, i.params, i.w, bench.EPS,
                                                       streams_out=outs[0], out=outs[1], h_post_out=outs[2],
                                                       h_res_out=outs[3], config=config)

        whole = _time(call)
        h = torch.randn(t, 4, 4, device="cuda")
        alone = {}
        for tb in (8, 16, 32, 64, 128):
            for w in (1, 2, 4):
                alone[(tb, w)] = _time(lambda tb=tb, w=w: sinkhorn_kernel[(triton.cdiv(t, tb),)](
                    h, t, N=4, NP=4, TB=tb, ITERS=20, num_warps=w))
        zeros = _time(lambda: torch.zeros(t // 16, dtype=torch.int32, device="cuda"))
        print(f"T={t}: split call {whole:.1f} µs; zeros alone "
              f"{zeros:.1f}; sinkhorn alone (TB, warps): " + ", ".join(f"{k}: {v:.1f}" for k, v in alone.items()),
              flush=True)


if __name__ == "__main__":
    with torch.no_grad():
        main()
