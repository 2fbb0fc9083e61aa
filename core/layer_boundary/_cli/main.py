"""``layer-boundary``: the core's command. ``plugins`` is its own; every other subcommand (``run``,
``bench ...`` from ``layer-boundary-app``, ``bench mhc`` from ``layer-boundary-mhc``) is an entry
point of ``layer_boundary.commands`` (protocol: :mod:`layer_boundary._cli.commands`).

Only the command chosen on the command line is imported; ``--help`` and ``--version`` read
distribution metadata and import the light command objects, never torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import metadata
from typing import Optional, Sequence

from .commands import KNOWN_COMMANDS, Command, CommandEntry, install_advice, installed_commands

__all__ = ["main", "build_parser"]

Path = tuple[str, ...]


def _core_version() -> str:
    try:
        return metadata.version("layer-boundary")
    except metadata.PackageNotFoundError:  # sources on sys.path, not installed
        return "unknown (not installed)"


class _Version(argparse.Action):
    """``--version``: the core's version and each installed command distribution's, read when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kw: object) -> None:
        super().__init__(option_strings, dest=dest, nargs=0, help="print the versions and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: Optional[str] = None) -> None:
        lines = [f"layer-boundary {_core_version()}"]
        by_dist: dict[tuple[str, str], list[str]] = {}
        for path, entries in sorted(installed_commands().items()):
            for e in entries:
                by_dist.setdefault((e.distribution or "?", e.version or "?"), []).append(" ".join(path))
        for (dist, version), paths in sorted(by_dist.items()):
            lines.append(f"  {dist} {version} (commands: {', '.join(paths)})")
        print("\n".join(lines))  # stdout, as argparse's own version action
        parser.exit()


class _Missing:
    """A command whose distribution is not installed: it says what to install."""

    def __init__(self, path: Path, distribution: str) -> None:
        self.path, self.distribution = path, distribution
        try:
            self.installed: Optional[str] = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            self.installed = None
        if self.installed is None:
            self.help = f"(not installed: {install_advice(distribution)})"
        else:  # a version from before the command moved to it
            self.help = f"(not in {distribution} {self.installed}: pip install -U {distribution})"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    def main(self, args: argparse.Namespace) -> int:
        name = " ".join(self.path)
        if self.installed is None:
            why = (f"this command comes from the distribution {self.distribution}, which is not installed "
                   f"here; {install_advice(self.distribution)}")
        else:
            why = (f"this command comes from the distribution {self.distribution}, but the installed "
                   f"{self.distribution} {self.installed} does not bring it; upgrade it: "
                   f"{install_advice(self.distribution).replace('pip install ', 'pip install -U ', 1)}")
        print(f"layer-boundary {name}: {why}", file=sys.stderr)
        return 2


class _Broken:
    """A command that cannot be used (its module fails to import, two distributions claim it):
    listed with the reason, and running it prints that reason."""

    def __init__(self, path: Path, why: str) -> None:
        self.path, self.why = path, why
        self.help = f"(unusable: {why})"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    def main(self, args: argparse.Namespace) -> int:
        print(f"layer-boundary {' '.join(self.path)}: {self.why}", file=sys.stderr)
        return 2


def _resolve(path: Path, entries: list[CommandEntry]) -> Command:
    if len(entries) > 1:
        return _Broken(path, "two distributions register it ("
                       + ", ".join(f"{e.distribution} {e.value}" for e in entries) + "); uninstall one")
    try:
        return entries[0].load()
    except Exception as e:  # a plugin's import error: reported, never a traceback for every command
        return _Broken(path, f"{entries[0].distribution} {entries[0].value} failed to load: {type(e).__name__}: {e}")


def _tree(found: dict[Path, list[CommandEntry]]) -> dict[Path, Optional[list[CommandEntry]]]:
    """Every command path: installed ones with their entries; known but missing ones, and groups
    that have no entry of their own, with None."""
    paths: dict[Path, Optional[list[CommandEntry]]] = {tuple(n.split(".")): None for n in KNOWN_COMMANDS}
    paths.update(found)
    for p in list(paths):
        for i in range(1, len(p)):
            paths.setdefault(p[:i], None)
    paths.pop(("plugins",), None)  # the core's own
    return paths


def _children(paths: dict[Path, Optional[list[CommandEntry]]], parent: Path) -> list[Path]:
    return [p for p in paths if len(p) == len(parent) + 1 and p[: len(parent)] == parent]


def _add(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", paths: dict[Path, Optional[list[CommandEntry]]],
         path: Path, chosen: Optional[Path]) -> None:
    """Add ``path``'s parser to ``sub``; import its command only when it is on the chosen path or
    under it (every command when ``chosen`` is None: the full listing)."""
    entries = paths[path]
    kids = _children(paths, path)
    # On the chosen path, or under it (``bench --help`` lists its children with their help).
    on_path = chosen is None or (chosen != () and (chosen[: len(path)] == path or path[: len(chosen)] == chosen))
    if not on_path:
        sub.add_parser(path[-1])  # a name for argparse's choices; never configured or imported
        return
    if entries is None and not kids:
        cmd: Command = _Missing(path, KNOWN_COMMANDS.get(".".join(path), "?"))
    elif entries is None:
        # Its children may come from several distributions: each missing one names its own.
        cmd = _Group(path)
    else:
        cmd = _resolve(path, entries)
    parser = sub.add_parser(path[-1], help=cmd.help)
    if kids and not isinstance(cmd, (_Missing, _Broken)):
        cmd.configure(parser)  # a group's description, or options its children share
        names = "{" + ",".join(k[-1] for k in kids) + "}"
        children = parser.add_subparsers(dest=path[-1], required=True, metavar=names)
        for kid in kids:
            _add(children, paths, kid, chosen)
        return
    cmd.configure(parser)
    parser.set_defaults(_command=cmd)


class _Group:
    """A group none of whose own entry point is installed (e.g. only ``bench.mhc``)."""

    def __init__(self, path: Path) -> None:
        self.help = f"{' '.join(path)} commands"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        pass

    def main(self, args: argparse.Namespace) -> int:  # never called: a group takes a child
        raise AssertionError(args)


def _configure_plugins(parser: argparse.ArgumentParser) -> None:
    parser.description = ("List the plugins found in the entry-point group layer_boundary.plugins. "
                          "Honours LAYER_BOUNDARY_PLUGINS, LAYER_BOUNDARY_DISABLE, "
                          "LAYER_BOUNDARY_DISABLE_PLUGIN_AUTOLOAD and LAYER_BOUNDARY_STRICT_PLUGINS.")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.add_argument("--check", nargs="+", metavar="NAME",
                        help="exit non-zero unless every named plugin is active")


class _Plugins:
    help = "list the plugins found through entry points, their status and why"
    configure = staticmethod(_configure_plugins)

    @staticmethod
    def main(args: argparse.Namespace) -> int:
        from .plugins import plugins_command

        return plugins_command(args)


def build_parser(chosen: Optional[Sequence[str]] = None) -> argparse.ArgumentParser:
    """The parser of every installed command (``chosen``: configure and import only the commands
    on that path, e.g. ``("bench", "host")``, and those under it; ``()``: none of them)."""
    p = argparse.ArgumentParser(
        prog="layer-boundary",
        description="Transformer layer boundaries: the plugins found here (plugins), and the commands "
        "installed distributions bring (run and bench from layer-boundary-app, bench mhc from "
        "layer-boundary-mhc).",
    )
    p.add_argument("--version", action=_Version)
    sub = p.add_subparsers(dest="command", required=True)
    plugins = sub.add_parser("plugins", help=_Plugins.help)
    _Plugins.configure(plugins)
    plugins.set_defaults(_command=_Plugins)
    paths = _tree(installed_commands())
    path = tuple(chosen) if chosen is not None else None
    for top in sorted((q for q in paths if len(q) == 1), key=lambda q: (q[0] != "run", q[0])):
        _add(sub, paths, top, path)
    return p


def _chosen(argv: Sequence[str], paths: dict[Path, Optional[list[CommandEntry]]]) -> Optional[Path]:
    """The command path named on the command line (``bench host`` -> ("bench", "host")), None when
    none is (``--help``, a typo: the full listing then), ``()`` when none is needed (``--version``)."""
    path: Path = ()
    for word in argv:
        if word.startswith("-"):
            if path:
                break  # an option of the command: its children come first
            if word == "--version":
                return ()  # no command's object is needed
            return None
        if path + (word,) in paths or (not path and word == "plugins"):
            path = path + (word,)
            continue
        break
    return path or None


def _unwritable(folder: str) -> Optional[str]:
    """Why no file can be created in ``folder`` (``None``: one can). A real file is made and
    removed: ``os.access`` says yes to root on a read-only file system."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as e:
        return e.strerror or str(e)


def _check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Output paths are checked before any work: a results folder is created, a file's folder must
    exist and take a new file (a missing or read-only one used to surface as a traceback after
    the whole run)."""
    for flag, path in (("--save-logits", getattr(args, "save_logits", None)), ("--json", getattr(args, "json", None))):
        if isinstance(path, str):
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                parser.error(f"{flag} {path!r}: the folder {folder!r} does not exist")
            if os.path.isdir(path):
                parser.error(f"{flag} {path!r} is a folder; give a file path in it")
            why = _unwritable(folder)
            if why is not None:
                parser.error(f"{flag} {path!r}: no file can be written in {folder!r} ({why}); "
                             "give a path in a writable folder")
            if os.path.exists(path) and not os.access(path, os.W_OK):
                parser.error(f"{flag} {path!r} exists and is read-only; give another path or make it writable")
    out = getattr(args, "out", None)
    if isinstance(out, str):
        try:
            os.makedirs(out, exist_ok=True)
        except OSError as e:
            parser.error(f"--out {out!r} cannot be created ({e.strerror})")
        why = _unwritable(out)
        if why is not None:
            parser.error(f"--out {out!r}: no file can be written there ({why}); give a writable folder")


def _torch_import_problem() -> Optional[str]:
    """Why torch cannot be imported here (``None``: it can). Every command needs it; when it fails,
    plugin discovery used to list each plugin ``failed`` with a second-hand error ("partially
    initialized module 'torch'") and the process could crash at exit, and ``run`` gave a traceback."""
    try:
        import torch  # noqa: F401
    except Warning as e:
        cause = "pip install numpy" if "NumPy" in str(e) else "remove its cause"
        return (f"importing torch raised its warning {type(e).__name__}: {e}, which the warning filter "
                f"(python -W error, PYTHONWARNINGS) makes an error; {cause}, or let that warning through "
                f"(-W error -W 'ignore::{type(e).__name__}')")
    except Exception as e:
        return f"importing torch raised {type(e).__name__}: {e}; repair the torch install"
    return None


def _own_usage(parser: argparse.ArgumentParser) -> None:
    """Each command's parser named in its namespace (``_parser``): an unknown option or a bad path
    then prints that command's usage, not the top level's (which lists only the commands)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.set_defaults(_parser=sub)
                _own_usage(sub)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader went away (`layer-boundary plugins | head -3`): stop quietly, as shell tools
        # do, rather than a traceback; stdout is pointed at /dev/null so that the interpreter's
        # own flush at exit does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_chosen(argv, _tree(installed_commands())))
    _own_usage(parser)
    args, extra = parser.parse_known_args(argv)
    here = vars(args).pop("_parser", parser)
    command = vars(args).pop("_command")
    if isinstance(command, (_Missing, _Broken)):
        return command.main(args)
    if extra:
        here.error(f"unrecognized arguments: {' '.join(extra)}")
    _check_outputs(here, args)
    problem = _torch_import_problem()
    if problem is not None:
        print(f"layer-boundary {args.command}: {problem}", file=sys.stderr)
        return 1
    return command.main(args)


if __name__ == "__main__":
    sys.exit(main())
