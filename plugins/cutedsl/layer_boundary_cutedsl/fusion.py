"""The CuTe DSL plugin's MoE finalize handoff service.

    service = install_cutedsl_fusion(model, terminal_finalize=True)
    prepare_cutedsl_fusion(model)          # every rank, before CUDA-graph capture
    ...
    hidden = residual_batch.norm(hidden, forward_batch, self.norm, handoff_norm=service)

``CuteDslFusion`` is the fusion provider the plugin offers to every stage (or that an engine
passes as the stages' ``fusions`` option). Until installed it lets no exit defer. Installed, a
sparse FFN exit whose next consumer takes the handoff returns a ``HandoffOutput``, and the next
layer's attention input (or, with ``terminal_finalize``, the final Gemma RMSNorm through
``finalize(handoff, residual, gamma)``) runs the top-k combine, the shared expert, the MoE
group's all-reduce, the residual add and the RMSNorm in one kernel.

On Hopper without NVLink multicast the all-reduce reads the peers' rows through symmetric-memory
peer pointers: the core's symmetric-memory kernel with its finalize prologue
(``layer_boundary.fusion.symm_mem_kernel``), whose workspaces ``prepare_cutedsl_fusion``
creates. The arithmetic, tolerance and fallback rules are the core's
(``layer_boundary.fusion.moe_finalize``).
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from layer_boundary.fusion.install import install_finalize_fusion, prepare_finalize_fusion
from layer_boundary.fusion.moe_finalize import MoeFinalizeFusion

__all__ = ["CuteDslFusion", "install_cutedsl_fusion", "prepare_cutedsl_fusion"]


class CuteDslFusion(MoeFinalizeFusion):
    """The plugin's MoE finalize fusion provider (see the module docstring)."""

    name = "cutedsl-moe-finalize"
    candidate_name = "cutedsl moe finalize + all-reduce + add + rmsnorm"


def install_cutedsl_fusion(model: nn.Module, *, terminal_finalize: bool = False,
                           final_norm: Optional[nn.Module] = None) -> CuteDslFusion:
    """Install the ``CuteDslFusion`` providers found through ``model``'s decoder layers
    (``attn_boundary``, ``ffn_boundary``); return the service for ``norm(handoff_norm=...)``.

    ``terminal_finalize``: the last layer's FFN may also defer, to the final norm (a Gemma RMSNorm,
    found as ``model.norm`` or ``model.model.norm`` unless ``final_norm`` is given). Sets the
    reference decoders' ``handoff_norm`` when the model has that attribute.
    """
    return install_finalize_fusion(model, CuteDslFusion, terminal_finalize=terminal_finalize,
                                   final_norm=final_norm)


def prepare_cutedsl_fusion(model: nn.Module) -> None:
    """Create the installed providers' peer-visible workspaces: a collective on each MoE group,
    so every rank calls it, in the same order, before the first forward or graph capture."""
    prepare_finalize_fusion(model, CuteDslFusion)
