"""layer-boundary-flashinfer: FlashInfer kernels for layer-boundary on NVIDIA GPUs.

Importing this package is light (neither torch nor FlashInfer): discovery loads only
``layer_boundary_flashinfer._manifest``, and ``layer_boundary_flashinfer.hooks`` once the plugin
can run here.
"""

__version__ = "0.1.0"
