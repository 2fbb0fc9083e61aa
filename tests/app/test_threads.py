"""Forward state is per thread: two models forwarded in two threads give exactly the numbers of
sequential runs, and ``get_forward()`` is clear after every scope closes."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from layer_boundary import Topology, get_forward
from layer_boundary_app.models.runner import RunSpec, build_model, rank_forward

SEQUENCES = ((1, 2, 3, 4), (5, 6))


def _clear() -> bool:
    f = get_forward()
    return not (f.fuse_mlp_allreduce or f.mlp_reduce_scatter or f.defer_moe_finalize) and f.open_scopes == 0


@pytest.fixture
def fast_switching():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    yield
    sys.setswitchinterval(old)


def test_two_models_in_two_threads_equal_sequential_runs(fast_switching):
    # One model's exit scopes publish defer_moe_finalize, the other's never do: read across
    # threads, the second model's MoE would return a handoff its exit refuses, or skip a finalize.
    specs = [RunSpec(sequences=SEQUENCES, moe=True, defer_moe_finalize=True),
             RunSpec(sequences=SEQUENCES, moe=True, seed=1)]
    models = [build_model(s, Topology.single(), "cpu") for s in specs]
    sequential = [rank_forward(m, s, "cpu")[1] for m, s in zip(models, specs)]
    results: list[list[torch.Tensor]] = [[], []]
    errors: list[BaseException] = []
    clear_after: list[bool] = []

    def work(i: int) -> None:
        try:
            for _ in range(15):
                results[i].append(rank_forward(models[i], specs[i], "cpu")[1])
            clear_after.append(_clear())
        except BaseException as e:  # reported below with the thread's index
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(2):
        assert all(torch.equal(r, sequential[i]) for r in results[i]), f"model {i} differs in a thread"
    assert clear_after == [True, True]
    assert _clear()


def test_another_threads_open_scope_is_invisible():
    spec = RunSpec(sequences=SEQUENCES, moe=True, defer_moe_finalize=True)
    model = build_model(spec, Topology.single(), "cpu")
    ffn = model.model.layers[0].ffn_boundary
    inside, seen = threading.Event(), []
    release = threading.Event()

    def hold_scope() -> None:
        from layer_boundary import ForwardBatch, residual_batch

        fb = ForwardBatch(num_tokens=2)
        residual_batch.start(fb)
        with ffn.exit(fb):
            seen.append(get_forward().defer_moe_finalize)
            inside.set()
            release.wait(10)

    t = threading.Thread(target=hold_scope)
    t.start()
    try:
        assert inside.wait(10)
        assert seen == [True]  # the scope is open in its own thread ...
        assert _clear()  # ... and invisible here
    finally:
        release.set()
        t.join()


def test_flags_are_clear_after_a_scope_whose_body_raises():
    spec = RunSpec(sequences=SEQUENCES, moe=True, defer_moe_finalize=True)
    model = build_model(spec, Topology.single(), "cpu")
    ffn = model.model.layers[0].ffn_boundary
    from layer_boundary import ForwardBatch, residual_batch

    fb = ForwardBatch(num_tokens=2)
    residual_batch.start(fb)
    with pytest.raises(RuntimeError, match="compute failed"):
        with ffn.exit(fb):
            assert get_forward().defer_moe_finalize
            raise RuntimeError("compute failed")
    assert _clear()
