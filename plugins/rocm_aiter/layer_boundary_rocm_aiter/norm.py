"""Norm-read kernels from AITER's CK ``rmsnorm2d`` family, with the core reference's signatures.

RMSNorm:            y = x / sqrt(mean(x^2) + eps) * w                      (aiter.rmsnorm2d_fwd)
Fused add+RMSNorm:  s = x + r (FP32);  r' = s.to(dtype);  y = RMSNorm(s)  (aiter.rmsnorm2d_fwd_with_add)

Shapes: x, r: [T, H] (any row stride, unit last stride; others are copied); w: [H], of the input
dtype. The residual is written out of place (``residual_in_place = False``): AITER documents no
aliasing of ``residual_out`` with ``residual_in``, and its own callers pass distinct buffers.

What AITER 0.1.7.post2.dev18 serves, and why the rest is refused (see ``refuse``):

* fp16 and bf16 only (its ``TORCH_CHECK``); FP32 and FP64 take the core's kernels.
* H up to 8192. Above it CK dispatches the two-pass pipeline, whose second pass re-reads the
  residual it stored, so it normalizes ``s`` rounded to the activation dtype instead of the FP32
  ``s`` (``rmsnorm2d_fwd_pipeline_two_pass.hpp``): the core's read keeps the FP32 sum.
* No Gemma form (weight + 1): ``rmsnorm2d_fwd`` has no weight offset in that release.
* FP8 outputs (``quant="fp8_e4m3"``): AITER's dynamic-quant variants are per-token, but on gfx942
  (MI300) their FP8 type is ``float8_e4m3fnuz`` (max 240), and where it is ``float8_e4m3fn``
  (gfx950) the scale has no floor: an all-zero row gets scale 0 and NaN codes, where the core's
  format floors the scale and writes zeros.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from layer_boundary.plugin_api import (
    check_rows,
    fused_add_rmsnorm_ref,
    kernel_op,
    NormKernels,
    NormRequest,
    rmsnorm_ref,
)

from layer_boundary.plugin_api import FP8_SCALE_FLOOR, QUANT_FORMATS

from .api import AiterApi

__all__ = ["AiterNormKernels", "MAX_ONE_PASS_HIDDEN"]

# CK's rmsnorm2d instance table (example/ck_tile/10_rmsnorm2d/generate.py) ends its one-pass
# buckets at n = 8192; wider rows go to the two-pass "big" instances.
MAX_ONE_PASS_HIDDEN = 8192
_DTYPES = (torch.bfloat16, torch.float16)


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# The AITER APIs kernel tables call, by index: the operators below take no Python object. One per
# provider; kept for the process's life, as AITER's loaded modules are.
_APIS: list[AiterApi] = []


def api_index(api: AiterApi) -> int:
    """``api``'s index for the operators here (registered on first use)."""
    for i, known in enumerate(_APIS):
        if known is api:
            return i
    _APIS.append(api)
    return len(_APIS) - 1


def _rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, api: int) -> torch.Tensor:
    """``rmsnorm2d_fwd`` of [T, H] rows with a unit last stride: a new [T, H] tensor."""
    rms = _APIS[api].rmsnorm
    assert rms is not None  # refuse() found it before the table was made
    return rms(x, weight, eps)


def _add_rmsnorm_into(out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, residual_out: torch.Tensor,
                      weight: torch.Tensor, eps: float, api: int) -> None:
    """``rmsnorm2d_fwd_with_add``: ``residual_out = x + residual``, ``out`` its norm (no aliasing)."""
    add_rms = _APIS[api].add_rmsnorm
    assert add_rms is not None
    add_rms(out, x, residual, residual_out, weight, eps)


# Opaque operators under torch.compile; rmsnorm2d_fwd allocates its output, so its fake does.
kernel_op("rmsnorm", _rmsnorm, fake=lambda x, weight, eps, api: torch.empty_like(x, memory_format=torch.contiguous_format))
kernel_op("add_rmsnorm", _add_rmsnorm_into, mutates=("out", "residual_out"))


class AiterNormKernels:
    """``NormKernelProvider`` over AITER's CK RMSNorm kernels.

    ``device_types``: where the bound functions run (``cuda``: ROCm torch names its GPUs so).
    Tests pass ``("cpu",)`` with a CPU test double of AITER.
    """

    name = "rocm-aiter"
    # FP32 accumulation in a block-tree order and rsqrtf: a few FP32 ulps before the output is
    # rounded, so one ulp of a 16-bit output (the core defaults' reasoning).
    tolerance = {torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}

    def __init__(self, api: AiterApi, device_types: tuple[str, ...] = ("cuda",)) -> None:
        self.api = api
        self.device_types = tuple(device_types)
        self._checked: set[tuple[str, torch.dtype, int]] = set()

    def refuse(self, request: NormRequest) -> Optional[str]:
        if request.quant is not None and request.quant not in QUANT_FORMATS:
            return f"unknown quantized output {request.quant!r} (known: {', '.join(QUANT_FORMATS)})"
        if request.device_type not in self.device_types:
            return (f"runs on {'/'.join(self.device_types)} devices only (torch calls ROCm GPUs 'cuda'), "
                    f"not {request.device_type}")
        if request.dtype not in _DTYPES:
            return f"AITER's CK rmsnorm2d takes fp16 and bf16 only, not {_dt(request.dtype)}"
        why = self.api.missing_norm()
        if why:
            return why
        if request.weight_offset != 0.0:
            return (f"Gemma RMSNorm (weight + {request.weight_offset:g}) is not offered: rmsnorm2d in "
                    f"{self.api.label} has no weight offset")
        if request.hidden_size > MAX_ONE_PASS_HIDDEN:
            return (f"H={request.hidden_size} is above {MAX_ONE_PASS_HIDDEN}, where CK's two-pass add + "
                    f"RMSNorm normalizes the residual rounded to {_dt(request.dtype)}, not the FP32 sum")
        if request.quant is not None:
            return self._fp8_refusal()
        return None

    def _fp8_refusal(self) -> str:
        why = self.api.missing_fp8()
        if why:
            return why
        fp8 = self.api.fp8_dtype
        if fp8 is torch.float8_e4m3fnuz:
            return ("AITER's FP8 on this GPU (gfx942, MI300) is float8_e4m3fnuz (max 240, another "
                    "exponent bias); fp8_e4m3 rows are float8_e4m3fn")
        if fp8 is not torch.float8_e4m3fn:
            return f"{self.api.label} has no FP8 type for this GPU (aiter.dtypes.fp8 is {fp8})"
        return (f"the dynamic-quant RMSNorm of {self.api.label} does not floor its per-token scale: an "
                f"all-zero row gets scale 0 and NaN codes, where fp8_e4m3 rows floor the scale at "
                f"{FP8_SCALE_FLOOR:g} with zero codes")

    def kernels(self, request: NormRequest) -> NormKernels:
        why = self.refuse(request)
        if why is not None:
            raise ValueError(f"{self.name} does not serve {request.describe()}: {why}")
        assert self.api.rmsnorm is not None and self.api.add_rmsnorm is not None  # refuse() found them
        api = api_index(self.api)

        def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, weight_offset: float = 0.0,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
            if weight_offset or x.dtype is not weight.dtype:
                # Not what this table was selected for (a caller mixing dtypes): the reference
                # gives the defined numbers; the CK kernel would misread the weight's bytes.
                return rmsnorm_ref(x, weight, eps, weight_offset=weight_offset, out=out)
            y = _rmsnorm(_rows(x), weight, eps, api)
            if y.shape != x.shape:
                y = y.view(x.shape)
            if out is None:
                return y
            out.copy_(y)
            return out

        def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                              weight_offset: float = 0.0, out: Optional[torch.Tensor] = None,
                              residual_out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
            check_rows(x, residual)
            if weight_offset or not (x.dtype is residual.dtype is weight.dtype):
                return fused_add_rmsnorm_ref(x, residual, weight, eps, weight_offset=weight_offset,
                                             out=out, residual_out=residual_out)
            shape = x.shape
            x2, r2 = _rows(x), _rows(residual)
            y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
            r_new = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
            _add_rmsnorm_into(y, x2, r2, r_new, weight, eps, api)
            y, r_new = y.view(shape), r_new.view(shape)
            # Destinations are filled by copy: AITER's buffers must not alias its inputs.
            if residual_out is not None:
                residual_out.copy_(r_new)
                r_new = residual_out
            if out is not None:
                out.copy_(y)
                y = out
            return y, r_new

        key = (request.device_type, request.dtype, request.hidden_size)
        if key not in self._checked:
            self._self_check(request, rmsnorm, fused_add_rmsnorm)
            self._checked.add(key)
        suffix = "" if request.quant is None else f" {request.quant}"
        return NormKernels(f"{self.name}{suffix}", rmsnorm, fused_add_rmsnorm, residual_in_place=False)

    def _self_check(self, request: NormRequest, rmsnorm: Any, fused_add_rmsnorm: Any) -> None:
        """Run both kernels once at construction, before any forward or graph capture.

        Loads (on first use, JIT-builds) AITER's norm module outside the forward, and compares
        with the reference: CK returns without writing anything when no instance matches the
        shape, and this is the only place that would notice before a model used the output.
        """
        device = torch.device(request.device_type, torch.cuda.current_device()) \
            if request.device_type == "cuda" else torch.device(request.device_type)
        g = torch.Generator().manual_seed(0)
        h = request.hidden_size
        x, r = (torch.randn(2, h, generator=g).to(request.dtype).to(device) for _ in range(2))
        w = (torch.rand(h, generator=g) + 0.5).to(request.dtype).to(device)
        atol, rtol = self.tolerance[request.dtype]
        got_y, got_r = fused_add_rmsnorm(x, r, w, 1e-6)
        want_y, want_r = fused_add_rmsnorm_ref(x, r, w, 1e-6)
        got_n, want_n = rmsnorm(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6)
        ok = (torch.equal(got_r, want_r) and torch.allclose(got_y, want_y, atol=atol, rtol=rtol)
              and torch.allclose(got_n, want_n, atol=atol, rtol=rtol))
        if not ok:
            raise RuntimeError(
                f"{self.api.label}: rmsnorm2d_fwd / rmsnorm2d_fwd_with_add disagree with the torch "
                f"reference for {request.describe()} at construction; this plugin was written against "
                "the API of amd-aiter 0.1.7.post2.dev18. Disable it with LAYER_BOUNDARY_DISABLE=rocm_aiter"
            )

    def __repr__(self) -> str:
        return f"AiterNormKernels({self.api.label}, devices={self.device_types})"


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D [rows, H] view with unit last stride (CK reads only the row stride)."""
    if t.dim() != 2:
        t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()
