"""The CuTe DSL add + RMSNorm kernel (Hopper, sm_90a). Imports ``cutlass``: load it only through
``layer_boundary_cutedsl.norm``, which does so at construction.

    fused:  s = x + r (FP32);  r <- s rounded;  y = s / sqrt(sum(s^2) / H + eps) * (w + offset)
    plain:  s = x (FP32);                        y = the same
    finalize (``topk`` > 0, fused): x = round(sum_j tw[j] * e[j] (+ sh)) in FP32, then as fused:
            a MoE finalize handoff on one rank (e: [T, topk, H] expert rows, tw: [T, topk] router
            weights, sh: [T, H] shared-expert rows when ``shared``)

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

    def __init__(self, hidden: int, dtype: Any, weight_offset: float, fused: bool, topk: int = 0,
                 shared: bool = False) -> None:
        shape = launch_shape(hidden)
        assert shape is not None, f"no launch shape for H={hidden}"
        assert topk == 0 or fused, "a finalize is always fused with the residual add"
        self.hidden = hidden
        self.dtype = dtype
        self.offset = float(weight_offset)
        self.fused = fused
        self.topk = topk
        self.shared = shared
        self.threads, self.per_thread = shape
        self.warps = self.threads // 32

    @cute.jit
    def __call__(
        self,
        x_ptr: cute.Pointer,
        r_ptr: cute.Pointer,
        w_ptr: cute.Pointer,
        y_ptr: cute.Pointer,
        tw_ptr: cute.Pointer,
        sh_ptr: cute.Pointer,
        rows: Int32,
        x_stride: Int32,
        k_stride: Int32,
        r_stride: Int32,
        y_stride: Int32,
        tw_stride: Int32,
        sh_stride: Int32,
        eps: Float32,
        stream: cuda.CUstream,
    ):
        h = self.hidden
        k = max(self.topk, 1)
        # Row strides are multiples of 8 elements (the wrapper checks): said here so every row
        # start keeps the 16-byte alignment the 128-bit accesses need. Without a finalize, x is
        # [T, 1, H] (k_stride unused) and tw, sh are never read.
        mX = cute.make_tensor(x_ptr, cute.make_layout(
            (rows, k, h), stride=(cute.assume(x_stride, divby=VEC), cute.assume(k_stride, divby=VEC), 1)))
        mR = cute.make_tensor(r_ptr, cute.make_layout((rows, h), stride=(cute.assume(r_stride, divby=VEC), 1)))
        mY = cute.make_tensor(y_ptr, cute.make_layout((rows, h), stride=(cute.assume(y_stride, divby=VEC), 1)))
        mW = cute.make_tensor(w_ptr, cute.make_layout((h,), stride=(1,)))
        mTw = cute.make_tensor(tw_ptr, cute.make_layout((rows, k), stride=(tw_stride, 1)))
        mSh = cute.make_tensor(sh_ptr, cute.make_layout((rows, h), stride=(cute.assume(sh_stride, divby=VEC), 1)))
        self.kernel(mX, mR, mW, mY, mTw, mSh, eps).launch(
            grid=[rows, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mR: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mTw: cute.Tensor,
               mSh: cute.Tensor, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        per = self.per_thread
        dtype = self.dtype

        smem = cutlass.memory.SmemAllocator()
        partial = smem.allocate_tensor(Float32, cute.make_layout((self.warps,)), byte_alignment=16)

        vec_copy = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
        # (VEC, vectors) views of this row: column v is one 16-byte access.
        gX = cute.zipped_divide(mX[row, 0, None], (VEC,))
        gR = cute.zipped_divide(mR[row, None], (VEC,))
        gY = cute.zipped_divide(mY[row, None], (VEC,))
        gW = cute.zipped_divide(mW, (VEC,))

        s_acc = cute.make_rmem_tensor((VEC, per), Float32)
        x_frag = cute.make_rmem_tensor((VEC,), dtype)
        r_frag = cute.make_rmem_tensor((VEC,), dtype)
        sq = Float32(0.0)
        # A finalize's router weights: read once per row, kept in registers.
        tw = []
        for j in cutlass.range_constexpr(self.topk):
            tw.append(mTw[row, j].to(Float32))
        for i in cutlass.range_constexpr(per):
            v = tidx + i * self.threads
            if cutlass.const_expr(self.topk > 0):
                # This row's finalized contribution in FP32, rounded once (as an unfused finalize
                # output is), so the add below sees what the unfused path adds.
                comb = cute.make_rmem_tensor((VEC,), Float32)
                comb.fill(0.0)
                for j in cutlass.range_constexpr(self.topk):
                    cute.copy(vec_copy, cute.zipped_divide(mX[row, j, None], (VEC,))[None, v], x_frag)
                    comb.store(comb.load() + x_frag.load().to(Float32) * tw[j])
                if cutlass.const_expr(self.shared):
                    cute.copy(vec_copy, cute.zipped_divide(mSh[row, None], (VEC,))[None, v], x_frag)
                    comb.store(comb.load() + x_frag.load().to(Float32))
                x_frag.store(comb.load().to(dtype))
            else:
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
                        topk: int = 0, shared: bool = False, ptx_dir: Optional[str] = None) -> Any:
    """Compile one variant ahead of time, from placeholder pointers and a placeholder stream: no
    GPU is touched, so this runs on a CPU machine too (with ``CUTE_DSL_ARCH=sm_90a``). The result
    is called as ``f(x_ptr, r_ptr, w_ptr, y_ptr, tw_ptr, sh_ptr, rows, x_stride, k_stride, r_stride,
    y_stride, tw_stride, sh_stride, eps, stream)`` (``topk`` 0: tw, sh and k_stride unused).
    With ``ptx_dir`` the PTX is also kept (``f.__ptx__``, and a file there).
    """
    el = CUTLASS_DTYPES[dtype]
    # assumed_align is part of the compiled signature: the caller must pass 16-byte aligned pointers.
    ptrs = [make_ptr(el, 16, cute.AddressSpace.gmem, assumed_align=16) for _ in range(4)]
    # Router weights are read as scalars: no vector alignment is assumed for them.
    tw = make_ptr(el, 16, cute.AddressSpace.gmem, assumed_align=el.width // 8)
    sh = make_ptr(el, 16, cute.AddressSpace.gmem, assumed_align=16)
    # The dump directory is an option, not CUTE_DSL_DUMP_DIR: that one is read once, at import.
    options = f"--keep-ptx --dump-dir={ptx_dir}" if ptx_dir else None
    k = max(topk, 1)
    return cute.compile(AddRMSNorm(hidden, el, weight_offset, fused, topk, shared), *ptrs, tw, sh, Int32(1),
                        Int32(k * hidden), Int32(hidden), Int32(hidden), Int32(hidden), Int32(k), Int32(hidden),
                        Float32(1e-6), make_fake_stream(), options=options)
