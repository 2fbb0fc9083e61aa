"""layer-boundary-rocm-aiter: AMD AITER kernels for layer-boundary on ROCm.

Importing this package is light (neither torch nor AITER): discovery loads only
``layer_boundary_rocm_aiter._manifest`` (and the probe in ``detect``), and
``layer_boundary_rocm_aiter.hooks`` once the plugin can run here.
"""

__version__ = "0.1.0"
