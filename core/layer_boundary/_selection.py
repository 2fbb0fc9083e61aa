"""The selection report: per stage and batch variant, the candidates, the choice and the refusals.

A refusal that is the normal case on this machine (a CUDA kernel on a CPU, an NVIDIA kernel on a
ROCm GPU) is an :class:`OffDevice` reason (``not_on_this_device(...)``): the report lists those
apart, after "not on this device:", so that a CPU run does not read as a run of errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["Candidate", "Selection", "SelectionReport", "OffDevice", "not_on_this_device"]


class OffDevice(str):
    """A refusal reason saying the candidate serves another kind of device than this one."""

    __slots__ = ()


def not_on_this_device(reason: str) -> OffDevice:
    """Mark ``reason`` (what a provider's ``refuse`` returns) as the device's, not a problem."""
    return OffDevice(reason)


@dataclass(frozen=True)
class Candidate:
    name: str
    origin: str  # the plugin that provides it, or "core"
    refused: Optional[str] = None  # why it was not chosen (None for the chosen one)


@dataclass(frozen=True)
class Selection:
    """One decision: what was chosen for ``what`` (e.g. "norm kernels", "consumer fusion")."""

    stage: str
    variant: str
    what: str
    request: str
    chosen: Optional[str]
    candidates: tuple[Candidate, ...]

    def text(self) -> str:
        refused = "; ".join(f"{c.name} ({c.origin}): {c.refused}" for c in self.candidates
                            if c.refused and not isinstance(c.refused, OffDevice))
        elsewhere = "; ".join(f"{c.name} ({c.origin}): {c.refused}" for c in self.candidates
                              if isinstance(c.refused, OffDevice))
        chosen = self.chosen or "none"
        if sum(c.name == self.chosen for c in self.candidates) > 1:
            # Two plugins' providers of one name: say whose was chosen.
            origin = next(c.origin for c in self.candidates if c.name == self.chosen and not c.refused)
            chosen = f"{chosen} ({origin})"
        line = f"{self.what} [{self.request}] -> {chosen}"
        return (line + (f"   refused: {refused}" if refused else "")
                + (f"   not on this device: {elsewhere}" if elsewhere else ""))

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage, "variant": self.variant, "what": self.what, "request": self.request,
            "chosen": self.chosen,
            "candidates": [{"name": c.name, "origin": c.origin, "refused": c.refused,
                            "off_device": isinstance(c.refused, OffDevice)} for c in self.candidates],
        }


@dataclass
class SelectionReport:
    selections: list[Selection] = field(default_factory=list)

    def add(self, selection: Selection) -> None:
        self.selections.append(selection)

    def replace(self, stage: str, what: str, selection: Selection) -> None:
        """Put ``selection`` in place of ``stage``'s ``what`` row (added when there is none)."""
        for i, s in enumerate(self.selections):
            if s.stage == stage and s.what == what:
                self.selections[i] = selection
                return
        self.selections.append(selection)

    def for_stage(self, stage: str) -> list[Selection]:
        return [s for s in self.selections if s.stage == stage]

    def lines(self) -> list[str]:
        """Readable report; stages whose selections are identical share one line."""
        groups: dict[tuple[str, str], list[str]] = {}
        for s in self.selections:
            kind = s.stage.split("#", 1)[0].strip()
            groups.setdefault((f"{kind} {s.variant}", s.text()), []).append(s.stage)
        out = []
        for (head, text), stages in groups.items():
            out.append(f"  {head} x{len(stages)}: {text}")
        return out

    def to_json(self) -> list[dict[str, Any]]:
        return [s.to_json() for s in self.selections]
