"""argparse types and option sets shared by the application's commands."""

from __future__ import annotations

import argparse
import os
from typing import Callable, Optional

__all__ = ["DEFAULT_INPUT_IDS", "DEFAULT_PATTERN_INPUT_IDS", "input_ids", "bounded", "positive", "seed",
           "usable_cpus", "grid_options"]

DEFAULT_INPUT_IDS = "9,41,7,300,12,5,88,150,2,61,33,404"
DEFAULT_PATTERN_INPUT_IDS = "9,41,7,200,12,5,88,150,2,61,33,204"  # inside the 256-token vocabulary


def input_ids(text: str) -> list[list[int]]:
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


def bounded(lo: int, hi: Optional[int], why: str) -> Callable[[str], int]:
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


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


positive = bounded(1, None, "must be at least 1")  # sizes, counts, iterations
seed = bounded(0, 2**63 - 1, "is not a seed torch takes (0 to 2**63 - 1)")


def grid_options(p: argparse.ArgumentParser, *, tokens_help: str, hidden: bool = True) -> None:
    p.add_argument("--tokens", type=positive, nargs="+", metavar="T", help=tokens_help)
    if hidden:
        p.add_argument("--hidden", type=positive, nargs="+", metavar="H", help="hidden sizes (default: the full grid)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="activation dtype (default bfloat16)")
    p.add_argument("--quick", action="store_true", help="a small grid and fewer replays (a minute or two)")
    p.add_argument("--replays", type=positive, default=None, metavar="N",
                   help="timed replays per measurement (default 50, 15 with --quick)")
    p.add_argument("--out", metavar="DIR", default="benchmarks/results",
                   help="where the dated JSON and SVG go (default benchmarks/results)")
