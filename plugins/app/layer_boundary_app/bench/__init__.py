"""Benchmarks behind ``layer-boundary bench``. Speed is measured here, never in tests.

``host`` (boundary host overhead on CPU), ``norm`` (add+RMSNorm providers against torch peers),
``allreduce`` (fused all-reduce + add + RMSNorm candidates against NCCL + a separate kernel),
``finalize`` (the fused MoE finalize handoff against NCCL + separate kernels) and ``decode`` (a
Qwen3 decode step with and without boundaries); ``timing`` (CUDA-graph replay, copy bandwidth),
``report`` (table, JSON, SVG) and ``candidates`` (fusion as construction accepted it) serve them.
"""
