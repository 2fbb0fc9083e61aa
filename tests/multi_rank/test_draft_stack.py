"""NextN / MTP draft stacks: a draft layer enters with ``previous=None``, is terminal by the draft's
own layer count, and leaves through ``fold()`` + ``take_output()``.

One rank: the draft equals its formula written out with the same compute modules and no
boundaries. Multi-process on gloo (the shared spawn of ``capture_cases``): target then draft on
TP, TP + attention DP and input-scattered layouts equal the single-rank draft logits.
"""

from __future__ import annotations

import pytest
import torch

from helpers import TOL, raises_exact
from layer_boundary import BoundaryError, ForwardBatch, Topology
from layer_boundary._errors import START_FIRST, WRITE_BEFORE_TAKE
from layer_boundary_app.models.config import small_random_config
from layer_boundary_app.models.nextn import Qwen3NextNForCausalLM, init_random_nextn_weights
from layer_boundary_app.models.qwen3 import Qwen3ForCausalLM
from layer_boundary_app.models.random_init import init_random_weights
from layer_boundary.residual import batch as rb

import capture_cases

F64 = torch.float64


def models(num_layers=1):
    target = Qwen3ForCausalLM(small_random_config(), Topology.single(), dtype=F64)
    init_random_weights(target, seed=1)
    draft = Qwen3NextNForCausalLM(target, num_layers=num_layers, dtype=F64)
    init_random_nextn_weights(draft, seed=2)
    return target, draft


def batch(seqs):
    flat = [t for s in seqs for t in s]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    return torch.tensor(flat), pos, lambda: ForwardBatch(num_tokens=len(flat), positions=pos,
                                                         seq_lens=tuple(len(s) for s in seqs))


def formula(target, draft, ids, pos, hidden, fb):
    """The draft written out with its compute modules: no boundary, no stream."""
    m = draft.model
    r = m.eh_proj(torch.cat([m.enorm(target.model.embed_tokens(ids)), m.hnorm(hidden)], dim=-1))
    for layer in m.layers:
        r = r + layer.self_attn(pos, layer.input_layernorm(r), fb)
        r = r + layer.mlp(layer.post_attention_layernorm(r))
    return target.lm_head(m.norm(r)).float()


@pytest.mark.parametrize("num_layers", [1, 2])
def test_draft_is_its_own_stack(num_layers):
    target, draft = models(num_layers)
    layers = draft.model.layers
    assert layers[0].attn_boundary.plan.declaration.previous is None
    for i, layer in enumerate(layers):
        assert layer.ffn_boundary.plan.declaration.terminal is (i == num_layers - 1)
        assert not layer.attn_boundary.plan.declaration.terminal
    # The target keeps its own count: only its last layer is terminal.
    assert [lyr.ffn_boundary.plan.declaration.terminal for lyr in target.model.layers] == [False] * 3 + [True]
    assert not any(n.startswith(("embed", "lm_head")) for n, _ in draft.named_parameters())


@pytest.mark.parametrize("num_layers", [1, 2])
def test_draft_matches_its_formula(num_layers):
    target, draft = models(num_layers)
    ids, pos, make = batch([[1, 5, 9], [4, 2, 2, 7]])
    nxt = torch.tensor([5, 9, 7, 2, 2, 7, 7])
    with torch.inference_mode():
        hidden = target.model(ids, pos, make())
        fb = make()
        got = draft(nxt, pos, hidden, fb)
        want = formula(target, draft, nxt, pos, hidden, make())
    assert fb.residual_stream.released
    torch.testing.assert_close(got, want, **TOL[F64])


def test_take_output_needs_the_fold():
    """The MTP exit takes a written stream: without the internal fold the pending FFN output
    would be dropped, so take_output refuses it, and leaves the stream for the fold its
    refusal asks for (issue 32: a refusal never releases the stream)."""
    target, draft = models()
    layer = draft.model.layers[0]
    ids, pos, make = batch([[3, 1, 4]])
    fb = make()
    rb.start(fb)
    with torch.inference_mode():
        h = layer(pos, torch.randn(3, 64, dtype=F64), fb)
        with raises_exact(BoundaryError, WRITE_BEFORE_TAKE):
            rb.take_output(h, fb)
        h = rb.fold(h, fb)
        assert torch.equal(rb.take_output(h, fb), h)
        with raises_exact(BoundaryError, START_FIRST):
            rb.fold(h, fb)


def test_draft_checks_its_inputs():
    target, draft = models()
    ids, pos, make = batch([[3, 1, 4]])
    with pytest.raises(ValueError, match="one target hidden state per input row"):
        draft(ids, pos, torch.zeros(2, 64, dtype=F64), make())


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def runs(request):
    world = request.param
    return world, [r["draft"] for r in capture_cases.results(world)]


@pytest.mark.slow
def test_draft_on_parallel_layouts_matches_one_rank(runs):
    """Float64 within 1e-10 (the Qwen3 reference's tolerance: attention and norms round
    differently when sums are regrouped); every token's logits come from exactly one DP group."""
    world, per_rank = runs
    for i, case in enumerate(capture_cases.DRAFT[world]):
        dp = case.get("dp", 1)
        group = world // dp
        rows = 0
        for rank, results in enumerate(per_rank):
            r = results[i]
            assert r["case"] == case
            assert r["max_diff"] <= 1e-10, (rank, r)
            if rank % group == 0:
                rows += r["rows"]
        assert rows == sum(len(s) for s in case["sequences"])
