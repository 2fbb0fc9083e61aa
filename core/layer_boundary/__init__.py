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

Importing this package discovers no plugins and creates no process groups.
"""

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
