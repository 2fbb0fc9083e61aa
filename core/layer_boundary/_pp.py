"""Pipeline handoff: ``to_pp()`` leaves a pipeline partition, ``from_pp()`` enters the next one.

What travels is the stream's state, not its objects: the residual, the producer output, and
which statically declared partial sums the receiver still owes (one small int64 tensor of
metadata). Dynamic owed work is completed before sending; a statically declared sum is not, and
the receiver's first stage completes it over its own group, after checking it is the one its
``previous=`` declares. Plain-add updates only.

``residual_batch.to_pp`` and ``StageBoundary.from_pp`` are the public names of these two.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from . import _ops as ops
from ._adapters.branch import refuse_unmerged
from ._construction import output_sum
from ._contracts import Owed, OwedKind
from ._edges import check_edge
from ._errors import BoundaryError
from ._layout import SumGroup
from ._output import HandoffOutput
from .residual._access import check_shape
from .residual._stream import Handle, ResidualStream, StreamState, start, started_stream

if TYPE_CHECKING:
    from ._plan import EntryPath, StagePlan

__all__ = ["to_pp", "from_pp", "PP_META", "PP_INITIAL", "PP_WRITTEN", "PP_PENDING", "pp_sum_groups"]


# Pipeline handoff metadata: one small int64 tensor under ``tensors[PP_META]``:
# ``[state, n, (sum group code, group size) * n]``; state 0 initial (``output`` is the embedding
# output), 1 written (``residual`` only), 2 pending (``output`` + ``residual`` when there is one);
# ``n`` statically declared partial sums the receiver still owes, in order. Codes index
# ``PP_SUM_GROUPS``.
PP_META = "meta"
PP_INITIAL, PP_WRITTEN, PP_PENDING = 0, 1, 2


def pp_sum_groups() -> tuple[SumGroup, ...]:
    return tuple(SumGroup)


def to_pp(hidden_states: Any, forward_batch: Any) -> dict[str, torch.Tensor]:
    """Leave this pipeline partition: the tensors the next stage's ``from_pp()`` rebuilds from.

    Dynamic owed work (sums an exit deferred for this batch, finalize handoffs, the output
    transform) is completed here; a statically declared partial sum (a PARTIAL attention's) is
    not: it travels as a partial and the receiver's first stage completes it. Plain-add updates
    only. The stream is released, also when this raises.
    """
    stream = started_stream(forward_batch)
    try:
        if stream.branches:
            refuse_unmerged(stream, "to_pp()")
        state = stream.state
        stream.rows.check_leaves_pp()
        if state is StreamState.INITIAL:
            if not isinstance(hidden_states, torch.Tensor):
                raise TypeError(f"to_pp() expects a tensor, got {type(hidden_states).__name__}")
            return {"output": hidden_states, PP_META: _meta(PP_INITIAL, (), hidden_states.device)}
        stream.expect(hidden_states)
        if state is StreamState.WRITTEN:
            assert stream.residual is not None
            if stream.next_update is not None and not stream.next_update.plain_add:
                raise BoundaryError(_NOT_PLAIN_PP.format(stream.next_update.name))
            return {"residual": stream.residual, PP_META: _meta(PP_WRITTEN, (), stream.residual.device)}
        c = stream.pending
        assert c is not None
        if not c.update.plain_add:
            raise BoundaryError(_NOT_PLAIN_PP.format(c.update.name))
        static = tuple(o for o in c.owed if o.kind is OwedKind.SUM and o.static)
        if static and c.transform is not None:
            raise BoundaryError(
                "to_pp(): the output carries a statically declared partial sum and an output "
                "transform, which must run after that sum; a transform on a PARTIAL output is not "
                "supported across pipeline stages yet"
            )
        value = c.value
        for o in c.owed:  # dynamic work in order; static sums are left to the receiver
            if o.kind is OwedKind.FINALIZE:
                assert isinstance(value, HandoffOutput)
                value = value.complete()
            elif not o.static:
                assert isinstance(value, torch.Tensor) and o.group is not None
                value = ops.all_reduce(value, o.group)
        if isinstance(value, HandoffOutput):
            value = value.complete()
        if c.transform is not None:
            value = c.transform.fn(value)
        stream.consume()
        out = {"output": value, PP_META: _meta(PP_PENDING, static, value.device)}
        if stream.residual is not None:
            check_shape("the layer output", value, stream.residual)
            out["residual"] = stream.residual
        return out
    finally:
        stream.release()


_NOT_PLAIN_PP = (
    "to_pp(): the residual update {!r} is not a plain add; nonlinear updates (for example MHC) are "
    "not supported across pipeline stages yet"
)


def _require(tensors: dict[str, Any], keys: tuple[str, ...], what: str) -> None:
    missing = [k for k in keys if not isinstance(tensors.get(k), torch.Tensor)]
    if missing:
        raise BoundaryError(
            f"from_pp(): the handoff says {what} but has no {' or '.join(repr(k) for k in missing)} "
            f"tensor (it holds {sorted(tensors)}); pass the whole dict residual_batch.to_pp() made "
            "on the previous stage")


def _meta(state: int, static: tuple[Any, ...], device: Any) -> torch.Tensor:
    groups = pp_sum_groups()
    vals = [state, len(static)]
    for o in static:
        vals += [groups.index(o.group_name), o.group.size]
    return torch.tensor(vals, dtype=torch.int64, device=device)


def from_pp(plan: StagePlan, entry_of: Callable[[Any, Any], EntryPath],
            tensors: dict[str, torch.Tensor], forward_batch: Any) -> Handle:
    """``StageBoundary.from_pp``: the stream the previous pipeline stage's ``to_pp()`` sent,
    installed on ``forward_batch``; ``entry_of(forward_batch, stream)`` is the receiving stage's
    entry path for the batch (its edge is checked before any collective)."""
    meta_t = tensors.get(PP_META) if isinstance(tensors, dict) else None
    if meta_t is None:
        raise TypeError(
            "from_pp() takes the tensor dict residual_batch.to_pp() produced on the previous "
            f"pipeline stage (with its {PP_META!r} entry)"
        )
    # The header as sent (a tensor), or already read to ints: a receiving stage compiled with
    # torch.compile reads it before the graph, which cannot hold a value-dependent branch.
    meta = list(meta_t) if isinstance(meta_t, (tuple, list)) else [int(v) for v in meta_t.tolist()]
    state, n = meta[0], meta[1]
    if state == PP_INITIAL:
        # Nothing read yet upstream: this stage must start the residual (previous=None), and
        # prepare() says so otherwise.
        _require(tensors, ("output",), "the stack input")
        start(forward_batch)
        return tensors["output"]
    prev = plan.declaration.previous
    if prev is None:
        raise BoundaryError(
            f"from_pp(): {plan.name} stage was built with previous=None (stack entry) but "
            "the previous pipeline stage hands on a residual stream; pass previous= the "
            "producer that ends the previous pipeline partition"
        )
    if not prev.update.plain_add:
        raise BoundaryError(
            f"from_pp(): previous= declares the update {prev.update.name!r}, which is not a plain "
            "add; nonlinear updates (for example MHC) are not supported across pipeline stages yet"
        )
    topo = plan.topology
    groups = pp_sum_groups()
    static: list[Owed] = []
    for i in range(n):
        name, size = groups[meta[2 + 2 * i]], meta[3 + 2 * i]
        group = topo.sum_group(name)
        if group.size != size:
            raise BoundaryError(
                f"from_pp(): the sender left a partial sum over {name.name} of {size} ranks, but "
                f"this stage's {name.name} group has {group.size}; every pipeline stage needs the "
                "same tensor-parallel layout"
            )
        static.append(Owed(OwedKind.SUM, name, group, static=True))
    if state == PP_PENDING:
        declared = output_sum(prev, topo)
        # A SUM always names its group (Owed checks it at construction).
        want = ((declared.group_name,) if declared is not None and declared.static
                and declared.group_name is not None else ())
        got = tuple(o.group_name for o in static if o.group_name is not None)
        if got != want:
            said = (f"a partial sum over {', '.join(g.name for g in got)}" if got
                    else "a complete output (no partial sum owed)")
            expected = (f"a partial sum over {want[0].name}" if want else "no partial sum")
            raise BoundaryError(
                f"from_pp(): the previous pipeline stage sent {said}, but this {plan.name} "
                f"stage was built with previous={prev.describe()}, which leaves {expected}; "
                "previous= does not describe the real producer (or complete_output() ran before "
                "to_pp()), which would reduce twice or not at all"
            )
        # A plain add always has a residual to add to (to_pp sends it); rebuilt without one, the
        # next add would drop the residual silently.
        _require(tensors, ("output", "residual") if prev.update.plain_add else ("output",), "a pending output")
        stream, handle = ResidualStream.arrive(
            residual=tensors.get("residual"), output=tensors["output"], update=prev.update,
            owed=tuple(static),
        )
    elif state == PP_WRITTEN:
        if static:
            raise BoundaryError("from_pp(): a written stream cannot owe a partial sum")
        _require(tensors, ("residual",), "a written stream")
        stream, handle = ResidualStream.arrive(residual=tensors["residual"])
    else:
        raise BoundaryError(f"from_pp(): unknown pipeline handoff state {state}")
    if stream.pending is not None:
        check_edge(plan, entry_of(forward_batch, stream), stream.pending)
    old = getattr(forward_batch, "residual_stream", None)
    if old is not None:
        old.release()
    try:
        forward_batch.residual_stream = stream
    except AttributeError as e:
        raise TypeError(
            f"{type(forward_batch).__name__} has no settable residual_stream attribute; the "
            "boundary owns that attribute of the engine's batch object (see ForwardBatchLike)"
        ) from e
    assert handle is not None
    return handle
