"""Error types and the spec's error texts (kept verbatim: users search for them)."""

from __future__ import annotations

import sys

__all__ = [
    "BoundaryError",
    "DeclarationError",
    "START_FIRST",
    "FOREIGN_OUTPUT",
    "WRITE_BEFORE_TAKE",
    "NO_PATH",
    "BRANCH_ENTRY",
    "PARTIAL_FFN",
    "LOCAL_TAIL_ATTN",
    "SNAPSHOT_PLAIN",
    "foreign_output",
    "no_path",
    "add_note",
    "notes_of",
]

START_FIRST = "start the layer stack before entering a stage"
FOREIGN_OUTPUT = (
    "output does not belong to this residual stream; change layer outputs through boundary accessors"
)
WRITE_BEFORE_TAKE = "write the residual update before taking the final output"
NO_PATH = "no stage boundary path for the active {variant} batch"
BRANCH_ENTRY = "a prepared branch must enter through branch_input, not prepare"
PARTIAL_FFN = "PARTIAL is not supported for ffn stages"
LOCAL_TAIL_ATTN = "LOCAL_TAIL is not supported for attention stages"
SNAPSHOT_PLAIN = "snapshot requires a plain residual update"


def notes_of(err: BaseException) -> list[str]:
    """The exception's ``__notes__`` list (created empty when it has none). On 3.11+ that is the
    list ``BaseException.add_note`` appends to and tracebacks print; on 3.10, where
    ``add_note`` does not exist, the same attribute still carries the notes for callers."""
    found: list[str] = vars(err).setdefault("__notes__", [])
    return found


def add_note(err: BaseException, note: str) -> None:
    """``err.add_note(note)`` where Python has it (3.11+); on 3.10 (``requires-python``
    allows it) the note is kept in ``__notes__`` the same way instead of raising AttributeError."""
    if sys.version_info >= (3, 11):
        err.add_note(note)
    else:
        notes_of(err).append(note)


class BoundaryError(RuntimeError):
    """Misuse of a boundary or residual stream at forward time."""


class DeclarationError(BoundaryError, ValueError):
    """A declaration or stage assembly that cannot be built (raised at model construction)."""


def foreign_output(why: str) -> BoundaryError:
    """The spec's identity error, with the specific reason attached as a note."""
    err = BoundaryError(FOREIGN_OUTPUT)
    add_note(err, why)
    return err


def no_path(variant_name: str, stage: str, reason: str | None = None) -> BoundaryError:
    """The spec's error for an active variant without a path; ``reason`` (from the plan's
    refusals, see ``layer_boundary._variants``) names the combination and why it cannot run."""
    err = BoundaryError(NO_PATH.format(variant=variant_name))
    if reason is not None:
        add_note(err, f"{stage}: {reason}")
    add_note(
        err,
        f"{stage} has paths only for the batch variants its topology supports; reject this "
        "parallel configuration in the engine's argument checks, or build the topology that has it"
    )
    return err
