"""The multi-rank launcher: results in rank order, and a failing rank stops the run quickly with
its own error (never a hang)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from layer_boundary_app.launch import RankError, spawn

import launch_cases


def test_results_come_back_in_rank_order():
    assert spawn(launch_cases.sum_ranks, 3, args=(10,)) == [33.0, 33.0, 33.0]


def test_a_raising_rank_stops_the_run_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(RankError) as e:
        spawn(launch_cases.one_rank_fails, 2, timeout_s=60)
    assert e.value.rank == 1 and "boom on rank 1" in e.value.remote
    assert time.monotonic() - t0 < 45, "the other rank was left waiting in its collective"


def test_a_rank_that_dies_silently_is_reported():
    t0 = time.monotonic()
    with pytest.raises(RankError) as e:
        spawn(launch_cases.one_rank_dies, 2, timeout_s=60)
    assert e.value.rank == 1 and "exited with code 3" in e.value.remote
    assert time.monotonic() - t0 < 45


@pytest.mark.parametrize("value", ["abc", "0", "-1"])
def test_a_bad_hang_dump_interval_is_named(value, monkeypatch):
    # It was "could not convert string to float: 'abc'" or "timeout must be greater than 0",
    # naming no variable (a trial).
    monkeypatch.setenv("LAYER_BOUNDARY_HANG_DUMP_S", value)
    with pytest.raises(RankError) as e:
        spawn(launch_cases.sum_ranks, 1, args=(1,), timeout_s=60)
    assert f"LAYER_BOUNDARY_HANG_DUMP_S={value!r}: give a number of seconds above 0" in e.value.remote


@pytest.mark.slow
def test_run_under_torchrun(tmp_path):
    out = tmp_path / "logits.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port,
         "-m", "layer_boundary._cli.main", "run", "--tp", "2", "--dp", "2", "--input-ids", "1,2;3",
         "--check", "--save-logits", str(out)],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("check:    ok") == 1  # rank 0 reports for the run
    assert out.exists()
