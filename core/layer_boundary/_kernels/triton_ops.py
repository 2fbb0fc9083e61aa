"""The core Triton norm reads: callables with the references' signatures, and the
``torch.library`` operators that carry them through ``torch.compile``.

| callable                        | reference                   | normalized output |
| ------------------------------- | --------------------------- | ----------------- |
| ``rmsnorm_triton``              | ``rmsnorm_ref``             | x.dtype           |
| ``fused_add_rmsnorm_triton``    | ``fused_add_rmsnorm_ref``   | x.dtype           |
| ``rmsnorm_fp8_triton``          | ``rmsnorm_fp8_ref``         | ``QuantizedRows`` |
| ``fused_add_rmsnorm_fp8_triton``| ``fused_add_rmsnorm_fp8_ref``| ``QuantizedRows`` |

The fused forms update the residual **in place** unless ``residual_out`` is given. Inputs are
``[T, H]`` (or ``[..., H]``, flattened) in bf16, fp16 or fp32; rows and columns may have any
stride (a column stride of 1 is the fast path), outputs are allocated contiguous unless ``out=``
(a tensor, or a ``QuantizedRows`` of destinations) is given.

Eager calls launch the kernel directly: the dispatcher costs tens of microseconds a call, more
than the kernel at decode sizes. Under ``torch.compile`` they call the operators
``layer_boundary::rmsnorm`` and ``layer_boundary::fused_add_rmsnorm``, whose schemas declare what
they write (``out``, ``scale``, ``residual``, ``residual_out``), so functionalization sees the
in-place residual update. Both paths run the same launch code, which allocates nothing and never
synchronizes, so either can be captured in a CUDA graph (after a first call has compiled it).
"""

from __future__ import annotations

import os

from typing import Callable, Optional

import torch
from torch.library import triton_op, wrap_triton

from .._quant import QuantizedRows
from ..residual._add_norm import NormKernels
from .kernel_op import kernel_op
from .reference import check_rows
from .triton_norm import INTERPRETED, launch, norm_rows_kernel

__all__ = [
    "rmsnorm_triton",
    "fused_add_rmsnorm_triton",
    "rmsnorm_fp8_triton",
    "fused_add_rmsnorm_fp8_triton",
    "SUPPORTED_DTYPES",
    "TRITON_KERNELS",
    "TRITON_FP8_KERNELS",
]

# A tuple: membership of constants is what every Dynamo version folds.
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FP8 = torch.float8_e4m3fn


# -- the operators (what torch.compile and CUDA-graph capture of a compiled graph see) ------------

def _rmsnorm_body(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float,
    out: torch.Tensor, scale: Optional[torch.Tensor],
) -> None:
    kernel = norm_rows_kernel if INTERPRETED else wrap_triton(norm_rows_kernel)
    launch(kernel, x, None, weight, out, None, scale, eps, weight_offset)


def _fused_add_rmsnorm_body(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float,
    out: torch.Tensor, residual_out: Optional[torch.Tensor], scale: Optional[torch.Tensor],
) -> None:
    kernel = norm_rows_kernel if INTERPRETED else wrap_triton(norm_rows_kernel)
    launch(kernel, x, residual, weight, out, residual_out, scale, eps, weight_offset)


def _define(name: str, body: Callable[..., None], writes: set[str]) -> None:
    if not INTERPRETED:
        # triton_op traces the body (wrap_triton) into the graph, so Inductor sees the kernel.
        triton_op(name, body, mutates_args=writes)
        return
    # The interpreter's kernel runs on CPU tensors and cannot be traced by wrap_triton: an opaque
    # operator with the same schema (the vendor SDK's, whose fake of a body that returns nothing
    # is derived) keeps the compiled path testable on a CPU.
    kernel_op(name, body, mutates=writes)


_define("layer_boundary::rmsnorm", _rmsnorm_body, {"out", "scale"})
# ``residual`` is declared written even when ``residual_out`` takes the update: one operator for
# both forms, at the price of a copy that functionalization may add in the rare second form.
_define("layer_boundary::fused_add_rmsnorm", _fused_add_rmsnorm_body, {"residual", "out", "residual_out", "scale"})


# -- shared checks (cheap: a few attribute reads per call) ----------------------------------------

def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"the Triton norm kernels take bf16, fp16 or fp32 input, got {x.dtype}; FP64 would be "
            "rounded by their FP32 accumulation: use layer_boundary._kernels.rmsnorm_ref for it"
        )
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"norm weight of shape {tuple(weight.shape)} does not match hidden size {x.shape[-1]}")
    if not (x.is_cuda and weight.is_cuda) and os.environ.get("TRITON_INTERPRET") != "1":
        # Stages selected for CUDA (BoundaryContext(device="cuda")) and fed host tensors: say so
        # here rather than in Triton's driver lookup (the interpreter runs host tensors).
        raise ValueError(
            f"the Triton norm kernels run on CUDA tensors, got input on {x.device} and norm weight on "
            f"{weight.device}; these stages were selected for CUDA (BoundaryContext(device='cuda')): "
            "move the model and its inputs there, or build it with device='cpu'"
        )


def _check_dest(dest: torch.Tensor, shape: torch.Size, what: str) -> None:
    # A kernel writes T * H elements through the given strides: a wrong shape would write past it.
    if dest.shape != shape:
        raise ValueError(f"{what} has shape {tuple(dest.shape)}; expected {tuple(shape)}")


def _rows(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` as [T, H] without a copy: outputs and the residual must be written where they are."""
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError as e:
        raise ValueError(
            f"{what} of shape {tuple(t.shape)} and strides {t.stride()} cannot be seen as rows "
            "without a copy; pass a 2-D [T, H] tensor"
        ) from e


def _run(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, out: torch.Tensor,
    residual_out: Optional[torch.Tensor], scale: Optional[torch.Tensor], eps: float, offset: float,
) -> None:
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])  # a read-only input may be copied
        out = _rows(out, "out")
        if residual is not None:
            residual = _rows(residual, "residual")
        if residual_out is not None:
            residual_out = _rows(residual_out, "residual_out")
        if scale is not None:
            scale = scale.view(-1, 1)
    # Dynamo sees is_compiling() as True: the compiled graph gets the operator; eager bypasses it.
    if torch.compiler.is_compiling():
        if residual is None:
            torch.ops.layer_boundary.rmsnorm(x, weight, eps, offset, out, scale)
        else:
            torch.ops.layer_boundary.fused_add_rmsnorm(x, residual, weight, eps, offset, out, residual_out, scale)
    else:
        launch(norm_rows_kernel, x, residual, weight, out, residual_out, scale, eps, offset)


def _check_residual(x: torch.Tensor, residual: torch.Tensor, residual_out: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    check_rows(x, residual)
    # The operator may not receive one tensor as two written arguments: in place is residual_out=None.
    if residual_out is residual or residual_out is None:
        return None
    _check_dest(residual_out, x.shape, "residual_out")
    return residual_out


# -- public callables: the references' signatures ---------------------------------------------------

def rmsnorm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, weight_offset: float = 0.0,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``out = x / sqrt(mean(x^2) + eps) * (weight + weight_offset)`` in FP32, rounded to x.dtype."""
    _check(x, weight)
    if out is None:
        out = x.new_empty(x.shape)
    else:
        _check_dest(out, x.shape, "out")
    _run(x, None, weight, out, None, None, eps, weight_offset)
    return out


def fused_add_rmsnorm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
    weight_offset: float = 0.0, out: Optional[torch.Tensor] = None,
    residual_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (FP32); store ``s`` in ``residual_out`` (default: ``residual``, in
    place); return ``(RMSNorm(s), residual')``."""
    _check(x, weight)
    residual_out = _check_residual(x, residual, residual_out)
    if out is None:
        out = x.new_empty(x.shape)
    else:
        _check_dest(out, x.shape, "out")
    _run(x, residual, weight, out, residual_out, None, eps, weight_offset)
    return out, residual if residual_out is None else residual_out


def _fp8_out(x: torch.Tensor, out: Optional[QuantizedRows]) -> QuantizedRows:
    if out is None:
        return QuantizedRows(x.new_empty(x.shape, dtype=_FP8), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32))
    if out.data.dtype != _FP8 or out.scale.dtype != torch.float32:
        raise TypeError(
            f"out= must be QuantizedRows(float8_e4m3fn data, float32 scale), got "
            f"({out.data.dtype}, {out.scale.dtype})"
        )
    _check_dest(out.data, x.shape, "out.data")
    _check_dest(out.scale, x.shape[:-1] + (1,), "out.scale")
    return out


def rmsnorm_fp8_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, weight_offset: float = 0.0,
    out: Optional[QuantizedRows] = None,
) -> QuantizedRows:
    """``rmsnorm_triton`` with the FP32 normalized rows quantized per token to FP8 e4m3."""
    _check(x, weight)
    q = _fp8_out(x, out)
    _run(x, None, weight, q.data, None, q.scale, eps, weight_offset)
    return q


def fused_add_rmsnorm_fp8_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
    weight_offset: float = 0.0, out: Optional[QuantizedRows] = None,
    residual_out: Optional[torch.Tensor] = None,
) -> tuple[QuantizedRows, torch.Tensor]:
    """``fused_add_rmsnorm_triton`` with a per-token FP8 e4m3 normalized output; the residual keeps
    its dtype and is updated in place unless ``residual_out`` is given."""
    _check(x, weight)
    residual_out = _check_residual(x, residual, residual_out)
    q = _fp8_out(x, out)
    _run(x, residual, weight, q.data, residual_out, q.scale, eps, weight_offset)
    return q, residual if residual_out is None else residual_out


TRITON_KERNELS = NormKernels("core-triton", rmsnorm_triton, fused_add_rmsnorm_triton, residual_in_place=True)
TRITON_FP8_KERNELS = NormKernels("core-triton fp8_e4m3", rmsnorm_fp8_triton, fused_add_rmsnorm_fp8_triton,
                                 residual_in_place=True)
