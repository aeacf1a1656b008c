"""Tiling and launch choices of the Triton GDN kernels: ``Config``, the launch table and ``get_config``.

Pure Python (no Triton import): the model's argument checks and the benchmark read it too.
DESIGN.md beside this file explains the tiles and the precision choices.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KernelCfg:
    """Per-kernel launch choice: warps, software-pipelining stages and, where the kernel has
    one, its column tile (``block``: BZ of the prep kernels, BV of the output and gradient
    kernels, BV of the state pass; 0 means the Config's shared BZ / BV / BV_PASS). ``maxnreg``
    caps the registers per thread (ptxas ``.maxnreg``; 0: the compiler's choice). The K = 32
    kernels are latency-bound at 1-2 warps per program with 235-255 registers per thread; a cap
    trades spills for more resident warps, which measured slower on an H200, so no TABLE entry
    sets one (``bench --tune --nregs`` tries them)."""

    num_warps: int = 2
    num_stages: int = 1
    block: int = 0
    maxnreg: int = 0


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiling. BT: tokens per chunk, the unit of the sequential state pass (a multiple of BC);
    BC: tokens per sub-chunk, the unit of the WY algebra (16 or 32; T = (I + A)⁻¹ is BC×BC);
    BZ: augmented columns per program in the prep kernels; BV: value columns per program in
    the output and gradient kernels (V > BV makes dq/dk/dg/dβ partial sums); BV_PASS: value
    columns per program in the state pass. A kernel's ``KernelCfg.block`` overrides its tile.

    dot_bf16: with bf16 inputs, the dots run on bf16 operands (fp32 accumulation) instead of
    tf32 on fp32 ones, except those with T = (I + A)⁻¹ (see t_bf16), the WY inverse and the
    state pass.
    t_bf16: with dot_bf16 on (so bf16 inputs), the dots with T and the key Gram matrix of A also
    run on bf16 operands, as fla keeps its A in bf16; T is then saved in bf16. T's entries
    cancel when keys collapse, which the collapsed-keys check bounds (DESIGN.md, Precision).
    inverse_prec: tl.dot's input_precision in the WY inverse's products: "ieee" (FMA, fp32) or
    "tf32x3" (three tf32 tensor-core passes, ~2⁻²¹ relative error). "tf32" is unsafe there
    (see ``wy._unit_lower_inverse``).
    local_sub_states: the forward saves every sub-chunk's start state and ``_bwd_local`` loads
    them in its reverse sweep, instead of re-running each chunk's forward into a scratch area
    (the "local_sub" backward; BT / BC times the saved state memory of "local").
    states_bf16: with bf16 dots (dot_bf16, bf16 inputs), the saved start states are stored in
    bf16: every dot that reads them rounds them to bf16 anyway. The recurrences inside the
    kernels and the final state stay fp32.
    prefetch_t: ``_bwd_local``'s reverse sweep loads the next sub-chunk's T one step ahead (the
    one load of that loop Triton does not software-pipeline)."""

    BT: int = 64
    BC: int = 16
    BZ: int = 64
    BV: int = 64
    BV_PASS: int = 16
    wy_inverse: KernelCfg = KernelCfg(1)
    fwd_prep: KernelCfg = KernelCfg()
    fwd_out: KernelCfg = KernelCfg()
    bwd_prep: KernelCfg = KernelCfg()
    bwd_local: KernelCfg = KernelCfg()
    state_pass: KernelCfg = KernelCfg(4)
    dot_bf16: bool = False
    inverse_prec: str = "ieee"
    t_bf16: bool = False
    local_sub_states: bool = False
    states_bf16: bool = False
    prefetch_t: bool = False

    def __post_init__(self):
        if self.BC not in (16, 32) or self.BT % self.BC:
            raise ValueError(f"BC must be 16 or 32 and divide BT, got BT = {self.BT}, BC = {self.BC}")
        if self.inverse_prec not in ("ieee", "tf32x3"):
            raise ValueError(f"inverse_prec must be 'ieee' or 'tf32x3', got {self.inverse_prec!r}")

    def tile(self, kernel: str) -> int:
        """The column tile that `kernel` runs with (0 for the inverse kernel, which has none)."""
        shared = {"fwd_prep": self.BZ, "bwd_prep": self.BZ, "fwd_out": self.BV, "bwd_local": self.BV,
                  "state_pass": self.BV_PASS}.get(kernel, 0)
        return (getattr(self, kernel).block or shared) if shared else 0

    def kernels(self) -> tuple[str, ...]:
        """The kernels this config launches, in launch order (both backward paths launch the same)."""
        return KERNELS

    @property
    def bwd_path(self) -> str:
        """The backward path, a BWD_PATHS key."""
        return "local_sub" if self.local_sub_states else "local"

    @property
    def slots(self) -> int:
        """Saved start states per chunk: one per sub-chunk with local_sub_states, else one."""
        return self.BT // self.BC if self.local_sub_states else 1


# The kernels in launch order (the state pass runs twice: forward, then in reverse); what
# `bench --tune` tunes.
KERNELS = ("wy_inverse", "fwd_prep", "state_pass", "fwd_out", "bwd_prep", "bwd_local")
# The two backward paths, as the Config field that picks one: "local" re-runs each chunk's
# forward into a scratch area in _bwd_local; "local_sub" loads the sub-chunk start states the
# forward saved.
BWD_PATHS = {"local": dict(local_sub_states=False), "local_sub": dict(local_sub_states=True)}

# Launch table by (K, V) class: the first entry (in key order) with K ≤ Kc and V ≤ Vc applies.
# Tiles: BT for N·H ≥ 128 (sequences × heads), BT_FEW below that (the state pass is then short
# of programs), BC, and BZ / BV / BV_PASS (0: derived, min(64, K + V) / min(V, 64) / 16 for
# V ≤ 64 else 32; explicit values are clamped to the head dims). Per kernel (num_warps,
# num_stages), (num_warps, num_stages, block) or (num_warps, num_stages, block, maxnreg), block
# 0 meaning the shared tile (KernelCfg). `python -m benchmarks.gdn.bench --tune` on a GPU prints
# its winners in this format, to paste here; the tuned entries' times are in BENCHMARKS.md.
_UNTUNED = dict(BT=64, BT_FEW=64, BC=16, BZ=64, BV=0, BV_PASS=0,
                wy_inverse=(1, 1), fwd_prep=(2, 1), state_pass=(4, 1), fwd_out=(2, 1),
                bwd_prep=(2, 1), bwd_local=(2, 1))
TABLE: dict[tuple[int, int], dict] = {
    # K = V ≤ 32 (HyMo): tuned on an H200 with Triton 3.6
    (32, 32): dict(BT=256, BT_FEW=256, BC=16, BZ=64, BV=32, BV_PASS=16,
                   wy_inverse=(1, 1), fwd_prep=(1, 3, 64), state_pass=(4, 3, 16), fwd_out=(1, 3, 32),
                   bwd_prep=(1, 3, 64), bwd_local=(2, 3, 32),
                   local_sub_states=True, states_bf16=True, dot_bf16=True, t_bf16=True, inverse_prec="tf32x3",
                   prefetch_t=True),
    # K = V = 64 and 256: not tuned
    (64, 64): _UNTUNED,
    # K = V = 128: tuned on an H200 with Triton 3.6 (two value blocks: dq/dk/dg/dβ are fp32
    # partial sums, summed by one kernel)
    (128, 128): dict(BT=64, BT_FEW=256, BC=16, BZ=64, BV=64, BV_PASS=32,
                     local_sub_states=True, states_bf16=True, dot_bf16=True, t_bf16=True, inverse_prec="tf32x3",
                     prefetch_t=True,
                     wy_inverse=(1, 1), fwd_prep=(4, 3, 128), state_pass=(8, 2, 64), fwd_out=(4, 3, 64),
                     bwd_prep=(4, 3, 64), bwd_local=(8, 3, 64)),
    (256, 256): _UNTUNED,
}

# Overrides for benchmarking/tuning, keyed by (K, V); read by both the real and the fake
# implementations, so change it only between whole forward/backward calls.
TUNING: dict[tuple[int, int], Config] = {}

# The TABLE entry keys that are not per-kernel launches.
_ENTRY_FIELDS = ("BT", "BT_FEW", "BC", "BZ", "BV", "BV_PASS", "dot_bf16", "t_bf16", "inverse_prec",
                 "local_sub_states", "states_bf16", "prefetch_t")


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def config_from_entry(K: int, V: int, NH: int, entry: dict) -> Config:
    """A Config for head dims K, V and NH = sequences × heads from a TABLE-style entry."""
    unknown = set(entry) - set(_ENTRY_FIELDS) - set(KERNELS)
    if unknown:
        raise ValueError(f"unknown launch table fields {sorted(unknown)}; known: {_ENTRY_FIELDS + KERNELS}")
    cap = dict(fwd_prep=triton_next_pow2(K + V), bwd_prep=triton_next_pow2(K + V), fwd_out=V, bwd_local=V,
               state_pass=V)
    kc = {}
    for n in KERNELS:
        if n in entry:
            c = KernelCfg(*entry[n])
            kc[n] = dataclasses.replace(c, block=min(c.block, cap[n])) if c.block and n in cap else c
    BZ = entry.get("BZ", 0) or min(64, triton_next_pow2(K + V))
    BV = entry.get("BV", 0) or min(V, 64)
    BV_PASS = entry.get("BV_PASS", 0) or (16 if V <= 64 else 32)
    BT = entry.get("BT", 64) if NH >= 128 else entry.get("BT_FEW", entry.get("BT", 64))
    return Config(BT=BT, BC=entry.get("BC", 16), BZ=min(BZ, triton_next_pow2(K + V)), BV=min(BV, V),
                  BV_PASS=min(BV_PASS, V), dot_bf16=bool(entry.get("dot_bf16", False)),
                  t_bf16=bool(entry.get("t_bf16", False)),
                  local_sub_states=bool(entry.get("local_sub_states", False)),
                  states_bf16=bool(entry.get("states_bf16", False)),
                  prefetch_t=bool(entry.get("prefetch_t", False)),
                  inverse_prec=entry.get("inverse_prec", "ieee"), **kc)


def get_config(K: int, V: int, NH: int = 160) -> Config:
    """Tiling for head dims K, V with NH = (number of sequences) × heads: TUNING[(K, V)] if
    set, else the first TABLE entry whose class holds (K, V). One config, no autotuning (the
    interpreter runs exactly this one too)."""
    if (K, V) in TUNING:
        return TUNING[(K, V)]
    for (kc, vc), entry in sorted(TABLE.items()):
        if K <= kc and V <= vc:
            # every forward and backward asks (building a Config costs ~25 µs of host time per
            # call); the copy of the entry keeps the cache right when TABLE is edited in place
            key = (K, V, NH >= 128, kc, vc)
            hit = _CONFIG_CACHE.get(key)
            if hit is None or hit[0] != entry:
                hit = _CONFIG_CACHE[key] = (dict(entry), config_from_entry(K, V, NH, entry))
            return hit[1]
    raise ValueError(f"no launch table entry for K = {K}, V = {V}")


_CONFIG_CACHE: dict[tuple, tuple[dict, Config]] = {}
