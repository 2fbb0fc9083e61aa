"""``layer-boundary bench norm|allreduce|decode``: the harness on CPU, the figures on GPUs.

Speed is never asserted here; these tests check that the command line, the report writer and the
CPU path of the norm benchmark work, and that GPU-only benchmarks refuse clearly without GPUs.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from datetime import date
from typing import Any, Optional

import pytest
import torch

from layer_boundary import BoundaryContext, Topology
from layer_boundary_app.bench import norm as norm_bench
from layer_boundary_app.bench import report
from layer_boundary_app.bench.candidates import (UnfusedContext, accepted_candidates, no_candidate_reason,
                                             strip_candidates, two_stage_plan)
from layer_boundary_app.bench.timing import TimingPlan, wall_time
from layer_boundary._cli.main import build_parser, main
from layer_boundary._kernels.reference import fused_add_rmsnorm_ref, rmsnorm_ref
from layer_boundary._providers import NormRequest
from layer_boundary.residual._add_norm import NormKernels

SVG = "{http://www.w3.org/2000/svg}"


def test_parser_reads_the_grid_options():
    a = build_parser().parse_args(["bench", "norm", "--device", "cpu", "--tokens", "1", "16", "--hidden", "256",
                                   "--dtype", "float32", "--quick", "--out", "d", "--no-compile", "--replays", "4"])
    assert (a.bench, a.device, a.tokens, a.hidden, a.dtype, a.quick, a.out, a.no_compile, a.replays) == (
        "norm", "cpu", [1, 16], [256], "float32", True, "d", True, 4)
    a = build_parser().parse_args(["bench", "allreduce"])
    assert (a.tokens, a.hidden, a.dtype, a.quick, a.out) == (None, None, "bfloat16", False, "benchmarks/results")
    a = build_parser().parse_args(["bench", "decode", "--tp", "1", "2", "--tokens", "1", "8", "--layers", "2"])
    assert (a.tp, a.tokens, a.layers, a.hidden, a.vocab) == ([1, 2], [1, 8], 2, 4096, 32768)


@pytest.mark.parametrize("argv", [
    ["bench", "norm", "--dtype", "int8"],
    ["bench", "norm", "--device", "tpu"],
    ["bench", "decode", "--tp", "3"],
    ["bench", "allreduce", "--tokens", "x"],
])
def test_parser_rejects_bad_values(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2


@pytest.mark.parametrize("argv", [["bench", "allreduce"], ["bench", "decode"], ["bench", "norm"],
                                  ["bench", "norm", "--device", "cuda", "--quick"]])
def test_gpu_benchmarks_refuse_without_cuda(argv, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(argv + ["--out", str(tmp_path)]) == 2
    text = capsys.readouterr().err
    assert "needs a CUDA GPU" in text and "sees none" in text
    assert not list(tmp_path.iterdir())  # nothing half-written


@pytest.mark.parametrize("argv", [["bench", "allreduce"], ["bench", "decode", "--tp", "1", "2"]])
def test_two_gpu_benchmarks_refuse_one_gpu(argv, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(argv) == 2
    assert "needs 2 CUDA GPUs of one host, but 1 is visible" in capsys.readouterr().err


@pytest.mark.parametrize("argv,gpus", [(["bench", "allreduce", "--world", "8"], 8),
                                       (["bench", "decode", "--tp", "1", "4"], 4)])
def test_wider_benchmarks_say_how_many_gpus_they_need(argv, gpus, monkeypatch, capsys):
    """TP=4 and TP=8 runs (the 4- and 8-GPU issue) on a 2-GPU machine: refused before any spawn."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert main(argv) == 2
    assert f"needs {gpus} CUDA GPUs of one host, but 2 are visible" in capsys.readouterr().err


@pytest.mark.slow
def test_allreduce_harness_runs_on_four_gloo_ranks():
    """The ranks' side of ``bench allreduce`` at world 4 on CPU (gloo): every row's check passes
    against the reference, and the fused candidates say why they refuse (they need NCCL)."""
    from layer_boundary_app.bench.allreduce import _rank
    from layer_boundary_app.launch import spawn

    spec = {"tokens": [1, 8], "hidden": [64], "dtype": "float32", "quick": True, "replays": 3, "compile": False,
            "device": "cpu"}
    out = spawn(_rank, 4, args=(spec,), timeout_s=240)[0]
    checked = [r for r in out["rows"] if r.get("ok") is not None]
    assert checked and all(r["ok"] for r in checked), checked
    assert {r["tokens"] for r in checked} == {1, 8}
    assert "needs a nccl group" in out["notes"][0]


def test_json_report_carries_date_device_versions_and_rows(tmp_path):
    env = report.environment("cpu")
    for key in ("date", "gpu", "driver", "cuda", "torch", "triton", "flashinfer", "python"):
        assert key in env
    assert env["date"] == date.today().isoformat() and env["torch"] == torch.__version__
    json_path, svg_path = report.result_paths(str(tmp_path / "out"), "norm", env)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d-norm-cpu-[a-z0-9-]+\.json", json_path.rsplit("/", 1)[1])
    assert svg_path == json_path[:-5] + ".svg"
    rows = [{"method": "a", "us": 1.5}, {"method": "b", "us": float("inf")}]
    report.write_json(json_path, "norm", env, rows, copy={"gbps": 3.0})
    doc = json.loads(open(json_path).read())
    assert doc["bench"] == "norm" and doc["date"] == env["date"] and doc["copy"] == {"gbps": 3.0}
    assert [r["method"] for r in doc["rows"]] == ["a", "b"]
    # a second run the same day keeps the first one's files
    again = report.result_paths(str(tmp_path / "out"), "norm", env)
    assert again == (json_path[:-5] + "-2.json", json_path[:-5] + "-2.svg")


def test_device_slug_names_the_gpu_and_count():
    assert report.device_slug({"gpu": "NVIDIA H200", "gpu_count": 1}) == "nvidia-h200"
    assert report.device_slug({"gpu": "NVIDIA H200", "gpu_count": 2}) == "nvidia-h200-x2"
    assert report.device_slug({"gpu": None}).startswith("cpu-")


def test_svg_is_well_formed_with_log_axes_and_one_legend_entry_per_series(tmp_path):
    panels = [
        report.Panel("H = 4096 <&>", "tokens", "GB/s", (
            report.Series("core-triton", ((1, 8.0), (128, 900.0), (8192, 4000.0))),
            report.Series("a & b <c>", ((1, 2.0), (8192, 1000.0)), color="core-triton"),
            report.Series("copy", ((1, 4200.0), (8192, 4200.0)), dashed=True),
            report.Series("bad points", ((0, 1.0), (2, float("nan")), (4, -3.0))),
        )),
        report.Panel("empty", "tokens", "µs", ()),
        report.Panel("one decade", "batch", "µs", (report.Series("core-triton", ((1, 30.0), (8, 45.0))),)),
    ]
    path = str(tmp_path / "plot.svg")
    assert report.write_plot(path, "title & more", panels, "sub", use_matplotlib=False) == "svg"
    root = ET.parse(path).getroot()
    assert root.tag == SVG + "svg"
    lines = root.findall(f".//{SVG}polyline")
    assert len(lines) == 4  # the series with no drawable point draws nothing
    texts = [t.text for t in root.iter(SVG + "text")]
    assert texts.count("core-triton") == 1 and "a & b <c>" in texts and "no data" in texts
    assert "1k" in texts  # decade ticks labelled compactly
    assert "2" in texts and "5" in texts  # 1-2-5 ticks on an axis of one decade


class _FakeProvider:
    def __init__(self, name: str, refuse: Optional[str] = None) -> None:
        self.name, self._refuse = name, refuse
        self.tolerance = {torch.bfloat16: (1e-2, 1e-2)}

    def refuse(self, request: NormRequest) -> Optional[str]:
        return self._refuse

    def kernels(self, request: NormRequest) -> NormKernels:
        return NormKernels(self.name, rmsnorm_ref, fused_add_rmsnorm_ref)


def test_bench_norm_on_cpu_end_to_end(tmp_path, monkeypatch, capsys):
    # A provider added later shows up without a change to the benchmark; a refusing one is
    # reported with its reason.
    real = norm_bench.providers_for

    def providers(device: str) -> list[tuple[str, Any]]:
        return [("acme", _FakeProvider("acme-norm")), ("acme", _FakeProvider("acme-fp8", "no FP8 here"))] + real(device)

    monkeypatch.setattr(norm_bench, "providers_for", providers)
    out = tmp_path / "results"
    assert main(["bench", "norm", "--device", "cpu", "--quick", "--no-compile", "--replays", "3",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "copy bandwidth" in text and "acme-fp8 (acme) refuses" in text
    (json_file,) = out.glob(f"{date.today().isoformat()}-norm-cpu-*.json")
    doc = json.loads(json_file.read_text())
    assert doc["device"] == "cpu" and doc["copy"]["gbps"] > 0
    methods = {r["method"] for r in doc["rows"]}
    assert {"acme-norm", "torch-reference", "torch eager"} <= methods
    assert {(r["tokens"], r["hidden"]) for r in doc["rows"]} == {(1, 2048), (16, 2048), (128, 2048)}
    for r in doc["rows"]:
        assert r["us"] > 0 and r["gbps"] > 0 and r["pct_copy"] > 0 and r["dtype"] == "bfloat16"
        assert r["check"] == ("-" if r["method"] == "torch eager" else "ok"), r
        assert r["gbps"] == pytest.approx(8 * r["hidden"] * r["tokens"] / r["us"] / 1e3)
    assert {"method": "acme-fp8", "origin": "acme", "hidden": 2048, "refused": "no FP8 here"} in doc["refused"]
    ET.parse(json_file.with_suffix(".svg"))


def test_a_wrong_kernel_fails_its_check(tmp_path, monkeypatch, capsys):
    def wrong(x, r, w, eps, *, weight_offset=0.0, out=None, residual_out=None):
        y, r2 = fused_add_rmsnorm_ref(x, r, w, eps, weight_offset=weight_offset, residual_out=residual_out)
        return y * 1.5, r2

    class Wrong(_FakeProvider):
        def kernels(self, request):
            return NormKernels(self.name, rmsnorm_ref, wrong)

    monkeypatch.setattr(norm_bench, "providers_for", lambda device: [("acme", Wrong("wrong-norm"))])
    assert main(["bench", "norm", "--device", "cpu", "--tokens", "4", "--hidden", "64", "--no-compile",
                 "--replays", "2", "--out", str(tmp_path)]) == 1
    assert "failed their check" in capsys.readouterr().out


def test_wall_time_reports_per_call_medians():
    plan = TimingPlan(replays=3, target_us=200.0, max_calls=50, warmup=1)
    calls = []
    m = wall_time(lambda: calls.append(1), plan, agree=lambda n: n + 1)
    assert m.replays == 3 and 2 <= m.calls <= 51 and m.min_us <= m.median_us
    assert len(calls) == 1 + 1 + 3 * m.calls  # warmup, probe, replays of the agreed length
    with pytest.raises(ValueError):
        TimingPlan(replays=0)


class _Candidate:
    name = "acme all-reduce + add + rmsnorm"
    sum_group = None

    def refuse(self, plan: Any) -> Optional[str]:
        return None

    def __call__(self, contribution, residual, read, forward_batch):
        return None


class _Provider:
    name = "acme-fusion"

    def attention_input(self, plan):
        return [_Candidate()]

    def ffn_input(self, plan):
        return [_Candidate()]


class _FusingContext(BoundaryContext):
    def fusion_providers(self):
        return (_Provider(),)


def test_candidates_are_read_from_the_built_plan_and_removed_for_the_baseline():
    ctx = _FusingContext(Topology.single())
    attn, ffn = two_stage_plan(ctx, 64, torch.float32, "cpu")
    found = accepted_candidates((ffn, attn))
    assert [c.name for c in found] == [_Candidate.name]  # one per name, the FFN stage's first
    assert found[0].stage.startswith("ffn") and found[0].read is ffn.plan.read
    assert strip_candidates((attn, ffn)) == 2 and accepted_candidates((attn, ffn)) == []

    plain = UnfusedContext(Topology.single())
    assert accepted_candidates(two_stage_plan(plain, 64, torch.float32, "cpu")) == []
    assert no_candidate_reason(plain).startswith("no fusion provider offered a candidate")


@pytest.mark.gpu
def test_bench_norm_quick_on_cuda(tmp_path, capsys):
    assert main(["bench", "norm", "--quick", "--out", str(tmp_path)]) == 0
    (json_file,) = tmp_path.glob("*-norm-*.json")
    doc = json.loads(json_file.read_text())
    assert doc["gpu"] and doc["copy"]["gbps"] > 100
    assert {"torch.compile", "torch eager"} <= {r["method"] for r in doc["rows"]}
    assert all(r["check"] in ("ok", "-") and r["us"] > 0 for r in doc["rows"]), doc["rows"]
    ET.parse(json_file.with_suffix(".svg"))


def test_decode_compile_checks_every_compiled_variant_against_plain():
    """The --compile harness on CPU (aot_eager for speed): every variant's compiled step is
    checked against the plain forward (timing of compiled steps needs CUDA-graph replay)."""
    from layer_boundary_app.bench.decode import _decode_rank

    spec = {"tokens": [1, 3], "hidden": 512, "layers": 2, "vocab": 512, "dtype": "float32",
            "quick": True, "replays": 2, "compile": True, "compile_backend": "aot_eager", "device": "cpu"}
    out = _decode_rank(0, 1, spec)
    compiled = [c for c in out["checks"] if c["variant"].endswith(" compiled")]
    assert {c["variant"] for c in compiled} == {"plain compiled", "boundaries compiled"}
    assert all(c["ok"] and c["max_diff"] == 0.0 for c in compiled), compiled
    assert all(not r["variant"].endswith(" compiled") for r in out["rows"])  # eager mode only on CPU
