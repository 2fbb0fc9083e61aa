"""The core's own norm-kernel providers (the torch reference; Triton joins on GPUs)."""

from __future__ import annotations

from typing import Optional

import torch

from ..providers import NormRequest
from ..residual.add_norm import REFERENCE_KERNELS, NormKernels

__all__ = ["ReferenceNormProvider", "REFERENCE_PROVIDER", "core_norm_providers"]


class ReferenceNormProvider:
    """The pure torch reference: accepts every unquantized request; exact by definition."""

    name = "torch-reference"
    tolerance = {torch.float32: (0.0, 0.0), torch.bfloat16: (0.0, 0.0), torch.float16: (0.0, 0.0),
                 torch.float64: (0.0, 0.0)}

    def refuse(self, request: NormRequest) -> Optional[str]:
        if request.quant is not None:
            return f"no {request.quant} output in the torch reference"
        return None

    def kernels(self, request: NormRequest) -> NormKernels:
        return REFERENCE_KERNELS


REFERENCE_PROVIDER = ReferenceNormProvider()


def core_norm_providers() -> list[ReferenceNormProvider]:
    return [REFERENCE_PROVIDER]
