"""layer-boundary-cutedsl: CuTe DSL kernels for layer-boundary on NVIDIA GPUs.

Importing this package is light (neither torch nor the CuTe DSL): discovery loads only
``layer_boundary_cutedsl._manifest``, and ``layer_boundary_cutedsl.hooks`` once the plugin can run
here.
"""

__version__ = "0.1.0"
