"""MHC as a new engine developer uses it: the mistakes its READMEs invite, each met with an error
that names the fix (the final norm bound without the scheme's exit read; MHC parameters of the
wrong shape or cast to 16 bits by ``model.to``)."""

from __future__ import annotations

import pytest
import torch

mhc = pytest.importorskip(
    "layer_boundary_mhc", reason="the MHC plugin is not installed (pip install -e plugins/mhc)"
)

from layer_boundary import (  # noqa: E402
    BoundaryContext,
    BoundaryError,
    ForwardBatch,
    Topology,
    declare_attn,
    make_stages,
)
from layer_boundary._norms import RMSNorm  # noqa: E402
from layer_boundary.residual import batch as residual_batch  # noqa: E402
from layer_boundary_mhc import MhcSemantics, mhc_read_ref  # noqa: E402
from layer_boundary_mhc.selection import KernelSelection  # noqa: E402

H = 16


def _one_stage(bind: str):
    """A one-stage MHC stack; ``bind``: "exit" (as documented), "plain" (bind_final_norm without
    read=) or "none" (never bound)."""
    ctx = BoundaryContext.discover(Topology.single())
    sem = MhcSemantics(4, seed=1, kernels="torch")
    part = sem.stage(H, dtype=torch.float32)
    (stage,) = make_stages((declare_attn(update=part.update, read=part.read), RMSNorm(H)), terminal=True,
                           context=ctx)
    norm = RMSNorm(H)
    if bind == "exit":
        residual_batch.bind_final_norm(norm, context=ctx, read=sem.exit(H, dtype=torch.float32).read)
    elif bind == "plain":
        residual_batch.bind_final_norm(norm, context=ctx)
    ctx.freeze()
    fb = ForwardBatch(num_tokens=3)
    residual_batch.start(fb)
    h = stage.prepare(torch.randn(3, H), fb)
    h = stage.finish(torch.tanh(h), fb)
    return residual_batch.norm(h, fb, norm)


def test_final_norm_with_exit_read_collapses_streams():
    assert tuple(_one_stage("exit").shape) == (3, H)


@pytest.mark.parametrize("bind", ["plain", "none"])
def test_final_norm_without_exit_read_names_the_fix(bind):
    # Before: the plain read normalized each of the 4 streams and returned [3, 4, H] silently.
    with pytest.raises(BoundaryError, match=r"bind_final_norm\(norm, context=context, read=final.read\)"):
        _one_stage(bind)


def _params(**replace):
    part = MhcSemantics(4, seed=1, kernels="torch").stage(H, dtype=torch.float32)
    for name, value in replace.items():
        setattr(part.params, name, torch.nn.Parameter(value))
    return part.params


@pytest.mark.parametrize("name,value", [
    ("b_pre", torch.zeros(1)),  # broadcast silently before
    ("alpha", torch.zeros(1)),  # IndexError before
    ("phi", torch.zeros(4 * H, 16)),  # a reshape error about [T, 4, 4] before
])
def test_wrong_parameter_shape_names_the_parameter(name, value):
    params = _params(**{name: value})
    with pytest.raises(ValueError, match=rf"MHC parameter {name} has shape"):
        mhc_read_ref(torch.randn(2, 4, H), params, torch.ones(H), 1e-6)


def test_parameters_cast_to_bf16_are_refused_on_the_reference():
    params = _params()
    params.to(torch.bfloat16)  # what model.to(torch.bfloat16) does to them
    with pytest.raises(ValueError, match=r"phi is bfloat16, expected float32 .*model.to\(dtype\)"):
        mhc_read_ref(torch.randn(2, 4, H).to(torch.bfloat16), params, torch.ones(H), 1e-6)


def test_parameters_cast_to_bf16_are_refused_before_the_kernels():
    params = _params()
    read = MhcSemantics(4, kernels="torch").stage(H, dtype=torch.float32).read
    read = type(read)(params, read.iters, "torch").bind(RMSNorm(H))
    # Kernels that would serve this call (never reached: the check runs first).
    read.kernels = KernelSelection("auto", object(), "cpu", None)
    streams = torch.randn(2, 4, H).to(torch.bfloat16)
    params.to(torch.bfloat16)
    with pytest.raises(ValueError, match="phi is bfloat16"):
        read.read(streams)


@pytest.mark.parametrize("name", ["alpha", "b_pre", "b_res"])
def test_a_parameter_recast_through_data_is_refused_before_the_kernels(name):
    """A ``.data`` assignment keeps the parameter object: the kernels' check, done once per set of
    parameters, must still see a recast alpha or bias (found by review: only phi's was keyed)."""
    params = _params()
    read = MhcSemantics(4, kernels="torch").stage(H, dtype=torch.float32).read
    read = type(read)(params, read.iters, "torch").bind(RMSNorm(H))
    read.kernels = KernelSelection("auto", object(), "cpu", None)  # kernels that would serve the call
    streams = torch.randn(2, 4, H).to(torch.bfloat16)
    assert read._triton(streams)  # checked once: float32 parameters pass
    t = getattr(params, name)
    t.data = t.data.to(torch.bfloat16)
    with pytest.raises(ValueError, match=rf"MHC parameter {name} is bfloat16, expected float32"):
        read._triton(streams)


def test_an_mhc_read_of_torch_rmsnorm_without_eps_follows_a_cast_of_the_model():
    # As the core's read: torch.nn.RMSNorm(eps=None) takes its compute dtype's epsilon at each
    # call, so a model built in float64 and cast to float32 (or back) must not keep the first one.
    from torch import nn

    from layer_boundary_mhc.read import _Norm

    norm = nn.RMSNorm(16, dtype=torch.float64)
    read = _Norm(norm)
    assert read.rms()[1] == torch.finfo(torch.float64).eps
    norm.float()
    assert read.rms()[1] == torch.finfo(torch.float32).eps
    fixed = _Norm(nn.RMSNorm(16, eps=1e-6, dtype=torch.float64))
    assert fixed.rms()[1] == 1e-6
