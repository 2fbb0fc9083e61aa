"""``layer-boundary plugins``: what discovery found, and why each plugin has its status."""

from __future__ import annotations

import argparse
import logging
import json
import os
import sys

from .._plugins import PluginError, PluginStatus
from .._plugins.discovery import DiscoveryOptions, find_plugins, warn_unknown_variables
from .._plugins.registry import PluginRegistry

__all__ = ["plugins_command"]


def plugins_command(args: argparse.Namespace) -> int:
    options = DiscoveryOptions.resolve()
    try:
        registry = PluginRegistry(find_plugins(options), options)
        records = registry.records
        warn_unknown_variables(os.environ, [r.name for r in records])
    except PluginError as e:
        # The report is still worth printing: rebuild it without the failing requirement.
        print(f"layer-boundary plugins: {e}", file=sys.stderr)
        lenient = DiscoveryOptions(options.allow, options.deny, options.autoload, strict=False)
        # Activated too (hooks called), so that a plugin whose hooks fail shows failed here as well;
        # its warnings were said once already (the error above, or the first pass's).
        quiet = logging.getLogger("layer_boundary.plugins")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            records = PluginRegistry(find_plugins(lenient), DiscoveryOptions(None, options.deny, options.autoload,
                                                                             strict=False)).records
        finally:
            quiet.setLevel(level)
        _print(records, args.json)
        return 1
    _print(records, args.json)
    if args.check:
        status = {r.name: r for r in records}
        bad = [n for n in args.check if n not in status or status[n].status is not PluginStatus.ACTIVE]
        for n in bad:
            r = status.get(n)
            near = [m for m in status if m.lower() == n.lower()]
            why = (f"{r.status.value}: {_one_line(r.reason)}" if r else
                   f"not installed; names are case-sensitive: {near[0]!r}" if near else "not installed")
            print(f"layer-boundary plugins --check: {n} is not active ({why})", file=sys.stderr)
        return 1 if bad else 0
    return 0


def _print(records: list, as_json: bool) -> None:
    if as_json:
        print(json.dumps([r.to_json() for r in records], indent=1))
        return
    if not records:
        print("no plugins found in the entry-point group layer_boundary.plugins")
        return
    rows = [("name", "distribution", "version", "api", "status", "provides / reason")]
    for r in records:
        detail = _one_line(r.reason) or ", ".join(r.provides)
        rows.append((r.name, r.distribution or "-", r.version or "-", str(r.api_version or "-"),
                     r.status.value, detail))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[5])


def _one_line(reason: str) -> str:
    # A reason can be an exception's text of several lines (pluggy's hook-call errors are): one row
    # a plugin, its lines joined (--json keeps them as they are).
    return " ".join(reason.split())
