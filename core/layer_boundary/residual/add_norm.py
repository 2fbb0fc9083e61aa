"""The plain residual add and the RMSNorm reads (plain and Gemma), plus a black-box norm read.

``update_and_read`` for the plain pair computes ``s = c + r`` in FP32, stores ``r' = s`` rounded
to the residual dtype, and normalizes the FP32 ``s``: the normalized input never sees the
rounding of the stored residual. Kernels come from a :class:`NormKernels` table so that faster
providers (Triton, plugins) replace the torch reference without changing these semantics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from ..kernels.reference import fused_add_rmsnorm_ref, rmsnorm_ref
from ..norms import norm_params
from . import StageRead, StageUpdate

__all__ = [
    "PlainAdd",
    "PLAIN_ADD",
    "NormKernels",
    "REFERENCE_KERNELS",
    "RMSNormRead",
    "ModuleRead",
    "AddNormReadSpec",
    "ADD_NORM",
]


class PlainAdd:
    """``r' = r + c`` (``r' = c`` at stack entry). Linear, so it may fuse and join sums."""

    name = "plain_add"
    plain_add = True
    at_producer = False
    outlives_producer = True  # stateless

    def apply(self, residual: Optional[torch.Tensor], contribution: torch.Tensor) -> torch.Tensor:
        if residual is None:
            return contribution
        acc = torch.promote_types(torch.promote_types(residual.dtype, contribution.dtype), torch.float32)
        return (residual.to(acc) + contribution.to(acc)).to(residual.dtype)

    def __repr__(self) -> str:
        return "PLAIN_ADD"


PLAIN_ADD = PlainAdd()


@dataclass(frozen=True, slots=True)
class NormKernels:
    """Norm-read kernels with the reference's signatures (see ``kernels.reference``)."""

    name: str
    rmsnorm: Callable[..., torch.Tensor]
    fused_add_rmsnorm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # True when fused_add_rmsnorm overwrites the residual it is given; a capture of that residual
    # is then borrowed rather than owned.
    residual_in_place: bool = False


REFERENCE_KERNELS = NormKernels("torch-reference", rmsnorm_ref, fused_add_rmsnorm_ref)


class RMSNormRead:
    """Read ``y = RMSNorm(r)`` with weight ``w + offset`` (offset 1 for Gemma).

    The weight and eps are looked up on the norm module at each call, so a loader that replaces
    the parameter object after construction is still honoured.
    """

    __slots__ = ("name", "norm", "offset", "kernels", "_eps", "_params")
    before_gather = False
    makes_update = False
    fuses_with = frozenset({PlainAdd.name})

    def __init__(self, norm: nn.Module, offset: float, kernels: NormKernels) -> None:
        self.norm = norm
        self.offset = offset
        self.kernels = kernels
        self.name = "gemma_rmsnorm" if offset == 1.0 else "rmsnorm"
        # eps is configuration, fixed at construction; the weight is looked up at each call in
        # the module's parameter table (a loader may replace the Parameter object), which skips
        # nn.Module.__getattr__ on the hot path.
        self._eps = float(norm.eps if hasattr(norm, "eps") else norm.variance_epsilon)
        self._params = norm._parameters if "weight" in norm._parameters else None

    @property
    def residual_in_place(self) -> bool:
        return self.kernels.residual_in_place

    @property
    def weight(self) -> torch.Tensor:
        p = self._params
        return p["weight"] if p is not None else self.norm.weight

    @property
    def eps(self) -> float:
        return self._eps

    def enter(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.read(hidden), hidden

    def read(self, residual: torch.Tensor) -> torch.Tensor:
        return self.kernels.rmsnorm(residual, self.weight, self._eps, weight_offset=self.offset)

    def update_and_read(
        self, update: StageUpdate, contribution: torch.Tensor, residual: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None and update.name in self.fuses_with:
            p = self._params
            return self.kernels.fused_add_rmsnorm(
                contribution, residual, p["weight"] if p is not None else self.norm.weight,
                self._eps, weight_offset=self.offset
            )
        new = update.apply(residual, contribution)
        return self.read(new), new

    def __repr__(self) -> str:
        return f"{self.name}(kernels={self.kernels.name})"


class ModuleRead:
    """Read through an arbitrary norm module's ``forward`` (no add+norm fusion)."""

    __slots__ = ("norm", "name")
    before_gather = False
    makes_update = False
    residual_in_place = False
    fuses_with: frozenset[str] = frozenset()

    def __init__(self, norm: nn.Module) -> None:
        self.norm = norm
        self.name = f"module:{type(norm).__name__}"

    def enter(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.norm(hidden), hidden

    def read(self, residual: torch.Tensor) -> torch.Tensor:
        return self.norm(residual)

    def update_and_read(
        self, update: StageUpdate, contribution: torch.Tensor, residual: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        new = update.apply(residual, contribution)
        return self.norm(new), new

    def __repr__(self) -> str:
        return self.name


class AddNormReadSpec:
    """The default read kind: RMSNorm (or Gemma RMSNorm) when the norm exposes its parameters,
    otherwise the norm module called as a black box.

    ``kernels=None`` lets construction select the kernels (plugins, core Triton, the torch
    reference); given kernels are used as they are.
    """

    name = "add_norm"

    def __init__(self, kernels: Optional[NormKernels] = None) -> None:
        self.kernels = kernels

    def bind(self, norm: nn.Module, select: Optional[Callable[..., NormKernels]] = None) -> StageRead:
        if not isinstance(norm, nn.Module):
            raise TypeError(
                f"a stage norm must be a torch.nn.Module, got {type(norm).__name__}; pass the "
                "layer's norm module (for example self.input_layernorm)"
            )
        params = norm_params(norm)
        if params is None:
            return ModuleRead(norm)
        weight, _, offset = params
        kernels = self.kernels
        if kernels is None:
            if select is None:
                kernels = REFERENCE_KERNELS
            else:
                from ..providers import NormRequest

                kernels = select(NormRequest(weight.device.type, weight.dtype, weight.shape[0], offset))
        return RMSNormRead(norm, offset, kernels)

    def __repr__(self) -> str:
        return f"AddNormReadSpec(kernels={self.kernels.name if self.kernels else 'selected'})"


ADD_NORM = AddNormReadSpec()
