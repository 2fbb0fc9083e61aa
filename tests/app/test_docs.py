"""Every fenced code block of ``README.md`` and ``docs/*.md`` runs here, so the docs cannot drift
from the code.

A block is taken by its language, and by one optional marker on the line just before its fence:

======================================  ==========================================================
``python``                              executed in a fresh namespace (one page's blocks in order)
``<!-- docs-test: continue -->``        ... in the namespace of the page's previous python block
``<!-- docs-test: ranks=2 -->``         ... on 2 gloo ranks, with the variables ``torchrun`` sets
                                        (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ...); the page's
                                        ranked blocks run in one launch, and ``continue`` chains
                                        them there too
``<!-- docs-test: file=PATH -->``       any language: written to PATH in the page's scratch
                                        folder (before anything runs), which is the working folder
                                        and on ``sys.path`` for everything else on that page
``<!-- docs-test: skip: REASON -->``    not run; the reason is required and should name what is
                                        missing (a GPU, an index to upload to)
``sh``                                  each command (``&&`` chains split) by its first word:
                                        ``layer-boundary``, ``torchrun``, ``python``/``pytest``
                                        naming test files: run, exit status 0 (``torchrun
                                        --nproc-per-node N FILE``: FILE on N ranks with torchrun's
                                        variables, without its agent); ``pip install``:
                                        not run, every distribution and path it names must exist in
                                        this repository; ``python3 -m venv``, ``.``/``source``: not
                                        run; ``python -m pytest`` without a test path (the whole
                                        suite, which is this test's own run) and a bare ``mypy``
                                        (the repository's type check, run by ``.ci/run``): not run
``toml``                                parsed
``mermaid``                             exempt (a diagram)
======================================  ==========================================================

Anything else (another language, a command of another kind, an unknown marker) fails, so a new
block is either run or explicitly excused.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w+-]*)\s*$")
MARKER = re.compile(r"^<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
LANGUAGES = {"python", "sh", "toml", "mermaid"}
# Each spawned command may take this long; the embedded defaults finish in seconds.
COMMAND_TIMEOUT = 180


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: Optional[str]

    @property
    def where(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page.name
        return f"{page}:{self.line}"

    @property
    def continues(self) -> bool:
        return self.marker == "continue"

    @property
    def ranked(self) -> bool:
        return self.marker == "ranks=2"

    @property
    def file(self) -> Optional[str]:
        return self.marker[len("file="):] if self.marker and self.marker.startswith("file=") else None

    @property
    def skip_reason(self) -> Optional[str]:
        if self.marker and self.marker.startswith("skip"):
            return self.marker[len("skip"):].lstrip(":").strip()
        return None


def blocks(page: Path) -> list[Block]:
    out: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        assert j < len(lines), f"{page.name}:{start + 1}: a fence that is never closed"
        prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        mm = MARKER.match(prev.strip())
        out.append(Block(page, start + 1, m.group(1), "\n".join(lines[start + 1:j]) + "\n",
                         mm.group(1) if mm else None))
        i = j + 1
    return out


ALL = [b for p in PAGES for b in blocks(p)]


def test_the_pages_exist_and_hold_blocks():
    names = {p.name for p in PAGES}
    assert {"README.md", "concepts.md", "engine-guide.md", "plugin-guide.md", "operations.md",
            "architecture.md", "benchmarks.md"} <= names
    assert sum(b.lang == "python" for b in ALL) >= 5


@pytest.mark.parametrize("block", ALL, ids=lambda b: b.where)
def test_every_block_is_run_or_excused(block):
    assert block.lang in LANGUAGES, f"{block.where}: fence language {block.lang!r} is not one of {sorted(LANGUAGES)}"
    if block.marker is None or block.continues or block.ranked or block.file:
        if block.continues:
            assert block.lang == "python", f"{block.where}: only python blocks continue"
        return
    reason = block.skip_reason
    assert reason is not None, f"{block.where}: unknown marker {block.marker!r}"
    assert len(reason) >= 10, f"{block.where}: a skipped block names why it cannot run, not {reason!r}"


# -- distributions and paths that pip install commands may name --------------------------------

def _projects() -> dict[str, tuple[Path, dict]]:
    """Every distribution of this repository: name -> (folder, [project] table)."""
    out = {}
    for toml in [ROOT / "pyproject.toml", *sorted(ROOT.glob("plugins/*/pyproject.toml"))]:
        project = tomllib.loads(toml.read_text())["project"]
        out[canonicalize_name(project["name"])] = (toml.parent, project)
    return out


def _declared(projects: dict[str, tuple[Path, dict]]) -> set[str]:
    """What the repository's distributions depend on (torch, pytest, flashinfer-python ...)."""
    names = set()
    for _, project in projects.values():
        reqs = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            reqs += extra
        names |= {canonicalize_name(Requirement(r).name) for r in reqs}
    return names


def _check_extras(where: str, what: str, project: dict, extras: set[str]) -> None:
    known = set(project.get("optional-dependencies", {}))
    assert extras <= known, f"{where}: {what} has no extra {sorted(extras - known)} (it has {sorted(known)})"


def check_pip_install(where: str, args: list[str]) -> None:
    projects = _projects()
    declared = _declared(projects)
    takes_value = {"-r", "--requirement", "-c", "--constraint", "-f", "--find-links", "-i",
                   "--index-url", "--extra-index-url", "-t", "--target"}
    named = 0
    it = iter(args)
    for arg in it:
        if arg in takes_value:
            next(it, None)
            continue
        if arg in ("-e", "--editable"):
            arg = next(it)
        elif arg.startswith("-"):
            continue
        named += 1
        m = re.match(r"^(.*?)(?:\[([^\]]*)\])?$", arg)
        target, extras = m.group(1), {e.strip() for e in (m.group(2) or "").split(",") if e.strip()}
        if target.startswith((".", "/")) or "/" in target:
            folder = (ROOT / target).resolve()
            assert (folder / "pyproject.toml").is_file(), (
                f"{where}: {target} is no distribution folder of this repository")
            project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
            _check_extras(where, target, project, extras)
            continue
        req = Requirement(arg)
        name = canonicalize_name(req.name)
        if name in projects:
            _check_extras(where, req.name, projects[name][1], set(req.extras))
        else:
            assert name in declared, (f"{where}: {req.name} is neither a distribution of this repository "
                                      f"nor one that they declare")
    assert named, f"{where}: pip install names nothing"


# -- shell commands --------------------------------------------------------------------------

def _commands(block: Block) -> list[list[str]]:
    text = block.code.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        cmd: list[str] = []
        for w in words + ["&&"]:
            if w == "&&":
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(w)
    return out


_RUN_CACHE: dict[tuple[str, ...], subprocess.CompletedProcess] = {}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # The console scripts of the interpreter running the tests (its venv), whatever PATH says.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def run_shell(block: Block, cwd: Path) -> None:
    for words in _commands(block):
        env = _env()
        env["PYTHONPATH"] = os.pathsep.join([str(cwd), env.get("PYTHONPATH", "")])
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value command ...
            k, v = words.pop(0).split("=", 1)
            env[k] = v
        head = words[0]
        if head == "pip" or words[:3] in (["python", "-m", "pip"], ["python3", "-m", "pip"]):
            sub = words[words.index("pip") + 1 if head == "pip" else 3]
            assert sub == "install", f"{block.where}: pip {sub} is neither run nor checked here"
            check_pip_install(block.where, words[words.index("install") + 1:])
            continue
        if words[:3] in (["python3", "-m", "venv"], ["python", "-m", "venv"]) or head in (".", "source"):
            continue  # making and entering a virtual environment: this test already runs in one
        pytest_args = (words[3:] if words[:3] in (["python", "-m", "pytest"], ["python3", "-m", "pytest"])
                       else words[1:] if head == "pytest" else None)
        if pytest_args is not None and not any(a.endswith(".py") or "/" in a for a in pytest_args):
            continue  # the whole suite: this test is part of that run
        if words == ["mypy"]:
            continue  # the repository's type check (its settings in pyproject.toml), which .ci/run runs
        if pytest_args is not None:
            argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *pytest_args]
        elif head == "layer-boundary":
            argv = words
        elif head == "torchrun":
            _torchrun(block, words, cwd)
            continue
        else:
            raise AssertionError(f"{block.where}: the command {' '.join(words)!r} is neither run nor "
                                 f"checked here; mark the block skip: REASON if it cannot run")
        key = (str(cwd) if head != "layer-boundary" else "", *argv, *sorted(f"{k}={v}" for k, v in env.items()
                                                                       if k.startswith("LAYER_BOUNDARY_")))
        if key not in _RUN_CACHE:
            _RUN_CACHE[key] = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                                             timeout=COMMAND_TIMEOUT)
        out = _RUN_CACHE[key]
        assert out.returncode == 0, (f"{block.where}: {' '.join(words)} exited {out.returncode}\n"
                                     f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def _torchrun(block: Block, words: list[str], cwd: Path) -> None:
    """``torchrun --nproc-per-node N FILE``: FILE on N ranks with the variables torchrun sets
    (its elastic agent, one more interpreter start, is left out: nothing here restarts ranks)."""
    m = re.fullmatch(r"torchrun --nproc[-_]per[-_]node[ =](\d+) (\S+\.py)", " ".join(words))
    assert m, f"{block.where}: only torchrun --nproc-per-node N FILE.py runs here, not {' '.join(words)!r}"
    code = (cwd / m.group(2)).read_text()
    launch_ranks([[(f"{block.where} {m.group(2)}", code)]], cwd, int(m.group(1)), main=True)


# -- python ----------------------------------------------------------------------------------

def _chains(bs: list[Block]) -> list[list[Block]]:
    chains: list[list[Block]] = []
    for b in bs:
        if b.continues and chains:
            chains[-1].append(b)
        else:
            assert not b.continues, f"{b.where}: continues, but no python block comes before it"
            chains.append([b])
    return chains


def _exec_chain(chain: list[Block]) -> None:
    namespace: dict = {"__name__": "__docs__"}
    for b in chain:
        try:
            exec(compile(b.code, b.where, "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{b.where} raised {type(e).__name__}: {e}") from e


RANK_WORKER = textwrap.dedent("""
    import json, sys, traceback
    chains = json.load(open(sys.argv[1]))
    for chain in chains:
        namespace = {"__name__": sys.argv[2]}
        for where, code in chain:
            try:
                exec(compile(code, where, "exec"), namespace)
            except BaseException:
                print(f"FAILED {where}", flush=True)
                traceback.print_exc()
                sys.exit(1)
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranked(chains: list[list[Block]], cwd: Path, world: int = 2) -> None:
    launch_ranks([[(b.where, b.code) for b in chain] for chain in chains], cwd, world)


def launch_ranks(chains: list[list[tuple[str, str]]], cwd: Path, world: int, main: bool = False) -> None:
    spec = cwd / "_ranked_blocks.json"
    spec.write_text(json.dumps(chains))
    worker = cwd / "_rank_worker.py"
    worker.write_text(RANK_WORKER)
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = _env()
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(cwd), env.get("PYTHONPATH", "")]))
        argv = [sys.executable, str(worker), str(spec), "__main__" if main else "__docs__"]
        procs.append(subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=COMMAND_TIMEOUT)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, text) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} of {world} exited {p.returncode}:\n{text[-4000:]}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_runs(page, tmp_path, monkeypatch):
    bs = [b for b in blocks(page) if b.skip_reason is None]
    for b in bs:
        if b.file:
            path = tmp_path / b.file
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(b.code)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    try:
        runnable = [b for b in bs if not b.file]
        for b in runnable:
            if b.lang == "toml":
                tomllib.loads(b.code)
        python = [b for b in runnable if b.lang == "python"]
        local = [b for b in python if not b.ranked and not (b.continues and _ranked_chain(python, b))]
        for chain in _chains(local):
            _exec_chain(chain)
        ranked = [b for b in python if b not in local]
        if ranked:
            run_ranked(_chains(ranked), tmp_path)
        for b in runnable:
            if b.lang == "sh":
                run_shell(b, tmp_path)
    finally:
        for name in set(sys.modules) - before:  # modules the page's files defined
            mod = sys.modules.get(name)
            if mod is not None and str(getattr(mod, "__file__", "") or "").startswith(str(tmp_path)):
                del sys.modules[name]


def _ranked_chain(python: list[Block], block: Block) -> bool:
    """Whether a ``continue`` block belongs to a chain that a ranked block starts."""
    i = python.index(block)
    while i > 0 and python[i].continues:
        i -= 1
    return python[i].ranked


def test_pip_check_refuses_what_does_not_exist():
    check_pip_install("x", ["-e", "plugins/flashinfer[vendor]", "torch==2.13.0", "layer-boundary[mhc]"])
    for bad in (["-e", "plugins/nvidia"], ["layer-boundary-acme"], ["-e", "plugins/flashinfer[fast]"],
                ["layer-boundary[everything]"]):
        with pytest.raises(AssertionError):
            check_pip_install("x", bad)


def test_the_runner_fails_a_failing_block(tmp_path):
    page = tmp_path / "page.md"
    fence = "`" * 3
    page.write_text(f"text\n\n{fence}python\nx = 1\n{fence}\n<!-- docs-test: continue -->\n"
                    f"{fence}python\nassert x == 2, 'wrong'\n{fence}\n\n{fence}sh\nrm -rf build\n{fence}\n")
    first, second, shell = blocks(page)
    assert second.continues and not first.continues
    with pytest.raises(AssertionError, match="page.md:7 raised AssertionError: wrong"):
        for chain in _chains([first, second]):
            _exec_chain(chain)
    with pytest.raises(AssertionError, match="neither run nor checked"):
        run_shell(shell, tmp_path)
