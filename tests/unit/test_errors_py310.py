"""The error notes on Python 3.10, which ``requires-python`` allows: ``BaseException.add_note``
only exists from 3.11, so the errors that carry a note (``foreign_output``, ``no_path``) must be
built without it there. Runs the core's error module under a 3.10 interpreter when one is found."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import pytest

CORE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "core")


def _python310() -> str | None:
    candidates = [shutil.which("python3.10")] + sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.10*/bin/python")))
    for cand in candidates:
        if not cand:
            continue
        try:
            out = subprocess.run([cand, "-c", "import sys; print(sys.version_info[:2] == (3, 10))"],
                                 capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == "True":
            return cand
    return None


SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
from layer_boundary._errors import add_note, foreign_output, no_path, notes_of
assert foreign_output("why").__notes__ == ["why"]
e = no_path("CP", "attn", "reason")
assert e.__notes__[0] == "attn: reason" and len(e.__notes__) == 2, e.__notes__
err = ValueError("x")
add_note(err, "a")
notes_of(err)[-1] = "b"
assert err.__notes__ == ["b"]
print("ok")
"""


def test_notes_without_add_note_on_python310():
    py = _python310()
    if py is None:
        pytest.skip("no Python 3.10 interpreter on this machine")
    out = subprocess.run([py, "-c", SCRIPT, CORE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_notes_same_as_add_note_here():
    from layer_boundary._errors import add_note, foreign_output, notes_of

    err = foreign_output("why")
    assert err.__notes__ == ["why"]
    add_note(err, "more")
    assert notes_of(err) is err.__notes__ and err.__notes__ == ["why", "more"]
    if sys.version_info >= (3, 11):
        plain = RuntimeError("x")
        plain.add_note("n")
        assert notes_of(plain) == ["n"]
