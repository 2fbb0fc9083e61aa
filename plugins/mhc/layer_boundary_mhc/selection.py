"""Which kernels an MHC read runs: the Triton kernels on CUDA, the torch reference elsewhere.

``MhcSemantics(kernels=...)``:

=========  ===================================================================================
``auto``   the Triton kernels on NVIDIA GPUs (and under the Triton interpreter) where they serve
           the call (bf16, fp16 or fp32 streams, an RMSNorm-like stage norm, n <= 8), the torch
           reference elsewhere: on ROCm GPUs too, where the kernels have not run (``UNVERIFIED``);
           ``reason()`` says which and why
``triton`` the same, but a call the kernels cannot serve raises with the reason
``torch``  the torch reference always
=========  ===================================================================================

``MhcSemantics(kernel_config=MhcKernelConfig(...))`` sets how the kernels launch (``config``); the
selection carries it to every call.

What can be decided at construction is (triton importable, the norm's kind, n); the rest is a
per-call predicate on the streams (device type and dtype): a model is often built on the CPU and
moved to its GPU afterwards. The Triton module is imported at construction where a CUDA device is
visible (or under ``TRITON_INTERPRET=1``, where the kernels run on CPU tensors), never on a
forward.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from types import ModuleType
from typing import Optional

import torch

from .coefficients import MAX_STREAMS
from .config import DEFAULT_CONFIG, MhcKernelConfig

__all__ = ["KERNEL_MODES", "KernelSelection", "select_kernels", "triton_unavailable"]

KERNEL_MODES = ("auto", "triton", "torch")
# The MHC GPU suite passed in full on an H200 (2026-11-30, third session: eager against the
# reference at T = 1 to 32768, one and two launches bitwise, CUDA-graph replay, torch.compile);
# "auto" runs the kernels on NVIDIA GPUs. Not on ROCm, where they have never run.
UNVERIFIED = ("not the default on ROCm GPUs: the MHC Triton kernels have been verified on NVIDIA GPUs only; "
              "MhcSemantics(kernels='triton') runs them")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _load() -> tuple[Optional[ModuleType], Optional[str]]:
    """``(triton_ops, None)``, or ``(None, why not)``; tried once per process."""
    if importlib.util.find_spec("triton") is None:
        return None, "triton is not installed (pip install triton)"
    try:
        from . import triton_ops
    except Exception as e:  # a triton/torch pair that does not fit, a broken install
        return None, f"triton is not importable ({type(e).__name__}: {e})"
    return triton_ops, None


def triton_unavailable() -> Optional[str]:
    """Why the Triton kernels cannot load here, without importing them (``None``: they may)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    return None


class KernelSelection:
    """A read's kernel choice: ``ops`` (the Triton callables, or ``None``), the device type they
    run on, ``refused``, why they cannot serve this read at all (``None``: they can), and ``config``,
    the kernel settings every call passes on."""

    __slots__ = ("mode", "ops", "device_type", "refused", "config")

    def __init__(self, mode: str, ops: Optional[ModuleType], device_type: str, refused: Optional[str],
                 config: MhcKernelConfig = DEFAULT_CONFIG) -> None:
        self.mode = mode
        self.ops = ops
        self.device_type = device_type
        self.refused = refused
        self.config = config

    def serves(self, x: torch.Tensor) -> bool:
        """The per-call predicate: a few attribute reads."""
        return self.ops is not None and x.device.type == self.device_type and x.dtype in _DTYPES

    def why_not(self, device_type: str, dtype: torch.dtype) -> Optional[str]:
        """Why the Triton kernels do not serve streams of this device type and dtype."""
        if self.mode == "torch":
            return "kernels='torch' asks for the torch reference"
        if self.refused is not None:
            return self.refused
        if device_type != self.device_type:
            return f"the Triton kernels run on {self.device_type} devices only, not {device_type}"
        if dtype not in _DTYPES:
            return (f"{str(dtype).replace('torch.', '')} streams are not supported (bf16, fp16, fp32): "
                    "FP32 accumulation would round them")
        if self.ops is None:
            return "no CUDA device was visible when the model was built, so the Triton kernels were not loaded"
        return None

    def reason(self, device_type: str, dtype: torch.dtype) -> str:
        """``"triton: ..."`` or ``"torch reference: <why not Triton>"`` for streams like these."""
        why = self.why_not(device_type, dtype)
        if why is None:
            return (f"triton: fused read and update kernels ({self.device_type}, "
                    f"{str(dtype).replace('torch.', '')}, FP32 accumulation)")
        return f"torch reference: {why}"

    def refusal(self, x: torch.Tensor) -> str:
        """The error for ``kernels='triton'`` and streams the kernels cannot serve."""
        return (f"MhcSemantics(kernels='triton') cannot run the Triton kernels on these streams: "
                f"{self.why_not(x.device.type, x.dtype)}; use kernels='auto' to fall back to the torch reference")

    def __repr__(self) -> str:
        state = ("unavailable: " + self.refused if self.refused else
                 f"triton on {self.device_type}" if self.ops is not None else "triton not loaded")
        return f"KernelSelection({self.mode}, {state})"


def select_kernels(mode: str, n: int, norm_kind: str, config: MhcKernelConfig = DEFAULT_CONFIG) -> KernelSelection:
    """The choice for one read with ``n`` streams and a stage norm of ``norm_kind`` (``rmsnorm``,
    ``gemma_rmsnorm`` or ``module:<Type>`` for a norm the kernels cannot apply themselves), whose
    kernels launch as ``config`` says.

    ``mode='triton'`` raises here when the kernels cannot serve this read on any device."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels={mode!r}: choose one of {KERNEL_MODES}")
    if not isinstance(config, MhcKernelConfig):
        raise TypeError(f"kernel_config={config!r}: give a layer_boundary_mhc.MhcKernelConfig")
    device_type = "cpu" if _interpreting() else "cuda"
    if mode == "torch":
        return KernelSelection(mode, None, device_type, "kernels='torch' asks for the torch reference", config)
    refused = None
    if n > MAX_STREAMS:
        refused = f"the Triton kernels take at most {MAX_STREAMS} streams, not {n}"
    elif norm_kind.startswith("module:"):
        refused = (f"the stage norm {norm_kind[len('module:'):]} is not an RMSNorm (weight, eps): the fused "
                   "read applies the norm itself")
    ops = None
    on_rocm = torch.version.hip is not None and torch.cuda.is_available()
    if refused is None and mode == "auto" and not _interpreting() and on_rocm:
        refused = UNVERIFIED
    if refused is None and (_interpreting() or torch.cuda.is_available()):
        ops, refused = _load()
    elif refused is None:
        refused = triton_unavailable()
    if mode == "triton" and refused is not None:
        raise ValueError(f"MhcSemantics(kernels='triton'): {refused}; use kernels='auto' to fall back to the "
                         "torch reference")
    if mode == "triton" and ops is None:
        raise ValueError("MhcSemantics(kernels='triton') needs a CUDA device, and torch sees none on this "
                         "machine; use kernels='auto' to fall back to the torch reference")
    return KernelSelection(mode, ops, device_type, refused, config)
