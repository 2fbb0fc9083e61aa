"""The MHC residual update: ``x'_i = sum_j H_res[i, j] x_j + H_post[i] y``.

``y [T, C]`` is the stage's (completed) output, ``x [T, n, C]`` the streams. The update is
nonlinear in what it carries (per-token coefficients), so it never joins a sum, never fuses with
a plain add+norm read and cannot be snapshotted: ``plain_add = False``. It is applied at the next
read, after every owed reduction (``at_producer = False``); its coefficients belong to the
contribution and its parameters to the model, so it outlives the producer.

Two objects share the name ``"mhc"``: :data:`MHC_UPDATE`, the kind a declaration carries (the
edge check compares names), and :class:`MhcCoefficients`, the update one stage invocation's output
actually carries, made by that stage's read.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from layer_boundary import BoundaryError

from .reference import mhc_update_ref

__all__ = ["MhcUpdate", "MHC_UPDATE", "MhcCoefficients"]


class _MhcCapabilities:
    __slots__ = ()
    name = "mhc"
    plain_add = False
    at_producer = False
    outlives_producer = True


class MhcUpdate(_MhcCapabilities):
    """The declared update kind of every MHC stage. It holds no coefficients and applies nothing:
    each invocation's coefficients come from the stage's MHC read."""

    def apply(self, residual: Optional[torch.Tensor], contribution: torch.Tensor) -> torch.Tensor:
        raise BoundaryError(
            "an MHC stage output was published without the coefficients its read makes; declare "
            "the stage with the MHC read (StageResidual.read) and call its prepare() before "
            "finish()/exit() (operation-scheduled postprocess() does not carry MHC coefficients)"
        )

    def __repr__(self) -> str:
        return "MHC_UPDATE"


MHC_UPDATE = MhcUpdate()


class MhcCoefficients(_MhcCapabilities):
    """The update of one stage invocation: ``h_post [T, n]`` and ``h_res [T, n, n]`` (FP32, or FP64
    for FP64 streams), computed by the read from that invocation's input streams. ``kernel``: the
    Triton update (``mhc_update_triton``) when the read that made them ran on Triton, used for
    streams it serves; the torch reference otherwise."""

    __slots__ = ("h_post", "h_res", "kernel")

    def __init__(self, h_post: torch.Tensor, h_res: torch.Tensor, kernel: Optional[Callable[..., torch.Tensor]] = None,
                 ) -> None:
        self.h_post = h_post
        self.h_res = h_res
        self.kernel = kernel

    def check(self, residual: Optional[torch.Tensor], contribution: torch.Tensor) -> None:
        """Raise unless ``contribution`` is an output ``[T, hidden]`` for these coefficients and
        ``residual`` (if any) the streams ``[T, n, hidden]`` it updates."""
        t, n = self.h_post.shape
        if contribution.dim() != 2 or contribution.shape[0] != t:
            raise ValueError(
                f"the MHC update got a stage output of shape {tuple(contribution.shape)}; it was made "
                f"for {t} token rows and takes an output [{t}, hidden]"
            )
        want = (t, n, contribution.shape[1])
        if residual is not None and tuple(residual.shape) != want:
            raise ValueError(
                f"the MHC streams have shape {tuple(residual.shape)} but the update expects "
                f"{want} ([tokens, n, hidden]); pass the stage's own output"
            )

    def apply(self, residual: Optional[torch.Tensor], contribution: torch.Tensor) -> torch.Tensor:
        """``H_res x + H_post^T y`` accumulated in the coefficients' precision, rounded once to the
        residual dtype. ``residual=None`` (no streams yet) gives ``H_post^T y``."""
        self.check(residual, contribution)
        if (self.kernel is not None and residual is not None and residual.device.type == contribution.device.type
                and residual.dtype == contribution.dtype and self.h_res.dtype == torch.float32):
            return self.kernel(residual, contribution, self.h_post, self.h_res)
        return mhc_update_ref(residual, contribution, self.h_post, self.h_res)

    def __repr__(self) -> str:
        t, n = self.h_post.shape
        return f"MhcCoefficients(tokens={t}, n={n}, {str(self.h_res.dtype).replace('torch.', '')})"
