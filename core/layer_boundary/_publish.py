"""Publishing a producer output: the stream takes it pending (or, for an ``at_producer`` update,
applies it at once). Every stage's finish, exit scope, postprocess and row return ends here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ._errors import BoundaryError
from ._output import Contribution
from .residual._access import complete
from .residual._stream import Handle, ResidualStream

if TYPE_CHECKING:
    from ._plan import StagePlan

__all__ = ["publish"]


def publish(plan: StagePlan, stream: ResidualStream, value: Any, owed: tuple, *,
            transformed: bool = False) -> Handle:
    """Hand a producer output to the stream (or apply an ``at_producer`` update right away).

    ``transformed``: the declared output transform was already applied to ``value``.
    """
    residual = stream.residual
    if residual is None and stream.pending is None:  # an initial stream
        raise BoundaryError(
            f"{plan.name} stage output was published before any stage read the residual; call "
            "prepare() before compute and finish() after it"
        )
    transform = None if transformed else plan.declaration.output_transform
    update = stream.next_update or plan.update
    if update.plain_add and residual is not None and stream.pending is None and isinstance(value, torch.Tensor):
        if value.shape != residual.shape:
            # Whole rows refuse it; input-scattered outputs sit on the group's rows while the
            # residual holds a slice (the stream's rows decide, off the equal-shape path).
            stream.rows.check_output_shape(f"the {plan.name} output", value, residual)
        if value.dtype != residual.dtype and (
                not value.is_floating_point()
                or torch.promote_types(value.dtype, residual.dtype) != residual.dtype):
            # A narrower output is the FP32-residual layout (bf16 compute, an FP32 stream: the
            # next read returns bf16). A wider or integer one is a mistake: the add rounds it to
            # the residual's dtype, but the next read's input keeps the output's, and the model's
            # next matmul fails on it far from here (an integer output is added silently).
            raise TypeError(
                f"the {plan.name} output is {str(value.dtype).replace('torch.', '')} but the residual is "
                f"{str(residual.dtype).replace('torch.', '')} (the stack input's dtype): return the layer "
                f"output in the model's compute dtype, e.g. out.to({residual.dtype})")
    if update.at_producer:
        stream.check_free()
        c = Contribution(value, update, owed, transform)
        residual = update.apply(stream.residual, complete(c))
        stream.write(residual, residual)
        return residual
    handle = stream.leave_parts(value, update, owed, transform)
    stream.next_update = None
    return handle
