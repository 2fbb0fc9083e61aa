"""Adapters for integrations that need more than a sequential prepare call (see the spec's
"Special adapters"): ``lora`` publishes the rows a stage's compute input lives on."""

from .lora import InputRows, RowKind, input_rows

__all__ = ["InputRows", "RowKind", "input_rows"]
