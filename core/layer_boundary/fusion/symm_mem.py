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

from .allreduce_norm import AllReduceNormProvider, FusedRun, FusedSum

__all__ = ["SymmMemAllReduceNorm", "SymmWorkspace"]


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
        import torch.distributed._symmetric_memory as symm_mem

        group = fused.group
        device = torch.device("cuda", torch.cuda.current_device())
        name = group.group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed before torch 2.9, a deprecated no-op since
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(name)
        max_programs = torch.cuda.get_device_properties(device).multi_processor_count
        # Two halves (consecutive calls alternate, so no closing barrier is needed), each with one
        # slot of rows per rank (ranks push their rows; see the kernel).
        row_bytes = 2 * group.size * fused.hidden_size * fused.dtype.itemsize
        rows = max(1, min(self.max_tokens, self.workspace_bytes // row_bytes))
        data = symm_mem.empty(rows * row_bytes // fused.dtype.itemsize, dtype=fused.dtype, device=device)
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
            torch.zeros(max_programs, dtype=torch.int32, device=device),
            group.rank, group.size, max_programs, rows,
        )
        # Every rank's flags must read zero before any rank's first kernel signals into them.
        torch.cuda.synchronize(device)
        dist.barrier(group=group.group)
        return ws

    def run_with(self, workspace: SymmWorkspace, fused: FusedSum) -> FusedRun:
        from .symm_mem_kernel import allreduce_add_rmsnorm_kernel

        hidden = fused.hidden_size
        block = 1 << (hidden - 1).bit_length()
        warps = _num_warps(block)
        grid = (workspace.max_programs,)  # always all programs: each keeps its rows (see kernel)
        rank, world = workspace.rank, workspace.world
        data, offsets, flag_ptrs = workspace.data, workspace.data_offsets, workspace.flag_ptrs
        epochs, slot = workspace.epochs, workspace.max_tokens * hidden

        def run(x: torch.Tensor, residual: torch.Tensor, read: Any) -> tuple[torch.Tensor, torch.Tensor]:
            rows = x.shape[0]
            out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
            allreduce_add_rmsnorm_kernel[grid](
                x, residual, read.weight, out, data, offsets, flag_ptrs, epochs,
                rows, hidden, x.stride(0), slot, read.eps, read.offset,
                RANK=rank, WORLD=world, BLOCK=block, num_warps=warps,
            )
            return out, residual

        return run
