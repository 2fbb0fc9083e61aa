"""layer-boundary: the transitions between the compute stages of a transformer layer stack.

A boundary completes outstanding reductions, moves token rows between ranks, applies the
producer's residual update and prepares the consumer's normalized input. Models keep their
compute; they declare stages and call ``prepare`` / ``finish`` / ``exit`` around it::

    attn_boundary, ffn_boundary = make_stages(
        (declare_attn(), input_layernorm),
        (declare_ffn(), post_attention_layernorm),
        previous=declare_ffn() if layer_id else None,
        terminal=layer_id == num_layers - 1,
        context=context,
    )

This package is the engine face; its one export list is ``__init__.pyi``. Plugin vendors use
``layer_boundary.plugin_api``, and the conformance kit is ``layer_boundary.testing``.

Importing this package discovers no plugins, creates no process groups and imports nothing
heavy: names load on first use (PEP 562), so a plugin's light manifest can import
``layer_boundary.plugin_api`` without torch.
"""

from __future__ import annotations

from ._lazy import attach_stub

__version__ = "0.1.0"

__getattr__, __dir__, __all__ = attach_stub(__name__, __file__, globals())
