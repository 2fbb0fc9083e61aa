"""pytest plugin (``-p split_default`` with ``benchmarks/sweeps`` on the path): the MHC split variant
as the default for update+reads from 1024 tokens (``cluster_ops.SPLIT_TOKENS``), so that the whole MHC
GPU suite runs with it before it becomes the default (``benchmarks/gpu_session.sh s``)."""


def pytest_configure(config):
    from layer_boundary_mhc import cluster_ops

    cluster_ops.SPLIT_TOKENS = 1024
