"""Shared pieces of the core test suite: independent float64 formulas, small stage stacks,
recording callbacks, counted handoffs and a fake two-rank group for one-process tests.

Nothing here calls into the library's kernels: the reference numbers are written out again so a
wrong kernel cannot agree with itself.
"""

from __future__ import annotations

import contextlib
import re
import types
from typing import Any, Callable, Iterator, Optional

import pytest
import torch

from layer_boundary import (
    ForwardBatch,
    GemmaRMSNorm,
    GroupInfo,
    HandoffOutput,
    ProducerReduction,
    RMSNorm,
    Topology,
    declare_attn,
    declare_ffn,
    make_stages,
)
from layer_boundary._contracts import Owed, OwedKind
from layer_boundary._layout import SumGroup

EPS = 1e-6

# Tolerances: (rtol, atol) per dtype and why.
#   float64: the library accumulates FP64 inputs in FP64; only summation order can differ.
#   float32: same formulas in FP32; the hand-computed matmul and mean reduce in the same order,
#            but allow a few ulps for reassociation in the norm's product.
#   bfloat16: one bf16 ulp (2^-8 relative) for the rounding of the normalized output.
TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype the spec requires: FP32, or FP64 for FP64 data."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms(s: torch.Tensor, weight: torch.Tensor, eps: float = EPS, offset: float = 0.0) -> torch.Tensor:
    """``s / sqrt(mean(s^2) + eps) * (w + offset)`` in ``s``'s dtype (no rounding)."""
    w = weight.to(s.dtype) + offset
    return s / torch.sqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps) * w


def rms64(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm evaluated in float64 (an independent formula for the kernels)."""
    return rms(x.double(), weight.double(), eps, offset)


def exact(text: str) -> str:
    """A ``pytest.raises(match=...)`` pattern for ``text`` at the start of the message (pytest
    matches against the message followed by its notes; ``raises_exact`` compares ``str()``)."""
    return "^" + re.escape(text)


@contextlib.contextmanager
def raises_exact(exc: type, text: str) -> Iterator[Any]:
    """``pytest.raises`` that also demands ``str(error) == text``."""
    with pytest.raises(exc, match=exact(text)) as info:
        yield info
    assert str(info.value) == text


# -- norms and stacks ------------------------------------------------------------------------


def make_norm(hidden: int, dtype: torch.dtype, *, gemma: bool = False, seed: int = 0) -> RMSNorm:
    """A norm with random (non-trivial) weights; no autograd, as in inference."""
    g = torch.Generator().manual_seed(seed)
    cls = GemmaRMSNorm if gemma else RMSNorm
    n = cls(hidden, eps=EPS, dtype=dtype)
    with torch.no_grad():
        n.weight.copy_((torch.rand(hidden, generator=g, dtype=torch.float64) + 0.5).to(dtype))
    n.weight.requires_grad_(False)
    return n


def declare(kind: str, **kw: Any) -> Any:
    """``attn`` (PARTIAL attention), ``ffn`` (dense SCOPED FFN) or ``mixer`` (SCOPED attention)."""
    if kind == "attn":
        return declare_attn(**kw)
    if kind == "mixer":
        return declare_attn(reduction=ProducerReduction.SCOPED, **kw)
    if kind == "ffn":
        return declare_ffn(**kw)
    raise ValueError(kind)


def run_stage(boundary: Any, kind: str, hidden: Any, fb: Any, compute: Callable[[torch.Tensor], Any]) -> Any:
    """One stage as a model runs it: prepare, compute, then finish or exit().finish()."""
    x = boundary.prepare(hidden, fb)
    if kind == "attn":
        return boundary.finish(compute(x), fb)
    with boundary.exit(fb) as output:
        y = compute(x)
    return output.finish(y)


# -- callbacks, providers, handoffs ----------------------------------------------------------


class Recorder:
    """A capture callback that keeps ``(value, owned)`` exactly as the boundary passed them."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, bool]] = []

    def capture(self, value: torch.Tensor, *, owned: bool = False) -> None:
        self.calls.append((value, owned))

    __call__ = capture


class Provider:
    """A fusion provider that answers the exit's questions and counts them."""

    def __init__(self, *, finalize: bool = False, all_reduce: bool = False) -> None:
        self.finalize = finalize
        self.all_reduce = all_reduce
        self.asked: list[str] = []

    def can_defer_finalize(self, plan: Any, forward_batch: Any) -> bool:
        self.asked.append("finalize")
        return self.finalize

    def can_defer_all_reduce(self, plan: Any, forward_batch: Any) -> bool:
        self.asked.append("all_reduce")
        return self.all_reduce


def counted_handoff(value: torch.Tensor, **payload: Any) -> tuple[HandoffOutput, list[int]]:
    """A handoff whose unfused finalize returns ``value`` and records each run."""
    runs: list[int] = []

    def finalize() -> torch.Tensor:
        runs.append(1)
        return value

    return HandoffOutput(finalize, num_tokens=value.shape[0], **payload), runs


class HalfSkip:
    """A nonlinear (non-additive) update ``r' = r / 2 + c`` that may be left pending."""

    name = "half_skip"
    plain_add = False
    at_producer = False
    outlives_producer = True

    def apply(self, residual: Optional[torch.Tensor], contribution: torch.Tensor) -> torch.Tensor:
        if residual is None:
            return contribution.clone()
        return residual / 2 + contribution


def solo_sum(static: bool = True) -> Owed:
    """An owed TP sum over a group of one (the identity, so numbers stay checkable)."""
    return Owed(OwedKind.SUM, SumGroup.TP, GroupInfo.solo(), static=static)


# -- a fake two-rank group: one process, every rank holding the same contribution -------------

FAKE_GROUP = object()


def fake_group(size: int = 2) -> GroupInfo:
    return GroupInfo(ranks=tuple(range(size)), rank=0, group=FAKE_GROUP)


def fake_topology(*, tp: int = 2, attn_dp: int = 1) -> Topology:
    """TP ``tp`` with attention DP ``attn_dp``; its sums run through ``FakeCollectives``."""
    tp_g = fake_group(tp)
    attn_tp = fake_group(tp // attn_dp) if tp // attn_dp > 1 else GroupInfo.solo()
    dp_g = fake_group(attn_dp) if attn_dp > 1 else GroupInfo.solo()
    solo = GroupInfo.solo()
    return Topology(tp=tp_g, attn_tp=attn_tp, attn_dp=dp_g, attn_cp=solo, moe_out=tp_g, pp=solo)


class FakeCollectives:
    """Stands in for torch.distributed under ``layer_boundary._ops``: an all-reduce over a fake
    group of ``n`` ranks multiplies by ``n`` (every rank holds the same values), so a sum that
    runs twice or not at all changes the numbers. Records every call."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def all_reduce(self, x: torch.Tensor, group: Any = None, **kw: Any) -> None:
        assert group is FAKE_GROUP, "a fake-topology test reached a real process group"
        self.calls.append(x.shape[0])
        x.mul_(2)

    def all_gather_into_tensor(self, *a: Any, **k: Any) -> None:  # pragma: no cover
        raise AssertionError("row gathers are not expected on these paths")


def install_fake_dist(monkeypatch: pytest.MonkeyPatch) -> FakeCollectives:
    """Route ``layer_boundary._ops`` collectives, and the reference models' own all-reduce
    (``layer_boundary_app.models.comm``), to a ``FakeCollectives`` (undone by monkeypatch)."""
    import layer_boundary._ops as ops
    import layer_boundary_app.models.comm as comm

    fake = FakeCollectives()
    for module in (ops, comm):
        monkeypatch.setattr(module, "dist", types.SimpleNamespace(
            all_reduce=fake.all_reduce, all_gather_into_tensor=fake.all_gather_into_tensor))
    return fake


# The norm each stage of ``two_layer`` was built with (tests compute expected reads from it).
NORM_OF: dict[Any, RMSNorm] = {}


def two_layer(hidden: int, dtype: torch.dtype = torch.float64, *, topology: Any = None, seed: int = 0,
              ffn_options: Optional[dict] = None, sparse: bool = False) -> list[tuple[str, Any]]:
    """A two-layer attention+FFN stack built as a decoder builds it, layer by layer."""
    stages: list[tuple[str, Any]] = []
    for layer in range(2):
        n_attn = make_norm(hidden, dtype, seed=seed + 2 * layer)
        n_ffn = make_norm(hidden, dtype, seed=seed + 2 * layer + 1)
        ffn_item: tuple = (declare_ffn(sparse=sparse), n_ffn)
        if ffn_options:
            ffn_item = ffn_item + (ffn_options,)
        a, f = make_stages(
            (declare_attn(), n_attn),
            ffn_item,
            previous=declare_ffn(sparse=sparse) if layer else None,
            terminal=layer == 1,
            topology=topology,
        )
        NORM_OF[a], NORM_OF[f] = n_attn, n_ffn
        stages += [("attn", a), ("ffn", f)]
    return stages


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    """Seeded float64 normal data."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# --- tiny random transformers checkpoints (test_qwen3_transformers, test_moe_transformers) ----


def randomize_hf(model: torch.nn.Module, seed: int) -> None:
    """Unit-scale activations: weights ~ N(0, 1/fan_in) (fused 3-D expert tensors included;
    router logits O(1), so tokens spread over the experts), the embedding ~ N(0, 1), biases
    ~ N(0, 0.1^2); norm weights away from one, so a skipped weight shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def save_hf(folder: Any, config_cls: Any, model_cls: Any, kw: dict[str, Any], *, seed: int = 0,
            rope_theta: float = 10_000.0, **save_kw: Any) -> Any:
    """A tiny random transformers model (``model_cls(config_cls(**kw))``, SDPA attention)
    saved to ``folder`` as safetensors; returns the transformers model."""
    config = config_cls(**kw, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                        attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize_hf(model, seed)
    model.save_pretrained(folder, safe_serialization=True, **save_kw)
    return model


def hf_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """A transformers model's FP32 logits ``[T, vocab]`` for one sequence ``ids [T]``."""
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


def our_logits(model: Any, ids: torch.Tensor, seq_lens: Any = None, *, forward: Any = None) -> torch.Tensor:
    """Our model's logits for ``ids`` (one sequence, or packed ``seq_lens``);
    ``forward(model, ids, positions, forward_batch)`` in place of ``model(...)`` (plain_forward)."""
    if seq_lens is None:
        positions = torch.arange(ids.shape[0])
    else:
        positions = torch.cat([torch.arange(n) for n in seq_lens])
    fb = ForwardBatch(num_tokens=ids.shape[0], positions=positions, seq_lens=seq_lens)
    with torch.no_grad():
        if forward is not None:
            return forward(model, ids, positions, fb)
        return model(ids, positions, fb)
