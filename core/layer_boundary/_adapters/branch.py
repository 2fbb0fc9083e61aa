"""Branches: stages that start from an input another stage already read, and run beside it.

LongCat-style layers run a MoE and a dense chain (FFN -> attention -> FFN) on the same normalized
input and add both to the residual at the end::

    y = r1 + moe(x) + chain(x, r1)        x = norm(r1), read once, by the MoE stage

The chain is built with ``make_stages(..., prepared_from=moe_boundary.declaration)``. Its first
stage is entered with ``first.branch_input(moe_boundary, x, forward_batch)`` instead of
``prepare()``: the source's read is not repeated (the first stage's own norm is never applied),
and from then on the residual belongs to the chain. The other branch's output is a plain
contribution with no residual of its own: ``branch_output()`` completes it and sets it aside,
``merge_branch()`` adds it to the chain's last output. Either branch may finish first::

    x = moe.prepare(h, fb)
    with moe.exit(fb) as out:
        y = moe_compute(x)
    side = branch_output(out.finish(y), fb)        # MoE's complete output, set aside
    h = first.branch_input(moe, x, fb)             # the chain now owns the residual
    ... first / second / third stages as usual ...
    h = merge_branch(h, fb, side)                  # the chain's output + the MoE's, pending

=======================  =============================  =====================================
call                     rows                           work
=======================  =============================  =====================================
``branch_input``         source input -> first stage's  none; under attention DP an FFN input
                         compute rows                   [ΣT, H] -> attention rows [T_d, H]
                                                        (no collective) or back (a DP gather)
``branch_output``        the handoff (residual) rows    every owed step once: finalize, sum,
                         [T_d, H]                       output transform
``merge_branch``         the handoff rows               added to the other output once: on a
                                                        pending sum, on that group's rank 0
                                                        only, so the sum still runs once
=======================  =============================  =====================================

Residual ownership is exact: one stream carries the residual; a set-aside output is tracked on it
until merged, and a stage outside the branch that reads the residual (or the stack's exit) before
the merge is refused rather than dropping that output. Branch transport moves ordinary token
rows only: construction leaves the context-parallel, input-scattered and sequence-parallel
variants out of every branch stage, so such a batch meets the spec's "no stage boundary path"
error. Updates are plain adds (two contributions meet by addition).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from .._contracts import OwedKind, StageKind
from .._dp import dp_rows
from .._errors import BoundaryError, DeclarationError, no_path
from .._forward import active_variant
from .._layout import BatchVariant
from .._output import Contribution, HandoffOutput, UnreducedOutput
from .._quant import QuantizedRows
from ..residual._access import check_shape, complete
from ..residual._add_norm import PLAIN_ADD
from ..residual._stream import Handle, ResidualStream, StreamState, started_stream
from .._rows import move_input

__all__ = ["BranchOutput", "branch_input", "branch_output", "merge_branch", "bind_branch",
           "is_branch_stage"]

_BRANCH_ROWS = "a branch moves ordinary token rows only; this variant has no branch path"


class BranchOutput:
    """A complete contribution set aside by :func:`branch_output` on the handoff rows.

    Opaque: pass it to :func:`merge_branch` of the same forward, exactly once.
    """

    __slots__ = ("_value", "_stream")

    def __init__(self, value: torch.Tensor, stream: ResidualStream) -> None:
        self._value: Optional[torch.Tensor] = value
        self._stream = stream

    @property
    def merged(self) -> bool:
        return self._value is None

    def __repr__(self) -> str:
        if self._value is None:
            return "BranchOutput(merged)"
        return f"BranchOutput(rows={self._value.shape[0]})"


# -- construction ---------------------------------------------------------------------------


def bind_branch(boundaries: Sequence[Any], source: Any, context: Any) -> None:
    """Construction of a ``prepared_from`` chain: plain-add updates only, ordinary rows only.

    Every other batch variant is removed from the chain's plans (and the refusal reported), so
    an active CP, input-scattered or sequence-parallel batch raises the spec's error instead of
    moving branch rows it has no correct path for.
    """
    for i, decl in enumerate((source, *(b.declaration for b in boundaries))):
        if not decl.update.plain_add:
            what = "its source (prepared_from)" if i == 0 else f"stage {i - 1}"
            raise DeclarationError(
                f"a branch's outputs meet by addition, but {what} {decl.describe()} declares the "
                f"update {decl.update.name!r}, which is not a plain add; branches support plain-add "
                "updates only"
            )
    from .._selection import Candidate, Selection

    for b in boundaries:
        plan = b.plan
        for variant in [v for v in plan.entries if v is not BatchVariant.ORDINARY]:
            del plan.entries[variant]
            plan.exits.pop(variant, None)
            plan.refusals[variant] = _BRANCH_ROWS  # no_path's note
            context.report.add(Selection(plan.name, variant.name, "branch transport",
                                         "prepared_from", None,
                                         (Candidate("branch rows", "core", _BRANCH_ROWS),)))
        # A flag on the plan, not a registry: a traced forward reads it as a constant.
        object.__setattr__(plan, "branch_member", True)


def is_branch_stage(boundary: Any) -> bool:
    """Whether ``boundary`` was built in a ``prepared_from`` chain."""
    return bool(boundary.plan.branch_member)


# -- forward --------------------------------------------------------------------------------


def _path_or_refuse(plan: Any, forward_batch: Any) -> None:
    variant = active_variant(forward_batch)
    if variant not in plan.entries:
        raise no_path(variant.name, plan.name, plan.refusals.get(variant))


def _ordinary_or_refuse(what: str, forward_batch: Any) -> None:
    variant = active_variant(forward_batch)
    if variant is not BatchVariant.ORDINARY:
        raise no_path(variant.name, what, _BRANCH_ROWS)


def _rows(x: Any) -> int:
    return (x.data if isinstance(x, QuantizedRows) else x).shape[0]


def branch_input(boundary: Any, source: Any, hidden_states: Any, forward_batch: Any) -> Any:
    """``boundary.branch_input(source, hidden_states, forward_batch)``: the source's prepared
    input on the rows ``boundary``'s compute runs on; the residual passes to the branch.

    Call it right after the source's ``prepare()`` (or after :func:`branch_output` set an output
    aside): the stream must hold a written residual and no layer output.
    """
    plan = boundary.plan
    stream = started_stream(forward_batch)
    decl = plan.declaration
    if decl.prepared_from is None:
        raise BoundaryError(
            f"branch_input(): {plan.name} stage was not built with prepared_from=; it reads its own "
            "input: call prepare()"
        )
    src = getattr(source, "declaration", source)
    if src is not decl.prepared_from and not (
            hasattr(src, "produces_like") and decl.prepared_from.produces_like(src)):
        raise BoundaryError(
            f"branch_input(): {plan.name} stage was built with prepared_from="
            f"{decl.prepared_from.describe()} but the source given is "
            f"{src.describe() if hasattr(src, 'describe') else type(src).__name__}; pass the "
            "boundary whose prepare() read this input"
        )
    _path_or_refuse(plan, forward_batch)
    if stream.state is StreamState.PENDING:
        raise BoundaryError(
            "branch_input(): a layer output is pending on the stream; set it aside with "
            "branch_output() first (one branch's output waits while the other runs), or enter the "
            "branch right after the source's prepare()"
        )
    if stream.state is not StreamState.WRITTEN or stream.handle is not None:
        raise BoundaryError(
            "branch_input() runs right after the source stage's prepare() (or after branch_output() "
            "set the source's output aside); the stream holds "
            + ("no residual yet" if stream.state is StreamState.INITIAL else "the model's residual "
               "tensor (a fold or written), not a read")
        )
    if stream.next_update is not None:
        raise BoundaryError(
            f"branch_input(): the source's read made the update {stream.next_update.name!r} for its "
            "own output; branches support plain-add updates only"
        )
    topo = plan.topology
    src_ffn = src.kind is StageKind.FFN
    dp = topo.attn_dp.size > 1
    # Under attention DP an FFN computes on every group's rows, an attention on its own.
    rows = dp_rows(stream, plan, forward_batch) if dp else None
    want = rows.total if (rows is not None and src_ffn) else forward_batch.num_tokens
    if _rows(hidden_states) != want:
        raise ValueError(
            f"branch_input(): got {_rows(hidden_states)} rows, but the source {src.describe()} reads "
            f"{want} on this rank; pass the input its prepare() returned, unchanged"
        )
    if rows is None or src_ffn == (decl.kind is StageKind.FFN):
        return hidden_states
    return move_input(rows.take_local if src_ffn else rows.gather, hidden_states)


def branch_output(hidden_states: Any, forward_batch: Any) -> BranchOutput:
    """Complete a layer output (its finalize, sums and transform, each once) on the handoff rows
    and set it aside for :func:`merge_branch`; the stream is left holding the residual alone."""
    stream = started_stream(forward_batch)
    _ordinary_or_refuse("branch_output()", forward_batch)
    stream.expect(hidden_states)
    c = stream.pending
    if c is None:
        raise BoundaryError(
            "branch_output() takes a layer output (a stage's finish() or exit().finish()); the "
            "stream holds a written residual, which belongs to the branch that carries it"
        )
    if not c.update.plain_add:
        raise BoundaryError(
            f"branch_output(): the output's update {c.update.name!r} is not a plain add; branches "
            "support plain-add updates only"
        )
    value = complete(c)
    assert stream.residual is not None, "a pending output always follows a read"
    check_shape("the branch output", value, stream.residual)
    stream.consume()
    out = BranchOutput(value, stream)
    stream.branches = stream.branches + (out,)
    return out


def merge_branch(hidden_states: Any, forward_batch: Any, branch: BranchOutput) -> Handle:
    """Add a set-aside branch output to the other branch's output ``hidden_states``; return the
    handle to pass on (the update stays pending, and so does a sum the other output owes)."""
    stream = started_stream(forward_batch)
    _ordinary_or_refuse("merge_branch()", forward_batch)
    if not isinstance(branch, BranchOutput):
        raise TypeError(f"merge_branch() takes the BranchOutput branch_output() returned, got "
                        f"{type(branch).__name__}")
    if branch._stream is not stream or branch not in stream.branches:
        raise BoundaryError(
            "merge_branch(): this branch output was "
            + ("merged already" if branch.merged else "set aside on another residual stream")
            + "; each branch output is merged exactly once, into its own forward"
        )
    stream.expect(hidden_states)
    extra = branch._value
    assert extra is not None
    c = stream.pending
    if c is None:  # the other branch's output was folded into the residual already
        assert stream.residual is not None
        check_shape("the branch output", extra, stream.residual)
        stream.handle = None
        handle = stream.leave(UnreducedOutput(extra, PLAIN_ADD))
    else:
        if not c.update.plain_add:
            raise BoundaryError(
                f"merge_branch(): the output's update {c.update.name!r} is not a plain add; "
                "branches support plain-add updates only"
            )
        _combine(c, extra)
        handle = stream.rehand()
    stream.branches = tuple(b for b in stream.branches if b is not branch)
    branch._value = None
    return handle


def _combine(c: Contribution, extra: torch.Tensor) -> None:
    """``c += extra``, keeping a single owed sum owed: ``extra`` (complete, the same on every
    rank) joins the partial on the sum group's rank 0 only, so the sum adds it once."""
    if isinstance(c.value, HandoffOutput):
        # A finalize payload takes no extra term: run it here; a sum after it stays owed.
        c.value = c.value.complete()
        c.owed = tuple(o for o in c.owed if o.kind is not OwedKind.FINALIZE)
    check_shape("the branch output", extra, c.value)
    owed = c.owed
    if c.transform is None and len(owed) == 1 and owed[0].kind is OwedKind.SUM:
        assert owed[0].group is not None
        if owed[0].group.rank == 0:
            c.value = c.value + extra
        return
    c.value = complete(c) + extra


# -- checks the rest of the library asks -----------------------------------------------------


def refuse_unmerged(stream: ResidualStream, where: str) -> None:
    """Refuse to read or leave the residual while a branch output is still set aside."""
    n = len(stream.branches)
    raise BoundaryError(
        f"{where} while {n} branch output(s) set aside by branch_output() are not merged; call "
        "merge_branch(hidden_states, forward_batch, branch) on the other branch's last output "
        "first, or the set-aside contribution would never reach the residual"
    )


def check_entry(boundary: Any, stream: ResidualStream) -> None:
    """``prepare()`` while a branch output is set aside: only the branch's own stages read."""
    if not boundary.plan.branch_member:
        refuse_unmerged(stream, f"{boundary.plan.name} stage prepare()")
