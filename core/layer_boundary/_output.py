"""Producer outputs as the boundary tracks them.

``Contribution``: what a producer adds to the residual, the update that adds it, and the work it
still owes. ``OwedOutput``: the model's opaque handle on an unfinished contribution.
``HandoffOutput``: producer-specific deferred work (a MoE finalize) with an unfused ``complete()``.
``OutputTransform``: processing declared to run on the contribution before the residual update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch

from ._contracts import Owed, OwedKind

if TYPE_CHECKING:
    from .residual import StageUpdate

__all__ = ["Contribution", "UnreducedOutput", "HandoffOutput", "OwedOutput", "OutputTransform",
           "fusable_handoff"]


@dataclass(frozen=True, slots=True)
class OutputTransform:
    """``fn(contribution) -> contribution``, applied once the contribution is complete.

    ``before_reduce_scatter=True`` keeps an implementation's order of applying the transform on
    the full rows before a reduce-scatter; it is not permission to commute ``fn`` with a sum.
    """

    fn: Callable[[torch.Tensor], torch.Tensor]
    before_reduce_scatter: bool = False

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"OutputTransform.fn must be callable, got {type(self.fn).__name__}")


class HandoffOutput:
    """Deferred producer work, such as a MoE finalize (top-k combine plus shared expert).

    ``complete()`` runs the unfused finalize once and returns the contribution (still unreduced
    over its sum group when the producer skipped that sum). A fused consumer may instead read
    ``payload`` and finish the work itself; either way the work runs exactly once.
    """

    __slots__ = ("_finalize", "payload", "num_tokens", "_done", "owed_sum")

    def __init__(self, finalize: Callable[[], torch.Tensor], *, num_tokens: int, **payload: Any) -> None:
        if not callable(finalize):
            raise TypeError("HandoffOutput needs a callable that runs the unfused finalize")
        self._finalize = finalize
        self.payload = payload
        self.num_tokens = int(num_tokens)
        self._done = False
        # The sum over ranks still owed after the finalize (an ``Owed``, or ``None``): set by the
        # boundary right before a fused consumer takes the handoff, so it sums exactly that.
        self.owed_sum: Optional[Owed] = None

    def complete(self) -> torch.Tensor:
        if self._done:
            raise RuntimeError(
                "this HandoffOutput was already completed; a finalize handoff runs exactly once"
            )
        self._done = True
        out = self._finalize()
        self._finalize = _spent
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"HandoffOutput finalize returned {type(out).__name__}, expected a tensor")
        return out

    def mark_consumed(self) -> None:
        """Record that a fused consumer did the finalize itself."""
        if self._done:
            raise RuntimeError("this HandoffOutput was already completed")
        self._done = True
        self._finalize = _spent

    @property
    def completed(self) -> bool:
        return self._done

    def __repr__(self) -> str:
        return f"HandoffOutput(num_tokens={self.num_tokens}, completed={self._done})"


def _spent() -> torch.Tensor:  # pragma: no cover - guarded by HandoffOutput._done
    raise AssertionError("spent handoff")


Value = Union[torch.Tensor, HandoffOutput]


class Contribution:
    """A producer output on its way into the residual.

    ``owed`` lists the work this output still requires, in the order it must run (a finalize
    before its sum). The stream owns a contribution; it is dropped as soon as it is consumed.
    """

    __slots__ = ("value", "update", "owed", "transform")

    def __init__(
        self,
        value: Value,
        update: "StageUpdate",
        owed: tuple[Owed, ...] = (),
        transform: Optional[OutputTransform] = None,
    ) -> None:
        self.value = value
        self.update = update
        self.owed = owed
        self.transform = transform

    @property
    def complete(self) -> bool:
        return not self.owed and isinstance(self.value, torch.Tensor)

    @property
    def is_handoff(self) -> bool:
        return isinstance(self.value, HandoffOutput)

    def __repr__(self) -> str:
        owed = ", ".join(o.describe() for o in self.owed) or "nothing"
        return f"Contribution(update={self.update.name}, owes {owed})"


def fusable_handoff(c: Contribution) -> Optional[HandoffOutput]:
    """The handoff of ``c`` when a fused finalize may take all it owes, else ``None``.

    Fusable: a finalize followed by at most one sum over ranks and no output transform. The
    handoff then records that sum (``owed_sum``) for the consumer that fuses it.
    """
    value = c.value
    if not isinstance(value, HandoffOutput) or c.transform is not None or not c.owed:
        return None
    if c.owed[0].kind is not OwedKind.FINALIZE or len(c.owed) > 2:
        return None
    if len(c.owed) == 2 and c.owed[1].kind is not OwedKind.SUM:
        return None
    value.owed_sum = c.owed[1] if len(c.owed) == 2 else None
    return value


@dataclass(frozen=True, slots=True)
class UnreducedOutput:
    """Internal adapter form: a producer's raw output and what it owes, before the stream owns it."""

    value: Value
    update: "StageUpdate"
    owed: tuple[Owed, ...] = ()
    transform: Optional[OutputTransform] = None


_TENSOR_USE = (
    "this layer output is an OwedOutput: it still owes {owed}. Pass it unchanged to the next "
    "boundary call (prepare / residual_batch.norm) or call residual_batch.complete_output() to "
    "get a tensor; do not {action} it"
)


class OwedOutput:
    """Opaque model-facing handle on an unfinished output. It refuses every tensor use."""

    # No __slots__: Dynamo reads the attributes of an object made inside a traced forward from its
    # __dict__; a slot it cannot see sends it into __getattr__, which refuses, recursively.

    def __init__(self, stream: Any, owed: tuple[Owed, ...]) -> None:
        self._stream = stream
        self._owed = owed

    def _refuse(self, action: str) -> TypeError:
        owed = ", ".join(o.describe() for o in self._owed) or "work"
        return TypeError(_TENSOR_USE.format(owed=owed, action=action))

    def __getattr__(self, name: str) -> Any:
        raise self._refuse(f"read .{name} of")

    def __getitem__(self, key: Any) -> Any:
        raise self._refuse("index")

    def __setitem__(self, key: Any, value: Any) -> None:
        raise self._refuse("index")

    def __len__(self) -> int:
        raise self._refuse("take len() of")

    def __iter__(self) -> Any:
        raise self._refuse("iterate")

    def __bool__(self) -> bool:
        raise self._refuse("test the truth of")

    def __array__(self, *a: Any, **k: Any) -> Any:
        raise self._refuse("convert")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise TypeError(
            f"an OwedOutput was passed to {getattr(func, '__name__', func)}; it still owes a "
            "reduction or finalize. Pass it to the next boundary or call "
            "residual_batch.complete_output() first"
        )

    def __repr__(self) -> str:
        owed = ", ".join(o.describe() for o in self._owed) or "nothing"
        return f"OwedOutput(owes {owed})"


def _arith(action: str) -> Callable[..., Any]:
    def refuse(self: OwedOutput, *args: Any) -> Any:
        raise self._refuse(action)

    return refuse


for _op in (
    "add", "radd", "iadd", "sub", "rsub", "isub", "mul", "rmul", "imul", "truediv", "rtruediv",
    "itruediv", "matmul", "rmatmul", "neg", "pos", "pow", "floordiv", "mod", "and", "or", "xor",
    "lt", "le", "gt", "ge", "float", "int", "index", "abs",
):
    setattr(OwedOutput, f"__{_op}__", _arith("use arithmetic on"))
