"""The AITER functions this plugin calls, bound once from the imported ``aiter`` module.

Targets the API of **amd-aiter 0.1.7.post2.dev18** (the release on PyPI, read from its wheel:
``aiter/ops/rmsnorm.py``, ``aiter/ops/custom_all_reduce.py``,
``aiter/dist/device_communicators/custom_all_reduce.py`` and the C++ sources under
``aiter_meta/csrc`` it ships). AITER's Python API changes between releases (later sources add
``gemma_norm`` as the 7th positional argument of ``rmsnorm2d_fwd_with_add`` and rework the
custom all-reduce), so every call here passes only the arguments that release documents, and
never the optional ones positionally.

What the plugin relies on, per function of that release:

* ``rmsnorm2d_fwd(input, weight, epsilon)`` -> Tensor: CK kernel, fp16/bf16 only; ``input`` is
  [m, n] with unit last stride (the row stride is read from ``stride(0)``); ``weight`` is [n] of
  the input dtype; ``out`` is allocated by AITER.
* ``rmsnorm2d_fwd_with_add(out, input, residual_in, residual_out, weight, epsilon)``:
  ``s = input + residual_in`` in FP32, ``residual_out = s`` rounded, ``out = rmsnorm(s)``; the
  four [m, n] tensors share one dtype.
* ``rmsnorm2d_fwd_with_dynamicquant(out, input, yscale, weight, epsilon)`` and
  ``rmsnorm2d_fwd_with_add_dynamicquant(out, input, residual_in, residual_out, yscale, weight,
  epsilon)``: per-token ``yscale`` [m, 1] FP32 = amax / max of the ``out`` dtype, no floor.
* ``dtypes.fp8``: the FP8 type of this GPU, ``float8_e4m3fnuz`` on gfx942 (MI300),
  ``float8_e4m3fn`` on gfx950.
* ``CustomAllreduce(group, device, max_size)`` in ``aiter.dist.device_communicators.
  custom_all_reduce``: ``group`` must not be an NCCL/RCCL group (IPC handles travel over it);
  2, 4, 6 or 8 ranks on one node; it sets ``disabled`` instead of raising.
* ``CustomAllreduce.all_reduce(inp, *, out=None, registered=False)``: out of place; with
  ``registered=False`` it copies ``inp`` (read as one flat span) into its IPC buffer first,
  which is graph-safe; fp32/fp16/bf16; a byte size that is a multiple of 16 and at most
  ``max_size``; sums in FP32 and rounds once.

Importing ``aiter.dist.device_communicators.custom_all_reduce`` loads (and on first use JIT
builds) AITER's all-reduce library, so it is imported only when a fused candidate is first
considered, never by the norm kernels.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
from typing import Any, Callable, Optional

__all__ = ["TARGET_VERSION", "CUSTOM_AR_MODULE", "AiterApi"]

TARGET_VERSION = "0.1.7.post2.dev18"
CUSTOM_AR_MODULE = "aiter.dist.device_communicators.custom_all_reduce"

_NORM = ("rmsnorm2d_fwd", "rmsnorm2d_fwd_with_add")
_FP8 = ("rmsnorm2d_fwd_with_dynamicquant", "rmsnorm2d_fwd_with_add_dynamicquant")


class AiterApi:
    """The bound AITER callables (``None`` where the installed version lacks one)."""

    def __init__(self, module: Any, version: str,
                 import_module: Callable[[str], Any] = importlib.import_module) -> None:
        self.module = module
        self.version = version
        self.rmsnorm = getattr(module, "rmsnorm2d_fwd", None)
        self.add_rmsnorm = getattr(module, "rmsnorm2d_fwd_with_add", None)
        self.rmsnorm_fp8 = getattr(module, "rmsnorm2d_fwd_with_dynamicquant", None)
        self.add_rmsnorm_fp8 = getattr(module, "rmsnorm2d_fwd_with_add_dynamicquant", None)
        self.fp8_dtype = getattr(getattr(module, "dtypes", None), "fp8", None)
        self._import = import_module
        self._custom_ar: Any = None

    @classmethod
    def load(cls) -> "AiterApi":
        """Import ``aiter`` (the probe has already imported it once, so this is cheap)."""
        module = importlib.import_module("aiter")
        return cls(module, _installed_version(module))

    @property
    def label(self) -> str:
        return f"amd-aiter {self.version}"

    def missing(self, names: tuple[str, ...]) -> Optional[str]:
        gone = [n for n in names if getattr(self.module, n, None) is None]
        if not gone:
            return None
        return (f"{self.label} has no {', '.join('aiter.' + n for n in gone)} (this plugin targets the "
                f"API of amd-aiter {TARGET_VERSION})")

    def missing_norm(self) -> Optional[str]:
        return self.missing(_NORM)

    def missing_fp8(self) -> Optional[str]:
        return self.missing(_FP8)

    def custom_allreduce(self) -> Any:
        """AITER's custom all-reduce module (imported on first use; raises what AITER raises)."""
        if self._custom_ar is None:
            self._custom_ar = self._import(CUSTOM_AR_MODULE)
        return self._custom_ar

    def custom_allreduce_missing(self) -> Optional[str]:
        """Why AITER's custom all-reduce cannot be used in this process, or ``None``."""
        try:
            mod = self.custom_allreduce()
        except Exception as e:  # AITER raises RuntimeError, not ImportError, without ROCm
            text = str(e).strip().splitlines()
            return (f"importing {CUSTOM_AR_MODULE} from {self.label} raised {type(e).__name__}"
                    + (f": {text[0][:200]}" if text else ""))
        if getattr(mod, "CustomAllreduce", None) is None:
            return f"{self.label} has no {CUSTOM_AR_MODULE}.CustomAllreduce"
        # The module sets custom_ar = False (and logs a warning) when its library does not load.
        if not getattr(mod, "custom_ar", False):
            return (f"AITER's custom all-reduce library did not load in this process ({self.label}; "
                    "aiter logged why: 'Custom allreduce is disabled')")
        return None

    def __repr__(self) -> str:
        return f"AiterApi({self.label})"


def _installed_version(module: Any) -> str:
    try:
        return md.version("amd-aiter")
    except md.PackageNotFoundError:
        return str(getattr(module, "__version__", "unknown"))
