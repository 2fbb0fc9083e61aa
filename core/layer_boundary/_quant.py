"""Quantized rows: what a norm read returns for a quantized consumer.

FP8 e4m3 per-token dynamic quantization (``quant="fp8_e4m3"``), for a row ``y`` of the FP32
normalized output (before any rounding to the activation dtype)::

    scale = max(amax(|y|) / 448, FP8_SCALE_FLOOR)          FP32, one per token
    data  = fp8_e4m3fn(clamp(y / scale, -448, 448))        round to nearest even
    y    ~= data.float() * scale

448 is the largest finite ``torch.float8_e4m3fn``. The floor keeps an all-zero row finite
(``scale = FP8_SCALE_FLOOR``, ``data = 0``) instead of dividing by zero.

| field | shape  | dtype                  |
| ----- | ------ | ---------------------- |
| data  | [T, H] | torch.float8_e4m3fn    |
| scale | [T, 1] | torch.float32          |
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["QuantizedRows", "QUANT_FORMATS", "FP8_E4M3_MAX", "FP8_SCALE_FLOOR", "check_quant"]

FP8_E4M3_MAX = 448.0
# Far below any scale a real row produces (amax / 448 of a normalized row is ~1e-3 and up), so it
# only ever acts on rows that are (almost) exactly zero.
FP8_SCALE_FLOOR = 1e-12

# The quantized output formats a NormRequest may name.
QUANT_FORMATS = ("fp8_e4m3",)


class QuantizedRows(NamedTuple):
    """Per-token quantized rows: ``data * scale`` approximates the rows (see the module docstring)."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data.float() * scale`` in ``dtype`` (for tests and unquantized fallbacks)."""
        return (self.data.float() * self.scale).to(dtype)


def check_quant(quant: object) -> None:
    """Raise ``ValueError`` unless ``quant`` is ``None`` or a known format."""
    if quant is not None and quant not in QUANT_FORMATS:
        raise ValueError(
            f"unknown quantized output {quant!r}; known formats: {', '.join(QUANT_FORMATS)} "
            "(or None for the activation dtype)"
        )
