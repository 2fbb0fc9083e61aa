"""Whether AMD's AITER can run here, told before anything heavy is imported.

AITER's PyPI distribution is ``amd-aiter``; its module is ``aiter``. Two other things install a
module named ``aiter``: PyPI's ``aiter``, an unrelated async-iterator library, and AITER source
builds from before the rename, which registered themselves as the distribution ``aiter``. Who owns
the module is read from distribution metadata (``packages_distributions``, the owner's file list),
never by importing it.

:func:`probe` answers, most useful reason first:

1. torch is a ROCm build (``torch.version.hip``): on a CUDA or CPU build nothing else matters;
2. ``amd-aiter`` is installed, and if not, what owns the module ``aiter`` instead;
3. no other distribution also installs a module ``aiter`` (their files overwrite each other);
4. a GPU is visible;
5. ``import aiter`` works. AITER raises ``RuntimeError``, not ``ImportError``, where ROCm is
   missing, so any exception is caught and becomes the reason.

torch is imported inside the probe, not by this module: the manifest that imports this module
stays light, and by the time discovery calls the probe the core has imported torch anyway.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import re
from typing import Any, Optional

__all__ = ["DISTRIBUTION", "MODULE", "probe", "module_owners"]

DISTRIBUTION = "amd-aiter"
MODULE = "aiter"
_INSTALL = "pip install 'layer-boundary-rocm-aiter[vendor]' (or pip install amd-aiter)"
_VISIBILITY_VARS = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


def probe() -> Optional[str]:
    """Why AITER cannot run here, or ``None`` when it can (``aiter`` then imports)."""
    torch = _torch()
    hip = getattr(torch.version, "hip", None)
    if hip is None:
        return (f"not a ROCm build of torch (torch {torch.__version__}, torch.version.hip is None); "
                "AITER runs only on ROCm")
    version = _version(DISTRIBUTION)
    others = [d for d in module_owners() if _normalize(d) != DISTRIBUTION]
    if version is None:
        if others:
            return f"AITER not installed: {_describe_owner(others[0])}"
        return f"AITER not installed (distribution {DISTRIBUTION} not found); {_INSTALL}"
    if others:
        return (f"the module {MODULE!r} is installed both by {DISTRIBUTION} {version} and by "
                f"{_describe_owner(others[0], short=True)}; their files overwrite each other: "
                f"pip uninstall {others[0]} && pip install --force-reinstall {DISTRIBUTION}")
    try:
        gpus = torch.cuda.device_count()
    except Exception as e:  # a broken driver install raises here rather than returning 0
        return f"asking torch {torch.__version__} (HIP {hip}) for GPUs raised {_describe(e)}"
    if gpus == 0:
        env = ", ".join(f"{k}={os.environ[k]!r}" for k in _VISIBILITY_VARS if k in os.environ)
        return (f"no ROCm GPU visible (torch {torch.__version__}, HIP {hip}, sees none"
                + (f"; {env}" if env else "") + ")")
    try:
        _import_aiter()
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        return f"{DISTRIBUTION} {version} is installed but importing {MODULE} raised {_describe(e)}"
    return None


def module_owners(module: str = MODULE) -> list[str]:
    """Distributions whose metadata says they install the top-level module ``module``."""
    owners = md.packages_distributions().get(module, [])
    return list(dict.fromkeys(owners))


# -- helpers (module attributes, so that tests can replace them) -----------------------------------


def _torch() -> Any:
    import torch

    return torch


def _import_aiter() -> Any:
    return importlib.import_module(MODULE)


def _version(dist: str) -> Optional[str]:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


def _describe_owner(dist_name: str, *, short: bool = False) -> str:
    """Who ``dist_name`` is, as the owner of the module ``aiter`` in place of amd-aiter."""
    try:
        dist = md.distribution(dist_name)
        version = dist.version
    except md.PackageNotFoundError:
        dist, version = None, "?"
    if dist is not None and _looks_like_aiter(dist):
        what = f"{dist_name} {version}, an AITER build registered under its old distribution name"
        if short:
            return what
        return (f"the module {MODULE!r} here comes from {what}; this plugin needs the current "
                f"distribution {DISTRIBUTION}: pip uninstall {dist_name} && pip install {DISTRIBUTION}")
    kind = "an unrelated package"
    if _normalize(dist_name) == "aiter":
        kind = "PyPI's unrelated async-iterator library"
    what = f"the distribution {dist_name} {version}, {kind}, not AMD's AITER"
    if short:
        return what
    return (f"the module {MODULE!r} here comes from {what}; AITER's distribution is {DISTRIBUTION}: "
            f"pip uninstall {dist_name} && pip install {DISTRIBUTION}")


def _looks_like_aiter(dist: Any) -> bool:
    """AITER ships ``aiter/jit/`` (its JIT build system); its metadata names AMD or ROCm."""
    files = dist.files or ()
    if any(str(f).replace("\\", "/").startswith(f"{MODULE}/jit/") for f in files):
        return True
    meta = dist.metadata
    text = " ".join(str(meta.get(k) or "") for k in ("Summary", "Author", "Author-email", "Home-page"))
    return any(k in text for k in ("ROCm", "AMD", "Advanced Micro Devices"))
