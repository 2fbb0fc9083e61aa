"""The MHC Triton kernels against the torch reference and an FP64 computation, on a GPU (H200).

Why the first H200 run's check failed at T >= 128 (2026-11-30: max |diff| 0.016 and 0.031): one
bf16 ulp of stream values in [2, 4) and [4, 8). This prints, for ``bench mhc``'s inputs (n = 4,
H = 4096, bf16) and each T:

- ``same``: the cooperative launch equals the two-launch one and itself over repeats (a race or a
  wrong index at multi-block grids would break this: the two launches need no ordering);
- ``check``: ``layer_boundary_mhc.accuracy.compare``, each output's worst |diff| / allowed;
- ``end to end``: the old check's figures: kernel against the reference run on its own streams,
  the streams that round differently and how far the coefficients of the tokens holding them and
  of the other tokens lie from the reference's;
- ``fp64``: kernel and reference against an FP64 computation from the same rounded streams
  (streams not correctly rounded, the input's worst error in ulps, the coefficients' worst
  absolute error): the kernel should be as close to FP64 as the reference, or closer;
- ``time`` (with ``--time``): CUDA-graph medians of the cooperative launch, the two launches, the
  stream passes alone, the finishes alone and the update kernel alone, each with its own bytes
  (x' re-read by the finishes counted) and its share of the copy bandwidth: which phase is slow.

``--set NAME=VALUE ...`` makes the kernel config (``MhcKernelConfig`` fields, as ``bench mhc --tune``
takes them) every call runs with; the check then covers that variant.

Run: python benchmarks/sweeps/mhc_check.py [--tokens T ...] [--hidden H] [--set NAME=VALUE ...]
(default 1 128 8192, 4096)
(on CPU under the interpreter, slowly: TRITON_INTERPRET=1 ... --device cpu --tokens 16 --hidden 256)
"""

from __future__ import annotations

import argparse
import sys

import torch

from layer_boundary_app.bench.timing import TimingPlan, copy_bandwidth, time_call
from layer_boundary_mhc import MhcKernelConfig, accuracy, bench, reference, triton_ops
from layer_boundary_mhc import triton_mhc as tm

N, BF16 = 4, torch.bfloat16


def correctly_rounded(v: torch.Tensor) -> torch.Tensor:
    """FP64 -> bf16 to nearest (through FP32 a value can round twice): the nearest of the FP32
    route's result and its two bf16 neighbours."""
    c = v.float().to(BF16)
    best = c
    for step in (1, -1):
        n = c.clone()
        n.view(torch.int16).add_(step)
        best = torch.where((n.double() - v).abs() < (best.double() - v).abs(), n, best)
    return best


def ulps(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|got - exact| in bf16 ulps of ``exact``."""
    _, e = torch.frexp(exact)
    return (got.double() - exact).abs() / torch.ldexp(torch.ones_like(exact), e - 8)


def fp64_read(streams: torch.Tensor, i: bench.Inputs) -> tuple[torch.Tensor, ...]:
    """The read in FP64 of rounded ``streams``: (input before rounding, H_post, H_res)."""
    mixed, hp, hr = reference.mhc_combine_ref(streams.double(), i.params.double())
    var = mixed.square().mean(-1, keepdim=True)
    return mixed * torch.rsqrt(var + bench.EPS) * i.w.double(), hp, hr


def run(t: int, hidden: int, device: str, config: MhcKernelConfig) -> bool:
    i = bench._inputs(t, N, hidden, BF16, device)
    call = lambda coop: triton_ops.mhc_update_read_triton(  # noqa: E731
        i.x, i.y, i.h_post, i.h_res, i.params, i.w, bench.EPS, cooperative=coop, config=config)
    got = call(True)
    same = all(torch.equal(a, b) for a, b in zip(got, call(False)))
    same &= all(all(torch.equal(a, b) for a, b in zip(got, call(True))) for _ in range(5))
    devs = accuracy.compare("update+read", got, i.x, y=i.y, h_post=i.h_post, h_res=i.h_res, params=i.params,
                            norm_weight=i.w, norm_eps=bench.EPS)
    print(f"T={t}: cooperative == two launches == repeats: {same}")
    print("  check: " + ", ".join(f"{d.output} {d.worst:.3f}" for d in devs) + ("  ok" if all(d.ok for d in devs)
                                                                                   else "  FAIL"))
    for d in devs:
        if not d.ok:
            print(f"    {d}")

    want = reference.mhc_update_read_ref(i.x, i.y, i.h_post, i.h_res, i.params, i.w, bench.EPS)
    flip = got[0] != want[0]
    tok = flip.flatten(1).any(1)
    print(f"  end to end: max |diff| streams {(got[0].float() - want[0].float()).abs().max():.4g} "
          f"input {(got[1].float() - want[1].float()).abs().max():.4g}; {int(flip.sum())} stream elements of "
          f"{flip.numel()} round differently, in {int(tok.sum())} of {t} tokens")
    for name, g, w in (("h_post", got[2], want[2]), ("h_res", got[3], want[3])):
        d = (g - w).abs().flatten(1).amax(1)
        parts = [f"{lab} {d[m].max():.3g}" for lab, m in (("those tokens", tok), ("others", ~tok)) if m.any()]
        print(f"    {name} max |diff|: " + ", ".join(parts))

    exact = reference.mhc_update_ref(i.x.double(), i.y.double(), i.h_post.double(), i.h_res.double())
    rounded = correctly_rounded(exact)
    for name, out in (("kernel", got), ("reference", want)):
        inp, hp, hr = fp64_read(out[0], i)
        off = int((out[1] != correctly_rounded(inp)).sum())
        print(f"  fp64 {name:9}: streams not correctly rounded {int((out[0] != rounded).sum())}; input worst "
              f"{ulps(out[1], inp).max():.3f} ulp, not correctly rounded {off}; "
              f"H_post {(out[2].double() - hp).abs().max():.3g}, H_res {(out[3].double() - hr).abs().max():.3g}")
    return same and all(d.ok for d in devs)


class Only:
    """Stands in for the boundary kernel in ``triton_ops._launch_boundary``: launches one MODE and
    keeps what it compiled (``compiled``: registers, spills, shared memory on a GPU)."""

    def __init__(self, mode: int) -> None:
        self.mode, self.compiled = mode, None

    def __getitem__(self, grid):
        def launch(*args, **meta):
            if meta["MODE"] == self.mode:
                self.compiled = tm.mhc_boundary_kernel[grid](*args, **meta)
        return launch


def launcher(i: bench.Inputs, config: MhcKernelConfig):
    """``launch(kernel, coop)``: a call of ``triton_ops._launch_boundary`` with ``kernel`` (or a
    stand-in) on the update+read of ``i`` under ``config``, into destinations made once."""
    t, n, c = i.x.shape
    streams, out = torch.empty_like(i.x), i.x.new_empty((t, c))
    hp, hr = torch.empty_like(i.h_post), torch.empty_like(i.h_res)
    params = triton_ops._param_tensors(i.params, i.x, config)

    def launch(kernel, coop: bool):
        return lambda: triton_ops._launch_boundary(kernel, i.x, i.y, i.h_post, i.h_res, streams, *params, i.w, out,
                                                   hp, hr, i.params.eps, bench.EPS, 0.0, 20, coop, config)
    return launch, streams, out


def phases(i: bench.Inputs, copy_gbps: float, config: MhcKernelConfig) -> None:
    t, n, c = i.x.shape
    e = i.x.element_size()
    launch, streams, _ = launcher(i, config)
    rows = [("cooperative", launch(tm.mhc_boundary_kernel, True), bench.bytes_moved("update+read", t, n, c, e)),
            ("two launches", launch(tm.mhc_boundary_kernel, False),
             bench.bytes_moved("update+read", t, n, c, e) + t * n * c * e),
            ("stream passes", launch(Only(tm.STREAM_PASS), False), bench.bytes_moved("update", t, n, c, e)),
            ("finishes", launch(Only(tm.FINISH), False), t * (n + 1) * c * e),
            ("update kernel", lambda: triton_ops.mhc_update_triton(i.x, i.y, i.h_post, i.h_res, out=streams),
             bench.bytes_moved("update", t, n, c, e))]
    for name, fn, nbytes in rows:
        us = time_call(fn, i.x.device.type, TimingPlan(replays=20, max_calls=50)).median_us
        gbps = nbytes / us / 1e3
        print(f"  time {name:13}: {us:8.1f} µs  {gbps:7.0f} GB/s  {100 * gbps / copy_gbps:5.1f} % of copy")


def apply_settings(settings: list[str]) -> tuple[MhcKernelConfig, dict[str, object]]:
    """The config ``NAME=VALUE`` settings of ``MhcKernelConfig`` fields make from the default (an
    integer, or integers by comma for the per-bucket fields), and the settings."""
    try:
        return bench._apply_tuning(settings)
    except ValueError as e:
        raise SystemExit(str(e).replace("--tune", "--set"))



def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 128, 8192])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--time", action="store_true", help="also time the phases")
    ap.add_argument("--set", nargs="+", default=[], metavar="NAME=VALUE", help="MhcKernelConfig fields")
    args = ap.parse_args(argv)
    config, applied = apply_settings(args.set)
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"{name}, torch {torch.__version__}, n={N}, H={args.hidden}, bf16, bench mhc's inputs"
          + (f"; set {applied}" if applied else ""))
    with torch.no_grad():
        ok = [run(t, args.hidden, args.device, config) for t in args.tokens]
        if args.time:
            copy = copy_bandwidth(args.device, 1 << (30 if args.device == "cuda" else 22))["gbps"]
            print(f"copy bandwidth {copy:.0f} GB/s")
            for t in args.tokens:
                print(f"T={t}: {tm.boundary_config(t, N, args.hidden, 2, bf16=True, config=config)}")
                phases(bench._inputs(t, N, args.hidden, BF16, args.device), copy, config)
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
