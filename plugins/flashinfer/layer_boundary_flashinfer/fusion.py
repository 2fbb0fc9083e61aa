"""FlashInfer's all-reduce fusion as a consumer candidate: all-reduce + residual add + RMSNorm.

For a stage whose input owes one sum over an attention-TP or TP group of 2, 4, 8 or 16 ranks::

    s  = sum over ranks of x_rank        (FP32 accumulation, rounded once to the dtype)
    r' = s + r                           (rounded to the dtype; written into r, in place)
    y  = r' / sqrt(mean(r'^2) + eps) * (w + offset)

in one kernel of FlashInfer's TensorRT-LLM backend (``flashinfer.comm``): peer buffers over
CUDA IPC, flags for the one-shot (Lamport) and two-shot protocols, created at construction by
``create_allreduce_fusion_workspace(backend="trtllm", ...)`` and run by ``allreduce_fusion(...,
pattern=kARResidualRMSNorm)``. The backend is always named: ``"auto"`` may pick ``"mnnvl"``, and
both ``"mnnvl"`` and ``"mnnvl-cutedsl"`` use NVLink multicast, which must never run on these
machines; ``"trtllm"`` allocates its peer memory with multicast off.

Facts of FlashInfer 0.7.2 this relies on (``flashinfer/comm/allreduce.py``, ``trtllm_ar.py``,
``include/flashinfer/comm/trtllm_allreduce_fusion.cuh``):

* Kernels exist for 2, 4, 8 and 16 ranks, for bf16, fp16 and fp32; rows move in 16-byte
  vectors, so H must be a multiple of 8 (4 in fp32); ``rms_gamma`` is read as the input's dtype.
* The workspace holds ``max_token_num`` rows; more rows would overrun it, so the candidate
  declines them (the stage then runs its all-reduce and the separate norm kernel).
* Each thread reads ``residual_in`` and ``allreduce_in`` at an index before it writes the
  outputs at that index, so ``residual_out`` may be ``residual_in`` (the residual is updated in
  place, as the contract asks). The normalized rows go to a fresh tensor: ``x`` stays intact.
  This pattern never writes ``output`` (the plain all-reduce result), so the normalized rows'
  buffer is passed there to save an allocation.
* ``fp32_acc=True`` sums the ranks' rows in FP32 in rank order and rounds once, the same order
  on every rank, so every rank stores the same residual (for two ranks the sum equals NCCL's).
* It adds the rounded sum to the residual, rounds, and normalizes that rounded residual, where
  the core's add+norm read normalizes the FP32 sum: the normalized rows may differ from the
  reference by about one unit in the last place of a 16-bit output (``tolerance``). The stored
  residual is the reference's bit for bit, given the same sum.
* ``use_oneshot=None`` asks FlashInfer's heuristic, whose table covers 2, 4 and 8 ranks only; the
  candidate passes its own choice (``oneshot_max_tokens``). The two-shot kernel needs more rows
  than ranks.
* The kernels wait on the preceding grid before touching memory, so programmatic dependent
  launch (``launch_with_pdl``) is safe; it pays only after kernels that trigger their dependents
  early, which the engine's GEMMs before this call need not do, so it is off by default.
  ``trigger_completion_at_end=True`` (completion signalled after the kernel's last write) is the
  only safe choice when the next kernel is not known to wait on its predecessor.
* The dynamic per-token FP8 pattern (``kARResidualRMSNormDynamicFP8Quant``) quantizes the
  normalized rows after rounding them to the activation dtype, so its per-token scales differ
  from the reference's (scales of the FP32 rows) by up to 2^-9 relative: ``fp8_e4m3`` reads are
  refused rather than served with other scales.
* FlashInfer keeps each workspace's peer memory for the life of the process (module-level
  references), so a provider makes one per (group, hidden size, dtype) and shares it among the
  stages, and models, built through it.
* Workspace creation is collective (peer handles exchanged, then a barrier) and compiles the
  kernels on first use, in between: a rank whose build fails there would leave the others
  waiting. The kernels are therefore built (``gen_trtllm_comm_module().build_and_load()``)
  before, as a check of this process whose failure the group agrees to refuse on.

The base class's ``can_defer_all_reduce`` lets an FFN (or a mixer) leave its TP sum to the next
input when a candidate of this provider completes that sum there and the batch fits the
workspace, so the FFN's all-reduce is fused too, not only attention's.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from layer_boundary.plugin_api import AllReduceNormProvider, FusedSum, kernel_op

__all__ = ["FlashInferAllReduceNorm", "CommApi", "FP8_REFUSAL", "WORLD_SIZES", "ONESHOT_BUDGET_MIB"]

WORLD_SIZES = (2, 4, 8, 16)

# FlashInfer 0.7.2 runs one-shot while T·H·2·world·bytes stays within these budgets (MiB, its
# measurements on B200); it has none for 16 ranks, where the kernel's own one-shot bound of 128
# tokens applies.
ONESHOT_BUDGET_MIB = {2: 512, 4: 64, 8: 42}
ONESHOT_TOKENS_16 = 128

FP8_REFUSAL = (
    "FlashInfer's dynamic per-token FP8 pattern quantizes the normalized rows after rounding them "
    "to the activation dtype, so its scales differ from the fp8_e4m3 read's (scales of the FP32 "
    "rows) by up to 2^-9 relative"
)


@dataclass(frozen=True)
class CommApi:
    """The parts of ``flashinfer.comm`` the candidate calls, bound once."""

    create_workspace: Callable[..., Any]
    allreduce_fusion: Callable[..., Any]
    pattern: int  # AllReduceFusionPattern.kARResidualRMSNorm
    weight_bias: bool  # allreduce_fusion takes weight_bias (Gemma RMSNorm)
    module_spec: Optional[Callable[[], Any]]  # gen_trtllm_comm_module: the kernels' JIT build


def _import_comm() -> Any:
    """The ``CommApi``, or the reason it cannot be used here."""
    try:
        import flashinfer.comm as comm
    except Exception as e:  # ImportError, or a CUDA/torch mismatch raised while importing
        return f"flashinfer.comm is not importable ({type(e).__name__}: {e}); pip install flashinfer-python"
    create = getattr(comm, "create_allreduce_fusion_workspace", None)
    run = getattr(comm, "allreduce_fusion", None)
    pattern = getattr(getattr(comm, "AllReduceFusionPattern", None), "kARResidualRMSNorm", None)
    if create is None or run is None or pattern is None:
        return ("this flashinfer.comm lacks create_allreduce_fusion_workspace, allreduce_fusion or "
                "AllReduceFusionPattern.kARResidualRMSNorm; install flashinfer-python 0.7.2 or newer")
    try:
        takes_bias = "weight_bias" in inspect.signature(run).parameters
    except (TypeError, ValueError):
        takes_bias = False
    return CommApi(create, run, int(pattern), takes_bias, getattr(comm, "gen_trtllm_comm_module", None))


def _build(comm: CommApi) -> Optional[str]:
    """Build (or load from FlashInfer's cache) the fusion kernels, or say why that failed.

    Workspace creation would build them anyway, but in the middle of its collectives, where a
    rank that fails leaves the others waiting; built here, a failure is this rank's refusal,
    which the group agrees on. The first build takes minutes (nvcc); later ones load the cache.
    """
    if comm.module_spec is None:
        return None
    try:
        comm.module_spec().build_and_load()
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return (f"FlashInfer could not build its all-reduce fusion kernels here ({type(e).__name__}: "
                f"{first}); they compile with nvcc on first use (CUDA_HOME)")
    return None


# On by default since its 2×H200 run (2026-11-30, second session: the candidate's 2-GPU test
# against NCCL + reference and `bench allreduce` at H=4096/7168). An operator can still turn it
# off (the first use on a fresh machine JIT-builds its kernels for minutes, at construction).
FUSION_ENV = "LAYER_BOUNDARY_FLASHINFER_FUSION"
TURNED_OFF = f"turned off ({FUSION_ENV}=0)"


def fusion_enabled_from_env() -> bool:
    return os.environ.get(FUSION_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class FlashInferAllReduceNorm(AllReduceNormProvider):
    """Fusion provider: FlashInfer's fused all-reduce + add + RMSNorm for owed TP sums.

    ``max_tokens``: rows the workspace holds (FlashInfer's ``max_token_num``); a batch with more
    rows takes the unfused path. ``oneshot_max_tokens``: the largest row count run one-shot
    (``None``: FlashInfer's budgets). ``launch_with_pdl``: launch with programmatic dependent
    launch. Workspaces are created at construction, collectively over the group, before any
    CUDA-graph capture, and shared by every stage with the same group, hidden size and dtype.
    """

    name = "flashinfer-allreduce-fusion"
    candidate_name = "flashinfer all-reduce + add + rmsnorm"
    dtypes = frozenset({torch.bfloat16, torch.float16, torch.float32})
    weight_offsets = frozenset({0.0, 1.0})
    quants = frozenset({None, "fp8_e4m3"})  # fp8_e4m3 is refused in group_refusal, with its reason
    max_world = max(WORLD_SIZES)
    max_hidden = 16384
    backends = frozenset({"nccl"})
    # bf16/fp16: the normalized rows come from the rounded residual, about one ulp from the
    # reference's; fp32: FP32 sums in another order and rsqrtf, a few ulps.
    tolerance = {torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3), torch.float32: (1e-5, 1e-5)}

    def __init__(self, max_tokens: int = 2048, *, oneshot_max_tokens: Optional[int] = None,
                 launch_with_pdl: bool = False, enabled: Optional[bool] = None) -> None:
        for what, v in (("max_tokens", max_tokens), ("oneshot_max_tokens", oneshot_max_tokens)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{what}={v!r} must be a positive integer (rows of the fused all-reduce)")
        super().__init__(max_tokens)
        self.oneshot_max_tokens = oneshot_max_tokens
        self.launch_with_pdl = bool(launch_with_pdl)
        self.enabled = fusion_enabled_from_env() if enabled is None else bool(enabled)
        self._comm: Any = None  # CommApi, or why flashinfer.comm cannot be used
        self._built: Optional[str] = None  # "" once the kernels load, else why they do not
        # (group ranks, hidden size, dtype) of every sum a candidate of this provider completes,
        # and, per producer plan, whether its output sum is one of them (decided once).

    # -- eligibility ---------------------------------------------------------------------------

    def group_refusal(self, fused: FusedSum) -> Optional[str]:
        world = fused.group.size
        if world not in WORLD_SIZES:
            return (f"FlashInfer's fused all-reduce has kernels for {', '.join(map(str, WORLD_SIZES))} "
                    f"ranks; the {fused.sum_group.value} group has {world}")
        vec = 16 // fused.dtype.itemsize
        if fused.hidden_size % vec:
            return (f"hidden size {fused.hidden_size} is not a multiple of {vec}: the fused kernel moves "
                    f"16-byte vectors of {str(fused.dtype).replace('torch.', '')}")
        if fused.quant == "fp8_e4m3":
            return FP8_REFUSAL
        return None

    def local_refusal(self, fused: FusedSum) -> Optional[str]:
        if not self.enabled:
            return TURNED_OFF  # a fact of this process (its environment): agreed over the group
        why = self.device_refusal()
        if why is not None:
            return why
        comm = self._load()
        if isinstance(comm, str):
            return comm
        if fused.weight_offset != 0.0 and not comm.weight_bias:
            return ("this FlashInfer's allreduce_fusion takes no weight_bias, so it has no Gemma "
                    "RMSNorm (weight + 1); install flashinfer-python 0.7.2 or newer")
        if self._built is None:
            self._built = _build(comm) or ""
        return self._built or None

    def device_refusal(self) -> Optional[str]:
        """Why this process's GPU cannot run the fused kernels (``None``: it can)."""
        if not torch.cuda.is_available():
            return "no CUDA device in this process"
        major, minor = torch.cuda.get_device_capability()
        if major not in (9, 10, 12):
            return (f"FlashInfer builds its all-reduce fusion for compute capability 9.x, 10.x and "
                    f"12.x; this GPU is {major}.{minor}")
        return None

    # -- workspace and kernel ------------------------------------------------------------------

    def make_workspace(self, fused: FusedSum) -> Any:
        comm = self._load()
        assert not isinstance(comm, str), comm  # local_refusal refused this group otherwise
        group = fused.group
        # Collective over the group (handle exchange and a barrier); every rank gets here for the
        # same stage, since the base class agreed on the refusal first.
        ws = comm.create_workspace(
            backend="trtllm", world_size=group.size, rank=group.rank, max_token_num=self.max_tokens,
            hidden_dim=fused.hidden_size, dtype=fused.dtype, group=group.group,
        )
        backend = getattr(ws, "backend", None)
        if backend != "trtllm":
            raise RuntimeError(f"flashinfer created a {backend!r} workspace where 'trtllm' was asked for")
        return ws

    def oneshot_rows(self, fused: FusedSum) -> int:
        """The largest row count run one-shot for this group, hidden size and dtype."""
        world = fused.group.size
        if self.oneshot_max_tokens is not None:
            rows = self.oneshot_max_tokens
        elif world in ONESHOT_BUDGET_MIB:
            rows = (ONESHOT_BUDGET_MIB[world] << 20) // (fused.hidden_size * 2 * world * fused.dtype.itemsize)
        else:
            rows = ONESHOT_TOKENS_16
        return max(rows, world)  # two-shot splits the rows among the ranks: it needs more rows than ranks

    def run_with(self, workspace: Any, fused: FusedSum) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        comm = self._load()
        assert not isinstance(comm, str), comm
        # FP32 accumulation for 16-bit rows: one rounding of the sum, the reference's. FlashInfer
        # ignores it for fp32 rows.
        extra: dict[str, Any] = {"fp32_acc": fused.dtype is not torch.float32}
        if fused.weight_offset != 0.0:
            extra["weight_bias"] = fused.weight_offset
        call = len(_CALLS)
        _CALLS.append(_Call(comm.allreduce_fusion, workspace, comm.pattern, self.launch_with_pdl,
                            self.oneshot_rows(fused), extra))
        hidden, dtype = fused.hidden_size, fused.dtype

        def run(x: torch.Tensor, residual: torch.Tensor, read: Any) -> tuple[torch.Tensor, torch.Tensor]:
            y = torch.empty((x.shape[0], hidden), dtype=dtype, device=x.device)
            _allreduce_add_rmsnorm(x, residual, read.weight, float(read.eps), y, call)
            return y, residual

        return run

    def _load(self) -> Any:
        if self._comm is None:
            self._comm = _import_comm()
        return self._comm

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(max_tokens={self.max_tokens}, oneshot_max_tokens="
                f"{self.oneshot_max_tokens}, launch_with_pdl={self.launch_with_pdl})")


@dataclass(frozen=True)
class _Call:
    """What one candidate's fused call passes to ``allreduce_fusion`` besides its tensors."""

    allreduce_fusion: Callable[..., Any]
    workspace: Any
    pattern: int
    pdl: bool
    oneshot_rows: int
    extra: dict[str, Any]


# The candidates' calls by index: the operator takes no Python object. One per (group, hidden
# size, dtype) and stage read; kept for the process's life, as FlashInfer keeps the workspaces.
_CALLS: list[_Call] = []


def _allreduce_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           out: torch.Tensor, call: int) -> None:
    """``out = rmsnorm(residual += all_reduce(x))`` in FlashInfer's one kernel: under
    ``torch.compile`` the operator ``layer_boundary_flashinfer::allreduce_add_rmsnorm`` (the
    collective runs inside it, through the workspace's peer buffers)."""
    c = _CALLS[call]
    # The kernel flattens its tensors and reads 16-byte vectors: rows must be packed and aligned
    # (the base class has checked dtype, width and that the residual is packed).
    if x.data_ptr() % 16 or not x.is_contiguous():
        x = x.clone(memory_format=torch.contiguous_format)
    r = residual if residual.data_ptr() % 16 == 0 else residual.clone()
    if weight.requires_grad:
        weight = weight.detach()  # DLPack refuses tensors that require grad
    c.allreduce_fusion(input=x, workspace=c.workspace, pattern=c.pattern, launch_with_pdl=c.pdl,
                       trigger_completion_at_end=True, output=out, residual_out=r, norm_out=out, residual_in=r,
                       rms_gamma=weight, rms_eps=eps, use_oneshot=x.shape[0] <= c.oneshot_rows, **c.extra)
    if r is not residual:
        residual.copy_(r)


kernel_op("allreduce_add_rmsnorm", _allreduce_add_rmsnorm, mutates=("residual", "out"))
