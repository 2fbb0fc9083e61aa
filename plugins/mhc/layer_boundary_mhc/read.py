"""MHC reads: a stage's input from the streams, and the stack exit's contraction.

Stage read (``makes_update = True``), for streams ``x [T, n, C]``::

    (H_pre, H_post, H_res) = coefficients(x)          once per invocation, FP32
    input                  = norm(sum_j H_pre[j] x_j)  [T, C]
    update                 = MhcCoefficients(H_post, H_res)

``update_and_read`` applies the producer's update first. Both run on the Triton kernels where
they serve the call (``layer_boundary_mhc.selection``: CUDA, 16-bit or FP32 streams, an RMSNorm),
the update fused with the read in one launch; on the torch reference otherwise
(``layer_boundary_mhc.reference``), which defines what both compute.

The update travels with the stream and then with this stage's contribution, so two microbatches
through the same stage never see each other's coefficients. The combination ``H_pre x`` stays in
FP32 through the norm and is rounded once to the activation dtype: the torch reference RMSNorm
(``rmsnorm_ref``) normalizes it, because the selected norm kernels take activation-dtype inputs and
rounding the combination first would add a rounding the plain add+norm read avoids.

Stack exit (``makes_update = False``): ``norm(contract(x))`` with ``contract`` the streams' mean or a
learned head ``sum_j w_j x_j``, again in FP32 with one rounding.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Optional

import torch
from torch import nn

from layer_boundary.plugin_api import StageUpdate
from layer_boundary.plugin_api import norm_params, rmsnorm_ref

from .coefficients import acc_dtype
from .params import MhcHead, MhcStageParams
from .reference import mhc_combine_ref
from .config import DEFAULT_CONFIG, MhcKernelConfig
from .selection import select_kernels
from .update import MhcCoefficients

__all__ = ["MhcRead", "MhcReadSpec", "MhcExitRead", "MhcExitReadSpec"]


def _check_norm(norm: Any) -> None:
    if not isinstance(norm, nn.Module):
        raise TypeError(
            f"a stage norm must be a torch.nn.Module, got {type(norm).__name__}; pass the layer's "
            "norm module (for example self.input_layernorm)"
        )


class _Norm:
    """The stage's norm applied to an FP32 (or FP64) tensor, rounded once to ``dtype``."""

    __slots__ = ("norm", "offset", "kind", "_eps", "_black_box", "_eps_follows")

    def __init__(self, norm: nn.Module) -> None:
        _check_norm(norm)
        self.norm = norm
        params = norm_params(norm)
        self._black_box = params is None
        self.offset = 0.0 if params is None else params[2]
        self._eps = None if params is None else params[1]  # configuration: fixed, as the core's read
        # ... except torch.nn.RMSNorm(eps=None), whose eps is its compute dtype's at each call: a
        # model cast after construction (.double()) changes it (as the core's RMSNormRead).
        self._eps_follows = type(norm) is nn.RMSNorm and getattr(norm, "eps", 0.0) is None
        if params is None:
            self.kind = f"module:{type(norm).__name__}"
        else:
            self.kind = "gemma_rmsnorm" if self.offset == 1.0 else "rmsnorm"

    def rms(self) -> tuple[torch.Tensor, float]:
        """``(weight, eps)`` of an RMSNorm-like norm, the weight looked up per call: a loader may
        replace the parameter object."""
        weight, eps = self.norm.weight, self._eps
        if not isinstance(weight, torch.Tensor) or eps is None:  # a black box's: never asked for
            raise TypeError(f"the stage norm {type(self.norm).__name__} has no RMSNorm weight and eps")
        if self._eps_follows:
            return weight, torch.finfo(torch.float64 if weight.dtype == torch.float64 else torch.float32).eps
        return weight, eps

    def __call__(self, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self._black_box:
            return self.norm(s.to(dtype))
        weight, eps = self.rms()
        return rmsnorm_ref(s, weight, eps, weight_offset=self.offset).to(dtype)


class MhcRead:
    """A stage's MHC read, bound to its parameters and its norm (see the module docstring).

    ``kernels`` (a ``KernelSelection``) says whether a call runs the Triton kernels or the torch
    reference, and ``kernels.reason(device_type, dtype)`` why."""

    __slots__ = ("params", "iters", "_norm", "name", "kernels", "_checked")
    before_gather = True  # coefficients are per residual row: read where the streams live
    makes_update = True
    residual_in_place = False
    fuses_with: frozenset[str] = frozenset()

    def __init__(self, params: MhcStageParams, norm: nn.Module, iters: int, kernels: str = "auto",
                 config: MhcKernelConfig = DEFAULT_CONFIG) -> None:
        self.params = params
        self.iters = iters
        self._norm = _Norm(norm)
        self.name = f"mhc(n={params.n})+{self._norm.kind}"
        self.kernels = select_kernels(kernels, params.n, self._norm.kind, config)
        self._checked: tuple = ()

    @property
    def norm(self) -> nn.Module:
        return self._norm.norm

    def enter(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, MhcCoefficients]:
        """Repeat the stack input ``[T, C]`` into ``n`` equal streams, then read them."""
        if hidden.dim() != 2:
            raise ValueError(
                f"the MHC stack entry takes the embedding output [tokens, hidden], got shape "
                f"{tuple(hidden.shape)}"
            )
        streams = hidden.unsqueeze(1).repeat(1, self.params.n, 1)
        x, update = self.read(streams)
        return x, streams, update

    def _triton(self, streams: torch.Tensor) -> Optional[ModuleType]:
        """The Triton ops where they serve ``streams`` (``None``: the torch reference does)."""
        k = self.kernels
        if k.serves(streams):
            # The torch path checks the parameters in the reference; the kernels would read a
            # wrong-shaped or 16-bit parameter without noticing. Checked again only when a loader
            # replaced a parameter object, module.to() or a .data assignment recast or reshaped
            # one in place, or the streams changed.
            p = self.params
            key = (streams.dtype,) + tuple((id(t), t.dtype, t.shape) for t in (p.phi, p.alpha, p.b_pre, p.b_post,
                                                                                p.b_res))
            if key != self._checked:
                p.check(streams.dtype)
                self._checked = key
            return k.ops
        if k.mode == "triton":
            raise ValueError(k.refusal(streams))
        return None

    def read(self, residual: torch.Tensor) -> tuple[torch.Tensor, MhcCoefficients]:
        p = self.params
        if residual.dim() != 3 or residual.shape[1:] != (p.n, p.hidden_size):
            raise ValueError(
                f"the MHC read takes streams [tokens, {p.n}, {p.hidden_size}], got shape "
                f"{tuple(residual.shape)}; an MHC stack starts at a stage whose read enters it"
            )
        ops = self._triton(residual)
        if ops is not None:
            weight, eps = self._norm.rms()
            x, h_post, h_res = ops.mhc_read_triton(residual, p, weight, eps, norm_offset=self._norm.offset,
                                                   iters=self.iters, config=self.kernels.config)
            return x, MhcCoefficients(h_post, h_res, ops.mhc_update_triton)
        mixed, h_post, h_res = mhc_combine_ref(residual, p, self.iters)
        return self._norm(mixed, residual.dtype), MhcCoefficients(h_post, h_res)

    def update_and_read(
        self, update: StageUpdate, contribution: torch.Tensor, residual: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, MhcCoefficients]:
        """Apply the producer's update, then read: each step rounds once. On Triton both run in
        one launch (the streams the read sees are the rounded ``x'`` it stores)."""
        if residual is not None and isinstance(update, MhcCoefficients) and contribution.dtype == residual.dtype:
            ops = self._triton(residual)
            if ops is not None:
                update.check(residual, contribution)
                p = self.params
                weight, eps = self._norm.rms()
                streams, x, h_post, h_res = ops.mhc_update_read_triton(
                    residual, contribution, update.h_post, update.h_res, p, weight, eps,
                    norm_offset=self._norm.offset, iters=self.iters, config=self.kernels.config)
                return x, streams, MhcCoefficients(h_post, h_res, ops.mhc_update_triton)
        streams = update.apply(residual, contribution)
        x, own = self.read(streams)
        return x, streams, own

    def __repr__(self) -> str:
        return f"MhcRead({self.name}, sinkhorn={self.iters}, {self.kernels!r})"


class MhcReadSpec:
    """The unbound read kind of one MHC stage: its parameters, Sinkhorn iteration count, kernel
    choice (``auto``, ``triton`` or ``torch``; see ``layer_boundary_mhc.selection``) and kernel
    settings (``MhcKernelConfig``)."""

    name = "mhc"

    def __init__(self, params: MhcStageParams, iters: int, kernels: str = "auto",
                 config: MhcKernelConfig = DEFAULT_CONFIG) -> None:
        self.params = params
        self.iters = iters
        self.kernels = kernels
        self.config = config

    def bind(self, norm: nn.Module, select: Optional[Callable[..., Any]] = None) -> MhcRead:
        return MhcRead(self.params, norm, self.iters, self.kernels, self.config)

    def __repr__(self) -> str:
        return f"MhcReadSpec(n={self.params.n}, kernels={self.kernels})"


class MhcExitRead:
    """The stack exit: ``norm(mean_j x_j)`` or ``norm(sum_j w_j x_j)`` with a learned head."""

    __slots__ = ("n", "head", "_norm", "name")
    before_gather = True
    makes_update = False
    residual_in_place = False
    fuses_with: frozenset[str] = frozenset()

    def __init__(self, n: int, head: Optional[MhcHead], norm: nn.Module) -> None:
        self.n = n
        self.head = head
        self._norm = _Norm(norm)
        self.name = f"mhc_exit(n={n}, {'head' if head is not None else 'mean'})+{self._norm.kind}"

    def contract(self, streams: torch.Tensor) -> torch.Tensor:
        """``[T, n, C] -> [T, C]`` in FP32 (FP64 for FP64 streams), not rounded."""
        s = streams.to(acc_dtype(streams.dtype))
        if self.head is None:
            return s.mean(dim=1)
        return (self.head.weight.to(s.dtype).unsqueeze(-1) * s).sum(dim=1)

    def enter(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.read(hidden), hidden

    def read(self, residual: torch.Tensor) -> torch.Tensor:
        if residual.dim() == 2:
            # Never expanded (a stack without stages): the mean of n copies is the input itself.
            return self._norm(residual.to(acc_dtype(residual.dtype)), residual.dtype)
        if residual.dim() != 3 or residual.shape[1] != self.n:
            raise ValueError(
                f"the MHC exit takes streams [tokens, {self.n}, hidden], got shape {tuple(residual.shape)}"
            )
        return self._norm(self.contract(residual), residual.dtype)

    def update_and_read(
        self, update: StageUpdate, contribution: torch.Tensor, residual: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        streams = update.apply(residual, contribution)
        return self.read(streams), streams

    def __repr__(self) -> str:
        return f"MhcExitRead({self.name})"


class MhcExitReadSpec:
    """The unbound exit read: stream count and the optional learned head."""

    name = "mhc_exit"

    def __init__(self, n: int, head: Optional[MhcHead] = None) -> None:
        self.n = n
        self.head = head

    def bind(self, norm: nn.Module, select: Optional[Callable[..., Any]] = None) -> MhcExitRead:
        return MhcExitRead(self.n, self.head, norm)

    def __repr__(self) -> str:
        return f"MhcExitReadSpec(n={self.n}, {'head' if self.head is not None else 'mean'})"
