"""``layer-boundary bench mhc``: the plugin's benchmark as a command of the core's ``layer-boundary``
(entry point ``bench.mhc`` of ``layer_boundary.commands``; protocol: ``layer_boundary.plugin_api.Command``).

This module imports argparse only; ``main`` imports the benchmark (``bench``), which times with the
application's bench helpers (``layer_boundary_app.bench``: ``pip install layer-boundary-app``).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

__all__ = ["BENCH_MHC"]


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be at least 1")
    return v


class BenchMhc:
    help = "MHC residual kernels (layer-boundary-mhc): Triton vs the torch reference and the byte roofline"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.description = (
            "The MHC plugin's kernels: the update fused with the next read, the read, and the update alone, "
            "Triton against the plugin's torch reference; µs, GB/s from the byte model (n=4, H=4096, bf16: "
            "80 KiB a token for update+read), % of the copy bandwidth measured in the same run, speedup over "
            "the reference.")
        parser.add_argument("--tokens", type=_positive, nargs="+", metavar="T",
                            help="token counts (default 1 16 128 1024 8192 32768)")
        parser.add_argument("--hidden", type=_positive, nargs="+", metavar="H",
                            help="hidden sizes (default: the full grid)")
        parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                            help="activation dtype (default bfloat16)")
        parser.add_argument("--quick", action="store_true", help="a small grid and fewer replays (a minute or two)")
        parser.add_argument("--replays", type=_positive, default=None, metavar="N",
                            help="timed replays per measurement (default 50, 15 with --quick)")
        parser.add_argument("--out", metavar="DIR", default="benchmarks/results",
                            help="where the dated JSON and SVG go (default benchmarks/results)")
        parser.add_argument("--streams", type=_positive, default=4, metavar="N", help="residual streams n (default 4)")
        parser.add_argument("--ops", nargs="+", choices=("update+read", "read", "update"), default=None,
                            help="which ops (default all three)")
        parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                            help="cuda (CUDA-graph replay) or cpu (wall clock, the torch reference only; for testing)")
        parser.add_argument("--compile", action="store_true",
                            help="also time torch.compile of the torch reference (one compile per op and width)")
        parser.add_argument("--kernels", choices=("auto", "triton"), default="auto",
                            help="auto: the plugin's default choice; triton: time the Triton kernels even where "
                            "auto does not pick them yet (as MhcSemantics(kernels='triton') runs them)")
        parser.add_argument("--tune", nargs="+", metavar="NAME=VALUE",
                            help="MhcKernelConfig fields to try instead of the defaults, e.g. lag=8 "
                            "slice_cols=128,128,128 finish_tokens=4")

    def main(self, args: argparse.Namespace) -> int:
        if importlib.util.find_spec("layer_boundary_app") is None:
            print("layer-boundary bench mhc: it times with the application's bench helpers, and "
                  "layer-boundary-app is not installed; pip install layer-boundary-app (in a checkout: "
                  "pip install -e plugins/app)", file=sys.stderr)
            return 2
        from .bench import mhc_command

        return mhc_command(args)


BENCH_MHC = BenchMhc()
