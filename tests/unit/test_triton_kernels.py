"""The core Triton norm kernels: selection on every machine, kernel logic under Triton's
interpreter on CPU (a subprocess, see triton_interpreter_cases.py), and on a GPU: eager,
``torch.compile(fullgraph=True)``, CUDA-graph capture, and the conformance kit.

Tolerances are ``TritonNormProvider.tolerance`` (per dtype: FP32 accumulated in another order
with an approximate rsqrt, then one rounding to the output dtype):

| dtype    | atol / rtol | why |
| -------- | ----------- | --- |
| float32  | 1e-5        | a few FP32 ulps of reduction order and rsqrt |
| bfloat16 | 1.6e-2      | the final rounding may land on the neighbouring bf16 value (2^-8) |
| float16  | 2e-3        | the same at fp16's 2^-11 |

The stored residual is the FP32 sum rounded once and is compared exactly; FP8 outputs are
compared dequantized, within one e4m3 step (``testing.tolerances.assert_fp8_rows_close``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import EPS, make_norm
from layer_boundary import BoundaryContext, ForwardBatch, declare_attn, declare_ffn, make_stages
from layer_boundary._providers import NormRequest
from layer_boundary._quant import QuantizedRows
from layer_boundary._kernels.providers import REFERENCE_PROVIDER, TRITON_PROVIDER, core_norm_providers
from layer_boundary._kernels.reference import (
    fused_add_rmsnorm_fp8_ref,
    fused_add_rmsnorm_ref,
    rmsnorm_fp8_ref,
    rmsnorm_ref,
)
from layer_boundary.residual import batch as rb
from layer_boundary.residual._add_norm import AddNormReadSpec
from layer_boundary.testing import NormKernelConformance
from layer_boundary.testing._tolerances import assert_fp8_rows_close, tolerance_of

HERE = Path(__file__).resolve().parents[1] / "support"  # the case files
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")


# -- every machine: selection and refusals ------------------------------------------------------------


def test_core_providers_put_triton_before_the_reference():
    assert [p.name for p in core_norm_providers()] == ["core-triton", "torch-reference"]


@pytest.mark.parametrize("request_, reason", [
    (NormRequest("cpu", BF16, 4096), "runs on CUDA devices only, not cpu"),
    (NormRequest("cuda", torch.float64, 4096),
     "float64 is not supported (bf16, fp16, fp32): FP32 accumulation would round FP64 input"),
    (NormRequest("cuda", BF16, 4096, 0.0, "int4"), "unknown quantized output 'int4' (known: fp8_e4m3)"),
], ids=["cpu", "fp64", "unknown-quant"])
def test_triton_refuses_with_a_reason(request_, reason):
    assert TRITON_PROVIDER.refuse(request_) == reason


@needs_triton
@pytest.mark.parametrize("quant", [None, "fp8_e4m3"])
def test_a_cuda_context_selects_core_triton(quant):
    """Selection only (no kernel runs): a model that will run on CUDA gets the Triton kernels, and
    a CPU one the reference, with the reason in the report."""
    from layer_boundary._kernels.triton_ops import TRITON_FP8_KERNELS, TRITON_KERNELS

    if quant is not None and torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 e4m3 needs compute capability 8.9 or newer")
    ctx = BoundaryContext(device="cuda")
    (attn,) = make_stages((declare_attn(read=AddNormReadSpec(quant=quant)), make_norm(64, BF16)), context=ctx)
    (sel,) = [s for s in ctx.report.selections if s.what == "norm kernels"]
    assert sel.chosen == "core-triton"
    assert [(c.name, c.refused) for c in sel.candidates] == [
        ("core-triton", None), ("torch-reference", "core-triton comes first")]
    read = attn.plan.read
    assert read.kernels is (TRITON_KERNELS if quant is None else TRITON_FP8_KERNELS)
    assert read.residual_in_place and read.quant == quant

    cpu = BoundaryContext()
    make_stages((declare_attn(), make_norm(64, BF16)), context=cpu)
    (sel,) = [s for s in cpu.report.selections if s.what == "norm kernels"]
    assert sel.chosen == "torch-reference"
    assert sel.candidates[0].refused == "runs on CUDA devices only, not cpu"


@needs_triton
def test_launch_configuration_is_cached_per_width_and_element_size():
    from layer_boundary._kernels import triton_norm as tn

    assert tn.launch_config(4096, 2) == (4096, 16)  # 8 bf16 a thread: one 16-byte access
    assert tn.launch_config(2048, 2) == (2048, 8)
    assert tn.launch_config(7168, 2) == (8192, 16)
    assert tn.launch_config(4097, 4)[0] == 8192
    assert tn.launch_config(1, 2) == (1, 1)
    assert tn.launch_config(tn.MAX_TILE + 1, 2)[0] == tn.CHUNK  # past a tile: chunked
    assert tn.launch_config(4096, 2) is tn.launch_config(4096, 2)


@needs_triton
def test_kernels_under_the_triton_interpreter():
    """The kernel logic on CPU tensors. TRITON_INTERPRET must be set before the kernels are
    defined, and this session's GPU tests need them compiled: hence a subprocess."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "triton_interpreter_cases.py")]
    proc = subprocess.run(cmd, cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"interpreter cases failed:\n{out[-8000:]}"
    assert " passed" in out and "skipped" not in out.splitlines()[-1], out[-2000:]


# -- GPU ----------------------------------------------------------------------------------------------

# Odd and prime widths, widths just past a power of two, the model widths of the speed targets,
# and one past MAX_TILE (the chunked kernel); fewer for fp16 and fp32 (each case compiles kernels).
WIDTHS = [1, 7, 128, 1000, 2048, 4096, 4097, 7168, 8192, 20000]
CASES = [(BF16, h) for h in WIDTHS] + [(d, h) for d in (FP16, FP32) for h in (1, 7, 1000, 4096, 4097, 20000)]
TOKENS = [0, 1, 3, 17, 128, 1024]


def cuda_rows(t: int, h: int, dtype: torch.dtype, seed: int = 0, stride: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, h + stride, generator=g) * 2).to(dtype).cuda()[:, :h]
    r = torch.randn(t, h, generator=g).to(dtype).cuda()
    w = (torch.rand(h, generator=g) + 0.5).to(dtype).cuda()
    return x, r, w


def tri():
    from layer_boundary._kernels import triton_ops

    return triton_ops


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,h", CASES, ids=str)
def test_gpu_eager_matches_reference(dtype, h):
    t_ = tri()
    tol = tolerance_of(TRITON_PROVIDER, dtype)
    for i, t in enumerate(TOKENS):
        offset = float(i % 2)  # plain and Gemma, alternating
        x, r, w = cuda_rows(t, h, dtype, seed=i, stride=3 if i == 2 else 0)  # one strided-row case
        what = f"T={t} H={h} {dtype} offset={offset}"
        torch.testing.assert_close(t_.rmsnorm_triton(x, w, EPS, weight_offset=offset),
                                   rmsnorm_ref(x, w, EPS, weight_offset=offset), **tol, msg=lambda m: f"{what}: {m}")
        want_y, want_r = fused_add_rmsnorm_ref(x, r, w, EPS, weight_offset=offset)
        r_in = r.clone()
        y, r_out = t_.fused_add_rmsnorm_triton(x, r_in, w, EPS, weight_offset=offset)
        assert r_out is r_in
        torch.testing.assert_close(r_in, want_r, rtol=0, atol=0, msg=lambda m: f"{what} residual: {m}")
        torch.testing.assert_close(y, want_y, **tol, msg=lambda m: f"{what}: {m}")
        assert_fp8_rows_close(t_.rmsnorm_fp8_triton(x, w, EPS, weight_offset=offset),
                              rmsnorm_fp8_ref(x, w, EPS, weight_offset=offset), what=what)
        want_q, want_r = fused_add_rmsnorm_fp8_ref(x, r, w, EPS, weight_offset=offset)
        r_in = r.clone()
        q, _ = t_.fused_add_rmsnorm_fp8_triton(x, r_in, w, EPS, weight_offset=offset)
        assert_fp8_rows_close(q, want_q, what=f"{what} fused")
        torch.testing.assert_close(r_in, want_r, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_strided_inputs_and_destinations():
    t_ = tri()
    h = 4096
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(64, 3 * h, generator=g).to(BF16).cuda()
    res_wide = torch.randn(64, 2 * h, generator=g).to(BF16).cuda()
    w = (torch.rand(h, generator=g) + 0.5).to(BF16).cuda()
    x, r = wide[:, h:2 * h], res_wide[:, ::2]  # strided rows; strided columns written in place
    want_y, want_r = fused_add_rmsnorm_ref(x, r, w, EPS)
    others = res_wide[:, 1::2].clone()
    y, r_out = t_.fused_add_rmsnorm_triton(x, r, w, EPS)
    assert r_out is r
    torch.testing.assert_close(r, want_r, rtol=0, atol=0)
    assert torch.equal(res_wide[:, 1::2], others)
    torch.testing.assert_close(y, want_y, **tolerance_of(TRITON_PROVIDER, BF16))
    # Destinations: out= and residual_out= (the residual is then left alone).
    r = torch.randn(64, h, generator=g).to(BF16).cuda()
    r0 = r.clone()
    out, r_dest = torch.empty(64, h, dtype=BF16, device="cuda"), torch.empty(64, h, dtype=BF16, device="cuda")
    y, got_r = t_.fused_add_rmsnorm_triton(x, r, w, EPS, out=out, residual_out=r_dest)
    assert y is out and got_r is r_dest and torch.equal(r, r0)
    want_y, want_r = fused_add_rmsnorm_ref(x, r0, w, EPS)
    torch.testing.assert_close(r_dest, want_r, rtol=0, atol=0)
    torch.testing.assert_close(out, want_y, **tolerance_of(TRITON_PROVIDER, BF16))
    dest = QuantizedRows(torch.empty(64, h, dtype=torch.float8_e4m3fn, device="cuda"),
                         torch.empty(64, 1, device="cuda"))
    assert t_.rmsnorm_fp8_triton(x, w, EPS, out=dest) is dest
    assert_fp8_rows_close(dest, rmsnorm_fp8_ref(x, w, EPS))


def _step(x, r, w):
    t_ = tri()
    y, r2 = t_.fused_add_rmsnorm_triton(x, r, w, EPS, weight_offset=1.0)
    q = t_.fused_add_rmsnorm_fp8_triton(y, r2, w, EPS)[0]
    z = t_.rmsnorm_triton(r2, w, EPS)
    return y, q.data, q.scale, z


def _same_step(got, want, r_got, r_want, *, exact: bool) -> None:
    """Eager against eager replay is bitwise; a compiled kernel may contract differently (FMA),
    moving a bf16 output by an ulp and, through it, the second residual update and FP8 codes."""
    tol = dict(rtol=0, atol=0) if exact else tolerance_of(TRITON_PROVIDER, BF16)
    torch.testing.assert_close(r_got, r_want, **tol)
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[3], want[3], **tol)
    if exact:
        assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))
        assert torch.equal(got[2], want[2])
    else:
        assert_fp8_rows_close(QuantizedRows(got[1], got[2]), QuantizedRows(want[1], want[2]), scale_rtol=1e-2)


@pytest.mark.gpu
def test_gpu_compiled_fullgraph_matches_eager():
    """Dynamo sends the wrappers to the layer_boundary operators and Inductor inlines the kernel;
    the caller's residual is updated in place exactly as in eager. Two token counts: the second
    call recompiles with a dynamic T."""
    torch._dynamo.reset()
    compiled = torch.compile(_step, fullgraph=True)
    for t in (64, 200):
        x, r, w = cuda_rows(t, 4096, BF16, seed=t)
        r_eager, r_comp = r.clone(), r.clone()
        want = _step(x, r_eager, w)
        got = compiled(x, r_comp, w)
        _same_step(got, want, r_comp, r_eager, exact=False)  # r_comp: the caller's tensor, updated


def _capture(fn, *static):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up outside capture (JIT compile, Dynamo)
        fn(*[a.clone() for a in static])
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn(*static)
    return graph, outs


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_gpu_cuda_graph_replay_equals_eager(mode):
    torch._dynamo.reset()
    fn = _step if mode == "eager" else torch.compile(_step, fullgraph=True)
    x, r, w = cuda_rows(16, 4096, BF16, seed=7)
    static_x, static_r = x.clone(), r.clone()
    graph, outs = _capture(fn, static_x, static_r, w)
    r_eager = r.clone()
    want = _step(x, r_eager, w)
    static_x.copy_(x)
    static_r.copy_(r)
    for o in outs:  # poison with NaN (0xFF is NaN in e4m3fn too): the replay must rewrite every output
        o.view(torch.uint8).fill_(0xFF)
    graph.replay()
    torch.cuda.synchronize()
    _same_step(outs, want, static_r, r_eager, exact=mode == "eager")


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [None, "fp8_e4m3"])
def test_gpu_stack_selects_core_triton_and_matches_the_reference(quant):
    """A two-layer stack on CUDA built with a context (core-triton) against the same stack built
    without one (torch reference)."""
    h, t = 2048, 33

    def build(ctx):
        spec = AddNormReadSpec(quant=quant)
        norms = [make_norm(h, BF16, seed=i).cuda() for i in range(4)]
        a0, f0 = make_stages((declare_attn(read=spec), norms[0]), (declare_ffn(), norms[1]), context=ctx)
        a1, f1 = make_stages((declare_attn(read=spec), norms[2]), (declare_ffn(), norms[3]),
                             previous=declare_ffn(), terminal=True, context=ctx)
        return [(a0, f0), (a1, f1)]

    def run(layers):
        fb = ForwardBatch.for_tokens(t)
        rb.start(fb)
        g = torch.Generator().manual_seed(3)
        hidden = torch.randn(t, h, generator=g).to(BF16).cuda()
        inputs = []
        for attn, ffn in layers:
            inp = attn.prepare(hidden, fb)
            inputs.append(inp)
            dense = inp.dequantize(BF16) if isinstance(inp, QuantizedRows) else inp
            hidden = attn.finish(dense * 0.5, fb)
            y = ffn.prepare(hidden, fb)
            with ffn.exit(fb) as out:
                d = y * 0.25
            hidden = out.finish(d)
        final = rb.norm(hidden, fb, make_norm(h, BF16, seed=9).cuda())
        return inputs, final

    ctx = BoundaryContext()
    fast = build(ctx)
    chosen = {s.chosen for s in ctx.report.selections if s.what == "norm kernels"}
    assert "core-triton" in chosen and "torch-reference" not in chosen
    got_inputs, got = run(fast)
    want_inputs, want = run(build(None))
    for g_in, w_in in zip(got_inputs, want_inputs):
        if quant is None:
            torch.testing.assert_close(g_in, w_in, **tolerance_of(TRITON_PROVIDER, BF16))
        else:
            assert isinstance(g_in, QuantizedRows)
            # The second layer's rows come from slightly different residuals: compare loosely.
            torch.testing.assert_close(g_in.dequantize(), w_in.dequantize(), atol=0.1, rtol=0.13)
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
class TestTritonConformance(NormKernelConformance):
    dtypes = (FP32, BF16, FP16)
    hidden_sizes = (64, 127, 4096, 7168)

    @pytest.fixture
    def provider(self):
        return TRITON_PROVIDER


def test_reference_provider_is_still_last_and_serves_everything():
    assert core_norm_providers()[-1] is REFERENCE_PROVIDER
    assert REFERENCE_PROVIDER.refuse(NormRequest("cuda", torch.float64, 7, 1.0, "fp8_e4m3")) is None
