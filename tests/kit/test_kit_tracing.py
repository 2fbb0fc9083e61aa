"""The kit's tracing check (``assert_traces``, ``NormKernelConformance.
test_kernels_trace_under_torch_compile``) over planted kernels: one Dynamo cannot trace (a vendor
launch reads data pointers), one that computes something else when compiled, and the first one
registered with ``kernel_op``, which passes. The core's reference provider runs the same check in
``test_conformance_core.TestReferenceKernels``."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from layer_boundary.plugin_api import NormKernels, fused_add_rmsnorm_ref, kernel_op, rmsnorm_ref
from layer_boundary.testing import NormKernelConformance, assert_traces


def _launch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float,
                 out: torch.Tensor) -> None:
    # What a vendor launch does first: hand raw pointers to its kernel. Dynamo cannot trace it.
    assert x.data_ptr() % 2 == 0 and out.data_ptr() % 2 == 0
    rmsnorm_ref(x, weight, eps, weight_offset=weight_offset, out=out)


def _launch_add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     weight_offset: float, out: torch.Tensor) -> None:
    assert residual.data_ptr() % 2 == 0
    fused_add_rmsnorm_ref(x, residual, weight, eps, weight_offset=weight_offset, out=out, residual_out=residual)


def _registered_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float,
                     out: torch.Tensor) -> None:
    _launch_norm(x, weight, eps, weight_offset, out)


def _registered_add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                         weight_offset: float, out: torch.Tensor) -> None:
    _launch_add_norm(x, residual, weight, eps, weight_offset, out)


kernel_op("lb_kit_test::norm", _registered_norm, mutates=("out",))
kernel_op("lb_kit_test::add_norm", _registered_add_norm, mutates=("residual", "out"))


class _Vendor:
    """A CPU provider over destination-passing launches, in place like most GPU kernels."""

    name = "pointer-vendor"

    def __init__(self, norm=_launch_norm, add_norm=_launch_add_norm) -> None:
        self._norm, self._add_norm = norm, add_norm

    def refuse(self, request) -> Optional[str]:
        ok = request.device_type == "cpu" and request.quant is None and request.dtype == torch.bfloat16
        return None if ok else "bf16 on cpu only"

    def kernels(self, request) -> NormKernels:
        def rmsnorm(x, w, eps, *, weight_offset=0.0, out=None):
            out = torch.empty_like(x) if out is None else out
            self._norm(x, w, eps, float(weight_offset), out)
            return out

        def fused(x, r, w, eps, *, weight_offset=0.0, out=None, residual_out=None):
            out = torch.empty_like(x) if out is None else out
            self._add_norm(x, r, w, eps, float(weight_offset), out)
            return out, r

        return NormKernels(self.name, rmsnorm, fused, residual_in_place=True)


class _OtherWhenCompiled(_Vendor):
    """Traces, but its compiled form skips the weight: a kernel with a compile-only code path."""

    name = "other-when-compiled"

    def kernels(self, request) -> NormKernels:
        table = super().kernels(request)

        def rmsnorm(x, w, eps, *, weight_offset=0.0, out=None):
            if torch.compiler.is_compiling():
                w = torch.ones_like(w)
            return rmsnorm_ref(x, w, eps, weight_offset=weight_offset, out=out)

        return NormKernels(self.name, rmsnorm, table.fused_add_rmsnorm, residual_in_place=True)


def _kit() -> NormKernelConformance:
    kit = NormKernelConformance()
    kit.hidden_sizes = (64,)
    kit.offsets = (1.0,)
    kit.quants = ()
    return kit


def test_a_kernel_that_does_not_trace_fails_and_is_told_to_use_kernel_op():
    with pytest.raises(AssertionError, match=r"pointer-vendor kernels .* does not trace under "
                                             r"torch.compile\(fullgraph=True\) .*plugin_api.kernel_op"):
        _kit().test_kernels_trace_under_torch_compile(_Vendor(), "cpu")


def test_the_same_launches_registered_with_kernel_op_pass():
    _kit().test_kernels_trace_under_torch_compile(_Vendor(_registered_norm, _registered_add_norm), "cpu")


def test_a_kernel_whose_compiled_numbers_differ_fails():
    with pytest.raises(AssertionError, match=r"output 0 compiled differs from eager"):
        _kit().test_kernels_trace_under_torch_compile(_OtherWhenCompiled(_registered_norm, _registered_add_norm),
                                                      "cpu")


def test_assert_traces_finds_a_write_the_compiled_graph_drops():
    # A mutation hidden from the compiler: the graph is traced with it, then the write is skipped
    # where Dynamo's trace (not the eager call) decides.
    def step(x, r):
        if not torch.compiler.is_compiling():
            r.add_(x)
        return x * 2

    x = torch.randn(3, 8)
    with pytest.raises(AssertionError, match=r"tensor argument 1 holds other values after the compiled call"):
        assert_traces(step, x, torch.zeros(3, 8), what="dropping-step")
    assert_traces(lambda x, r: r.add_(x), x, torch.zeros(3, 8), what="in-place add")
