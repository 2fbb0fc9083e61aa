"""The stream pass's projection ``acc + x' @ phi`` on tensor cores, to about FP32 accuracy.

``phi`` is FP32; tensor cores multiply TF32 or 16-bit operands. Two ways to keep FP32 accuracy:

- **TF32 pair** (fp16 and fp32 streams, and bf16 streams at decode and mid sizes): phi's TF32 high
  part (11 leading bits, exact) and the rest, which the MMA rounds to TF32 (2^-21 of each term);
  16-bit streams are exact in TF32. The x' tile enters the MMA as FP32.
- **bf16 parts** (``bf16_parts``, bf16 streams in ``stream_joined``): phi as the sum of three bf16
  parts cut by truncation: each has at most 8 significant bits, so the conversions are exact and
  ``hi + mid + lo == phi`` bit for bit (FP32 has 24); bf16 x bf16 products are exact in the MMA's
  FP32 accumulator. More exact than the TF32 pair, but not the same bits. The bf16 x' tile enters
  the MMA as it was stored.

Not kept: two bf16 parts (``lo`` dropped, the rest rounded into ``mid``): 17 times the reference's
coefficient error from FP64 (7.6e-6 at C = 256). Splitting phi into bf16 parts inside the stream
pass of each stream (the ``BF16_PHI`` experiment): 342 µs of stream passes on an H200 at T = 8192
against 218 for ``stream_joined`` (PERFORMANCE-history.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import triton
import triton.language as tl

if TYPE_CHECKING:
    import torch


@triton.jit
def _tf32_high(v):
    # The 11 leading significant bits: exact in TF32, and v - high is exact in FP32.
    return (v.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def project_tf32(v, phi_hi, phi_lo, acc, SPLIT_A: tl.constexpr):
    """``acc + v @ (phi_hi + phi_lo)``, ``v`` FP32 (exact in TF32 unless ``SPLIT_A``: FP32 streams,
    split here the same way as phi)."""
    if SPLIT_A:
        v_hi = _tf32_high(v)
        acc = tl.dot(v - v_hi, phi_hi, acc, input_precision="tf32")
        v = v_hi
    acc = tl.dot(v, phi_lo, acc, input_precision="tf32")
    return tl.dot(v, phi_hi, acc, input_precision="tf32")


@triton.jit
def split_tf32(phi):
    """FP32 ``phi`` -> its TF32 high part and the exact rest (as ``triton_mhc.phi_parts``)."""
    hi = _tf32_high(phi)
    return hi, phi - hi


def bf16_parts(phi: "torch.Tensor", n: int, np_: int, kp: int) -> "torch.Tensor":
    """``[3, C NP, KP]`` bf16: FP32 ``phi`` ([n C, K]) cut by truncation into its high, middle and low
    bf16 parts, rows reordered to ``c NP + i`` for stream ``i``'s column ``c``
    (``stream_joined``), zero rows for padding streams and zero columns past K. The three parts
    sum to phi bit for bit."""
    import torch

    k = phi.shape[1]
    c = phi.shape[0] // n
    full = phi.new_zeros((c, np_, kp))
    full[:, :n, :k] = phi.detach().view(n, c, k).transpose(0, 1)

    def high(v: torch.Tensor) -> torch.Tensor:
        return (v.view(torch.int32) & -65536).view(torch.float32)

    hi = high(full)
    rest = full - hi
    mid = high(rest)
    return torch.stack((hi, mid, rest - mid)).to(torch.bfloat16).view(3, c * np_, kp)
