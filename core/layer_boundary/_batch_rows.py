"""``BatchRows``: the one interface through which a batch variant moves a stage's rows (declared
in ``layer_boundary._plan`` with the paths that bind it), and the ordinary variant's ``OrdinaryRows``.

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

from typing import TYPE_CHECKING, Any

from ._plan import BatchRows, Capture
from ._prepare import run_entry
from ._rows import check_counts_agree

if TYPE_CHECKING:
    from ._plan import StagePlan

__all__ = ["BatchRows", "Capture", "OrdinaryRows"]


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
