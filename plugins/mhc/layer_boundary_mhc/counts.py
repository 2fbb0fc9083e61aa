"""Where a launch of the split variant gets its ready counts (one int32 a block).

A launch's 16 stream CTAs of a block take its count from 0 to 16, and its finishers wait for 16.
The counts come from a buffer kept from launch to launch (``SplitShape.kept``): ``[phase, arrivals,
-, -, counts[0][cap], counts[1][cap]]``. A launch takes the half its phase names and zeroes the
other (the launch before's); its last CTA flips the phase once every CTA has read it. That saves
the memset of counts zeroed per call (1.2 to 1.3 µs of an H200 call; that form was removed).

Such a buffer must never serve two launches at once:

- eager calls: one buffer a (device, stream, capacity), since launches on a stream run one after
  another;
- calls captured in a CUDA graph: a slice of a pool set aside outside the capture, each captured
  call its own for the life of the process. Two graphs may be replayed at once on two streams
  (two-batch overlap), and a slice is not told when its graph is freed. Its size is
  ``MhcKernelConfig.split_captured_words`` (one pool a device and size). With the pool used up,
  captured calls take zeroed counts again (a memset node in the graph), with a warning.
"""

from __future__ import annotations

import threading
import warnings
from typing import Optional

import torch

_HEAD = 4  # phase, arrivals, two words to keep the counts 16-byte aligned
_EAGER: dict[tuple[int, int, int], torch.Tensor] = {}
_POOL: dict[tuple[int, int], list] = {}  # (device index, pool words) -> [words, how many handed out]
_WARNED: set[tuple[int, int]] = set()
_LOCK = threading.Lock()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def capacity(blocks: int) -> int:
    """Counts a half of a kept buffer for ``blocks`` blocks: a power of two, so that eager calls of
    nearby sizes share a buffer."""
    return max(64, 1 << (blocks - 1).bit_length())


def reserve(device: torch.device, pool_words: int) -> None:
    """Set aside a pool of ``pool_words`` for captured calls on ``device`` (outside any capture, once;
    a capture starts with a device synchronize, so the zeros are in place before any replay)."""
    key = (_index(device), pool_words)
    with _LOCK:
        if key not in _POOL and not torch.cuda.is_current_stream_capturing():
            _POOL[key] = [torch.zeros(pool_words, dtype=torch.int32, device=device), 0]


def counts(device: torch.device, blocks: int, pool_words: int,
           stream: Optional[int] = None) -> tuple[torch.Tensor, int]:
    """The counts for one launch of ``blocks`` blocks on the current stream (``stream``: its handle,
    where the caller has it already), and the capacity of the buffer's half; captured calls take
    theirs from the pool of ``pool_words`` (``MhcKernelConfig.split_captured_words``)."""
    idx, cap = _index(device), capacity(blocks)
    words = _HEAD + 2 * cap
    if torch.cuda.is_current_stream_capturing():
        pool_key = (idx, pool_words)
        with _LOCK:
            pool = _POOL.get(pool_key)
            if pool is not None and pool[1] + words <= pool[0].numel():
                pool[1] += words
                return pool[0][pool[1] - words:pool[1]], cap
            first = pool_key not in _WARNED
            _WARNED.add(pool_key)
        if first:
            warnings.warn(f"the MHC split variant's counts set aside for CUDA-graph capture on cuda:{idx} are "
                          f"{'used up' if pool is not None else 'missing'} ({pool_words} words a device); "
                          "captured calls from here zero theirs with a memset (about 1.3 µs a call). Give "
                          "MhcKernelConfig(split_captured_words=...) more, or call "
                          "cluster_ops.prepare_cluster before capturing", stacklevel=4)
        # The kept layout, zeroed in the graph: the kernel was compiled for it.
        return torch.zeros(words, dtype=torch.int32, device=device), cap
    if (idx, pool_words) not in _POOL:
        reserve(device, pool_words)
    key = (idx, torch.cuda.current_stream(device).cuda_stream if stream is None else stream, cap)
    buf = _EAGER.get(key)
    if buf is None:
        buf = _EAGER[key] = torch.zeros(words, dtype=torch.int32, device=device)
    return buf, cap
