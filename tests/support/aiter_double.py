"""A CPU test double of the AMD AITER functions that layer-boundary-rocm-aiter calls.

It stands in for amd-aiter 0.1.7.post2.dev18 (the API the plugin targets), so the plugin's wiring
runs without AMD hardware. Each function checks what AITER's sources of that release require of
its arguments, and raises where AITER would raise (``RuntimeError``, as its ``TORCH_CHECK`` does)
or where a call would be silently wrong on the GPU (:class:`Violation`: a pointer AITER reads
with another dtype, an alias it does not document, a stride it never reads), then computes the
torch reference. Where that release computes something else than the reference, the double
computes what the release computes (noted at the function), so a refusal the plugin makes for it
is tested against the behaviour that motivates it.

Sources read (amd-aiter 0.1.7.post2.dev18 wheel): ``aiter/ops/rmsnorm.py``,
``aiter_meta/csrc/py_itfs_ck/rmsnorm_ck_kernels.cu``, CK's ``rmsnorm2d_fwd_pipeline_*_pass.hpp``
and ``example/ck_tile/10_rmsnorm2d/generate.py``, ``aiter/dist/device_communicators/
custom_all_reduce.py``, ``aiter_meta/csrc/kernels/custom_all_reduce.cu``, ``aiter/utility/dtypes.py``.

This is not AITER. It shows that the plugin calls what it means to call, with the arguments
AITER documents; it cannot show that AITER's kernels compute what their sources say.
"""

from __future__ import annotations

import sys
import types
from collections import Counter
from typing import Any, Optional

import torch
import torch.distributed as dist

from layer_boundary._kernels.reference import fused_add_rmsnorm_ref, rmsnorm_ref

__all__ = ["VERSION", "Violation", "AiterDouble", "install"]

VERSION = "0.1.7.post2.dev18"
_HALF = (torch.float16, torch.bfloat16)
_AR_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CUSTOM_AR = "aiter.dist.device_communicators.custom_all_reduce"


class Violation(AssertionError):
    """A call that AITER would not reject but would compute wrongly (or that the plugin promised
    never to make)."""


def _dt(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class AiterDouble:
    """The ``aiter`` module and its custom all-reduce module, with a record of the calls.

    ``fp8``: what ``aiter.dtypes.fp8`` says (gfx942: e4m3fnuz; gfx950: e4m3fn).
    ``custom_ar``: whether AITER's all-reduce library "loaded" (its module flag).
    ``omit``: names of ``aiter`` functions this installation lacks.
    """

    def __init__(self, *, fp8: torch.dtype = torch.float8_e4m3fn, custom_ar: bool = True,
                 omit: tuple[str, ...] = (), version: str = VERSION) -> None:
        self.calls: Counter[str] = Counter()
        self.workspaces: list[Any] = []
        self.module = types.ModuleType("aiter")
        self.module.__version__ = version  # the real package keeps it in aiter._version
        self.module.__path__ = []  # a package, as the real one is
        funcs = {
            "rmsnorm2d_fwd": self.rmsnorm2d_fwd,
            "rmsnorm2d_fwd_with_add": self.rmsnorm2d_fwd_with_add,
            "rmsnorm2d_fwd_with_dynamicquant": self._fp8_call("rmsnorm2d_fwd_with_dynamicquant"),
            "rmsnorm2d_fwd_with_add_dynamicquant": self._fp8_call("rmsnorm2d_fwd_with_add_dynamicquant"),
        }
        for name, fn in funcs.items():
            if name not in omit:
                setattr(self.module, name, fn)
        self.module.dtypes = types.SimpleNamespace(fp8=fp8)
        self.custom_ar_module = types.ModuleType(CUSTOM_AR)
        self.custom_ar_module.custom_ar = custom_ar
        double = self

        class CustomAllreduce(_CustomAllreduce):
            owner = double

        self.custom_ar_module.CustomAllreduce = CustomAllreduce

    def modules(self) -> dict[str, types.ModuleType]:
        dist_pkg = types.ModuleType("aiter.dist")
        dist_pkg.__path__ = []
        comms = types.ModuleType("aiter.dist.device_communicators")
        comms.__path__ = []
        return {"aiter": self.module, "aiter.dist": dist_pkg, "aiter.dist.device_communicators": comms,
                CUSTOM_AR: self.custom_ar_module}

    # -- aiter.ops.rmsnorm (CK rmsnorm2d, module_rmsnorm) ----------------------------------------

    def rmsnorm2d_fwd(self, input: torch.Tensor, weight: torch.Tensor, epsilon: float,
                      use_model_sensitive_rmsnorm: int = 0) -> torch.Tensor:
        """``out = rmsnorm(input) * weight``; CK allocates ``out`` with ``empty_like(input)``."""
        self.calls["rmsnorm2d_fwd"] += 1
        n = self._check_input("rmsnorm2d_fwd", input)
        self._check_weight("rmsnorm2d_fwd", weight, input, n)
        self._check_mode(use_model_sensitive_rmsnorm)
        return rmsnorm_ref(input, weight, float(epsilon)).contiguous()

    def rmsnorm2d_fwd_with_add(self, out: torch.Tensor, input: torch.Tensor, residual_in: torch.Tensor,
                               residual_out: torch.Tensor, weight: torch.Tensor, epsilon: float,
                               use_model_sensitive_rmsnorm: int = 0) -> None:
        """``s = input + residual_in`` (FP32); ``residual_out = s``; ``out = rmsnorm(s) * weight``.

        Above n = 8192 CK runs its two-pass pipeline, whose second pass re-reads the stored
        ``residual_out``: ``out`` then normalizes ``s`` rounded to the dtype. So does this double.
        """
        self.calls["rmsnorm2d_fwd_with_add"] += 1
        name = "rmsnorm2d_fwd_with_add"
        n = self._check_input(name, input)
        for label, t in (("out", out), ("residual_in", residual_in), ("residual_out", residual_out)):
            if t.dtype is not input.dtype:
                raise Violation(f"{name}: {label} is {_dt(t)}; CK reads it with the input precision {_dt(input)}")
            if t.shape != input.shape or t.stride(-1) != 1:
                raise Violation(f"{name}: {label} {tuple(t.shape)} stride {t.stride()} is not an [m, n] "
                                f"row-strided tensor like input {tuple(input.shape)}")
        for a, b, la, lb in ((residual_out, residual_in, "residual_out", "residual_in"),
                             (residual_out, input, "residual_out", "input"),
                             (out, input, "out", "input"), (out, residual_in, "out", "residual_in"),
                             (out, residual_out, "out", "residual_out")):
            if _overlap(a, b):
                raise Violation(f"{name}: {la} shares memory with {lb}; AITER documents no aliasing")
        self._check_weight(name, weight, input, n)
        self._check_mode(use_model_sensitive_rmsnorm)
        if n <= 8192:
            fused_add_rmsnorm_ref(input, residual_in, weight, float(epsilon), out=out, residual_out=residual_out)
            return
        s = input.float() + residual_in.float()
        residual_out.copy_(s.to(residual_out.dtype))
        out.copy_(rmsnorm_ref(residual_out, weight, float(epsilon)))

    def _fp8_call(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> None:
            self.calls[name] += 1
            raise Violation(f"{name}: the plugin refuses FP8 outputs on this AITER and must not call it")
        return call

    @staticmethod
    def _check_input(name: str, input: torch.Tensor) -> int:
        if input.dtype not in _HALF:
            raise RuntimeError(f"{name}: ck rmsnorm2d only support fp16 and bf16 data type (got {_dt(input)})")
        if input.stride(-1) != 1 or (input.dim() != 2 and not input.is_contiguous()):
            raise Violation(f"{name}: input stride {input.stride()}: CK reads rows of unit stride "
                            "at input.stride(0) apart")
        return input.shape[-1]

    @staticmethod
    def _check_weight(name: str, weight: torch.Tensor, input: torch.Tensor, n: int) -> None:
        if weight.dtype is not input.dtype:
            raise Violation(f"{name}: weight is {_dt(weight)}; CK reads gamma with the input precision {_dt(input)}")
        if weight.numel() != n or not weight.is_contiguous():
            raise Violation(f"{name}: weight {tuple(weight.shape)} is not a contiguous [{n}]")

    @staticmethod
    def _check_mode(mode: int) -> None:
        if mode != 0:
            raise Violation(f"use_model_sensitive_rmsnorm={mode} is the T5-like variant, not RMSNorm")


class _CustomAllreduce:
    """aiter.dist.device_communicators.custom_all_reduce.CustomAllreduce, on gloo and CPU tensors.

    Construction exchanges one "IPC handle" per rank over ``group`` exactly as AITER does
    (``broadcast_object_list`` from each rank, on the CPU), so a group other ranks do not join
    hangs here as it would there. ``all_reduce`` copies the input into the registered buffer,
    sums every rank's copy in FP32 in rank order and rounds once, as AITER's kernel does.
    """

    owner: AiterDouble
    _SUPPORTED_WORLD_SIZES = [2, 4, 6, 8]

    def __init__(self, group: Any, device: Any, max_size: int = 8192 * 1024 * 8) -> None:
        self.disabled = True
        self.group = group
        assert dist.get_backend(group) != dist.Backend.NCCL, "CustomAllreduce should be attached to a non-NCCL group."
        self.rank = dist.get_rank(group=group)
        self.world_size = dist.get_world_size(group=group)
        if not self.owner.custom_ar_module.custom_ar or self.world_size == 1 \
                or self.world_size not in self._SUPPORTED_WORLD_SIZES:
            return  # AITER logs a warning and stays disabled
        self.device = torch.device(device)
        self.max_size = max_size
        self.buffer = torch.zeros(max_size, dtype=torch.uint8, device=self.device)
        ranks = sorted(dist.get_process_group_ranks(group))
        shards: list[list[Any]] = [[None] for _ in ranks]
        shards[self.rank][0] = (f"ipc-handle-of-rank-{dist.get_rank()}".encode(), 0)
        for i, r in enumerate(ranks):
            dist.broadcast_object_list(shards[i], src=r, group=group, device="cpu")
        self.handles = [s[0] for s in shards]
        self.disabled = False
        self.owner.workspaces.append(self)

    def should_custom_ar(self, inp: torch.Tensor) -> bool:
        size = inp.numel() * inp.element_size()
        return not self.disabled and size % 16 == 0 and inp.is_contiguous() and size <= self.max_size

    def all_reduce(self, inp: torch.Tensor, *, out: Optional[torch.Tensor] = None,
                   open_fp8_quant: bool = False, registered: bool = False) -> torch.Tensor:
        self.owner.calls["CustomAllreduce.all_reduce"] += 1
        if self.disabled:
            raise Violation("all_reduce on a disabled CustomAllreduce (AITER would crash on a null handle)")
        if registered:
            raise Violation("registered=True reads inp at an address the peers never registered")
        if open_fp8_quant:
            raise Violation("open_fp8_quant sends fp16 through FP8: not the sum the boundary owes")
        if inp.dtype not in _AR_DTYPES:
            raise RuntimeError("custom allreduce only supports float32, float16 and bfloat16")
        if out is None:
            out = torch.empty_like(inp)
        if out.dtype is not inp.dtype or out.numel() != inp.numel():
            raise RuntimeError(f"Check failed: out {_dt(out)}[{out.numel()}] vs inp {_dt(inp)}[{inp.numel()}]")
        size = inp.numel() * inp.element_size()
        if size > self.buffer.numel():
            raise RuntimeError("registered buffer is too small to contain the input")
        if size % 16:
            raise RuntimeError(f"custom allreduce currently requires input length to be multiple of "
                               f"{16 // inp.element_size()}")
        if not inp.is_contiguous():
            # The C++ side copies numel * element_size bytes from inp.data_ptr(): a strided
            # input would send the wrong rows.
            raise Violation(f"all_reduce: inp stride {inp.stride()} is not one flat span")
        staged = self.buffer[:size]
        staged.copy_(inp.reshape(-1).view(torch.uint8))
        parts = [torch.empty_like(staged) for _ in range(self.world_size)]
        dist.all_gather(parts, staged, group=self.group)
        acc = torch.zeros(inp.numel(), dtype=torch.float32)
        for p in parts:  # rank order, FP32, one rounding at the end
            acc += p.view(inp.dtype).float()
        out.copy_(acc.to(inp.dtype).view(out.shape))
        return out

    def close(self) -> None:
        self.disabled = True


def install(double: Optional[AiterDouble] = None, monkeypatch: Any = None) -> AiterDouble:
    """Put the double's modules in ``sys.modules`` (through ``monkeypatch`` when given, so a test
    restores them; directly in a spawned rank, which ends with its process)."""
    double = double or AiterDouble()
    for name, mod in double.modules().items():
        if monkeypatch is not None:
            monkeypatch.setitem(sys.modules, name, mod)
        else:
            sys.modules[name] = mod
    return double
