"""Each batch variant's row movement is one ``BatchRows`` object, bound to the plan at construction.

One process, fake groups: which class each stage's path holds on each topology, what it says
about its moves (the facts the exit scope, LoRA rows and fusion providers read), and that the
entry and the exit of one variant share one object.
"""

from __future__ import annotations

import pytest

from layer_boundary import BatchVariant, RMSNorm, declare_attn, declare_ffn, make_stages
from layer_boundary._batch_rows import BatchRows, OrdinaryRows
from layer_boundary._context import BoundaryContext
from layer_boundary._cp import CpRows
from layer_boundary._dp import AttentionDpRows
from layer_boundary._scatter import ScatteredRows

from cp_cases import fake_cp_topology
from helpers import fake_topology

H = 4


def layer(topology, **ctx):
    context = BoundaryContext(topology, **ctx) if ctx else None
    kw = {"context": context} if context is not None else {"topology": topology}
    return make_stages((declare_attn(), RMSNorm(H)), (declare_ffn(), RMSNorm(H)), **kw)


def rows_of(boundary, variant):
    entry, exit_ = boundary.plan.entries[variant], boundary.plan.exits[variant]
    assert entry.rows is exit_.rows, "a variant's entry and exit share one BatchRows"
    assert isinstance(entry.rows, BatchRows)
    return entry.rows


def test_one_rank_moves_nothing():
    a, f = make_stages((declare_attn(), RMSNorm(H)), (declare_ffn(), RMSNorm(H)))
    for b in (a, f):
        rows = rows_of(b, BatchVariant.ORDINARY)
        assert type(rows) is OrdinaryRows and not rows.agree_counts
        assert rows.output_return is None and not rows.reduce_scatters and rows.input_move is None


def test_tensor_parallel_ordinary_and_sequence_parallel():
    a, f = layer(fake_topology(tp=2))
    for b in (a, f):
        rows = rows_of(b, BatchVariant.ORDINARY)
        assert type(rows) is OrdinaryRows and rows.agree_counts  # every TP rank computes the same rows
    sa, sf = rows_of(a, BatchVariant.SEQUENCE_PARALLEL), rows_of(f, BatchVariant.SEQUENCE_PARALLEL)
    assert type(sa) is type(sf) is ScatteredRows and sa.sliced_residual and sf.sliced_residual
    assert (sa.input_move, sa.every_group_input, sa.output_return) == ("group", False, None)
    assert (sf.input_move, sf.every_group_input, sf.output_return) == ("all", True, "scatter")
    assert sf.reduce_scatters and not sa.reduce_scatters


@pytest.mark.parametrize("policy, chosen", [("ar", "ar"), ("rs", "rs"), ("auto", None)])
def test_attention_dp_binds_the_policy_return_once(policy, chosen):
    a, f = layer(fake_topology(tp=2, attn_dp=2), reduction=policy)
    ra, rf = rows_of(a, BatchVariant.ORDINARY), rows_of(f, BatchVariant.ORDINARY)
    assert type(ra) is type(rf) is AttentionDpRows
    assert ra.input_move is None and ra.output_return is None and not ra.every_group_input
    assert rf.input_move == "join" and rf.every_group_input  # a plain add joins the attention sum
    assert rf.output_return in ("ar", "rs", "rsv")
    if chosen is not None:
        assert rf.output_return == chosen
    assert rf.reduce_scatters == (rf.output_return != "ar")


def test_context_parallel_gathers_the_ffn_input_and_returns_its_output():
    a, f = layer(fake_cp_topology(tp=2, cp=2))
    ca, cf = rows_of(a, BatchVariant.CP), rows_of(f, BatchVariant.CP)
    assert type(ca) is type(cf) is CpRows
    assert (ca.input_move, ca.token_gather, ca.output_return) == ("local", False, None)
    assert (cf.input_move, cf.token_gather, cf.output_return) == ("gather", True, "cp")
    assert cf.output_group is not None and cf.output_group.size == 2
    assert type(rows_of(a, BatchVariant.ORDINARY)) is OrdinaryRows


def test_the_base_interface_refuses_a_return_it_does_not_make():
    with pytest.raises(AssertionError, match="returns no output rows"):
        OrdinaryRows().give_back(None, None, None, None)
