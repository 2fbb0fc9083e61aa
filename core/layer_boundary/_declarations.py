"""Stage declarations: what a stage's compute does (kind, reduction contract, dense or sparse,
residual semantics), frozen and checked when declared.

A leaf below everything that builds from a declaration (``construction``, ``context``, ``stage``,
``factories``), so each of them can name the type without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ._contracts import ProducerReduction, StageKind
from ._errors import LOCAL_TAIL_ATTN, PARTIAL_FFN, DeclarationError
from ._output import OutputTransform
from .residual import ReadSpec, StageUpdate
from .residual._add_norm import ADD_NORM, PLAIN_ADD

__all__ = ["StageDeclaration", "declare_attn", "declare_ffn"]


_PLAIN_VERIFIED: set[int] = set()


def _check_plain_claim(update: Any) -> None:
    """An update that declares ``plain_add`` must compute ``r + c`` (the FP32 sum rounded once):
    the boundary joins it to a reduction on one rank and snapshots it, so a nonlinear update that
    claims it is wrong only under TP, with no error. Tried once per update object on two CPU
    rows; an update that cannot run there (parameters elsewhere) is not judged."""
    from .residual._add_norm import PLAIN_ADD

    if update is PLAIN_ADD or id(update) in _PLAIN_VERIFIED:
        return
    import torch

    g = torch.Generator().manual_seed(0)
    r, c = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
    try:
        got = update.apply(r.clone(), c.clone())
    except Exception:
        return
    if not (isinstance(got, torch.Tensor) and got.shape == r.shape and torch.equal(got, r + c)):
        raise DeclarationError(
            f"update {getattr(update, 'name', update)!r} declares plain_add=True but apply(r, c) is not r + c; "
            "plain_add lets the boundary join the sum to a reduction on one rank, so a nonlinear update "
            "claiming it is wrong under tensor parallelism: declare plain_add=False")
    _PLAIN_VERIFIED.add(id(update))


@dataclass(frozen=True, slots=True)
class StageDeclaration:
    """What one stage's compute does, as the model declares it.

    Source fields (``previous``, ``prepared_from``, ``terminal``) are filled in by the
    assembler; a declaration handed to ``make_stages`` must not carry them.
    """

    kind: StageKind
    reduction: ProducerReduction
    update: StageUpdate = PLAIN_ADD
    read: ReadSpec = ADD_NORM
    sparse: bool = False
    next_sparse: bool = False
    gathers_tp_input: bool = True
    output_transform: Optional[OutputTransform] = None
    previous: Optional["StageDeclaration"] = None
    prepared_from: Optional["StageDeclaration"] = None
    terminal: bool = False

    def __post_init__(self) -> None:
        if self.kind is StageKind.FFN and self.reduction is ProducerReduction.PARTIAL:
            raise DeclarationError(PARTIAL_FFN)
        if self.kind is StageKind.ATTN and self.reduction is ProducerReduction.LOCAL_TAIL:
            raise DeclarationError(LOCAL_TAIL_ATTN)
        if not isinstance(self.reduction, ProducerReduction):
            raise DeclarationError(
                f"reduction={self.reduction!r} is not a ProducerReduction; use "
                "ProducerReduction.PARTIAL, SCOPED or LOCAL_TAIL"
            )
        for name in ("plain_add", "at_producer", "outlives_producer"):
            if not hasattr(self.update, name) or not callable(getattr(self.update, "apply", None)):
                raise DeclarationError(
                    f"update={self.update!r} does not implement StageUpdate (missing {name!r} or "
                    "apply); see layer_boundary.residual.StageUpdate"
                )
        if not callable(getattr(self.read, "bind", None)):
            raise DeclarationError(
                f"read={self.read!r} is not a read kind (it has no bind(norm)); see "
                "layer_boundary.residual.ReadSpec"
            )
        if self.kind is StageKind.ATTN and (self.sparse or self.next_sparse):
            raise DeclarationError(
                "sparse/next_sparse describe FFN compute; declare them with declare_ffn()"
            )
        if self.update.plain_add:
            _check_plain_claim(self.update)
        # A nonlinear update applied at the next read must still be valid when that read runs.
        if not self.update.plain_add and not self.update.at_producer and not self.update.outlives_producer:
            raise DeclarationError(
                f"update {self.update.name!r} is nonlinear, is applied after the producer returns, "
                "and does not declare outlives_producer; set at_producer=True or make its "
                "parameters and state outlive the producer"
            )

    @property
    def is_mixer(self) -> bool:
        return self.kind is StageKind.ATTN and self.reduction is ProducerReduction.SCOPED

    def produces_like(self, other: "StageDeclaration") -> bool:
        """Whether ``other`` describes the same producer (its source fields aside)."""
        return (
            self.kind is other.kind
            and self.reduction is other.reduction
            and self.update.name == other.update.name
            and self.sparse == other.sparse
            and self.next_sparse == other.next_sparse
            and self.gathers_tp_input == other.gathers_tp_input
        )

    def has_source(self) -> bool:
        return self.previous is not None or self.prepared_from is not None or self.terminal

    def describe(self) -> str:
        parts = ["mixer" if self.is_mixer else self.kind.value, self.reduction.name]
        if self.sparse:
            parts.append("sparse")
        if self.update is not PLAIN_ADD:
            parts.append(f"update={self.update.name}")
        return "(" + " ".join(parts) + ")"


def _declare(kind: StageKind, reduction: ProducerReduction, **kw: Any) -> StageDeclaration:
    if kw.get("update") is None:
        kw["update"] = PLAIN_ADD
    if kw.get("read") is None:
        kw["read"] = ADD_NORM
    return StageDeclaration(kind=kind, reduction=reduction, **kw)


def declare_attn(
    *,
    reduction: ProducerReduction = ProducerReduction.PARTIAL,
    update: Optional[StageUpdate] = None,
    read: Optional[ReadSpec] = None,
    gathers_tp_input: bool = True,
    output_transform: Optional[OutputTransform] = None,
    previous: Optional[StageDeclaration] = None,
    prepared_from: Optional[StageDeclaration] = None,
    terminal: bool = False,
) -> StageDeclaration:
    """Declare an attention (or, with ``reduction=SCOPED``, a single-stage mixer) stage.

    Source fields are for ``make_attn_stage`` only; ``make_stages`` takes them as its own arguments.
    """
    return _declare(
        StageKind.ATTN, reduction, update=update, read=read, gathers_tp_input=gathers_tp_input,
        output_transform=output_transform, previous=previous, prepared_from=prepared_from,
        terminal=terminal,
    )


def declare_ffn(
    *,
    reduction: ProducerReduction = ProducerReduction.SCOPED,
    sparse: bool = False,
    next_sparse: bool = False,
    update: Optional[StageUpdate] = None,
    read: Optional[ReadSpec] = None,
    output_transform: Optional[OutputTransform] = None,
    previous: Optional[StageDeclaration] = None,
    prepared_from: Optional[StageDeclaration] = None,
    terminal: bool = False,
) -> StageDeclaration:
    """Declare a dense or sparse (MoE) FFN stage. ``next_sparse`` describes the next FFN."""
    return _declare(
        StageKind.FFN, reduction, sparse=sparse, next_sparse=next_sparse, update=update, read=read,
        output_transform=output_transform, previous=previous, prepared_from=prepared_from,
        terminal=terminal,
    )
