"""pluggy runs at construction only: a forward step makes zero hook calls.

Two watches, both shown to see calls before they are trusted to see none: the registry's own
hook-call monitoring, and a process-wide count of every pluggy hook call and plugin manager
created (a forward that rediscovered plugins, or called hooks through another manager, would show
there). Meanwhile the plugin's providers do run in forward, through the callables bound at
construction.
"""

from __future__ import annotations

from typing import Any, Iterator

import pluggy
import pytest
import torch

from layer_boundary import BoundaryContext
from layer_boundary._forward import ForwardBatch, ForwardMode
from layer_boundary_app.models import Qwen3ForCausalLM, init_random_weights, small_random_config
from layer_boundary._plugins import discover
from plugin_fixtures import VendorPlugin

SPECS = ["layer_boundary_norm_kernels", "layer_boundary_fusion_providers", "layer_boundary_residual_semantics"]


class PluggyWatch:
    """Counts, process-wide, every pluggy hook call and every ``PluginManager`` created."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        self.managers = 0
        caller = pluggy.HookCaller
        for meth in ("__call__", "call_extra", "call_historic"):
            real = getattr(caller, meth)
            monkeypatch.setattr(caller, meth, self._counted(real))
        real_init = pluggy.PluginManager.__init__

        def init(pm: Any, *a: Any, **k: Any) -> None:
            self.managers += 1
            real_init(pm, *a, **k)

        monkeypatch.setattr(pluggy.PluginManager, "__init__", init)

    def _counted(self, real: Any) -> Any:
        def counted(hook: Any, *a: Any, **k: Any) -> Any:
            self.calls.append(hook.name)
            return real(hook, *a, **k)

        return counted

    def clear(self) -> None:
        self.calls.clear()
        self.managers = 0


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> Iterator[PluggyWatch]:
    yield PluggyWatch(monkeypatch)


def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor, ForwardBatch]]:
    """Prefill of one sequence, packed prefill of two, a decode step, and an empty batch."""
    yield torch.tensor([3, 1, 4, 1, 5]), torch.arange(5), ForwardBatch(num_tokens=5, positions=torch.arange(5))
    pos = torch.tensor([0, 1, 2, 0, 1])
    yield torch.tensor([9, 2, 6, 5, 3]), pos, ForwardBatch(num_tokens=5, positions=pos, seq_lens=(3, 2))
    pos = torch.tensor([3, 2])
    yield torch.tensor([7, 8]), pos, ForwardBatch(num_tokens=2, positions=pos, seq_lens=(1, 1),
                                                 mode=ForwardMode.DECODE)
    empty = torch.zeros(0, dtype=torch.long)
    yield empty, empty, ForwardBatch(num_tokens=0, positions=empty)


def test_forward_makes_zero_hook_calls(watch: PluggyWatch):
    registry = discover(allow=[])  # discovery is over: no installed plugin takes part
    monitored: list[str] = []
    undo = registry.pm.add_hookcall_monitoring(
        before=lambda name, impls, kwargs: monitored.append(name),
        after=lambda outcome, name, impls, kwargs: None,
    )
    try:
        # Construction: registering a plugin calls each hook once, and both watches see it.
        watch.clear()
        plugin = VendorPlugin()
        registry.register(plugin, name="vendor")
        assert sorted(monitored) == sorted(SPECS)
        assert sorted(watch.calls) == sorted(SPECS)

        context = BoundaryContext(registry=registry)
        model = Qwen3ForCausalLM(small_random_config(), context=context)
        init_random_weights(model, seed=0)
        model.eval()
        context.freeze()
        assert registry.frozen

        monitored.clear()
        watch.clear()
        with torch.inference_mode():
            for ids, pos, fb in batches():
                model(ids, pos, fb)
                model(ids, pos, fb)  # the same step again: nothing warms up lazily through pluggy
        assert monitored == [], f"forward called pluggy hooks {monitored}"
        assert watch.calls == [], f"forward called pluggy hooks {watch.calls}"
        assert watch.managers == 0, "forward created a pluggy PluginManager (discovery in forward?)"

        # The plugin's providers did run in forward, through what construction bound.
        assert plugin.counting.calls["fused_add_rmsnorm"] > 0 and plugin.counting.calls["rmsnorm"] > 0
        assert plugin.fusion.asked["finalize"] > 0  # exit decisions, asked of the bound provider

        # Control: a hook call now would have been seen by both watches.
        registry.pm.hook.layer_boundary_fusion_providers()
        assert monitored == ["layer_boundary_fusion_providers"]
        assert watch.calls == ["layer_boundary_fusion_providers"]
    finally:
        undo()


def test_construction_itself_calls_no_hooks(watch: PluggyWatch):
    """The registry's hooks ran when it was built; stages only read what it collected."""
    registry = discover(allow=[])
    registry.register(VendorPlugin(), name="vendor")
    watch.clear()
    context = BoundaryContext(registry=registry)
    Qwen3ForCausalLM(small_random_config(), context=context)
    context.freeze()
    assert watch.calls == [] and watch.managers == 0
