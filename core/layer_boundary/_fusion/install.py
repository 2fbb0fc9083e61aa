"""Find a backend's fusion providers in a built model and install or prepare them.

A backend's ``install_*_fusion(model, ...)`` and ``prepare_*_fusion(model)`` work on a model whose
stages were built with the backend's provider (passed as the stages' ``fusions`` option or
offered by its plugin): they reach the providers through each decoder layer's
``attn_boundary`` and ``ffn_boundary``, as the specification says, and never through a registry.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

__all__ = ["decoder_layers", "install_finalize_fusion", "prepare_finalize_fusion"]


def decoder_layers(model: nn.Module) -> list[tuple[Any, Any]]:
    """``(attn_boundary, ffn_boundary)`` of every decoder layer of ``model``, in stack order."""
    return [(m.attn_boundary, m.ffn_boundary) for m in model.modules()
            if hasattr(m, "attn_boundary") and hasattr(m, "ffn_boundary")]


def _providers(model: nn.Module, kind: type) -> tuple[list[tuple[Any, Any]], list[Any]]:
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no decoder layers with attn_boundary and ffn_boundary "
            "attributes; build its layers with make_stages() and keep the two stages on the layer "
            "under those names"
        )
    found: list[Any] = []
    for pair in layers:
        for boundary in pair:
            for p in boundary.plan.fusions:
                if isinstance(p, kind) and not any(p is q for q in found):
                    found.append(p)
    if not found:
        raise ValueError(
            f"no {kind.__name__} in the model's stages: pass one as the stages' fusions option "
            f"(declaration, norm, {{'fusions': provider}}), or build the model with a "
            "BoundaryContext whose plugins offer it, before installing"
        )
    return layers, found


def _final_norm(model: nn.Module) -> Optional[nn.Module]:
    for owner in (model, getattr(model, "model", None)):
        norm = getattr(owner, "norm", None) if owner is not None else None
        if isinstance(norm, nn.Module):
            return norm
    return None


def install_finalize_fusion(model: nn.Module, kind: type, *, terminal_finalize: bool = False,
                            final_norm: Optional[nn.Module] = None) -> Any:
    """Install every ``kind`` provider found in ``model``'s stages; return the one that serves
    the final norm (the last layer's) as ``residual_batch.norm(..., handoff_norm=...)`` takes it.

    With ``terminal_finalize``, a model (or its ``model``) with a ``handoff_norm`` attribute, as
    the reference decoders have, gets the service there.
    """
    layers, providers = _providers(model, kind)
    norm = final_norm if final_norm is not None else _final_norm(model)
    for p in providers:
        p.install(layers, terminal_finalize=terminal_finalize, final_norm=norm)
    last = [p for p in layers[-1][1].plan.fusions if isinstance(p, kind)]
    service = last[0] if last else providers[-1]
    if terminal_finalize:
        for owner in (model, getattr(model, "model", None)):
            if owner is not None and hasattr(owner, "handoff_norm"):
                owner.handoff_norm = service
                break
    return service


def prepare_finalize_fusion(model: nn.Module, kind: type, **options: Any) -> None:
    """Create the installed providers' workspaces (collectives on their groups) and build their
    kernels: every rank calls it in the same order, before CUDA-graph capture. ``options`` go to
    each provider's ``prepare``."""
    _, providers = _providers(model, kind)
    for p in providers:
        if not p.installed:
            raise RuntimeError(f"{p!r} is not installed; call install first")
        p.prepare(**options)
