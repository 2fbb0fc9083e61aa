"""The conformance kit run over the core's own providers (and a deliberately broken one)."""

from __future__ import annotations

import pytest
import torch

from layer_boundary._kernels.providers import REFERENCE_PROVIDER
from layer_boundary._kernels.reference import fused_add_rmsnorm_ref, rmsnorm_ref
from layer_boundary.residual._add_norm import NormKernels
from layer_boundary.residual._semantics import PLAIN_RESIDUAL
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


class _WritesItsInput(_FixedEps):
    """rmsnorm writes its output over its input (the residual): a trial's plugin gave wrong logits
    with no warning, and the kit said only that a later comparison was not close."""

    name = "writes-input"

    def kernels(self, request):
        def norm(x, w, eps, *, weight_offset=0.0):
            return x.copy_(rmsnorm_ref(x, w, eps, weight_offset=weight_offset))

        def fused(x, r, w, eps, *, weight_offset=0.0):
            y, s = fused_add_rmsnorm_ref(x, r, w, eps, weight_offset=weight_offset)
            return x.copy_(y), s  # over x, without input_as_out

        return NormKernels(self.name, norm, fused)


def test_kit_names_a_kernel_that_writes_an_input_it_was_not_given_to_write():
    kit = NormKernelConformance()
    kit.hidden_sizes = (64,)
    with pytest.raises(AssertionError, match=r"writes-input.rmsnorm wrote into its input x .*the input is the "
                                             r"residual"):
        kit.test_inputs_are_written_only_where_declared(_WritesItsInput(), "cpu")
    kit.test_inputs_are_written_only_where_declared(REFERENCE_PROVIDER, "cpu")


def test_kit_skips_numeric_tests_when_the_provider_serves_nothing_here():
    # A trial: a CUDA-only provider whose kernels() always raised passed every numeric test on the
    # CPU (each looped over no request).
    class CudaOnly(_FixedEps):
        name = "cuda-only"

        def refuse(self, request):
            return "cuda only"

        def kernels(self, request):
            raise RuntimeError("never called")

    kit = NormKernelConformance()
    with pytest.raises(pytest.skip.Exception, match="cuda-only accepts none of the requests tried on cpu"):
        kit.test_rmsnorm_matches_reference(CudaOnly(), "cpu")


class _ScaledClaimsPlain:
    """r' = 0.5 r + y, declared plain_add=True: wrong under TP (a trial's --check found 28.1)."""

    name = "scaled-claims-plain"

    class Update:
        name, plain_add, at_producer, outlives_producer = "scaled", True, False, True

        def apply(self, residual, contribution):
            return contribution if residual is None else (0.5 * residual.float() + contribution.float()).to(
                residual.dtype)

    def stage(self, hidden_size, *, dtype, device=None):
        from layer_boundary._providers import StageResidual
        from layer_boundary.residual._add_norm import ADD_NORM

        return StageResidual(self.Update(), ADD_NORM, None)

    exit = stage


class _Fp32Read(_ScaledClaimsPlain):
    """An honest plain add whose read returns FP32 under bfloat16: the model's next matmul failed
    on the dtype, far from the scheme."""

    name = "fp32-read"

    class Read:
        name, before_gather, makes_update, fuses_with = "fp32", False, False, frozenset()
        residual_in_place, quant = False, None

        def __init__(self, norm):
            self.norm = norm

        def enter(self, hidden):
            return self.read(hidden), hidden

        def read(self, residual):
            return rmsnorm_ref(residual, self.norm.weight, 1e-6).float()

        def update_and_read(self, update, contribution, residual):
            new = update.apply(residual, contribution)
            return self.read(new), new

    class Spec:
        name = "fp32-read"

        def bind(self, norm, select=None):
            return _Fp32Read.Read(norm)

    def stage(self, hidden_size, *, dtype, device=None):
        from layer_boundary._providers import StageResidual
        from layer_boundary.residual._add_norm import PLAIN_ADD

        return StageResidual(PLAIN_ADD, self.Spec(), None)

    exit = stage


def test_semantics_kit_says_what_a_defective_scheme_got_wrong():
    kit = ResidualSemanticsConformance()
    with pytest.raises(AssertionError, match=r"update 'scaled' declares plain_add=True but apply\(r, c\) is not "
                                             r"r \+ c.*declare plain_add=False"):
        kit.test_plain_add_means_plain_add(_ScaledClaimsPlain(), 32, torch.float32)
    kit.test_stream_transitions(_Fp32Read(), 32, torch.float32)  # FP32 activations: right
    with pytest.raises(AssertionError, match=r"attn #\d+'s read returned \(6, 32\) torch.float32 for an input "
                                             r"\(6, 32\) torch.bfloat16"):
        kit.test_stream_transitions(_Fp32Read(), 32, torch.bfloat16)

    class ExitNone(_Fp32Read):
        def exit(self, hidden_size, *, dtype, device=None):
            return None

    with pytest.raises(TypeError, match=r"exit\(\) returned NoneType, expected layer_boundary.plugin_api.StageResidual"):
        kit.test_stream_transitions(ExitNone(), 32, torch.float32)
