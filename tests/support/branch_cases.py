"""Worker functions for the branch tests (importable by spawned ranks), and the synthetic stack.

The synthetic stack has two layer shapes, each in two schedules (which branch's output is set
aside with ``branch_output`` and which one it is merged into):

* ``L`` (LongCat-like): attention A0, then a sparse FFN S that reads the residual; a dense chain
  F1 -> A1 -> F2 is ``prepared_from`` S and starts from S's input. ``La``: S's output is set aside
  first and merged into F2's; ``Lb``: the chain runs first, F2's output is set aside and merged
  into S's.
* ``P`` (parallel attention and MLP): attention A reads the residual, a dense FFN F is
  ``prepared_from`` A (under attention DP its input is gathered from A's rows). ``Pa``: A's output
  set aside, merged into F's; ``Pb``: F's set aside, merged into A's partial sum.

Norms are identities and weights are multiples of 1/2 in [-1/2, 1/2] (the expert activation is
linear, the router's top-k weights 3/4 and 1/4), so with quarter-integer inputs every value stays
exactly representable in float64: every layout must give the single-rank numbers bit for bit.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from layer_boundary import BoundaryContext, ForwardBatch, Topology, declare_attn, declare_ffn, make_stages
from layer_boundary._adapters.branch import branch_output, merge_branch
from layer_boundary_app.models.layers import ColumnParallelLinear, RowParallelLinear
from layer_boundary_app.models.moe import SparseMoeBlock

import moe_cases
# The MoE stack's shapes, router and linear expert activation; only the weights' values differ.
from moe_cases import E, F, H, I, K, DyadicRouter, _linear_act, count_handoffs
from parallel_cases import BoundaryStack, count_collectives, dp_rows, dyadic, topology


def halves(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Weights in {-1/2, 0, 1/2}: each matmul adds one bit of granularity and rarely grows values."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, 2, shape, generator=g).double() / 2


def _fill(lin: nn.Module, shape: tuple[int, int], seed: int, shard: Any = None) -> None:
    moe_cases._fill(lin, shape, seed, shard, draw=halves)


class Attn(nn.Module):
    """A PARTIAL attention-like stage: ``wo(wq(x))`` over attention TP, never reduced."""

    def __init__(self, topo: Topology, seed: int) -> None:
        super().__init__()
        self.wq = ColumnParallelLinear(H, H, bias=False, group=topo.attn_tp, dtype=torch.float64)
        self.wo = RowParallelLinear(H, H, bias=False, group=topo.attn_tp, reduce_results=False,
                                    dtype=torch.float64)
        _fill(self.wq, (H, H), seed)
        _fill(self.wo, (H, H), seed + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.wq(x))


class Dense(nn.Module):
    """A dense FFN over TP whose row-parallel sum obeys the exit's flags."""

    def __init__(self, topo: Topology, seed: int) -> None:
        super().__init__()
        self.up = ColumnParallelLinear(H, F, bias=False, group=topo.tp, dtype=torch.float64)
        self.down = RowParallelLinear(F, H, bias=False, group=topo.tp, dtype=torch.float64)
        _fill(self.up, (F, H), seed)
        _fill(self.down, (H, F), seed + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x))


def sparse(topo: Topology, seed: int) -> SparseMoeBlock:
    moe = SparseMoeBlock(H, E, K, I, topo.moe_out, renormalize=False, act=_linear_act,
                         router=DyadicRouter(seed, draw=halves), dtype=torch.float64)
    for e, expert in enumerate(moe.experts):
        _fill(expert.gate_up_proj, (I, H), seed + 10 + 3 * e, 0)
        _fill(expert.gate_up_proj, (I, H), seed + 11 + 3 * e, 1)
        _fill(expert.down_proj, (H, I), seed + 12 + 3 * e)
    return moe


class DeferBoth:
    """Fusion provider that asks every exit to defer its finalize and its sum (where the plan
    allows), so outputs reach branch_output and merge_branch still owing work."""

    name = "test-defer-both"

    def __init__(self) -> None:
        self.asked = 0

    def can_defer_finalize(self, plan: Any, forward_batch: Any) -> bool:
        self.asked += 1
        return True

    def can_defer_all_reduce(self, plan: Any, forward_batch: Any) -> bool:
        return True


def _exit(boundary: Any, compute: nn.Module, x: torch.Tensor, fb: Any) -> Any:
    with boundary.exit(fb) as out:
        y = compute(x)
    return out.finish(y)


def _producer(code: str) -> Any:
    """The declaration of what a layer's merged output was produced by (the next layer's
    ``previous``): the stage whose output the other branch is merged into."""
    return {"La": declare_ffn(), "Lb": declare_ffn(sparse=True), "Pa": declare_ffn(),
            "Pb": declare_attn()}[code]


class LLayer(nn.Module):
    def __init__(self, i: int, schedule: str, previous: Any, terminal: bool, ctx: BoundaryContext,
                 options: dict) -> None:
        super().__init__()
        topo = ctx.topology
        self.schedule = schedule
        self.attn0, self.attn1 = Attn(topo, 100 * i), Attn(topo, 100 * i + 10)
        self.moe = sparse(topo, 100 * i + 20)
        self.ffn1, self.ffn2 = Dense(topo, 100 * i + 70), Dense(topo, 100 * i + 80)
        ident = nn.Identity()
        self.a0, self.s = make_stages((declare_attn(), ident, options),
                                      (declare_ffn(sparse=True), ident, options),
                                      previous=previous, terminal=terminal and schedule == "b",
                                      context=ctx)
        self.f1, self.a1, self.f2 = make_stages(
            (declare_ffn(), ident, options), (declare_attn(), ident, options),
            (declare_ffn(), ident, options),
            prepared_from=self.s.declaration, terminal=terminal and schedule == "a", context=ctx)

    def chain(self, x: torch.Tensor, fb: Any) -> Any:
        h = _exit(self.f1, self.ffn1, self.f1.branch_input(self.s, x, fb), fb)
        y = self.a1.prepare(h, fb)
        h = self.a1.finish(self.attn1(y), fb)
        return _exit(self.f2, self.ffn2, self.f2.prepare(h, fb), fb)

    def forward(self, h: Any, fb: Any) -> Any:
        x = self.a0.prepare(h, fb)
        h = self.a0.finish(self.attn0(x), fb)
        x = self.s.prepare(h, fb)
        if self.schedule == "a":
            side = branch_output(_exit(self.s, self.moe, x, fb), fb)
            return merge_branch(self.chain(x, fb), fb, side)
        side = branch_output(self.chain(x, fb), fb)
        return merge_branch(_exit(self.s, self.moe, x, fb), fb, side)

    def plain(self, r: torch.Tensor) -> torch.Tensor:
        """The layer written out on one rank (no boundaries): the reference formula."""
        r1 = r + self.attn0(r)
        x = r1
        r2 = r1 + self.ffn1(x)
        r3 = r2 + self.attn1(r2)
        return r3 + (self.ffn2(r3) + self.moe(x))


class PLayer(nn.Module):
    def __init__(self, i: int, schedule: str, previous: Any, terminal: bool, ctx: BoundaryContext,
                 options: dict) -> None:
        super().__init__()
        topo = ctx.topology
        self.schedule = schedule
        self.attn, self.ffn = Attn(topo, 100 * i), Dense(topo, 100 * i + 50)
        ident = nn.Identity()
        (self.a,) = make_stages((declare_attn(), ident, options), previous=previous,
                                terminal=terminal and schedule == "b", context=ctx)
        (self.f,) = make_stages((declare_ffn(), ident, options), prepared_from=self.a.declaration,
                                terminal=terminal and schedule == "a", context=ctx)

    def forward(self, h: Any, fb: Any) -> Any:
        x = self.a.prepare(h, fb)
        if self.schedule == "a":
            side = branch_output(self.a.finish(self.attn(x), fb), fb)
            return merge_branch(_exit(self.f, self.ffn, self.f.branch_input(self.a, x, fb), fb), fb, side)
        side = branch_output(_exit(self.f, self.ffn, self.f.branch_input(self.a, x, fb), fb), fb)
        return merge_branch(self.a.finish(self.attn(x), fb), fb, side)

    def plain(self, r: torch.Tensor) -> torch.Tensor:
        return r + (self.attn(r) + self.ffn(r))


class BranchStack(BoundaryStack):
    """Layers from codes such as ``["La", "Pb"]``; ``defer``: every stage gets ``DeferBoth``."""

    def __init__(self, codes: list[str], ctx: BoundaryContext, defer: bool = False) -> None:
        provider = DeferBoth() if defer else None
        options = {"fusions": provider} if defer else {}
        layers = []
        for i, code in enumerate(codes):
            cls = LLayer if code[0] == "L" else PLayer
            prev = _producer(codes[i - 1]) if i else None
            layers.append(cls(i, code[1], prev, i == len(codes) - 1, ctx, options))
        super().__init__(layers)
        self.provider = provider

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer.plain(x)
        return x


def stack_input(rows: int) -> torch.Tensor:
    return dyadic((rows, H), 7)


def linear_matrix(world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = []
    for case in cases:
        dp, counts, codes = case["dp"], tuple(case["counts"]), case["codes"]
        topo = topology(world, dp)
        ctx = BoundaryContext(topo, reduction=case["policy"])
        model = BranchStack(codes, ctx, defer=case.get("defer", False))
        ref = BranchStack(codes, BoundaryContext(Topology.single()))
        x, fb = dp_rows(topo, counts)
        with count_collectives() as n, count_handoffs() as handoffs:
            out = model(x.clone(), fb)
        want = ref(x.clone(), ForwardBatch(num_tokens=x.shape[0]))
        results.append({
            "case": case, "equal": bool(torch.equal(out, want)), "rows": out.shape[0],
            "collectives": dict(n), "handoffs": handoffs,
            "largest": want.abs().max().item() if want.numel() else 0.0,
            "returns": [s.chosen for s in ctx.report.selections if s.what == "output return"][:1],
        })
    return results


def refused_variants(world: int) -> dict[str, Optional[str]]:
    """An input-scattered batch runs the source stage's own path, then meets the branch: every
    rank raises the spec's error at the same call (before any branch collective)."""
    out: dict[str, Optional[str]] = {}
    topo = topology(world, 1)
    for code in ("La", "Pa"):
        model = BranchStack([code], BoundaryContext(topo))
        fb = ForwardBatch(num_tokens=4, input_scattered=True)
        try:
            model(stack_input(4), fb)
            out[code] = None
        except Exception as e:  # noqa: BLE001 - the text is what the test checks
            out[code] = f"{type(e).__name__}: {e}"
    return out


_SINGLE: dict[Any, torch.Tensor] = {}


def longcat_matrix(world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The LongCat-style reference on each case's layout against the single-rank model."""
    from layer_boundary_app.models.runner import RunSpec, build_model, rank_forward, single_rank_logits

    results = []
    for case in cases:
        pp, dp = case.get("pp", 1), case.get("dp", 1)
        tp = world // pp
        spec = RunSpec(sequences=tuple(tuple(s) for s in case["sequences"]), tp=tp, dp=dp, pp=pp,
                       reduction=case.get("policy", "ar"), dtype=case.get("dtype", "float64"),
                       longcat=True, plugins=False, defer_moe_finalize=case.get("defer", False),
                       config_overrides=case.get("config", {}))
        model = build_model(spec, topology(tp, dp, pp), "cpu")
        with count_handoffs() as handoffs:
            idx, logits, _ = rank_forward(model, spec, "cpu")
        key = (spec.sequences, spec.dtype, tuple(sorted(spec.config_overrides.items())))
        if key not in _SINGLE:
            _SINGLE[key] = single_rank_logits(spec)
        want = _SINGLE[key][idx] if idx else logits[:0]
        results.append({
            "case": case, "rows": len(idx), "handoffs": handoffs, "pp_rank": model.topology.pp.rank,
            "max_diff": (logits - want).abs().max().item() if idx else 0.0,
            "scale": want.abs().max().item() if idx else 0.0,
            "layer_ids": [layer.layer_id for layer in model.model.layers],
        })
    return results


def matrix(rank: int, world: int, linear: list[dict[str, Any]],
           longcat: list[dict[str, Any]]) -> dict[str, Any]:
    """Every branch case of one world size in one spawn (process groups are created once)."""
    return {"linear": linear_matrix(world, linear), "longcat": longcat_matrix(world, longcat),
            "refused": refused_variants(world)}
