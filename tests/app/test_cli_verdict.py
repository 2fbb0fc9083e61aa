"""``layer-boundary run`` as a newcomer reads it: one closing verdict, the device's normal refusals
apart from real ones, and one pointer to the page that explains every term."""

from __future__ import annotations

import torch

from layer_boundary._cli.main import main
from layer_boundary._selection import Candidate, Selection, not_on_this_device


def _lines(capsys) -> list[str]:
    return capsys.readouterr().out.strip().splitlines()


def test_the_last_line_says_what_ran_and_that_nothing_was_checked(capsys):
    assert main(["run", "--input-ids", "1,2,3"]) == 0
    last = _lines(capsys)[-1]
    assert last.startswith("verdict:  ran embedded random Qwen3 (seed 0) in float32 on 2 ranks (tp=2 ")
    assert "cpu, gloo" in last
    assert last.endswith("nothing checked: rerun with --check to compare every rank's logits with the "
                         "single-rank model")


def test_the_last_line_says_what_check_verified(capsys):
    assert main(["run", "--tp", "1", "--dtype", "bfloat16", "--input-ids", "1,2,3", "--check"]) == 0
    last = _lines(capsys)[-1]
    assert last.startswith("verdict:  ran embedded random Qwen3 (seed 0) in bfloat16 on 1 rank (")
    assert "; checked: logits equal the single-rank model (max |diff| 0 on rank 0, tolerance " in last


def test_a_failed_check_is_the_verdict_and_the_exit_status(capsys, monkeypatch):
    import layer_boundary_app.cli.run as run

    real = run.single_rank_logits
    monkeypatch.setattr(run, "single_rank_logits", lambda spec: real(spec) + 1.0)
    assert main(["run", "--tp", "1", "--input-ids", "1,2", "--check"]) == 1
    last = _lines(capsys)[-1]
    assert "; CHECK FAILED: logits differ from the single-rank model by 1 on rank 0, above the tolerance" in last


def test_a_cuda_kernel_on_a_cpu_is_not_on_this_device_not_refused(capsys):
    # Every selection line ended in "refused: core-triton (core): runs on CUDA devices only", which
    # read like an error on a machine where it is the normal case.
    assert main(["run", "--tp", "1", "--input-ids", "1,2"]) == 0
    norm = [line for line in _lines(capsys) if "norm kernels [" in line]
    assert norm and all("not on this device: core-triton (core): runs on CUDA devices only, not cpu" in line
                        for line in norm)
    assert not any("refused: core-triton" in line for line in norm)


def test_a_gpu_fusion_on_gloo_groups_is_not_on_this_device(capsys):
    assert main(["run", "--input-ids", "1,2"]) == 0
    fusion = [line for line in _lines(capsys) if "consumer fusion [" in line]
    assert fusion and all("not on this device: symm-mem all-reduce + add + rmsnorm (core): needs a nccl group; "
                          in line and "refused: symm-mem" not in line for line in fusion)


def test_the_selection_report_lists_device_refusals_apart():
    sel = Selection("attn #1", "ORDINARY", "norm kernels", "rmsnorm cpu float32 H=8", "torch-reference", (
        Candidate("gpu-kernel", "vendor", not_on_this_device("runs on CUDA devices only, not cpu")),
        Candidate("picky", "vendor", "hidden size 8 is not offered"),
        Candidate("torch-reference", "core"),
    ))
    assert sel.text() == ("norm kernels [rmsnorm cpu float32 H=8] -> torch-reference   refused: picky (vendor): "
                          "hidden size 8 is not offered   not on this device: gpu-kernel (vendor): runs on CUDA "
                          "devices only, not cpu")
    assert [c["off_device"] for c in sel.to_json()["candidates"]] == [True, False, False]


def test_the_core_and_vendor_device_refusals_are_marked():
    from layer_boundary._kernels.providers import TRITON_PROVIDER
    from layer_boundary.plugin_api import NormRequest, cuda_half_norm_refusal
    from layer_boundary._selection import OffDevice

    req = NormRequest("cpu", torch.bfloat16, 64)
    assert isinstance(TRITON_PROVIDER.refuse(req), OffDevice)
    why = cuda_half_norm_refusal(req, takes="X takes", offers="X has", fp8_refusal="no fp8")
    assert isinstance(why, OffDevice) and why == "runs on CUDA devices only, not cpu"


def test_the_output_points_once_to_the_concepts_page(capsys):
    assert main(["run", "--tp", "1", "--input-ids", "1,2"]) == 0
    lines = _lines(capsys)
    assert sum("docs/concepts.md" in line for line in lines) == 1
    assert lines[-2].startswith("terms:    docs/concepts.md explains every term above")
