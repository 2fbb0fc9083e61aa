"""A test double of the FlashInfer 0.7.2 functions the FlashInfer plugin calls, for CPU tests.

``install()`` puts modules named ``flashinfer`` and ``flashinfer.comm`` into ``sys.modules``.
Each function first checks what the real one requires or assumes of its arguments (dtypes it
dispatches, shapes, contiguous and aligned rows, which tensors it writes, the workspace it was
given), raising ``FlashInferMisuse`` where the real kernel would fail or read garbage; then it
computes the torch reference with FlashInfer's rounding order and writes the tensors FlashInfer
writes, and nothing else. Every call is recorded in ``double.calls``.

Norm kernels: ``rmsnorm``/``gemma_rmsnorm`` write ``out``; ``fused_add_rmsnorm``/
``gemma_fused_add_rmsnorm`` store the rounded sum into ``residual`` and the normalized FP32 sum
into ``input``. All-reduce fusion: the sum over the workspace's group (gathered over gloo and
added in rank order, FP32 with ``fp32_acc``), added to ``residual_in`` and rounded, then that
rounded residual normalized, as FlashInfer's kernel does.
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from layer_boundary._kernels.reference import rmsnorm_ref

__all__ = ["FlashInferMisuse", "FlashInferDouble", "install"]

_DTYPES = (torch.bfloat16, torch.float16)
_MISSING = object()


class FlashInferMisuse(AssertionError):
    """An argument the real FlashInfer function would reject or misread."""


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise FlashInferMisuse(what)


def _rows_ok(t: torch.Tensor, name: str, hidden: int) -> None:
    # FlashInfer takes tensors through DLPack, and torch exports no tensor that requires grad.
    _need(not t.requires_grad, f"{name}: requires grad (DLPack export refuses it; pass it detached)")
    _need(t.stride(-1) == 1, f"{name}: last dimension not contiguous (CHECK_LAST_DIM_CONTIGUOUS_INPUT)")
    align = math.gcd(16, hidden * t.element_size())
    _need(t.data_ptr() % align == 0, f"{name}: rows not aligned to {align} bytes (vector loads)")
    if t.dim() == 2:
        _need((t.stride(0) * t.element_size()) % align == 0, f"{name}: row stride breaks {align}-byte alignment")


class AllReduceFusionPattern:
    kAllReduce = 0
    kARResidualRMSNorm = 1
    kARResidualRMSNormFP8Quant = 2
    kARResidualRMSNormDynamicFP8Quant = 10


@dataclass(eq=False)
class FakeWorkspace:
    world_size: int
    rank: int
    group: Any
    metadata: dict
    backend: str = "trtllm"


@dataclass
class FlashInferDouble:
    calls: list[tuple[str, dict]] = field(default_factory=list)
    weight_bias: bool = True  # allreduce_fusion takes weight_bias (0.7.2 does)
    build_error: Optional[str] = None  # what building the fusion kernels raises, if anything
    pkg: Any = None
    comm: Any = None

    # -- norm ------------------------------------------------------------------------------

    def _norm_args(self, name: str, x: torch.Tensor, weight: torch.Tensor, eps: float, enable_pdl: Any) -> None:
        _need(x.dtype in _DTYPES, f"{name}: failed to dispatch data type {x.dtype} (bf16 and fp16 only)")
        _need(weight.dim() == 1 and weight.shape[0] == x.shape[-1], f"{name}: weight shape {tuple(weight.shape)}")
        _need(weight.dtype == x.dtype, f"{name}: weight {weight.dtype} is read as {x.dtype}")
        _need(x.device == weight.device, f"{name}: CHECK_DEVICE")
        _need(x.shape[0] > 0, f"{name}: zero rows is a launch of zero blocks (invalid configuration)")
        _need(isinstance(eps, float), f"{name}: eps {eps!r} is not a float")
        _need(enable_pdl is None or isinstance(enable_pdl, bool), f"{name}: enable_pdl {enable_pdl!r}")
        _rows_ok(x, f"{name} input", x.shape[-1])
        _rows_ok(weight, f"{name} weight", x.shape[-1])

    def _rmsnorm(self, name: str, offset: float, input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                 out: Optional[torch.Tensor] = None, enable_pdl: Optional[bool] = None) -> torch.Tensor:
        self._norm_args(name, input, weight, eps, enable_pdl)
        _need(input.dim() in (2, 3), f"{name}: {input.dim()}-D input")
        if out is None:
            out = torch.empty_like(input)
        _need(out.shape == input.shape and out.dtype == input.dtype, f"{name}: out {tuple(out.shape)} {out.dtype}")
        _rows_ok(out, f"{name} out", input.shape[-1])
        self.calls.append((name, {"input": input, "out": out, "weight": weight}))
        out.copy_(rmsnorm_ref(input, weight, eps, weight_offset=offset))
        return out

    def _fused(self, name: str, offset: float, input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
               eps: float = 1e-6, enable_pdl: Optional[bool] = None) -> None:
        self._norm_args(name, input, weight, eps, enable_pdl)
        _need(input.dim() == 2 and residual.dim() == 2, f"{name}: CHECK_DIM(2)")
        _need(residual.shape == input.shape, f"{name}: residual {tuple(residual.shape)} vs input {tuple(input.shape)}")
        _need(residual.dtype == input.dtype, f"{name}: residual {residual.dtype} is read as {input.dtype}")
        _rows_ok(residual, f"{name} residual", input.shape[-1])
        self.calls.append((name, {"input": input, "residual": residual, "weight": weight,
                                  "input_ptr": input.data_ptr(), "residual_ptr": residual.data_ptr()}))
        s = input.float() + residual.float()  # the FP32 sum stays in shared memory ...
        y = rmsnorm_ref(s, weight, eps, weight_offset=offset).to(input.dtype)  # ... and is normalized
        residual.copy_(s)
        input.copy_(y)

    # -- comm --------------------------------------------------------------------------------

    def create_allreduce_fusion_workspace(self, backend: Any = _MISSING, world_size: Optional[int] = None,
                                          rank: Optional[int] = None, max_token_num: Optional[int] = None,
                                          hidden_dim: Optional[int] = None, dtype: Optional[torch.dtype] = None,
                                          gpus_per_node: Optional[int] = None, comm_backend: Any = None,
                                          force_oneshot_support: bool = False, group: Any = None) -> FakeWorkspace:
        _need(backend == "trtllm", f"backend={backend!r}: only 'trtllm' may run here ('auto' and 'mnnvl' use "
                                   "NVLink multicast)" if backend is not _MISSING else
              "backend not given: its default 'auto' may pick 'mnnvl' (NVLink multicast)")
        _need(group is not None, "group not given: the workspace would rendezvous over WORLD")
        _need(world_size == dist.get_world_size(group) and rank == dist.get_rank(group),
              f"world_size={world_size} rank={rank} do not match the group")
        _need(world_size is not None and 1 < world_size <= 16, f"world_size={world_size}")
        _need(isinstance(max_token_num, int) and max_token_num > 0, f"max_token_num={max_token_num!r}")
        _need(isinstance(hidden_dim, int) and hidden_dim > 0, f"hidden_dim={hidden_dim!r}")
        _need(dtype in (torch.bfloat16, torch.float16, torch.float32), f"dtype={dtype}")
        self.calls.append(("create_allreduce_fusion_workspace", {
            "backend": backend, "world_size": world_size, "rank": rank, "max_token_num": max_token_num,
            "hidden_dim": hidden_dim, "dtype": dtype}))
        dist.barrier(group=group)  # creation is collective
        meta = {"tp_size": world_size, "max_token_num": max_token_num, "hidden_dim": hidden_dim,
                "use_fp32_lamport": dtype == torch.float32}
        return FakeWorkspace(world_size, rank, group, meta)

    def allreduce_fusion(self, input: torch.Tensor, workspace: FakeWorkspace, pattern: int,
                         launch_with_pdl: bool = False, trigger_completion_at_end: bool = True,
                         output: Optional[torch.Tensor] = None, residual_out: Optional[torch.Tensor] = None,
                         norm_out: Optional[torch.Tensor] = None, quant_out: Any = None, scale_out: Any = None,
                         residual_in: Optional[torch.Tensor] = None, rms_gamma: Optional[torch.Tensor] = None,
                         rms_eps: float = 1e-6, scale_factor: Any = None, layout_code: Any = None,
                         use_oneshot: Optional[bool] = None, fp32_acc: bool = False,
                         weight_bias: Any = _MISSING) -> torch.Tensor:
        _need(isinstance(workspace, FakeWorkspace) and workspace.backend == "trtllm", "not a trtllm workspace")
        _need(pattern == AllReduceFusionPattern.kARResidualRMSNorm, f"pattern {pattern}")
        _need(weight_bias is _MISSING or self.weight_bias, "this FlashInfer takes no weight_bias")
        bias = 0.0 if weight_bias is _MISSING else float(weight_bias)
        meta, world = workspace.metadata, workspace.world_size
        _need(input.dim() == 2 and input.is_contiguous(), "input must be a contiguous [T, H]")
        tokens, hidden = input.shape
        dtype = input.dtype
        _need(meta["use_fp32_lamport"] == (dtype == torch.float32), f"input {dtype} on a workspace for another dtype")
        _need(tokens * hidden <= meta["max_token_num"] * meta["hidden_dim"], "rows over the workspace")
        _need(tokens > 0, "zero rows")
        _need(hidden % (16 // input.element_size()) == 0, "hidden_dim % VEC_SIZE != 0")
        _need(world in (2, 4, 8, 16), "unsupported ranks number")
        _need(use_oneshot is not None or world in (2, 4, 8), "use_oneshot=None has no heuristic for 16 ranks")
        _need(use_oneshot is not False or tokens > world, "sequence length should be larger than tp_size")
        _need(isinstance(launch_with_pdl, bool) and isinstance(trigger_completion_at_end, bool), "flags")
        _need(isinstance(fp32_acc, bool), "fp32_acc")
        for name, t in (("residual_in", residual_in), ("residual_out", residual_out), ("norm_out", norm_out),
                        ("output", output)):
            if name == "output" and t is None:
                continue
            _need(t is not None, f"{name} is required")
            _need(t.shape == input.shape and t.dtype == dtype and t.is_contiguous(), f"{name} {tuple(t.shape)} {t.dtype}")
            _rows_ok(t, name, hidden)
        _rows_ok(input, "input", hidden)
        _need(rms_gamma is not None and rms_gamma.dim() == 1 and rms_gamma.shape[0] == hidden, "rms_gamma shape")
        _need(rms_gamma.dtype == dtype, f"rms_gamma {rms_gamma.dtype} is read as {dtype}")
        _rows_ok(rms_gamma, "rms_gamma", hidden)
        _need(quant_out is None and scale_out is None and scale_factor is None, "no quantized output here")
        self.calls.append(("allreduce_fusion", {
            "tokens": tokens, "use_oneshot": use_oneshot, "fp32_acc": fp32_acc, "launch_with_pdl": launch_with_pdl,
            "trigger_completion_at_end": trigger_completion_at_end, "weight_bias": bias,
            "residual_in_place": residual_out is residual_in, "norm_out_is_input": norm_out is input,
            "output_is_norm_out": output is norm_out, "input_ptr": input.data_ptr(),
            "output_ptr": None if output is None else output.data_ptr()}))
        parts = [torch.empty_like(input) for _ in range(world)]
        dist.all_gather(parts, input, group=workspace.group)
        if fp32_acc and dtype != torch.float32:
            total = torch.stack([p.float() for p in parts]).sum(0).to(dtype)
        else:
            total = parts[0]
            for p in parts[1:]:
                total = (total.float() + p.float()).to(dtype)
        s = (total.float() + residual_in.float()).to(dtype)  # rounded before the norm, as the kernel does
        y = rmsnorm_ref(s, rms_gamma, rms_eps, weight_offset=bias)
        residual_out.copy_(s)
        norm_out.copy_(y)
        return norm_out


class _JitSpec:
    """``gen_trtllm_comm_module()``: building and loading the fusion kernels."""

    def __init__(self, double: FlashInferDouble) -> None:
        self.double = double

    def build_and_load(self) -> Any:
        self.double.calls.append(("build_and_load", {}))
        if self.double.build_error is not None:
            raise RuntimeError(self.double.build_error)
        return types.SimpleNamespace()


def install(monkeypatch: Any = None, *, weight_bias: bool = True) -> FlashInferDouble:
    """Put the double's ``flashinfer`` and ``flashinfer.comm`` into ``sys.modules`` (through
    ``monkeypatch`` when given, so the test undoes it; for good in a spawned worker)."""
    d = FlashInferDouble(weight_bias=weight_bias)
    pkg = types.ModuleType("flashinfer")
    pkg.__version__ = "0.7.2.post1+double"
    pkg.rmsnorm = lambda *a, **k: d._rmsnorm("rmsnorm", 0.0, *a, **k)
    pkg.gemma_rmsnorm = lambda *a, **k: d._rmsnorm("gemma_rmsnorm", 1.0, *a, **k)
    pkg.fused_add_rmsnorm = lambda *a, **k: d._fused("fused_add_rmsnorm", 0.0, *a, **k)
    pkg.gemma_fused_add_rmsnorm = lambda *a, **k: d._fused("gemma_fused_add_rmsnorm", 1.0, *a, **k)
    norm = types.ModuleType("flashinfer.norm")

    def get_norm_module() -> Any:
        d.calls.append(("get_norm_module", {}))
        if d.build_error is not None:
            raise RuntimeError(d.build_error)
        return types.SimpleNamespace()

    norm.get_norm_module = get_norm_module
    pkg.norm = norm
    comm = types.ModuleType("flashinfer.comm")
    comm.AllReduceFusionPattern = AllReduceFusionPattern
    comm.create_allreduce_fusion_workspace = d.create_allreduce_fusion_workspace
    comm.gen_trtllm_comm_module = lambda: _JitSpec(d)
    if weight_bias:
        comm.allreduce_fusion = d.allreduce_fusion
    else:
        def allreduce_fusion(input, workspace, pattern, launch_with_pdl=False, trigger_completion_at_end=True,
                             output=None, residual_out=None, norm_out=None, quant_out=None, scale_out=None,
                             residual_in=None, rms_gamma=None, rms_eps=1e-6, scale_factor=None, layout_code=None,
                             use_oneshot=None, fp32_acc=False):
            return d.allreduce_fusion(input, workspace, pattern, launch_with_pdl, trigger_completion_at_end,
                                      output, residual_out, norm_out, quant_out, scale_out, residual_in,
                                      rms_gamma, rms_eps, scale_factor, layout_code, use_oneshot, fp32_acc)
        comm.allreduce_fusion = allreduce_fusion
    pkg.comm = comm
    d.pkg, d.comm = pkg, comm
    for name, mod in (("flashinfer", pkg), ("flashinfer.comm", comm)):
        if monkeypatch is not None:
            monkeypatch.setitem(sys.modules, name, mod)
        else:
            sys.modules[name] = mod
    return d

