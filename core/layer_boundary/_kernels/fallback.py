"""Saying once that a fast kernel handed a call to a slower path.

A provider's kernel may meet an input it cannot take (misaligned rows, another dtype) and hand the
call to the torch reference: correct, but slower. That must never be silent, and must not flood
the log either: one warning per kernel and cause.
"""

from __future__ import annotations

import logging

__all__ = ["FallbackNotice"]

log = logging.getLogger("layer_boundary")


class FallbackNotice:
    """``notice(kernel, why)`` logs ``"<provider> <kernel>: <why>; ..."`` the first time only."""

    __slots__ = ("provider", "_seen")

    def __init__(self, provider: str) -> None:
        self.provider = provider
        self._seen: set[tuple[str, str]] = set()

    def __call__(self, kernel: str, why: str) -> None:
        if (kernel, why) not in self._seen:
            self._seen.add((kernel, why))
            log.warning("%s %s: %s; this call and others like it use the torch reference",
                        self.provider, kernel, why)
