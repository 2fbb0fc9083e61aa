"""layer-boundary: the transitions between the compute stages of a transformer layer stack.

A boundary completes outstanding reductions, moves token rows between ranks, applies the
producer's residual update and prepares the consumer's normalized input. Models keep their
compute; they declare stages and call ``prepare`` / ``finish`` / ``exit`` around it::

    attn_boundary, ffn_boundary = make_stages(
        (declare_attn(), input_layernorm),
        (declare_ffn(), post_attention_layernorm),
        previous=declare_ffn() if layer_id else None,
        terminal=layer_id == num_layers - 1,
        topology=topology,
    )

Importing this package discovers no plugins, creates no process groups and imports nothing
heavy: names load on first use (PEP 562), so a plugin's light manifest can import
``layer_boundary.plugins.manifest`` without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "AuxHiddenStateList": ".capture",
    "BoundaryContext": ".context",
    "Owed": ".contracts",
    "OwedKind": ".contracts",
    "ProducerReduction": ".contracts",
    "StageKind": ".contracts",
    "BoundaryError": ".errors",
    "DeclarationError": ".errors",
    "FfnExit": ".exit",
    "MixerExit": ".exit",
    "StageDeclaration": ".factories",
    "declare_attn": ".factories",
    "declare_ffn": ".factories",
    "make_attn_stage": ".factories",
    "make_ffn_stage": ".factories",
    "make_stages": ".factories",
    "ForwardBatch": ".forward",
    "ForwardBatchLike": ".forward",
    "ForwardFlags": ".forward",
    "ForwardMode": ".forward",
    "active_variant": ".forward",
    "get_forward": ".forward",
    "BatchVariant": ".layout",
    "Layout": ".layout",
    "SumGroup": ".layout",
    "TokenAxis": ".layout",
    "GemmaRMSNorm": ".norms",
    "RMSNorm": ".norms",
    "Contribution": ".output",
    "HandoffOutput": ".output",
    "OutputTransform": ".output",
    "OwedOutput": ".output",
    "UnreducedOutput": ".output",
    "LayerResidual": ".residual",
    "ReadSpec": ".residual",
    "StageRead": ".residual",
    "StageUpdate": ".residual",
    "ResidualStream": ".residual.stream",
    "StreamState": ".residual.stream",
    "ConsumerCandidate": ".providers",
    "FusionProvider": ".providers",
    "NormKernelProvider": ".providers",
    "NormRequest": ".providers",
    "ResidualSemantics": ".providers",
    "StageResidual": ".providers",
    "QuantizedRows": ".quant",
    "SelectionReport": ".selection",
    "StageBoundary": ".stage",
    "GroupInfo": ".topology",
    "Topology": ".topology",
}

if TYPE_CHECKING:  # static checkers see the eager imports
    from .capture import AuxHiddenStateList
    from .context import BoundaryContext
    from .contracts import Owed, OwedKind, ProducerReduction, StageKind
    from .errors import BoundaryError, DeclarationError
    from .exit import FfnExit, MixerExit
    from .factories import (
        StageDeclaration,
        declare_attn,
        declare_ffn,
        make_attn_stage,
        make_ffn_stage,
        make_stages,
    )
    from .forward import ForwardBatch, ForwardBatchLike, ForwardFlags, ForwardMode, active_variant, get_forward
    from .layout import BatchVariant, Layout, SumGroup, TokenAxis
    from .norms import GemmaRMSNorm, RMSNorm
    from .output import Contribution, HandoffOutput, OutputTransform, OwedOutput, UnreducedOutput
    from .residual import LayerResidual, ReadSpec, StageRead, StageUpdate
    from .residual.stream import ResidualStream, StreamState
    from .providers import (
        ConsumerCandidate,
        FusionProvider,
        NormKernelProvider,
        NormRequest,
        ResidualSemantics,
        StageResidual,
    )
    from .quant import QuantizedRows
    from .selection import SelectionReport
    from .stage import StageBoundary
    from .topology import GroupInfo, Topology

__version__ = "0.1.0"

__all__ = [
    "AuxHiddenStateList",
    "BoundaryContext",
    "BatchVariant",
    "BoundaryError",
    "ConsumerCandidate",
    "FusionProvider",
    "NormKernelProvider",
    "NormRequest",
    "QuantizedRows",
    "ResidualSemantics",
    "SelectionReport",
    "StageResidual",
    "Contribution",
    "DeclarationError",
    "FfnExit",
    "ForwardBatch",
    "ForwardBatchLike",
    "ForwardFlags",
    "ForwardMode",
    "GemmaRMSNorm",
    "GroupInfo",
    "HandoffOutput",
    "LayerResidual",
    "Layout",
    "MixerExit",
    "OutputTransform",
    "Owed",
    "OwedKind",
    "OwedOutput",
    "ProducerReduction",
    "RMSNorm",
    "ReadSpec",
    "ResidualStream",
    "StageBoundary",
    "StageDeclaration",
    "StageKind",
    "StageRead",
    "StageUpdate",
    "StreamState",
    "SumGroup",
    "TokenAxis",
    "Topology",
    "UnreducedOutput",
    "active_variant",
    "declare_attn",
    "declare_ffn",
    "get_forward",
    "make_attn_stage",
    "make_ffn_stage",
    "make_stages",
]


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
