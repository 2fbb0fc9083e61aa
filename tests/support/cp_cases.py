"""Worker functions and cases for the context-parallel and sequence-parallel gloo tests.

One spawn per world size runs every case below (CP and SP, synthetic and Qwen3) and the results
are cached here, so tests/multi_rank/test_cp.py and tests/multi_rank/test_sequence_parallel.py share the spawns and the
process groups (``parallel_cases.topology``). Spawning ranks is the expensive part on a 2-core
machine; the cases themselves are small.

The synthetic stacks use dyadic float64 data, so every sum is exact and each parallel path must
give the single-rank numbers bit for bit. Its attention-like stage mixes tokens: a causal prefix
sum over each sequence of a head-sharded value projection, so under CP it needs every earlier
token's values, which it gathers through the batch's token mapping as an attention gathers K/V.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from layer_boundary import BoundaryContext, ForwardBatch, ForwardMode, Topology, get_forward, make_stages
from layer_boundary import ProducerReduction, declare_attn, declare_ffn
from layer_boundary._cp import CpSplit, context_parallel_split
from layer_boundary_app.launch import spawn
from layer_boundary_app.models.layers import ColumnParallelLinear, RowParallelLinear

import parallel_cases
from parallel_cases import H, F, BoundaryStack, count_collectives, dyadic, topology

F64 = torch.float64


def fake_cp_topology(*, tp: int = 2, cp: int = 2, dp: int = 1) -> Topology:
    """Rank 0's view of ``Topology.from_sizes(tp=tp, dp=dp, cp=cp)`` for one-process tests; its
    groups are fake (helpers.FAKE_GROUP): a path that reaches a collective fails loudly."""
    from layer_boundary import GroupInfo

    from helpers import FAKE_GROUP

    a = tp // dp

    def g(ranks: tuple[int, ...]) -> GroupInfo:
        return GroupInfo(ranks, 0, FAKE_GROUP) if len(ranks) > 1 else GroupInfo.solo()

    return Topology(tp=g(tuple(range(tp))), attn_tp=g(tuple(range(a))), attn_dp=g(tuple(range(0, tp, a))),
                    attn_cp=g(tuple(range(cp))), moe_out=g(tuple(range(tp))), pp=GroupInfo.solo(),
                    attn_heads=g(tuple(range(0, a, cp))))


def block_causal(seq_lens: Optional[tuple[int, ...]], n: int) -> torch.Tensor:
    """``[n, n]`` bool: token ``i`` sees token ``j <= i`` of its own sequence (packed order)."""
    lens = seq_lens or (n,)
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    rows = torch.arange(n)
    return (seq[:, None] == seq[None, :]) & (rows[None, :] <= rows[:, None])


class CpLinearLayer(nn.Module):
    """PARTIAL token-mixing stage + FFN (column then row parallel over TP), identity norms.

    ``tail``: the FFN is LOCAL_TAIL and adds ``x/2 + b`` after its sum (on TP rank 0 only, before
    the sum, when the exit leaves the sum to the boundary).
    """

    def __init__(self, i: int, layers: int, ctx: BoundaryContext, tail: bool = False) -> None:
        super().__init__()
        topo = ctx.topology
        self.tail = tail
        self.wv = ColumnParallelLinear(H, H, bias=False, group=topo.attn_heads, dtype=F64)
        self.wo = RowParallelLinear(H, H, bias=False, group=topo.attn_heads, reduce_results=False, dtype=F64)
        self.up = ColumnParallelLinear(H, F, bias=False, group=topo.tp, dtype=F64)
        self.down = RowParallelLinear(F, H, bias=False, group=topo.tp, dtype=F64)
        for lin, shape, s in ((self.wv, (H, H), 0), (self.wo, (H, H), 1), (self.up, (F, H), 2),
                              (self.down, (H, F), 3)):
            lin.weight_loader(lin.weight, dyadic(shape, 300 + 10 * i + s))
        self.register_buffer("b", dyadic((H,), 300 + 10 * i + 4))
        ffn = declare_ffn(reduction=ProducerReduction.LOCAL_TAIL) if tail else declare_ffn()
        self.attn, self.ffn = make_stages((declare_attn(), nn.Identity()), (ffn, nn.Identity()),
                                          previous=ffn if i else None, terminal=i == layers - 1,
                                          context=ctx)
        self.seen: list[tuple[str, int]] = []
        self.flags: list[tuple[bool, bool]] = []

    def mix(self, v: torch.Tensor, fb: Any) -> torch.Tensor:
        cp = context_parallel_split(fb)
        if cp is None:
            return block_causal(getattr(fb, "seq_lens", None), v.shape[0]).to(v.dtype) @ v
        return cp.causal_mask().to(v.dtype) @ cp.gather(v)  # every token's values, then my queries

    def forward(self, h: Any, fb: Any) -> Any:
        x = self.attn.prepare(h, fb)
        self.seen.append(("attn", x.shape[0]))
        h = self.attn.finish(self.wo(self.mix(self.wv(x), fb)), fb)
        x = self.ffn.prepare(h, fb)
        self.seen.append(("ffn", x.shape[0]))
        with self.ffn.exit(fb) as out:
            y = self.down(self.up(x))
            if self.tail:
                f = get_forward()
                self.flags.append((f.fuse_mlp_allreduce, f.mlp_reduce_scatter))
                if not (f.fuse_mlp_allreduce or f.mlp_reduce_scatter) or self.down.group.rank == 0:
                    y = y + (x / 2 + self.b)
        return out.finish(y)


class CpLinearStack(BoundaryStack):
    def __init__(self, layers: int, ctx: BoundaryContext, tail: bool = False) -> None:
        super().__init__(CpLinearLayer(i, layers, ctx, tail) for i in range(layers))


def cp_linear(world: int, case: dict[str, Any]) -> dict[str, Any]:
    """The synthetic stack as a CP batch against one rank (bitwise)."""
    cp, layers, seqs = case["cp"], case["layers"], tuple(case["seqs"])
    topo = topology(world, 1, cp=cp)
    tail = case.get("tail", False)
    model = CpLinearStack(layers, BoundaryContext(topo), tail)
    ref = CpLinearStack(layers, BoundaryContext(Topology.single()), tail)
    n = sum(seqs)
    x_all = dyadic((n, H), 7)
    split = getattr(CpSplit, case.get("mapping", "zigzag"))(seqs, topo)
    fb = ForwardBatch(num_tokens=split.local_rows, positions=split.take_local(torch.arange(n)),
                      context_parallel=True, cp_split=split)
    with count_collectives() as counts:
        out = model(split.take_local(x_all), fb)
    want = split.take_local(ref(x_all.clone(), ForwardBatch(num_tokens=n, seq_lens=seqs)))
    return {"case": case, "equal": bool(torch.equal(out, want)), "rows": split.local_rows,
            "owners": split.owners(split.rank).tolist(), "collectives": dict(counts),
            "seen": [s for layer in model.layers for s in layer.seen],
            "tail_flags": [f for layer in model.layers for f in layer.flags],
            "heads": topo.attn_heads.size}


def sp_linear(world: int, case: dict[str, Any]) -> dict[str, Any]:
    """``parallel_cases.LinearStack`` as a sequence-parallel batch against one rank (bitwise)."""
    layers, n, tail = case["layers"], case["tokens"], case.get("tail", False)
    topo = topology(world, 1)
    model = parallel_cases.LinearStack(layers, BoundaryContext(topo), tail)
    ref = parallel_cases.LinearStack(layers, BoundaryContext(Topology.single()), tail)
    x = dyadic((n, H), 7)
    fb = ForwardBatch(num_tokens=n, sequence_parallel=True)
    parallel_cases.TAIL_FLAGS.clear()
    with count_collectives() as counts:
        out = model(x.clone(), fb)
    flags = list(parallel_cases.TAIL_FLAGS)
    stream = fb.residual_stream
    want = ref(x.clone(), ForwardBatch(num_tokens=n))
    return {"case": case, "equal": bool(torch.equal(out, want)), "shape": tuple(out.shape),
            "collectives": dict(counts), "tail_flags": flags, "released": stream.released}


def _packed(seqs: tuple[tuple[int, ...], ...]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([t for s in seqs for t in s])
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    return ids, pos


def qwen3_cp(world: int, case: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3 reference (or Qwen3-MoE) as a CP prefill against the single-rank model."""
    from layer_boundary_app.models.runner import RunSpec, build_model, rank_forward, single_rank_logits

    cp, pp = case["cp"], case.get("pp", 1)
    residual = case.get("residual", "plain")
    spec = RunSpec(sequences=tuple(tuple(s) for s in case["sequences"]), tp=world // pp, pp=pp, cp=cp,
                   dtype=case.get("dtype", "float32"), residual=residual, plugins=residual != "plain",
                   moe=case.get("moe", False))
    topo = topology(world // pp, 1, pp, cp)
    model = build_model(spec, topo, "cpu")
    with count_collectives() as counts:
        idx, logits, _ = rank_forward(model, spec, "cpu")
    out: dict[str, Any] = {"case": case, "rows": len(idx), "collectives": dict(counts),
                           "layers": len(model.model.layers), "heads": topo.attn_heads.size,
                           "head_rank": topo.attn_heads.rank,
                           "pp_rank": topo.pp.rank}
    if idx:
        want = single_rank_logits(spec)[idx]
        out["max_diff"] = (logits - want).abs().max().item()
        out["scale"] = want.abs().max().item()
    return out


def qwen3_decode_on_cp(world: int, case: dict[str, Any]) -> dict[str, Any]:
    """A decode batch on a CP topology: run ordinary it matches one rank; flagged CP it is refused
    before any collective (no rank enters one, so nothing hangs)."""
    from layer_boundary_app.models.runner import RunSpec, build_model, single_rank_logits

    spec = RunSpec(sequences=tuple((t,) for t in case["tokens"]), tp=world, cp=case["cp"], plugins=False)
    topo = topology(world, 1, cp=case["cp"])
    model = build_model(spec, topo, "cpu")
    ids, pos = _packed(spec.sequences)
    n = len(case["tokens"])
    fb = ForwardBatch(num_tokens=n, positions=pos, seq_lens=(1,) * n, mode=ForwardMode.DECODE)
    with torch.inference_mode():
        logits = model(ids, pos, fb)
    want = single_rank_logits(spec)
    refused = None
    split = CpSplit.zigzag((1,) * n, topo)
    fb_cp = ForwardBatch(num_tokens=split.local_rows, positions=split.take_local(pos), mode=ForwardMode.DECODE,
                         context_parallel=True, cp_split=split)
    try:
        with torch.inference_mode():
            model(split.take_local(ids), fb_cp.positions, fb_cp)
    except Exception as e:  # noqa: BLE001 - recorded for the test
        refused = (type(e).__name__, str(e))
    return {"case": case, "max_diff": (logits - want).abs().max().item(), "refused": refused}


def qwen3_sp(world: int, case: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3 reference as a sequence-parallel batch against the single-rank model."""
    from layer_boundary_app.models.runner import RunSpec, build_model, single_rank_logits

    from layer_boundary_app.models.runner import tbo_split

    spec = RunSpec(sequences=tuple(tuple(s) for s in case["sequences"]), tp=world,
                   dtype=case.get("dtype", "float32"), plugins=False, tbo=case.get("tbo", False),
                   moe=case.get("moe", False))
    model = build_model(spec, topology(world, 1), "cpu")
    ids, pos = _packed(spec.sequences)
    fb = ForwardBatch(num_tokens=ids.shape[0], positions=pos, seq_lens=tuple(len(s) for s in spec.sequences),
                      sequence_parallel=True)
    if spec.tbo:  # two microbatches, each with its own sequence-parallel row slices
        fb.tbo_split = tbo_split(spec, 0)
    with count_collectives() as counts, torch.inference_mode():
        logits = model(ids, pos, fb)
    want = single_rank_logits(spec)
    return {"case": case, "max_diff": (logits - want).abs().max().item(), "scale": want.abs().max().item(),
            "collectives": dict(counts), "layers": len(model.model.layers)}


_RUN = {"cp_linear": cp_linear, "sp_linear": sp_linear, "qwen3_cp": qwen3_cp,
        "qwen3_decode_on_cp": qwen3_decode_on_cp, "qwen3_sp": qwen3_sp}


def run_cases(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_RUN[c["kind"]](world, c) for c in cases]


# -- the cases -------------------------------------------------------------------------------------
# Uneven sequences: lengths not divisible by 2 x CP, some shorter than 2 x CP (a CP rank holds none
# of their tokens), and a batch whose single token leaves one CP rank without any row.

CASES: dict[int, list[dict[str, Any]]] = {
    2: [
        dict(kind="cp_linear", cp=2, seqs=(5,), layers=2),
        dict(kind="cp_linear", cp=2, seqs=(3, 1, 4, 6), layers=2),
        dict(kind="cp_linear", cp=2, seqs=(1,), layers=2),  # CP rank 1 holds no token
        dict(kind="cp_linear", cp=2, seqs=(7, 2), layers=2, mapping="contiguous"),
        dict(kind="cp_linear", cp=2, seqs=(6, 3), layers=2, tail=True),
        dict(kind="sp_linear", tokens=5, layers=2),
        dict(kind="sp_linear", tokens=1, layers=2),  # one rank's slice is padding only
        dict(kind="sp_linear", tokens=6, layers=2, tail=True),
        dict(kind="qwen3_cp", cp=2, sequences=[[1, 5, 9, 2, 7], [4], [3, 8, 1, 30, 2, 2, 9]]),
        dict(kind="qwen3_cp", cp=2, sequences=[[6, 2, 7, 1, 8, 2, 8, 1, 8]], residual="mhc"),
        dict(kind="qwen3_cp", cp=2, sequences=[[1, 5, 9, 2], [4, 8, 16]], moe=True),
        dict(kind="qwen3_cp", cp=2, sequences=[[7]]),  # CP rank 1 holds no token: it still joins
        dict(kind="qwen3_cp", cp=2, sequences=[[7]], moe=True),  # every gather of rank 0
        dict(kind="qwen3_sp", sequences=[[1, 5, 9], [4, 4], [7]]),
        dict(kind="qwen3_sp", sequences=[[1, 5, 9], [4, 77, 6, 2], [3]], moe=True, tbo=True),
    ],
    4: [
        dict(kind="cp_linear", cp=2, seqs=(5, 2, 9), layers=2),  # heads over 2 ranks too
        dict(kind="cp_linear", cp=4, seqs=(11, 3), layers=2),
        dict(kind="cp_linear", cp=4, seqs=(2, 1), layers=2),  # CP ranks without tokens
        dict(kind="cp_linear", cp=2, seqs=(4, 7), layers=2, tail=True),
        dict(kind="cp_linear", cp=4, seqs=(9,), layers=2, tail=True, mapping="contiguous"),
        dict(kind="sp_linear", tokens=7, layers=2),
        dict(kind="sp_linear", tokens=9, layers=2, tail=True),
        dict(kind="qwen3_cp", cp=2, sequences=[[1, 5, 9, 11, 30], [4, 2], [7, 7, 7, 1, 2, 3, 4, 5, 6]]),
        dict(kind="qwen3_cp", cp=4, sequences=[[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [2, 7], [1]]),
        dict(kind="qwen3_cp", cp=2, pp=2, sequences=[[1, 5, 9, 11, 4, 4, 8], [2, 3]]),
        dict(kind="qwen3_decode_on_cp", cp=2, tokens=[5, 9, 2]),
        dict(kind="qwen3_sp", sequences=[[2, 4, 6, 8, 10, 12, 14], [3, 5]]),
    ],
}

_RESULTS: dict[int, list[list[dict[str, Any]]]] = {}


def results(world: int) -> list[list[dict[str, Any]]]:
    """Per-rank results of every case on ``world`` ranks (one spawn per world size per session)."""
    if world not in _RESULTS:
        _RESULTS[world] = spawn(run_cases, world, args=(CASES[world],), timeout_s=240)
    return _RESULTS[world]


def of_kind(per_rank: list[list[dict[str, Any]]], kind: str) -> list[tuple[int, dict[str, Any]]]:
    """``(rank, result)`` of every case of ``kind``."""
    return [(rank, r) for rank, rs in enumerate(per_rank) for r in rs if r["case"]["kind"] == kind]
