"""Sweep the core Triton add+RMSNorm kernel's warps per row (H200), to choose launch_config.

Times the kernel through the same launch path the provider uses, overriding (BLOCK, num_warps)
in the cache, by CUDA-graph replay (median of 30 replays of 20 calls).
"""
import statistics
import sys

import torch

from layer_boundary._kernels import triton_norm, triton_ops


def time_us(fn, calls=20, replays=30):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / calls)
    return statistics.median(ts)


def main():
    print(torch.cuda.get_device_name(), torch.__version__)
    for h in (4096, 7168, 8192):
        for t in (1, 16, 1024, 8192):
            x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
            r = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
            w = torch.ones(h, device="cuda", dtype=torch.bfloat16)
            row = [f"H={h} T={t}"]
            for warps in (4, 8, 16):
                block = triton_norm.launch_config(h, 2)[0]
                triton_norm._CONFIGS[(h, 2)] = (block, warps)
                us = time_us(lambda: triton_ops.fused_add_rmsnorm_triton(x, r, w, 1e-6))
                row.append(f"w{warps}={us:.2f}")
            triton_norm._CONFIGS.pop((h, 2), None)
            print("  ".join(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())
