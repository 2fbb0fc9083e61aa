"""The kit's tracing check: a kernel compiles under ``torch.compile(fullgraph=True)`` and gives
its eager numbers.

Engines compile whole models with ``fullgraph=True`` (vLLM, SGLang's decode graphs): one kernel
Dynamo cannot trace (a data-pointer read, a DLPack export, a C extension call, an undeclared
write) fails the engine's compile, not the kernel's tests. ``assert_traces`` compiles a call
with the ``aot_eager`` backend, which traces with fake tensors and functionalizes mutations as
Inductor does but runs the kernels as eager code, so a kernel registered as an operator gives the
eager bits and any difference is the trace's fault (a lost in-place write, a wrong fake shape).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

__all__ = ["assert_traces", "ADVICE"]

ADVICE = ("register the kernel as an operator with layer_boundary.plugin_api.kernel_op(name, kernel, "
          "mutates=(...)) (a destination-passing kernel that returns None, its written tensors named in "
          "mutates) and allocate destinations in the plain Python around it; see 'Your kernel under "
          "torch.compile' in docs/plugin-guide.md")


def _clone(tree: Any) -> Any:
    return pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, tree)


def _leaves(tree: Any) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(tree) if isinstance(v, torch.Tensor)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point and a.element_size() == 1:  # FP8: compare the codes
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return bool(torch.equal(a, b)) or bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(
        a.nan_to_num(), b.nan_to_num()))


def assert_traces(fn: Callable[..., Any], *args: Any, what: str = "", **kwargs: Any) -> Any:
    """Compile ``fn`` with ``fullgraph=True``, call it and eager ``fn`` on copies of ``args`` and
    ``kwargs``, and assert that outputs and every argument afterwards (in-place writes) are equal
    bit for bit. Returns the compiled call's output. ``what`` names the call in failures."""
    name = what or getattr(fn, "__qualname__", repr(fn))
    eager_args, eager_kwargs = _clone(args), _clone(kwargs)
    want = fn(*eager_args, **eager_kwargs)
    got_args, got_kwargs = _clone(args), _clone(kwargs)
    # Dynamo keys its cache on fn's code: a check of another kernel through the same helper code
    # must not find this one's graph, nor run into the recompile limit and fall back to eager.
    torch._dynamo.reset()
    try:
        got = torch.compile(fn, fullgraph=True, backend="aot_eager")(*got_args, **got_kwargs)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise AssertionError(f"{name} does not trace under torch.compile(fullgraph=True) ({type(e).__name__}: "
                             f"{first}); {ADVICE}") from e
    want_leaves, got_leaves = _leaves(want), _leaves(got)
    assert len(want_leaves) == len(got_leaves), (
        f"{name} returned {len(got_leaves)} tensors compiled and {len(want_leaves)} in eager")
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        assert _same(g, w), (
            f"{name}: output {i} compiled differs from eager ({g.dtype} {tuple(g.shape)} against {w.dtype} "
            f"{tuple(w.shape)}); the compiled graph ran other code than eager: {ADVICE}")
    for i, (g, w) in enumerate(zip(_leaves((got_args, got_kwargs)), _leaves((eager_args, eager_kwargs)))):
        assert _same(g, w), (
            f"{name}: tensor argument {i} holds other values after the compiled call than after the eager "
            f"one: a write the compiled graph lost (an in-place residual or out= not declared in mutates); "
            f"{ADVICE}")
    return got
