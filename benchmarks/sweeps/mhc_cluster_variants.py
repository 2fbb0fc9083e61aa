"""Variants of the MHC cluster kernel (``layer_boundary_mhc.cluster_ops``, CuTe DSL) on one GPU: for
each variant and T, whether update+read passes ``accuracy.compare``, and its CUDA-graph median with
its share of the byte roofline (``bench mhc``'s model, over the copy bandwidth of the same run),
beside the Triton kernels' two launches.

A variant is ``"CLUSTER=16 BLOCK_TOKENS=32 WARPS=8 CTAS=2"`` (settings of ``cluster_ops``; ``""`` the
defaults). Run: python benchmarks/sweeps/mhc_cluster_variants.py "" "BLOCK_TOKENS=32 CTAS=2" --tokens 1024 8192
"""

from __future__ import annotations

import argparse
import sys

import torch

from layer_boundary.bench import mhc as bench
from layer_boundary.bench.timing import TimingPlan, copy_bandwidth, time_call, time_eager
from layer_boundary_mhc import accuracy, cluster_ops, triton_ops

N = 4
SETTINGS = ("CLUSTER", "BLOCK_TOKENS", "WARPS", "CTAS", "STAGES", "PHI_STAGED", "PUSH", "SINKHORN_AFTER_TOKENS",
            "PERSISTENT_TOKENS", "PERSISTENT_WARPS", "SPLIT_TOKENS", "SPLIT_FINISHERS",
            "SPLIT_PRODUCERS", "SPLIT_PRODUCE_DEPTH", "SPLIT_ENDS", "SPLIT_SINKHORN_LANES", "SPLIT_COPY_FIRST",
            "SPLIT_KEPT_COUNTS", "SPLIT_PDL", "SPLIT_L2_HINTS")


def _time(fn) -> float:
    return time_call(fn, "cuda", TimingPlan(replays=20, max_calls=50)).median_us


def measure(t: int, hidden: int, copy_gbps: float, triton_too: bool, phases: bool = False) -> str:
    i = bench._inputs(t, N, hidden, torch.bfloat16, "cuda")
    shape = cluster_ops._variant(t, N, hidden, True, 20)
    persistent = shape.persistent
    got = cluster_ops.mhc_update_read_cluster(i.x, i.y, i.h_post, i.h_res, i.params, i.w, bench.EPS)
    devs = accuracy.compare("update+read", got, i.x, y=i.y, h_post=i.h_post, h_res=i.h_res, params=i.params,
                            norm_weight=i.w, norm_eps=bench.EPS)
    ok = all(d.ok for d in devs)
    outs = [torch.empty_like(g) for g in got]
    us = _time(lambda: cluster_ops.mhc_update_read_cluster(i.x, i.y, i.h_post, i.h_res, i.params, i.w, bench.EPS,
                                                           streams_out=outs[0], out=outs[1], h_post_out=outs[2],
                                                           h_res_out=outs[3]))
    roof = bench.bytes_moved("update+read", t, N, hidden, 2) / (copy_gbps * 1e3)
    eager = ""
    if EAGER:  # launched back to back without a graph: what a graph replay changes
        ea = time_eager(lambda: cluster_ops.mhc_update_read_cluster(
            i.x, i.y, i.h_post, i.h_res, i.params, i.w, bench.EPS, streams_out=outs[0], out=outs[1],
            h_post_out=outs[2], h_res_out=outs[3]), "cuda", TimingPlan(replays=20, max_calls=50)).median_us
        eager = f" eager {ea:7.1f}"
    line = (f"T={t:5d} {'ok  ' if ok else 'FAIL'} cluster {us:7.1f} ({100 * roof / us:4.1f} %){eager}  "
            f"[{'split ' if shape.split else 'persistent ' if persistent else ''}CL={shape.cl} BT={shape.bt} warps={shape.warps} "
            f"ctas={shape.ctas} stages={shape.stages} smem={shape.smem // 1024} KiB]")
    if triton_too:
        two = _time(lambda: triton_ops.mhc_update_read_triton(i.x, i.y, i.h_post, i.h_res, i.params, i.w, bench.EPS,
                                                              streams_out=outs[0], out=outs[1], h_post_out=outs[2],
                                                              h_res_out=outs[3], cooperative=False))
        line += f"  triton 2-launch {two:7.1f} ({100 * roof / two:4.1f} %)"
    if not ok:
        line += "  " + "; ".join(str(d) for d in devs if not d.ok)
    if phases:
        split = _split_ends(i) if cluster_ops.SPLIT_ENDS else _split_sections(i)
        line += "\n" + (split if shape.split else _sections(i, shape) if persistent else _phases(i, shape))
    return line


# Profiled calls made back to back before the one read (--steady): the timed figures are replays of
# many calls, whose GPU clock and memory state a single call after a sync does not have.
STEADY = 1
EAGER = False


def _profiled(i, values: int, ctas: int = 0):
    """``STEADY`` calls with ``cluster_ops.PROFILE`` (``values`` int64 values) set, the last one's
    values: ``[CTA, 16]`` (the first ``ctas`` CTAs' and the rest as given, if ``ctas``), on the CPU."""
    cluster_ops.PROFILE = torch.zeros(values, dtype=torch.int64, device="cuda")
    try:
        for _ in range(STEADY):
            cluster_ops.mhc_update_read_cluster(i.x, i.y, i.h_post, i.h_res, i.params, i.w, bench.EPS)
        torch.cuda.synchronize()
        got = cluster_ops.PROFILE.cpu()
        return (got[: 16 * ctas].view(-1, 16).double(), got[16 * ctas:]) if ctas else got.view(-1, 16).double()
    finally:
        cluster_ops.PROFILE = None


def _sections(i, shape) -> str:
    """One profiled call of the persistent variant: per section of an iteration, the median over
    CTAs of stream warp 0's (and the coefficient warp's) cycles an iteration."""
    clusters = cluster_ops._resident_clusters(i.x.device)
    prof = cluster_ops.persistent_shape(N, i.x.shape[2], True)
    raw = _profiled(i, clusters * shape.cl * 16)
    raw = raw[raw[:, 8] > 0]
    per = (raw / raw[:, 8:9]).median(dim=0).values.tolist()
    parts = ", ".join(f"{name} {per[k]:.0f}" for k, name in prof.SECTIONS.items())
    return f"      cycles an iteration (median over {len(raw)} CTAs, {int(raw[:, 8].max())} iterations at most): {parts}"


def _split_sections(i) -> str:
    """One profiled call of the split variant: per role, the median over its CTAs of thread 0's cycles
    a block (stream CTAs) or a token (finisher warp 0), and of the whole kernel."""
    prof = cluster_ops.split_shape(N, i.x.shape[2], True)
    t = i.x.shape[0]
    blocks = -(-t // prof.bt)
    sets, fins = cluster_ops._split_grid(i.x.device, blocks)
    ctas = 16 * sets + fins
    raw, st = _profiled(i, prof.profile_values(ctas, blocks, t), ctas)
    lines = []
    for role, flag in (("stream", 0), ("finisher", 1)):
        rows = raw[(raw[:, 10] == flag) & (raw[:, 8] > 0)]
        if not len(rows):
            continue
        per = (rows / rows[:, 8:9]).median(dim=0).values.tolist()
        parts = ", ".join(f"{name} {per[k]:.0f}" for k, name in prof.SECTIONS[role].items())
        us = rows[:, 9] / 1.98e3
        span = (rows[:, 11] - rows[:, 14]) / 1e3  # globaltimer: the CTA's start to its end, µs
        ghz = rows[:, 9] / (span * 1e3)
        lines.append(f"      {role} ({len(rows)} CTAs, {int(rows[:, 8].median())} each): {parts}; "
                     f"kernel {us.median():.0f} µs at 1.98 GHz (CTAs {us.min():.0f}-{us.max():.0f}); by the timer "
                     f"{span.median():.0f} µs (CTAs {span.min():.0f}-{span.max():.0f}), so {ghz.median():.2f} GHz")
        if role == "stream":  # the slowest CTA of each set of 16 (a block is ready when its set's 16 are)
            sets = us[: len(us) // 16 * 16].view(-1, 16).max(dim=1).values
            lines.append("      slowest CTA of each set: " + ", ".join(f"{v:.0f}" for v in sets.tolist()) + " µs")
    lines.append(_split_stamps(st, blocks, t, prof.bt))
    return "\n".join(lines)


def _split_ends(i) -> str:
    """The kernel writing only each CTA's start and end (``SPLIT_ENDS``), the last of ``STEADY`` calls:
    when each role's CTAs end, µs from the first CTA's start."""
    prof = cluster_ops.split_shape(N, i.x.shape[2], True)
    blocks = -(-i.x.shape[0] // prof.bt)
    sets, fins = cluster_ops._split_grid(i.x.device, blocks)
    ctas = 16 * sets + fins
    raw, _ = _profiled(i, prof.profile_values(ctas, blocks, i.x.shape[0]), ctas)
    zero = raw[:, 14].min()
    stream, fin = raw[: 16 * sets], raw[16 * sets:]

    def q(v):
        v = (v - zero) / 1e3
        return f"median {v.median():.1f}, max {v.max():.1f}"

    return (f"      ends only (µs from the first start): stream CTAs end {q(stream[:, 11])}; finishers' producers "
            f"{q(fin[:, 11])}, consumers {q(fin[:, 12])}; starts spread {(raw[:, 14].max() - zero) / 1e3:.1f}")


def _split_stamps(st, blocks: int, t: int, bt: int) -> str:
    """When each block was counted ready (its 16 CTAs' last count), when each token's producer saw
    it, and when each token's input was stored (%globaltimer, µs from the first count)."""
    ns = st[0::2].double()
    counts = ns[: 16 * blocks].view(blocks, 16)
    ready = counts.max(dim=1).values
    seen, done = ns[16 * blocks: 16 * blocks + t], ns[16 * blocks + t: 16 * blocks + 2 * t]
    zero = ready.min()
    blk = torch.arange(t) // bt

    def q(v):
        v = v / 1e3
        return f"median {v.median():.2f}, p90 {v.quantile(0.9):.2f}, max {v.max():.2f}"

    return (f"      stamps (µs): last block ready {(ready.max() - zero) / 1e3:.1f}, last input stored "
            f"{(done.max() - zero) / 1e3:.1f}; a block's 16 counts spread over {q(ready - counts.min(dim=1).values)}; "
            f"count seen after ready: {q(seen - ready[blk])}; input stored after seen: {q(done - seen)}")


def _phases(i, shape) -> str:
    """One profiled call: median phase durations over CTAs, how many clusters ran at once, SMs used."""
    from layer_boundary_mhc.cluster_shape import PHASES

    t = i.x.shape[0]
    blocks = -(-t // shape.bt)
    cluster_ops.PROFILE = torch.zeros(blocks * shape.cl * 16, dtype=torch.int64, device="cuda")
    try:
        cluster_ops.mhc_update_read_cluster(i.x, i.y, i.h_post, i.h_res, i.params, i.w, bench.EPS)
        torch.cuda.synchronize()
        raw = cluster_ops.PROFILE.view(blocks, shape.cl, 8, 2).cpu()
        st, cyc = raw[:, :, :6], raw[:, :, 6:].reshape(-1, 4).double()
    finally:
        cluster_ops.PROFILE = None
    ns = st[..., 0].double()
    ns -= ns.min()
    steps = (ns[..., 1:] - ns[..., :-1]).reshape(-1, 5).median(dim=0).values / 1e3
    span = (ns[..., 5].max(dim=1).values - ns[..., 0].min(dim=1).values)  # per block
    starts, ends = ns[..., 0].min(dim=1).values, ns[..., 5].max(dim=1).values
    live = max(int(((starts <= s0) & (ends > s0)).sum()) for s0 in starts.tolist())
    parts = ", ".join(f"{a} -> {b} {v:.1f}" for a, b, v in zip(PHASES, PHASES[1:], steps.tolist()))
    per = (cyc[:, :3] / cyc[:, 3:4]).median(dim=0).values.tolist()
    parts += f"; chunk loop (warp 0, cycles a chunk): wait {per[0]:.0f}, issue {per[1]:.0f}, compute {per[2]:.0f}"
    return (f"      phases (median µs): {parts}; block {span.median() / 1e3:.1f} µs; at most {live} clusters at once; "
            f"{len(set(st[..., 1].flatten().tolist()))} SMs; all {float(ns.max()) / 1e3:.1f} µs")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help='"NAME=VALUE ..." of cluster_ops settings; "" = defaults')
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096])
    ap.add_argument("--phases", action="store_true", help="also one profiled call: the phase durations")
    ap.add_argument("--once", action="store_true", help="one call of each variant and T, untimed (under ncu)")
    ap.add_argument("--eager", action="store_true", help="also time eager back-to-back launches")
    ap.add_argument("--steady", type=int, default=1, help="--phases: profiled calls back to back, the last read")
    args = ap.parse_args(argv)
    global STEADY, EAGER
    STEADY, EAGER = max(1, args.steady), args.eager
    defaults = {k: getattr(cluster_ops, k) for k in SETTINGS}
    copy = 0.0 if args.once else copy_bandwidth("cuda", 1 << 30)["gbps"]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, n={N}, bf16; copy {copy:.0f} GB/s")
    with torch.no_grad():
        for v in args.variants:
            for k, val in defaults.items():
                setattr(cluster_ops, k, val)
            for item in v.split():
                k, _, val = item.partition("=")
                if k not in SETTINGS:
                    raise SystemExit(f"{item!r}: settings are {', '.join(SETTINGS)}")
                setattr(cluster_ops, k, int(val))
            print(f"variant {v or 'defaults'}", flush=True)
            for h in args.hidden:
                for t in args.tokens:
                    try:
                        if args.once:
                            i = bench._inputs(t, N, h, torch.bfloat16, "cuda")
                            cluster_ops.mhc_update_read_cluster(i.x, i.y, i.h_post, i.h_res, i.params, i.w, bench.EPS)
                            torch.cuda.synchronize()
                            continue
                        print(f"  H={h} " + measure(t, h, copy, not v, args.phases), flush=True)
                    except Exception as e:  # one variant that does not compile must not end the sweep
                        print(f"  H={h} T={t}: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
