"""Auxiliary-output collection: callbacks with the ``capture(value, *, owned=False)`` signature."""

from __future__ import annotations

from typing import Iterator, Protocol

import torch

__all__ = ["AuxHiddenStateList", "CaptureCallback", "CaptureCollector"]


class CaptureCallback(Protocol):
    """A ``capture_output=`` callback: receives a value, ``owned`` or borrowed."""

    def __call__(self, value: torch.Tensor, *, owned: bool) -> None: ...


class CaptureCollector(Protocol):
    """A ``captured_last_layer_outputs=`` collector (``AuxHiddenStateList`` is one)."""

    def capture(self, value: torch.Tensor, *, owned: bool = False) -> None: ...


class AuxHiddenStateList:
    """Collects captured hidden states in call order.

    A borrowed value (``owned=False``) may alias the mutable residual or a reusable buffer, so it
    is copied before it is kept; an owned value is kept as is.
    """

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: list[torch.Tensor] = []

    def capture(self, value: torch.Tensor, *, owned: bool = False) -> None:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"capture() takes a tensor, got {type(value).__name__}")
        self._items.append(value if owned else value.clone())

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self._items[i]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._items)

    def clear(self) -> None:
        self._items.clear()

    def stack(self) -> torch.Tensor:
        return torch.stack(self._items)
