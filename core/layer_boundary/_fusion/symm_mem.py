"""The core's fused consumer candidate: symmetric-memory all-reduce + add + RMSNorm (CUDA, Triton).

It completes an owed attention-TP or TP sum of up to ``max_tokens`` rows in one kernel that
reads the peers' partial rows through symmetric-memory peer pointers (NVLink P2P, never
multicast). Above the limit, or where it refuses, the stage completes the sum with the
group's all-reduce followed by the selected norm kernel.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from .._kernels.kernel_op import kernel_op
from .allreduce_norm import AllReduceNormProvider, FusedRun, FusedSum

__all__ = ["SymmMemAllReduceNorm", "SymmWorkspace", "make_symm_workspace", "launch"]


@dataclass(eq=False)
class SymmWorkspace:
    """Peer-visible row buffer and barrier flags of one group, created at construction."""

    data: torch.Tensor
    flags: torch.Tensor
    data_offsets: torch.Tensor  # int64 [world] element offsets of every rank's rows from ours
    flag_ptrs: torch.Tensor  # int64 [world] device addresses of every rank's flags
    epochs: torch.Tensor  # int32 [max_programs] calls made by each program (this rank only)
    rank: int
    world: int
    max_programs: int
    max_tokens: int  # rows per call the buffers hold
    index: int = -1  # in _WORKSPACES: how the operator, which takes no Python object, finds it

    def __post_init__(self) -> None:
        self.index = len(_WORKSPACES)
        _WORKSPACES.append(self)


# Every workspace made, by index (a handful a process: one per group, hidden size and dtype, kept
# for the process's life as its peer memory is).
_WORKSPACES: list[SymmWorkspace] = []


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 256))


class SymmMemAllReduceNorm(AllReduceNormProvider):
    name = "core-symm-mem"
    candidate_name = "symm-mem all-reduce + add + rmsnorm"

    def __init__(self, max_tokens: int = 2048, workspace_bytes: int = 256 << 20) -> None:
        super().__init__(max_tokens)
        # Per group, hidden size and dtype: 2 halves x world slots x rows x hidden. Past this the
        # row limit shrinks (where the fusion gains least: NCCL catches up at long batches).
        self.workspace_bytes = workspace_bytes

    def local_refusal(self, fused: FusedSum) -> Optional[str]:
        if not torch.cuda.is_available():
            return "no CUDA device in this process"
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        try:
            importlib.import_module("torch.distributed._symmetric_memory")
        except Exception as exc:  # a torch build without it
            return f"torch.distributed._symmetric_memory is unavailable ({exc})"
        return None

    def make_workspace(self, fused: FusedSum) -> SymmWorkspace:
        return make_symm_workspace(fused.group, fused.hidden_size, fused.dtype, self.max_tokens,
                                   self.workspace_bytes)

    def run_with(self, workspace: SymmWorkspace, fused: FusedSum) -> FusedRun:
        def run(x: torch.Tensor, residual: torch.Tensor, read: Any) -> tuple[torch.Tensor, torch.Tensor]:
            out = torch.empty((x.shape[0], fused.hidden_size), dtype=x.dtype, device=x.device)
            launch(workspace, x, residual, read.weight, out, read.eps, read.offset)
            return out, residual

        return run


def make_symm_workspace(group: Any, hidden: int, dtype: torch.dtype, max_tokens: int,
                        budget_bytes: int) -> SymmWorkspace:
    """Peer-visible rows and flags for ``group`` (a collective: every rank calls it in turn).

    A group of one rank gets no symmetric memory: the kernel then sums nothing over ranks.
    """
    device = torch.device("cuda", torch.cuda.current_device())
    max_programs = torch.cuda.get_device_properties(device).multi_processor_count
    epochs = torch.zeros(max_programs, dtype=torch.int32, device=device)
    if group.size == 1:
        none = torch.zeros(1, dtype=torch.int64, device=device)
        return SymmWorkspace(torch.empty(0, dtype=dtype, device=device), none.int(), none, none, epochs,
                             0, 1, max_programs, max_tokens)
    import torch.distributed._symmetric_memory as symm_mem

    name = group.group.group_name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # needed before torch 2.9, a deprecated no-op since
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(name)
    # Two halves (consecutive calls alternate, so no closing barrier is needed), each with one
    # slot of rows per rank (ranks push their rows; see the kernel).
    row_bytes = 2 * group.size * hidden * dtype.itemsize
    rows = max(1, min(max_tokens, budget_bytes // row_bytes))
    data = symm_mem.empty(rows * row_bytes // dtype.itemsize, dtype=dtype, device=device)
    flags = symm_mem.empty(max_programs * group.size, dtype=torch.int32, device=device)
    flags.zero_()
    data_h = symm_mem.rendezvous(data, name)
    flags_h = symm_mem.rendezvous(flags, name)
    elem = data.element_size()
    offsets = []
    for ptr in data_h.buffer_ptrs:
        delta = ptr - data.data_ptr()
        if delta % (16 * elem):
            raise RuntimeError(f"symmetric buffers of group {name} are not 16-element aligned "
                               f"to each other (offset {delta} bytes)")
        offsets.append(delta // elem)
    ws = SymmWorkspace(
        data, flags,
        torch.tensor(offsets, dtype=torch.int64, device=device),
        torch.tensor(list(flags_h.buffer_ptrs), dtype=torch.int64, device=device),
        epochs, group.rank, group.size, max_programs, rows,
    )
    # Every rank's flags must read zero before any rank's first kernel signals into them.
    torch.cuda.synchronize(device)
    dist.barrier(group=group.group)
    return ws


def launch(ws: SymmWorkspace, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
           out: torch.Tensor, eps: float, weight_offset: float, *, topk_weights: Optional[torch.Tensor] = None,
           shared: Optional[torch.Tensor] = None) -> None:
    """One fused call: sum ``x`` over the workspace's group, add ``residual`` (in place), write
    the norm into ``out``. With ``topk_weights``, ``x`` is ``[T, k, H]`` expert outputs that are
    combined (plus ``shared``) first: a MoE finalize handoff. Under ``torch.compile`` the launch is
    the operator ``layer_boundary::symm_mem_allreduce_add_rmsnorm`` (its peer buffers and flags are
    the workspace's own state, outside the graph)."""
    if residual.shape[0] > ws.max_tokens:  # past the buffers: peers' rows would be overwritten
        raise ValueError(f"{residual.shape[0]} rows exceed the workspace's {ws.max_tokens}; callers decline "
                         "such batches before launching")
    _launch(x, residual, weight, out, float(eps), float(weight_offset), topk_weights, shared, ws.index)


def _launch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float,
            weight_offset: float, topk_weights: Optional[torch.Tensor], shared: Optional[torch.Tensor],
            workspace: int) -> None:
    from .symm_mem_kernel import allreduce_add_rmsnorm_kernel

    ws = _WORKSPACES[workspace]
    hidden = residual.shape[-1]
    block = 1 << (hidden - 1).bit_length()
    topk = 0 if topk_weights is None else topk_weights.shape[1]
    topk_stride = 0 if topk_weights is None else topk_weights.stride(0)
    # With peers, always all programs (each keeps its rows, see the kernel); alone, one per row.
    grid = (ws.max_programs,) if ws.world > 1 else (max(1, residual.shape[0]),)
    allreduce_add_rmsnorm_kernel[grid](
        x, residual, weight, out, ws.data, ws.data_offsets, ws.flag_ptrs, ws.epochs,
        residual.shape[0], hidden, x.stride(0), ws.max_tokens * hidden, eps, weight_offset,
        topk_weights if topk else x, shared if shared is not None else x,
        x.stride(1) if topk else 0, topk_stride,
        shared.stride(0) if shared is not None else 0, ws.max_programs,
        RANK=ws.rank, WORLD=ws.world, BLOCK=block, TOPK=topk, HAS_SHARED=shared is not None,
        num_warps=_num_warps(block),
    )


kernel_op("layer_boundary::symm_mem_allreduce_add_rmsnorm", _launch, mutates=("residual", "out"))
