"""Norm modules whose parameters a stage read binds: RMSNorm and Gemma RMSNorm.

A stage's read calls a norm-read kernel with ``(weight, eps, weight_offset)`` taken from these
modules, so the module's own ``forward`` is only used outside boundaries. Other modules with a 1-D
``weight`` and an ``eps`` (or ``variance_epsilon``), such as transformers' ``LlamaRMSNorm`` or
``GemmaRMSNorm``, are read the same way once a probe showed what their forward computes:
``x / rms(x) * weight`` (offset 0) or ``* (1 + weight)`` (offset 1). A module that is neither (a
hand-written LayerNorm, a batch norm), or that the probe cannot run, is called as a black box (no
add+norm fusion), with a warning that says so. An engine whose norm's forward cannot run on a CPU
copy declares what it computes instead: a float ``weight_offset`` attribute (0.0 or 1.0) is taken
as is.
"""

from __future__ import annotations

import copy
import warnings
import weakref

import torch
from torch import nn

from ._kernels.reference import rmsnorm_ref

__all__ = ["RMSNorm", "GemmaRMSNorm", "norm_params"]


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight``; weight initialized to ones."""

    weight_offset = 0.0

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"{type(self).__name__}(hidden_size={hidden_size!r}): an int of at least 1")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"{type(self).__name__}(eps={eps!r}): a number of at least 0 (1e-6 is usual)")
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm_ref(x, self.weight, self.eps, weight_offset=self.weight_offset)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GemmaRMSNorm(RMSNorm):
    """``y = x / sqrt(mean(x^2) + eps) * (1 + weight)``; weight initialized to zeros."""

    weight_offset = 1.0

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__(hidden_size, eps, dtype)
        with torch.no_grad():
            self.weight.zero_()

    @property
    def gemma_weight(self) -> torch.Tensor:
        """The stored weight (without the +1), as fused Gemma kernels take it."""
        return self.weight


# Offsets a probe found, per module (weakly held): bound once per stage, looked up again by the
# final norm and the fused finalize's checks.
_PROBED: "weakref.WeakKeyDictionary[nn.Module, float | None]" = weakref.WeakKeyDictionary()
_WARNED: set[type] = set()


def norm_params(norm: nn.Module) -> tuple[torch.Tensor, float, float] | None:
    """``(weight, eps, weight_offset)`` of an RMSNorm-like module, or ``None`` if it is not one."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    torch_rms = type(norm) is nn.RMSNorm
    if torch_rms and eps is None and isinstance(weight, torch.Tensor):
        # torch's default is the epsilon of the dtype it computes in, not of the input's: FP32's for
        # FP16/BF16/FP32 inputs, FP64's for FP64 (the weight's dtype stands for the input's here).
        # BF16's own epsilon (7.8e-3) would swamp the mean square of small activations.
        eps = torch.finfo(torch.float64 if weight.dtype == torch.float64 else torch.float32).eps
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, (int, float)):
        _black_box(norm, "has no 1-D weight and float eps of an RMSNorm")
        return None
    if not weight.is_floating_point():
        # An integer weight (a quantized module's storage, or a load gone wrong) is not what the
        # fused kernels multiply by: the module's own forward decides what it means.
        _black_box(norm, f"keeps its weight as {str(weight.dtype).replace('torch.', '')}, not floating point")
        return None
    if isinstance(norm, (nn.LayerNorm, nn.GroupNorm)) or hasattr(norm, "running_mean"):
        _black_box(norm, "normalizes by its mean and variance, not by the root mean square")
        return None
    declared = 0.0 if torch_rms else getattr(norm, "weight_offset", None)
    if isinstance(declared, (int, float)) and float(declared) in (0.0, 1.0):
        return weight, float(eps), float(declared)
    if norm not in _PROBED:
        _PROBED[norm] = _probe_offset(norm, weight.shape[0], float(eps))
    offset = _PROBED[norm]
    return None if offset is None else (weight, float(eps), offset)


def _probe_offset(norm: nn.Module, hidden: int, eps: float) -> float | None:
    """What ``norm``'s forward computes, found on an FP32 CPU copy with a random weight: the offset
    0 or 1 of ``x / rms(x) * (offset + weight)``, or ``None`` (warned once per class) if neither."""
    try:
        probe = copy.deepcopy(norm)
        meta = any(t.is_meta for t in list(probe.parameters()) + list(probe.buffers()))
        probe = (probe.to_empty(device="cpu") if meta else probe.to("cpu")).float()
        gen = torch.Generator().manual_seed(0)
        w = torch.rand(hidden, generator=gen) + 0.5
        x = torch.randn(3, hidden, generator=gen) * 2.0
        with torch.no_grad():
            getattr(probe, "weight").copy_(w)  # norm_params found a tensor there
            got = probe(x).float()
        for offset in (0.0, 1.0):
            want = rmsnorm_ref(x, w, eps, weight_offset=offset)
            if got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                return offset
        why = "its forward is neither x / rms(x) * weight nor x / rms(x) * (1 + weight)"
    except Exception as e:  # a forward that needs more arguments, a weight it does not own, ...
        why = f"probing its forward failed ({type(e).__name__}: {e})"
    _black_box(norm, f"has a weight and an eps, but {why}", stacklevel=4)
    return None


def _black_box(norm: nn.Module, why: str, stacklevel: int = 3) -> None:
    """Warn, once per class, that stages call ``norm`` as it is: that stage has no fused
    add+norm read, a slower path the engine should know of. ``nn.Identity`` (no norm) is silent."""
    if type(norm) not in _WARNED and not isinstance(norm, nn.Identity):
        _WARNED.add(type(norm))
        warnings.warn(f"norm module {type(norm).__name__} {why}: stages call it as a black box (no fused "
                      "add+norm read)", stacklevel=stacklevel)
    return None
