"""Where a launch of the split variant gets its ready counts (one int32 a block).

A launch's 16 stream CTAs of a block take its count from 0 to 16, and its finishers wait for 16.
The counts come either zeroed for the call (``torch.zeros``: a memset before the launch, about
1.3 µs of an H200 call) or, with ``cluster_ops.SPLIT_CLEAN_COUNTS``, from a buffer that the launch
before left at zero: in that kernel the last reader of each block sets its count back
(``SplitShape.clean``).

Such a buffer must never serve two launches at once:

- eager calls: one buffer a (device, stream), since launches on a stream run one after another;
- calls captured in a CUDA graph: a slice of a pool set aside outside the capture, each captured
  call its own for the life of the process. Two graphs may be replayed at once on two streams
  (two-batch overlap), and a slice is not told when its graph is freed. With the pool used up,
  captured calls take zeroed counts again (a memset node in the graph), with a warning.
"""

from __future__ import annotations

import threading
import warnings

import torch

# int32 counts set aside a device for captured calls (8 MiB: a block is 16 tokens, so 4096
# captured calls of 8192 tokens).
CAPTURED_COUNTS = 1 << 21
_EAGER: dict[tuple[int, int], torch.Tensor] = {}
_POOL: dict[int, list] = {}  # device index -> [counts, how many handed out]
_WARNED: set[int] = set()
_LOCK = threading.Lock()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def reserve(device: torch.device) -> None:
    """Set aside the pool for captured calls on ``device`` (outside any capture, once; a graph
    capture starts with a device synchronize, so the zeros are in place before any replay)."""
    idx = _index(device)
    with _LOCK:
        if idx not in _POOL and not torch.cuda.is_current_stream_capturing():
            _POOL[idx] = [torch.zeros(CAPTURED_COUNTS, dtype=torch.int32, device=device), 0]


def counts(device: torch.device, blocks: int, clean: bool) -> torch.Tensor:
    """``blocks`` zeroed counts for one launch on the current stream (``clean``: a kernel that
    leaves them at zero again)."""
    if not clean:
        return torch.zeros(blocks, dtype=torch.int32, device=device)
    idx = _index(device)
    if torch.cuda.is_current_stream_capturing():
        with _LOCK:
            pool = _POOL.get(idx)
            if pool is not None and pool[1] + blocks <= pool[0].numel():
                pool[1] += blocks
                return pool[0][pool[1] - blocks:pool[1]]
            first = idx not in _WARNED
            _WARNED.add(idx)
        if first:
            warnings.warn(f"the MHC split variant's counts for CUDA-graph capture on cuda:{idx} are "
                          f"{'used up' if pool is not None else 'not set aside'} "
                          f"({CAPTURED_COUNTS} a device); captured calls from here zero theirs with a "
                          "memset (about 1 µs a call). Set layer_boundary_mhc.counts.CAPTURED_COUNTS "
                          "higher before the first call, or call cluster_ops.prepare_cluster before capturing",
                          stacklevel=4)
        return torch.zeros(blocks, dtype=torch.int32, device=device)
    reserve(device)
    key = (idx, torch.cuda.current_stream(device).cuda_stream)
    buf = _EAGER.get(key)
    if buf is None or buf.numel() < blocks:
        # Stream ordered: the launches that used the old buffer come before any reuse of its memory.
        buf = _EAGER[key] = torch.zeros(max(blocks, 2048), dtype=torch.int32, device=device)
    return buf[:blocks]
