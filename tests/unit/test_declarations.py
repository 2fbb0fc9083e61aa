"""Declarations and assembly: what declare_attn/declare_ffn describe, how make_stages and the
single-stage factories connect them, and which output decisions construction permits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import (
    FakeCollectives,
    HalfSkip,
    Provider,
    declare,
    fake_topology,
    install_fake_dist,
    make_norm,
    rms,
)
from layer_boundary import (
    DeclarationError,
    ForwardBatch,
    OutputTransform,
    ProducerReduction,
    ResidualStream,
    StageBoundary,
    StageDeclaration,
    StageKind,
    Topology,
    declare_attn,
    declare_ffn,
    get_forward,
    make_attn_stage,
    make_ffn_stage,
    make_stages,
)
from layer_boundary._output import OwedOutput
from layer_boundary.residual._stream import StreamState
from layer_boundary.residual import batch as rb
from layer_boundary.residual._add_norm import ADD_NORM, PLAIN_ADD

H, T = 8, 3
F64 = torch.float64


def norm(seed=0):
    return make_norm(H, F64, seed=seed)


# -- declarations ------------------------------------------------------------------------------


def test_declare_attn_defaults():
    d = declare_attn()
    assert isinstance(d, StageDeclaration)
    assert d.kind is StageKind.ATTN and d.reduction is ProducerReduction.PARTIAL
    assert d.update is PLAIN_ADD and d.read is ADD_NORM
    assert d.gathers_tp_input and not d.sparse and not d.next_sparse
    assert d.previous is None and d.prepared_from is None and not d.terminal and not d.has_source()
    assert not d.is_mixer


def test_declare_ffn_defaults():
    d = declare_ffn()
    assert d.kind is StageKind.FFN and d.reduction is ProducerReduction.SCOPED
    assert not d.sparse and not d.is_mixer
    s = declare_ffn(sparse=True, next_sparse=True)
    assert s.sparse and s.next_sparse
    assert declare_ffn(reduction=ProducerReduction.LOCAL_TAIL).reduction is ProducerReduction.LOCAL_TAIL


def test_mixer_declaration():
    d = declare_attn(reduction=ProducerReduction.SCOPED, gathers_tp_input=False)
    assert d.is_mixer and not d.gathers_tp_input


def test_declarations_are_frozen_values():
    d = declare_attn()
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.terminal = True  # type: ignore[misc]
    assert declare_ffn(sparse=True) == declare_ffn(sparse=True)
    assert declare_ffn(sparse=True).produces_like(declare_ffn(sparse=True, previous=declare_attn()))
    assert not declare_ffn(sparse=True).produces_like(declare_ffn())
    assert not declare_attn().produces_like(declare("mixer"))


def test_reduction_must_be_a_producer_reduction():
    with pytest.raises(DeclarationError, match="ProducerReduction"):
        declare_attn(reduction="PARTIAL")  # type: ignore[arg-type]


def test_sparse_is_an_ffn_fact():
    with pytest.raises(DeclarationError, match="declare_ffn"):
        StageDeclaration(kind=StageKind.ATTN, reduction=ProducerReduction.PARTIAL, sparse=True)


def test_update_must_implement_stage_update():
    class NotAnUpdate:
        name = "x"

    with pytest.raises(DeclarationError, match="StageUpdate"):
        declare_attn(update=NotAnUpdate())  # type: ignore[arg-type]


def test_read_must_bind():
    with pytest.raises(DeclarationError, match="bind"):
        declare_attn(read=object())  # type: ignore[arg-type]


def test_nonlinear_pending_update_must_outlive_the_producer():
    class Fleeting(HalfSkip):
        outlives_producer = False

    with pytest.raises(DeclarationError, match="outlive"):
        declare_attn(update=Fleeting())

    class AtProducer(Fleeting):
        at_producer = True

    assert declare_attn(update=AtProducer()).update.at_producer  # applied at exit: allowed
    assert not declare_attn(update=HalfSkip()).update.plain_add  # declares outlives_producer


# -- make_stages -------------------------------------------------------------------------------


def test_make_stages_returns_one_independent_boundary_per_item():
    attn_decl, ffn_decl, attn2_decl = declare_attn(), declare_ffn(), declare_attn()
    prev = declare_ffn()
    norms = [norm(0), norm(1), norm(2)]
    stages = make_stages((attn_decl, norms[0]), (ffn_decl, norms[1]), (attn2_decl, norms[2]),
                         previous=prev, terminal=True)
    assert len(stages) == 3 and all(isinstance(s, StageBoundary) for s in stages)
    assert len({id(s) for s in stages}) == 3
    a, f, a2 = (s.declaration for s in stages)
    assert a.previous is prev and f.previous is attn_decl and a2.previous is ffn_decl
    assert [d.terminal for d in (a, f, a2)] == [False, False, True]
    assert all(d.prepared_from is None for d in (a, f, a2))
    # The caller's declarations were not modified.
    assert not attn_decl.has_source() and not ffn_decl.has_source()
    # Each stage reads through its own norm.
    r = torch.randn(T, H, dtype=F64)
    for s, n in zip(stages, norms):
        stream, h = ResidualStream.arrive(residual=r)
        fb = ForwardBatch.for_tokens(T)
        fb.residual_stream = stream
        torch.testing.assert_close(s.prepare(h, fb), rms(r, n.weight), rtol=1e-12, atol=1e-12)


def test_make_stages_prepared_from_only_on_the_first_stage():
    src = declare_ffn(sparse=True)
    f, a = make_stages((declare_ffn(), norm()), (declare_attn(), norm(1)), prepared_from=src)
    assert f.declaration.prepared_from is src and f.declaration.previous is None
    assert a.declaration.prepared_from is None and a.declaration.previous is not None


def test_make_stages_argument_errors():
    with pytest.raises(TypeError):
        make_stages()
    with pytest.raises(TypeError):
        make_stages(declare_attn())
    with pytest.raises(TypeError):
        make_stages((declare_attn(),))
    with pytest.raises(TypeError):
        make_stages(("attn", norm()))
    with pytest.raises(TypeError, match="options"):
        make_stages((declare_attn(), norm(), ["fusions"]))
    with pytest.raises(TypeError, match="previous"):
        make_stages((declare_attn(), norm()), previous="ffn")
    with pytest.raises(TypeError, match="following"):
        make_stages((declare_attn(), norm()), following=object())
    with pytest.raises(DeclarationError, match="not both"):
        make_stages((declare_attn(), norm()), previous=declare_ffn(), prepared_from=declare_ffn())
    with pytest.raises(DeclarationError, match="terminal"):
        make_stages((declare_attn(), norm()), terminal=True, following=declare_ffn())
    with pytest.raises(TypeError, match="callable"):
        make_stages((declare_attn(), norm(), {"qkv_latent_func": 3}))
    with pytest.raises(TypeError, match="Topology"):
        make_stages((declare_attn(), norm()), topology="tp=2")


def test_options_reach_the_stage():
    provider = Provider(finalize=True)
    a, f = make_stages((declare_attn(), norm(), {"qkv_latent_func": lambda x: x, "fusions": provider}),
                       (declare_ffn(sparse=True), norm(1), {"fusions": provider}))
    fb = ForwardBatch.for_tokens(T)
    rb.start(fb)
    f.prepare(a.finish(a.prepare(torch.ones(T, H, dtype=F64), fb), fb), fb)
    with f.exit(fb) as out:
        assert out.defer_moe_finalize  # the FFN's provider was consulted
    assert "finalize" in provider.asked


# -- single-stage factories --------------------------------------------------------------------


def test_make_attn_and_ffn_stage():
    a = make_attn_stage(declare_attn(previous=declare_ffn()), norm(), following=declare_ffn(previous=declare_attn()))
    f = make_ffn_stage(declare_ffn(previous=declare_attn(), terminal=True), norm(1))
    assert isinstance(a, StageBoundary) and isinstance(f, StageBoundary)
    assert a.declaration.previous == declare_ffn() and f.declaration.terminal


def test_single_stage_factories_check_the_kind():
    with pytest.raises(DeclarationError, match="make_attn_stage"):
        make_attn_stage(declare_ffn(), norm())
    with pytest.raises(DeclarationError, match="make_ffn_stage"):
        make_ffn_stage(declare_attn(), norm())


def test_single_stage_terminal_has_no_following():
    with pytest.raises(DeclarationError, match="terminal"):
        make_ffn_stage(declare_ffn(terminal=True), norm(), following=declare_attn(previous=declare_ffn()))


# -- construction decides which output decisions an exit may take ------------------------------


def _exit_flags(stage, fb):
    with stage.exit(fb) as out:
        f = get_forward()
        seen = (f.fuse_mlp_allreduce, f.defer_moe_finalize)
    return seen, out


def _ready(*stages):
    """Prepare the last stage on a fresh batch, after publishing a producer for it if needed."""
    fb = ForwardBatch.for_tokens(T)
    rb.start(fb)
    return fb


def _decisions(topology, stage_kind, *, following, provider=None, terminal=False, reduction=None,
               sparse=False, previous=None):
    kw = {} if reduction is None else {"reduction": reduction}
    if stage_kind == "ffn":
        decl = declare_ffn(sparse=sparse, **kw)
    else:
        decl = declare("mixer")
    item = (decl, norm()) + (({"fusions": provider},) if provider else ())
    (stage,) = make_stages(item, following=following, terminal=terminal, topology=topology)
    fb = ForwardBatch.for_tokens(T)
    rb.start(fb)
    stage.prepare(torch.zeros(T, H, dtype=F64), fb)
    seen, out = _exit_flags(stage, fb)
    return seen


def test_single_rank_never_defers_a_sum():
    topo = Topology.single()
    provider = Provider(all_reduce=True, finalize=True)
    assert _decisions(topo, "mixer", following=declare_ffn()) == (False, False)
    assert _decisions(topo, "ffn", following=declare_attn(), provider=provider) == (False, False)
    # A finalize handoff is a producer fact, not a sum: it may be deferred on one rank.
    assert _decisions(topo, "ffn", following=declare_attn(), provider=provider, sparse=True) == (False, True)


def test_sum_deferral_permissions(fake_dist):
    topo = fake_topology()
    yes, no = Provider(all_reduce=True), Provider(all_reduce=False)
    # A mixer always leaves its sum to a following FFN, with or without a provider.
    assert _decisions(topo, "mixer", following=declare_ffn()) == (True, False)
    # Before another mixer: only when the provider accepts the batch.
    assert _decisions(topo, "mixer", following=declare("mixer")) == (False, False)
    assert _decisions(topo, "mixer", following=declare("mixer"), provider=yes) == (True, False)
    # Before a PARTIAL attention the mixer reduces itself.
    assert _decisions(topo, "mixer", following=declare_attn(), provider=yes) == (False, False)
    # A dense FFN defers its all-reduce only when the provider accepts the batch.
    assert _decisions(topo, "ffn", following=declare_attn(), provider=yes) == (True, False)
    assert _decisions(topo, "ffn", following=declare_attn(), provider=no) == (False, False)
    assert _decisions(topo, "ffn", following=declare_attn()) == (False, False)
    # Never at the end of the stack, and never for LOCAL_TAIL.
    assert _decisions(topo, "ffn", following=None, provider=yes, terminal=True) == (False, False)
    assert _decisions(topo, "ffn", following=declare_attn(), provider=yes,
                      reduction=ProducerReduction.LOCAL_TAIL) == (False, False)
    # A deferred finalize carries the sum that follows it.
    fin = Provider(finalize=True)
    assert _decisions(topo, "ffn", following=declare_attn(), provider=fin, sparse=True) == (True, True)


def test_mixer_deferral_under_attention_dp(fake_dist):
    topo = fake_topology(tp=4, attn_dp=2)
    yes = Provider(all_reduce=True)
    # Before an FFN the mixer leaves its sum, including under attention DP ...
    assert _decisions(topo, "mixer", following=declare_ffn()) == (True, False)
    # ... but never to another mixer under attention DP.
    assert _decisions(topo, "mixer", following=declare("mixer"), provider=yes) == (False, False)


def test_a_provider_is_asked_on_every_ffn_exit():
    provider = Provider(finalize=False)
    a, f = make_stages((declare_attn(), norm()), (declare_ffn(sparse=True), norm(1), {"fusions": provider}))
    for _ in range(3):
        fb = ForwardBatch.for_tokens(T)
        rb.start(fb)
        f.prepare(a.finish(a.prepare(torch.ones(T, H, dtype=F64), fb), fb), fb)
        with f.exit(fb) as out:
            pass
        out.finish(torch.zeros(T, H, dtype=F64))
    assert provider.asked.count("finalize") == 3


def test_deferred_sum_is_owed_and_completed_by_the_declared_consumer(fake_dist: FakeCollectives):
    topo = fake_topology()
    f, a = make_stages((declare_ffn(), norm(), {"fusions": Provider(all_reduce=True)}),
                       (declare_attn(), norm(1)), topology=topo)
    fb = ForwardBatch.for_tokens(T)
    rb.start(fb)
    x = torch.ones(T, H, dtype=F64)
    inp = f.prepare(x, fb)
    with f.exit(fb) as out:
        assert out.fuse_mlp_allreduce
        y = inp.clone()
    h = out.finish(y)
    assert isinstance(h, OwedOutput)
    a.prepare(h, fb)
    assert fake_dist.calls == [T]
    torch.testing.assert_close(fb.residual_stream.residual, x + 2 * inp, rtol=0, atol=0)


# -- output transforms and updates applied at the producer -------------------------------------


def test_output_transform_runs_once_before_the_update():
    calls = []

    def triple(c):
        calls.append(1)
        return c * 3

    n_f, n_a = norm(1), norm(2)
    f, a = make_stages((declare_ffn(output_transform=OutputTransform(triple)), n_f), (declare_attn(), n_a))
    fb = ForwardBatch.for_tokens(T)
    rb.start(fb)
    x = torch.randn(T, H, dtype=F64)
    inp = f.prepare(x, fb)
    with f.exit(fb) as out:
        y = inp * 2
    h = out.finish(y)
    assert calls == []  # the transform runs on completion, not at publication
    got = a.prepare(h, fb)
    assert calls == [1]
    torch.testing.assert_close(fb.residual_stream.residual, x + 3 * y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, rms(x + 3 * y, n_a.weight), rtol=1e-12, atol=1e-12)


def test_postprocess_applies_the_transform_and_owes_nothing(fake_dist):
    topo = fake_topology()
    f, a = make_stages((declare_ffn(output_transform=OutputTransform(lambda c: c * 3)), norm(1)),
                       (declare_attn(), norm(2)), topology=topo)
    fb = ForwardBatch.for_tokens(T)
    rb.start(fb)
    x = torch.randn(T, H, dtype=F64)
    inp = f.prepare(x, fb)
    y = inp * 2  # computed without an exit scope: fully reduced
    h = f.postprocess(y, fb)
    assert isinstance(h, torch.Tensor)
    torch.testing.assert_close(h, 3 * y, rtol=0, atol=0)
    a.prepare(h, fb)
    assert fake_dist.calls == []  # nothing owed
    torch.testing.assert_close(fb.residual_stream.residual, x + 3 * y, rtol=1e-12, atol=1e-12)


def test_update_at_producer_is_applied_at_the_exit():
    class ScaledAtExit(HalfSkip):
        name = "half_skip_at_exit"
        at_producer = True

    a, f = make_stages((declare_attn(update=ScaledAtExit()), norm()),
                       (declare_ffn(), norm(1)))
    fb = ForwardBatch.for_tokens(T)
    rb.start(fb)
    x = torch.randn(T, H, dtype=F64)
    inp = a.prepare(x, fb)
    h = a.finish(inp * 2, fb)
    assert fb.residual_stream.state is StreamState.WRITTEN
    torch.testing.assert_close(h, x / 2 + inp * 2, rtol=1e-12, atol=1e-12)
    f.prepare(h, fb)
    torch.testing.assert_close(fb.residual_stream.residual, x / 2 + inp * 2, rtol=1e-12, atol=1e-12)


def test_terminal_is_a_bool():
    # Found by a new-user trial: terminal="yes" was taken as true.
    from layer_boundary import DeclarationError, declare_attn, make_stages
    from layer_boundary._norms import RMSNorm

    with pytest.raises(DeclarationError, match="got str 'yes'"):
        make_stages((declare_attn(), RMSNorm(8)), terminal="yes")


def test_make_stages_errors_describe_a_wrong_argument_briefly():
    # A module or a tensor passed by mistake printed its whole tree or contents in the error.
    import torch

    from layer_boundary import DeclarationError, declare_attn, make_stages
    from layer_boundary._norms import RMSNorm

    big = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(50)])
    with pytest.raises(TypeError, match="make_stages item 0 must be") as err:
        make_stages(big)
    assert len(str(err.value)) < 250 and "Sequential" in str(err.value)
    with pytest.raises(TypeError, match=r"got a tuple of 1 \(StageDeclaration\)"):
        make_stages((declare_attn(),))
    with pytest.raises(DeclarationError, match="got Tensor") as err:
        make_stages((declare_attn(), RMSNorm(8)), terminal=torch.ones(10000))
    assert len(str(err.value)) < 250


def test_an_option_typo_gets_the_near_name():
    from layer_boundary import DeclarationError, declare_attn, make_stages
    from layer_boundary._norms import RMSNorm

    with pytest.raises(DeclarationError, match=r"an attn stage accepts only \['fusions', 'qkv_latent_func'\] "
                                               r"\('fusion': did you mean 'fusions'\?\)"):
        make_stages((declare_attn(), RMSNorm(8), {"fusion": None}))


def test_an_update_that_claims_plain_add_but_is_not_is_refused_at_declaration():
    # A trial: r' = 0.5 r + y declared plain_add=True ran without a word; under TP its sum was
    # joined to the reduction and the logits were off by 28 (found only by --check).
    import pytest as _pytest

    from layer_boundary import DeclarationError, declare_attn

    class Halves:
        name, plain_add, at_producer, outlives_producer = "halves", True, False, True

        def apply(self, residual, contribution):
            return contribution if residual is None else 0.5 * residual + contribution

    with _pytest.raises(DeclarationError, match=r"update 'halves' declares plain_add=True but apply\(r, c\) is not "
                                                r"r \+ c.*declare plain_add=False"):
        declare_attn(update=Halves())

    class Honest(Halves):
        name = "honest"

        def apply(self, residual, contribution):
            return contribution if residual is None else residual + contribution

    declare_attn(update=Honest())
