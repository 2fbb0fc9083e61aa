"""The construction context: process groups, plugins and policy a model is built with.

One context per model per process. ``make_stages(..., context=ctx)`` selects each stage's kernels
and fusion providers from it and records the choices in ``ctx.report``; ``ctx.freeze()`` ends
construction (the registry accepts nothing more) and logs the report once.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from ._kernels.providers import core_norm_providers
from ._errors import BoundaryError
from ._providers import NormKernelProvider, NormRequest, ResidualSemantics, bound_kernels, refusal
from .residual._add_norm import NormKernels, NormOutput
from ._selection import Candidate, Selection, SelectionReport
from ._topology import Topology

if TYPE_CHECKING:
    import torch.distributed

    from ._declarations import StageDeclaration
    from ._plugins.registry import PluginRegistry

__all__ = ["BoundaryContext", "BuiltStage"]


def _out_of_place(kernels: NormKernels) -> NormKernels:
    """In-place kernels standing in for out-of-place ones: the residual they are given may be one
    the boundary promised not to overwrite (a capture kept without a copy), so they get a copy."""
    fused = kernels.fused_add_rmsnorm

    def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, *args: Any,
                          **kwargs: Any) -> tuple[NormOutput, torch.Tensor]:
        return fused(x, residual.clone(), *args, **kwargs)

    from dataclasses import replace

    return replace(kernels, name=f"{kernels.name} (residual copied)", fused_add_rmsnorm=fused_add_rmsnorm,
                   residual_in_place=False)

log = logging.getLogger("layer_boundary")


@dataclass(frozen=True, slots=True)
class BuiltStage:
    """A stage as the next one built must see it: its name, its resolved declaration and its
    ``following`` (``None``: it did not say which consumer comes next)."""

    name: str
    declaration: StageDeclaration
    following: Optional[StageDeclaration]


class BoundaryContext:
    """Everything ``make_stages`` needs besides the declarations.

    ``registry``: a ``PluginRegistry`` (``None``: the core's own providers only).
    ``device``: where the model will run, for kernel selection (default: where each norm's
    weight is at construction). ``reduction``: the FFN output policy (``ar``, ``rs``, ``rsv``,
    ``rs+rsv`` or ``auto``, which resolves from ``architecture`` here, before any stage is built).
    ``core_fusion``: offer the core's fused consumer candidates (``False`` keeps every owed sum on
    the all-reduce + separate norm path, e.g. to measure the fusion).
    """

    def __init__(
        self,
        topology: Optional[Topology] = None,
        *,
        registry: Optional[PluginRegistry] = None,
        device: Optional[torch.device | str] = None,
        reduction: str = "auto",
        architecture: Optional[str] = None,
        core_fusion: bool = True,
    ) -> None:
        from ._reduction import resolve_policy

        self.topology = topology or Topology.single()
        self.reduction = resolve_policy(reduction, architecture)
        self.registry = registry
        self.device = torch.device(device) if device is not None else None
        self.report = SelectionReport()
        # The core's fused consumer candidates (symmetric-memory all-reduce + add + norm) come
        # after the plugins'; created once so their workspaces are shared by all stages.
        self._core_fusions: tuple[Any, ...] = ()
        if core_fusion:
            from ._fusion import core_fusion_providers

            self._core_fusions = tuple(core_fusion_providers())
        self._stage_count = 0
        self._peeked: dict[NormRequest, tuple[Any, NormKernels]] = {}
        # The kernels each recorded selection gave (by identity), and the providers whose kernels
        # failed their first-call check: skipped by every later selection of this model.
        self._given: dict[int, tuple[Any, NormKernels]] = {}
        self._defective: set[Any] = set()
        # Every read bound to a recorded selection (weakly): (read, request, stage, variant).
        self._bound: list[tuple[Any, NormRequest, str, str]] = []
        # The last stage built, in construction order, and what it declared about its consumer:
        # the next stage's previous= is checked against it (see factories._check_neighbours).
        self.last_stage: Optional[BuiltStage] = None
        self._frozen = False

    @classmethod
    def discover(
        cls,
        topology: Optional[Topology] = None,
        *,
        device: Optional[torch.device | str] = None,
        reduction: str = "auto",
        architecture: Optional[str] = None,
        core_fusion: bool = True,
        **options: Any,
    ) -> "BoundaryContext":
        """A context with the plugins found through entry points (options as ``plugins.discover``)."""
        from ._plugins import discover

        return cls(topology, registry=discover(**options), device=device, reduction=reduction,
                   architecture=architecture, core_fusion=core_fusion)

    # -- construction-time queries ---------------------------------------------------------------

    def next_stage_name(self, kind: str) -> str:
        self._stage_count += 1
        return f"{kind} #{self._stage_count}"

    def _check_open(self) -> None:
        if self._frozen:
            raise RuntimeError(
                "this BoundaryContext is frozen: model construction is over. Build another "
                "context for another model"
            )

    def norm_candidates(self) -> list[tuple[str, NormKernelProvider]]:
        plugin = list(self.registry.norm_kernels) if self.registry is not None else []
        return plugin + [("core", p) for p in core_norm_providers()]

    def kernel_selector(self, stage: str, variant: str, *, record: bool = True) -> Callable[[NormRequest], NormKernels]:
        """Selection for one stage's read; ``record=False`` answers what would be chosen without
        a report row (to judge a neighbour's kernels at construction).

        A read bound to the selected kernels registers with ``select.register_read(read,
        request)``: when kernels of a provider fail a first-call check (see ``RMSNormRead``), the
        provider is reported and skipped, and every such read gets the next provider's."""

        def select(request: NormRequest) -> NormKernels:
            self._check_open()
            request = self._for_device(request)
            prov, kernels, cands = self._choose(stage, request, peeked=record)
            if not record:
                # A peek at the next stage's kernels: keep them for that stage's own selection,
                # so a provider is asked once per norm.
                self._peeked[request] = (prov, kernels)
                return kernels
            self._given[id(kernels)] = (prov, kernels)
            self.report.add(Selection(stage, variant, "norm kernels", request.describe(), prov.name, tuple(cands)))
            return kernels

        def register_read(read: Any, request: NormRequest) -> None:
            """A read bound to this selection's kernels: told to replace them when their provider
            is found defective at any stage's first call (see ``_replace_defective``)."""
            if not record:  # a peek's read is thrown away
                return
            self._bound.append((weakref.ref(read), request, stage, variant))
            read._on_defect = lambda bad, why: self._replace_defective(stage, bad, why)

        select.register_read = register_read  # type: ignore[attr-defined]
        return select

    def _replace_defective(self, stage: str, bad: NormKernels, why: str) -> Optional[NormKernels]:
        """``bad`` (this context's choice) failed its first-call check in ``stage`` for ``why``:
        report its provider, skip it from now on and give every read bound to its kernels the
        next provider's, replacing their rows of the report. Returns the calling read's (``None``:
        not this context's choice, which the read reports as an error)."""
        prov, _ = self._given.get(id(bad), (None, bad))
        if prov is None:
            return None
        origin = next((o for o, p in self.norm_candidates() if p is prov), "core")
        said = f"its kernels {bad.name!r} (plugin {origin}) are defective at their first call in {stage}: {why}"
        if self.registry is not None and self.registry.options.strict:
            from ._plugins.registry import _STRICT

            raise BoundaryError(f"norm kernel provider {prov.name}: {said} {_STRICT}")
        self._defective.add(prov)
        mine: Optional[NormKernels] = None
        nxt_name = "the next provider"
        for ref, request, stg, variant in self._bound:
            read = ref()
            if read is None or self._given.get(id(read.kernels), (None,))[0] is not prov:
                continue
            nxt, kernels, cands = self._choose(stg, self._for_device(request), peeked=False)
            nxt_name = nxt.name
            self._given[id(kernels)] = (nxt, kernels)
            if kernels.residual_in_place and not read.kernels.residual_in_place:
                kernels = _out_of_place(kernels)
            if read.kernels is bad:
                mine = kernels
            read._set_kernels(kernels)
            self.report.replace(stg, "norm kernels", Selection(stg, variant, "norm kernels (after a defect)",
                                                                request.describe(), nxt.name, tuple(cands)))
        # Logged here, once a provider: not through providers._skipped, whose record is of defects
        # found while the model was built.
        log.warning("provider %s skipped: %s; %s serves instead, for every stage of this model (run the "
                    "plugin's conformance kit; LAYER_BOUNDARY_DISABLE=%s leaves it out)", prov.name, said,
                    nxt_name, origin)
        return mine

    def _for_device(self, request: NormRequest) -> NormRequest:
        if self.device is not None and request.device_type != self.device.type:
            # The model is built here and moved to its device afterwards: select for where it
            # will run.
            from dataclasses import replace

            return replace(request, device_type=self.device.type)
        return request

    def _choose(self, stage: str, request: NormRequest, *, peeked: bool) -> tuple[Any, NormKernels, list[Candidate]]:
        """The first provider that serves ``request`` (skipping those found defective), its
        kernels and every candidate's line for the report."""
        cands: list[Candidate] = []
        chosen = kernels = None
        for origin, prov in self.norm_candidates():
            if chosen is not None:
                # Its own reason too: "comes first" alone hides why it could not serve anyway.
                why = refusal(prov, request)
                cands.append(Candidate(prov.name, origin, f"{chosen.name} comes first"
                                       + (f" (and it refuses: {why})" if why else "")))
                continue
            if prov in self._defective:
                cands.append(Candidate(prov.name, origin, "defective at a first call in this model (see the warning)"))
                continue
            why, failed = refusal(prov, request), None
            if why is None:
                # A peek at this stage (record=False) may have asked this provider already.
                got = self._peeked.pop(request, None) if peeked else None
                if got is not None and got[0] is prov:
                    kernels = got[1]
                else:
                    kernels, failed = bound_kernels(prov, request)
            if failed is not None or why is not None:
                cands.append(Candidate(prov.name, origin, failed or why))
                continue
            chosen = prov
            cands.append(Candidate(prov.name, origin))
        if chosen is None:
            from ._errors import DeclarationError

            refusals = "; ".join(f"{c.name}: {c.refused}" for c in cands)
            raise DeclarationError(
                f"{stage}: no norm kernel serves {request.describe()} ({refusals}); install a "
                "plugin that provides it"
            )
        assert kernels is not None
        return chosen, kernels, cands

    def fusion_providers(self) -> tuple[Any, ...]:
        plugin = tuple(p for _, p in self.registry.fusion_providers) if self.registry is not None else ()
        return plugin + self._core_fusions

    def provider_origin(self, provider: Any) -> str:
        if self.registry is not None:
            for origin, p in self.registry.fusion_providers:
                if p is provider:
                    return origin
        if any(p is provider for p in self._core_fusions):
            return "core"
        return "model option"

    def semantics(self, name: str) -> ResidualSemantics:
        if self.registry is None:
            if name == "plain":
                from .residual._semantics import PLAIN_RESIDUAL

                return PLAIN_RESIDUAL
            from ._plugins import PluginError

            raise PluginError(
                f"residual semantics {name!r} needs plugins; build the context with "
                "BoundaryContext.discover() so installed plugins are found"
            )
        return self.registry.semantics(name)

    def freeze(self) -> SelectionReport:
        """End construction: freeze the registry and log the selection report once."""
        if not self._frozen:
            self._frozen = True
            if self.registry is not None:
                self.registry.freeze()
            if self.report.selections:
                log.info("layer-boundary selection report:\n%s", "\n".join(self.report.lines()))
        return self.report

    @property
    def frozen(self) -> bool:
        return self._frozen

    def verify_agreement(self, group: Optional[torch.distributed.ProcessGroup] = None) -> None:
        """Check that the ranks of ``group`` chose alike. A collective: every rank of the group
        calls it once, after construction. Ranks that chose differently (a plugin installed, or
        available, on one host only; another reduction policy in one host's config) would compute
        different numbers or start collectives that do not match; this raises DeclarationError
        naming the first difference instead. On one rank it does nothing.

        By default the group is this context's TP group, whose ranks build the same stages: every
        decision (stage, variant and kind) must be made on every rank, asked the same and answered
        the same. With another ``group`` (one that spans pipeline stages, whose ranks build other
        layers) only the decisions two ranks both made with the same request are compared."""
        import torch.distributed as dist

        strict = group is None
        if group is None:
            tp = self.topology.tp if self.topology is not None else None
            if tp is None or tp.size == 1:
                return
            group = tp.group
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            return
        from ._errors import DeclarationError
        from ._ops import gather_objects

        # strict: a decision per stage, variant and kind with what it was asked and what it chose, so
        # that a rank that asked something else (another policy, another dtype) or built stages the
        # others did not (another layer count) differs as much as one that chose another kernel.
        mine: dict[tuple, Any] = {}
        for sel in self.report.selections:
            if strict:
                mine.setdefault((sel.stage, sel.variant, sel.what), []).append((sel.request, sel.chosen or "none"))
            else:
                mine[(sel.stage, sel.variant, f"{sel.what} [{sel.request}]")] = [("", sel.chosen or "none")]
        gathered = gather_objects({k: sorted(v) for k, v in mine.items()}, group)
        ranks = [dist.get_global_rank(group, i) for i in range(len(gathered))]
        for key in sorted(set().union(*gathered)):
            seen = [(rank, rows[key]) if key in rows else (rank, None) for rank, rows in zip(ranks, gathered)]
            if not strict:
                seen = [(rank, got) for rank, got in seen if got is not None]
            (r0, want), other = seen[0], next(((r, got) for r, got in seen[1:] if got != seen[0][1]), None)
            if other is None:
                continue
            r1, got = other
            raise DeclarationError(
                f"ranks decided differently for {key[0]} ({key[1]}) {key[2]}: rank {r0} {_decisions(want)}, "
                f"rank {r1} {_decisions(got)}; build the same stages with the same options on every rank "
                "of the group, and install the same plugins (and versions) on every host, or pin them "
                "with LAYER_BOUNDARY_PLUGINS"
            )


def _decisions(rows: Optional[list[tuple[str, str]]]) -> str:
    """``[request] -> chosen`` of one rank's decisions for a key, or that it made none."""
    if rows is None:
        return "made no such decision (a stage it did not build)"
    return ", ".join(f"[{request}] -> {chosen}" if request else chosen for request, chosen in rows)


def as_context(context: Optional[BoundaryContext], topology: Optional[Topology]) -> BoundaryContext:
    """The context a factory builds with (``topology=`` alone is shorthand for a plugin-free one)."""
    if context is not None:
        if not isinstance(context, BoundaryContext):
            raise TypeError(f"context= must be a BoundaryContext, got {type(context).__name__}")
        if topology is not None and topology is not context.topology:
            raise ValueError("give either context= or topology=, not both (the context has a topology)")
        return context
    return BoundaryContext(topology)


