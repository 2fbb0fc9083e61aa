"""Interfaces a plugin implements: norm-read kernels, fusion providers and residual semantics.

Each is a plain ``Protocol``: the core binds the chosen callables at model construction and a
forward step never goes back through pluggy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from ._forward import ForwardBatchLike
from ._layout import SumGroup
from .residual import ReadSpec, StageRead, StageUpdate
from ._quant import QuantizedRows
from .residual._add_norm import NormKernels, NormRequest

# NormRequest (what a provider is asked; it lives beside NormKernels, which answers it), NormKernels
# (what kernels() returns) and QuantizedRows (what a quantized request's kernels
# return) are re-exported: a plugin finds everything it implements or returns here.
__all__ = [
    "NormKernels",
    "QuantizedRows",
    "NormRequest",
    "NormKernelProvider",
    "ConsumerCandidate",
    "FusionProvider",
    "StageResidual",
    "ResidualSemantics",
    "guarded",
    "refusal",
    "bound_kernels",
    "offered_candidates",
]

if TYPE_CHECKING:
    from ._plan import StagePlan

log = logging.getLogger("layer_boundary")


@runtime_checkable
class NormKernelProvider(Protocol):
    """A set of norm-read kernels with the reference's signatures.

    ``refuse(request)`` returns why it cannot serve a request (``None`` when it can), without
    touching any tensor; ``kernels(request)`` returns the bound kernels. ``tolerance`` maps a
    dtype to the ``(atol, rtol)`` its results keep against the torch reference.
    """

    name: str
    tolerance: dict[torch.dtype, tuple[float, float]]

    def refuse(self, request: NormRequest) -> Optional[str]: ...

    def kernels(self, request: NormRequest) -> NormKernels: ...


@runtime_checkable
class ConsumerCandidate(Protocol):
    """One fused way to complete an owed sum together with the consumer's update and read.

    ``refuse(plan)`` is the static eligibility check at construction. ``__call__(contribution,
    residual, read, forward_batch)`` returns ``(input, residual')`` or ``None``; it must return
    ``None`` before modifying any input or starting a collective, so the fallback stays valid.
    """

    name: str
    sum_group: Optional[SumGroup]

    def refuse(self, plan: StagePlan) -> Optional[str]: ...

    def __call__(
        self, contribution: torch.Tensor, residual: Optional[torch.Tensor], read: StageRead,
        forward_batch: ForwardBatchLike,
    ) -> Optional[tuple[torch.Tensor, torch.Tensor]]: ...


@runtime_checkable
class FusionProvider(Protocol):
    """Backend fusion for a stage: ordered consumer candidates and output-deferral decisions.

    Every method is optional except ``name``; a provider that lacks one offers nothing there.
    """

    name: str

    def attention_input(self, plan: StagePlan) -> Sequence[ConsumerCandidate]: ...

    def ffn_input(self, plan: StagePlan) -> Sequence[ConsumerCandidate]: ...

    def can_defer_finalize(self, plan: StagePlan, forward_batch: ForwardBatchLike) -> bool: ...

    def can_defer_all_reduce(self, plan: StagePlan, forward_batch: ForwardBatchLike) -> bool: ...


@dataclass(frozen=True, slots=True)
class StageResidual:
    """The residual pieces of one stage: its update kind, its read kind and the parameters they
    own (an ``nn.Module`` the model registers so checkpoints and ``.to()`` reach it)."""

    update: StageUpdate
    read: ReadSpec
    params: Optional[nn.Module] = None


def residual_part(semantics: ResidualSemantics, which: str, hidden_size: int, *,
                  dtype: Optional[torch.dtype]) -> StageResidual:
    """``semantics.stage(...)`` or ``semantics.exit(...)`` (``which``), checked: a scheme that returns
    anything but a ``StageResidual`` is named, rather than failing later on a missing attribute."""
    got = getattr(semantics, which)(hidden_size, dtype=dtype)
    if not isinstance(got, StageResidual):
        raise TypeError(f"residual semantics {getattr(semantics, 'name', type(semantics).__name__)!r}: {which}() "
                        f"returned {type(got).__name__}, expected layer_boundary.plugin_api.StageResidual "
                        "(update, read, params)")
    return got


@runtime_checkable
class ResidualSemantics(Protocol):
    """A named residual scheme for a whole stack (plain add, MHC, ...).

    ``stage(hidden_size, ...)`` gives each stage its update, read and parameters; ``exit(...)``
    gives the read the final norm uses (it may contract an expanded residual). ``dtype=None``
    means torch's default dtype, as for a module built without one.
    """

    name: str

    def stage(self, hidden_size: int, *, dtype: Optional[torch.dtype], device: Any = None) -> StageResidual: ...

    def exit(self, hidden_size: int, *, dtype: Optional[torch.dtype], device: Any = None) -> StageResidual: ...


def guarded(provider: Any, method: str, *args: Any) -> tuple[Any, Optional[str]]:
    """``provider.method(*args)`` as ``(result, None)``, or ``(None, why)`` when the provider (a
    plugin's code) raises: the caller then skips that provider as refused, with the reason, so that
    a broken plugin is reported and skipped rather than ending the model's construction."""
    try:
        return getattr(provider, method)(*args), None
    except Exception as e:
        return None, _skipped(provider, f"{method}() raised {type(e).__name__}: {e}")


_WARNED: set[tuple[str, str]] = set()


def _skipped(provider: Any, why: str) -> str:
    """``why``, warned once a provider and reason (a stack asks a provider once a stage)."""
    key = (str(getattr(provider, "name", provider)), why)
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("provider %s skipped: %s", key[0], why)
    return why


def defects_of(names: set[str]) -> list[tuple[str, str]]:
    """``(provider, why)`` of the providers named in ``names`` that were skipped for a defect (they
    raised, or returned the wrong thing) in this process: what strict plugin mode refuses."""
    return sorted(key for key in _WARNED if key[0] in names)


def refusal(provider: Any, *args: Any) -> Optional[str]:
    """Why ``provider.refuse(*args)`` declines (its str), ``None`` when it serves, or why the
    provider is skipped: it raised, or returned something else (``False`` would otherwise read
    as neither serving nor refusing)."""
    why, failed = guarded(provider, "refuse", *args)
    if failed is not None or why is None or (isinstance(why, str) and why):
        return failed or why
    return _skipped(provider, f"refuse() returned {why!r}: expected None (it serves) or a str saying why not")


def bound_kernels(provider: Any, request: NormRequest) -> tuple[Optional[NormKernels], Optional[str]]:
    """``provider.kernels(request)`` as ``(kernels, None)``, or ``(None, why)`` when it raised or
    returned something other than ``NormKernels`` (whose two callables every read calls)."""
    kernels, failed = guarded(provider, "kernels", request)
    if failed is not None:
        return kernels, failed
    if not isinstance(kernels, NormKernels):
        return None, _skipped(provider, f"kernels() returned {type(kernels).__name__}: expected "
                                        "layer_boundary.residual._add_norm.NormKernels")
    for member in ("rmsnorm", "fused_add_rmsnorm"):
        if not callable(getattr(kernels, member)):
            return None, _skipped(provider, f"kernels() returned a NormKernels whose {member} is "
                                            f"{type(getattr(kernels, member)).__name__}, not a callable")
    return kernels, None


def offered_candidates(provider: Any, hook: str, plan: Any) -> tuple[Sequence[Any], Optional[str]]:
    """``provider.<hook>(plan)`` (a fusion provider's consumer candidates) as ``(candidates, None)``,
    or ``((), why)`` when it raised or returned anything but a list or tuple of candidates (a str
    ``name`` and a call each)."""
    offered, failed = guarded(provider, hook, plan)
    if failed is not None or offered is None:
        return (), failed
    if not isinstance(offered, (list, tuple)):
        return (), _skipped(provider, f"{hook}() returned {type(offered).__name__}: expected a list of "
                                      "consumer candidates")
    for cand in offered:
        if not (isinstance(getattr(cand, "name", None), str) and callable(cand)):
            return (), _skipped(provider, f"{hook}() returned a {type(cand).__name__} among its candidates: "
                                          "a consumer candidate has a str name and is called "
                                          "(providers.ConsumerCandidate)")
    return offered, None
