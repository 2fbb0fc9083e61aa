"""The fused MoE finalize handoff (``layer_boundary._fusion.moe_finalize``), its install/prepare
helpers and the CuTe DSL plugin's service names, against the unfused single-rank model.

The embedded Qwen3-MoE has sparse layers 0, 2 and 3 (layer 1 is dense), so one forward fuses
three handoffs: layer 0's at layer 1's attention input, layer 2's at layer 3's, and layer 3's at
the final (Gemma) norm. Tolerances: ``FINALIZE_TOLERANCE`` relative to the largest |logit|.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from layer_boundary import BoundaryContext, Topology
from layer_boundary._fusion.install import install_finalize_fusion, prepare_finalize_fusion
from layer_boundary._fusion.moe_finalize import FINALIZE_TOLERANCE, MoeFinalizeFusion, finalize_partial_ref
from layer_boundary._kernels.reference import fused_add_rmsnorm_ref
from layer_boundary.testing._finalize import make_handoff
from layer_boundary_app.launch import spawn
from layer_boundary_app.models.config import small_random_moe_config
from layer_boundary_app.models.qwen3_moe import Qwen3MoeForCausalLM, init_random_moe_weights
from layer_boundary_app.models.runner import _batch

import finalize_cases

HERE = Path(__file__).resolve().parents[1] / "support"  # the case files
SEQS = [[1, 5, 9, 2, 77], [4, 8]]
# In bf16 a token near a top-k tie may pick another expert once the residual rounds differently
# (a jump, not a rounding error): bf16 cases route every token to all 8 experts.
ALL_EXPERTS = {"num_experts_per_tok": 8}
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def _check(r: dict, *, calls: int = 3) -> None:
    atol, _ = FINALIZE_TOLERANCE[DTYPES[r["case"]["dtype"]]]
    assert r["max_diff"] <= atol * max(1.0, r["scale"]), r
    assert r["fused_calls"] == calls, r


def test_finalize_kernel_under_the_triton_interpreter():
    pytest.importorskip("triton", reason="triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "finalize_interpreter_cases.py")]
    proc = subprocess.run(cmd, cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


def test_auto_kernel_takes_the_reference_for_a_model_on_the_cpu_of_a_cuda_machine(monkeypatch):
    # On the H200 the CPU model's candidate chose Triton (CUDA was available) and handed it CPU
    # tensors ("Pointer argument cannot be accessed from Triton"); float64 was declined outright.
    from layer_boundary._topology import GroupInfo

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    auto, triton = MoeFinalizeFusion(kernel="auto"), MoeFinalizeFusion(kernel="triton")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert auto.kernel == "triton" and not auto._triton_on(cpu) and auto._triton_on(cuda)
    assert auto._group_refusal(GroupInfo.solo(), torch.float64, 64, cpu) is None  # the reference serves
    assert triton._group_refusal(GroupInfo.solo(), torch.bfloat16, 64, cpu) == (
        "kernel='triton' runs on CUDA tensors; this norm's weight is on cpu")
    # The whole one-rank model as on that machine: every handoff fused, on the reference path.
    for r in finalize_cases.fused_matrix(0, 1, [dict(sequences=SEQS, dtype="float64")]):
        _check(r)
        assert r["kernel"] == "triton"


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_one_rank_fused_finalize_matches_the_unfused_model(dtype):
    config = ALL_EXPERTS if dtype == "bfloat16" else {}
    for r in finalize_cases.fused_matrix(0, 1, [dict(sequences=SEQS, dtype=dtype, config=config)]):
        _check(r)


def test_tensor_parallel_fused_finalize_matches_one_rank_on_gloo():
    cases = [dict(sequences=SEQS, dtype="float64"), dict(sequences=SEQS, dtype="bfloat16", config=ALL_EXPERTS),
             # attention DP: the candidate refuses (rows move), every handoff completes unfused
             dict(sequences=SEQS + [[3, 3, 7]], dtype="float64", dp=2)]
    for rank_results in spawn(finalize_cases.fused_matrix, 2, args=(cases,), timeout_s=240):
        _check(rank_results[0])
        _check(rank_results[1])
        _check(rank_results[2], calls=0)


def _model(fusions=None, *, zero_centered=True, dtype=torch.float64, device="cpu", **cfg_kw):
    cfg = dataclasses.replace(small_random_moe_config(), zero_centered_norms=zero_centered, **cfg_kw)
    ctx = BoundaryContext(Topology.single(), device=device)
    model = Qwen3MoeForCausalLM(cfg, context=ctx, dtype=dtype, fusions=fusions)
    init_random_moe_weights(model, seed=0)
    return model.to(device).eval()


def _logits(model, seqs=SEQS, device="cpu"):
    ids, fb = _batch(seqs, device, None)
    with torch.inference_mode():
        return model(ids, fb.positions, fb)


def test_install_finds_no_provider_and_says_how_to_pass_one():
    with pytest.raises(ValueError, match="no MoeFinalizeFusion in the model's stages: pass one as the stages' fusions"):
        install_finalize_fusion(_model(), MoeFinalizeFusion)
    with pytest.raises(ValueError, match="has no decoder layers with attn_boundary"):
        install_finalize_fusion(torch.nn.Linear(2, 2), MoeFinalizeFusion)
    with pytest.raises(ValueError, match="kernel must be"):
        MoeFinalizeFusion(kernel="cuda")


def test_an_uninstalled_provider_defers_nothing_and_prepare_needs_install():
    provider = MoeFinalizeFusion(kernel="reference")
    model = _model(provider)
    with pytest.raises(RuntimeError, match="is not installed"):
        prepare_finalize_fusion(model, MoeFinalizeFusion)
    torch.testing.assert_close(_logits(model), _logits(_model()), rtol=0, atol=0)
    assert provider.fused_calls == 0
    with pytest.raises(RuntimeError, match="terminal_finalize=True"):
        provider.finalize(None, torch.zeros(1, 64), torch.zeros(64))


def test_a_plain_final_norm_keeps_the_terminal_handoff_unfused():
    provider = MoeFinalizeFusion(kernel="reference")
    model = _model(provider, zero_centered=False)
    service = install_finalize_fusion(model, MoeFinalizeFusion, terminal_finalize=True)
    assert service is provider and model.model.handoff_norm is provider
    # The last FFN does not defer (its final norm is not Gemma): two handoffs fuse, not three.
    torch.testing.assert_close(_logits(model), _logits(_model(zero_centered=False)), rtol=1e-12, atol=1e-12)
    assert provider.fused_calls == 2


def test_batches_over_the_workspace_complete_unfused():
    provider = MoeFinalizeFusion(kernel="reference", max_tokens=4)
    model = _model(provider)
    install_finalize_fusion(model, MoeFinalizeFusion, terminal_finalize=True)
    torch.testing.assert_close(_logits(model), _logits(_model()), rtol=1e-12, atol=1e-12)
    assert provider.fused_calls == 0  # 7 tokens > 4: no exit deferred
    _logits(model, [[1, 2, 3]])
    assert provider.fused_calls == 3


def test_selection_report_names_the_candidate_after_each_sparse_ffn():
    provider = MoeFinalizeFusion(kernel="reference")
    model = _model(provider)
    rows = [s for s in model.context.report.selections if s.what == "consumer fusion"]
    chosen = {s.stage: s.chosen for s in rows}
    # Layer 1 follows sparse layer 0, layer 3 follows sparse layer 2; layer 2 follows dense 1.
    assert any("moe finalize" in (c or "") for c in chosen.values()), chosen


def test_cutedsl_service_names_install_through_the_boundaries():
    from layer_boundary_cutedsl import CuteDslFusion, install_cutedsl_fusion, prepare_cutedsl_fusion

    provider = CuteDslFusion(kernel="reference")
    model = _model(provider)
    service = install_cutedsl_fusion(model, terminal_finalize=True)
    prepare_cutedsl_fusion(model)
    assert service is provider and model.model.handoff_norm is provider
    atol, _ = FINALIZE_TOLERANCE[torch.float64]
    torch.testing.assert_close(_logits(model), _logits(_model()), rtol=atol, atol=atol)
    assert provider.fused_calls == 3
    with pytest.raises(ValueError, match="no CuteDslFusion"):
        install_cutedsl_fusion(_model(MoeFinalizeFusion(kernel="reference")))


# -- GPU --------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_triton_fused_finalize_on_one_gpu(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    seqs = [[1, 5, 9, 2, 77], [4, 8], list(range(3, 200))]
    config = ALL_EXPERTS if dtype == "bfloat16" else {}
    for r in finalize_cases.fused_matrix(0, 1, [dict(sequences=seqs, dtype=dtype, config=config)], "cuda"):
        assert r["kernel"] == "triton"
        _check(r)


@pytest.mark.gpu
def test_cutedsl_finalize_variant_on_one_gpu():
    """The plugin's service end to end on one H200: the CuTe DSL variant built in prepare (its
    self-check passed) serves all three handoffs of a forward; H=256 is the smallest width it
    takes (whole 128-bit vectors over full warps)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    from layer_boundary_cutedsl import CuteDslFusion, install_cutedsl_fusion, prepare_cutedsl_fusion

    kw = dict(hidden_size=256, head_dim=32, num_attention_heads=8, num_key_value_heads=4, **ALL_EXPERTS)
    provider = CuteDslFusion()
    model = _model(provider, dtype=torch.bfloat16, device="cuda", **kw)
    install_cutedsl_fusion(model, terminal_finalize=True)
    prepare_cutedsl_fusion(model)
    assert sorted(v[3:] for v in provider._variants) == [(8, False), (8, True)], provider._variants
    seqs = SEQS + [list(range(3, 100))]
    got = _logits(model, seqs, "cuda")
    want = _logits(_model(dtype=torch.bfloat16, device="cuda", **kw), seqs, "cuda")
    atol, _ = FINALIZE_TOLERANCE[torch.bfloat16]
    assert (got - want).abs().max().item() <= atol * max(1.0, want.abs().max().item())
    assert provider.fused_calls == 3


@pytest.mark.gpu
def test_triton_fused_finalize_on_two_gpus_matches_one():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs; {torch.cuda.device_count()} visible")
    cases = [dict(sequences=SEQS + [list(range(3, 300))], dtype="bfloat16", config=ALL_EXPERTS),
             dict(sequences=SEQS + [list(range(3, 300))], dtype="float32")]
    for rank_results in spawn(finalize_cases.fused_matrix, 2, args=(cases, "cuda"), backend="nccl", timeout_s=300):
        for r in rank_results:
            assert r["kernel"] == "triton"
            _check(r)


# -- the conformance kit ------------------------------------------------------------------------

from layer_boundary import ForwardBatch  # noqa: E402
from layer_boundary.testing import FusionProviderConformance  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
class TestReferenceFinalizeConformance(FusionProviderConformance):
    @pytest.fixture
    def provider(self):
        return MoeFinalizeFusion(kernel="reference", max_tokens=64)

    @pytest.fixture
    def dtype(self, dtype):
        return dtype

    @pytest.fixture
    def device(self):
        return "cpu"

    @pytest.fixture
    def declined_batch(self):
        return ForwardBatch(num_tokens=1 << 20)


# -- the CuTe DSL one-rank variants (compiler and launcher doubles) -----------------------------


def test_cutedsl_prepares_one_rank_variants_and_serves_only_what_it_built(caplog):
    from layer_boundary_cutedsl import CuteDslFusion

    built, launched = [], []

    def compiler(h, dtype, offset, fused, *, topk, shared):
        built.append((h, dtype, offset, topk, shared))
        return ("variant", topk, shared)

    def launch(compiled, x, r, w, y, eps, tw, sh):
        launched.append(compiled)
        y.copy_(fused_add_rmsnorm_ref(finalize_partial_ref(x, tw, sh), r, w, eps, weight_offset=1.0,
                                      residual_out=r)[0])

    p = CuteDslFusion(kernel="triton", compiler=compiler, launch=launch)
    p._norms.add((1, 256, torch.bfloat16, 1.0))
    p._norms.add((2, 256, torch.bfloat16, 1.0))  # a two-rank consumer: the core kernel's
    p.prepare(top_k=(2,))
    assert built == [(256, "bfloat16", 1.0, 2, False), (256, "bfloat16", 1.0, 2, True)]
    launched.clear()  # where CUDA is, prepare's self-check launched each variant once
    h = make_handoff(4, 256, torch.bfloat16, "cpu")  # top-4: not prepared
    p_ = h.payload
    r = torch.randn(4, 256).to(torch.bfloat16)
    norm = (torch.zeros(256, dtype=torch.bfloat16), 1e-6, 1.0)
    assert p.local_kernel(p_["expert_out"], p_["topk_weights"], p_["shared_out"], r, norm) is None
    assert any("no CuTe DSL variant was prepared for H=256 top-4" in m for m in caplog.messages)
    e2, w2 = p_["expert_out"][:, :2].contiguous(), p_["topk_weights"][:, :2].contiguous()
    call = p.local_kernel(e2, w2, p_["shared_out"], r, norm)
    out = torch.empty_like(r)
    call(out)
    assert launched == [("variant", 2, True)]
    # A row stride that breaks the 128-bit accesses: the core kernel instead.
    assert p.local_kernel(p_["expert_out"][:, :2], w2, p_["shared_out"], r, norm) is not None  # stride 4*256
    odd = torch.randn(4, 2, 260).to(torch.bfloat16)[:, :, :256]
    assert p.local_kernel(odd, w2, None, r, norm) is None


def test_cutedsl_failed_variant_is_reported_and_skipped(caplog):
    from layer_boundary_cutedsl import CuteDslFusion

    def compiler(*a, **k):
        raise RuntimeError("ptxas died")

    p = CuteDslFusion(kernel="triton", compiler=compiler)
    p._norms.add((1, 256, torch.float16, 0.0))
    p.prepare(top_k=(8,))
    assert not p._variants
    assert any("is not used (RuntimeError: ptxas died)" in m for m in caplog.messages)


@pytest.mark.gpu
class TestTritonFinalizeConformance(TestReferenceFinalizeConformance):
    """The core Triton kernel (one rank: its WORLD == 1 path) through the same kit, on a GPU, for
    the dtypes the parent class is parametrized with."""

    @pytest.fixture
    def provider(self):
        return MoeFinalizeFusion(kernel="triton", max_tokens=64)

    @pytest.fixture
    def device(self):
        return "cuda"


def test_one_provider_serves_two_models_each_with_its_own_final_norm():
    provider = MoeFinalizeFusion(kernel="reference")
    a, b = _model(provider), _model(provider)
    with torch.no_grad():
        b.model.norm.weight.add_(0.5)  # a different final norm: its own eps/weight must be used
    install_finalize_fusion(a, MoeFinalizeFusion, terminal_finalize=True)
    install_finalize_fusion(b, MoeFinalizeFusion, terminal_finalize=True)
    ref_b = _model()
    with torch.no_grad():
        ref_b.model.norm.weight.add_(0.5)
    torch.testing.assert_close(_logits(a), _logits(_model()), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(_logits(b), _logits(ref_b), rtol=1e-12, atol=1e-12)
    assert provider.fused_calls == 6
