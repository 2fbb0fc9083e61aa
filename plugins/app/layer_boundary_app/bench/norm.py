"""Fused add+RMSNorm on one device: every norm-kernel provider against torch peers.

Per token, ``fused_add_rmsnorm`` reads ``x`` and ``r`` and writes ``r' = x + r`` (in place) and
``y = RMSNorm(r')``: ``bytes = 4 * H * element_size`` (8·H in bf16). GB/s is that over the median
time; ``% copy`` compares it with a large device-to-device ``copy_`` measured in the same run
(read + write counted), the bandwidth a memory-bound kernel can reach in practice. Small batches
stay in the L2 cache, so their GB/s may exceed the copy's.

Methods: each provider that serves the request on this device, found generically (the plugins'
norm kernels and the core's, through ``BoundaryContext.norm_candidates()``), and two peers:
``torch.compile`` of the torch reference, and torch eager (``r += x``, then RMSNorm written in
torch ops, as an unfused model does it).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, TypedDict

import torch

from layer_boundary.plugin_api import fused_add_rmsnorm_ref, NormRequest

from . import report
from .timing import TimingPlan, cuda_unavailable, reported_copy_bandwidth, this_device, time_call

__all__ = ["NORM_HIDDEN", "NORM_TOKENS", "DTYPES", "NormMethod", "norm_methods", "peer_methods",
           "torch_fused_add_rmsnorm",
           "providers_for", "run_norm", "norm_command"]

NORM_HIDDEN = (2048, 4096, 7168, 8192)
NORM_TOKENS = (1, 16, 128, 1024, 8192, 32768)
QUICK = {"cuda": ((1, 128, 8192), (4096,)), "cpu": ((1, 16, 128), (2048,))}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
EPS = 1e-6
# Bytes of the copy the norm kernels are compared with: far past any L2 cache.
COPY_BYTES = {"cuda": (1 << 30, 1 << 28), "cpu": (1 << 26, 1 << 24)}  # (full, quick)

Call = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]



class NormTolerance(TypedDict):
    """``atol`` and ``rtol`` of ``torch.allclose``, as ``plugin_api.tolerance_of`` returns them."""

    atol: float
    rtol: float


@dataclass(frozen=True)
class NormMethod:
    """One way to run add+RMSNorm: ``call(x, r, w, y) -> (y, r')`` updates ``r`` in place.

    ``tolerance``: the ``(atol, rtol)`` it keeps against the torch reference (``None``: a peer
    that rounds differently on purpose, compared but not checked).
    """

    name: str
    origin: str
    call: Call
    tolerance: Optional[NormTolerance]


def _provider_method(origin: str, provider: Any, request: NormRequest) -> NormMethod:
    from layer_boundary.plugin_api import tolerance_of

    k = provider.kernels(request)
    fused = k.fused_add_rmsnorm
    offset = request.weight_offset

    def call(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Any:
        return fused(x, r, w, EPS, weight_offset=offset, out=y, residual_out=r)

    def call_over_input(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Any:
        # As the boundary's read calls it (NormKernels.input_as_out): over the consumed input.
        return fused(x, r, w, EPS, weight_offset=offset, out=x, residual_out=r)

    if k.input_as_out:
        call = call_over_input

    return NormMethod(provider.name, origin, call, tolerance_of(provider, request.dtype))


def torch_fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                            weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_add_rmsnorm_ref``'s arithmetic in torch ops, the residual updated in place: what
    Inductor fuses into one kernel. The reference itself compiles to its operator (eager ATen
    calls, for compiled results bit-equal to eager), which is no compiled peer."""
    s = x.float() + residual.float()
    residual.copy_(s)
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * (weight.float() + weight_offset)
    return y.to(x.dtype), residual


def _compiled_method(dtype: torch.dtype, weight_offset: float = 0.0) -> NormMethod:
    import torch._dynamo

    from layer_boundary.plugin_api import DEFAULT_TOLERANCE

    # A fresh Dynamo cache per shape: shapes are static (dynamic=False, as an engine captures a
    # graph per batch size) and would otherwise run into Dynamo's recompile limit.
    torch._dynamo.reset()
    compiled = torch.compile(torch_fused_add_rmsnorm, fullgraph=True, dynamic=False)

    def call(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Any:
        # The compiled graph allocates y itself; the bytes moved are the same.
        return compiled(x, r, w, EPS, weight_offset=weight_offset)

    atol, rtol = DEFAULT_TOLERANCE[dtype]
    return NormMethod("torch.compile", "peer", call, {"atol": atol, "rtol": rtol})


def _eager_call(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Any:
    r.add_(x)
    h = r.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return w * h.to(r.dtype), r


EAGER = NormMethod("torch eager", "peer", _eager_call, None)


def providers_for(device: str) -> list[tuple[str, Any]]:
    """``(origin, provider)`` of every norm-kernel provider known here: installed plugins' and the
    core's (a provider added later appears here without a change to this benchmark)."""
    from layer_boundary import BoundaryContext

    return BoundaryContext.discover(device=device).norm_candidates()


def norm_methods(providers: Sequence[tuple[str, Any]],
                 request: NormRequest) -> tuple[list[NormMethod], list[dict[str, Any]]]:
    """The providers' methods for ``request`` and the providers that refused it, with why."""
    methods: list[NormMethod] = []
    refused: list[dict[str, Any]] = []
    for origin, prov in providers:
        why = prov.refuse(request)
        if why is None:
            try:
                methods.append(_provider_method(origin, prov, request))
                continue
            except Exception as e:  # one broken provider must not end the run
                why = f"kernels() raised {type(e).__name__}: {e}"
        refused.append({"method": prov.name, "origin": origin, "hidden": request.hidden_size,
                        "refused": why})
    return methods, refused


def peer_methods(dtype: torch.dtype, *, compile: bool, weight_offset: float = 0.0) -> list[NormMethod]:
    """torch.compile of the reference (compiled afresh for each shape) and torch eager (plain
    RMSNorm only: EAGER is written for weight offset 0)."""
    return (([_compiled_method(dtype, weight_offset)] if compile else [])
            + ([EAGER] if weight_offset == 0.0 else []))


def _check(method: NormMethod, got: tuple[torch.Tensor, torch.Tensor],
           want: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, Optional[bool]]:
    err = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))
    if method.tolerance is None:
        return err, None
    ok = all(torch.allclose(g.float(), w.float(), **method.tolerance) for g, w in zip(got, want))
    return err, ok


def measure_shape(method: NormMethod, tokens: int, hidden: int, dtype: torch.dtype, device: str,
                  plan: TimingPlan, inputs: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """Check ``method`` once against the reference, then time it with the residual updated in
    place (its values drift over the calls; the time does not depend on them)."""
    x0, r0, w, want_y, want_r = inputs
    row: dict[str, Any] = {"method": method.name, "origin": method.origin, "hidden": hidden,
                           "tokens": tokens, "dtype": str(dtype).replace("torch.", "")}
    x, r = x0.clone(), r0.clone()  # a method may write over its input (input_as_out)
    y = torch.empty_like(x)
    try:
        got = method.call(x, r, w, y)
        row["max_err"], row["ok"] = _check(method, got, (want_y, want_r))
        m = time_call(lambda: method.call(x, r, w, y), device, plan)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
        return row
    moved = 4 * hidden * x.element_size() * tokens
    row.update(us=m.median_us, min_us=m.min_us, calls=m.calls, replays=m.replays,
               gbps=moved / m.median_us / 1e3)
    return row


def _inputs(tokens: int, hidden: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=device).manual_seed(tokens * 100003 + hidden)
    x = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
    r = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
    w = (1.0 + 0.1 * torch.randn(hidden, generator=g, device=device)).to(dtype)
    want_y, want_r = fused_add_rmsnorm_ref(x, r, w, EPS)
    return x, r, w, want_y, want_r


COLUMNS = [
    report.Column("method", "method", width=22),
    report.Column("origin", "origin", width=12),
    report.Column("H", "hidden", "d", 6),
    report.Column("T", "tokens", "d", 6),
    report.Column("µs", "us", report.sig, 9),
    report.Column("GB/s", "gbps", report.sig, 7),
    report.Column("% copy", "pct_copy", ".1f", 7),
    report.Column("check", "check", width=6),
]


def run_norm(tokens: Sequence[int], hidden: Sequence[int], dtype: torch.dtype, device: str,
             plan: TimingPlan, *, compile: bool, copy_bytes: int,
             out: Callable[[str], None] = print) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """``(copy bandwidth, rows, refusals)``; rows are printed as they are measured."""
    copy = reported_copy_bandwidth(device, copy_bytes, plan, out)
    providers = providers_for(device)
    table = report.Table(COLUMNS, out)
    rows: list[dict[str, Any]] = []
    refusals: list[dict[str, Any]] = []
    # no_grad rather than inference_mode: torch.compile then traces ordinary tensors.
    with torch.no_grad():
        for h in hidden:
            request = NormRequest(torch.device(device).type, dtype, h)
            base, refused = norm_methods(providers, request)
            refusals += refused
            for r in refused:
                out(f"{r['method']} ({r['origin']}) refuses {request.describe()}: {r['refused']}")
            table.header()
            for t in tokens:
                inputs = _inputs(t, h, dtype, device)
                for method in base + peer_methods(dtype, compile=compile):
                    row = measure_shape(method, t, h, dtype, device, plan, inputs)
                    if "gbps" in row:
                        row["pct_copy"] = 100.0 * row["gbps"] / copy["gbps"]
                    row["check"] = "error" if "error" in row else {True: "ok", False: "FAIL", None: "-"}[row.get("ok")]
                    rows.append(row)
                    table.row(row)
                    if "error" in row:
                        out(f"  {method.name}: {row['error']}")
                del inputs
    return copy, rows, refusals


def norm_panels(rows: Sequence[dict[str, Any]], copy_gbps: float) -> list[report.Panel]:
    panels = []
    for h in sorted({r["hidden"] for r in rows}):
        mine = [r for r in rows if r["hidden"] == h and "gbps" in r]
        names = list(dict.fromkeys(r["method"] for r in mine))
        series = [report.Series(n, tuple((r["tokens"], r["gbps"]) for r in mine if r["method"] == n))
                  for n in names]
        ts = [r["tokens"] for r in mine]
        if ts:
            series.append(report.Series("copy bandwidth", ((min(ts), copy_gbps), (max(ts), copy_gbps)), dashed=True))
        panels.append(report.Panel(f"H = {h}", "tokens", "GB/s", tuple(series)))
    return panels


def norm_command(args: argparse.Namespace) -> int:
    device = args.device
    if device == "cuda":
        why = cuda_unavailable("norm")
        if why:
            print(why, file=sys.stderr)
            return 2
    dtype = DTYPES[args.dtype]
    quick_tokens, quick_hidden = QUICK[device]
    tokens = args.tokens or (quick_tokens if args.quick else NORM_TOKENS)
    hidden = args.hidden or (quick_hidden if args.quick else NORM_HIDDEN)
    plan = TimingPlan.for_run(args.quick, args.replays)
    env = report.environment(device)
    timing = "CUDA-graph replay" if device == "cuda" else "wall clock"
    print(f"layer-boundary bench norm: add+RMSNorm (residual in place), {args.dtype}, "
          f"{env['gpu'] or env['cpu']}, torch {env['torch']}, {env['date']}; median µs by {timing} "
          f"over {plan.replays} replays; bytes = 4·H·{torch.empty((), dtype=dtype).element_size()} per token")
    compile = not args.no_compile
    copy, rows, refusals = run_norm(tokens, hidden, dtype, this_device(device), plan, compile=compile,
                                    copy_bytes=COPY_BYTES[device][1 if args.quick else 0])
    report.publish(args, "norm", env, rows, f"add+RMSNorm, {args.dtype}, residual in place",
                   norm_panels(rows, copy["gbps"]), copy=copy, refused=refusals, eps=EPS,
                   bytes_per_token=f"4*H*{torch.empty((), dtype=dtype).element_size()}",
                   timing=timing, replays=plan.replays)
    return report.exit_status(rows)
