"""Collectives and token-row movement over torch.distributed.

Every function takes a :class:`~layer_boundary._topology.GroupInfo`; on a group of one it returns
its input untouched and starts nothing, which is what makes the single-rank model the same code.
Collectives are not differentiable: they run under ``no_grad`` so that a caller that forgot
inference mode does not trip autograd's view checks inside gloo.
"""

from __future__ import annotations

import ctypes
import pickle
from typing import Any, Optional

import torch
import torch.distributed as dist

from ._topology import GroupInfo

# torch 2.13 renamed the single-tensor collectives; older torch (2.11 on the GPU hosts) has only
# the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = ["all_reduce", "all_gather_rows", "reduce_scatter_rows", "all_to_all_rows", "send_tensors",
           "recv_tensors", "gather_objects"]


@torch.no_grad()
def all_reduce(x: torch.Tensor, group: GroupInfo) -> torch.Tensor:
    """Sum ``x`` over ``group`` in place and return it."""
    if group.size == 1:
        return x
    dist.all_reduce(x, group=group.group)
    return x


@torch.no_grad()
def all_gather_rows(x: torch.Tensor, group: GroupInfo) -> torch.Tensor:
    """Concatenate equal-shaped ``[T, ...]`` slices of every rank along dim 0, in group order."""
    if group.size == 1:
        return x
    out = x.new_empty((x.shape[0] * group.size, *x.shape[1:]))
    _all_gather(out, x.contiguous(), group=group.group)
    return out


@torch.no_grad()
def reduce_scatter_rows(x: torch.Tensor, group: GroupInfo) -> torch.Tensor:
    """Sum ``x [group.size * C, ...]`` over ``group``; rank ``i`` keeps rows ``[i*C, (i+1)*C)``."""
    if group.size == 1:
        return x
    rows = x.shape[0] // group.size
    assert rows * group.size == x.shape[0], "callers pad rows to a multiple of the group size"
    out = x.new_empty((rows, *x.shape[1:]))
    _reduce_scatter(out, x.contiguous(), group=group.group)
    return out


@torch.no_grad()
def all_to_all_rows(x: torch.Tensor, send_rows: list[int], recv_rows: list[int], group: GroupInfo) -> torch.Tensor:
    """Send ``send_rows[i]`` consecutive rows of ``x`` to group rank ``i``; receive ``recv_rows[i]``
    rows from rank ``i``, concatenated in rank order."""
    if group.size == 1:
        return x
    out = x.new_empty((sum(recv_rows), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv_rows,
                           input_split_sizes=send_rows, group=group.group)
    return out


# Point-to-point transport of a named tensor dict between adjacent pipeline stages. The sender
# first sends a header (its length, then the names, dtypes and shapes) so the receiver can
# allocate; then each tensor in name order.
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32,
           torch.uint8, torch.bool)


def _peer(group: GroupInfo, offset: int) -> int:
    i = group.rank + offset
    if not 0 <= i < group.size:
        where = "first" if offset < 0 else "last"
        raise ValueError(f"pipeline rank {group.rank} is the {where} stage of {group.size}; it has no "
                         f"{'previous' if offset < 0 else 'next'} stage to exchange tensors with")
    return group.ranks[i]


@torch.no_grad()
def send_tensors(tensors: dict[str, torch.Tensor], group: GroupInfo) -> None:
    """Send ``tensors`` to the next rank of the pipeline ``group`` (see :func:`recv_tensors`)."""
    dst = _peer(group, +1)
    names = sorted(tensors)
    header: list[int] = [len(names)]
    for name in names:
        t = tensors[name]
        if not isinstance(t, torch.Tensor) or t.dtype not in _DTYPES:
            raise TypeError(f"send_tensors: {name!r} must be a tensor of one of {_DTYPES}, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
        key = list(name.encode())
        header += [len(key), *key, _DTYPES.index(t.dtype), t.dim(), *t.shape]
    device = tensors[names[0]].device if names else torch.device("cpu")
    head = torch.tensor(header, dtype=torch.int64, device=device)
    dist.send(torch.tensor([head.numel()], dtype=torch.int64, device=device), dst, group=group.group)
    dist.send(head, dst, group=group.group)
    for name in names:
        dist.send(tensors[name].contiguous(), dst, group=group.group)


@torch.no_grad()
def recv_tensors(group: GroupInfo, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Receive the tensor dict the previous rank of the pipeline ``group`` sent."""
    src = _peer(group, -1)
    n = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(n, src, group=group.group)
    head = torch.empty(int(n.item()), dtype=torch.int64, device=device)
    dist.recv(head, src, group=group.group)
    h = head.tolist()
    pos, out = 1, {}
    for _ in range(h[0]):
        k = h[pos]
        name = bytes(h[pos + 1 : pos + 1 + k]).decode()
        pos += 1 + k
        dtype, ndim = _DTYPES[h[pos]], h[pos + 1]
        shape = h[pos + 2 : pos + 2 + ndim]
        pos += 2 + ndim
        out[name] = torch.empty(shape, dtype=dtype, device=device)
    for name in sorted(out):
        dist.recv(out[name], src, group=group.group)
    return out


def gather_objects(obj: Any, group: Optional[dist.ProcessGroup] = None) -> list[Any]:
    """Every rank's ``obj`` (picklable) in ``group`` (default the world), in group rank order.
    torch's all_gather_object needs NumPy, which a CPU install of torch does not bring (``run``
    under torchrun failed on it): pickled bytes in uint8 tensors instead. Host syncs (the sizes'
    ``.item()``): for construction and results, never a forward step."""
    device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
              else torch.device("cpu"))
    # Bytes in and out without a Python int per byte (a rank's logits can be many MB).
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    n = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device), group=group)
    lengths = [int(v.item()) for v in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    bufs = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(bufs, padded, group=group)
    host = [b[:k].cpu().contiguous() for b, k in zip(bufs, lengths)]
    return [pickle.loads(ctypes.string_at(h.data_ptr(), h.numel())) for h in host]
