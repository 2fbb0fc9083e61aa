"""The MHC kernels' one-launch form (tickets) against two launches on a GPU: the same bits where the
finish runs with the stream pass's warps (else the same x' and both within the check:
``mhc_gpu._launch_forms_agree``), under ordering pressure, through the joined stream pass, and
with the L2 eviction hints. Each case passes its own ``MhcKernelConfig``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("layer_boundary_mhc", reason="the MHC plugin is not installed (pip install -e plugins/mhc)")

from mhc_gpu import _inputs, _launch_forms_agree, _ops, _params  # noqa: E402

from layer_boundary_mhc import MhcKernelConfig  # noqa: E402
from layer_boundary_mhc.accuracy import assert_matches_reference  # noqa: E402

BF16 = torch.bfloat16
EPS = 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("lag,slice_cols", [(1, 32), (8, 128), (64, 64)], ids=str)
def test_gpu_cooperative_ordering_under_pressure(lag, slice_cols):
    """Many narrow slices and short or long lags: finishes that wait on their stream passes, and
    x' that has left L2, give the two-launch result bitwise."""
    config = MhcKernelConfig(lag=lag, slice_cols=(slice_cols,) * 3)
    ops = _ops()
    x, y, w, hp, hr = _inputs(4099, 4, 2048, BF16, seed=lag)
    p = _params(4, 2048, seed=3)
    for _ in range(3):
        coop = ops.mhc_update_read_triton(x, y, hp, hr, p, w, EPS, cooperative=True, config=config)
        two = ops.mhc_update_read_triton(x, y, hp, hr, p, w, EPS, cooperative=False, config=config)
        assert all(torch.equal(a, b) for a, b in zip(coop, two))


JOINED_CASES = [(rows, t, n, c) for rows in (1, 2)
                for (t, n, c) in ((8192, 4, 4096), (4099, 4, 2048), (300, 3, 1000), (64, 8, 512), (17, 2, 129))]


@pytest.mark.gpu
@pytest.mark.parametrize("rows,t,n,c", JOINED_CASES, ids=str)
def test_gpu_joined_stream_pass_and_one_launch_form(rows, t, n, c):
    """bf16 streams through ``stream_joined`` in every bucket, strided streams at T = 17, finishes of
    one token at a time or two: within the check; the one-launch form gives the two-launch bits,
    repeatedly."""
    config = MhcKernelConfig(joined=(1, 1, 1), finish_rows=rows)
    ops = _ops()
    x, y, w, hp, hr = _inputs(t, n, c, BF16, seed=t, stride=3 if t == 17 else 0)
    p = _params(n, c, seed=5)
    kw = dict(y=y, h_post=hp, h_res=hr, params=p, norm_weight=w, norm_eps=EPS)
    two = ops.mhc_update_read_triton(x, y, hp, hr, p, w, EPS, cooperative=False, config=config)
    assert_matches_reference("update+read", two, x, where=f"T={t} n={n} C={c}", **kw)
    for _ in range(3):
        one = ops.mhc_update_read_triton(x, y, hp, hr, p, w, EPS, cooperative=True, config=config)
        if not _launch_forms_agree(one, two, t, n, c, BF16, f"T={t} n={n} C={c}", config):
            assert_matches_reference("update+read", one, x, where=f"T={t} n={n} C={c} one launch", **kw)
    assert_matches_reference("read", ops.mhc_read_triton(x, p, w, EPS, config=config), x, where=f"T={t} read", **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("lag,evict,rows", [(1, 1, 1), (1, 0, 1), (1, 1, 4), (2, 1, 2)], ids=str)
@pytest.mark.parametrize("t,c", [(8192, 4096), (4099, 2048), (1100, 7168)], ids=str)
def test_gpu_short_lag_and_l2_hints(lag, evict, rows, t, c):
    """The one launch finishing a block one or two rounds back, four tokens a program, with and
    without the L2 eviction hints: the two-launch bits, which pass the check with the hints as
    without."""
    config = MhcKernelConfig(joined=(1, 1, 1), lag=lag, evict=(evict,) * 3, finish_tokens=4, finish_rows=rows)
    ops = _ops()
    x, y, w, hp, hr = _inputs(t, 4, c, BF16, seed=t + lag)
    p = _params(4, c, seed=6)
    two = ops.mhc_update_read_triton(x, y, hp, hr, p, w, EPS, cooperative=False, config=config)
    assert_matches_reference("update+read", two, x, where=f"T={t} C={c}", y=y, h_post=hp, h_res=hr, params=p,
                             norm_weight=w, norm_eps=EPS)
    for _ in range(3):
        one = ops.mhc_update_read_triton(x, y, hp, hr, p, w, EPS, cooperative=True, config=config)
        if not _launch_forms_agree(one, two, t, 4, c, BF16, f"T={t} C={c}", config):
            assert_matches_reference("update+read", one, x, where=f"T={t} C={c} one launch", y=y, h_post=hp,
                                     h_res=hr, params=p, norm_weight=w, norm_eps=EPS)
