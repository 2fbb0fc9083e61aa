"""The vendor SDK: what a plugin that ships fusion providers, norm kernels or residual
semantics writes against. This stub is its one export list (``plugin_api.py`` reads it lazily).

Plugins may also use the engine face (``layer_boundary``); nothing else of the core is public.
"""

# Registering a plugin: the manifest (read without torch) and the hook implementation marker
from ._plugins.manifest import HOOK_API_VERSION as HOOK_API_VERSION
from ._plugins.manifest import PluginManifest as PluginManifest
from ._plugins.manifest import Provides as Provides
from ._plugins.hookspecs import hookimpl as hookimpl
from ._lazy import lazy_exports as lazy_exports

# Norm-read kernels
from ._providers import NormKernelProvider as NormKernelProvider
from ._providers import NormRequest as NormRequest
from .residual._add_norm import NormKernels as NormKernels
from ._quant import FP8_E4M3_MAX as FP8_E4M3_MAX
from ._quant import FP8_SCALE_FLOOR as FP8_SCALE_FLOOR
from ._quant import QUANT_FORMATS as QUANT_FORMATS
from ._quant import QuantizedRows as QuantizedRows
from ._kernels.refusals import cuda_half_norm_refusal as cuda_half_norm_refusal
from ._selection import not_on_this_device as not_on_this_device
from ._kernels.fallback import FallbackNotice as FallbackNotice
from ._norms import norm_params as norm_params
# A kernel as a registered torch.library operator: itself in eager, the operator under torch.compile
from ._kernels.kernel_op import kernel_op as kernel_op
from ._kernels.kernel_op import registered_op as registered_op

# The torch references that define each op, and the tolerances a provider is held to
from ._kernels.reference import check_rows as check_rows
from ._kernels.reference import fused_add_rmsnorm_fp8_ref as fused_add_rmsnorm_fp8_ref
from ._kernels.reference import fused_add_rmsnorm_ref as fused_add_rmsnorm_ref
from ._kernels.reference import rmsnorm_fp8_ref as rmsnorm_fp8_ref
from ._kernels.reference import rmsnorm_ref as rmsnorm_ref
from ._tolerances import DEFAULT_TOLERANCE as DEFAULT_TOLERANCE
from ._tolerances import MAX_TOLERANCE as MAX_TOLERANCE
from ._tolerances import tolerance_of as tolerance_of

# Fusion providers: consumer candidates, fused all-reduce + add + norm, the MoE finalize handoff
from ._providers import ConsumerCandidate as ConsumerCandidate
from ._providers import FusionProvider as FusionProvider
from ._fusion import AllReduceNormProvider as AllReduceNormProvider
from ._fusion import FusedSum as FusedSum
from ._fusion import WorkspaceUnavailable as WorkspaceUnavailable
from ._fusion.moe_finalize import FINALIZE_TOLERANCE as FINALIZE_TOLERANCE
from ._fusion.moe_finalize import MoeFinalizeFusion as MoeFinalizeFusion
from ._fusion.moe_finalize import finalize_partial_ref as finalize_partial_ref
from ._fusion.moe_finalize import moe_finalize as moe_finalize
# The core's fused kernel under both providers (symmetric-memory all-reduce + add + RMSNorm, with
# the MoE finalize prologue): its workspace (a collective) and one launch, for a backend's own
# kernel or a benchmark to measure against
from ._fusion import make_symm_workspace as make_symm_workspace
from ._fusion import symm_mem_launch as symm_mem_launch
# A construction-time collective (picklable objects over a group, without NumPy): workspace set-up
from ._ops import gather_objects as gather_objects

# Residual semantics: update/read pairs registered by name
from ._providers import ResidualSemantics as ResidualSemantics
from ._providers import StageResidual as StageResidual
from ._providers import residual_part as residual_part
from .residual import LayerResidual as LayerResidual
from .residual import ReadSpec as ReadSpec
from .residual import StageRead as StageRead
from .residual import StageUpdate as StageUpdate

# Commands: a distribution adds `layer-boundary <name>` through the entry-point group
# `layer_boundary.commands` with an object of this protocol
from ._cli.commands import Command as Command
