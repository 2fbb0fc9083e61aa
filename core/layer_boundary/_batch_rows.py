"""``BatchRows``: the one interface through which a batch variant moves a stage's rows.

Each variant's row movement lives in one class, bound to each stage's plan at construction
(``EntryPath.rows`` and ``ExitPath.rows`` hold the same object); a forward calls its methods and
never asks which variant it is in again.

=====================  ============================  =================================  ==========================
class (module)         variant                       input (``enter``)                  FFN output (``give_back``)
=====================  ============================  =================================  ==========================
``OrdinaryRows``       ORDINARY                      read on this rank's rows           none (nothing moved)
``AttentionDpRows``    ORDINARY under attention DP   FFN: every group's rows (``dp``)   to the group's rows: ar/rs/rsv
``ScatteredRows``      INPUT_SCATTERED, SEQ. PAR.    read on a slice, then gather       reduce-scatter to the slice
``CpRows``             CP                            read local, FFN gathers tokens     reduce-scatter to local tokens
=====================  ============================  =================================  ==========================

``postprocess`` brings a fully reduced output (computed without an exit scope) back to the rows the
residual lives on, the way ``give_back`` does for a partial one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from ._prepare import run_entry
from ._rows import check_counts_agree
from .residual._stream import ResidualStream

if TYPE_CHECKING:
    from ._construction import EntryPath, StagePlan

__all__ = ["BatchRows", "OrdinaryRows"]

Capture = Callable[..., Any]


class BatchRows:
    """How one batch variant moves one stage's rows (the base is the ordinary variant's no-move).

    Facts a caller may read (fixed at construction):

    ``output_return``: how an FFN output returns at ``finish()`` (``"ar"``, ``"rs"``, ``"rsv"``
    under attention DP, ``"scatter"``, ``"cp"``), ``None`` when it stays where compute left it.
    ``reduce_scatters``: that return sums the output itself (compute skips its all-reduce).
    ``every_group_input``: the compute input holds every DP group's rows (``"all"``).
    ``sliced_residual``: the residual holds this rank's slice of the group's rows.
    ``token_gather``: the input is gathered to every token of the CP group.
    """

    __slots__ = ()

    output_return: Optional[str] = None
    reduce_scatters = False
    every_group_input = False
    sliced_residual = False
    token_gather = False
    # A label of the input move for reports and tests ("join" / "read_first" under attention
    # DP, "group" / "all" input-scattered, "local" / "gather" CP), None for none.
    input_move: Optional[str] = None

    def enter(self, plan: StagePlan, entry: EntryPath, stream: ResidualStream, hidden: Any,
              capture: Optional[Capture], collector: Any, forward_batch: Any) -> Any:
        """The stage's compute input; leaves the stream written with the updated residual."""
        raise NotImplementedError

    def check_stack_rows(self, plan: StagePlan, forward_batch: Any) -> None:
        """At the stack entry, before the first read: check what this variant needs of the
        batch's rows across ranks (nothing by default)."""

    def give_back(self, plan: StagePlan, stream: ResidualStream, forward_batch: Any,
                  value: torch.Tensor) -> torch.Tensor:
        """An FFN output (partial over its sum group where ``reduce_scatters``) on the rows the
        residual lives on, complete. Called only where ``output_return`` is set."""
        raise AssertionError(f"{type(self).__name__} returns no output rows")

    def postprocess(self, plan: StagePlan, stream: ResidualStream, forward_batch: Any,
                    value: torch.Tensor) -> torch.Tensor:
        """A fully reduced output on the rows the residual lives on."""
        return value

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class OrdinaryRows(BatchRows):
    """Ordinary rows: the residual and every input and output share this rank's rows.

    ``agree_counts``: TP > 1 without attention DP, where every rank of the TP group computes the
    same rows; the stack input's row count is compared across the group (when checking is on).
    """

    __slots__ = ("agree_counts",)

    # Nothing moves: the entry is the read on this rank's rows, called without a wrapper.
    enter = staticmethod(run_entry)

    def __init__(self, agree_counts: bool = False) -> None:
        self.agree_counts = agree_counts

    def check_stack_rows(self, plan: StagePlan, forward_batch: Any) -> None:
        if self.agree_counts:
            check_counts_agree((forward_batch.num_tokens,), plan.topology, dp=False)
