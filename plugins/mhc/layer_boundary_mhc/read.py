"""MHC reads: a stage's input from the streams, and the stack exit's contraction.

Stage read (``makes_update = True``), for streams ``x [T, n, C]``::

    (H_pre, H_post, H_res) = coefficients(x)          once per invocation, FP32
    input                  = norm(sum_j H_pre[j] x_j)  [T, C]
    update                 = MhcCoefficients(H_post, H_res)

The update travels with the stream and then with this stage's contribution, so two microbatches
through the same stage never see each other's coefficients. The combination ``H_pre x`` stays in
FP32 through the norm and is rounded once to the activation dtype: the torch reference RMSNorm
(``rmsnorm_ref``) normalizes it, because the selected norm kernels take activation-dtype inputs and
rounding the combination first would add a rounding the plain add+norm read avoids.

Stack exit (``makes_update = False``): ``norm(contract(x))`` with ``contract`` the streams' mean or a
learned head ``sum_j w_j x_j``, again in FP32 with one rounding.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from layer_boundary import StageUpdate
from layer_boundary.kernels.reference import rmsnorm_ref
from layer_boundary.norms import norm_params

from .coefficients import acc_dtype, mhc_coefficients
from .params import MhcHead, MhcStageParams
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

    __slots__ = ("norm", "offset", "kind", "_eps_attr", "_black_box")

    def __init__(self, norm: nn.Module) -> None:
        _check_norm(norm)
        self.norm = norm
        params = norm_params(norm)
        self._black_box = params is None
        self.offset = 0.0 if params is None else params[2]
        self._eps_attr = "eps" if hasattr(norm, "eps") else "variance_epsilon"
        if params is None:
            self.kind = f"module:{type(norm).__name__}"
        else:
            self.kind = "gemma_rmsnorm" if self.offset == 1.0 else "rmsnorm"

    def __call__(self, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self._black_box:
            return self.norm(s.to(dtype))
        # Weight and eps are looked up per call: a loader may replace the parameter object.
        eps = getattr(self.norm, self._eps_attr)
        return rmsnorm_ref(s, self.norm.weight, eps, weight_offset=self.offset).to(dtype)


class MhcRead:
    """A stage's MHC read, bound to its parameters and its norm (see the module docstring)."""

    __slots__ = ("params", "iters", "_norm", "name")
    before_gather = True  # coefficients are per residual row: read where the streams live
    makes_update = True
    residual_in_place = False
    fuses_with: frozenset[str] = frozenset()

    def __init__(self, params: MhcStageParams, norm: nn.Module, iters: int) -> None:
        self.params = params
        self.iters = iters
        self._norm = _Norm(norm)
        self.name = f"mhc(n={params.n})+{self._norm.kind}"

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

    def read(self, residual: torch.Tensor) -> tuple[torch.Tensor, MhcCoefficients]:
        p = self.params
        if residual.dim() != 3 or residual.shape[1:] != (p.n, p.hidden_size):
            raise ValueError(
                f"the MHC read takes streams [tokens, {p.n}, {p.hidden_size}], got shape "
                f"{tuple(residual.shape)}; an MHC stack starts at a stage whose read enters it"
            )
        h_pre, h_post, h_res = mhc_coefficients(residual, p, self.iters)
        mixed = (h_pre.unsqueeze(1) @ residual.to(acc_dtype(residual.dtype))).squeeze(1)  # [T, C]
        return self._norm(mixed, residual.dtype), MhcCoefficients(h_post, h_res)

    def update_and_read(
        self, update: StageUpdate, contribution: torch.Tensor, residual: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, MhcCoefficients]:
        """Apply the producer's update, then read: two steps, each rounding once."""
        streams = update.apply(residual, contribution)
        x, own = self.read(streams)
        return x, streams, own

    def __repr__(self) -> str:
        return f"MhcRead({self.name}, sinkhorn={self.iters})"


class MhcReadSpec:
    """The unbound read kind of one MHC stage: its parameters and Sinkhorn iteration count."""

    name = "mhc"

    def __init__(self, params: MhcStageParams, iters: int) -> None:
        self.params = params
        self.iters = iters

    def bind(self, norm: nn.Module, select: Optional[Callable[..., Any]] = None) -> MhcRead:
        return MhcRead(self.params, norm, self.iters)

    def __repr__(self) -> str:
        return f"MhcReadSpec(n={self.params.n})"


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
