"""Which batch variants a stage gets paths for, and why it gets none for the others.

A plan holds one entry/exit path per variant its topology and declaration support (see
``construction``). A variant without a path is an error at forward (the spec's ``no stage
boundary path for the active <VARIANT> batch``, with the reason below as a note); a combination
that can never run on the configured topology is refused at construction instead.

======================  ==========================================  ===================================
variant                 built when                                  refused (the reason names it)
======================  ==========================================  ===================================
ORDINARY                always                                      never
INPUT_SCATTERED         attention TP > 1                            CP topology; a mixer that does not
                                                                    gather its TP input; branch stages
SEQUENCE_PARALLEL       TP > 1, no attention DP                     attention DP; CP topology; a mixer
                                                                    that does not gather its input;
                                                                    branch stages
CP                      attention CP > 1                            a mixer that does not gather its
                                                                    input; branch stages
(construction error)    CP > 1 with attention DP > 1, or an MoE output group other than TP
======================  ==========================================  ===================================

When a batch sets several variant flags, ``VARIANT_PRIORITY`` picks the one that runs, and that
variant's path (or its refusal) decides: a batch flagged both input-scattered and CP on a CP
topology is refused with the input-scattered reason, never run as CP.
"""

from __future__ import annotations

from typing import Any

from ._contracts import StageKind
from ._errors import DeclarationError
from ._layout import BatchVariant, SumGroup
from ._selection import Candidate, Selection
from ._topology import Topology

__all__ = ["stage_variants", "check_topology", "report_cp_return"]


def check_topology(topology: Topology) -> None:
    """Refuse at construction a topology whose CP batches could never run correctly."""
    cp, dp = topology.attn_cp.size, topology.attn_dp.size
    if cp == 1:
        return
    if dp > 1:
        raise DeclarationError(
            f"context parallelism (cp={cp}) with attention DP (dp={dp}) is not supported: under "
            "attention DP the FFN input joins every DP group's rows in one all-reduce over TP, which "
            "needs each group's rows replicated over its attention-TP ranks, and CP ranks hold "
            "different tokens. Use cp=1 with attention DP, or dp=1 with CP"
        )
    if topology.moe_out.ranks != topology.tp.ranks:
        raise DeclarationError(
            f"context parallelism (cp={cp}) with a MoE output group {topology.moe_out.ranks} other "
            f"than TP {topology.tp.ranks} is not supported: the CP reduce-scatter of an FFN output "
            "maps TP ranks to CP partitions"
        )


def stage_variants(decl: Any, topology: Topology) -> tuple[tuple[BatchVariant, ...], dict[BatchVariant, str]]:
    """``(variants with a path, {variant: why it has none})`` for one stage; ORDINARY first.

    Variants whose axis has size one on this topology are simply absent (nothing to move); the
    reasons cover variants the topology has but this stage or combination cannot run.
    """
    check_topology(topology)
    a, tp = topology.attn_tp.size, topology.tp.size
    cp, dp = topology.attn_cp.size, topology.attn_dp.size
    ungathered = decl.kind is StageKind.ATTN and not decl.gathers_tp_input
    branch = decl.prepared_from is not None
    refused: dict[BatchVariant, str] = {}
    out = [BatchVariant.ORDINARY]

    def consider(variant: BatchVariant, present: bool, reasons: list[tuple[bool, str]]) -> None:
        if not present:
            return
        for bad, why in reasons:
            if bad:
                refused[variant] = why
                return
        out.append(variant)

    branch_why = ("branch transport supports only ordinary token rows; a prepared_from stage has no "
                  "{} path")
    mixer_why = ("a mixer that takes the whole sequence un-gathered (gathers_tp_input=False, e.g. a "
                 "recurrent scan) cannot run on {}")
    heads = topology.sum_group(SumGroup.ATTN_TP).size
    cp_topo_why = (f"{{}} on a context-parallel topology (cp={cp}) is not supported: attention heads "
                   f"are sharded over the {heads} ranks of one CP position "
                   f"and replicated over CP, so a row slice over attention TP ({a} ranks) would sum "
                   "each head's output once per CP rank; run the batch ordinary or as CP")
    consider(BatchVariant.INPUT_SCATTERED, a > 1, [
        (cp > 1, cp_topo_why.format("the input-scattered variant")),
        (ungathered, mixer_why.format("an attention-TP row slice")),
        (branch, branch_why.format("input-scattered")),
    ])
    consider(BatchVariant.SEQUENCE_PARALLEL, tp > 1, [
        (dp > 1, f"sequence parallel shards the residual over the whole TP group ({tp} ranks), but "
                 f"under attention DP (dp={dp}) each DP group holds its own rows; the input-scattered "
                 "variant slices each group's rows over its attention-TP ranks instead"),
        (cp > 1, cp_topo_why.format("sequence parallel")),
        (ungathered, mixer_why.format("a TP row slice")),
        (branch, branch_why.format("sequence-parallel")),
    ])
    consider(BatchVariant.CP, cp > 1, [
        (ungathered, mixer_why.format("a context-parallel token partition")),
        (branch, branch_why.format("context-parallel")),
    ])
    return tuple(out), refused


def report_cp_return(context: Any, stage: str) -> None:
    """Say in the selection report how a CP FFN's output returns (a required row move, which the
    reduction policy does not govern: the policy's permissions are about attention DP)."""
    context.report.add(Selection(stage, BatchVariant.CP.name, "output return", "CP token mapping",
                                 "reduce-scatter", (Candidate("reduce-scatter", "core"),)))
