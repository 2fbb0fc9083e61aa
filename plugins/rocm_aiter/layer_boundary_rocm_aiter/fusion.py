"""Consumer candidate: the owed TP all-reduce through AITER's custom all-reduce, then AITER's add +
RMSNorm.

    total = sum over the group of x      (CustomAllreduce.all_reduce: FP32 sum, rounded once)
    s = total + r (FP32);  r' = s.to(dtype);  y = RMSNorm(s)       (rmsnorm2d_fwd_with_add)

Shapes: x, r, y, r': [T, H] with T <= ``max_tokens``. The numbers are those of the unfused path
(all-reduce in the activation dtype, then the FP32 add + norm read); what changes is the
all-reduce: AITER's one-node IPC kernel instead of RCCL, which wins on the small decode-sized
messages this candidate is limited to. ``r'`` is a new tensor (AITER documents no aliasing of
its residual buffers).

Why not AITER's one-kernel ``fused_allreduce_rmsnorm``: in amd-aiter 0.1.7.post2.dev18 its C++
entry passes ``eps`` through an ``int`` parameter (``csrc/kernels/custom_all_reduce.cu``,
``_fused_allreduce_rmsnorm(..., int eps, ...)``), so it normalizes with eps = 0 (an all-zero row
becomes NaN), and it normalizes the sum rounded to the activation dtype
(``local_device_load_rmsnorm*`` in ``custom_all_reduce.cuh``), not the FP32 sum the core's read
defines. Later AITER sources change that function's signature; wiring it means targeting them.

Eligibility, as refusal reasons in the selection report: the base class's (RCCL group, which
torch reports as backend ``nccl``; dtype fp16/bf16; H <= 8192; plain RMSNorm; unquantized
output), then 2, 4, 6 or 8 ranks and rows a multiple of 16 bytes (AITER's limits), then, per
process and agreed over the group, one host, a GPU, and AITER's all-reduce library loaded.
"""

from __future__ import annotations

import logging
import socket
from typing import Any, Optional

import torch
import torch.distributed as dist

from layer_boundary import GroupInfo
from layer_boundary.plugin_api import (
    AllReduceNormProvider,
    FusedSum,
    gather_objects,
    kernel_op,
    WorkspaceUnavailable,
)

from .api import AiterApi
from .norm import MAX_ONE_PASS_HIDDEN, _add_rmsnorm_into, api_index

# The CustomAllreduce workspaces by index: the operator takes no Python object. One per group, H
# and dtype; kept for the process's life, as their IPC buffers are.
_WORKSPACES: list[Any] = []


def _custom_all_reduce(x: torch.Tensor, workspace: int) -> torch.Tensor:
    """The group's sum of contiguous rows ``x`` (a new tensor) through AITER's IPC all-reduce.
    registered=False: AITER copies x into its pre-registered buffer, so no address of ours has
    to be registered with the peers, in eager mode or under graph capture."""
    return _WORKSPACES[workspace].all_reduce(x, registered=False)


# Opaque under torch.compile: the collective runs inside (every rank's graph holds one call).
kernel_op("custom_all_reduce", _custom_all_reduce, fake=lambda x, workspace: torch.empty_like(x))

__all__ = ["AiterAllReduceNorm", "WORLD_SIZES"]

log = logging.getLogger("layer_boundary.rocm_aiter")

# CustomAllreduce._SUPPORTED_WORLD_SIZES; init_custom_ar also rejects odd sizes and more than 8.
WORLD_SIZES = (2, 4, 6, 8)


class AiterAllReduceNorm(AllReduceNormProvider):
    """Fusion provider over AITER's ``CustomAllreduce`` (one workspace per group, H and dtype).

    ``defer_ffn_sums``: let FFN outputs leave their TP sum to the next input, where this candidate
    completes it (``False``: only the attention sums an FFN input owes anyway are fused).
    ``device_type`` and ``backends`` are where it runs: a ROCm GPU on an RCCL group. Tests pass
    ``device_type="cpu", backends=("gloo",)`` with a CPU test double of AITER.
    """

    name = "rocm-aiter-allreduce"
    candidate_name = "aiter custom all-reduce + add + rmsnorm"
    dtypes = frozenset({torch.bfloat16, torch.float16})
    weight_offsets = frozenset({0.0})
    quants: frozenset[Optional[str]] = frozenset({None})
    max_world = max(WORLD_SIZES)
    max_hidden = MAX_ONE_PASS_HIDDEN
    backends = frozenset({"nccl"})

    def __init__(self, api: AiterApi, max_tokens: int = 2048, *, defer_ffn_sums: bool = True,
                 device_type: str = "cuda", backends: Optional[tuple[str, ...]] = None) -> None:
        super().__init__(max_tokens)
        self.api = api
        self.defer_sums = defer_ffn_sums
        self.device_type = device_type
        if backends is not None:
            self.backends = frozenset(backends)
        # Per group (its ranks): the gloo group AITER exchanges IPC handles over, and the hosts.
        self._cpu: dict[tuple[int, ...], tuple[Any, list[str]]] = {}

    # -- eligibility ----------------------------------------------------------------------------

    def group_refusal(self, fused: FusedSum) -> Optional[str]:
        world = fused.group.size
        if world not in WORLD_SIZES:
            return f"AITER's custom all-reduce runs on {', '.join(map(str, WORLD_SIZES))} ranks, not {world}"
        row_bytes = fused.hidden_size * _elem_size(fused.dtype)
        if row_bytes % 16:
            return (f"a row of H={fused.hidden_size} is {row_bytes} bytes; AITER's custom all-reduce "
                    "moves whole 16-byte packs")
        return None

    def local_refusal(self, fused: FusedSum) -> Optional[str]:
        # Every rank of the group gets here together (the checks before use shared facts only),
        # so the group's one collective of this step comes first, before any local answer.
        _, hosts = self._cpu_group(fused.group)
        if len(set(hosts)) > 1:
            return (f"the group spans hosts {', '.join(sorted(set(hosts)))}; AITER's custom all-reduce "
                    "maps peer GPU memory over IPC, within one node")
        if self.device_type == "cuda" and not torch.cuda.is_available():
            return "no ROCm GPU in this process"
        return self.api.missing_norm() or self.api.custom_allreduce_missing()

    # -- workspace and kernel ---------------------------------------------------------------------

    def make_workspace(self, fused: FusedSum) -> Any:
        cpu_group, _ = self._cpu_group(fused.group)
        device = torch.device("cuda", torch.cuda.current_device()) if self.device_type == "cuda" \
            else torch.device(self.device_type)
        max_size = self.max_tokens * fused.hidden_size * _elem_size(fused.dtype)
        ca = self.api.custom_allreduce().CustomAllreduce(cpu_group, device, max_size=max_size)
        if ca.disabled:
            # The conditions AITER checks were refused above with the same answer on every rank,
            # so this is an AITER change this plugin does not know: the group agrees to refuse.
            raise WorkspaceUnavailable(
                f"{self.api.label} disabled its CustomAllreduce for ranks {fused.group.ranks} after "
                "this plugin found it eligible (see aiter's warning)"
            )
        return ca

    def run_with(self, workspace: Any, fused: FusedSum) -> Any:
        assert self.api.add_rmsnorm is not None  # the provider offered this candidate because AITER has it
        api = api_index(self.api)
        ws = len(_WORKSPACES)
        _WORKSPACES.append(workspace)

        def run(x: torch.Tensor, residual: torch.Tensor, read: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if not x.is_contiguous():
                x = x.contiguous()  # the copy into AITER's IPC buffer reads the rows as one flat span
            total = _custom_all_reduce(x, ws)
            y = torch.empty_like(residual)
            r_new = torch.empty_like(residual)
            _add_rmsnorm_into(y, total, residual, r_new, read.weight, float(read.eps), api)
            return y, r_new

        return run

    # -- helpers ----------------------------------------------------------------------------------

    def _cpu_group(self, group: GroupInfo) -> tuple[Any, list[str]]:
        """A gloo group over the same ranks (AITER asserts its group is not RCCL) and each rank's
        host, created once per group and only by its members (local synchronization)."""
        found = self._cpu.get(group.ranks)
        if found is None:
            cpu = dist.new_group(list(group.ranks), backend="gloo", use_local_synchronization=True)
            # Not all_gather_object: it needs NumPy, which a CPU install of torch does not bring.
            hosts = gather_objects(socket.gethostname(), group=cpu)
            found = self._cpu[group.ranks] = (cpu, [str(h) for h in hosts])
        return found

    def __repr__(self) -> str:
        return f"AiterAllReduceNorm({self.api.label}, max_tokens={self.max_tokens})"


def _elem_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
