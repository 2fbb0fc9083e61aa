"""Reference decoders compiled with ``torch.compile(fullgraph=True)`` against the same model eager.

Run on every rank by ``tests/multi_rank/test_compile_parallel.py`` (and on one rank by
``tests/app/test_compile.py``). The backend is ``aot_eager`` wrapped to count the collectives in
the graphs Dynamo hands it: AOT autograd functionalizes the forward (in-place residual writes,
collectives as functional ops) and runs the same aten kernels eager runs, so the logits must be
the same bits, and the graph must hold exactly the collectives the eager forward calls.
"""

from __future__ import annotations

import contextlib
import traceback
from typing import Any, Iterator

import torch
import torch.distributed as dist

from layer_boundary import Topology
from layer_boundary_app.models.runner import RunSpec, build_model, rank_forward

SEQUENCES = ((1, 2, 3), (4, 5), (6, 7, 8, 9))

_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


class CountingBackend:
    """``aot_eager`` that records the collective calls of every graph it compiles."""

    def __init__(self) -> None:
        self.graphs = 0
        self.collectives = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        self.graphs += 1
        self.collectives += sum(
            1 for n in gm.graph.nodes
            if n.op == "call_function" and any(c in _name(n.target) for c in _COLLECTIVES)
            and "wait" not in _name(n.target))
        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)


def _name(target: Any) -> str:
    return getattr(target, "__name__", None) or str(target)


@contextlib.contextmanager
def eager_collectives() -> Iterator[dict[str, int]]:
    """Count the collectives an eager forward calls (every torch.distributed entry point)."""
    counts = {"n": 0}
    names = ["all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
             "all_to_all_single", "reduce_scatter"]
    from layer_boundary import _ops  # holds the gather / scatter entry points it resolved at import

    saved = [(dist, n, getattr(dist, n)) for n in names]
    saved += [(_ops, n, getattr(_ops, n)) for n in ("_all_gather", "_reduce_scatter")]

    def counting(orig: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            counts["n"] += 1
            return orig(*a, **k)
        return call

    for owner, n, f in saved:
        setattr(owner, n, counting(f))
    try:
        yield counts
    finally:
        for owner, n, f in saved:
            setattr(owner, n, f)


def run_cases(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for kw in cases:
        row: dict[str, Any] = {"case": kw}
        # Dynamo caches per code object, so every earlier case's model would stay a guarded
        # entry of the same forward (and count against its recompile limit).
        torch._dynamo.reset()
        try:
            spec = RunSpec(sequences=SEQUENCES, **kw)
            topo = (Topology.from_sizes(tp=spec.tp, dp=spec.dp, pp=spec.pp, cp=spec.cp)
                    if world > 1 else Topology.single())
            model = build_model(spec, topo, "cpu")
            with eager_collectives() as counts:
                _, eager, _ = rank_forward(model, spec, "cpu")
            backend = CountingBackend()
            _, compiled, _ = rank_forward(model, RunSpec(sequences=SEQUENCES, compile=backend, **kw), "cpu")
            row.update(equal=bool(torch.equal(eager, compiled)), graphs=backend.graphs,
                       eager_collectives=counts["n"], graph_collectives=backend.collectives)
        except Exception as e:  # reported per case, so one failure does not hide the others
            row["error"] = f"{type(e).__name__}: {e}"[:2000] + "\n" + traceback.format_exc()[-3000:]
        out.append(row)
    return out
