"""A Hugging Face Qwen3 folder through ``layer-boundary run`` on several ranks still matches
transformers.

A tiny random transformers ``Qwen3ForCausalLM`` is saved with ``save_pretrained`` (safetensors);
the command line runs it with ``--tp``/``--dp`` on gloo, its sequences spread over the DP groups
(one group gets two sequences, the other one), ``--check`` compares every rank with the
single-rank model, and the saved logits are compared with transformers run on each sequence
separately (float32, 1e-4 absolute, the bound of tests/test_qwen3_transformers.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import Qwen3Config as HFQwen3Config  # noqa: E402
from transformers import Qwen3ForCausalLM as HFQwen3ForCausalLM  # noqa: E402

from layer_boundary.cli.main import main  # noqa: E402

pytestmark = pytest.mark.slow

FP32_VS_HF = 1e-4
CONFIG = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
SEQUENCES = [[5, 17, 3, 88], [41, 2], [9, 60, 7]]
# (tp, dp): attention TP 2 everywhere (two KV heads), FFN TP over all ranks.
LAYOUTS = [(2, 1), (2, 2), (4, 2)]


def _save_hf(folder, seed: int = 0) -> HFQwen3ForCausalLM:
    config = HFQwen3Config(**CONFIG, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
                           attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = HFQwen3ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # unit activation scale; norm weights away from one
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def test_hf_folder_matches_transformers_on_every_layout(tmp_path, capsys):
    folder = tmp_path / "qwen3"
    hf = _save_hf(folder)
    with torch.no_grad():
        want = torch.cat([hf(torch.tensor([s])).logits[0].float() for s in SEQUENCES])
    ids = ";".join(",".join(str(t) for t in s) for s in SEQUENCES)
    for tp, dp in LAYOUTS:
        for policy in ("ar", "rs+rsv") if dp > 1 else ("auto",):
            out = tmp_path / f"logits-{tp}-{dp}-{policy}.pt"
            rc = main(["run", "--model", str(folder), "--tp", str(tp), "--dp", str(dp), "--reduction", policy,
                       "--input-ids", ids, "--save-logits", str(out), "--check"])
            text = capsys.readouterr().out
            where = f"--tp {tp} --dp {dp} --reduction {policy}"
            assert rc == 0, f"{where}: exit {rc}\n{text}"
            assert "check:    ok" in text, f"{where}\n{text}"
            got = torch.load(out)
            assert got.shape == want.shape, where
            err = (got - want).abs().max().item()
            assert err <= FP32_VS_HF, f"{where}: max |logit - transformers| {err:.3g}"
