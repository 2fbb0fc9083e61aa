"""Shared test settings: GPU-marked tests skip with the physical reason where no GPU is visible."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    reason = f"needs a CUDA GPU; torch {torch.__version__} sees none on this machine"
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fake_dist(monkeypatch: pytest.MonkeyPatch):
    """Collectives of ``layer_boundary._ops`` routed to a recording fake (see helpers.FakeCollectives)."""
    from helpers import install_fake_dist

    return install_fake_dist(monkeypatch)
