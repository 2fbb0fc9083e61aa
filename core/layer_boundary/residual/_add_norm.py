"""The plain residual add and the RMSNorm reads (plain and Gemma), plus a black-box norm read.

``update_and_read`` for the plain pair computes ``s = c + r`` in FP32, stores ``r' = s`` rounded
to the residual dtype, and normalizes the FP32 ``s``: the normalized input never sees the
rounding of the stored residual. Kernels come from a :class:`NormKernels` table so that faster
providers (Triton, plugins) replace the torch reference without changing these semantics.

A quantized read (``AddNormReadSpec(quant="fp8_e4m3")``) returns the normalized input as
``QuantizedRows`` (per-token FP8, see ``layer_boundary._quant``); the residual keeps its dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from .._errors import BoundaryError
from .._kernels.reference import fused_add_rmsnorm_fp8_ref, fused_add_rmsnorm_ref, rmsnorm_fp8_ref, rmsnorm_ref
from .._norms import norm_params
from .._quant import QuantizedRows, check_quant
from . import StageRead, StageUpdate

__all__ = [
    "PlainAdd",
    "PLAIN_ADD",
    "NormRequest",
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
class NormRequest:
    """What a stage's norm read needs from a kernel, known at construction.

    ``weight_offset`` 0 is RMSNorm, 1 Gemma RMSNorm. ``quant`` names a quantized output format
    for a quantized consumer (``None``: the activation dtype; ``"fp8_e4m3"``: per-token FP8).
    """

    device_type: str
    dtype: torch.dtype
    hidden_size: int
    weight_offset: float = 0.0
    quant: Optional[str] = None

    def describe(self) -> str:
        kind = "gemma_rmsnorm" if self.weight_offset == 1.0 else "rmsnorm"
        q = f" -> {self.quant}" if self.quant else ""
        return f"{kind} {self.device_type} {str(self.dtype).replace('torch.', '')} H={self.hidden_size}{q}"


# A norm kernel's normalized output: a tensor in the activation dtype, or ``QuantizedRows`` for a
# quantized request.
NormOutput = Union[torch.Tensor, QuantizedRows]


@dataclass(frozen=True, slots=True)
class NormKernels:
    """Norm-read kernels with the reference's signatures (see ``kernels.reference``).

    For a quantized request (``NormRequest.quant``) both return ``QuantizedRows`` as the
    normalized output, as ``rmsnorm_fp8_ref`` / ``fused_add_rmsnorm_fp8_ref`` define.
    """

    name: str
    # (x, weight, eps, *, weight_offset, out=None) -> y
    rmsnorm: Callable[..., NormOutput]
    # (x, residual, weight, eps, *, weight_offset, out=None, residual_out=None) -> (y, residual)
    fused_add_rmsnorm: Callable[..., tuple[NormOutput, torch.Tensor]]
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


def _meta(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


def _quantized_problem(got: Any, like: torch.Tensor) -> Optional[str]:
    """What is wrong with a quantized read's output, against ``quant``'s table (None: nothing)."""
    if not isinstance(got, QuantizedRows):
        return f"{type(got).__name__} (not QuantizedRows(data, scale))"
    data, scale = got
    want_scale = (like.shape[0], 1)
    if not isinstance(data, torch.Tensor) or data.shape != like.shape or data.dtype != torch.float8_e4m3fn:
        return f"data {_meta(data) if isinstance(data, torch.Tensor) else type(data).__name__} " \
               f"(want {tuple(like.shape)} float8_e4m3fn)"
    if not isinstance(scale, torch.Tensor) or tuple(scale.shape) != want_scale or scale.dtype != torch.float32:
        return f"scale {_meta(scale) if isinstance(scale, torch.Tensor) else type(scale).__name__} " \
               f"(want {want_scale} float32)"
    return None


class RMSNormRead:
    """Read ``y = RMSNorm(r)`` with weight ``w + offset`` (offset 1 for Gemma).

    The weight and eps are looked up on the norm module at each call, so a loader that replaces
    the parameter object after construction is still honoured. ``quant`` names the output format
    its kernels produce (``None``: the activation dtype; ``"fp8_e4m3"``: ``QuantizedRows``);
    fusion candidates inspect it and refuse reads they cannot produce.
    """

    __slots__ = ("name", "norm", "offset", "kernels", "quant", "_eps", "_params", "_checked_read", "_checked_fused",
                 "_on_defect", "_eps64", "__weakref__")
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
        if eps is None:
            params = norm_params(norm)
            if params is None:
                raise TypeError(f"{type(norm).__name__} exposes no RMSNorm weight and eps: give eps, or "
                                "read it through ModuleRead")
            eps = params[1]  # as norm_params read it
        self._eps = eps
        # torch.nn.RMSNorm(eps=None) uses the epsilon of the dtype it computes in, at each call:
        # FP64's for FP64 inputs, FP32's for the rest. A model cast after construction
        # (.double(), .float()) changes it, so such a norm keeps both.
        self._eps64: Optional[float] = None
        if type(norm) is nn.RMSNorm and getattr(norm, "eps", 0.0) is None:
            self._eps, self._eps64 = torch.finfo(torch.float32).eps, torch.finfo(torch.float64).eps
        self._params = norm._parameters if "weight" in norm._parameters else None
        # Each kernel's first call is checked (shape and dtype of what it returns: metadata, no
        # sync; or that it did not raise where the reference does not): a plugin's kernel that is
        # defective is reported there and replaced through _on_defect, which the selection sets
        # when it registers the read (the next provider's kernels), not found deep in the model's
        # next matmul. Without it (kernels given to the read spec) it is an error. The table's own
        # numerics are the conformance kit's.
        self._on_defect: Optional[Callable[[NormKernels, str], Optional[NormKernels]]] = None
        self._set_kernels(kernels)

    def _set_kernels(self, kernels: NormKernels) -> None:
        self.kernels = kernels
        self._checked_read = self._checked_fused = kernels is REFERENCE_KERNELS or kernels is REFERENCE_FP8_KERNELS

    @property
    def residual_in_place(self) -> bool:
        return self.kernels.residual_in_place

    @property
    def weight(self) -> torch.Tensor:
        p = self._params
        w = p["weight"] if p is not None else self.norm.weight
        if not isinstance(w, torch.Tensor):  # an RMSNorm-like module's weight is a tensor
            raise TypeError(f"{type(self.norm).__name__}.weight is {type(w).__name__}, not a tensor")
        return w

    @property
    def eps(self) -> float:
        """The eps for inputs of the weight's dtype (the model's)."""
        return self._eps_of(self.weight)

    def _eps_of(self, x: torch.Tensor) -> float:
        return self._eps64 if self._eps64 is not None and x.dtype == torch.float64 else self._eps

    def enter(self, hidden: torch.Tensor) -> tuple[NormOutput, torch.Tensor]:
        return self.read(hidden), hidden

    def read(self, residual: torch.Tensor) -> NormOutput:
        if not self._checked_read:
            return self._first_call("rmsnorm", residual)
        eps = self._eps if self._eps64 is None else self._eps_of(residual)
        return self.kernels.rmsnorm(residual, self.weight, eps, weight_offset=self.offset)

    def update_and_read(
        self, update: StageUpdate, contribution: torch.Tensor, residual: Optional[torch.Tensor]
    ) -> tuple[NormOutput, torch.Tensor]:
        if residual is not None and update.name in self.fuses_with:
            if not self._checked_fused:
                return self._first_call("fused_add_rmsnorm", contribution, residual)
            # _fused's body, inline: this is the call every layer's entry makes.
            k = self.kernels
            p = self._params
            weight = p["weight"] if p is not None else self.norm.weight
            eps = self._eps if self._eps64 is None else self._eps_of(residual)
            if k.input_as_out:
                return k.fused_add_rmsnorm(contribution, residual, weight, eps, weight_offset=self.offset,
                                           out=contribution)
            return k.fused_add_rmsnorm(contribution, residual, weight, eps, weight_offset=self.offset)
        new = update.apply(residual, contribution)
        return self.read(new), new

    def _fused(self, k: NormKernels, contribution: torch.Tensor, residual: torch.Tensor) -> Any:
        p = self._params
        weight = p["weight"] if p is not None else self.norm.weight
        eps = self._eps if self._eps64 is None else self._eps_of(residual)
        if k.input_as_out:
            return k.fused_add_rmsnorm(contribution, residual, weight, eps, weight_offset=self.offset,
                                       out=contribution)
        return k.fused_add_rmsnorm(contribution, residual, weight, eps, weight_offset=self.offset)

    def _run(self, k: NormKernels, kernel: str, args: tuple) -> Any:
        if kernel == "rmsnorm":
            return k.rmsnorm(args[0], self.weight, self._eps_of(args[0]), weight_offset=self.offset)
        return self._fused(k, *args)

    def _first_call(self, kernel: str, *args: torch.Tensor) -> Any:
        """A kernel's first call, checked; a defective one is replaced and the call rerun."""
        k = self.kernels
        # A kernel may write its inputs (declared or not) before it fails: it works on copies
        # this once, so that its replacement reruns on what the stream holds.
        given = tuple(a.clone() for a in args)
        problem: Optional[str]
        try:
            got = self._run(k, kernel, given)
        except Exception as e:
            try:  # the reference on the same input: if it fails too, the input is at fault
                self._run(reference_kernels(self.quant), kernel, tuple(a.clone() for a in args))
            except Exception:
                raise e from None
            problem = f"{kernel} raised {type(e).__name__}: {e} (the torch reference runs this input)"
        else:
            if kernel == "rmsnorm":
                problem = self._problem(kernel, ((got, args[0], "y"),))
            else:
                pair = got if isinstance(got, (tuple, list)) and len(got) == 2 else (got, None)
                problem = self._problem(kernel, ((pair[0], args[0], "y"), (pair[1], args[1], "residual")))
            if problem is None:
                if kernel == "rmsnorm":
                    self._checked_read = True
                else:
                    self._checked_fused = True
                return got
        replacement = self._on_defect(k, problem) if self._on_defect is not None else None
        if replacement is None:
            raise BoundaryError(
                f"norm kernels {k.name!r}: {problem}; the plugin that provides them is defective (run its "
                "conformance kit; LAYER_BOUNDARY_DISABLE=<plugin> leaves it out)")
        self._set_kernels(replacement)
        return self._again(kernel, args)

    def _again(self, kernel: str, args: tuple) -> Any:
        checked = self._checked_read if kernel == "rmsnorm" else self._checked_fused
        return self._run(self.kernels, kernel, args) if checked else self._first_call(kernel, *args)

    def _problem(self, kernel: str, pairs: tuple) -> Optional[str]:
        """What is wrong with a first call's outputs (None: nothing), against their inputs."""
        for got, like, what in pairs:
            if what == "y" and self.quant is not None:
                problem = _quantized_problem(got, like)
            elif not isinstance(got, torch.Tensor):
                problem = f"{type(got).__name__} (not (y, residual) tensors)"
            elif got.shape != like.shape or got.dtype != like.dtype:
                problem = _meta(got)
            else:
                problem = None
            if problem is not None:
                fmt = f" (a {self.quant} read)" if self.quant is not None and what == "y" else ""
                return f"{kernel} returned {what} {problem} for an input {_meta(like)}{fmt}"
        return None

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
                request = NormRequest(weight.device.type, weight.dtype, weight.shape[0], offset, self.quant)
                kernels = select(request)
        read = RMSNormRead(norm, offset, kernels, self.quant, eps)
        register = getattr(select, "register_read", None) if self.kernels is None else None
        if register is not None:  # a defective table is replaced through it (see RMSNormRead)
            register(read, request)
        return read

    def __repr__(self) -> str:
        q = f", quant={self.quant!r}" if self.quant else ""
        return f"AddNormReadSpec(kernels={self.kernels.name if self.kernels else 'selected'}{q})"


ADD_NORM = AddNormReadSpec()


def explain_width(where: str, read: Any, hidden_states: Any, error: RuntimeError) -> None:
    """On a failed read: if the input's device or width is not the norm's, say that, naming
    ``where`` (a stage, or the final norm); torch's own error is a broadcast of two sizes or a
    device assertion deep in its ops. Only the failure path pays for the check."""
    weight = getattr(read, "weight", None)
    if not isinstance(hidden_states, torch.Tensor) or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return
    if hidden_states.device != weight.device:
        raise ValueError(f"{where}: hidden_states are on {hidden_states.device}, but its norm's weight is on "
                         f"{weight.device}; move the model and its inputs to one device (model.to(device) "
                         "before the forward)") from error
    width = hidden_states.shape[-1] if hidden_states.dim() else None
    if width != weight.shape[0]:
        raise ValueError(f"{where}: hidden_states has {width} columns, but its norm is for hidden size "
                         f"{weight.shape[0]}; pass this layer's hidden states (last dimension {weight.shape[0]})"
                         ) from error
