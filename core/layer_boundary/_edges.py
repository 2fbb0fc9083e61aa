"""The check of an incoming edge: the pending contribution is what this stage's input was built
to complete. It runs before any collective of the entry, in every batch variant, so a producer that
``previous=`` misdescribes is refused instead of reducing twice or not at all."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._errors import BoundaryError
from ._output import Contribution

if TYPE_CHECKING:
    from ._plan import EntryPath, StagePlan

__all__ = ["check_edge"]


def check_edge(plan: StagePlan, entry: EntryPath, c: Contribution) -> None:
    """Refuse a contribution the incoming edge was not built for, before any collective runs."""
    if not c.owed and (entry.expected_update is None or c.update.name == entry.expected_update):
        return
    if entry.expected_update is not None and c.update.name != entry.expected_update:
        raise BoundaryError(
            f"{plan.name} stage input was built for a producer update {entry.expected_update!r} but "
            f"the pending contribution carries {c.update.name!r}; make previous= describe the real "
            "producer (the same declaration arguments it uses)"
        )
    for owed in c.owed:
        key = (owed.kind, owed.group_name)
        if key not in entry.accepts:
            built = ", ".join(f"{k.value}:{g.name if g else '-'}" for k, g in sorted(
                entry.accepts, key=lambda x: (x[0].value, x[1].name if x[1] else ""))) or "nothing"
            raise BoundaryError(
                f"the pending contribution owes {owed.describe()}, but this {plan.name} stage's input "
                f"was built to complete only [{built}]; previous= does not describe the real "
                "producer, which would reduce twice or not at all"
            )
