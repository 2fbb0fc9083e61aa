"""Which norm modules a stage read binds as RMSNorm (fused add+norm), which as Gemma RMSNorm, and
which it calls as a black box: a stage's prepared input must equal ``norm(x)`` for every one of them.
Found by a new-user trial: transformers' GemmaRMSNorm (``* (1 + weight)``), a hand-written LayerNorm
and a batch norm were once all read as plain RMSNorm, silently."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from layer_boundary import ForwardBatch, Topology, declare_attn, declare_ffn, make_stages
from layer_boundary._norms import GemmaRMSNorm, RMSNorm, norm_params
from layer_boundary.residual import batch as residual_batch

H = 16


class LlamaStyleRMSNorm(nn.Module):
    """As transformers' LlamaRMSNorm: FP32 statistics, ``variance_epsilon``, ``weight * x``."""

    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class GemmaStyleRMSNorm(nn.Module):
    """As transformers' GemmaRMSNorm: ``x / rms(x) * (1 + weight)``, weight initialized to zeros."""

    def __init__(self, hidden: int, eps: float = 1e-6, device: str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class HandWrittenLayerNorm(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.bias = nn.Parameter(torch.zeros(hidden))
        self.eps = 1e-5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class NeedsMask(nn.Module):
    """RMSNorm-like attributes, but a forward that takes two arguments."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x * mask


def _prepared(norm: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, str]:
    (stage,) = make_stages((declare_attn(), norm), topology=Topology.single())
    fb = ForwardBatch.for_tokens(x.shape[0])
    residual_batch.start(fb)
    return stage.prepare(x, fb), repr(stage)


@pytest.mark.parametrize("make,read", [
    (lambda: RMSNorm(H), "read=rmsnorm"),
    (lambda: GemmaRMSNorm(H), "read=gemma_rmsnorm"),
    (lambda: nn.RMSNorm(H, eps=1e-6), "read=rmsnorm"),
    (lambda: nn.RMSNorm(H), "read=rmsnorm"),  # eps None: torch's default, FP32's epsilon
    (lambda: LlamaStyleRMSNorm(H), "read=rmsnorm"),
    (lambda: GemmaStyleRMSNorm(H), "read=gemma_rmsnorm"),
    (lambda: nn.BatchNorm1d(H).eval(), "read=module:BatchNorm1d"),
    (lambda: nn.LayerNorm(H), "read=module:LayerNorm"),
], ids=["rmsnorm", "gemma", "torch-rmsnorm", "torch-rmsnorm-default-eps", "llama-style", "gemma-style",
        "batchnorm", "layernorm"])
def test_a_stage_prepares_what_the_norm_computes(make, read):
    torch.manual_seed(0)
    norm = make()
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.5)
    x = torch.randn(4, H) * 3 + 1
    got, desc = _prepared(norm, x)
    assert read in desc
    torch.testing.assert_close(got, norm(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_torch_rmsnorm_default_eps_is_the_compute_dtypes(dtype):
    # A trial (a bf16 model with nn.RMSNorm(H)): the read took bf16's epsilon (7.8e-3) where torch
    # takes FP32's for FP16/BF16 (FP64's for FP64); on activations of magnitude 0.02 (the usual
    # init) the prepared input was off by half its size.
    torch.manual_seed(0)
    norm = nn.RMSNorm(H, dtype=dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(4, H) * 0.02).to(dtype)
    got, desc = _prepared(norm, x)
    assert "read=rmsnorm" in desc
    torch.testing.assert_close(got, norm(x))


@pytest.mark.parametrize("built, run", [(torch.float64, torch.float32), (torch.float32, torch.float64)])
def test_torch_rmsnorm_default_eps_follows_a_cast_after_construction(built, run):
    # A trial: the stage was built, then the model cast (.float() / .double()); torch's module took
    # the new dtype's epsilon, the read kept the old one (off by up to 58% on small activations).
    torch.manual_seed(0)
    norm = nn.RMSNorm(H, dtype=built)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    (attn, ffn) = make_stages((declare_attn(), norm), (declare_ffn(), nn.RMSNorm(H, dtype=built)),
                              topology=Topology.single())
    norm.to(run)
    ffn.plan.read.norm.to(run)
    x = (torch.randn(4, H, dtype=torch.float64) * 3e-4).to(run)
    fb = ForwardBatch.for_tokens(4)
    residual_batch.start(fb)
    torch.testing.assert_close(attn.prepare(x, fb), norm(x))
    c = (torch.randn(4, H, dtype=torch.float64) * 3e-4).to(run)
    got = ffn.prepare(attn.finish(c, fb), fb)
    torch.testing.assert_close(got, ffn.plan.read.norm((x.double() + c.double()).to(run)))
    assert attn.plan.read.eps == torch.finfo(run).eps


def test_an_unrecognized_norm_is_called_as_a_black_box_with_a_warning():
    torch.manual_seed(0)
    norm = HandWrittenLayerNorm(H)
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.5)
        norm.bias.normal_(0.0, 0.5)
    x = torch.randn(4, H) * 3 + 1
    with pytest.warns(UserWarning, match="HandWrittenLayerNorm .* black box"):
        got, desc = _prepared(norm, x)
    assert "read=module:HandWrittenLayerNorm" in desc
    torch.testing.assert_close(got, norm(x))
    with pytest.warns(UserWarning, match="NeedsMask .* probing its forward failed"):
        assert norm_params(NeedsMask(H)) is None  # its forward cannot be probed: a black box too
    declared = NeedsMask(H)
    declared.weight_offset = 1.0  # what an engine whose norm cannot run on a CPU copy declares
    assert norm_params(declared)[2] == 1.0


def test_the_probe_reads_a_meta_device_norm_and_leaves_the_module_alone():
    # Engines often build on the meta device and load weights later: the probe runs on a copy.
    norm = GemmaStyleRMSNorm(H, device="meta")
    params = norm_params(norm)
    assert params is not None and params[2] == 1.0 and params[0] is norm.weight and norm.weight.is_meta
    llama = LlamaStyleRMSNorm(H)
    before = llama.weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert norm_params(llama)[2] == 0.0
    assert torch.equal(llama.weight, before)


def test_transformers_gemma_rmsnorm_reads_with_its_offset():
    gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    torch.manual_seed(0)
    norm = gemma.GemmaRMSNorm(H, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.5)
    x = torch.randn(4, H) * 3 + 1
    got, desc = _prepared(norm, x)
    assert "read=gemma_rmsnorm" in desc
    torch.testing.assert_close(got, norm(x), rtol=1e-6, atol=1e-6)


def test_an_input_of_the_wrong_width_names_the_stage_and_the_width():
    # torch's own error was a broadcast of two sizes, with no stage named.
    with pytest.raises(ValueError, match=r"attn #1: hidden_states has 8 columns, but its norm is for "
                                         r"hidden size 16"):
        _prepared(RMSNorm(H), torch.randn(4, 8))


def test_a_final_norm_of_the_wrong_width_is_named():
    # A trial: the final norm gave torch's broadcast error from inside the reference kernel.
    (stage,) = make_stages((declare_attn(), RMSNorm(H)), topology=Topology.single(), terminal=True)
    fb = ForwardBatch.for_tokens(4)
    residual_batch.start(fb)
    x = torch.randn(4, H)
    h = stage.finish(stage.prepare(x, fb), fb)
    with pytest.raises(ValueError, match=rf"the final norm: hidden_states has {H} columns, but its norm is for "
                                         r"hidden size 8"):
        residual_batch.norm(h, fb, RMSNorm(8))


def test_layer_norm_and_other_modules_are_black_boxes_with_a_warning_once(monkeypatch):
    # Found by a new-user trial: nn.LayerNorm (and a module that is no norm) took the black-box path
    # without the warning the docs promise; nn.Identity (no norm at all) stays silent.
    from layer_boundary import _norms as norms

    monkeypatch.setattr(norms, "_WARNED", set())
    with pytest.warns(UserWarning, match="LayerNorm normalizes by its mean and variance"):
        assert norm_params(nn.LayerNorm(H)) is None
    with pytest.warns(UserWarning, match="Linear has no 1-D weight"):
        assert norm_params(nn.Linear(H, H)) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert norm_params(nn.LayerNorm(H)) is None  # once per class
        assert norm_params(nn.Identity()) is None


class Int8ScaledRMSNorm(nn.Module):
    """A norm that keeps its weight as int8 codes with a scale: its own forward knows what they mean."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randint(-100, 100, (hidden,), dtype=torch.int8), requires_grad=False)
        self.scale = 0.01
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (x.float() * rms * (self.weight.float() * self.scale)).to(x.dtype)


def test_a_norm_with_an_integer_weight_is_called_as_a_black_box(monkeypatch):
    # Its int8 codes were once multiplied in as if they were the weight (cast to the input dtype).
    from layer_boundary import _norms as norms

    monkeypatch.setattr(norms, "_WARNED", set())
    torch.manual_seed(0)
    norm = Int8ScaledRMSNorm(H)
    x = torch.randn(4, H) * 3 + 1
    with pytest.warns(UserWarning, match="Int8ScaledRMSNorm keeps its weight as int8, not floating point"):
        got, desc = _prepared(norm, x)
    assert "read=module:Int8ScaledRMSNorm" in desc
    torch.testing.assert_close(got, norm(x))


def test_the_library_norms_refuse_sizes_and_eps_that_cannot_be():
    from layer_boundary._norms import GemmaRMSNorm, RMSNorm

    for cls in (RMSNorm, GemmaRMSNorm):
        for bad in (0, -3, 2.5, True):
            with pytest.raises(ValueError, match="hidden_size=.* an int of at least 1"):
                cls(bad)
        with pytest.raises(ValueError, match=r"eps=-1\): a number of at least 0"):
            cls(8, eps=-1)
    assert RMSNorm(8, eps=0).eps == 0.0
