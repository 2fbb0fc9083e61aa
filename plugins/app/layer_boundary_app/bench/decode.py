"""A decode step of the reference Qwen3 decoder with and without boundaries, eager and replayed.

The model has random weights and Qwen3-8B-like widths (hidden 4096, 32 query and 8 kv heads of
128, FFN 12288) with fewer layers and a smaller vocabulary. A step is one token per sequence.
Variants, each against ``plain`` of the same run and mode:

* ``plain``: the same modules without boundaries, an explicit residual, the all-reduce after
  attention, and the same norm kernels the boundaries selected (so only the boundaries differ);
* ``boundaries``: the model's forward, with no fused consumer candidate (a context that offers no
  fusion provider): every sum completed by NCCL, then the separate add+norm kernel;
* ``boundaries+fused`` (TP=2, when construction accepted a candidate): the model as discovered.

Eager timing shows what the boundaries cost on the host; CUDA-graph replay shows what is left
once the host is out of the picture.
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Any, Callable, Optional

import torch

from . import report
from .candidates import (UnfusedContext, accepted_candidates, describe_candidates, model_stages,
                         strip_candidates)
from .norm import DTYPES
from .timing import TimingPlan, cuda_unavailable, max_over_group, slowest, this_device, time_call, time_eager

__all__ = ["DECODE_BATCH", "decode_config", "plain_step", "decode_command"]

DECODE_BATCH = (1, 8, 32, 128)
QUICK_BATCH = (1, 32)
HEAD_DIM = 128
# bf16 logits against the plain forward, relative to the largest |logit| (as the GPU tests).
REL_TOL = {"bfloat16": 0.03, "float16": 0.01, "float32": 1e-4}


def decode_config(hidden: int, layers: int, vocab: int) -> Any:
    """Qwen3-8B's proportions at width ``hidden``: heads of 128, 4 query heads per kv head, FFN 3x."""
    from ..models.config import Qwen3Config

    if hidden % (4 * HEAD_DIM):
        raise ValueError(f"--hidden {hidden}: use a multiple of {4 * HEAD_DIM} (heads of {HEAD_DIM}, "
                         "4 query heads per kv head)")
    heads = hidden // HEAD_DIM
    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 4,
                       head_dim=HEAD_DIM, tie_word_embeddings=False, max_position_embeddings=4096)


def plain_step(model: Any, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any) -> torch.Tensor:
    """The model's logits computed without its boundaries, with the norm kernels they selected.

    The final norm uses the last FFN stage's kernels: its request (RMSNorm, dtype, width, device)
    is the same, so selection chose the same provider for it.
    """
    from ..models.comm import all_reduce

    m = model.model
    attn_tp = model.topology.attn_tp
    h = m.embed_tokens(input_ids)
    residual: Optional[torch.Tensor] = None
    read = None
    for layer in m.layers:
        read = layer.attn_boundary.plan.read
        k = read.kernels
        if residual is None:
            residual = h
            x = k.rmsnorm(h, read.weight, read.eps, weight_offset=read.offset)
        else:
            x, residual = k.fused_add_rmsnorm(h, residual, read.weight, read.eps, weight_offset=read.offset)
        x = layer.self_attn(positions=positions, hidden_states=x, forward_batch=forward_batch)
        h = all_reduce(x, attn_tp)  # o_proj leaves its sum (PARTIAL)
        read = layer.ffn_boundary.plan.read
        x, residual = read.kernels.fused_add_rmsnorm(h, residual, read.weight, read.eps,
                                                     weight_offset=read.offset)
        h = layer.mlp(x)  # down_proj reduces: no exit scope asks it not to
    assert read is not None and residual is not None
    x, _ = read.kernels.fused_add_rmsnorm(h, residual, m.norm.weight, m.norm.eps, weight_offset=0.0)
    return model.lm_head(x).float()


def _build(cfg: Any, ctx: Any, dtype: torch.dtype, device: str, like: Any = None) -> Any:
    from ..models.qwen3 import Qwen3ForCausalLM
    from ..models.random_init import init_random_weights

    model = Qwen3ForCausalLM(cfg, context=ctx, dtype=dtype)
    ctx.freeze()
    for stage in model_stages(model):
        if not hasattr(stage.plan.read, "kernels"):
            raise AssertionError(f"{stage.plan.name} reads through {stage.plan.read!r}, not RMSNorm kernels")
    if like is None:
        init_random_weights(model, seed=0)
        model = model.to(device)
    else:
        model = model.to(device)
        model.load_state_dict(like.state_dict())
    return model.eval().requires_grad_(False)


COLUMNS = [
    report.Column("variant", "variant", width=18),
    report.Column("TP", "tp", "d", 3),
    report.Column("batch", "batch", "d", 6),
    report.Column("mode", "mode", width=6),
    report.Column("µs/step", "us", report.sig, 9),
    report.Column("x plain", "ratio", ".3f", 8),
    report.Column("Δµs/bnd", "delta_per_boundary_us", ".2f", 8),
]


def _decode_rank(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    from layer_boundary import BoundaryContext, ForwardBatch, ForwardMode, Topology

    say: Callable[[str], None] = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    # cuda (NCCL) for the benchmark; cpu (gloo) only exercises the harness.
    device = this_device(spec.get("device", "cuda"))
    dtype = DTYPES[spec["dtype"]]
    plan = TimingPlan.for_run(spec["quick"], spec["replays"])
    topo = Topology.from_sizes(tp=world) if world > 1 else Topology.single()
    agree = max_over_group(topo.tp.group, device) if world > 1 else None
    cfg = decode_config(spec["hidden"], spec["layers"], spec["vocab"])
    boundaries = 2 * cfg.num_hidden_layers + 1  # per step: two per layer and the final norm

    ctx = BoundaryContext.discover(topo, device=device)
    discovered = _build(cfg, ctx, dtype, device)
    cands = accepted_candidates(model_stages(discovered))
    note = f"TP={world}: " + (describe_candidates(cands, ctx) if world > 1 or cands else
                              "one rank, no sum between stages, nothing to fuse")
    variants: dict[str, Any] = {}
    if cands:
        unfused_ctx = UnfusedContext(topo, registry=_registry(device), device=device)
        unfused = _build(cfg, unfused_ctx, dtype, device, like=discovered)
        dropped = strip_candidates(model_stages(unfused))
        if dropped:
            note += f" ({dropped} built-in candidate(s) removed from the unfused model)"
        variants = {"plain": unfused, "boundaries": unfused, "boundaries+fused": discovered}
    else:
        variants = {"plain": discovered, "boundaries": discovered}
    say(note)
    report_lines = ctx.report.lines()
    table = report.Table(COLUMNS, say)
    table.header()
    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    compiled_steps: dict[str, Any] = {}
    with torch.inference_mode():
        for batch in spec["tokens"]:
            g = torch.Generator().manual_seed(batch)
            ids = torch.randint(0, cfg.vocab_size, (batch,), generator=g).to(device)  # same on every rank
            pos = torch.zeros(batch, dtype=torch.long, device=device)

            def step_of(name: str, model: Any) -> Callable[[], torch.Tensor]:
                fn = plain_step if name == "plain" else (lambda m, i, p, fb: m(i, p, fb))

                def step() -> torch.Tensor:
                    fb = ForwardBatch(num_tokens=batch, positions=pos, seq_lens=(1,) * batch,
                                      mode=ForwardMode.DECODE)
                    return fn(model, ids, pos, fb)

                return step

            steps = {name: step_of(name, model) for name, model in variants.items()}
            if spec.get("compile"):
                # Each variant's step compiled whole (fullgraph: a break is an error), then timed
                # by CUDA-graph replay like the eager graphs: what an engine that compiles and
                # captures runs. One compile per batch size (decode seq_lens has one entry per row).
                for name in list(variants):
                    compiled = compiled_steps.setdefault(name, torch.compile(
                        plain_step if name == "plain" else variants[name], fullgraph=True, dynamic=False,
                        backend=spec.get("compile_backend", "inductor")))
                    steps[f"{name} compiled"] = _bound(compiled, variants[name], name, ids, pos, batch)
            want = steps["plain"]().float()
            scale = max(1.0, want.abs().max().item())
            for name in steps:
                if name == "plain":
                    continue
                diff = (steps[name]().float() - want).abs().max().item()
                ok = diff <= REL_TOL[spec["dtype"]] * scale
                checks.append({"tp": world, "batch": batch, "variant": name, "max_diff": diff, "scale": scale,
                               "ok": ok})
                if not ok:
                    say(f"  WARNING: {name} differs from plain by {diff:.3g} (largest |logit| {scale:.3g})")
            base: dict[str, float] = {}
            modes = (("eager", time_eager), ("graph", time_call)) if device.startswith("cuda") else (("eager", time_eager),)
            for mode, timer in modes:
                for name, step in steps.items():
                    compiled_row = name.endswith(" compiled")
                    if compiled_row and mode != "graph":
                        continue  # compiled steps are timed captured, as engines run them
                    m = timer(step, device, plan, agree)
                    us = m.median_us
                    if world > 1:
                        us = slowest(us, topo.tp.group, device)
                    key = f"{mode} compiled" if compiled_row else mode
                    base.setdefault(key, us)  # each mode's plain is timed first
                    row = {"tp": world, "batch": batch, "variant": name, "mode": mode, "us": us,
                           "min_us": m.min_us, "calls": m.calls, "ratio": us / base[key],
                           "delta_per_boundary_us": (us - base[key]) / boundaries}
                    rows.append(row)
                    table.row(row)
                gc.collect()
    return {"rows": rows, "checks": checks, "note": note, "selection": report_lines,
            "layers": cfg.num_hidden_layers, "boundaries_per_step": boundaries}


def _bound(compiled: Any, model: Any, name: str, ids: torch.Tensor, pos: torch.Tensor,
           batch: int) -> Callable[[], torch.Tensor]:
    from layer_boundary import ForwardBatch, ForwardMode

    def step() -> torch.Tensor:
        fb = ForwardBatch(num_tokens=batch, positions=pos, seq_lens=(1,) * batch, mode=ForwardMode.DECODE)
        return compiled(model, ids, pos, fb) if name == "plain" else compiled(ids, pos, fb)

    return step


def _registry(device: str) -> Any:
    """A fresh registry of the plugins found here (a context's own, for the unfused peer)."""
    from layer_boundary import BoundaryContext

    return BoundaryContext.discover(device=device).registry


def _panels(rows: list[dict[str, Any]]) -> list[report.Panel]:
    panels = []
    for tp in sorted({r["tp"] for r in rows}):
        mine = [r for r in rows if r["tp"] == tp]
        keys = list(dict.fromkeys((r["variant"], r["mode"]) for r in mine))
        series = tuple(report.Series(f"{v}, {mode}", tuple((r["batch"], r["us"]) for r in mine
                                                         if r["variant"] == v and r["mode"] == mode),
                                     dashed=mode == "eager", color=v)
                       for v, mode in keys)
        panels.append(report.Panel(f"TP = {tp}", "batch (tokens)", "µs per decode step", series))
    return panels


def decode_command(args: argparse.Namespace) -> int:
    tps = args.tp
    why = cuda_unavailable("decode", max(tps) if tps else 1)
    if why:
        print(why, file=sys.stderr)
        return 2
    if tps is None:
        tps = [1, 2] if torch.cuda.device_count() >= 2 else [1]
        if tps == [1]:
            print("one GPU visible: TP=1 only (TP=2 and the fused candidates need 2 GPUs)")
    layers = args.layers or (4 if args.quick else 8)
    spec = {"tokens": list(args.tokens or (QUICK_BATCH if args.quick else DECODE_BATCH)),
            "hidden": args.hidden, "layers": layers, "vocab": args.vocab, "dtype": args.dtype,
            "quick": args.quick, "replays": args.replays, "compile": args.compile}
    decode_config(args.hidden, layers, args.vocab)  # a bad width fails here, before any GPU work
    env = report.environment("cuda", max(tps))
    plan = TimingPlan.for_run(args.quick, args.replays)
    print(f"layer-boundary bench decode: Qwen3 decode step, {layers} layers, hidden {args.hidden}, "
          f"vocab {args.vocab}, {args.dtype}, {env['gpu']}, torch {env['torch']}, {env['date']}\n"
          f"median µs per step over {plan.replays} rounds (eager: between CUDA events; graph: "
          "CUDA-graph replay); x plain and Δµs/bnd against the plain forward of the same mode, "
          f"{2 * layers + 1} boundaries per step\n", flush=True)
    results = []
    for tp in tps:
        if tp == 1:
            results.append(_decode_rank(0, 1, spec))
            gc.collect()  # the models go before another process needs the GPU
            torch.cuda.empty_cache()
        else:
            from ..launch import spawn

            results.append(spawn(_decode_rank, tp, args=(spec,), backend="nccl", timeout_s=1200)[0])
        print("", flush=True)
    rows = [r for res in results for r in res["rows"]]
    checks = [c for res in results for c in res["checks"]]
    report.publish(args, "decode", env, rows, f"Qwen3 decode step, {layers} layers, {args.dtype}", _panels(rows),
                   note="; dashed: eager", checks=checks, notes=[res["note"] for res in results],
                   selection={f"tp{tp}": res["selection"] for tp, res in zip(tps, results)},
                   model={"hidden": args.hidden, "layers": layers, "vocab": args.vocab,
                          "heads": args.hidden // HEAD_DIM, "kv_heads": args.hidden // HEAD_DIM // 4,
                          "head_dim": HEAD_DIM, "intermediate": 3 * args.hidden},
                   timing="median per step; eager between CUDA events, graph by CUDA-graph replay; slowest rank",
                   replays=plan.replays)
    bad = [c for c in checks if not c["ok"]]
    if bad:
        print(f"{len(bad)} variant(s) differ from the plain forward beyond tolerance: "
              + "; ".join(f"{c['variant']} TP={c['tp']} batch={c['batch']}" for c in bad))
        return 1
    return 0
