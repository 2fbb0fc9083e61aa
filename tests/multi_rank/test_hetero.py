"""The heterogeneous reference decoder (mixer ``M``, attention ``*``, FFN ``-`` layers) and the
single-stage mixer semantics it exercises.

One process: the model against a direct float64 torch implementation of the same network (plain
loops, no boundaries), the pattern parser, the neighbour-consistency check at construction, and
each mixer exit decision on a fake multi-rank topology. On gloo with 2 and 4 ranks (one spawn per
world size): every layout, policy and deferral path against the single-rank model, with the
collectives each path must run exactly once.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F

from helpers import Provider, fake_topology, install_fake_dist, make_norm, rms
from layer_boundary import (
    BoundaryContext,
    DeclarationError,
    ForwardBatch,
    declare_attn,
    declare_ffn,
    get_forward,
    make_attn_stage,
    make_ffn_stage,
    make_stages,
    _ops as ops,
)
from layer_boundary._exit import MixerExit
from layer_boundary._output import OwedOutput
from layer_boundary._cli.main import main
from layer_boundary_app.launch import spawn
from layer_boundary_app.models.hetero import (
    HeteroConfig,
    HeteroForCausalLM,
    LayerKind,
    causal_conv,
    hetero_state_dict,
    init_hetero_weights,
    layer_declaration,
    parse_pattern,
    sequence_offsets,
)
from layer_boundary_app.models.runner import RunSpec
from layer_boundary.residual import batch as rb

import hetero_cases

F64 = torch.float64
H, T = 8, 3
MIXER, ATTN, FFN = (layer_declaration(k) for k in LayerKind)


# -- a direct implementation of the same network: per sequence, plain loops, no boundaries ----


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox rotation of ``x [T, heads, d]``; the angles in FP32 as the model's table has them."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = positions.float()[:, None] * inv[None, :]
    cos = torch.cat((ang, ang), -1).cos().to(x.dtype)[:, None]
    sin = torch.cat((ang, ang), -1).sin().to(x.dtype)[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


def _attention(sd: dict, p: str, c: HeteroConfig, x: torch.Tensor) -> torch.Tensor:
    n, d = x.shape[0], c.head_dim
    q = (x @ sd[p + "q_proj.weight"].T).view(n, -1, d)
    k = (x @ sd[p + "k_proj.weight"].T).view(n, -1, d)
    v = (x @ sd[p + "v_proj.weight"].T).view(n, -1, d)
    q = rms(q, sd[p + "q_norm.weight"], c.rms_norm_eps)
    k = rms(k, sd[p + "k_norm.weight"], c.rms_norm_eps)
    pos = torch.arange(n)
    q, k = _rope(q, pos, c.rope_theta), _rope(k, pos, c.rope_theta)
    group = c.num_attention_heads // c.num_key_value_heads
    out = torch.zeros(n, c.num_attention_heads, d, dtype=x.dtype)
    for h in range(c.num_attention_heads):
        for t in range(n):
            scores = torch.stack([q[t, h] @ k[s, h // group] for s in range(t + 1)]) * d**-0.5
            w = torch.softmax(scores, 0)
            out[t, h] = sum(w[s] * v[s, h // group] for s in range(t + 1))
    return out.reshape(n, -1) @ sd[p + "o_proj.weight"].T


def _mixer(sd: dict, p: str, c: HeteroConfig, x: torch.Tensor) -> torch.Tensor:
    u = x @ sd[p + "conv_proj.weight"].T
    g = x @ sd[p + "gate_proj.weight"].T
    w, b, k = sd[p + "conv.weight"], sd[p + "conv.bias"], c.conv_kernel
    v = torch.zeros_like(u)
    for t in range(x.shape[0]):
        v[t] = b.clone()
        for j in range(k):
            src = t - (k - 1) + j
            if src >= 0:
                v[t] += w[:, j] * u[src]
    return (v * F.silu(g)) @ sd[p + "out_proj.weight"].T


def _mlp(sd: dict, p: str, x: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ sd[p + "gate_proj.weight"].T) * (x @ sd[p + "up_proj.weight"].T)) @ sd[p + "down_proj.weight"].T


def direct_logits(c: HeteroConfig, pattern: str, sequences: list[list[int]], seed: int = 0) -> torch.Tensor:
    sd = {k: v.double() for k, v in hetero_state_dict(c, pattern, seed=seed).items()}
    out = []
    for seq in sequences:
        r = sd["model.embed_tokens.weight"][torch.tensor(seq)]
        for i, ch in enumerate(pattern):
            p = f"model.layers.{i}."
            x = rms(r, sd[p + "norm.weight"], c.rms_norm_eps)
            if ch == "M":
                y = _mixer(sd, p + "mixer.", c, x)
            elif ch == "*":
                y = _attention(sd, p + "self_attn.", c, x)
            else:
                y = _mlp(sd, p + "mlp.", x)
            r = r + y
        out.append(rms(r, sd["model.norm.weight"], c.rms_norm_eps) @ sd["lm_head.weight"].T)
    return torch.cat(out)


def _packed(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
    ids = torch.tensor([t for s in sequences for t in s])
    pos = torch.cat([torch.arange(len(s)) for s in sequences])
    return ids, pos, ForwardBatch(num_tokens=len(ids), positions=pos, seq_lens=tuple(len(s) for s in sequences))


@pytest.mark.parametrize("pattern", ["M-M*-", "MM*-", "*-M-", "M", "-*", "M*M-*"])
def test_single_rank_model_is_the_direct_network(pattern):
    seqs = [[1, 5, 9, 2], [4], [7, 8, 200, 3, 3]]
    c = HeteroConfig()
    model = HeteroForCausalLM(c, pattern, dtype=F64)
    init_hetero_weights(model, seed=0)
    ids, pos, fb = _packed(seqs)
    with torch.inference_mode():
        logits = model.eval()(ids, pos, fb)
        # The model returns FP32 logits; compare its FP64 values before that rounding.
        fb = ForwardBatch(num_tokens=len(ids), positions=pos, seq_lens=fb.seq_lens)
        got = model.lm_head(model.model(ids, pos, fb))
    assert logits.dtype == torch.float32 and logits.shape == (len(ids), c.vocab_size)
    torch.testing.assert_close(got, direct_logits(c, pattern, seqs), rtol=0, atol=1e-12)


def test_convolution_stays_inside_each_packed_sequence():
    g = torch.Generator().manual_seed(3)
    u = torch.randn(7, 4, generator=g, dtype=F64)
    w = torch.randn(4, 3, generator=g, dtype=F64)
    b = torch.randn(4, generator=g, dtype=F64)
    lens = (2, 1, 4)
    packed = causal_conv(u, w, b, sequence_offsets(7, lens, "cpu"))
    alone = torch.cat([causal_conv(part, w, b, sequence_offsets(n, None, "cpu"))
                       for part, n in zip(u.split(lens), lens)])
    assert torch.equal(packed, alone)
    assert sequence_offsets(7, lens, "cpu").tolist() == [0, 1, 0, 0, 1, 2, 3]
    assert causal_conv(u[:0], w, b, sequence_offsets(0, None, "cpu")).shape == (0, 4)


# -- the pattern ------------------------------------------------------------------------------


def test_pattern_parser():
    assert parse_pattern("M-M*-") == (LayerKind.MIXER, LayerKind.FFN, LayerKind.MIXER, LayerKind.ATTENTION,
                                      LayerKind.FFN)
    with pytest.raises(ValueError, match=r"layer pattern is empty; give one character per layer: M"):
        parse_pattern("")
    with pytest.raises(ValueError, match=r"'M-x\*' has 'x' at position 2; each character is one layer"):
        parse_pattern("M-x*")
    with pytest.raises(ValueError, match=r"has ' ' at position 1"):
        parse_pattern("M -")
    with pytest.raises(TypeError, match="pattern must be a string"):
        parse_pattern(["M"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="has 'A' at position 0"):
        HeteroForCausalLM(HeteroConfig(), "A")
    with pytest.raises(ValueError, match="is empty"):
        RunSpec(sequences=((1,),), pattern="")
    with pytest.raises(ValueError, match="takes no --model"):
        RunSpec(sequences=((1,),), pattern="M", model="/some/folder")


def test_layers_declare_their_real_neighbours():
    model = HeteroForCausalLM(HeteroConfig(), "M-MM*-")
    plans = [b.plan for b in model.boundaries()]
    assert [p.name.split(" #")[0] for p in plans] == ["mixer", "ffn", "mixer", "mixer", "attn", "ffn"]
    for i, plan in enumerate(plans):
        d = plan.declaration
        assert (d.previous is None) == (i == 0)
        if i:
            assert d.previous.produces_like(plans[i - 1].declaration)
        assert d.terminal == (i == len(plans) - 1)
        if i + 1 < len(plans):
            assert plan.following.produces_like(plans[i + 1].declaration)
    assert plans[0].declaration.is_mixer and not plans[0].declaration.gathers_tp_input


# -- neighbour consistency ----------------------------------------------------------------------


def _norm():
    return make_norm(H, F64)


def test_following_that_names_the_wrong_consumer_is_a_construction_error():
    ctx = BoundaryContext()
    make_stages((MIXER, _norm()), following=FFN, context=ctx)
    with pytest.raises(DeclarationError) as info:
        make_stages((MIXER, _norm()), previous=MIXER, terminal=True, context=ctx)
    text = str(info.value)
    assert "mixer #1 (mixer SCOPED) was built with following=(ffn SCOPED)" in text
    assert "the next stage built is (mixer SCOPED)" in text
    assert "Pass following= the declaration the next stage is built with" in text


def test_previous_that_names_the_wrong_producer_is_a_construction_error():
    ctx = BoundaryContext()
    make_stages((MIXER, _norm()), following=FFN, context=ctx)
    with pytest.raises(DeclarationError) as info:
        make_stages((FFN, _norm()), previous=ATTN, terminal=True, context=ctx)
    text = str(info.value)
    assert "declares previous=(attn PARTIAL), but its real producer, mixer #1, is declared (mixer SCOPED)" in text
    assert "Pass previous= the declaration that producer is built with" in text


def test_single_stage_factories_are_checked_too():
    ctx = BoundaryContext()
    make_ffn_stage(declare_ffn(), _norm(), following=declare_attn(previous=declare_ffn()), context=ctx)
    mixer = declare_attn(reduction=MIXER.reduction, gathers_tp_input=False, previous=declare_ffn())
    with pytest.raises(DeclarationError, match=r"was built with following=\(attn PARTIAL\)"):
        make_attn_stage(mixer, _norm(), context=ctx)


def test_consistent_unknown_and_restarted_chains_build():
    ctx = BoundaryContext()
    # following=None on a non-terminal stage: the consumer is unknown, that side is not checked.
    make_stages((ATTN, _norm()), (FFN, _norm()), context=ctx)
    make_stages((MIXER, _norm()), previous=FFN, following=MIXER, context=ctx)
    make_stages((MIXER, _norm()), previous=MIXER, following=ATTN, context=ctx)
    # A branch (prepared_from) and what comes after it are not checked against the main chain.
    make_stages((FFN, _norm()), (ATTN, _norm()), prepared_from=MIXER, context=ctx)
    make_stages((FFN, _norm()), previous=ATTN, context=ctx)
    # A terminal stage ends the chain; a stack entry (previous=None) starts one.
    make_stages((ATTN, _norm()), previous=FFN, terminal=True, context=ctx)
    make_stages((MIXER, _norm()), previous=FFN, following=FFN, context=ctx)  # e.g. a pipeline receiver
    make_stages((MIXER, _norm()), following=FFN, context=ctx)  # a new stack, not checked


def test_qwen3_and_every_pattern_build_on_one_context():
    from layer_boundary_app.models import Qwen3ForCausalLM, small_random_config

    Qwen3ForCausalLM(small_random_config(), context=BoundaryContext())
    for pattern in ("M-M*-", "MM*-", "*-M-", "M", "-*", "--**MM"):
        HeteroForCausalLM(HeteroConfig(), pattern, context=BoundaryContext())


# -- mixer exit decisions on a fake multi-rank topology ------------------------------------------


CONSUMERS = {"ffn": FFN, "mixer": MIXER, "attn": ATTN}


def _mixer_then(consumer: Optional[str], topo: Any, provider: Any, *, terminal: bool = False):
    """A mixer and (unless terminal) its consumer, built on one context as a model builds them."""
    ctx = BoundaryContext(topo)
    opts = ({"fusions": provider},) if provider is not None else ()
    following = CONSUMERS[consumer] if consumer else None
    (m,) = make_stages((MIXER, make_norm(H, F64), *opts), following=None if terminal else following,
                       terminal=terminal, context=ctx)
    nxt = None
    if consumer:
        (nxt,) = make_stages((CONSUMERS[consumer], make_norm(H, F64, seed=1), *opts), previous=MIXER,
                             terminal=True, context=ctx)
    return m, nxt


@pytest.mark.parametrize("consumer, answer, skips", [
    ("ffn", None, True),  # before an FFN: always, without asking
    ("ffn", False, True),
    ("mixer", None, False),  # before a mixer: only when a provider accepts the batch
    ("mixer", False, False),
    ("mixer", True, True),
    ("attn", True, False),  # before a PARTIAL attention the mixer reduces itself
    (None, True, False),  # at the end of the stack
])
def test_mixer_skips_reduction_per_neighbour_and_sums_once(monkeypatch, consumer, answer, skips):
    fake = install_fake_dist(monkeypatch)
    provider = Provider(all_reduce=answer) if answer is not None else None
    m, nxt = _mixer_then(consumer, fake_topology(tp=2), provider, terminal=consumer is None)
    fb = ForwardBatch.for_tokens(T)
    rb.start(fb)
    x = torch.randn(T, H, dtype=F64)
    inp = m.prepare(x, fb)
    with m.exit(fb) as out:
        assert isinstance(out, MixerExit)
        assert out.skips_reduction == get_forward().fuse_mlp_allreduce == out.fuse_mlp_allreduce == skips
        y = inp * 3
        if not out.skips_reduction:  # what RowParallelLinear(reduce_results=True) does
            ops.all_reduce(y, m.plan.topology.attn_tp)
    assert not get_forward().fuse_mlp_allreduce  # the scope restored the flags
    h = out.finish(y if skips else y.clone())
    assert isinstance(h, OwedOutput) == skips
    want = x + 2 * (inp * 3)  # the fake all-reduce doubles: summed exactly once
    if nxt is None:
        final = make_norm(H, F64, seed=2)
        torch.testing.assert_close(rb.norm(h, fb, final), rms(want, final.weight), rtol=1e-12, atol=1e-12)
    else:
        nxt.prepare(h, fb)
        torch.testing.assert_close(fb.residual_stream.residual, want, rtol=1e-12, atol=1e-12)
    assert len(fake.calls) == 1
    if provider is not None:
        assert provider.asked == (["all_reduce"] if consumer == "mixer" else [])


def test_mixer_never_defers_to_a_mixer_under_attention_dp(monkeypatch):
    install_fake_dist(monkeypatch)
    topo = fake_topology(tp=4, attn_dp=2)
    for consumer, skips in (("ffn", True), ("mixer", False), ("attn", False)):
        provider = Provider(all_reduce=True)
        m, _ = _mixer_then(consumer, topo, provider)
        fb = ForwardBatch.for_tokens(T, dp_num_tokens=(T, T))
        rb.start(fb)
        m.prepare(torch.ones(T, H, dtype=F64), fb)
        with m.exit(fb) as out:
            assert out.skips_reduction == get_forward().fuse_mlp_allreduce == skips, consumer
        assert provider.asked == []  # nothing to ask: the answer is fixed at construction


def test_mixer_on_one_attention_tp_rank_has_nothing_to_skip(monkeypatch):
    install_fake_dist(monkeypatch)
    m, _ = _mixer_then("ffn", fake_topology(tp=2, attn_dp=2), None)
    fb = ForwardBatch.for_tokens(T, dp_num_tokens=(T, T))
    rb.start(fb)
    m.prepare(torch.ones(T, H, dtype=F64), fb)
    with m.exit(fb) as out:
        assert not out.skips_reduction and not get_forward().fuse_mlp_allreduce


# -- gloo: every layout, against the single-rank model ---------------------------------------------


def _p(defer: bool, accept: bool) -> dict:
    return {"defer": defer, "accept": accept}


CASES_2 = [
    dict(pattern="M-M*-", dp=1, policy="ar", sequences=[[1, 5, 9], [4]]),
    dict(pattern="MM*-", dp=1, policy="ar", sequences=[[1, 5, 9, 2], [4, 8]], provider=_p(True, True)),
    dict(pattern="MM*-", dp=1, policy="ar", sequences=[[3], [7, 7, 1]], provider=_p(True, False)),
    dict(pattern="MMM", dp=1, policy="ar", sequences=[[2, 4, 6]], provider=_p(False, True)),
    dict(pattern="-*", dp=1, policy="rs", sequences=[[10, 20, 30]]),
    dict(pattern="*-M-", dp=2, policy="rs", sequences=[[1, 5, 9, 2], [4, 8]]),
    dict(pattern="M", dp=2, policy="rsv", sequences=[[3, 3, 7]]),  # DP group 1 gets nothing
    dict(pattern="-*", dp=2, policy="rsv", sequences=[[1, 2], [3, 4, 5]]),
    dict(pattern="M-M*-", dp=2, policy="rs+rsv", sequences=[[5], [6, 7, 8]], provider=_p(True, True)),
    dict(pattern="MM*-", dp=2, policy="ar", sequences=[[2, 3], [4]], provider=_p(True, True)),
]
CASES_4 = [
    dict(pattern="M-M*-", dp=1, policy="ar", sequences=[[1, 5, 9, 11, 30]]),
    dict(pattern="MM*-", dp=1, policy="rs", sequences=[[1, 5], [9, 9, 9]], provider=_p(True, True)),
    dict(pattern="MM*-", dp=1, policy="ar", sequences=[[4, 4]], provider=_p(True, False)),
    dict(pattern="M-M*-", dp=2, policy="rs", sequences=[[1, 5, 9], [4, 8, 16, 2]]),
    dict(pattern="*-M-", dp=4, policy="rsv", sequences=[[1, 5], [7], [9, 9, 9]]),  # DP group 3 empty
    dict(pattern="MM-", dp=2, policy="ar", sequences=[[6, 2, 7, 1]], provider=_p(True, True)),
    dict(pattern="-*", dp=4, policy="rs", sequences=[[1], [2], [3], [4]]),
    dict(pattern="M", dp=4, policy="ar", sequences=[[1, 2], [3]]),
]
# TP=8 (eight heads: every layout shards them), TP=4 x DP=2, TP=2 x DP=4.
HEADS_8 = dict(num_attention_heads=8, num_key_value_heads=2)
CASES_8 = [
    dict(pattern="M-M*-", dp=1, policy="ar", sequences=[[1, 5, 9, 11, 30]], config=HEADS_8),
    dict(pattern="MM*-", dp=1, policy="rs", sequences=[[1, 5], [9, 9, 9]], provider=_p(True, True), config=HEADS_8),
    dict(pattern="MM*-", dp=1, policy="ar", sequences=[[4, 4]], provider=_p(True, False), config=HEADS_8),
    dict(pattern="M-M*-", dp=2, policy="rs", sequences=[[1, 5, 9], [4, 8, 16, 2]]),
    dict(pattern="MM*-", dp=2, policy="ar", sequences=[[6, 2, 7, 1]], provider=_p(True, True)),
    dict(pattern="*-M-", dp=4, policy="rsv", sequences=[[1, 5], [7], [9, 9, 9]]),  # DP group 3 empty
    dict(pattern="-*", dp=4, policy="rs", sequences=[[1], [2], [3], [4]]),
    dict(pattern="M-M*-", dp=2, policy="rs+rsv", sequences=[[5], [6, 7, 8]], provider=_p(True, True)),
]


def expected(world: int, case: dict, ret: str) -> dict[str, Any]:
    """What each path must run: every owed sum exactly once, where its path completes it."""
    kinds, dp = case["pattern"], case["dp"]
    attn_tp = world // dp
    prov = case.get("provider") or {}
    defer = prov.get("defer", False)
    n: Counter[str] = Counter()
    flags, asked, calls = [], 0, 0
    if attn_tp > 1:
        n["all_reduce"] += 1  # vocab-parallel embedding
    for i, k in enumerate(kinds):
        prev = kinds[i - 1] if i else None
        nxt = kinds[i + 1] if i + 1 < len(kinds) else None
        if k == "-":
            if dp == 1:
                n["all_reduce"] += 1  # in compute, or at the next input when the provider defers
                asked += nxt is not None and bool(prov)
                continue
            # FFN input under attention DP: one all-reduce over TP that completes the producer's
            # attention sum, adds the residual and gathers every group's rows; at stack entry a
            # gather of the normalized input.
            n["all_gather" if prev is None else "all_reduce"] += 1
            if ret == "ar":
                n["all_reduce"] += 1
            elif ret == "rs":
                n["reduce_scatter"] += 1
                if attn_tp > 1:
                    n["all_gather"] += 1
            else:
                n["all_to_all"] += 1
            continue
        # M or *: the attention-TP sum, in compute or at the next input; before an FFN under
        # attention DP it rides on the FFN's joined all-reduce.
        if attn_tp > 1 and not (dp > 1 and nxt == "-"):
            n["all_reduce"] += 1
        if k == "M":
            flags.append(attn_tp > 1 and (nxt == "-" or (nxt == "M" and dp == 1 and defer)))
            asked += attn_tp > 1 and nxt == "M" and dp == 1 and bool(prov)
        # A consumer candidate is offered an owed attention-TP sum: always after an attention,
        # after a mixer only when that mixer deferred (to a mixer, without attention DP).
        if attn_tp > 1 and (prev == "*" or (prev == k == "M" and dp == 1 and defer)):
            calls += bool(prov)
    if attn_tp > 1:
        n["all_gather"] += 1  # LM head
    stats = None
    if prov:
        stats = {"asked": asked, "candidate_calls": calls, "fused": calls if prov["accept"] else 0}
    return {"collectives": dict(n), "mixer_flags": flags, "provider": stats}


@pytest.fixture(scope="module", params=[2, 4, 8], ids=["2ranks", "4ranks", "8ranks"])
def matrix(request):
    world = request.param
    return world, spawn(hetero_cases.hetero_matrix, world, args=({2: CASES_2, 4: CASES_4, 8: CASES_8}[world],),
                        timeout_s=300)


@pytest.mark.slow
def test_every_layout_matches_the_single_rank_model(matrix):
    world, per_rank = matrix
    for rank, results in enumerate(per_rank):
        for r in results:
            case = r["case"]
            groups = [list(range(d, len(case["sequences"]), case["dp"])) for d in range(case["dp"])]
            mine = groups[rank // (world // case["dp"])]
            assert r["rows"] == sum(len(case["sequences"][i]) for i in mine), (rank, case)
            assert r["max_diff"] <= 1e-10, (rank, r)


@pytest.mark.slow
def test_every_owed_sum_runs_exactly_once(matrix):
    world, per_rank = matrix
    for rank, results in enumerate(per_rank):
        for r in results:
            want = expected(world, r["case"], r["return"])
            got = {"collectives": r["collectives"], "mixer_flags": r["mixer_flags"], "provider": r["provider"]}
            assert got == want, (rank, r["case"], r["return"])


@pytest.mark.slow
def test_the_deferral_paths_were_exercised(matrix):
    world, per_rank = matrix
    seen = Counter()
    for r in per_rank[0]:
        p = r["provider"]
        if p and p["fused"]:
            seen["fused"] += 1
        if p and p["candidate_calls"] > p["fused"]:
            seen["declined"] += 1
        if any(r["mixer_flags"]):
            seen["skipped"] += 1
        if r["case"]["dp"] > 1 and r["case"].get("provider"):
            seen["dp refusal"] += 1
    assert set(seen) == {"fused", "declined", "skipped", "dp refusal"}, seen


# -- the command line -----------------------------------------------------------------------------


@pytest.mark.slow
def test_run_pattern_checks_against_one_rank(capsys):
    rc = main(["run", "--pattern", "M-M*-", "--tp", "2", "--dp", "2", "--input-ids", "5,6,7;8;9,10", "--check"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "heterogeneous decoder 'M-M*-'" in text and "check:    ok" in text
    assert "stages:   5 boundaries" in text
    assert "mixer: (mixer SCOPED) read=rmsnorm update=plain_add previous=stack entry following=(ffn SCOPED)" in text


def test_run_pattern_refuses_a_bad_pattern(capsys):
    assert main(["run", "--pattern", "M?", "--tp", "1"]) == 2
    assert "layer pattern 'M?' has '?' at position 1" in capsys.readouterr().err
