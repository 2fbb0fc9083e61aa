"""The conformance kit's tolerances: ``layer_boundary._tolerances``, where the benchmarks read them
without pytest."""

from .._tolerances import *  # noqa: F401,F403
from .._tolerances import __all__  # noqa: F401
