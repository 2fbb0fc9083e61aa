"""Is the add+RMSNorm gap to FlashInfer at T=1024 (H=7168/8192) about L2 residency?

At T=1024 a call's rows (x, r, y: about 15-17 MiB each) fit in the H200's L2, and bench norm
replays one call on the same buffers, so each call finds the previous call's lines in L2. This
times every norm method of bench norm two ways, by CUDA-graph replay of 16 calls: "hot", all 16
on one buffer set (as bench norm), and "cold", each call on the next of 16 buffer sets (16 x 50
MiB, several times the L2), so every call streams from HBM as a forward step's boundary does.
"""
import statistics
import sys

import torch

from layer_boundary_app.bench.norm import _inputs, norm_methods, peer_methods, providers_for
from layer_boundary._providers import NormRequest

SETS = 16


def replay_us(calls, replays=30):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls[:3]:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / len(calls))
    return statistics.median(ts)


def main():
    dtype = torch.bfloat16
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; µs per call, hot (one buffer set) "
          f"vs cold ({SETS} rotating sets)")
    providers = providers_for("cuda")
    for h in (4096, 7168, 8192):
        for t in (1024, 8192):
            methods, _ = norm_methods(providers, NormRequest("cuda", dtype, h))
            methods += [m for m in peer_methods(dtype, compile=True) if "eager" not in m.name]
            x0, r0, w, _, _ = _inputs(t, h, dtype, "cuda")
            sets = [(x0.clone(), r0.clone(), torch.empty_like(x0)) for _ in range(SETS)]
            for m in methods:
                try:
                    hot = replay_us([lambda m=m, s=sets[0]: m.call(s[0], s[1], w, s[2])] * SETS)
                    cold = replay_us([lambda m=m, s=s: m.call(s[0], s[1], w, s[2]) for s in sets])
                except Exception as e:  # a method that cannot run this shape
                    print(f"H={h} T={t} {m.name}: {type(e).__name__}: {e}")
                    continue
                moved = 4 * h * 2 * t
                print(f"H={h:5d} T={t:5d} {m.name:22s} hot {hot:8.2f} ({moved / hot / 1e3:5.0f} GB/s)  "
                      f"cold {cold:8.2f} ({moved / cold / 1e3:5.0f} GB/s)")
            del sets
            torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
