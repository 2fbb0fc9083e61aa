"""Build a :class:`StagePlan`: the entry and exit paths of one stage for each batch variant.

Everything a forward needs is decided here; at forward time a stage only looks its path up by
the active variant. Each path holds the variant's row movement as one bound ``BatchRows`` object
(``batch_rows``: ordinary, ``dp``: attention DP, ``scatter``: input-scattered and sequence
parallel, ``cp``: context parallel), so a forward never asks which variant it is in again.

Module order (no cycle, type-only imports included: tests/unit/test_import_graph.py): ``plan`` (the
types built here) and ``declarations`` < ``prepare`` (the read on this rank's rows, with ``edges``)
< ``batch_rows`` < ``dp``, ``scatter``, ``cp`` < ``construction`` < ``pp`` < ``stage`` (with
``publish`` and ``exit``) < ``factories``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Optional

from torch import nn

from ._contracts import Owed, OwedKind, ProducerReduction, StageKind
from ._layout import BatchVariant, SumGroup
from ._topology import Topology
from ._batch_rows import BatchRows, OrdinaryRows
from ._cp import CpRows
from ._dp import AttentionDpRows
from ._providers import offered_candidates, refusal
from ._reduction import refusals, return_paths
from ._scatter import ScatteredRows
from ._selection import Candidate, Selection
from ._variants import report_cp_return, stage_variants
from ._plan import EntryPath, ExitPath, StagePlan

__all__ = ["EntryPath", "ExitPath", "StagePlan", "build_stage", "output_sum"]


def output_sum(decl: Any, topology: Topology) -> Optional[Owed]:
    """The sum a producer's output needs, or None when its group has one rank."""
    if decl.kind is StageKind.ATTN:
        name = SumGroup.ATTN_TP
    else:
        name = SumGroup.MOE_OUTPUT if decl.sparse else SumGroup.TP
    group = topology.sum_group(name)
    if group.size == 1:
        return None
    return Owed(OwedKind.SUM, name, group, static=decl.reduction is ProducerReduction.PARTIAL)


def _accepts(previous: Any, topology: Topology) -> frozenset[tuple[OwedKind, Optional[SumGroup]]]:
    if previous is None:
        return frozenset()
    acc: set[tuple[OwedKind, Optional[SumGroup]]] = set()
    s = output_sum(previous, topology)
    if s is not None:
        acc.add((OwedKind.SUM, s.group_name))
    if previous.kind is StageKind.FFN and previous.sparse:
        acc.add((OwedKind.FINALIZE, None))
    return frozenset(acc)


def build_stage(
    decl: Any,
    norm: nn.Module,
    options: Mapping[str, Any],
    *,
    following: Any,
    next_local_norm: Optional[nn.Module],
    next_local_decl: Any,
    context: Any,
) -> StagePlan:
    topology: Topology = context.topology
    kind = "mixer" if decl.is_mixer else decl.kind.value
    name = context.next_stage_name(kind)
    if decl.prepared_from is None and norm is None:
        raise TypeError(f"{decl.kind.value} stage needs its norm module; got None")
    # A variant exists only where the topology gives it rows to move and the stage can run it;
    # any other active variant is an error at forward, never a silent fallback to ordinary rows.
    variants, refused_variants = stage_variants(decl, topology)
    read = decl.read.bind(norm, context.kernel_selector(name, variants[0].name)) if norm is not None else None
    out_sum = output_sum(decl, topology)
    # A certificate that the next local read leaves the residual it is given untouched: judged
    # with the kernels selection will give that read (an in-place kernel overwrites it), and never
    # where this stage leaves a sum to the next input, which a consumer fusion candidate (they all
    # update the residual in place) may complete.
    capture_owned = False
    if next_local_decl is not None and next_local_norm is not None and out_sum is None:
        peek = context.kernel_selector(name, variants[0].name, record=False)
        capture_owned = not getattr(next_local_decl.read.bind(next_local_norm, peek), "residual_in_place", True)

    scoped = decl.reduction is not ProducerReduction.PARTIAL
    dp = topology.attn_dp.size > 1
    is_ffn = decl.kind is StageKind.FFN
    gather: Optional[str] = None
    returned: Optional[str] = None
    if dp and is_ffn:
        # Under attention DP an FFN input moves to every group's rows: "join" completes the
        # attention sum, the plain add and the gather in one all-reduce; "read_first" reads on the
        # local rows and gathers the normalized input.
        prev = decl.previous
        plain = prev is None or prev.update.plain_add
        gather = "join" if plain and read is not None and not read.before_gather else "read_first"
    if is_ffn:
        returns = return_paths(context.reduction, topology)
        returned = returns[0]
        _report_returns(context, name, variants[0].name, context.reduction, returns,
                        refusals(context.reduction, topology))
        if BatchVariant.CP in variants:
            report_cp_return(context, name)
    # The ORDINARY variant's rows: under attention DP an FFN moves them, else nothing does.
    ordinary_rows: BatchRows = (AttentionDpRows(gather, returned if is_ffn else None) if dp
                                else OrdinaryRows(agree_counts=topology.tp.size > 1))
    before_ffn = following is not None and following.kind is StageKind.FFN
    mixer_before_mixer = following is not None and following.is_mixer
    accepts = _accepts(decl.previous, topology)
    expected = decl.previous.update.name if decl.previous is not None else None
    static_owed = (out_sum,) if (out_sum is not None and not scoped) else ()
    entries: dict[BatchVariant, EntryPath] = {}
    exits: dict[BatchVariant, ExitPath] = {}
    for variant in variants:
        rows: BatchRows
        if variant in (BatchVariant.INPUT_SCATTERED, BatchVariant.SEQUENCE_PARALLEL):
            rows = ScatteredRows(is_ffn)
            entries[variant] = EntryPath(variant, accepts, expected, capture_owned, rows)
            # A mixer leaves its attention-TP sum to the next input, which reduce-scatters it.
            mixer_sum = out_sum if (decl.is_mixer and out_sum is not None) else None
            exits[variant] = ExitPath(
                variant=variant,
                static_owed=static_owed,
                skip_owed=mixer_sum,
                may_defer_sum=mixer_sum is not None,
                always_defer_sum=mixer_sum is not None,
                may_defer_finalize=False,
                rows=rows,
            )
            continue
        if variant is BatchVariant.CP:  # ORDINARY comes first: its exit is built
            # Every stage reads on this rank's tokens as an ordinary batch does; an FFN returns its
            # output to them at finish() (leaving nothing owed), an attention's stays owed.
            if is_ffn:
                assert out_sum is not None, "CP > 1 implies a TP sum"
                rows = CpRows(out_sum.group)
                exits[variant] = ExitPath(variant, (), None, False, False, False, rows)
            else:
                rows = CpRows(None)
                exits[variant] = replace(exits[BatchVariant.ORDINARY], variant=variant, rows=rows)
            entries[variant] = EntryPath(variant, accepts, expected, capture_owned, rows)
            continue
        entries[variant] = EntryPath(variant, accepts, expected, capture_owned, ordinary_rows)
        # An FFN's next consumer is the next layer's first stage when following is not given.
        may_defer = (
            scoped
            and out_sum is not None
            and not decl.terminal
            and decl.reduction is not ProducerReduction.LOCAL_TAIL
            and (following is not None or is_ffn)
            and not (dp and is_ffn)  # under DP the output returns to its rows at finish()
        )
        always = bool(may_defer and decl.is_mixer and before_ffn)
        if decl.is_mixer and not (before_ffn or mixer_before_mixer):
            may_defer = False
        if decl.is_mixer and dp and not before_ffn:
            may_defer = False  # never defer between mixers under attention DP
        exits[variant] = ExitPath(
            variant=variant,
            static_owed=static_owed,
            skip_owed=out_sum if scoped else None,
            may_defer_sum=may_defer,
            always_defer_sum=always,
            may_defer_finalize=is_ffn and decl.sparse and not dp,
            rows=ordinary_rows,
        )
    if "fusions" in options:
        fusions: tuple[Any, ...] = (options["fusions"],) if options["fusions"] is not None else ()
    else:
        fusions = context.fusion_providers()
    plan = StagePlan(
        name=name,
        declaration=decl,
        following=following,
        topology=topology,
        read=read,
        update=decl.update,
        fusions=fusions,
        options=dict(options),
        entries=entries,
        exits=exits,
        refusals=refused_variants,
    )
    _bind_candidates(plan, context)
    return plan


def _bind_candidates(plan: StagePlan, context: Any) -> None:
    """Ask each fusion provider for consumer candidates; keep those that accept this stage."""
    if not plan.fusions:
        return
    hook = "attention_input" if plan.declaration.kind is StageKind.ATTN else "ffn_input"
    accepted: list[Any] = []
    cands: list[Candidate] = []
    for provider in plan.fusions:
        origin = context.provider_origin(provider)
        if getattr(provider, hook, None) is None:
            continue
        offered, failed = offered_candidates(provider, hook, plan)
        if failed is not None:
            cands.append(Candidate(provider.name, origin, failed))
            continue
        for cand in offered:
            why = refusal(cand, plan) if hasattr(cand, "refuse") else None
            if why is None and plan.declaration.previous is None:
                why = "stack entry: nothing is owed to this input"
            if why is None and not getattr(plan.read, "fuses_with", ()):
                why = f"read {plan.read.name} declares no fusable update"
            cands.append(Candidate(cand.name, origin, why))
            if why is None:
                accepted.append(cand)
    if not cands:
        return  # no provider offers anything here (e.g. nothing is owed on one rank): no row
    for variant, entry in list(plan.entries.items()):
        if entry.rows.sliced_residual:
            continue  # a row slice reduce-scatters what it owes: no candidate runs there
        plan.entries[variant] = replace(entry, candidates=tuple(accepted))  # type: ignore[index]
        context.report.add(Selection(
            plan.name, variant.name, "consumer fusion", hook,
            accepted[0].name if accepted else None, tuple(cands),
        ))


def _report_returns(context: Any, stage: str, variant: str, policy: str, chosen: tuple[str, ...],
                    refused: dict[str, str]) -> None:
    cands = [Candidate(p, "policy", refused.get(p)) for p in ("rsv", "rs") if p in refused or p in chosen]
    cands.append(Candidate("ar", "core"))
    context.report.add(Selection(stage, variant, "output return", f"policy {policy}",
                                 "/".join(chosen), tuple(cands)))
