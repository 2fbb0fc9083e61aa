"""The Qwen3-MoE reference against transformers' ``Qwen3MoeForCausalLM`` on one rank.

Each test saves a tiny random transformers model with ``save_pretrained`` (safetensors, per-expert
tensor names), loads it with our loader and compares logits.

Tolerances, relative to the scale of the logits (``max |fp32 logit|``; logits reach ~4 here):

| dtype | vs                 | bound                    | why |
| ----- | ------------------ | ------------------------ | --- |
| fp32  | transformers fp32  | 1e-4 x max(1, max logit) | same math; expert matmuls on row subsets sum in another order |
| fp32  | deferred finalize  | 0 (bitwise)              | the same finalize runs at the next input instead of in compute |
| bf16  | transformers bf16  | 0.03 x max logit         | the dense test's ``BF16_REL``: add+norm rounds once in FP32 |
| bf16  | fp32 reference     | 0.03 x max logit         | same bound for both bf16 models |
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from transformers import Qwen3MoeConfig as HFQwen3MoeConfig  # noqa: E402
from transformers import Qwen3MoeForCausalLM as HFQwen3MoeForCausalLM  # noqa: E402

from safetensors.torch import load_file, save_file  # noqa: E402

from helpers import hf_logits, our_logits, save_hf  # noqa: E402

from layer_boundary._cli.main import main  # noqa: E402
from layer_boundary_app.models.config import Qwen3MoeConfig, load_config  # noqa: E402
from layer_boundary_app.models.loader import CheckpointMismatch  # noqa: E402
from layer_boundary_app.models.moe import DeferFinalize  # noqa: E402
from layer_boundary_app.models.qwen3_moe import Qwen3MoeForCausalLM  # noqa: E402
from layer_boundary._output import HandoffOutput  # noqa: E402

FP32_REL = 1e-4
BF16_REL = 0.03  # tests/app/test_qwen3_transformers.py: measured 0.015 for the dense model, doubled

BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def save_hf_moe(folder, seed: int = 0, **overrides) -> HFQwen3MoeForCausalLM:
    """A tiny random transformers Qwen3-MoE saved to ``folder``; returns the transformers model."""
    return save_hf(folder, HFQwen3MoeConfig, HFQwen3MoeForCausalLM, {**BASE, **overrides}, seed=seed)


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, BASE["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


def _bound(rel: float, ref: torch.Tensor) -> float:
    return rel * max(1.0, ref.abs().max().item())


CONFIGS = {
    "all-sparse": {},
    "norm-topk": dict(norm_topk_prob=True),
    "sparse-step-2": dict(decoder_sparse_step=2),  # layer 1 sparse, layers 0 and 2 dense
    "mlp-only-layers": dict(mlp_only_layers=[0, 2], norm_topk_prob=True),
    "top-3-of-6-tied": dict(num_experts=6, num_experts_per_tok=3, tie_word_embeddings=True),
}


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_fp32_matches_transformers(tmp_path, overrides):
    hf = save_hf_moe(tmp_path, **overrides)
    ours = Qwen3MoeForCausalLM.from_pretrained(tmp_path)
    cfg = ours.config
    want_sparse = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    assert [cfg.is_sparse(i) for i in range(cfg.num_hidden_layers)] == want_sparse
    assert [layer.is_sparse for layer in ours.model.layers] == want_sparse
    # Each FFN declares what it is and what follows it; each previous= names the real producer.
    for i, layer in enumerate(ours.model.layers):
        decl = layer.ffn_boundary.declaration
        assert (decl.sparse, decl.next_sparse) == (want_sparse[i], i + 1 < len(want_sparse) and want_sparse[i + 1])
        if i:
            assert layer.attn_boundary.declaration.previous.produces_like(ours.model.layers[i - 1].ffn_boundary.declaration)
    ids = _ids(11)
    ref = hf_logits(hf, ids)
    got = our_logits(ours, ids)
    assert got.shape == (11, BASE["vocab_size"]) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=_bound(FP32_REL, ref), rtol=0)


def test_deferred_finalize_is_bitwise_the_same_and_runs_once_per_sparse_layer(tmp_path, monkeypatch):
    hf = save_hf_moe(tmp_path, decoder_sparse_step=1, mlp_only_layers=[1])
    plain = Qwen3MoeForCausalLM.from_pretrained(tmp_path)
    provider = DeferFinalize()
    deferring = Qwen3MoeForCausalLM.from_pretrained(tmp_path, fusions=provider)
    made, completed = [], []
    init, complete = HandoffOutput.__init__, HandoffOutput.complete

    def counted_init(self, *a, **k):
        made.append(self)
        init(self, *a, **k)

    def counted_complete(self):
        completed.append(self)
        return complete(self)

    monkeypatch.setattr(HandoffOutput, "__init__", counted_init)
    monkeypatch.setattr(HandoffOutput, "complete", counted_complete)
    ids = _ids(9)
    want = our_logits(plain, ids)
    assert made == []
    got = our_logits(deferring, ids)
    # Layers 0 and 2 are sparse: each returned one handoff, completed exactly once (layer 0's by
    # layer 1's attention input, layer 2's, the terminal one, by the final norm).
    assert len(made) == 2 and completed == made
    assert provider.asked == 3  # every FFN exit asks its provider, the dense one too
    assert torch.equal(got, want)
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=_bound(FP32_REL, want), rtol=0)


def test_packed_sequences_and_empty_batch(tmp_path):
    hf = save_hf_moe(tmp_path, norm_topk_prob=True)
    ours = Qwen3MoeForCausalLM.from_pretrained(tmp_path)
    a, b = _ids(6, seed=2), _ids(3, seed=3)
    packed = our_logits(ours, torch.cat([a, b]), seq_lens=(6, 3))
    torch.testing.assert_close(packed[6:], hf_logits(hf, b), atol=_bound(FP32_REL, packed), rtol=0)
    torch.testing.assert_close(packed[:6], hf_logits(hf, a), atol=_bound(FP32_REL, packed), rtol=0)
    empty = our_logits(ours, torch.zeros(0, dtype=torch.long))
    assert empty.shape == (0, BASE["vocab_size"])


def test_bf16_close_to_transformers_bf16_and_fp32(tmp_path):
    hf = save_hf_moe(tmp_path, norm_topk_prob=True, tie_word_embeddings=True)
    ids = _ids(13)
    ref32 = hf_logits(hf, ids)
    hf16 = hf_logits(hf.to(torch.bfloat16), ids)
    ours = Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    got = our_logits(ours, ids)
    atol = BF16_REL * ref32.abs().max().item()
    torch.testing.assert_close(got, hf16, atol=atol, rtol=0)
    torch.testing.assert_close(got, ref32, atol=atol, rtol=0)
    assert (got - ref32).abs().max() > FP32_REL  # bf16 really is coarser than the fp32 bound


# --- configuration and loading -----------------------------------------------------------------


def test_config_reads_both_expert_count_keys_and_rejects_a_shared_expert(tmp_path):
    save_hf_moe(tmp_path, mlp_only_layers=[2], decoder_sparse_step=1)
    with open(tmp_path / "config.json") as f:
        d = json.load(f)
    cfg = load_config(tmp_path)
    assert isinstance(cfg, Qwen3MoeConfig) and cfg.num_experts == 4 and cfg.mlp_only_layers == (2,)
    # Hub checkpoints (transformers 4) name the expert count num_experts.
    d4 = {k: v for k, v in d.items() if k != "num_local_experts"}
    assert Qwen3MoeConfig.from_dict({**d4, "num_experts": 6}).num_experts == 6
    with pytest.raises(ValueError, match="num_experts"):
        Qwen3MoeConfig.from_dict(d4)
    with pytest.raises(ValueError, match="shared expert"):
        Qwen3MoeConfig.from_dict({**d, "shared_expert_intermediate_size": 8})
    with pytest.raises(ValueError, match="num_experts_per_tok=5 exceeds num_experts=4"):
        Qwen3MoeConfig.from_dict({**d, "num_experts_per_tok": 5})
    assert Qwen3MoeConfig.from_dict(cfg.to_dict()) == cfg


def test_unsupported_model_type_names_the_supported_ones(tmp_path, capsys):
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"model_type": "llama"}, f)
    with pytest.raises(ValueError, match=r"model_type 'llama' is not supported.*'qwen3', 'qwen3_moe'"):
        load_config(tmp_path)
    assert main(["run", "--model", str(tmp_path), "--tp", "1"]) == 2
    err = capsys.readouterr().err
    assert "model_type 'llama' is not supported" in err and "'qwen3_moe'" in err


def test_missing_expert_tensor_is_named(tmp_path):
    save_hf_moe(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors.pop("model.layers.1.mlp.experts.3.up_proj.weight")
    tensors["model.layers.1.mlp.experts.4.up_proj.weight"] = torch.zeros(16, 32)
    save_file(tensors, path)
    with pytest.raises(CheckpointMismatch) as err:
        Qwen3MoeForCausalLM.from_pretrained(tmp_path)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in str(err.value)
    assert "model.layers.1.mlp.experts.4.up_proj.weight" in str(err.value)


def test_run_picks_the_decoder_from_model_type(tmp_path, capsys):
    hf = save_hf_moe(tmp_path, norm_topk_prob=True)
    out = tmp_path / "logits.pt"
    rc = main(["run", "--model", str(tmp_path), "--tp", "1", "--input-ids", "5,17,3,88",
               "--save-logits", str(out), "--defer-moe-finalize"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert f"Qwen3-MoE (4 experts, top 2, 3 of 3 layers sparse) from {tmp_path}" in text
    assert "(ffn SCOPED sparse)" in text and "defer their finalize" in text
    ref = hf_logits(hf, torch.tensor([5, 17, 3, 88]))
    torch.testing.assert_close(torch.load(out), ref, atol=_bound(FP32_REL, ref), rtol=0)
