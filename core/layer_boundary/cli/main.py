"""``layer-boundary`` entry point: ``run`` (the main job) and ``bench`` (benchmarks)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional, Sequence

__all__ = ["main", "build_parser"]

DEFAULT_INPUT_IDS = "9,41,7,300,12,5,88,150,2,61,33,404"
DEFAULT_PATTERN_INPUT_IDS = "9,41,7,200,12,5,88,150,2,61,33,204"  # inside the 256-token vocabulary


def _input_ids(text: str) -> list[list[int]]:
    """``1,2,3`` is one sequence; ``1,2;3,4,5`` two, spread over the DP groups as requests."""
    seqs = []
    for part in text.split(";"):
        items = part.split(",")
        if part.strip() and any(t.strip() == "" for t in items):
            raise argparse.ArgumentTypeError(f"--input-ids {text!r} has an empty item between commas")
        try:
            ids = [int(t) for t in items if t.strip() != ""]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--input-ids {text!r}: give comma-separated integers, for example 1,2,3 "
                "(several sequences separated by ';')"
            ) from None
        if not ids:
            raise argparse.ArgumentTypeError(
                f"--input-ids {text!r} has an empty sequence; give at least one token id each")
        if any(i < 0 for i in ids):
            raise argparse.ArgumentTypeError(f"--input-ids {text!r}: token ids must be non-negative")
        seqs.append(ids)
    return seqs


def _bounded(lo: int, hi: Optional[int], why: str) -> Any:
    """An argparse type: an integer in ``[lo, hi]`` (``hi`` None: no upper bound)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{v} {why}")
        return v

    return parse


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


_positive = _bounded(1, None, "must be at least 1")  # sizes, counts, iterations
_seed = _bounded(0, 2**63 - 1, "is not a seed torch takes (0 to 2**63 - 1)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="layer-boundary",
        description="Run and measure transformer layer boundaries (reductions, row movement, "
        "residual update and normalized input between compute stages).",
    )
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="build a reference decoder on the boundaries and run one forward",
        description="Build a reference decoder on the boundaries and run one forward on N ranks "
        "(spawned here, or started by torchrun). With no --model it builds an embedded small "
        "random Qwen3 (with --moe a Qwen3-MoE, with --longcat a LongCat-style decoder) on 2 CPU "
        "ranks (gloo).",
    )
    run.add_argument("--model", metavar="PATH",
                     help="a Hugging Face checkpoint folder (config.json + *.safetensors); its "
                     "config.json model_type picks the decoder: qwen3 (dense) or qwen3_moe")
    run.add_argument("--moe", action="store_true",
                     help="build the embedded random Qwen3-MoE instead of the dense Qwen3 (8 "
                     "tensor-parallel experts, top 2; layer 1 dense, the others sparse)")
    run.add_argument("--defer-moe-finalize", action="store_true",
                     help="let sparse FFNs return finalize handoffs (defer_moe_finalize) that the "
                     "next layer's input or the final norm completes; Qwen3-MoE only")
    run.add_argument("--fused-finalize", action="store_true",
                     help="fuse each sparse FFN's finalize handoff (top-k combine, shared expert, "
                     "all-reduce, residual add, RMSNorm) into the next attention input and the "
                     "final norm (one Triton kernel on CUDA, the torch reference elsewhere); builds "
                     "zero-centered (Gemma) norms; Qwen3-MoE only")
    run.add_argument("--tbo", action="store_true",
                     help="two-batch overlap: split each DP group's sequences into two microbatches "
                     "(balanced by tokens) with their own residual streams, interleave their layer "
                     "stages and merge; dense Qwen3 overlaps every layer, Qwen3-MoE its sparse ones")
    run.add_argument("--longcat", action="store_true",
                     help="build the embedded random LongCat-style decoder: every layer runs a MoE "
                     "branch (8 experts, top 2) beside a dense FFN -> attention -> FFN branch that "
                     "starts from the MoE's prepared input (branch_input) and merges its output "
                     "(branch_output, merge_branch); ordinary token rows only (no input-scattered, "
                     "CP or sequence-parallel variant), --pp and --defer-moe-finalize allowed")
    run.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                     help="compute dtype of the whole model (default float32, whatever dtype a --model "
                          "checkpoint was saved in: its weights are cast)")
    run.add_argument(
        "--input-ids", type=_input_ids, default=None, metavar="IDS",
        help=f"comma-separated token ids; several sequences separated by ';' (default: {DEFAULT_INPUT_IDS}; "
        f"with --pattern {DEFAULT_PATTERN_INPUT_IDS})",
    )
    run.add_argument("--save-logits", metavar="FILE", help="torch.save the float32 logits [tokens, vocab]")
    run.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    run.add_argument("--tp", type=_positive, default=None, metavar="N",
                     help="ranks (the world size of a stage group); default 2 for the embedded model "
                     "on CPU, else 1")
    run.add_argument("--dp", type=_positive, default=1, metavar="D",
                     help="attention data parallel: D groups of N/D attention-TP ranks (D divides N)")
    run.add_argument("--pp", type=_positive, default=1, metavar="P",
                     help="pipeline stages (layers split evenly, the remainder on the last); the "
                     "world is N x P ranks, stage s on ranks [s*N, (s+1)*N)")
    run.add_argument("--cp", type=_positive, default=1, metavar="C",
                     help="context-parallel prefill: each sequence's tokens spread (zig-zag) over C "
                     "ranks of attention TP, heads over the other N/D/C (C divides N/D; needs --dp 1)")
    run.add_argument("--reduction", choices=("auto", "ar", "rs", "rsv", "rs+rsv"), default="auto",
                     help="FFN output return permissions under attention DP (default: auto)")
    run.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                     help="torch.distributed backend (default: gloo on CPU, nccl on CUDA)")
    run.add_argument("--check", action="store_true",
                     help="compare every rank's logits with the single-rank model built with the same "
                          "kernels (it checks the layout, not a kernel against the torch reference: "
                          "that is the conformance kit, pytest -p layer_boundary.testing); exit 1 on a "
                          "mismatch")
    run.add_argument("--seed", type=_seed, default=0, help="seed of the embedded random model")
    run.add_argument(
        "--pattern", metavar="LAYERS", default=None,
        help="build the embedded random heterogeneous decoder instead of Qwen3, one layer per "
        "character: M (gated short-convolution mixer), * (attention), - (dense FFN); e.g. 'M-M*-' "
        "(one that starts with '-' is given with '=': --pattern=-M*-)",
    )
    run.add_argument(
        "--residual", default="plain", metavar="SCHEME",
        help="residual scheme: plain add (built in), mhc (manifold-constrained hyper-connections, "
        "from the layer-boundary-mhc plugin) or any scheme an active plugin registers (an unknown "
        "name is refused with those available) (default: plain)",
    )

    plugins = sub.add_parser(
        "plugins",
        help="list the plugins found through entry points, their status and why",
        description="List the plugins found in the entry-point group layer_boundary.plugins. "
        "Honours LAYER_BOUNDARY_PLUGINS, LAYER_BOUNDARY_DISABLE, "
        "LAYER_BOUNDARY_DISABLE_PLUGIN_AUTOLOAD and LAYER_BOUNDARY_STRICT_PLUGINS.",
    )
    plugins.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    plugins.add_argument("--check", nargs="+", metavar="NAME",
                         help="exit non-zero unless every named plugin is active")

    bench = sub.add_parser("bench", help="benchmarks", description="Benchmarks; each prints a table.")
    bsub = bench.add_subparsers(dest="bench", required=True)
    host = bsub.add_parser(
        "host",
        help="host time per boundary and decoder forward time with and without boundaries (CPU)",
    )
    host.add_argument("--tokens", type=_positive, nargs="+", default=[1, 8, 32], help="batch sizes (decode-sized)")
    host.add_argument("--iters", type=_positive, default=2000, help="timed calls per boundary measurement")
    host.add_argument("--forward-iters", type=_positive, default=200, help="timed decoder forwards per measurement")
    host.add_argument("--hidden", type=_positive, nargs="+", default=[64, 1024],
                      help="decoder hidden sizes for the forward comparison (4 layers each)")
    cpus = _usable_cpus()
    # Far more threads than CPUs crashed torch (a segfault at 100000), and past the CPU count the
    # figures measure contention, not the boundaries.
    host.add_argument("--threads", type=_bounded(1, cpus, f"must be 1 to {cpus} (the CPUs this process may use)"),
                      default=1, help=f"torch intra-op threads, 1 to {cpus} (default 1)")
    host.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    _add_gpu_benches(bsub)
    return p


def _grid_options(p: argparse.ArgumentParser, *, tokens_help: str, hidden: bool = True) -> None:
    p.add_argument("--tokens", type=_positive, nargs="+", metavar="T", help=tokens_help)
    if hidden:
        p.add_argument("--hidden", type=_positive, nargs="+", metavar="H", help="hidden sizes (default: the full grid)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="activation dtype (default bfloat16)")
    p.add_argument("--quick", action="store_true", help="a small grid and fewer replays (a minute or two)")
    p.add_argument("--replays", type=_positive, default=None, metavar="N",
                   help="timed replays per measurement (default 50, 15 with --quick)")
    p.add_argument("--out", metavar="DIR", default="benchmarks/results",
                   help="where the dated JSON and SVG go (default benchmarks/results)")


def _add_gpu_benches(bsub: Any) -> None:
    norm = bsub.add_parser(
        "norm", help="fused add+RMSNorm: every norm-kernel provider vs torch.compile and torch eager",
        description="Fused add+RMSNorm (residual updated in place) for every norm-kernel provider that "
        "serves the request here, against torch.compile of the torch reference and torch eager; "
        "µs, GB/s (4·H·element-size bytes per token) and % of the copy bandwidth measured in the same run.",
    )
    _grid_options(norm, tokens_help="token counts (default 1 16 128 1024 8192 32768)")
    norm.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                      help="cuda (CUDA-graph replay) or cpu (wall clock; for testing the harness)")
    norm.add_argument("--no-compile", action="store_true", help="leave out the torch.compile peer")

    ar = bsub.add_parser(
        "allreduce", help="all-reduce + add + RMSNorm: fused consumer candidates vs NCCL + separate kernel",
        description="On 2 (4, 8) GPUs: each fused consumer candidate a TP stage of that size accepts, against "
        "NCCL all-reduce followed by the best separate add+RMSNorm kernel of the same run; µs, speedup and bus "
        "bandwidth against the nominal NVLink bandwidth.",
    )
    _grid_options(ar, tokens_help="token counts (default 1 2 4 ... 8192)")
    ar.add_argument("--world", type=int, choices=(2, 4, 8), default=2,
                    help="GPUs (TP ranks) of one host (default 2)")
    ar.add_argument("--no-compile", action="store_true",
                    help="leave torch.compile out of the separate-kernel choice")

    fin = bsub.add_parser(
        "finalize", help="MoE finalize handoff: the fused finalize + all-reduce + add + Gemma RMSNorm vs NCCL + "
        "separate kernels",
        description="The core's fused MoE finalize kernel (top-k combine + shared expert + all-reduce over "
        "symmetric memory + residual add + Gemma RMSNorm, one launch) against moe_finalize in torch ops + NCCL + "
        "the best separate add+norm kernel, and against torch.compile'd finalize + NCCL + torch.compile'd add+norm; "
        "µs, speedup over the best baseline, bytes per rank, % of the copy bandwidth measured in the same run, "
        "and a check against the unfused path. --world 1 runs the one-GPU path (no all-reduce).",
    )
    _grid_options(fin, tokens_help="token counts (default 1 4 16 64 128 256 512 1024)")
    fin.add_argument("--world", type=int, choices=(1, 2), default=None,
                     help="GPUs (ranks): 2 sums over NCCL / symmetric memory, 1 has no all-reduce "
                     "(default 2 when 2 GPUs are visible, else 1)")
    fin.add_argument("--topk", type=_positive, default=8, metavar="K", help="experts per token (default 8)")
    fin.add_argument("--no-compile", action="store_true",
                     help="leave torch.compile out (the compiled peer and the separate-kernel choice)")

    dec = bsub.add_parser(
        "decode", help="Qwen3 decode step with vs without boundaries, eager and CUDA-graph replay",
        description="A decode step (one token per sequence) of the reference Qwen3 decoder with random "
        "weights, with boundaries against the same model without them, eager and CUDA-graph replay, "
        "at TP=1 and TP=2 (or the --tp given, up to 8); above TP=1 also with the fused consumer candidates "
        "against without.",
    )
    _grid_options(dec, tokens_help="batch sizes, one token per sequence (default 1 8 32 128)", hidden=False)
    dec.add_argument("--tp", type=int, nargs="+", choices=(1, 2, 4, 8), default=None,
                     help="tensor-parallel sizes (default: 1 and, with 2 GPUs visible, 2)")
    dec.add_argument("--layers", type=_positive, default=None, help="decoder layers (default 8, 4 with --quick)")
    dec.add_argument("--hidden", type=_positive, default=4096,
                     help="model width (default 4096; heads of 128, 4 query heads per kv head, FFN 3x)")
    dec.add_argument("--vocab", type=_positive, default=32768, help="vocabulary size (default 32768)")

    mhc = bsub.add_parser(
        "mhc", help="MHC residual kernels (layer-boundary-mhc): Triton vs the torch reference and the byte roofline",
        description="The MHC plugin's kernels: the update fused with the next read, the read, and the update "
        "alone, Triton against the plugin's torch reference; µs, GB/s from the byte model (n=4, H=4096, bf16: "
        "80 KiB a token for update+read), % of the copy bandwidth measured in the same run, speedup over the "
        "reference. Needs the plugin installed (exit 2 otherwise).",
    )
    _grid_options(mhc, tokens_help="token counts (default 1 16 128 1024 8192 32768)")
    mhc.add_argument("--streams", type=_positive, default=4, metavar="N", help="residual streams n (default 4)")
    mhc.add_argument("--ops", nargs="+", choices=("update+read", "read", "update"), default=None,
                     help="which ops (default all three)")
    mhc.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                     help="cuda (CUDA-graph replay) or cpu (wall clock, the torch reference only; for testing)")
    mhc.add_argument("--compile", action="store_true",
                     help="also time torch.compile of the torch reference (one compile per op and width)")
    mhc.add_argument("--kernels", choices=("auto", "triton"), default="auto",
                     help="auto: the plugin's default choice; triton: time the Triton kernels even where "
                     "auto does not pick them yet (as MhcSemantics(kernels='triton') runs them)")
    mhc.add_argument("--tune", nargs="+", metavar="NAME=VALUE",
                     help="launch-shape constants of layer_boundary_mhc.triton_mhc to try, e.g. LAG=8 "
                     "SLICE_COLS=128,128,128 FINISH_TOKENS=4")


def _unwritable(folder: str) -> Optional[str]:
    """Why no file can be created in ``folder`` (``None``: one can). A real file is made and
    removed: ``os.access`` says yes to root on a read-only file system."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as e:
        return e.strerror or str(e)


def _check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Output paths are checked before any work: a results folder is created, a file's folder must
    exist and take a new file (a missing or read-only one used to surface as a traceback after
    the whole run)."""
    for flag, path in (("--save-logits", getattr(args, "save_logits", None)), ("--json", getattr(args, "json", None))):
        if isinstance(path, str):
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                parser.error(f"{flag} {path!r}: the folder {folder!r} does not exist")
            if os.path.isdir(path):
                parser.error(f"{flag} {path!r} is a folder; give a file path in it")
            why = _unwritable(folder)
            if why is not None:
                parser.error(f"{flag} {path!r}: no file can be written in {folder!r} ({why}); "
                             "give a path in a writable folder")
            if os.path.exists(path) and not os.access(path, os.W_OK):
                parser.error(f"{flag} {path!r} exists and is read-only; give another path or make it writable")
    out = getattr(args, "out", None)
    if isinstance(out, str):
        try:
            os.makedirs(out, exist_ok=True)
        except OSError as e:
            parser.error(f"--out {out!r} cannot be created ({e.strerror})")
        why = _unwritable(out)
        if why is not None:
            parser.error(f"--out {out!r}: no file can be written there ({why}); give a writable folder")


def _torch_import_problem() -> Optional[str]:
    """Why torch cannot be imported here (``None``: it can). Every command needs it; when it fails,
    plugin discovery used to list each plugin ``failed`` with a second-hand error ("partially
    initialized module 'torch'") and the process could crash at exit, and ``run`` gave a traceback."""
    try:
        import torch  # noqa: F401
    except Warning as e:
        cause = "pip install numpy" if "NumPy" in str(e) else "remove its cause"
        return (f"importing torch raised its warning {type(e).__name__}: {e}, which the warning filter "
                f"(python -W error, PYTHONWARNINGS) makes an error; {cause}, or let that warning through "
                f"(-W error -W 'ignore::{type(e).__name__}')")
    except Exception as e:
        return f"importing torch raised {type(e).__name__}: {e}; repair the torch install"
    return None


def _own_usage(parser: argparse.ArgumentParser) -> None:
    """Each command's parser named in its namespace (``_parser``): an unknown option or a bad path
    then prints that command's usage, not the top level's (which lists only the commands)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.set_defaults(_parser=sub)
                _own_usage(sub)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader went away (`layer-boundary plugins | head -3`): stop quietly, as shell tools
        # do, rather than a traceback; stdout is pointed at /dev/null so that the interpreter's
        # own flush at exit does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    _own_usage(parser)
    args, extra = parser.parse_known_args(argv)
    here = vars(args).pop("_parser", parser)
    if extra:
        here.error(f"unrecognized arguments: {' '.join(extra)}")
    _check_outputs(here, args)
    problem = _torch_import_problem()
    if problem is not None:
        print(f"layer-boundary {args.command}: {problem}", file=sys.stderr)
        return 1
    if args.command == "run":
        from .run import run_command

        args.default_ids = args.input_ids is None
        if args.input_ids is None:
            args.input_ids = _input_ids(DEFAULT_PATTERN_INPUT_IDS if args.pattern else DEFAULT_INPUT_IDS)

        return run_command(args)
    if args.command == "plugins":
        from .plugins import plugins_command

        return plugins_command(args)
    if args.command == "bench" and args.bench == "host":
        from ..bench.host import host_command

        return host_command(args)
    if args.command == "bench" and args.bench == "norm":
        from ..bench.norm import norm_command

        return norm_command(args)
    if args.command == "bench" and args.bench == "allreduce":
        from ..bench.allreduce import allreduce_command

        return allreduce_command(args)
    if args.command == "bench" and args.bench == "finalize":
        from ..bench.finalize import finalize_command

        return finalize_command(args)
    if args.command == "bench" and args.bench == "decode":
        from ..bench.decode import decode_command

        return decode_command(args)
    if args.command == "bench" and args.bench == "mhc":
        from ..bench.mhc import mhc_command

        return mhc_command(args)
    raise AssertionError(args)


if __name__ == "__main__":
    sys.exit(main())
