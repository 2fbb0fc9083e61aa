"""The construction context: process groups, plugins and policy a model is built with.

One context per model per process. ``make_stages(..., context=ctx)`` selects each stage's kernels
and fusion providers from it and records the choices in ``ctx.report``; ``ctx.freeze()`` ends
construction (the registry accepts nothing more) and logs the report once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .kernels.providers import core_norm_providers
from .providers import NormRequest, bound_kernels, refusal
from .residual.add_norm import NormKernels
from .selection import Candidate, Selection, SelectionReport
from .topology import Topology

__all__ = ["BoundaryContext", "BuiltStage"]

log = logging.getLogger("layer_boundary")


@dataclass(frozen=True, slots=True)
class BuiltStage:
    """A stage as the next one built must see it: its name, its resolved declaration and its
    ``following`` (``None``: it did not say which consumer comes next)."""

    name: str
    declaration: Any
    following: Any


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
        registry: Any = None,
        device: Optional[torch.device | str] = None,
        reduction: str = "auto",
        architecture: Optional[str] = None,
        core_fusion: bool = True,
    ) -> None:
        from .reduction import resolve_policy

        self.topology = topology or Topology.single()
        self.reduction = resolve_policy(reduction, architecture)
        self.registry = registry
        self.device = torch.device(device) if device is not None else None
        self.report = SelectionReport()
        # The core's fused consumer candidates (symmetric-memory all-reduce + add + norm) come
        # after the plugins'; created once so their workspaces are shared by all stages.
        self._core_fusions: tuple[Any, ...] = ()
        if core_fusion:
            from .fusion import core_fusion_providers

            self._core_fusions = tuple(core_fusion_providers())
        self._stage_count = 0
        self._peeked: dict[NormRequest, tuple[Any, NormKernels]] = {}
        # The last stage built, in construction order, and what it declared about its consumer:
        # the next stage's previous= is checked against it (see factories._check_neighbours).
        self.last_stage: Optional[BuiltStage] = None
        self._frozen = False

    @classmethod
    def discover(
        cls,
        topology: Optional[Topology] = None,
        *,
        device: Any = None,
        reduction: str = "auto",
        architecture: Optional[str] = None,
        core_fusion: bool = True,
        **options: Any,
    ) -> "BoundaryContext":
        """A context with the plugins found through entry points (options as ``plugins.discover``)."""
        from .plugins import discover

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

    def norm_candidates(self) -> list[tuple[str, Any]]:
        plugin = list(self.registry.norm_kernels) if self.registry is not None else []
        return plugin + [("core", p) for p in core_norm_providers()]

    def kernel_selector(self, stage: str, variant: str, *, record: bool = True) -> Callable[[NormRequest], NormKernels]:
        """Selection for one stage's read; ``record=False`` answers what would be chosen without
        a report row (to judge a neighbour's kernels at construction)."""

        def select(request: NormRequest) -> NormKernels:
            self._check_open()
            if self.device is not None and request.device_type != self.device.type:
                # The model is built here and moved to its device afterwards: select for where
                # it will run.
                from dataclasses import replace

                request = replace(request, device_type=self.device.type)
            cands: list[Candidate] = []
            chosen = kernels = None
            for origin, prov in self.norm_candidates():
                if chosen is not None:
                    cands.append(Candidate(prov.name, origin, f"{chosen[1].name} comes first"))
                    continue
                why, failed = refusal(prov, request), None
                if why is None:
                    # A peek at this stage (record=False, below) may have asked this provider already.
                    peeked = self._peeked.pop(request, None) if record else None
                    if peeked is not None and peeked[0] is prov:
                        kernels = peeked[1]
                    else:
                        kernels, failed = bound_kernels(prov, request)
                if failed is not None or why is not None:
                    cands.append(Candidate(prov.name, origin, failed or why))
                    continue
                chosen = (origin, prov)
                cands.append(Candidate(prov.name, origin))
            if chosen is None:
                from .errors import DeclarationError

                refusals = "; ".join(f"{c.name}: {c.refused}" for c in cands)
                raise DeclarationError(
                    f"{stage}: no norm kernel serves {request.describe()} ({refusals}); install a "
                    "plugin that provides it"
                )
            if not record:
                # A peek at the next stage's kernels: keep them for that stage's own selection,
                # so a provider is asked once per norm.
                self._peeked[request] = (chosen[1], kernels)
                return kernels
            self.report.add(Selection(stage, variant, "norm kernels", request.describe(), chosen[1].name,
                                      tuple(cands)))
            return kernels

        return select

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

    def semantics(self, name: str) -> Any:
        if self.registry is None:
            if name == "plain":
                from .residual.semantics import PLAIN_RESIDUAL

                return PLAIN_RESIDUAL
            from .plugins import PluginError

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

    def verify_agreement(self, group: Any = None) -> None:
        """Check that the ranks of ``group`` (a torch.distributed group; default this context's TP
        group, whose ranks build the same stages) chose alike: every decision two ranks both made
        (the same stage, variant and request) names the same kernel or fusion. A collective: every
        rank of the group calls it once, after construction. Ranks that chose differently (a plugin
        installed, or available, on one host only) would compute different numbers or start
        collectives that do not match; this raises DeclarationError naming the first difference
        instead. On one rank it does nothing."""
        import torch.distributed as dist

        if group is None:
            tp = self.topology.tp if self.topology is not None else None
            if tp is None or tp.size == 1:
                return
            group = tp.group
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            return
        mine = {(s.stage, s.variant, s.what, s.request): s.chosen for s in self.report.selections}
        from .launch import gather_objects

        gathered = gather_objects(mine, group)
        first: dict[tuple, tuple[int, Optional[str]]] = {}
        for i, rows in enumerate(gathered):
            rank = dist.get_global_rank(group, i)
            for key, chosen in rows.items():
                seen = first.setdefault(key, (rank, chosen))
                if seen[1] != chosen:
                    from .errors import DeclarationError

                    raise DeclarationError(
                        f"ranks chose differently for {key[0]} ({key[1]}) {key[2]} [{key[3]}]: rank {seen[0]} "
                        f"{seen[1] or 'none'}, rank {rank} {chosen or 'none'}; install the same plugins (and "
                        "versions) on every host, or pin them with LAYER_BOUNDARY_PLUGINS"
                    )


def as_context(context: Optional[BoundaryContext], topology: Optional[Topology]) -> BoundaryContext:
    """The context a factory builds with (``topology=`` alone is shorthand for a plugin-free one)."""
    if context is not None:
        if not isinstance(context, BoundaryContext):
            raise TypeError(f"context= must be a BoundaryContext, got {type(context).__name__}")
        if topology is not None and topology is not context.topology:
            raise ValueError("give either context= or topology=, not both (the context has a topology)")
        return context
    return BoundaryContext(topology)


