"""Workers for the AITER plugin's multi-process tests (spawned gloo ranks, CPU).

Each rank puts the AITER test double (``aiter_double``) in ``sys.modules`` and builds the
plugin's providers from it with their test seams (CPU tensors, a gloo group): the plugin's code
runs unchanged, and every AITER call it makes goes through the double's checks.
"""

from __future__ import annotations

import socket
from typing import Any

import torch
import torch.distributed as dist

from layer_boundary import BoundaryContext, ForwardBatch, declare_attn, declare_ffn, make_stages
from layer_boundary._kernels.reference import fused_add_rmsnorm_ref
from layer_boundary._layout import BatchVariant
from layer_boundary._norms import GemmaRMSNorm, RMSNorm
from layer_boundary._plugins import PluginRegistry, hookimpl
from layer_boundary_rocm_aiter.api import AiterApi
from layer_boundary_rocm_aiter.fusion import AiterAllReduceNorm
from layer_boundary_rocm_aiter.norm import AiterNormKernels

import aiter_double
import fused_cases
import parallel_cases

CANDIDATE = "aiter custom all-reduce + add + rmsnorm"


class _Plugin:
    """The plugin's providers as its hooks would return them, on CPU and gloo."""

    def __init__(self, norm: Any, fusion: Any) -> None:
        self.norm, self.fusion = norm, fusion

    @hookimpl
    def layer_boundary_norm_kernels(self) -> list[Any]:
        return [self.norm]

    @hookimpl
    def layer_boundary_fusion_providers(self) -> list[Any]:
        return [self.fusion]


def context(topology: Any, double: aiter_double.AiterDouble, **fusion_kw: Any) -> tuple[BoundaryContext, Any]:
    aiter_double.install(double)
    api = AiterApi.load()  # imports the double from sys.modules, as the hooks import aiter
    fusion = AiterAllReduceNorm(api, device_type="cpu", backends=("gloo",), **fusion_kw)
    registry = PluginRegistry([])
    registry.register(_Plugin(AiterNormKernels(api, device_types=("cpu",)), fusion), name="aiter")
    return BoundaryContext(topology, registry=registry), fusion


def _report(ctx: BoundaryContext, what: str) -> tuple[list[str], list[str]]:
    rows = [s for s in ctx.report.selections if s.what == what]
    chosen = sorted({str(s.chosen) for s in rows})
    refused = sorted({c.refused for s in rows for c in s.candidates if c.refused and c.origin == "aiter"})
    return chosen, refused


def model_cases(rank: int, world: int) -> dict[str, Any]:
    """Qwen3 (4 layers, H=64) on TP=world through the plugin, against the model without plugins."""
    topo = parallel_cases.topology(world, 1)
    ids = [3, 17, 5, 99, 42, 7, 1]
    out: dict[str, Any] = {}
    base = {dt: fused_cases._logits(fused_cases._qwen3(BoundaryContext(topo, core_fusion=False), dt, "cpu"), ids, "cpu")
            for dt in (torch.bfloat16, torch.float32)}
    cases = {
        "no_defer": (dict(defer_ffn_sums=False), {}, torch.bfloat16),
        "defer": ({}, {}, torch.bfloat16),
        "over_limit": (dict(max_tokens=4), {}, torch.bfloat16),
        "rank1_no_library": ({}, {"custom_ar": rank != 1}, torch.bfloat16),
        "float32": ({}, {}, torch.float32),
    }
    for name, (fusion_kw, double_kw, dtype) in cases.items():
        double = aiter_double.AiterDouble(**double_kw)
        ctx, fusion = context(topo, double, **fusion_kw)
        model = fused_cases._qwen3(ctx, dtype, "cpu")
        logits = fused_cases._logits(model, ids, "cpu")
        fusion_chosen, fusion_refused = _report(ctx, "consumer fusion")
        norm_chosen, norm_refused = _report(ctx, "norm kernels")
        out[name] = {
            "equal": torch.equal(logits, base[dtype]), "layers": len(model.model.layers),
            "all_reduces": double.calls["CustomAllreduce.all_reduce"],
            "add_norms": double.calls["rmsnorm2d_fwd_with_add"], "norms": double.calls["rmsnorm2d_fwd"],
            "workspaces": len(double.workspaces), "chosen": fusion_chosen, "refusals": fusion_refused,
            "norm_chosen": norm_chosen, "norm_refusals": norm_refused,
        }
    out["two_hosts"] = _two_hosts(rank, topo)
    out["direct"] = _direct(rank, topo)
    out["static"] = _static_refusals(topo)
    return out


def _two_hosts(rank: int, topo: Any) -> dict[str, Any]:
    real = socket.gethostname
    socket.gethostname = lambda: f"node{rank}"  # type: ignore[assignment]
    try:
        double = aiter_double.AiterDouble()
        ctx, _ = context(topo, double)
        _stage_pair(ctx, 64, torch.bfloat16)
        return {"refusals": _report(ctx, "consumer fusion")[1], "workspaces": len(double.workspaces)}
    finally:
        socket.gethostname = real  # type: ignore[assignment]


def _stage_pair(ctx: BoundaryContext, hidden: int, dtype: torch.dtype, gemma: bool = False) -> tuple[Any, Any]:
    norm = GemmaRMSNorm if gemma else RMSNorm
    stages = make_stages((declare_attn(), norm(hidden, dtype=dtype)), (declare_ffn(), norm(hidden, dtype=dtype)),
                         previous=declare_ffn(), context=ctx)
    return stages[0], stages[1]


def _direct(rank: int, topo: Any) -> dict[str, Any]:
    """The FFN input's candidate called as the boundary calls it, on a row-strided contribution."""
    double = aiter_double.AiterDouble()
    ctx, _ = context(topo, double, max_tokens=16)
    _, ffn = _stage_pair(ctx, 64, torch.bfloat16)
    cands = ffn.plan.entries[BatchVariant.ORDINARY].candidates
    read = ffn.plan.read
    with torch.no_grad():
        read.norm.weight.copy_(torch.linspace(0.5, 1.5, 64).to(torch.bfloat16))
    g = torch.Generator().manual_seed(11)
    wide = (torch.randn(5, 128, generator=g) * (rank + 1)).to(torch.bfloat16)
    x = wide[:, 32:96]  # rows 128 apart: the IPC copy must not read them as one span
    residual = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    x0, r0 = x.clone(), residual.clone()
    total = x.contiguous()
    dist.all_reduce(total)
    want_y, want_r = fused_add_rmsnorm_ref(total, residual.clone(), read.weight, read.eps)
    y, r_new = cands[0](x, residual, read, ForwardBatch(num_tokens=5))
    declined = cands[0](torch.zeros(17, 64, dtype=torch.bfloat16), torch.zeros(17, 64, dtype=torch.bfloat16),
                        read, ForwardBatch(num_tokens=17))
    return {
        "candidates": [c.name for c in cands], "y_equal": torch.equal(y, want_y), "r_equal": torch.equal(r_new, want_r),
        "inputs_untouched": torch.equal(x, x0) and torch.equal(residual, r0),
        "residual_out_of_place": r_new.data_ptr() != residual.data_ptr(),
        "declined_over_limit": declined is None, "all_reduces": double.calls["CustomAllreduce.all_reduce"],
    }


def _static_refusals(topo: Any) -> dict[str, list[str]]:
    out = {}
    for name, hidden, dtype, gemma in (("wide", 8200, torch.bfloat16, False), ("odd_bytes", 60, torch.bfloat16, False),
                                       ("gemma", 64, torch.bfloat16, True), ("fp16", 64, torch.float16, False)):
        double = aiter_double.AiterDouble()
        ctx, _ = context(topo, double)
        _stage_pair(ctx, hidden, dtype, gemma)
        out[name] = _report(ctx, "consumer fusion")[1] + [f"workspaces={len(double.workspaces)}"]
    return out
