"""The MHC plugin (``layer-boundary-mhc``): coefficients, update orientation, per-invocation
coefficients, the Qwen3 decoder on MHC residuals against the equations written out here, and the
command line.

The direct implementation below shares no code with the plugin: its own RMSNorm, Sinkhorn,
coefficient split and stream loops, reading only the model's parameters.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
from pathlib import Path

import pytest
import torch

mhc = pytest.importorskip(
    "layer_boundary_mhc", reason="the MHC plugin is not installed (pip install -e plugins/mhc)"
)

from helpers import fake_topology, install_fake_dist, make_norm, raises_exact  # noqa: E402

from layer_boundary import (  # noqa: E402
    BoundaryContext,
    BoundaryError,
    ForwardBatch,
    declare_attn,
    declare_ffn,
    make_stages,
)
from layer_boundary._cli.main import main  # noqa: E402
from layer_boundary._errors import SNAPSHOT_PLAIN  # noqa: E402
from layer_boundary_app.models import (  # noqa: E402
    Qwen3ForCausalLM,
    init_random_weights,
    load_tensors,
    plain_forward,
    random_state_dict,
    small_random_config,
)
from layer_boundary._plugins import PluginError  # noqa: E402
from layer_boundary.residual import batch as residual_batch  # noqa: E402
from layer_boundary_mhc import MhcCoefficients, MhcSemantics, MhcStageParams, sinkhorn  # noqa: E402
from layer_boundary_mhc.read import MhcReadSpec  # noqa: E402

IDS = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
POS = torch.arange(len(IDS))


def _fb(n: int = len(IDS)) -> ForwardBatch:
    return ForwardBatch(num_tokens=n, positions=torch.arange(n))


def _random_params(n: int, hidden: int, seed: int, dtype: torch.dtype = torch.float32) -> MhcStageParams:
    p = MhcStageParams(n, hidden, dtype=dtype)
    p.init_random(torch.Generator().manual_seed(seed))
    return p.requires_grad_(False)


# -- the equations, written out independently --------------------------------------------------


def _rms(s: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return s / torch.sqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.to(s.dtype)


def _sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """``[T, i, j]``: columns (sum over i) then rows (sum over j), ``iters`` times."""
    m = logits.exp()
    for _ in range(iters):
        m = m / m.sum(dim=1, keepdim=True)
        m = m / m.sum(dim=2, keepdim=True)
    return m


def _coefficients(x: torch.Tensor, p: MhcStageParams, iters: int = 20):
    """``x [T, n, C]`` in the accumulation dtype -> ``(H_pre [T, n], H_post [T, n], H_res [T, n, n])``."""
    t, n, c = x.shape
    flat = x.reshape(t, n * c)
    xt = flat / torch.sqrt(flat.pow(2).mean(dim=-1, keepdim=True) + p.eps)
    phi, a = p.phi.to(x.dtype), p.alpha.to(x.dtype)
    pre = a[0] * (xt @ phi[:, :n]) + p.b_pre.to(x.dtype)
    post = a[1] * (xt @ phi[:, n : 2 * n]) + p.b_post.to(x.dtype)
    v = xt @ phi[:, 2 * n :]  # [T, n*n]; H~_res[i, j] = v[i*n + j]
    res = torch.stack([torch.stack([v[:, i * n + j] for j in range(n)], dim=-1) for i in range(n)], dim=1)
    res = a[2] * res + p.b_res.to(x.dtype)
    return torch.sigmoid(pre), 2 * torch.sigmoid(post), _sinkhorn(res, iters)


def _mix(h_res: torch.Tensor, h_post: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x'_i = sum_j H_res[i, j] x_j + H_post[i] y``, stream by stream."""
    n = x.shape[1]
    rows = []
    for i in range(n):
        acc = h_post[:, i, None] * y
        for j in range(n):
            acc = acc + h_res[:, i, j, None] * x[:, j]
        rows.append(acc)
    return torch.stack(rows, dim=1)


def direct_forward(model: Qwen3ForCausalLM, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The MHC Qwen3 forward written from its equations, using the model's weights only."""
    m = model.model
    dtype = m.embed_tokens.weight.dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    sem = model.residual
    fb = _fb(len(ids))
    h = m.embed_tokens(ids)
    x = torch.stack([h] * sem.n, dim=1)
    for layer in m.layers:
        stages = (
            (layer.attn_residual, layer.input_layernorm,
             lambda inp: layer.self_attn(positions=positions, hidden_states=inp, forward_batch=fb)),
            (layer.ffn_residual, layer.post_attention_layernorm, lambda inp: layer.mlp(inp)),
        )
        for params, norm, compute in stages:
            xa = x.to(acc)
            h_pre, h_post, h_res = _coefficients(xa, params, sem.sinkhorn_iters)
            combined = sum(h_pre[:, j, None] * xa[:, j] for j in range(sem.n))
            y = compute(_rms(combined, norm.weight, norm.eps).to(dtype))
            x = _mix(h_res, h_post, xa, y.to(acc)).to(dtype)
    xa = x.to(acc)
    if sem.contraction == "mean":
        merged = sum(xa[:, j] for j in range(sem.n)) / sem.n
    else:
        w = m.final_residual.weight.to(acc)
        merged = sum(w[j] * xa[:, j] for j in range(sem.n))
    return model.lm_head(_rms(merged, m.norm.weight, m.norm.eps).to(dtype)).float()


def _mhc_model(dtype=torch.float32, **kw) -> Qwen3ForCausalLM:
    model = Qwen3ForCausalLM(small_random_config(), dtype=dtype, residual=MhcSemantics(**kw))
    init_random_weights(model, seed=0)
    return model.eval().requires_grad_(False)


# -- plugin packaging ---------------------------------------------------------------------------


def _module_imports(path: Path) -> set[str]:
    """Modules a file imports when it is loaded (top-level statements only)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


def test_entry_point_manifest_is_light_and_the_plugin_is_active():
    (ep,) = [e for e in md.entry_points(group="layer_boundary.plugins") if e.name == "mhc"]
    assert ep.value == "layer_boundary_mhc._manifest:MANIFEST" and ep.dist.version == "0.1.0"
    manifest = ep.load()
    assert manifest is mhc.MANIFEST
    assert (manifest.name, manifest.provides, manifest.hooks) == (
        "mhc", ("residual_semantics",), "layer_boundary_mhc.hooks")
    # What the entry point loads (the package's __init__ and the manifest module) imports no torch
    # and none of the plugin's torch modules: the vendor SDK's light face only.
    pkg = Path(mhc.__file__).parent
    assert _module_imports(pkg / "__init__.py") == {"__future__", "layer_boundary.plugin_api", "._manifest"}
    assert _module_imports(pkg / "_manifest.py") == {"__future__", "layer_boundary.plugin_api"}

    registry = BoundaryContext.discover(allow=["mhc"]).registry
    sem = registry.semantics("mhc")
    assert isinstance(sem, MhcSemantics) and (sem.n, sem.sinkhorn_iters, sem.contraction) == (4, 20, "mean")
    assert [r.status.value for r in registry.records if r.name == "mhc"] == ["active"]


def test_mhc_needs_a_context_with_the_plugin():
    with pytest.raises(PluginError, match="BoundaryContext.discover"):
        Qwen3ForCausalLM(small_random_config(), residual="mhc")
    with pytest.raises(PluginError, match="no active plugin provides residual semantics 'mhc'"):
        Qwen3ForCausalLM(small_random_config(), context=BoundaryContext.discover(deny=["mhc"]), residual="mhc")


# -- coefficients and the update ----------------------------------------------------------------


def test_declared_capabilities():
    """Nonlinear, applied at the next read (after any sum), outliving its producer; the read
    makes a per-invocation update and fuses with nothing."""
    part = MhcSemantics().stage(16, dtype=torch.bfloat16)
    read = part.read.bind(make_norm(16, torch.bfloat16))
    _, streams, made = read.enter(torch.randn(3, 16).to(torch.bfloat16))
    assert streams.shape == (3, 4, 16)
    for u in (part.update, made):
        assert (u.name, u.plain_add, u.at_producer, u.outlives_producer) == ("mhc", False, False, True)
    assert isinstance(made, MhcCoefficients) and read.makes_update and not read.fuses_with
    assert {k: tuple(v.shape) for k, v in part.params.named_parameters()} == {
        "phi": (64, 24), "alpha": (3,), "b_pre": (4,), "b_post": (4,), "b_res": (4, 4)}
    assert all(v.dtype == torch.float32 for v in part.params.parameters())
    with pytest.raises(BoundaryError, match="without the coefficients its read makes"):
        part.update.apply(None, torch.zeros(3, 16))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_sinkhorn_rows_and_columns_sum_to_one(n):
    g = torch.Generator().manual_seed(n)
    logits = torch.rand(200, n, n, generator=g) * 2 - 1  # bounded: |logit| <= 1
    h = sinkhorn(logits)
    assert h.dtype == torch.float32 and (h > 0).all()
    torch.testing.assert_close(h.sum(dim=-1), torch.ones(200, n), atol=1e-5, rtol=0)
    torch.testing.assert_close(h.sum(dim=-2), torch.ones(200, n), atol=1e-5, rtol=0)
    # Rows are normalized last: exact to rounding whatever the logits, even huge ones.
    wild = torch.randn(50, n, n, generator=g) * 40
    torch.testing.assert_close(sinkhorn(wild).sum(dim=-1), torch.ones(50, n), atol=1e-6, rtol=0)
    torch.testing.assert_close(h, _sinkhorn(logits, 20), atol=1e-6, rtol=0)


def test_equal_streams_and_a_zero_output_stay_unchanged():
    n, c = 4, 16
    p = _random_params(n, c, seed=1)
    read = MhcReadSpec(p, 20).bind(make_norm(c, torch.float32))
    h = torch.randn(6, c, generator=torch.Generator().manual_seed(2))
    streams = h.unsqueeze(1).repeat(1, n, 1)
    _, update = read.read(streams)
    assert not torch.allclose(update.h_res, torch.eye(n).expand(6, n, n), atol=0.1)  # really mixes
    torch.testing.assert_close(update.apply(streams, torch.zeros(6, c)), streams, atol=1e-6, rtol=1e-6)


def test_update_orientation_is_caught_by_a_permutation():
    """``x'_i = sum_j H_res[i, j] x_j``: with ``H_res[i, (i+1) % n] = 1`` stream ``i`` takes stream
    ``i+1``; the transposed layout would take stream ``i-1``. ``H_post`` is per target stream."""
    n, c = 4, 8
    x = torch.randn(3, n, c, generator=torch.Generator().manual_seed(3))
    perm = torch.roll(torch.eye(n), 1, dims=1)  # perm[i, (i+1) % n] = 1
    assert perm[0, 1] == 1
    up = MhcCoefficients(torch.zeros(3, n), perm.expand(3, n, n).contiguous())
    assert torch.equal(up.apply(x, torch.zeros(3, c)), x[:, [1, 2, 3, 0]])
    y = torch.randn(3, c)
    onehot = torch.zeros(3, n)
    onehot[:, 2] = 1.5
    got = MhcCoefficients(onehot, torch.eye(n).expand(3, n, n).contiguous()).apply(x, y)
    want = x.clone()
    want[:, 2] += 1.5 * y
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_permutation_logits_move_streams_through_the_boundary():
    """The static logits ``b_res[i, j]`` reach ``H_res[i, j]`` unchanged in layout: a stage whose
    output is zero permutes the streams it read, as the next stage's input sees them."""
    n, c = 4, 8
    sem = MhcSemantics(n)
    a, f = sem.stage(c, dtype=torch.float32), sem.stage(c, dtype=torch.float32)
    perm = torch.roll(torch.eye(n), 1, dims=1)
    with torch.no_grad():
        a.params.b_res.copy_(40 * perm)  # off-pattern entries ~ e^-40 after Sinkhorn
    attn, ffn = make_stages(
        (declare_attn(update=a.update, read=a.read), make_norm(c, torch.float32)),
        (declare_ffn(update=f.update, read=f.read), make_norm(c, torch.float32, seed=1)),
    )
    fb = _fb(5)
    residual_batch.start(fb)
    streams = torch.randn(5, n, c, generator=torch.Generator().manual_seed(4))
    residual_batch.written(streams, fb)  # a stack entry accepts a written stream
    xin = attn.prepare(streams, fb)
    h = attn.finish(torch.zeros_like(xin), fb)
    ffn.prepare(h, fb)
    torch.testing.assert_close(fb.residual_stream.residual, streams[:, [1, 2, 3, 0]], atol=1e-6, rtol=0)


def test_coefficients_are_fp32_under_bf16_activations():
    n, c = 4, 32
    p = _random_params(n, c, seed=5)
    norm = make_norm(c, torch.bfloat16)
    read = MhcReadSpec(p, 20).bind(norm)
    streams = torch.randn(7, n, c, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    x, update = read.read(streams)
    assert x.dtype == torch.bfloat16
    assert update.h_post.dtype == update.h_res.dtype == torch.float32
    # Against the equations in FP64 from the same bf16 streams: FP32 math keeps ~1e-6; the
    # same math in bf16 would be off by ~1e-2.
    h_pre, h_post, h_res = _coefficients(streams.double(), p)
    torch.testing.assert_close(update.h_post.double(), h_post, atol=2e-6, rtol=0)
    torch.testing.assert_close(update.h_res.double(), h_res, atol=2e-6, rtol=0)
    combined = sum(h_pre[:, j, None] * streams.double()[:, j] for j in range(n))
    torch.testing.assert_close(x, _rms(combined, norm.weight.double(), norm.eps).to(torch.bfloat16), atol=0, rtol=0)
    y = torch.randn(7, c, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    new = update.apply(streams, y)
    assert new.dtype == torch.bfloat16
    ref = _mix(h_res, h_post, streams.double(), y.double())
    # One rounding of an FP32 sum: at most one bf16 ulp from the FP64 value.
    assert ((new.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-30).all()


# -- stream semantics at the boundary -----------------------------------------------------------


def test_snapshot_requires_a_plain_update():
    model = _mhc_model()
    layer = model.model.layers[0]
    fb = _fb()
    residual_batch.start(fb)
    x = layer.attn_boundary.prepare(model.model.embed_tokens(IDS), fb)
    h = layer.attn_boundary.finish(layer.self_attn(positions=POS, hidden_states=x, forward_batch=fb), fb)
    assert isinstance(fb.residual_stream.pending.update, MhcCoefficients)
    with raises_exact(BoundaryError, SNAPSHOT_PLAIN):
        residual_batch.snapshot(h, fb)
    with raises_exact(BoundaryError, SNAPSHOT_PLAIN):
        layer.attn_boundary.capture_output(h, fb)


def test_the_update_runs_after_the_owed_sum(monkeypatch):
    """Under TP 2 the attention output owes a sum; the MHC update applies to the summed output
    (the fake all-reduce doubles it), never before the reduction. A fusion candidate offered
    for the stage is refused: MHC reads fuse with nothing."""
    collectives = install_fake_dist(monkeypatch)
    n, c = 4, 8
    sem = MhcSemantics(n, seed=8)
    a, f = sem.stage(c, dtype=torch.float32), sem.stage(c, dtype=torch.float32)

    class Candidate:
        name = "never"
        sum_group = None

        def refuse(self, plan):
            return None

        def __call__(self, *args):
            raise AssertionError("an MHC read must not reach a fused add+norm candidate")

    class Fusions:
        name = "test-fusions"

        def ffn_input(self, plan):
            return [Candidate()]

        def attention_input(self, plan):
            return [Candidate()]

    attn, ffn = make_stages(
        (declare_attn(update=a.update, read=a.read), make_norm(c, torch.float32), {"fusions": Fusions()}),
        (declare_ffn(update=f.update, read=f.read), make_norm(c, torch.float32, seed=1), {"fusions": Fusions()}),
        topology=fake_topology(tp=2),
    )
    assert not ffn.plan.entries[next(iter(ffn.plan.entries))].candidates
    fb = _fb(5)
    residual_batch.start(fb)
    hidden = torch.randn(5, c, generator=torch.Generator().manual_seed(9))
    xin = attn.prepare(hidden, fb)
    streams = fb.residual_stream.residual.clone()
    y = torch.randn(5, c, generator=torch.Generator().manual_seed(10))
    h = attn.finish(y.clone(), fb)
    coeffs = fb.residual_stream.pending.update
    ffn.prepare(h, fb)
    assert collectives.calls == [5]
    want = _mix(coeffs.h_res, coeffs.h_post, streams, 2 * y)
    torch.testing.assert_close(fb.residual_stream.residual, want, atol=1e-6, rtol=1e-6)
    assert xin.shape == (5, c)


def test_two_microbatches_interleaved_through_the_same_stages():
    """Each microbatch's output carries the coefficients its own read made: interleaving the
    reads of two batches (same size, different tokens) through every stage changes nothing."""
    model = _mhc_model()
    m = model.model
    ids_a, ids_b = IDS, torch.tensor([7, 7, 100, 2, 33, 8, 1, 0, 250, 4])
    with torch.inference_mode():
        alone_a = model(ids_a, POS, _fb())
        alone_b = model(ids_b, POS, _fb())
        fa, fb = _fb(), _fb()
        residual_batch.start(fa)
        residual_batch.start(fb)
        ha, hb = m.embed_tokens(ids_a), m.embed_tokens(ids_b)
        for layer in m.layers:
            attn, ffn = layer.attn_boundary, layer.ffn_boundary
            xa, xb = attn.prepare(ha, fa), attn.prepare(hb, fb)
            ya = layer.self_attn(positions=POS, hidden_states=xa, forward_batch=fa)
            yb = layer.self_attn(positions=POS, hidden_states=xb, forward_batch=fb)
            ha, hb = attn.finish(ya, fa), attn.finish(yb, fb)
            ua, ub = fa.residual_stream.pending.update, fb.residual_stream.pending.update
            assert ua is not ub and not torch.equal(ua.h_res, ub.h_res)
            xa, xb = ffn.prepare(ha, fa), ffn.prepare(hb, fb)
            with ffn.exit(fa) as oa:
                ya = layer.mlp(xa)
            with ffn.exit(fb) as ob:
                yb = layer.mlp(xb)
            ha, hb = oa.finish(ya), ob.finish(yb)
        out_b = model.lm_head(residual_batch.norm(hb, fb, m.norm)).float()
        out_a = model.lm_head(residual_batch.norm(ha, fa, m.norm)).float()
    assert torch.equal(out_a, alone_a) and torch.equal(out_b, alone_b)
    assert not torch.allclose(alone_a, alone_b)


# -- the Qwen3 decoder on MHC residuals ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_n1_is_the_plain_residual(dtype):
    """``n = 1`` with the default init (``phi = 0``, ``b_pre = 40`` so ``H_pre = 1``, ``H_post = 1``,
    ``H_res = 1``) is the plain add + RMSNorm model to the last bit."""
    sd = random_state_dict(small_random_config(), seed=3)
    plain = Qwen3ForCausalLM(small_random_config(), dtype=dtype)
    one = Qwen3ForCausalLM(small_random_config(), dtype=dtype, residual=MhcSemantics(1))
    for model in (plain, one):
        load_tensors(model, sd.items())
    with torch.inference_mode():
        want = plain(IDS, POS, _fb())
        got = one(IDS, POS, _fb())
    assert torch.equal(got, want)
    assert one.model.layers[0].attn_boundary.plan.read.name == "mhc(n=1)+rmsnorm"


# Logits are ~10 in magnitude. FP32: eight stages of FP32 math in another operation order, so a
# few ulps of the largest logit (2e-5 absolute). FP64: reassociation only.
FP32_TOL = dict(atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,contraction,tol", [
    (torch.float32, "mean", FP32_TOL),
    (torch.float64, "head", dict(atol=1e-10, rtol=1e-10)),
])
def test_qwen3_mhc_matches_the_direct_equations(dtype, contraction, tol):
    model = _mhc_model(dtype, contraction=contraction)
    with torch.inference_mode():
        got = model(IDS, POS, _fb())
        want = direct_forward(model, IDS, POS)
        plain = Qwen3ForCausalLM(small_random_config(), dtype=dtype)
        load_tensors(plain, random_state_dict(small_random_config(), seed=0).items())
        plain_logits = plain(IDS, POS, _fb())
    torch.testing.assert_close(got, want, **tol)
    # The seeded coefficients are far from a plain residual: the comparison tests MHC.
    assert (got - plain_logits).abs().max() > 1.0


def test_checkpoints_without_mhc_tensors_load(tmp_path):
    """An HF checkpoint has no MHC tensors: they keep the near-plain init (so the model computes
    what the plain one does), and a checkpoint that has them loads them."""
    from safetensors.torch import save_file

    config = small_random_config()
    sd = random_state_dict(config, seed=4)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    save_file(sd, str(folder / "model.safetensors"))
    ctx = BoundaryContext.discover(allow=["mhc"])
    model = Qwen3ForCausalLM.from_pretrained(folder, context=ctx, residual="mhc")
    assert model.optional_parameter("model.layers.0.attn_residual.phi")
    assert not model.optional_parameter("model.layers.0.input_layernorm.weight")
    plain = Qwen3ForCausalLM.from_pretrained(folder)
    assert not plain.residual_modules() and not any("residual" in k for k in plain.state_dict())
    with torch.inference_mode():
        torch.testing.assert_close(model(IDS, POS, _fb()), plain(IDS, POS, _fb()), atol=1e-4, rtol=1e-5)

    seeded = _mhc_model()
    extra = {k: v for k, v in seeded.state_dict().items() if "_residual." in k}
    assert len(extra) == 2 * 5 * config.num_hidden_layers
    fresh = Qwen3ForCausalLM(config, residual=MhcSemantics())
    load_tensors(fresh, [*random_state_dict(config, seed=0).items(), *extra.items()])
    with torch.inference_mode():
        assert torch.equal(fresh(IDS, POS, _fb()), seeded(IDS, POS, _fb()))


def test_plain_forward_refuses_mhc():
    with pytest.raises(ValueError, match="residual='mhc'"):
        plain_forward(_mhc_model(), IDS, POS, _fb())


# -- command line -------------------------------------------------------------------------------


def test_cli_run_with_mhc_residual(tmp_path, capsys):
    out = tmp_path / "logits.pt"
    assert main(["run", "--tp", "1", "--residual", "mhc", "--input-ids", "3,1,4,1,5",
                 "--save-logits", str(out)]) == 0
    text = capsys.readouterr().out
    assert "residual: mhc: 4 streams, Sinkhorn 20 iterations" in text
    assert "read=mhc(n=4)+rmsnorm update=mhc" in text
    # The same numbers through the Python API: discovered context, residual="mhc", seed 0.
    model = Qwen3ForCausalLM(small_random_config(), context=BoundaryContext.discover(), residual="mhc")
    init_random_weights(model, seed=0)
    ids = torch.tensor([3, 1, 4, 1, 5])
    with torch.inference_mode():
        ref = model.eval()(ids, torch.arange(5), _fb(5))
        direct = direct_forward(model, ids, torch.arange(5))
    logits = torch.load(out)
    torch.testing.assert_close(logits, ref, atol=0, rtol=0)
    torch.testing.assert_close(logits, direct, **FP32_TOL)


def test_cli_run_mhc_on_a_checkpoint_and_without_the_plugin(tmp_path, capsys, monkeypatch):
    from safetensors.torch import save_file

    config = small_random_config()
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    save_file(random_state_dict(config, seed=5), str(folder / "model.safetensors"))
    assert main(["run", "--model", str(folder), "--residual", "mhc", "--input-ids", "1,2,3"]) == 0
    assert "update=mhc" in capsys.readouterr().out
    monkeypatch.setenv("LAYER_BOUNDARY_DISABLE", "mhc")
    assert main(["run", "--residual", "mhc", "--input-ids", "1"]) == 2
    assert "no active plugin provides residual semantics 'mhc'" in capsys.readouterr().err


# -- the core's conformance kit -------------------------------------------------------------------

from layer_boundary.testing import ResidualSemanticsConformance  # noqa: E402


class TestMhcConformance(ResidualSemanticsConformance):
    """The kit's checks on seeded (non-trivial) MHC stages, against the equations above."""

    @pytest.fixture(params=["mean", "head"])
    def semantics(self, request):
        return MhcSemantics(4, contraction=request.param, seed=11)

    @pytest.fixture(params=[torch.float32, torch.float64], ids=["fp32", "fp64"])
    def dtype(self, request):
        return request.param

    @pytest.fixture
    def reference(self, semantics):
        def run(stack, x):
            acc = torch.float64 if x.dtype == torch.float64 else torch.float32
            n = semantics.n
            streams = torch.stack([x] * n, dim=1)
            for params, norm, w in zip(stack.params, stack.norms, stack.weights):
                xa = streams.to(acc)
                h_pre, h_post, h_res = _coefficients(xa, params, semantics.sinkhorn_iters)
                combined = sum(h_pre[:, j, None] * xa[:, j] for j in range(n))
                y = _rms(combined, norm.weight, norm.eps).to(x.dtype) @ w
                streams = _mix(h_res, h_post, xa, y.to(acc)).to(x.dtype)
            xa = streams.to(acc)
            if semantics.contraction == "mean":
                merged = sum(xa[:, j] for j in range(n)) / n
            else:
                merged = sum(stack.exit_params.weight.to(acc)[j] * xa[:, j] for j in range(n))
            return _rms(merged, stack.norms[-1].weight, stack.norms[-1].eps).to(x.dtype)

        return run


def test_the_torch_functions_refuse_shapes_that_do_not_fit():
    # Found by a new-user trial: torch's "mat1 and mat2" errors, silent broadcasts of another
    # token's row, and integer streams read as zeros.
    from layer_boundary_mhc import MhcHead, MhcStageParams, mhc_read_ref, mhc_update_ref

    n, c, t = 4, 32, 3
    p = MhcStageParams(n, c)
    w = torch.ones(c)
    with pytest.raises(ValueError, match=r"streams \[T, 3, 32\] do not fit parameters made for n = 4"):
        mhc_read_ref(torch.randn(t, 3, c), p, w, 1e-6)
    with pytest.raises(ValueError, match="floating-point"):
        mhc_read_ref(torch.ones(t, n, c, dtype=torch.int64), p, w, 1e-6)
    x, y = torch.randn(t, n, c), torch.randn(t, c)
    hp, hr = torch.rand(t, n), torch.rand(t, n, n)
    with pytest.raises(ValueError, match=r"h_post has shape \(3, 1\), expected \(3, 4\)"):
        mhc_update_ref(x, y, hp[:, :1], hr)
    with pytest.raises(ValueError, match=r"y has shape \(1, 32\), expected \(3, 32\)"):
        mhc_update_ref(x, y[:1], hp, hr)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="int of at least 1"):
            MhcStageParams(bad, c)
        with pytest.raises(ValueError, match="int of at least 1"):
            MhcHead(bad)


def test_sinkhorn_and_destinations_refuse_what_does_not_fit():
    # Found by a new-user trial: non-square logits normalized anyway, 0 or negative iterations taken
    # as none, and an out= tensor of another shape filled by broadcasting.
    from layer_boundary_mhc import MhcStageParams, mhc_read_ref, mhc_update_ref
    from layer_boundary_mhc.coefficients import sinkhorn

    with pytest.raises(ValueError, match=r"square \[\.\.\., n, n\] logits, got shape \(2, 3, 4\)"):
        sinkhorn(torch.zeros(2, 3, 4))
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="int of at least 1"):
            sinkhorn(torch.zeros(2, 4, 4), bad)
    assert torch.allclose(sinkhorn(torch.zeros(4, 4), 1), torch.full((4, 4), 0.25))
    n, c, t = 4, 32, 3
    p = MhcStageParams(n, c)
    x, y = torch.randn(t, n, c), torch.randn(t, c)
    hp, hr = torch.rand(t, n), torch.rand(t, n, n)
    with pytest.raises(ValueError, match=r"out has shape \(2, 3, 4, 32\); expected \(3, 4, 32\)"):
        mhc_update_ref(x, y, hp, hr, out=torch.empty(2, t, n, c))
    with pytest.raises(ValueError, match=r"h_res has shape \(3, 16\); expected \(3, 4, 4\)"):
        mhc_read_ref(x, p, torch.ones(c), 1e-6, h_res=torch.empty(t, n * n))
    got = torch.empty(t, c)
    assert mhc_read_ref(x, p, torch.ones(c), 1e-6, out=got)[0] is got
