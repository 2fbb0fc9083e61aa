"""The CuTe DSL plugin (``plugins/cutedsl``): the fused add + RMSNorm norm-read kernel for Hopper.

On the CPU: refusal reasons, the hook registering the provider without importing ``cutlass``, the
wrappers' checks and fallbacks over a launch double, and (where ``cutlass`` imports) the kernel
compiled ahead of time for sm_90a with no GPU. GPU-marked tests run the real kernel against the
torch reference, eagerly and replayed from a CUDA graph.
"""

from __future__ import annotations

import logging
import os
import re
import sys

import pytest
import torch

from layer_boundary._kernels.reference import fused_add_rmsnorm_ref, rmsnorm_ref
from layer_boundary._providers import NormKernelProvider, NormRequest

from layer_boundary_cutedsl import hooks as cute_hooks
from layer_boundary_cutedsl.norm import FP8_REFUSAL, CuTeDSLNormProvider, cutedsl_kernels
from layer_boundary_cutedsl.shape import launch_shape

EPS = 1e-6
HOPPER = lambda: (9, 0)  # noqa: E731


def _req(h: int = 4096, dtype: torch.dtype = torch.bfloat16, offset: float = 0.0, quant=None,
         device: str = "cuda") -> NormRequest:
    return NormRequest(device, dtype, h, offset, quant)


def _rand(t: int, h: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype).to(device)
    r = torch.randn(t, h, generator=g).to(dtype).to(device)
    w = (torch.rand(h, generator=g) + 0.5).to(dtype).to(device)
    return x, r, w


# -- refusals ----------------------------------------------------------------------------------


def test_provider_is_a_norm_kernel_provider():
    assert isinstance(CuTeDSLNormProvider(), NormKernelProvider)


@pytest.mark.parametrize("request_, reason", [
    (_req(device="cpu"), "runs on CUDA devices only, not cpu"),
    (_req(quant="fp8_e4m3"), FP8_REFUSAL),
    (_req(dtype=torch.float32), "float32 is not supported: the CuTe DSL kernel takes bf16 and fp16 only"),
    (_req(offset=0.5), "weight offset 0.5 is not offered: RMSNorm (offset 0) and Gemma RMSNorm (offset 1) only"),
    (_req(h=65536), "hidden size 65536 is over 32768: the kernel keeps a row's FP32 sum in registers"),
    (_req(h=4097), "hidden size 4097 is not a multiple of 256: the kernel gives every thread of full warps "
                   "whole 128-bit vectors"),
    (_req(h=4104), "hidden size 4104 is not a multiple of 256: the kernel gives every thread of full warps "
                   "whole 128-bit vectors"),
])
def test_refusal_reasons(request_, reason, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    assert CuTeDSLNormProvider(capability=HOPPER).refuse(request_) == reason


def test_refuses_an_unknown_quantized_output(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    assert CuTeDSLNormProvider(capability=HOPPER).refuse(_req(quant="int4")).startswith(
        "unknown quantized output 'int4'")


def test_refuses_without_a_device_or_before_hopper(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    assert CuTeDSLNormProvider(capability=lambda: None).refuse(_req()) == "no CUDA device is visible"
    assert CuTeDSLNormProvider(capability=lambda: (8, 0)).refuse(_req()) == (
        "needs Hopper (sm_90) or newer; this device is sm_80")


def test_refuses_on_rocm(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert CuTeDSLNormProvider(capability=HOPPER).refuse(_req()).startswith(
        "runs on NVIDIA GPUs only, not a ROCm build of torch")


def test_refuses_when_cutlass_does_not_import(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setitem(sys.modules, "cutlass", None)
    monkeypatch.setitem(sys.modules, "cutlass.cute", None)
    p = CuTeDSLNormProvider(capability=HOPPER)
    why = p.refuse(_req())
    assert why.startswith("the CuTe DSL is not importable (ModuleNotFoundError") and "nvidia-cutlass-dsl" in why
    with pytest.raises(ValueError, match="cutedsl cannot serve rmsnorm cuda bfloat16 H=4096: the CuTe DSL"):
        p.kernels(_req())


@pytest.mark.parametrize("h, shape", [(2048, (256, 1)), (4096, (256, 2)), (7168, (128, 7)), (8192, (256, 4)),
                                      (256, (32, 1)), (32768, (256, 16)), (127, None), (4104, None)])
def test_launch_shapes(h, shape):
    assert launch_shape(h) == shape


# -- the hook -------------------------------------------------------------------------------------


def test_hook_registers_the_provider_without_importing_cutlass(monkeypatch):
    for m in [m for m in sys.modules if m == "cutlass" or m.startswith("cutlass.")]:
        monkeypatch.delitem(sys.modules, m)
    monkeypatch.delitem(sys.modules, "layer_boundary_cutedsl.kernel", raising=False)
    (provider,) = cute_hooks.layer_boundary_norm_kernels()
    assert provider.name == "cutedsl" and isinstance(provider, CuTeDSLNormProvider)
    (fusion,) = cute_hooks.layer_boundary_fusion_providers()
    assert fusion.name == "cutedsl-moe-finalize" and not fusion.installed
    assert "cutlass" not in sys.modules


# -- the wrappers, over a launch double (CPU) -------------------------------------------------------


class _Launches:
    """Records launches and computes them with the torch reference, in the kernel's write order."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def __call__(self, compiled, x, r, w, y, eps):
        self.calls.append((compiled, x.shape[0]))
        if compiled == "fused":
            fused_add_rmsnorm_ref(x, r, w, eps, weight_offset=self.offset, out=y, residual_out=r)
        else:
            rmsnorm_ref(x, w, eps, weight_offset=self.offset, out=y)


def _table(h=256, dtype=torch.bfloat16, offset=0.0):
    launches = _Launches()
    launches.offset = offset
    return cutedsl_kernels(h, dtype, offset, "plain", "fused", launches), launches


def test_fused_wrapper_updates_the_residual_in_place_and_writes_a_separate_output():
    k, launches = _table()
    x, r, w = _rand(3, 256, torch.bfloat16)
    x0 = x.clone()
    want_y, want_r = fused_add_rmsnorm_ref(x, r, w, EPS)
    y, r2 = k.fused_add_rmsnorm(x, r, w, EPS)
    assert k.residual_in_place and not k.input_as_out
    assert r2 is r and y.data_ptr() not in (x.data_ptr(), r.data_ptr())
    assert torch.equal(x, x0) and torch.equal(r, want_r) and torch.equal(y, want_y)
    assert launches.calls == [("fused", 3)]


def test_wrappers_skip_empty_batches_and_fall_back_visibly(caplog):
    k, launches = _table()
    x, r, w = _rand(0, 256, torch.bfloat16)
    k.fused_add_rmsnorm(x, r, w, EPS)
    k.rmsnorm(x, w, EPS)
    assert launches.calls == []
    x, r, w = _rand(4, 256, torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="layer_boundary"):
        y = k.rmsnorm(x, w.float(), EPS)  # an FP32 weight: the kernel reads the input's dtype
        k.rmsnorm(x, w.float(), EPS)
        k.rmsnorm(x, w, EPS)
        k.fused_add_rmsnorm(x[::2], r[::2], w, EPS)  # row stride 512: still fits
        k.fused_add_rmsnorm(x, r, w, EPS, weight_offset=1.0)  # not the compiled offset
    torch.testing.assert_close(y, rmsnorm_ref(x, w.float(), EPS))
    warnings = [m for m in caplog.messages if m.startswith("cutedsl")]
    assert len(warnings) == 2, warnings  # once per cause
    assert "weight is float32" in warnings[0] and "weight offset 1.0 was not compiled here" in warnings[1]
    assert launches.calls == [("plain", 4), ("fused", 2)]


def test_misaligned_rows_take_the_reference():
    k, launches = _table()
    buf = torch.randn(4 * 256 + 1).to(torch.bfloat16)
    x = buf[1:].view(4, 256)  # 2-byte offset: no 128-bit access may start there
    _, r, w = _rand(4, 256, torch.bfloat16)
    y, _ = k.fused_add_rmsnorm(x, r.clone(), w, EPS)
    torch.testing.assert_close(y, fused_add_rmsnorm_ref(x, r, w, EPS)[0], atol=0, rtol=0)
    assert launches.calls == []


def test_kernels_are_compiled_once_per_hidden_size_dtype_and_offset(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    compiled = []

    def compiler(h, dtype, offset, fused):
        compiled.append((h, dtype, offset, fused))
        return object()

    p = CuTeDSLNormProvider(capability=HOPPER, compiler=compiler, launch=lambda *a: None)
    p._library = object()  # cutlass "imports"
    a = p.kernels(_req(4096))
    assert p.kernels(_req(4096)) is a
    p.kernels(_req(4096, offset=1.0))
    p.kernels(_req(2048, dtype=torch.float16))
    assert compiled == [(4096, "bfloat16", 0.0, False), (4096, "bfloat16", 0.0, True),
                        (4096, "bfloat16", 1.0, False), (4096, "bfloat16", 1.0, True),
                        (2048, "float16", 0.0, False), (2048, "float16", 0.0, True)]


# -- compiled for sm_90a without a GPU --------------------------------------------------------------


def _cute_kernel_module():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # no device to ask: compile for Hopper
    try:
        import cutlass.cute  # noqa: F401
    except Exception as e:
        pytest.skip(f"the CuTe DSL is not importable here ({type(e).__name__}: {e}); "
                    "pip install 'nvidia-cutlass-dsl[cu13]==4.8.1' to compile the kernel")
    from layer_boundary_cutedsl import kernel
    return kernel


@pytest.mark.parametrize("h, dtype, offset, fused", [(4096, "bfloat16", 1.0, True), (7168, "float16", 0.0, False)])
def test_kernel_compiles_for_sm90a_without_a_gpu(h, dtype, offset, fused, tmp_path):
    kernel = _cute_kernel_module()
    compiled = kernel.compile_add_rmsnorm(h, dtype, offset, fused, ptx_dir=str(tmp_path))
    ptx = compiled.__ptx__
    assert ".target sm_90a" in ptx
    threads, per = launch_shape(h)
    # Every global access is one 128-bit vector: 2 (x, w) or 4 (x, r, r', w) per vector, plus y.
    loads = len(re.findall(r"ld\.global\.v4\.b32", ptx))
    stores = len(re.findall(r"st\.global\.v4\.b32", ptx))
    assert (loads, stores) == ((3 if fused else 2) * per, (2 if fused else 1) * per), (loads, stores)
    assert not re.search(r"(ld|st)\.global\.(b16|u16|v2\.b32)", ptx)
    assert "shfl.sync.bfly" in ptx and "rsqrt" in ptx


@pytest.mark.parametrize("h, dtype, k, shared", [(4096, "bfloat16", 8, True), (2048, "float16", 2, False)])
def test_finalize_variant_compiles_with_vector_accesses_only(h, dtype, k, shared, tmp_path):
    kernel = _cute_kernel_module()
    ptx = kernel.compile_add_rmsnorm(h, dtype, 1.0, True, topk=k, shared=shared, ptx_dir=str(tmp_path)).__ptx__
    assert ".target sm_90a" in ptx
    _, per = launch_shape(h)
    # Per vector: k expert rows (+ shared), the residual and the weight in; residual and y out.
    loads = len(re.findall(r"ld\.global\.v4\.b32", ptx))
    stores = len(re.findall(r"st\.global\.v4\.b32", ptx))
    assert (loads, stores) == ((k + shared + 2) * per, 2 * per), (loads, stores)
    # The router weights: one scalar load each per row, nothing else narrower than 128 bits.
    assert len(re.findall(r"ld\.global\.(b16|u16)", ptx)) == k
    assert not re.search(r"st\.global\.(b16|u16|v2\.b32)", ptx)


# -- GPU ------------------------------------------------------------------------------------------


def _gpu_provider():
    p = CuTeDSLNormProvider()
    why = p.refuse(_req())
    if why is not None:
        pytest.skip(f"cutedsl cannot run here: {why}")
    return p


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("h", [2048, 4096, 7168, 8192])
def test_gpu_matches_the_reference(h, dtype, offset):
    p = _gpu_provider()
    k = p.kernels(_req(h, dtype, offset))
    tol = dict(zip(("atol", "rtol"), p.tolerance[dtype]))
    for t in (1, 7, 128, 4096):
        x, r, w = _rand(t, h, dtype, "cuda", seed=t)
        want_y, want_r = fused_add_rmsnorm_ref(x, r, w, EPS, weight_offset=offset)
        got_y, got_r = k.fused_add_rmsnorm(x, r.clone(), w, EPS, weight_offset=offset)
        torch.testing.assert_close(got_y, want_y, **tol, msg=lambda m: f"H={h} T={t}: {m}")
        torch.testing.assert_close(got_r, want_r, atol=0, rtol=0, msg=lambda m: f"H={h} T={t} residual: {m}")
        torch.testing.assert_close(k.rmsnorm(x, w, EPS, weight_offset=offset),
                                   rmsnorm_ref(x, w, EPS, weight_offset=offset), **tol)


@pytest.mark.gpu
def test_gpu_odd_width_is_refused():
    p = _gpu_provider()
    assert "not a multiple of 256" in p.refuse(_req(4097))


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_restores_poisoned_outputs():
    p = _gpu_provider()
    h, dtype = 4096, torch.bfloat16
    k = p.kernels(_req(h, dtype))
    x, r, w = _rand(64, h, dtype, "cuda")
    r0 = r.clone()
    y = torch.empty_like(x)
    want_y, want_r = fused_add_rmsnorm_ref(x, r0, w, EPS)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on the capture stream
        k.fused_add_rmsnorm(x, r, w, EPS, out=y)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    r.copy_(r0)
    with torch.cuda.graph(g):
        k.fused_add_rmsnorm(x, r, w, EPS, out=y)
    y.fill_(float("nan"))
    r.copy_(r0)
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, want_y, atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(r, want_r, atol=0, rtol=0)


def test_a_kernel_that_does_not_build_is_a_refusal_asked_once(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    calls = []

    def broken(*args):
        calls.append(args)
        raise RuntimeError("ptxas fatal: something\nmore lines")

    p = CuTeDSLNormProvider(capability=HOPPER, compiler=broken)
    p._library = object()  # as if cutlass imported
    why = p.refuse(_req())
    assert why == "the CuTe DSL kernel failed its build check (RuntimeError: ptxas fatal: something)"
    assert p.refuse(_req()) == why and len(calls) == 1  # remembered: no rebuild per stage
