"""MHC residual kernels on one device: the MHC plugin's Triton kernels against its torch reference.

Ops, for ``n`` streams ``x [T, n, C]``, a stage output ``y [T, C]`` and element size ``e``:

=============  ======================================================================================
``update+read`` the producer's update ``x' = H_res x + H_post^T y`` and the next stage's read of
               ``x'`` (coefficients, Sinkhorn, combination and RMSNorm): post and pre fused, what a
               boundary between two MHC stages runs
``read``       the read alone (the stack entry, a written residual)
``update``     the update alone (a stage whose streams are not read next)
=============  ======================================================================================

Bytes (the roofline's byte model): every stream and activation read or written once, the FP32
coefficients in and out, and ``phi`` ([n C, n^2 + 2n] FP32) and the norm weight once a call::

    update+read  T (2n + 2) C e + 8 T (n + n^2) + 4 n C (n^2 + 2n) + C e
    read         T (n + 1) C e  + 4 T (n + n^2) + 4 n C (n^2 + 2n) + C e
    update       T (2n + 1) C e + 4 T (n + n^2)

At n = 4, C = 4096 in bf16 the first is 80 KiB a token (plus 1.5 MiB of ``phi`` a call). GB/s is
that over the median time; ``% roof`` compares it with a large device-to-device copy measured in
the same run (``timing.copy_bandwidth``), the bandwidth a memory-bound kernel reaches in
practice; ``x ref`` is the speedup over the torch reference of the same op and shape.

``check``: every output against the reference by ``layer_boundary_mhc.accuracy`` (the tests'
comparison): the read of ``update+read`` against the reference read of the streams the method
stored, since a stream element that rounds the other way (about one in 2^15, both right) moves
that token's coefficients by about 1e-4. ``tol`` is the worst element's |difference| over what
its tolerance allows (at most 1 passes); rows keep each output's figures under ``deviations``.

Methods: ``triton`` (the cooperative single launch), ``triton 2-launch`` (stream passes, then
finishes: x' is re-read from HBM), ``cute cluster`` (on CUDA where the CuTe DSL imports: one
thread-block cluster a token block, x' kept in shared memory, ``layer_boundary_mhc.cluster_ops``),
``torch reference`` (what the plugin runs off CUDA, and the meaning of the kernels) and, with
``--compile``, ``torch.compile`` of the reference.

``--tune NAME=VALUE``: fields of ``MhcKernelConfig`` (``layer_boundary_mhc.config``) to try; the
run passes the config to every kernel call, as ``MhcSemantics(kernel_config=...)`` does.

The shared bench helpers (``timing``, ``report``) are imported inside the functions that use them:
this module belongs to the MHC plugin, and importing it must not need the application's benches.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from .config import DEFAULT_CONFIG, PER_BUCKET, MhcKernelConfig

if TYPE_CHECKING:
    from layer_boundary_app.bench import report
    from layer_boundary_app.bench.timing import TimingPlan

    from .params import MhcStageParams

__all__ = ["MHC_HIDDEN", "MHC_TOKENS", "OPS", "bytes_moved", "run_mhc", "mhc_command", "TUNABLE"]

MHC_HIDDEN = (4096, 7168)
MHC_TOKENS = (1, 16, 128, 1024, 8192, 32768)
QUICK = {"cuda": ((1, 128, 8192), (4096,)), "cpu": ((1, 16), (256,))}
OPS = ("update+read", "read", "update")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
EPS = 1e-6
COPY_BYTES = {"cuda": (1 << 30, 1 << 28), "cpu": (1 << 26, 1 << 24)}  # (full, quick)
# The MhcKernelConfig fields --tune may set (every field; PER_BUCKET ones take three values).
TUNABLE = tuple(f.name for f in fields(MhcKernelConfig) if f.compare)



def bytes_moved(op: str, tokens: int, n: int, hidden: int, itemsize: int) -> int:
    """The byte model of the module docstring."""
    coeff = 4 * tokens * (n + n * n)
    fixed = 4 * n * hidden * (n * n + 2 * n) + hidden * itemsize
    if op == "update+read":
        return tokens * (2 * n + 2) * hidden * itemsize + 2 * coeff + fixed
    if op == "read":
        return tokens * (n + 1) * hidden * itemsize + coeff + fixed
    return tokens * (2 * n + 1) * hidden * itemsize + coeff


@dataclass
class Inputs:
    x: torch.Tensor
    y: torch.Tensor
    w: torch.Tensor
    h_post: torch.Tensor
    h_res: torch.Tensor
    params: MhcStageParams


@dataclass(frozen=True)
class MhcMethod:
    """One way to run ``op``: ``call(inputs) -> outputs`` (the reference's); ``checked``: compared
    with the reference (not the reference itself)."""

    name: str
    op: str
    call: Callable[[Inputs], tuple[torch.Tensor, ...]]
    checked: bool = True


def _inputs(tokens: int, n: int, hidden: int, dtype: torch.dtype, device: str) -> Inputs:
    from .params import MhcStageParams

    g = torch.Generator(device=device).manual_seed(tokens * 100003 + hidden)
    x = torch.randn(tokens, n, hidden, generator=g, device=device).to(dtype)
    y = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
    w = (1.0 + 0.1 * torch.randn(hidden, generator=g, device=device)).to(dtype)
    h_post = 2 * torch.rand(tokens, n, generator=g, device=device)
    h_res = torch.softmax(torch.randn(tokens, n, n, generator=g, device=device), dim=-1)
    params = MhcStageParams(n, hidden)
    params.init_random(torch.Generator().manual_seed(hidden))
    return Inputs(x, y, w, h_post, h_res, params.requires_grad_(False).to(device))


def _reference_methods(reference: Any, ops: Sequence[str]) -> list[MhcMethod]:
    calls = {
        "update+read": lambda i: reference.mhc_update_read_ref(i.x, i.y, i.h_post, i.h_res, i.params, i.w, EPS),
        "read": lambda i: reference.mhc_read_ref(i.x, i.params, i.w, EPS),
        "update": lambda i: (reference.mhc_update_ref(i.x, i.y, i.h_post, i.h_res),),
    }
    return [MhcMethod("torch reference", op, calls[op], checked=False) for op in ops]


def _compiled_methods(reference: Any, ops: Sequence[str]) -> list[MhcMethod]:
    import torch._dynamo

    # One compile per op and width; T is dynamic (the Sinkhorn loop unrolls into a large graph).
    fns = {"update+read": torch.compile(reference.mhc_update_read_ref, dynamic=True),
           "read": torch.compile(reference.mhc_read_ref, dynamic=True),
           "update": torch.compile(reference.mhc_update_ref, dynamic=True)}
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    calls = {
        "update+read": lambda i: fns["update+read"](i.x, i.y, i.h_post, i.h_res, i.params, i.w, EPS),
        "read": lambda i: fns["read"](i.x, i.params, i.w, EPS),
        "update": lambda i: (fns["update"](i.x, i.y, i.h_post, i.h_res),),
    }
    return [MhcMethod("torch.compile", op, calls[op]) for op in ops]


def _triton_methods(ops_module: Any, ops: Sequence[str], config: MhcKernelConfig) -> list[MhcMethod]:
    out: list[MhcMethod] = []
    for op in ops:
        if op == "update":
            out.append(MhcMethod("triton", op, lambda i: (ops_module.mhc_update_triton(i.x, i.y, i.h_post, i.h_res),)))
            continue
        for name, coop in (("triton", True), ("triton 2-launch", False)):
            if op == "read":
                def call(i: Inputs, coop: bool = coop) -> tuple[torch.Tensor, ...]:
                    return ops_module.mhc_read_triton(i.x, i.params, i.w, EPS, cooperative=coop, config=config)
            else:
                def call(i: Inputs, coop: bool = coop) -> tuple[torch.Tensor, ...]:
                    return ops_module.mhc_update_read_triton(i.x, i.y, i.h_post, i.h_res, i.params, i.w, EPS,
                                                             cooperative=coop, config=config)
            out.append(MhcMethod(name, op, call))
    return out


def _cluster_methods(ops: Sequence[str], config: MhcKernelConfig) -> list[MhcMethod]:
    """The MHC plugin's CuTe DSL cluster kernel (one launch, x' kept on chip), where it imports."""
    from . import triton_ops as k

    calls = {
        "update+read": lambda i: k.mhc_update_read_cluster(i.x, i.y, i.h_post, i.h_res, i.params, i.w, EPS,
                                                           config=config),
        "read": lambda i: k.mhc_read_cluster(i.x, i.params, i.w, EPS, config=config),
    }
    return [MhcMethod("cute cluster", op, calls[op]) for op in ops if op in calls]


def _destinations(method: MhcMethod, i: Inputs, config: MhcKernelConfig) -> Callable[[], Any]:
    """``method`` writing into destinations allocated once (no allocation a replay repeats beyond
    the kernels' workspace) where it takes them; the reference allocates as it always does."""
    cluster = method.name == "cute cluster"
    if not (cluster or method.name.startswith("triton")):
        return lambda: method.call(i)
    from . import cluster_ops, triton_ops

    t, n, c = i.x.shape
    streams = torch.empty_like(i.x)
    out = i.x.new_empty((t, c))
    h_post, h_res = torch.empty_like(i.h_post), torch.empty_like(i.h_res)
    if method.op == "update":
        return lambda: (triton_ops.mhc_update_triton(i.x, i.y, i.h_post, i.h_res, out=streams),)
    # The cluster kernel's callables take the Triton ones' arguments, less the launch form.
    read, update_read = ((triton_ops.mhc_read_cluster, triton_ops.mhc_update_read_cluster) if cluster else
                         (triton_ops.mhc_read_triton, triton_ops.mhc_update_read_triton))
    form: dict[str, Any] = {"config": config} if cluster else {"cooperative": method.name == "triton", "config": config}
    if method.op == "read":
        return lambda: read(i.x, i.params, i.w, EPS, out=out, h_post=h_post, h_res=h_res, **form)
    return lambda: update_read(i.x, i.y, i.h_post, i.h_res, i.params, i.w, EPS, streams_out=streams, out=out,
                               h_post_out=h_post, h_res_out=h_res, **form)


def _check(method: MhcMethod, got: Sequence[torch.Tensor], i: Inputs) -> dict[str, Any]:
    """``max_err`` (the largest |difference| of any output), ``tol`` (the worst over what the
    tolerance allows), ``ok`` and ``deviations`` (each output's) of ``got`` against the reference."""
    from . import accuracy

    devs = accuracy.compare(method.op, got, i.x, y=i.y, h_post=i.h_post, h_res=i.h_res, params=i.params,
                            norm_weight=i.w, norm_eps=EPS)
    worst = max(devs, key=lambda d: d.worst if d.worst == d.worst else float("inf"))
    return {"max_err": max(d.max_abs for d in devs), "tol": worst.worst, "ok": all(d.ok for d in devs),
            "worst": str(worst), "deviations": {d.output: {"max_abs": d.max_abs, "tol": d.worst} for d in devs}}


def _config(method: MhcMethod, tokens: int, n: int, hidden: int, dtype: torch.dtype,
            config: MhcKernelConfig) -> Optional[str]:
    if not method.name.startswith("triton") or method.op == "update":
        return None
    from . import triton_mhc as tm

    c = tm.boundary_config(tokens, n, hidden, dtype.itemsize, dtype == torch.bfloat16, config)
    return (f"BT={c.block_tokens} BC={c.block_cols} S={c.slices}x{c.slice_cols} TB={c.finish_tokens} "
            f"lag={c.lag_for(tokens)} stages={c.stages} warps={c.num_warps}" + (" joined" if c.joined else ""))


def _columns() -> list[report.Column]:
    from layer_boundary_app.bench import report

    return [
        report.Column("op", "op", width=12),
        report.Column("method", "method", width=16),
        report.Column("H", "hidden", "d", 5),
        report.Column("T", "tokens", "d", 6),
        report.Column("µs", "us", report.sig, 9),
        report.Column("GB/s", "gbps", report.sig, 7),
        report.Column("% roof", "pct_roofline", ".1f", 7),
        report.Column("x ref", "speedup", ".1f", 6),
        report.Column("tol", "tol", ".2f", 5),
        report.Column("check", "check", width=6),
    ]


def measure(method: MhcMethod, inputs: Inputs, plan: TimingPlan, device: str, n: int,
            config: MhcKernelConfig = DEFAULT_CONFIG) -> dict[str, Any]:
    from layer_boundary_app.bench.timing import time_call

    t, _, c = inputs.x.shape
    dtype = inputs.x.dtype
    row: dict[str, Any] = {"op": method.op, "method": method.name, "hidden": c, "tokens": t, "streams": n,
                           "dtype": str(dtype).replace("torch.", "")}
    try:
        got = method.call(inputs)
        if method.checked:
            row.update(_check(method, got, inputs))
        del got
        fn = _destinations(method, inputs, config)
        m = time_call(fn, device, plan)
    except Exception as e:  # one failing method must not end the run
        row["error"] = f"{type(e).__name__}: {e}"
        return row
    moved = bytes_moved(method.op, t, n, c, inputs.x.element_size())
    row.update(us=m.median_us, min_us=m.min_us, calls=m.calls, replays=m.replays, bytes=moved,
               gbps=moved / m.median_us / 1e3, config=_config(method, t, n, c, inputs.x.dtype, config))
    return row


def run_mhc(tokens: Sequence[int], hidden: Sequence[int], dtype: torch.dtype, device: str, plan: TimingPlan, *,
            n: int = 4, ops: Sequence[str] = OPS, compile: bool = False, copy_bytes: int,
            kernels_mode: str = "auto", config: MhcKernelConfig = DEFAULT_CONFIG,
            out: Callable[[str], None] = print) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """``(copy bandwidth, rows, refusals)``; rows are printed as they are measured. Every kernel
    call runs with ``config``."""
    from layer_boundary_app.bench import report
    from layer_boundary_app.bench.timing import reported_copy_bandwidth

    from . import reference, selection

    copy = reported_copy_bandwidth(device, copy_bytes, plan, out)
    kernels = selection.select_kernels(kernels_mode, n, "rmsnorm", config)
    device_type = torch.device(device).type
    why = kernels.why_not(device_type, dtype)
    refusals: list[dict[str, Any]] = []
    methods = _reference_methods(reference, ops)
    if why is None:
        methods += _triton_methods(kernels.ops, ops, config)
    else:
        refusals.append({"method": "triton", "refused": why})
        out(f"triton refuses {device_type} {str(dtype).replace('torch.', '')} n={n}: {why}")
    if device_type == "cuda":
        from . import cluster_ops

        why_not = cluster_ops.import_problem()
        if why_not:
            refusals.append({"method": "cute cluster", "refused": why_not})
        else:
            methods += _cluster_methods(ops, config)
    if compile:
        methods += _compiled_methods(reference, ops)
    table = report.Table(_columns(), out)
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        for c in hidden:
            table.header()
            for t in tokens:
                inputs = _inputs(t, n, c, dtype, device)
                for op in ops:
                    ref_us = None
                    for method in (m for m in methods if m.op == op):
                        row = measure(method, inputs, plan, device, n, config)
                        if "gbps" in row:
                            row["pct_roofline"] = 100.0 * row["gbps"] / copy["gbps"]
                            if not method.checked:
                                ref_us = row["us"]
                            if ref_us is not None:
                                row["speedup"] = ref_us / row["us"]
                        row["check"] = ("error" if "error" in row else
                                        {True: "ok", False: "FAIL", None: "-"}[row.get("ok")])
                        rows.append(row)
                        table.row(row)
                        if "error" in row:
                            out(f"  {method.name} {op}: {row['error']}")
                        elif row.get("ok") is False:
                            out(f"  {method.name} {op}: {row['worst']}")
                del inputs
    return copy, rows, refusals


def mhc_panels(rows: Sequence[dict[str, Any]], copy_gbps: float) -> list[report.Panel]:
    from layer_boundary_app.bench import report

    panels = []
    for c in sorted({r["hidden"] for r in rows}):
        for op in OPS:
            mine = [r for r in rows if r["hidden"] == c and r["op"] == op and "gbps" in r]
            if not mine:
                continue
            names = list(dict.fromkeys(r["method"] for r in mine))
            series = [report.Series(name, tuple((r["tokens"], r["gbps"]) for r in mine if r["method"] == name))
                      for name in names]
            ts = [r["tokens"] for r in mine]
            series.append(report.Series("copy bandwidth", ((min(ts), copy_gbps), (max(ts), copy_gbps)), dashed=True))
            panels.append(report.Panel(f"{op}, H = {c}", "tokens", "GB/s", tuple(series)))
    return panels


def _apply_tuning(settings: Sequence[str]) -> tuple[MhcKernelConfig, dict[str, Any]]:
    """The config that ``NAME=VALUE`` settings of ``MhcKernelConfig`` fields (``TUNABLE``) make from
    the default, and the settings as applied."""
    applied: dict[str, Any] = {}
    for s in settings:
        name, _, value = s.partition("=")
        if name not in TUNABLE or not value:
            raise ValueError(f"--tune {s!r}: give NAME=VALUE with NAME a field of MhcKernelConfig: "
                             f"{', '.join(TUNABLE)}")
        per_bucket = name in PER_BUCKET
        pair = name in ("update_read_tokens", "read_tokens")
        try:
            parsed: Any = tuple(int(v) for v in value.split(",")) if per_bucket or pair else int(value)
        except ValueError:
            raise ValueError(f"--tune {s!r}: give integers ({name} takes three for decode, mid and prefill "
                             "token counts, e.g. 16,32,64)" if per_bucket else f"--tune {s!r}: give integers")
        if per_bucket and len(parsed) != 3:
            raise ValueError(f"--tune {s!r}: {name} takes three values (decode, mid and prefill token counts), "
                             "e.g. 16,32,64")
        if name == "push":
            parsed = bool(parsed)
        applied[name] = parsed
    try:
        config = replace(DEFAULT_CONFIG, **applied)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--tune: {e}") from None
    return config, applied



def mhc_command(args: argparse.Namespace) -> int:
    from layer_boundary_app.bench import report
    from layer_boundary_app.bench.timing import TimingPlan, cuda_unavailable, this_device

    device = args.device
    if device == "cuda":
        why = cuda_unavailable("mhc")
        if why:
            print(why, file=sys.stderr)
            return 2
    try:
        config, tuned = _apply_tuning(args.tune or ())
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    quick_tokens, quick_hidden = QUICK[device]
    tokens = args.tokens or (quick_tokens if args.quick else MHC_TOKENS)
    hidden = args.hidden or (quick_hidden if args.quick else MHC_HIDDEN)
    ops = args.ops or OPS
    plan = TimingPlan.for_run(args.quick, args.replays)
    env = report.environment(device)
    timing = "CUDA-graph replay" if device == "cuda" else "wall clock"
    esize = torch.empty((), dtype=dtype).element_size()
    print(f"layer-boundary bench mhc: MHC update and read, n={args.streams}, {args.dtype}, "
          f"{env['gpu'] or env['cpu']}, torch {env['torch']}, {env['date']}; median µs by {timing} over "
          f"{plan.replays} replays; update+read bytes = T(2n+2)C·{esize} + coefficients + phi"
          + (f"; tuned {tuned}" if tuned else ""))
    copy, rows, refusals = run_mhc(tokens, hidden, dtype, this_device(device), plan, n=args.streams, ops=ops,
                                   compile=args.compile, copy_bytes=COPY_BYTES[device][1 if args.quick else 0],
                                   kernels_mode=getattr(args, "kernels", "auto"), config=config)
    report.publish(args, "mhc", env, rows, f"MHC update and read, n = {args.streams}, {args.dtype}",
                   mhc_panels(rows, copy["gbps"]), copy=copy, refused=refusals, eps=EPS, streams=args.streams,
                   bytes_per_call={"update+read": "T*(2n+2)*C*e + 8*T*(n+n^2) + 4*n*C*(n^2+2n) + C*e",
                                   "read": "T*(n+1)*C*e + 4*T*(n+n^2) + 4*n*C*(n^2+2n) + C*e",
                                   "update": "T*(2n+1)*C*e + 4*T*(n+n^2)"},
                   tuned=tuned, timing=timing, replays=plan.replays)
    return report.exit_status(rows, ("op", "tokens", "hidden"))
