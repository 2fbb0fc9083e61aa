"""Conformance of a ``NormKernelProvider`` against the torch reference."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

from .._kernels.reference import fused_add_rmsnorm_fp8_ref, fused_add_rmsnorm_ref, rmsnorm_fp8_ref, rmsnorm_ref
from .._providers import NormRequest
from .._quant import FP8_SCALE_FLOOR
from ._tolerances import MAX_TOLERANCE, assert_fp8_rows_close, tolerance_of
from ._tracing import assert_traces

__all__ = ["NormKernelConformance"]

# Shapes that find bugs: one token, a few tokens, and more rows than a block usually covers.
TOKENS = (1, 3, 130)


class NormKernelConformance:
    """Subclass and provide the ``provider`` fixture (a ``NormKernelProvider``).

    Optional overrides: ``device`` fixture (default: ``cuda`` when the provider's requests need
    it, else ``cpu``), ``dtypes``, ``hidden_sizes`` and ``quants`` class attributes for the
    requests tried. Requests the provider refuses are skipped, and at least one must be accepted.
    Quantized requests (``quants``, default FP8 e4m3) are compared through
    ``tolerances.assert_fp8_rows_close``; a provider that refuses them skips those tests.
    """

    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    hidden_sizes: tuple[int, ...] = (64, 127, 4096)
    offsets: tuple[float, ...] = (0.0, 1.0)
    quants: tuple[str, ...] = ("fp8_e4m3",)

    @pytest.fixture
    def device(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    def _accepted(self, provider: Any, device: str, quant: Optional[str] = None, *,
                  skip_if_none: bool = True) -> list[NormRequest]:
        """The requests tried that ``provider`` serves; none skips the calling test (a numeric
        test over no request would pass without a kernel call)."""
        reqs = [NormRequest(device, dt, h, off, quant) for dt in self.dtypes for h in self.hidden_sizes
                for off in self.offsets]
        ok = []
        for r in reqs:
            why = provider.refuse(r)
            assert why is None or (isinstance(why, str) and why), (
                f"refuse() must return None or a non-empty reason, got {why!r} for {r.describe()}")
            if why is None:
                ok.append(r)
        if not ok and skip_if_none:
            pytest.skip(f"{provider.name} accepts none of the {'' if quant is None else quant + ' '}requests "
                        f"tried on {device} ({len(reqs)}: dtypes {[str(d) for d in self.dtypes]}, hidden sizes "
                        f"{list(self.hidden_sizes)}); run the kit where it serves")
        return ok

    def _tensors(self, r: NormRequest, tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(tokens, r.hidden_size, generator=g).to(r.dtype).to(r.device_type)
        res = torch.randn(tokens, r.hidden_size, generator=g).to(r.dtype).to(r.device_type)
        w = (torch.rand(r.hidden_size, generator=g) + 0.5).to(r.dtype).to(r.device_type)
        return x, res, w

    def test_refuses_with_reasons_and_accepts_something(self, provider: Any, device: str) -> None:
        assert isinstance(provider.name, str) and provider.name
        for q in self.quants:
            self._accepted(provider, device, q, skip_if_none=False)  # checks the form of every refusal
        if not self._accepted(provider, device, skip_if_none=False):
            pytest.skip(f"{provider.name} accepts none of the requests tried on {device}")

    def test_declared_tolerance_is_within_the_cap(self, provider: Any) -> None:
        """A provider's own tolerance table is a claim about its rounding, not a licence: one
        looser than ``tolerances.MAX_TOLERANCE`` would pass any kernel."""
        for dtype, (atol, rtol) in (getattr(provider, "tolerance", None) or {}).items():
            cap = MAX_TOLERANCE.get(dtype)
            assert cap is None or (atol <= cap[0] and rtol <= cap[1]), (
                f"{provider.name} declares tolerance (atol={atol}, rtol={rtol}) for {dtype}, looser than the "
                f"kit's cap (atol={cap[0]}, rtol={cap[1]}); fix the kernel's numerics rather than the bound")

    def test_eps_and_row_magnitude_are_honoured(self, provider: Any, device: str) -> None:
        """Rows whose mean square is near eps (small activations) and large rows, with two eps:
        a kernel that fixes eps, or squares in the activation dtype, differs here by far more than
        the tolerance (at mean square 1e-4, eps=1e-2 scales the output by ~0.1)."""
        for r in self._accepted(provider, device):
            k = provider.kernels(r)
            x, res, w = self._tensors(r, 3, seed=7)
            for scale in (1e-2, 1.0, 1e2):
                xs = (x.float() * scale).to(r.dtype)
                for eps in (1e-6, 1e-2):
                    tol = tolerance_of(provider, r.dtype)
                    where = f"{r.describe()}, rows of rms ~{scale:g}, eps={eps:g}"
                    torch.testing.assert_close(
                        k.rmsnorm(xs, w, eps, weight_offset=r.weight_offset),
                        rmsnorm_ref(xs, w, eps, weight_offset=r.weight_offset), **tol,
                        msg=lambda m: f"{k.name}.rmsnorm, {where}: {m}")
                    got_y, _ = k.fused_add_rmsnorm(xs.clone(), (res.float() * scale).to(r.dtype), w, eps,
                                                   weight_offset=r.weight_offset)
                    want_y, _ = fused_add_rmsnorm_ref(xs, (res.float() * scale).to(r.dtype), w, eps,
                                                      weight_offset=r.weight_offset)
                    torch.testing.assert_close(got_y, want_y, **tol,
                                               msg=lambda m: f"{k.name}.fused_add_rmsnorm, {where}: {m}")

    def test_refuses_an_unknown_quantized_output(self, provider: Any, device: str) -> None:
        """A provider that ignores ``quant`` would be chosen for outputs it does not produce."""
        r = NormRequest(device, self.dtypes[0], self.hidden_sizes[0], 0.0, "no-such-format")
        why = provider.refuse(r)
        assert isinstance(why, str) and why, (
            f"{provider.name} accepted {r.describe()}; refuse quantized formats it does not produce")

    def test_rmsnorm_matches_reference(self, provider: Any, device: str) -> None:
        for r in self._accepted(provider, device):
            k = provider.kernels(r)
            for t in TOKENS:
                x, _, w = self._tensors(r, t)
                got = k.rmsnorm(x, w, 1e-6, weight_offset=r.weight_offset)
                want = rmsnorm_ref(x, w, 1e-6, weight_offset=r.weight_offset)
                torch.testing.assert_close(got, want, **tolerance_of(provider, r.dtype),
                                           msg=lambda m: f"{k.name}.rmsnorm, {r.describe()} T={t}: {m}")

    def test_fused_add_rmsnorm_matches_reference(self, provider: Any, device: str) -> None:
        for r in self._accepted(provider, device):
            k = provider.kernels(r)
            for t in TOKENS:
                x, res, w = self._tensors(r, t)
                want_y, want_r = fused_add_rmsnorm_ref(x, res, w, 1e-6, weight_offset=r.weight_offset)
                got = k.fused_add_rmsnorm(x.clone(), res.clone(), w, 1e-6, weight_offset=r.weight_offset)
                assert isinstance(got, (tuple, list)) and len(got) == 2, (
                    f"{k.name}.fused_add_rmsnorm returned {type(got).__name__}"
                    f"{'' if not isinstance(got, (tuple, list)) else f' of {len(got)}'}: expected (y, residual)")
                got_y, got_r = got
                torch.testing.assert_close(got_y, want_y, **tolerance_of(provider, r.dtype),
                                           msg=lambda m: f"{k.name}.fused_add_rmsnorm, {r.describe()} T={t}: {m}")
                # The stored residual is the FP32 sum rounded once: no tolerance applies.
                torch.testing.assert_close(got_r, want_r, atol=0, rtol=0,
                                           msg=lambda m: f"{k.name}.fused_add_rmsnorm, {r.describe()} T={t} "
                                                         f"residual: {m}")

    def test_normalizes_the_unrounded_sum(self, provider: Any, device: str) -> None:
        """Rounding order: the output comes from the FP32 sum, not from the stored residual."""
        for r in self._accepted(provider, device):
            if r.dtype not in (torch.bfloat16, torch.float16):
                continue
            k = provider.kernels(r)
            x, res, w = self._tensors(r, 130, seed=3)
            y, _ = k.fused_add_rmsnorm(x.clone(), res.clone(), w, 1e-6, weight_offset=r.weight_offset)
            exact = (x.double() + res.double())
            from_fp32 = rmsnorm_ref(exact, w.double(), 1e-6, weight_offset=r.weight_offset)
            from_rounded = rmsnorm_ref(exact.to(r.dtype).double(), w.double(), 1e-6,
                                       weight_offset=r.weight_offset)
            err_fp32 = (y.double() - from_fp32).abs().mean().item()
            err_rounded = (y.double() - from_rounded).abs().mean().item()
            assert err_fp32 <= err_rounded, (
                f"{r.describe()}: the output is closer to normalizing the rounded residual "
                f"({err_rounded:.3g}) than the FP32 sum ({err_fp32:.3g}); normalize before rounding")

    def test_non_contiguous_input(self, provider: Any, device: str) -> None:
        for r in self._accepted(provider, device):
            k = provider.kernels(r)
            g = torch.Generator().manual_seed(5)
            wide = torch.randn(7, 2 * r.hidden_size, generator=g).to(r.dtype).to(r.device_type)
            x = wide[:, ::2]
            w = (torch.rand(r.hidden_size, generator=g) + 0.5).to(r.dtype).to(r.device_type)
            torch.testing.assert_close(
                k.rmsnorm(x, w, 1e-6, weight_offset=r.weight_offset),
                rmsnorm_ref(x.contiguous(), w, 1e-6, weight_offset=r.weight_offset),
                **tolerance_of(provider, r.dtype),
                msg=lambda m: f"{k.name}.rmsnorm on a non-contiguous input (row stride 2H), {r.describe()}: {m}")

    def test_inputs_are_written_only_where_declared(self, provider: Any, device: str) -> None:
        """``rmsnorm`` never writes its input (the residual, which the stream keeps); the fused
        kernel writes ``x`` only with ``input_as_out`` (and then only through ``out=``). A kernel
        that writes an input it was not given to write corrupts the residual or a capture."""
        for r in self._accepted(provider, device):
            k = provider.kernels(r)
            x, res, w = self._tensors(r, 3, seed=11)
            kept = x.clone()
            k.rmsnorm(x, w, 1e-6, weight_offset=r.weight_offset)
            assert torch.equal(x, kept), (
                f"{k.name}.rmsnorm wrote into its input x ({r.describe()}); the input is the residual, which "
                "the boundary keeps: write the output to a new tensor")
            k.fused_add_rmsnorm(x, res, w, 1e-6, weight_offset=r.weight_offset)  # without out=
            assert torch.equal(x, kept), (
                f"{k.name}.fused_add_rmsnorm wrote into x without out= ({r.describe()}); only a table "
                "that declares input_as_out=True is given out=x, and only then may it write there")

    def test_declared_in_place_residual(self, provider: Any, device: str) -> None:
        for r in self._accepted(provider, device):
            k = provider.kernels(r)
            x, res, w = self._tensors(r, 3)
            before = res.clone()
            _, out_r = k.fused_add_rmsnorm(x, res, w, 1e-6, weight_offset=r.weight_offset)
            if k.residual_in_place:
                assert out_r.data_ptr() == res.data_ptr(), "declares residual_in_place but returned a new tensor"
            else:
                assert torch.equal(res, before), (
                    "overwrote the residual it was given without declaring residual_in_place=True; "
                    "captures of that residual would be reported as owned")

    def test_declared_input_as_out(self, provider: Any, device: str) -> None:
        """A table that declares ``input_as_out`` is called with ``out=`` its contribution (the read
        does that): the output written over x must still come from x + residual read before it."""
        for r in self._accepted(provider, device):
            k = provider.kernels(r)
            if not k.input_as_out:
                continue
            for t in TOKENS:
                x, res, w = self._tensors(r, t, seed=7)
                want_y, want_r = fused_add_rmsnorm_ref(x, res, w, 1e-6, weight_offset=r.weight_offset)
                contribution = x.clone()
                got_y, got_r = k.fused_add_rmsnorm(contribution, res.clone(), w, 1e-6,
                                                   weight_offset=r.weight_offset, out=contribution)
                torch.testing.assert_close(got_y, want_y, **tolerance_of(provider, r.dtype),
                                           msg=lambda m: f"{k.name} with out=x (input_as_out), {r.describe()} "
                                                         f"T={t}: {m}")
                torch.testing.assert_close(got_r, want_r, atol=0, rtol=0,
                                           msg=lambda m: f"{k.name} with out=x (input_as_out), {r.describe()} "
                                                         f"T={t} residual: {m}")

    def _fp8_accepted(self, provider: Any, device: str) -> list[NormRequest]:
        reqs = [r for q in self.quants for r in self._accepted(provider, device, q, skip_if_none=False)]
        if not reqs:
            pytest.skip(f"{provider.name} accepts no quantized request ({', '.join(self.quants)}) on {device}")
        return reqs

    def test_fp8_rmsnorm_matches_reference(self, provider: Any, device: str) -> None:
        for r in self._fp8_accepted(provider, device):
            k = provider.kernels(r)
            for t in TOKENS:
                x, _, w = self._tensors(r, t)
                got = k.rmsnorm(x, w, 1e-6, weight_offset=r.weight_offset)
                want = rmsnorm_fp8_ref(x, w, 1e-6, weight_offset=r.weight_offset)
                assert_fp8_rows_close(got, want, what=f"{r.describe()} T={t}")

    def test_fp8_fused_add_rmsnorm_matches_reference(self, provider: Any, device: str) -> None:
        for r in self._fp8_accepted(provider, device):
            k = provider.kernels(r)
            for t in TOKENS:
                x, res, w = self._tensors(r, t)
                want_q, want_r = fused_add_rmsnorm_fp8_ref(x, res, w, 1e-6, weight_offset=r.weight_offset)
                res_in = res.clone()
                got_q, got_r = k.fused_add_rmsnorm(x, res_in, w, 1e-6, weight_offset=r.weight_offset)
                assert_fp8_rows_close(got_q, want_q, what=f"{r.describe()} T={t}")
                assert got_r.dtype == res.dtype, f"{r.describe()}: the residual must keep {res.dtype}"
                torch.testing.assert_close(got_r, want_r, atol=0, rtol=0,
                                           msg=lambda m: f"{r.describe()} T={t} residual: {m}")
                if k.residual_in_place:
                    assert got_r.data_ptr() == res_in.data_ptr(), "declares residual_in_place but returned a new tensor"
                else:
                    assert torch.equal(res_in, res), "overwrote the residual without declaring residual_in_place=True"

    def test_fp8_zero_row_has_the_floor_scale(self, provider: Any, device: str) -> None:
        """An all-zero row must not divide by zero: scale is the floor and every code is 0."""
        for r in self._fp8_accepted(provider, device):
            k = provider.kernels(r)
            x, _, w = self._tensors(r, 3)
            x[1].zero_()
            got = k.rmsnorm(x, w, 1e-6, weight_offset=r.weight_offset)
            assert got.scale[1].item() == pytest.approx(FP8_SCALE_FLOOR), f"{r.describe()}: {got.scale[1].item()}"
            assert not got.data[1].float().any(), f"{r.describe()}: a zero row quantized to nonzero codes"
            assert bool(torch.isfinite(got.data.float()).all()), f"{r.describe()}: non-finite codes"

    def test_kernels_trace_under_torch_compile(self, provider: Any, device: str) -> None:
        """Engines compile whole models with ``fullgraph=True``: the table's kernels (plain, fused,
        fused with ``out=x`` where declared, and the quantized outputs it serves) must trace and
        give the eager numbers, their in-place writes included. One request per weight offset and
        output (each is a compile)."""
        picked: dict[tuple[float, Optional[str]], NormRequest] = {}
        for q in (None, *self.quants):
            for r in self._accepted(provider, device, q, skip_if_none=q is None):
                picked.setdefault((r.weight_offset, q), r)
        for r in picked.values():
            k = provider.kernels(r)
            off = r.weight_offset

            def step(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor) -> tuple[Any, ...]:
                y = k.rmsnorm(x, w, 1e-6, weight_offset=off)
                y2, r2 = k.fused_add_rmsnorm(x, res, w, 1e-5, weight_offset=off)
                if not k.input_as_out:
                    return y, y2, r2
                c = x * 2  # a contribution the call owns, handed over as the destination
                y3, r3 = k.fused_add_rmsnorm(c, r2, w, 1e-6, weight_offset=off, out=c)
                return y, y2, y3, r3

            x, res, w = self._tensors(r, 5, seed=13)
            assert_traces(step, x, res, w, what=f"{k.name} kernels ({r.describe()})")

    @pytest.mark.gpu
    def test_cuda_graph_capture_replays(self, provider: Any) -> None:
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        reqs = self._accepted(provider, "cuda")
        if not reqs:
            pytest.skip(f"{provider.name} accepts no CUDA request")
        for r in reqs[:4]:
            k = provider.kernels(r)
            x, res, w = self._tensors(r, 64)
            res0 = res.clone()
            static_x, static_r = x.clone(), res.clone()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):  # warm up outside capture (JIT, autotune)
                k.fused_add_rmsnorm(static_x.clone(), static_r.clone(), w, 1e-6, weight_offset=r.weight_offset)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y, out_r = k.fused_add_rmsnorm(static_x, static_r, w, 1e-6, weight_offset=r.weight_offset)
            want_y, want_r = fused_add_rmsnorm_ref(x, res0, w, 1e-6, weight_offset=r.weight_offset)
            static_x.copy_(x)
            static_r.copy_(res0)
            y.fill_(float("nan"))  # poison: replay must restore it
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(y, want_y, **tolerance_of(provider, r.dtype))
            torch.testing.assert_close(out_r, want_r, atol=0, rtol=0)

    @pytest.mark.gpu
    def test_fp8_cuda_graph_capture_replays(self, provider: Any) -> None:
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        for r in self._fp8_accepted(provider, "cuda")[:2]:
            k = provider.kernels(r)
            x, res, w = self._tensors(r, 64)
            static_x, static_r = x.clone(), res.clone()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                k.fused_add_rmsnorm(static_x.clone(), static_r.clone(), w, 1e-6, weight_offset=r.weight_offset)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                q, out_r = k.fused_add_rmsnorm(static_x, static_r, w, 1e-6, weight_offset=r.weight_offset)
            want_q, want_r = fused_add_rmsnorm_fp8_ref(x, res, w, 1e-6, weight_offset=r.weight_offset)
            static_x.copy_(x)
            static_r.copy_(res)
            q.scale.fill_(float("nan"))  # poison: replay must restore both parts
            q.data.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert_fp8_rows_close(q, want_q, what=f"{r.describe()} replay")
            torch.testing.assert_close(out_r, want_r, atol=0, rtol=0)
