"""The MHC kernels' settings: one frozen value passed to kernel selection, and from there to every launch.

``MhcKernelConfig()`` is what the plugin runs by default, the settings measured fastest on an H200
(n = 4, H = 4096, bf16; ``plugins/mhc/PERFORMANCE.md`` has the figures and their dates). A field
exists because a user or a test has a reason to vary it; the docstring of each says which.
Facts (hardware limits, ``coefficients.MAX_STREAMS``) stay constants in their modules.

Use::

    from dataclasses import replace
    from layer_boundary_mhc import MhcKernelConfig, MhcSemantics

    semantics = MhcSemantics(kernel_config=MhcKernelConfig(split_tokens=0))  # no split variant
    tuned = replace(MhcKernelConfig(), lag=8, slice_cols=(128, 128, 256))

Per-bucket fields (tuples of three) hold one value for each token bucket of the Triton kernels:
decode (at most ``decode_tokens``), mid (at most ``mid_tokens``) and prefill (above).

No torch, no Triton: importable anywhere, as the plugin's manifest must be.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["MhcKernelConfig", "DEFAULT_CONFIG", "PER_BUCKET"]

Bucketed = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class MhcKernelConfig:
    """Settings of the MHC Triton kernels and of the CuTe DSL cluster kernels (sm_90)."""

    # -- Triton: which token counts fall in which bucket, and which launch form an open choice takes
    decode_tokens: int = 16
    """Largest call of the decode bucket: one 16-token block (the smallest MMA) a decode step."""
    mid_tokens: int = 1024
    """Largest call of the mid bucket; above it, the prefill bucket's shapes."""
    cooperative_tokens: int = 16
    """Calls of at most this many tokens take the one-launch (ticket) form when the caller leaves the
    launch form open; above, two launches (faster at every size measured on an H200, where a second
    host launch costs more than the 1.4 µs one launch saves only at decode sizes)."""
    presplit_tokens: int = 32
    """Blocks of at most this many tokens read phi's TF32 parts split once beforehand (``mma.sync``);
    larger blocks split phi in the stream pass (same instruction count on wgmma, half the L2 bytes).
    0 turns the pre-split off (the interpreter tests cover both)."""

    # -- Triton: launch shapes (the interpreter tests shrink them to reach every path at small sizes)
    block_tokens: Bucketed = (16, 32, 64)
    """Tokens a block of the TF32 stream pass, per bucket: phi is read from L2 once a block and
    stream pass (1.5 MiB / BT a token at n = 4, H = 4096)."""
    joined_block_tokens: Bucketed = (16, 64, 64)
    """The same for the joined (bf16) stream pass, whose 64-token blocks run on wgmma."""
    slice_cols: Bucketed = (128, 256, 256)
    """Columns a stream pass covers (288 KiB of traffic at 64 tokens, 256 columns); narrower at
    decode, to spread the read of phi over more SMs."""
    finish_tokens: int = 8
    """Tokens a finish normalizes (TB)."""
    finish_rows: int = 1
    """Tokens a finish normalizes at once (a divisor of ``finish_tokens``)."""
    lag: int = 4
    """Rounds of tickets between a block's stream passes and its finishes in the one-launch form:
    its finishes rarely wait, while the x' in between stays in L2."""
    stage_bytes: int = 112 * 1024
    """Shared memory the pipelined loads of a stream pass may take (of 227 KiB)."""
    joined: Bucketed = (0, 1, 1)
    """1: bf16 streams take ``stream_joined``'s stream pass in that bucket (the n streams one MMA
    operand against phi's bf16 parts; 505 -> 218 µs of stream passes at T = 8192). Decode keeps the
    TF32 pair (the joined pass on mma.sync compiled to twice the instructions)."""
    evict: Bucketed = (0, 0, 1)
    """1: the joined stream pass's inputs and the finishes' x' loads evict-first, x' stored
    evict-last in L2 (two launches at prefill: 1 % faster)."""
    num_warps: Bucketed = (8, 8, 8)
    """Warps of a TF32-pass program (stream pass and finish share the program size)."""
    joined_warps: Bucketed = (8, 4, 4)
    """Warps of a joined-pass program: at prefill one warpgroup takes the 64-token MMA whole
    (218 against 280 µs of stream passes at T = 8192)."""
    finish_warps: int = 0
    """Warps of a finish launched on its own (two launches); 0: 4 for row tiles up to 4096
    columns, 8 above (H = 7168, T = 8192: 170 against 324 µs with 4)."""
    joined_programs: int = 2
    """Programs an SM the joined kernels keep registers for (a cap of 64K / (this x threads));
    0: no cap."""
    max_tile: int = 8192
    """Widest row a finish holds in registers; wider rows are normalized in ``chunk``-wide pieces,
    read twice (tests lower both to reach the chunked path at small widths)."""
    chunk: int = 4096
    """Width of those pieces."""

    # -- CuTe DSL cluster kernel (sm_90): which calls an open launch form hands it
    update_read_tokens: tuple[int, int] = (1, 384)
    """Token range whose update+reads go to the cluster kernel (13.3 against 15.4 µs at T = 1, 23.5
    against 32.9 at 384; from 512 the Triton kernels are faster). ``(0, -1)`` sends none."""
    read_tokens: tuple[int, int] = (1, 384)
    """The same for reads."""
    split_tokens: int = 1024
    """Calls of at least this many tokens run the split variant where it fits (n = 2 to 4, H up to
    4096; 70 % of the roofline at T = 8192); 0: never."""
    persistent_tokens: int = 0
    """Calls of at least this many tokens (after ``split_tokens``) run the persistent variant where
    it fits; 0: never (the default: it ties the Triton two launches, which serve every shape)."""

    # -- the cluster kernel's shape (``cluster_shape`` falls back to smaller forms where it does not fit)
    cluster: int = 16
    """CTAs a cluster (16, a non-portable size Hopper allows: 256-column slices at H = 4096)."""
    cluster_block_tokens: int = 32
    """Tokens a cluster's block."""
    cluster_warps: int = 8
    """Warps a CTA."""
    cluster_ctas: int = 2
    """CTAs an SM shared memory is sized for: two let one CTA's exchanges overlap another's stream
    pass (557 against 589 µs for one CTA of 64 tokens, T = 8192)."""
    cluster_stages: int = 0
    """Chunks in flight a CTA (0: as many as shared memory holds)."""
    push: bool = True
    """The cluster's exchanges as st.async stores completing the receivers' mbarriers; False: three
    cluster barriers around plain stores (the same bits, 380.5 against 370.1 µs at T = 8192), the
    protocol the push form is checked against bit for bit on the GPU."""
    sinkhorn_after_tokens: int = 512
    """From this many tokens the cluster kernel stores H_res's logits and a Triton Sinkhorn runs on
    all tokens after it (448.5 -> 382.8 µs at T = 8192); below, in one wave, it stays in the kernel."""
    sinkhorn_tokens: int = 64
    """Tokens a program of that Sinkhorn launch."""
    sinkhorn_warps: int = 2
    """Its warps (64 tokens on 2 warps: 3.5 µs at T = 8192 against 6.8 on 4)."""

    # -- persistent and split variants
    persistent_warps: int = 8
    """Warps a CTA of the persistent and split variants."""
    split_finishers: int = 36
    """SMs at least left to the split variant's finisher CTAs (an H200's 132: 6 sets of 16 stream
    CTAs and 36 finishers; 20 finishers were too few: 337.8 against 236.2 µs at T = 8192)."""
    split_producers: int = 3
    """Producer warps of a finisher CTA (3 of one token: 234.1 against 242.7 µs for 2 of two)."""
    split_produce_depth: int = 1
    """Tokens a producer warp takes a step."""
    split_captured_words: int = 1 << 21
    """int32 words of ready counts set aside a device for calls captured in CUDA graphs (8 MiB: 4096
    captured calls of 8192 tokens); past them, captured calls zero their counts with a memset
    (about 1.3 µs a call) and warn. Raise it for many captured graphs."""

    _hash: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "_hash":
                continue
            value = getattr(self, f.name)
            if f.name in PER_BUCKET and (not isinstance(value, tuple) or len(value) != 3):
                raise ValueError(f"MhcKernelConfig({f.name}={value!r}): give a tuple of three values "
                                 "(decode, mid and prefill token counts), e.g. (16, 32, 64)")
            if f.name in ("update_read_tokens", "read_tokens") and (not isinstance(value, tuple) or len(value) != 2):
                raise ValueError(f"MhcKernelConfig({f.name}={value!r}): give (lowest, highest) tokens")
            items = value if isinstance(value, tuple) else (value,)
            if any(isinstance(v, bool) and f.type != "bool" or not isinstance(v, int) for v in items):
                raise TypeError(f"MhcKernelConfig({f.name}={value!r}): integers only")
            if f.name not in ("update_read_tokens", "read_tokens") and min(items) < 0:
                raise ValueError(f"MhcKernelConfig({f.name}={value!r}) must not be negative")
        positive = ("decode_tokens", "mid_tokens", "finish_tokens", "finish_rows", "stage_bytes", "max_tile",
                    "chunk", "cluster", "cluster_block_tokens", "cluster_warps", "cluster_ctas", "sinkhorn_tokens",
                    "sinkhorn_warps", "persistent_warps", "split_producers", "split_produce_depth", "split_captured_words")
        for name in positive + ("block_tokens", "joined_block_tokens", "slice_cols", "num_warps", "joined_warps"):
            if min(_items(getattr(self, name))) < 1:
                raise ValueError(f"MhcKernelConfig({name}={getattr(self, name)!r}) must be at least 1")
        if self.finish_tokens % self.finish_rows:
            raise ValueError(f"MhcKernelConfig(finish_rows={self.finish_rows}) must divide "
                             f"finish_tokens={self.finish_tokens}")
        if self.decode_tokens > self.mid_tokens:
            raise ValueError(f"MhcKernelConfig: decode_tokens={self.decode_tokens} is above "
                             f"mid_tokens={self.mid_tokens}")
        # Hashed once: the config keys the launch-shape caches, looked up on every call.
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self) if f.compare)))

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        # The fields that differ from the default: the whole list is 37 fields long.
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                   if f.compare and getattr(self, f.name) != f.default]
        return f"MhcKernelConfig({', '.join(changed)})"

    def bucket(self, tokens: int) -> int:
        """0 (decode), 1 (mid) or 2 (prefill): the index of the per-bucket fields for a call."""
        return 0 if tokens <= self.decode_tokens else 1 if tokens <= self.mid_tokens else 2


def _items(value: Any) -> tuple:
    return value if isinstance(value, tuple) else (value,)


PER_BUCKET = ("block_tokens", "joined_block_tokens", "slice_cols", "joined", "evict", "num_warps", "joined_warps")
DEFAULT_CONFIG = MhcKernelConfig()
