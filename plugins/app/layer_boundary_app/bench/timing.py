"""Timing for the benchmarks: CUDA-graph replay with medians on GPUs, wall clock on CPU.

A GPU measurement captures ``calls`` back-to-back calls of the function into one CUDA graph, so
that launch latency is paid once per replay rather than once per call, replays the graph
``replays`` times between CUDA events and reports the median time per call. ``calls`` is chosen
from a one-call probe so that a replay lasts about ``target_us``.

Ranks that time collectives must capture graphs of the same length: ``agree`` maps each rank's
choice of ``calls`` to one value for all of them (for example the maximum over the group).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

__all__ = [
    "reported_copy_bandwidth",
    "Measure",
    "TimingPlan",
    "graph_time",
    "eager_time",
    "wall_time",
    "time_call",
    "time_eager",
    "copy_bandwidth",
    "cuda_unavailable",
    "max_over_group",
    "slowest",
    "this_device",
]

Agree = Callable[[int], int]


@dataclass(frozen=True, slots=True)
class Measure:
    """Median and minimum µs per call over ``replays`` replays of ``calls`` calls each."""

    median_us: float
    min_us: float
    calls: int
    replays: int


@dataclass(frozen=True, slots=True)
class TimingPlan:
    replays: int = 50
    target_us: float = 1000.0
    max_calls: int = 200
    warmup: int = 3

    def __post_init__(self) -> None:
        if self.replays < 1 or self.max_calls < 1 or self.warmup < 1 or not self.target_us > 0:
            raise ValueError(f"{self}: replays, max_calls and warmup must be at least 1, target_us positive")

    @classmethod
    def for_run(cls, quick: bool, replays: Optional[int] = None) -> "TimingPlan":
        base = cls(replays=15, target_us=300.0, max_calls=100) if quick else cls()
        return cls(replays=replays, target_us=base.target_us, max_calls=base.max_calls) if replays else base


def _calls_for(est_us: float, plan: TimingPlan) -> int:
    return max(1, min(plan.max_calls, math.ceil(plan.target_us / max(est_us, 1e-3))))


def _capture(fn: Callable[[], Any], calls: int) -> "torch.cuda.CUDAGraph":
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def _replay_us(graph: "torch.cuda.CUDAGraph", replays: int, calls: int) -> list[float]:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    # Two untimed replays: the first replay of a graph uploads it to the device.
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    for s, e in zip(starts, ends):
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 / calls for s, e in zip(starts, ends)]


def graph_time(fn: Callable[[], Any], plan: TimingPlan = TimingPlan(), agree: Optional[Agree] = None) -> Measure:
    """µs per call of ``fn`` by CUDA-graph replay (``fn`` must be capturable; it runs eagerly
    ``plan.warmup`` times first, on a side stream as capture requires, so that lazy
    initialization and compilation happen outside the graph)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(plan.warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    probe = _capture(fn, 1)
    est = statistics.median(_replay_us(probe, 5, 1))
    del probe
    calls = _calls_for(est, plan)
    if agree is not None:
        calls = agree(calls)
    graph = _capture(fn, calls)
    times = _replay_us(graph, plan.replays, calls)
    del graph
    return Measure(statistics.median(times), min(times), calls, plan.replays)


def eager_time(fn: Callable[[], Any], plan: TimingPlan = TimingPlan(), agree: Optional[Agree] = None) -> Measure:
    """µs per call of ``fn`` launched eagerly, between CUDA events: device time when the GPU is
    the bottleneck, the host's launch time when the host is (events then see the device idle)."""
    for _ in range(plan.warmup):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    calls = _calls_for(s.elapsed_time(e) * 1e3, plan)
    if agree is not None:
        calls = agree(calls)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(plan.replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(plan.replays)]
    for s, e in zip(starts, ends):
        s.record()
        for _ in range(calls):
            fn()
        e.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) * 1e3 / calls for s, e in zip(starts, ends)]
    return Measure(statistics.median(times), min(times), calls, plan.replays)


def wall_time(fn: Callable[[], Any], plan: TimingPlan = TimingPlan(), agree: Optional[Agree] = None) -> Measure:
    """µs per call on the host clock (CPU tensors: the call is done when it returns)."""
    for _ in range(plan.warmup):
        fn()
    t0 = time.perf_counter_ns()
    fn()
    calls = _calls_for((time.perf_counter_ns() - t0) / 1e3, plan)
    if agree is not None:
        calls = agree(calls)
    times = []
    for _ in range(plan.replays):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter_ns() - t0) / 1e3 / calls)
    return Measure(statistics.median(times), min(times), calls, plan.replays)


def time_call(fn: Callable[[], Any], device: str, plan: TimingPlan = TimingPlan(),
              agree: Optional[Agree] = None) -> Measure:
    """CUDA-graph replay on ``cuda``, wall clock on ``cpu``."""
    if torch.device(device).type == "cuda":
        return graph_time(fn, plan, agree)
    return wall_time(fn, plan, agree)


def time_eager(fn: Callable[[], Any], device: str, plan: TimingPlan = TimingPlan(),
               agree: Optional[Agree] = None) -> Measure:
    """Eager launches between CUDA events on ``cuda``, wall clock on ``cpu``."""
    if torch.device(device).type == "cuda":
        return eager_time(fn, plan, agree)
    return wall_time(fn, plan, agree)


def copy_bandwidth(device: str, nbytes: int, plan: TimingPlan = TimingPlan()) -> dict[str, float]:
    """A device-to-device ``copy_`` of ``nbytes``, counting read + write: the practical memory
    bandwidth the norm kernels are compared with (``nbytes`` well past the L2 cache)."""
    n = max(1, nbytes // 4)
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    # The faster of the driver's memcpy (copy_ of contiguous tensors) and an elementwise kernel:
    # on an H200 the memcpy path reaches about two thirds of what a kernel streams.
    m = min((time_call(fn, device, plan) for fn in (lambda: dst.copy_(src), lambda: torch.mul(src, 1.0, out=dst))),
            key=lambda t: t.median_us)
    moved = 2 * n * 4
    return {"bytes": float(moved), "us": m.median_us, "gbps": moved / m.median_us / 1e3}


def cuda_unavailable(what: str, gpus: int = 1) -> Optional[str]:
    """Why ``what`` cannot run here (no CUDA, or fewer than ``gpus`` GPUs), or ``None``."""
    if not torch.cuda.is_available():
        return (f"layer-boundary bench {what} needs a CUDA GPU, but torch {torch.__version__} sees none "
                "on this machine; run it on a GPU machine (only `layer-boundary bench norm --device "
                "cpu`, `bench mhc --device cpu` and `bench host` run without one)")
    have = torch.cuda.device_count()
    if have < gpus:
        return (f"layer-boundary bench {what} needs {gpus} CUDA GPUs of one host, but {have} "
                f"{'is' if have == 1 else 'are'} visible; run it on a machine with {gpus} GPUs")
    return None


def max_over_group(group: Any, device: str = "cuda") -> Agree:
    """``agree`` for ranks of ``group``: the largest value any rank proposes (``device``: where
    the group's backend takes tensors, cuda for NCCL, cpu for gloo)."""
    import torch.distributed as dist

    def agree(value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(t.item())

    return agree


def reported_copy_bandwidth(device: str, nbytes: int, plan: TimingPlan, out: Callable[[str], None],
                            group: Any = None) -> dict[str, float]:
    """``copy_bandwidth`` (the slowest rank's over ``group`` when given), said once through ``out``:
    the figure every bench's "% copy" column divides by, measured in the same run."""
    copy = copy_bandwidth(device, nbytes, plan)
    if group is not None:
        copy["us"] = slowest(copy["us"], group, device)
        copy["gbps"] = copy["bytes"] / copy["us"] / 1e3
    out(f"copy bandwidth: {copy['gbps']:.0f} GB/s ({copy['bytes'] / 2**20:.0f} MiB read + written "
        f"in {copy['us']:.1f} µs{', slowest rank' if group is not None else ''})")
    return copy


def slowest(value: float, group: Any, device: str = "cuda") -> float:
    """The largest of the ranks' ``value`` (a collective's time is its slowest rank's)."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def this_device(device: str) -> str:
    """``cuda`` made explicit (``cuda:<current device>``): a rank's generators and tensors then
    name its own GPU rather than whatever a bare ``cuda`` resolves to."""
    if device == "cuda":
        return f"cuda:{torch.cuda.current_device()}"
    return device
