"""The conformance kit over every provider the in-repo vendor plugins register.

Each plugin is discovered through its entry point; where it is unavailable here (no CUDA device,
vendor library missing, not ROCm) its classes skip with that reason. Their kernels arrive in later
work (FlashInfer and CuTe DSL on the H200, AITER against test doubles), at which point these
classes run them without change.
"""

from __future__ import annotations

import pytest

from layer_boundary._plugins import PluginStatus, discover
from layer_boundary._plugins.discovery import DiscoveryOptions, find_plugins
from layer_boundary.testing import FusionProviderConformance, NormKernelConformance
from layer_boundary import ForwardBatch

VENDORS = ("flashinfer", "cutedsl", "rocm_aiter")


def _registry(name: str):
    records = {r.name: r for r in find_plugins(DiscoveryOptions())}
    rec = records.get(name)
    if rec is None:
        pytest.skip(f"plugin {name} is not installed (pip install -e plugins/{name})")
    if rec.status is not PluginStatus.ACTIVE:
        pytest.skip(f"plugin {name} is {rec.status.value} here: {rec.reason}")
    return discover(allow=[name])


def _norm_providers(name: str) -> list:
    providers = [p for _, p in _registry(name).norm_kernels]
    if not providers:
        pytest.skip(f"plugin {name} registers no norm kernels yet")
    return providers


def _fusion_providers(name: str) -> list:
    providers = [p for _, p in _registry(name).fusion_providers]
    if not providers:
        pytest.skip(f"plugin {name} registers no fusion providers yet")
    return providers


@pytest.mark.parametrize("plugin", VENDORS)
class TestVendorNormKernels(NormKernelConformance):
    @pytest.fixture
    def provider(self, plugin):
        return _norm_providers(plugin)[0]


@pytest.mark.parametrize("plugin", VENDORS)
class TestVendorFusion(FusionProviderConformance):
    @pytest.fixture
    def provider(self, plugin):
        return _fusion_providers(plugin)[0]

    @pytest.fixture
    def declined_batch(self):
        return ForwardBatch(num_tokens=1 << 20)


def test_every_vendor_plugin_is_discoverable_with_a_reason():
    records = {r.name: r for r in find_plugins(DiscoveryOptions())}
    for name in VENDORS:
        rec = records.get(name)
        assert rec is not None, f"{name} is not installed; the README's set-up installs it"
        assert rec.status is PluginStatus.ACTIVE or rec.reason, rec
