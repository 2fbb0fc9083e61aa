"""``MhcSemantics``: the ``ResidualSemantics`` named ``"mhc"``.

A model asks its context for it by name (``context.semantics("mhc")``), then per stage::

    part = semantics.stage(hidden_size, dtype=dtype)   # StageResidual(update, read, params)
    declare_attn(update=part.update, read=part.read)    # register part.params on the layer

and at the stack exit::

    final = semantics.exit(hidden_size, dtype=dtype)
    residual_batch.bind_final_norm(norm, context=context, read=final.read)
"""

from __future__ import annotations

from typing import Any, Optional, cast

import torch

from layer_boundary.plugin_api import ReadSpec, StageResidual

from .coefficients import SINKHORN_ITERS
from .config import DEFAULT_CONFIG, MhcKernelConfig
from .params import MhcHead, MhcStageParams
from .read import MhcExitReadSpec, MhcReadSpec
from .selection import KERNEL_MODES, triton_unavailable
from .update import MHC_UPDATE

__all__ = ["MhcSemantics", "CONTRACTIONS"]

CONTRACTIONS = ("mean", "head")


class MhcSemantics:
    """Manifold-constrained hyper-connections with ``n`` residual streams.

    ``sinkhorn_iters``: Sinkhorn-Knopp iterations (one row and one column normalization each).
    ``contraction``: how the stack exit merges the streams, ``"mean"`` or a learned ``"head"``.
    ``eps``: of the weight-free RMSNorm the coefficients read the flat streams through.
    ``seed``: ``None`` gives every stage the deterministic near-plain init (see ``params``);
    an int draws each stage's parameters with ``init_random`` from one generator seeded with it,
    in construction order (tests and demos that want non-trivial coefficients at once).
    ``kernels``: ``"auto"`` (the Triton kernels where they serve a call, the torch reference
    elsewhere), ``"triton"`` (raise where they cannot) or ``"torch"``; see ``selection``.
    ``kernel_config``: how the kernels launch (``MhcKernelConfig``; the default is the settings
    measured fastest on an H200), passed to every read's kernel selection.
    """

    name = "mhc"
    # (atol, rtol) of the MHC stack against its equations written out directly.
    tolerance: dict[torch.dtype, tuple[float, float]] = {
        torch.float32: (1e-5, 1e-5),  # FP32 coefficient math in another operation order
        torch.bfloat16: (1.6e-2, 1.6e-2),  # one bf16 rounding of each stored stream and input
        torch.float64: (1e-10, 1e-10),  # FP64 throughout; Sinkhorn reassociation only
    }

    def __init__(
        self,
        n: int = 4,
        *,
        sinkhorn_iters: int = SINKHORN_ITERS,
        contraction: str = "mean",
        eps: float = 1e-6,
        seed: Optional[int] = None,
        kernels: str = "auto",
        kernel_config: Optional[MhcKernelConfig] = None,
    ) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"MhcSemantics(n={n!r}): the number of streams must be a positive int")
        if isinstance(sinkhorn_iters, bool) or not isinstance(sinkhorn_iters, int) or sinkhorn_iters < 1:
            raise ValueError(f"MhcSemantics(sinkhorn_iters={sinkhorn_iters!r}) must be a positive int")
        if contraction not in CONTRACTIONS:
            raise ValueError(f"MhcSemantics(contraction={contraction!r}): choose one of {CONTRACTIONS}")
        if kernels not in KERNEL_MODES:
            raise ValueError(f"MhcSemantics(kernels={kernels!r}): choose one of {KERNEL_MODES}")
        if kernel_config is not None and not isinstance(kernel_config, MhcKernelConfig):
            raise TypeError(f"MhcSemantics(kernel_config={kernel_config!r}): give a "
                            "layer_boundary_mhc.MhcKernelConfig (or None for the default)")
        self.n = n
        self.sinkhorn_iters = sinkhorn_iters
        self.contraction = contraction
        self.eps = float(eps)
        self.seed = seed
        self.kernels = kernels
        self.kernel_config = kernel_config if kernel_config is not None else DEFAULT_CONFIG
        self._generator = torch.Generator().manual_seed(seed) if seed is not None else None

    def _init(self, module: Any) -> Any:
        if self._generator is not None:
            module.init_random(self._generator)
        return module

    def stage(self, hidden_size: int, *, dtype: Optional[torch.dtype], device: Any = None) -> StageResidual:
        """The update kind, the read (bound to this stage's parameters) and the parameters."""
        params = self._init(MhcStageParams(self.n, hidden_size, dtype=dtype, device=device, eps=self.eps))
        # The core's StageRead protocol spells only a read with makes_update = False (read -> input,
        # enter and update_and_read -> pairs); MhcRead is the makes_update = True form its docstring
        # describes (read -> (input, update), triples), which the protocol has no type for yet.
        spec = cast(ReadSpec, MhcReadSpec(params, self.sinkhorn_iters, self.kernels, self.kernel_config))
        return StageResidual(MHC_UPDATE, spec, params)

    def exit(self, hidden_size: int, *, dtype: Optional[torch.dtype], device: Any = None) -> StageResidual:
        """The final norm's read: contract the streams, then normalize. A ``head`` owns parameters."""
        head = self._init(MhcHead(self.n, dtype=dtype, device=device)) if self.contraction == "head" else None
        return StageResidual(MHC_UPDATE, MhcExitReadSpec(self.n, head), head)

    def describe(self) -> str:
        return (f"mhc: {self.n} streams, Sinkhorn {self.sinkhorn_iters} iterations, "
                f"exit {self.contraction}, FP32 coefficients, kernels {self._kernels_text()}")

    def _kernels_text(self) -> str:
        if self.kernels == "torch":
            return "torch (the reference)"
        why = triton_unavailable()
        if why is not None:
            return f"{self.kernels}: torch reference ({why})"
        return f"{self.kernels}: Triton on CUDA (bf16, fp16, fp32 streams), torch reference elsewhere"

    def __repr__(self) -> str:
        return (f"MhcSemantics(n={self.n}, sinkhorn_iters={self.sinkhorn_iters}, "
                f"contraction={self.contraction!r}, kernels={self.kernels!r}"
                + (f", kernel_config={self.kernel_config!r})" if self.kernel_config != DEFAULT_CONFIG else ")"))
