"""Run a reference model on N ranks: sequences spread over attention-DP groups, logits gathered.

Used by ``layer-boundary run`` and by the multi-process tests. Every rank builds the same model
(the same checkpoint or the same seeded random weights) on its topology; DP group ``d`` gets the
sequences ``i`` with ``i % dp == d`` (a group may get none) and runs them packed in one forward.
With ``cp > 1`` the forward is a context-parallel prefill: each CP rank runs its tokens of every
sequence (``CpSplit.zigzag``) and returns their logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import torch
from torch import nn

from layer_boundary import BoundaryContext, ForwardBatch, Topology

if TYPE_CHECKING:  # imported where used: building a model loads the model modules
    from .qwen3 import Qwen3ForCausalLM

__all__ = ["RunSpec", "assign_sequences", "build_model", "model_class", "describe_model", "rank_forward",
           "single_rank_logits", "tbo_split", "compiled", "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True)
class RunSpec:
    sequences: tuple[tuple[int, ...], ...]
    model: Optional[str] = None  # a Hugging Face folder; None: the embedded random model
    seed: int = 0
    dtype: str = "float32"
    tp: int = 1
    dp: int = 1
    pp: int = 1  # pipeline stages; the world is tp * pp ranks
    cp: int = 1  # context-parallel prefill over cp ranks of attention TP (cp divides tp // dp)
    reduction: str = "auto"
    residual: str = "plain"
    device: str = "cpu"
    plugins: bool = True  # discover plugins through entry points
    input_scattered: bool = False  # run the input-scattered batch variant (attention TP > 1)
    config_overrides: dict[str, Any] = field(default_factory=dict)
    # A layer pattern such as "M-M*-" builds the heterogeneous reference (models/hetero.py)
    # instead of Qwen3: M mixer, * attention, - FFN.
    pattern: Optional[str] = None
    # The embedded random model is Qwen3-MoE instead of dense Qwen3 (a --model folder says what
    # it is through config.json's model_type).
    moe: bool = False
    # Sparse FFNs return finalize handoffs (a fusion provider that always allows
    # defer_moe_finalize): the next layer's input, or the final norm, completes them unfused.
    defer_moe_finalize: bool = False
    # The handoffs are fused instead (layer_boundary._fusion.moe_finalize): the next attention input
    # and the final norm run combine + all-reduce + add + RMSNorm in one kernel. Builds
    # zero-centered (Gemma) norms, which the fused final norm needs.
    fused_finalize: bool = False
    # Two-batch overlap: each DP group's sequences split into two microbatches (balanced by
    # tokens, at a sequence boundary) whose layer stages interleave; see adapters/tbo.py.
    tbo: bool = False
    # The embedded random LongCat-style model (models/longcat.py): a MoE branch beside a dense
    # FFN -> attention -> FFN branch in every layer (see adapters/branch.py).
    longcat: bool = False
    # Run the forward under torch.compile(fullgraph=True) with this backend ("inductor",
    # "aot_eager", ... or a backend callable): a graph break is an error, not a silent fallback.
    compile: Any = None

    def __post_init__(self) -> None:
        if self.longcat:
            _check_longcat(self)
        if self.tbo:
            if self.pattern is not None:
                raise ValueError("--tbo runs the Qwen3 and Qwen3-MoE references; the heterogeneous "
                                 "--pattern model has no two-batch-overlap schedule yet")
            if self.residual != "plain":
                raise ValueError(f"--tbo needs the plain residual: {self.residual!r} is a nonlinear "
                                 "update, whose per-call state cannot be split into microbatches")
            if self.defer_moe_finalize or self.fused_finalize:
                raise ValueError("--tbo runs the sparse FFNs operation-scheduled (no exit scope, so "
                                 "they finalize and reduce themselves); drop "
                                 f"{'--defer-moe-finalize' if self.defer_moe_finalize else '--fused-finalize'}")
        if self.moe and (self.model or self.pattern is not None):
            raise ValueError("--moe builds the embedded random Qwen3-MoE; it takes no --model (whose "
                             "config.json names its model_type) and no --pattern")
        if self.pattern is not None:
            from .hetero import parse_pattern

            parse_pattern(self.pattern)
            if self.model:
                raise ValueError("--pattern builds the embedded heterogeneous model; it takes no --model")
            if self.residual != "plain":
                raise ValueError(f"the heterogeneous model has the plain residual only, not {self.residual!r}")
        if not self.sequences or any(len(s) == 0 for s in self.sequences):
            raise ValueError("every sequence needs at least one token")
        if self.tp < 1 or self.dp < 1 or self.tp % self.dp:
            raise ValueError(f"--dp {self.dp} must divide --tp {self.tp} (attention DP splits the TP group)")
        if self.pp < 1:
            raise ValueError(f"--pp {self.pp} must be at least 1")
        if self.pp > 1:
            if self.pattern is not None:
                raise ValueError("--pp is supported for the Qwen3 reference only, not --pattern yet")
            if self.residual != "plain":
                raise ValueError(f"--pp needs the plain residual: {self.residual!r} is a nonlinear update, "
                                 "which is not supported across pipeline stages yet")
            if self.input_scattered:
                raise ValueError("the input-scattered variant is not supported across pipeline stages yet")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: use one of {sorted(DTYPES)}")
        if self.fused_finalize:
            # Name the option that conflicts (a fixed "drop --defer-moe-finalize" once answered
            # --pp 2, which never named it).
            conflict = ("--defer-moe-finalize: --fused-finalize already defers the finalize"
                        if self.defer_moe_finalize else "--longcat" if self.longcat else
                        "--pattern" if self.pattern is not None else f"--pp {self.pp}" if self.pp > 1 else None)
            if conflict:
                raise ValueError("--fused-finalize runs a Qwen3-MoE model (--moe or a qwen3_moe --model) on "
                                 f"one pipeline stage; drop {conflict}")
        if self.cp != 1:
            self._check_cp()

    def _check_cp(self) -> None:
        if not isinstance(self.cp, int) or self.cp < 1:
            raise ValueError(f"--cp {self.cp!r} must be a positive integer")
        attn_tp = self.tp // self.dp
        if attn_tp % self.cp:
            raise ValueError(f"--cp {self.cp} must divide the attention-TP size --tp {self.tp} / --dp "
                             f"{self.dp} = {attn_tp}: context parallelism splits attention TP into "
                             "CP ranks (different tokens) x head ranks (different heads)")
        if self.dp > 1:
            raise ValueError(f"--cp {self.cp} with --dp {self.dp}: context parallelism with attention DP "
                             "is not supported (the DP moves need each group's rows on all of its "
                             "attention-TP ranks); use --dp 1")
        if self.tbo:
            raise ValueError("--cp with --tbo: two-batch overlap splits at sequence boundaries, and a CP "
                             "batch spreads every sequence over the CP ranks; drop one of them")
        if self.pattern is not None:
            raise ValueError("--cp runs the Qwen3 and Qwen3-MoE references; the heterogeneous --pattern "
                             "model's mixers scan whole sequences and have no CP path")
        if self.input_scattered:
            raise ValueError("--cp with the input-scattered variant is not supported: on a CP topology "
                             "attention heads are replicated over CP, so a row slice over attention TP "
                             "would sum each head once per CP rank")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp


def assign_sequences(n: int, dp: int) -> list[list[int]]:
    """Sequence indices of each DP group, round-robin."""
    return [list(range(d, n, dp)) for d in range(dp)]


def _check_longcat(spec: RunSpec) -> None:
    """The configurations the LongCat-style model refuses up front (its branches move ordinary
    token rows only and meet by addition)."""
    if spec.model or spec.pattern is not None or spec.moe:
        raise ValueError("--longcat builds the embedded random LongCat-style model; it takes no "
                         "--model, --pattern or --moe")
    if spec.tbo:
        raise ValueError("--longcat has no two-batch-overlap schedule; drop --tbo")
    if spec.residual != "plain":
        raise ValueError(f"--longcat needs the plain residual: its MoE and dense branches meet by "
                         f"addition, and {spec.residual!r} is a nonlinear update")
    if spec.input_scattered or getattr(spec, "cp", 1) != 1:
        raise ValueError("--longcat runs ordinary token rows only: branch transport has no "
                         "context-parallel, input-scattered or sequence-parallel path")


def _config(spec: RunSpec) -> Any:
    import dataclasses

    from .config import Qwen3Config, load_config, small_random_config, small_random_moe_config
    from .hetero import HeteroConfig

    cfg: Union[HeteroConfig, Qwen3Config]
    if spec.pattern is not None:
        cfg = HeteroConfig()
    elif spec.model:
        cfg = load_config(spec.model)  # the class config.json's model_type names
    elif spec.longcat:
        from .longcat import small_random_longcat_config

        cfg = small_random_longcat_config()
    else:
        cfg = small_random_moe_config() if spec.moe else small_random_config()
    overrides = dict(spec.config_overrides)
    if spec.fused_finalize:
        overrides.setdefault("zero_centered_norms", True)
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def model_class(config: Any) -> type[Qwen3ForCausalLM]:
    """The reference decoder class for a config (dense Qwen3, Qwen3-MoE or LongCat-style)."""
    from .config import Qwen3MoeConfig
    from .longcat import LongcatConfig, LongcatForCausalLM

    if isinstance(config, LongcatConfig):
        return LongcatForCausalLM
    if isinstance(config, Qwen3MoeConfig):
        from .qwen3_moe import Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM
    from .qwen3 import Qwen3ForCausalLM

    return Qwen3ForCausalLM


def describe_model(spec: RunSpec) -> str:
    """What ``spec`` builds, in words (for the command line's report)."""
    if spec.pattern is not None:
        return (f"embedded random heterogeneous decoder {spec.pattern!r} (seed {spec.seed}; "
                "M mixer, * attention, - FFN)")
    cfg = _config(spec)
    if cfg.model_type == "longcat":
        what = (f"embedded random LongCat-style decoder (seed {spec.seed}; {cfg.num_hidden_layers} "
                f"layers, each a {cfg.num_experts}-expert top-{cfg.num_experts_per_tok} MoE branch "
                "beside a dense FFN -> attention -> FFN branch)")
        return what + ("; the MoE defers its finalize" if spec.defer_moe_finalize else "")
    name = "Qwen3-MoE" if cfg.model_type == "qwen3_moe" else "Qwen3"
    if cfg.model_type == "qwen3_moe":
        sparse = sum(cfg.is_sparse(i) for i in range(cfg.num_hidden_layers))
        name += (f" ({cfg.num_experts} experts, top {cfg.num_experts_per_tok}, {sparse} of "
                 f"{cfg.num_hidden_layers} layers sparse)")
    what = f"{name} from {spec.model}" if spec.model else f"embedded random {name} (seed {spec.seed})"
    if spec.defer_moe_finalize:
        what += "; sparse FFNs defer their finalize"
    if spec.fused_finalize:
        what += "; Gemma norms, fused MoE finalize handoffs"
    return what


def build_model(spec: RunSpec, topology: Topology, device: str) -> Any:
    """The model this spec names, on ``topology``, with its construction context frozen."""
    from .random_init import init_random_weights

    cfg = _config(spec)
    cls = model_class(cfg)
    arch = cfg.model_type
    ctx = (BoundaryContext.discover(topology, device=device, reduction=spec.reduction, architecture=arch)
           if spec.plugins else
           BoundaryContext(topology, device=device, reduction=spec.reduction, architecture=arch))
    kw: dict[str, Any] = {"context": ctx, "dtype": DTYPES[spec.dtype]}
    if spec.residual != "plain":
        kw["residual"] = spec.residual
    if spec.defer_moe_finalize:
        if cfg.model_type not in ("qwen3_moe", "longcat"):
            raise ValueError("--defer-moe-finalize needs a Qwen3-MoE model or the LongCat-style one "
                             "(--moe, --longcat, or a --model folder whose model_type is qwen3_moe); "
                             "a dense model has no finalize")
        from .moe import DeferFinalize

        kw["fusions"] = DeferFinalize()
    if spec.fused_finalize:
        if cfg.model_type != "qwen3_moe":
            raise ValueError("--fused-finalize needs a Qwen3-MoE model (--moe, or a --model folder "
                             "whose model_type is qwen3_moe); a dense model has no finalize")
        from layer_boundary.plugin_api import MoeFinalizeFusion

        kw["fusions"] = MoeFinalizeFusion()
    model: nn.Module
    if spec.pattern is not None:
        from .hetero import HeteroForCausalLM, init_hetero_weights

        model = HeteroForCausalLM(cfg, spec.pattern, **kw)
        init_hetero_weights(model, seed=spec.seed)
        model = model.to(device).eval().requires_grad_(False)
    elif spec.model:
        model = cls.from_pretrained(spec.model, device=device, **kw)
    else:
        built = cls(cfg, **kw)
        if cfg.model_type == "qwen3_moe":
            from .qwen3_moe import Qwen3MoeForCausalLM, init_random_moe_weights

            assert isinstance(built, Qwen3MoeForCausalLM)  # model_class() of a Qwen3-MoE config
            init_random_moe_weights(built, seed=spec.seed)
        elif cfg.model_type == "longcat":
            from .longcat import LongcatForCausalLM, init_random_longcat_weights

            assert isinstance(built, LongcatForCausalLM)  # model_class() of a LongCat config
            init_random_longcat_weights(built, seed=spec.seed)
        else:
            init_random_weights(built, seed=spec.seed)
        model = built.to(device).eval().requires_grad_(False)
    if spec.fused_finalize:
        from layer_boundary import install_finalize_fusion, prepare_finalize_fusion

        install_finalize_fusion(model, type(kw["fusions"]), terminal_finalize=True)
        prepare_finalize_fusion(model, type(kw["fusions"]))
    ctx.freeze()
    ctx.verify_agreement()  # every rank chose the same kernels and fusions (a collective)
    return model


def _batch(seqs: Sequence[Sequence[int]], device: str, dp_counts: Optional[tuple[int, ...]]) -> tuple[torch.Tensor, ForwardBatch]:
    flat = [t for s in seqs for t in s]
    ids = torch.tensor(flat, dtype=torch.long, device=device)
    pos = torch.cat([torch.arange(len(s)) for s in seqs]).to(device) if seqs else torch.zeros(0, dtype=torch.long, device=device)
    fb = ForwardBatch(num_tokens=len(flat), positions=pos, seq_lens=tuple(len(s) for s in seqs) or None,
                      dp_num_tokens=dp_counts)
    return ids, fb


def rank_forward(model: Any, spec: RunSpec, device: str) -> tuple[list[int], torch.Tensor, float]:
    """This rank's forward: (global token indices of its rows, float32 logits, seconds)."""
    topo = model.topology
    groups = assign_sequences(len(spec.sequences), spec.dp)
    counts = tuple(sum(len(spec.sequences[i]) for i in g) for g in groups)
    mine = groups[topo.attn_dp.rank]
    starts = [0]
    for s in spec.sequences:
        starts.append(starts[-1] + len(s))
    token_index = [starts[i] + j for i in mine for j in range(len(spec.sequences[i]))]
    ids, fb = _batch([spec.sequences[i] for i in mine], device, counts if spec.dp > 1 else None)
    fb.input_scattered = spec.input_scattered
    if spec.cp > 1:
        ids, fb, token_index = _cp_batch(ids, fb, token_index, topo, device)
    if spec.tbo:
        fb.tbo_split = tbo_split(spec, topo.attn_dp.rank)
    forward = compiled(model, spec.compile) if spec.compile else model
    with torch.inference_mode():
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = forward(ids, fb.positions, fb)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    if logits is None:  # a pipeline stage before the last: its output went on to the next stage
        return [], torch.zeros(0, model.config.vocab_size), seconds
    return token_index, logits.cpu(), seconds


def compiled(model: Any, backend: Any) -> Any:
    """``model`` under ``torch.compile(fullgraph=True)``, compiled once per model and backend.

    The token dimension is left to torch's automatic dynamic shapes: the first size compiles
    statically, the second recompiles once with the dimension symbolic, and every later size
    (other than 0 and 1, which torch specializes) reuses that graph.
    """
    cache = model.__dict__.setdefault("_compiled_forwards", {})
    if backend not in cache:
        cache[backend] = (torch.compile(model, fullgraph=True, backend=backend)
                          if model.topology.pp.size == 1 else _PipelineStage(model, backend))
    return cache[backend]


class _PipelineStage:
    """A pipeline stage's forward with its layer stack compiled and the transfer left eager.

    The receiving stage learns the sent tensors' shapes from a header at run time, which no graph
    can hold: engines compile the stack between the transfers the same way. The boundaries'
    ``from_pp`` / ``to_pp`` run inside the compiled stack.
    """

    def __init__(self, model: Any, backend: Any) -> None:
        self.model = model
        last = model.topology.pp.rank == model.topology.pp.size - 1

        def stage(input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any, tensors: Any) -> Any:
            hidden = model.model(input_ids, positions, forward_batch, tensors)
            return model.lm_head(hidden).float() if last else hidden

        self.stage = torch.compile(stage, fullgraph=True, backend=backend)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any) -> Any:
        from layer_boundary import recv_tensors, send_tensors

        pp = self.model.topology.pp
        received = recv_tensors(pp, device=input_ids.device) if pp.rank > 0 else None
        tensors: Optional[dict[str, Any]] = None
        if received is not None:  # the handoff header as ints: its branches are decided here
            tensors = {k: (tuple(int(x) for x in v.tolist()) if k == "meta" else v) for k, v in received.items()}
        out = self.stage(input_ids, positions, forward_batch, tensors)
        if pp.rank < pp.size - 1:
            send_tensors(out, pp)
            return None
        return out


def _cp_batch(ids: torch.Tensor, fb: ForwardBatch, token_index: list[int], topology: Topology,
              device: str) -> tuple[torch.Tensor, ForwardBatch, list[int]]:
    """This CP rank's part of a packed prefill batch: its tokens of every sequence (zig-zag)."""
    from layer_boundary import CpSplit

    split = CpSplit.zigzag(fb.seq_lens or (fb.num_tokens,), topology, device=device)
    mine = split.owners(split.rank).tolist()
    local = ForwardBatch(num_tokens=split.local_rows, positions=split.take_local(fb.positions),
                         context_parallel=True, cp_split=split)
    return split.take_local(ids), local, [token_index[i] for i in mine]


def tbo_split(spec: RunSpec, dp_rank: int, trace: Optional[list] = None) -> Any:
    """The two-batch split of DP group ``dp_rank``'s sequences (every group's row counts too)."""
    from layer_boundary import TboSplit

    groups = assign_sequences(len(spec.sequences), spec.dp)
    return TboSplit.balanced([[len(spec.sequences[i]) for i in g] for g in groups], dp_rank, trace=trace)


def single_rank_logits(spec: RunSpec, device: Optional[str] = None) -> torch.Tensor:
    """Logits of every token, in input order, from the single-rank model (all sequences packed)."""
    model = build_model(RunSpec(**{**spec.__dict__, "tp": 1, "dp": 1, "pp": 1, "cp": 1,
                                   "input_scattered": False}),
                        Topology.single(), device or spec.device)
    ids, fb = _batch(spec.sequences, device or spec.device, None)
    with torch.inference_mode():
        return model(ids, fb.positions, fb).cpu()
