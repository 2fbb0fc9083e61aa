"""How far an MHC kernel's outputs may lie from the torch reference, and the comparison that
``layer-boundary bench mhc`` and the tests share.

Each output element is allowed ``atol * magnitude + rtol * |want|`` (``TOLERANCE``, per stream
dtype): ``rtol`` is the final rounding to the output dtype (one ulp: two roundings of FP32 values
that agree to a few FP32 ulps land on the same or the neighbouring value), ``atol`` the FP32
arithmetic done in another order, relative to the *magnitude* the element would have if none of
its terms cancelled (that is where an FP32 sum loses its relative accuracy)::

    streams x'_i     |H_post[i]| |y| + sum_j H_res[i, j] |x_j|
    input            rstd(sum_j H_pre[j] x'_j) |w + offset| sum_j |x'_j|   (an error of atol in
                     each H_pre moves the output by at most atol times this)
    coefficients     1 (H_pre and H_res lie in [0, 1], H_post in [0, 2])

The read is compared with the reference read of the streams the kernel stored, never with the
reference's own streams. A stream element whose FP32 sum lies within a few FP32 ulps of a
rounding boundary rounds one way in the kernel and the other in the reference (about one
element in 2^15), and the coefficients of that token then differ by about 1e-4 (at n = 4,
C = 4096: alpha / sqrt(n C) times one bf16 ulp of a stream value, through the sigmoid) although
both are right to FP32 accuracy for the streams they read. That, compared end to end with the
coefficients' 2e-5, was the "failure" of the first H200 run (2026-11-30). Measured under the
Triton interpreter with the bench's inputs (n = 4, C = 4096, T = 128, bf16), against an FP64
computation from the same rounded streams:

==================================  =====================  =====================
                                    kernel                 torch reference
==================================  =====================  =====================
streams not correctly rounded       76 of 2^21             72 of 2^21
input, max error                    0.66 ulp               1.17 ulp
H_post, H_res max abs error         2.8e-7, 1.9e-7         3.6e-7, 3.4e-7
==================================  =====================  =====================

Kernel and reference differ in 73 stream elements, each by one ulp; the coefficients differ by
up to 9.3e-5 in the 53 tokens holding one and by at most 4.8e-7 elsewhere, and 9.2e-5 is what
FP64 gives for the coefficients of the one set of streams against the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from .coefficients import SINKHORN_ITERS
from .reference import mhc_combine_ref, mhc_read_ref, mhc_update_ref

if TYPE_CHECKING:
    from .params import MhcStageParams

__all__ = ["TOLERANCE", "OUTPUTS", "Deviation", "compare", "assert_matches_reference", "deviation"]

# (atol, rtol) per stream dtype and output, in the sense of the module docstring.
TOLERANCE: dict[torch.dtype, dict[str, tuple[float, float]]] = {
    torch.bfloat16: {
        # n + 1 FP32 products summed in another order (n + 1 FP32 ulps of the magnitude), rounded once.
        "streams": (2.0**-18, 2.0**-7),
        # each coefficient within its atol (below), and one rounding.
        "input": (2e-5, 2.0**-7),
        # FP32 statistics over n C values reduced in another order, the projection as TF32
        # products of phi's high and low parts (2^-21 of each term), 20 Sinkhorn iterations with
        # approximate division: measured 3e-7 from FP64, as the reference.
        "coefficients": (2e-5, 2e-5),
    },
    torch.float16: {
        "streams": (2.0**-18, 2.0**-10),
        "input": (2e-5, 2.0**-10),
        "coefficients": (2e-5, 2e-5),
    },
    torch.float32: {
        # No final rounding to speak of: FP32 arithmetic in another order and an approximate rsqrt.
        "streams": (2.0**-18, 2.0**-20),
        "input": (2e-5, 2.0**-20),
        "coefficients": (2e-5, 2e-5),
    },
}

# What each operation returns (the references' order) and the tolerance entry of each.
OUTPUTS: dict[str, tuple[tuple[str, str], ...]] = {
    "update+read": (("streams", "streams"), ("input", "input"), ("h_post", "coefficients"),
                    ("h_res", "coefficients")),
    "read": (("input", "input"), ("h_post", "coefficients"), ("h_res", "coefficients")),
    "update": (("streams", "streams"),),
}


@dataclass(frozen=True)
class Deviation:
    """The worst element of one output, at ``index``: ``worst = |got - want| / allowed``, at most 1
    to pass (NaN, which fails, where ``got`` is NaN and ``want`` is not)."""

    output: str
    max_abs: float
    worst: float
    index: tuple[int, ...]
    got: float
    want: float
    allowed: float

    @property
    def ok(self) -> bool:
        return self.worst <= 1.0  # False for NaN

    def __str__(self) -> str:
        return (f"{self.output}: max |diff| {self.max_abs:.3g}, worst {self.worst:.3g} of the tolerance at "
                f"{list(self.index)} (got {self.got:.8g}, want {self.want:.8g}, allowed {self.allowed:.3g})")


def deviation(output: str, got: torch.Tensor, want: torch.Tensor, allowed: torch.Tensor) -> Deviation:
    """``got`` against ``want`` elementwise, with ``allowed`` the largest |difference| of each."""
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{output}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}")
    if got.numel() == 0:
        return Deviation(output, 0.0, 0.0, (), 0.0, 0.0, 0.0)
    g, w = got.detach().float(), want.detach().float()
    err = (g - w).abs()
    same = (err == 0) | (torch.isnan(g) & torch.isnan(w))
    ratio = torch.where(same, torch.zeros_like(err), err / allowed.float().expand_as(err))
    flat = int(torch.nan_to_num(ratio, nan=float("inf")).argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), ratio.shape))
    return Deviation(output, float(err.max()), float(ratio.flatten()[flat]), index, float(g[index]), float(w[index]),
                     float(allowed.float().expand_as(err)[index]))


def _allowed(tol: tuple[float, float], magnitude: Any, want: torch.Tensor) -> torch.Tensor:
    atol, rtol = tol
    return atol * magnitude + rtol * want.detach().float().abs()


def _update(streams: torch.Tensor, x: torch.Tensor, y: torch.Tensor, h_post: torch.Tensor,
            h_res: torch.Tensor) -> Deviation:
    want = mhc_update_ref(x, y, h_post, h_res)
    magnitude = h_post.abs().unsqueeze(-1) * y.float().abs().unsqueeze(1) + h_res.abs() @ x.float().abs()
    return deviation("streams", streams, want, _allowed(TOLERANCE[x.dtype]["streams"], magnitude, want))


def _read(got: Sequence[torch.Tensor], streams: torch.Tensor, params: MhcStageParams, norm_weight: torch.Tensor,
          norm_eps: float, norm_offset: float, iters: int) -> list[Deviation]:
    tol = TOLERANCE[streams.dtype]
    want = mhc_read_ref(streams, params, norm_weight, norm_eps, norm_offset=norm_offset, iters=iters)
    mixed = mhc_combine_ref(streams, params, iters)[0].float()
    rstd = torch.rsqrt(mixed.square().mean(dim=-1, keepdim=True) + norm_eps)
    magnitude = rstd * (norm_weight.float() + norm_offset).abs() * streams.float().abs().sum(dim=1)
    out = [deviation("input", got[0], want[0], _allowed(tol["input"], magnitude, want[0]))]
    for name, g, w in zip(("h_post", "h_res"), got[1:], want[1:]):
        out.append(deviation(name, g, w, _allowed(tol["coefficients"], 1.0, w)))
    return out


@torch.no_grad()
def compare(op: str, got: Sequence[torch.Tensor], x: torch.Tensor, *, y: Optional[torch.Tensor] = None,
            h_post: Optional[torch.Tensor] = None, h_res: Optional[torch.Tensor] = None,
            params: Optional[MhcStageParams] = None, norm_weight: Optional[torch.Tensor] = None,
            norm_eps: float = 0.0, norm_offset: float = 0.0, iters: int = SINKHORN_ITERS) -> list[Deviation]:
    """One ``Deviation`` per output of ``op`` (``OUTPUTS``): ``got`` is what a kernel returned for
    streams ``x`` (and, for an update, ``y``, ``h_post``, ``h_res``). The read of
    ``update+read`` is compared with the reference read of ``got``'s streams."""
    if op not in OUTPUTS:
        raise ValueError(f"op {op!r}: choose one of {tuple(OUTPUTS)}")
    if len(got) != len(OUTPUTS[op]):
        raise AssertionError(f"{op} returns {len(OUTPUTS[op])} tensors, got {len(got)}")
    if x.dtype not in TOLERANCE:
        raise TypeError(f"no MHC kernel tolerance for {x.dtype} streams")
    out = []
    if op != "read":
        if y is None or h_post is None or h_res is None:
            raise TypeError(f"compare({op!r}) needs the update's y, h_post and h_res")
        out.append(_update(got[0], x, y, h_post, h_res))
    if op != "update":
        if norm_weight is None or params is None:
            raise TypeError(f"compare({op!r}) needs the read's params and norm_weight")
        streams = got[0] if op == "update+read" else x
        out += _read(got[-3:], streams, params, norm_weight, norm_eps, norm_offset, iters)
    return out


def assert_matches_reference(op: str, got: Sequence[torch.Tensor], x: torch.Tensor, *, where: str = "",
                             **kw: Any) -> None:
    """``compare`` and raise ``AssertionError`` naming every output out of tolerance."""
    bad = [d for d in compare(op, got, x, **kw) if not d.ok]
    if bad:
        raise AssertionError(f"{where + ': ' if where else ''}{op} out of tolerance: " + "; ".join(map(str, bad)))
