"""The conformance kit: test classes a plugin vendor subclasses to prove a provider.

Opt in with ``pytest -p layer_boundary.testing`` (or ``pytest_plugins = ["layer_boundary.testing"]``
in a conftest), then subclass and provide the fixtures each class documents::

    from layer_boundary.testing import NormKernelConformance

    class TestMyKernels(NormKernelConformance):
        @pytest.fixture
        def provider(self):
            return MyNormProvider()

Classes: :class:`NormKernelConformance` (norm-read kernels), :class:`FusionProviderConformance`
(consumer candidates and deferral decisions), :class:`ResidualSemanticsConformance` (update/read
pairs). Each checks numerics against the core's torch reference with the provider's declared
tolerance, the rounding order of update and read, stream state transitions, that norm kernels
trace under ``torch.compile(fullgraph=True)`` with their eager numbers (:func:`assert_traces`, which
a vendor may call on any kernel), and, where the provider claims a GPU, CUDA-graph capture safety.
"""

from __future__ import annotations

import pytest

from .._kit_markers import pytest_configure
from ._fusion import FusionProviderConformance
from ._norm_kernels import NormKernelConformance
from ._semantics import ResidualSemanticsConformance
from ._tolerances import DEFAULT_TOLERANCE, tolerance_of
from ._tracing import assert_traces

__all__ = [
    "NormKernelConformance",
    "FusionProviderConformance",
    "ResidualSemanticsConformance",
    "DEFAULT_TOLERANCE",
    "tolerance_of",
    "assert_traces",
    "pytest_configure",
]
