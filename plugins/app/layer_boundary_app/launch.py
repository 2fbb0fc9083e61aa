"""Run a function on N ranks over torch.distributed (spawned processes, or under torchrun).

A rank that raises stops the whole run: the others are terminated and the caller gets that
rank's traceback, within the process-group timeout at worst, never a hang.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import shutil
import tempfile
import traceback
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankError", "spawn", "under_torchrun", "init_rank"]


class RankError(RuntimeError):
    """A rank failed; ``rank`` and the remote traceback are in the message."""

    def __init__(self, rank: int, remote: str) -> None:
        super().__init__(f"rank {rank} failed:\n{remote}")
        self.rank = rank
        self.remote = remote


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def init_rank(rank: int, world_size: int, backend: str, store_path: str, timeout_s: float) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast here
    # A file store: no TCP port to pick, so no race with other processes for a free one.
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=torch.device("cuda", rank % torch.cuda.device_count()) if backend == "nccl" else None,
    )


def _worker(rank: int, world_size: int, backend: str, store_path: str, timeout_s: float,
            fn: Callable[..., Any], args: Sequence[Any], results: Any) -> None:
    try:
        torch.set_num_threads(1)  # N ranks share the host's cores
        hang_dump = os.environ.get("LAYER_BOUNDARY_HANG_DUMP_S")
        if hang_dump:
            # Diagnosing a rank that stops making progress: its stacks go to stderr after that
            # many seconds (and every as many again), where a parent's timeout would leave nothing.
            import faulthandler

            try:
                seconds = float(hang_dump)
                if not seconds > 0:
                    raise ValueError
            except ValueError:
                raise ValueError(f"LAYER_BOUNDARY_HANG_DUMP_S={hang_dump!r}: give a number of seconds above 0, "
                                 "or unset it") from None
            faulthandler.dump_traceback_later(seconds, repeat=True)
        init_rank(rank, world_size, backend, store_path, timeout_s)
        out = fn(rank, world_size, *args)
        # Plain pickle bytes, not the queue's torch reduction: that one hands tensors over as
        # file descriptors served by this process, which may have exited before the parent reads
        # them (FileNotFoundError in the parent, seen in CI-like runs).
        try:
            payload = pickle.dumps(out)
        except Exception:
            payload = pickle.dumps(repr(out))
        results.put((rank, True, payload))
    except BaseException:  # report everything, SystemExit included
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _root_cause(failure: RankError, procs: list, got: dict, results: Any) -> RankError:
    """A rank whose collective broke usually reports a peer that died first: name that peer."""
    import time

    deadline = time.monotonic() + 3.0
    reported = {failure.rank}
    while time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if i not in got and i not in reported and not p.is_alive() and p.exitcode not in (0, None):
                return RankError(i, f"exited with code {p.exitcode} without a report; rank "
                                    f"{failure.rank} then failed:\n{failure.remote}")
        try:
            rank, ok, payload = results.get(timeout=0.2)
            if not ok:
                reported.add(rank)
        except queue.Empty:
            pass
    return failure


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> list[Any]:
    """``[fn(rank, world_size, *args) for each rank]``, each in its own process.

    ``fn`` must be importable (a module-level function). Returns the per-rank results in rank
    order; raises :class:`RankError` with the first failing rank's traceback.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: use 'gloo' (CPU) or 'nccl' (GPUs)")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"--backend nccl with {world_size} ranks needs {world_size} GPUs; "
            f"{torch.cuda.device_count()} visible"
        )
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="layer-boundary-")
    store_path = os.path.join(store_dir, "store")
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, backend, store_path, timeout_s, fn, tuple(args), results),
                    daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    failure: Optional[RankError] = None
    deadline = timeout_s * 2 + 60
    waited = 0.0
    try:
        while len(got) < world_size and failure is None:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
                dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in got]
                if dead and all(not p.is_alive() for p in procs) or (dead and waited > 5):
                    # A rank died without reporting (killed, segfault): give the queue a moment.
                    try:
                        rank, ok, payload = results.get(timeout=2.0)
                    except queue.Empty:
                        code = procs[dead[0]].exitcode
                        failure = RankError(dead[0], f"exited with code {code} without a report")
                        break
                elif waited > deadline:
                    failure = RankError(-1, f"no result after {deadline:.0f} s")
                    break
                else:
                    continue
            if ok:
                got[rank] = pickle.loads(payload)
            else:
                failure = _root_cause(RankError(rank, payload), procs, got, results)
    finally:
        if failure is not None:
            for p in procs:
                if p.is_alive():
                    p.terminate()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        shutil.rmtree(store_dir, ignore_errors=True)
    if failure is not None:
        raise failure
    return [got[r] for r in range(world_size)]
