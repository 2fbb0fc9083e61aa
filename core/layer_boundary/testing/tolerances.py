"""The conformance kit's tolerances: ``layer_boundary.tolerances``, where the benchmarks read them
without pytest."""

from ..tolerances import *  # noqa: F401,F403
from ..tolerances import __all__  # noqa: F401
