"""Compile-time shape of the MHC cluster kernel (``cute_cluster``): sizes, shared-memory plan and
why a shape does not fit. No ``cutlass`` import, so eligibility is decided anywhere."""

from __future__ import annotations

WARPS = 8
THREADS = 32 * WARPS
SMEM_LIMIT = 227 * 1024


class ClusterShape:
    """Compile-time shape of one variant (n streams, hidden size C, cluster CL, block BT)."""

    def __init__(self, n: int, hidden: int, cluster: int, block_tokens: int, update: bool, iters: int,
                 stages: int = 0) -> None:
        self.n, self.c, self.cl, self.bt, self.update, self.iters = n, hidden, cluster, block_tokens, update, iters
        self.hs = hidden // cluster
        self.nch = self.hs // 16
        self.k = n * n + 2 * n
        self.nt = (self.k + 7) // 8
        self.kpad = 8 * self.nt
        self.mt = block_tokens // 16
        self.kh = WARPS // self.mt
        self.tpc = block_tokens // cluster
        self.units = self.hs // 8
        self.xr_bytes = n * block_tokens * self.hs * 2
        self.sx = n * block_tokens * 32
        self.sy = block_tokens * 32 if update else 0
        self.phi_chunk = n * 3 * self.nt * 256
        self.stage_bytes = self.sx + self.sy + self.phi_chunk
        self.part_bytes = block_tokens * (self.kpad + 1) * 4
        self.wp_bytes = WARPS * 16 * (self.kpad + 1) * 4
        self.hpre_bytes = block_tokens * n * 4
        self.hsq_bytes = cluster * block_tokens * 4
        fixed = self.xr_bytes + self.part_bytes + self.hpre_bytes + self.hsq_bytes + 1024
        self.stages = stages or max(2, min(6, (SMEM_LIMIT - fixed) // self.stage_bytes))
        self.smem = fixed + self.stages * self.stage_bytes
        self.problem = self._problem()

    def _problem(self) -> str:
        if self.n > 4:
            return f"n = {self.n} streams (at most 4)"
        if self.c % (self.cl * 16):
            return f"hidden size {self.c} is not a multiple of {self.cl * 16} (cluster of {self.cl} x 16 columns)"
        if self.hs % 64:
            return f"{self.hs} columns a CTA (a multiple of 64: the resident x' is swizzled in 8-unit groups)"
        if self.bt % 16 or WARPS % self.mt or self.bt % self.cl or not 1 <= self.tpc <= WARPS:
            return f"block of {self.bt} tokens does not fit a cluster of {self.cl}"
        if self.smem > SMEM_LIMIT or self.stages * self.stage_bytes < self.wp_bytes:
            return f"{self.smem} bytes of shared memory (at most {SMEM_LIMIT})"
        return ""
