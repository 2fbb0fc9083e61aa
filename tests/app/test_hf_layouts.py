"""A Hugging Face Qwen3 folder through ``layer-boundary run`` on several ranks still matches
transformers.

A tiny random transformers ``Qwen3ForCausalLM`` is saved with ``save_pretrained`` (safetensors);
the command line runs it with ``--tp``/``--dp`` on gloo, its sequences spread over the DP groups
(one group gets two sequences, the other one), ``--check`` compares every rank with the
single-rank model, and the saved logits are compared with transformers run on each sequence
separately (float32, 1e-4 absolute, the bound of tests/app/test_qwen3_transformers.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")


from layer_boundary._cli.main import main  # noqa: E402

pytestmark = pytest.mark.slow

# The same tiny random checkpoint as the single-rank comparison with transformers.
from test_qwen3_transformers import FP32_VS_HF, _save_hf  # noqa: E402

SEQUENCES = [[5, 17, 3, 88], [41, 2], [9, 60, 7]]
# (tp, dp): attention TP 2 everywhere (two KV heads), FFN TP over all ranks.
LAYOUTS = [(2, 1), (2, 2), (4, 2)]


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
