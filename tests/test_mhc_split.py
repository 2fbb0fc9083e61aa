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

from layer_boundary_mhc import cluster_ops
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


def test_split_grid_leaves_the_finishers_their_sms(monkeypatch):
    monkeypatch.setitem(cluster_ops._SMS, 0, 132)
    assert cluster_ops._split_grid(torch.device("cuda", 0), 512) == (6, 36)  # H200
    assert cluster_ops._split_grid(torch.device("cuda", 0), 3) == (3, 84)  # fewer blocks than sets
    monkeypatch.setitem(cluster_ops._SMS, 0, 114)
    assert cluster_ops._split_grid(torch.device("cuda", 0), 512) == (4, 50)
    monkeypatch.setitem(cluster_ops._SMS, 0, 20)
    assert cluster_ops._split_grid(torch.device("cuda", 0), 512) == (1, 4)


def test_calls_take_the_split_variant_when_asked(monkeypatch):
    monkeypatch.setattr(cluster_ops, "PERSISTENT_TOKENS", 512)
    monkeypatch.setattr(cluster_ops, "SPLIT_TOKENS", 512)  # before the persistent variant
    assert cluster_ops._variant(8192, 4, 4096, True, 20).split
    assert not cluster_ops._variant(511, 4, 4096, True, 20).persistent
    wide = cluster_ops._variant(8192, 4, 7168, True, 20)  # phi's slice does not fit: the cluster kernel
    assert not wide.persistent and not wide.split
    monkeypatch.setattr(cluster_ops, "SPLIT_TOKENS", 0)
    assert not cluster_ops._variant(8192, 4, 4096, True, 20).split


def test_split_tokens_send_large_update_reads_to_the_split_variant(monkeypatch):
    """SPLIT_TOKENS: update+reads from that many tokens run the split variant where it fits, also on
    an open launch form (``takes``, device checks and compiler stood in for); reads, sizes between
    the small range and SPLIT_TOKENS, and shapes it does not fit stay with the Triton kernels."""
    from test_mhc_cluster import _FakeCudaStreams

    monkeypatch.setattr(cluster_ops, "SPLIT_TOKENS", 0)
    assert not cluster_ops._variant(8192, 4, 4096, True, 20).split
    monkeypatch.setattr(cluster_ops, "SPLIT_TOKENS", 1024)
    assert cluster_ops._variant(1024, 4, 4096, True, 20).split
    assert not cluster_ops._variant(1023, 4, 4096, True, 20).split
    assert cluster_ops._variant(8192, 4, 4096, False, 20).split  # a read asked of the cluster path runs it too
    assert not cluster_ops._variant(8192, 4, 7168, True, 20).split  # phi's slice does not fit
    compiled = []
    monkeypatch.setattr(cluster_ops, "cluster_problem", lambda x, *a, **k: "")
    monkeypatch.setattr(cluster_ops, "_compiled", lambda shape: compiled.append(type(shape).__name__))
    monkeypatch.setattr(cluster_ops, "_ELIGIBLE", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    y = object()
    monkeypatch.setattr(cluster_ops, "_rows_ok", lambda v: v is y or v.data_ptr() % 16 == 0)

    def takes(t, c=4096, update=True):
        return cluster_ops.takes(_FakeCudaStreams(t, c=c), y if update else None, None, _FakeCudaStreams(t, c=c), 20)

    hi = cluster_ops.UPDATE_READ_TOKENS[1]
    assert [takes(t) for t in (hi, hi + 1, 1023, 1024, 32768)] == [True, False, False, True, True]
    # reads from SPLIT_TOKENS too (the split variant's read beats the Triton two launches there)
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
    # step's ring waits
    assert ptx.count("trap;") == 2 * shape.pdepth + mod.CONSUME_DEPTH
    assert "fence.proxy.async.global" in ptx
    # x' rows by the copy engine into the ring (one copy a stream), counted on the row's barrier;
    # the partials from L2
    assert ptx.count("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes") == n * shape.pdepth
    assert f", {c * 2}, " in ptx and "ld.global.cg.f32" in ptx


# The sweep's settings (benchmarks/sweeps/mhc_cluster_variants.py; measured and not kept,
# plugins/mhc/PERFORMANCE.md, fourteenth pass), and the producers' form before it (2 of two tokens).
KNOBS = [dict(SPLIT_SINKHORN_LANES=0), dict(SPLIT_COPY_FIRST=1), dict(SPLIT_PRODUCERS=2, SPLIT_PRODUCE_DEPTH=2),
         dict(SPLIT_SINKHORN_LANES=0, SPLIT_COPY_FIRST=1), dict(SPLIT_KEPT_COUNTS=0), dict(SPLIT_PDL=1),
         dict(SPLIT_KEPT_COUNTS=1, SPLIT_PDL=1, SPLIT_PRODUCERS=2, SPLIT_PRODUCE_DEPTH=2),
         dict(SPLIT_L2_HINTS=1), dict(SPLIT_L2_HINTS=2), dict(SPLIT_L2_HINTS=3)]


def test_kept_counts_layout_and_capacity():
    from layer_boundary_mhc import counts

    # a half's capacity: a power of two of at least 64 blocks, so nearby sizes share an eager buffer
    assert [counts.capacity(b) for b in (1, 64, 65, 69, 512, 513)] == [64, 64, 128, 128, 512, 1024]
    # the kept layout: 4 header words (phase, arrivals, two to keep the counts 16-byte aligned),
    # then two halves; a pool slice keeps the next one aligned too
    assert counts._HEAD == 4 and all((counts._HEAD + 2 * counts.capacity(b)) % 4 == 0 for b in range(1, 3000, 37))
    got, cap = counts.counts(torch.device("cpu"), 7, kept=False)  # counts zeroed for the call
    assert cap == 0 and got.dtype == torch.int32 and got.tolist() == [0] * 7
    assert cluster_ops.split_shape(4, 4096, True).kept and not cluster_ops.split_shape(4, 4096, True).pdl


def test_split_settings_make_distinct_shapes(monkeypatch):
    base = cluster_ops.split_shape(4, 4096, True)
    keys = {cluster_ops._key(base)}
    for knob in KNOBS:
        with monkeypatch.context() as m:
            for name, value in knob.items():
                m.setattr(cluster_ops, name, value)
            shape = cluster_ops.split_shape(4, 4096, True)
            assert not shape.problem
            keys.add(cluster_ops._key(shape))
    assert len(keys) == len(KNOBS) + 1
    # with PROFILE unset, SPLIT_ENDS asks nothing of the kernel (it would write to h_res_out)
    monkeypatch.setattr(cluster_ops, "SPLIT_ENDS", 1)
    assert not cluster_ops.split_shape(4, 4096, True).ends


def test_split_settings_compile_for_sm90a(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    mod = _cute()
    ptx = {name: mod.compile_split(SplitShape(4, 4096, True, 20, **kw), str(tmp_path)).__ptx__
           for name, kw in (("launch", {}), ("batch", dict(sinkhorn_lanes=True)), ("first", dict(copy_first=True)),
                            ("kept", dict(kept=True)), ("pdl", dict(kept=True, pdl=True)),
                            ("hints", dict(kept=True, l2_hints=2)))}
    # a kept buffer: the phase read, the CTA's arrival, the other half zeroed, the phase flipped
    for name in ("kept", "pdl"):
        assert ptx[name].count("st.relaxed.gpu.global.u32") == 3 and "ld.relaxed.gpu.global.u32" in ptx[name]
        assert ptx[name].count("red.release.gpu.global.add.u32") == ptx["launch"].count(
            "red.release.gpu.global.add.u32") + 1
    assert "st.relaxed.gpu.global.u32" not in ptx["launch"]
    # the programmatic dependent launch waits before any global access
    assert "griddepcontrol" not in ptx["kept"]
    assert ptx["pdl"].index("griddepcontrol.wait") < ptx["pdl"].index("ld.relaxed.gpu.global.u32")
    # the Sinkhorn in the producers (cluster_ops' default; "launch": a launch after the kernel): a
    # reciprocal a sum, and a relaxed look at the next count
    assert "rcp.approx.f32" in ptx["batch"] and "rcp.approx.f32" not in ptx["launch"]
    assert "ld.relaxed.gpu.global.u32" in ptx["batch"]
    # a free row's copy first: lane 0 looks at the row's barrier without waiting; two arrivals a row
    assert "mbarrier.test_wait.parity" in ptx["first"] and "mbarrier.test_wait" not in ptx["launch"]
    assert ptx["first"].count("mbarrier.arrive.shared::cta.b64") > ptx["launch"].count(
        "mbarrier.arrive.shared::cta.b64")
    # L2 priorities: x and y copied evict-first (n + 1 copies a row and half-group), x' stored
    # evict-last, the finishers' x' copies evict-first; none without the setting
    hints = ptx["hints"]
    n_xy = 2 * 5 * 2  # two fills (the first block's, the loop's) x (n + 1) tiles x 2 half-groups
    assert "createpolicy.fractional.L2::evict_first.b64" in hints
    assert "createpolicy.fractional.L2::evict_last.b64" in hints
    plain, hinted = "cp.async.cg.shared.global [", "cp.async.cg.shared.global.L2::cache_hint"
    assert hints.count(hinted) == n_xy > 0 and hints.count(plain) + n_xy == ptx["launch"].count(plain)
    assert "st.global.L2::cache_hint.v4.b32" in hints and "st.global.v4.b32 [" in hints  # the output stays plain
    assert hints.count("complete_tx::bytes.L2::cache_hint") == ptx["launch"].count("complete_tx::bytes [")
    assert "cache_hint" not in ptx["kept"] and "createpolicy" not in ptx["launch"]


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
def test_gpu_split_matches_reference_and_the_persistent_variant(t, n, c, op, monkeypatch):
    _gpu_ready()
    from test_mhc_persistent import checked_run

    got, run = checked_run(t, n, c, op, monkeypatch, "split", SPLIT_TOKENS=1)
    assert cluster_ops._variant(t, n, c, op != "read", 20).split
    # The stream pass and the coefficients' sums are the persistent variant's: x', H_post and H_res's
    # logits bit for bit (the input sums its squares in another order). H_res: the same bits where
    # the Sinkhorn runs after the kernel, as the persistent variant's; the producers' Sinkhorn (the
    # default) sums in its own order and multiplies by a reciprocal, within a few ulp.
    lanes = cluster_ops.split_shape(n, c, op != "read").sinkhorn_lanes
    monkeypatch.setattr(cluster_ops, "SPLIT_TOKENS", 0)
    ref = run()
    assert not cluster_ops._variant(t, n, c, op != "read", 20).split
    same = got[-2:-1] if op == "read" else (got[0], got[-2])
    want = ref[-2:-1] if op == "read" else (ref[0], ref[-2])
    assert all(torch.equal(a, b) for a, b in zip(same, want)), "differs from the persistent variant"
    if lanes:
        torch.testing.assert_close(got[-1], ref[-1], rtol=2e-6, atol=1e-7)
    else:
        assert torch.equal(got[-1], ref[-1]), "H_res differs from the persistent variant's"


@pytest.mark.gpu
def test_gpu_open_launch_form_takes_the_split_variant_from_split_tokens(monkeypatch):
    """With SPLIT_TOKENS set, cooperative=None sends update+reads from that size to the split
    variant, bit for bit, reads too, and leaves the sizes below it and H = 7168 to the Triton
    kernels."""
    _gpu_ready()
    from mhc_gpu import _inputs, _params, open_and_named_update_read

    from layer_boundary_mhc import triton_ops

    monkeypatch.setattr(cluster_ops, "SPLIT_TOKENS", 1024)
    monkeypatch.setattr(cluster_ops, "_ELIGIBLE", {})
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
@pytest.mark.parametrize("ready", [dict(SPLIT_KEPT_COUNTS=0), dict(SPLIT_KEPT_COUNTS=1),
                                   dict(SPLIT_KEPT_COUNTS=1, SPLIT_PDL=1)], ids=["memset", "kept", "kept-pdl"])
def test_gpu_split_under_cuda_graph_capture(ready, monkeypatch):
    """Captured once and replayed: each replay finds its ready counts at zero, zeroed for it or
    left so by the replay before (one that found the last one's would not wait for its stream
    CTAs), and gives eager's bits, on new inputs too (the stale partials of the same inputs would
    hide a race)."""
    _gpu_ready()
    from mhc_gpu import _inputs, _params

    monkeypatch.setattr(cluster_ops, "SPLIT_TOKENS", 512)
    for name, value in ready.items():
        monkeypatch.setattr(cluster_ops, name, value)
    t, n, c = 4096, 4, 4096
    params = _params(n, c)
    x, y, w, h_post, h_res = _inputs(t, n, c, torch.bfloat16)
    cluster_ops.prepare_cluster(n, c)
    eager = cluster_ops.mhc_update_read_cluster(x, y, h_post, h_res, params, w, 1e-6)
    outs = [torch.empty_like(v) for v in eager]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cluster_ops.mhc_update_read_cluster(x, y, h_post, h_res, params, w, 1e-6, streams_out=outs[0], out=outs[1],
                                            h_post_out=outs[2], h_res_out=outs[3])
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
        want = cluster_ops.mhc_update_read_cluster(x, y, h_post, h_res, params, w, 1e-6)
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(want, outs)), f"replay on new inputs {k}"


@pytest.mark.gpu
def test_gpu_split_kept_counts_across_sizes_and_streams(monkeypatch):
    """Eager calls of growing and shrinking sizes (a ragged last block among them) on two streams,
    read and update+read: each matches the reference, and leaves its stream's buffer ready for the
    next launch: the phase flipped, the arrivals at zero, the half the next launch takes zeroed."""
    _gpu_ready()
    from mhc_gpu import _inputs, _params

    from layer_boundary_mhc import accuracy, counts

    monkeypatch.setattr(cluster_ops, "SPLIT_TOKENS", 1)
    monkeypatch.setattr(cluster_ops, "SPLIT_KEPT_COUNTS", 1)
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
            got = cluster_ops.mhc_update_read_cluster(x, y, h_post, h_res, params, w, 1e-6)
            read = cluster_ops.mhc_read_cluster(x, params, w, 1e-6)
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
def test_gpu_split_kept_counts_pool_used_up_falls_back_to_a_memset(monkeypatch):
    """With the captured calls' counts used up, a capture warns once and zeroes its counts in the
    graph: still right on every replay."""
    _gpu_ready()
    from mhc_gpu import _inputs, _params

    from layer_boundary_mhc import counts

    monkeypatch.setattr(cluster_ops, "SPLIT_TOKENS", 512)
    monkeypatch.setattr(cluster_ops, "SPLIT_KEPT_COUNTS", 1)
    monkeypatch.setattr(counts, "CAPTURED_WORDS", 600)  # one call of 4096 tokens (4 + 2 x 256 words)
    monkeypatch.setattr(counts, "_POOL", {})
    monkeypatch.setattr(counts, "_WARNED", set())
    t, n, c = 4096, 4, 4096
    params = _params(n, c)
    x, y, w, h_post, h_res = _inputs(t, n, c, torch.bfloat16)
    cluster_ops.prepare_cluster(n, c)
    eager = cluster_ops.mhc_update_read_cluster(x, y, h_post, h_res, params, w, 1e-6)
    outs = [[torch.empty_like(v) for v in eager] for _ in range(2)]
    graph = torch.cuda.CUDAGraph()
    with pytest.warns(UserWarning, match="used up"):
        with torch.cuda.graph(graph):
            for o in outs:  # the first from the pool, the second zeroed in the graph
                cluster_ops.mhc_update_read_cluster(x, y, h_post, h_res, params, w, 1e-6, streams_out=o[0], out=o[1],
                                                    h_post_out=o[2], h_res_out=o[3])
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
def test_gpu_split_settings_match_the_reference(knob, t, monkeypatch):
    """Each sweep setting gives outputs within the tolerance table, bit for bit again on a replay."""
    _gpu_ready()
    from test_mhc_persistent import checked_run

    checked_run(t, 4, 4096, "update+read", monkeypatch, f"split {knob}", SPLIT_TOKENS=1, **knob)
    assert cluster_ops._variant(t, 4, 4096, True, 20).split
