"""Output completion decisions and the compute flags an exit scope publishes.

A decision is made once per exit: it publishes flags for compute and fixes the matching
completion (what the output owes). A skip flag never goes out without the owed work that
completes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from ._contracts import Owed, OwedKind, StageKind
from ._errors import BoundaryError
from ._forward import _THREAD
from ._output import HandoffOutput
from ._publish import publish
from .residual._stream import Handle, ResidualStream

if TYPE_CHECKING:
    from ._construction import ExitPath, StagePlan

__all__ = ["FfnExit", "MixerExit", "decide"]

_FINALIZE = Owed(OwedKind.FINALIZE)


def decide(plan: StagePlan, path: ExitPath, forward_batch: Any) -> tuple[bool, bool]:
    """``(defer_sum, defer_finalize)`` for this batch.

    Each decision is asked of the providers in order until one allows it: a provider that cannot
    complete the work at the next input says no for itself, not for a provider after it (a
    deferred sum no candidate fuses is still completed there, by the group's all-reduce).
    Providers were bound at construction.
    """
    defer_finalize = False
    defer_sum = path.always_defer_sum
    if plan.declaration.kind is StageKind.FFN:
        for ask in plan.finalize_askers:
            if ask(plan, forward_batch):
                defer_finalize = path.may_defer_finalize
                break
    if path.may_defer_sum and not defer_sum:
        for ask in plan.sum_askers:
            if ask(plan, forward_batch):
                defer_sum = True
                break
    if defer_finalize and path.skip_owed is not None:
        defer_sum = True  # a deferred finalize carries the sum that follows it
    return defer_sum, defer_finalize


class _Exit:
    __slots__ = ("_plan", "_path", "_stream", "_defer_sum", "_defer_finalize", "_saved", "_done",
                 "_return", "_fb", "_rs", "_flags")

    def __init__(self, plan: StagePlan, path: ExitPath, stream: ResidualStream, forward_batch: Any) -> None:
        self._plan = plan
        self._path = path
        self._stream = stream
        self._fb = forward_batch
        if plan.finalize_askers or (path.may_defer_sum and plan.sum_askers):
            self._defer_sum, self._defer_finalize = decide(plan, path, forward_batch)
        else:  # no provider to ask: decide() would return exactly this
            self._defer_sum, self._defer_finalize = path.always_defer_sum, False
        # An FFN output that returns to the residual's rows at finish() (attention DP, a row
        # slice, CP tokens) goes through the variant's rows; a reduce-scatter return leaves the
        # sum to that collective (mlp_reduce_scatter).
        self._return = path.rows.output_return
        self._rs = path.rows.reduce_scatters
        self._saved: Optional[tuple[bool, bool, bool]] = None
        self._done = False

    def __enter__(self) -> "_Exit":
        f = self._flags = _THREAD.flags  # the thread's own; __exit__ runs on the same thread
        self._saved = (f.fuse_mlp_allreduce, f.mlp_reduce_scatter, f.defer_moe_finalize)
        f.fuse_mlp_allreduce, f.mlp_reduce_scatter, f.defer_moe_finalize = (
            self._defer_sum, self._rs, self._defer_finalize)
        f.open_scopes += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._saved is not None
        f = self._flags
        f.fuse_mlp_allreduce, f.mlp_reduce_scatter, f.defer_moe_finalize = self._saved
        f.open_scopes -= 1

    @property
    def fuse_mlp_allreduce(self) -> bool:
        return self._defer_sum

    @property
    def mlp_reduce_scatter(self) -> bool:
        return self._rs

    @property
    def output_return(self) -> Optional[str]:
        """``"ar"``, ``"rs"`` or ``"rsv"`` under attention DP; ``"scatter"`` to a row slice
        (input-scattered, sequence parallel); ``"cp"`` to this rank's CP tokens; ``None`` otherwise."""
        return self._return

    @property
    def defer_moe_finalize(self) -> bool:
        return self._defer_finalize

    def finish(self, hidden_states: Any) -> Handle:
        """Publish the compute output with exactly the work this exit's flags left undone."""
        if self._done:
            raise BoundaryError(
                "this exit was already finished; call exit() again for the next computation"
            )
        if self._saved is None:
            # Compute never saw this exit's flags, so its output is not what finish() would
            # complete (under attention DP a reduce-scatter return summed it twice).
            raise BoundaryError(
                "exit().finish() on an exit scope that was never entered: run the computation "
                "inside `with boundary.exit(forward_batch) as output:` (its flags reach compute "
                "there), then call output.finish(result); an FFN run without a scope returns "
                "through boundary.postprocess()"
            )
        self._done = True
        owed: tuple[Owed, ...] = ()
        if isinstance(hidden_states, HandoffOutput):
            if not self._defer_finalize:
                raise BoundaryError(
                    "compute returned a HandoffOutput but this exit did not publish "
                    "defer_moe_finalize; finalize inside compute unless "
                    "get_forward().defer_moe_finalize is set"
                )
            if hidden_states.completed:
                raise BoundaryError(
                    "compute returned a HandoffOutput whose finalize already ran; return the "
                    "finalized tensor instead (a handoff's finalize runs exactly once)"
                )
            owed = (_FINALIZE,)
        elif not isinstance(hidden_states, torch.Tensor):
            raise TypeError(
                f"exit().finish() takes the compute output tensor (or a HandoffOutput), got "
                f"{type(hidden_states).__name__}"
            )
        if self._return is not None:
            return publish(self._plan, self._stream, self._returned(hidden_states, owed), ())
        if self._defer_sum and self._path.skip_owed is not None:
            owed = owed + (self._path.skip_owed,)
        return publish(self._plan, self._stream, hidden_states, owed)

    def _returned(self, value: Any, owed: tuple[Owed, ...]) -> torch.Tensor:
        """Move an output back to the residual's rows, completing its sum."""
        if owed:  # a handoff: its finalize runs before the rows move
            value = value.complete()
        return self._path.rows.give_back(self._plan, self._stream, self._fb, value)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(fuse_mlp_allreduce={self._defer_sum}, "
            f"defer_moe_finalize={self._defer_finalize})"
        )


class FfnExit(_Exit):
    """Exit scope of an FFN: publishes ``fuse_mlp_allreduce``, ``mlp_reduce_scatter`` and
    ``defer_moe_finalize`` on ``get_forward()`` while compute runs."""

    __slots__ = ()


class MixerExit(_Exit):
    """Exit scope of a single-stage SCOPED mixer; ``skips_reduction`` is its sum decision."""

    __slots__ = ()

    @property
    def skips_reduction(self) -> bool:
        return self._defer_sum
