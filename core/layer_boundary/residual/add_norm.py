"""The plain residual add and the RMSNorm reads (plain and Gemma), plus a black-box norm read.

``update_and_read`` for the plain pair computes ``s = c + r`` in FP32, stores ``r' = s`` rounded
to the residual dtype, and normalizes the FP32 ``s``: the normalized input never sees the
rounding of the stored residual. Kernels come from a :class:`NormKernels` table so that faster
providers (Triton, plugins) replace the torch reference without changing these semantics.

A quantized read (``AddNormReadSpec(quant="fp8_e4m3")``) returns the normalized input as
``QuantizedRows`` (per-token FP8, see ``layer_boundary.quant``); the residual keeps its dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..errors import BoundaryError
from ..kernels.reference import fused_add_rmsnorm_fp8_ref, fused_add_rmsnorm_ref, rmsnorm_fp8_ref, rmsnorm_ref
from ..norms import norm_params
from ..quant import check_quant
from . import StageRead, StageUpdate

__all__ = [
    "PlainAdd",
    "PLAIN_ADD",
    "NormKernels",
    "REFERENCE_KERNELS",
    "REFERENCE_FP8_KERNELS",
    "reference_kernels",
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
    """Norm-read kernels with the reference's signatures (see ``kernels.reference``).

    For a quantized request (``NormRequest.quant``) both return ``QuantizedRows`` as the
    normalized output, as ``rmsnorm_fp8_ref`` / ``fused_add_rmsnorm_fp8_ref`` define.
    """

    name: str
    rmsnorm: Callable[..., torch.Tensor]
    fused_add_rmsnorm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # True when fused_add_rmsnorm overwrites the residual it is given; a capture of that residual
    # is then borrowed rather than owned.
    residual_in_place: bool = False
    # True when fused_add_rmsnorm is cheapest writing its output over the contribution (a kernel
    # that works in place on its input would otherwise copy it first). The read then passes
    # out=contribution: the boundary owns a consumed contribution and nothing reads it later.
    input_as_out: bool = False


REFERENCE_KERNELS = NormKernels("torch-reference", rmsnorm_ref, fused_add_rmsnorm_ref)
REFERENCE_FP8_KERNELS = NormKernels("torch-reference fp8_e4m3", rmsnorm_fp8_ref, fused_add_rmsnorm_fp8_ref)


def reference_kernels(quant: Optional[str] = None) -> NormKernels:
    """The torch reference table for ``quant`` (``None``: outputs in the activation dtype)."""
    check_quant(quant)
    return REFERENCE_KERNELS if quant is None else REFERENCE_FP8_KERNELS


class RMSNormRead:
    """Read ``y = RMSNorm(r)`` with weight ``w + offset`` (offset 1 for Gemma).

    The weight and eps are looked up on the norm module at each call, so a loader that replaces
    the parameter object after construction is still honoured. ``quant`` names the output format
    its kernels produce (``None``: the activation dtype; ``"fp8_e4m3"``: ``QuantizedRows``);
    fusion candidates inspect it and refuse reads they cannot produce.
    """

    __slots__ = ("name", "norm", "offset", "kernels", "quant", "_eps", "_params", "_checked_read", "_checked_fused")
    before_gather = False
    makes_update = False
    fuses_with = frozenset({PlainAdd.name})

    def __init__(self, norm: nn.Module, offset: float, kernels: NormKernels, quant: Optional[str] = None,
                 eps: Optional[float] = None) -> None:
        check_quant(quant)
        self.norm = norm
        self.offset = offset
        self.kernels = kernels
        self.quant = quant
        self.name = "gemma_rmsnorm" if offset == 1.0 else "rmsnorm"
        # eps is configuration, fixed at construction; the weight is looked up at each call in
        # the module's parameter table (a loader may replace the Parameter object), which skips
        # nn.Module.__getattr__ on the hot path.
        self._eps = norm_params(norm)[1] if eps is None else eps  # as norm_params read it
        self._params = norm._parameters if "weight" in norm._parameters else None
        # The first call's outputs are checked against their inputs (shape and dtype: metadata, no
        # sync): a plugin's kernel that returns the wrong thing is named there, not deep in the
        # model's next matmul. The table's own numerics are the conformance kit's.
        self._checked_read = self._checked_fused = kernels is REFERENCE_KERNELS or quant is not None

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
        y = self.kernels.rmsnorm(residual, self.weight, self._eps, weight_offset=self.offset)
        if not self._checked_read:
            self._check_first("rmsnorm", ((y, residual, "y"),))
            self._checked_read = True
        return y

    def _check_first(self, kernel: str, pairs: tuple) -> None:
        for got, like, what in pairs:
            if not isinstance(got, torch.Tensor) or got.shape != like.shape or got.dtype != like.dtype:
                desc = (f"{type(got).__name__} (not (y, residual) tensors)" if not isinstance(got, torch.Tensor)
                        else f"{tuple(got.shape)} {str(got.dtype).replace('torch.', '')}")
                raise BoundaryError(
                    f"norm kernels {self.kernels.name!r}: {kernel} returned {what} {desc} for an input "
                    f"{tuple(like.shape)} {str(like.dtype).replace('torch.', '')}; the plugin that provides "
                    "them is defective (run its conformance kit; LAYER_BOUNDARY_DISABLE=<plugin> leaves it out)")

    def update_and_read(
        self, update: StageUpdate, contribution: torch.Tensor, residual: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None and update.name in self.fuses_with:
            p = self._params
            k = self.kernels
            if k.input_as_out:
                got = k.fused_add_rmsnorm(contribution, residual, p["weight"] if p is not None else self.norm.weight,
                                          self._eps, weight_offset=self.offset, out=contribution)
            else:
                got = k.fused_add_rmsnorm(
                    contribution, residual, p["weight"] if p is not None else self.norm.weight,
                    self._eps, weight_offset=self.offset
                )
            if not self._checked_fused:
                # In place or not, the inputs keep their shape and dtype: what the outputs should have.
                pair = got if isinstance(got, (tuple, list)) and len(got) == 2 else (got, None)
                self._check_first("fused_add_rmsnorm", ((pair[0], contribution, "y"), (pair[1], residual, "residual")))
                self._checked_fused = True
            return got
        new = update.apply(residual, contribution)
        return self.read(new), new

    def __repr__(self) -> str:
        q = f", quant={self.quant}" if self.quant else ""
        return f"{self.name}(kernels={self.kernels.name}{q})"


class ModuleRead:
    """Read through an arbitrary norm module's ``forward`` (no add+norm fusion)."""

    __slots__ = ("norm", "name")
    before_gather = False
    makes_update = False
    residual_in_place = False
    quant = None  # a black-box norm returns what its forward returns
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
    reference); given kernels are used as they are, and must produce ``quant``'s format.
    ``quant`` asks for a quantized normalized input (``"fp8_e4m3"``: ``QuantizedRows``) for a
    quantized consumer; it needs an RMSNorm-like norm (a black-box module cannot quantize).
    """

    name = "add_norm"

    def __init__(self, kernels: Optional[NormKernels] = None, quant: Optional[str] = None) -> None:
        check_quant(quant)
        self.kernels = kernels
        self.quant = quant

    def bind(self, norm: nn.Module, select: Optional[Callable[..., NormKernels]] = None) -> StageRead:
        if not isinstance(norm, nn.Module):
            raise TypeError(
                f"a stage norm must be a torch.nn.Module, got {type(norm).__name__}; pass the "
                "layer's norm module (for example self.input_layernorm)"
            )
        params = norm_params(norm)
        if params is None:
            if self.quant is not None:
                raise TypeError(
                    f"a {self.quant} read needs an RMSNorm-like norm (weight and eps), got "
                    f"{type(norm).__name__}; use quant=None for a norm called as a black box"
                )
            return ModuleRead(norm)
        weight, eps, offset = params
        kernels = self.kernels
        if kernels is None:
            if select is None:
                kernels = reference_kernels(self.quant)
            else:
                from ..providers import NormRequest

                kernels = select(NormRequest(weight.device.type, weight.dtype, weight.shape[0], offset, self.quant))
        return RMSNormRead(norm, offset, kernels, self.quant, eps)

    def __repr__(self) -> str:
        q = f", quant={self.quant!r}" if self.quant else ""
        return f"AddNormReadSpec(kernels={self.kernels.name if self.kernels else 'selected'}{q})"


ADD_NORM = AddNormReadSpec()


def explain_width(where: str, read: Any, hidden_states: Any, error: RuntimeError) -> None:
    """On a failed read: if the input's width is not the norm's, say that, naming ``where`` (a
    stage, or the final norm); torch's own error is a broadcast of two sizes. Only the failure
    path pays for the check."""
    weight = getattr(read, "weight", None)
    if not isinstance(hidden_states, torch.Tensor) or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return
    width = hidden_states.shape[-1] if hidden_states.dim() else None
    if width != weight.shape[0]:
        raise ValueError(f"{where}: hidden_states has {width} columns, but its norm is for hidden size "
                         f"{weight.shape[0]}; pass this layer's hidden states (last dimension {weight.shape[0]})"
                         ) from error
