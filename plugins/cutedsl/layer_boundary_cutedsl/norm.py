"""The CuTe DSL add + RMSNorm kernel as a ``NormKernelProvider`` (plain and Gemma, with the fused add).

    rmsnorm:            y = x / sqrt(mean(x^2) + eps) * (w + offset)          x, y: [T, H]; w: [H]
    fused_add_rmsnorm:  s = x + r in FP32;  r' = s rounded;  y = rmsnorm(s)  offset 0, or 1 (Gemma)

The wrappers have the torch references' signatures (``layer_boundary._kernels.reference``). The
kernel (``layer_boundary_cutedsl.kernel``) is compiled ahead of time once per (H, dtype, offset),
when ``kernels(request)`` is first asked for it at model construction, never in a forward; on a
GPU it is also launched once there, so the CUDA module is loaded before any graph capture.

What the kernel needs, and what the wrappers therefore check on every call:

* bf16 or fp16 rows, the weight and the residual in the input's dtype;
* H a multiple of 256 (whole 128-bit vectors over full warps) and at most 32768 (the FP32 row
  lives in registers between the two passes);
* [T, H] tensors with a contiguous last dimension, every base pointer 16-byte aligned and row
  strides a multiple of 8 elements (the kernel issues 128-bit accesses only).

A call that breaks one of these takes the torch reference (with one warning per cause); a
request that cannot be served is refused at construction with the reason. The residual is
updated in place (``residual_in_place=True``), or in ``residual_out`` when one is given; the
normalized rows go to a separate buffer (``out``, or a fresh one).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

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

from .shape import MAX_PER_THREAD, VEC, launch_shape

__all__ = ["CuTeDSLNormProvider", "FP8_REFUSAL", "cutedsl_kernels", "import_cutlass"]


DTYPES = (torch.bfloat16, torch.float16)
MAX_HIDDEN = 256 * MAX_PER_THREAD * VEC

FP8_REFUSAL = ("the CuTe DSL kernel has no per-token FP8 e4m3 output yet; it writes the normalized "
               "rows in the activation dtype")

Compiled = Callable[..., Any]


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _rows_fit(t: torch.Tensor, dtype: torch.dtype, hidden: int) -> bool:
    return (t.dim() == 2 and t.dtype is dtype and t.shape[1] == hidden and t.stride(1) == 1
            and t.data_ptr() % 16 == 0 and t.stride(0) % VEC == 0)


def _weight_fits(w: torch.Tensor, dtype: torch.dtype, hidden: int) -> bool:
    return (w.dtype is dtype and w.dim() == 1 and w.shape[0] == hidden and w.stride(0) == 1
            and w.data_ptr() % 16 == 0)


class _Table:
    """What one kernel table calls: its two compiled variants, the launcher and its notice."""

    __slots__ = ("hidden", "dtype", "offset", "plain", "fused", "run", "fall_back")

    def __init__(self, hidden: int, dtype: torch.dtype, offset: float, plain: Compiled, fused: Compiled,
                 run: Callable[..., None]) -> None:
        self.hidden, self.dtype, self.offset = hidden, dtype, offset
        self.plain, self.fused, self.run = plain, fused, run
        self.fall_back = FallbackNotice("cutedsl")  # correct but slower: said once per cause


# The tables by index: the operators below take no Python object. One per (H, dtype, offset) a
# provider builds; kept for the process's life, as the compiled CUDA modules are.
_TABLES: list[_Table] = []


def _rmsnorm_into(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float, out: torch.Tensor,
                  table: int) -> None:
    """``out = rmsnorm(x)`` by the compiled kernel where it takes the tensors, else by the torch
    reference. Its checks read data pointers (alignment): an operator as a whole."""
    t = _TABLES[table]
    why = _why_not(x, weight, weight_offset, t.hidden, t.dtype, want_offset=t.offset)
    if why is None and not (_rows_fit(out, t.dtype, t.hidden) and out.shape == x.shape):
        why = "out= is not [T, H] rows like the input (contiguous last dimension, 16-byte aligned)"
    if why is not None:
        t.fall_back("rmsnorm", why)
        rmsnorm_ref(x, weight, eps, weight_offset=weight_offset, out=out)
    elif x.shape[0]:  # zero rows would be an empty grid, an invalid launch
        t.run(t.plain, x, x, weight, out, eps)


def _fused_add_rmsnorm_into(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            weight_offset: float, out: torch.Tensor, residual_out: Optional[torch.Tensor],
                            table: int) -> None:
    """``out, residual_out (default: residual) = fused_add_rmsnorm(x, residual)``; ``out`` may be x."""
    t = _TABLES[table]
    dest = residual if residual_out is None else residual_out
    why = _why_not(x, weight, weight_offset, t.hidden, t.dtype, want_offset=t.offset)
    if why is None and not (_rows_fit(residual, t.dtype, t.hidden) and _rows_fit(dest, t.dtype, t.hidden)
                            and dest.shape == x.shape):
        why = "the residual is not [T, H] rows of the input's dtype (contiguous last dimension, 16-byte aligned)"
    if why is None and not (_rows_fit(out, t.dtype, t.hidden) and out.shape == x.shape):
        why = "out= is not [T, H] rows like the input (contiguous last dimension, 16-byte aligned)"
    if why is not None:
        t.fall_back("fused_add_rmsnorm", why)
        fused_add_rmsnorm_ref(x, residual, weight, eps, weight_offset=weight_offset, out=out, residual_out=dest)
        return
    if dest is not residual:
        dest.copy_(residual)
    if x.shape[0]:
        # out may be x itself: each thread reads its vectors of x before it writes them.
        t.run(t.fused, x, dest, weight, out, eps)


# Under torch.compile each call, checks and fallback included, is one opaque operator.
kernel_op("rmsnorm", _rmsnorm_into, mutates=("out",))
kernel_op("fused_add_rmsnorm", _fused_add_rmsnorm_into, mutates=("residual", "out", "residual_out"))


def cutedsl_kernels(hidden: int, dtype: torch.dtype, weight_offset: float, plain: Compiled,
                    fused: Compiled, launch: Optional[Callable[..., None]] = None) -> NormKernels:
    """The kernel table over two compiled variants (plain and fused) for one (H, dtype, offset).

    ``launch(compiled, x, r, w, y, eps)`` runs a compiled variant on torch tensors; the default
    passes raw pointers and the current stream (tests pass a double).
    """
    table = len(_TABLES)
    _TABLES.append(_Table(hidden, dtype, float(weight_offset), plain, fused, launch or _launch))

    def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, weight_offset: float = 0.0,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _rmsnorm_into(x, weight, eps, float(weight_offset), out, table)
        return out

    def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                          weight_offset: float = 0.0, out: Optional[torch.Tensor] = None,
                          residual_out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        check_rows(x, residual)
        if residual_out is residual:
            residual_out = None  # in place: the operator may not take one tensor as two written arguments
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _fused_add_rmsnorm_into(x, residual, weight, eps, float(weight_offset), out, residual_out, table)
        return out, residual if residual_out is None else residual_out

    return NormKernels("cutedsl", rmsnorm, fused_add_rmsnorm, residual_in_place=True)


def _why_not(x: torch.Tensor, weight: torch.Tensor, offset: float, hidden: int, dtype: torch.dtype, *,
             want_offset: float) -> Optional[str]:
    if float(offset) != want_offset:
        return f"weight offset {offset} was not compiled here (this table serves offset {want_offset})"
    if x.dim() != 2 or x.shape[-1] != hidden:
        return f"input of shape {tuple(x.shape)}; this table's kernel takes [T, {hidden}] rows"
    if x.dtype is not dtype:
        return f"{_short(x.dtype)} input; this table's kernel was compiled for {_short(dtype)}"
    if not _weight_fits(weight, dtype, hidden):
        return (f"weight is {_short(weight.dtype)} {tuple(weight.shape)}; the kernel reads a contiguous, "
                f"16-byte aligned [{hidden}] weight of the input's dtype")
    if not _rows_fit(x, dtype, hidden):
        return ("input rows are not contiguous in their last dimension, 16-byte aligned, with a row "
                f"stride a multiple of {VEC} elements")
    return None


def _launch(compiled: Compiled, x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, y: torch.Tensor,
            eps: float, tw: Optional[torch.Tensor] = None, sh: Optional[torch.Tensor] = None) -> None:
    """Run a compiled variant on torch tensors, on the current stream. With ``tw`` (a finalize
    variant), ``x`` is ``[T, k, H]`` expert rows and ``sh`` the optional shared-expert rows."""
    from cuda.bindings import driver as cuda
    from cutlass.cute.runtime import make_ptr

    from .kernel import CUTLASS_DTYPES

    el = CUTLASS_DTYPES[_short(r.dtype)]

    def ptr(t: torch.Tensor, align: int = 16) -> Any:
        import cutlass.cute as cute
        return make_ptr(el, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)

    stream = cuda.CUstream(torch.cuda.current_stream(x.device).cuda_stream)
    k_stride = x.stride(1) if tw is not None else 0
    # Without a finalize the router-weight and shared pointers are never read: x stands in.
    tw_t, sh_t = (tw if tw is not None else x), (sh if sh is not None else x)
    # The launch goes to the current stream, so a CUDA-graph capture on that stream records it.
    with torch.cuda.device(x.device):
        compiled(ptr(x), ptr(r), ptr(w), ptr(y), ptr(tw_t, r.element_size()), ptr(sh_t), r.shape[0],
                 x.stride(0), k_stride, r.stride(0), y.stride(0), tw_t.stride(0), sh_t.stride(0), float(eps),
                 stream)


class CuTeDSLNormProvider:
    """The CuTe DSL RMSNorm, Gemma RMSNorm and fused add + (Gemma) RMSNorm on Hopper, bf16 and fp16.

    ``refuse(request)`` answers from the request, the device's compute capability and whether
    ``cutlass`` imports here (tried once per provider, never per forward).
    """

    name = "cutedsl"
    device_type = "cuda"
    min_capability = (9, 0)
    # FP32 accumulation in another order (per-thread, then a butterfly and a warp tree) and the
    # approximate rsqrt: a few FP32 ulps before the single rounding, so one ulp of the 16-bit output.
    tolerance = {torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}

    def __init__(self, *, capability: Optional[Callable[[], Optional[tuple[int, int]]]] = None,
                 compiler: Optional[Callable[..., Compiled]] = None,
                 launch: Optional[Callable[..., None]] = None) -> None:
        # Seams for CPU tests: the device's capability, the compiler and the launcher.
        self._capability = capability or _cuda_capability
        self._compiler = compiler
        self._launch = launch
        self._library: Any = None  # the cutlass module, or why it cannot load
        self._tables: dict[tuple[int, torch.dtype, float], NormKernels] = {}
        self._failed: dict[tuple[int, torch.dtype, float], str] = {}

    def refuse(self, request: NormRequest) -> Optional[str]:
        why = cuda_half_norm_refusal(request, takes="the CuTe DSL kernel takes", fp8_refusal=FP8_REFUSAL,
                                     offers="RMSNorm (offset 0) and Gemma RMSNorm (offset 1) only")
        if why is not None:
            return why
        h = request.hidden_size
        if h > MAX_HIDDEN:
            return f"hidden size {h} is over {MAX_HIDDEN}: the kernel keeps a row's FP32 sum in registers"
        if launch_shape(h) is None:
            return (f"hidden size {h} is not a multiple of {32 * VEC}: the kernel gives every thread of "
                    "full warps whole 128-bit vectors")
        cap = self._capability()
        if cap is None:
            return "no CUDA device is visible"
        if tuple(cap) < self.min_capability:
            return f"needs Hopper (sm_90) or newer; this device is sm_{cap[0]}{cap[1]}"
        lib = self._load()
        if isinstance(lib, str):
            return lib
        # Build (and, on a GPU, check against the torch reference) at selection: a kernel that
        # does not compile or computes something else is a refusal, never a wrong forward.
        key = (h, request.dtype, float(request.weight_offset))
        if key not in self._tables and key not in self._failed:
            try:
                self._tables[key] = self._build(*key)
            except Exception as e:
                first = (str(e).strip().splitlines() or [""])[0]
                self._failed[key] = f"the CuTe DSL kernel failed its build check ({type(e).__name__}: {first})"
        return self._failed.get(key)

    def kernels(self, request: NormRequest) -> NormKernels:
        why = self.refuse(request)
        if why is not None:
            raise ValueError(f"{self.name} cannot serve {request.describe()}: {why}")
        key = (request.hidden_size, request.dtype, float(request.weight_offset))
        table = self._tables.get(key)
        if table is None:
            table = self._build(*key)
            self._tables[key] = table
        return table

    def _build(self, hidden: int, dtype: torch.dtype, offset: float) -> NormKernels:
        compile_fn = self._compiler or load_compiler()
        plain = compile_fn(hidden, _short(dtype), offset, False)
        fused = compile_fn(hidden, _short(dtype), offset, True)
        table = cutedsl_kernels(hidden, dtype, offset, plain, fused, self._launch)
        if self._launch is None and torch.cuda.is_available():
            # Launching now loads the CUDA module (no first call does it inside a graph capture),
            # and compares the kernel with the torch reference before any model relies on it.
            _self_check(table, hidden, dtype, offset, self.tolerance[dtype])
        return table

    def _load(self) -> Any:
        if self._library is None:
            self._library = import_cutlass()
        return self._library


def _self_check(table: NormKernels, hidden: int, dtype: torch.dtype, offset: float,
                tol: tuple[float, float]) -> None:
    from layer_boundary.plugin_api import check_rows, fused_add_rmsnorm_ref, rmsnorm_ref

    g = torch.Generator(device="cuda").manual_seed(hidden)
    x = torch.randn(5, hidden, generator=g, device="cuda").to(dtype)
    r = torch.randn(5, hidden, generator=g, device="cuda").to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g, device="cuda")).to(dtype)
    want_y, want_r = fused_add_rmsnorm_ref(x, r, w, 1e-6, weight_offset=offset)
    got_y, got_r = table.fused_add_rmsnorm(x.clone(), r.clone(), w, 1e-6, weight_offset=offset)
    want_p = rmsnorm_ref(x, w, 1e-6, weight_offset=offset)
    got_p = table.rmsnorm(x, w, 1e-6, weight_offset=offset)
    torch.cuda.synchronize()
    for what, got, want in (("add+rmsnorm", got_y, want_y), ("residual", got_r, want_r), ("rmsnorm", got_p, want_p)):
        if not isinstance(got, torch.Tensor):  # an unquantized table returns tensors
            raise RuntimeError(f"{what} returned {type(got).__name__}, not a tensor (H={hidden})")
        if not torch.allclose(got.float(), want.float(), atol=tol[0], rtol=tol[1]):
            diff = (got.float() - want.float()).abs().max().item()
            raise RuntimeError(f"{what} disagrees with the torch reference (H={hidden}, "
                               f"{str(dtype).replace('torch.', '')}, max |diff| {diff:.3g})")


def _cuda_capability() -> Optional[tuple[int, int]]:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def load_compiler() -> Callable[..., Any]:
    """``kernel.compile_add_rmsnorm``, imported when first needed: it imports the CuTe DSL."""
    from .kernel import compile_add_rmsnorm

    return compile_add_rmsnorm


def import_cutlass() -> Any:
    """``cutlass.cute``, or the reason the CuTe DSL cannot be used here."""
    try:
        import cutlass.cute as cute
    except Exception as e:  # ImportError, or a CUDA library mismatch raised while importing
        return (f"the CuTe DSL is not importable ({type(e).__name__}: {e}); "
                "pip install 'nvidia-cutlass-dsl[cu13]==4.8.1'")
    return cute
