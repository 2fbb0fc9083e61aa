"""Launch-shape variants of the MHC boundary kernel on one GPU, in one process: for each variant and
T, whether it passes ``accuracy.compare``, the compiled stream pass's registers, spills and shared
memory, and CUDA-graph medians of the stream passes, the finishes, the two launches (and with ``--coop`` the
cooperative launch), with the two launches' share of the byte roofline (``bench mhc``'s model).

A variant is one argument of ``NAME=VALUE`` settings of ``MhcKernelConfig`` fields separated by
spaces (``""`` is the defaults); each makes its config from the defaults.

Run: python benchmarks/sweeps/mhc_variants.py "" "lag=16" "joined_warps=8,8,8" --coop --tokens 8192
(CPU, interpreter: TRITON_INTERPRET=1 ... --device cpu --tokens 16 --hidden 256 "")
"""

from __future__ import annotations

import argparse
import sys

import torch

import mhc_check
from layer_boundary_app.bench.timing import TimingPlan, copy_bandwidth, time_call
from layer_boundary_mhc import MhcKernelConfig, accuracy, bench, triton_ops
from layer_boundary_mhc import triton_mhc as tm

N, BF16 = 4, torch.bfloat16


def _kernel_facts(k) -> str:
    if k is None:
        return "-"
    return f"{k.n_regs} regs, {k.n_spills} spill, {k.metadata.shared // 1024} KiB"


def measure(t: int, hidden: int, copy_gbps: float, device: str, config: MhcKernelConfig, once: bool = False,
            coop: bool = False) -> str:
    i = bench._inputs(t, N, hidden, BF16, device)
    got = triton_ops.mhc_update_read_triton(i.x, i.y, i.h_post, i.h_res, i.params, i.w, bench.EPS, cooperative=False,
                                            config=config)
    devs = accuracy.compare("update+read", got, i.x, y=i.y, h_post=i.h_post, h_res=i.h_res, params=i.params,
                            norm_weight=i.w, norm_eps=bench.EPS)
    ok = all(d.ok for d in devs)
    _, n, c = i.x.shape
    launch, streams, out = mhc_check.launcher(i, config)
    same = ""
    if coop:  # the one launch gives the two launches' bits
        launch(tm.mhc_boundary_kernel, False)()
        want = out.clone(), streams.clone()
        launch(tm.mhc_boundary_kernel, True)()
        same = "same " if torch.equal(out, want[0]) and torch.equal(streams, want[1]) else "DIFF "
    probe = mhc_check.Only(tm.STREAM_PASS)
    launch(probe, False)()
    if once:  # for a profiler: one stream pass (after the compile and check above), no timing
        torch.cuda.synchronize()
        facts = _kernel_facts(probe.compiled)
        return f"T={t:5d} {'ok  ' if ok else 'FAIL'} one stream pass launched [{facts}]"
    plan = TimingPlan(replays=20, max_calls=50)
    us = {name: time_call(fn, device, plan).median_us for name, fn in (
        ("stream", launch(mhc_check.Only(tm.STREAM_PASS), False)),
        ("finish", launch(mhc_check.Only(tm.FINISH), False)),
        ("two", launch(tm.mhc_boundary_kernel, False)),
        *((("coop", launch(tm.mhc_boundary_kernel, True)),) if coop else ()))}
    roof = bench.bytes_moved("update+read", t, n, c, 2) / (copy_gbps * 1e3)
    return (f"T={t:5d} {'ok  ' if ok else 'FAIL'} stream {us['stream']:7.1f}  finish {us['finish']:6.1f}  "
            f"two {us['two']:7.1f} ({100 * roof / us['two']:4.1f} % roofline)  "
            + (f"coop {us['coop']:7.1f} {same} " if coop else "")
            + f"[{_kernel_facts(probe.compiled)}]")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help='"NAME=VALUE NAME=VALUE" of MhcKernelConfig fields; "" = defaults')
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--coop", action="store_true", help="also time the cooperative launch (one more compile)")
    ap.add_argument("--once", action="store_true", help="launch each stream pass once, untimed (under ncu)")
    args = ap.parse_args(argv)
    copy = copy_bandwidth(args.device, 1 << (30 if args.device == "cuda" else 22))["gbps"]
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"{name}, torch {torch.__version__}, n={N}, H={args.hidden}, bf16; "
          f"copy {copy:.0f} GB/s")
    with torch.no_grad():
        for v in args.variants:
            config, applied = mhc_check.apply_settings(v.split())
            print(f"variant {applied or 'defaults'}", flush=True)
            for t in args.tokens:
                try:
                    print("  " + measure(t, args.hidden, copy, args.device, config, args.once, args.coop), flush=True)
                except Exception as e:  # one variant that does not compile must not end the sweep
                    print(f"  T={t}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
