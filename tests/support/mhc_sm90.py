"""Compile the MHC kernels for sm_90 (Hopper) on a machine without a GPU, as a launch would.

The launch code of ``layer_boundary_mhc.triton_ops`` runs unchanged against a recorder that
stands in for the kernel and keeps ``(grid, args, meta)``; each recorded launch is then
specialized with Triton's own binder (argument types, 16-byte alignment and divisibility, as the
JIT would see these tensors on a GPU) and compiled with ``triton.compile`` for
``GPUTarget("cuda", 90, 32)``. ptxas (shipped with Triton) reports registers and spills.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

__all__ = ["Recorder", "Compiled", "compile_launches", "SM90"]

SM90 = GPUTarget("cuda", 90, 32)


class Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **meta)`` is recorded."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.launches: list[tuple[Any, tuple, dict]] = []

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **meta: Any) -> None:
            self.launches.append((grid, args, meta))

        return launch


@dataclass
class Compiled:
    meta: dict
    ptx: str
    shared: int
    registers: int
    spill_bytes: int

    def count(self, pattern: str) -> int:
        return len(re.findall(pattern, self.ptx))


def _ptxas(ptx: str, arch: str = "sm_90a") -> tuple[int, int]:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, f"-arch={arch}", "-v", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", out).group(1))
    spills = sum(int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", out))
    return regs, spills


def compile_launches(recorder: Recorder, target: GPUTarget = SM90) -> list[Compiled]:
    backend = make_backend(target)
    fn = recorder.fn
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    out = []
    for _, args, meta in recorder.launches:
        kw = dict(meta, debug=False, instrumentation_mode="")
        bound, specialization, options = binder(*args, **kw)
        options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, specialization, options)
        ck = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
        regs, spills = _ptxas(ck.asm["ptx"])
        out.append(Compiled(meta, ck.asm["ptx"], ck.metadata.shared, regs, spills))
    return out
