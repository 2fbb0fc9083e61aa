"""Whole reference decoders under ``torch.compile(fullgraph=True)`` on 2 and 4 gloo ranks: the
logits are the eager forward's bits, the forward is one graph (no break), and the graph holds
exactly the collectives the eager forward calls (see ``compile_cases``)."""

from __future__ import annotations

import pytest

from layer_boundary_app.launch import spawn

import compile_cases

pytestmark = pytest.mark.slow

CASES = {
    2: [
        dict(tp=2),  # tensor parallel, deferred sums fused into the next read
        dict(tp=2, dp=2),  # attention DP, the policy's return
        dict(tp=2, dp=2, reduction="rs"),
        dict(tp=2, input_scattered=True),
        dict(tp=2, cp=2),  # context-parallel prefill
        dict(tp=1, pp=2),  # two pipeline stages (the transfer stays eager)
        dict(tp=2, moe=True, defer_moe_finalize=True),  # owed finalize handles
        dict(tp=2, moe=True, fused_finalize=True),  # ... completed by the finalize fusion
        dict(tp=2, residual="mhc"),
        dict(tp=2, tbo=True, moe=True),  # two-batch overlap
        dict(tp=2, longcat=True, defer_moe_finalize=True),  # branches
        dict(tp=2, pattern="M-M*-"),  # the heterogeneous stack with mixers
    ],
    4: [
        dict(tp=4, dp=2, reduction="rs+rsv"),
        dict(tp=4, dp=4),
        dict(tp=2, pp=2),
        dict(tp=4, cp=2),
        dict(tp=4, input_scattered=True),
    ],
}


@pytest.mark.parametrize("world", [2, 4], ids=["2ranks", "4ranks"])
def test_compiled_layouts_equal_eager_with_the_same_collectives(world):
    per_rank = spawn(compile_cases.run_cases, world, args=(CASES[world],), timeout_s=600)
    for rank, rows in enumerate(per_rank):
        for row in rows:
            case = row["case"]
            assert "error" not in row, f"rank {rank} {case}:\n{row.get('error')}"
            assert row["equal"], f"rank {rank} {case}: compiled logits differ from eager"
            assert row["graphs"] == 1, f"rank {rank} {case}: {row['graphs']} graphs (a recompile)"
            assert row["graph_collectives"] == row["eager_collectives"], (rank, case, row)
    # The layouts that move rows put their collectives in the graph at all (a count of 0 = 0
    # would pass without tracing one).
    assert per_rank[0][0]["graph_collectives"] > 0
