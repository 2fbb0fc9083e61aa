"""Worker functions for the multi-process tests (importable by spawned ranks).

A synthetic linear stack with dyadic float64 data makes every sum exact, so each parallel path
must give the single-rank numbers bit for bit; the Qwen3 reference checks the same paths on a
real decoder within the float tolerance.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from layer_boundary import (BoundaryContext, ForwardBatch, ProducerReduction, Topology, declare_attn,
                            declare_ffn, get_forward, make_stages)
from layer_boundary import _ops as ops
from layer_boundary_app.models.layers import ColumnParallelLinear, RowParallelLinear
from layer_boundary.residual import batch as residual_batch

H, F = 8, 16


def dyadic(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Multiples of 1/4 in [-1, 1]: through a few layers every product and sum stays exact in
    float64 (each matmul adds two bits of granularity; magnitudes stay far below 2^50)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=g).double() / 4


class DeferAlways:
    """Fusion provider that asks every SCOPED exit to leave its sum to the next input: only the
    LOCAL_TAIL rule (the boundary never defers that sum) keeps a tail FFN from deferring."""

    name = "test-defer-always"

    def __init__(self) -> None:
        self.asked = 0

    def can_defer_all_reduce(self, plan: Any, forward_batch: Any) -> bool:
        self.asked += 1
        return True


# (fuse_mlp_allreduce, mlp_reduce_scatter) that each LOCAL_TAIL compute saw, in call order.
TAIL_FLAGS: list[tuple[bool, bool]] = []


def _tail_decl() -> Any:
    return declare_ffn(reduction=ProducerReduction.LOCAL_TAIL)


class LinearLayer(nn.Module):
    """attention-like PARTIAL stage (row-parallel projection) + FFN (column then row parallel),
    identity norms, so every value stays dyadic.

    ``tail``: the FFN is ``LOCAL_TAIL``: after its internal sum it adds a replicated component
    ``t(x) = x/2 + b`` (a row-dependent part computed from the replicated input, and a bias). When
    the exit publishes a skip flag the sum happens later, so ``t`` is added on TP rank 0 only,
    before that sum; otherwise compute sums and every rank adds ``t``.
    """

    def __init__(self, i: int, layers: int, ctx: BoundaryContext, tail: bool = False) -> None:
        super().__init__()
        self.tail = tail
        topo = ctx.topology
        self.wq = ColumnParallelLinear(H, H, bias=False, group=topo.attn_tp, dtype=torch.float64)
        self.wo = RowParallelLinear(H, H, bias=False, group=topo.attn_tp, reduce_results=False, dtype=torch.float64)
        self.up = ColumnParallelLinear(H, F, bias=False, group=topo.tp, dtype=torch.float64)
        self.down = RowParallelLinear(F, H, bias=False, group=topo.tp, dtype=torch.float64)
        for lin, (o, k), s in ((self.wq, (H, H), 3), (self.wo, (H, H), 0), (self.up, (F, H), 1),
                               (self.down, (H, F), 2)):
            lin.weight_loader(lin.weight, dyadic((o, k), 100 * i + s))
        self.register_buffer("b", dyadic((H,), 100 * i + 4))
        self.n1, self.n2 = nn.Identity(), nn.Identity()
        ffn = _tail_decl() if tail else declare_ffn()
        # The tail FFN gets a provider that always asks to defer: the boundary must refuse.
        ffn_item = (ffn, self.n2, {"fusions": DeferAlways()}) if tail else (ffn, self.n2)
        self.attn, self.ffn = make_stages((declare_attn(), self.n1), ffn_item,
                                          previous=ffn if i else None,
                                          terminal=i == layers - 1, context=ctx)

    def forward(self, h: Any, fb: Any) -> Any:
        x = self.attn.prepare(h, fb)
        h = self.attn.finish(self.wo(self.wq(x)), fb)
        x = self.ffn.prepare(h, fb)
        with self.ffn.exit(fb) as out:
            y = self.down(self.up(x))
            if self.tail:
                f = get_forward()
                TAIL_FLAGS.append((f.fuse_mlp_allreduce, f.mlp_reduce_scatter))
                if not (f.fuse_mlp_allreduce or f.mlp_reduce_scatter) or self.down.group.rank == 0:
                    y = y + (x / 2 + self.b)
        return out.finish(y)


class BoundaryStack(nn.Module):
    """A synthetic stack as a model runs it: the stack's entry (a fresh residual stream), each
    ``layer(h, fb)``, and the exit's read through an identity final norm."""

    def __init__(self, layers: Iterable[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = nn.Identity()

    def forward(self, x: torch.Tensor, fb: Any) -> torch.Tensor:
        residual_batch.start(fb)
        h: Any = x
        for layer in self.layers:
            h = layer(h, fb)
        return residual_batch.norm(h, fb, self.norm, skip_empty=True)


class LinearStack(BoundaryStack):
    def __init__(self, layers: int, ctx: BoundaryContext, tail: bool = False) -> None:
        super().__init__(LinearLayer(i, layers, ctx, tail) for i in range(layers))


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


_TOPOLOGIES: dict[tuple[int, int, int, int], Topology] = {}


def topology(tp: int, dp: int, pp: int = 1, cp: int = 1) -> Topology:
    """One set of process groups per layout for the whole worker (groups are expensive)."""
    if (tp, dp, pp, cp) not in _TOPOLOGIES:
        _TOPOLOGIES[(tp, dp, pp, cp)] = Topology.from_sizes(tp=tp, dp=dp, pp=pp, cp=cp)
    return _TOPOLOGIES[(tp, dp, pp, cp)]


def dp_rows(topo: Topology, counts: tuple[int, ...], *, scattered: bool = False,
            device: str = "cpu") -> tuple[torch.Tensor, ForwardBatch]:
    """This attention-DP group's rows of the stack input ``dyadic((sum(counts), H), 7)`` (group
    ``d`` holds ``counts[d]`` rows, in order) and the forward batch that carries them."""
    d = topo.attn_dp.rank
    x_all = dyadic((sum(counts), H), 7).to(device)
    lo = sum(counts[:d])
    fb = ForwardBatch(num_tokens=counts[d], dp_num_tokens=counts if topo.attn_dp.size > 1 else None,
                      input_scattered=scattered)
    return x_all[lo : lo + counts[d]], fb


def linear_matrix(rank: int, world: int, cases: list[dict[str, Any]], device: str = "cpu") -> list[dict[str, Any]]:
    """Run each case (dp, policy, counts, layers) on this rank and on one rank; compare."""
    results = []
    for case in cases:
        dp, counts, layers = case["dp"], tuple(case["counts"]), case["layers"]
        topo = topology(world, dp)
        ctx = BoundaryContext(topo, reduction=case["policy"])
        tail = case.get("tail", False)
        model = LinearStack(layers, ctx, tail).to(device)
        ref = LinearStack(layers, BoundaryContext(Topology.single()), tail).to(device)
        x, fb = dp_rows(topo, counts, scattered=case.get("scattered", False), device=device)
        TAIL_FLAGS.clear()
        with count_collectives() as n:
            out = model(x.clone(), fb)
        flags = list(TAIL_FLAGS)
        want = ref(x.clone(), ForwardBatch(num_tokens=x.shape[0]))
        results.append({
            "case": case, "equal": bool(torch.equal(out.cpu(), want.cpu())), "shape": tuple(out.shape),
            "collectives": dict(n), "tail_flags": flags,
            "returns": [s.chosen for s in ctx.report.selections if s.what == "output return"][:1],
        })
    return results


def expected_collectives(world: int, dp: int, layers: int, returns: list[str], *,
                          scattered: bool = False) -> dict[str, int]:
    """What ``count_collectives`` should see for a stack of attention + FFN layers: each owed sum
    and each row move exactly once per layer. ``returns``: the stack's "output return" choices
    (the first one decides the FFN output's return under attention DP)."""
    attn_tp = world // dp
    n: dict[str, int] = {}

    def add(k: str, v: int = 1) -> None:
        n[k] = n.get(k, 0) + v * layers

    if scattered:
        # Each layer: attention input gathered over attention TP; its partial sum reduce-scattered
        # back to the slice; FFN input gathered over TP; FFN output reduce-scattered to the slice.
        add("all_gather", 2)
        add("reduce_scatter", 2)
        n["all_gather"] += 1  # the final norm's output back to the group's rows
        return n
    if dp == 1:
        add("all_reduce", 2)  # the attention sum at the FFN input, the FFN sum in compute
        return n
    add("all_reduce")  # joined: attention sum + residual add + DP gather in one all-reduce
    ret = returns[0].split("/")[0]
    if ret == "ar":
        add("all_reduce")
    elif ret == "rs":
        add("reduce_scatter")
        if attn_tp > 1:
            add("all_gather")
    else:
        add("all_to_all")
    return n


@contextlib.contextmanager
def count_dp_moves() -> Iterator[dict[str, int]]:
    """How often the FFN input under attention DP took each path: ``joined_sum`` (the attention
    sum, the plain add and the gather in one all-reduce) or ``gather`` (read on the local rows,
    then the normalized input gathered: the ``before_gather`` read order)."""
    from layer_boundary._dp import DpRows

    counts = {"gather": 0, "joined_sum": 0}
    saved = {name: getattr(DpRows, name) for name in counts}

    def wrap(name: str) -> Any:
        orig = saved[name]

        def counted(self: Any, *a: Any, **k: Any) -> Any:
            counts[name] += 1
            return orig(self, *a, **k)

        return counted

    for name in counts:
        setattr(DpRows, name, wrap(name))
    try:
        yield counts
    finally:
        for name, orig in saved.items():
            setattr(DpRows, name, orig)


def qwen3_matrix(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Qwen3 reference on each case's layout against the single-rank model."""
    from layer_boundary._layout import BatchVariant
    from layer_boundary_app.models.runner import RunSpec, build_model, rank_forward, single_rank_logits

    results = []
    for case in cases:
        residual = case.get("residual", "plain")
        # A residual scheme other than plain comes from a plugin: discover them.
        spec = RunSpec(sequences=tuple(tuple(s) for s in case["sequences"]), tp=world, dp=case["dp"],
                       reduction=case["policy"], dtype=case.get("dtype", "float64"),
                       residual=residual, plugins=residual != "plain",
                       config_overrides=case.get("config", {}),
                       input_scattered=case.get("scattered", False))
        topo = topology(world, case["dp"])
        model = build_model(spec, topo, "cpu")
        with count_dp_moves() as moves:
            idx, logits, _ = rank_forward(model, spec, "cpu")
        want = single_rank_logits(spec)[idx] if idx else logits[:0]
        results.append({"case": case, "max_diff": (logits - want).abs().max().item() if idx else 0.0,
                        "rows": len(idx), "dp_moves": moves,
                        "layers": len(model.model.layers),
                        "dp_gather": [layer.ffn_boundary.plan.entries[BatchVariant.ORDINARY].rows.input_move
                                      for layer in model.model.layers]})
    return results


# -- pipeline parallel ---------------------------------------------------------------------------


class LinStage(nn.Module):
    """One stage of a synthetic stack: ``a`` (A) a PARTIAL attention-like row-parallel pair over
    attention TP, or (F) an FFN column/row pair over TP; identity norms, dyadic weights, so every
    sum is exact. Weights depend on the stage's global index only."""

    def __init__(self, kind: str, j: int, topo: Topology) -> None:
        super().__init__()
        self.kind = kind
        if kind == "A":
            self.a = ColumnParallelLinear(H, H, bias=False, group=topo.attn_tp, dtype=torch.float64)
            self.b = RowParallelLinear(H, H, bias=False, group=topo.attn_tp, reduce_results=False,
                                       dtype=torch.float64)
            shapes = ((H, H), (H, H))
        else:
            self.a = ColumnParallelLinear(H, F, bias=False, group=topo.tp, dtype=torch.float64)
            self.b = RowParallelLinear(F, H, bias=False, group=topo.tp, dtype=torch.float64)
            shapes = ((F, H), (H, F))
        for lin, shape, s in ((self.a, shapes[0], 0), (self.b, shapes[1], 1)):
            lin.weight_loader(lin.weight, dyadic(shape, 1000 + 10 * j + s))
        self.norm = nn.Identity()

    def run(self, boundary: Any, h: Any, fb: Any) -> Any:
        x = boundary.prepare(h, fb)
        if self.kind == "A":
            return boundary.finish(self.b(self.a(x)), fb)
        with boundary.exit(fb) as out:
            y = self.b(self.a(x))
        return out.finish(y)


def _lin_decl(kind: str) -> Any:
    return declare_attn() if kind == "A" else declare_ffn()


def linear_pipeline(topo: Topology, kinds: str, split: int, x: torch.Tensor,
                    defer_last: bool = False) -> dict[str, Any]:
    """Run the stack ``kinds`` (e.g. "AFA|FAF" without the bar) with stages ``[0, split)`` on
    pipeline stage 0 and the rest on stage 1 (everything on a single-stage topology).
    ``defer_last``: the sender's last stage (an FFN) is asked to defer its sum dynamically."""
    from layer_boundary.residual.batch import PP_META

    pp = topo.pp
    ctx = BoundaryContext(topo)
    stages = [LinStage(k, j, topo) for j, k in enumerate(kinds)]
    lo, hi = (0, len(kinds)) if pp.size == 1 else ((0, split) if pp.rank == 0 else (split, len(kinds)))
    defer = DeferAlways()
    items = []
    for j in range(lo, hi):
        item: tuple = (_lin_decl(kinds[j]), stages[j].norm)
        if defer_last and j == hi - 1 and pp.rank == 0 and pp.size > 1:
            item = (*item, {"fusions": defer})
        items.append(item)
    prev = None if lo == 0 else _lin_decl(kinds[lo - 1])
    bounds = make_stages(*items, previous=prev, terminal=hi == len(kinds), context=ctx)
    fb = ForwardBatch(num_tokens=x.shape[0])
    out: dict[str, Any] = {"errors": []}
    with count_collectives() as n:
        if lo == 0:
            residual_batch.start(fb)
            h: Any = x.clone()
        else:
            tensors = ops.recv_tensors(pp)
            out["received_meta"] = tensors[PP_META].tolist()
            # A receiver whose previous= contradicts what arrived is refused before any collective.
            wrong = declare_ffn() if kinds[lo - 1] == "A" else declare_attn()
            bad = make_stages((_lin_decl(kinds[lo]), nn.Identity()), previous=wrong,
                              terminal=True, context=BoundaryContext(topo))
            try:
                bad[0].from_pp(tensors, ForwardBatch(num_tokens=x.shape[0]))
            except Exception as e:  # noqa: BLE001 - recorded for the test
                out["errors"].append(f"{type(e).__name__}: {e}")
            h = bounds[0].from_pp(tensors, fb)
        for j, b in zip(range(lo, hi), bounds):
            h = stages[j].run(b, h, fb)
        if hi == len(kinds):
            out["value"] = residual_batch.norm(h, fb, nn.Identity(), skip_empty=True)
        else:
            sent = residual_batch.to_pp(h, fb)
            out["sent_meta"] = sent[PP_META].tolist()
            out["released"] = fb.residual_stream.released
            ops.send_tensors(sent, pp)
    out["all_reduce"] = n.get("all_reduce", 0)
    out["deferred_asks"] = defer.asked
    return out


def pipeline_matrix(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pipeline-parallel cases: the Qwen3 reference over tp x pp, and the synthetic stack whose
    partition falls after a PARTIAL attention (or after an FFN that deferred its sum)."""
    from layer_boundary_app.models.runner import RunSpec, build_model, rank_forward, single_rank_logits

    results = []
    for case in cases:
        pp, dp = case["pp"], case.get("dp", 1)
        tp = world // pp
        topo = topology(tp, dp, pp)
        r: dict[str, Any] = {"case": case, "pp_rank": topo.pp.rank, "pp_ranks": topo.pp.ranks}
        if case["kind"] == "qwen3":
            spec = RunSpec(sequences=tuple(tuple(s) for s in case["sequences"]), tp=tp, dp=dp, pp=pp,
                           dtype="float64", plugins=False)
            model = build_model(spec, topo, "cpu")
            idx, logits, _ = rank_forward(model, spec, "cpu")
            want = single_rank_logits(spec)[idx] if idx else logits[:0]
            r.update(rows=len(idx), max_diff=(logits - want).abs().max().item() if idx else 0.0,
                     layers=[layer.layer_id for layer in model.model.layers],
                     terminal=[layer.ffn_boundary.plan.declaration.terminal for layer in model.model.layers])
        else:
            x = dyadic((5, H), 7)
            got = linear_pipeline(topo, case["kinds"], case["split"], x, case.get("defer", False))
            if "value" in got:
                want = linear_pipeline(Topology.single(), case["kinds"], case["split"], x)["value"]
                got["equal"] = bool(torch.equal(got.pop("value"), want))
            r.update(got)
        results.append(r)
    return results


def matrix(rank: int, world: int, linear: list[dict[str, Any]], qwen: list[dict[str, Any]],
           pipeline: list[dict[str, Any]] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    """All matrices in one spawn: process groups are created once per layout."""
    return {"linear": linear_matrix(rank, world, linear), "qwen3": qwen3_matrix(rank, world, qwen),
            "pipeline": pipeline_matrix(rank, world, list(pipeline))}


def disagreeing_tp_batches(rank: int, world: int, sequence_parallel: bool) -> str:
    """TP=2 without attention DP, rank 1 given 4 rows and rank 0 six (a trial: gloo aborted in
    its pair transport, "Received data size doesn't match expected size"); with the check on, every
    rank's stack entry raises naming both counts. Returns the error text."""
    from layer_boundary import BoundaryError

    topo = topology(world, 1)
    n = 4 if rank == 1 else 6
    model = LinearStack(1, BoundaryContext(topo), False)
    try:
        model(dyadic((n, H), 3), ForwardBatch(num_tokens=n, sequence_parallel=sequence_parallel))
    except BoundaryError as e:
        return str(e)
    return "no error"


def disagreeing_dp_counts(rank: int, world: int) -> str:
    """Ranks of one TP=2 x DP=2 layout give the batch different dp_num_tokens (rank 1 believes
    group 1 has 4 rows, not 3); with LAYER_BOUNDARY_CHECK_DP_COUNTS on, every rank's first row
    move raises. Returns the error text."""
    from layer_boundary import BoundaryError

    topo = topology(world, 2)
    counts = (2, 4) if rank == 1 else (2, 3)
    ctx = BoundaryContext(topo)
    model = LinearStack(1, ctx, False)
    d = topo.attn_dp.rank
    x = dyadic((counts[d], H), 3)
    try:
        model(x, ForwardBatch(num_tokens=counts[d], dp_num_tokens=counts))
    except BoundaryError as e:
        return str(e)
    return "no error"


# The case matrices per world size (linear stack, Qwen3 reference, pipeline stages), shared by
# multi_rank/test_parallel.py (gloo) and gpu/test_gpu_parallel.py (NCCL).
LINEAR_2 = [
    dict(dp=1, policy="ar", counts=(5,), layers=2),
    dict(dp=1, policy="rs+rsv", counts=(1,), layers=1),
    dict(dp=1, policy="ar", counts=(0,), layers=2),
    dict(dp=2, policy="ar", counts=(3, 5), layers=2),
    dict(dp=2, policy="rs", counts=(3, 5), layers=3),
    dict(dp=2, policy="rsv", counts=(4, 1), layers=2),
    dict(dp=2, policy="rs+rsv", counts=(0, 3), layers=2),
    dict(dp=2, policy="rs", counts=(0, 0), layers=1),
    dict(dp=2, policy="auto", counts=(2, 2), layers=2),
    dict(dp=1, policy="ar", counts=(5,), layers=2, scattered=True),
    dict(dp=1, policy="ar", counts=(0,), layers=1, scattered=True),
    # LOCAL_TAIL FFNs: the replicated component is added exactly once on every path.
    dict(dp=1, policy="ar", counts=(5,), layers=2, tail=True),
    dict(dp=2, policy="ar", counts=(3, 5), layers=2, tail=True),
    dict(dp=2, policy="rs", counts=(0, 3), layers=2, tail=True),
    dict(dp=2, policy="rsv", counts=(4, 1), layers=3, tail=True),
    dict(dp=2, policy="rsv", counts=(0, 0), layers=1, tail=True),
    dict(dp=1, policy="ar", counts=(5,), layers=2, scattered=True, tail=True),
]
LINEAR_4 = [
    dict(dp=1, policy="ar", counts=(6,), layers=2),
    dict(dp=2, policy="ar", counts=(3, 4), layers=2),
    dict(dp=2, policy="rs", counts=(5, 0), layers=2),
    dict(dp=2, policy="rs+rsv", counts=(2, 3), layers=3),  # rsv refused: attention TP 2
    dict(dp=4, policy="rsv", counts=(1, 0, 3, 2), layers=2),
    dict(dp=4, policy="rs", counts=(2, 2, 2, 2), layers=1),
    dict(dp=4, policy="ar", counts=(0, 0, 1, 0), layers=2),
    dict(dp=1, policy="ar", counts=(7,), layers=3, scattered=True),
    dict(dp=2, policy="ar", counts=(3, 6), layers=2, scattered=True),
    dict(dp=2, policy="rs", counts=(0, 1), layers=2, scattered=True),
    dict(dp=1, policy="ar", counts=(6,), layers=2, tail=True),
    dict(dp=2, policy="rs", counts=(5, 0), layers=2, tail=True),
    dict(dp=2, policy="rsv", counts=(2, 3), layers=2, tail=True),  # RSv refused: all-reduce
    dict(dp=4, policy="rsv", counts=(1, 0, 3, 2), layers=3, tail=True),
    dict(dp=4, policy="rs", counts=(0, 2, 0, 1), layers=2, tail=True),
    dict(dp=4, policy="ar", counts=(0, 0, 1, 0), layers=2, tail=True),
    dict(dp=1, policy="ar", counts=(7,), layers=2, scattered=True, tail=True),
    dict(dp=2, policy="rs", counts=(3, 6), layers=2, scattered=True, tail=True),
    dict(dp=2, policy="ar", counts=(0, 1), layers=1, scattered=True, tail=True),
]

# TP=8, TP=4 x DP=2, TP=2 x DP=4: uneven and empty token counts, each reduction policy, local tails.
LINEAR_8 = [
    dict(dp=1, policy="ar", counts=(9,), layers=2),
    dict(dp=2, policy="rs", counts=(5, 0), layers=2),
    dict(dp=2, policy="rs+rsv", counts=(2, 3), layers=2),  # rsv refused: attention TP 4
    dict(dp=4, policy="rsv", counts=(1, 0, 3, 2), layers=2),  # refused: attention TP 2; all-reduce
    dict(dp=4, policy="rs", counts=(2, 2, 0, 1), layers=1),
    dict(dp=1, policy="ar", counts=(7,), layers=2, scattered=True),
    dict(dp=1, policy="ar", counts=(6,), layers=2, tail=True),
    dict(dp=2, policy="rs", counts=(5, 0), layers=2, tail=True),
    dict(dp=2, policy="ar", counts=(3, 4), layers=1, tail=True),
    dict(dp=4, policy="rs", counts=(0, 2, 0, 1), layers=2, tail=True),
    dict(dp=4, policy="ar", counts=(0, 0, 1, 0), layers=2, tail=True),
    dict(dp=1, policy="ar", counts=(7,), layers=1, scattered=True, tail=True),
]

QWEN_2 = [
    dict(dp=1, policy="ar", sequences=[[1, 5, 9], [4]]),
    dict(dp=2, policy="rs+rsv", sequences=[[1, 5, 9, 2], [4, 8]]),
    dict(dp=2, policy="rs", sequences=[[3, 3, 7]]),  # DP group 1 gets no sequence
    dict(dp=2, policy="ar", sequences=[[1], [2], [3]]),
    dict(dp=1, policy="ar", sequences=[[1, 5, 9], [4, 4]], scattered=True),
    # MHC: non-plain update, before_gather read: the FFN input is read on the local rows and the
    # normalized input gathered, never joined into the sum.
    dict(dp=2, policy="rs+rsv", sequences=[[1, 5, 9, 2], [4, 8]], residual="mhc"),
    dict(dp=2, policy="ar", sequences=[[3, 3, 7]], residual="mhc"),  # DP group 1 gets nothing
    # MHC on row slices: the expanded residual [T, n, H] is sliced and gathered by rows.
    dict(dp=1, policy="ar", sequences=[[2, 7, 1, 8, 2]], residual="mhc", scattered=True),
]
QWEN_4 = [
    dict(dp=1, policy="ar", sequences=[[1, 5, 9, 11, 30]]),
    dict(dp=2, policy="rs", sequences=[[1, 5, 9], [4, 8, 16, 2]]),
    dict(dp=4, policy="rsv", sequences=[[1, 5], [7], [9, 9, 9]]),
    dict(dp=4, policy="ar", sequences=[[6, 2, 7, 1]], dtype="float32"),
    dict(dp=2, policy="rs", sequences=[[1, 5, 9], [4, 8, 16, 2], [3]], scattered=True),
    dict(dp=1, policy="ar", sequences=[[2, 4, 6, 8, 10, 12, 14]], scattered=True),
    dict(dp=2, policy="rs", sequences=[[1, 5, 9], [4, 8, 16, 2], [3]], residual="mhc"),
]

# Eight attention heads (two KV heads, replicated where attention TP exceeds them) so that every
# layout of 8 ranks shards the heads.
HEADS_8 = dict(num_attention_heads=8, num_key_value_heads=2)
QWEN_8 = [
    dict(dp=1, policy="ar", sequences=[[1, 5, 9, 11, 30]], config=HEADS_8),
    dict(dp=2, policy="rs", sequences=[[1, 5, 9], [4, 8, 16, 2]], config=HEADS_8),
    dict(dp=4, policy="rsv", sequences=[[1, 5], [7], [9, 9, 9]], config=HEADS_8),  # DP group 3 empty
    dict(dp=2, policy="rs", sequences=[[1, 5, 9], [4, 8, 16, 2], [3]], scattered=True, config=HEADS_8),
    dict(dp=2, policy="rs", sequences=[[1, 5, 9], [4, 8, 16, 2], [3]], residual="mhc", config=HEADS_8),
]


# Pipeline parallel (world = tp x pp): the Qwen3 reference, and the synthetic stack "kinds" (A a
# PARTIAL attention, F an FFN) split after stage ``split``.
PIPE_2 = [
    dict(kind="qwen3", pp=2, sequences=[[1, 5, 9], [4]]),
]
PIPE_4 = [
    dict(kind="qwen3", pp=2, sequences=[[1, 5, 9, 11], [4, 2]]),
    dict(kind="qwen3", pp=2, dp=2, sequences=[[1, 5, 9], [4, 8, 16, 2]]),
    dict(kind="qwen3", pp=4, sequences=[[3, 1, 4, 1, 5]]),
    # The partition falls right after a PARTIAL attention: its sum crosses as a partial.
    dict(kind="linear", pp=2, kinds="AFAFAF", split=3),
    # ... after an FFN whose exit deferred its sum: to_pp completes it before transport.
    dict(kind="linear", pp=2, kinds="AFAFAF", split=2, defer=True),
]
PIPE_8 = [
    dict(kind="qwen3", pp=2, sequences=[[1, 5, 9, 11], [4, 2]]),  # TP 4: the four heads shard
]
MATRICES = {2: (LINEAR_2, QWEN_2, PIPE_2), 4: (LINEAR_4, QWEN_4, PIPE_4), 8: (LINEAR_8, QWEN_8, PIPE_8)}
