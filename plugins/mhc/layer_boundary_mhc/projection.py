"""The stream pass's projection ``acc + x' @ phi`` on tensor cores, to about FP32 accuracy.

``phi`` is FP32; tensor cores multiply TF32 or 16-bit operands. Two ways to keep FP32 accuracy:

- **TF32 pair** (the default, ``triton_mhc.BF16_PHI = 0``): phi's TF32 high part (11 leading bits, exact)
  and the rest, which the MMA rounds to TF32 (2^-21 of each term); 16-bit streams are exact in
  TF32. The x' tile enters the MMA as FP32: its conversion and its trip through shared memory to
  the MMA's layout move 4 bytes an element.
- **bf16 parts** (``BF16_PHI = 1``, bf16 streams only): phi as the sum of three bf16 parts cut
  by truncation: each has at most 8 significant bits, so the conversions are exact and
  ``hi + mid + lo == phi`` bit for bit (FP32 has 24); bf16 x bf16 products are exact in the
  MMA's FP32 accumulator. More exact than the TF32 pair, but not the same bits. The bf16 x' tile
  enters the MMA as it was stored (2 bytes an element through shared memory) and a bf16 wgmma
  step covers 16 columns (TF32: 8), so three bf16 MMAs issue fewer wgmma instructions than two
  TF32 ones. On sm_90 at BT = 64 it compiles to 128 registers against 170 (two 8-warp programs
  an SM) for 725 instructions a chunk against 675 (PERFORMANCE.md).

Not kept: two bf16 parts (``lo`` dropped, the rest rounded into ``mid``): 693 instructions, 127
registers, but 17 times the reference's coefficient error from FP64 (7.6e-6 at C = 256).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tf32_high(v):
    # The 11 leading significant bits: exact in TF32, and v - high is exact in FP32.
    return (v.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_high(v):
    # The 8 leading significant bits (truncation): exact in bf16, and v - high is exact in FP32.
    return (v.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)


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


@triton.jit
def _dot_bf16(a, part, acc, INTERPRETED: tl.constexpr):
    if INTERPRETED:
        # Triton 3.6's interpreter multiplies bf16 tiles as their uint16 bit patterns: take the
        # (exact) FP32 values instead; the products of two bf16 values are exact in FP32 too.
        return tl.dot(a.to(tl.float32), part, acc, input_precision="ieee")
    return tl.dot(a, part.to(tl.bfloat16), acc)


@triton.jit
def project_bf16(a, phi, acc, INTERPRETED: tl.constexpr):
    """``acc + a @ phi``, ``a`` a bf16 tile, ``phi`` FP32 cut into three bf16 parts here: the
    smallest part first, as the TF32 pair."""
    hi = _bf16_high(phi)
    rest = phi - hi
    mid = _bf16_high(rest)
    acc = _dot_bf16(a, rest - mid, acc, INTERPRETED)
    acc = _dot_bf16(a, mid, acc, INTERPRETED)
    return _dot_bf16(a, hi, acc, INTERPRETED)


def bf16_parts(phi: "torch.Tensor", n: int, np_: int, kp: int, wide: bool = False) -> "torch.Tensor":
    """``[3, C NP, KP]`` bf16: FP32 ``phi`` ([n C, K]) cut by truncation into its high, middle and low
    bf16 parts (as ``project_bf16``), rows reordered to ``c NP + i`` for stream ``i``'s column ``c``
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
    parts = torch.stack((hi, mid, rest - mid)).to(torch.bfloat16).view(3, c * np_, kp)
    return parts.transpose(0, 1).contiguous() if wide else parts
