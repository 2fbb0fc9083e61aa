"""The ``layer-boundary`` command line. Nothing in the library imports it.

Distributions add subcommands through the entry-point group ``layer_boundary.commands``; the
protocol (:class:`Command`: ``help``, ``configure(parser)``, ``main(args) -> int``) is in
:mod:`layer_boundary._cli.commands`.
"""

from .commands import ENTRY_POINT_GROUP, Command

__all__ = ["Command", "ENTRY_POINT_GROUP"]
