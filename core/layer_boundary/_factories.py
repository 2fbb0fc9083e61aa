"""Local sequence assembly and stage factories.

``make_stages`` connects declarations (:class:`StageDeclaration`, ``declare_attn``, ``declare_ffn``:
see ``layer_boundary._declarations``) into boundaries; the neighbours outside the local sequence
are described by ``previous`` and ``following``.
"""

from __future__ import annotations

import dataclasses
import reprlib
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from torch import nn

from ._contracts import StageKind
from ._declarations import StageDeclaration, declare_attn, declare_ffn
from ._errors import DeclarationError
from ._topology import Topology

if TYPE_CHECKING:
    from ._context import BoundaryContext
    from ._stage import StageBoundary

__all__ = [
    "StageDeclaration",
    "declare_attn",
    "declare_ffn",
    "make_stages",
    "make_attn_stage",
    "make_ffn_stage",
    "ATTN_OPTIONS",
    "FFN_OPTIONS",
]

ATTN_OPTIONS = frozenset({"qkv_latent_func", "fusions"})
FFN_OPTIONS = frozenset({"fusions"})


def _described(value: Any) -> str:
    """A value for an error message: its type, and a repr cut short (a module or a tensor passed by
    mistake would otherwise print its whole tree or contents)."""
    if isinstance(value, (tuple, list)):
        inner = ", ".join(type(v).__name__ for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"a {type(value).__name__} of {len(value)} ({inner})"
    return f"{type(value).__name__} {reprlib.repr(value)}"


def _split_item(i: int, item: Any) -> tuple[StageDeclaration, nn.Module, dict[str, Any]]:
    if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
        raise TypeError(
            f"make_stages item {i} must be (declaration, norm) or (declaration, norm, options), "
            f"got {_described(item)}"
        )
    decl, norm = item[0], item[1]
    if len(item) == 3 and not isinstance(item[2], Mapping):
        raise TypeError(f"make_stages item {i}: options must be a dict, got {type(item[2]).__name__}")
    options = dict(item[2]) if len(item) == 3 else {}
    if not isinstance(decl, StageDeclaration):
        raise TypeError(
            f"make_stages item {i}: expected a StageDeclaration from declare_attn()/declare_ffn(), "
            f"got {type(decl).__name__}"
        )
    allowed = ATTN_OPTIONS if decl.kind is StageKind.ATTN else FFN_OPTIONS
    unknown = sorted(set(options) - allowed)
    if unknown:
        import difflib

        kind = decl.kind.value
        hints = [f"{u!r}: did you mean {close[0]!r}?" for u in unknown
                 for close in [difflib.get_close_matches(str(u), sorted(allowed), n=1)] if close]
        raise DeclarationError(
            f"make_stages item {i}: {kind} stage option(s) {unknown} are not accepted; "
            f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} stage accepts only {sorted(allowed)}"
            + (f" ({'; '.join(hints)})" if hints else "")
        )
    if options.get("qkv_latent_func") is not None and not callable(options["qkv_latent_func"]):
        raise TypeError(f"make_stages item {i}: qkv_latent_func must be callable")
    return decl, norm, options


def _check_neighbour(name: str, decl: Optional[StageDeclaration]) -> None:
    if decl is not None and not isinstance(decl, StageDeclaration):
        raise TypeError(f"{name}= must be a StageDeclaration or None, got {type(decl).__name__}")


def make_stages(
    *items: Any,
    previous: Optional[StageDeclaration] = None,
    following: Optional[StageDeclaration] = None,
    terminal: bool = False,
    prepared_from: Optional[StageDeclaration] = None,
    topology: Optional[Topology] = None,
    context: Optional[BoundaryContext] = None,
) -> tuple[StageBoundary, ...]:
    """Connect local stages and return one independent ``StageBoundary`` per item.

    ``previous`` describes the real producer before the first stage (``None`` at stack entry),
    ``following`` the external consumer after the last one. ``terminal`` marks the end of the
    model's layer stack. ``prepared_from`` makes the first stage a branch entered through
    ``branch_input``. ``context`` (a ``BoundaryContext``) carries the process groups, plugins and
    the selection report; ``topology=`` alone is shorthand for a context without plugins, and
    with neither the single-rank topology is used when torch.distributed runs one process.
    """
    from ._construction import build_stage
    from ._stage import StageBoundary

    if not items:
        raise TypeError("make_stages needs at least one (declaration, norm) item")
    _check_neighbour("previous", previous)
    _check_neighbour("following", following)
    _check_neighbour("prepared_from", prepared_from)
    if previous is not None and prepared_from is not None:
        raise DeclarationError(
            "give either previous= (a producer before the first stage) or prepared_from= (a "
            "branch whose input another stage already read), not both"
        )
    if not isinstance(terminal, bool):
        raise DeclarationError(f"make_stages(terminal=...): True (the end of the layer stack) or False, got "
                               f"{_described(terminal)}")
    if terminal and following is not None:
        raise DeclarationError("a terminal stage has no following consumer; drop following=")
    split = [_split_item(i, item) for i, item in enumerate(items)]
    for i, (decl, _, _) in enumerate(split):
        if decl.has_source():
            raise DeclarationError(
                f"make_stages item {i}: the declaration already carries previous/prepared_from/"
                "terminal; declare it without them and pass previous=, prepared_from= or "
                "terminal= to make_stages"
            )
    ctx = _resolve_context(context, topology)
    decls = [d for d, _, _ in split]
    resolved = []
    for i, decl in enumerate(decls):
        resolved.append(
            dataclasses.replace(
                decl,
                previous=(previous if i == 0 else decls[i - 1]),
                prepared_from=(prepared_from if i == 0 else None),
                terminal=(terminal and i == len(decls) - 1),
            )
        )
    _check_neighbours(ctx, resolved[0])
    boundaries = []
    for i, (decl, (_, norm, options)) in enumerate(zip(resolved, split)):
        nxt = decls[i + 1] if i + 1 < len(decls) else following
        next_local = split[i + 1][1] if i + 1 < len(decls) else None
        boundaries.append(
            StageBoundary(build_stage(decl, norm, options, following=nxt, next_local_norm=next_local,
                                      next_local_decl=(decls[i + 1] if i + 1 < len(decls) else None),
                                      context=ctx))
        )
    if prepared_from is not None:
        from ._adapters.branch import bind_branch

        bind_branch(boundaries, prepared_from, ctx)
    _remember(ctx, boundaries[-1], following, branch=prepared_from is not None)
    return tuple(boundaries)


def _check_neighbours(ctx: BoundaryContext, first: StageDeclaration) -> None:
    """Both neighbours of an edge between separately built stages must describe each other.

    Stages are built in forward order on one context, so the last stage built is the real
    producer of the next stage that has a ``previous``: that ``previous`` must describe it, and
    its ``following`` (when given) must describe the next stage. A stack entry (``previous=None``)
    and a branch (``prepared_from``) start a new chain; ``following=None`` leaves that side
    unchecked (the consumer is not known).
    """
    last = getattr(ctx, "last_stage", None)
    if last is None or first.previous is None or first.prepared_from is not None:
        return
    if not first.previous.produces_like(last.declaration):
        raise DeclarationError(
            f"the stage {first.describe()} built after {last.name} declares previous="
            f"{first.previous.describe()}, but its real producer, {last.name}, is declared "
            f"{last.declaration.describe()}; both neighbours must describe the same edge, or one "
            "side completes the producer's sum twice and the other never. Pass previous= the "
            "declaration that producer is built with (the same declare_attn()/declare_ffn() arguments)"
        )
    if last.following is not None and not last.following.produces_like(first):
        raise DeclarationError(
            f"{last.name} {last.declaration.describe()} was built with following="
            f"{last.following.describe()}, but the next stage built is {first.describe()}; both "
            "neighbours must describe the same edge, or the producer leaves its sum to a consumer "
            "that is not there. Pass following= the declaration the next stage is built with "
            "(or None where it is not known)"
        )


def _remember(ctx: BoundaryContext, boundary: StageBoundary, following: Optional[StageDeclaration], *,
              branch: bool) -> None:
    """Record the last stage built for the next stage's neighbour check (a stack end or a
    branch output ends the chain: what comes next names its own producer)."""
    from ._context import BuiltStage

    decl = boundary.plan.declaration
    ctx.last_stage = None if (decl.terminal or branch) else BuiltStage(boundary.plan.name, decl, following)


def _make_single(
    kind: StageKind,
    declaration: StageDeclaration,
    norm: nn.Module,
    options: Optional[Mapping[str, Any]],
    following: Optional[StageDeclaration],
    topology: Optional[Topology],
    context: Optional[BoundaryContext],
) -> StageBoundary:
    from ._construction import build_stage
    from ._stage import StageBoundary

    decl, norm, opts = _split_item(0, (declaration, norm, options or {}))
    if decl.kind is not kind:
        fn = "make_attn_stage" if kind is StageKind.ATTN else "make_ffn_stage"
        raise DeclarationError(f"{fn} got a {decl.kind.value} declaration; use the factory of that kind")
    _check_neighbour("following", following)
    if following is not None:
        if following.previous is None or not following.previous.produces_like(decl):
            raise DeclarationError(
                f"following={following.describe()} must name this producer {decl.describe()} in its "
                "previous field (build it with the same arguments this stage's declaration uses)"
            )
        if decl.terminal:
            raise DeclarationError("a terminal stage has no following consumer; drop following=")
    ctx = _resolve_context(context, topology)
    _check_neighbours(ctx, decl)
    boundary = StageBoundary(build_stage(decl, norm, opts, following=following, next_local_norm=None,
                                         next_local_decl=None, context=ctx))
    if decl.prepared_from is not None:
        from ._adapters.branch import bind_branch

        bind_branch((boundary,), decl.prepared_from, ctx)
    _remember(ctx, boundary, following, branch=decl.prepared_from is not None)
    return boundary


def make_attn_stage(
    declaration: StageDeclaration,
    norm: nn.Module,
    options: Optional[Mapping[str, Any]] = None,
    *,
    following: Optional[StageDeclaration] = None,
    topology: Optional[Topology] = None,
    context: Optional[BoundaryContext] = None,
) -> StageBoundary:
    """Build one attention stage whose declaration carries its own source fields."""
    return _make_single(StageKind.ATTN, declaration, norm, options, following, topology, context)


def make_ffn_stage(
    declaration: StageDeclaration,
    norm: nn.Module,
    options: Optional[Mapping[str, Any]] = None,
    *,
    following: Optional[StageDeclaration] = None,
    topology: Optional[Topology] = None,
    context: Optional[BoundaryContext] = None,
) -> StageBoundary:
    """Build one FFN stage whose declaration carries its own source fields."""
    return _make_single(StageKind.FFN, declaration, norm, options, following, topology, context)


def _resolve_context(context: Optional[BoundaryContext], topology: Optional[Topology]) -> BoundaryContext:
    from ._context import BoundaryContext, as_context

    if context is not None:
        return as_context(context, topology)
    return BoundaryContext(_resolve_topology(topology))


def _resolve_topology(topology: Optional[Topology]) -> Topology:
    if topology is not None:
        if not isinstance(topology, Topology):
            raise TypeError(f"topology= must be a layer_boundary.Topology, got {type(topology).__name__}")
        return topology
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise DeclarationError(
            f"torch.distributed runs {dist.get_world_size()} processes but no topology= was given; "
            "build one with Topology.from_sizes(tp=..., dp=...) and pass it to every make_stages call"
        )
    return Topology.single()
