"""The LoRA adapter hook: ``boundary.input_rows(forward_batch)`` says which tokens the rows of the
selected compute input are, in every batch variant.

One process, fake groups: the descriptor of each path (no communication). Multi-process on gloo
(the shared spawn of ``capture_cases``): a stack whose column-parallel projections add a per-token
LoRA, with adapter indices mapped through the descriptor, is bitwise the single-rank stack on
every variant; a wrong row mapping would apply another token's adapter.
"""

from __future__ import annotations

import pytest
import torch

from helpers import fake_topology, make_norm, raises_exact
from layer_boundary import BoundaryError, ForwardBatch, declare_attn, declare_ffn, make_stages
from layer_boundary._adapters import InputRows, RowKind
from layer_boundary._errors import NO_PATH
from layer_boundary._layout import BatchVariant

import capture_cases

H = 8
F64 = torch.float64


def layer(topology=None):
    return make_stages((declare_attn(), make_norm(H, F64)), (declare_ffn(), make_norm(H, F64, seed=1)),
                       topology=topology)


def test_one_rank_rows_are_the_local_rows():
    attn, ffn = layer()
    fb = ForwardBatch.for_tokens(5)
    for stage in (attn, ffn):
        rows = stage.input_rows(fb)
        assert isinstance(rows, InputRows)
        assert rows.kind is RowKind.LOCAL and rows.variant is BatchVariant.ORDINARY
        assert rows.num_rows == 5 and rows.residual_rows == (0, 5)
        assert rows.spans() == ((0, 0, 5),)
        assert torch.equal(rows.token_index(), torch.arange(5))
        ids = torch.tensor([2, 0, 1, 1, 2])
        assert rows.gather(ids) is ids and rows.select(ids) is ids


def test_under_attention_dp_the_ffn_input_holds_every_group():
    attn, ffn = layer(fake_topology(tp=2, attn_dp=2))  # this process is DP rank 0
    fb = ForwardBatch(num_tokens=3, dp_num_tokens=(3, 5))
    ids_all = torch.arange(8) * 10
    a = attn.input_rows(fb)
    assert a.kind is RowKind.LOCAL and a.num_rows == 3 and a.local_rows == 3
    assert torch.equal(a.select(ids_all), ids_all[:3])
    f = ffn.input_rows(fb)
    assert f.kind is RowKind.ALL_GROUPS and f.num_rows == 8
    assert f.spans() == ((0, 0, 3), (1, 3, 5))
    assert torch.equal(f.token_index(), torch.arange(8))
    assert f.select(ids_all) is ids_all
    assert f.residual_rows == (0, 3)  # the FFN output returns to this group's rows


def test_input_scattered_residual_is_a_slice():
    attn, ffn = layer(fake_topology(tp=2))  # attention-TP rank 0 of 2
    fb = ForwardBatch(num_tokens=5, input_scattered=True)
    for stage in (attn, ffn):
        rows = stage.input_rows(fb)
        assert rows.variant is BatchVariant.INPUT_SCATTERED
        assert rows.kind is RowKind.LOCAL and rows.num_rows == 5  # one DP group: all its rows
        assert rows.residual_rows == (0, 3)  # slice rows ceil(5 / 2) = 3


def test_errors():
    attn, ffn = layer(fake_topology(tp=2, attn_dp=2))
    with pytest.raises(BoundaryError, match="dp_num_tokens"):
        ffn.input_rows(ForwardBatch(num_tokens=3))
    with pytest.raises(BoundaryError, match="dp_num_tokens"):
        ffn.input_rows(ForwardBatch(num_tokens=4, dp_num_tokens=(3, 5)))
    rows = ffn.input_rows(ForwardBatch(num_tokens=3, dp_num_tokens=(3, 5)))
    with pytest.raises(ValueError, match="every DP group"):
        rows.select(torch.zeros(3))
    with pytest.raises(ValueError, match="this DP group"):
        rows.gather(torch.zeros(8))
    single_attn, _ = layer()
    with raises_exact(BoundaryError, NO_PATH.format(variant="INPUT_SCATTERED")):
        single_attn.input_rows(ForwardBatch(num_tokens=2, input_scattered=True))


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def runs(request):
    world = request.param
    return world, [r["lora"] for r in capture_cases.results(world)]


@pytest.mark.slow
def test_lora_stack_is_bitwise_the_single_rank_stack(runs):
    world, per_rank = runs
    variants = set()
    for rank, results in enumerate(per_rank):
        assert len(results) == len(capture_cases.LORA[world])
        for r in results:
            case = r["case"]
            assert r["equal"], (rank, case)
            counts, dp, d = case["counts"], case.get("dp", 1), r["dp_rank"]
            for entry in r["log"]:
                every = entry["stage"] == "ffn" and dp > 1
                variants.add((entry["stage"], every, bool(case.get("scattered"))))
                assert entry["kind"] == ("all_groups" if every else "local"), (rank, case, entry)
                assert entry["num_rows"] == entry["input_rows"] == (sum(counts) if every else counts[d])
                assert entry["select_equal"] and entry["index_equal"], (rank, case, entry)
                if case.get("scattered"):
                    s = -(-max(counts) // r["attn_tp"])
                    lo = r["attn_tp_rank"] * s
                    assert entry["residual_rows"] == (min(lo, counts[d]), min(lo + s, counts[d]))
                else:
                    assert entry["residual_rows"] == (0, counts[d])
    # Local and every-group inputs, in the ordinary and the input-scattered variant.
    assert {("attn", False, False), ("ffn", False, False), ("attn", False, True),
            ("ffn", False, True)} <= variants or world == 4
    assert ("ffn", True, False) in variants
    if world == 4:
        assert ("ffn", True, True) in variants


def test_rows_that_are_not_the_groups_count_are_named_before_the_collective():
    # A trial: an attention output (or stage input) with another row count than dp_num_tokens gives
    # this group failed inside the row move as torch's copy error (and as a size mismatch in gloo
    # on the other ranks).
    from layer_boundary._dp import DpRows

    rows = DpRows((3, 5), fake_topology(tp=2, attn_dp=2))  # this process: DP rank 0, 3 rows
    for move, what in ((lambda x: rows.gather(x), "the stage input"),
                       (lambda x: rows.joined_sum(x, None), "the attention output")):
        with pytest.raises(BoundaryError, match=rf"{what} has 4 rows, but ForwardBatch.dp_num_tokens gives "
                                                r"this DP group \(rank 0\) 3"):
            move(torch.zeros(4, 8))
