"""``layer-boundary bench ...``: the benchmark commands, entry points of ``layer_boundary.commands``
(``bench`` and ``bench.<name>``; protocol: :class:`layer_boundary.plugin_api.Command`). This module imports
argparse only; each ``main`` imports its benchmark's module when it runs.
"""

from __future__ import annotations

import argparse

from ..cli.args import bounded, grid_options, positive, usable_cpus

__all__ = ["BENCH", "HOST", "NORM", "ALLREDUCE", "FINALIZE", "DECODE"]


class BenchGroup:
    help = "benchmarks"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.description = "Benchmarks; each prints a table."

    def main(self, args: argparse.Namespace) -> int:  # a group: the core CLI runs one of its children
        raise AssertionError(args)


class HostBench:
    help = "host time per boundary and decoder forward time with and without boundaries (CPU)"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--tokens", type=positive, nargs="+", default=[1, 8, 32],
                            help="batch sizes (decode-sized)")
        parser.add_argument("--iters", type=positive, default=2000, help="timed calls per boundary measurement")
        parser.add_argument("--forward-iters", type=positive, default=200, help="timed decoder forwards per measurement")
        parser.add_argument("--hidden", type=positive, nargs="+", default=[64, 1024],
                            help="decoder hidden sizes for the forward comparison (8 layers each)")
        cpus = usable_cpus()
        # Far more threads than CPUs crashed torch (a segfault at 100000), and past the CPU count the
        # figures measure contention, not the boundaries.
        parser.add_argument("--threads", type=bounded(1, cpus, f"must be 1 to {cpus} (the CPUs this process may use)"),
                            default=1, help=f"torch intra-op threads, 1 to {cpus} (default 1)")
        parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")

    def main(self, args: argparse.Namespace) -> int:
        from .host import host_command

        return host_command(args)


class NormBench:
    help = "fused add+RMSNorm: every norm-kernel provider vs torch.compile and torch eager"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.description = (
            "Fused add+RMSNorm (residual updated in place) for every norm-kernel provider that serves the "
            "request here, against torch.compile of the torch reference and torch eager; µs, GB/s "
            "(4·H·element-size bytes per token) and % of the copy bandwidth measured in the same run.")
        grid_options(parser, tokens_help="token counts (default 1 16 128 1024 8192 32768)")
        parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                            help="cuda (CUDA-graph replay) or cpu (wall clock; for testing the harness)")
        parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile peer")

    def main(self, args: argparse.Namespace) -> int:
        from .norm import norm_command

        return norm_command(args)


class AllreduceBench:
    help = "all-reduce + add + RMSNorm: fused consumer candidates vs NCCL + separate kernel"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.description = (
            "On 2 (4, 8) GPUs: each fused consumer candidate a TP stage of that size accepts, against NCCL "
            "all-reduce followed by the best separate add+RMSNorm kernel of the same run; µs, speedup and bus "
            "bandwidth against the nominal NVLink bandwidth.")
        grid_options(parser, tokens_help="token counts (default 1 2 4 ... 8192)")
        parser.add_argument("--world", type=int, choices=(2, 4, 8), default=2,
                            help="GPUs (TP ranks) of one host (default 2)")
        parser.add_argument("--no-compile", action="store_true",
                            help="leave torch.compile out of the separate-kernel choice")

    def main(self, args: argparse.Namespace) -> int:
        from .allreduce import allreduce_command

        return allreduce_command(args)


class FinalizeBench:
    help = ("MoE finalize handoff: the fused finalize + all-reduce + add + Gemma RMSNorm vs NCCL + "
            "separate kernels")

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.description = (
            "The core's fused MoE finalize kernel (top-k combine + shared expert + all-reduce over symmetric "
            "memory + residual add + Gemma RMSNorm, one launch) against moe_finalize in torch ops + NCCL + the "
            "best separate add+norm kernel, and against torch.compile'd finalize + NCCL + torch.compile'd "
            "add+norm; µs, speedup over the best baseline, bytes per rank, % of the copy bandwidth measured in "
            "the same run, and a check against the unfused path. --world 1 runs the one-GPU path (no all-reduce).")
        grid_options(parser, tokens_help="token counts (default 1 4 16 64 128 256 512 1024)")
        parser.add_argument("--world", type=int, choices=(1, 2), default=None,
                            help="GPUs (ranks): 2 sums over NCCL / symmetric memory, 1 has no all-reduce "
                            "(default 2 when 2 GPUs are visible, else 1)")
        parser.add_argument("--topk", type=positive, default=8, metavar="K", help="experts per token (default 8)")
        parser.add_argument("--no-compile", action="store_true",
                            help="leave torch.compile out (the compiled peer and the separate-kernel choice)")

    def main(self, args: argparse.Namespace) -> int:
        from .finalize import finalize_command

        return finalize_command(args)


class DecodeBench:
    help = "Qwen3 decode step with vs without boundaries, eager and CUDA-graph replay"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.description = (
            "A decode step (one token per sequence) of the reference Qwen3 decoder with random weights, with "
            "boundaries against the same model without them, eager and CUDA-graph replay, at TP=1 and TP=2 (or "
            "the --tp given, up to 8); above TP=1 also with the fused consumer candidates against without.")
        grid_options(parser, tokens_help="batch sizes, one token per sequence (default 1 8 32 128)", hidden=False)
        parser.add_argument("--tp", type=int, nargs="+", choices=(1, 2, 4, 8), default=None,
                            help="tensor-parallel sizes (default: 1 and, with 2 GPUs visible, 2)")
        parser.add_argument("--layers", type=positive, default=None,
                            help="decoder layers (default 8, 4 with --quick)")
        parser.add_argument("--compile", action="store_true",
                            help="also time each variant compiled (torch.compile, fullgraph) and captured "
                                 "in a CUDA graph, against plain compiled the same way")
        parser.add_argument("--hidden", type=positive, default=4096,
                            help="model width (default 4096; heads of 128, 4 query heads per kv head, FFN 3x)")
        parser.add_argument("--vocab", type=positive, default=32768, help="vocabulary size (default 32768)")

    def main(self, args: argparse.Namespace) -> int:
        from .decode import decode_command

        return decode_command(args)


BENCH = BenchGroup()
HOST = HostBench()
NORM = NormBench()
ALLREDUCE = AllreduceBench()
FINALIZE = FinalizeBench()
DECODE = DecodeBench()
