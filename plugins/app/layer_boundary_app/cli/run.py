"""``layer-boundary run``: build a reference decoder on the boundaries and run one forward."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
import torch.distributed as dist

from layer_boundary import PluginError, Topology
from layer_boundary.plugin_api import gather_objects

from ..launch import RankError, spawn, under_torchrun
from ..models.layers import head_group
from ..models.runner import RunSpec, build_model, describe_model, rank_forward, single_rank_logits

__all__ = ["run_command", "describe_stages"]

def _layer_boundaries(layer: Any) -> tuple[Any, ...]:
    # A heterogeneous layer has one stage; a Qwen3 layer an attention and an FFN stage.
    return getattr(layer, "boundaries", None) or (layer.attn_boundary, layer.ffn_boundary)


def describe_stages(model: Any) -> list[str]:
    """One line per run of layers whose stages are built alike."""
    rows: list[tuple[int, str]] = []
    for i, layer in enumerate(model.model.layers):
        for b in _layer_boundaries(layer):
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
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(parts)


# Tolerance of --check against the single-rank model, relative to the largest |logit|: regrouped
# sums round differently. float32: a few ulps through the stack; bfloat16: measured against
# transformers at 0.015 (see tests/app/test_qwen3_transformers.py), doubled.
CHECK_REL = {"float32": 1e-5, "bfloat16": 0.03, "float64": 1e-12}


def _spec(args: argparse.Namespace, tp: int) -> RunSpec:
    return RunSpec(sequences=tuple(tuple(s) for s in args.input_ids), model=args.model, seed=args.seed,
                   dtype=args.dtype, tp=tp, dp=args.dp, pp=getattr(args, "pp", 1), cp=getattr(args, "cp", 1),
                   reduction=args.reduction, residual=args.residual,
                   device=args.device, pattern=args.pattern, moe=getattr(args, "moe", False),
                   defer_moe_finalize=getattr(args, "defer_moe_finalize", False),
                   fused_finalize=getattr(args, "fused_finalize", False),
                   tbo=getattr(args, "tbo", False), longcat=getattr(args, "longcat", False),
                   compile=getattr(args, "compile", None))


def _check_lengths(spec: RunSpec, cfg: Any) -> None:
    """Every sequence within the model's positions (its rotary table has that many rows)."""
    limit = getattr(cfg, "max_position_embeddings", None)
    longest = max(len(s) for s in spec.sequences)
    if limit is not None and longest > limit:
        raise ValueError(f"a sequence of {longest} tokens is longer than the model's "
                         f"max_position_embeddings={limit}; pass shorter --input-ids sequences")


def _check_layout(spec: RunSpec, cfg: Any) -> None:
    """The model's own layout rules (heads over the attention ranks, layers over pipeline stages),
    checked before any rank starts: each rank would say the same after its start-up."""
    from ..models.layers import local_head_counts
    from ..models.qwen3 import pp_layer_range

    heads, kv = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    # Heads are sharded over the attention-TP ranks of one CP position: tp / dp / cp of them.
    if isinstance(heads, int) and isinstance(kv, int) and spec.tp % (spec.dp * spec.cp) == 0:
        local_head_counts(heads, kv, spec.tp // (spec.dp * spec.cp))
    layers = getattr(cfg, "num_hidden_layers", None)
    if isinstance(layers, int) and spec.pp > 1:
        pp_layer_range(layers, 0, spec.pp)


def _check_world(spec: RunSpec, backend: str) -> None:
    """A layout this machine can start: one process a rank (gloo: at most 4 a CPU, 16 at least)."""
    cpus = os.cpu_count() or 1
    limit = max(16, 4 * cpus)
    if backend == "gloo" and spec.world_size > limit and not under_torchrun():
        raise ValueError(f"--tp {spec.tp} x --pp {spec.pp} is {spec.world_size} ranks, one process each; this "
                         f"machine has {cpus} CPUs (at most {limit} ranks here): choose a smaller layout")


def _rank_job(rank: int, world: int, spec: RunSpec, repeats: int) -> dict[str, Any]:
    """One rank: build, run ``repeats`` forwards, return its rows' logits (rank 0 also the report)."""
    if rank != 0:
        # Every rank discovers the same plugins and builds the same stages: rank 0 alone says what
        # it warns about, once (errors still come from every rank).
        import logging
        import warnings

        logging.getLogger("layer_boundary").setLevel(logging.ERROR)
        warnings.simplefilter("ignore")
    topo = (Topology.from_sizes(tp=spec.tp, dp=spec.dp, cp=spec.cp, pp=spec.pp) if world > 1
            else Topology.single())
    device = spec.device
    model = build_model(spec, topo, device)
    idx, logits, first = rank_forward(model, spec, device)
    if not bool(torch.isfinite(logits).all()):
        raise ValueError("the logits hold NaN or inf values: check the checkpoint's weights "
                         f"(a NaN or inf weight) and --dtype{_plugin_suspects(model.context)}")
    times = []
    for _ in range(repeats):
        idx2, again, t = rank_forward(model, spec, device)
        if not torch.equal(again, logits):
            raise RuntimeError(f"rank {rank}: two forwards of the same input gave different logits")
        times.append(t)
    times.sort()
    out: dict[str, Any] = {"rank": rank, "tokens": idx, "logits": logits, "first": first,
                           "median": times[len(times) // 2] if times else first,
                           # Ranks of one head group hold the same rows: the first reports them.
                           "attn_tp_rank": head_group(topo).rank}
    if rank == 0:
        registry = model.context.registry
        out["header"] = {
            "topology": topo.describe(),
            "residual": _describe_residual(model.residual),
            "boundaries": sum(len(_layer_boundaries(layer)) for layer in model.model.layers),
            "stages": describe_stages(model),
            "plugins": (", ".join(f"{r.name} ({r.status.value})" for r in registry.records) or "none found")
            if registry is not None else "not discovered",
            "selection": model.context.report.lines(),
            "vocab": model.config.vocab_size,
        }
        if spec.tbo:
            out["header"]["tbo"] = _describe_tbo(model, spec)
    return out


def _run_ranks(spec: RunSpec, backend: str, repeats: int) -> list[dict[str, Any]]:
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != spec.world_size:
            raise SystemExit(f"layer-boundary run: torchrun started {world} ranks but --tp {spec.tp} x "
                             f"--pp {spec.pp} is {spec.world_size}")
        rank = int(os.environ["RANK"])
        ours = not dist.is_initialized()
        if ours:
            dist.init_process_group(backend)
        try:
            everyone = gather_objects(_rank_job(rank, world, spec, repeats))  # no NumPy needed
        finally:
            if ours:
                # A rank that exits with its gloo group alive can abort in the group's threads
                # ("terminate called without an active exception") while rank 0 still reports.
                dist.destroy_process_group()
        return everyone
    if spec.world_size == 1:
        return [_rank_job(0, 1, spec, repeats)]
    return spawn(_rank_job, spec.world_size, args=(spec, repeats), backend=backend)


# Exceptions a rank raises for what the user asked (the message says what to change), printed
# without their traceback.
_USER_ERRORS = frozenset({"ValueError", "DeclarationError", "CheckpointMismatch", "FileNotFoundError"})


def run_command(args: argparse.Namespace) -> int:
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("layer-boundary run: --device cuda but no CUDA device is visible to torch "
              f"{torch.__version__}; run with --device cpu or on a machine with a GPU", file=sys.stderr)
        return 2
    if args.model and not os.path.isdir(args.model):  # a usage error: 2, as the others
        print(f"layer-boundary run: --model {args.model!r} is not a folder; give a Hugging Face checkpoint "
              "folder with config.json and *.safetensors", file=sys.stderr)
        return 2
    tp = args.tp if args.tp is not None else (1 if args.model or device == "cuda" else 2)
    backend = args.backend or ("nccl" if device == "cuda" else "gloo")
    if backend == "nccl" and device != "cuda":
        print("layer-boundary run: --backend nccl needs --device cuda", file=sys.stderr)
        return 2
    try:
        spec = _spec(args, tp)
    except ValueError as e:
        print(f"layer-boundary run: {e}", file=sys.stderr)
        return 2
    from ..models.runner import _config

    try:
        # Reads a --model folder's config.json: its model_type picks the decoder.
        cfg = _config(spec)
        if args.model:
            from ..models.loader import check_safetensors

            check_safetensors(args.model)  # the weights are there and read (each rank loads them)
        _check_lengths(spec, cfg)
        _check_world(spec, backend)
        _check_layout(spec, cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"layer-boundary run: {e}", file=sys.stderr)
        return 2
    if spec.fused_finalize and cfg.model_type != "qwen3_moe":
        print("layer-boundary run: --fused-finalize needs a Qwen3-MoE model (--moe, or a --model "
              f"folder whose model_type is qwen3_moe); this model is {cfg.model_type!r}", file=sys.stderr)
        return 2
    if spec.defer_moe_finalize and cfg.model_type not in ("qwen3_moe", "longcat"):
        print("layer-boundary run: --defer-moe-finalize needs a Qwen3-MoE model or the LongCat-style "
              "one (--moe, --longcat, or a --model folder whose model_type is qwen3_moe); this model "
              f"is {cfg.model_type!r}", file=sys.stderr)
        return 2
    vocab = cfg.vocab_size
    bad = sorted({i for s in spec.sequences for i in s if i >= vocab})
    note = None
    if bad and getattr(args, "default_ids", False):
        # The default ids are examples, not a text: any vocabulary takes them modulo its size.
        spec = replace(spec, sequences=tuple(tuple(i % vocab for i in s) for s in spec.sequences))
        note = (f"the default token ids {bad} are past the vocabulary of {vocab} tokens: taken modulo "
                f"{vocab} ({', '.join(str(i) for s in spec.sequences for i in s)}); --input-ids gives your own")
    elif bad:
        print(f"layer-boundary run: --input-ids {bad} are outside the vocabulary of {vocab} tokens; pass "
              f"--input-ids below {vocab}", file=sys.stderr)
        return 2
    try:
        results = _run_ranks(spec, backend, repeats=5)
    except PluginError as e:
        print(f"layer-boundary run: {e}", file=sys.stderr)
        return 2
    except RankError as e:
        last = e.remote.strip().splitlines()[-1] if e.remote.strip() else str(e)
        if "PluginError" in last:
            print(f"layer-boundary run: {last.split(': ', 1)[-1]}", file=sys.stderr)
            return 2
        if last.split(": ", 1)[0].rsplit(".", 1)[-1] in _USER_ERRORS:
            # A layout or checkpoint the model refuses (heads --tp does not divide, more pipeline
            # stages than layers, ...): its message, not a rank's traceback.
            print(f"layer-boundary run: rank {e.rank}: {last}", file=sys.stderr)
            return 2
        print(f"layer-boundary run: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # the one rank ran in this process: the same one-line report as spawned ranks
        if type(e).__name__ not in _USER_ERRORS:
            raise
        print(f"layer-boundary run: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if under_torchrun() and int(os.environ["RANK"]) != 0:
        return 0  # rank 0 reports (and checks, and saves) for the whole run
    return _report(args, spec, results, backend, note)


def _report(args: argparse.Namespace, spec: RunSpec, results: list[dict[str, Any]], backend: str,
            note: Optional[str] = None) -> int:
    head = results[0]["header"]
    total = sum(len(s) for s in spec.sequences)
    print(f"model:    {describe_model(spec)}")
    if note is not None:
        print(f"input:    {note}")
    print(f"dtype:    {spec.dtype}   device: {spec.device}   ranks: {spec.world_size} ({backend})   "
          f"topology: {head['topology']}   reduction: {spec.reduction}")
    print(f"residual: {head['residual']}")
    # Rank 0 reports: under --pp its pipeline stage's layers, not the whole model's.
    where = f" (pipeline stage 0 of {spec.pp}: its layers only)" if spec.pp > 1 else ""
    print(f"stages:   {head['boundaries']} boundaries{where}")
    for line in head["stages"]:
        print(line)
    if "tbo" in head:
        for line in head["tbo"]:
            print(line)
    print(f"plugins:  {head['plugins']}")
    print("selection:")
    for line in head["selection"]:
        print(line)
    logits = torch.zeros(total, head["vocab"])
    for r in results:
        if r["attn_tp_rank"] == 0 and r["tokens"]:
            logits[r["tokens"]] = r["logits"]
    slowest = max(results, key=lambda r: r["median"])
    print(f"forward:  {total} tokens in {len(spec.sequences)} sequence(s) on {spec.world_size} rank(s): "
          f"{1e3 * results[0]['median']:.2f} ms median on rank 0, slowest rank {slowest['rank']} "
          f"{1e3 * slowest['median']:.2f} ms (first call {1e3 * results[0]['first']:.2f} ms)")
    top = torch.topk(logits[-1], k=min(5, head["vocab"]))
    print(f"logits:   [{total}, {head['vocab']}] float32; last token top-5 ids {top.indices.tolist()}")
    checked = _check(spec, results) if args.check else None
    if args.save_logits:
        torch.save(logits, args.save_logits)
        print(f"saved:    {args.save_logits}")
    print(f"terms:    {CONCEPTS} explains every term above (PARTIAL, SCOPED, [policy ...] -> ..., variants, ...)")
    print(_verdict(spec, head["topology"], backend, checked))
    return 0 if checked is None or checked.ok else 1


# The concepts page every term of the report is explained in (linked once, in the "terms" line).
CONCEPTS = "docs/concepts.md"


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    worst: float  # the largest |logit difference| against the single-rank model
    rank: int  # where it was (-1: no rank holds rows)
    tolerance: float


def _verdict(spec: RunSpec, topology: str, backend: str, checked: Optional[CheckResult]) -> str:
    """The report's last line: what ran, on what layout, and what was verified (or that nothing was)."""
    ran = (f"verdict:  ran {describe_model(spec)} in {spec.dtype} on {spec.world_size} "
           f"{'rank' if spec.world_size == 1 else 'ranks'} ({topology}; {spec.device}, {backend}"
           f"{f'; compiled, {spec.compile}' if spec.compile else ''})")
    if checked is None:
        return (f"{ran}; nothing checked: rerun with --check to compare every rank's logits with the "
                "single-rank model")
    where = f" on rank {checked.rank}" if checked.rank >= 0 else ""
    if checked.ok:
        return (f"{ran}; checked: logits equal the single-rank model (max |diff| {checked.worst:.3g}{where}, "
                f"tolerance {checked.tolerance:.3g})")
    return (f"{ran}; CHECK FAILED: logits differ from the single-rank model by {checked.worst:.3g}{where}, "
            f"above the tolerance {checked.tolerance:.3g}")


def _check(spec: RunSpec, results: list[dict[str, Any]]) -> CheckResult:
    ref = single_rank_logits(RunSpec(**{**spec.__dict__, "tp": 1, "dp": 1, "pp": 1, "cp": 1}))
    scale = max(1.0, ref.abs().max().item())
    tol = CHECK_REL[spec.dtype] * scale
    worst = (0.0, -1)
    for r in results:
        if r["tokens"]:
            d = (r["logits"] - ref[r["tokens"]]).abs().max().item()
            worst = max(worst, (d, r["rank"]))
    ok = worst[0] <= tol
    where = f" (rank {worst[1]})" if worst[1] >= 0 else ""
    print(f"check:    {'ok' if ok else 'MISMATCH'}: largest |logit difference| against the single-rank "
          f"model {worst[0]:.3g}{where}, tolerance {tol:.3g}")
    if not ok and spec.dtype == "bfloat16" and (spec.moe or spec.longcat or _is_moe_folder(spec)):
        print("note:     in bfloat16 a near-tie in a MoE router's top-k can choose another expert "
              "when the sums feeding it are regrouped over ranks; that token's logits then move by "
              "more than rounding. Check the layout in float32 (--dtype float32)")
    return CheckResult(ok, worst[0], worst[1], tol)


def _is_moe_folder(spec: RunSpec) -> bool:
    from ..models.runner import _config

    return bool(spec.model) and _config(spec).model_type == "qwen3_moe"


def _describe_tbo(model: Any, spec: RunSpec) -> list[str]:
    from ..models.runner import tbo_split

    ids = [layer.layer_id for layer in model.model.layers]  # this pipeline partition's layers
    lines = [f"tbo:      {model.model.tbo_plan.describe()} (local layers {ids[0]}-{ids[-1]})"]
    split = tbo_split(spec, 0)
    if split.dp_num_tokens is None:
        a = sum(len(s) for s in spec.sequences[: split.seq_index])
        lines.append(f"          microbatches: {split.seq_index} + {len(spec.sequences) - split.seq_index} "
                     f"sequence(s), {a} + {sum(len(s) for s in spec.sequences) - a} tokens")
    else:
        a, b = split.dp_num_tokens
        lines.append("          microbatch tokens per DP group: " + ", ".join(
            f"{x} + {y}" for x, y in zip(a, b)))
    return lines


def _plugin_suspects(context: Any) -> str:
    """The plugins' providers this model chose, for a bad result's message: a kernel can be the
    cause as well as a weight (LAYER_BOUNDARY_DISABLE=<plugin> tells them apart)."""
    registry = context.registry
    if registry is None:
        return ""
    origins = {p.name: o for o, p in list(registry.norm_kernels) + list(registry.fusion_providers)}
    chosen = sorted({f"{s.chosen} (plugin {origins[s.chosen]})" for s in context.report.selections
                     if s.chosen in origins})
    if not chosen:
        return ""
    return (f"; or a plugin's kernel: this model runs {', '.join(chosen)} (rerun with "
            "LAYER_BOUNDARY_DISABLE=<plugin> to tell them apart)")


def _describe_residual(semantics: Any) -> str:
    describe = getattr(semantics, "describe", None)
    if callable(describe):
        return describe()
    # A plugin's scheme that does not describe itself is named, never given the plain formula.
    return f"{semantics.name} (a plugin's scheme; it has no describe())"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
