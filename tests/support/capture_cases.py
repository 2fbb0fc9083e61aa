"""Worker functions for the capture, LoRA-rows and NextN-draft tests (importable by spawned ranks).

One spawn per world size runs the cases of all three test files, with process groups shared
through ``parallel_cases.topology``; ``results(world)`` caches what the ranks returned, so the
three files share that spawn inside one pytest process.

The synthetic stacks use dyadic float64 data and an exact read (``r / 2`` in place of the norm),
so every sum is exact and every parallel path must give the single-rank numbers bit for bit.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from layer_boundary import (AuxHiddenStateList, BoundaryContext, ForwardBatch, RMSNorm, Topology,
                            declare_attn, declare_ffn, make_stages, _ops as ops)
from layer_boundary._layout import BatchVariant
from layer_boundary_app.models.layers import ColumnParallelLinear, RowParallelLinear
from layer_boundary.residual import batch as rb
from layer_boundary.residual._add_norm import AddNormReadSpec, NormKernels

from parallel_cases import DeferAlways, F, H, dyadic, topology

F64 = torch.float64


def _half(x: torch.Tensor, weight: torch.Tensor, eps: float, **kw: Any) -> torch.Tensor:
    return x * 0.5


def _add_half(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
              **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    r = residual + x
    return r * 0.5, r


# An RMSNorm-shaped read whose "norm" halves its input: exact on dyadic data, and fusable with a
# plain add, so consumer fusion candidates may take it.
HALF_READ = AddNormReadSpec(NormKernels("exact-half", _half, _add_half))


class InPlaceSum:
    """Fusion provider whose consumer candidate completes an owed sum, adds it to the residual
    in place and reads, as the NCCL all-reduce + add + norm kernels do (here over gloo). Also asks
    every FFN exit to defer its sum, so attention inputs owe one too. Counts its fused runs."""

    name = "test-inplace-sum"

    def __init__(self) -> None:
        self.runs = 0

    def can_defer_all_reduce(self, plan: Any, forward_batch: Any) -> bool:
        return True

    def attention_input(self, plan: Any) -> tuple[Any, ...]:
        return self._offer(plan)

    def ffn_input(self, plan: Any) -> tuple[Any, ...]:
        return self._offer(plan)

    def _offer(self, plan: Any) -> tuple[Any, ...]:
        entry = plan.entries[BatchVariant.ORDINARY]
        sums = [g for _, g in entry.accepts if g is not None]
        if len(sums) != 1 or plan.topology.sum_group(sums[0]).size == 1 or entry.rows.every_group_input:
            return ()
        return (_InPlaceCandidate(self, sums[0], plan.topology.sum_group(sums[0])),)


class _InPlaceCandidate:
    name = "test in-place all-reduce + add + read"

    def __init__(self, owner: InPlaceSum, sum_group: Any, group: Any) -> None:
        self.owner, self.sum_group, self.group = owner, sum_group, group

    def refuse(self, plan: Any) -> Optional[str]:
        return None

    def __call__(self, value: torch.Tensor, residual: Optional[torch.Tensor], read: Any, fb: Any) -> Any:
        if residual is None:
            return None
        total = value.clone()
        dist.all_reduce(total, group=self.group.group)
        residual.add_(total)  # the residual is updated in place, like the fused kernels do
        self.owner.runs += 1
        return read.read(residual), residual


# -- the capture stack ---------------------------------------------------------------------------


class CapLayer(nn.Module):
    """A PARTIAL attention-like pair over attention TP and an FFN pair over TP, dyadic weights."""

    def __init__(self, i: int, layers: int, ctx: BoundaryContext, provider: Any = None) -> None:
        super().__init__()
        topo = ctx.topology
        self.wq = ColumnParallelLinear(H, H, False, topo.attn_tp, dtype=F64)
        self.wo = RowParallelLinear(H, H, False, topo.attn_tp, reduce_results=False, dtype=F64)
        self.up = ColumnParallelLinear(H, F, False, topo.tp, dtype=F64)
        self.down = RowParallelLinear(F, H, False, topo.tp, dtype=F64)
        for lin, shape, s in ((self.wq, (H, H), 0), (self.wo, (H, H), 1), (self.up, (F, H), 2),
                              (self.down, (H, F), 3)):
            lin.weight_loader(lin.weight, dyadic(shape, 300 + 10 * i + s))
        self.n1, self.n2 = RMSNorm(H, dtype=F64), RMSNorm(H, dtype=F64)
        opts = ({"fusions": provider},) if provider is not None else ()
        self.attn, self.ffn = make_stages(
            (declare_attn(read=HALF_READ), self.n1, *opts), (declare_ffn(read=HALF_READ), self.n2, *opts),
            previous=declare_ffn() if i else None, terminal=i == layers - 1, context=ctx)


class _Col:
    """A captured_last_layer_outputs collector that also logs the ownership it was given."""

    def __init__(self, owned_log: dict[str, bool], key: str) -> None:
        self.aux, self.log, self.key = AuxHiddenStateList(), owned_log, key

    def capture(self, value: torch.Tensor, *, owned: bool = False) -> None:
        self.log[self.key] = owned
        self.aux.capture(value, owned=owned)


def _run_layers(layers: dict[int, CapLayer], lo: int, hi: int, h: Any, fb: Any, case: dict,
                extras: dict[int, torch.Tensor], kept: dict[str, Any], owned: dict[str, bool]) -> Any:
    """Layers ``[lo, hi)`` with every capture point the case asks for; values land in ``kept``."""
    ops_all = case.get("ops", "all") == "all"
    every = case.get("capture_every", 1)
    for i in range(lo, hi):
        layer = layers[i]
        kw: dict[str, Any] = {}
        if i % every == 0:
            cap, col = _Col(owned, f"cap{i}"), _Col(owned, f"col{i}")
            kept[f"cap{i}"], kept[f"col{i}"] = cap.aux, col.aux
            kw = dict(capture_output=cap.capture, captured_last_layer_outputs=col)
        x = layer.attn.prepare(h, fb, **kw)
        h = layer.attn.finish(layer.wo(layer.wq(x)), fb)
        kept[f"snapA{i}"] = rb.snapshot(h, fb)  # a static attention sum, on a copy
        if ops_all:
            h, kept[f"copyF{i}"] = layer.ffn.capture_output(h, fb)
        x = layer.ffn.prepare(h, fb)
        with layer.ffn.exit(fb) as out:
            y = layer.down(layer.up(x))
        h = out.finish(y)
        kept[f"snapF{i}"] = rb.snapshot(h, fb)  # a deferred FFN sum (where deferred), on a copy
        if ops_all:
            if i in extras:  # deepstack: an extra contribution after this layer
                h = rb.add_to_output(h, fb, extras[i])
            if i % 2 == 1 and i + 1 in layers:  # a dynamic sum completed on the main output
                h, kept[f"copyA{i + 1}"] = layers[i + 1].attn.capture_output(h, fb)
            if i == 0:
                h = rb.complete_output(h, fb)
            if i == 1:  # compute that produced the full residual itself: fold, then written()
                h = rb.fold(h, fb)
                kept[f"fold{i}"] = h.clone()
                h = rb.written(h.clone(), fb)
    return h


def capture_forward(topo: Topology, case: dict, x_all: torch.Tensor, counts: tuple[int, ...],
                    reference: bool = False) -> dict[str, Any]:
    """Run the capture stack on ``topo`` (this rank's rows and layers); return what was kept."""
    layers_n = case["layers"]
    pp = topo.pp
    split = case.get("split", 0)
    lo, hi = (0, layers_n) if pp.size == 1 else ((0, split) if pp.rank == 0 else (split, layers_n))
    provider = {"defer": DeferAlways, "fused": InPlaceSum}.get(case.get("provider", ""), lambda: None)()
    ctx = BoundaryContext(topo, reduction=case.get("policy", "ar"))
    layers = {i: CapLayer(i, layers_n, ctx, provider) for i in range(lo, hi)}
    final = RMSNorm(H, dtype=F64)
    rb.bind_final_norm(final, read=HALF_READ)
    d = topo.attn_dp.rank
    r0 = sum(counts[:d])
    rows = slice(r0, r0 + counts[d])
    fb = ForwardBatch(num_tokens=counts[d], dp_num_tokens=counts if len(counts) > 1 else None,
                      input_scattered=case.get("scattered", False) and not reference)
    extras = {i: dyadic((sum(counts), H), 50 + i)[rows] for i in range(case.get("deepstack", 0))}
    kept: dict[str, Any] = {}
    owned: dict[str, bool] = {}
    between: list[bool] = []
    # Split prefill: the stream starts in the first segment and completes in the last; the model
    # keeps the handle and the batch between segments.
    cuts = [lo, *[c for c in case.get("segments", ()) if lo < c < hi and not reference], hi]
    h: Any = None
    for s, (a, b) in enumerate(zip(cuts, cuts[1:])):
        if s == 0:
            if lo == 0:
                rb.start(fb)
                h = x_all[rows].clone()
            else:
                h = layers[lo].attn.from_pp(ops.recv_tensors(pp), fb)
        h = _run_layers(layers, a, b, h, fb, case, extras, kept, owned)
        between.append(fb.residual_stream.released)
    if hi == layers_n:
        aux = AuxHiddenStateList()
        kept["final"] = rb.norm(h, fb, final, capture_output=aux.capture)
        kept["capF"] = aux
    else:
        ops.send_tensors(rb.to_pp(h, fb), pp)
    values = {k: (v[0] if isinstance(v, AuxHiddenStateList) else v) for k, v in kept.items()}
    return {"values": values, "owned": owned, "between": between, "released": fb.residual_stream.released,
            "runs": getattr(provider, "runs", None), "rows": (r0, r0 + counts[d]), "layers": (lo, hi)}


def _expected(key: str, first: int, last: int, case: dict) -> bool:
    """Whether a rank running layers ``[first, last)`` takes the value ``key`` names: a layer's
    own values, ``copyA{j}`` where layers ``j - 1`` and ``j`` are both local, the final norm's on
    the last stage."""
    digits = key.lstrip("abcdefghijklmnopqrstuvwxyzACF")
    if not digits:
        return last == case["layers"]
    j = int(digits)
    return first <= j < last and (not key.startswith("copyA") or first <= j - 1)


def capture_matrix(world: int, cases: list[dict]) -> list[dict]:
    out = []
    for case in cases:
        topo = topology(case.get("tp", world), case.get("dp", 1), case.get("pp", 1))
        counts = tuple(case["counts"])
        x_all = dyadic((sum(counts), H), 11)
        got = capture_forward(topo, case, x_all, counts)
        want = capture_forward(Topology.single(), case, x_all, (sum(counts),), reference=True)
        lo, hi = got["rows"]
        equal = {k: bool(torch.equal(v, want["values"][k][lo:hi])) for k, v in got["values"].items()}
        # Every capture the single-rank run took on this rank's layers was taken here too.
        first, last = got["layers"]
        missing = sorted(k for k in want["values"]
                         if k not in got["values"] and _expected(k, first, last, case))
        out.append({"case": case, "equal": equal, "missing": missing, "owned": got["owned"],
                    "between": got["between"],
                    "released": got["released"], "runs": got["runs"], "pp_rank": topo.pp.rank,
                    "attn_tp": topo.attn_tp.size})
    return out


# -- LoRA rows -----------------------------------------------------------------------------------

ADAPTERS, RANK = 3, 2


class LoraLayer(nn.Module):
    """``CapLayer``'s compute with a per-token LoRA on each column-parallel projection:
    ``y += (x A[a]^T) B[a]^T`` with ``B`` sharded by output rows like the base weight."""

    def __init__(self, i: int, layers: int, ctx: BoundaryContext) -> None:
        super().__init__()
        self.base = CapLayer(i, layers, ctx)
        self.lora = {}
        for k, (name, lin, out_f) in enumerate((("wq", self.base.wq, H), ("up", self.base.up, F))):
            a = dyadic((ADAPTERS, RANK, H), 700 + 10 * i + k)
            b = dyadic((ADAPTERS, out_f, RANK), 800 + 10 * i + k)
            b[0] = 0  # adapter 0: no LoRA
            n = lin.output_size_per_partition
            self.lora[name] = (a, b[:, lin.group.rank * n:(lin.group.rank + 1) * n])

    def _lora(self, name: str, lin: nn.Module, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        a, b = self.lora[name]
        t = torch.einsum("nh,nrh->nr", x, a[ids])
        return lin(x) + torch.einsum("nr,nor->no", t, b[ids])

    def forward(self, h: Any, fb: Any, ids_all: torch.Tensor, ids_local: torch.Tensor,
                log: list[dict]) -> Any:
        base = self.base
        for stage in ("attn", "ffn"):
            boundary = getattr(base, stage)
            rows = boundary.input_rows(fb)
            x = boundary.prepare(h, fb)
            ids = rows.gather(ids_local)  # the same row move as the input, for this group's ids
            log.append({"stage": stage, "kind": rows.kind.value, "num_rows": rows.num_rows,
                        "input_rows": x.shape[0], "residual_rows": rows.residual_rows,
                        "select_equal": bool(torch.equal(rows.select(ids_all), ids)),
                        "index_equal": bool(torch.equal(ids_all[rows.token_index()], ids))})
            if stage == "attn":
                h = boundary.finish(base.wo(self._lora("wq", base.wq, x, ids)), fb)
            else:
                with boundary.exit(fb) as out:
                    y = base.down(self._lora("up", base.up, x, ids))
                h = out.finish(y)
        return h


def lora_forward(topo: Topology, case: dict, counts: tuple[int, ...], reference: bool = False) -> dict:
    ctx = BoundaryContext(topo, reduction=case.get("policy", "ar"))
    layers = [LoraLayer(i, case["layers"], ctx) for i in range(case["layers"])]
    final = RMSNorm(H, dtype=F64)
    rb.bind_final_norm(final, read=HALF_READ)
    d = topo.attn_dp.rank
    r0 = sum(counts[:d])
    ids_all = torch.randint(0, ADAPTERS, (sum(counts),), generator=torch.Generator().manual_seed(5))
    fb = ForwardBatch(num_tokens=counts[d], dp_num_tokens=counts if len(counts) > 1 else None,
                      input_scattered=case.get("scattered", False) and not reference)
    rb.start(fb)
    h: Any = dyadic((sum(counts), H), 13)[r0 : r0 + counts[d]].clone()
    log: list[dict] = []
    for layer in layers:
        h = layer(h, fb, ids_all, ids_all[r0 : r0 + counts[d]], log)
    return {"out": rb.norm(h, fb, final), "log": log, "rows": (r0, r0 + counts[d])}


def lora_matrix(world: int, cases: list[dict]) -> list[dict]:
    out = []
    for case in cases:
        topo = topology(world, case.get("dp", 1))
        counts = tuple(case["counts"])
        got = lora_forward(topo, case, counts)
        want = lora_forward(Topology.single(), case, (sum(counts),), reference=True)
        lo, hi = got["rows"]
        out.append({"case": case, "equal": bool(torch.equal(got["out"], want["out"][lo:hi])),
                    "log": got["log"], "attn_tp_rank": topo.attn_tp.rank, "attn_tp": topo.attn_tp.size,
                    "dp_rank": topo.attn_dp.rank})
    return out


# -- NextN draft ---------------------------------------------------------------------------------


def draft_logits(topo: Topology, case: dict, reference: bool = False) -> tuple[list[int], torch.Tensor]:
    """Target forward, then the NextN draft on its hidden states, on this rank's sequences."""
    from layer_boundary_app.models.config import small_random_config
    from layer_boundary_app.models.nextn import Qwen3NextNForCausalLM, init_random_nextn_weights
    from layer_boundary_app.models.qwen3 import Qwen3ForCausalLM
    from layer_boundary_app.models.random_init import init_random_weights
    from layer_boundary_app.models.runner import assign_sequences

    seqs = [tuple(s) for s in case["sequences"]]
    dp = topo.attn_dp.size
    ctx = BoundaryContext(topo, reduction=case.get("policy", "ar"))
    target = Qwen3ForCausalLM(small_random_config(), context=ctx, dtype=F64)
    init_random_weights(target, seed=1)
    draft = Qwen3NextNForCausalLM(target, context=BoundaryContext(topo, reduction=case.get("policy", "ar")),
                                  num_layers=case.get("draft_layers", 1), dtype=F64)
    init_random_nextn_weights(draft, seed=2)
    groups = assign_sequences(len(seqs), dp)
    counts = tuple(sum(len(seqs[i]) for i in g) for g in groups)
    mine = groups[topo.attn_dp.rank]
    starts = [0]
    for s in seqs:
        starts.append(starts[-1] + len(s))
    index = [starts[i] + j for i in mine for j in range(len(seqs[i]))]
    ids = torch.tensor([t for i in mine for t in seqs[i]], dtype=torch.long)
    nxt = torch.tensor([t for i in mine for t in (*seqs[i][1:], 7)], dtype=torch.long)  # the draft's tokens
    pos = torch.cat([torch.arange(len(seqs[i])) for i in mine]) if mine else torch.zeros(0, dtype=torch.long)

    def batch() -> ForwardBatch:
        return ForwardBatch(num_tokens=len(ids), positions=pos,
                            seq_lens=tuple(len(seqs[i]) for i in mine) or None,
                            dp_num_tokens=counts if dp > 1 else None,
                            input_scattered=case.get("scattered", False) and not reference)

    with torch.inference_mode():
        hidden = target.model(ids, pos, batch())
        fb = batch()
        logits = draft(nxt, pos, hidden, fb)
    assert fb.residual_stream.released
    return index, logits


def draft_matrix(world: int, cases: list[dict]) -> list[dict]:
    out = []
    for case in cases:
        topo = topology(world, case.get("dp", 1))
        index, logits = draft_logits(topo, case)
        _, want = draft_logits(Topology.single(), case, reference=True)
        diff = (logits - want[index]).abs().max().item() if index else 0.0
        out.append({"case": case, "rows": len(index), "max_diff": diff})
    return out


# -- the cases, one spawn per world size ---------------------------------------------------------

CAPTURE = {
    2: [
        dict(counts=(5,), layers=3, deepstack=2, provider="defer", segments=(1, 2)),
        dict(counts=(4,), layers=4, provider="fused", ops="snapshot", capture_every=2),
        dict(dp=2, policy="ar", counts=(3, 5), layers=3, deepstack=2, segments=(2,)),
        dict(dp=2, policy="rs", counts=(0, 3), layers=2, deepstack=1),
        dict(dp=2, policy="rsv", counts=(4, 1), layers=2, deepstack=2),
        dict(dp=2, policy="rs+rsv", counts=(2, 2), layers=2, deepstack=1, provider="defer"),
        dict(counts=(5,), layers=3, deepstack=2, scattered=True, segments=(1,)),
        dict(counts=(1,), layers=2, deepstack=1, scattered=True),
        dict(tp=1, pp=2, counts=(4,), layers=3, split=2, deepstack=3, provider="defer"),
    ],
    4: [
        dict(counts=(6,), layers=3, provider="fused", ops="snapshot", capture_every=2),
        dict(dp=2, policy="rs", counts=(3, 4), layers=3, deepstack=2, segments=(1,)),
        dict(dp=4, policy="rsv", counts=(1, 0, 3, 2), layers=2, deepstack=1),
        dict(dp=2, policy="ar", counts=(3, 6), layers=2, deepstack=2, scattered=True),
        dict(tp=2, pp=2, counts=(5,), layers=3, split=1, deepstack=2, provider="defer"),
    ],
}
LORA = {
    2: [
        dict(counts=(5,), layers=2),
        dict(dp=2, policy="ar", counts=(3, 5), layers=2),
        dict(dp=2, policy="rsv", counts=(0, 3), layers=1),
        dict(counts=(5,), layers=2, scattered=True),
    ],
    4: [
        dict(dp=2, policy="rs", counts=(3, 4), layers=2),
        dict(dp=4, policy="rsv", counts=(1, 0, 3, 2), layers=1),
        dict(dp=2, policy="ar", counts=(3, 6), layers=2, scattered=True),
        dict(counts=(7,), layers=1, scattered=True),
    ],
}
DRAFT = {
    2: [
        dict(sequences=[[1, 5, 9], [4, 2]]),
        dict(dp=2, policy="rs+rsv", sequences=[[1, 5, 9, 2], [4, 8], [3]]),
        dict(sequences=[[2, 7, 1, 8, 2]], scattered=True),
    ],
    4: [
        dict(dp=2, policy="rs", sequences=[[1, 5, 9], [4, 8, 16, 2]], draft_layers=2),
    ],
}


def matrix(rank: int, world: int, capture: list[dict], lora: list[dict], draft: list[dict]) -> dict:
    return {"capture": capture_matrix(world, capture), "lora": lora_matrix(world, lora),
            "draft": draft_matrix(world, draft)}


_RESULTS: dict[int, list[dict]] = {}


def results(world: int) -> list[dict]:
    """Every rank's results for ``world`` ranks, from one spawn per pytest process."""
    if world not in _RESULTS:
        from layer_boundary_app.launch import spawn

        _RESULTS[world] = spawn(matrix, world, args=(CAPTURE[world], LORA[world], DRAFT[world]),
                                timeout_s=240)
    return _RESULTS[world]
