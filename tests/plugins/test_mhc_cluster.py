"""The MHC cluster kernel (``layer_boundary_mhc.cute_cluster``, CuTe DSL, one thread-block cluster per
token block with x' kept in shared memory).

On the CPU: phi's fragment layout against the mma.sync register mapping the kernel uses (emulated
from the PTX definition of m16n8k16), the shape plan and its refusals, and, where the CuTe DSL
imports, the sm_90a compile. On an H200 (``-m gpu``): every output against the reference within the
tolerance table, bitwise replays, CUDA-graph capture, and the Triton kernels' results.
"""

from __future__ import annotations

import re

import pytest
import torch

from layer_boundary_mhc import MhcKernelConfig
from layer_boundary_mhc.cluster_ops import cluster_shape, phi_fragments
from layer_boundary_mhc.cluster_shape import ClusterShape
from layer_boundary_mhc.projection import bf16_parts


def _lane_fragments(xt: torch.Tensor, frag: torch.Tensor, ch: int, i: int, part: int, nt: int):
    """The A matrix (16 x 16, k slots) and B matrix (16 x 8) that mma.sync sees when each lane
    ``(g, q)`` passes the kernel's registers: x' rows g, g + 8 at columns 4q .. 4q + 3 of chunk
    ``ch`` (``xt``: [16, C] of one stream), and phi's fragment words."""
    a = torch.zeros(16, 16, dtype=torch.float64)
    b = torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        g, q = lane // 4, lane % 4
        cols = [16 * ch + 4 * q + e for e in range(4)]
        regs = [(g, cols[0:2]), (g + 8, cols[0:2]), (g, cols[2:4]), (g + 8, cols[2:4])]
        # PTX m16n8k16 A: a0 = (row g, k 2q, 2q+1), a1 = (g+8, same), a2 = (g, k 2q+8, +9), a3 = (g+8, ...)
        slots = [(g, 2 * q), (g + 8, 2 * q), (g, 2 * q + 8), (g + 8, 2 * q + 8)]
        for (row, c2), (srow, k0) in zip(regs, slots):
            assert row == srow
            a[row, k0], a[row, k0 + 1] = float(xt[row, c2[0]]), float(xt[row, c2[1]])
        # B: b0 = (k 2q, 2q+1; n g), b1 = (k 2q+8, 2q+9; n g)
        vals = frag[ch, i, part, nt, g, q].double()
        b[2 * q, g], b[2 * q + 1, g], b[2 * q + 8, g], b[2 * q + 9, g] = vals
    return a, b


@pytest.mark.parametrize("n,c", [(4, 64), (3, 32), (2, 48)])
def test_phi_fragments_follow_the_kernels_mma_mapping(n, c):
    g = torch.Generator().manual_seed(n * c)
    k = n * n + 2 * n
    phi = torch.randn(n * c, k, generator=g) * 0.02
    xs = torch.randn(n, 16, c, generator=g).to(torch.bfloat16)
    frag = phi_fragments(phi, n)
    nt_count = (k + 7) // 8
    assert frag.shape == (c // 16, n, 3, nt_count, 8, 4, 4) and frag.dtype == torch.bfloat16
    # The three parts sum to phi bit for bit, as projection.bf16_parts does.
    parts = frag.permute(2, 1, 0, 5, 6, 3, 4).reshape(3, n * c, 8 * nt_count).double()
    assert torch.equal(parts.sum(0)[:, :k], phi.double()) and not parts[:, :, k:].any()
    np_ = 4 if n > 2 else 2
    kp = max(16, 1 << k.bit_length())
    joined = bf16_parts(phi, n, np_, kp).view(3, c, np_, kp)[:, :, :n, :k].permute(0, 2, 1, 3).reshape(3, n * c, k)
    assert torch.equal(parts[:, :, :k].to(torch.bfloat16), joined)
    want = sum(xs[i].double() @ phi[i * c:(i + 1) * c].double() for i in range(n))  # [16, K]
    got = torch.zeros(16, 8 * nt_count, dtype=torch.float64)
    for ch in range(c // 16):
        for i in range(n):
            for part in range(3):
                for nt in range(nt_count):
                    a, b = _lane_fragments(xs[i], frag, ch, i, part, nt)
                    got[:, 8 * nt:8 * nt + 8] += a @ b
    assert torch.allclose(got[:, :k], want, rtol=0, atol=1e-12), (got[:, :k] - want).abs().max()


def test_shape_plan_and_refusals():
    s = cluster_shape(4, 4096, True)
    assert (s.cl, s.bt, s.ctas, s.hs, s.nch, s.k, s.nt, s.problem) == (16, 32, 2, 256, 16, 24, 3, "")
    assert s.xr_bytes == 64 * 1024 and 2 * (s.smem + 1024) <= 228 * 1024 and s.stages >= 2
    one = ClusterShape(4, 4096, 16, 64, True, 20)
    assert one.xr_bytes == 128 * 1024 and one.smem <= 227 * 1024 and one.problem == ""
    wide = cluster_shape(4, 7168, True)  # 32 tokens x 448 columns do not fit two CTAs an SM
    assert (wide.cl, wide.bt, wide.ctas, wide.problem) == (16, 32, 1, "")
    assert cluster_shape(2, 2048, False).problem == ""
    assert "2 to 4" in ClusterShape(8, 4096, 16, 64, True, 20).problem
    assert "2 to 4" in ClusterShape(1, 4096, 16, 64, True, 20).problem  # compiles, never ran on a GPU
    assert "multiple of 256" in ClusterShape(4, 4000, 16, 64, True, 20).problem
    assert "shared memory" in ClusterShape(4, 8192, 16, 64, True, 20).problem
    assert cluster_shape(4, 1000, True).problem  # no cluster of 16 or 8 divides it into 16-column chunks


class _FakeCudaStreams:
    """Stands in for bf16 CUDA streams [T, n, C] (what ``cluster_ops.takes`` reads of a tensor)."""

    def __init__(self, t: int, n: int = 4, c: int = 4096, aligned: bool = True) -> None:
        self.shape = (t, n, c)
        self.dtype = torch.bfloat16
        self.is_cuda = True
        self.device = torch.device("cuda", 0)
        self._ptr = 0 if aligned else 8

    def stride(self, dim=None):
        strides = (self.shape[1] * self.shape[2], self.shape[2], 1)
        return strides if dim is None else strides[dim]

    def data_ptr(self) -> int:
        return self._ptr


def stand_in_dispatch(compiled: list, y: object, compile=None):
    """A ``cluster_ops.Dispatch`` whose device checks and compiler are stood in for: every device
    accepted, compiles recorded in ``compiled`` (or ``compile``), no capture, rows aligned where the
    fake pointer is (``y``: the stage output of an update, only its presence counts)."""
    from layer_boundary_mhc import cluster_ops

    return cluster_ops.Dispatch(problem=lambda x, *a, **k: "",
                                compile=compile or (lambda shape: compiled.append((shape.c, shape.sinkhorn))),
                                rows_ok=lambda v: v is y or v.data_ptr() % 16 == 0, capturing=lambda: False)


def test_open_calls_dispatch_by_token_count_and_fall_back_when_the_kernel_fails():
    """cluster_ops.takes on the CPU, with the device checks and the compiler stood in for."""
    compiled = []
    y = object()
    d = stand_in_dispatch(compiled, y)
    default = MhcKernelConfig()
    lo, hi = default.read_tokens
    reads = {t: d.takes(_FakeCudaStreams(t), None, None, _FakeCudaStreams(t), 20) for t in (lo, hi, hi + 1)}
    assert reads == {lo: True, hi: True, hi + 1: False}
    lo, hi = default.update_read_tokens
    got = {t: d.takes(_FakeCudaStreams(t), y, None, _FakeCudaStreams(t), 20) for t in (lo - 1, lo, 128, hi, hi + 1)}
    assert got == {lo - 1: False, lo: True, 128: True, hi: True, hi + 1: False}
    assert compiled == [(4096, True), (4096, True)]  # the read and the update variant, each compiled once
    # Past sinkhorn_after_tokens a call runs (and so is decided on) the variant without the Sinkhorn.
    after = default.sinkhorn_after_tokens
    wide = MhcKernelConfig(update_read_tokens=(1, 4 * after))
    assert d.takes(_FakeCudaStreams(after), y, None, _FakeCudaStreams(after), 20, wide)
    assert compiled[2:] == [(4096, False)]
    assert not d.takes(_FakeCudaStreams(after), y, None, _FakeCudaStreams(after), 20)  # not by default
    assert not d.takes(_FakeCudaStreams(128, aligned=False), y, None, _FakeCudaStreams(128), 20)
    assert not d.takes(_FakeCudaStreams(128), y, None, _FakeCudaStreams(128), 20,
                       MhcKernelConfig(update_read_tokens=(0, -1)))  # none sent to the cluster kernel

    def broken(shape):
        raise RuntimeError("no cubin for this driver")

    d = stand_in_dispatch(compiled, y, compile=broken)
    with pytest.warns(UserWarning, match="no cubin for this driver"):
        assert not d.takes(_FakeCudaStreams(128, c=2048), y, None, _FakeCudaStreams(128, c=2048), 20)
    assert not d.takes(_FakeCudaStreams(128, c=2048), y, None, _FakeCudaStreams(128, c=2048), 20)  # no retry


def _cute(module: str = "cute_cluster"):
    """``layer_boundary_mhc.<module>`` (a CuTe DSL kernel module), or a skip where it cannot import."""
    import importlib

    try:
        return importlib.import_module(f"layer_boundary_mhc.{module}")
    except Exception as e:
        pytest.skip(f"the CuTe DSL is not importable here ({type(e).__name__}: {e})")


@pytest.mark.parametrize("n,c,update", [(4, 4096, True), (4, 7168, True), (3, 2048, False)])
def test_cluster_kernel_compiles_for_sm90a(n, c, update, tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    mod = _cute()
    shape = cluster_shape(n, c, update)
    ptx = mod.compile_cluster(shape, str(tmp_path)).__ptx__
    assert ".target sm_90a" in ptx
    streams_per_warp = -(-n // shape.kh)
    # One k16 step a stream and chunk: 3 parts x NT n-tiles of mma.sync, in the chunk loop (two
    # chunks an iteration).
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ptx)) == \
        2 * streams_per_warp * 3 * shape.nt
    assert "barrier.cluster.arrive" in ptx and "mapa.shared::cluster" in ptx
    assert ("st.global.v2.b32" in ptx) == update  # x' is stored only by an update
    # phi's fragments come with the stages, never from L2 per warp
    assert shape.stage_bytes == shape.sx + shape.sy + shape.phi_chunk
    assert "ld.global.nc.v2.b32" not in ptx and "cp.async.cg.shared.global" in ptx


def test_the_sinkhorn_leaves_the_kernel_at_prefill_sizes(tmp_path, monkeypatch):
    """From SINKHORN_AFTER_TOKENS tokens the kernel stores H_res's logits, without the Sinkhorn loop
    (its 2 n shuffles by index and 2 divisions a column-and-row step), and
    ``finish.sinkhorn_kernel`` follows."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    mod = _cute()
    counts = {}
    for sinkhorn in (True, False):
        shape = cluster_shape(4, 4096, True, 20, sinkhorn=sinkhorn)
        assert shape.sinkhorn is sinkhorn and not shape.problem
        (tmp_path / str(sinkhorn)).mkdir()
        ptx = mod.compile_cluster(shape, str(tmp_path / str(sinkhorn))).__ptx__
        counts[sinkhorn] = (len(re.findall(r"shfl\.sync\.idx", ptx)), len(re.findall(r"div\.full\.f32", ptx)))
    assert counts[True][0] - counts[False][0] == 2 * 4 and counts[True][1] - counts[False][1] == 2


def test_pushed_exchanges_compile_without_cluster_loads_or_gpu_fences(tmp_path, monkeypatch):
    """push (the default): partials, H_pre and the norms' sums are st.async stores completing the receivers'
    mbarriers; one cluster barrier (arrive at the start, wait before the first store), no remote
    loads, and no barrier.cluster around the exchanges."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    mod = _cute()
    shape = ClusterShape(4, 4096, 16, 32, True, 20, ctas=2, push=True)
    assert not shape.problem
    ptx = mod.compile_cluster(shape, str(tmp_path)).__ptx__
    assert "ld.shared::cluster" not in ptx and "st.shared::cluster" not in ptx
    assert re.findall(r"barrier\.cluster\.\w+", ptx) == ["barrier.cluster.arrive", "barrier.cluster.wait"]
    assert len(re.findall(r"mbarrier\.init", ptx)) == 3 and len(re.findall(r"mbarrier\.try_wait", ptx)) == 3
    # per thread: partials (BT x (K + 1) cells over the threads), H_pre to 16 CTAs, 4 tokens' sums to 16
    assert len(re.findall(r"st\.async", ptx)) == -(-32 * 25 // 256) + 16 + 4 * 16


# -- GPU ---------------------------------------------------------------------------------------------

def _gpu_ready():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    _cute()


CASES = [(8192, 4, 4096), (1, 4, 4096), (100, 4, 4096), (1100, 4, 7168), (333, 2, 2048), (70, 3, 1024)]


@pytest.mark.gpu
@pytest.mark.parametrize("t,n,c", CASES, ids=str)
@pytest.mark.parametrize("op", ["update+read", "read"])
def test_gpu_cluster_matches_reference(t, n, c, op):
    _gpu_ready()
    from mhc_gpu import _inputs, _params

    from layer_boundary_mhc import accuracy, triton_ops

    params = _params(n, c)
    x, y, w, h_post, h_res = _inputs(t, n, c, torch.bfloat16, stride=8)
    if op == "read":
        got = triton_ops.mhc_read_cluster(x, params, w, 1e-6, norm_offset=1.0)
        again = triton_ops.mhc_read_cluster(x, params, w, 1e-6, norm_offset=1.0)
        kw = {}
    else:
        got = triton_ops.mhc_update_read_cluster(x, y, h_post, h_res, params, w, 1e-6, norm_offset=1.0)
        again = triton_ops.mhc_update_read_cluster(x, y, h_post, h_res, params, w, 1e-6, norm_offset=1.0)
        kw = dict(y=y, h_post=h_post, h_res=h_res)
    accuracy.assert_matches_reference(op, got, x, params=params, norm_weight=w, norm_eps=1e-6, norm_offset=1.0,
                                      where=f"cluster T={t} n={n} C={c}", **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "replays differ"
    if op == "update+read":
        from layer_boundary_mhc import triton_ops

        tri = triton_ops.mhc_update_read_triton(x, y, h_post, h_res, params, w, 1e-6, norm_offset=1.0)
        # The same mix and rounding; where the compiler fuses another product of the sum into the
        # first FMA (Triton's choice), an element can round the other way: rarely, by one ulp.
        differ = tri[0] != got[0]
        assert differ.float().mean() < 1e-3, f"x' differs from the Triton kernel's in {int(differ.sum())} elements"


@pytest.mark.gpu
@pytest.mark.parametrize("t,n,c,op", [(1, 4, 4096, "update+read"), (100, 4, 4096, "update+read"),
                                      (1100, 4, 7168, "update+read"), (333, 2, 2048, "read"), (70, 3, 1024, "read")],
                         ids=str)
def test_gpu_pushed_exchanges_give_the_same_bits(t, n, c, op):
    """push=True (mbarrier-signalled st.async exchanges) sums the same partials in the same order as
    the cluster barriers' form (push=False): every output bit for bit, with and without the
    Sinkhorn in the kernel."""
    _gpu_ready()
    from mhc_gpu import _inputs, _params

    from layer_boundary_mhc import triton_ops

    params = _params(n, c)
    x, y, w, h_post, h_res = _inputs(t, n, c, torch.bfloat16, seed=t)

    def run(config):
        if op == "read":
            return triton_ops.mhc_read_cluster(x, params, w, 1e-6, config=config)
        return triton_ops.mhc_update_read_cluster(x, y, h_post, h_res, params, w, 1e-6, config=config)

    barriers = run(MhcKernelConfig(push=False))
    pushed = run(MhcKernelConfig(push=True))
    assert all(torch.equal(a, b) for a, b in zip(barriers, pushed))


@pytest.mark.gpu
@pytest.mark.parametrize("persistent_tokens", [0, 512], ids=["cluster", "persistent"])
def test_gpu_cluster_under_cuda_graph_capture(persistent_tokens):
    """Captured and replayed: the same bits as eager, for the cluster kernel and (from
    persistent_tokens, the split variant off) its persistent variant, both prepared before the
    capture."""
    _gpu_ready()
    from mhc_gpu import _inputs, _params

    from layer_boundary_mhc import cluster_ops, triton_ops

    config = MhcKernelConfig(persistent_tokens=persistent_tokens, split_tokens=0)
    t, n, c = 4096, 4, 4096
    params = _params(n, c)
    x, y, w, h_post, h_res = _inputs(t, n, c, torch.bfloat16)
    cluster_ops.prepare_cluster(n, c, config=config)
    assert cluster_ops._variant(t, n, c, True, 20, config).persistent == bool(persistent_tokens)
    eager = triton_ops.mhc_update_read_cluster(x, y, h_post, h_res, params, w, 1e-6, config=config)
    outs = _captured_and_replayed(eager, lambda o: triton_ops.mhc_update_read_cluster(
        x, y, h_post, h_res, params, w, 1e-6, streams_out=o[0], out=o[1], h_post_out=o[2], h_res_out=o[3],
        config=config))
    assert all(torch.equal(a, b) for a, b in zip(eager, outs))


def _captured_and_replayed(like, call, capture_context=None):
    """``call(outs)`` captured in a CUDA graph (inside ``capture_context``) into buffers shaped as
    ``like``, replayed once: the buffers."""
    import contextlib

    outs = [torch.empty_like(v) for v in like]
    graph = torch.cuda.CUDAGraph()
    with capture_context or contextlib.nullcontext():
        with torch.cuda.graph(graph):
            call(outs)
    graph.replay()
    torch.cuda.synchronize()
    return outs


@pytest.mark.gpu
def test_gpu_open_launch_form_takes_the_cluster_kernel_at_mid_sizes():
    """cooperative=None (what the model's read passes) sends update_read_tokens update+reads and
    read_tokens reads to the cluster kernel, bit for bit, and leaves the sizes around them to the
    Triton kernels (one launch up to 16 tokens, two above)."""
    _gpu_ready()
    from mhc_gpu import _inputs, _params, open_and_named_update_read

    from layer_boundary_mhc import triton_ops

    n, c = 4, 4096
    params = _params(n, c)

    def same(a, b, where):
        assert all(torch.equal(u, v) for u, v in zip(a, b)), where

    lo, hi = MhcKernelConfig().update_read_tokens
    below = [(lo - 1, True)] if lo > 1 else []  # one Triton launch up to 16 tokens
    for t, form in [(lo, "cluster"), (128, "cluster"), (hi, "cluster"), (hi + 1, False)] + below:
        auto, want = open_and_named_update_read(t, n, c, form, params)
        same(auto, want, f"update+read T={t}: not the {form} result")
    lo, hi = MhcKernelConfig().read_tokens
    for t, form in ((lo, "cluster"), (hi, "cluster"), (hi + 1, False)):
        x, _, w, _, _ = _inputs(t, n, c, torch.bfloat16, seed=t)
        auto = triton_ops.mhc_read_triton(x, params, w, 1e-6)
        want = (triton_ops.mhc_read_cluster(x, params, w, 1e-6) if form == "cluster"
                else triton_ops.mhc_read_triton(x, params, w, 1e-6, cooperative=form))
        same(auto, want, f"read T={t}: not the {form} result")


@pytest.mark.gpu
def test_gpu_capture_of_an_uncompiled_shape_warns_and_runs_triton():
    _gpu_ready()
    from mhc_gpu import _inputs, _params

    from layer_boundary_mhc import cluster_ops, triton_ops

    t, n, c = 64, 3, 3072  # a shape no other test compiles
    assert not cluster_ops.cluster_shape(n, c, True).problem
    params = _params(n, c)
    x, y, w, h_post, h_res = _inputs(t, n, c, torch.bfloat16)
    want = triton_ops.mhc_update_read_triton(x, y, h_post, h_res, params, w, 1e-6, cooperative=False)
    outs = _captured_and_replayed(want, lambda o: triton_ops.mhc_update_read_triton(
        x, y, h_post, h_res, params, w, 1e-6, streams_out=o[0], out=o[1], h_post_out=o[2], h_res_out=o[3]),
        pytest.warns(UserWarning, match="not compiled before CUDA-graph capture"))
    assert all(torch.equal(a, b) for a, b in zip(outs, want))
