"""Load Hugging Face safetensors checkpoints into tensor-parallel modules (safetensors only).

A checkpoint folder holds ``config.json`` and either ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Each checkpoint tensor is matched to a parameter by name; fused
parameters (``qkv_proj``, ``gate_up_proj``) come from the model's ``stacked_params_mapping``
``(checkpoint fragment, parameter fragment, shard id)``. The parameter's ``weight_loader`` slices the
full tensor for this rank and casts it to the parameter's dtype. Every parameter (and every shard of
a fused one) must be filled exactly once, and every checkpoint tensor must be used or explicitly
ignored by the model; anything else is an error naming the tensors. The model's
``optional_parameter(name) -> bool`` names parameters a checkpoint may lack (those a residual
scheme owns, such as MHC's): they are loaded when present and keep their init otherwise.
"""

from __future__ import annotations

import glob
import json
import os
from types import TracebackType
from typing import Any, Callable, Iterable, Iterator, Literal, Optional

import torch
from safetensors import safe_open
from torch import nn

from .layers import WeightLoader, default_weight_loader

__all__ = ["safetensors_files", "iter_safetensors", "check_safetensors", "load_tensors", "load_checkpoint",
           "CheckpointMismatch"]

_INDEX = "model.safetensors.index.json"
_LISTED = 8  # names shown per category in a mismatch message


class CheckpointMismatch(ValueError):
    """The checkpoint's tensors do not match the model's parameters."""


def safetensors_files(folder: str | os.PathLike[str]) -> list[str]:
    """The safetensors files of a checkpoint folder, from its index when it has one."""
    folder = os.fspath(folder)
    index = os.path.join(folder, _INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map'; the sharded checkpoint index is malformed")
        files = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
        absent = [f for f in files if not os.path.isfile(f)]
        if absent:
            raise FileNotFoundError(
                f"{index} lists shards that are not in the folder: {[os.path.basename(f) for f in absent]}; "
                "download the complete checkpoint"
            )
        return files
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {folder!r}; save the checkpoint with safe_serialization=True "
            "(PyTorch .bin checkpoints are not read)"
        )
    return files


def iter_safetensors(folder: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the folder, one file open at a time. A file that
    does not read (corrupt, truncated) is a :class:`CheckpointMismatch` naming it."""
    for path in safetensors_files(folder):
        with _unreadable(path):
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    with _unreadable(path, name):
                        tensor = f.get_tensor(name)
                    yield name, tensor


def check_safetensors(folder: str | os.PathLike[str]) -> None:
    """Every safetensors file of the folder opens and lists its tensors (headers only): what a
    launcher checks once before its ranks each load the weights."""
    for path in safetensors_files(folder):
        with _unreadable(path):
            with safe_open(path, framework="pt", device="cpu") as f:
                f.keys()


class _unreadable:
    """Re-raise a safetensors read failure as a CheckpointMismatch that names the file (and tensor)."""

    def __init__(self, path: str, name: str = "") -> None:
        self.path, self.name = path, name

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Optional[type[BaseException]], err: Optional[BaseException],
                 tb: Optional[TracebackType]) -> Literal[False]:
        if err is None or not (type(err).__name__ == "SafetensorError" or isinstance(err, OSError)):
            return False
        what = f"tensor {self.name!r} of " if self.name else ""
        raise CheckpointMismatch(f"{what}{self.path!r} does not read as safetensors ({type(err).__name__}: "
                                 f"{err}); the file is damaged or incomplete: download or save it again") from err


def load_tensors(
    model: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    source: str = "checkpoint",
) -> None:
    """Load full, HF-named ``tensors`` into ``model``'s (possibly sharded) parameters.

    ``model`` may define ``stacked_params_mapping``, ``ignored_checkpoint_name(name) -> bool``,
    ``optional_parameter(name) -> bool`` and ``local_checkpoint_name(name) -> str | None`` (a
    pipeline stage: the local name, or None for another stage's tensor).
    """
    mapping: tuple[tuple[str, str, Any], ...] = tuple(getattr(model, "stacked_params_mapping", ()))
    ignored: Callable[[str], bool] = getattr(model, "ignored_checkpoint_name", lambda name: False)
    optional: Callable[[str], bool] = getattr(model, "optional_parameter", lambda name: False)
    params = dict(model.named_parameters())  # tied parameters appear once, under their first name

    expected: set[tuple[str, Any]] = set()
    for pname in params:
        if optional(pname):
            continue
        shards = [sid for _, dst, sid in mapping if dst in pname]
        expected.update((pname, sid) for sid in shards or [None])

    loaded: set[tuple[str, Any]] = set()
    unexpected: list[str] = []
    duplicated: list[str] = []
    # A pipeline stage holds only some of the checkpoint's modules, under local names: the model
    # maps each name to its own (None: another stage's tensor).
    local_name: Callable[[str], Any] = getattr(model, "local_checkpoint_name", lambda name: name)
    # A tied config's embedding and stored head, compared once both came and then let go (only
    # for a tied config: an untied large checkpoint would hold gigabytes here for nothing).
    tie = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    tied: dict[str, torch.Tensor] = {}
    for name, full in tensors:
        if tie and name in _TIED_NAMES:
            tied[name] = full
            if len(tied) == 2:
                _check_tied_head(tied, source)
                tied.clear()
        if ignored(name):
            continue
        local = local_name(name)
        if local is None:
            continue
        name = local
        target, shard = name, None
        for src, dst, sid in mapping:
            if src in name:
                target, shard = name.replace(src, dst), sid
                break
        param = params.get(target)
        if param is None:
            unexpected.append(name)
            continue
        key = (target, shard)
        if key in loaded:
            duplicated.append(name)
            continue
        loader: WeightLoader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard is None:
                loader(param, full)
            else:
                loader(param, full, shard)
        except ValueError as e:
            raise CheckpointMismatch(f"{source}: tensor {name!r} cannot be loaded: {e}") from e
        loaded.add(key)

    tied.clear()
    missing = sorted(_checkpoint_name(p, s, mapping) for p, s in expected - loaded)
    if missing or unexpected or duplicated:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s) {_head(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected tensor(s) {_head(sorted(unexpected))}")
        if duplicated:
            parts.append(f"{len(duplicated)} tensor(s) given twice {_head(sorted(duplicated))}")
        raise CheckpointMismatch(
            f"{source} does not match {type(model).__name__}: " + "; ".join(parts) + ". "
            "Check that config.json belongs to these safetensors files and that the checkpoint is the "
            "architecture this model implements"
        )


_TIED_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


def _check_tied_head(tied: dict[str, torch.Tensor], source: str) -> None:
    """A config that ties the embeddings while the checkpoint stores a different LM head: the model
    would drop that head (transformers, in this case, keeps it untied), so the logits would differ."""
    embed, head = (tied[n] for n in _TIED_NAMES)
    if head.shape != embed.shape or not torch.equal(head, embed):
        raise CheckpointMismatch(
            f"{source}: config.json ties the embeddings (tie_word_embeddings: true) but the checkpoint's "
            "lm_head.weight differs from model.embed_tokens.weight; transformers then keeps the stored "
            "head untied. Set tie_word_embeddings to false in config.json to load it that way, or drop "
            "lm_head.weight from the checkpoint to tie them"
        )


def load_checkpoint(model: nn.Module, folder: str | os.PathLike[str]) -> None:
    """Load a HF checkpoint folder into ``model`` (see :func:`load_tensors`)."""
    load_tensors(model, iter_safetensors(folder), source=f"checkpoint {os.fspath(folder)!r}")


def _checkpoint_name(pname: str, shard: Any, mapping: tuple[tuple[str, str, Any], ...]) -> str:
    if shard is None:
        return pname
    for src, dst, sid in mapping:
        if sid == shard and dst in pname:
            return pname.replace(dst, src)
    return f"{pname}[{shard}]"


def _head(names: list[str]) -> str:
    shown = names[:_LISTED]
    more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return f"{shown}{more}"
