"""Workers for the GPU tests (NCCL ranks spawned by tests/gpu/test_gpu_parallel.py)."""

from __future__ import annotations

from typing import Any

import torch

import parallel_cases


def nccl_matrix(rank: int, world: int, linear: list[dict[str, Any]], qwen: list[dict[str, Any]]) -> dict[str, Any]:
    """The gloo matrix again on NCCL: the linear stack bitwise in float64, Qwen3 in bfloat16."""
    from layer_boundary_app.models.runner import RunSpec, build_model, rank_forward, single_rank_logits

    linear_results = parallel_cases.linear_matrix(rank, world, linear, device="cuda")
    qwen_results = []
    for case in qwen:
        spec = RunSpec(sequences=tuple(tuple(s) for s in case["sequences"]), tp=world, dp=case["dp"],
                       reduction=case["policy"], dtype=case["dtype"], plugins=False, device="cuda",
                       input_scattered=case.get("scattered", False), config_overrides=case.get("config", {}))
        model = build_model(spec, parallel_cases.topology(world, case["dp"]), "cuda")
        idx, logits, _ = rank_forward(model, spec, "cuda")
        want = single_rank_logits(spec, "cuda")
        scale = want.abs().max().item()
        diff = (logits - want[idx]).abs().max().item() if idx else 0.0
        qwen_results.append({"case": case, "max_diff": diff, "scale": scale})
    return {"linear": linear_results, "qwen3": qwen_results}


def graph_decode(rank: int, world: int, dp: int, policy: str, batch: int) -> dict[str, Any]:
    """A decode step (one token per sequence) with boundaries, eager vs CUDA-graph replay."""
    from layer_boundary import ForwardBatch
    from layer_boundary_app.models.runner import RunSpec, build_model

    spec = RunSpec(sequences=tuple((i + 1,) for i in range(batch * dp)), tp=world, dp=dp,
                   reduction=policy, dtype="bfloat16", plugins=False, device="cuda")
    topo = parallel_cases.topology(world, dp) if world > 1 else None
    from layer_boundary import Topology

    model = build_model(spec, topo or Topology.single(), "cuda")
    ids = torch.arange(1, batch + 1, device="cuda") + 7 * (model.topology.attn_dp.rank)
    pos = torch.zeros(batch, dtype=torch.long, device="cuda")

    def step() -> torch.Tensor:
        fb = ForwardBatch(num_tokens=batch, positions=pos, seq_lens=(1,) * batch,
                          dp_num_tokens=(batch,) * dp if dp > 1 else None)
        return model(ids, pos, fb)

    with torch.inference_mode():
        eager = step().clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        equal = bool(torch.equal(out, eager))
        # New inputs in the same static buffers: the replay follows them.
        ids.add_(3)
        eager2 = step().clone()
        graph.replay()
        torch.cuda.synchronize()
        equal2 = bool(torch.equal(out, eager2))
    return {"equal": equal, "equal_after_new_inputs": equal2, "shape": tuple(out.shape)}
