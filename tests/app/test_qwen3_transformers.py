"""The Qwen3 reference model against transformers, on tiny random checkpoints.

Each test saves a random transformers ``Qwen3ForCausalLM`` with ``save_pretrained`` (safetensors),
loads it with our loader (safetensors only) and compares logits on one rank.

Tolerances (absolute; logits reach magnitude ~4, or ~30 with tied embeddings, with the weights
drawn below):

| dtype | vs                 | atol              | why |
| ----- | ------------------ | ----------------- | --- |
| fp32  | transformers fp32  | 1e-4              | same math; summation order may differ; measured 0 |
| fp32  | plain path         | 0                 | same modules, same kernels, same order |
| fp32  | packed vs separate | 1e-5              | masked vs ``is_causal`` SDPA sum in different orders |
| bf16  | transformers bf16  | 0.03 x max logit  | rounding order of residual sum and norm weight |
| bf16  | fp32 reference     | 0.03 x max logit  | same bound for both bf16 models (``BF16_REL``) |
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")

# Import the modeling module at collection: its lazy import takes seconds and would otherwise be
# charged to whichever test runs first.
from transformers import Qwen3Config as HFQwen3Config  # noqa: E402
from transformers import Qwen3ForCausalLM as HFQwen3ForCausalLM  # noqa: E402

from safetensors.torch import load_file, save_file  # noqa: E402

from helpers import hf_logits, our_logits, save_hf  # noqa: E402

from layer_boundary._forward import ForwardBatch  # noqa: E402
from layer_boundary_app.models import (  # noqa: E402
    CheckpointMismatch,
    Qwen3Config,
    Qwen3ForCausalLM,
    init_random_weights,
    plain_forward,
    small_random_config,
)
from layer_boundary_app.models.layers import (  # noqa: E402
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from layer_boundary._topology import GroupInfo  # noqa: E402

FP32_VS_HF = 1e-4
PACKED_VS_SEPARATE = 1e-5
# bf16 tolerances are relative to the scale of the logits (max |fp32 logit|), because a bf16 ulp
# is. Measured over the six CONFIGS x seeds 0-19 (13 tokens, 2 layers), max |error| / max |logit|:
# ours vs transformers bf16 0.0150, ours bf16 vs fp32 0.0176, transformers bf16 vs fp32 0.0156
# (median absolute errors 0.035 / 0.033 / 0.036 at logits of ~4). bf16 spacing is 2^-8..2^-7 of a
# value, so these are 2-4 ulps of the largest logit. The two bf16 models differ by design: our
# add+norm normalizes the FP32 sum and applies the norm weight in FP32 with one rounding, while
# transformers rounds the residual sum to bf16 first and multiplies the weight after rounding.
# Both are equally far from the FP32 model, which is what shows neither is wrong. The bound is
# about twice the worst measured case.
BF16_REL = 0.03

BASE = dict(
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


def _save_hf(folder, seed: int = 0, max_shard_size=None, **overrides):
    kw = {**BASE, **overrides}
    theta = kw.pop("rope_theta", 10_000.0)
    extra = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    return save_hf(folder, HFQwen3Config, HFQwen3ForCausalLM, kw, seed=seed, rope_theta=theta, **extra)


def _ours(model: Qwen3ForCausalLM, ids: torch.Tensor, seq_lens=None, plain: bool = False) -> torch.Tensor:
    return our_logits(model, ids, seq_lens, forward=plain_forward if plain else None)


def _ids(n: int, seed: int = 1, vocab: int = BASE["vocab_size"]) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


CONFIGS = {
    "untied-gqa": {},
    "tied": dict(tie_word_embeddings=True),
    "mha": dict(num_key_value_heads=4),
    "head-dim-not-hidden-over-heads": dict(head_dim=16, num_attention_heads=4, num_key_value_heads=1),
    "rope-theta": dict(rope_theta=1_000_000.0),
    "attention-bias": dict(attention_bias=True),
}


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_fp32_matches_transformers(tmp_path, overrides):
    hf = _save_hf(tmp_path, **overrides)
    ours = Qwen3ForCausalLM.from_pretrained(tmp_path)
    assert ours.config.tie_word_embeddings == hf.config.tie_word_embeddings
    if ours.config.tie_word_embeddings:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = _ids(11)
    ref = hf_logits(hf, ids)
    got = _ours(ours, ids)
    assert got.shape == (11, BASE["vocab_size"]) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=FP32_VS_HF, rtol=0)


def test_sharded_checkpoint(tmp_path):
    hf = _save_hf(tmp_path, max_shard_size="8KB")
    with open(tmp_path / "model.safetensors.index.json") as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) > 3, "the checkpoint should really be sharded"
    ours = Qwen3ForCausalLM.from_pretrained(tmp_path)
    ids = _ids(6)
    torch.testing.assert_close(_ours(ours, ids), hf_logits(hf, ids), atol=FP32_VS_HF, rtol=0)


def test_packed_batch_equals_separate_sequences(tmp_path):
    hf = _save_hf(tmp_path)
    ours = Qwen3ForCausalLM.from_pretrained(tmp_path)
    a, b = _ids(7, seed=2), _ids(4, seed=3)
    packed = _ours(ours, torch.cat([a, b]), seq_lens=(7, 4))
    torch.testing.assert_close(packed[:7], _ours(ours, a), atol=PACKED_VS_SEPARATE, rtol=0)
    torch.testing.assert_close(packed[7:], _ours(ours, b), atol=PACKED_VS_SEPARATE, rtol=0)
    torch.testing.assert_close(packed[7:], hf_logits(hf, b), atol=FP32_VS_HF, rtol=0)
    # The mask really separates the sequences: the second one unmasked would see the first.
    unmasked = _ours(ours, torch.cat([a, b]), seq_lens=None)
    assert (unmasked[7:] - packed[7:]).abs().max() > 1e-2


def test_single_token(tmp_path):
    hf = _save_hf(tmp_path, tie_word_embeddings=True)
    ours = Qwen3ForCausalLM.from_pretrained(tmp_path)
    ids = _ids(1)
    got = _ours(ours, ids)
    assert got.shape == (1, BASE["vocab_size"])
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=FP32_VS_HF, rtol=0)


def test_empty_batch_still_runs_the_stack(tmp_path):
    """A rank with no tokens skips attention but still passes through every boundary."""
    _save_hf(tmp_path)
    ours = Qwen3ForCausalLM.from_pretrained(tmp_path)
    fb = ForwardBatch.for_tokens(0)
    with torch.no_grad():
        logits = ours(torch.zeros(0, dtype=torch.long), fb.positions, fb)
    assert logits.shape == (0, BASE["vocab_size"])


@pytest.mark.parametrize("seq_lens", [None, (5, 1, 3)], ids=["one-sequence", "packed"])
def test_plain_path_equals_boundary_path_bitwise(tmp_path, seq_lens):
    _save_hf(tmp_path, num_hidden_layers=3)
    ours = Qwen3ForCausalLM.from_pretrained(tmp_path)
    ids = _ids(9)
    boundary = _ours(ours, ids, seq_lens=seq_lens)
    plain = _ours(ours, ids, seq_lens=seq_lens, plain=True)
    assert torch.equal(boundary, plain)


def test_bf16_close_to_transformers_bf16_and_fp32(tmp_path):
    hf = _save_hf(tmp_path, tie_word_embeddings=True)
    ids = _ids(13)
    ref32 = hf_logits(hf, ids)
    hf16 = hf_logits(hf.to(torch.bfloat16), ids)
    ours = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    got = _ours(ours, ids)
    atol = BF16_REL * ref32.abs().max().item()
    torch.testing.assert_close(got, hf16, atol=atol, rtol=0)
    torch.testing.assert_close(got, ref32, atol=atol, rtol=0)
    torch.testing.assert_close(hf16, ref32, atol=atol, rtol=0)
    # The comparison is not vacuous: bf16 really is lower precision than the tolerance of fp32.
    assert (got - ref32).abs().max() > FP32_VS_HF


# --- loading errors -------------------------------------------------------------------------


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    _save_hf(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors.pop("model.layers.1.self_attn.k_proj.weight")
    tensors["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, path)
    with pytest.raises(CheckpointMismatch) as err:
        Qwen3ForCausalLM.from_pretrained(tmp_path)
    text = str(err.value)
    assert "model.layers.1.self_attn.k_proj.weight" in text
    assert "model.layers.1.mlp.extra.weight" in text


def test_wrong_shape_is_reported(tmp_path):
    _save_hf(tmp_path)
    with open(tmp_path / "config.json") as f:
        cfg = json.load(f)
    cfg["intermediate_size"] = 48
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(CheckpointMismatch, match=r"mlp\.\w+_proj\.weight.*has shape \((64, 32|32, 64)\)"):
        Qwen3ForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope_type 'yarn'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
        ({"model_type": "qwen3_moe"}, "model_type='qwen3_moe'"),
        # values of the wrong type or null: named, never converted or a traceback (a trial)
        ({"rms_norm_eps": None}, r"rms_norm_eps=None must be a positive number"),
        ({"rms_norm_eps": "1e-6"}, r"rms_norm_eps='1e-6' must be a positive number"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": "abc"}}, "rope_theta='abc' must be a positive"),
        ({"tie_word_embeddings": "false"}, r"tie_word_embeddings='false' must be true or false"),
        ({"num_key_value_heads": 0}, r"num_key_value_heads=0 must be a positive integer"),
        ({"head_dim": 0}, r"head_dim=0 must be a positive integer"),
        ({"layer_types": ["full_attention"]}, "one type for each of the num_hidden_layers"),
    ],
)
def test_config_rejects_what_the_model_does_not_implement(change, message):
    base = small_random_config().to_dict()
    with pytest.raises(ValueError, match=message):
        Qwen3Config.from_dict({**base, **change})


@pytest.mark.parametrize("text, message", [
    ("[1]", "holds a JSON list, not an object of config fields"),
    ("{'a': 1}", "is not valid JSON in UTF-8"),
    ("", "is not valid JSON in UTF-8"),
    (b"\xff\xfe{}", "is not valid JSON in UTF-8"),
])
def test_a_config_file_that_is_not_a_json_object_is_named(tmp_path, text, message):
    from layer_boundary_app.models.config import load_config

    (tmp_path / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    for read in (load_config, Qwen3Config.from_folder):
        with pytest.raises(ValueError, match=f"config.json {message}"):
            read(tmp_path)


@pytest.mark.parametrize("arch, warns", [
    (["Qwen3ForSequenceClassification"], True), (["LlamaForCausalLM"], True), (["Qwen3ForCausalLM"], False),
    (None, False), ([], False),
])
def test_architectures_that_do_not_name_the_loaded_class_warn(tmp_path, caplog, arch, warns):
    import json
    import logging

    from layer_boundary_app.models.config import load_config

    d = small_random_config().to_dict()
    if arch is not None:
        d["architectures"] = arch
    (tmp_path / "config.json").write_text(json.dumps(d))
    with caplog.at_level(logging.WARNING, logger="layer_boundary_app.models.config"):
        assert isinstance(load_config(tmp_path), Qwen3Config)
        Qwen3Config.from_folder(tmp_path)  # as the model classes read it: the same file, said once
    said = [r.getMessage() for r in caplog.records if "does not name Qwen3ForCausalLM" in r.getMessage()]
    assert len(said) == int(warns), caplog.text


def test_config_reads_both_rope_theta_layouts():
    base = {k: v for k, v in small_random_config().to_dict().items() if k != "rope_parameters"}
    assert Qwen3Config.from_dict({**base, "rope_theta": 5e5}).rope_theta == 5e5  # transformers 4
    v5 = {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 2e5}}
    assert Qwen3Config.from_dict(v5).rope_theta == 2e5  # transformers 5
    assert Qwen3Config.from_dict({**base, "rope_scaling": None}).rope_theta == 10_000.0
    no_head_dim = {k: v for k, v in base.items() if k != "head_dim"}
    # Whatever transformers makes of a config.json without head_dim, we make the same.
    hf_head_dim = HFQwen3Config(**{k: v for k, v in no_head_dim.items() if k != "model_type"}).head_dim
    assert Qwen3Config.from_dict(no_head_dim).head_dim == hf_head_dim


def test_random_default_model_runs():
    config = small_random_config()
    model = Qwen3ForCausalLM(config)
    init_random_weights(model, seed=0)
    ids = _ids(5, vocab=config.vocab_size)
    logits = _ours(model, ids)
    assert logits.shape == (5, config.vocab_size) and torch.isfinite(logits).all()
    assert torch.equal(logits, _ours(model, ids, plain=True))


# --- sharded loading with fake groups (one process, no collectives) ---------------------------


def _fake_group(size: int, rank: int) -> GroupInfo:
    return GroupInfo(ranks=tuple(range(size)), rank=rank, group=object())


@pytest.mark.parametrize("tp, kv_heads", [(2, 2), (4, 2), (4, 1), (2, 4)])
def test_qkv_shards_hold_the_heads_their_queries_attend_to(tp, kv_heads):
    heads, hd, hidden = 4, 3, 8
    g = torch.Generator().manual_seed(0)
    wq, wk, wv = (torch.randn(n * hd, hidden, generator=g) for n in (heads, kv_heads, kv_heads))
    x = torch.randn(5, hidden, generator=g)
    for rank in range(tp):
        layer = QKVParallelLinear(hidden, hd, heads, kv_heads, False, _fake_group(tp, rank))
        for sid, w in zip("qkv", (wq, wk, wv)):
            layer.weight_loader(layer.weight, w, sid)
        q, k, v = layer.split(layer(x))
        q_heads = range(rank * heads // tp, (rank + 1) * heads // tp)
        group_size = heads // kv_heads
        kv_of = sorted({h // group_size for h in q_heads})
        if kv_heads < tp:
            assert len(kv_of) == 1, "replicated kv: one kv head per rank"
        torch.testing.assert_close(q, x @ torch.cat([wq[h * hd : (h + 1) * hd] for h in q_heads]).T)
        torch.testing.assert_close(k, x @ torch.cat([wk[h * hd : (h + 1) * hd] for h in kv_of]).T)
        torch.testing.assert_close(v, x @ torch.cat([wv[h * hd : (h + 1) * hd] for h in kv_of]).T)


def test_column_merged_row_and_vocab_shards_reassemble(monkeypatch):
    tp, g = 2, torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, generator=g)
    b = torch.randn(6, generator=g)
    x = torch.randn(3, 4, generator=g)
    col = [ColumnParallelLinear(4, 6, True, _fake_group(tp, r)) for r in range(tp)]
    for layer in col:
        layer.weight_loader(layer.weight, w)
        layer.weight_loader(layer.bias, b)
    torch.testing.assert_close(torch.cat([layer(x) for layer in col], -1), x @ w.T + b)

    gate, up = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    merged = [MergedColumnParallelLinear(4, [6, 6], False, _fake_group(tp, r)) for r in range(tp)]
    for layer in merged:
        layer.weight_loader(layer.weight, gate, 0)
        layer.weight_loader(layer.weight, up, 1)
    halves = [layer(x).chunk(2, -1) for layer in merged]
    torch.testing.assert_close(torch.cat([h[0] for h in halves], -1), x @ gate.T)
    torch.testing.assert_close(torch.cat([h[1] for h in halves], -1), x @ up.T)

    # Row-parallel partials sum to the full product, with the bias counted once (rank 0 only).
    wr, br = torch.randn(5, 6, generator=g), torch.randn(5, generator=g)
    xr = torch.randn(3, 6, generator=g)
    rows = [RowParallelLinear(6, 5, True, _fake_group(tp, r), reduce_results=False) for r in range(tp)]
    for layer in rows:
        layer.weight_loader(layer.weight, wr)
        layer.bias.weight_loader(layer.bias, br)
    partial = sum(layer(xr.chunk(tp, -1)[r]) for r, layer in enumerate(rows))
    torch.testing.assert_close(partial, xr @ wr.T + br)

    # Vocab shards (7 rows over 2 ranks: 4 + 3, padded) sum to the full lookup.
    monkeypatch.setattr("layer_boundary_app.models.layers.all_reduce", lambda t, group: t)
    emb = torch.randn(7, 4, generator=g)
    ids = torch.tensor([0, 3, 4, 6])
    parts = [VocabParallelEmbedding(7, 4, _fake_group(tp, r)) for r in range(tp)]
    for layer in parts:
        layer.weight_loader(layer.weight, emb)
    torch.testing.assert_close(sum(layer(ids) for layer in parts), emb[ids])
    assert parts[1].weight[3].abs().sum() == 0, "padding row of the last shard is zero"


def test_loader_casts_and_accepts_checkpoint_written_by_safetensors(tmp_path):
    """A checkpoint written without transformers (fp32 tensors) loads into a bf16 model."""
    from layer_boundary_app.models import random_state_dict

    config = small_random_config()
    tensors = {k: v.contiguous() for k, v in random_state_dict(config, seed=3).items()}
    save_file(tensors, tmp_path / "model.safetensors")
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(config.to_dict(), f)
    model = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert torch.isfinite(_ours(model, _ids(4, vocab=config.vocab_size))).all()
