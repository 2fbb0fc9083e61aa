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
import time
from datetime import date
from typing import Any, Callable

import torch

from layer_boundary import (
    AddNormReadSpec, declare_attn, declare_ffn, ForwardBatch, make_stages, ResidualStream, RMSNorm,
)
from layer_boundary.plugin_api import fused_add_rmsnorm_ref, NormKernels

__all__ = ["boundary_overhead", "forward_ratio", "host_command", "FORWARD_LAYERS"]

FORWARD_LAYERS = 8  # the decoder forward comparison's depth (issue 30 states its target at 8 layers)

# Per-thread CPU time, not wall time: torch runs on this one thread here (``--threads 1``), and
# the time the thread spends descheduled (another process on a shared CPU) is not the boundary's.
# Measured on this 2-core machine under load, wall-clock minima of the difference swung from -0.1
# to 17.6 µs per boundary between runs; thread time held within a few tenths.
_ns = time.thread_time_ns


def _loop_us(fn: Callable[[], Any], iters: int) -> float:
    t0 = _ns()
    for _ in range(iters):
        fn()
    return (_ns() - t0) / iters / 1e3


def _min_interleaved(fns: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Minimum over ``repeats`` rounds, the candidates interleaved within each round: machine
    noise only ever adds time, and interleaving exposes every candidate to the same drift."""
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            best[k] = min(best[k], fn())
    return best


def boundary_overhead(tokens: int, hidden: int, iters: int, repeats: int = 9) -> dict[str, float]:
    """Host µs per boundary: a cycle of one attention (prepare + finish) and one FFN boundary
    (prepare + exit + finish) against the two fused add+RMSNorm calls it makes, and the same
    cycle with no-op kernels (the boundary's own bookkeeping, free of kernel timing)."""
    n1, n2 = RMSNorm(hidden), RMSNorm(hidden)
    attn, ffn = make_stages((declare_attn(), n1), (declare_ffn(), n2), previous=declare_ffn())
    n3, n4 = RMSNorm(hidden), RMSNorm(hidden)
    noop = NormKernels("no-op", lambda x, w, e, weight_offset=0.0: x,
                       lambda x, r, w, e, weight_offset=0.0: (x, r))
    attn0, ffn0 = make_stages((declare_attn(read=AddNormReadSpec(noop)), n3),
                              (declare_ffn(read=AddNormReadSpec(noop)), n4), previous=declare_ffn())
    c_attn = torch.randn(tokens, hidden)
    c_ffn = torch.randn(tokens, hidden)
    w, eps = n1.weight, n1.eps

    def cycle_of(a: Any, f: Any) -> Callable[[], float]:
        fb = ForwardBatch(num_tokens=tokens)

        def run() -> float:
            stream, h = ResidualStream.arrive(residual=torch.randn(tokens, hidden), output=c_ffn)
            fb.residual_stream = stream
            state = [h]

            def one() -> None:
                a.prepare(state[0], fb)
                h1 = a.finish(c_attn, fb)
                f.prepare(h1, fb)
                with f.exit(fb) as out:
                    pass
                state[0] = out.finish(c_ffn)

            return _loop_us(one, iters)

        return run

    def kernels_only() -> float:
        r = torch.randn(tokens, hidden)

        def two() -> None:
            fused_add_rmsnorm_ref(c_attn, r, w, eps)
            fused_add_rmsnorm_ref(c_ffn, r, w, eps)

        return _loop_us(two, iters)

    with torch.inference_mode():
        best = _min_interleaved(
            {"cycle": cycle_of(attn, ffn), "kernels": kernels_only, "bookkeeping": cycle_of(attn0, ffn0)},
            repeats,
        )
    return {
        "tokens": tokens,
        "hidden": hidden,
        "kernel_us": best["kernels"] / 2,
        "cycle_us": best["cycle"],
        "per_boundary_us": (best["cycle"] - best["kernels"]) / 2,
        "bookkeeping_per_boundary_us": best["bookkeeping"] / 2,
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
        best = _min_interleaved({"b": lambda: timed(bounded), "p": lambda: timed(plain)}, 9)
    bm, pm = best["b"], best["p"]
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
    print("timing: per-thread CPU time (time.thread_time_ns), min of 9 interleaved rounds")
    print("\nper boundary (µs, min of 9 interleaved rounds; a cycle is one attention boundary "
          "(prepare + finish) and one FFN boundary (prepare + exit + finish))")
    print(f"{'T':>5} {'H':>6} {'kernel':>8} {'cycle':>8} {'per bnd':>8} {'bookkeeping':>12}")
    per = []
    for t in args.tokens:
        r = boundary_overhead(t, 64, args.iters)
        per.append(r)
        print(f"{t:>5} {64:>6} {r['kernel_us']:>8.2f} {r['cycle_us']:>8.2f} {r['per_boundary_us']:>8.2f} "
              f"{r['bookkeeping_per_boundary_us']:>12.2f}")
    print("\ndecoder forward with / without boundaries (same modules and kernels; µs, min of 9 "
          "interleaved rounds)")
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
                               num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                               num_hidden_layers=FORWARD_LAYERS)
