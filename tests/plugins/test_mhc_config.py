"""``MhcKernelConfig``: the one value that carries the MHC kernels' settings (no torch, no Triton
needed), checked at construction, hashed once, and carried from the scheme to each read's kernels."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, fields, replace

import pytest

pytest.importorskip("layer_boundary_mhc", reason="the MHC plugin is not installed (pip install -e plugins/mhc)")

from layer_boundary_mhc import MhcKernelConfig, MhcSemantics  # noqa: E402
from layer_boundary_mhc.config import DEFAULT_CONFIG, PER_BUCKET  # noqa: E402


def test_every_field_is_documented_and_the_default_is_the_shared_instance():
    import ast
    import inspect

    import layer_boundary_mhc.config as module

    tree = ast.parse(inspect.getsource(module))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MhcKernelConfig")
    documented = set()
    for a, b in zip(cls.body, cls.body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            documented.add(a.target.id)
    settings = {f.name for f in fields(MhcKernelConfig) if f.compare}
    assert settings <= documented, f"fields without a docstring: {sorted(settings - documented)}"
    assert MhcKernelConfig() == DEFAULT_CONFIG and MhcSemantics().kernel_config is DEFAULT_CONFIG
    assert set(PER_BUCKET) <= settings


def test_frozen_slotted_hashable_and_short_repr():
    c = MhcKernelConfig(lag=8, slice_cols=(64, 128, 256))
    with pytest.raises(FrozenInstanceError):
        c.lag = 2  # type: ignore[misc]
    assert not hasattr(c, "__dict__")
    assert hash(c) == hash(MhcKernelConfig(lag=8, slice_cols=(64, 128, 256))) and c != DEFAULT_CONFIG
    assert {c: 1}[replace(DEFAULT_CONFIG, lag=8, slice_cols=(64, 128, 256))] == 1
    assert repr(c) == "MhcKernelConfig(slice_cols=(64, 128, 256), lag=8)" and repr(DEFAULT_CONFIG) == "MhcKernelConfig()"
    assert [c.bucket(t) for t in (1, 16, 17, 1024, 1025)] == [0, 0, 1, 1, 2]


@pytest.mark.parametrize("kw,error,text", [
    (dict(block_tokens=(16, 32)), ValueError, "give a tuple of three values"),
    (dict(lag=True), TypeError, "integers only"),
    (dict(lag=1.5), TypeError, "integers only"),
    (dict(lag=-1), ValueError, "must not be negative"),
    (dict(slice_cols=(0, 256, 256)), ValueError, "must be at least 1"),
    (dict(finish_rows=3), ValueError, "must divide finish_tokens=8"),
    (dict(decode_tokens=2048), ValueError, "is above mid_tokens=1024"),
    (dict(read_tokens=(1,)), ValueError, "give (lowest, highest) tokens"),
])
def test_bad_settings_are_refused_with_the_field_and_value(kw, error, text):
    with pytest.raises(error, match=text.replace("(", r"\(").replace(")", r"\)")):
        MhcKernelConfig(**kw)


def test_the_scheme_carries_its_config_to_each_reads_kernel_selection():
    import torch

    from layer_boundary_mhc.read import MhcReadSpec

    config = MhcKernelConfig(split_tokens=0)
    semantics = MhcSemantics(kernel_config=config)
    spec = semantics.stage(64, dtype=torch.float32).read
    assert isinstance(spec, MhcReadSpec) and spec.config is config
    read = spec.bind(torch.nn.RMSNorm(64, eps=1e-6))
    assert read.kernels.config is config
    assert "kernel_config=MhcKernelConfig(split_tokens=0)" in repr(semantics)
    with pytest.raises(TypeError, match="give a layer_boundary_mhc.MhcKernelConfig"):
        MhcSemantics(kernel_config={"split_tokens": 0})
