"""Consumer candidates that complete an owed all-reduce together with the add + RMSNorm read.

Every backend that fuses "sum the partial outputs over a group, add the residual, normalize"
(the core's symmetric-memory kernel, FlashInfer's all-reduce fusion, AITER's custom all-reduce)
shares the same contract, kept here so each backend only supplies its kernel and its own
eligibility facts:

* **Static eligibility at construction.** Facts every rank of the group shares (group size and
  backend, dtype, hidden size, read kind) are checked without communication. Facts of this
  process alone (a library that imports here, a device property) are then agreed over the group
  with one small all-reduce: if any rank refuses, every rank refuses, so no rank ever waits in a
  fused kernel for a peer that took the unfused path.
* **Per-batch eligibility from shared facts only.** A candidate declines a batch (returns
  ``None`` before touching anything) only on facts every rank of the group has in common: the
  shape and dtype of the contribution, which an all-reduce requires to be equal on all ranks.
* **Workspaces before capture.** A backend's workspace (peer-visible buffers, barriers) is
  created at construction, once per group, hidden size and dtype, never inside a forward, so a
  CUDA graph captured later replays it.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .._contracts import OwedKind
from .._forward import active_variant
from .._layout import BatchVariant, SumGroup
from .._selection import not_on_this_device
from .._topology import GroupInfo

__all__ = [
    "FusedSum",
    "AllReduceNormCandidate",
    "RefusedCandidate",
    "AllReduceNormProvider",
    "agree",
    "group_backend",
    "WorkspaceUnavailable",
]

log = logging.getLogger("layer_boundary")

# (contribution, residual, read) -> (normalized input, residual'), residual updated in place.
FusedRun = Callable[[torch.Tensor, torch.Tensor, Any], tuple[Any, torch.Tensor]]


class WorkspaceUnavailable(RuntimeError):
    """Raised by ``make_workspace`` when the backend turns the workspace down on this rank (its
    own late check): the group then agrees to refuse, instead of one rank going unfused."""


@dataclass(frozen=True, slots=True)
class FusedSum:
    """What a stage's input owes, as a fused candidate sees it at construction."""

    sum_group: SumGroup
    group: GroupInfo
    hidden_size: int
    dtype: torch.dtype
    weight_offset: float
    quant: Optional[str]


def group_backend(group: GroupInfo) -> str:
    """The torch.distributed backend of a group (``"none"`` for a group of one)."""
    if group.size == 1 or group.group is None:
        return "none"
    try:
        return str(dist.get_backend(group.group))
    except Exception:  # a test double or an engine-made group the default world does not know
        return "unknown"


def agree(group: GroupInfo, why: Optional[str]) -> Optional[str]:
    """Make a rank-local refusal the whole group's: if any rank refuses, every rank does.

    A collective at construction (one int all-reduce); every rank of the group must call it for
    the same stage, which holds because every rank builds the same stages in the same order.
    """
    if group.size == 1:
        return why
    backend = group_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    flag = torch.tensor([1 if why else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group.group)
    if why:
        return why
    if int(flag.item()):
        return ("another rank of the group refused it (its selection report says why); every rank "
                "takes the same path or none does")
    return None


class AllReduceNormCandidate:
    """Completes a sum over ``group`` with the plain add and the (RMSNorm) read in one call.

    Declines (returns ``None``) a batch with no residual yet, no rows, more than ``max_tokens``
    rows, or a contribution whose dtype or layout the workspace was not built for. Each of these
    is the same on every rank of the group, so the ranks never split between paths.
    """

    __slots__ = ("name", "sum_group", "group", "max_tokens", "dtype", "hidden_size", "_run", "_warned")

    def __init__(self, name: str, fused: FusedSum, max_tokens: int, run: FusedRun) -> None:
        self.name = name
        self.sum_group = fused.sum_group
        self.group = fused.group
        self.max_tokens = max_tokens
        self.dtype = fused.dtype
        self.hidden_size = fused.hidden_size
        self._run = run
        self._warned: set[str] = set()

    def refuse(self, plan: Any) -> Optional[str]:
        return None  # the provider refused at offer time; an offered candidate accepts its stage

    def __call__(self, contribution: torch.Tensor, residual: Optional[torch.Tensor], read: Any,
                 forward_batch: Any) -> Optional[tuple[Any, torch.Tensor]]:
        if residual is None:
            return None
        rows = contribution.shape[0]
        if rows == 0 or rows > self.max_tokens:
            return None  # over the workspace: the documented limit, not a surprise
        if contribution.dtype is not self.dtype or residual.dtype is not self.dtype \
                or contribution.dim() != 2 or contribution.shape[1] != self.hidden_size \
                or contribution.stride(1) != 1 or not residual.is_contiguous():
            self._decline_once(contribution, residual)
            return None
        return self._run(contribution, residual, read)

    def _decline_once(self, contribution: torch.Tensor, residual: torch.Tensor) -> None:
        # Not a limit the report announced: say so once, so the unfused path is never silent.
        key = f"{contribution.dtype}/{residual.dtype}/{tuple(contribution.shape[1:])}"
        if key not in self._warned:
            self._warned.add(key)
            log.warning(
                "%s: declined a contribution %s %s with residual %s (built for %s H=%d, contiguous "
                "rows); this input takes the unfused all-reduce path", self.name,
                tuple(contribution.shape), contribution.dtype, residual.dtype, self.dtype, self.hidden_size,
            )

    def __repr__(self) -> str:
        return f"{self.name}(group={self.group.ranks}, max_tokens={self.max_tokens})"


class RefusedCandidate:
    """A candidate that refuses its stage with a reason, so the selection report shows why."""

    __slots__ = ("name", "why")
    sum_group = None

    def __init__(self, name: str, why: str) -> None:
        self.name = name
        self.why = why

    def refuse(self, plan: Any) -> Optional[str]:
        return self.why

    def __call__(self, *args: Any) -> None:
        return None


def limits_refusal(limits: Any, world: int, dtype: torch.dtype, hidden: int) -> Optional[str]:
    """A fused kernel's shape limits, read from ``limits`` (``max_world``, ``dtypes``,
    ``max_hidden``, as the providers declare them): ``None`` when the group and rows fit."""
    if world > limits.max_world:
        return f"group of {world} ranks is over its limit of {limits.max_world}"
    if dtype not in limits.dtypes:
        return f"dtype {str(dtype).replace('torch.', '')} is not supported"
    if hidden > limits.max_hidden:
        return f"hidden size {hidden} is over its limit of {limits.max_hidden}"
    return None


def owed_sum(plan: Any) -> Optional[tuple[SumGroup, GroupInfo]]:
    """The single sum a stage's ordinary input completes, or ``None`` (stack entry, one rank)."""
    entry = plan.entries.get(BatchVariant.ORDINARY)
    if entry is None:
        return None
    sums = [g for kind, g in entry.accepts if kind is OwedKind.SUM and g is not None]
    if len(sums) != 1:
        return None
    if sums[0] is SumGroup.TP and plan.topology.attn_dp.size > 1:
        return None  # under attention DP an FFN output returns to its rows at its own exit
    group = plan.topology.sum_group(sums[0])
    return (sums[0], group) if group.size > 1 else None


class AllReduceNormProvider:
    """Base of fusion providers whose candidates complete an all-reduce with add + RMSNorm.

    A backend sets ``name``, ``candidate_name`` and the class limits, and implements
    ``group_refusal`` (facts all ranks share), ``local_refusal`` (facts of this process),
    ``make_workspace`` and ``run_with``. Workspaces are cached per (group, hidden, dtype).
    """

    name = "allreduce-norm"
    candidate_name = "fused all-reduce + add + rmsnorm"
    dtypes: frozenset[torch.dtype] = frozenset({torch.bfloat16, torch.float16, torch.float32})
    weight_offsets: frozenset[float] = frozenset({0.0, 1.0})
    quants: frozenset[Optional[str]] = frozenset({None})
    max_world = 8
    max_hidden = 16384
    # Let producers leave their output sums to the next input where a candidate fuses them.
    defer_sums = True
    backends: frozenset[str] = frozenset({"nccl"})

    def __init__(self, max_tokens: int = 2048) -> None:
        self.max_tokens = max_tokens
        self._workspaces: dict[tuple[Any, ...], Any] = {}
        self._turned_down: dict[tuple[Any, ...], str] = {}
        # Per producer plan (construction-time facts): whether its output sum is one we fuse.
        self._deferrable: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()

    # -- FusionProvider ---------------------------------------------------------------------

    def attention_input(self, plan: Any) -> Sequence[Any]:
        return self._offer(plan)

    def ffn_input(self, plan: Any) -> Sequence[Any]:
        return self._offer(plan)

    def can_defer_all_reduce(self, plan: Any, forward_batch: Any) -> bool:
        """Let a producer leave its output sum to the next input when a candidate of this
        provider completes that sum there and the batch fits its workspace.

        Only ordinary batches: their rows are the same on every rank of the sum group, so every
        rank decides alike. (The core asks only producers that may defer: never under attention
        DP.) A deferred sum the next input does not fuse is completed there by the all-reduce.
        """
        if not self.defer_sums:
            return False
        if torch.compiler.is_compiling():
            # Traced, the answer is worked out once at trace time (Dynamo cannot read a
            # WeakKeyDictionary); eager forwards keep the cache.
            ok: Optional[int] = self._serves_output_of(plan)
        else:
            ok = self._deferrable.get(plan)  # the rows the fusing workspace holds; 0: none fuses
        if ok is None:
            ok = self._deferrable[plan] = self._serves_output_of(plan)
        return 0 < forward_batch.num_tokens <= ok \
            and active_variant(forward_batch) is BatchVariant.ORDINARY \
            and getattr(forward_batch, "dp_num_tokens", None) is None

    def _serves_output_of(self, plan: Any) -> int:
        from .._construction import output_sum

        owed = output_sum(plan.declaration, plan.topology)
        weight = getattr(plan.read, "weight", None)
        if owed is None or owed.group is None or weight is None:
            return 0
        key = (owed.group.ranks, int(weight.shape[0]), weight.dtype)
        if key not in self._workspaces:
            return 0
        return int(getattr(self._workspaces[key], "max_tokens", self.max_tokens))

    # -- what a backend supplies ------------------------------------------------------------

    def group_refusal(self, fused: FusedSum) -> Optional[str]:
        return None

    def local_refusal(self, fused: FusedSum) -> Optional[str]:
        return None

    def make_workspace(self, fused: FusedSum) -> Any:
        raise NotImplementedError

    def run_with(self, workspace: Any, fused: FusedSum) -> FusedRun:
        raise NotImplementedError

    # -- shared logic -----------------------------------------------------------------------

    def _offer(self, plan: Any) -> Sequence[Any]:
        owed = owed_sum(plan)
        if owed is None:
            return ()  # nothing owed to fuse here: no candidate, no workspace
        entry = plan.entries[BatchVariant.ORDINARY]
        if entry.rows.every_group_input:
            return (RefusedCandidate(self.candidate_name, "attention DP moves this input's rows; "
                                     "the fused all-reduce serves ordinary rows only"),)
        read = plan.read
        weight = getattr(read, "weight", None)
        if weight is None or not hasattr(read, "offset"):
            return (RefusedCandidate(self.candidate_name, f"read {read.name} is not an RMSNorm read"),)
        fused = FusedSum(owed[0], owed[1], int(weight.shape[0]), weight.dtype, float(read.offset),
                         getattr(read, "quant", None))
        why = self._common_refusal(fused) or self.group_refusal(fused)
        if why is not None:
            return (RefusedCandidate(self.candidate_name, why),)
        why = agree(fused.group, self.local_refusal(fused))
        if why is not None:
            return (RefusedCandidate(self.candidate_name, why),)
        key = (fused.group.ranks, fused.hidden_size, fused.dtype)
        if key in self._turned_down:
            return (RefusedCandidate(self.candidate_name, self._turned_down[key]),)
        workspace = self._workspaces.get(key)
        if workspace is None:
            late: Optional[str] = None
            try:
                workspace = self.make_workspace(fused)
            except WorkspaceUnavailable as exc:
                late = str(exc) or "the backend turned its workspace down"
            # Every rank made its workspace (a collective) before any uses it; one that could
            # not makes the whole group refuse.
            late = agree(fused.group, late)
            if late is not None:
                self._turned_down[key] = late  # every rank remembers it: no retry per stage
                return (RefusedCandidate(self.candidate_name, late),)
            self._workspaces[key] = workspace
        # A workspace may hold fewer rows than asked for (a memory budget): it says so.
        rows = getattr(workspace, "max_tokens", self.max_tokens)
        return (AllReduceNormCandidate(self.candidate_name, fused, rows, self.run_with(workspace, fused)),)

    def _common_refusal(self, fused: FusedSum) -> Optional[str]:
        backend = group_backend(fused.group)
        if backend not in self.backends:
            why = f"needs a {'/'.join(sorted(self.backends))} group; {fused.sum_group.value} uses {backend}"
            # gloo is the CPU's backend: a GPU fusion declining it is the normal case there.
            return not_on_this_device(why) if backend == "gloo" else why
        limit = limits_refusal(self, fused.group.size, fused.dtype, fused.hidden_size)
        if limit is not None:
            return limit
        if fused.weight_offset not in self.weight_offsets:
            return "Gemma RMSNorm (weight + 1) is not offered" if fused.weight_offset == 1.0 else \
                f"weight offset {fused.weight_offset} is not offered"
        if fused.quant not in self.quants:
            return f"{fused.quant or 'unquantized'} output is not offered"
        return None
