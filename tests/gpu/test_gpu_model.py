"""The Qwen3 reference decoder on a CUDA GPU: same numbers as on the CPU and as transformers.

Tolerances: fp32 on the GPU against fp32 on the CPU within 1e-4 (TF32 is off; matmul and
reduction order differ between devices); bf16 against transformers bf16 on the same GPU within
the relative bound measured on the CPU (see test_qwen3_transformers.BF16_REL).
"""

from __future__ import annotations

import pytest
import torch

from layer_boundary._forward import ForwardBatch
from layer_boundary_app.models import Qwen3ForCausalLM

pytestmark = pytest.mark.gpu

BF16_REL = 0.03


def _hf_checkpoint(tmp_path, tie: bool) -> str:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        tie_word_embeddings=tie, rope_theta=50000.0,
    )
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return str(tmp_path)


def _ours(folder: str, dtype: torch.dtype, device: str, ids: torch.Tensor) -> torch.Tensor:
    model = Qwen3ForCausalLM.from_pretrained(folder, dtype=dtype, device=device)
    pos = torch.arange(ids.numel(), device=device)
    with torch.inference_mode():
        return model(ids.to(device), pos, ForwardBatch(num_tokens=ids.numel(), positions=pos)).float().cpu()


@pytest.mark.parametrize("tie", [False, True])
def test_cuda_matches_cpu_and_transformers(tmp_path, tie):
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    folder = _hf_checkpoint(tmp_path, tie)
    ids = torch.randint(0, 256, (17,), generator=torch.Generator().manual_seed(1))
    cpu32 = _ours(folder, torch.float32, "cpu", ids)
    gpu32 = _ours(folder, torch.float32, "cuda", ids)
    torch.testing.assert_close(gpu32, cpu32, atol=1e-4, rtol=0)

    gpu16 = _ours(folder, torch.bfloat16, "cuda", ids)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16).cuda().eval()
    with torch.inference_mode():
        ref16 = hf(ids[None].cuda()).logits[0].float().cpu()
    scale = cpu32.abs().max().item()
    assert (gpu16 - ref16).abs().max().item() <= BF16_REL * scale
    assert (gpu16 - cpu32).abs().max().item() <= BF16_REL * scale
