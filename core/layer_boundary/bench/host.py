"""Host overhead of the boundaries on CPU at decode-sized batches.

Two measurements, each against a baseline that runs the same kernels in the same run:

* per boundary: ``prepare + finish`` (PARTIAL attention) and ``prepare + exit + finish`` (FFN),
  minus the time of the fused add+RMSNorm call they make, in µs per boundary;
* per decoder forward: the Qwen3 reference with boundaries against ``plain_forward`` (the same
  modules and kernels with an explicit residual), as a ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import date
from typing import Any, Callable

import torch

from ..factories import declare_attn, declare_ffn, make_stages
from ..forward import ForwardBatch
from ..kernels.reference import fused_add_rmsnorm_ref
from ..norms import RMSNorm
from ..residual.stream import ResidualStream

__all__ = ["boundary_overhead", "forward_ratio", "host_command"]

_ns = time.perf_counter_ns


def _median_of(repeats: int, fn: Callable[[], float]) -> float:
    return statistics.median(fn() for _ in range(repeats))


def boundary_overhead(tokens: int, hidden: int, iters: int) -> dict[str, float]:
    """µs per call of each boundary step sequence, with and without the boundary around it."""
    n1, n2 = RMSNorm(hidden), RMSNorm(hidden)
    attn, ffn = make_stages((declare_attn(), n1), (declare_ffn(), n2), previous=declare_ffn())
    c_attn = torch.randn(tokens, hidden)
    c_ffn = torch.randn(tokens, hidden)
    fb = ForwardBatch(num_tokens=tokens)
    w, eps = n1.weight, n1.eps

    def with_boundaries() -> tuple[float, float]:
        stream, h = ResidualStream.arrive(residual=torch.randn(tokens, hidden), output=c_ffn)
        fb.residual_stream = stream
        ta = tf = 0
        for _ in range(iters):
            t0 = _ns()
            attn.prepare(h, fb)
            h = attn.finish(c_attn, fb)
            t1 = _ns()
            ffn.prepare(h, fb)
            with ffn.exit(fb) as out:
                pass
            h = out.finish(c_ffn)
            t2 = _ns()
            ta += t1 - t0
            tf += t2 - t1
        return ta / iters / 1e3, tf / iters / 1e3

    def kernels_only() -> float:
        r = torch.randn(tokens, hidden)
        t = 0
        for _ in range(iters):
            t0 = _ns()
            _, r = fused_add_rmsnorm_ref(c_ffn, r, w, eps)
            t += _ns() - t0
        return t / iters / 1e3

    with torch.inference_mode():
        with_boundaries(), kernels_only()  # warm up
        runs = [with_boundaries() for _ in range(5)]
        base = _median_of(5, kernels_only)
    attn_us = statistics.median(r[0] for r in runs)
    ffn_us = statistics.median(r[1] for r in runs)
    return {
        "tokens": tokens,
        "hidden": hidden,
        "kernel_us": base,
        "attn_prepare_finish_us": attn_us,
        "ffn_prepare_exit_finish_us": ffn_us,
        "attn_overhead_us": attn_us - base,
        "ffn_overhead_us": ffn_us - base,
    }


def forward_ratio(tokens: int, iters: int, config: Any = None) -> dict[str, float]:
    """Median forward time of the Qwen3 reference with and without boundaries (same kernels)."""
    from ..models.config import small_random_config
    from ..models.qwen3 import Qwen3ForCausalLM
    from ..models.qwen3_plain import plain_forward
    from ..models.random_init import init_random_weights

    config = config or small_random_config()
    model = Qwen3ForCausalLM(config)
    init_random_weights(model, seed=0)
    model.eval()
    ids = torch.randint(0, config.vocab_size, (tokens,))
    pos = torch.arange(tokens)

    def timed(fn: Callable[[], Any]) -> float:
        t0 = _ns()
        for _ in range(iters):
            fn()
        return (_ns() - t0) / iters / 1e3

    def bounded() -> Any:
        return model(ids, pos, ForwardBatch(num_tokens=tokens, positions=pos))

    def plain() -> Any:
        return plain_forward(model, ids, pos, ForwardBatch(num_tokens=tokens, positions=pos))

    with torch.inference_mode():
        if not torch.equal(bounded(), plain()):
            raise AssertionError("the boundary and plain forwards disagree; the comparison is void")
        b, p = [], []
        for _ in range(7):  # interleave so drift in machine load hits both alike
            b.append(timed(bounded))
            p.append(timed(plain))
    bm, pm = statistics.median(b), statistics.median(p)
    return {
        "tokens": tokens,
        "hidden": config.hidden_size,
        "layers": config.num_hidden_layers,
        "with_boundaries_us": bm,
        "without_boundaries_us": pm,
        "ratio": bm / pm,
        "per_boundary_us": (bm - pm) / (2 * config.num_hidden_layers + 1),
    }


def host_command(args: argparse.Namespace) -> int:
    # Decode-sized CPU work is host-bound: intra-op threads only add dispatch noise.
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"layer-boundary bench host: CPU {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, {date.today()}")
    print("\nper boundary (µs, median of 5 runs; kernel = the fused add+RMSNorm call alone)")
    print(f"{'T':>5} {'H':>6} {'kernel':>8} {'attn p+f':>9} {'ffn p+e+f':>10} {'attn ovh':>9} {'ffn ovh':>8}")
    per = []
    for t in args.tokens:
        r = boundary_overhead(t, 64, args.iters)
        per.append(r)
        print(f"{t:>5} {64:>6} {r['kernel_us']:>8.2f} {r['attn_prepare_finish_us']:>9.2f} "
              f"{r['ffn_prepare_exit_finish_us']:>10.2f} {r['attn_overhead_us']:>9.2f} {r['ffn_overhead_us']:>8.2f}")
    print("\ndecoder forward with / without boundaries (same modules and kernels; µs, median of 7)")
    print(f"{'T':>5} {'H':>6} {'layers':>6} {'with':>9} {'without':>9} {'ratio':>6} {'µs/bnd':>7}")
    fwd = []
    for hidden in args.hidden:
        cfg = _config_of_width(hidden)
        for t in args.tokens:
            iters = max(10, args.forward_iters * 64 // max(64, hidden))
            r = forward_ratio(t, iters, cfg)
            fwd.append(r)
            print(f"{t:>5} {r['hidden']:>6} {r['layers']:>6} {r['with_boundaries_us']:>9.1f} "
                  f"{r['without_boundaries_us']:>9.1f} {r['ratio']:>6.3f} {r['per_boundary_us']:>7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": str(date.today()), "torch": torch.__version__,
                       "cpu": platform.processor() or platform.machine(),
                       "threads": torch.get_num_threads(), "per_boundary": per, "forward": fwd}, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


def _config_of_width(hidden: int) -> Any:
    """The embedded model's shape at another width (head_dim 16 up to 256 wide, 128 above)."""
    import dataclasses

    from ..models.config import small_random_config

    head_dim = 16 if hidden <= 256 else 128
    heads = max(1, hidden // head_dim)
    kv = heads // 2 if heads % 2 == 0 else heads
    return dataclasses.replace(small_random_config(), hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                               num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim)
