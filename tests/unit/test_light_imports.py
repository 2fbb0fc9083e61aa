"""Discovery reads every plugin's manifest before deciding whether the plugin can run here, so
importing a manifest (and the core names it uses) must not import torch, pluggy or a vendor
library; the core package itself loads its names on first use."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

MANIFESTS = ["layer_boundary_flashinfer._manifest", "layer_boundary_cutedsl._manifest",
             "layer_boundary_rocm_aiter._manifest", "layer_boundary_mhc._manifest"]


@pytest.mark.parametrize("module", MANIFESTS)
def test_a_manifest_imports_without_torch_or_pluggy(module):
    script = textwrap.dedent(f"""
        import importlib, json, sys
        m = importlib.import_module({module!r})
        heavy = sorted(n for n in sys.modules if n.split(".")[0] in
                       ("torch", "pluggy", "flashinfer", "cutlass", "aiter", "triton", "numpy"))
        print(json.dumps({{"name": m.MANIFEST.name, "heavy": heavy}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["heavy"] == [], res


def test_the_package_loads_names_on_first_use():
    script = textwrap.dedent("""
        import json, sys
        import layer_boundary as lb
        before = "torch" in sys.modules
        from layer_boundary import make_stages, ForwardBatch  # noqa: F401
        star = {}
        exec("from layer_boundary import *", star)
        print(json.dumps({"before": before, "after": "torch" in sys.modules,
                          "star": sorted(k for k in star if not k.startswith("__")) == sorted(lb.__all__),
                          "dir": set(lb.__all__) <= set(dir(lb))}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"before": False, "after": True, "star": True, "dir": True}


def test_an_unknown_name_is_an_attribute_error():
    import layer_boundary

    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        layer_boundary.nope  # noqa: B018
