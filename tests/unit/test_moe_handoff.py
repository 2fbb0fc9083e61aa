"""The MoE finalize handoff in one process: the sparse block's flags and formula, the exit's
decision, and every consumer of a ``HandoffOutput`` (next input, final norm with and without
``handoff_norm``, pipeline send) and the accessors that refuse or complete it.

Sums over a fake two-rank group run through ``helpers.FakeCollectives`` (an all-reduce doubles
the value), so a sum that runs twice, or not at all, or before the finalize, changes the numbers.
The expected numbers come from an independent float64 formula, not from the library.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import (
    HalfSkip,
    Provider,
    Recorder,
    counted_handoff,
    fake_topology,
    make_norm,
    rand,
    rms64,
)
from layer_boundary import (
    BoundaryError,
    ForwardBatch,
    HandoffOutput,
    OutputTransform,
    Topology,
    declare_attn,
    declare_ffn,
    get_forward,
    make_stages,
)
from layer_boundary._output import OwedOutput
from layer_boundary_app.models.moe import SparseMoeBlock
from layer_boundary.residual import batch as rb
from layer_boundary._topology import GroupInfo

F64 = torch.float64
T, H, E, K, I, S = 5, 8, 4, 2, 6, 4  # tokens, hidden, experts, top-k, expert width, shared width


def _weights(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g, dtype=F64) * shape[-1] ** -0.5

    return {
        "router": w(E, H),
        "experts": [(w(I, H), w(I, H), w(H, I)) for _ in range(E)],
        "shared": (w(S, H), w(S, H), w(H, S)),
        "shared_gate": w(1, H),
    }


def _block(group: GroupInfo, weights: dict, *, shared: bool = False, gated: bool = False,
           renormalize: bool = True) -> SparseMoeBlock:
    """The real block with ``weights`` loaded through its weight loaders (this rank's slices)."""
    block = SparseMoeBlock(H, E, K, I, group, renormalize=renormalize,
                           shared_intermediate_size=S if shared else 0, shared_gate=gated, dtype=F64)
    block.gate.weight.data.copy_(weights["router"])
    mlps = list(block.experts) + ([block.shared_expert] if shared else [])
    for mlp, (gate, up, down) in zip(mlps, weights["experts"] + [weights["shared"]]):
        mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, gate, 0)
        mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, up, 1)
        mlp.down_proj.weight_loader(mlp.down_proj.weight, down)
    if gated:
        block.shared_expert_gate.weight.data.copy_(weights["shared_gate"])
    return block.requires_grad_(False)


def moe_ref(x: torch.Tensor, weights: dict, *, shared: bool = False, gated: bool = False,
            renormalize: bool = True, shard: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """Token by token: softmax router, top-k, (renormalize), weighted SwiGLU experts, shared
    expert; ``shard = (rank, size)`` keeps that rank's slice of every expert's width (its partial)."""
    rank, size = shard

    def mlp(v, gate, up, down):
        n = gate.shape[0] // size
        cols = slice(rank * n, (rank + 1) * n)
        return down[:, cols] @ (F.silu(gate[cols] @ v) * (up[cols] @ v))

    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        p = torch.softmax(weights["router"] @ x[t], dim=-1)
        top = torch.topk(p, K)
        w = top.values / top.values.sum() if renormalize else top.values
        for wj, e in zip(w, top.indices.tolist()):
            out[t] += wj * mlp(x[t], *weights["experts"][e])
        if shared:
            s = mlp(x[t], *weights["shared"])
            out[t] += torch.sigmoid(weights["shared_gate"][0] @ x[t]) * s if gated else s
    return out


# -- the block ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shared, gated, renormalize", [(False, False, False), (False, False, True),
                                                         (True, False, True), (True, True, False)])
def test_block_matches_the_formula_and_its_handoff_completes_once(shared, gated, renormalize):
    wts = _weights()
    block = _block(GroupInfo.solo(), wts, shared=shared, gated=gated, renormalize=renormalize)
    x = rand(T, H, seed=1)
    want = moe_ref(x, wts, shared=shared, gated=gated, renormalize=renormalize)
    torch.testing.assert_close(block(x), want, rtol=1e-12, atol=1e-12)

    flags = get_forward()
    saved = flags.snapshot()
    flags.restore((False, False, True))
    try:
        handoff = block(x)
    finally:
        flags.restore(saved)
    assert isinstance(handoff, HandoffOutput) and handoff.num_tokens == T and not handoff.completed
    p = handoff.payload
    assert p["expert_out"].shape == (T, K, H) and p["topk_weights"].shape == (T, K)
    assert p["topk_ids"].shape == (T, K) and (p["shared_out"] is not None) == shared
    torch.testing.assert_close(handoff.complete(), want, rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError, match="exactly once"):
        handoff.complete()


def test_block_sums_once_unless_a_flag_takes_the_sum(fake_dist):
    """On a group of two the block returns this rank's partial; the one all-reduce runs in the
    block unless ``fuse_mlp_allreduce`` or ``mlp_reduce_scatter`` leaves it to the boundary."""
    wts = _weights()
    block = _block(fake_topology().moe_out, wts, shared=True)
    x = rand(T, H, seed=1)
    partial = moe_ref(x, wts, shared=True, shard=(0, 2))
    flags = get_forward()
    saved = flags.snapshot()
    try:
        for values, summed in (((False, False, False), True), ((True, False, False), False),
                               ((False, True, False), False)):
            flags.restore(values)
            before = len(fake_dist.calls)
            y = block(x)
            assert len(fake_dist.calls) - before == int(summed)
            torch.testing.assert_close(y, partial * (2 if summed else 1), rtol=1e-12, atol=1e-12)
    finally:
        flags.restore(saved)


# -- exit decisions -------------------------------------------------------------------------------


def _stages(topology, *, sparse=True, provider=None, terminal=False, ffn_kw=None):
    opts = {"fusions": provider} if provider is not None else {}
    return make_stages(
        (declare_attn(), make_norm(H, F64), opts),
        (declare_ffn(sparse=sparse, **(ffn_kw or {})), make_norm(H, F64, seed=1), opts),
        terminal=terminal, following=None if terminal else declare_attn(), topology=topology,
    )


def _ffn_input(stages, fb, x):
    a, f = stages
    rb.start(fb)
    inp = a.prepare(x, fb)
    return f.prepare(a.finish(inp * 0.5, fb), fb)


@pytest.mark.parametrize("case, want", [
    ("solo", (False, True)),  # one rank: no sum to defer, but the finalize may wait
    ("tp2", (True, True)),  # a deferred finalize carries the sum that follows it
    ("tp2-terminal", (True, True)),  # the final norm takes both
    ("tp2-declines", (False, False)),
    ("tp2-dense", (False, False)),  # a dense FFN has no finalize to defer
    ("tp2-dp2", (False, False)),  # under DP the output returns to its rows at finish()
    ("tp2-scattered", (False, False)),  # ... and to its slice in the input-scattered variant
])
def test_exit_publishes_defer_moe_finalize_only_where_it_is_allowed(fake_dist, case, want):
    topo = Topology.single() if case == "solo" else fake_topology(attn_dp=2 if "dp2" in case else 1)
    provider = Provider(finalize="declines" not in case)
    stages = _stages(topo, sparse="dense" not in case, provider=provider, terminal="terminal" in case)
    counts = (T, T) if "dp2" in case else None
    fb = ForwardBatch(num_tokens=T, dp_num_tokens=counts, input_scattered="scattered" in case)
    if "scattered" in case or "dp2" in case:
        rb.start(fb)  # the decision does not depend on the input; no rows are moved here
    else:
        _ffn_input(stages, fb, rand(T, H))
    with stages[1].exit(fb) as out:
        seen = (get_forward().fuse_mlp_allreduce, get_forward().defer_moe_finalize)
    assert seen == (out.fuse_mlp_allreduce, out.defer_moe_finalize) == want
    assert provider.asked.count("finalize") == 1  # asked once, on every FFN exit


# -- consumers ------------------------------------------------------------------------------------


class Layer:
    """Attention + sparse FFN (the real block on a fake TP group of two) that returns a handoff,
    and the expected numbers: residual ``r``, this rank's finalized partial ``p`` (the sum
    doubles it)."""

    def __init__(self, fake, *, terminal=False, ffn_kw=None, provider=True):
        fake.calls.clear()  # count this layer's sums only
        self.topo = fake_topology()
        self.wts = _weights()
        self.block = _block(self.topo.moe_out, self.wts, shared=True)
        self.stages = _stages(self.topo, provider=Provider(finalize=provider), terminal=terminal,
                              ffn_kw=ffn_kw)
        self.fb = ForwardBatch.for_tokens(T)
        x = rand(T, H, seed=3)
        # The attention's output (half its input) is summed over the fake group: it doubles.
        self.r = x + 2 * (rms64(x, self.stages[0].plan.read.norm.weight) * 0.5)
        inp = _ffn_input(self.stages, self.fb, x.clone())
        assert len(fake.calls) == 1  # the attention's partial sum, completed at the FFN input
        self.p = moe_ref(inp, self.wts, shared=True, shard=(0, 2))
        with self.stages[1].exit(self.fb) as out:
            y = self.block(inp)
        self.handoff = y
        self.h = out.finish(y)
        if provider:
            assert len(fake.calls) == 1, "nothing may be summed before the finalize runs"


def test_next_input_completes_the_finalize_then_the_sum_then_adds_and_reads(fake_dist):
    layer = Layer(fake_dist)
    assert isinstance(layer.handoff, HandoffOutput) and isinstance(layer.h, OwedOutput)
    assert "a producer finalize" in repr(layer.h) and "MOE_OUTPUT" in repr(layer.h)
    norm = make_norm(H, F64, seed=2)
    (nxt,) = make_stages((declare_attn(), norm), previous=declare_ffn(sparse=True), topology=layer.topo)
    x = nxt.prepare(layer.h, layer.fb)
    assert layer.handoff.completed and len(fake_dist.calls) == 2  # one sum, after the finalize
    r = layer.r + 2 * layer.p
    torch.testing.assert_close(layer.fb.residual_stream.residual, r, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x, rms64(r, norm.weight), rtol=1e-12, atol=1e-12)


def test_an_input_built_for_a_dense_producer_refuses_the_handoff(fake_dist):
    layer = Layer(fake_dist)
    (nxt,) = make_stages((declare_attn(), make_norm(H, F64)), previous=declare_ffn(), topology=layer.topo)
    with pytest.raises(BoundaryError, match="a producer finalize"):
        nxt.prepare(layer.h, layer.fb)
    assert not layer.handoff.completed and len(fake_dist.calls) == 1


def test_final_norm_completes_the_handoff_unfused_and_may_capture(fake_dist):
    layer = Layer(fake_dist, terminal=True)
    final, rec = make_norm(H, F64, seed=4), Recorder()
    out = rb.norm(layer.h, layer.fb, final, capture_output=rec)
    r = layer.r + 2 * layer.p
    assert layer.handoff.completed and len(fake_dist.calls) == 2
    torch.testing.assert_close(out, rms64(r, final.weight), rtol=1e-12, atol=1e-12)
    ((captured, owned),) = rec.calls
    torch.testing.assert_close(captured, r, rtol=1e-12, atol=1e-12)
    assert not owned and layer.fb.residual_stream.released


class Service:
    """A ``handoff_norm`` service written out: finalize, all-reduce (doubling, as the fake
    group does), add, Gemma RMSNorm; records its calls."""

    def __init__(self):
        self.calls = 0

    def finalize(self, handoff, residual, gamma):
        self.calls += 1
        p = handoff.payload
        y = (p["expert_out"] * p["topk_weights"][..., None]).sum(1) + p["shared_out"]
        return rms64(residual + 2 * y, gamma, offset=1.0)


def test_final_norm_with_handoff_norm_fuses_and_the_finalize_never_runs_twice(fake_dist):
    layer = Layer(fake_dist, terminal=True)
    final, service = make_norm(H, F64, gemma=True, seed=4), Service()
    out = rb.norm(layer.h, layer.fb, final, handoff_norm=service)
    assert service.calls == 1 and len(fake_dist.calls) == 1  # the service did the sum
    assert layer.handoff.completed  # consumed by the service: complete() would now raise
    with pytest.raises(RuntimeError, match="already completed"):
        layer.handoff.complete()
    torch.testing.assert_close(out, rms64(layer.r + 2 * layer.p, final.weight, offset=1.0),
                               rtol=1e-12, atol=1e-12)
    assert layer.fb.residual_stream.released


def test_handoff_norm_refuses_capture_and_is_bypassed_where_it_cannot_apply(fake_dist):
    layer = Layer(fake_dist, terminal=True)
    with pytest.raises(BoundaryError, match="capture_output"):
        rb.norm(layer.h, layer.fb, make_norm(H, F64, gemma=True), handoff_norm=Service(),
                capture_output=Recorder())
    assert not layer.fb.residual_stream.released  # refused before it changed the stream
    # An output transform must run on the finalized output before the add: the fused service
    # cannot, so the handoff completes unfused (and the service is never called).
    half = OutputTransform(lambda v: v / 2)
    layer = Layer(fake_dist, terminal=True, ffn_kw={"output_transform": half})
    final, service = make_norm(H, F64, gemma=True, seed=4), Service()
    out = rb.norm(layer.h, layer.fb, final, handoff_norm=service)
    assert service.calls == 0 and layer.handoff.completed
    torch.testing.assert_close(out, rms64(layer.r + layer.p, final.weight, offset=1.0),
                               rtol=1e-12, atol=1e-12)
    # A nonlinear update adds differently than the service would: unfused too.
    layer = Layer(fake_dist, terminal=True, ffn_kw={"update": HalfSkip()})
    service = Service()
    out = rb.norm(layer.h, layer.fb, final, handoff_norm=service)
    assert service.calls == 0 and layer.handoff.completed
    torch.testing.assert_close(out, rms64(layer.r / 2 + 2 * layer.p, final.weight, offset=1.0),
                               rtol=1e-12, atol=1e-12)


def test_accessors_on_a_handoff(fake_dist):
    layer = Layer(fake_dist)
    with pytest.raises(BoundaryError, match="snapshot"):
        rb.snapshot(layer.h, layer.fb)
    with pytest.raises(BoundaryError, match="handoff"):
        layer.stages[1].capture_output(layer.h, layer.fb)
    assert not layer.handoff.completed and len(fake_dist.calls) == 1
    # complete_output runs the unfused finalize and the sum, once; the update stays pending.
    h = rb.complete_output(layer.h, layer.fb)
    assert isinstance(h, torch.Tensor) and layer.handoff.completed and len(fake_dist.calls) == 2
    torch.testing.assert_close(h, 2 * layer.p, rtol=1e-12, atol=1e-12)
    snap = rb.snapshot(h, layer.fb)
    torch.testing.assert_close(snap, layer.r + 2 * layer.p, rtol=1e-12, atol=1e-12)
    with pytest.raises(BoundaryError, match="does not belong"):
        rb.complete_output(layer.h, layer.fb)  # the old handle went stale
    assert len(fake_dist.calls) == 2


def test_to_pp_completes_the_handoff_and_its_sum_before_sending(fake_dist):
    layer = Layer(fake_dist)
    sent = rb.to_pp(layer.h, layer.fb)
    assert layer.handoff.completed and len(fake_dist.calls) == 2
    assert sent[rb.PP_META].tolist() == [2, 0]  # pending, nothing left for the receiver to sum
    torch.testing.assert_close(sent["output"], 2 * layer.p, rtol=1e-12, atol=1e-12)


def test_returning_a_handoff_without_defer_moe_finalize_fails_in_finish(fake_dist):
    layer = Layer(fake_dist, provider=False)
    assert isinstance(layer.h, torch.Tensor)  # the block finalized and summed in compute
    assert len(fake_dist.calls) == 2
    torch.testing.assert_close(layer.h, 2 * layer.p, rtol=1e-12, atol=1e-12)
    # A handoff returned anyway (compute ignored the flag) is refused in finish().
    a, f = _stages(layer.topo, provider=Provider(finalize=False))
    fb = ForwardBatch.for_tokens(T)
    inp = _ffn_input((a, f), fb, rand(T, H))
    with f.exit(fb) as out:
        assert not out.defer_moe_finalize
        handoff, runs = counted_handoff(inp)
    with pytest.raises(BoundaryError, match="did not publish defer_moe_finalize"):
        out.finish(handoff)
    assert runs == []


def test_returning_a_completed_handoff_fails_in_finish(fake_dist):
    a, f = _stages(fake_topology(), provider=Provider(finalize=True))
    fb = ForwardBatch.for_tokens(T)
    inp = _ffn_input((a, f), fb, rand(T, H))
    with f.exit(fb) as out:
        handoff, runs = counted_handoff(inp)
        handoff.complete()
    with pytest.raises(BoundaryError, match="already ran"):
        out.finish(handoff)
    assert runs == [1]
