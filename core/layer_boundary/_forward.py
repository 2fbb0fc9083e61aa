"""The engine seam for per-forward facts: :class:`ForwardBatch` and the compute flags.

An engine may pass its own batch object instead of :class:`ForwardBatch`; the boundary reads only
the attributes named in :class:`ForwardBatchLike` and owns one, ``residual_stream``.

``get_forward()`` returns the flags an exit scope publishes while compute runs. It is a plain
object rather than a ContextVar because Dynamo cannot trace ContextVar reads; scopes save and
restore the previous values, so nesting and exceptions leave it as it was.
"""

from __future__ import annotations

import enum
import operator
import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol, runtime_checkable

from ._layout import VARIANT_PRIORITY, BatchVariant

if TYPE_CHECKING:
    from .residual._stream import ResidualStream

__all__ = [
    "ForwardMode",
    "ForwardBatch",
    "ForwardBatchLike",
    "ForwardFlags",
    "get_forward",
    "active_variant",
]


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill: many tokens per sequence
    DECODE = "decode"  # one token per sequence
    IDLE = "idle"  # this rank has no tokens but joins the collectives of the others


@runtime_checkable
class ForwardBatchLike(Protocol):
    """What the boundary reads from an engine's batch object."""

    num_tokens: int
    residual_stream: Optional["ResidualStream"]


@dataclass(eq=False)
class ForwardBatch:
    """Batch facts for one forward on one rank.

    ``num_tokens``: rows this rank computes attention on. ``positions``: position of each row.
    ``seq_lens``: lengths of the packed sequences (their sum is ``num_tokens``; ``None`` means one
    sequence). ``dp_num_tokens``: rows of every attention-DP rank, in DP-rank order (``None`` on one
    DP rank). The three variant flags say which row arrangement is active; see ``active_variant``.
    ``tbo_split``: run the model's two-batch-overlap schedule, split there (``None``: unsplit).
    ``cp_split``: under ``context_parallel``, the token mapping over the attention-CP group (a
    ``layer_boundary._cp.CpSplit``); ``num_tokens`` and ``positions`` are then this rank's rows.
    """

    num_tokens: int
    positions: Any = None
    seq_lens: Optional[tuple[int, ...]] = None
    mode: ForwardMode = ForwardMode.EXTEND
    dp_num_tokens: Optional[tuple[int, ...]] = None
    context_parallel: bool = False
    input_scattered: bool = False
    sequence_parallel: bool = False
    residual_stream: Optional["ResidualStream"] = field(default=None, repr=False)
    tbo_split: Any = None  # a layer_boundary._adapters.tbo.TboSplit
    cp_split: Any = None  # a layer_boundary._cp.CpSplit

    def __post_init__(self) -> None:
        # numpy integers too; not a bool, nor a tensor (reading one would wait for the device). A
        # tensor exists only once torch is imported, and this module does not import it.
        torch = sys.modules.get("torch")
        if torch is not None and torch.compiler.is_compiling():
            # Under torch.compile the count may be a traced symbol (a dynamic token dimension):
            # operator.index would specialize it to this call's value and recompile per size;
            # a comparison only guards.
            if isinstance(self.num_tokens, bool) or self.num_tokens < 0:
                raise ValueError(f"ForwardBatch.num_tokens={self.num_tokens!r} must be a non-negative int")
            return
        tensor = torch is not None and isinstance(self.num_tokens, torch.Tensor)
        try:
            count = -1 if tensor or isinstance(self.num_tokens, bool) else operator.index(self.num_tokens)
        except TypeError:
            count = -1
        if count < 0:
            raise ValueError(f"ForwardBatch.num_tokens={self.num_tokens!r} must be a non-negative int")
        self.num_tokens = count
        if self.seq_lens is not None:
            self.seq_lens = tuple(int(s) for s in self.seq_lens)
            if sum(self.seq_lens) != self.num_tokens or any(s < 0 for s in self.seq_lens):
                # Under CP, num_tokens is this rank's share: the whole sequences are the split's.
                cp = (" (under context_parallel num_tokens counts this rank's rows: give the batch's whole "
                      "sequences to cp_split, CpSplit.zigzag(seq_lens, topology), and leave seq_lens unset)"
                      if self.context_parallel or self.cp_split is not None else "")
                raise ValueError(
                    f"seq_lens {self.seq_lens} must be non-negative and sum to num_tokens={self.num_tokens}{cp}"
                )

    @classmethod
    def for_tokens(cls, num_tokens: int, **kw: Any) -> "ForwardBatch":
        """A batch of one sequence with positions 0..num_tokens-1."""
        import torch

        kw.setdefault("positions", torch.arange(num_tokens))
        if num_tokens == 0:
            kw.setdefault("mode", ForwardMode.IDLE)
        return cls(num_tokens=num_tokens, **kw)


def active_variant(forward_batch: Any) -> BatchVariant:
    """The variant a forward runs in; the one place where the priority order is applied."""
    if type(forward_batch) is ForwardBatch and not (
        forward_batch.sequence_parallel or forward_batch.input_scattered or forward_batch.context_parallel
    ):
        return BatchVariant.ORDINARY  # the common case, without the generic attribute probing
    for flag, variant in _FLAGGED:
        if getattr(forward_batch, flag, False):
            return variant
    return BatchVariant.ORDINARY


_VARIANT_FLAG = {
    BatchVariant.SEQUENCE_PARALLEL: "sequence_parallel",
    BatchVariant.INPUT_SCATTERED: "input_scattered",
    BatchVariant.CP: "context_parallel",
}
_FLAGGED = tuple((_VARIANT_FLAG[v], v) for v in VARIANT_PRIORITY if v is not BatchVariant.ORDINARY)


class ForwardFlags:
    """Flags an exit scope publishes for compute (reference layers read them).

    ``fuse_mlp_allreduce``: skip the output all-reduce; the next input completes it.
    ``mlp_reduce_scatter``: skip the output all-reduce; the boundary reduce-scatters.
    ``defer_moe_finalize``: a MoE may return a ``HandoffOutput`` instead of finalizing.

    One per thread (see ``_PerThread``).
    """

    __slots__ = ("fuse_mlp_allreduce", "mlp_reduce_scatter", "defer_moe_finalize", "open_scopes")

    def __init__(self) -> None:
        self.fuse_mlp_allreduce = False
        self.mlp_reduce_scatter = False
        self.defer_moe_finalize = False
        # exit() scopes open now: one whose flags are all False changes no flag, and a
        # two-batch-overlap yield inside it is still an error (adapters.tbo.interleave).
        self.open_scopes = 0

    def snapshot(self) -> tuple[bool, bool, bool]:
        return (self.fuse_mlp_allreduce, self.mlp_reduce_scatter, self.defer_moe_finalize)

    def restore(self, values: tuple[bool, bool, bool]) -> None:
        self.fuse_mlp_allreduce, self.mlp_reduce_scatter, self.defer_moe_finalize = values

    def __repr__(self) -> str:
        return (
            f"ForwardFlags(fuse_mlp_allreduce={self.fuse_mlp_allreduce}, "
            f"mlp_reduce_scatter={self.mlp_reduce_scatter}, defer_moe_finalize={self.defer_moe_finalize})"
        )


class _PerThread(threading.local):
    """Each thread's flags: a thread sees only the scopes it opened, so two models forwarded in
    two threads never read each other's flags (a shared object let one thread's compute skip or
    double a reduction another thread's scope decided). ``threading.local``, not a ContextVar:
    torch.compile traces a thread-local's attributes under ``fullgraph=True`` and breaks the graph
    on ``ContextVar.get()``. The flags themselves are a slotted object the local holds: an exit
    scope reads the local once, where attributes of the local itself cost a lookup each."""

    def __init__(self) -> None:  # runs once in each thread that touches the flags
        self.flags = ForwardFlags()


_THREAD = _PerThread()


def get_forward() -> ForwardFlags:
    """This thread's compute flags of its innermost open exit scope (all False outside any scope)."""
    return _THREAD.flags
