"""layer-boundary-app: the application beside the layer-boundary core.

The reference decoders (Qwen3, Qwen3-MoE, LongCat, the heterogeneous stack, NextN) written on the
boundaries as an engine would write them, the Hugging Face checkpoint loader (``models``), the rank
launcher (``launch``), and the ``layer-boundary run`` and ``layer-boundary bench ...`` commands
(``cli``, ``bench``), which the core's ``layer-boundary`` finds through the entry-point group
``layer_boundary.commands``. Importing this package imports nothing heavy.
"""
