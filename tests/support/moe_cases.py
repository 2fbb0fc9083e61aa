"""Worker functions for the multi-process MoE tests (importable by spawned ranks).

Two kinds of cases run in one spawn per world size:

* ``linear``: a synthetic stack of PARTIAL attention-like stages and FFNs that are either dense
  (column/row parallel) or sparse (the real ``SparseMoeBlock`` with a linear expert activation,
  a router whose top-k weights are dyadic, and optionally an ungated shared expert). With dyadic
  float64 data every sum is exact, so every layout must equal one rank bit for bit, and the
  collectives each owed sum runs are counted.
* ``qwen3_moe``: the Qwen3-MoE reference (embedded random weights, or a HF folder) on a layout,
  against the single-rank model within the per-dtype tolerance.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from layer_boundary import BoundaryContext, ForwardBatch, Topology, declare_attn, declare_ffn, make_stages
from layer_boundary_app.models.layers import ColumnParallelLinear, RowParallelLinear
from layer_boundary_app.models.moe import DeferFinalize, SparseMoeBlock
from layer_boundary._output import HandoffOutput

from parallel_cases import BoundaryStack, count_collectives, dp_rows, dyadic, topology

H, F, E, K, I, S = 8, 16, 4, 2, 8, 8  # hidden, dense FFN, experts, top-k, expert width, shared width
SLOT_WEIGHTS = (0.75, 0.25)  # dyadic top-k weights: the weighted combine stays exact


class DyadicRouter(nn.Module):
    """Top-k experts by ``x Wr^T`` (exact for dyadic data, so every rank and the single-rank
    model pick the same experts), weighted ``SLOT_WEIGHTS`` by rank of the logit.
    ``draw(shape, seed)``: the router weights' dyadic values."""

    def __init__(self, seed: int, draw: Callable[[tuple[int, ...], int], torch.Tensor] = dyadic) -> None:
        super().__init__()
        self.register_buffer("weight", draw((E, H), seed))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.topk(x @ self.weight.T, K, dim=-1).indices
        return torch.tensor(SLOT_WEIGHTS, dtype=x.dtype).expand(x.shape[0], K), ids


def _linear_act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return gate - up  # linear, so products of dyadic numbers never pile up


def _fill(lin: nn.Module, shape: tuple[int, int], seed: int, shard: Any = None, *,
          draw: Callable[[tuple[int, ...], int], torch.Tensor] = dyadic) -> None:
    full = draw(shape, seed)
    if shard is None:
        lin.weight_loader(lin.weight, full)
    else:
        lin.weight_loader(lin.weight, full, shard)


class LinearMoeLayer(nn.Module):
    def __init__(self, i: int, kinds: str, ctx: BoundaryContext, *, shared: bool, fusions: Any) -> None:
        super().__init__()
        topo = ctx.topology
        self.sparse = kinds[i] == "S"
        self.wq = ColumnParallelLinear(H, H, bias=False, group=topo.attn_tp, dtype=torch.float64)
        self.wo = RowParallelLinear(H, H, bias=False, group=topo.attn_tp, reduce_results=False,
                                    dtype=torch.float64)
        _fill(self.wq, (H, H), 100 * i + 1)
        _fill(self.wo, (H, H), 100 * i + 2)
        if self.sparse:
            self.mlp = SparseMoeBlock(H, E, K, I, topo.moe_out, renormalize=False,
                                      shared_intermediate_size=S if shared else 0, act=_linear_act,
                                      router=DyadicRouter(100 * i + 3), dtype=torch.float64)
            experts = list(self.mlp.experts) + ([self.mlp.shared_expert] if shared else [])
            for e, expert in enumerate(experts):
                width = expert.down_proj.input_size
                _fill(expert.gate_up_proj, (width, H), 100 * i + 10 + 3 * e, 0)
                _fill(expert.gate_up_proj, (width, H), 100 * i + 11 + 3 * e, 1)
                _fill(expert.down_proj, (H, width), 100 * i + 12 + 3 * e)
        else:
            up = ColumnParallelLinear(H, F, bias=False, group=topo.tp, dtype=torch.float64)
            down = RowParallelLinear(F, H, bias=False, group=topo.tp, dtype=torch.float64)
            _fill(up, (F, H), 100 * i + 4)
            _fill(down, (H, F), 100 * i + 5)
            self.mlp = nn.Sequential(up, down)
        self.n1, self.n2 = nn.Identity(), nn.Identity()

        def ffn(j: int) -> Any:
            nxt = j + 1 < len(kinds) and kinds[j + 1] == "S"
            return declare_ffn(sparse=kinds[j] == "S", next_sparse=nxt)

        options = {"fusions": fusions} if fusions is not None else {}
        self.attn, self.ffn = make_stages((declare_attn(), self.n1, options), (ffn(i), self.n2, options),
                                          previous=ffn(i - 1) if i else None,
                                          terminal=i == len(kinds) - 1, context=ctx)

    def forward(self, h: Any, fb: Any) -> Any:
        x = self.attn.prepare(h, fb)
        h = self.attn.finish(self.wo(self.wq(x)), fb)
        x = self.ffn.prepare(h, fb)
        with self.ffn.exit(fb) as out:
            y = self.mlp(x)
        return out.finish(y)


class LinearMoeStack(BoundaryStack):
    def __init__(self, kinds: str, ctx: BoundaryContext, *, shared: bool = False, defer: bool = False) -> None:
        provider = DeferFinalize() if defer else None
        super().__init__(LinearMoeLayer(i, kinds, ctx, shared=shared, fusions=provider)
                         for i in range(len(kinds)))
        self.provider = provider


@contextlib.contextmanager
def count_handoffs() -> Iterator[dict[str, int]]:
    """How many handoffs compute returned (``made``) and how many finalizes ran (``completed``)."""
    counts = {"made": 0, "completed": 0}
    init, complete = HandoffOutput.__init__, HandoffOutput.complete

    def made(self: HandoffOutput, *a: Any, **k: Any) -> None:
        counts["made"] += 1
        init(self, *a, **k)

    def completed(self: HandoffOutput) -> torch.Tensor:
        counts["completed"] += 1
        return complete(self)

    HandoffOutput.__init__, HandoffOutput.complete = made, completed  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        HandoffOutput.__init__, HandoffOutput.complete = init, complete  # type: ignore[method-assign]


def linear_moe_matrix(world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = []
    for case in cases:
        dp, counts, kinds = case["dp"], tuple(case["counts"]), case["kinds"]
        topo = topology(world, dp)
        ctx = BoundaryContext(topo, reduction=case["policy"])
        shared, defer = case.get("shared", False), case.get("defer", False)
        model = LinearMoeStack(kinds, ctx, shared=shared, defer=defer)
        ref = LinearMoeStack(kinds, BoundaryContext(Topology.single()), shared=shared)
        x, fb = dp_rows(topo, counts, scattered=case.get("scattered", False))
        with count_collectives() as n, count_handoffs() as handoffs:
            out = model(x.clone(), fb)
        want = ref(x.clone(), ForwardBatch(num_tokens=x.shape[0]))
        results.append({
            "case": case, "equal": bool(torch.equal(out, want)), "rows": out.shape[0],
            "collectives": dict(n), "handoffs": handoffs,
            "asked": model.provider.asked if model.provider is not None else 0,
            "returns": [s.chosen for s in ctx.report.selections if s.what == "output return"][:1],
        })
    return results


_SINGLE: dict[Any, torch.Tensor] = {}


def _single(spec: Any) -> torch.Tensor:
    """Single-rank logits, once per model and input (policy and deferral do not change them)."""
    from layer_boundary_app.models.runner import single_rank_logits

    key = (spec.sequences, spec.dtype, spec.model, spec.moe, tuple(sorted(spec.config_overrides.items())))
    if key not in _SINGLE:
        _SINGLE[key] = single_rank_logits(spec)
    return _SINGLE[key]


def qwen3_moe_matrix(world: int, cases: list[dict[str, Any]], folder: Optional[str]) -> list[dict[str, Any]]:
    from layer_boundary_app.models.runner import RunSpec, build_model, rank_forward

    results = []
    for case in cases:
        pp, dp = case.get("pp", 1), case.get("dp", 1)
        tp = world // pp
        spec = RunSpec(sequences=tuple(tuple(s) for s in case["sequences"]), tp=tp, dp=dp, pp=pp,
                       reduction=case.get("policy", "ar"), dtype=case.get("dtype", "float64"),
                       model=folder if case.get("hf") else None, moe=not case.get("hf"), plugins=False,
                       defer_moe_finalize=case.get("defer", False),
                       config_overrides=case.get("config", {}),
                       input_scattered=case.get("scattered", False))
        model = build_model(spec, topology(tp, dp, pp), "cpu")
        with count_handoffs() as handoffs:
            idx, logits, _ = rank_forward(model, spec, "cpu")
        want = _single(spec)[idx] if idx else logits[:0]
        layers = model.model.layers
        results.append({
            "case": case, "rows": len(idx), "tokens": idx, "logits": logits if case.get("hf") else None,
            "max_diff": (logits - want).abs().max().item() if idx else 0.0,
            "scale": want.abs().max().item() if idx else 0.0,
            "handoffs": handoffs, "sparse": [layer.is_sparse for layer in layers],
            "layer_ids": [layer.layer_id for layer in layers], "pp_rank": model.topology.pp.rank,
        })
    return results


def matrix(rank: int, world: int, linear: list[dict[str, Any]], qwen: list[dict[str, Any]],
           folder: Optional[str] = None) -> dict[str, Any]:
    """Every MoE case of one world size in one spawn (process groups are created once)."""
    return {"linear": linear_moe_matrix(world, linear), "qwen3_moe": qwen3_moe_matrix(world, qwen, folder)}
