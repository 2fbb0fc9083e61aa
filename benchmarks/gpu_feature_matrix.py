"""Run the feature matrix (tests/gpu_feature_cases.py) on 2 ranks and record it, dated.

On the device machine (2 GPUs, NCCL)::

    python3 benchmarks/gpu_feature_matrix.py --out "$OUT"

On a CPU machine (gloo), to see the record being made: ``--device cpu --backend gloo``. Writes
``<out>/YYYY-MM-DD-gpu-features-<device>.{json,md}``: the GPU, torch / triton / NCCL versions,
and per case the worst rank's max |difference| against the single-device model, its tolerance
and pass/fail. Exits 1 when a case fails. Not a benchmark of speed: correctness on the hardware.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# The case module lives with the tests (the pytest module runs the same cases); spawned ranks
# import it by name, and they inherit this sys.path.
sys.path.insert(0, os.path.join(HERE, os.pardir, "tests"))

import gpu_feature_cases  # noqa: E402
from layer_boundary_app.bench import report  # noqa: E402
from layer_boundary_app.launch import spawn  # noqa: E402

WORLD = 2
COLUMNS = [report.Column("case", "case", width=26), report.Column("layout", "layout", width=30),
           report.Column("dtype", "dtype", width=9), report.Column("max diff", "max_diff", ".3g", 10),
           report.Column("tolerance", "tolerance", ".3g", 10),
           report.Column("pass", "pass", lambda ok: "ok" if ok else "FAIL", 5)]


def parse(argv: Any = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/out", help="folder for the record")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--backend", default=None, choices=("nccl", "gloo"), help="default: nccl on cuda, gloo on cpu")
    p.add_argument("--cases", nargs="*", default=None, help="case names (default: the whole matrix)")
    # A rank stuck in a collective fails the run after this long (gpu_session.sh allows 150 s).
    p.add_argument("--timeout", type=float, default=120.0, help="process-group timeout, seconds")
    args = p.parse_args(argv)
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    return args


def _nccl() -> Any:
    try:
        v = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:  # a CPU build has no NCCL
        return f"unavailable ({type(e).__name__})"


def markdown(env: dict[str, Any], rows: list[dict[str, Any]], seconds: float, command: str) -> str:
    passed = sum(r["pass"] for r in rows)
    lines = [
        f"# Feature matrix on {WORLD} ranks: {env['gpu'] or 'CPU ' + env['cpu']} x{WORLD}, {env['date']}", "",
        f"`{command}`", "",
        f"backend {env['backend']}, device {env['device']}, torch {env['torch']} (CUDA {env['cuda']}), "
        f"triton {env['triton']}, NCCL {env['nccl']}, driver {env['driver']}, Python {env['python']}", "",
        "Each case against the single-device model (same device, same dtype); max diff is the worst "
        "rank's largest |difference| (logits, or the worst captured value for capture cases), the "
        "tolerance is REL x max(1, max |reference|) with REL = "
        + ", ".join(f"{k} {gpu_feature_cases.REL[k]:g}" for k in sorted({r["dtype"] for r in rows})) + ".", "",
        "| case | feature | layout | dtype | max diff | tolerance | pass |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        verdict = "ok" if r["pass"] else "FAIL: " + "; ".join(r["problems"]).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r['case']} | {r['feature']} | {r['layout']} | {r['dtype']} | {r['max_diff']:.3g} "
                     f"| {r['tolerance']:.3g} | {verdict} |")
    lines += ["", f"{passed} of {len(rows)} cases passed in {seconds:.1f} s (spawn included)."]
    return "\n".join(lines) + "\n"


def main(argv: Any = None) -> int:
    args = parse(argv)
    cases = gpu_feature_cases.select(args.cases) if args.cases else gpu_feature_cases.CASES
    t0 = time.perf_counter()
    per_rank = spawn(gpu_feature_cases.feature_matrix, WORLD, args=(cases, args.device),
                     backend=args.backend, timeout_s=args.timeout)
    seconds = time.perf_counter() - t0
    rows = gpu_feature_cases.verdicts(cases, per_rank)
    env = {**report.environment(args.device, gpus=WORLD), "backend": args.backend,
           "nccl": _nccl() if args.device == "cuda" else None}
    table = report.Table(COLUMNS)
    table.header()
    for r in rows:
        table.row(r)
    json_path, _ = report.result_paths(args.out, "gpu-features", env)
    md_path = json_path[: -len(".json")] + ".md"
    command = "python3 benchmarks/gpu_feature_matrix.py " + " ".join(sys.argv[1:] if argv is None else argv)
    report.write_json(json_path, "gpu-features", env, rows, seconds=seconds, world=WORLD,
                      rel=gpu_feature_cases.REL, command=command.strip())
    with open(md_path, "w") as f:
        f.write(markdown(env, rows, seconds, command.strip()))
    failed = [r["case"] for r in rows if not r["pass"]]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} passed in {seconds:.1f} s"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    print(f"wrote {json_path}\nwrote {md_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
