"""The engine face: what an engine developer writes to put a layer stack on boundaries.

This stub is the one export list of ``layer_boundary``: ``__init__.py`` reads it at run time
(lazily, see ``lazy.py``) and type checkers read it statically.
"""

# Declaring stages
from .factories import StageDeclaration as StageDeclaration
from .factories import declare_attn as declare_attn
from .factories import declare_ffn as declare_ffn
from .factories import make_attn_stage as make_attn_stage
from .factories import make_ffn_stage as make_ffn_stage
from .factories import make_stages as make_stages
from .contracts import ProducerReduction as ProducerReduction
from .contracts import StageKind as StageKind
from .output import OutputTransform as OutputTransform
from .residual.add_norm import AddNormReadSpec as AddNormReadSpec

# The model's process groups and installed plugins
from .context import BoundaryContext as BoundaryContext
from .topology import GroupInfo as GroupInfo
from .topology import Topology as Topology

# Running a forward
from .forward import ForwardBatch as ForwardBatch
from .forward import ForwardBatchLike as ForwardBatchLike
from .forward import ForwardMode as ForwardMode
from .forward import get_forward as get_forward
from .layout import BatchVariant as BatchVariant
from .stage import StageBoundary as StageBoundary
# Pipeline parallel: a stage's tensors (residual_batch.to_pp) to the next stage's ranks and back
from .ops import recv_tensors as recv_tensors
from .ops import send_tensors as send_tensors
from .residual import batch as residual_batch
from .residual.stream import ResidualStream as ResidualStream
from .output import HandoffOutput as HandoffOutput
from .capture import AuxHiddenStateList as AuxHiddenStateList
from .norms import GemmaRMSNorm as GemmaRMSNorm
from .norms import RMSNorm as RMSNorm

# Batch variants and adapters: two-batch overlap, context parallel, branches, MoE finalize fusion
from .adapters.tbo import TboSplit as TboSplit
from .adapters.tbo import model_forward_stages as model_forward_stages
from .adapters.tbo import plan_overlap as plan_overlap
from .cp import CpSplit as CpSplit
from .cp import context_parallel_split as context_parallel_split
from .adapters.branch import branch_output as branch_output
from .adapters.branch import merge_branch as merge_branch
from .fusion.install import install_finalize_fusion as install_finalize_fusion
from .fusion.install import prepare_finalize_fusion as prepare_finalize_fusion

# Errors
from .errors import BoundaryError as BoundaryError
from .errors import DeclarationError as DeclarationError
from .plugins.discovery import PluginError as PluginError

__version__: str
