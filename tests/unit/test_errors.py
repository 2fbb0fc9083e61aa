"""Every error of the spec's "Common errors" table, with its exact text, under its cause; the
clear errors for other misuse; and exit scopes that restore the compute flags."""

from __future__ import annotations

import pytest
import torch

from helpers import (
    rand,
    FakeCollectives,
    HalfSkip,
    Provider,
    counted_handoff,
    declare,
    fake_topology,
    install_fake_dist,
    make_norm,
    raises_exact,
    solo_sum,
)
from layer_boundary import (
    BoundaryError,
    DeclarationError,
    ForwardBatch,
    ProducerReduction,
    ResidualStream,
    declare_attn,
    declare_ffn,
    get_forward,
    make_attn_stage,
    make_ffn_stage,
    make_stages,
)
from layer_boundary import _errors as errors
from layer_boundary._errors import (
    BRANCH_ENTRY,
    FOREIGN_OUTPUT,
    LOCAL_TAIL_ATTN,
    PARTIAL_FFN,
    SNAPSHOT_PLAIN,
    START_FIRST,
    WRITE_BEFORE_TAKE,
)
from layer_boundary.residual import batch as rb

H, T = 8, 3
F64 = torch.float64

# The spec's table, verbatim: the library's constants must be these strings.
SPEC_TEXTS = {
    "START_FIRST": "start the layer stack before entering a stage",
    "FOREIGN_OUTPUT": "output does not belong to this residual stream; change layer outputs through boundary accessors",
    "WRITE_BEFORE_TAKE": "write the residual update before taking the final output",
    "BRANCH_ENTRY": "a prepared branch must enter through branch_input, not prepare",
    "PARTIAL_FFN": "PARTIAL is not supported for ffn stages",
    "LOCAL_TAIL_ATTN": "LOCAL_TAIL is not supported for attention stages",
    "SNAPSHOT_PLAIN": "snapshot requires a plain residual update",
}


def started(**kw):
    fb = ForwardBatch.for_tokens(T, **kw)
    rb.start(fb)
    return fb


def layer(previous=None, terminal=False, **ffn):
    return make_stages(
        (declare_attn(), make_norm(H, F64)),
        (declare_ffn(**ffn), make_norm(H, F64, seed=1)),
        previous=previous,
        terminal=terminal,
    )


def test_error_constants_are_the_spec_texts():
    for name, text in SPEC_TEXTS.items():
        assert getattr(errors, name) == text


# -- start the layer stack before entering a stage ---------------------------------------------


def test_start_first_for_every_entry_point():
    a, f = layer()
    x = rand(T, H)
    fb = ForwardBatch.for_tokens(T)  # the model skipped residual_batch.start()
    calls = {
        "prepare": lambda: a.prepare(x, fb),
        "finish": lambda: a.finish(x, fb),
        "exit": lambda: f.exit(fb),
        "capture_output": lambda: a.capture_output(x, fb),
        "postprocess": lambda: f.postprocess(x, fb),
        "norm": lambda: rb.norm(x, fb, make_norm(H, F64)),
        "take_output": lambda: rb.take_output(x, fb),
    }
    for name, call in calls.items():
        with raises_exact(BoundaryError, START_FIRST):
            call()


def test_start_first_after_the_stream_was_released():
    """A split-prefill segment or MTP head that reuses a finished batch without start()."""
    a, f = layer(terminal=True)
    fb = started()
    inp = f.prepare(a.finish(a.prepare(rand(T, H), fb), fb), fb)
    with f.exit(fb) as out:
        y = inp
    rb.norm(out.finish(y), fb, make_norm(H, F64))
    with raises_exact(BoundaryError, START_FIRST):
        a.prepare(rand(T, H), fb)
    rb.start(fb)
    a.prepare(rand(T, H), fb)  # a fresh start works


# -- output does not belong to this residual stream --------------------------------------------


def test_foreign_output_rebinding():
    a, f = layer()
    fb = started()
    h = a.finish(a.prepare(rand(T, H), fb), fb)
    h = h * 1.0  # rebinding the layer output to a new tensor
    with raises_exact(BoundaryError, FOREIGN_OUTPUT):
        f.prepare(h, fb)


def test_foreign_output_other_microbatch():
    a, f = layer()
    fb1, fb2 = started(), started()
    h1 = a.finish(a.prepare(rand(T, H), fb1), fb1)
    h2 = a.finish(a.prepare(rand(T, H, seed=1), fb2), fb2)
    with raises_exact(BoundaryError, FOREIGN_OUTPUT):
        f.prepare(h1, fb2)
    with raises_exact(BoundaryError, FOREIGN_OUTPUT):
        f.prepare(h2, fb1)


def test_foreign_output_other_microbatch_owed():
    s1, h1 = ResidualStream.arrive(residual=rand(T, H), output=rand(T, H, seed=1), owed=(solo_sum(),))
    s2, h2 = ResidualStream.arrive(residual=rand(T, H), output=rand(T, H, seed=2), owed=(solo_sum(),))
    fb2 = ForwardBatch.for_tokens(T)
    fb2.residual_stream = s2
    with raises_exact(BoundaryError, FOREIGN_OUTPUT):
        rb.complete_output(h1, fb2)


# -- write the residual update before taking the final output ----------------------------------


def test_write_before_take():
    a, f = layer()
    fb = started()
    h = a.finish(a.prepare(rand(T, H), fb), fb)
    with raises_exact(BoundaryError, WRITE_BEFORE_TAKE):
        rb.take_output(h, fb)


# -- no stage boundary path for the active <VARIANT> batch -------------------------------------

VARIANTS = [
    ("context_parallel", "CP"),
    ("input_scattered", "INPUT_SCATTERED"),
    ("sequence_parallel", "SEQUENCE_PARALLEL"),
]


@pytest.mark.parametrize("flag,name", VARIANTS, ids=[v[1] for v in VARIANTS])
def test_no_path_for_an_unsupported_variant(flag, name):
    text = f"no stage boundary path for the active {name} batch"
    a, f = layer()
    fb = started(**{flag: True})
    x = rand(T, H)
    with raises_exact(BoundaryError, text):
        a.prepare(x, fb)
    with raises_exact(BoundaryError, text):
        f.exit(fb)
    # An output published in an ordinary batch cannot be consumed in the unsupported one.
    fb_ok = started()
    h = a.finish(a.prepare(x, fb_ok), fb_ok)
    fb_ok.context_parallel = flag == "context_parallel"
    fb_ok.input_scattered = flag == "input_scattered"
    fb_ok.sequence_parallel = flag == "sequence_parallel"
    with raises_exact(BoundaryError, text):
        f.prepare(h, fb_ok)
    with raises_exact(BoundaryError, text):
        a.finish(h, fb_ok)
    # Nothing was consumed on the way to the error.
    assert fb_ok.residual_stream.pending is not None and fb_ok.residual_stream.handle is h


def test_no_path_names_the_variant_that_runs_first():
    a, _ = layer()
    fb = started(context_parallel=True, sequence_parallel=True, input_scattered=True)
    with raises_exact(BoundaryError, "no stage boundary path for the active SEQUENCE_PARALLEL batch"):
        a.prepare(rand(T, H), fb)
    fb = started(context_parallel=True, input_scattered=True)
    with raises_exact(BoundaryError, "no stage boundary path for the active INPUT_SCATTERED batch"):
        a.prepare(rand(T, H), fb)


# -- a prepared branch must enter through branch_input -----------------------------------------


def test_branch_entry():
    moe = declare_ffn(sparse=True)
    first, second = make_stages(
        (declare_ffn(), make_norm(H, F64)),
        (declare_attn(), make_norm(H, F64, seed=1)),
        prepared_from=moe,
    )
    assert first.declaration.prepared_from is moe and second.declaration.prepared_from is None
    fb = started()
    with raises_exact(BoundaryError, BRANCH_ENTRY):
        first.prepare(rand(T, H), fb)
    (single,) = make_stages((declare_attn(), None), prepared_from=moe)  # its norm is never applied
    with raises_exact(BoundaryError, BRANCH_ENTRY):
        single.prepare(rand(T, H), fb)


# -- PARTIAL / LOCAL_TAIL for the wrong stage kind ---------------------------------------------


def test_partial_ffn():
    with raises_exact(DeclarationError, PARTIAL_FFN):
        declare_ffn(reduction=ProducerReduction.PARTIAL)
    with raises_exact(DeclarationError, PARTIAL_FFN):
        declare_ffn(sparse=True, reduction=ProducerReduction.PARTIAL)


def test_local_tail_attention():
    with raises_exact(DeclarationError, LOCAL_TAIL_ATTN):
        declare_attn(reduction=ProducerReduction.LOCAL_TAIL)


def test_declaration_errors_are_value_errors_and_boundary_errors():
    with pytest.raises(ValueError):
        declare_ffn(reduction=ProducerReduction.PARTIAL)
    with pytest.raises(BoundaryError):
        declare_attn(reduction=ProducerReduction.LOCAL_TAIL)


# -- snapshot requires a plain residual update -------------------------------------------------


def test_snapshot_plain():
    a, f = make_stages((declare_attn(update=HalfSkip()), make_norm(H, F64)), (declare_ffn(), make_norm(H, F64)))
    fb = started()
    h = a.finish(a.prepare(rand(T, H), fb), fb)
    with raises_exact(BoundaryError, SNAPSHOT_PLAIN):
        rb.snapshot(h, fb)
    with raises_exact(BoundaryError, SNAPSHOT_PLAIN):
        f.capture_output(h, fb)


# -- other misuse: clear errors ----------------------------------------------------------------


def test_wrong_kind_of_stage_option():
    with pytest.raises(DeclarationError, match="qkv_latent_func"):
        make_stages((declare_ffn(), make_norm(H, F64), {"qkv_latent_func": lambda x: x}))
    with pytest.raises(DeclarationError, match="qkv_latent_func"):
        make_ffn_stage(declare_ffn(), make_norm(H, F64), {"qkv_latent_func": lambda x: x})
    with pytest.raises(DeclarationError, match="bogus"):
        make_stages((declare_attn(), make_norm(H, F64), {"bogus": 1}))
    with pytest.raises(DeclarationError, match="bogus"):
        make_stages((declare_ffn(), make_norm(H, F64), {"fusions": None, "bogus": 1}))
    # The accepted options are accepted.
    make_stages((declare_attn(), make_norm(H, F64), {"qkv_latent_func": lambda x: x, "fusions": None}),
                (declare_ffn(), make_norm(H, F64), {"fusions": None}))


@pytest.mark.parametrize("source", ["previous", "prepared_from", "terminal"])
def test_declaration_with_a_source_is_refused_by_make_stages(source):
    value = True if source == "terminal" else declare_ffn()
    decl = declare_attn(**{source: value})
    with pytest.raises(DeclarationError, match="already carries"):
        make_stages((decl, make_norm(H, F64)))
    with pytest.raises(DeclarationError, match="already carries"):
        make_stages((declare_attn(), make_norm(H, F64)), (declare_ffn(**{source: value}), make_norm(H, F64)))


def test_finish_on_a_scoped_stage():
    a, f = layer()
    m, _ = make_stages((declare("mixer"), make_norm(H, F64)), (declare_ffn(), make_norm(H, F64)))
    fb = started()
    inp = f.prepare(a.finish(a.prepare(rand(T, H), fb), fb), fb)
    with pytest.raises(BoundaryError, match="exit"):
        f.finish(inp, fb)
    with pytest.raises(BoundaryError, match="exit"):
        m.finish(inp, fb)


def test_exit_on_a_partial_stage():
    a, _ = layer()
    fb = started()
    a.prepare(rand(T, H), fb)
    with pytest.raises(BoundaryError, match="PARTIAL"):
        a.exit(fb)


@pytest.mark.parametrize("case", ["dense", "sparse_no_provider", "sparse_provider_declines"])
def test_handoff_without_defer_moe_finalize_fails_in_finish(case):
    options = {"sparse_provider_declines": {"fusions": Provider(finalize=False)}}.get(case)
    item = (declare_ffn(sparse=case != "dense"), make_norm(H, F64))
    a, f = make_stages((declare_attn(), make_norm(H, F64)), item + ((options,) if options else ()))
    fb = started()
    inp = f.prepare(a.finish(a.prepare(rand(T, H), fb), fb), fb)
    with f.exit(fb) as out:
        assert not get_forward().defer_moe_finalize and not out.defer_moe_finalize
        handoff, runs = counted_handoff(inp)
    with pytest.raises(BoundaryError, match="defer_moe_finalize"):
        out.finish(handoff)
    assert runs == [] and fb.residual_stream.pending is None
    # A finalized output through a new exit is accepted.
    with f.exit(fb) as out:
        y = inp * 2
    assert out.finish(y) is y


def test_exit_finish_twice():
    a, f = layer()
    fb = started()
    inp = f.prepare(a.finish(a.prepare(rand(T, H), fb), fb), fb)
    with f.exit(fb) as out:
        y = inp * 2
    out.finish(y)
    with pytest.raises(BoundaryError, match="already finished"):
        out.finish(y)
    with pytest.raises(BoundaryError, match="already finished"):
        out.finish(inp * 3)
    assert fb.residual_stream.pending.value is y


def test_make_attn_stage_following_must_name_the_producer():
    decl = declare_attn(previous=declare_ffn())
    for following in (declare_ffn(), declare_ffn(previous=declare("mixer")), declare_ffn(previous=declare_ffn())):
        with pytest.raises(DeclarationError, match="must name this producer"):
            make_attn_stage(decl, make_norm(H, F64), following=following)
    make_attn_stage(decl, make_norm(H, F64), following=declare_ffn(previous=declare_attn()))
    with pytest.raises(DeclarationError, match="must name this producer"):
        make_ffn_stage(declare_ffn(sparse=True), make_norm(H, F64), following=declare_attn(previous=declare_ffn()))


@pytest.mark.parametrize("norm", ["not a module", 1.0, torch.ones(H)], ids=["str", "float", "tensor"])
def test_norm_must_be_a_module(norm):
    with pytest.raises(TypeError, match="nn.Module"):
        make_stages((declare_attn(), norm))
    with pytest.raises(TypeError, match="nn.Module"):
        make_attn_stage(declare_attn(), norm)
    with pytest.raises(TypeError):
        make_stages((declare_attn(), None))


def test_previous_must_describe_the_real_producer_update():
    a, f = make_stages((declare_attn(update=HalfSkip()), make_norm(H, F64)), (declare_ffn(), make_norm(H, F64)))
    (wrong,) = make_stages((declare_ffn(), make_norm(H, F64)), previous=declare_attn())
    fb = started()
    h = a.finish(a.prepare(rand(T, H), fb), fb)
    with pytest.raises(BoundaryError, match="half_skip"):
        wrong.prepare(h, fb)
    assert fb.residual_stream.pending is not None  # refused before consuming anything
    f.prepare(h, fb)


def test_previous_must_describe_the_real_producer_sum(fake_dist: FakeCollectives):
    topo = fake_topology(tp=4, attn_dp=2)  # attention TP (2) differs from TP (4)
    a, _ = make_stages((declare_attn(), make_norm(H, F64)), (declare_ffn(), make_norm(H, F64)), topology=topo)
    (wrong,) = make_stages((declare_attn(), make_norm(H, F64)), previous=declare_ffn(), topology=topo)
    fb = started()
    h = a.finish(a.prepare(rand(T, H), fb), fb)
    with pytest.raises(BoundaryError, match="ATTN_TP"):
        wrong.prepare(h, fb)
    assert fake_dist.calls == []  # refused before any collective


def test_finish_takes_a_tensor():
    a, _ = layer()
    fb = started()
    a.prepare(rand(T, H), fb)
    with pytest.raises(TypeError):
        a.finish([1.0], fb)


def test_the_stack_entry_takes_floating_point_hidden_states():
    # Token ids given where the embedding output belongs once came back as integers: a norm
    # rounded to int64 (a trial).
    a, _ = layer()
    with pytest.raises(TypeError, match="floating-point hidden states .* got torch.int64; embed the token ids"):
        a.prepare(torch.tensor([[3, 1, 2, 5, 0, 0, 0, 7]] * T), started())


def test_hf_shaped_batch_seq_hidden_rows_are_named_under_dp(fake_dist: FakeCollectives):
    # A trial: an engine that kept transformers' [1, seq, hidden] activations ran on one rank and
    # under TP, then under attention DP got "the attention output has 1 rows" for 3 tokens.
    topo = fake_topology(tp=2, attn_dp=2)
    a, f = make_stages((declare_attn(), make_norm(H, F64)), (declare_ffn(), make_norm(H, F64)), topology=topo)
    fb = ForwardBatch.for_tokens(3, dp_num_tokens=(3, 2))
    rb.start(fb)
    # Now at the stack entry, on every layout (one rank too), not at the first row move.
    with pytest.raises(BoundaryError, match=r"the stack input has 1 rows \(shape \(1, 3, 8\): boundaries move "
                                            r"token rows, \[tokens, hidden\]; flatten"):
        a.prepare(rand(1, 3, H), fb)
    assert fake_dist.calls == []  # refused before any collective


@pytest.mark.parametrize("shape, tokens, said", [
    ((1, 3, H), 1, "the stack input has shape (1, 3, 8): boundaries move token rows, [tokens, hidden]; flatten it "
                "with x.view(-1, x.shape[-1])"),
    ((7, H), 3, "the stack input has 7 rows, but ForwardBatch.num_tokens is 3: give one row per token of this "
             "rank's batch (num_tokens counts them)"),
])
def test_the_stack_input_is_checked_against_num_tokens_on_one_rank_too(shape, tokens, said):
    # A trial: on one rank 7 rows with num_tokens=5, and a [1, 7, H] tensor with num_tokens=7, ran
    # without a word, then failed under TP inside the model's attention.
    (a,) = make_stages((declare_attn(), make_norm(H, F64)))
    fb = ForwardBatch(num_tokens=tokens)
    rb.start(fb)
    with raises_exact(BoundaryError, said):
        a.prepare(rand(*shape), fb)


# -- exit scopes and get_forward() -------------------------------------------------------------


def _flags():
    f = get_forward()
    return (f.fuse_mlp_allreduce, f.mlp_reduce_scatter, f.defer_moe_finalize)


def _sparse_layer():
    return make_stages(
        (declare_attn(), make_norm(H, F64)),
        (declare_ffn(sparse=True), make_norm(H, F64), {"fusions": Provider(finalize=True)}),
        following=declare_attn(),
    )


def test_exit_publishes_flags_only_inside_the_block():
    a, f = _sparse_layer()
    fb = started()
    inp = f.prepare(a.finish(a.prepare(rand(T, H), fb), fb), fb)
    assert _flags() == (False, False, False)
    scope = f.exit(fb)
    assert _flags() == (False, False, False)
    with scope as out:
        assert _flags() == (False, False, True)
        assert out.defer_moe_finalize
        handoff, runs = counted_handoff(inp)
    assert _flags() == (False, False, False)
    out.finish(handoff)


def test_finish_of_an_exit_never_entered_is_refused():
    # A new-user trial: exit() without `with` left compute unaware of the exit's flags, and under
    # attention DP with a reduce-scatter return finish() summed the output a second time.
    a, f = _sparse_layer()
    fb = started()
    f.prepare(a.finish(a.prepare(rand(T, H), fb), fb), fb)
    out = f.exit(fb)
    with pytest.raises(BoundaryError, match="never entered: run the computation inside `with"):
        out.finish(rand(T, H))


def test_exit_restores_flags_when_compute_raises():
    a, f = _sparse_layer()
    fb = started()
    inp = f.prepare(a.finish(a.prepare(rand(T, H), fb), fb), fb)
    with pytest.raises(ZeroDivisionError):
        with f.exit(fb):
            assert get_forward().defer_moe_finalize
            1 / 0
    assert _flags() == (False, False, False)
    assert fb.residual_stream.pending is None  # nothing was published
    with f.exit(fb) as out:
        y = inp * 2
    assert out.finish(y) is y


def test_exit_flags_nest(fake_dist: FakeCollectives):
    topo = fake_topology()
    m, f = make_stages((declare("mixer"), make_norm(H, F64)), (declare_ffn(), make_norm(H, F64)), topology=topo)
    a2, f2 = _sparse_layer()
    fb_outer, fb_inner = started(), started()
    m.prepare(rand(T, H), fb_outer)
    f2.prepare(a2.finish(a2.prepare(rand(T, H), fb_inner), fb_inner), fb_inner)
    with m.exit(fb_outer) as outer:
        assert _flags() == (True, False, False) and outer.skips_reduction
        with pytest.raises(RuntimeError):
            with f2.exit(fb_inner):
                assert _flags() == (False, False, True)
                raise RuntimeError("compute failed")
        assert _flags() == (True, False, False)
    assert _flags() == (False, False, False)


def test_exit_restores_flags_set_before_it():
    a, f = layer()
    fb = started()
    f.prepare(a.finish(a.prepare(rand(T, H), fb), fb), fb)
    flags = get_forward()
    saved = _flags()
    flags.restore((True, True, True))
    try:
        with f.exit(fb):
            assert _flags() == (False, False, False)
        assert _flags() == (True, True, True)
    finally:
        flags.restore(saved)


def test_forward_batch_token_counts_take_any_integer_and_no_bool():
    # An engine's counts are often numpy integers; True used to pass as 1, np.int64(5) failed; a tensor
    # would make the batch wait for the device.
    from layer_boundary._forward import ForwardBatch

    np = pytest.importorskip("numpy")

    fb = ForwardBatch(num_tokens=np.int64(5))
    assert fb.num_tokens == 5 and type(fb.num_tokens) is int
    for bad in (True, 2.0, -1, "3", torch.tensor(3)):
        with pytest.raises(ValueError, match="must be a non-negative int"):
            ForwardBatch(num_tokens=bad)


def test_a_second_final_norm_says_the_stack_already_ended():
    from layer_boundary import ForwardBatch, Topology, declare_attn, make_stages
    from layer_boundary._errors import BoundaryError
    from layer_boundary._norms import RMSNorm
    from layer_boundary.residual import batch as rb

    (stage,) = make_stages((declare_attn(), RMSNorm(16)), topology=Topology.single(), terminal=True)
    fb = ForwardBatch.for_tokens(3)
    rb.start(fb)
    out = stage.finish(stage.prepare(torch.randn(3, 16), fb), fb)
    rb.norm(out, fb, RMSNorm(16))
    with pytest.raises(BoundaryError, match="start the layer stack before entering a stage") as e:
        rb.norm(out, fb, RMSNorm(16))
    assert any("already ended" in n for n in e.value.__notes__)


def test_a_call_order_mistake_names_the_stage_and_the_missing_call():
    # A trial: prepare() twice, an attention output passed on without finish(), and an FFN output
    # without exit() all printed one generic text; the reason is the note, now led by the stage.
    attn, ffn = make_stages((declare_attn(), make_norm(H, F64)), (declare_ffn(), make_norm(H, F64)))
    fb = ForwardBatch.for_tokens(T)
    rb.start(fb)
    x = attn.prepare(rand(T, H), fb)
    with raises_exact(BoundaryError, FOREIGN_OUTPUT) as info:
        ffn.prepare(x * 2, fb)  # no attn.finish()
    assert info.value.__notes__ == [
        "ffn #2 prepare(): the stream holds no layer output: the last call was a read (prepare). Call the "
        "stage's finish() or exit().finish() on the compute output first"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.int64])
def test_a_layer_output_in_another_dtype_than_the_residual_is_refused_at_finish(dtype):
    # A trial: an FP32 attention output in a bf16 model was accepted; the next read returned FP32
    # rows and the model's next matmul failed on the dtype, far from the mistake.
    attn, ffn = make_stages((declare_attn(), make_norm(H, torch.bfloat16)),
                            (declare_ffn(), make_norm(H, torch.bfloat16)))
    fb = ForwardBatch.for_tokens(T)
    rb.start(fb)
    x = attn.prepare(rand(T, H).to(torch.bfloat16), fb)
    name = str(dtype).replace("torch.", "")
    with pytest.raises(TypeError, match=rf"the attn #1 output is {name} but the residual is bfloat16 \(the stack "
                                        r"input's dtype\): return the layer output in the model's compute dtype, "
                                        r"e.g. out.to\(torch.bfloat16\)"):
        attn.finish(x.to(dtype), fb)


def test_a_narrower_output_into_an_fp32_residual_is_the_fp32_residual_layout():
    # bf16 compute over an FP32 residual stream (an FP32 embedding output): allowed, and the next
    # read returns the compute dtype.
    attn, ffn = make_stages((declare_attn(), make_norm(H, torch.bfloat16)),
                            (declare_ffn(), make_norm(H, torch.bfloat16)))
    fb = ForwardBatch.for_tokens(T)
    rb.start(fb)
    x = attn.prepare(rand(T, H).float(), fb)
    y = ffn.prepare(attn.finish(x.to(torch.bfloat16), fb), fb)
    assert y.dtype == torch.bfloat16 and fb.residual_stream.residual.dtype == torch.float32


def test_an_input_on_another_device_than_the_norm_is_named():
    # A trial: the error was torch's "Tensor on device cpu is not on the expected device meta!",
    # from deep in its ops, naming neither the stage nor the norm.
    (attn,) = make_stages((declare_attn(), make_norm(H, F64)))
    fb = ForwardBatch.for_tokens(T)
    rb.start(fb)
    with pytest.raises(ValueError, match=r"attn #1: hidden_states are on meta, but its norm's weight is on cpu; move "
                                         r"the model and its inputs to one device"):
        attn.prepare(torch.empty(T, H, dtype=F64, device="meta"), fb)
