"""Batch-variant selection on a (fake) two-rank topology: which stages have which paths, the
fixed priority order, and the spec's error for an unsupported active variant."""

from __future__ import annotations

import pytest
import torch

from layer_boundary import (
    BatchVariant,
    ForwardBatch,
    ProducerReduction,
    RMSNorm,
    declare_attn,
    declare_ffn,
    make_stages,
)
from layer_boundary._forward import active_variant
from layer_boundary._errors import NO_PATH
from layer_boundary.residual import batch as rb

from helpers import fake_topology, raises_exact


def test_priority_order_is_sequence_parallel_then_scattered_then_cp():
    fb = ForwardBatch(num_tokens=1, sequence_parallel=True, input_scattered=True, context_parallel=True)
    assert active_variant(fb) is BatchVariant.SEQUENCE_PARALLEL
    fb.sequence_parallel = False
    assert active_variant(fb) is BatchVariant.INPUT_SCATTERED
    fb.input_scattered = False
    assert active_variant(fb) is BatchVariant.CP
    fb.context_parallel = False
    assert active_variant(fb) is BatchVariant.ORDINARY


def test_scattered_paths_exist_only_with_attention_tp():
    a, f = make_stages((declare_attn(), RMSNorm(4)), (declare_ffn(), RMSNorm(4)), topology=fake_topology(tp=2))
    assert BatchVariant.INPUT_SCATTERED in a.plan.variants and BatchVariant.INPUT_SCATTERED in f.plan.variants
    a1, = make_stages((declare_attn(), RMSNorm(4)))
    assert a1.plan.variants == (BatchVariant.ORDINARY,)


def test_a_mixer_that_does_not_gather_its_input_has_no_scattered_path():
    mixer = declare_attn(reduction=ProducerReduction.SCOPED, gathers_tp_input=False)
    m, = make_stages((mixer, RMSNorm(4)), following=declare_ffn(), topology=fake_topology(tp=2))
    assert BatchVariant.INPUT_SCATTERED not in m.plan.variants
    fb = ForwardBatch(num_tokens=2, input_scattered=True)
    rb.start(fb)
    with raises_exact(RuntimeError, NO_PATH.format(variant="INPUT_SCATTERED")):
        m.prepare(torch.randn(2, 4), fb)


# CP needs a CP group; sequence parallel is refused under attention DP (see tests/multi_rank/test_cp.py and
# tests/multi_rank/test_sequence_parallel.py for the topologies that have them).
@pytest.mark.parametrize("flag,name,dp", [("context_parallel", "CP", 1), ("sequence_parallel", "SEQUENCE_PARALLEL", 2)])
def test_variants_without_a_path_raise_on_two_ranks_too(flag, name, dp):
    a, _ = make_stages((declare_attn(), RMSNorm(4)), (declare_ffn(), RMSNorm(4)),
                       topology=fake_topology(tp=2, attn_dp=dp))
    fb = ForwardBatch(num_tokens=2, **{flag: True})
    rb.start(fb)
    with raises_exact(RuntimeError, NO_PATH.format(variant=name)):
        a.prepare(torch.randn(2, 4), fb)


def test_topology_refuses_a_tp_group_out_of_dp_order():
    from layer_boundary import GroupInfo, Topology

    solo = GroupInfo.solo()
    g = object()
    # Global ranks 0..3: attention DP rank 1, attention TP rank 0 must be TP rank 2, not 1.
    with pytest.raises(ValueError, match="order the TP group"):
        Topology(tp=GroupInfo((0, 1, 2, 3), 1, g), attn_tp=GroupInfo((1, 3), 0, g),
                 attn_dp=GroupInfo((0, 1), 1, g), attn_cp=solo, moe_out=GroupInfo((0, 1, 2, 3), 1, g), pp=solo)
