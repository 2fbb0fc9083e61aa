"""Workers for the FlashInfer plugin's multi-process tests (spawned ranks).

On gloo (CPU), FlashInfer is the test double (``flashinfer_double``) and the fusion provider is
the plugin's own class with two facts of this machine changed: it accepts a gloo group and skips
the CUDA check. Everything else, workspaces, the call it makes, the declines and the agreement
across ranks, is the plugin's. On NCCL (2 GPUs) everything is real.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from layer_boundary import BoundaryContext, ForwardBatch, declare_attn, declare_ffn, make_stages
from layer_boundary._layout import BatchVariant
from layer_boundary._norms import GemmaRMSNorm, RMSNorm
from layer_boundary._plugins import PluginRegistry

import flashinfer_double
import fused_cases
import parallel_cases


def norm_inputs(t: int, h: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A contribution, a residual and a norm weight (CPU tensors, seeded)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    r = torch.randn(t, h, generator=g).to(dtype)
    w = (torch.rand(h, generator=g) + 0.5).to(dtype)
    return x, r, w


def gloo_provider(**kw: Any) -> Any:
    from layer_boundary_flashinfer.fusion import FlashInferAllReduceNorm

    class GlooFlashInfer(FlashInferAllReduceNorm):
        backends = frozenset({"gloo"})

        def device_refusal(self) -> Optional[str]:
            return None

    return GlooFlashInfer(**kw)


def _registry(provider: Any, *, with_hooks: bool = True) -> PluginRegistry:
    """``provider``, then the plugin's real hooks (whose providers refuse this machine: gloo,
    CPU). ``provider`` comes first because the first provider that answers an output decision
    (``can_defer_all_reduce``) makes it."""
    registry = PluginRegistry([])
    registry.register(fused_cases.ProviderPlugin(provider), name="flashinfer-test")
    if with_hooks:
        import layer_boundary_flashinfer.hooks as hooks

        registry.register(hooks, name="flashinfer")
    return registry


def _calls(double: Any, name: str) -> list[dict]:
    return [info for n, info in double.calls if n == name]


def _stages(ctx: BoundaryContext, hidden: int, dtype: torch.dtype, gemma: bool, device: str) -> tuple[Any, Any]:
    norm_cls = GemmaRMSNorm if gemma else RMSNorm
    norms = [norm_cls(hidden, dtype=dtype).to(device) for _ in range(2)]
    g = torch.Generator().manual_seed(7)
    for n in norms:
        n.weight.data.copy_((torch.randn(hidden, generator=g) * 0.1 + 1).to(dtype))
    stages = make_stages((declare_attn(), norms[0]), (declare_ffn(), norms[1]), previous=declare_ffn(), context=ctx)
    ctx.freeze()
    return stages


def _inputs(t: int, hidden: int, dtype: torch.dtype, rank: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, hidden, generator=g) * (rank + 1)).to(dtype).to(device)
    g.manual_seed(seed + 1)  # the residual is replicated: the same on every rank
    return x, torch.randn(t, hidden, generator=g).to(dtype).to(device)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in rows that start one element past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = flat[1:].view(t.shape)
    out.copy_(t)
    return out


# -- gloo: the model and the candidate over the double ---------------------------------------------

def gloo_cases(rank: int, world: int, cases: list[dict[str, Any]]) -> dict[str, Any]:
    double = flashinfer_double.install()
    out = {"model": _model_case(rank, world, double), "candidate": [_candidate_case(rank, world, double, c) for c in cases]}
    out["gemma_unsupported_on_rank_1"] = _mixed_versions_case(rank, world)
    return out


def _model_case(rank: int, world: int, double: Any) -> dict[str, Any]:
    """Qwen3 fp32 on TP=world: the plugin's candidate completes attention's sums at the FFN input
    and, deferred by the same provider, the FFN's at the next attention input; the logits equal
    the unfused model's bit for bit (in fp32 the double's rounded residual is the FP32 sum)."""
    topo = parallel_cases.topology(world, 1)
    ids = [3, 17, 5, 99, 42, 7, 1]
    base = fused_cases._logits(fused_cases._qwen3(BoundaryContext(topo, core_fusion=False), torch.float32, "cpu"),
                               ids, "cpu")
    prov = gloo_provider(max_tokens=64)
    ctx = BoundaryContext(topo, registry=_registry(prov), core_fusion=False)
    model = fused_cases._qwen3(ctx, torch.float32, "cpu")
    before = len(double.calls)
    logits = fused_cases._logits(model, ids, "cpu")
    runs = [info for n, info in double.calls[before:] if n == "allreduce_fusion"]
    rows = [s for s in ctx.report.selections if s.what == "consumer fusion"]
    return {
        "equal": torch.equal(logits, base), "calls": len(runs), "layers": len(model.model.layers),
        "workspaces": _calls(double, "create_allreduce_fusion_workspace"),
        "chosen": sorted({str(s.chosen) for s in rows}),
        "refused": sorted({f"{c.origin}: {c.refused}" for s in rows for c in s.candidates if c.refused}),
        "norm_rows": sorted({s.text() for s in ctx.report.selections if s.what == "norm kernels"}),
        "flags": sorted({(r["fp32_acc"], r["launch_with_pdl"], r["trigger_completion_at_end"], r["residual_in_place"],
                          r["output_is_norm_out"], r["norm_out_is_input"]) for r in runs}),
    }


def _candidate_case(rank: int, world: int, double: Any, case: dict[str, Any]) -> dict[str, Any]:
    """The FFN input's candidate called directly against the group's all-reduce + the reference."""
    dtype, hidden = getattr(torch, case["dtype"]), case["hidden"]
    prov = gloo_provider(max_tokens=case["max_tokens"], oneshot_max_tokens=case.get("oneshot"))
    ctx = BoundaryContext(parallel_cases.topology(world, 1), registry=_registry(prov, with_hooks=False),
                          core_fusion=False)
    created = len(_calls(double, "create_allreduce_fusion_workspace"))
    attn, ffn = _stages(ctx, hidden, dtype, case.get("gemma", False), "cpu")
    cands = ffn.plan.entries[BatchVariant.ORDINARY].candidates
    row: dict[str, Any] = {"case": case, "candidates": [c.name for c in cands],
                           "workspaces": len(_calls(double, "create_allreduce_fusion_workspace")) - created,
                           "oneshot_rows": prov.oneshot_rows(_fused_of(ffn.plan, prov)) if cands else None}
    if not cands:
        row["report"] = [s.text() for s in ctx.report.selections]
        return row
    cand, read = cands[0], ffn.plan.read
    worst, runs, declined, problems = 0.0, [], [], []
    for i, t in enumerate(case["tokens"]):
        x, r = _inputs(t, hidden, dtype, rank, 100 + t, "cpu")
        if case.get("misaligned") and i % 2:
            x, r = _misaligned(x), _misaligned(r)
        x0, r_ptr = x.clone(), r.data_ptr()
        want_y, want_r = fused_cases.reference_sum(x, r, read)
        before = len(double.calls)
        got = cand(x, r, read, ForwardBatch(num_tokens=t))
        new = [info for n, info in double.calls[before:] if n == "allreduce_fusion"]
        if got is None:
            declined.append(t)
            if new or not torch.equal(x, x0):
                problems.append(f"T={t}: declined after calling FlashInfer or touching x")
            continue
        y, r2 = got
        if not torch.equal(x, x0):
            problems.append(f"T={t}: the contribution was overwritten")
        if r2 is not r or r.data_ptr() != r_ptr:
            problems.append(f"T={t}: the residual was not updated in place")
        if not torch.equal(r2, want_r):
            problems.append(f"T={t}: residual differs from all-reduce + reference")
        if y.dtype != dtype or y.shape != x.shape:
            problems.append(f"T={t}: output {y.dtype} {tuple(y.shape)}")
        worst = max(worst, (y.float() - want_y.float()).abs().max().item())
        runs.append({k: new[0][k] for k in ("tokens", "use_oneshot", "fp32_acc", "launch_with_pdl",
                                           "trigger_completion_at_end", "weight_bias", "residual_in_place",
                                           "output_is_norm_out", "norm_out_is_input")} if len(new) == 1 else
                    {"calls": len(new)})
    row.update(worst_y=worst, runs=runs, declined=declined, problems=problems,
               defer={t: prov.can_defer_all_reduce(attn.plan, ForwardBatch(num_tokens=t)) for t in (0, 1, case["max_tokens"], case["max_tokens"] + 1)})
    return row


def _fused_of(plan: Any, prov: Any) -> Any:
    from layer_boundary._fusion import FusedSum
    from layer_boundary._layout import SumGroup

    w = plan.read.weight
    return FusedSum(SumGroup.ATTN_TP, plan.topology.attn_tp, int(w.shape[0]), w.dtype, float(plan.read.offset), None)


def _mixed_versions_case(rank: int, world: int) -> dict[str, Any]:
    """A FlashInfer without Gemma in its fused all-reduce on rank 1 only: every rank refuses."""
    double = flashinfer_double.install(weight_bias=rank != 1)
    prov = gloo_provider(max_tokens=16)
    ctx = BoundaryContext(parallel_cases.topology(world, 1), registry=_registry(prov, with_hooks=False),
                          core_fusion=False)
    attn, ffn = _stages(ctx, 64, torch.bfloat16, True, "cpu")
    rows = [s for s in ctx.report.selections if s.what == "consumer fusion"]
    return {"chosen": sorted({str(s.chosen) for s in rows}),
            "refused": sorted({c.refused for s in rows for c in s.candidates if c.refused}),
            "workspaces": len(_calls(double, "create_allreduce_fusion_workspace"))}


# -- NCCL: the real FlashInfer on 2 GPUs ------------------------------------------------------------

def nccl_cases(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The plugin's candidate (real FlashInfer) against NCCL all-reduce + the torch reference,
    replayed in a CUDA graph and run back to back without host syncs."""
    from layer_boundary_flashinfer.fusion import FlashInferAllReduceNorm

    topo = parallel_cases.topology(world, 1)
    results = []
    for case in cases:
        dtype, hidden = getattr(torch, case["dtype"]), case["hidden"]
        prov = FlashInferAllReduceNorm(max_tokens=case.get("max_tokens", 2048), oneshot_max_tokens=case.get("oneshot"))
        ctx = BoundaryContext(topo, registry=_registry(prov, with_hooks=False), device="cuda", core_fusion=False)
        attn, ffn = _stages(ctx, hidden, dtype, case.get("gemma", False), "cuda")
        cands = ffn.plan.entries[BatchVariant.ORDINARY].candidates
        row: dict[str, Any] = {"case": case, "candidates": [c.name for c in cands]}
        if not cands:
            row["report"] = [s.text() for s in ctx.report.selections]
            results.append(row)
            continue
        cand, read = cands[0], ffn.plan.read
        worst, res_equal, kept_x, declined = 0.0, True, True, []
        for t in case["tokens"]:
            x, r = _inputs(t, hidden, dtype, rank, 100 + t, "cuda")
            x0, r_ptr = x.clone(), r.data_ptr()
            want_y, want_r = fused_cases.reference_sum(x, r, read)
            got = cand(x, r, read, ForwardBatch(num_tokens=t))
            if got is None:
                declined.append(t)
                continue
            y, r2 = got
            # Two ranks: FlashInfer's FP32 sum rounded once is NCCL's sum, so the residual is bitwise.
            res_equal &= bool(torch.equal(r2, want_r)) and r2.data_ptr() == r_ptr
            kept_x &= bool(torch.equal(x, x0))
            worst = max(worst, (y.float() - want_y.float()).abs().max().item())
        row.update(worst_y=worst, residual_equal=res_equal, kept_x=kept_x, declined=declined)
        if case.get("graph"):
            row["graph_equal"] = fused_cases._graph_equal(cand, read, hidden, dtype, rank, case["graph"])
        if case.get("repeat"):
            row["repeat_equal"] = fused_cases._repeat_equal(cand, read, hidden, dtype, rank, case["repeat"])
        results.append(row)
    return results
