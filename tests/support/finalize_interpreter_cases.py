"""The fused MoE finalize kernel (one rank) under Triton's interpreter, on CPU tensors.

Run by tests/gpu/test_moe_finalize_fusion.py in a subprocess with TRITON_INTERPRET=1 (see
triton_interpreter_cases.py for why). One rank needs no symmetric memory: the workspace is made
of plain CPU tensors, and the kernel's one-rank branch never touches its peer buffers.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run with TRITON_INTERPRET=1 (tests/gpu/test_moe_finalize_fusion.py does)", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from layer_boundary._fusion.moe_finalize import finalize_partial_ref  # noqa: E402
from layer_boundary._fusion.symm_mem import SymmWorkspace, launch  # noqa: E402
from layer_boundary._kernels.reference import fused_add_rmsnorm_ref  # noqa: E402

EPS = 1e-6


def _workspace(rows: int) -> SymmWorkspace:
    none = torch.zeros(1, dtype=torch.int64)
    return SymmWorkspace(torch.empty(0), none.int(), none, none, torch.zeros(4, dtype=torch.int32),
                         0, 1, 4, rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,k,h,shared,offset", [(1, 2, 64, False, 1.0), (5, 3, 96, True, 1.0),
                                                 (9, 1, 40, True, 0.0)])
def test_finalize_add_norm_matches_the_reference(dtype, t, k, h, shared, offset):
    g = torch.Generator().manual_seed(t * 100 + k)
    # A [T, k + 1, H] buffer sliced to k slots: the row stride is not k * H.
    expert = torch.randn(t, k + 1, h, generator=g).to(dtype)[:, :k]
    weights = torch.rand(t, k, generator=g).to(dtype)
    sh = torch.randn(t, h, generator=g).to(dtype) if shared else None
    residual = torch.randn(t, h, generator=g).to(dtype)
    w = (torch.rand(h, generator=g) - 0.5).to(dtype)
    want_y, want_r = fused_add_rmsnorm_ref(finalize_partial_ref(expert, weights, sh), residual.clone(), w,
                                           EPS, weight_offset=offset)
    out = torch.empty_like(residual)
    launch(_workspace(t), expert, residual, w, out, EPS, offset, topk_weights=weights, shared=sh)
    atol = 2e-2 if dtype is torch.bfloat16 else 1e-5
    torch.testing.assert_close(residual, want_r, atol=atol, rtol=atol)
    torch.testing.assert_close(out, want_y, atol=atol, rtol=atol)


def test_one_rank_plain_contribution_adds_and_normalizes():
    g = torch.Generator().manual_seed(3)
    x, residual = torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)
    w = torch.rand(64, generator=g)
    want_y, want_r = fused_add_rmsnorm_ref(x, residual.clone(), w, EPS)
    out = torch.empty_like(x)
    launch(_workspace(4), x, residual, w, out, EPS, 0.0)
    torch.testing.assert_close(residual, want_r)
    torch.testing.assert_close(out, want_y, atol=1e-5, rtol=1e-5)
