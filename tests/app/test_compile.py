"""The reference decoders under ``torch.compile(fullgraph=True)`` on one rank.

``fullgraph=True`` makes any graph break an error. With ``aot_eager`` (the same aten kernels as
eager, after functionalization) the logits must be the same bits; inductor generates its own
kernels, so it is held to the tolerance table. Token counts marked dynamic share one graph.
"""

from __future__ import annotations

import pytest
import torch

from layer_boundary import ForwardBatch
from layer_boundary.plugin_api import MAX_TOLERANCE
from layer_boundary_app.models.config import small_random_config
from layer_boundary_app.models.moe import SparseMoeBlock
from layer_boundary_app.models.qwen3 import Qwen3ForCausalLM
from layer_boundary_app.models.random_init import init_random_weights

import compile_cases

pytestmark = pytest.mark.slow

ONE_RANK = [
    {},
    dict(moe=True, defer_moe_finalize=True),
    dict(pattern="M-M*-"),
    dict(residual="mhc"),
    dict(longcat=True, defer_moe_finalize=True),
    dict(tbo=True, moe=True),
    dict(moe=True, fused_finalize=True),  # the finalize fusion's consumer candidates
]


def test_every_reference_decoder_compiles_to_one_graph_and_equals_eager():
    rows = compile_cases.run_cases(0, 1, ONE_RANK)
    for row in rows:
        assert "error" not in row, f"{row['case']}:\n{row.get('error')}"
        assert row["equal"], f"{row['case']}: compiled logits differ from eager"
        assert row["graphs"] == 1, row
        assert row["graph_collectives"] == row["eager_collectives"] == 0, row


def _model():
    cfg = small_random_config()
    model = Qwen3ForCausalLM(cfg)
    init_random_weights(model, seed=0)
    return cfg, model.eval()


def _sizes_and_graphs(step, cfg, model, backend, *, mark: bool) -> list[tuple[int, int]]:
    seen = []
    with torch.inference_mode():
        for i, t in enumerate((4, 9, 2, 16, 3, 1, 7, 1, 5)):
            ids = torch.randint(0, cfg.vocab_size, (t,), generator=torch.Generator().manual_seed(t))
            pos = torch.arange(t)
            if mark and i == 0:
                torch._dynamo.mark_dynamic(ids, 0)
                torch._dynamo.mark_dynamic(pos, 0)
            got = step(ids, pos)
            assert torch.equal(got, model(ids, pos, ForwardBatch(num_tokens=t, positions=pos))), t
            seen.append((t, backend.graphs))
    return seen


def test_a_declared_dynamic_token_dimension_compiles_once():
    """Token count marked dynamic and the batch built from the input's shape inside the step:
    one graph serves every size from 2 up; size 1 is one more (torch specializes sizes 0 and 1),
    and no step after those compiles again."""
    torch._dynamo.reset()
    cfg, model = _model()
    backend = compile_cases.CountingBackend()

    def step(ids, pos):
        return model(ids, pos, ForwardBatch(num_tokens=ids.shape[0], positions=pos))

    seen = _sizes_and_graphs(torch.compile(step, fullgraph=True, backend=backend), cfg, model, backend, mark=True)
    assert [g for _, g in seen] == [1, 1, 1, 1, 1, 2, 2, 2, 2], seen


def test_a_batch_built_outside_the_graph_recompiles_once():
    """A ForwardBatch built outside with a plain int count: torch's automatic dynamic shapes
    compile the first size statically and the second once with the count symbolic; every later
    size from 2 up reuses that graph (size 1: one more)."""
    torch._dynamo.reset()
    cfg, model = _model()
    backend = compile_cases.CountingBackend()
    compiled = torch.compile(model, fullgraph=True, backend=backend)

    def step(ids, pos):
        return compiled(ids, pos, ForwardBatch(num_tokens=ids.shape[0], positions=pos))

    seen = _sizes_and_graphs(step, cfg, model, backend, mark=False)
    assert [g for _, g in seen] == [1, 2, 2, 2, 2, 3, 3, 3, 3], seen


def test_inductor_logits_within_the_tolerance_table():
    torch._dynamo.reset()
    cfg, model = _model()
    ids = torch.randint(0, cfg.vocab_size, (6,), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(6)
    with torch.inference_mode():
        eager = model(ids, pos, ForwardBatch(num_tokens=6, positions=pos))
        compiled = torch.compile(model, fullgraph=True)(ids, pos, ForwardBatch(num_tokens=6, positions=pos))
    atol, rtol = MAX_TOLERANCE[torch.float32]
    torch.testing.assert_close(compiled, eager, atol=atol, rtol=rtol)


def test_an_expert_activation_the_operator_cannot_name_is_refused_clearly():
    torch._dynamo.reset()
    block = SparseMoeBlock(16, 8, 4, 2, group=_single_group(), renormalize=True, act=lambda g, u: g * u)
    x = torch.randn(3, 16)
    block(x)  # eager runs any activation
    with pytest.raises(Exception, match="has no name in moe_experts.ACTIVATIONS"):
        torch.compile(block.routed, fullgraph=True, backend="eager")(x)


def _single_group():
    from layer_boundary import Topology

    return Topology.single().tp
