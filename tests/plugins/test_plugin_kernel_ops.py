"""Every vendor kernel a boundary calls is a registered operator (``kernel_op``), on the CPU.

The FlashInfer and CuTe DSL tables run over their CPU doubles (the kit's own trace check skips
them here: their providers serve CUDA requests only), compiled with ``fullgraph=True`` against
eager, in-place writes included; GPU-only launches (the core's symmetric-memory all-reduce, the
FlashInfer and AITER fused all-reduces) are checked through their schemas and fake tensors.
The AITER tables pass the kit's trace check over its double in ``test_rocm_aiter_plugin.py``;
the MHC and core Triton operators compile under the Triton interpreter
(``*_interpreter_cases.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from layer_boundary.plugin_api import fused_add_rmsnorm_ref, registered_op, rmsnorm_ref
from layer_boundary.testing import assert_traces

from support import flashinfer_double
from support.flashinfer_cases import norm_inputs

EPS = 1e-6


def _written(op_name: str) -> set[str]:
    namespace, _, name = op_name.partition("::")
    schema = getattr(getattr(torch.ops, namespace), name).default._schema
    return {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}


@pytest.fixture
def fi(monkeypatch):
    return flashinfer_double.install(monkeypatch)


def _table_step(k):
    def step(x, res, w):
        y = k.rmsnorm(x, w, EPS, weight_offset=1.0)
        y2, r2 = k.fused_add_rmsnorm(x, res, w, EPS, weight_offset=0.0)
        c = x * 2
        y3, r3 = k.fused_add_rmsnorm(c, r2, w, EPS, weight_offset=0.0, out=c)  # the contribution handed over
        return y, y2, y3, r3

    return step


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_tables_compile_to_the_eager_bits_and_writes(fi, dtype):
    from layer_boundary_flashinfer.norm import flashinfer_kernels

    k = flashinfer_kernels(fi.pkg)
    x, r, w = norm_inputs(5, 64, dtype)
    assert_traces(_table_step(k), x, r, w, what="flashinfer table over the double")
    # The kernels ran (not the reference fallback): inside the operators, at run time.
    assert {name for name, _ in fi.calls} >= {"gemma_rmsnorm", "fused_add_rmsnorm"}


def test_flashinfer_fallback_inside_the_operator_traces_too(fi):
    from layer_boundary_flashinfer.norm import flashinfer_kernels

    k = flashinfer_kernels(fi.pkg)
    x, r, w = norm_inputs(4, 63, torch.bfloat16)  # 126-byte rows: not 16-byte aligned, the reference runs
    assert_traces(lambda x, r, w: k.fused_add_rmsnorm(x, r, w, EPS), x, r, w, what="flashinfer fallback")


def test_flashinfer_operators_declare_their_writes_and_pass_opcheck(fi):
    import layer_boundary_flashinfer.fusion  # noqa: F401  (registers the fused all-reduce's operator)
    from layer_boundary_flashinfer import norm

    norm.flashinfer_kernels(fi.pkg)
    library = len(norm._LIBRARIES) - 1
    assert _written("layer_boundary_flashinfer::rmsnorm") == {"out"}
    assert _written("layer_boundary_flashinfer::fused_add_rmsnorm") == {"residual", "out", "residual_out"}
    assert _written("layer_boundary_flashinfer::allreduce_add_rmsnorm") == {"residual", "out"}
    x, r, w = norm_inputs(3, 64, torch.bfloat16)
    torch.library.opcheck(registered_op(norm._rmsnorm_into), (x, w, EPS, 0.0, torch.empty_like(x), library))
    torch.library.opcheck(registered_op(norm._fused_add_rmsnorm_into),
                          (x, r.clone(), w, EPS, 1.0, torch.empty_like(x), None, library))


def _cute_table(h: int = 256, dtype: torch.dtype = torch.bfloat16, offset: float = 0.0):
    """A CuTe DSL table whose launch double computes the reference into the destinations."""
    from layer_boundary_cutedsl.norm import cutedsl_kernels

    def launch(compiled, x, r, w, y, eps):
        if compiled == "plain":
            rmsnorm_ref(x, w, eps, weight_offset=offset, out=y)
        else:
            fused_add_rmsnorm_ref(x.clone(), r, w, eps, weight_offset=offset, out=y, residual_out=r)

    return cutedsl_kernels(h, dtype, offset, "plain", "fused", launch)


def test_cutedsl_tables_compile_to_the_eager_bits_and_writes():
    k = _cute_table()

    def step(x, res, w):
        y = k.rmsnorm(x, w, EPS)
        y2, r2 = k.fused_add_rmsnorm(x, res, w, EPS)
        return y, y2, r2

    x, r, w = norm_inputs(5, 256, torch.bfloat16)
    assert_traces(step, x, r, w, what="cutedsl table over a launch double")
    assert _written("layer_boundary_cutedsl::fused_add_rmsnorm") == {"residual", "out", "residual_out"}


def test_gpu_only_fusions_trace_on_fake_tensors():
    """The launches need their GPU workspaces; their operators' fakes and declared writes need
    nothing: a graph holding them is built here with fake tensors."""
    import layer_boundary._fusion.symm_mem  # noqa: F401  (registers the operator)
    import layer_boundary_flashinfer.fusion  # noqa: F401
    import layer_boundary_rocm_aiter.fusion  # noqa: F401

    assert _written("layer_boundary::symm_mem_allreduce_add_rmsnorm") == {"residual", "out"}
    with FakeTensorMode():
        x, r, w = torch.empty(4, 64), torch.empty(4, 64), torch.empty(64)
        out = torch.empty(4, 64)
        assert torch.ops.layer_boundary.symm_mem_allreduce_add_rmsnorm(x, r, w, out, EPS, 0.0, None, None, 0) is None
        assert torch.ops.layer_boundary_flashinfer.allreduce_add_rmsnorm(x, r, w, EPS, out, 0) is None
        total = torch.ops.layer_boundary_rocm_aiter.custom_all_reduce(x, 0)
    assert total.shape == (4, 64) and total.dtype == torch.float32


def test_mhc_operators_declare_their_destinations():
    pytest.importorskip("triton")
    import layer_boundary_mhc.triton_ops  # noqa: F401

    assert _written("layer_boundary_mhc::boundary") == {"streams_out", "out", "h_post_out", "h_res_out"}
    assert _written("layer_boundary_mhc::update") == {"out"}


def test_cutedsl_finalize_variant_compiles_to_the_eager_bits():
    """The one-rank MoE finalize + add + norm variant over a launch double: the alignment check
    that eager runs before choosing it moves into the operator under compile."""
    from layer_boundary.plugin_api import finalize_partial_ref
    from layer_boundary_cutedsl.fusion import CuteDslFusion

    launches = []

    def launch(compiled, x, r, w, y, eps, tw, sh):
        launches.append(compiled)
        fused_add_rmsnorm_ref(finalize_partial_ref(x, tw, sh), r, w, eps, weight_offset=1.0, out=y, residual_out=r)

    fusion = CuteDslFusion(compiler=lambda *a, **kw: "variant", launch=launch)
    h, k = 256, 2
    fusion._build((h, torch.bfloat16, 1.0, k, True))  # no GPU: built unchecked, as a CPU build check is
    g = torch.Generator().manual_seed(0)
    experts = torch.randn(3, k, h, generator=g).bfloat16()
    weights = torch.softmax(torch.randn(3, k, generator=g), -1).bfloat16()
    shared = torch.randn(3, h, generator=g).bfloat16()
    w = (torch.rand(h, generator=g) + 0.5).bfloat16()

    def step(experts, weights, shared, residual, w):
        call = fusion.local_kernel(experts, weights, shared, residual, (w, EPS, 1.0))
        assert call is not None
        out = torch.empty_like(residual)
        call(out)
        return out

    residual = torch.randn(3, h, generator=g).bfloat16()
    assert_traces(step, experts, weights, shared, residual, w, what="cutedsl finalize variant")
    # Eager and compiled both ran the variant, never the fallback (torch 2.11 on the H200 runs the
    # operator once more while tracing, so the count is at least two).
    assert len(launches) >= 2 and set(launches) == {"variant"}, launches
    assert _written("layer_boundary_cutedsl::finalize_add_rmsnorm") == {"residual", "out"}
