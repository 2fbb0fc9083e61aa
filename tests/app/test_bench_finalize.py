"""``layer-boundary bench finalize``: the command line, the refusal without GPUs, the byte model and
the CPU side of its pure pieces. The figures come from GPUs (benchmarks/gpu_session.sh, stage 2);
speed is never asserted here.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
import torch

from layer_boundary_app.bench import finalize as fin
from layer_boundary_app.bench import report
from layer_boundary_app.bench.norm import EPS, norm_methods
from layer_boundary._cli.main import build_parser, main
from layer_boundary._fusion.moe_finalize import FINALIZE_TOLERANCE, finalize_partial_ref
from layer_boundary._kernels.providers import ReferenceNormProvider
from layer_boundary._kernels.reference import fused_add_rmsnorm_ref
from layer_boundary_app.models.moe import moe_finalize
from layer_boundary._providers import NormRequest


def test_parser_reads_the_finalize_options():
    a = build_parser().parse_args(["bench", "finalize"])
    assert (a.bench, a.tokens, a.hidden, a.dtype, a.world, a.topk, a.quick, a.no_compile, a.out) == (
        "finalize", None, None, "bfloat16", None, 8, False, False, "benchmarks/results")
    a = build_parser().parse_args(["bench", "finalize", "--world", "1", "--tokens", "1", "16", "--hidden", "4096",
                                   "--topk", "4", "--quick", "--no-compile", "--replays", "5", "--out", "d"])
    assert (a.world, a.tokens, a.hidden, a.topk, a.quick, a.no_compile, a.replays, a.out) == (
        1, [1, 16], [4096], 4, True, True, 5, "d")


@pytest.mark.parametrize("argv", [["bench", "finalize", "--world", "3"], ["bench", "finalize", "--topk", "x"]])
def test_parser_rejects_bad_finalize_values(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2


@pytest.mark.parametrize("extra", [[], ["--world", "1"], ["--world", "2", "--quick"]])
def test_finalize_refuses_without_cuda(extra, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "finalize", *extra, "--out", str(tmp_path)]) == 2
    text = capsys.readouterr().err
    assert "bench finalize needs a CUDA GPU" in text and "sees none" in text
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_finalize_on_two_ranks_refuses_one_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["bench", "finalize", "--world", "2"]) == 2
    assert "needs 2 CUDA GPUs of one host, but 1 is visible" in capsys.readouterr().err


def test_byte_model():
    # Per token: read k·H + H (shared) + H (residual), write H + H; the exchange adds 2·world·H.
    assert fin.bytes_moved(1, 4096, 8, 1, 2) == 12 * 4096 * 2
    assert fin.bytes_moved(1, 4096, 8, 2, 2) == (12 + 4) * 4096 * 2
    assert fin.bytes_moved(16, 7168, 8, 2, 2) == 16 * 16 * 7168 * 2
    assert fin.bytes_moved(3, 64, 4, 4, 4, shared=False) == 3 * (4 + 3 + 8) * 64 * 4


def test_inputs_are_replicated_where_a_model_replicates_them():
    a = fin.make_inputs(3, 32, 4, torch.bfloat16, "cpu", rank=0)
    b = fin.make_inputs(3, 32, 4, torch.bfloat16, "cpu", rank=1)
    assert a.expert_out.shape == (3, 4, 32) and a.topk_weights.shape == (3, 4) and a.shared_out.shape == (3, 32)
    for name in ("residual", "topk_weights", "gamma"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert not torch.equal(a.expert_out, b.expert_out) and not torch.equal(a.shared_out, b.shared_out)
    w = a.topk_weights.float()
    assert (w >= 0).all() and (w <= 1).all() and torch.allclose(w.sum(-1), torch.ones(3), atol=2e-2)


def test_cpu_paths_agree_with_the_reference_within_the_finalize_tolerance():
    # One rank, no all-reduce: the unfused torch path, the one-graph function the compiled peer
    # compiles (run eagerly here) and the fused kernel's arithmetic (FP32 combine, one rounding).
    dtype = torch.bfloat16
    i = fin.make_inputs(5, 64, 8, dtype, "cpu")
    residual = i.residual.clone()
    want = fin.reference(i, None)
    assert torch.equal(i.residual, residual)  # the reference leaves the inputs alone
    (gemma,), refused = norm_methods([("core", ReferenceNormProvider())], NormRequest("cpu", dtype, 64, 1.0))
    assert refused == []
    got = fin.separate_call(i, moe_finalize, None, gemma)()
    assert fin.check_close(got, want, dtype) == (0.0, True)
    assert fin.check_close(fin.whole_call(i, fin.finalize_add_norm)(), want, dtype)[1]
    r = i.residual.clone()
    fused = fused_add_rmsnorm_ref(finalize_partial_ref(i.expert_out, i.topk_weights, i.shared_out), r, i.gamma,
                                  EPS, weight_offset=1.0, residual_out=r)
    err, ok = fin.check_close(fused, want, dtype)
    assert ok and 0 < err <= FINALIZE_TOLERANCE[dtype][0]
    # A Gemma norm read as a plain one (offset lost) or a NaN fails.
    plain = fused_add_rmsnorm_ref(moe_finalize(i.expert_out, i.topk_weights, i.shared_out), i.residual, i.gamma, EPS)
    assert not fin.check_close(plain, want, dtype)[1]
    assert not fin.check_close((want[0], torch.full_like(want[1], float("nan"))), want, dtype)[1]


def test_a_separate_call_updates_its_own_residual_and_sums_through_the_all_reduce():
    i = fin.make_inputs(2, 16, 2, torch.float32, "cpu")
    (gemma,), _ = norm_methods([("core", ReferenceNormProvider())], NormRequest("cpu", torch.float32, 16, 1.0))
    seen = []
    call = fin.separate_call(i, moe_finalize, lambda t: (seen.append(t.shape), t.mul_(2)), gemma)
    y, r = call()
    assert seen == [(2, 16)] and r is not i.residual
    part = 2 * moe_finalize(i.expert_out, i.topk_weights, i.shared_out)
    want = fused_add_rmsnorm_ref(part, i.residual, i.gamma, EPS, weight_offset=1.0)
    torch.testing.assert_close((y, r), want)


def test_the_fused_call_hands_the_core_kernel_its_inputs_and_a_residual_of_its_own():
    # The launch the bench times is the plugin_api's (the kernel needs a GPU); a torch stand-in
    # with its signature and the kernel's arithmetic shows what the call passes it.
    from layer_boundary.plugin_api import make_symm_workspace, symm_mem_launch

    assert fin.fused_call.__defaults__ == (symm_mem_launch,) and callable(make_symm_workspace)
    dtype = torch.bfloat16
    i = fin.make_inputs(3, 32, 4, dtype, "cpu")
    residual = i.residual.clone()
    ws = object()
    seen = []

    def launch(ws_, x, r, weight, out, eps, weight_offset, *, topk_weights=None, shared=None):
        seen.append((ws_, x, r, weight, out, eps, weight_offset, topk_weights, shared))
        fused_add_rmsnorm_ref(finalize_partial_ref(x, topk_weights, shared), r, weight, eps,
                              weight_offset=weight_offset, out=out, residual_out=r)

    y, r = fin.fused_call(i, ws, launch)()
    (ws_, x, r_in, weight, out, eps, offset, topk, shared), = seen
    assert ws_ is ws and x is i.expert_out and weight is i.gamma and topk is i.topk_weights and shared is i.shared_out
    assert out is y and r_in is r and r is not i.residual and (eps, offset) == (EPS, 1.0)
    assert torch.equal(i.residual, residual)  # the inputs stay as they were for the other methods
    assert fin.check_close((y, r), fin.reference(i, None), dtype)[1]


def test_finish_shape_fills_speedups_bandwidth_and_checks():
    rows = [{"method": "b", "kind": "baseline", "us": 20.0, "ok": True},
            {"method": "c", "kind": "baseline", "us": 10.0, "ok": True},
            {"method": "nccl", "kind": "reference", "us": 5.0},
            {"method": "fused", "kind": "fused", "us": 4.0, "ok": False},
            {"method": "broken", "kind": "fused", "error": "RuntimeError: x"},
            {"method": "big", "kind": "fused", "check": "declined"}]
    fin.finish_shape(rows, 8000, copy_gbps=4.0)
    assert [r.get("speedup") for r in rows] == [0.5, 1.0, 2.0, 2.5, None, None]
    assert [r["check"] for r in rows] == ["ok", "ok", "-", "FAIL", "error", "declined"]
    assert rows[3]["gbps"] == pytest.approx(2.0) and rows[3]["pct_copy"] == pytest.approx(50.0)
    assert all(r["bytes"] == 8000 for r in rows)


def test_the_command_publishes_one_gpu_rows_and_fails_on_a_bad_check(tmp_path, monkeypatch, capsys):
    # The ranks' work is replaced (it needs a GPU); the rest of the command runs: the default
    # world with one GPU visible, the dated JSON and the plot.
    import layer_boundary_app.launch as launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cpu_env = report.environment("cpu")
    monkeypatch.setattr(report, "environment", lambda device, gpus=1: {
        **cpu_env, "device": "cuda", "gpu": "NVIDIA H200", "gpu_count": gpus})
    rows = []
    for t in (1, 16):
        mine = [{"method": "finalize (torch) + core-triton", "kind": "baseline", "us": 9.0, "ok": True},
                {"method": "fused triton finalize (1 rank)", "kind": "fused", "us": 3.0, "ok": True}]
        fin.finish_shape(mine, 1000, 3000.0)
        rows += [{**r, "hidden": 4096, "tokens": t} for r in mine]
    spawned = []

    def spawn(fn, world, *, args, backend, timeout_s):
        spawned.append((world, backend, args[0]))
        return [{"rows": rows, "copy": {"gbps": 3000.0}, "refused": []}]

    monkeypatch.setattr(launch, "spawn", spawn)
    assert main(["bench", "finalize", "--quick", "--out", str(tmp_path)]) == 0
    world, backend, spec = spawned[0]
    assert (world, backend, spec["tokens"], spec["hidden"], spec["topk"]) == (1, "nccl", [1, 16, 128, 1024], [4096], 8)
    (json_file,) = tmp_path.glob("*-finalize-nvidia-h200.json")
    doc = json.loads(json_file.read_text())
    assert doc["bench"] == "finalize" and doc["world"] == 1 and doc["gpu"] == "NVIDIA H200" and doc["torch"]
    assert doc["weight_offset"] == 1.0 and doc["tolerance"]["atol"] == FINALIZE_TOLERANCE[torch.bfloat16][0]
    assert [r["speedup"] for r in doc["rows"] if r["kind"] == "fused"] == [3.0, 3.0]
    ET.parse(json_file.with_suffix(".svg"))
    assert "bench finalize" in capsys.readouterr().out

    rows[-1]["ok"] = False
    assert main(["bench", "finalize", "--quick", "--out", str(tmp_path)]) == 1
    assert "1 result(s) failed their check" in capsys.readouterr().out


@pytest.mark.gpu
def test_bench_finalize_quick_on_one_gpu(tmp_path):
    assert main(["bench", "finalize", "--world", "1", "--tokens", "1", "16", "--hidden", "4096", "--replays", "3", "--no-compile",
                 "--out", str(tmp_path)]) == 0
    (json_file,) = tmp_path.glob("*-finalize-*.json")
    doc = json.loads(json_file.read_text())
    fused = [r for r in doc["rows"] if r["kind"] == "fused"]
    assert len(fused) == 2 and all(r["check"] == "ok" and r["us"] > 0 for r in fused), doc["rows"]
