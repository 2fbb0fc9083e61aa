"""Subcommands of ``layer-boundary`` that other distributions bring: the ``layer_boundary.commands``
entry-point group.

The core's command has one subcommand of its own (``plugins``). Every other one is an entry point
in the group ``layer_boundary.commands`` (the way llm and datasette plugins add commands): the
application distribution ``layer-boundary-app`` brings ``run`` and ``bench``, the MHC plugin its
``bench mhc``.

The protocol
============
An entry point's name is the command's path, dot-separated; its object is a :class:`Command`
(any object with these attributes; nothing to subclass)::

    [project.entry-points."layer_boundary.commands"]
    run = "my_app.cli:RUN"               # layer-boundary run ...
    bench = "my_app.cli:BENCH"           # a group: layer-boundary bench <name> ...
    "bench.host" = "my_app.cli:HOST"     # layer-boundary bench host ...

============  ==============================================================================
attribute     meaning
============  ==============================================================================
``help``      one line for the listing (``layer-boundary --help``)
``configure`` ``configure(parser)``: adds the command's options to its ``argparse`` parser
              (set ``parser.description`` there for a longer text)
``main``      ``main(args) -> int``: runs with the parsed ``argparse.Namespace``; the exit status
============  ==============================================================================

A name with a dot hangs under the command named by what precedes it, which is then a group: it
takes one of its children (``bench host``, ``bench mhc``) and its own ``main`` is never called. A
group's entry point is optional (without it the group is listed with its children only), so a
plugin can add ``bench.mhc`` whether or not the application's ``bench`` is installed.

Listing reads names from distribution metadata without importing anything; the command chosen
on the command line is the only one imported, so a command's module should import its heavy
dependencies (torch) inside ``main``. The command's module may import everything; nothing in the
library imports a command.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from importlib import metadata
from typing import Optional, Protocol, runtime_checkable

__all__ = ["Command", "CommandEntry", "ENTRY_POINT_GROUP", "KNOWN_COMMANDS", "installed_commands",
           "install_advice"]

ENTRY_POINT_GROUP = "layer_boundary.commands"


@runtime_checkable
class Command(Protocol):
    """What an entry point of ``layer_boundary.commands`` names (see the module docstring)."""

    help: str

    def configure(self, parser: argparse.ArgumentParser) -> None: ...

    def main(self, args: argparse.Namespace) -> int: ...


# Commands this repository's distributions bring: a missing one is listed with the distribution
# that brings it, instead of argparse's "invalid choice".
KNOWN_COMMANDS: dict[str, str] = {
    "run": "layer-boundary-app",
    "bench": "layer-boundary-app",
    "bench.host": "layer-boundary-app",
    "bench.norm": "layer-boundary-app",
    "bench.allreduce": "layer-boundary-app",
    "bench.finalize": "layer-boundary-app",
    "bench.decode": "layer-boundary-app",
    "bench.mhc": "layer-boundary-mhc",
}

# Where each of them lives in a checkout of this repository.
_CHECKOUT_FOLDERS = {"layer-boundary-app": "plugins/app", "layer-boundary-mhc": "plugins/mhc"}


def install_advice(distribution: str) -> str:
    folder = _CHECKOUT_FOLDERS.get(distribution)
    where = f" (in a checkout of this repository: pip install -e {folder})" if folder else ""
    return f"pip install {distribution}{where}"


@dataclass(frozen=True)
class CommandEntry:
    """One command as distribution metadata declares it; nothing imported yet."""

    path: tuple[str, ...]  # ("bench", "mhc")
    value: str  # "module:attribute"
    distribution: str  # "" when the metadata does not say
    version: str

    def load(self) -> Command:
        """Import the command's module and check the object against :class:`Command`."""
        obj = metadata.EntryPoint(name=".".join(self.path), value=self.value, group=ENTRY_POINT_GROUP).load()
        if not isinstance(obj, Command) or not isinstance(getattr(obj, "help", None), str):
            missing = [a for a in ("help", "configure", "main") if not hasattr(obj, a)]
            raise TypeError(f"the entry point {'.'.join(self.path)} = {self.value!r} of {self.distribution or '?'} "
                            f"is not a layer-boundary command (missing: {', '.join(missing) or 'a str help'}); "
                            "it needs help, configure(parser) and main(args) -> int")
        return obj


def installed_commands() -> dict[tuple[str, ...], list[CommandEntry]]:
    """Every installed command by path, from metadata only. Two distributions naming one path
    give a list of two: the caller refuses that command, naming both."""
    found: dict[tuple[str, ...], list[CommandEntry]] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist: Optional[metadata.Distribution] = getattr(ep, "dist", None)
        name = dist.metadata["Name"] if dist is not None else ""
        entry = CommandEntry(tuple(ep.name.split(".")), ep.value, name or "", dist.version if dist else "")
        same = found.setdefault(entry.path, [])
        # An editable install can show one distribution twice: the same value is one command.
        if all(e.value != entry.value or e.distribution != entry.distribution for e in same):
            same.append(entry)
    return found
