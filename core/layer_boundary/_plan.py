"""The plan of one stage: what construction decides and a forward only looks up.

``StagePlan`` holds a stage's entry and exit path for each batch variant (``EntryPath``,
``ExitPath``); each path binds the variant's row movement, a ``BatchRows`` (the interface is here,
its classes are ``batch_rows.OrdinaryRows``, ``dp.AttentionDpRows``, ``scatter.ScatteredRows`` and
``cp.CpRows``). These types name each other and nothing above them: every module of the boundary
engine can name them, and ``construction`` builds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import torch

from ._contracts import Owed, OwedKind
from ._layout import BatchVariant, SumGroup
from .residual import StageRead, StageUpdate
from ._topology import Topology

if TYPE_CHECKING:
    from ._declarations import StageDeclaration
    from .residual._stream import ResidualStream

__all__ = ["BatchRows", "Capture", "EntryPath", "ExitPath", "StagePlan"]

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


@dataclass(frozen=True, slots=True)
class EntryPath:
    """How a stage's input is prepared in one batch variant.

    ``accepts``: the owed work the incoming edge was built to complete (checked before any
    collective runs). ``expected_update``: the producer update the edge was built for.
    ``capture_owned``: the following local stage certifies it leaves the captured residual
    untouched, so a capture of it is owned.
    """

    variant: BatchVariant
    accepts: frozenset[tuple[OwedKind, Optional[SumGroup]]]
    expected_update: Optional[str]
    capture_owned: bool
    # This variant's row movement for this stage (see batch_rows): the entry runs rows.enter().
    rows: BatchRows
    candidates: tuple[Any, ...] = ()  # consumer fusion candidates, tried in order


@dataclass(frozen=True, slots=True)
class ExitPath:
    """How a stage's output is handed on in one batch variant.

    ``static_owed``: the sum a PARTIAL producer always leaves. ``skip_owed``: what a skipped
    output sum leaves when the exit decides to defer it. ``may_defer_sum`` and
    ``may_defer_finalize`` are construction-time permissions; the exit decides per batch.
    """

    variant: BatchVariant
    static_owed: tuple[Owed, ...]
    skip_owed: Optional[Owed]
    may_defer_sum: bool
    always_defer_sum: bool
    may_defer_finalize: bool
    # The stage's row movement in this variant (the entry's): an FFN output that returns to the
    # residual's rows at finish() (rows.output_return) goes through rows.give_back().
    rows: BatchRows


@dataclass(frozen=True, eq=False)
class StagePlan:
    name: str
    declaration: StageDeclaration  # with its source fields resolved
    following: Optional[StageDeclaration]
    topology: Topology
    read: StageRead
    update: StageUpdate
    fusions: tuple[Any, ...]
    options: Mapping[str, Any]
    entries: Mapping[BatchVariant, EntryPath] = field(default_factory=dict)
    exits: Mapping[BatchVariant, ExitPath] = field(default_factory=dict)
    # Why a variant the topology has gets no path at this stage (see layer_boundary._variants).
    refusals: Mapping[BatchVariant, str] = field(default_factory=dict)

    # Facts derived from the fields above, fixed here rather than looked up on every forward.
    # Plain attributes, not functools.cached_property: its lock is an RLock, which Dynamo cannot
    # enter, so the first compiled forward would break the graph there.
    # Whether the read returns (input, residual, update) rather than (input, residual).
    read_makes_update: bool = field(init=False)
    # The providers' output decisions, bound once: an exit asks them per batch, and a provider
    # that lacks one must not cost an attribute miss on every forward.
    finalize_askers: tuple[Any, ...] = field(init=False)
    sum_askers: tuple[Any, ...] = field(init=False)
    # Built in a prepared_from chain (set once, by the branch adapter's construction): it may
    # read the residual while another branch's output is set aside.
    branch_member: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        fix = object.__setattr__  # frozen: these are set once, here
        fix(self, "read_makes_update", bool(getattr(self.read, "makes_update", False)))
        fix(self, "finalize_askers", tuple(
            f for p in self.fusions if (f := getattr(p, "can_defer_finalize", None)) is not None))
        fix(self, "sum_askers", tuple(
            f for p in self.fusions if (f := getattr(p, "can_defer_all_reduce", None)) is not None))

    @property
    def variants(self) -> tuple[BatchVariant, ...]:
        return tuple(self.entries)

    def describe(self) -> str:
        d = self.declaration
        prev = d.previous.describe() if d.previous is not None else "stack entry"
        src = (f"prepared_from={d.prepared_from.describe()}" if d.prepared_from is not None
               else f"previous={prev}")
        nxt = "terminal" if d.terminal else (self.following.describe() if self.following else "next layer")
        return (
            f"{self.name.split(' #')[0]}: {d.describe()} read={self.read.name} update={self.update.name} "
            f"{src} following={nxt} variants={[v.name for v in self.variants]}"
        )
