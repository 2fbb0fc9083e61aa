"""The AMD AITER plugin (layer-boundary-rocm-aiter), tested without AMD hardware.

Nothing here has run on an AMD GPU. The plugin's code runs unchanged against ``aiter_double``, a
CPU test double of the amd-aiter 0.1.7.post2.dev18 functions it calls: the double checks the
argument layouts, dtypes and buffer rules AITER's sources state and computes the torch
reference. What is tested: why the plugin is unavailable on each kind of machine, the norm
kernels through the conformance kit's CPU mode, every refusal reason, and on two spawned gloo
ranks the fused candidate inside a Qwen3 model, bitwise against the model without plugins.
What is not: that AITER's kernels compute what their sources say, and anything about speed.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import sys
import types
from typing import Any

import pytest
import torch

from layer_boundary import ForwardBatch
from layer_boundary._fusion import FusedSum
from layer_boundary._kernels.reference import rmsnorm_ref
from layer_boundary_app.launch import spawn
from layer_boundary._layout import SumGroup
from layer_boundary._plugins import PluginRegistry, PluginStatus
from layer_boundary._plugins.discovery import DiscoveryOptions, find_plugins
from layer_boundary._providers import NormRequest
from layer_boundary.testing import FusionProviderConformance, NormKernelConformance
from layer_boundary._topology import GroupInfo
from layer_boundary_rocm_aiter import detect, norm
from layer_boundary_rocm_aiter.api import AiterApi
from layer_boundary_rocm_aiter.fusion import AiterAllReduceNorm
from layer_boundary_rocm_aiter.norm import AiterNormKernels

import aiter_cases
import aiter_double

CPU = ("cpu",)


def api_of(double: aiter_double.AiterDouble, monkeypatch: Any = None) -> AiterApi:
    aiter_double.install(double, monkeypatch)
    return AiterApi(double.module, aiter_double.VERSION, import_module=lambda name: double.modules()[name])


# -- availability: each kind of machine, through discovery -----------------------------------------


@pytest.fixture
def machine(monkeypatch):
    """A machine to describe: ``hip`` (None: a CUDA/CPU build), ``gpus``, installed distribution
    versions (None: absent) and which distributions own the module ``aiter``."""
    m = types.SimpleNamespace(hip="6.3.42131-fa1d09cbd", gpus=1, versions={"amd-aiter": aiter_double.VERSION},
                              owners={"aiter": ["amd-aiter"]}, files={})
    real_version = md.version

    def version(name: str) -> str:
        key = name.lower().replace("_", "-")
        if key in m.versions:
            if m.versions[key] is None:
                raise md.PackageNotFoundError(name)
            return m.versions[key]
        return real_version(name)

    def distribution(name: str) -> Any:
        return types.SimpleNamespace(version=version(name), files=m.files.get(name, []),
                                     metadata={"Name": name, "Summary": ""})

    monkeypatch.setattr(torch.cuda, "device_count", lambda: m.gpus)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: m.gpus > 0)
    monkeypatch.setattr(md, "version", version)
    monkeypatch.setattr(md, "distribution", distribution)
    monkeypatch.setattr(md, "packages_distributions", lambda: dict(m.owners))
    monkeypatch.delitem(sys.modules, "aiter", raising=False)
    return m


def _record(monkeypatch: Any, m: Any) -> Any:
    """Discovery's record of the installed plugin on machine ``m`` (``hip`` is read now, so a test
    may change it after the fixture)."""
    monkeypatch.setattr(torch.version, "hip", m.hip)
    (rec,) = [r for r in find_plugins(DiscoveryOptions(allow=("rocm_aiter",))) if r.name == "rocm_aiter"]
    return rec


def test_unavailable_on_a_cuda_or_cpu_build_of_torch(machine, monkeypatch):
    machine.hip = None
    rec = _record(monkeypatch, machine)
    assert rec.status is PluginStatus.UNAVAILABLE
    assert rec.reason.startswith("not a ROCm build of torch (torch ")


def test_unavailable_without_amd_aiter(machine, monkeypatch):
    machine.versions = {"amd-aiter": None}
    machine.owners = {}
    rec = _record(monkeypatch, machine)
    assert rec.status is PluginStatus.UNAVAILABLE
    assert rec.reason == ("AITER not installed (distribution amd-aiter not found); "
                          "pip install 'layer-boundary-rocm-aiter[vendor]' (or pip install amd-aiter)")


def test_unavailable_with_pypis_unrelated_aiter_package_says_which_it_is(machine, monkeypatch):
    machine.versions = {"amd-aiter": None, "aiter": "0.13.20191203"}
    machine.owners = {"aiter": ["aiter"]}
    machine.files = {"aiter": ["aiter/__init__.py"]}
    rec = _record(monkeypatch, machine)
    assert rec.status is PluginStatus.UNAVAILABLE and rec.hooks is None
    assert ("the distribution aiter 0.13.20191203, PyPI's unrelated async-iterator library, "
            "not AMD's AITER") in rec.reason
    assert rec.reason.endswith("pip uninstall aiter && pip install amd-aiter")


def test_unavailable_without_a_gpu(machine, monkeypatch):
    machine.gpus = 0
    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("ROCR_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    rec = _record(monkeypatch, machine)
    assert rec.status is PluginStatus.UNAVAILABLE
    assert rec.reason == f"no ROCm GPU visible (torch {torch.__version__}, HIP {machine.hip}, sees none)"


def test_import_aiter_raising_runtime_error_is_the_reason(machine, monkeypatch):
    def import_aiter() -> Any:
        raise RuntimeError("Unable to find a ROCm installation (HIP_PATH unset)\n  traceback ...")

    monkeypatch.setattr(detect, "_import_aiter", import_aiter)
    rec = _record(monkeypatch, machine)
    assert (rec.status, rec.reason) == (
        PluginStatus.UNAVAILABLE, f"amd-aiter {aiter_double.VERSION} is installed but importing aiter raised "
        "RuntimeError: Unable to find a ROCm installation (HIP_PATH unset)")


def test_active_where_everything_holds_and_offers_both_providers(machine, monkeypatch):
    double = aiter_double.install(aiter_double.AiterDouble(), monkeypatch)
    rec = _record(monkeypatch, machine)
    assert rec.status is PluginStatus.ACTIVE, rec.reason
    reg = PluginRegistry([rec], DiscoveryOptions(allow=("rocm_aiter",)))
    (norm_origin, kernels), (fusion_origin, fusion) = reg.norm_kernels[0], reg.fusion_providers[0]
    assert (norm_origin, fusion_origin) == ("rocm_aiter", "rocm_aiter")
    assert isinstance(kernels, AiterNormKernels) and kernels.device_types == ("cuda",)
    assert isinstance(fusion, AiterAllReduceNorm) and fusion.backends == frozenset({"nccl"})
    # As shipped it serves ROCm GPUs and RCCL groups only; CPU requests are refused with the reason.
    why = kernels.refuse(NormRequest("cpu", torch.bfloat16, 64))
    assert why == "runs on cuda devices only (torch calls ROCm GPUs 'cuda'), not cpu"
    assert not double.calls  # nothing ran: the norm module is loaded when a model selects it


def test_an_aiter_without_the_targeted_functions_offers_nothing_and_says_so(monkeypatch, caplog):
    from layer_boundary_rocm_aiter import hooks

    aiter_double.install(aiter_double.AiterDouble(omit=("rmsnorm2d_fwd_with_add",)), monkeypatch)
    with caplog.at_level(logging.WARNING, logger="layer_boundary.rocm_aiter"):
        assert hooks.layer_boundary_norm_kernels() == [] and hooks.layer_boundary_fusion_providers() == []
    assert "has no aiter.rmsnorm2d_fwd_with_add (this plugin targets the API of amd-aiter 0.1.7.post2.dev18)" \
        in caplog.records[0].getMessage()


# -- norm kernels: the conformance kit's CPU mode over the double ---------------------------------


class TestAiterNormKernelsConformance(NormKernelConformance):
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    hidden_sizes = (64, 127, 4096, 8192, 8200)

    @pytest.fixture
    def device(self) -> str:
        return "cpu"

    @pytest.fixture
    def provider(self, monkeypatch):
        self.double = aiter_double.AiterDouble()
        return AiterNormKernels(api_of(self.double, monkeypatch), device_types=CPU)

    def test_the_accepted_requests_are_the_documented_ones(self, provider, device):
        accepted = {(r.dtype, r.hidden_size, r.weight_offset) for r in self._accepted(provider, device)}
        assert accepted == {(dt, h, 0.0) for dt in (torch.bfloat16, torch.float16) for h in (64, 127, 4096, 8192)}
        self.test_fused_add_rmsnorm_matches_reference(provider, device)
        assert self.double.calls["rmsnorm2d_fwd_with_add"] > 0  # the kit ran AITER's (double's) kernel


@pytest.mark.parametrize("request_, reason", [
    (NormRequest("cpu", torch.float32, 64), "AITER's CK rmsnorm2d takes fp16 and bf16 only, not float32"),
    (NormRequest("cpu", torch.bfloat16, 64, 1.0),
     "Gemma RMSNorm (weight + 1) is not offered: rmsnorm2d in amd-aiter 0.1.7.post2.dev18 has no weight offset"),
    (NormRequest("cpu", torch.bfloat16, 8200), "H=8200 is above 8192, where CK's two-pass add + RMSNorm "
     "normalizes the residual rounded to bfloat16, not the FP32 sum"),
    (NormRequest("cpu", torch.bfloat16, 64, 0.0, "int4"), "unknown quantized output 'int4' (known: fp8_e4m3)"),
], ids=["fp32", "gemma", "two-pass", "unknown-quant"])
def test_norm_refusals(request_, reason):
    assert AiterNormKernels(api_of(aiter_double.AiterDouble()), device_types=CPU).refuse(request_) == reason


def test_the_two_pass_refusal_is_what_keeps_the_fp32_sum(monkeypatch):
    # Lift the limit: at H=8200 the output then normalizes the rounded residual, as CK's two-pass
    # pipeline does (and the double with it), which the conformance kit's rounding check rejects.
    monkeypatch.setattr(norm, "MAX_ONE_PASS_HIDDEN", 1 << 20)
    k = AiterNormKernels(api_of(aiter_double.AiterDouble()), device_types=CPU).kernels(
        NormRequest("cpu", torch.bfloat16, 8200))
    g = torch.Generator().manual_seed(3)
    x, r = (torch.randn(64, 8200, generator=g).to(torch.bfloat16) for _ in range(2))
    w = torch.ones(8200, dtype=torch.bfloat16)
    y, _ = k.fused_add_rmsnorm(x, r, w, 1e-6)
    exact = x.double() + r.double()
    err_fp32 = (y.double() - rmsnorm_ref(exact, w.double(), 1e-6)).abs().mean()
    err_rounded = (y.double() - rmsnorm_ref(exact.to(torch.bfloat16).double(), w.double(), 1e-6)).abs().mean()
    assert err_rounded < err_fp32


@pytest.mark.parametrize("fp8, omit, reason", [
    (torch.float8_e4m3fnuz, (), "AITER's FP8 on this GPU (gfx942, MI300) is float8_e4m3fnuz (max 240, another "
     "exponent bias); fp8_e4m3 rows are float8_e4m3fn"),
    (torch.float8_e4m3fn, (), "the dynamic-quant RMSNorm of amd-aiter 0.1.7.post2.dev18 does not floor its per-token "
     "scale: an all-zero row gets scale 0 and NaN codes, where fp8_e4m3 rows floor the scale at 1e-12 with zero codes"),
    (torch.uint8, (), "amd-aiter 0.1.7.post2.dev18 has no FP8 type for this GPU (aiter.dtypes.fp8 is torch.uint8)"),
    (torch.float8_e4m3fn, ("rmsnorm2d_fwd_with_add_dynamicquant",), "amd-aiter 0.1.7.post2.dev18 has no "
     "aiter.rmsnorm2d_fwd_with_add_dynamicquant (this plugin targets the API of amd-aiter 0.1.7.post2.dev18)"),
], ids=["gfx942-fnuz", "gfx950-no-floor", "no-fp8-type", "no-function"])
def test_fp8_outputs_are_refused_with_the_mismatch(fp8, omit, reason):
    double = aiter_double.AiterDouble(fp8=fp8, omit=omit)
    provider = AiterNormKernels(api_of(double), device_types=CPU)
    assert provider.refuse(NormRequest("cpu", torch.bfloat16, 64, 0.0, "fp8_e4m3")) == reason
    with pytest.raises(ValueError, match="does not serve"):
        provider.kernels(NormRequest("cpu", torch.bfloat16, 64, 0.0, "fp8_e4m3"))
    assert not double.calls


def test_kernels_check_aiter_against_the_reference_when_a_model_is_built():
    class Silent(aiter_double.AiterDouble):
        def rmsnorm2d_fwd_with_add(self, out, input, residual_in, residual_out, weight, epsilon, *a):
            pass  # CK returns without writing when no instance matches the shape

    with pytest.raises(RuntimeError, match="disagree with the torch reference for rmsnorm cpu bfloat16 H=64"):
        AiterNormKernels(api_of(Silent()), device_types=CPU).kernels(NormRequest("cpu", torch.bfloat16, 64))


def test_kernels_pass_aiter_only_what_it_reads_correctly():
    double = aiter_double.AiterDouble()
    k = AiterNormKernels(api_of(double), device_types=CPU).kernels(NormRequest("cpu", torch.bfloat16, 16))
    before = dict(double.calls)
    x = torch.randn(3, 16).to(torch.bfloat16)
    # A weight of another dtype would be misread by CK: the reference serves that call.
    w32 = torch.rand(16) + 0.5
    assert torch.equal(k.rmsnorm(x, w32, 1e-6), rmsnorm_ref(x, w32, 1e-6))
    assert dict(double.calls) == before
    # Destinations are filled by copy (AITER's residual_out must not alias residual_in).
    r = torch.randn(3, 16).to(torch.bfloat16)
    r0 = r.clone()
    y, r2 = k.fused_add_rmsnorm(x, r, w32.to(torch.bfloat16), 1e-6, residual_out=r)
    assert r2 is r and torch.equal(r, (x.float() + r0.float()).to(torch.bfloat16))
    assert double.calls["rmsnorm2d_fwd_with_add"] == before["rmsnorm2d_fwd_with_add"] + 1


def test_the_double_rejects_what_aiter_rejects():
    d = aiter_double.AiterDouble()
    x = torch.randn(2, 8).to(torch.bfloat16)
    w = torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="only support fp16 and bf16"):
        d.rmsnorm2d_fwd(x.float(), w.float(), 1e-6)
    r = x.clone()
    with pytest.raises(aiter_double.Violation, match="shares memory with residual_in"):
        d.rmsnorm2d_fwd_with_add(torch.empty_like(x), x, r, r, w, 1e-6)
    with pytest.raises(aiter_double.Violation, match="reads gamma with the input precision"):
        d.rmsnorm2d_fwd(x, w.float(), 1e-6)
    with pytest.raises(aiter_double.Violation, match="must not call it"):
        d.module.rmsnorm2d_fwd_with_dynamicquant(None)


# -- the fused candidate's refusals and decisions, in one process ---------------------------------


def _fused(world: int, hidden: int = 64, dtype: torch.dtype = torch.bfloat16) -> FusedSum:
    group = GroupInfo(ranks=tuple(range(world)), rank=0, group=object())
    return FusedSum(SumGroup.TP, group, hidden, dtype, 0.0, None)


@pytest.mark.parametrize("world, hidden, dtype, reason", [
    (3, 64, torch.bfloat16, "AITER's custom all-reduce runs on 2, 4, 6, 8 ranks, not 3"),
    (2, 60, torch.bfloat16, "a row of H=60 is 120 bytes; AITER's custom all-reduce moves whole 16-byte packs"),
    (2, 4, torch.float16, "a row of H=4 is 8 bytes; AITER's custom all-reduce moves whole 16-byte packs"),
    (6, 64, torch.bfloat16, None), (8, 8192, torch.float16, None),
])
def test_group_refusals(world, hidden, dtype, reason):
    provider = AiterAllReduceNorm(api_of(aiter_double.AiterDouble()))
    assert provider.group_refusal(_fused(world, hidden, dtype)) == reason


def test_custom_allreduce_that_fails_to_import_is_a_local_reason():
    def failing(name: str) -> Any:
        raise RuntimeError("HIP error: no ROCm-capable device is detected\nmore")

    double = aiter_double.AiterDouble()
    api = AiterApi(double.module, aiter_double.VERSION, import_module=failing)
    assert api.custom_allreduce_missing() == (
        "importing aiter.dist.device_communicators.custom_all_reduce from amd-aiter 0.1.7.post2.dev18 raised "
        "RuntimeError: HIP error: no ROCm-capable device is detected")


def test_ffn_sums_are_deferred_only_where_every_rank_decides_alike():
    from layer_boundary import BoundaryContext, Topology, declare_attn, declare_ffn, make_stages
    from layer_boundary._norms import RMSNorm
    from layer_boundary._topology import GroupInfo

    pair, solo = GroupInfo(ranks=(0, 1), rank=0, group=object()), GroupInfo.solo()
    topo = Topology(tp=pair, attn_tp=pair, attn_dp=solo, attn_cp=solo, moe_out=pair, pp=solo)
    _, ffn = make_stages((declare_attn(), RMSNorm(64, dtype=torch.bfloat16)),
                         (declare_ffn(), RMSNorm(64, dtype=torch.bfloat16)), previous=declare_ffn(),
                         context=BoundaryContext(topo, core_fusion=False))
    provider = AiterAllReduceNorm(api_of(aiter_double.AiterDouble()), max_tokens=8)
    fb = ForwardBatch(num_tokens=4)
    assert provider.can_defer_all_reduce(ffn.plan, fb) is False  # no candidate serves that sum
    other = AiterAllReduceNorm(api_of(aiter_double.AiterDouble()), max_tokens=8)
    other._workspaces[((0, 1), 64, torch.bfloat16)] = object()  # as if it served the TP group
    assert other.can_defer_all_reduce(ffn.plan, fb) is True
    assert other.can_defer_all_reduce(ffn.plan, ForwardBatch(num_tokens=9)) is False  # over the workspace
    assert other.can_defer_all_reduce(ffn.plan, ForwardBatch(num_tokens=0)) is False
    assert other.can_defer_all_reduce(ffn.plan, ForwardBatch(num_tokens=4, dp_num_tokens=(4, 3))) is False
    assert other.can_defer_all_reduce(ffn.plan, ForwardBatch(num_tokens=4, context_parallel=True)) is False
    other.defer_sums = False
    assert other.can_defer_all_reduce(ffn.plan, fb) is False


class TestAiterFusionConformance(FusionProviderConformance):
    """On one rank nothing is owed, so the kit checks the decisions and that nothing is offered."""

    @pytest.fixture
    def device(self) -> str:
        return "cpu"

    @pytest.fixture
    def provider(self, monkeypatch):
        return AiterAllReduceNorm(api_of(aiter_double.AiterDouble(), monkeypatch), device_type="cpu",
                                  backends=("gloo",))

    @pytest.fixture
    def declined_batch(self):
        return ForwardBatch(num_tokens=1 << 20)


# -- two gloo ranks: the candidate inside a model, bitwise against the model without plugins ------


@pytest.fixture(scope="module")
def gloo2() -> list[dict]:
    return spawn(aiter_cases.model_cases, 2, timeout_s=300)


def _per_rank(gloo2: list[dict], case: str) -> list[dict]:
    return [res[case] for res in gloo2]


def test_attention_sums_complete_through_aiters_custom_allreduce(gloo2):
    for rank, r in enumerate(_per_rank(gloo2, "no_defer")):
        assert r["equal"], (rank, r)
        assert r["all_reduces"] == r["layers"], (rank, r)  # each FFN input's attention-TP sum
        assert r["workspaces"] == 1, (rank, r)  # one CustomAllreduce per (group, H, dtype)
        assert r["chosen"] == [aiter_cases.CANDIDATE] and r["norm_chosen"] == ["rocm-aiter"], (rank, r)


def test_deferred_ffn_sums_complete_at_the_next_attention_input(gloo2):
    for rank, r in enumerate(_per_rank(gloo2, "defer")):
        assert r["equal"], (rank, r)
        # Every FFN but the terminal one leaves its sum to the next input.
        assert r["all_reduces"] == 2 * r["layers"] - 1, (rank, r)


def test_over_the_token_limit_every_rank_takes_the_unfused_path(gloo2):
    for rank, r in enumerate(_per_rank(gloo2, "over_limit")):
        assert r["equal"] and r["all_reduces"] == 0, (rank, r)


def test_a_rank_without_aiters_allreduce_library_turns_every_rank_away(gloo2):
    r0, r1 = _per_rank(gloo2, "rank1_no_library")
    for rank, r in enumerate((r0, r1)):
        assert r["equal"] and r["all_reduces"] == 0 and r["workspaces"] == 0 and r["chosen"] == ["None"], (rank, r)
    assert r1["refusals"] == ["AITER's custom all-reduce library did not load in this process (amd-aiter "
                              "0.1.7.post2.dev18; aiter logged why: 'Custom allreduce is disabled')"]
    assert r0["refusals"] == ["another rank of the group refused it (its selection report says why); every rank "
                              "takes the same path or none does"]


def test_float32_is_refused_by_both_providers_with_reasons(gloo2):
    for r in _per_rank(gloo2, "float32"):
        assert r["equal"] and r["add_norms"] == r["norms"] == r["all_reduces"] == 0, r
        assert r["refusals"] == ["dtype float32 is not supported"]
        assert r["norm_chosen"] == ["torch-reference"]
        assert r["norm_refusals"] == ["AITER's CK rmsnorm2d takes fp16 and bf16 only, not float32"]


def test_a_group_across_hosts_is_refused(gloo2):
    for r in _per_rank(gloo2, "two_hosts"):
        assert r == {"refusals": ["the group spans hosts node0, node1; AITER's custom all-reduce maps peer GPU "
                                  "memory over IPC, within one node"], "workspaces": 0}


def test_the_candidate_called_directly(gloo2):
    for rank, r in enumerate(_per_rank(gloo2, "direct")):
        assert r["candidates"] == [aiter_cases.CANDIDATE], (rank, r)
        # Two ranks: the FP32 sum rounded once is the gloo sum; the add + norm is the reference's.
        assert r["y_equal"] and r["r_equal"], (rank, r)
        assert r["inputs_untouched"] and r["residual_out_of_place"], (rank, r)
        assert r["declined_over_limit"] and r["all_reduces"] == 1, (rank, r)


def test_static_refusals_in_the_selection_report(gloo2):
    for r in _per_rank(gloo2, "static"):
        assert r == {
            "wide": ["hidden size 8200 is over its limit of 8192", "workspaces=0"],
            "odd_bytes": ["a row of H=60 is 120 bytes; AITER's custom all-reduce moves whole 16-byte packs",
                          "workspaces=0"],
            "gemma": ["Gemma RMSNorm (weight + 1) is not offered", "workspaces=0"],
            "fp16": ["workspaces=1"],
        }
