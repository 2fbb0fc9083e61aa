"""The conformance kit run over the core's own providers (and a deliberately broken one)."""

from __future__ import annotations

import pytest
import torch

from layer_boundary.kernels.providers import REFERENCE_PROVIDER
from layer_boundary.kernels.reference import fused_add_rmsnorm_ref, rmsnorm_ref
from layer_boundary.residual.add_norm import NormKernels
from layer_boundary.residual.semantics import PLAIN_RESIDUAL
from layer_boundary.testing import NormKernelConformance, ResidualSemanticsConformance


class TestReferenceKernels(NormKernelConformance):
    hidden_sizes = (64, 127)

    @pytest.fixture
    def provider(self):
        return REFERENCE_PROVIDER


class TestPlainResidual(ResidualSemanticsConformance):
    @pytest.fixture
    def semantics(self):
        return PLAIN_RESIDUAL

    @pytest.fixture
    def reference(self):
        def direct(stack, x):
            r = x.double()
            for i, w in enumerate(stack.weights):
                n = stack.norms[i]
                r = r + rmsnorm_ref(r, n.weight.double(), n.eps) @ w.double()
            n = stack.norms[-1]
            return rmsnorm_ref(r, n.weight.double(), n.eps).to(x.dtype)

        return direct


class _RoundsFirst:
    """A kernel set that rounds the sum before normalizing: the kit must reject it."""

    name = "rounds-first"
    tolerance = {torch.bfloat16: (1.6e-2, 1.6e-2)}

    def refuse(self, request):
        return None if request.dtype == torch.bfloat16 and request.device_type == "cpu" else "bf16 cpu only"

    def kernels(self, request):
        def fused(x, r, w, eps, *, weight_offset=0.0):
            s = (x.float() + r.float()).to(r.dtype)
            return rmsnorm_ref(s, w, eps, weight_offset=weight_offset), s

        return NormKernels(self.name, rmsnorm_ref, fused)


def test_kit_catches_a_kernel_that_rounds_before_normalizing():
    kit = NormKernelConformance()
    kit.hidden_sizes = (4096,)
    with pytest.raises(AssertionError, match="closer to normalizing the rounded residual"):
        kit.test_normalizes_the_unrounded_sum(_RoundsFirst(), "cpu")


class _AliasesBadly:
    """Declares input_as_out but writes y into ``out`` before it reads x for the residual (a trial's
    plugin passed the whole kit and corrupted every layer in the engine)."""

    name = "aliases-badly"

    def refuse(self, request):
        return None if request.device_type == "cpu" else "cpu only"

    def kernels(self, request):
        def fused(x, r, w, eps, *, weight_offset=0.0, out=None):
            y, summed = fused_add_rmsnorm_ref(x, r, w, eps, weight_offset=weight_offset)
            if out is None:
                return y, summed
            out.copy_(y)
            return out, (x.float() + r.float()).to(r.dtype)  # x is y by now

        return NormKernels(self.name, rmsnorm_ref, fused, input_as_out=True)


def test_kit_calls_a_table_that_declares_input_as_out_with_out():
    kit = NormKernelConformance()
    kit.hidden_sizes = (64,)
    kit.test_fused_add_rmsnorm_matches_reference(_AliasesBadly(), "cpu")  # without out=: right
    with pytest.raises(AssertionError, match=r"aliases-badly with out=x \(input_as_out\), .* residual"):
        kit.test_declared_input_as_out(_AliasesBadly(), "cpu")
    kit.test_declared_input_as_out(REFERENCE_PROVIDER, "cpu")  # declares nothing: nothing to call


class _FixedEps:
    """Ignores the eps it is given (compiled with 1e-6): a trial's kernel passed the kit, whose
    every call used eps=1e-6 on rows of rms ~1."""

    name = "fixed-eps"

    def refuse(self, request):
        return None if request.device_type == "cpu" else "cpu only"

    def kernels(self, request):
        def norm(x, w, eps, *, weight_offset=0.0):
            return rmsnorm_ref(x, w, 1e-6, weight_offset=weight_offset)

        def fused(x, r, w, eps, *, weight_offset=0.0):
            return fused_add_rmsnorm_ref(x, r, w, 1e-6, weight_offset=weight_offset)

        return NormKernels(self.name, norm, fused)


def test_kit_catches_a_kernel_that_ignores_eps():
    kit = NormKernelConformance()
    kit.hidden_sizes = (64,)
    kit.test_rmsnorm_matches_reference(_FixedEps(), "cpu")  # eps=1e-6 everywhere: it passed
    with pytest.raises(AssertionError, match=r"fixed-eps.rmsnorm, .*rows of rms ~0.01, eps=0.01"):
        kit.test_eps_and_row_magnitude_are_honoured(_FixedEps(), "cpu")
    kit.test_eps_and_row_magnitude_are_honoured(REFERENCE_PROVIDER, "cpu")


def test_kit_caps_a_providers_own_tolerance():
    class Loose(_FixedEps):
        name = "loose"
        tolerance = {torch.bfloat16: (0.5, 0.5)}

    kit = NormKernelConformance()
    with pytest.raises(AssertionError, match=r"loose declares tolerance \(atol=0.5, rtol=0.5\) for torch.bfloat16, "
                                             r"looser than the kit's cap \(atol=0.032, rtol=0.032\)"):
        kit.test_declared_tolerance_is_within_the_cap(Loose())
    kit.test_declared_tolerance_is_within_the_cap(_RoundsFirst())
