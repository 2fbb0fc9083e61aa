"""``layer-boundary run --moe``: the embedded random Qwen3-MoE on the command line."""

from __future__ import annotations

import pytest
import torch

from layer_boundary._cli.main import build_parser, main
from layer_boundary._forward import ForwardBatch
from layer_boundary_app.models.config import small_random_moe_config
from layer_boundary_app.models.qwen3_moe import Qwen3MoeForCausalLM, init_random_moe_weights


def _embedded(ids: list[int]) -> torch.Tensor:
    model = Qwen3MoeForCausalLM(small_random_moe_config())
    init_random_moe_weights(model, seed=0)
    pos = torch.arange(len(ids))
    with torch.inference_mode():
        return model.eval()(torch.tensor(ids), pos, ForwardBatch(num_tokens=len(ids), positions=pos))


@pytest.mark.slow
def test_moe_runs_on_the_default_two_ranks_and_checks(tmp_path, capsys):
    out = tmp_path / "logits.pt"
    rc = main(["run", "--moe", "--check", "--input-ids", "3,1,4,1,5,9,2,6", "--save-logits", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "embedded random Qwen3-MoE (8 experts, top 2, 3 of 4 layers sparse)" in text
    assert "ranks: 2 (gloo)" in text and "check:    ok" in text
    assert "(ffn SCOPED sparse)" in text and "(ffn SCOPED) read" in text  # layer 1 is dense
    # What was saved is the embedded model's forward (2 ranks: float32 regrouping only).
    torch.testing.assert_close(torch.load(out), _embedded([3, 1, 4, 1, 5, 9, 2, 6]), atol=1e-4, rtol=0)


def test_single_rank_moe_run_is_bitwise_the_model_with_and_without_deferral(tmp_path, capsys):
    want = _embedded([7, 300, 12])
    for extra in ([], ["--defer-moe-finalize"]):
        out = tmp_path / f"logits{len(extra)}.pt"
        assert main(["run", "--moe", "--tp", "1", "--input-ids", "7,300,12", "--save-logits", str(out),
                     *extra]) == 0
        assert torch.equal(torch.load(out), want)
    assert "sparse FFNs defer their finalize" in capsys.readouterr().out


def test_moe_misuse_is_refused(tmp_path, capsys):
    assert main(["run", "--moe", "--pattern", "M-*-", "--tp", "1"]) == 2
    assert "--moe builds the embedded random Qwen3-MoE" in capsys.readouterr().err
    assert main(["run", "--defer-moe-finalize", "--tp", "1"]) == 2
    assert "--defer-moe-finalize needs a Qwen3-MoE model" in capsys.readouterr().err


def test_help_describes_the_moe_options():
    text = build_parser()._subparsers._group_actions[0].choices["run"].format_help()
    assert "--moe" in text and "Qwen3-MoE" in text and "--defer-moe-finalize" in text
    assert "model_type" in text


def test_fused_finalize_on_the_command_line(tmp_path, capsys):
    """``--fused-finalize``: Gemma norms, the handoffs fused (torch reference kernel on CPU),
    checked against the single-rank model on two ranks; misuse refused with the reason."""
    rc = main(["run", "--moe", "--fused-finalize", "--check", "--input-ids", "3,1,4,1,5;9,2"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "Gemma norms, fused MoE finalize handoffs" in text and "check:    ok" in text
    assert "consumer fusion [attention_input] -> moe finalize + all-reduce + add + rmsnorm (reference)" in text
    assert main(["run", "--fused-finalize", "--tp", "1"]) == 2
    assert "--fused-finalize needs a Qwen3-MoE model" in capsys.readouterr().err
    assert main(["run", "--moe", "--fused-finalize", "--defer-moe-finalize", "--tp", "1"]) == 2
    assert "drop --defer-moe-finalize" in capsys.readouterr().err
    # the option named is the one given (a fixed "drop --defer-moe-finalize" once answered these)
    assert main(["run", "--moe", "--fused-finalize", "--pp", "2", "--tp", "1"]) == 2
    assert "drop --pp 2" in capsys.readouterr().err
    assert main(["run", "--moe", "--fused-finalize", "--tbo", "--tp", "1"]) == 2
    assert "drop --fused-finalize" in capsys.readouterr().err
