"""The split variant of the MHC persistent kernel (``layer_boundary_mhc.cute_split``: stream CTAs on
sets of 16 SMs, finisher CTAs on the rest, exchanging through global memory).

On the CPU: its shape plan and refusals, the grid it asks for, and, where the CuTe DSL imports, the
sm_90a compile (the persistent variant's stream pass, no cluster, a release count a block, an
acquire spin). On an H200 (``-m gpu``): every output against the reference, bitwise replays, x' and
the coefficients bit for bit the persistent variant's (the same sums in the same order), ragged and
tiny grids, CUDA-graph capture.
"""

from __future__ import annotations

import re

import pytest
import torch

from layer_boundary_mhc import MhcKernelConfig, cluster_ops
from layer_boundary_mhc.cluster_shape import SMEM_LIMIT, PersistentShape, SplitShape


def test_split_shape_plan_and_refusals():
    s = SplitShape(4, 4096, True, 20)
    p = PersistentShape(4, 4096, True, 20)
    assert s.split and s.persistent and not p.split and (s.bt, s.hs, s.gpw, s.problem) == (16, 256, 1, "")
    # stream role: phi, slots, coefficient rows, per-warp partials (no exchange buffers); finisher
    # role: a ring of 7 x' rows of 32 KiB with their barriers, H_pre for 16 tokens (twice the ring:
    # computed before a token has a row), which sets the size here.
    assert s.phi_bytes + s.slot_bytes + s.coef_bytes + s.wp_bytes + 1024 < p.smem
    assert s.fslots == 7 and s.hrows >= 2 * s.fslots
    assert s.smem == 7 * (4 * 4096 * 2 + 16) + 16 * 16 + 256 + 1024 <= SMEM_LIMIT
    assert SplitShape(2, 1024, True, 20).fslots == 8 <= SplitShape(2, 1024, True, 20).hrows // 2  # at most 8 rows
    # a producer step's tokens: all producers' steps fit the ring (no step waits on a later one)
    assert (s.pdepth, SplitShape(4, 4096, True, 20, producers=4).pdepth) == (2, 1)
    assert SplitShape(4, 4096, True, 20, producers=7).pdepth == 1
    assert "8" in SplitShape(4, 4096, True, 20, warps=4).problem and SplitShape(4, 4096, True, 20, producers=8).problem
    assert SplitShape(3, 2048, False, 20).problem == "" and SplitShape(2, 1024, True, 20).problem == ""
    assert "phi's slice alone" in SplitShape(4, 7168, True, 20).problem
    assert "2 to 4" in SplitShape(5, 4096, True, 20).problem
    assert cluster_ops._key(s) != cluster_ops._key(p)


def test_split_grid_leaves_the_finishers_their_sms():
    finishers = MhcKernelConfig().split_finishers
    assert cluster_ops.split_grid(132, 512, finishers) == (6, 36)  # H200
    assert cluster_ops.split_grid(132, 3, finishers) == (3, 84)  # fewer blocks than sets
    assert cluster_ops.split_grid(114, 512, finishers) == (4, 50)
    assert cluster_ops.split_grid(20, 512, finishers) == (1, 4)
    assert cluster_ops.split_grid(132, 512, 20) == (7, 20)  # a seventh set where fewer finishers are asked


def test_calls_take_the_split_variant_when_asked():
    both = MhcKernelConfig(persistent_tokens=512, split_tokens=512)  # split before the persistent variant
    assert cluster_ops._variant(8192, 4, 4096, True, 20, both).split
    assert not cluster_ops._variant(511, 4, 4096, True, 20, both).persistent
    wide = cluster_ops._variant(8192, 4, 7168, True, 20, both)  # phi's slice does not fit: the cluster kernel
    assert not wide.persistent and not wide.split
    assert not cluster_ops._variant(8192, 4, 4096, True, 20, MhcKernelConfig(split_tokens=0)).split


def test_split_tokens_send_large_update_reads_to_the_split_variant():
    """split_tokens: update+reads from that many tokens run the split variant where it fits, also on
    an open launch form (``takes``, device checks and compiler stood in for); reads, sizes between
    the small range and split_tokens, and shapes it does not fit stay with the Triton kernels."""
    from test_mhc_cluster import _FakeCudaStreams, stand_in_dispatch

    assert not cluster_ops._variant(8192, 4, 4096, True, 20, MhcKernelConfig(split_tokens=0)).split
    assert MhcKernelConfig().split_tokens == 1024
    assert cluster_ops._variant(1024, 4, 4096, True, 20).split
    assert not cluster_ops._variant(1023, 4, 4096, True, 20).split
    assert cluster_ops._variant(8192, 4, 4096, False, 20).split  # a read asked of the cluster path runs it too
    assert not cluster_ops._variant(8192, 4, 7168, True, 20).split  # phi's slice does not fit
    compiled = []
    y = object()
    d = stand_in_dispatch([], y, compile=lambda shape: compiled.append(type(shape).__name__))

    def takes(t, c=4096, update=True):
        return d.takes(_FakeCudaStreams(t, c=c), y if update else None, None, _FakeCudaStreams(t, c=c), 20)

    hi = MhcKernelConfig().update_read_tokens[1]
    assert [takes(t) for t in (hi, hi + 1, 1023, 1024, 32768)] == [True, False, False, True, True]
    # reads from split_tokens too (the split variant's read beats the Triton two launches there)
    assert [takes(t, update=False) for t in (1023, 1024, 8192)] == [False, True, True]
    assert not takes(8192, c=7168) and not takes(8192, c=7168, update=False)
    assert compiled == ["ClusterShape", "SplitShape", "SplitShape"]  # each decided once (update+read, read)


def _cute():
    from test_mhc_cluster import _cute as cute_module

    return cute_module("cute_split")


@pytest.mark.parametrize("n,c,update", [(4, 4096, True), (3, 2048, False), (2, 1024, True), (4, 3072, True)])
def test_split_kernel_compiles_for_sm90a(n, c, update, tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    mod = _cute()
    shape = SplitShape(n, c, update, 20)
    ptx = mod.compile_split(shape, str(tmp_path)).__ptx__
    assert ".target sm_90a" in ptx
    # the persistent variant's stream pass: per group of a warp, stream and k-step, 3 parts x NT
    # n-tiles and 2 for the sums of squares
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16", ptx)) == shape.gpw * n * 2 * (3 * shape.nt + 2)
    # no cluster barrier, no distributed shared memory access (the bulk copies name this CTA's own
    # shared memory in the shared::cluster window)
    assert "barrier.cluster" not in ptx and "mapa" not in ptx and "st.async" not in ptx
    # a block counted ready by one release behind a CTA barrier, no per-thread fence; producers
    # wait with an acquire read, then order it before their copy-engine reads of x'
    assert "red.release.gpu.global.add.u32" in ptx and "fence.acq_rel.gpu" not in ptx
    assert "ld.acquire.gpu.global.u32" in ptx and "trap;" in ptx  # a count that never comes: an error, not a hang
    # every wait bounded the same way: a producer step's ready spins and ring waits, a consumer
    # step's ring waits, and the last CTA's wait for every CTA's arrival at the kept counts
    assert ptx.count("trap;") == 2 * shape.pdepth + mod.CONSUME_DEPTH + 1
    assert "fence.proxy.async.global" in ptx
    # x' rows by the copy engine into the ring (one copy a stream), counted on the row's barrier;
    # the partials from L2
    assert ptx.count("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes") == n * shape.pdepth
    assert f", {c * 2}, " in ptx and "ld.global.cg.f32" in ptx


# Split-variant settings other than the default: the producers' form before it (2 of two tokens).
KNOBS = [dict(split_producers=2, split_produce_depth=2)]



def test_kept_counts_layout_and_capacity():
    from layer_boundary_mhc import counts

    # a half's capacity: a power of two of at least 64 blocks, so nearby sizes share an eager buffer
    assert [counts.capacity(b) for b in (1, 64, 65, 69, 512, 513)] == [64, 64, 128, 128, 512, 1024]
    # the kept layout: 4 header words (phase, arrivals, two to keep the counts 16-byte aligned),
    # then two halves; a pool slice keeps the next one aligned too
    assert counts._HEAD == 4 and all((counts._HEAD + 2 * counts.capacity(b)) % 4 == 0 for b in range(1, 3000, 37))
    shape = cluster_ops.split_shape(4, 4096, True)
    assert shape.kept and shape.sinkhorn_lanes  # the only forms left (PERFORMANCE.md)


def test_split_settings_make_distinct_shapes():
    base = cluster_ops.split_shape(4, 4096, True)
    keys = {cluster_ops._key(base)}
    for knob in KNOBS:
        shape = cluster_ops.split_shape(4, 4096, True, config=MhcKernelConfig(**knob))
        assert not shape.problem
        keys.add(cluster_ops._key(shape))
    assert len(keys) == len(KNOBS) + 1
    # settings of other variants leave the split variant's shape (and compiled kernel) alone
    assert cluster_ops.split_shape(4, 4096, True, config=MhcKernelConfig(push=False, lag=8)) is base


def test_split_kernel_keeps_its_counts_and_runs_the_sinkhorn_in_its_producers(tmp_path, monkeypatch):
    """The one split form left: a kept counts buffer (the phase read, the CTA's arrival, the other
    half zeroed, the phase flipped) and the Sinkhorn in the producers (a reciprocal a sum, and a
    relaxed look at the next count); nothing of the deleted forms (a programmatic dependent launch,
    L2 priorities, the copy first, profile clocks; %globaltimer stays: the bounded waits read it)
    is left in its PTX."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    mod = _cute()
    ptx = mod.compile_split(SplitShape(4, 4096, True, 20), str(tmp_path)).__ptx__
    assert ptx.count("st.relaxed.gpu.global.u32") == 3 and "ld.relaxed.gpu.global.u32" in ptx
    assert "rcp.approx.f32" in ptx
    for gone in ("griddepcontrol", "cache_hint", "createpolicy", "mbarrier.test_wait", "%clock64", "%smid"):
        assert gone not in ptx, gone



# -- GPU ---------------------------------------------------------------------------------------------

def _gpu_ready():
    from test_mhc_cluster import _gpu_ready as cluster_ready

    cluster_ready()
    _cute()


# 8192: 512 blocks over 6 sets; 1100: a ragged last block; 97: 7 blocks, one more than sets; 40: fewer
# (3); 5: part of one block (fewer tokens than finisher CTAs); H = 3072: 3 units a consumer thread;
# H = 1024: one unit, and n = 2 rows of 4 KiB (8 in the ring).
CASES = [(8192, 4, 4096), (1100, 4, 4096), (600, 3, 2048), (97, 2, 1024), (40, 4, 3072), (5, 4, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("t,n,c", CASES, ids=str)
@pytest.mark.parametrize("op", ["update+read", "read"])
def test_gpu_split_matches_reference_and_the_persistent_variant(t, n, c, op):
    _gpu_ready()
    from test_mhc_persistent import PERSISTENT, checked_run

    split = MhcKernelConfig(persistent_tokens=1, split_tokens=1)
    got, run = checked_run(t, n, c, op, "split", split)
    assert cluster_ops._variant(t, n, c, op != "read", 20, split).split
    # The stream pass and the coefficients' sums are the persistent variant's: x', H_post and H_res's
    # logits bit for bit (the input sums its squares in another order). H_res: the producers'
    # Sinkhorn sums in its own order and multiplies by a reciprocal, within a few ulp of the
    # persistent variant's (a launch after the kernel).
    ref = run(PERSISTENT)
    assert not cluster_ops._variant(t, n, c, op != "read", 20, PERSISTENT).split
    same = got[-2:-1] if op == "read" else (got[0], got[-2])
    want = ref[-2:-1] if op == "read" else (ref[0], ref[-2])
    assert all(torch.equal(a, b) for a, b in zip(same, want)), "differs from the persistent variant"
    torch.testing.assert_close(got[-1], ref[-1], rtol=2e-6, atol=1e-7)


@pytest.mark.gpu
def test_gpu_open_launch_form_takes_the_split_variant_from_split_tokens():
    """With split_tokens at its default (1024), cooperative=None sends update+reads from that size to the split
    variant, bit for bit, reads too, and leaves the sizes below it and H = 7168 to the Triton
    kernels."""
    _gpu_ready()
    from mhc_gpu import _inputs, _params, open_and_named_update_read

    from layer_boundary_mhc import triton_ops

    assert MhcKernelConfig().split_tokens == 1024
    for t, c, form in ((1024, 4096, "split"), (3000, 4096, "split"), (1023, 4096, False), (2048, 7168, False)):
        auto, want = open_and_named_update_read(t, 4, c, form, _params(4, c))
        assert all(torch.equal(a, b) for a, b in zip(auto, want)), f"T={t} C={c}: not the {form} result"
    for t, c, form in ((2048, 4096, "split"), (1023, 4096, False), (2048, 7168, False)):
        x, _, w, _, _ = _inputs(t, 4, c, torch.bfloat16)
        p = _params(4, c)
        auto = triton_ops.mhc_read_triton(x, p, w, 1e-6)
        if form:
            assert cluster_ops._variant(t, 4, c, False, 20).split
            want = cluster_ops.mhc_read_cluster(x, p, w, 1e-6)
        else:
            want = triton_ops.mhc_read_triton(x, p, w, 1e-6, cooperative=False)
        assert all(torch.equal(a, b) for a, b in zip(auto, want)), f"read T={t} C={c}: not the {form} result"


@pytest.mark.gpu
def test_gpu_split_under_cuda_graph_capture():
    """Captured once and replayed: each replay finds its ready counts at zero, left so by the
    replay before (one that found the last one's would not wait for its stream
    CTAs), and gives eager's bits, on new inputs too (the stale partials of the same inputs would
    hide a race)."""
    _gpu_ready()
    from mhc_gpu import _inputs, _params

    config = MhcKernelConfig(split_tokens=512)
    t, n, c = 4096, 4, 4096
    params = _params(n, c)
    x, y, w, h_post, h_res = _inputs(t, n, c, torch.bfloat16)
    cluster_ops.prepare_cluster(n, c, config=config)
    eager = cluster_ops.mhc_update_read_cluster(x, y, h_post, h_res, params, w, 1e-6, config=config)
    outs = [torch.empty_like(v) for v in eager]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cluster_ops.mhc_update_read_cluster(x, y, h_post, h_res, params, w, 1e-6, streams_out=outs[0], out=outs[1],
                                            h_post_out=outs[2], h_res_out=outs[3], config=config)
    for _ in range(2):
        for v in outs:
            v.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(eager, outs))
    for k in range(3):  # new inputs in place, replays back to back
        x2, y2, _, _, _ = _inputs(t, n, c, torch.bfloat16, seed=10 + k)
        x.copy_(x2)
        y.copy_(y2)
        want = cluster_ops.mhc_update_read_cluster(x, y, h_post, h_res, params, w, 1e-6, config=config)
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(want, outs)), f"replay on new inputs {k}"


@pytest.mark.gpu
def test_gpu_split_kept_counts_across_sizes_and_streams():
    """Eager calls of growing and shrinking sizes (a ragged last block among them) on two streams,
    read and update+read: each matches the reference, and leaves its stream's buffer ready for the
    next launch: the phase flipped, the arrivals at zero, the half the next launch takes zeroed."""
    _gpu_ready()
    from mhc_gpu import _inputs, _params

    from layer_boundary_mhc import accuracy, counts

    config = MhcKernelConfig(split_tokens=1)
    params = _params(4, 4096)
    side = torch.cuda.Stream()
    for t, stream in ((1100, None), (4096, side), (37, None), (8192, None), (2000, side), (1030, None)):
        x, y, w, h_post, h_res = _inputs(t, 4, 4096, torch.bfloat16, seed=t)
        stream = stream or torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        cap = counts.capacity((t + 15) // 16)
        key = (torch.cuda.current_device(), stream.cuda_stream, cap)
        before = int(counts._EAGER[key][0]) if key in counts._EAGER else 0
        with torch.cuda.stream(stream):
            got = cluster_ops.mhc_update_read_cluster(x, y, h_post, h_res, params, w, 1e-6, config=config)
            read = cluster_ops.mhc_read_cluster(x, params, w, 1e-6, config=config)
        torch.cuda.synchronize()
        accuracy.assert_matches_reference("update+read", got, x, y=y, h_post=h_post, h_res=h_res, params=params,
                                          norm_weight=w, norm_eps=1e-6, where=f"kept counts T={t}")
        accuracy.assert_matches_reference("read", read, x, params=params, norm_weight=w, norm_eps=1e-6,
                                          where=f"kept counts T={t}")
        buf = counts._EAGER[key].cpu()
        assert int(buf[0]) == before, f"T={t}: two launches flip the phase twice"
        assert int(buf[1]) == 0, f"T={t}: arrivals left at {int(buf[1])}"
        nxt = buf[4 + before * cap:4 + (before + 1) * cap]
        assert int(nxt.abs().sum()) == 0, f"T={t}: the half the next launch takes is not zeroed"


@pytest.mark.gpu
def test_gpu_split_kept_counts_pool_used_up_falls_back_to_a_memset():
    """With the captured calls' counts used up, a capture warns once and zeroes its counts in the
    graph: still right on every replay."""
    _gpu_ready()
    from mhc_gpu import _inputs, _params

    from layer_boundary_mhc import counts

    # A pool of its own (one a device and size): one call of 4096 tokens (4 + 2 x 256 words).
    config = MhcKernelConfig(split_tokens=512, split_captured_words=600)
    assert (torch.cuda.current_device(), 600) not in counts._POOL
    t, n, c = 4096, 4, 4096
    params = _params(n, c)
    x, y, w, h_post, h_res = _inputs(t, n, c, torch.bfloat16)
    cluster_ops.prepare_cluster(n, c, config=config)
    eager = cluster_ops.mhc_update_read_cluster(x, y, h_post, h_res, params, w, 1e-6, config=config)
    outs = [[torch.empty_like(v) for v in eager] for _ in range(2)]
    graph = torch.cuda.CUDAGraph()
    with pytest.warns(UserWarning, match="used up"):
        with torch.cuda.graph(graph):
            for o in outs:  # the first from the pool, the second zeroed in the graph
                cluster_ops.mhc_update_read_cluster(x, y, h_post, h_res, params, w, 1e-6, streams_out=o[0], out=o[1],
                                                    h_post_out=o[2], h_res_out=o[3], config=config)
    for _ in range(3):
        for o in outs:
            for v in o:
                v.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for o in outs:
            assert all(torch.equal(a, b) for a, b in zip(eager, o))


@pytest.mark.gpu
@pytest.mark.parametrize("knob", KNOBS, ids=lambda k: " ".join(f"{a}={b}" for a, b in k.items()))
@pytest.mark.parametrize("t", [8192, 1100, 5])
def test_gpu_split_settings_match_the_reference(knob, t):
    """Each split setting gives outputs within the tolerance table, bit for bit again on a replay."""
    _gpu_ready()
    from test_mhc_persistent import checked_run

    config = MhcKernelConfig(split_tokens=1, **knob)
    checked_run(t, 4, 4096, "update+read", f"split {knob}", config)
    assert cluster_ops._variant(t, 4, 4096, True, 20, config).split
