"""The CuTe DSL plugin's MoE finalize handoff service.

    service = install_cutedsl_fusion(model, terminal_finalize=True)
    prepare_cutedsl_fusion(model)          # every rank, before CUDA-graph capture
    ...
    hidden = residual_batch.norm(hidden, forward_batch, self.norm, handoff_norm=service)

``CuteDslFusion`` is the fusion provider the plugin offers to every stage (or that an engine
passes as the stages' ``fusions`` option). Until installed it lets no exit defer. Installed, a
sparse FFN exit whose next consumer takes the handoff returns a ``HandoffOutput``, and the next
layer's attention input (or, with ``terminal_finalize``, the final Gemma RMSNorm through
``finalize(handoff, residual, gamma)``) runs the top-k combine, the shared expert, the MoE
group's all-reduce, the residual add and the RMSNorm in one kernel:

* **one rank** (no sum over ranks owed): the CuTe DSL kernel (``kernel.AddRMSNorm`` with its
  finalize prologue), built in ``prepare_cutedsl_fusion`` for the top-k the model's sparse blocks
  use and checked there against the torch reference; a variant that was not built or failed its
  check leaves the call to the core's Triton kernel (said once);
* **several ranks**: on Hopper without NVLink multicast the all-reduce reads the peers' rows
  through symmetric-memory peer pointers, in the core's symmetric-memory kernel with the same
  finalize prologue (``layer_boundary._fusion.symm_mem_kernel``), whose workspaces
  ``prepare_cutedsl_fusion`` creates.

Arithmetic, tolerance and fallback rules are the core's (``layer_boundary._fusion.moe_finalize``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from layer_boundary import install_finalize_fusion, prepare_finalize_fusion
from layer_boundary.plugin_api import (
    finalize_partial_ref,
    FINALIZE_TOLERANCE,
    fused_add_rmsnorm_ref,
    kernel_op,
    MoeFinalizeFusion,
)

from .norm import load_compiler
from .shape import VEC, launch_shape

__all__ = ["CuteDslFusion", "install_cutedsl_fusion", "prepare_cutedsl_fusion"]

log = logging.getLogger("layer_boundary")

# (hidden, dtype, weight offset, top-k, shared expert) -> compiled CuTe DSL variant
Variant = tuple[int, torch.dtype, float, int, bool]


class CuteDslFusion(MoeFinalizeFusion):
    """The plugin's MoE finalize fusion provider (see the module docstring)."""

    name = "cutedsl-moe-finalize"
    candidate_name = "cutedsl moe finalize + all-reduce + add + rmsnorm"

    def __init__(self, *, compiler: Optional[Callable[..., Any]] = None,
                 launch: Optional[Callable[..., None]] = None, **kw: Any) -> None:
        super().__init__(**kw)
        # Seams for CPU tests: the compiler and the launcher of the CuTe DSL variants.
        self._compiler = compiler
        self._launch = launch
        self._variants: dict[Variant, Any] = {}
        self._indexes: dict[Variant, int] = {}  # in _VARIANTS, for the operator

    def prepare(self, top_k: Iterable[int] = ()) -> None:
        """Workspaces (the core's), then the CuTe DSL variants for one-rank consumers and each
        ``top_k``, with and without a shared expert, each checked against the reference."""
        super().prepare()
        if self.kernel != "triton":
            return
        for world, hidden, dtype, offset in sorted(self._norms, key=repr):
            if world != 1 or dtype not in (torch.bfloat16, torch.float16) or launch_shape(hidden) is None:
                continue
            for k in sorted(set(top_k)):
                for shared in (False, True):
                    self._build((hidden, dtype, offset, k, shared))

    def _build(self, v: Variant) -> None:
        hidden, dtype, offset, k, shared = v
        try:
            compile_fn = self._compiler or load_compiler()
            compiled = compile_fn(hidden, str(dtype).replace("torch.", ""), offset, True, topk=k, shared=shared)
            why = _self_check(compiled, v, self._launch or _launch)
        except Exception as exc:  # a DSL or driver failure: the core kernel serves instead
            why = f"{type(exc).__name__}: {exc}"
        if why is None:
            self._variants[v] = compiled
        else:
            log.warning("%s: the CuTe DSL finalize variant H=%d %s top-%d%s is not used (%s); the core "
                        "Triton kernel runs it", self.name, hidden, dtype, k, " +shared" if shared else "", why)

    def local_kernel(self, expert_out: torch.Tensor, weights: torch.Tensor, shared: Optional[torch.Tensor],
                     residual: torch.Tensor, norm: Any) -> Optional[Callable[[torch.Tensor], None]]:
        weight, eps, offset = norm
        v = (residual.shape[1], residual.dtype, float(offset), expert_out.shape[1], shared is not None)
        compiled = self._variants.get(v)
        if compiled is None:
            if self.kernel == "triton" and v[1] in (torch.bfloat16, torch.float16):
                self._decline_once(f"no CuTe DSL variant was prepared for H={v[0]} top-{v[3]}"
                                   f"{' +shared' if v[4] else ''} (prepare_cutedsl_fusion(model, top_k=...)); "
                                   "the core Triton kernel runs it")
            return None
        # Eager: a payload the 128-bit accesses cannot read goes to the core's Triton kernel. Dynamo
        # cannot read data pointers: under torch.compile the operator checks and falls back itself.
        if not torch.compiler.is_compiling() and not _vector_ready(expert_out, weights, shared, residual, weight):
            return None
        index = self._variant_index(v, compiled)
        offset = float(v[2])

        def call(out: torch.Tensor) -> None:
            _finalize_add_rmsnorm(expert_out, residual, weight, out, float(eps), offset, weights, shared, index)

        return call

    def _variant_index(self, v: Variant, compiled: Any) -> int:
        index = self._indexes.get(v)
        if index is None:
            index = self._indexes[v] = len(_VARIANTS)
            _VARIANTS.append((compiled, self._launch or _launch))
        return index


# The compiled variants (and their launcher) by index: the operator takes no Python object. A few a
# process (top-k values x shared or not); kept for its life, as their CUDA modules are.
_VARIANTS: list[tuple[Any, Callable[..., None]]] = []


def _finalize_add_rmsnorm(expert_out: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          out: torch.Tensor, eps: float, weight_offset: float, topk_weights: torch.Tensor,
                          shared: Optional[torch.Tensor], variant: int) -> None:
    """One rank's finalize + add + RMSNorm by the CuTe DSL variant: ``residual += combine(expert_out)``
    (in place), ``out = rmsnorm(residual)``. Rows its vector accesses cannot read (only a compiled
    graph gets here with them) take the torch reference's finalize arithmetic, within
    ``FINALIZE_TOLERANCE`` of the kernel."""
    if not _vector_ready(expert_out, topk_weights, shared, residual, weight):
        fused_add_rmsnorm_ref(finalize_partial_ref(expert_out, topk_weights, shared), residual, weight, eps,
                              weight_offset=weight_offset, out=out, residual_out=residual)
        return
    compiled, run = _VARIANTS[variant]
    run(compiled, expert_out, residual, weight, out, eps, topk_weights, shared)


kernel_op("finalize_add_rmsnorm", _finalize_add_rmsnorm, mutates=("residual", "out"))


def _vector_ready(expert_out: torch.Tensor, weights: torch.Tensor, shared: Optional[torch.Tensor],
                  residual: torch.Tensor, weight: torch.Tensor) -> bool:
    """What the 128-bit accesses need: 16-byte aligned bases, row strides a multiple of 8."""
    rows16 = [expert_out, residual, weight] + ([shared] if shared is not None else [])
    return (all(t.data_ptr() % 16 == 0 for t in rows16) and expert_out.stride(0) % VEC == 0
            and expert_out.stride(1) % VEC == 0 and (shared is None or shared.stride(0) % VEC == 0)
            and weights.stride(1) == 1 and weight.stride(0) == 1)


def _launch(compiled: Any, x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, y: torch.Tensor, eps: float,
            tw: torch.Tensor, sh: Optional[torch.Tensor]) -> None:
    from .norm import _launch as launch_variant

    launch_variant(compiled, x, r, w, y, eps, tw, sh)


def _self_check(compiled: Any, v: Variant, run: Callable[..., None]) -> Optional[str]:
    """Run the variant once on random rows against the reference; ``None`` when it agrees."""
    hidden, dtype, offset, k, shared = v
    if not torch.cuda.is_available():
        return None  # compiled for a GPU this process does not have (a CPU build check)
    g = torch.Generator().manual_seed(0)
    rows = 3

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).cuda()

    e, tw = rand(rows, k, hidden), torch.softmax(torch.randn(rows, k, generator=g), -1).to(dtype).cuda()
    sh = rand(rows, hidden) if shared else None
    r, w = rand(rows, hidden), rand(hidden)
    want_y, want_r = fused_add_rmsnorm_ref(finalize_partial_ref(e, tw, sh), r, w, 1e-6, weight_offset=offset)
    y = torch.empty_like(r)
    run(compiled, e, r, w, y, 1e-6, tw, sh)
    torch.cuda.synchronize()
    atol, rtol = FINALIZE_TOLERANCE[dtype]
    for got, want, what in ((y, want_y, "normalized rows"), (r, want_r, "residual")):
        if not torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol):
            return f"its {what} differ from the reference by {(got.float() - want.float()).abs().max().item():.3g}"
    return None


def _model_top_k(model: nn.Module) -> set[int]:
    return {int(getattr(m, "top_k")) for m in model.modules() if isinstance(getattr(m, "top_k", None), int)}


def install_cutedsl_fusion(model: nn.Module, *, terminal_finalize: bool = False,
                           final_norm: Optional[nn.Module] = None) -> CuteDslFusion:
    """Install the ``CuteDslFusion`` providers found through ``model``'s decoder layers
    (``attn_boundary``, ``ffn_boundary``); return the service for ``norm(handoff_norm=...)``.

    ``terminal_finalize``: the last layer's FFN may also defer, to the final norm (a Gemma RMSNorm,
    found as ``model.norm`` or ``model.model.norm`` unless ``final_norm`` is given). Sets the
    reference decoders' ``handoff_norm`` when the model has that attribute.
    """
    return install_finalize_fusion(model, CuteDslFusion, terminal_finalize=terminal_finalize,
                                   final_norm=final_norm)


def prepare_cutedsl_fusion(model: nn.Module, *, top_k: Optional[Iterable[int]] = None) -> None:
    """Create the installed providers' peer-visible workspaces (a collective on each MoE group,
    so every rank calls it, in the same order) and build the CuTe DSL variants for ``top_k``
    (default: every ``top_k`` attribute among the model's modules), before the first forward or
    graph capture."""
    prepare_finalize_fusion(model, CuteDslFusion, top_k=tuple(top_k) if top_k is not None else tuple(_model_top_k(model)))
