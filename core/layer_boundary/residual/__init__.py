"""Residual semantics: how a producer updates the residual and how a consumer reads it.

A producer owns a :class:`StageUpdate`; a consumer owns a :class:`StageRead` bound to its norm.
Capabilities are declared, not inferred, and boundary paths are chosen from them:

========================  ============================================================
``plain_add``             ``r' = r + c``: may fuse with add+norm reads, may join the sum
                          on one rank, may be snapshotted on a copy
``at_producer``           apply at the producer's exit instead of at the next read
``outlives_producer``     parameters/state stay valid after the producer returns
                          (required to leave a nonlinear update pending)
``before_gather``         (read) must run on the source rows before a DP gather
``fuses_with``            (read) update names ``update_and_read`` truly fuses with
``residual_in_place``     (read) ``update_and_read`` overwrites the residual it is given
                          (absent: assumed True); the stack's input is copied once before
                          such a read would overwrite the model's tensor
========================  ============================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Union, runtime_checkable

import torch

if TYPE_CHECKING:
    from .._quant import QuantizedRows

__all__ = ["StageUpdate", "StageRead", "ReadSpec", "LayerResidual"]


@runtime_checkable
class StageUpdate(Protocol):
    """``apply(residual, contribution) -> residual'``; ``residual`` is ``None`` at stack entry."""

    name: str
    plain_add: bool
    at_producer: bool
    outlives_producer: bool

    def apply(self, residual: Optional[torch.Tensor], contribution: torch.Tensor) -> torch.Tensor: ...


# What a read hands the consumer as its input: a tensor, or ``QuantizedRows`` for a quantized
# read (``AddNormReadSpec(quant=...)``).
ReadInput = Union[torch.Tensor, "QuantizedRows"]


@runtime_checkable
class StageRead(Protocol):
    """A consumer's read of the residual, bound to its norm.

    ``enter(hidden) -> (input, residual)`` starts the residual from the stack input;
    ``read(residual) -> input`` reads a written residual;
    ``update_and_read(update, contribution, residual) -> (input, residual')`` applies the
    producer's update and reads the result, fused where ``update.name in fuses_with``.

    A read with ``makes_update = True`` also returns the update this stage's own output will
    carry (per-invocation state such as MHC coefficients): ``enter`` and ``update_and_read``
    return ``(input, residual, update)`` and ``read`` returns ``(input, update)``. The update
    travels with the stream and then with the stage's contribution, never on the layer.
    """

    name: str
    before_gather: bool
    fuses_with: frozenset[str]
    makes_update: bool

    def enter(self, hidden: torch.Tensor) -> tuple[ReadInput, torch.Tensor]: ...

    def read(self, residual: torch.Tensor) -> ReadInput: ...

    def update_and_read(
        self, update: StageUpdate, contribution: torch.Tensor, residual: Optional[torch.Tensor]
    ) -> tuple[ReadInput, torch.Tensor]: ...


@runtime_checkable
class ReadSpec(Protocol):
    """An unbound read kind carried by a declaration; ``bind(norm, select)`` gives the stage's read.

    ``select(NormRequest) -> NormKernels`` picks norm kernels at construction (``None``: the torch
    reference); a read that runs no norm kernel ignores it.
    """

    name: str

    def bind(self, norm: torch.nn.Module, select: Optional[Callable[..., Any]] = None) -> StageRead: ...


class LayerResidual:
    """A declaration's residual pair: the producer's update and the consumer's read kind."""

    __slots__ = ("update", "read")

    def __init__(self, update: StageUpdate, read: ReadSpec) -> None:
        self.update = update
        self.read = read

    def __repr__(self) -> str:
        return f"LayerResidual(update={self.update.name}, read={self.read.name})"
