"""Inputs and checks shared by the MHC plugin's GPU tests (test_mhc_kernels.py,
test_mhc_launch_forms.py)."""

from __future__ import annotations

import torch

from layer_boundary_mhc import MhcStageParams

BF16 = torch.bfloat16


def _ops():
    from layer_boundary_mhc import triton_ops

    return triton_ops


def _params(n: int, c: int, seed: int = 0) -> MhcStageParams:
    p = MhcStageParams(n, c)
    p.init_random(torch.Generator().manual_seed(seed))
    return p.requires_grad_(False).cuda()


def _inputs(t: int, n: int, c: int, dtype, seed: int = 1, stride: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, n, c + stride, generator=g) * 2).to(dtype).cuda()[:, :, :c]
    y = torch.randn(t, c, generator=g).to(dtype).cuda()
    w = (torch.rand(c, generator=g) + 0.5).to(dtype).cuda()
    h_post = (2 * torch.rand(t, n, generator=g)).cuda()
    h_res = torch.softmax(2 * torch.randn(t, n, n, generator=g), dim=-1).cuda()
    return x, y, w, h_post, h_res


def _launch_forms_agree(one, two, t, n, c, dtype, where, config=None) -> bool:
    """One launch against two: the same bits where the finish has the stream pass's warps (and
    True); else the same x' (one stream pass) and False: the caller checks the rest against the
    reference (the finish's own warps reduce in another order: MhcKernelConfig.finish_warps)."""
    from layer_boundary_mhc import MhcKernelConfig
    from layer_boundary_mhc import triton_mhc as tm

    cfg = tm.boundary_config(t, n, c, torch.empty((), dtype=dtype).element_size(), dtype == BF16,
                             config or MhcKernelConfig())
    if cfg.finish_warps == cfg.num_warps:
        assert all(torch.equal(a, b) for a, b in zip(one, two)), f"{where}: one launch != two launches"
        return True
    assert torch.equal(one[0], two[0]), f"{where}: one launch's x' != two launches'"
    return False


def open_and_named_update_read(t: int, n: int, c: int, form, params: MhcStageParams):
    """An update+read of ``t`` tokens (seeded by ``t``) with the launch form left open, and with
    the form named: ``"cluster"`` / ``"split"`` the cluster path (``cluster_ops`` picks the
    variant), else the Triton kernels' ``cooperative=form``. The open-form tests compare the two."""
    from layer_boundary_mhc import triton_ops

    x, y, w, h_post, h_res = _inputs(t, n, c, torch.bfloat16, seed=t)
    auto = triton_ops.mhc_update_read_triton(x, y, h_post, h_res, params, w, 1e-6)
    if form in ("cluster", "split"):
        return auto, triton_ops.mhc_update_read_cluster(x, y, h_post, h_res, params, w, 1e-6)
    return auto, triton_ops.mhc_update_read_triton(x, y, h_post, h_res, params, w, 1e-6, cooperative=form)
