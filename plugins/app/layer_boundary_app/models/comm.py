"""The collectives the reference models run themselves, as an engine runs its own: the
tensor-parallel layers' all-reduce and the pipeline stages' hand-over of tensors.

Every function takes a :class:`~layer_boundary.GroupInfo`; on a group of one it starts nothing.
They run under ``no_grad``: collectives are not differentiable, and a caller that forgot
inference mode must not trip autograd's view checks inside gloo.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from layer_boundary import GroupInfo

__all__ = ["all_reduce", "send_tensors", "recv_tensors"]


@torch.no_grad()
def all_reduce(x: torch.Tensor, group: GroupInfo) -> torch.Tensor:
    """Sum ``x`` over ``group`` in place and return it."""
    if group.size == 1:
        return x
    dist.all_reduce(x, group=group.group)
    return x


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
