"""``kernel_op`` (the vendor SDK's helper) and the reference kernels as registered operators.

A kernel the helper registers runs as itself in eager and as its operator under
``torch.compile(fullgraph=True)``; the kernels here read ``data_ptr()``, which Dynamo cannot
trace, so a test that compiles them passes only through the operator.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from layer_boundary.plugin_api import (
    QuantizedRows,
    fused_add_rmsnorm_fp8_ref,
    fused_add_rmsnorm_ref,
    kernel_op,
    registered_op,
    rmsnorm_fp8_ref,
    rmsnorm_ref,
)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (weight.float() + offset)).to(x.dtype)


def launch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, weight_offset: float = 0.0,
                out: Optional[torch.Tensor] = None) -> None:
    assert out is not None and x.data_ptr() != 0  # a vendor launch reads pointers: Dynamo cannot
    out.copy_(_norm(x, weight, eps, weight_offset))


def launch_add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                    weight_offset: float = 0.0, out: Optional[torch.Tensor] = None) -> None:
    assert out is not None and residual.data_ptr() != 0
    residual.add_(x)
    out.copy_(_norm(residual, weight, eps, weight_offset))


def fresh_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, weight_offset: float = 0.0) -> torch.Tensor:
    # Returns a new tensor and is written in torch operations: its fake is itself on fake tensors.
    return _norm(x, weight, eps, weight_offset)


def untraced_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, weight_offset: float = 0.0,
                  out: Optional[torch.Tensor] = None) -> None:
    assert out is not None and x.data_ptr() != 0
    out.copy_(_norm(x, weight, eps, weight_offset))


kernel_op("lb_test::norm", launch_norm, mutates=("out",))
kernel_op("lb_test::add_norm", launch_add_norm, mutates=("residual", "out"))
kernel_op("lb_test::fresh_norm", fresh_norm)


def _rows(tokens: int = 5, hidden: int = 37, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    r = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    return x, r, w


def test_the_kernel_is_returned_itself_so_eager_calls_cost_nothing_more():
    def k(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x)

    assert kernel_op("lb_test::identity", k, mutates=("out",)) is k
    assert registered_op(k) is not None and registered_op(rmsnorm_ref) is None


def test_keyword_arguments_and_destinations_cross_the_operator_under_fullgraph():
    def step(x, r, w):
        y = torch.empty_like(x)
        launch_norm(x, w, 1e-6, weight_offset=1.0, out=y)
        z = torch.empty_like(x)
        launch_add_norm(y, r, w, 1e-5, out=z)  # weight_offset left at its default
        return y, z, fresh_norm(z, w, 1e-6, weight_offset=0.5)

    x, r, w = _rows()
    r_eager, r_compiled = r.clone(), r.clone()
    want = step(x, r_eager, w)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(x, r_compiled, w)
    for g, e in zip(got, want):
        assert torch.equal(g, e)
    assert torch.equal(r_compiled, r_eager), "the in-place residual update was lost under compile"


def test_without_the_helper_the_same_kernel_breaks_the_graph():
    x, _, w = _rows()

    def step(x, w):
        y = torch.empty_like(x)
        untraced_norm(x, w, 1e-6, out=y)
        return y

    with pytest.raises(Exception, match="data_ptr|Unsupported"):
        torch.compile(step, fullgraph=True, backend="aot_eager")(x, w)


def test_registered_operators_pass_opcheck():
    x, r, w = _rows()
    torch.library.opcheck(registered_op(launch_norm), (x, w, 1e-6, 1.0, torch.empty_like(x)))
    torch.library.opcheck(registered_op(launch_add_norm), (x, r.clone(), w, 1e-6, 0.0, torch.empty_like(x)))
    torch.library.opcheck(registered_op(fresh_norm), (x, w, 1e-6, 0.0))


def test_an_undeclared_write_is_found_by_opcheck():
    def writes_out(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x)

    kernel_op("lb_test::undeclared", writes_out)  # forgot mutates=("out",)
    x, _, _ = _rows()
    with pytest.raises(Exception, match="mutat|modif"):
        torch.library.opcheck(registered_op(writes_out), (x, torch.empty_like(x)))


def test_the_namespace_is_the_kernels_distribution():
    def k(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    k.__module__ = "layer_boundary_lbtestvendor.kernels"
    kernel_op("plus_one", k)
    assert torch.ops.layer_boundary_lbtestvendor.plus_one(torch.zeros(2)).tolist() == [1.0, 1.0]


def test_a_kernel_that_cannot_run_on_fake_tensors_says_to_pass_fake():
    def gpu_only(x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError("the vendor kernel runs on CUDA only")
        return x.clone()

    kernel_op("lb_test::gpu_only", gpu_only)
    with pytest.raises(Exception, match=r"pass kernel_op\(\.\.\., fake=\.\.\.\)"):
        torch.compile(lambda x: gpu_only(x) + 1, fullgraph=True, backend="aot_eager")(torch.zeros(3))


def test_a_given_fake_makes_a_gpu_kernel_traceable_on_fake_tensors():
    def gpu_double(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("never runs here: traced only")

    kernel_op("lb_test::gpu_double", gpu_double, fake=lambda x: torch.empty_like(x))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        y = registered_op(gpu_double)(torch.empty(4, 8, device="meta"))
    assert y.shape == (4, 8)


@pytest.mark.parametrize("case, match", [
    ("method", "plain function"),
    ("unannotated", "no annotation"),
    ("quantized", "QuantizedRows as its two tensors"),
    ("unknown_write", "declares 'nope' written"),
    ("varargs", r"takes \*args"),
])
def test_kernels_an_operator_cannot_carry_are_refused_with_advice(case, match):
    def unannotated(x, out: torch.Tensor) -> None: ...
    def quantized(x: torch.Tensor, out: QuantizedRows) -> None: ...
    def plain(x: torch.Tensor, out: torch.Tensor) -> None: ...
    def varargs(*args: torch.Tensor) -> None: ...

    class K:
        def method(self, x: torch.Tensor) -> None: ...

    kernel, mutates = {
        "method": (K().method, ()), "unannotated": (unannotated, ()), "quantized": (quantized, ()),
        "unknown_write": (plain, ("nope",)), "varargs": (varargs, ()),
    }[case]
    with pytest.raises((TypeError, ValueError), match=match):
        kernel_op(f"lb_test::refused_{case}", kernel, mutates=mutates)


# -- the references: plain torch in eager, their operators under compile --------------------------

def test_the_references_compile_to_the_eager_bits_with_inductor():
    """Inductor regenerates a traced torch RMSNorm with its own reduction order (an ulp of bf16 off
    here); the reference's operators run the eager ATen calls, so a compiled model that uses the
    reference gives exactly its eager numbers."""
    x, r, w = _rows(64, 4096)

    def step(x, r, w):
        y = rmsnorm_ref(x, w, 1e-6, weight_offset=1.0)
        y2, r2 = fused_add_rmsnorm_ref(x, r, w, 1e-6)
        q = rmsnorm_fp8_ref(x, w, 1e-6)
        dest = torch.empty_like(x)
        q2, r3 = fused_add_rmsnorm_fp8_ref(y2, r2, w, 1e-5, residual_out=dest)
        out = torch.empty_like(x)
        rmsnorm_ref(r3, w, 1e-6, out=out)
        return y, y2, r2, q.data, q.scale, q2.data, q2.scale, r3, dest, out

    want = step(x, r, w)
    got = torch.compile(step, fullgraph=True)(x, r, w)
    for i, (g, e) in enumerate(zip(got, want)):
        assert torch.equal(g.float(), e.float()), f"output {i} differs from eager"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_reference_operators_pass_opcheck(dtype):
    x, r, w = _rows(3, 64, dtype)
    from layer_boundary._kernels import reference

    for kernel, args in ((reference._rmsnorm, (x, w, 1e-6, 1.0)),
                         (reference._fused_add_rmsnorm, (x, r, w, 1e-6, 0.0)),
                         (reference._rmsnorm_fp8, (x, w, 1e-6, 0.0)),
                         (reference._fused_add_rmsnorm_fp8, (x, r, w, 1e-6, 1.0))):
        torch.library.opcheck(registered_op(kernel), args)


def test_the_finalize_reference_compiles_to_the_eager_bits_with_inductor():
    from layer_boundary.plugin_api import finalize_partial_ref

    g = torch.Generator().manual_seed(1)
    experts = torch.randn(9, 4, 512, generator=g).bfloat16()
    weights = torch.softmax(torch.randn(9, 4, generator=g), -1).bfloat16()
    shared = torch.randn(9, 512, generator=g).bfloat16()

    def step(e, w, s):
        return finalize_partial_ref(e, w, s), finalize_partial_ref(e, w, None)

    for got, want in zip(torch.compile(step, fullgraph=True)(experts, weights, shared), step(experts, weights, shared)):
        assert torch.equal(got, want)
    torch.library.opcheck(registered_op(finalize_partial_ref), (experts, weights, shared))
    torch.library.opcheck(registered_op(finalize_partial_ref), (experts, weights, None))


def _graph_ops(fn, *args):
    """The call_function targets of the graph Dynamo hands its backend for ``fn(*args)``."""
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend=backend)(*args)
    return seen


def test_inference_compiles_the_operator_and_grad_mode_stays_differentiable():
    weight = torch.nn.Parameter(torch.rand(64) + 0.5)
    x = torch.randn(3, 64)

    def step(x):
        return rmsnorm_ref(x, weight, 1e-6)

    with torch.no_grad():
        assert any("rmsnorm_ref" in t for t in _graph_ops(step, x))
    assert not any("rmsnorm_ref" in t for t in _graph_ops(step, x))  # traced torch: has a backward
    torch._dynamo.reset()
    y = torch.compile(step, fullgraph=True, backend="aot_eager")(x)
    (got,) = torch.autograd.grad(y.sum(), weight)
    (want,) = torch.autograd.grad(step(x).sum(), weight)
    torch.testing.assert_close(got, want)


def test_registering_kernels_does_not_import_dynamo_and_its_import_makes_the_substitutions():
    """torch._dynamo takes over a second to import: a process that never compiles must not pay it
    for importing the references (nor a plugin for its kernels)."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from layer_boundary.plugin_api import rmsnorm_ref\n"
        "import layer_boundary._kernels.reference\n"
        "assert 'torch._dynamo' not in sys.modules, 'kernel_op imported torch._dynamo'\n"
        "x, w = torch.randn(3, 64), torch.rand(64)\n"
        "def step(x, w):\n"
        "    return rmsnorm_ref(x, w, 1e-6)\n"
        "seen = []\n"
        "def backend(gm, inputs):\n"
        "    seen.extend(str(n.target) for n in gm.graph.nodes if n.op == 'call_function')\n"
        "    return gm.forward\n"
        "with torch.no_grad():\n"
        "    torch.compile(step, fullgraph=True, backend=backend)(x, w)\n"
        "assert seen == ['layer_boundary.rmsnorm_ref.default'], seen\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
