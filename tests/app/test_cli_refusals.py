"""Found by an operator's trial of the README's install and the command line (CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from layer_boundary._cli.main import main
from layer_boundary._plugins import PluginError, discover
from plugin_fixtures import PluginSite, plugin_site  # noqa: F401  (fixture)


def _run(code: str, *flags: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout)


def test_bench_norm_on_cpu_runs_without_pytest(tmp_path):
    # The README's main-job install has no pytest; the benchmark took its tolerances from the
    # conformance kit's package, which imports pytest: every provider was "refused" with
    # ModuleNotFoundError, and without --no-compile the run ended in a traceback.
    r = _run(f"""
        import sys
        sys.modules["pytest"] = None  # not installed
        import torch
        from layer_boundary_app.bench import norm
        from layer_boundary._cli.main import main
        norm._compiled_method(torch.bfloat16)  # the torch.compile peer's tolerance (compiles lazily)
        sys.exit(main(["bench", "norm", "--device", "cpu", "--tokens", "1", "--hidden", "64",
                       "--no-compile", "--replays", "2", "--out", {str(tmp_path)!r}]))
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "No module named" not in r.stdout + r.stderr
    assert "torch-reference" in r.stdout.split("method", 1)[1]  # a measured row, not a refusal


def _read_only_folder(tmp_path) -> str:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        (folder / "probe").write_bytes(b"")
    except OSError:
        return str(folder)
    # root writes through permissions: take a read-only file system instead
    if os.path.isdir("/proc"):
        return "/proc"
    pytest.skip("no read-only folder to write into here")


@pytest.mark.parametrize("argv", [["run", "--input-ids", "1,2", "--save-logits", "{ro}/l.pt"],
                                  ["bench", "host", "--tokens", "1", "--iters", "1", "--forward-iters", "1",
                                   "--hidden", "64", "--json", "{ro}/h.json"],
                                  ["bench", "norm", "--device", "cpu", "--tokens", "1", "--hidden", "64",
                                   "--no-compile", "--replays", "1", "--out", "{ro}"]])
def test_an_output_in_a_read_only_folder_is_refused_before_the_work(argv, tmp_path, capsys):
    # They used to fail with a traceback after the whole run (torch.save / open).
    ro = _read_only_folder(tmp_path)
    with pytest.raises(SystemExit) as e:
        main([a.format(ro=ro) for a in argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no file can be written" in err and "Traceback" not in err


def test_more_threads_than_cpus_is_refused_when_parsed(capsys):
    # --threads 100000 ended the benchmark in a segmentation fault inside torch.
    with pytest.raises(SystemExit) as e:
        main(["bench", "host", "--threads", "100000"])
    assert e.value.code == 2
    assert "argument --threads: 100000 must be 1 to" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["plugins"], ["run", "--input-ids", "1,2"]])
def test_torch_that_cannot_import_is_one_clear_error(command):
    # python -W error without NumPy: torch's import warning becomes an error. `plugins` listed every
    # plugin "failed: partially initialized module 'torch'" and crashed at exit; `run` gave a
    # traceback.
    r = _run(f"""
        import sys
        sys.modules["numpy"] = None  # torch warns at import without NumPy
        from layer_boundary._cli.main import main
        sys.exit(main({command!r}))
    """, "-W", "error")
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
    assert "importing torch raised its warning UserWarning" in r.stderr and "pip install numpy" in r.stderr
    assert "Traceback" not in r.stderr and "partially initialized" not in r.stdout + r.stderr


def test_a_pin_with_another_separator_says_names_are_separated_by_commas(plugin_site: PluginSite):
    # LAYER_BOUNDARY_DISABLE said so for "a;b"; LAYER_BOUNDARY_PLUGINS did not.
    plugin_site.add("acme")
    plugin_site.add("zeta")
    with pytest.raises(PluginError, match=r"plugin 'zeta;acme' is asked for by name .*\(did you mean "
                                          r"zeta,acme\? names are separated by commas\)"):
        discover(allow=["zeta;acme"])
