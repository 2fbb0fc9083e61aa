"""``layer-boundary run``: build a reference decoder on the boundaries and run one forward."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Optional

import torch

from ..forward import ForwardBatch
from ..topology import Topology

__all__ = ["run_command", "describe_stages"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def describe_stages(model: Any) -> list[str]:
    """One line per run of layers whose stages are built alike."""
    rows: list[tuple[int, str]] = []
    for i, layer in enumerate(model.model.layers):
        for b in (layer.attn_boundary, layer.ffn_boundary):
            rows.append((i, b.plan.describe()))
    return _merge(rows)


def _merge(rows: list[tuple[int, str]]) -> list[str]:
    # Group identical descriptions that repeat with the layer index; keep first-seen order.
    groups: dict[str, list[int]] = {}
    for layer, text in rows:
        groups.setdefault(text, []).append(layer)
    out = []
    for text, layers in groups.items():
        span = f"layer {layers[0]}" if len(layers) == 1 else f"layers {_ranges(layers)}"
        out.append(f"  {span:<14} {text}")
    return out


def _ranges(xs: list[int]) -> str:
    parts, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:  # type: ignore[list-item]
        if x is not None and x == prev + 1:
            prev = x
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(parts)


def _build(args: argparse.Namespace, dtype: torch.dtype, device: str) -> Optional[tuple[Any, str]]:
    from ..context import BoundaryContext
    from ..models.qwen3 import Qwen3ForCausalLM
    from ..plugins import PluginError

    context = BoundaryContext.discover(Topology.single(), device=device)
    topology = None
    try:
        residual = context.semantics(args.residual)
    except PluginError as e:  # the scheme's plugin is missing, disabled or failed: say why
        print(f"layer-boundary run: --residual {args.residual}: {e}", file=sys.stderr)
        return None
    if args.model:
        if not os.path.isdir(args.model):
            raise SystemExit(f"layer-boundary run: --model {args.model!r} is not a folder; give a "
                             "Hugging Face checkpoint folder with config.json and *.safetensors")
        model = Qwen3ForCausalLM.from_pretrained(args.model, topology, context=context, dtype=dtype,
                                                 device=device, residual=residual)
        what = f"Qwen3 from {args.model}"
    else:
        from ..models.config import small_random_config
        from ..models.random_init import init_random_weights

        config = small_random_config()
        model = Qwen3ForCausalLM(config, topology, context=context, dtype=dtype, residual=residual)
        init_random_weights(model, seed=args.seed)
        model = model.to(device).eval()
        what = (f"embedded random Qwen3 (seed {args.seed}): {config.num_hidden_layers} layers, "
                f"hidden {config.hidden_size}, vocab {config.vocab_size}")
    context.freeze()
    return model, what


def run_command(args: argparse.Namespace) -> int:
    dtype = _DTYPES[args.dtype]
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("layer-boundary run: --device cuda but no CUDA device is visible to torch "
              f"{torch.__version__}; run with --device cpu or on a machine with a GPU", file=sys.stderr)
        return 2
    built = _build(args, dtype, device)
    if built is None:
        return 2
    model, what = built
    vocab = model.config.vocab_size
    bad = [i for i in args.input_ids if i >= vocab]
    if bad:
        print(f"layer-boundary run: --input-ids {bad} are outside the vocabulary of {vocab} tokens",
              file=sys.stderr)
        return 2
    ids = torch.tensor(args.input_ids, dtype=torch.long, device=device)
    positions = torch.arange(len(args.input_ids), device=device)

    print(f"model:    {what}")
    print(f"dtype:    {args.dtype}   device: {device}   topology: {model.topology.describe()}")
    print(f"residual: {_describe_residual(model.residual)}")
    print(f"stages:   {2 * len(model.model.layers)} boundaries")
    for line in describe_stages(model):
        print(line)
    registry = model.context.registry
    if registry is not None:
        found = ", ".join(f"{r.name} ({r.status.value})" for r in registry.records) or "none found"
        print(f"plugins:  {found}")
    print("selection:")
    for line in model.context.report.lines():
        print(line)

    def forward() -> torch.Tensor:
        fb = ForwardBatch(num_tokens=len(args.input_ids), positions=positions)
        return model(ids, positions, fb)

    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = forward()
        _sync(device)
        first = time.perf_counter() - t0
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            again = forward()
            _sync(device)
            times.append(time.perf_counter() - t0)
    if not torch.equal(logits, again):
        print("layer-boundary run: two forwards of the same input gave different logits", file=sys.stderr)
        return 1
    times.sort()
    last = logits[-1]
    top = torch.topk(last, k=min(5, vocab))
    print(f"forward:  {len(args.input_ids)} tokens, {1e3 * times[len(times) // 2]:.2f} ms median of 5 "
          f"(first call {1e3 * first:.2f} ms)")
    print(f"logits:   [{logits.shape[0]}, {logits.shape[1]}] float32; last token top-5 ids "
          f"{top.indices.tolist()}")
    if args.save_logits:
        torch.save(logits.float().cpu(), args.save_logits)
        print(f"saved:    {args.save_logits}")
    return 0


def _describe_residual(semantics: Any) -> str:
    describe = getattr(semantics, "describe", None)
    return describe() if callable(describe) else f"{semantics.name}: r' = r + y, add+RMSNorm reads"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
