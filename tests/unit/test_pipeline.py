"""Pipeline handoff on one process: ``residual_batch.to_pp()`` and ``StageBoundary.from_pp()``.

The multi-rank cases (transport over send/recv, a partial sum crossing the pipeline, Qwen3 over
tp x pp) are in test_parallel.py; these check the stream rules without processes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from layer_boundary import (
    BoundaryContext,
    BoundaryError,
    ForwardBatch,
    Topology,
    declare_attn,
    declare_ffn,
    make_stages,
)
from layer_boundary.residual import batch as residual_batch
from layer_boundary.residual._stream import ResidualStream

import parallel_cases


def _stack(kinds: str, previous=None, terminal=True):
    ctx = BoundaryContext(Topology.single())
    stages = [parallel_cases.LinStage(k, j, ctx.topology) for j, k in enumerate(kinds)]
    items = [(parallel_cases._lin_decl(k), nn.Identity()) for k in kinds]
    return stages, make_stages(*items, previous=previous, terminal=terminal, context=ctx)


def test_single_process_round_trip_equals_the_whole_stack():
    x = parallel_cases.dyadic((4, parallel_cases.H), 3)
    want = parallel_cases.linear_pipeline(Topology.single(), "AFAF", 2, x)["value"]
    # Partition after the first A F: stage 0 ends on an FFN, stage 1 starts with previous=FFN.
    s0 = [parallel_cases.LinStage(k, j, Topology.single()) for j, k in enumerate("AFAF")]
    b0 = make_stages(*[(parallel_cases._lin_decl(k), nn.Identity()) for k in "AF"], previous=None,
                     context=BoundaryContext(Topology.single()))
    b1 = make_stages(*[(parallel_cases._lin_decl(k), nn.Identity()) for k in "AF"], previous=declare_ffn(),
                     terminal=True, context=BoundaryContext(Topology.single()))
    fb = ForwardBatch(num_tokens=4)
    residual_batch.start(fb)
    h = x.clone()
    for s, b in zip(s0[:2], b0):
        h = s.run(b, h, fb)
    tensors = residual_batch.to_pp(h, fb)
    assert fb.residual_stream.released
    assert set(tensors) == {"residual", "output", "meta"} and tensors["meta"].tolist() == [2, 0]
    fb2 = ForwardBatch(num_tokens=4)
    h = b1[0].from_pp(tensors, fb2)
    for s, b in zip(s0[2:], b1):
        h = s.run(b, h, fb2)
    assert torch.equal(residual_batch.norm(h, fb2, nn.Identity()), want)


def test_initial_stream_at_a_stage_with_previous_says_call_from_pp():
    stages, (attn, _) = _stack("AF", previous=declare_ffn())
    fb = ForwardBatch(num_tokens=2)
    residual_batch.start(fb)
    with pytest.raises(BoundaryError, match="from_pp"):
        attn.prepare(torch.zeros(2, parallel_cases.H, dtype=torch.float64), fb)


def test_from_pp_at_stack_entry_is_refused():
    _, (attn, _) = _stack("AF", previous=None)
    tensors = {"residual": torch.zeros(2, 8), "meta": torch.tensor([1, 0])}
    with pytest.raises(BoundaryError, match="previous=None"):
        attn.from_pp(tensors, ForwardBatch(num_tokens=2))


def test_to_pp_releases_the_stream_when_it_raises():
    fb = ForwardBatch(num_tokens=2)
    residual_batch.start(fb)
    stream, handle = ResidualStream.arrive(residual=torch.ones(2, 8), output=torch.ones(2, 8))
    fb.residual_stream = stream
    with pytest.raises(BoundaryError, match="not the object the last boundary call returned"):
        residual_batch.to_pp(torch.ones(2, 8), fb)  # a rebound tensor, not the handle
    assert stream.released and stream.pending is None


def test_to_pp_refuses_a_nonlinear_update_and_releases():
    class Gated:  # a stand-in nonlinear update (MHC-like)
        name = "gated"
        plain_add = False
        at_producer = False

        def apply(self, residual, contribution):
            return residual * torch.sigmoid(contribution)

    fb = ForwardBatch(num_tokens=2)
    stream, handle = ResidualStream.arrive(residual=torch.ones(2, 8), output=torch.ones(2, 8), update=Gated())
    fb.residual_stream = stream
    with pytest.raises(BoundaryError, match="not supported across pipeline stages yet"):
        residual_batch.to_pp(handle, fb)
    assert stream.released


def test_to_pp_keeps_a_static_sum_and_from_pp_checks_previous():
    """On one rank no sum is ever owed; a metadata claim of a partial sum over a group of 2
    against this single-rank topology is refused (layouts differ), and a partial sum at a stage
    whose previous is an FFN is refused too."""
    _, (ffn,) = _stack("F", previous=declare_attn())
    tensors = {"output": torch.zeros(2, 8), "residual": torch.zeros(2, 8),
               "meta": torch.tensor([2, 1, 0, 2])}
    with pytest.raises(BoundaryError, match="same tensor-parallel layout"):
        ffn.from_pp(tensors, ForwardBatch(num_tokens=2))
