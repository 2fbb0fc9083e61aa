"""The FlashInfer plugin (``plugins/flashinfer``): norm-read kernels and the fused all-reduce +
add + RMSNorm consumer candidate.

On the CPU, FlashInfer is a test double (``flashinfer_double``) that checks the argument layouts,
dtypes and in-place writes FlashInfer 0.7.2 documents and computes the torch reference in its
rounding order; the plugin's wrappers, refusals, selection and model wiring run over it (the
conformance kit's CPU mode, and 2 gloo ranks). The real FlashInfer on GPUs: test_flashinfer_gpu.py.
"""

from __future__ import annotations

import logging
import pathlib
import re
import sys

import pytest
import torch

from layer_boundary import BoundaryContext, ForwardBatch
from layer_boundary._fusion import FusedSum
from layer_boundary._kernels.reference import fused_add_rmsnorm_ref, rmsnorm_ref
from layer_boundary_app.launch import spawn
from layer_boundary._layout import SumGroup
from layer_boundary._plugins import PluginError, PluginRegistry, PluginStatus
from layer_boundary._plugins.discovery import DiscoveryOptions, find_plugins
from layer_boundary._providers import NormRequest
from layer_boundary.testing import FusionProviderConformance, NormKernelConformance
from layer_boundary._topology import GroupInfo

import flashinfer_cases
import flashinfer_double
from layer_boundary_flashinfer import fusion as fi_fusion
from layer_boundary_flashinfer import hooks as fi_hooks
from layer_boundary_flashinfer.fusion import FlashInferAllReduceNorm
from layer_boundary_flashinfer.norm import FP8_REFUSAL, FlashInferNormProvider, flashinfer_kernels

PLUGIN_SRC = pathlib.Path(fi_hooks.__file__).parent
EPS = 1e-6


@pytest.fixture(autouse=True)
def fusion_default(monkeypatch):
    """The fused candidate is on unless an operator turned it off; no test inherits a setting."""
    monkeypatch.delenv(fi_fusion.FUSION_ENV, raising=False)


def test_the_fused_candidate_is_on_unless_turned_off(monkeypatch, fi):
    assert FlashInferAllReduceNorm().enabled
    monkeypatch.setenv(fi_fusion.FUSION_ENV, "0")
    assert FlashInferAllReduceNorm().local_refusal(_fused()) == fi_fusion.TURNED_OFF
    assert FlashInferAllReduceNorm(enabled=True).local_refusal(_fused()) != fi_fusion.TURNED_OFF
    monkeypatch.setenv(fi_fusion.FUSION_ENV, "yes")
    assert FlashInferAllReduceNorm().enabled


@pytest.fixture
def fi(monkeypatch):
    """The FlashInfer test double in ``sys.modules`` for this test."""
    return flashinfer_double.install(monkeypatch)


@pytest.fixture
def no_flashinfer(monkeypatch):
    """``import flashinfer`` fails, as where the distribution is missing."""
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setitem(sys.modules, "flashinfer.comm", None)


class CpuFlashInferNorm(FlashInferNormProvider):
    """The plugin's provider with one fact changed: it serves CPU requests (over the double)."""

    device_type = "cpu"


_rand = flashinfer_cases.norm_inputs


def _called(double, name: str) -> list[dict]:
    return [info for n, info in double.calls if n == name]


# -- the norm kernels over the double: the conformance kit and the wrappers' contract ------------

class TestNormKernelsOverTheDouble(NormKernelConformance):
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    hidden_sizes = (64, 127, 1000)

    @pytest.fixture
    def provider(self, fi):
        return CpuFlashInferNorm()


def test_default_fused_call_keeps_the_contribution_and_updates_the_residual_in_place(fi):
    k = flashinfer_kernels(fi.pkg)
    assert k.residual_in_place and k.name == "flashinfer"
    x, r, w = _rand(5, 64, torch.bfloat16)
    x0, r0 = x.clone(), r.clone()
    y, r2 = k.fused_add_rmsnorm(x, r, w, EPS, weight_offset=0.0)
    want_y, want_r = fused_add_rmsnorm_ref(x0, r0, w, EPS)
    assert torch.equal(x, x0), "the caller's contribution was overwritten"
    assert r2 is r and torch.equal(r, want_r)
    assert torch.equal(y, want_y) and y.data_ptr() != x.data_ptr()
    (call,) = _called(fi, "fused_add_rmsnorm")
    # FlashInfer normalized a copy of x in place, and added into the caller's residual.
    assert call["input_ptr"] == y.data_ptr() and call["residual_ptr"] == r.data_ptr()


def test_out_x_hands_the_contribution_over_and_saves_the_copy(fi):
    k = flashinfer_kernels(fi.pkg)
    x, r, w = _rand(5, 64, torch.float16, seed=1)
    want_y, want_r = fused_add_rmsnorm_ref(x.clone(), r.clone(), w, EPS, weight_offset=1.0)
    ptr = x.data_ptr()
    y, r2 = k.fused_add_rmsnorm(x, r, w, EPS, weight_offset=1.0, out=x)
    assert y is x and torch.equal(y, want_y) and r2 is r and torch.equal(r, want_r)
    (call,) = _called(fi, "gemma_fused_add_rmsnorm")
    assert call["input_ptr"] == ptr


def test_given_destinations_leave_the_inputs_alone(fi):
    k = flashinfer_kernels(fi.pkg)
    x, r, w = _rand(4, 64, torch.bfloat16, seed=2)
    x0, r0 = x.clone(), r.clone()
    out, r_out = torch.empty_like(x), torch.empty_like(r)
    y, r2 = k.fused_add_rmsnorm(x, r, w, EPS, weight_offset=0.0, out=out, residual_out=r_out)
    want_y, want_r = fused_add_rmsnorm_ref(x0, r0, w, EPS)
    assert y is out and r2 is r_out and torch.equal(y, want_y) and torch.equal(r2, want_r)
    assert torch.equal(x, x0) and torch.equal(r, r0)


def test_a_parameter_weight_reaches_flashinfer_detached(fi):
    k = flashinfer_kernels(fi.pkg)
    x, r, _ = _rand(3, 64, torch.bfloat16, seed=5)
    norm = torch.nn.Parameter(torch.rand(64).to(torch.bfloat16) + 0.5)  # requires grad
    with torch.inference_mode():
        y, _ = k.fused_add_rmsnorm(x, r.clone(), norm, EPS, weight_offset=0.0)
        n = k.rmsnorm(x, norm, EPS, weight_offset=0.0)
    assert torch.equal(n, rmsnorm_ref(x, norm.detach(), EPS))
    assert [c["weight"].requires_grad for _, c in fi.calls] == [False, False]


def test_an_empty_batch_launches_nothing(fi):
    k = flashinfer_kernels(fi.pkg)
    x, r, w = _rand(0, 64, torch.bfloat16)
    y, r2 = k.fused_add_rmsnorm(x, r, w, EPS, weight_offset=0.0)
    assert y.shape == (0, 64) and r2 is r
    assert k.rmsnorm(x, w, EPS, weight_offset=1.0).shape == (0, 64)
    assert fi.calls == []  # the double, like FlashInfer, rejects a launch over zero rows


def test_rmsnorm_copies_a_strided_input_and_writes_out(fi):
    k = flashinfer_kernels(fi.pkg)
    wide, _, w = _rand(6, 128, torch.bfloat16, seed=3)
    x = wide[:, ::2]
    w = w[:64].contiguous()
    out = torch.empty(6, 64, dtype=torch.bfloat16)
    got = k.rmsnorm(x, w, EPS, weight_offset=0.0, out=out)
    assert got is out and torch.equal(out, rmsnorm_ref(x.contiguous(), w, EPS))
    (call,) = _called(fi, "rmsnorm")
    assert call["input"].is_contiguous() and call["out"] is out


@pytest.mark.parametrize("case", ["weight dtype", "misaligned residual", "3-D", "offset 0.5"])
def test_inputs_flashinfer_cannot_take_go_to_the_reference_with_one_warning(fi, case, caplog):
    k = flashinfer_kernels(fi.pkg)
    x, r, w = _rand(3, 64, torch.bfloat16, seed=4)
    offset = 0.0
    if case == "weight dtype":
        w = w.float()  # FlashInfer would read these FP32 bytes as bf16
    elif case == "misaligned residual":
        r = flashinfer_cases._misaligned(r)
    elif case == "3-D":
        x, r = x.view(3, 1, 64), r.view(3, 1, 64)
    else:
        offset = 0.5
    want_y, want_r = fused_add_rmsnorm_ref(x.clone(), r.clone(), w, EPS, weight_offset=offset)
    with caplog.at_level(logging.WARNING, logger="layer_boundary"):
        for _ in range(2):
            x_in = x.clone()
            r_in = flashinfer_cases._misaligned(r) if case == "misaligned residual" else r.clone()
            y, r2 = k.fused_add_rmsnorm(x_in, r_in, w, EPS, weight_offset=offset)
            assert torch.equal(y, want_y) and torch.equal(r2, want_r) and r2 is r_in
    assert fi.calls == []
    assert len(caplog.records) == 1 and "use the torch reference" in caplog.records[0].getMessage()


# -- refusals and selection --------------------------------------------------------------------

@pytest.mark.parametrize("request_, reason", [
    (NormRequest("cpu", torch.bfloat16, 64), "runs on CUDA devices only, not cpu"),
    (NormRequest("cuda", torch.bfloat16, 64, 0.0, "fp8_e4m3"), FP8_REFUSAL),
    (NormRequest("cuda", torch.bfloat16, 64, 0.0, "int4"), "unknown quantized output 'int4' (known: fp8_e4m3)"),
    (NormRequest("cuda", torch.float32, 64),
     "float32 is not supported: FlashInfer's norm kernels take bf16 and fp16 only"),
    (NormRequest("cuda", torch.float64, 64),
     "float64 is not supported: FlashInfer's norm kernels take bf16 and fp16 only"),
    (NormRequest("cuda", torch.float16, 64, 0.5),
     "weight offset 0.5 is not offered: FlashInfer has RMSNorm (offset 0) and Gemma RMSNorm (offset 1)"),
    (NormRequest("cuda", torch.bfloat16, 65536),
     "hidden size 65536 is over 32768: the fused kernel keeps a row in shared memory"),
    (NormRequest("cuda", torch.bfloat16, 7168, 1.0), None),
], ids=lambda v: v.describe() if isinstance(v, NormRequest) else "")
def test_norm_provider_refusals(fi, request_, reason):
    assert FlashInferNormProvider().refuse(request_) == reason


def test_fp8_refusal_names_what_flashinfer_offers_instead():
    assert "static per-tensor scale" in FP8_REFUSAL and "per-token" in FP8_REFUSAL


def test_norm_provider_refuses_where_flashinfer_does_not_import(no_flashinfer):
    why = FlashInferNormProvider().refuse(NormRequest("cuda", torch.bfloat16, 64))
    assert why.startswith("flashinfer is not importable (ModuleNotFoundError: ")
    assert why.endswith("; pip install flashinfer-python")


def test_norm_provider_refuses_a_flashinfer_without_the_functions(fi, monkeypatch):
    monkeypatch.delattr(fi.pkg, "gemma_fused_add_rmsnorm")
    assert FlashInferNormProvider().refuse(NormRequest("cuda", torch.bfloat16, 64)) == (
        "flashinfer 0.7.2.post1+double lacks gemma_fused_add_rmsnorm; install flashinfer-python 0.7.2 or newer")


def test_norm_kernels_are_built_at_construction_and_a_failed_build_is_a_refusal(fi, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert FlashInferNormProvider().refuse(NormRequest("cuda", torch.bfloat16, 64)) is None
    assert len(_called(fi, "get_norm_module")) == 1
    fi.build_error = "Ninja build failed.\nmore"
    assert FlashInferNormProvider().refuse(NormRequest("cuda", torch.bfloat16, 64)) == (
        "FlashInfer could not build its norm kernels here (RuntimeError: Ninja build failed.); they compile "
        "with nvcc on first use (CUDA_HOME)")


def _registry_with_hooks() -> PluginRegistry:
    registry = PluginRegistry([])
    registry.register(fi_hooks, name="flashinfer")
    return registry


def test_selection_report_shows_flashinfer_chosen_and_why_it_refuses(fi):
    ctx = BoundaryContext(registry=_registry_with_hooks(), device="cuda")  # selection for a CUDA model
    select = ctx.kernel_selector("attn #1", "ORDINARY")
    kernels = select(NormRequest("cpu", torch.bfloat16, 4096))
    assert kernels.name == "flashinfer" and kernels.residual_in_place
    select(NormRequest("cpu", torch.bfloat16, 4096, 0.0, "fp8_e4m3"))
    select(NormRequest("cpu", torch.float32, 4096))
    chosen, fp8, fp32 = ctx.report.selections
    assert chosen.chosen == "flashinfer" and [c.refused for c in chosen.candidates][0] is None
    for row, why in ((fp8, FP8_REFUSAL), (fp32, "float32 is not supported: FlashInfer's norm kernels take bf16 "
                                                "and fp16 only")):
        assert row.chosen != "flashinfer"
        assert f"flashinfer (flashinfer): {why}" in row.text()


# -- the fusion provider's refusals --------------------------------------------------------------

def _fused(world: int = 2, hidden: int = 4096, dtype=torch.bfloat16, offset: float = 0.0, quant=None) -> FusedSum:
    group = GroupInfo(ranks=tuple(range(world)), rank=0, group=object())
    return FusedSum(SumGroup.TP, group, hidden, dtype, offset, quant)


@pytest.mark.parametrize("fused, reason", [
    (_fused(world=3), "FlashInfer's fused all-reduce has kernels for 2, 4, 8, 16 ranks; the tp group has 3"),
    (_fused(world=6), "FlashInfer's fused all-reduce has kernels for 2, 4, 8, 16 ranks; the tp group has 6"),
    (_fused(hidden=1001), "hidden size 1001 is not a multiple of 8: the fused kernel moves 16-byte vectors of bfloat16"),
    (_fused(hidden=1002, dtype=torch.float32),
     "hidden size 1002 is not a multiple of 4: the fused kernel moves 16-byte vectors of float32"),
    (_fused(quant="fp8_e4m3"), fi_fusion.FP8_REFUSAL),
    (_fused(world=16, hidden=1000, dtype=torch.float16, offset=1.0), None),
    (_fused(world=8, hidden=1004, dtype=torch.float32), None),
], ids=str)
def test_fusion_group_refusals(fused, reason):
    assert FlashInferAllReduceNorm().group_refusal(fused) == reason


def test_fusion_static_limits_through_the_shared_checks():
    class AnyGroup(FlashInferAllReduceNorm):
        backends = frozenset({"unknown"})  # a test double's group has no torch.distributed backend

    prov = AnyGroup()
    # The base class checks these first; the provider's limits make its reasons.
    assert prov._common_refusal(_fused(world=32)) == "group of 32 ranks is over its limit of 16"
    assert prov._common_refusal(_fused(hidden=32768)) == "hidden size 32768 is over its limit of 16384"
    assert prov._common_refusal(_fused(quant="int4")) == "int4 output is not offered"
    assert prov._common_refusal(_fused(dtype=torch.float64)) == "dtype float64 is not supported"


class TestFusionProviderKit(FusionProviderConformance):
    """On one rank nothing is owed, so no candidate is offered: the kit checks the decisions."""

    @pytest.fixture
    def provider(self):
        return FlashInferAllReduceNorm()

    @pytest.fixture
    def declined_batch(self):
        return ForwardBatch(num_tokens=1 << 20)


def test_fp8_fusion_refusal_says_why():
    assert "rounding them to the activation dtype" in fi_fusion.FP8_REFUSAL


def test_fusion_local_refusals(monkeypatch, fi):
    prov = FlashInferAllReduceNorm()
    if not torch.cuda.is_available():
        assert prov.local_refusal(_fused()) == "no CUDA device in this process"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert prov.local_refusal(_fused()) == (
        "FlashInfer builds its all-reduce fusion for compute capability 9.x, 10.x and 12.x; this GPU is 8.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert prov.local_refusal(_fused()) is None
    assert prov.local_refusal(_fused(offset=1.0)) is None


def test_fusion_local_refusal_without_flashinfer_or_its_gemma(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setitem(sys.modules, "flashinfer.comm", None)
    why = FlashInferAllReduceNorm().local_refusal(_fused())
    assert why.startswith("flashinfer.comm is not importable (ModuleNotFoundError: ") and why.endswith(
        "; pip install flashinfer-python")
    flashinfer_double.install(monkeypatch, weight_bias=False)
    prov = FlashInferAllReduceNorm()
    assert prov.local_refusal(_fused()) is None
    assert prov.local_refusal(_fused(offset=1.0)) == (
        "this FlashInfer's allreduce_fusion takes no weight_bias, so it has no Gemma RMSNorm (weight + 1); "
        "install flashinfer-python 0.7.2 or newer")


def test_fusion_kernels_that_do_not_build_are_a_refusal(monkeypatch, fi):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fi.build_error = "Ninja build failed.\nnvcc: not found"
    prov = FlashInferAllReduceNorm()
    why = "FlashInfer could not build its all-reduce fusion kernels here (RuntimeError: Ninja build failed.); " \
          "they compile with nvcc on first use (CUDA_HOME)"
    assert prov.local_refusal(_fused()) == why
    assert prov.local_refusal(_fused(hidden=2048)) == why  # tried once per provider
    assert len(_called(fi, "build_and_load")) == 1
    fi.build_error = None
    ok = FlashInferAllReduceNorm()
    assert ok.local_refusal(_fused()) is None and ok.local_refusal(_fused()) is None
    assert len(_called(fi, "build_and_load")) == 2


@pytest.mark.parametrize("world, hidden, dtype, option, rows", [
    (2, 4096, torch.bfloat16, None, 16384),  # 512 MiB / (4096 * 2 * 2 * 2 bytes)
    (4, 4096, torch.bfloat16, None, 1024),
    (8, 7168, torch.bfloat16, None, 192),  # 42 MiB is exactly 192 such rows
    (8, 4096, torch.float32, None, 168),
    (16, 4096, torch.bfloat16, None, 128),
    (4, 4096, torch.bfloat16, 1, 4),  # never two-shot with fewer rows than ranks
    (2, 4096, torch.bfloat16, 100, 100),
])
def test_oneshot_row_limit(world, hidden, dtype, option, rows):
    prov = FlashInferAllReduceNorm(oneshot_max_tokens=option)
    assert prov.oneshot_rows(_fused(world=world, hidden=hidden, dtype=dtype)) == rows


@pytest.mark.parametrize("kw", [{"max_tokens": 0}, {"max_tokens": 1.5}, {"oneshot_max_tokens": -1},
                                {"max_tokens": True}])
def test_fusion_provider_rejects_bad_limits(kw):
    with pytest.raises(ValueError, match="must be a positive integer"):
        FlashInferAllReduceNorm(**kw)


def test_the_workspace_backend_is_always_trtllm():
    """NVLink multicast must never run here: "auto" may pick "mnnvl", and both "mnnvl" backends
    use multicast. The plugin names its backend, and names no other."""
    backends = [b for p in PLUGIN_SRC.glob("*.py") for b in re.findall(r"backend\s*=\s*['\"]([\w-]+)['\"]", p.read_text())]
    assert backends and set(backends) == {"trtllm"}


# -- hooks, registry and discovery ---------------------------------------------------------------

def test_hooks_give_each_registry_fresh_providers_without_importing_flashinfer(monkeypatch):
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    a, b = _registry_with_hooks(), _registry_with_hooks()
    (origin, norm), = a.norm_kernels
    (_, fusion), = a.fusion_providers
    assert origin == "flashinfer" and isinstance(norm, FlashInferNormProvider)
    assert isinstance(fusion, FlashInferAllReduceNorm) and fusion.max_tokens == 2048
    assert fusion is not b.fusion_providers[0][1]  # workspaces belong to one registry's models
    assert "flashinfer" not in sys.modules


def test_max_tokens_from_the_environment(monkeypatch):
    monkeypatch.setenv(fi_hooks.ENV_MAX_TOKENS, "4096")
    assert _registry_with_hooks().fusion_providers[0][1].max_tokens == 4096
    assert fi_hooks.max_tokens_from_env({}) == 2048
    monkeypatch.setenv(fi_hooks.ENV_MAX_TOKENS, "many")
    with pytest.raises(PluginError, match=r"LAYER_BOUNDARY_FLASHINFER_MAX_TOKENS='many' is not a positive integer"):
        _registry_with_hooks()


def test_discovery_reports_the_plugin_unavailable_here():
    (rec,) = [r for r in find_plugins(DiscoveryOptions(allow=("flashinfer",))) if r.name == "flashinfer"]
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: whether the plugin is active depends on flashinfer-python")
    assert rec.status is PluginStatus.UNAVAILABLE
    assert rec.reason == f"no CUDA device (torch {torch.__version__} sees none)"
    assert rec.hooks is None


# -- two gloo ranks: the candidate in a model and called directly, over the double ----------------

GLOO_CASES = [
    dict(dtype="bfloat16", hidden=64, tokens=[1, 2, 5, 16, 17], max_tokens=16),
    dict(dtype="float16", hidden=128, tokens=[1, 3, 8, 9], max_tokens=8, gemma=True, oneshot=2),
    dict(dtype="float32", hidden=60, tokens=[1, 4, 7], max_tokens=8, misaligned=True),
    dict(dtype="bfloat16", hidden=64, tokens=[2, 3, 4, 5], max_tokens=8, misaligned=True),
]
TOL = {"bfloat16": 1.6e-2, "float16": 2e-3, "float32": 1e-5}


@pytest.fixture(scope="module")
def gloo2() -> list[dict]:
    with pytest.MonkeyPatch.context() as mp:  # the spawned ranks inherit the default (on)
        mp.delenv(fi_fusion.FUSION_ENV, raising=False)
        return spawn(flashinfer_cases.gloo_cases, 2, args=(GLOO_CASES,), timeout_s=240)


def test_model_fuses_every_owed_sum_and_gives_the_unfused_logits(gloo2):
    for rank, res in enumerate(gloo2):
        m = res["model"]
        assert m["equal"], (rank, m)
        # Attention's sums at each FFN input, and every FFN's (deferred by the provider) at the
        # next attention input; the terminal FFN sums before the final norm.
        assert m["calls"] == 2 * m["layers"] - 1, (rank, m)
        assert [w["backend"] for w in m["workspaces"]] == ["trtllm"], (rank, m)  # one, shared by every stage
        assert m["workspaces"][0]["max_token_num"] == 64 and m["workspaces"][0]["world_size"] == 2
        assert m["chosen"] == ["flashinfer all-reduce + add + rmsnorm"], (rank, m)
        # The plugin's own provider (registered through its hooks) says why it cannot run here.
        assert m["refused"] == ["flashinfer: needs a nccl group; attn_tp uses gloo",
                                "flashinfer: needs a nccl group; tp uses gloo"], (rank, m)
        assert all("flashinfer (flashinfer): runs on CUDA devices only, not cpu" in t for t in m["norm_rows"])
        # fp32 rows: no FP32 accumulation to ask for; in place residual; the output buffer reused.
        assert m["flags"] == [(False, False, True, True, True, False)], (rank, m)


def test_candidate_matches_the_all_reduce_and_the_reference(gloo2):
    for rank, res in enumerate(gloo2):
        for row in res["candidate"]:
            case = row["case"]
            assert row["candidates"] == ["flashinfer all-reduce + add + rmsnorm"], (rank, row)
            assert row["workspaces"] == 1, (rank, row)
            assert row["problems"] == [], (rank, row)
            assert row["worst_y"] <= TOL[case["dtype"]] * 8, (rank, row)  # |y| reaches about 8 here
            assert row["declined"] == [t for t in case["tokens"] if t > case["max_tokens"]], (rank, row)
            served = [t for t in case["tokens"] if t <= case["max_tokens"]]
            assert [r["tokens"] for r in row["runs"]] == served, (rank, row)
            for run in row["runs"]:
                assert run["use_oneshot"] == (run["tokens"] <= row["oneshot_rows"]), (rank, row)
                assert run["fp32_acc"] == (case["dtype"] != "float32")
                assert (run["launch_with_pdl"], run["trigger_completion_at_end"]) == (False, True)
                assert run["weight_bias"] == (1.0 if case.get("gemma") else 0.0)
                assert run["residual_in_place"] and run["output_is_norm_out"] and not run["norm_out_is_input"]
            m = case["max_tokens"]
            assert row["defer"] == {0: False, 1: True, m: True, m + 1: False}, (rank, row)


def test_two_shot_runs_above_the_one_shot_limit(gloo2):
    row = gloo2[0]["candidate"][1]  # oneshot_max_tokens=2
    assert row["oneshot_rows"] == 2
    assert [r["use_oneshot"] for r in row["runs"]] == [True, False, False]


def test_a_rank_whose_flashinfer_lacks_gemma_makes_every_rank_refuse(gloo2):
    r0, r1 = (res["gemma_unsupported_on_rank_1"] for res in gloo2)
    assert r0["chosen"] == r1["chosen"] == ["None"]
    assert r0["workspaces"] == r1["workspaces"] == 0
    assert r1["refused"] == ["this FlashInfer's allreduce_fusion takes no weight_bias, so it has no Gemma "
                             "RMSNorm (weight + 1); install flashinfer-python 0.7.2 or newer"]
    assert r0["refused"] == ["another rank of the group refused it (its selection report says why); every "
                             "rank takes the same path or none does"]
