"""The core's ``layer-boundary`` and the commands other distributions bring through the entry-point
group ``layer_boundary.commands``: listing without imports, nested commands, a missing
distribution named with how to install it, ``--version``."""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata

import pytest

from layer_boundary._cli import ENTRY_POINT_GROUP
from layer_boundary.plugin_api import Command
from layer_boundary._cli import commands as commands_module
from layer_boundary._cli import main as main_module
from layer_boundary._cli.commands import CommandEntry
from layer_boundary._cli.main import main


class DemoBench:
    """A plugin's nested benchmark, as the MHC plugin's ``bench.mhc`` is."""

    help = "a demo benchmark"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--size", type=int, default=3)

    def main(self, args: argparse.Namespace) -> int:
        print(f"demo ran with size {args.size}")
        return 7


DEMO = DemoBench()
NOT_A_COMMAND = object()


def _entries(**paths: str) -> dict[tuple[str, ...], list[CommandEntry]]:
    return {tuple(name.split("__")): [CommandEntry(tuple(name.split("__")), value, "demo-dist", "9.9")]
            for name, value in paths.items()}


def _installed_with(monkeypatch, extra: dict[tuple[str, ...], list[CommandEntry]], *, keep: bool = True) -> None:
    found = commands_module.installed_commands() if keep else {}
    merged = {**found, **extra}
    monkeypatch.setattr(main_module, "installed_commands", lambda: merged)


def test_the_application_registers_run_and_bench_as_entry_points():
    names = {ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert names["run"] == "layer_boundary_app.cli.commands:RUN"
    assert {"bench", "bench.host", "bench.norm", "bench.allreduce", "bench.finalize", "bench.decode"} <= set(names)
    for path, entries in commands_module.installed_commands().items():
        if entries[0].distribution == "layer-boundary-app":
            assert isinstance(entries[0].load(), Command), path


def test_a_plugins_nested_command_hangs_under_its_group_and_runs(monkeypatch, capsys):
    _installed_with(monkeypatch, _entries(bench__demo=f"{__name__}:DEMO"))
    assert main(["bench", "demo", "--size", "5"]) == 7
    assert "demo ran with size 5" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    listing = capsys.readouterr().out
    assert "demo" in listing and "a demo benchmark" in listing and "host" in listing


def test_a_group_without_its_own_entry_point_still_takes_a_plugins_child(monkeypatch, capsys):
    # Only the plugin installed (no layer-boundary-app): ``bench demo`` works, ``bench host``
    # names the distribution that brings it.
    _installed_with(monkeypatch, _entries(bench__demo=f"{__name__}:DEMO"), keep=False)
    monkeypatch.setattr(main_module.metadata, "version", _not_found)
    assert main(["bench", "demo"]) == 7
    capsys.readouterr()
    assert main(["bench", "host"]) == 2
    assert "pip install layer-boundary-app" in capsys.readouterr().err


def test_a_command_whose_distribution_is_missing_says_what_to_install(monkeypatch, capsys):
    # It was argparse's "invalid choice: 'run'" once the application left the core.
    _installed_with(monkeypatch, {}, keep=False)
    monkeypatch.setattr(main_module.metadata, "version", _not_found)
    assert main(["run", "--tp", "2", "--check"]) == 2
    err = capsys.readouterr().err
    assert ("layer-boundary run: this command comes from the distribution layer-boundary-app, which is not "
            "installed here; pip install layer-boundary-app (in a checkout of this repository: pip install -e "
            "plugins/app)") in err
    assert "invalid choice" not in err
    with pytest.raises(SystemExit):
        main(["--help"])
    listing = capsys.readouterr().out
    assert "run" in listing and "(not installed: pip install layer-boundary-app" in listing


def _not_found(name: str) -> str:
    raise metadata.PackageNotFoundError(name)


def test_an_installed_distribution_without_the_command_is_told_to_upgrade(monkeypatch, capsys):
    _installed_with(monkeypatch, {}, keep=False)
    monkeypatch.setattr(main_module.metadata, "version", lambda name: "0.0.1")
    assert main(["bench", "mhc"]) == 2
    err = capsys.readouterr().err
    assert "the installed layer-boundary-mhc 0.0.1 does not bring it; upgrade it: pip install -U layer-boundary-mhc" in err


def test_an_object_that_is_not_a_command_and_a_command_claimed_twice_are_refused(monkeypatch, capsys):
    two = {("bench", "demo"): [CommandEntry(("bench", "demo"), f"{__name__}:DEMO", "dist-a", "1"),
                               CommandEntry(("bench", "demo"), f"{__name__}:DEMO", "dist-b", "2")]}
    _installed_with(monkeypatch, {**_entries(bench__odd=f"{__name__}:NOT_A_COMMAND"), **two})
    assert main(["bench", "odd"]) == 2
    assert "is not a layer-boundary command" in capsys.readouterr().err
    assert main(["bench", "demo"]) == 2
    err = capsys.readouterr().err
    assert "two distributions register it (dist-a" in err and "dist-b" in err


def test_version_prints_the_core_and_the_command_distributions(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"layer-boundary {metadata.version('layer-boundary')}"
    app = next(line for line in out if "layer-boundary-app" in line)
    assert metadata.version("layer-boundary-app") in app and "run" in app and "bench host" in app


@pytest.mark.parametrize("argv, unwanted", [
    (["--help"], ["torch", "layer_boundary_app.cli.run", "layer_boundary_app.bench.host"]),
    (["run", "--help"], ["torch", "layer_boundary_app.cli.run", "layer_boundary_app.bench"]),
    (["--version"], ["torch", "layer_boundary_app"]),
])
def test_listing_imports_no_torch_and_no_command_module(argv, unwanted):
    code = (f"import sys\nfrom layer_boundary._cli.main import main\ntry:\n    main({argv!r})\n"
            f"except SystemExit:\n    pass\nprint(sorted(m for m in {unwanted!r} if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"
