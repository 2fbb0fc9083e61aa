"""The persistent variant of the MHC cluster kernel (``layer_boundary_mhc.cute_persistent``: phi
resident in shared memory, clusters that take 16-token blocks in turn, two blocks in flight).

On the CPU: its shape plan and refusals and, where the CuTe DSL imports, the sm_90a compile (one
mma.sync chain per stream and chunk, the sums of squares from two more, pushed exchanges only). On an
H200 (``-m gpu``): every output against the reference, bitwise replays, x' bit for bit the cluster
kernel's (the same mix), block counts below, at and above the resident clusters. CUDA-graph
capture: ``test_mhc_cluster.test_gpu_cluster_under_cuda_graph_capture[persistent]``.
"""

from __future__ import annotations

import re

import pytest
import torch

from layer_boundary_mhc import MhcKernelConfig, cluster_ops
from layer_boundary_mhc.cluster_shape import SMEM_LIMIT, PersistentShape


def test_persistent_shape_plan_and_refusals():
    s = PersistentShape(4, 4096, True, 20)
    assert (s.cl, s.bt, s.hs, s.groups, s.gpw, s.nt, s.problem) == (16, 16, 256, 8, 1, 3, "")
    assert s.group_slot == 5 * 16 * 64 and s.slot_bytes == 8 * s.group_slot  # x and y of the next block
    assert s.phi_bytes == 144 * 1024 and s.xr_bytes == 32 * 1024 and s.smem <= SMEM_LIMIT
    assert s.coef_row == 80  # 20 coefficients, 5 units: rows g = 0..7 start in distinct bank quads
    assert PersistentShape(3, 2048, False, 20).problem == "" and PersistentShape(2, 1024, True, 20).problem == ""
    assert "phi's slice alone" in PersistentShape(4, 7168, True, 20).problem  # 252 KiB of phi
    assert "multiple of 1024" in PersistentShape(4, 4000, True, 20).problem
    assert "2 to 4" in PersistentShape(5, 4096, True, 20).problem
    assert "warps" in PersistentShape(4, 4096, True, 20, warps=3).problem
    # 16 warps: half stream nothing (8 groups), and have no slots; the partials reduce through 4 slots
    w16 = PersistentShape(4, 4096, True, 20, warps=16)
    assert (w16.gpw, w16.wslots, w16.slot_bytes, w16.problem) == (1, 4, s.slot_bytes, "") and w16.smem <= SMEM_LIMIT
    assert "at most 2 groups" in PersistentShape(4, 4096, True, 20, warps=2).problem  # 4 groups a warp
    assert "warps" in PersistentShape(4, 4096, True, 20, warps=10).problem  # 10 is not a multiple of 4 slots


@pytest.mark.parametrize("n,c", [(4, 4096), (3, 2048), (2, 1024)])
def test_resident_phi_order_gives_each_lane_adjacent_columns(n, c):
    # The resident copy, gathered from phi_fragments piece by piece: k-step s of group u, lane (g, q),
    # value e is phi's part at column 32 u + 8 q + 4 s + e of its stream (coefficient 8 nt + g).
    from layer_boundary_mhc.cluster_shape import resident_piece

    torch.manual_seed(0)
    k = n * n + 2 * n
    phi = torch.randn(n * c, k)
    frags = cluster_ops.phi_fragments(phi, n)  # [C / 16, n, 3, NT, 8, 4, 4]
    nt = frags.shape[3]
    pieces = frags.view(-1, 4)  # 8 bytes: the 4 values of a lane
    resident = pieces[resident_piece(torch.arange(pieces.shape[0]), n * 3 * nt)].view(frags.shape)
    hi = (phi.view(torch.int32) & -65536).view(torch.float32)
    ch, i, nti, g, q, e = (torch.arange(v).view([-1] + [1] * (5 - d)) for d, v in
                           enumerate((c // 16, n, nt, 8, 4, 4)))
    col = 32 * (ch // 2) + 8 * q + 4 * (ch % 2) + e
    coef = (8 * nti + g).expand(c // 16, n, nt, 8, 4, 4)
    rows = (i * c + col).expand(coef.shape)
    live = coef < k
    want = torch.where(live, hi[rows, coef.clamp(max=k - 1)], torch.zeros(()))
    assert torch.equal(resident[:, :, 0].float(), want.to(torch.bfloat16).float())


def test_settings_that_change_the_kernel_change_its_cache_key():
    # A compiled kernel is looked up by its shape: every compile-time setting must be part of the key
    # (settings of the persistent variant once were not, and variants shared a kernel).
    shapes = [PersistentShape(4, 4096, True, 20), PersistentShape(4, 4096, True, 20, warps=16),
              PersistentShape(4, 4096, True, 10), PersistentShape(4, 4096, False, 20)]
    assert len({cluster_ops._key(s) for s in shapes}) == 4
    assert cluster_ops._key(shapes[0]) == cluster_ops._key(PersistentShape(4, 4096, True, 20))
    assert cluster_ops._key(cluster_ops.cluster_shape(4, 4096, True)) != cluster_ops._key(shapes[0])


def test_calls_take_the_persistent_variant_from_its_token_count():
    from layer_boundary_mhc import cluster_ops

    config = MhcKernelConfig(persistent_tokens=512, split_tokens=0)  # the split variant comes first by default
    assert cluster_ops._variant(512, 4, 4096, True, 20, config).persistent
    assert not cluster_ops._variant(511, 4, 4096, True, 20, config).persistent
    # where phi's slice does not fit, the cluster kernel (Sinkhorn after it) serves large calls
    wide = cluster_ops._variant(8192, 4, 7168, True, 20, config)
    assert not wide.persistent and not wide.sinkhorn
    assert not cluster_ops._variant(8192, 4, 4096, True, 20, MhcKernelConfig(split_tokens=0)).persistent


def _cute():
    from test_mhc_cluster import _cute as cute_module

    return cute_module("cute_persistent")


@pytest.mark.parametrize("n,c,update", [(4, 4096, True), (3, 2048, False), (2, 1024, True)])
def test_persistent_kernel_compiles_for_sm90a(n, c, update, tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    mod = _cute()
    shape = PersistentShape(n, c, update, 20, warps=MhcKernelConfig().persistent_warps)
    ptx = mod.compile_persistent(shape, str(tmp_path)).__ptx__
    assert ".target sm_90a" in ptx
    # per group of a warp, stream and k-step (2): 3 parts x NT n-tiles, and 2 for the sums of squares
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16", ptx)) == shape.gpw * n * 2 * (3 * shape.nt + 2)
    assert "ld.shared::cluster" not in ptx and "st.shared::cluster" not in ptx
    # one cluster barrier: arrived at the start, waited for before the first push
    assert re.findall(r"barrier\.cluster\.\w+", ptx) == ["barrier.cluster.arrive", "barrier.cluster.wait"]
    assert len(re.findall(r"mbarrier\.init", ptx)) == 6
    assert f".reqntid {32 * shape.warps}" in ptx  # the stream warps alone: warp 0 computes the coefficients
    # 16-byte stores: x' (only by an update: each stream, row g and g + 8 of each group) and the read's input
    outs = (shape.bt // shape.warps) * -(-shape.units // 32)
    assert len(re.findall(r"st\.global\.v4\.b32", ptx)) == (shape.gpw * n * 2 if update else 0) + outs
    assert "st.global.v2" not in ptx
    # phi's fragments gathered at the start in 8-byte pieces (the groups' lane order)
    assert re.search(r"cp\.async\.ca\.shared\.global \[[^]]+\], \[[^]]+\], 8;", ptx)
    # x and y by cp.async into per-warp slots (no stage ring), x' back from L2 (not kept in shared
    # memory) for the combination
    assert "cp.async.wait_group" not in ptx and "cp.async.wait_all" in ptx
    assert "ld.global.cg.v4.b32" in ptx and "st.shared.v2" not in ptx


# -- GPU ---------------------------------------------------------------------------------------------

def _gpu_ready():
    from test_mhc_cluster import _gpu_ready as cluster_ready

    cluster_ready()
    _cute()


# 8192: 512 blocks over the resident clusters; 1100: a ragged last block; 97: fewer blocks than clusters.
CASES = [(8192, 4, 4096), (1100, 4, 4096), (600, 3, 2048), (97, 2, 1024), (16, 4, 4096)]


PERSISTENT = MhcKernelConfig(persistent_tokens=1, split_tokens=0)  # the variant itself, not the default


def checked_run(t, n, c, op, what, config=PERSISTENT):
    """The persistent variant (or the split one: a ``config`` that sends ``t`` tokens to either) on
    ``bench``-like inputs: checked against the reference, replayed bit for bit. Returns its outputs
    and the call (``run(config)``: the same inputs under another config)."""
    from mhc_gpu import _inputs, _params

    from layer_boundary_mhc import accuracy, cluster_ops

    params = _params(n, c)
    x, y, w, h_post, h_res = _inputs(t, n, c, torch.bfloat16, stride=8)

    def run(cfg=config):
        if op == "read":
            return cluster_ops.mhc_read_cluster(x, params, w, 1e-6, norm_offset=1.0, config=cfg)
        return cluster_ops.mhc_update_read_cluster(x, y, h_post, h_res, params, w, 1e-6, norm_offset=1.0,
                                                   config=cfg)

    assert cluster_ops._variant(t, n, c, op != "read", 20, config).persistent
    got, again = run(), run()
    kw = {} if op == "read" else dict(y=y, h_post=h_post, h_res=h_res)
    accuracy.assert_matches_reference(op, got, x, params=params, norm_weight=w, norm_eps=1e-6, norm_offset=1.0,
                                      where=f"{what} T={t} n={n} C={c}", **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "replays differ"
    return got, run


@pytest.mark.gpu
@pytest.mark.parametrize("t,n,c", CASES, ids=str)
@pytest.mark.parametrize("op", ["update+read", "read"])
def test_gpu_persistent_matches_reference(t, n, c, op):
    _gpu_ready()
    got, run = checked_run(t, n, c, op, "persistent")
    if op == "update+read":
        cluster = run(MhcKernelConfig(split_tokens=0))
        assert torch.equal(cluster[0], got[0]), "x' differs from the cluster kernel's (the same mix)"


@pytest.mark.gpu
def test_gpu_persistent_takes_coefficient_rows_off_16_byte_boundaries():
    # The variant copies H_post and H_res rows 16 bytes at a time at n = 4; views that start 4 bytes
    # past a boundary go through an aligned copy and give the same bits.
    _gpu_ready()
    from mhc_gpu import _inputs, _params

    from layer_boundary_mhc import cluster_ops

    t, n, c = 300, 4, 4096
    params = _params(n, c)
    x, y, w, h_post, h_res = _inputs(t, n, c, torch.bfloat16, stride=8)
    off_post = torch.empty(t * n + 1, device=x.device)[1:].view(t, n)
    off_res = torch.empty(t * n * n + 1, device=x.device)[1:].view(t, n, n)
    off_post.copy_(h_post)
    off_res.copy_(h_res)
    assert off_post.data_ptr() % 16 and off_res.data_ptr() % 16
    got = cluster_ops.mhc_update_read_cluster(x, y, h_post, h_res, params, w, 1e-6, norm_offset=1.0, config=PERSISTENT)
    off = cluster_ops.mhc_update_read_cluster(x, y, off_post, off_res, params, w, 1e-6, norm_offset=1.0,
                                              config=PERSISTENT)
    assert all(torch.equal(a, b) for a, b in zip(got, off))
