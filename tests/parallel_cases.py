"""Worker functions for the multi-process tests (importable by spawned ranks).

A synthetic linear stack with dyadic float64 data makes every sum exact, so each parallel path
must give the single-rank numbers bit for bit; the Qwen3 reference checks the same paths on a
real decoder within the float tolerance.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from layer_boundary import BoundaryContext, ForwardBatch, Topology, declare_attn, declare_ffn, make_stages
from layer_boundary import ops
from layer_boundary.models.layers import ColumnParallelLinear, RowParallelLinear
from layer_boundary.residual import batch as residual_batch

H, F = 8, 16


def dyadic(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Multiples of 1/4 in [-1, 1]: through a few layers every product and sum stays exact in
    float64 (each matmul adds two bits of granularity; magnitudes stay far below 2^50)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=g).double() / 4


class LinearLayer(nn.Module):
    """attention-like PARTIAL stage (row-parallel projection) + FFN (column then row parallel),
    identity norms, so every value stays dyadic."""

    def __init__(self, i: int, layers: int, ctx: BoundaryContext) -> None:
        super().__init__()
        topo = ctx.topology
        self.wq = ColumnParallelLinear(H, H, bias=False, group=topo.attn_tp, dtype=torch.float64)
        self.wo = RowParallelLinear(H, H, bias=False, group=topo.attn_tp, reduce_results=False, dtype=torch.float64)
        self.up = ColumnParallelLinear(H, F, bias=False, group=topo.tp, dtype=torch.float64)
        self.down = RowParallelLinear(F, H, bias=False, group=topo.tp, dtype=torch.float64)
        for lin, (o, k), s in ((self.wq, (H, H), 3), (self.wo, (H, H), 0), (self.up, (F, H), 1),
                               (self.down, (H, F), 2)):
            lin.weight_loader(lin.weight, dyadic((o, k), 100 * i + s))
        self.n1, self.n2 = nn.Identity(), nn.Identity()
        self.attn, self.ffn = make_stages((declare_attn(), self.n1), (declare_ffn(), self.n2),
                                          previous=declare_ffn() if i else None,
                                          terminal=i == layers - 1, context=ctx)

    def forward(self, h: Any, fb: Any) -> Any:
        x = self.attn.prepare(h, fb)
        h = self.attn.finish(self.wo(self.wq(x)), fb)
        x = self.ffn.prepare(h, fb)
        with self.ffn.exit(fb) as out:
            y = self.down(self.up(x))
        return out.finish(y)


class LinearStack(nn.Module):
    def __init__(self, layers: int, ctx: BoundaryContext) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LinearLayer(i, layers, ctx) for i in range(layers))
        self.norm = nn.Identity()

    def forward(self, x: torch.Tensor, fb: Any) -> torch.Tensor:
        residual_batch.start(fb)
        h = x
        for layer in self.layers:
            h = layer(h, fb)
        return residual_batch.norm(h, fb, self.norm, skip_empty=True)


@contextlib.contextmanager
def count_collectives() -> Iterator[dict[str, int]]:
    counts: dict[str, int] = {}
    patched = []

    def wrap(owner: Any, name: str, label: str) -> None:
        orig = getattr(owner, name)

        def counted(*a: Any, **k: Any) -> Any:
            counts[label] = counts.get(label, 0) + 1
            return orig(*a, **k)

        setattr(owner, name, counted)
        patched.append((owner, name, orig))

    wrap(dist, "all_reduce", "all_reduce")
    wrap(dist, "all_gather", "all_gather")
    wrap(dist, "all_to_all_single", "all_to_all")
    wrap(ops, "_all_gather", "all_gather")
    wrap(ops, "_reduce_scatter", "reduce_scatter")
    try:
        yield counts
    finally:
        for owner, name, orig in reversed(patched):
            setattr(owner, name, orig)


_TOPOLOGIES: dict[tuple[int, int], Topology] = {}


def topology(tp: int, dp: int) -> Topology:
    """One set of process groups per layout for the whole worker (groups are expensive)."""
    if (tp, dp) not in _TOPOLOGIES:
        _TOPOLOGIES[(tp, dp)] = Topology.from_sizes(tp=tp, dp=dp)
    return _TOPOLOGIES[(tp, dp)]


def linear_matrix(rank: int, world: int, cases: list[dict[str, Any]], device: str = "cpu") -> list[dict[str, Any]]:
    """Run each case (dp, policy, counts, layers) on this rank and on one rank; compare."""
    results = []
    for case in cases:
        dp, counts, layers = case["dp"], tuple(case["counts"]), case["layers"]
        topo = topology(world, dp)
        ctx = BoundaryContext(topo, reduction=case["policy"])
        model = LinearStack(layers, ctx).to(device)
        ref = LinearStack(layers, BoundaryContext(Topology.single())).to(device)
        d = topo.attn_dp.rank
        x_all = dyadic((sum(counts), H), 7).to(device)
        lo = sum(counts[:d])
        x = x_all[lo : lo + counts[d]]
        fb = ForwardBatch(num_tokens=counts[d], dp_num_tokens=counts if dp > 1 else None,
                          input_scattered=case.get("scattered", False))
        with count_collectives() as n:
            out = model(x.clone(), fb)
        want = ref(x.clone(), ForwardBatch(num_tokens=counts[d]))
        results.append({
            "case": case, "equal": bool(torch.equal(out.cpu(), want.cpu())), "shape": tuple(out.shape),
            "collectives": dict(n),
            "returns": [s.chosen for s in ctx.report.selections if s.what == "output return"][:1],
        })
    return results


def qwen3_matrix(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Qwen3 reference on each case's layout against the single-rank model."""
    from layer_boundary.models.runner import RunSpec, build_model, rank_forward, single_rank_logits

    results = []
    for case in cases:
        spec = RunSpec(sequences=tuple(tuple(s) for s in case["sequences"]), tp=world, dp=case["dp"],
                       reduction=case["policy"], dtype=case.get("dtype", "float64"), plugins=False,
                       config_overrides=case.get("config", {}),
                       input_scattered=case.get("scattered", False))
        topo = topology(world, case["dp"])
        model = build_model(spec, topo, "cpu")
        idx, logits, _ = rank_forward(model, spec, "cpu")
        want = single_rank_logits(spec)[idx] if idx else logits[:0]
        results.append({"case": case, "max_diff": (logits - want).abs().max().item() if idx else 0.0,
                        "rows": len(idx)})
    return results


def matrix(rank: int, world: int, linear: list[dict[str, Any]], qwen: list[dict[str, Any]]) -> dict[str, Any]:
    """Both matrices in one spawn: process groups are created once per layout."""
    return {"linear": linear_matrix(rank, world, linear), "qwen3": qwen3_matrix(rank, world, qwen)}
