"""Tensors derived from a parameter (phi's splits, the cluster kernel's fragments and FP32 norm
weight), made once per parameter version and shared by the Triton and cluster kernels."""

from __future__ import annotations

import weakref
from typing import Callable

import torch

__all__ = ["derived"]

# (id(parameter), data pointer, kind) -> (weak reference to the parameter, its version counter, the
# derived tensor); the parameter is the base where it is a view (as a compiled graph may pass).
# phi's splits (and the cluster kernel's fragments and FP32 weight) are made once per parameter
# version, not per call: a split is a few elementwise kernels over phi, more than a decode step's
# launch overhead. The TF32 parts hold twice phi's memory (3 MiB a stage at n = 4, C = 4096), the
# bf16 parts 1.5 times (with the padding columns, 2 at n = 4).
_DERIVED: dict[tuple, tuple[weakref.ref, int, torch.Tensor]] = {}


def derived(t: torch.Tensor, kind: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``make()``, computed once per (parameter ``t``, its version, ``kind``)."""
    base = t if t._base is None else t._base
    key = (id(base), t.data_ptr(), kind)
    hit = _DERIVED.get(key)
    if hit is not None and hit[0]() is base and hit[1] == t._version:
        return hit[2]
    value = make()
    # While a CUDA graph is captured the kernels that make it do not run: keep nothing made then.
    if not (t.is_cuda and torch.cuda.is_current_stream_capturing()):
        def forget(_: object, k: tuple = key) -> None:
            _DERIVED.pop(k, None)

        _DERIVED[key] = (weakref.ref(base, forget), t._version, value)
    return value
