"""The MHC plugin's Triton kernels (``layer_boundary_mhc.triton_ops``): selection and its reasons
on every machine, the kernel logic under Triton's interpreter on CPU (a subprocess, see
mhc_interpreter_cases.py), a compile for sm_90 without a GPU (mhc_sm90.py: compile errors,
16-byte accesses, tensor-core projection, no spills), and on a GPU: eager against the torch
reference, cooperative against two launches, CUDA-graph replay, ``torch.compile`` and a model.

Outputs are compared by ``layer_boundary_mhc.accuracy`` (``compare``, also ``bench mhc``'s check):
each element within ``atol * magnitude + rtol * |want|``, ``rtol`` one ulp of the output dtype,
``atol`` FP32 arithmetic relative to the element's cancel-free magnitude; the read of an
update+read against the reference read of the streams the kernel stored (a stream element
rounded the other way moves its token's coefficients by about 1e-4, both right).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

mhc = pytest.importorskip("layer_boundary_mhc", reason="the MHC plugin is not installed (pip install -e plugins/mhc)")

from helpers import make_norm  # noqa: E402

from layer_boundary_mhc import MhcKernelConfig, MhcSemantics, MhcStageParams  # noqa: E402
from layer_boundary_mhc.accuracy import TOLERANCE, assert_matches_reference, compare  # noqa: E402
from layer_boundary_mhc.read import MhcReadSpec  # noqa: E402
from layer_boundary_mhc.reference import mhc_read_ref, mhc_update_ref  # noqa: E402
from layer_boundary_mhc.selection import select_kernels  # noqa: E402

HERE = Path(__file__).resolve().parents[1] / "support"  # the case files
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
EPS = 1e-6
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")


# -- every machine: selection and its reasons --------------------------------------------------------


def _read(kernels: str = "auto", n: int = 4, norm=None):
    return MhcReadSpec(MhcStageParams(n, 16), 20, kernels).bind(norm if norm is not None else make_norm(16, BF16))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reasons given where no GPU is visible")
def test_without_a_gpu_the_torch_reference_runs_and_says_why():
    read = _read()
    assert not read.kernels.serves(torch.zeros(2, 4, 16, dtype=BF16))
    assert read.kernels.reason("cpu", BF16) == "torch reference: the Triton kernels run on cuda devices only, not cpu"
    if HAS_TRITON:
        assert read.kernels.reason("cuda", BF16) == (
            "torch reference: no CUDA device was visible when the model was built, so the Triton kernels were "
            "not loaded")
    with pytest.raises(ValueError, match="kernels='triton'.*needs a CUDA device|triton is not installed"):
        _read("triton")


def test_refusals_that_hold_on_every_device():
    assert _read("torch").kernels.reason("cuda", BF16) == "torch reference: kernels='torch' asks for the torch reference"
    assert _read(n=9).kernels.reason("cuda", BF16) == "torch reference: the Triton kernels take at most 8 streams, not 9"

    class Scale(torch.nn.Module):
        def forward(self, x):
            return x * 2

    assert _read(norm=Scale()).kernels.reason("cuda", BF16) == (
        "torch reference: the stage norm Scale is not an RMSNorm (weight, eps): the fused read applies the "
        "norm itself")
    with pytest.raises(ValueError, match="at most 8 streams"):
        _read("triton", n=9)
    with pytest.raises(ValueError, match=r"kernels='bogus'\): choose one of \('auto', 'triton', 'torch'\)"):
        MhcSemantics(kernels="bogus")
    with pytest.raises(ValueError, match="choose one of"):
        select_kernels("bogus", 4, "rmsnorm")


def test_float64_streams_stay_on_the_reference():
    sel = select_kernels("auto", 4, "rmsnorm")
    assert not sel.serves(torch.zeros(1, 4, 8, dtype=torch.float64))
    why = sel.why_not(sel.device_type, torch.float64)
    assert why == "float64 streams are not supported (bf16, fp16, fp32): FP32 accumulation would round them"


def test_describe_names_the_kernels():
    text = MhcSemantics().describe()
    assert text.startswith("mhc: 4 streams, Sinkhorn 20 iterations, exit mean, FP32 coefficients, kernels auto")
    assert "Triton on CUDA" in text or "triton is not installed" in text
    assert MhcSemantics(kernels="torch").describe().endswith("kernels torch (the reference)")


def test_the_torch_path_is_the_reference():
    """On the reference the read and the update are the functional references (one definition)."""
    p = MhcStageParams(4, 16)
    p.init_random(torch.Generator().manual_seed(0))
    norm = make_norm(16, BF16)
    read = MhcReadSpec(p, 20, "torch").bind(norm)
    x = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(1)).to(BF16)
    inp, up = read.read(x)
    want = mhc_read_ref(x, p, norm.weight, norm.eps)
    assert torch.equal(inp, want[0]) and torch.equal(up.h_post, want[1]) and torch.equal(up.h_res, want[2])
    y = torch.randn(3, 16).to(BF16)
    assert torch.equal(up.apply(x, y), mhc_update_ref(x, y, up.h_post, up.h_res))


@needs_triton
def test_launch_shapes_are_cached_and_cover_the_row():
    from layer_boundary_mhc import triton_mhc as tm

    for tokens, bt in ((1, 16), (16, 16), (17, 32), (1024, 32), (1025, 64), (32768, 64)):
        cfg = tm.boundary_config(tokens, 4, 4096, 2)
        assert cfg.block_tokens == bt and cfg is tm.boundary_config(tokens, 4, 4096, 2)
        assert cfg.slices * cfg.slice_cols >= 4096 > (cfg.slices - 1) * cfg.slice_cols
        assert cfg.finishers * cfg.finish_tokens == bt and cfg.slice_cols % cfg.block_cols == 0
    cfg = tm.boundary_config(1, 4, 4096, 2)
    assert cfg.grid(1, tm.COOPERATIVE) == 2 * (cfg.slices + cfg.finishers)  # one block, lag 1
    big = tm.boundary_config(8192, 4, 4096, 2)
    assert big.grid(8192, tm.COOPERATIVE) == (128 + big.lag) * (big.slices + big.finishers)
    assert big.grid(8192, tm.STREAM_PASS) == 128 * big.slices and big.grid(8192, tm.FINISH) == 128 * big.finishers
    assert not big.chunked and tm.boundary_config(8192, 4, 20000, 2).chunked
    assert tm.coefficient_columns(4) == (24, 32) and tm.coefficient_columns(2) == (8, 16)
    assert tm.coefficient_columns(8) == (80, 128)


@needs_triton
def test_kernels_under_the_triton_interpreter():
    """The kernel logic on CPU tensors. TRITON_INTERPRET must be set before the kernels are
    defined, and this session's GPU tests need them compiled: hence a subprocess."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "mhc_interpreter_cases.py")]
    proc = subprocess.run(cmd, cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"interpreter cases failed:\n{out[-8000:]}"
    assert " passed" in out and "skipped" not in out.splitlines()[-1], out[-2000:]


# -- layer-boundary bench mhc (the harness on CPU: the torch reference only) --------------------------


def _bench(argv: list[str]) -> int:
    """``layer-boundary bench mhc ARGV``: the plugin's command on the CLI's arguments (the command
    comes from the plugin; the core's parser still declares its options)."""
    from layer_boundary._cli.main import build_parser
    from layer_boundary_mhc.bench import mhc_command

    return mhc_command(build_parser().parse_args(["bench", "mhc", *argv]))


def test_byte_model_is_80_kib_a_token_at_n4_h4096_bf16():
    from layer_boundary_mhc.bench import bytes_moved

    per_token = bytes_moved("update+read", 2, 4, 4096, 2) - bytes_moved("update+read", 1, 4, 4096, 2)
    assert per_token == 80 * 1024 + 8 * 20  # streams and activations, plus FP32 coefficients in and out
    assert bytes_moved("update+read", 0, 4, 4096, 2) == 4 * 4 * 4096 * 24 + 4096 * 2  # phi and the weight
    assert bytes_moved("update", 1, 4, 4096, 2) == 9 * 4096 * 2 + 4 * 20


def test_bench_mhc_on_cpu_end_to_end(tmp_path, capsys):
    import json
    import xml.etree.ElementTree as ET
    from datetime import date

    from layer_boundary_mhc.bench import bytes_moved

    out = tmp_path / "results"
    assert _bench(["--device", "cpu", "--tokens", "1", "3", "--hidden", "64", "--replays", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "copy bandwidth" in text and "triton refuses cpu bfloat16 n=4: " in text
    (json_file,) = out.glob(f"{date.today().isoformat()}-mhc-cpu-*.json")
    doc = json.loads(json_file.read_text())
    assert doc["bench"] == "mhc" and doc["streams"] == 4 and doc["copy"]["gbps"] > 0
    assert {(r["op"], r["tokens"]) for r in doc["rows"]} == {(op, t) for op in ("update+read", "read", "update")
                                                              for t in (1, 3)}
    for r in doc["rows"]:
        assert r["method"] == "torch reference" and r["check"] == "-" and r["speedup"] == 1.0
        assert r["bytes"] == bytes_moved(r["op"], r["tokens"], 4, 64, 2)
        assert r["gbps"] == pytest.approx(r["bytes"] / r["us"] / 1e3) and r["pct_roofline"] > 0
    assert doc["refused"][0]["method"] == "triton"
    ET.parse(json_file.with_suffix(".svg"))


def test_bench_mhc_tunes_config_fields_and_says_when_a_setting_is_wrong(capsys, tmp_path):
    from layer_boundary_mhc import MhcKernelConfig
    from layer_boundary_mhc import bench

    assert _bench(["--device", "cpu", "--tune", "WARPS=4", "--out", str(tmp_path)]) == 2
    assert "--tune 'WARPS=4': give NAME=VALUE with NAME a field of MhcKernelConfig: decode_tokens" in (
        capsys.readouterr().err)
    assert _bench(["--device", "cpu", "--tune", "num_warps=4", "--out", str(tmp_path)]) == 2
    assert "num_warps takes three values (decode, mid and prefill token counts)" in capsys.readouterr().err
    assert _bench(["--device", "cpu", "--tune", "finish_rows=3", "--out", str(tmp_path)]) == 2
    assert "must divide finish_tokens=8" in capsys.readouterr().err
    assert bench._apply_tuning([]) == (MhcKernelConfig(), {})
    config, applied = bench._apply_tuning(["lag=8", "slice_cols=64,128,256", "push=0"])
    assert config == MhcKernelConfig(lag=8, slice_cols=(64, 128, 256), push=False)
    assert applied == {"lag": 8, "slice_cols": (64, 128, 256), "push": False}
    assert set(bench.PER_BUCKET) <= set(bench.TUNABLE)


# -- the reference check (bench mhc's and the tests'), no kernels needed ---------------------------------


def _neighbour(t: torch.Tensor, index: tuple, steps: int = 1) -> torch.Tensor:
    """``t`` with ``t[index]`` moved ``steps`` bf16 values away from zero."""
    out = t.clone()
    out.view(torch.int16)[index] += steps
    return out


def test_the_check_takes_a_stream_rounded_the_other_way_and_the_read_of_it():
    """What a correct kernel may return (the first H200 run's "failure"): one stream element on
    the neighbouring bf16 value (its FP32 sum lay within FP32 ulps of a rounding boundary) and the
    read of those streams, whose coefficients then lie further from the reference's than FP32
    accuracy. The check passes it, and fails a read of other streams, two ulps, another token's
    coefficients and a NaN."""
    from layer_boundary_mhc import bench

    i = bench._inputs(4, 4, 256, BF16, "cpu")
    method = bench.MhcMethod("kernel", "update+read", lambda _: ())
    streams = mhc_update_ref(i.x, i.y, i.h_post, i.h_res)
    at = tuple(int(v) for v in torch.unravel_index(streams.float().abs().argmax(), streams.shape))
    read = lambda s: mhc_read_ref(s, i.params, i.w, bench.EPS)  # noqa: E731
    ref = (streams, *read(streams))
    flipped = _neighbour(streams, at)
    got = (flipped, *read(flipped))
    assert (got[2] - ref[2]).abs().max() > 2 * TOLERANCE[BF16]["coefficients"][0]  # end to end
    check = bench._check(method, got, i)
    assert check["ok"] and 0.5 < check["deviations"]["streams"]["tol"] <= 1, check
    assert bench._check(method, ref, i)["tol"] == 0
    assert not bench._check(method, (flipped, *ref[1:]), i)["ok"]
    twice = _neighbour(streams, at, 2)
    assert bench._check(method, (twice, *read(twice)), i)["deviations"]["streams"]["tol"] > 1
    assert not bench._check(method, (*got[:3], got[3][[1, 0, 2, 3]]), i)["ok"]
    nan = got[1].clone()
    nan[0, 0] = float("nan")
    assert "input" in bench._check(method, (got[0], nan, *got[2:]), i)["worst"]


def test_tolerances_scale_with_the_cancel_free_magnitude():
    """Where the streams cancel in the combination, the input is allowed the FP32 error of the
    terms (atol times rstd |w| sum_j |x_j|), not of the normalized result."""
    from layer_boundary_mhc.coefficients import mhc_coefficients

    p = MhcStageParams(2, 8).requires_grad_(False)
    p.init_random(torch.Generator().manual_seed(0))
    x = torch.tensor([[[4.0] * 8, [-4.0] * 8]])
    w = torch.ones(8)
    h_pre = mhc_coefficients(x, p)[0][0]
    magnitude = float(8 / (4 * (h_pre[0] - h_pre[1])).abs())  # rstd |w| (|x_0| + |x_1|)
    assert magnitude > 4  # the streams cancel: the normalized input is 1
    atol, rtol = TOLERANCE[FP32]["input"]
    want = mhc_read_ref(x, p, w, EPS)
    devs = compare("read", (want[0] + 1e-5, *want[1:]), x, params=p, norm_weight=w, norm_eps=EPS)
    assert [d.output for d in devs] == ["input", "h_post", "h_res"] and all(d.ok for d in devs)
    assert devs[0].allowed == pytest.approx(atol * magnitude + rtol, rel=1e-4)
    with pytest.raises(AssertionError, match=r"read out of tolerance: input: max \|diff\| 0.001"):
        assert_matches_reference("read", (want[0] + 1e-3, *want[1:]), x, params=p, norm_weight=w, norm_eps=EPS)


# -- sm_90 compile, no GPU needed ---------------------------------------------------------------------


def _record(t: int, update: bool, cooperative: bool = True, n: int = 4, c: int = 4096, dtype=BF16, config=None):
    from layer_boundary_mhc import triton_mhc as tm
    from layer_boundary_mhc import triton_ops as ops
    from mhc_sm90 import Recorder

    p = MhcStageParams(n, c).requires_grad_(False)
    x, y, w = torch.empty(t, n, c, dtype=dtype), torch.empty(t, c, dtype=dtype), torch.empty(c, dtype=dtype)
    h_post, h_res = torch.empty(t, n), torch.empty(t, n, n)
    config = config or MhcKernelConfig()
    rec = Recorder(tm.mhc_boundary_kernel)
    ops._launch_boundary(rec, x, y if update else None, h_post if update else None, h_res if update else None,
                         torch.empty_like(x) if update else None, *ops._param_tensors(p, x, config), w,
                         torch.empty(t, c, dtype=dtype), torch.empty(t, n), torch.empty(t, n, n), EPS, EPS, 0.0, 20,
                         cooperative, config)
    return rec


@needs_triton
def test_phi_is_split_once_per_parameter_version():
    from layer_boundary_mhc import triton_ops as ops

    p = MhcStageParams(2, 8).requires_grad_(False)
    p.init_random(torch.Generator().manual_seed(0))
    x = torch.zeros(1, 2, 8, dtype=BF16)  # a decode-sized block reads phi's TF32 parts
    parts = ops._param_tensors(p, x)[1]
    assert parts.shape == (2, 8, 16) and torch.equal((parts[0] + parts[1]).t(), p.phi)
    assert (parts[0].view(torch.int32) & 8191).eq(0).all()  # the high part is exact in TF32
    assert ops._param_tensors(p, x)[1] is parts
    p.phi.mul_(2)  # a new version: split again
    again = ops._param_tensors(p, x)[1]
    assert again is not parts and torch.equal((again[0] + again[1]).t(), p.phi)


@needs_triton
def test_one_launch_at_decode_sizes_two_above_unless_chosen():
    """Two launches were faster on an H200 from T = 128 up (and phi is read split into TF32 parts
    by the small blocks only): what a call picks when the caller does not say, and the launches
    each form makes."""
    from dataclasses import replace

    from layer_boundary_mhc import triton_mhc as tm
    from layer_boundary_mhc import triton_ops as ops

    for t, coop, modes in ((16, None, [tm.COOPERATIVE]), (17, None, [tm.STREAM_PASS, tm.FINISH]),
                           (17, True, [tm.COOPERATIVE]), (2, False, [tm.STREAM_PASS, tm.FINISH])):
        one = ops.one_launch(t, coop)
        rec = _record(t, update=False, cooperative=one, c=64)
        assert [meta["MODE"] for _, _, meta in rec.launches] == modes, (t, coop)
    assert ops.one_launch(17, None, replace(MhcKernelConfig(), cooperative_tokens=32))
    assert [tm.boundary_config(t, 4, 4096, 2).presplit for t in (1, 1024, 1025)] == [True, True, False]


@needs_triton
@pytest.mark.slow
def test_kernels_compile_for_sm90_with_wide_accesses_and_no_spills():
    """The cooperative kernel at a decode and a prefill size, and the update alone, compiled for
    Hopper: loads of streams, outputs and phi are 16-byte vectors (ld.global.v4 or cp.async of
    16 bytes), stores of x' and of the input too; the prefill projection runs on wgmma; the
    finish acquires what the stream passes release; nothing spills at the prefill size. The TF32
    pair's stream pass at every size (the joined one: test_joined_stream_pass_compiles_...)."""
    pytest.importorskip("triton.compiler")
    from layer_boundary_mhc import triton_mhc as tm
    from layer_boundary_mhc import triton_ops as ops
    from mhc_sm90 import Recorder, compile_launches

    if tm.INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 is set: the kernels are interpreted, not compiled")
    tf32 = MhcKernelConfig(joined=(0, 0, 0), num_warps=(8, 8, 8))
    try:
        decode, prefill = (compile_launches(_record(t, update=True, config=tf32))[0] for t in (1, 8192))
    except AttributeError as e:  # the binder and _pack_args are Triton internals
        pytest.skip(f"this Triton's JIT internals differ ({e}); the GPU tests compile the kernels")
    wide_load = r"ld\.global(?:\.cg)?\.v4|cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10"
    for k in (decode, prefill):
        assert k.count(wide_load) >= 5, "streams and phi are not loaded as 16-byte vectors"
        assert k.count(r"st\.global\.v4\.b32") >= 2, "x' and the input are not stored as 16-byte vectors"
        assert k.count(r"atom\.global\.gpu\.release") == 1 and k.count(r"ld\.global\.gpu\.acquire") == 1
        assert k.count(r"atom\.global\.gpu\.acq_rel\.add") == 1  # the ticket
    assert prefill.count(r"wgmma\.mma_async") > 0, "the projection is not on Hopper tensor cores"
    assert decode.count(r"\bmma\.sync") > 0
    assert prefill.spill_bytes == 0, f"{prefill.spill_bytes} bytes of register spills"
    # 249 when Triton recomputed the mix in the MMA's layout as well as the store's (_store_cast).
    assert prefill.registers <= 200, f"{prefill.registers} registers: is the mix computed twice?"
    assert prefill.shared <= 200 * 1024
    (mid, _) = compile_launches(_record(1024, update=True, cooperative=False, config=tf32))  # stream passes, finishes
    # phi read split (phi_parts): two 8-warp stream passes an SM; 173 registers when split per chunk.
    assert mid.spill_bytes == 0 and mid.registers <= 128, f"{mid.registers} registers, {mid.spill_bytes} B spilled"
    # The chunk's 2 n tiles of phi's parts, 16 bytes a thread each (the K-major layout the MMA reads).
    assert mid.count(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10") >= 8, "phi not copied as vectors"
    rec = Recorder(tm.mhc_update_kernel)
    t, n, c = 64, 4, 4096
    x = torch.empty(t, n, c, dtype=BF16)
    ops._launch_update(rec, x, torch.empty(t, c, dtype=BF16), torch.empty(t, n), torch.empty(t, n, n),
                       torch.empty_like(x))
    (update,) = compile_launches(rec)
    assert update.count(r"ld\.global\.v4\.b32") >= 5 and update.count(r"st\.global\.v4\.b32") >= 4
    assert update.spill_bytes == 0


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("warps", [4, 8])
def test_joined_stream_pass_compiles_to_two_programs_an_sm(warps):
    """``stream_joined`` at the prefill size (BT = 64, the default 4 warps and 8): bf16 wgmma, no
    spills, registers for two programs an SM (128 at 8 warps); and, for the one launch, the
    stream pass and finish in one kernel within the same count."""
    from layer_boundary_mhc import triton_mhc as tm
    from mhc_sm90 import compile_launches

    if tm.INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 is set: the kernels are interpreted, not compiled")
    config = MhcKernelConfig(joined=(0, 0, 1), joined_warps=(8, 8, warps))
    try:
        stream_pass, finish = compile_launches(_record(8192, update=True, cooperative=False, config=config))
        (one,) = compile_launches(_record(8192, update=True, cooperative=True, config=config))
    except AttributeError as e:
        pytest.skip(f"this Triton's JIT internals differ ({e}); the GPU tests compile the kernels")
    assert stream_pass.meta["JOINED"] == 1 and stream_pass.count(r"wgmma\.mma_async[^ ]*\.bf16\.bf16") > 0
    assert one.meta["MODE"] == tm.COOPERATIVE
    for k in (stream_pass, one):
        assert k.spill_bytes == 0 and k.registers * 32 * warps * 2 <= 65536, (
            f"{k.registers} registers, {k.spill_bytes} B spilled")
    # Pure roundings only (torch.compile's analysis of written arguments reads no impure assembly).
    assert stream_pass.meta["CASTS"] != tm.CAST_PTX and finish.meta["CASTS"] != tm.CAST_PTX


# -- GPU (one launch against two: test_mhc_launch_forms.py) -------------------------------------------

from mhc_gpu import _inputs, _launch_forms_agree, _ops, _params  # noqa: E402


def _one_rounding(got, want, dtype, what, where=""):
    # The same kernels through Inductor: at most the final rounding apart.
    torch.testing.assert_close(got, want, atol=0, rtol=TOLERANCE[dtype][what][1], msg=lambda m: f"{where} {what}: {m}")


GPU_CASES = [(t, 4, c, BF16) for t in (1, 17, 1024) for c in (1000, 4096, 7168)]
GPU_CASES += [(t, n, c, d) for d in (FP16, FP32) for (t, n, c) in ((1, 4, 4096), (33, 4, 4097), (200, 2, 129),
                                                                    (64, 8, 512), (5, 1, 7), (300, 3, 20000))]


@pytest.mark.gpu
@pytest.mark.parametrize("t,n,c,dtype", GPU_CASES, ids=str)
def test_gpu_eager_matches_the_reference(t, n, c, dtype):
    ops = _ops()
    x, y, w, hp, hr = _inputs(t, n, c, dtype, stride=3 if t == 17 else 0)
    p = _params(n, c)
    where = f"T={t} n={n} C={c} {dtype}"
    offset = float(t % 2)
    got = ops.mhc_update_read_triton(x, y, hp, hr, p, w, EPS, norm_offset=offset, cooperative=True)
    kw = dict(y=y, h_post=hp, h_res=hr, params=p, norm_weight=w, norm_eps=EPS, norm_offset=offset)
    assert_matches_reference("update+read", got, x, where=where, **kw)
    two = ops.mhc_update_read_triton(x, y, hp, hr, p, w, EPS, norm_offset=offset, cooperative=False)
    if not _launch_forms_agree(got, two, t, n, c, dtype, where):
        assert_matches_reference("update+read", two, x, where=f"{where} two launches", **kw)
    assert_matches_reference("read", ops.mhc_read_triton(x, p, w, EPS, norm_offset=offset), x, where=where, **kw)
    assert_matches_reference("update", (ops.mhc_update_triton(x, y, hp, hr),), x, where=where, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("t,c", [(8192, 4096), (32768, 4096), (8192, 7168)], ids=str)
def test_gpu_prefill_sizes_match_the_reference(t, c):
    ops = _ops()
    x, y, w, hp, hr = _inputs(t, 4, c, BF16, seed=t)
    p = _params(4, c, seed=2)
    got = ops.mhc_update_read_triton(x, y, hp, hr, p, w, EPS)
    assert_matches_reference("update+read", got, x, y=y, h_post=hp, h_res=hr, params=p, norm_weight=w,
                             norm_eps=EPS, where=f"T={t}")


def _step(x, y, hp, hr, p, w):
    ops = _ops()
    streams, inp, h_post, h_res = ops.mhc_update_read_triton(x, y, hp, hr, p, w, EPS)
    inp2, h_post2, h_res2 = ops.mhc_read_triton(streams, p, w, EPS, norm_offset=1.0)
    return streams, inp, inp2, ops.mhc_update_triton(streams, inp2, h_post2, h_res2)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [16, 2048])
def test_gpu_cuda_graph_replay_equals_eager(t):
    """Captured (the workspace and the zeroed ticket counters are graph allocations and memsets),
    outputs poisoned, replayed: bitwise the eager result."""
    x, y, w, hp, hr = _inputs(t, 4, 4096, BF16, seed=7)
    p = _params(4, 4096, seed=8)
    want = _step(x, y, hp, hr, p, w)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _step(x, y, hp, hr, p, w)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _step(x, y, hp, hr, p, w)
    for _ in range(2):
        for o in outs:
            o.view(torch.uint8).fill_(0xFF)  # NaN in bf16
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(g, e) for g, e in zip(outs, want))


@pytest.mark.gpu
def test_gpu_compiled_fullgraph_matches_eager():
    """Dynamo sends the wrappers to the layer_boundary_mhc operators and Inductor inlines the
    kernels; token counts of two launch shapes (the second recompiles with a dynamic T), the
    last the prefill shape."""
    torch._dynamo.reset()
    p = _params(4, 4096, seed=9)
    compiled = torch.compile(lambda x, y, hp, hr, w: _step(x, y, hp, hr, p, w), fullgraph=True)
    for t in (64, 200, 2048):
        x, y, w, hp, hr = _inputs(t, 4, 4096, BF16, seed=t)
        want = _step(x, y, hp, hr, p, w)
        got = compiled(x, y, hp, hr, w)
        for g, e, what in zip(got, want, ("streams", "input", "input", "streams")):
            _one_rounding(g, e, BF16, what, f"compiled T={t}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_gpu_model_selects_triton_and_matches_the_torch_reference(dtype):
    from layer_boundary import ForwardBatch
    from layer_boundary_app.models import Qwen3ForCausalLM, init_random_weights, small_random_config

    def model(kernels: str) -> Qwen3ForCausalLM:
        m = Qwen3ForCausalLM(small_random_config(), dtype=dtype, residual=MhcSemantics(kernels=kernels, seed=3))
        init_random_weights(m, seed=0)
        return m.eval().requires_grad_(False).cuda()

    fast, ref = model("triton"), model("torch")
    read = fast.model.layers[0].attn_boundary.plan.read
    assert read.kernels.reason("cuda", dtype).startswith("triton: ")
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3]).cuda()
    pos = torch.arange(10).cuda()
    with torch.inference_mode():
        got = fast(ids, pos, ForwardBatch(num_tokens=10, positions=pos))
        want = ref(ids, pos, ForwardBatch(num_tokens=10, positions=pos))
    tol = dict(atol=1e-3, rtol=1e-3) if dtype == FP32 else dict(atol=0.25, rtol=0.05)  # logits ~10
    torch.testing.assert_close(got, want, **tol)
    with pytest.raises(ValueError, match=r"kernels='triton'\) cannot run the Triton kernels on these streams"):
        read.read(torch.zeros(2, 4, read.params.hidden_size, dtype=dtype))  # CPU streams


def test_auto_runs_the_kernels_on_nvidia_gpus_and_keeps_the_reference_on_rocm(monkeypatch):
    """The GPU suite passed on an H200: "auto" loads the kernels where CUDA is NVIDIA's; on a ROCm
    build of torch, where they have not run, it keeps the torch reference and says why."""
    from layer_boundary_mhc import selection

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    sel = selection.select_kernels("auto", 4, "rmsnorm")
    if selection.triton_unavailable():
        pytest.skip(f"the kernels cannot load here: {selection.triton_unavailable()}")
    assert sel.ops is not None and sel.refused is None and sel.why_not("cuda", torch.bfloat16) is None
    monkeypatch.setattr(torch.version, "hip", "6.4")
    sel = selection.select_kernels("auto", 4, "rmsnorm")
    assert sel.ops is None and sel.refused == selection.UNVERIFIED
    assert sel.reason("cuda", torch.bfloat16) == f"torch reference: {selection.UNVERIFIED}"
