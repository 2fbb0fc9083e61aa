"""Two-batch overlap workers and the synthetic stack (importable by spawned ranks).

``TboStack`` is ``moe_cases``' dyadic float64 stack (PARTIAL attention-like stages, dense FFNs and
the real ``SparseMoeBlock``) whose layers also offer ``forward_stages``: every sum is exact, so the
two-batch schedule must give the unsplit numbers bit for bit on every layout. ``tbo_matrix`` runs
the synthetic cases and the Qwen3 / Qwen3-MoE references on one process-group set per layout.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from layer_boundary import BoundaryContext, ForwardBatch, Topology
from layer_boundary._adapters.tbo import TboPlan, TboRows, TboSplit, model_forward_stages, plan_overlap
from layer_boundary.residual import batch as residual_batch

from moe_cases import H, LinearMoeLayer, count_handoffs
from parallel_cases import count_collectives, dyadic, topology


class DeferBoth:
    """Every exit that may leaves its sum to the next input, and sparse FFNs return handoffs:
    what a split in the middle of the stack then has to cut (or finalize) correctly."""

    name = "test-defer-both"

    def can_defer_finalize(self, plan: Any, forward_batch: Any) -> bool:
        return True

    def can_defer_all_reduce(self, plan: Any, forward_batch: Any) -> bool:
        return True


class TboLayer(LinearMoeLayer):
    @property
    def attn_boundary(self) -> Any:
        return self.attn

    @property
    def ffn_boundary(self) -> Any:
        return self.ffn

    def forward(self, positions: Any, h: Any, fb: Any) -> Any:  # type: ignore[override]
        return super().forward(h, fb)

    def forward_stages(self, positions: Any, h: Any, fb: Any) -> Any:
        x = self.attn.prepare(h, fb)
        h = self.attn.finish(self.wo(self.wq(x)), fb)
        yield "attn"
        x = self.ffn.prepare(h, fb)
        yield "ffn_input"
        h = self.ffn.postprocess(self.mlp(x), fb)  # no exit scope: compute reduces itself
        yield "ffn"
        return h


class TboStack(nn.Module):
    def __init__(self, kinds: str, ctx: BoundaryContext, *, defer: bool = False) -> None:
        super().__init__()
        fusions = DeferBoth() if defer else None
        self.layers = nn.ModuleList(
            TboLayer(i, kinds, ctx, shared=False, fusions=fusions) for i in range(len(kinds)))
        self.norm = nn.Identity()

    def forward(self, x: torch.Tensor, fb: Any, split: Optional[TboSplit] = None,
                plan: Optional[TboPlan] = None) -> torch.Tensor:
        residual_batch.start(fb)
        h: Any = x
        if split is None:
            for layer in self.layers:
                h = layer(None, h, fb)
        else:
            h = model_forward_stages(self.layers, None, h, fb, split=split, plan=plan)
        return residual_batch.norm(h, fb, self.norm, skip_empty=True)


def custom_plan(overlapped: str) -> TboPlan:
    """A plan that overlaps the layers marked ``o`` whatever their FFNs are (to split right after
    a producer that left a handoff or a partial sum)."""
    flags = tuple(c == "o" for c in overlapped)
    edges = [TboRows.SPLIT if flags[0] else TboRows.BATCH]
    for a, b in zip(flags, flags[1:]):
        edges.append({(False, False): TboRows.BATCH, (False, True): TboRows.SPLIT,
                      (True, True): TboRows.MICROBATCH, (True, False): TboRows.MERGE}[a, b])
    edges.append(TboRows.MERGE if flags[-1] else TboRows.BATCH)
    return TboPlan("custom", flags, tuple(edges))


def synthetic_case(topo: Topology, case: dict[str, Any]) -> dict[str, Any]:
    """One synthetic case on ``topo``: the two-batch schedule against the unsplit stack on the
    same layout and on one rank (bitwise), with the schedule's trace and handoff counts."""
    kinds, groups = case["kinds"], [list(g) for g in case["groups"]]
    dp = len(groups)
    d = topo.attn_dp.rank
    counts = tuple(sum(g) for g in groups)
    defer = case.get("defer", False)
    ctx = BoundaryContext(topo, reduction=case.get("policy", "ar"))
    model = TboStack(kinds, ctx, defer=defer)
    plan = custom_plan(case["plan"]) if "plan" in case else plan_overlap(model.layers,
                                                                        overlap=case.get("overlap", "sparse"))
    x_all = dyadic((sum(counts), H), 7)
    lo = sum(counts[:d])
    x = x_all[lo : lo + counts[d]]

    def batch() -> ForwardBatch:
        return ForwardBatch(num_tokens=counts[d], seq_lens=tuple(groups[d]) or None,
                            dp_num_tokens=counts if dp > 1 else None,
                            input_scattered=case.get("scattered", False))

    trace: list = []
    split = TboSplit.balanced(groups, d, trace=trace)
    fb = batch()
    with count_collectives() as n, count_handoffs() as handoffs:
        got = model(x.clone(), fb, split, plan)
    whole = model(x.clone(), batch())
    ref = TboStack(kinds, BoundaryContext(Topology.single()))(x.clone(), ForwardBatch(num_tokens=counts[d]))
    return {"case": case, "equal": bool(torch.equal(got, ref)), "equal_layout": bool(torch.equal(got, whole)),
            "rows": got.shape[0], "trace": trace, "handoffs": handoffs, "collectives": dict(n),
            "edges": [e.value for e in plan.edges], "released": fb.residual_stream.released}


def qwen3_case(topo: Topology, case: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3 or Qwen3-MoE reference with ``tbo``: against the single-rank unsplit model, and
    (``per_microbatch``) each microbatch's rows against that microbatch run alone, unsplit, on
    the same layout."""
    from layer_boundary_app.models.runner import RunSpec, build_model, rank_forward, single_rank_logits

    tp, pp = topo.tp.size, topo.pp.size
    spec = RunSpec(sequences=tuple(tuple(s) for s in case["sequences"]), tp=tp, dp=case.get("dp", 1), pp=pp,
                   dtype=case.get("dtype", "float64"), moe=case.get("moe", False), plugins=False,
                   reduction=case.get("policy", "ar"), input_scattered=case.get("scattered", False),
                   tbo=True)
    model = build_model(spec, topo, "cpu")
    idx, logits, _ = rank_forward(model, spec, "cpu")  # no rows on a pipeline stage before the last
    want = single_rank_logits(spec)
    scale = max(1.0, want.abs().max().item())
    out: dict[str, Any] = {"case": case, "rows": len(idx),
                           "rel_diff": (logits - want[idx]).abs().max().item() / scale if idx else 0.0}
    if case.get("per_microbatch"):
        # Final-normed hidden states (the LM head's GEMM rounds by row count, the layers here do
        # not: each microbatch of a dense stack is exactly that microbatch's own forward).
        from layer_boundary_app.models.runner import _batch, tbo_split

        assert spec.dp == 1, "one DP group: every rank runs the same microbatch forwards"
        split = tbo_split(spec, 0)
        with torch.inference_mode():
            ids, fb = _batch(spec.sequences, "cpu", None)
            fb.tbo_split = split
            fb.input_scattered = spec.input_scattered
            hidden = model.model(ids, fb.positions, fb)
            alone = []
            for seqs in (spec.sequences[: split.seq_index], spec.sequences[split.seq_index :]):
                if seqs:
                    ids, fb = _batch(seqs, "cpu", None)
                    fb.input_scattered = spec.input_scattered
                    alone.append(model.model(ids, fb.positions, fb))
        out["bitwise_per_microbatch"] = bool(torch.equal(torch.cat(alone), hidden))
    return out


def tbo_matrix(rank: int, world: int, synthetic: list[dict[str, Any]], qwen: list[dict[str, Any]]) -> dict[str, Any]:
    """Every case on this rank; process groups come from ``parallel_cases.topology`` (one set
    per layout for the whole worker)."""
    res = {"synthetic": [], "qwen3": []}
    for case in synthetic:
        res["synthetic"].append(synthetic_case(topology(world, len(case["groups"])), case))
    for case in qwen:
        pp = case.get("pp", 1)
        res["qwen3"].append(qwen3_case(topology(world // pp, case.get("dp", 1), pp), case))
    return res
