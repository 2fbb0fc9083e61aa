"""The CuTe DSL add + RMSNorm kernel (Hopper, sm_90a). Imports ``cutlass``: load it only through
``layer_boundary_cutedsl.norm``, which does so at construction.

    fused:  s = x + r (FP32);  r <- s rounded;  y = s / sqrt(sum(s^2) / H + eps) * (w + offset)
    plain:  s = x (FP32);                        y = the same

    x, r, y: [T, H] rows of bf16 or fp16 (last dimension contiguous, row strides in elements a
    multiple of 8, every base 16-byte aligned); w: [H] of the same dtype.

Layout: one CTA per row. A row is cut into 128-bit vectors (8 elements); thread ``t`` owns vectors
``t, t + threads, ...`` (``per_thread`` of them), so each warp access is 32 consecutive 16-byte
vectors, fully coalesced. The FP32 sum stays in registers between the two passes (at most
``MAX_PER_THREAD`` vectors, 128 FP32 registers), so the row is read from global memory once.
The sum of squares is reduced by butterfly shuffles in each warp, then across the (at most 8)
warps through shared memory.
"""

from __future__ import annotations

from typing import Any, Optional

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32
from cutlass.cute.runtime import make_fake_stream, make_ptr

from .shape import VEC, launch_shape

__all__ = ["AddRMSNorm", "CUTLASS_DTYPES", "compile_add_rmsnorm"]

CUTLASS_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


class AddRMSNorm:
    """One compiled variant: hidden size, dtype, weight offset and fused (with the residual add)
    or plain are compile-time constants; rows, row strides and eps are runtime arguments."""

    def __init__(self, hidden: int, dtype: Any, weight_offset: float, fused: bool) -> None:
        shape = launch_shape(hidden)
        assert shape is not None, f"no launch shape for H={hidden}"
        self.hidden = hidden
        self.dtype = dtype
        self.offset = float(weight_offset)
        self.fused = fused
        self.threads, self.per_thread = shape
        self.warps = self.threads // 32

    @cute.jit
    def __call__(
        self,
        x_ptr: cute.Pointer,
        r_ptr: cute.Pointer,
        w_ptr: cute.Pointer,
        y_ptr: cute.Pointer,
        rows: Int32,
        x_stride: Int32,
        r_stride: Int32,
        y_stride: Int32,
        eps: Float32,
        stream: cuda.CUstream,
    ):
        h = self.hidden
        # Row strides are multiples of 8 elements (the wrapper checks): said here so every row
        # start keeps the 16-byte alignment the 128-bit accesses need.
        mX = cute.make_tensor(x_ptr, cute.make_layout((rows, h), stride=(cute.assume(x_stride, divby=VEC), 1)))
        mR = cute.make_tensor(r_ptr, cute.make_layout((rows, h), stride=(cute.assume(r_stride, divby=VEC), 1)))
        mY = cute.make_tensor(y_ptr, cute.make_layout((rows, h), stride=(cute.assume(y_stride, divby=VEC), 1)))
        mW = cute.make_tensor(w_ptr, cute.make_layout((h,), stride=(1,)))
        self.kernel(mX, mR, mW, mY, eps).launch(
            grid=[rows, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mR: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        per = self.per_thread
        dtype = self.dtype

        smem = cutlass.memory.SmemAllocator()
        partial = smem.allocate_tensor(Float32, cute.make_layout((self.warps,)), byte_alignment=16)

        vec_copy = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
        # (VEC, vectors) views of this row: column v is one 16-byte access.
        gX = cute.zipped_divide(mX[row, None], (VEC,))
        gR = cute.zipped_divide(mR[row, None], (VEC,))
        gY = cute.zipped_divide(mY[row, None], (VEC,))
        gW = cute.zipped_divide(mW, (VEC,))

        s_acc = cute.make_rmem_tensor((VEC, per), Float32)
        x_frag = cute.make_rmem_tensor((VEC,), dtype)
        r_frag = cute.make_rmem_tensor((VEC,), dtype)
        sq = Float32(0.0)
        for i in cutlass.range_constexpr(per):
            v = tidx + i * self.threads
            cute.copy(vec_copy, gX[None, v], x_frag)
            s = x_frag.load().to(Float32)
            if cutlass.const_expr(self.fused):
                cute.copy(vec_copy, gR[None, v], r_frag)
                s = s + r_frag.load().to(Float32)
                # r' is the FP32 sum rounded once, stored before the norm needs it again.
                r_frag.store(s.to(dtype))
                cute.copy(vec_copy, r_frag, gR[None, v])
            s_acc[None, i].store(s)
            sq = sq + (s * s).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)

        sq = cute.arch.warp_reduction_sum(sq)
        lane = tidx % 32
        warp = tidx // 32
        if lane == 0:
            partial[warp] = sq
        cute.arch.barrier()
        total = Float32(0.0)
        for k in cutlass.range_constexpr(self.warps):
            total = total + partial[k]
        # mean as the reference computes it: the FP32 sum divided by H, then rsqrt(var + eps).
        rstd = cute.math.rsqrt(total / Float32(self.hidden) + eps)

        w_frag = cute.make_rmem_tensor((VEC,), dtype)
        y_frag = cute.make_rmem_tensor((VEC,), dtype)
        for i in cutlass.range_constexpr(per):
            v = tidx + i * self.threads
            cute.copy(vec_copy, gW[None, v], w_frag)
            w = w_frag.load().to(Float32)
            if cutlass.const_expr(self.offset != 0.0):
                w = w + Float32(self.offset)
            # (s * rstd) * w in FP32, rounded once: the reference's order.
            y_frag.store(((s_acc[None, i].load() * rstd) * w).to(dtype))
            cute.copy(vec_copy, y_frag, gY[None, v])


def compile_add_rmsnorm(hidden: int, dtype: str, weight_offset: float, fused: bool, *,
                        ptx_dir: Optional[str] = None) -> Any:
    """Compile one variant ahead of time, from placeholder pointers and a placeholder stream: no
    GPU is touched, so this runs on a CPU machine too (with ``CUTE_DSL_ARCH=sm_90a``). The result
    is called as ``f(x_ptr, r_ptr, w_ptr, y_ptr, rows, x_stride, r_stride, y_stride, eps, stream)``.
    With ``ptx_dir`` the PTX is also kept (``f.__ptx__``, and a file there).
    """
    el = CUTLASS_DTYPES[dtype]
    # assumed_align is part of the compiled signature: the caller must pass 16-byte aligned pointers.
    ptrs = [make_ptr(el, 16, cute.AddressSpace.gmem, assumed_align=16) for _ in range(4)]
    # The dump directory is an option, not CUTE_DSL_DUMP_DIR: that one is read once, at import.
    options = f"--keep-ptx --dump-dir={ptx_dir}" if ptx_dir else None
    return cute.compile(AddRMSNorm(hidden, el, weight_offset, fused), *ptrs, Int32(1), Int32(hidden),
                        Int32(hidden), Int32(hidden), Float32(1e-6), make_fake_stream(), options=options)
