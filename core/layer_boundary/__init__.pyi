"""The engine face: what an engine developer writes to put a layer stack on boundaries.

This stub is the one export list of ``layer_boundary``: ``__init__.py`` reads it at run time
(lazily, see ``lazy.py``) and type checkers read it statically.
"""

# Declaring stages
from ._declarations import StageDeclaration as StageDeclaration
from ._declarations import declare_attn as declare_attn
from ._declarations import declare_ffn as declare_ffn
from ._factories import make_attn_stage as make_attn_stage
from ._factories import make_ffn_stage as make_ffn_stage
from ._factories import make_stages as make_stages
from ._contracts import ProducerReduction as ProducerReduction
from ._contracts import StageKind as StageKind
from ._output import OutputTransform as OutputTransform
from .residual._add_norm import AddNormReadSpec as AddNormReadSpec

# The model's process groups and installed plugins
from ._context import BoundaryContext as BoundaryContext
from ._topology import GroupInfo as GroupInfo
from ._topology import Topology as Topology

# Running a forward
from ._forward import ForwardBatch as ForwardBatch
from ._forward import ForwardBatchLike as ForwardBatchLike
from ._forward import ForwardMode as ForwardMode
from ._forward import get_forward as get_forward
from ._layout import BatchVariant as BatchVariant
from ._stage import StageBoundary as StageBoundary
# Pipeline parallel: a stage's tensors (residual_batch.to_pp) to the next stage's ranks and back
from ._ops import recv_tensors as recv_tensors
from ._ops import send_tensors as send_tensors
from .residual import batch as residual_batch
from .residual._stream import ResidualStream as ResidualStream
from ._output import HandoffOutput as HandoffOutput
from ._capture import AuxHiddenStateList as AuxHiddenStateList
from ._norms import GemmaRMSNorm as GemmaRMSNorm
from ._norms import RMSNorm as RMSNorm

# Batch variants and adapters: two-batch overlap, context parallel, branches, MoE finalize fusion
from ._adapters.tbo import TboSplit as TboSplit
from ._adapters.tbo import model_forward_stages as model_forward_stages
from ._adapters.tbo import plan_overlap as plan_overlap
from ._cp import CpSplit as CpSplit
from ._cp import context_parallel_split as context_parallel_split
from ._adapters.branch import branch_output as branch_output
from ._adapters.branch import merge_branch as merge_branch
from ._fusion.install import install_finalize_fusion as install_finalize_fusion
from ._fusion.install import prepare_finalize_fusion as prepare_finalize_fusion

# Errors
from ._errors import BoundaryError as BoundaryError
from ._errors import DeclarationError as DeclarationError
from ._plugins.discovery import PluginError as PluginError

__version__: str
