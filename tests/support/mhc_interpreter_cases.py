"""The MHC Triton kernels under Triton's interpreter, on CPU tensors.

Run by tests/plugins/test_mhc_kernels.py in a subprocess with TRITON_INTERPRET=1 (set before the kernel
module is imported: Triton 3.6 picks the interpreter in ``@triton.jit``). The interpreter runs
one program at a time in ticket order, so the cooperative launch never waits here; the GPU tests
take the large shapes and the real concurrency. Every call passes ``SMALL``, a kernel config of small
launch shapes (16-token blocks, 32-column slices), so that small tensors still take several blocks,
slices and finishes.

Outputs are compared by ``layer_boundary_mhc.accuracy`` (its tolerances, with their reasons): the
read of an update+read against the reference read of the streams the kernel stored.
"""

from __future__ import annotations

import functools
import os
from dataclasses import replace

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run with TRITON_INTERPRET=1 (tests/plugins/test_mhc_kernels.py does)", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")
pytest.importorskip("layer_boundary_mhc", reason="the MHC plugin is not installed")
import triton  # noqa: E402

from layer_boundary_mhc import MhcKernelConfig, MhcSemantics, MhcStageParams  # noqa: E402
from layer_boundary_mhc import triton_mhc as tm  # noqa: E402
from layer_boundary_mhc import triton_ops  # noqa: E402
from layer_boundary_mhc.accuracy import assert_matches_reference  # noqa: E402
from layer_boundary_mhc.reference import mhc_read_ref  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
EPS = 1e-6
SMALL = MhcKernelConfig(block_tokens=(16, 16, 16), joined_block_tokens=(16, 16, 16), slice_cols=(32, 32, 32),
                        finish_tokens=8, lag=2)
# The kernels as the tests call them: with SMALL unless a test passes its own config.
mhc_read_triton = functools.partial(triton_ops.mhc_read_triton, config=SMALL)
mhc_update_read_triton = functools.partial(triton_ops.mhc_update_read_triton, config=SMALL)
mhc_update_triton = triton_ops.mhc_update_triton  # its shape depends on no setting


def boundary_config(tokens: int, n: int, hidden: int, itemsize: int, bf16: bool = False, config=SMALL):
    return tm.boundary_config(tokens, n, hidden, itemsize, bf16, config)


def params(n: int, c: int, seed: int = 0) -> MhcStageParams:
    p = MhcStageParams(n, c)
    p.init_random(torch.Generator().manual_seed(seed))
    return p.requires_grad_(False)


def inputs(t: int, n: int, c: int, dtype: torch.dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, n, c, generator=g) * 2).to(dtype)
    y = torch.randn(t, c, generator=g).to(dtype)
    w = (torch.rand(c, generator=g) + 0.5).to(dtype)
    h_post = 2 * torch.rand(t, n, generator=g)
    h_res = torch.softmax(2 * torch.randn(t, n, n, generator=g), dim=-1)
    return x, y, w, h_post, h_res


def matches(op: str, got, x, p, w, y=None, hp=None, hr=None, offset: float = 0.0, **kw) -> None:
    assert_matches_reference(op, got, x, y=y, h_post=hp, h_res=hr, params=p, norm_weight=w, norm_eps=EPS,
                             norm_offset=offset, **kw)


def test_the_interpreter_is_in_use():
    assert tm.INTERPRETED, "TRITON_INTERPRET=1 was set after the kernel module was imported"


# (T, n, C, dtype, norm offset): one token, odd and prime widths, a width past a power of two,
# several 16-token blocks, n from 1 to 8.
CASES = [
    (1, 4, 64, BF16, 0.0), (3, 4, 37, FP32, 1.0), (19, 4, 100, BF16, 0.0), (40, 4, 64, FP16, 0.0),
    (5, 1, 33, FP32, 0.0), (6, 3, 45, BF16, 1.0), (2, 8, 16, FP32, 0.0),
]


@pytest.mark.parametrize("t,n,c,dtype,offset", CASES, ids=str)
def test_update_read_matches_the_reference(t, n, c, dtype, offset):
    x, y, w, hp, hr = inputs(t, n, c, dtype)
    p = params(n, c)
    x0 = x.clone()
    got = mhc_update_read_triton(x, y, hp, hr, p, w, EPS, norm_offset=offset)
    matches("update+read", got, x, p, w, y, hp, hr, offset)
    assert torch.equal(x, x0)


@pytest.mark.parametrize("t,n,c,dtype,offset", CASES[:4], ids=str)
def test_read_matches_the_reference(t, n, c, dtype, offset):
    x, _, w, _, _ = inputs(t, n, c, dtype, seed=2)
    p = params(n, c, seed=3)
    got = mhc_read_triton(x, p, w, EPS, norm_offset=offset)
    matches("read", got, x, p, w, offset=offset)
    torch.testing.assert_close(got[2].sum(-1), torch.ones(t, n), atol=1e-6, rtol=0)  # rows last: exact


@pytest.mark.parametrize("t,n,c,dtype", [(1, 4, 7, BF16), (33, 4, 100, FP16), (5, 3, 600, FP32)], ids=str)
def test_update_alone_matches_the_reference(t, n, c, dtype):
    x, y, _, hp, hr = inputs(t, n, c, dtype, seed=4)
    matches("update", (mhc_update_triton(x, y, hp, hr),), x, None, None, y, hp, hr)


def test_two_launches_give_the_cooperative_result_bitwise():
    x, y, w, hp, hr = inputs(37, 4, 70, BF16, seed=5)
    p = params(4, 70, seed=6)
    coop = mhc_update_read_triton(x, y, hp, hr, p, w, EPS, cooperative=True)
    two = mhc_update_read_triton(x, y, hp, hr, p, w, EPS, cooperative=False)
    assert all(torch.equal(a, b) for a, b in zip(coop, two))
    cfg = boundary_config(37, 4, 70, 2)
    assert (cfg.blocks(37), cfg.slices, cfg.finishers) == (3, 3, 2)  # what SMALL makes


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=str)
def test_phi_split_before_the_launch_or_in_the_stream_pass_gives_the_same_bits(dtype):
    x, y, w, hp, hr = inputs(37, 4, 70, dtype, seed=8)
    p = params(4, 70, seed=9)
    assert boundary_config(37, 4, 70, x.element_size()).presplit
    pre = mhc_update_read_triton(x, y, hp, hr, p, w, EPS)
    unsplit = replace(SMALL, presplit_tokens=0)
    assert not boundary_config(37, 4, 70, x.element_size(), config=unsplit).presplit
    got = mhc_update_read_triton(x, y, hp, hr, p, w, EPS, config=unsplit)
    assert all(torch.equal(a, b) for a, b in zip(pre, got))


def test_the_sinkhorn_iteration_count_is_the_reference_s():
    x, _, w, _, _ = inputs(4, 4, 32, FP32, seed=7)
    p = params(4, 32, seed=8)
    one = mhc_read_triton(x, p, w, EPS, iters=1)[2]
    torch.testing.assert_close(one, mhc_read_ref(x, p, w, EPS, iters=1)[2], atol=2e-6, rtol=0)
    assert not torch.allclose(one, mhc_read_triton(x, p, w, EPS)[2], atol=1e-4)


@pytest.mark.parametrize("t,n", [(1, 4), (70, 4), (130, 3), (9, 2)], ids=str)
def test_the_sinkhorn_after_the_cluster_kernel_is_the_reference_s(t, n):
    """``finish.sinkhorn_kernel`` (what runs on the cluster kernel's H_res logits): in place, the
    rows past T untouched, and the reference's matrices from the same logits (n x n, not a
    power of two at n = 3; one token; a block and a ragged tail)."""
    from layer_boundary_mhc.coefficients import sinkhorn
    from layer_boundary_mhc.finish import sinkhorn_kernel

    g = torch.Generator().manual_seed(t)
    logits = torch.randn(t + 3, n, n, generator=g) * 3
    logits[0, 0, 0] = 120.0  # a saturating entry: the floor keeps its column summable
    h = logits.clone()
    sinkhorn_kernel[(-(-t // 64),)](h, t, N=n, NP=triton.next_power_of_2(n), TB=64, ITERS=20)
    torch.testing.assert_close(h[:t], sinkhorn(logits[:t]), atol=2e-6, rtol=0)
    assert torch.equal(h[t:], logits[t:])


def test_unbalanced_logits_saturate_without_nan():
    """Logits further apart than exp can represent: the floor keeps every column summable."""
    x, _, w, _, _ = inputs(3, 4, 32, FP32, seed=9)
    p = params(4, 32, seed=10)
    with torch.no_grad():
        p.b_res.copy_(torch.tensor([[200.0, -200, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]))
    got = mhc_read_triton(x, p, w, EPS)
    assert all(bool(torch.isfinite(g).all()) for g in got)
    matches("read", got, x, p, w)


def test_rows_wider_than_a_tile_take_the_chunked_finish():
    narrow = replace(SMALL, max_tile=64, chunk=32)
    cfg = boundary_config(3, 4, 100, 2, config=narrow)
    assert cfg.chunked and cfg.row_tile == 32
    x, y, w, hp, hr = inputs(3, 4, 100, BF16, seed=11)
    p = params(4, 100, seed=12)
    got = mhc_update_read_triton(x, y, hp, hr, p, w, EPS, norm_offset=1.0, config=narrow)
    matches("update+read", got, x, p, w, y, hp, hr, 1.0)


def test_strided_streams_and_outputs_need_no_copy():
    t, n, c = 5, 4, 40
    g = torch.Generator().manual_seed(13)
    wide = torch.randn(t, n, 2 * c, generator=g).to(BF16)
    x = wide[:, :, ::2]  # column stride 2
    y = torch.randn(c, t, generator=g).to(BF16).t()  # column-major rows
    _, _, w, hp, hr = inputs(t, n, c, BF16, seed=14)
    p = params(n, c, seed=15)
    streams_out = torch.empty(n, t, c, dtype=BF16).transpose(0, 1)  # written where it lies
    out = torch.empty(t, 2 * c, dtype=BF16)[:, :c]
    got = mhc_update_read_triton(x, y, hp, hr, p, w, EPS, streams_out=streams_out, out=out)
    assert got[0] is streams_out and got[1] is out
    matches("update+read", got, x, p, w, y, hp, hr)
    matches("read", mhc_read_triton(x, p, w, EPS), x, p, w)


def test_destinations_are_written_and_returned():
    t, n, c = 4, 4, 32
    x, y, w, hp, hr = inputs(t, n, c, FP16, seed=16)
    p = params(n, c, seed=17)
    out, h_post, h_res = torch.empty(t, c, dtype=FP16), torch.empty(t, n), torch.empty(t, n, n)
    got = mhc_read_triton(x, p, w, EPS, out=out, h_post=h_post, h_res=h_res)
    assert got[0] is out and got[1] is h_post and got[2] is h_res
    dest = torch.empty_like(x)
    assert mhc_update_triton(x, y, hp, hr, out=dest) is dest
    matches("update", (dest,), x, p, w, y, hp, hr)


def test_empty_batch_launches_nothing():
    x, y, w, hp, hr = inputs(0, 4, 32, BF16)
    p = params(4, 32)
    got = mhc_update_read_triton(x, y, hp, hr, p, w, EPS)
    assert [tuple(g.shape) for g in got] == [(0, 4, 32), (0, 32), (0, 4), (0, 4, 4)]
    assert mhc_update_triton(x, y, hp, hr).shape == (0, 4, 32)


def test_bad_inputs_are_refused_before_any_launch():
    x, y, w, hp, hr = inputs(2, 4, 16, FP32)
    p = params(4, 16)
    with pytest.raises(TypeError, match="FP64"):
        mhc_read_triton(x.double(), p, w, EPS)
    with pytest.raises(ValueError, match=r"streams \[tokens, n, hidden\]"):
        mhc_read_triton(x[:, 0], p, w, EPS)
    with pytest.raises(ValueError, match="parameters are for n=4, hidden=16"):
        mhc_read_triton(x[:, :, :8], p, w[:8], EPS)
    with pytest.raises(ValueError, match=r"the stage output y has shape \(1, 16\)"):
        mhc_update_read_triton(x, y[:1], hp, hr, p, w, EPS)
    with pytest.raises(TypeError, match="H_res has dtype"):
        mhc_update_triton(x, y, hp, hr.double())
    with pytest.raises(ValueError, match=r"out has shape \(2, 8\)"):
        mhc_read_triton(x, p, w, EPS, out=torch.empty(2, 8))
    big = params(9, 4)
    with pytest.raises(ValueError, match="at most 8 streams"):
        mhc_read_triton(torch.zeros(1, 9, 4), big, torch.ones(4), EPS)


def test_compiled_fullgraph_matches_eager():
    """Dynamo traces the wrappers into the operators (under the interpreter plain custom ops with
    the same schemas)."""
    torch._dynamo.reset()
    x, y, w, hp, hr = inputs(3, 4, 32, BF16, seed=18)
    p = params(4, 32, seed=19)

    def step(x, y, hp, hr):
        streams, inp, h_post, h_res = mhc_update_read_triton(x, y, hp, hr, p, w, EPS)
        inp2, h_post2, h_res2 = mhc_read_triton(streams, p, w, EPS)
        return mhc_update_triton(streams, inp2, h_post2, h_res2), inp, h_res2

    want = step(x, y, hp, hr)
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(x, y, hp, hr)
    for g, e in zip(got, want):
        assert torch.equal(g, e)


def test_a_stack_on_mhc_runs_the_kernels_and_matches_the_torch_reference():
    """Under the interpreter the kernels serve CPU streams: the MHC read picks them (read, fused
    update and read, and the update its coefficients carry) and a small Qwen3 matches the same
    model on the torch reference."""
    from layer_boundary import ForwardBatch
    from layer_boundary_app.models import Qwen3ForCausalLM, init_random_weights, small_random_config

    def model(kernels: str) -> Qwen3ForCausalLM:
        m = Qwen3ForCausalLM(small_random_config(),
                             residual=MhcSemantics(kernels=kernels, seed=3, kernel_config=SMALL))
        init_random_weights(m, seed=0)
        return m.eval().requires_grad_(False)

    fast, ref = model("auto"), model("torch")
    read = fast.model.layers[0].attn_boundary.plan.read
    assert read.kernels.serves(torch.zeros(1, 4, 8)) and read.kernels.config is SMALL
    assert read.kernels.reason("cpu", FP32).startswith("triton: ")
    assert ref.model.layers[0].attn_boundary.plan.read.kernels.reason("cpu", FP32) == (
        "torch reference: kernels='torch' asks for the torch reference")
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2])
    with torch.inference_mode():
        got = fast(ids, torch.arange(7), ForwardBatch(num_tokens=7, positions=torch.arange(7)))
        want = ref(ids, torch.arange(7), ForwardBatch(num_tokens=7, positions=torch.arange(7)))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_bench_methods_run_the_kernels_into_their_destinations():
    """``bench mhc``'s Triton methods (checked once, then timed over destinations allocated once)
    under the interpreter: the same numbers both ways, within tolerance of the reference."""
    from layer_boundary_mhc import bench

    inputs = bench._inputs(2, 4, 32, BF16, "cpu")
    methods = bench._triton_methods(triton_ops, bench.OPS, SMALL)
    assert [(m.op, m.name) for m in methods] == [
        ("update+read", "triton"), ("update+read", "triton 2-launch"), ("read", "triton"),
        ("read", "triton 2-launch"), ("update", "triton")]
    for m in methods:
        got = m.call(inputs)
        check = bench._check(m, got, inputs)
        assert check["ok"] is True and check["tol"] <= 1, (m, check)
        again = bench._destinations(m, inputs, SMALL)()
        assert all(torch.equal(a, b) for a, b in zip(again, got)), m


@pytest.mark.parametrize("rows", [1, 2], ids=["finish 1 token", "finish 2 tokens"])
@pytest.mark.parametrize("t,n,c", [(37, 4, 70), (6, 3, 45), (2, 8, 16), (5, 1, 33)], ids=str)
def test_joined_stream_pass_and_one_launch_form_match_the_reference(rows, t, n, c):
    """bf16 streams through ``stream_joined`` (the n streams one MMA operand, phi's bf16 parts split
    once; padded streams at n = 1 and 3): within the check; the one-launch form (tickets) gives the
    two-launch bits; finishes that normalize one token at a time or two."""
    joined = replace(SMALL, joined=(1, 1, 1), finish_rows=rows)
    x, y, w, hp, hr = inputs(t, n, c, BF16, seed=30 + t)
    p = params(n, c, seed=31)
    assert boundary_config(t, n, c, 2, bf16=True, config=joined).joined
    assert not boundary_config(t, n, c, 2, bf16=False, config=joined).joined  # fp16 is not exact in bf16 parts
    two = mhc_update_read_triton(x, y, hp, hr, p, w, EPS, cooperative=False, config=joined)
    matches("update+read", two, x, p, w, y, hp, hr)
    one = mhc_update_read_triton(x, y, hp, hr, p, w, EPS, cooperative=True, config=joined)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    matches("read", mhc_read_triton(x, p, w, EPS, config=joined), x, p, w)
