"""Workers for the fused all-reduce + add + RMSNorm candidate tests (spawned ranks).

``EchoFusion`` is a gloo-capable provider built on the core's ``AllReduceNormProvider``: its run
is the group's all-reduce followed by the torch reference, so a model that takes it must give
the unfused path's numbers bit for bit, and the number of its calls is the number of owed sums
it completed.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from layer_boundary import BoundaryContext, ForwardBatch
from layer_boundary._fusion import AllReduceNormProvider, FusedSum, WorkspaceUnavailable
from layer_boundary._kernels.reference import fused_add_rmsnorm_ref
from layer_boundary._plugins import PluginRegistry, hookimpl

import parallel_cases


class EchoFusion(AllReduceNormProvider):
    name = "echo-fusion"
    candidate_name = "echo all-reduce + add + rmsnorm"
    backends = frozenset({"gloo", "nccl"})

    def __init__(self, max_tokens: int = 64, refuse_on_rank: Optional[int] = None, defer: bool = False,
                 late_on_rank: Optional[int] = None) -> None:
        super().__init__(max_tokens)
        self.refuse_on_rank = refuse_on_rank
        self.late_on_rank = late_on_rank
        self.defer = defer
        self.calls = 0
        self.workspaces = 0

    def local_refusal(self, fused: FusedSum) -> Optional[str]:
        if fused.group.rank == self.refuse_on_rank:
            return f"rank {fused.group.rank} lacks the library"
        return None

    def make_workspace(self, fused: FusedSum) -> Any:
        if fused.group.rank == self.late_on_rank:
            raise WorkspaceUnavailable(f"rank {fused.group.rank} could not map the peer buffers")
        self.workspaces += 1
        return fused.group

    def run_with(self, workspace: Any, fused: FusedSum) -> Any:
        def run(x: torch.Tensor, residual: torch.Tensor, read: Any) -> tuple[torch.Tensor, torch.Tensor]:
            self.calls += 1
            total = x.clone()
            dist.all_reduce(total, group=workspace.group)
            return fused_add_rmsnorm_ref(total, residual, read.weight, read.eps, weight_offset=read.offset,
                                         residual_out=residual)
        return run

    def can_defer_all_reduce(self, plan: Any, forward_batch: Any) -> bool:
        return self.defer


class ProviderPlugin:
    """A plugin whose only hook offers ``provider`` as a fusion provider."""

    def __init__(self, provider: Any) -> None:
        self.provider = provider

    @hookimpl
    def layer_boundary_fusion_providers(self) -> list[Any]:
        return [self.provider]


def context_with(provider: Any, topology: Any, **kw: Any) -> BoundaryContext:
    registry = PluginRegistry([])
    registry.register(ProviderPlugin(provider), name="echo")
    return BoundaryContext(topology, registry=registry, **kw)


def reference_sum(x: torch.Tensor, residual: torch.Tensor, read: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """What a candidate must return for this rank's contribution ``x``: the world's all-reduce,
    then the torch add + RMSNorm reference (on copies: the candidate gets the originals)."""
    total = x.clone()
    dist.all_reduce(total)
    return fused_add_rmsnorm_ref(total, residual.clone(), read.weight, read.eps, weight_offset=read.offset)


def _qwen3(ctx: BoundaryContext, dtype: torch.dtype, device: str) -> Any:
    from layer_boundary_app.models.config import small_random_config
    from layer_boundary_app.models.qwen3 import Qwen3ForCausalLM
    from layer_boundary_app.models.random_init import init_random_weights

    model = Qwen3ForCausalLM(small_random_config(), context=ctx, dtype=dtype)
    init_random_weights(model, seed=0)
    ctx.freeze()
    return model.to(device).eval().requires_grad_(False)


def _logits(model: Any, ids: list[int], device: str) -> torch.Tensor:
    t = torch.tensor(ids, device=device)
    fb = ForwardBatch(num_tokens=len(ids), positions=torch.arange(len(ids), device=device), seq_lens=(len(ids),))
    with torch.inference_mode():
        return model(t, fb.positions, fb).float().cpu()


def model_cases(rank: int, world: int, device: str = "cpu") -> dict[str, Any]:
    """Qwen3 on TP=world with the echo provider (deferring FFN sums or not), a declining token
    count, a rank that refuses, and attention DP; each against the model without fusion."""
    topo = parallel_cases.topology(world, 1)
    ids = [3, 17, 5, 99, 42, 7, 1]
    base = _logits(_qwen3(BoundaryContext(topo, core_fusion=False), torch.float32, device), ids, device)
    out: dict[str, Any] = {}
    for name, kw in (("attn_sum", {}), ("both_sums", {"defer": True}), ("over_limit", {"max_tokens": 4}),
                     ("rank1_refuses", {"refuse_on_rank": 1})):
        prov = EchoFusion(**kw)
        ctx = context_with(prov, topo)
        model = _qwen3(ctx, torch.float32, device)
        logits = _logits(model, ids, device)
        fusion_rows = [s for s in ctx.report.selections if s.what == "consumer fusion"]
        out[name] = {
            "equal": torch.equal(logits, base), "calls": prov.calls, "workspaces": prov.workspaces,
            "layers": len(model.model.layers),
            "chosen": sorted({str(s.chosen) for s in fusion_rows}),
            "refusals": sorted({c.refused for s in fusion_rows for c in s.candidates
                                if c.refused and c.origin == "echo"}),
        }
    if world % 2 == 0:
        prov = EchoFusion()
        ctx = context_with(prov, parallel_cases.topology(world, 2))
        _qwen3(ctx, torch.float32, device)
        out["dp"] = {"refusals": sorted({c.refused for s in ctx.report.selections for c in s.candidates
                                         if c.refused and c.origin == "echo"}), "workspaces": prov.workspaces}
    return out


def late_refusal(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 turns the workspace down after the static checks passed everywhere."""
    topo = parallel_cases.topology(world, 1)
    ids = [3, 17, 5]
    base = _logits(_qwen3(BoundaryContext(topo, core_fusion=False), torch.float32, "cpu"), ids, "cpu")
    prov = EchoFusion(late_on_rank=1)
    ctx = context_with(prov, topo)
    logits = _logits(_qwen3(ctx, torch.float32, "cpu"), ids, "cpu")
    return {"equal": torch.equal(logits, base), "calls": prov.calls,
            "workspaces": prov.workspaces if rank != 1 else 0,
            "refusals": sorted({c.refused for s in ctx.report.selections for c in s.candidates
                                if c.refused and c.origin == "echo"})}


def symm_mem_cases(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The core symmetric-memory candidate against NCCL all-reduce + the torch reference."""
    from layer_boundary import Topology, declare_attn, declare_ffn, make_stages
    from layer_boundary._layout import BatchVariant
    from layer_boundary._norms import GemmaRMSNorm, RMSNorm

    topo = parallel_cases.topology(world, 1)
    results = []
    for case in cases:
        dtype = getattr(torch, case["dtype"])
        hidden = case["hidden"]
        norm_cls = GemmaRMSNorm if case.get("gemma") else RMSNorm
        ctx = BoundaryContext(topo, device="cuda")
        norms = [norm_cls(hidden, dtype=dtype).cuda() for _ in range(2)]
        g = torch.Generator(device="cuda").manual_seed(7)
        for n in norms:
            n.weight.data.copy_(torch.randn(hidden, generator=g, device="cuda").to(dtype) * 0.1 + 1)
        attn, ffn = make_stages((declare_attn(), norms[0]), (declare_ffn(), norms[1]),
                                previous=declare_ffn(), context=ctx)
        ctx.freeze()
        cands = ffn.plan.entries[BatchVariant.ORDINARY].candidates
        row: dict[str, Any] = {"case": case, "candidates": [c.name for c in cands]}
        if not cands:
            row["report"] = [s.text() for s in ctx.report.selections]
            results.append(row)
            continue
        cand, read = cands[0], ffn.plan.read
        worst_y, res_equal, declined = 0.0, True, []
        for t in case["tokens"]:
            x, r = _inputs(t, hidden, dtype, rank, 100 + t)
            want_y, want_r = reference_sum(x, r, read)
            got = cand(x, r, read, ForwardBatch(num_tokens=t))
            if got is None:
                declined.append(t)
                continue
            y, r2 = got
            res_equal &= torch.equal(r2, want_r) and r2.data_ptr() == r.data_ptr()
            worst_y = max(worst_y, (y.float() - want_y.float()).abs().max().item() if t else 0.0)
        row.update(worst_y=worst_y, residual_equal=res_equal, declined=declined)
        if case.get("graph"):
            row["graph_equal"] = _graph_equal(cand, read, hidden, dtype, rank, case["graph"])
        if case.get("repeat"):
            row["repeat_equal"] = _repeat_equal(cand, read, hidden, dtype, rank, case["repeat"])
        results.append(row)
    return results


def _inputs(t: int, hidden: int, dtype: torch.dtype, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, hidden, generator=gen, device="cuda").to(dtype) * (rank + 1)
    return x, torch.randn(t, hidden, generator=gen, device="cuda").to(dtype)


def _graph_equal(cand: Any, read: Any, hidden: int, dtype: torch.dtype, rank: int, t: int) -> bool:
    """Captured in a CUDA graph (20 calls chained through the residual), replay == eager."""
    x, r0 = _inputs(t, hidden, dtype, rank, 5)
    fb = ForwardBatch(num_tokens=t)

    def chain(r: torch.Tensor) -> torch.Tensor:
        y = None
        for _ in range(20):
            y, r = cand(x, r, read, fb)
        return y

    eager = chain(r0.clone())
    r_static = r0.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(r0.clone())  # warm up (Triton compiles outside the capture)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = chain(r_static)
    r_static.copy_(r0)
    graph.replay()
    torch.cuda.synchronize()
    return bool(torch.equal(y_static, eager))


def _repeat_equal(cand: Any, read: Any, hidden: int, dtype: torch.dtype, rank: int, n: int) -> bool:
    """n back-to-back calls with fresh inputs, no host sync between them (the barriers alone keep
    a fast rank from overwriting rows a slow one still reads); compared at the end."""
    outs, wants = [], []
    for i in range(n):
        t = 1 + (i * 37) % 300
        x, r = _inputs(t, hidden, dtype, rank, 1000 + i)
        wants.append(reference_sum(x, r, read)[1])
        outs.append(cand(x, r, read, ForwardBatch(num_tokens=t))[1])
    torch.cuda.synchronize()
    return all(torch.equal(a, b) for a, b in zip(outs, wants))
