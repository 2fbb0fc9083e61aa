"""The kit's pytest markers, registered wherever ``layer-boundary`` is installed.

The core distribution names this module as a ``pytest11`` entry point, so a vendor's test file that
subclasses the kit's classes gets no unknown-mark warnings even without ``-p layer_boundary.testing``.
It imports nothing but pytest, and lives outside ``testing`` (whose package imports torch): pytest
loads it in every project of the environment.
"""

from __future__ import annotations

import pytest

__all__ = ["MARKERS", "pytest_configure"]

MARKERS = (
    "gpu: needs a CUDA GPU (skipped where none is visible)",
    "conformance: a layer-boundary conformance-kit check",
)


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)
