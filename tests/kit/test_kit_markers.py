"""A vendor's test file that subclasses the kit runs without ``-p layer_boundary.testing`` and
without unknown-mark warnings: the core registers the kit's markers through ``pytest11``."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_kit_subclass_runs_warning_free_without_opting_in(tmp_path):
    (tmp_path / "test_vendor.py").write_text(textwrap.dedent("""
        import pytest
        from layer_boundary._kernels.providers import ReferenceNormProvider
        from layer_boundary.testing import NormKernelConformance

        class TestReference(NormKernelConformance):
            @pytest.fixture
            def provider(self):
                return ReferenceNormProvider()
    """))
    # A project of its own: no conftest, no ini file of this repository; unknown marks are errors.
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-W", "error::pytest.PytestUnknownMarkWarning", "test_vendor.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "passed" in out.stdout
    assert "Unknown pytest.mark" not in out.stdout + out.stderr
