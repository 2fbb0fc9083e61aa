"""Rank functions for tests/app/test_launch.py (importable by spawned processes)."""

import time

import torch
import torch.distributed as dist


def sum_ranks(rank: int, world: int, offset: int) -> float:
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return t.item()


def one_rank_fails(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.all_reduce(torch.zeros(1))  # would wait for rank 1 forever
    return 0


def one_rank_dies(rank: int, world: int) -> int:
    if rank == 1:
        import os

        os._exit(3)  # no traceback, no report
    time.sleep(0.5)
    dist.all_reduce(torch.zeros(1))
    return 0
