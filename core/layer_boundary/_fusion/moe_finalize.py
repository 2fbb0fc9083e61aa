"""Fused MoE finalize handoff: top-k combine + shared expert + TP all-reduce + add + RMSNorm.

A sparse FFN whose exit defers its finalize returns a ``HandoffOutput`` carrying its expert
outputs (``expert_out [T, k, H]``, partial over the MoE output group), router weights
(``topk_weights [T, k]``) and shared-expert output (``shared_out [T, H]`` or ``None``). The
next consumer (the next layer's attention input, or the final norm at the end of the stack)
finishes all of it in one kernel instead of a combine, an all-reduce, an add and a norm.

:class:`MoeFinalizeFusion` is a fusion provider that does this. It is inert until
:meth:`~MoeFinalizeFusion.install` names the FFN exits that may defer (an engine calls it
through a backend's ``install_*_fusion(model, ...)``, which finds the provider through the
decoder layers' ``attn_boundary`` and ``ffn_boundary``), and it allocates its peer-visible
workspaces in :meth:`~MoeFinalizeFusion.prepare`, before any CUDA-graph capture. Its
``finalize(handoff, residual, gamma)`` is the service ``residual_batch.norm(...,
handoff_norm=service)`` calls at the terminal layer.

Kernels: ``"triton"`` runs the core's symmetric-memory kernel with its finalize prologue (peer
buffers through symmetric memory, never NVLink multicast); ``"reference"`` runs the same
arithmetic with torch ops and the group's all-reduce (CPU engines, and tests on gloo). A
backend subclass may supply its own kernel for some cases (``local_kernel``).

Numerics (both kernels): each rank combines its expert rows in FP32 (in slot order, shared
expert last) and rounds once to the activation dtype; the ranks' rows are summed in FP32 in
rank order and rounded once, as an all-reduce output is; the add and the norm then follow the
torch reference. The unfused path rounds every weighted product before adding, so the two
differ by a few activation-dtype roundings (:data:`FINALIZE_TOLERANCE`).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .._forward import active_variant
from .._kernels.kernel_op import kernel_op
from .._kernels.reference import _acc_dtype, fused_add_rmsnorm_ref
from .._layout import BatchVariant
from .._output import HandoffOutput
from .._topology import GroupInfo
from .allreduce_norm import RefusedCandidate, agree, group_backend, limits_refusal, owed_sum

__all__ = ["MoeFinalizeFusion", "FinalizeCandidate", "moe_finalize", "finalize_partial_ref", "FINALIZE_TOLERANCE"]

log = logging.getLogger("layer_boundary")

# (atol, rtol) of the fused finalize against the unfused path, relative to the output scale:
# the unfused combine rounds k products and k-1 partial sums to the activation dtype.
FINALIZE_TOLERANCE = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (6e-2, 3e-2),
    torch.float16: (1e-2, 5e-3),
}

# Where the fused kernel reads parameters from: (weight, eps, weight offset).
NormParams = tuple[torch.Tensor, float, float]


def moe_finalize(
    expert_out: torch.Tensor, topk_weights: torch.Tensor, shared_out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The unfused finalize: ``sum_j w[t, j] * expert_out[t, j] (+ shared_out[t])`` -> ``[T, H]``.

    Summed expert by expert in slot order, each product rounded to the model dtype first, as the
    reference (transformers) accumulates; a sum over ranks still follows when the output is partial.
    """
    if expert_out.shape[1]:
        out = expert_out[:, 0] * topk_weights[:, :1]
        for j in range(1, expert_out.shape[1]):
            out = out + expert_out[:, j] * topk_weights[:, j : j + 1]
    else:
        out = expert_out.new_zeros(expert_out.shape[0], expert_out.shape[2])
    if shared_out is not None:
        out = out + shared_out
    return out


def finalize_partial_ref(expert_out: torch.Tensor, topk_weights: torch.Tensor,
                         shared_out: Optional[torch.Tensor]) -> torch.Tensor:
    """This rank's finalized rows as the fused kernel forms them: FP32 combine, one rounding."""
    acc = _acc_dtype(expert_out.dtype)
    y = (expert_out.to(acc) * topk_weights.to(acc).unsqueeze(-1)).sum(dim=1)
    if shared_out is not None:
        y = y + shared_out.to(acc)
    return y.to(expert_out.dtype)


# The fused finalize's reference path is an operator under torch.compile (plain torch in eager),
# for the norm references' reason: Inductor would regenerate the FP32 combine in its own order, and
# the compiled path would leave the eager numbers the fused kernels are checked against. The
# unfused moe_finalize is model arithmetic, which Inductor may fuse with its neighbours (within
# FINALIZE_TOLERANCE), as bench finalize's compiled peer measures.
kernel_op("layer_boundary::finalize_partial_ref", finalize_partial_ref)


class FinalizeCandidate:
    """A consumer candidate that takes a finalize handoff (``takes_handoff``) at one stage."""

    takes_handoff = True
    __slots__ = ("name", "sum_group", "_service", "_group", "_norm")

    def __init__(self, name: str, service: "MoeFinalizeFusion", group: GroupInfo, norm: NormParams) -> None:
        self.name = name
        self.sum_group = None  # it sums what the handoff records it owes, over its own group
        self._service = service
        self._group = group
        self._norm = norm

    def refuse(self, plan: Any) -> Optional[str]:
        return None

    def __call__(self, handoff: HandoffOutput, residual: Optional[torch.Tensor], read: Any,
                 forward_batch: Any) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        if residual is None:
            return None
        out = self._service.run(handoff, residual, self._group, self._norm)
        return None if out is None else (out, residual)

    def __repr__(self) -> str:
        return f"{self.name}(group={self._group.ranks})"


class MoeFinalizeFusion:
    """Fusion provider and terminal ``handoff_norm`` service for MoE finalize handoffs.

    ``max_tokens``: rows per call the workspaces hold; a larger batch's handoff completes
    unfused (its exit does not defer it). ``kernel``: ``"triton"``, ``"reference"`` or
    ``"auto"`` (Triton where CUDA is, else the torch reference).
    """

    name = "moe-finalize"
    candidate_name = "moe finalize + all-reduce + add + rmsnorm"
    dtypes = frozenset({torch.bfloat16, torch.float16, torch.float32})
    max_world = 8
    max_hidden = 16384

    def __init__(self, *, max_tokens: int = 1024, kernel: str = "auto",
                 workspace_bytes: int = 256 << 20) -> None:
        if kernel not in ("auto", "triton", "reference"):
            raise ValueError(f"kernel must be 'auto', 'triton' or 'reference', got {kernel!r}")
        # "auto" is decided per norm weight's device as well: a model built on the CPU of a CUDA
        # machine (tests, a CPU run) takes the torch reference there, not Triton on CPU tensors.
        self._auto = kernel == "auto"
        if kernel == "auto":
            kernel = "triton" if torch.cuda.is_available() else "reference"
        self.kernel = kernel
        self.max_tokens = int(max_tokens)
        self.workspace_bytes = workspace_bytes
        self.installed = False
        # FFN plan -> whether its exit may defer (set by install: a fusing consumer follows it).
        self._defers: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()
        # The same answers as a list of the deferring plans, for traced forwards (see
        # can_defer_finalize); held as long as the provider, which a model's context holds.
        self._deferring: list[Any] = []
        # Final norm weight -> (the terminal FFN's group, the norm's eps), per installed model: a
        # provider a context's plugin offers is shared by every model built from that context,
        # and finalize() knows its model by the weight the final norm passes.
        # Keyed by id (tensors compare elementwise); the weak reference confirms the identity.
        self._finals: dict[int, tuple[Any, GroupInfo, float]] = {}
        # (group ranks, hidden, dtype) -> workspace, made by prepare() for every group offered.
        self._groups: dict[tuple[Any, ...], tuple[GroupInfo, int, torch.dtype]] = {}
        self._workspaces: dict[tuple[Any, ...], Any] = {}
        # (group size, hidden, dtype, norm weight offset) of every consumer offered: what a
        # backend's own kernels are built for in prepare().
        self._norms: set[tuple[int, int, torch.dtype, float]] = set()
        self._warned: set[str] = set()
        self.fused_calls = 0  # handoffs this provider finished (a count for tests and operators)

    # -- FusionProvider ---------------------------------------------------------------------

    def attention_input(self, plan: Any) -> Sequence[Any]:
        return self._offer(plan)

    def ffn_input(self, plan: Any) -> Sequence[Any]:
        return self._offer(plan)

    def can_defer_finalize(self, plan: Any, forward_batch: Any) -> bool:
        """Defer where install found a fusing consumer after this exit, for ordinary batches
        that fit the workspace (facts every rank of the MoE group shares)."""
        if torch.compiler.is_compiling():
            # Dynamo cannot hash a plan (a frozen dataclass holding dicts): compare identities,
            # once, at trace time.
            defers = any(p is plan for p in self._deferring)
        else:
            defers = self._defers.get(plan, False)
        return defers and 0 < forward_batch.num_tokens <= self.max_tokens \
            and active_variant(forward_batch) is BatchVariant.ORDINARY \
            and getattr(forward_batch, "dp_num_tokens", None) is None

    # -- install / prepare ------------------------------------------------------------------

    def install(self, layers: Sequence[tuple[Any, Any]], *, terminal_finalize: bool = False,
                final_norm: Any = None) -> "MoeFinalizeFusion":
        """Let each FFN exit among ``layers`` (``(attn_boundary, ffn_boundary)`` per decoder
        layer, in stack order) defer its finalize when the next layer's attention input takes
        the handoff with this provider's candidate, or at the last layer when
        ``terminal_finalize`` (the final norm then calls :meth:`finalize`)."""
        for i, (_, ffn) in enumerate(layers):
            plan = ffn.plan
            if not any(p.may_defer_finalize for p in plan.exits.values()):
                continue
            if i + 1 < len(layers):
                nxt = layers[i + 1][0].plan
                entry = nxt.entries.get(BatchVariant.ORDINARY)
                self._defers[plan] = entry is not None and any(
                    getattr(c, "_service", None) is self for c in entry.candidates)
            elif terminal_finalize:
                self._defers[plan] = plan.declaration.terminal and self._terminal_refusal(plan, final_norm) is None
            if self._defers.get(plan) and not any(p is plan for p in self._deferring):
                self._deferring.append(plan)
        self.installed = True
        return self

    def _terminal_refusal(self, plan: Any, final_norm: Any) -> Optional[str]:
        from .._norms import norm_params

        params = norm_params(final_norm) if final_norm is not None else None
        if params is None or params[2] != 1.0:
            return "the final norm is not a Gemma RMSNorm (the fused finalize reads gemma_weight)"
        owed = plan.exits[BatchVariant.ORDINARY].skip_owed
        group = owed.group if owed is not None else GroupInfo.solo()
        why = self._group_refusal(group, params[0].dtype, int(params[0].shape[0]), params[0].device)
        if why is None:
            self._finals[id(params[0])] = (weakref.ref(params[0]), group, params[1])
            if self._triton_on(params[0].device):
                self._want(group, int(params[0].shape[0]), params[0].dtype, 1.0)
        return why

    def prepare(self) -> None:
        """Create the workspaces of every group this provider fuses over (a collective on each
        group, in the same order on every rank); call before CUDA-graph capture."""
        if self.kernel == "reference":
            return
        for key, (group, hidden, dtype) in sorted(self._groups.items(), key=lambda kv: repr(kv[0])):
            if key not in self._workspaces:
                self._workspaces[key] = self._make_workspace(group, hidden, dtype)

    # -- the service ------------------------------------------------------------------------

    def finalize(self, handoff: HandoffOutput, residual: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        """Finalize ``handoff``, complete its owed sum, add it to ``residual`` (in place) and
        return the Gemma RMSNorm (weight ``gamma`` + 1) of the sum: the terminal layer's work."""
        final = self._finals.get(id(gamma))
        if final is None or final[0]() is not gamma:
            raise RuntimeError(
                f"{self.name}: finalize() needs install(..., terminal_finalize=True) with this Gemma "
                "RMSNorm as the final norm; the terminal FFN exit would not have deferred otherwise"
            )
        _, group, eps = final
        norm = (gamma, eps, 1.0)
        out = self.run(handoff, residual, group, norm)
        if out is None:  # not fusable here (rows over the workspace, payload layout): unfused
            value = handoff.complete()
            owed = handoff.owed_sum
            if owed is not None and owed.group is not None and owed.group.size > 1:
                dist.all_reduce(value, group=owed.group.group)
            out, _ = fused_add_rmsnorm_ref(value, residual, gamma, eps, weight_offset=1.0,
                                           residual_out=residual)
        return out

    def run(self, handoff: HandoffOutput, residual: torch.Tensor, group: GroupInfo,
            norm: NormParams) -> Optional[torch.Tensor]:
        """The fused call, or ``None`` (before touching anything) when this batch is not one it
        fuses: the caller then completes the handoff unfused."""
        p = handoff.payload
        expert_out, weights, shared = p.get("expert_out"), p.get("topk_weights"), p.get("shared_out")
        owed = handoff.owed_sum
        world = owed.group.size if owed is not None and owed.group is not None else 1
        if world != group.size and world != 1:
            return None
        if world == 1:
            group = GroupInfo.solo()
        why = self._payload_refusal(expert_out, weights, shared, residual)
        if why is not None:
            self._decline_once(why)
            return None
        assert isinstance(expert_out, torch.Tensor) and isinstance(weights, torch.Tensor)  # refusal checked
        rows = residual.shape[0]
        if rows == 0 or rows > self.max_tokens:
            return None
        weight, eps, offset = norm
        out = torch.empty_like(residual)
        local = self.local_kernel(expert_out, weights, shared, residual, norm) if group.size == 1 else None
        if local is not None:
            local(out)
        elif not self._triton_on(residual.device):
            partial = finalize_partial_ref(expert_out, weights, shared)
            if group.size > 1:
                dist.all_reduce(partial, group=group.group)
            fused_add_rmsnorm_ref(partial, residual, weight, eps, weight_offset=offset, out=out,
                                  residual_out=residual)
        else:
            from .symm_mem import launch

            ws = self._workspace(group, residual.shape[1], residual.dtype)
            if ws is None or rows > ws.max_tokens:
                return None
            launch(ws, expert_out, residual, weight, out, eps, offset, topk_weights=weights, shared=shared)
        handoff.mark_consumed()
        self.fused_calls += 1
        return out

    def local_kernel(self, expert_out: torch.Tensor, weights: torch.Tensor, shared: Optional[torch.Tensor],
                     residual: torch.Tensor, norm: NormParams) -> Optional[Callable[[torch.Tensor], None]]:
        """A backend's own one-rank kernel for this call (``run(out)``), or ``None`` for the
        core's. Called only with a payload that passed the layout checks."""
        return None

    # -- internals ---------------------------------------------------------------------------

    def _offer(self, plan: Any) -> Sequence[Any]:
        prev = plan.declaration.previous
        if prev is None or not getattr(prev, "sparse", False):
            return ()  # no handoff arrives here: nothing to offer, no row in the report
        entry = plan.entries.get(BatchVariant.ORDINARY)
        if entry is None:
            return ()
        name = f"{self.candidate_name} ({self.kernel})"
        if entry.rows.every_group_input:
            return (RefusedCandidate(name, "attention DP moves this input's rows; the fused finalize "
                                     "serves ordinary rows only"),)
        read = plan.read
        weight = getattr(read, "weight", None)
        if weight is None or not hasattr(read, "offset") or getattr(read, "quant", None):
            return (RefusedCandidate(name, f"read {read.name} is not an unquantized RMSNorm read"),)
        owed = owed_sum(plan)
        group = owed[1] if owed is not None else GroupInfo.solo()
        why = agree(group, self._group_refusal(group, weight.dtype, int(weight.shape[0]), weight.device))
        if why is not None:
            return (RefusedCandidate(name, why),)
        if self._triton_on(weight.device):
            self._want(group, int(weight.shape[0]), weight.dtype, float(read.offset))
        return (FinalizeCandidate(name, self, group, (weight, read.eps, float(read.offset))),)

    def _triton_on(self, device: torch.device) -> bool:
        """Whether rows on ``device`` take the Triton kernel (else the torch reference)."""
        return self.kernel == "triton" and (not self._auto or device.type == "cuda")

    def _group_refusal(self, group: GroupInfo, dtype: torch.dtype, hidden: int,
                       device: torch.device) -> Optional[str]:
        if not self._triton_on(device):
            return None  # the torch reference: any device, any backend
        if not torch.cuda.is_available():
            return "no CUDA device in this process"
        if device.type != "cuda":
            return f"kernel='triton' runs on CUDA tensors; this norm's weight is on {device.type}"
        if group.size > 1 and group_backend(group) != "nccl":
            return f"the Triton kernel needs an nccl group; this one uses {group_backend(group)}"
        return limits_refusal(self, group.size, dtype, hidden)

    def _want(self, group: GroupInfo, hidden: int, dtype: torch.dtype, offset: float) -> None:
        self._groups[(group.ranks, hidden, dtype)] = (group, hidden, dtype)
        self._norms.add((group.size, hidden, dtype, offset))

    def _workspace(self, group: GroupInfo, hidden: int, dtype: torch.dtype) -> Any:
        ws = self._workspaces.get((group.ranks, hidden, dtype))
        if ws is None:
            # Made lazily only on one rank (no collective): a multi-rank group must be prepared.
            if group.size > 1:
                raise RuntimeError(
                    f"{self.name}: no workspace for group {group.ranks}; call prepare() (through "
                    "prepare_*_fusion) on every rank after install and before the first forward"
                )
            ws = self._workspaces[(group.ranks, hidden, dtype)] = self._make_workspace(group, hidden, dtype)
        return ws

    def _make_workspace(self, group: GroupInfo, hidden: int, dtype: torch.dtype) -> Any:
        from .symm_mem import make_symm_workspace

        return make_symm_workspace(group, hidden, dtype, self.max_tokens, self.workspace_bytes)

    @staticmethod
    def _payload_refusal(expert_out: Any, weights: Any, shared: Any, residual: torch.Tensor) -> Optional[str]:
        if not isinstance(expert_out, torch.Tensor) or not isinstance(weights, torch.Tensor):
            return "the handoff carries no expert_out / topk_weights payload"
        rows, hidden = residual.shape
        if expert_out.dim() != 3 or expert_out.shape[0] != rows or expert_out.shape[2] != hidden \
                or expert_out.stride(2) != 1:
            return f"expert_out {tuple(expert_out.shape)} is not [T, k, H] with contiguous rows"
        if tuple(weights.shape) != tuple(expert_out.shape[:2]):
            return f"topk_weights {tuple(weights.shape)} does not match expert_out's [T, k]"
        if expert_out.dtype is not residual.dtype or not residual.is_contiguous():
            return f"expert_out {expert_out.dtype} / residual {residual.dtype} layout differs"
        if shared is not None and (not isinstance(shared, torch.Tensor) or shared.shape != residual.shape
                                   or shared.dtype is not residual.dtype or shared.stride(1) != 1):
            return "shared_out does not match the residual's shape and dtype"
        return None

    def _decline_once(self, why: str) -> None:
        if why not in self._warned:
            self._warned.add(why)
            log.warning("%s: %s; this handoff completes unfused", self.name, why)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kernel={self.kernel}, max_tokens={self.max_tokens}, installed={self.installed})"

