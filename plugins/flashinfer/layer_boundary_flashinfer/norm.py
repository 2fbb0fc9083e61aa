"""FlashInfer's RMSNorm kernels as a ``NormKernelProvider`` (plain and Gemma, with the fused add).

    rmsnorm:            y = x / sqrt(mean(x^2) + eps) * (w + offset)          x, y: [T, H]; w: [H]
    fused_add_rmsnorm:  s = x + r in FP32;  r' = s rounded;  y = rmsnorm(s)  offset 0, or 1 (Gemma)

The wrappers have the torch references' signatures (``layer_boundary._kernels.reference``). What
they rely on, read in FlashInfer 0.7.2's sources (``flashinfer/norm``, ``csrc/norm.cu``,
``include/flashinfer/norm.cuh``):

* Only bf16 and fp16 are dispatched, and the weight and the residual are read as the input's
  dtype, so all three must share it; FP32 and FP64 requests are refused.
* ``fused_add_rmsnorm(input, residual, weight, eps)`` (and the Gemma form) returns nothing: it
  stores the rounded sum into ``residual`` and the normalized rows into ``input``. It normalizes
  the FP32 sum it keeps in shared memory (4·H bytes a row), not the rounded residual, which is the
  reference's rounding order. ``rmsnorm`` writes into a separate ``out``.
* A launch runs one block per row; zero rows is an invalid launch, so empty batches stop here.
* Tensors reach the kernels through DLPack, which refuses tensors that require grad (a norm's
  ``Parameter`` does, also under ``inference_mode``): the weight is passed detached.
* Rows move in vectors of gcd(16, H·bytes) bytes: the last dimension must be contiguous and
  every row start aligned to that many bytes. Anything else takes the torch reference (with one
  warning), never a misaligned kernel access.
* The FP8 outputs (``rmsnorm_quant``, ``fused_add_rmsnorm_quant``) take one static per-tensor
  scale, and ``fused_add_rmsnorm_fp8_block_quant`` scales 1x128 blocks of the bf16-rounded
  output: neither is the per-token dynamic e4m3 that ``quant="fp8_e4m3"`` defines, so those
  requests are refused rather than served with other numbers.

The contribution ``x`` of ``fused_add_rmsnorm`` is never overwritten unless the caller asks for
it with ``out=x``; by default it is copied into a fresh output buffer first, which the FlashInfer
kernel then normalizes in place. A caller that owns ``x`` (the boundary's read owns a contribution
it consumed from the residual stream: nothing reads it afterwards) passes ``out=x`` and saves the
copy. The residual is updated in place (``residual_in_place=True``), or in ``residual_out`` when
one is given.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from layer_boundary.plugin_api import (
    check_rows,
    cuda_half_norm_refusal,
    FallbackNotice,
    fused_add_rmsnorm_ref,
    kernel_op,
    NormKernels,
    NormRequest,
    rmsnorm_ref,
)

__all__ = ["FlashInferNormProvider", "FP8_REFUSAL", "flashinfer_kernels"]


DTYPES = (torch.bfloat16, torch.float16)

FP8_REFUSAL = (
    "FlashInfer 0.7.2 has no per-token dynamic FP8 norm output: rmsnorm_quant and "
    "fused_add_rmsnorm_quant take one static per-tensor scale, and "
    "fused_add_rmsnorm_fp8_block_quant scales 1x128 blocks of the bf16-rounded output"
)

_FUNCTIONS = ("rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm", "gemma_fused_add_rmsnorm")


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _fits(t: torch.Tensor, dtype: torch.dtype, hidden: int) -> bool:
    """``t`` is [T, hidden] rows of ``dtype`` the kernels' vector loads can read where they are."""
    if t.dim() != 2 or t.dtype is not dtype or t.shape[1] != hidden or t.stride(1) != 1:
        return False
    align = math.gcd(16, hidden * t.element_size())
    return t.data_ptr() % align == 0 and (t.stride(0) * t.element_size()) % align == 0


def _weight_fits(weight: torch.Tensor, x: torch.Tensor) -> bool:
    return (x.dtype in DTYPES and weight.dtype is x.dtype and weight.dim() == 1
            and weight.shape[0] == x.shape[-1] and weight.stride(0) == 1
            and weight.data_ptr() % math.gcd(16, x.shape[-1] * x.element_size()) == 0)


class _Library:
    """What a kernel table calls: FlashInfer's functions by weight offset, and its fallback notice."""

    __slots__ = ("plain", "fused", "fall_back")

    def __init__(self, fi: Any) -> None:
        self.plain = {0.0: fi.rmsnorm, 1.0: fi.gemma_rmsnorm}
        self.fused = {0.0: fi.fused_add_rmsnorm, 1.0: fi.gemma_fused_add_rmsnorm}
        self.fall_back = FallbackNotice("flashinfer")  # correct but slower: said once per cause


# The libraries kernel tables call, by index: the operators below take no Python object. One entry
# per table (a provider makes one); kept for the process's life, as FlashInfer keeps its modules.
_LIBRARIES: list[_Library] = []


def _rmsnorm_into(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float, out: torch.Tensor,
                  library: int) -> None:
    """``out = rmsnorm(x)`` by FlashInfer where it takes the tensors, else by the torch reference.
    Its checks read data pointers (alignment), which is why it is an operator as a whole."""
    lib = _LIBRARIES[library]
    fn = lib.plain.get(weight_offset)
    if fn is None or not _weight_fits(weight, x) or not _fits(x, x.dtype, x.shape[-1]) \
            or not _fits(out, x.dtype, x.shape[-1]) or out.shape != x.shape:
        lib.fall_back("rmsnorm", _why_not(x, weight, weight_offset, out=out))
        rmsnorm_ref(x, weight, eps, weight_offset=weight_offset, out=out)
        return
    if x.shape[0]:
        fn(x, weight.detach() if weight.requires_grad else weight, eps, out=out)


def _fused_add_rmsnorm_into(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            weight_offset: float, out: torch.Tensor, residual_out: Optional[torch.Tensor],
                            library: int) -> None:
    """``out, residual_out (default: residual) = fused_add_rmsnorm(x, residual)``; ``out`` may be x."""
    lib = _LIBRARIES[library]
    dest = residual if residual_out is None else residual_out
    fn = lib.fused.get(weight_offset)
    hidden = x.shape[-1]
    ok = (fn is not None and x.dim() == 2 and _weight_fits(weight, x) and residual.dtype is x.dtype
          and _fits(dest, x.dtype, hidden)
          and (_fits(x, x.dtype, hidden) if out is x else _fits(out, x.dtype, hidden) and out.shape == x.shape))
    if not ok:
        lib.fall_back("fused_add_rmsnorm", _why_not(x, weight, weight_offset, residual=dest, out=out))
        fused_add_rmsnorm_ref(x, residual, weight, eps, weight_offset=weight_offset, out=out, residual_out=dest)
        return
    assert fn is not None  # ok above
    if dest is not residual:
        dest.copy_(residual)
    # FlashInfer normalizes into the tensor it adds from: out holds a copy of x unless the caller
    # handed x over (out=x).
    if out is not x:
        out.copy_(x)
    if x.shape[0]:
        fn(out, dest, weight.detach() if weight.requires_grad else weight, eps)


# Under torch.compile the whole call, checks and fallback included, is one opaque operator.
kernel_op("rmsnorm", _rmsnorm_into, mutates=("out",))
kernel_op("fused_add_rmsnorm", _fused_add_rmsnorm_into, mutates=("residual", "out", "residual_out"))


def flashinfer_kernels(fi: Any) -> NormKernels:
    """The kernel table over a module holding FlashInfer's four norm functions (``flashinfer``
    itself, or a test double with the same functions)."""
    library = len(_LIBRARIES)
    _LIBRARIES.append(_Library(fi))

    def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, weight_offset: float = 0.0,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.dim() == 2 and x.stride(1) != 1:
            x = x.contiguous()  # a read-only input may be copied; the kernel reads whole rows
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _rmsnorm_into(x, weight, eps, float(weight_offset), out, library)
        return out

    def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                          weight_offset: float = 0.0, out: Optional[torch.Tensor] = None,
                          residual_out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        check_rows(x, residual)
        if residual_out is residual:
            residual_out = None  # in place: the operator may not take one tensor as two written arguments
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _fused_add_rmsnorm_into(x, residual, weight, eps, float(weight_offset), out, residual_out, library)
        return out, residual if residual_out is None else residual_out

    return NormKernels("flashinfer", rmsnorm, fused_add_rmsnorm, residual_in_place=True, input_as_out=True)


def _why_not(x: torch.Tensor, weight: torch.Tensor, offset: float, *, residual: Optional[torch.Tensor] = None,
             out: Optional[torch.Tensor] = None) -> str:
    if offset not in (0.0, 1.0):
        return f"weight offset {offset} has no FlashInfer kernel (plain 0 and Gemma 1 only)"
    if x.dim() != 2:
        return f"{x.dim()}-D input; the kernels take [T, H] rows"
    if x.dtype not in DTYPES:
        return f"{_short(x.dtype)} input; FlashInfer's norm kernels take bf16 or fp16"
    for what, t in (("weight", weight), ("residual", residual)):
        if t is not None and t.dtype is not x.dtype:
            return f"{what} is {_short(t.dtype)} but the input is {_short(x.dtype)}; the kernel reads both as one dtype"
    return ("a tensor's rows are not contiguous in their last dimension or not aligned to "
            f"{math.gcd(16, x.shape[-1] * x.element_size())} bytes (or out= does not match the input)")


class FlashInferNormProvider:
    """FlashInfer's RMSNorm, Gemma RMSNorm and fused add + (Gemma) RMSNorm on CUDA, bf16 and fp16.

    ``refuse(request)`` answers from the request and whether FlashInfer imports here (tried once
    per provider, at construction time, never per forward).
    """

    name = "flashinfer"
    device_type = "cuda"
    # The fused kernel keeps the FP32 row in shared memory (4·H bytes, at most 227 KiB a block on
    # Hopper, 163 KiB on A100): well inside for every hidden size up to this one.
    max_hidden = 32768
    # FP32 accumulation in another order (a block tree) with an approximate rsqrt: a few FP32 ulps
    # before the single rounding of the output, so one ulp of a 16-bit output.
    tolerance = {torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}

    def __init__(self) -> None:
        self._library: Any = None  # the flashinfer module, or why it cannot load
        self._kernels: Optional[NormKernels] = None

    def refuse(self, request: NormRequest) -> Optional[str]:
        why = cuda_half_norm_refusal(request, takes="FlashInfer's norm kernels take", fp8_refusal=FP8_REFUSAL,
                                     offers="FlashInfer has RMSNorm (offset 0) and Gemma RMSNorm (offset 1)")
        if why is not None:
            return why
        if request.hidden_size > self.max_hidden:
            return (f"hidden size {request.hidden_size} is over {self.max_hidden}: the fused kernel "
                    "keeps a row in shared memory")
        lib = self._load()
        return lib if isinstance(lib, str) else None

    def kernels(self, request: NormRequest) -> NormKernels:
        why = self.refuse(request)
        if why is not None:
            raise ValueError(f"{self.name} cannot serve {request.describe()}: {why}")
        if self._kernels is None:
            self._kernels = flashinfer_kernels(self._load())
        return self._kernels

    def _load(self) -> Any:
        if self._library is None:
            self._library = _import_norm()
        return self._library


def _import_norm() -> Any:
    """``flashinfer`` with its norm functions, or the reason it cannot be used here."""
    try:
        import flashinfer
    except Exception as e:  # ImportError, or a CUDA/torch mismatch raised while importing
        return f"flashinfer is not importable ({type(e).__name__}: {e}); pip install flashinfer-python"
    missing = [f for f in _FUNCTIONS if not callable(getattr(flashinfer, f, None))]
    if missing:
        version = getattr(flashinfer, "__version__", "unknown")
        return f"flashinfer {version} lacks {', '.join(missing)}; install flashinfer-python 0.7.2 or newer"
    # Compile (or load from FlashInfer's cache) the CUDA norm kernels now, at construction: not in
    # the first forward, perhaps inside a CUDA-graph capture, and a failure is a refusal here.
    build = getattr(getattr(flashinfer, "norm", None), "get_norm_module", None)
    if build is not None and torch.cuda.is_available():
        try:
            build()
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            return (f"FlashInfer could not build its norm kernels here ({type(e).__name__}: {first}); "
                    "they compile with nvcc on first use (CUDA_HOME)")
    return flashinfer
