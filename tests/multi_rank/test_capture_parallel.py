"""Capture and extra contributions on every parallel layout, against the single-rank stack.

On gloo with 2 and 4 ranks (one spawn per world size, shared with test_lora_rows.py and
test_draft_stack.py through ``capture_cases.results``), the synthetic stack takes, per layer:
``prepare(capture_output=, captured_last_layer_outputs=)``, ``snapshot()`` of a static attention
sum and of a (deferred) FFN sum, ``capture_output()`` of a static sum (on a copy) and of a dynamic
one (on the main output), ``add_to_output()`` of deepstack extras, ``complete_output()``,
``fold()`` then ``written()``, and ``norm(capture_output=)`` at the end; split prefill runs it in
segments. Layouts: TP, TP + attention DP with every reduction policy, input-scattered (with and
without DP), pipeline, and TP with a consumer fusion candidate that updates the residual in place. Dyadic float64 data and an exact
read make every value bitwise equal to the single-rank one on this rank's rows.
"""

from __future__ import annotations

import pytest

import capture_cases

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def runs(request):
    world = request.param
    return world, [r["capture"] for r in capture_cases.results(world)]


def test_every_capture_is_bitwise_the_single_rank_value(runs):
    world, per_rank = runs
    for rank, results in enumerate(per_rank):
        assert len(results) == len(capture_cases.CAPTURE[world])
        for r in results:
            case = r["case"]
            bad = sorted(k for k, ok in r["equal"].items() if not ok)
            assert bad == [], (rank, case, bad)
            assert r["missing"] == [], (rank, case, r["missing"])
            layers = r["equal"].keys()
            assert any(k.startswith("cap") for k in layers), (rank, case)
            if r["pp_rank"] == case.get("pp", 1) - 1:
                assert {"final", "capF"} <= set(layers)


def test_every_layout_and_helper_was_covered(runs):
    """A guard on the matrix itself: each layout kind and each helper ran somewhere."""
    world, per_rank = runs
    cases = [r["case"] for r in per_rank[0]]
    assert any(c.get("scattered") for c in cases)
    assert any(c.get("pp", 1) > 1 for c in cases)
    assert any(c.get("provider") == "fused" for c in cases)
    assert any(c.get("segments") for c in cases)
    if world == 2:
        assert {c["policy"] for c in cases if c.get("dp", 1) > 1} == {"ar", "rs", "rsv", "rs+rsv"}
    kinds = {k.rstrip("0123456789") for r in per_rank[0] for k in r["equal"]}
    assert kinds >= {"cap", "col", "snapA", "snapF", "copyF", "copyA", "fold", "final", "capF"}


def test_split_prefill_keeps_the_stream_until_the_last_segment(runs):
    """Start in the first segment, complete in the last: between segments the batch's stream is
    live, after the final norm (or to_pp) it is released."""
    world, per_rank = runs
    for rank, results in enumerate(per_rank):
        for r in results:
            case = r["case"]
            assert r["released"], (rank, case)
            assert not any(r["between"]), (rank, case)
            if case.get("pp", 1) == 1:
                assert len(r["between"]) == len(case.get("segments", ())) + 1


def test_a_captured_input_completes_its_sum_unfused(runs):
    """With a consumer candidate that sums into the residual in place: an input that captures
    takes the unfused path (the candidate does not run there); every other owed input fuses.
    Every capture still equals the single-rank value (checked above), so none was overwritten."""
    world, per_rank = runs
    seen = 0
    for rank, results in enumerate(per_rank):
        for r in results:
            case = r["case"]
            if case.get("provider") != "fused":
                assert r["runs"] is None
                continue
            seen += 1
            n, every = case["layers"], case["capture_every"]
            # Every FFN input owes the attention sum; attention inputs after layer 0 owe the
            # deferred FFN sum and fuse only where they do not capture.
            assert r["runs"] == n + sum(1 for i in range(1, n) if i % every), (rank, r)
    assert seen == world


def test_capture_ownership(runs):
    """Owned only for storage nothing else writes: a gather (input-scattered) or a residual the
    next stage's input leaves alone (no sum left to a possibly in-place fused completion). The
    stack entry's capture aliases the model's input: borrowed."""
    world, per_rank = runs
    for rank, results in enumerate(per_rank):
        for r in results:
            case = r["case"]
            for key, owned in r["owned"].items():
                layer = int(key.lstrip("capol"))
                if layer == 0:
                    want = False
                elif case.get("scattered"):
                    want = True
                else:
                    want = r["attn_tp"] == 1
                assert owned is want, (rank, case, key)
