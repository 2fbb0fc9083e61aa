"""The command line as a user runs it: the default job, a checkpoint folder, and misuse."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from layer_boundary._cli.main import main
from layer_boundary._forward import ForwardBatch
from layer_boundary_app.models import Qwen3ForCausalLM, init_random_weights, small_random_config


def test_default_run_prints_stages_and_saves_logits(tmp_path, capsys):
    out = tmp_path / "logits.pt"
    assert main(["run", "--input-ids", "3,1,4,1,5", "--save-logits", str(out)]) == 0
    text = capsys.readouterr().out
    assert "embedded random Qwen3" in text
    assert "ranks: 2 (gloo)" in text  # the embedded default runs tensor parallel on 2 CPU ranks
    assert "read=rmsnorm" in text and "update=plain_add" in text
    assert "forward:" in text
    logits = torch.load(out)
    assert logits.dtype == torch.float32 and logits.shape == (5, small_random_config().vocab_size)

    # The saved logits are the embedded model's forward (on 2 ranks: sums regroup, so within
    # float32 rounding), not something else of that shape.
    model = Qwen3ForCausalLM(small_random_config())
    init_random_weights(model, seed=0)
    ids = torch.tensor([3, 1, 4, 1, 5])
    pos = torch.arange(5)
    with torch.inference_mode():
        ref = model.eval()(ids, pos, ForwardBatch(num_tokens=5, positions=pos))
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def test_single_rank_run_is_bitwise_the_model(tmp_path):
    out = tmp_path / "logits.pt"
    assert main(["run", "--tp", "1", "--input-ids", "3,1,4", "--save-logits", str(out)]) == 0
    model = Qwen3ForCausalLM(small_random_config())
    init_random_weights(model, seed=0)
    pos = torch.arange(3)
    with torch.inference_mode():
        ref = model.eval()(torch.tensor([3, 1, 4]), pos, ForwardBatch(num_tokens=3, positions=pos))
    assert torch.equal(torch.load(out), ref)


def test_data_parallel_run_checks_against_one_rank(tmp_path, capsys):
    out = tmp_path / "logits.pt"
    rc = main(["run", "--tp", "2", "--dp", "2", "--reduction", "rsv", "--input-ids", "5,6,7;8;9,10",
               "--check", "--save-logits", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "check:    ok" in text and "3 sequence(s)" in text
    assert "output return [policy rsv] -> rsv/ar" in text
    logits = torch.load(out)
    assert logits.shape == (6, small_random_config().vocab_size)
    # Input order: sequence 1 ([8]) ran on DP group 1, the others on group 0.
    model = Qwen3ForCausalLM(small_random_config())
    init_random_weights(model, seed=0)
    with torch.inference_mode():
        one = model.eval()(torch.tensor([8]), torch.arange(1), ForwardBatch.for_tokens(1))
    torch.testing.assert_close(logits[3:4], one, atol=1e-4, rtol=0)


def test_bad_layout_is_refused(capsys):
    assert main(["run", "--tp", "3", "--dp", "2"]) == 2
    assert "must divide" in capsys.readouterr().err


@pytest.mark.parametrize("argv,usage", [
    (["run", "--out", "x"], "usage: layer-boundary run"),
    (["bench", "norm", "--bogus"], "usage: layer-boundary bench norm"),
    (["bench", "host", "--json", "/nonexistent-folder/x.json"], "usage: layer-boundary bench host"),
])
def test_a_command_error_prints_that_commands_usage(argv, usage, capsys):
    # The top level's usage lists only the commands: it told a user nothing about a run option.
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and usage in err and "usage: layer-boundary [-h] {run" not in err, err


def test_run_loads_a_checkpoint_folder(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
    )
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    out = tmp_path / "l.pt"
    assert main(["run", "--model", str(tmp_path / "ckpt"), "--input-ids", "1,2,3,60",
                 "--save-logits", str(out)]) == 0
    assert "Qwen3 from" in capsys.readouterr().out
    with torch.inference_mode():
        ref = hf(torch.tensor([[1, 2, 3, 60]])).logits[0]
    torch.testing.assert_close(torch.load(out), ref.float(), atol=1e-4, rtol=0)


def test_bfloat16_run(capsys):
    assert main(["run", "--dtype", "bfloat16", "--input-ids", "7"]) == 0
    assert "bfloat16" in capsys.readouterr().out


@pytest.mark.parametrize("ids", ["1,x,3", "", "-1", "1,,2", "1,2,"])
def test_bad_input_ids_are_refused(ids, capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "--input-ids", ids])
    assert e.value.code == 2
    assert "--input-ids" in capsys.readouterr().err


def test_token_outside_vocabulary(capsys):
    assert main(["run", "--input-ids", "1,100000"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err


def test_missing_model_folder(tmp_path, capsys):
    assert main(["run", "--model", str(tmp_path / "nope")]) == 2  # a usage error, as the others
    assert "is not a folder" in capsys.readouterr().err


def test_a_folder_without_weights_is_refused_before_the_ranks_start(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    cfg.save_pretrained(tmp_path)  # config.json alone
    assert main(["run", "--model", str(tmp_path), "--input-ids", "1,2"]) == 2
    assert "no *.safetensors files" in capsys.readouterr().err


@pytest.mark.parametrize("argv,flag,why", [
    (["run", "--tp", "-1"], "--tp", "must be at least 1"),
    (["run", "--pp", "0"], "--pp", "must be at least 1"),
    (["run", "--seed", "99999999999999999999"], "--seed", "not a seed"),
    (["bench", "host", "--iters", "0"], "--iters", "must be at least 1"),
    (["bench", "host", "--tokens", "-1"], "--tokens", "must be at least 1"),
    (["bench", "host", "--threads", "0"], "--threads", "must be 1 to"),
    (["bench", "norm", "--hidden", "0"], "--hidden", "must be at least 1"),
])
def test_counts_and_sizes_are_checked_when_parsed(argv, flag, why, capsys):
    # They used to fail deep inside the job with a ZeroDivisionError or a torch error.
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and why in err


@pytest.mark.parametrize("argv", [["run", "--save-logits", "{missing}/l.pt"],
                                  ["bench", "host", "--json", "{missing}/h.json"]])
def test_an_output_file_in_a_missing_folder_is_refused_before_the_work(argv, tmp_path, capsys):
    # --save-logits used to fail after the whole forward.
    with pytest.raises(SystemExit) as e:
        main([a.format(missing=tmp_path / "nope") for a in argv])
    assert e.value.code == 2 and "does not exist" in capsys.readouterr().err


def test_a_layout_the_model_refuses_is_its_message_not_a_traceback(capsys):
    # 4 layers over 5 pipeline stages: the ranks refuse it; the user sees why, in one line.
    assert main(["run", "--pp", "5", "--input-ids", "1,2"]) == 2
    err = capsys.readouterr().err
    assert "cannot be split over 5 pipeline stages" in err and "Traceback" not in err


def test_default_ids_fit_a_300_token_vocabulary_and_explicit_ids_past_it_are_refused(tmp_path, capsys):
    # The defaults (up to id 404) were refused by a checkpoint of 300 tokens: a newcomer's first
    # run of their own model failed on ids they never gave.
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    assert main(["run", "--model", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "the default token ids [300, 404] are past the vocabulary of 300 tokens: taken modulo 300" in out
    assert "logits:   [12, 300]" in out
    assert main(["run", "--model", str(tmp_path), "--input-ids", "1,299,300"]) == 2
    err = capsys.readouterr().err
    assert "--input-ids [300] are outside the vocabulary of 300 tokens; pass --input-ids below 300" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_cuda_without_gpu_says_so(capsys):
    assert main(["run", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_console_script_is_installed():
    # The installed entry point, as the README runs it.
    r = subprocess.run([sys.executable, "-m", "layer_boundary._cli.main", "run", "--input-ids", "1,2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "logits:" in r.stdout


def test_bench_host_runs(capsys):
    assert main(["bench", "host", "--tokens", "1", "--iters", "20", "--forward-iters", "2", "--hidden", "64"]) == 0
    text = capsys.readouterr().out
    assert "per boundary" in text and "ratio" in text


# -- found by a new-user trial (stop 21) ------------------------------------------------------------

def _tiny_checkpoint(path, **overrides):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=16, **overrides)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def test_a_layout_this_machine_cannot_start_is_refused_before_any_rank(capsys, monkeypatch):
    # --tp 1000 started 1000 processes on 2 CPUs before a rank could refuse the head count.
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert main(["run", "--tp", "1000", "--input-ids", "1,2"]) == 2
    assert "1000 ranks, one process each; this machine has 2 CPUs (at most 16" in capsys.readouterr().err


def test_a_sequence_longer_than_the_positions_is_refused(tmp_path, capsys):
    # It was an IndexError from the rotary table, in every rank.
    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    assert main(["run", "--model", str(ckpt), "--input-ids", ",".join(["1"] * 17)]) == 2
    assert "17 tokens is longer than the model's max_position_embeddings=16" in capsys.readouterr().err


def test_checkpoint_problems_are_one_line_on_one_rank_too(tmp_path, capsys):
    import json

    from safetensors.torch import load_file, save_file

    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    weights = load_file(str(ckpt / "model.safetensors"))
    # a tied config over a stored head that differs: transformers keeps the head, we used to drop it
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    assert main(["run", "--model", str(ckpt), "--input-ids", "1,2"]) == 2
    err = capsys.readouterr().err
    assert "lm_head.weight differs from model.embed_tokens.weight" in err and "Traceback" not in err
    (ckpt / "config.json").write_text(json.dumps(cfg))
    # a NaN weight: it was reported as two forwards that differ
    save_file({**weights, "model.norm.weight": torch.full_like(weights["model.norm.weight"], float("nan"))},
              str(ckpt / "model.safetensors"))
    assert main(["run", "--model", str(ckpt), "--input-ids", "1,2"]) == 2
    assert "the logits hold NaN or inf values" in capsys.readouterr().err
    # a damaged file: named, before the ranks start
    (ckpt / "model.safetensors").write_bytes(b"\xff" * 64)
    assert main(["run", "--model", str(ckpt), "--input-ids", "1,2"]) == 2
    assert "model.safetensors' does not read as safetensors" in capsys.readouterr().err


def test_an_output_file_that_is_a_folder_is_refused_before_the_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "--save-logits", str(tmp_path)])
    assert e.value.code == 2 and "is a folder" in capsys.readouterr().err


def test_a_reader_that_goes_away_ends_the_listing_quietly():
    # A trial: `layer-boundary plugins | head -3` ended in a BrokenPipeError traceback.
    proc = subprocess.Popen([sys.executable, "-m", "layer_boundary._cli.main", "plugins"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the listing is written
    _, err = proc.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()[-2000:]
    assert proc.returncode == 1


def test_plugins_command_names_a_misspelled_variable(monkeypatch, caplog, capsys):
    """An operator's finding: LAYER_BOUNDARY_PLUGIN=mhc (one letter short) pinned nothing, silently."""
    import logging

    monkeypatch.setenv("LAYER_BOUNDARY_PLUGIN", "mhc")
    with caplog.at_level(logging.WARNING, logger="layer_boundary.plugins"):
        assert main(["plugins"]) == 0
    assert ("LAYER_BOUNDARY_PLUGIN is set, but nothing reads it, so it changes nothing: did you mean "
            "LAYER_BOUNDARY_PLUGINS?") in caplog.text


def test_a_residual_scheme_is_any_registered_name_and_an_unknown_one_says_which_exist(capsys):
    # Before, argparse allowed only plain and mhc: a vendor's registered scheme could not be run.
    assert main(["run", "--residual", "Mhc", "--input-ids", "1,2"]) == 2
    err = capsys.readouterr().err
    assert "no active plugin provides residual semantics 'Mhc' (available: ['plain', 'mhc']); names are " \
           "case-sensitive: residual='mhc'" in err and "Traceback" not in err


def test_a_plugins_scheme_is_never_described_with_the_plain_formula():
    from layer_boundary_app.cli.run import _describe_residual
    from layer_boundary.residual._semantics import PLAIN_RESIDUAL

    class Vendor:
        name = "vendor-hc"

    assert _describe_residual(Vendor()) == "vendor-hc (a plugin's scheme; it has no describe())"
    assert _describe_residual(PLAIN_RESIDUAL).endswith("r' = r + y, add+RMSNorm reads")


def test_non_finite_logits_name_the_plugin_kernels_the_model_ran_as_suspects():
    # A trial: a plugin kernel that produced NaN was blamed on the checkpoint's weights alone.
    from types import SimpleNamespace

    from layer_boundary_app.cli.run import _plugin_suspects
    from layer_boundary._selection import Selection, SelectionReport

    norm = SimpleNamespace(name="acme-norm")
    report = SelectionReport([Selection("attn #1", "ORDINARY", "norm kernels", "r", "acme-norm", ()),
                              Selection("ffn #2", "ORDINARY", "norm kernels", "r", "torch-reference", ())])
    ctx = SimpleNamespace(registry=SimpleNamespace(norm_kernels=[("acme", norm)], fusion_providers=[]), report=report)
    assert _plugin_suspects(ctx) == ("; or a plugin's kernel: this model runs acme-norm (plugin acme) (rerun with "
                                     "LAYER_BOUNDARY_DISABLE=<plugin> to tell them apart)")
    assert _plugin_suspects(SimpleNamespace(registry=None, report=report)) == ""


@pytest.mark.parametrize("argv, said", [
    (["--tp", "3"], "num_attention_heads=4 is not divisible by the tensor-parallel size 3"),
    (["--pp", "5"], "4 layers cannot be split over 5 pipeline stages"),
    (["--tp", "4", "--dp", "2"], None),  # 2 attention ranks: 4 heads divide
])
def test_a_layout_the_model_cannot_take_is_refused_before_any_rank_starts(argv, said, capsys, monkeypatch):
    # A trial: --tp 3 said so only after 23 s, from rank 1, once every rank had started.
    from layer_boundary_app.cli import run as run_cli
    from layer_boundary_app.cli.run import _check_layout
    from layer_boundary_app.models.runner import _config

    def no_ranks(*a, **k):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(run_cli, "spawn", no_ranks)
    if said is None:
        from layer_boundary_app.models.runner import RunSpec

        spec = RunSpec(sequences=((1, 2),), tp=4, dp=2)
        _check_layout(spec, _config(spec))
        return
    assert main(["run", *argv, "--input-ids", "1,2"]) == 2
    assert said in capsys.readouterr().err


def test_a_pipeline_runs_stage_count_says_it_is_the_first_stages(capsys):
    # A trial: "stages: 4 boundaries" under --pp 2 read as the whole model's (it is rank 0's layers).
    assert main(["run", "--pp", "2", "--input-ids", "1,2"]) == 0
    assert "boundaries (pipeline stage 0 of 2: its layers only)" in capsys.readouterr().out
