"""Chunked Gated DeltaNet in Triton: the public op, its torch.library registration and launchers.

``chunk_gated_delta_rule`` takes flash-linear-attention's arguments in the same order and
returns ``(o, final_state)``; the kernels are in ``chunk_kernels.py`` (and the large-head
path's, ``Config.large_head``, in ``large_head_kernels.py``) and the derivation of the forward
and the hand-written backward in ``README.md``.

The op is two ``torch.library.custom_op``s (forward, backward) with fake implementations and
``register_autograd``, so ``torch.compile(fullgraph=True)`` traces a model that calls it
without a graph break (fla's entry point is ``@torch.compiler.disable``). Eager calls run the
same launches through a plain ``torch.autograd.Function`` instead: the custom ops' dispatch
cost the host more than the kernels' GPU time at the HyMo shape (README, "Host time").

No silent fallback: on a machine without Triton, or with CPU tensors outside Triton's
interpreter (``TRITON_INTERPRET=1``, used by the CPU tests), the call raises a RuntimeError
that says to pick ``gdn_backend = "torch_chunk"`` (or ``"naive"``) instead.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from .naive import check_gdn_inputs

try:  # Triton is optional for the package: only this backend needs it (chunk_kernels imports it)
    from . import chunk_kernels as _kern
    from . import large_head_kernels as _lh

    _TRITON_ERROR: Exception | None = None
except Exception as e:  # noqa: BLE001 - any import failure means "no Triton backend"
    _kern = _lh = None
    _TRITON_ERROR = e

# Whether the kernels were built for Triton's CPU interpreter (decided when triton.jit ran).
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_HINT = 'set the model arg gdn_backend = "torch_chunk" (or "naive") to run the PyTorch reference'


@dataclasses.dataclass(frozen=True)
class KernelCfg:
    """Per-kernel launch choice: warps, software-pipelining stages and, where the kernel has
    one, its column tile (``block``: BZ of the prep kernels, BV of the output/gradient kernels,
    BV of the state pass; 0 means the Config's shared BZ / BV / BV_PASS). ``maxnreg`` caps the
    registers per thread (ptxas ``.maxnreg``; 0: the compiler's choice). The K = 32 kernels
    are latency-bound at 1-2 warps per program and hold 235-255 registers per thread, which
    leaves about 8 warps per SM; a cap trades spills for more resident warps. On an H200 every
    cap measured slower there (eighth session, benchmarks/LOG.md), so no TABLE entry sets one. The
    large-head kernels' Config defaults do (255), for another reason: see Config."""

    num_warps: int = 2
    num_stages: int = 1
    block: int = 0
    maxnreg: int = 0


_LH_NREG = 255  # the large-head kernels' register cap (KernelCfg.maxnreg), see Config


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiling. BT: tokens per chunk, the unit of the sequential state pass (a multiple of BC);
    BC: tokens per sub-chunk, the unit of the WY algebra (16 or 32; T = (I + A)⁻¹ is BC×BC);
    BZ: augmented columns per program in the prep kernels; BV: value columns per program in
    the output and gradient kernels (V > BV makes dq/dk/dg/dβ partial sums); BV_PASS: value
    columns per program in the state pass. A kernel's ``KernelCfg.block`` overrides its tile.
    bwd_split: the backward's last stage is ``_bwd_dstate`` (sequential over a chunk's
    sub-chunks, carries only dS) + ``_bwd_sub`` (one program per sub-chunk) instead of
    ``_bwd_local``; the forward then saves every sub-chunk's start state (README, "Split
    backward").
    dot_bf16: with bf16 inputs, the dots run on bf16 operands (fp32 accumulation) instead of tf32
    on fp32 ones, except those with T = (I + A)⁻¹, the WY inverse and the state pass.
    inverse_prec: tl.dot's input_precision in the WY inverse's products: "ieee" (FMA, fp32) or
    "tf32x3" (three tf32 tensor-core passes, ~2⁻²¹ relative error: the same collapsed-keys error
    on an H200, 40 % less time in `_wy_inverse`; the tuned entries use it, see
    _unit_lower_inverse). "tf32" is unsafe there.
    large_head: the large-head path (``large_head_kernels.py``; meant for K ≥ 64): the chunk
    algebra on whole chunks of BT tokens (T = (I + A)⁻¹ is BT×BT, built from BC-token blocks),
    a sequential pass per value block instead of [M | N] chunk maps, and the backward as a
    reverse pass plus one parallel gradient kernel. Off in TABLE: slower than the default path
    on an H200 at both K (seventh session, kernels/gdn/README.md), and most of its launches with
    ≥ 4 warps fault on Hopper (check_large_head_launch refuses them all).
    lh_wu: on the large-head path, one more parallel kernel (``_lh_wu``, fla's recompute_w_u)
    writes W = T X and U = T Y (fp32, transient), and the passes load them instead of running
    two dots with T per chunk on their sequential path.
    lh_split: the large-head path's gradient stage as three kernels instead of
    ``_lh_bwd_grads`` (which spills at K = 128): ``_lh_bwd_dv`` (chunk, head, value block: the
    dots that need all K columns, and dv), ``_lh_bwd_dqk`` (key block, chunk, head, as fla
    splits its dq/dk kernel: dq and dk in fp32, shares of the sums over K) and
    ``_lh_bwd_finish`` (chunk, head: the shares summed, dg's reverse cumsum, the l2norm
    backward). With large_head off it replaces ``_bwd_local`` on the default path, after
    ``_lh_inverse`` has built the chunk-wide T there (BT ≤ 128). Off in TABLE: slower than
    ``_bwd_local`` on an H200 at K = 32 and 128 (tenth session, kernels/gdn/README.md), and its
    4-warp launches fault at K = 128 there.
    t_bf16: with dot_bf16 on (so bf16 inputs), the dots with T = (I + A)⁻¹ and the key Gram
    matrix of A also run on bf16 operands, as fla keeps its A in bf16. T's entries cancel when
    keys collapse. On an H200 (eighth session): 4-6 % less time, collapsed-keys error 9.4e-3 ->
    9.8e-3 at K = 32 (limit 0.02); 200-step training runs with and without it end level (six
    seeds, ninth session). On in the K = 32 and K = 128 entries of TABLE.
    local_sub_states: the forward saves every sub-chunk's start state (as with bwd_split) and
    ``_bwd_local`` loads them in its reverse sweep instead of re-running the forward sweep
    through a scratch area. BT / BC times the saved state memory (16× at the K = 32 entry's BT = 256;
    README, "Split backward").
    The large-head path, which has no _bwd_local, ignores it (as it ignores bwd_split). On in
    the K = 32 and K = 128 entries of TABLE since the thirteenth session (5-10 % less time on an H200).
    states_bf16: with bf16 dots (dot_bf16, bf16 inputs), the saved start states (per chunk or per
    sub-chunk) are stored in bf16: every dot that reads them rounds them to bf16 anyway; the
    chunk recurrences inside the kernels stay fp32, and only ⟨dS', S⟩ (dγ_L) and the first
    sub-chunk update of each chunk see the rounding. Half the bytes _fwd_out writes and the
    backward reads. The final state stays fp32. The large-head path and lh_split ignore it. On in
    the K = 32 and K = 128 entries of TABLE since the thirteenth session (5-10 % less time on an
    H200, the same parity errors).
    prefetch_t: ``_bwd_local``'s reverse sweep loads the next sub-chunk's T one step ahead (the
    one load of that loop Triton 3.6 does not pipeline; in its sm_90 code here no more registers,
    stack 24 B at K = 32 as before and 512 -> 480 B at K = 128). On in the K = 32 and K = 128
    entries of TABLE since the sixteenth session (GPU time -2 % at K = 32, -0.8 % at K = 128)."""

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
    bwd_split: bool = False
    dot_bf16: bool = False
    inverse_prec: str = "ieee"
    bwd_dstate: KernelCfg = KernelCfg(1, 2)
    bwd_sub: KernelCfg = KernelCfg(2, 1)
    large_head: bool = False
    # two warps: the large-head kernels' only launches measured correct on an H200 with Triton 3.6
    # at both K (seventh session; see check_large_head_launch). 255 registers: at 2 warps
    # (.reqntid 64) Triton 3.6's ptxas gives some of them 32 registers and kilobytes of spills
    # unless capped, 3-12x slower there (tenth session, kernels/gdn/README.md)
    lh_inverse: KernelCfg = KernelCfg(2, 1, 0, _LH_NREG)
    lh_fwd_h: KernelCfg = KernelCfg(2, 2, 0, _LH_NREG)
    lh_fwd_o: KernelCfg = KernelCfg(2, 2, 0, _LH_NREG)
    lh_bwd_dh: KernelCfg = KernelCfg(2, 2, 0, _LH_NREG)
    lh_bwd_grads: KernelCfg = KernelCfg(2, 1, 0, _LH_NREG)
    lh_wu_kernel: KernelCfg = KernelCfg(2, 1, 0, _LH_NREG)
    lh_wu: bool = False
    t_bf16: bool = False
    lh_bwd_dv: KernelCfg = KernelCfg(2, 1, 0, _LH_NREG)
    lh_bwd_dqk: KernelCfg = KernelCfg(2, 1, 0, _LH_NREG)  # block: the key columns per program (BK)
    lh_bwd_finish: KernelCfg = KernelCfg(2, 1, 0, _LH_NREG)
    lh_split: bool = False
    local_sub_states: bool = False
    states_bf16: bool = False
    prefetch_t: bool = False

    def __post_init__(self):
        # the large-head kernels hold BT × BT tiles (T, P, their gradients) in registers
        if (self.large_head or self.lh_split) and not (self.BC <= self.BT <= 128):
            raise ValueError(f"large_head and lh_split need BC <= BT <= 128 (BT × BT tiles), got BT = {self.BT}; "
                             "set BT (and BT_FEW in a TABLE entry) to 64")
        if self.lh_split and self.bwd_split:
            raise ValueError("lh_split and bwd_split both replace _bwd_local: turn one of them off")
        if self.local_sub_states and (self.bwd_split or self.lh_split) and not self.large_head:
            raise ValueError("local_sub_states changes _bwd_local, which bwd_split and lh_split replace: "
                             "turn one of them off")

    def tile(self, kernel: str) -> int:
        """The column tile that `kernel` runs with (0 for the inverse kernel, which has none)."""
        shared = {"fwd_prep": self.BZ, "bwd_prep": self.BZ, "fwd_out": self.BV, "bwd_local": self.BV,
                  "bwd_dstate": self.BV, "bwd_sub": self.BV, "state_pass": self.BV_PASS,
                  "lh_fwd_h": self.BV, "lh_fwd_o": self.BV, "lh_bwd_dh": self.BV,
                  "lh_bwd_grads": self.BV, "lh_wu_kernel": self.BV, "lh_bwd_dv": self.BV,
                  "lh_bwd_dqk": 64}.get(kernel, 0)
        return (getattr(self, kernel).block or shared) if shared else 0

    def kernels(self) -> tuple[str, ...]:
        """The kernels this config launches (its backward path's), in launch order."""
        if self.large_head:
            passes = KERNELS_LARGE[:-1] + (("lh_wu_kernel",) if self.lh_wu else ())
            return passes + (KERNELS_LH_GRADS if self.lh_split else KERNELS_LARGE[-1:])
        if self.lh_split:
            return KERNELS_LOCAL[:-1] + ("lh_inverse",) + KERNELS_LH_GRADS
        return KERNELS_SPLIT if self.bwd_split else KERNELS_LOCAL

    @property
    def bwd_path(self) -> str:
        """The default path's backward, a BWD_PATHS key (the large-head path has its own)."""
        return "split" if self.bwd_split else "local_sub" if self.local_sub_states else "local"

    @property
    def slots(self) -> int:
        """Saved states per chunk: one per sub-chunk on the split path and with
        local_sub_states, else one."""
        return self.BT // self.BC if (self.bwd_split or self.local_sub_states) and not self.large_head else 1

    @property
    def t_width(self) -> int:
        """Columns of the saved T = (I + A)⁻¹ per token: a chunk's on the large-head path."""
        return self.BT if self.large_head else self.BC


# The kernels in launch order (the state pass runs twice: forward, then in reverse), per backward
# path, and all of them (what `bench.py --tune` tunes).
KERNELS_LOCAL = ("wy_inverse", "fwd_prep", "state_pass", "fwd_out", "bwd_prep", "bwd_local")
KERNELS_SPLIT = ("wy_inverse", "fwd_prep", "state_pass", "fwd_out", "bwd_prep", "bwd_dstate", "bwd_sub")
KERNELS = KERNELS_LOCAL + ("bwd_dstate", "bwd_sub")
# The default path's three backwards, as the Config fields that pick one (local: _bwd_local
# re-runs each chunk's forward into a scratch; local_sub: _bwd_local on the saved sub-chunk
# states; split: _bwd_dstate + _bwd_sub)
BWD_PATHS = {"local": dict(bwd_split=False, local_sub_states=False),
             "local_sub": dict(bwd_split=False, local_sub_states=True),
             "split": dict(bwd_split=True, local_sub_states=False)}
# the large-head path's (`bench.py --tune --large-head` tunes these instead of KERNELS)
KERNELS_LARGE = ("lh_inverse", "lh_fwd_h", "lh_fwd_o", "lh_bwd_dh", "lh_bwd_grads")
KERNELS_LH_GRADS = ("lh_bwd_dv", "lh_bwd_dqk", "lh_bwd_finish")  # with Config.lh_split
KERNELS_LARGE_ALL = KERNELS_LARGE + ("lh_wu_kernel",) + KERNELS_LH_GRADS  # with Config.lh_wu, lh_split

# Launch table by (K, V) class: the first entry (in key order) with K ≤ Kc and V ≤ Vc applies.
# Tiles: BT for N·H ≥ 128 (sequences × heads), BT_FEW below that (the state pass is then short
# of programs), BC, and BZ / BV / BV_PASS (0: derived, min(64, K + V) / min(V, 64) /
# 16 for V ≤ 64 else 32; explicit values are clamped to the head dims). Per kernel
# (num_warps, num_stages), (num_warps, num_stages, block) or (num_warps, num_stages, block,
# maxnreg), block 0 meaning the shared tile (KernelCfg); a large-head kernel given without
# maxnreg gets the Config default cap (255), the others none. `bench.py --tune` on a GPU
# prints its winners in this format, to paste here. bwd_split picks the backward path
# (False: _bwd_local; True: _bwd_dstate + _bwd_sub, on an H200 6 % faster at
# (4,4096,40,32,32) but 20 % slower at 8x and 32K tokens, untuned: README "Split backward");
# the K = 32 launches of bwd_dstate and bwd_sub are guesses until `bench.py --tune` has timed them.
_UNTUNED = dict(BT=64, BT_FEW=64, BC=16, BZ=64, BV=0, BV_PASS=0,
                wy_inverse=(1, 1), fwd_prep=(2, 1), state_pass=(4, 1), fwd_out=(2, 1),
                bwd_prep=(2, 1), bwd_local=(2, 1), bwd_split=False, bwd_dstate=(2, 1), bwd_sub=(2, 1))
TABLE: dict[tuple[int, int], dict] = {
    # K = V ≤ 32 (HyMo): `bench.py --tune` on an H200, Triton 3.6, 2026-11-29 (benchmarks/LOG.md);
    # the stages of (4,4096,40,32,32), the chunk of its BT sweep (BT=256 won by 3% at B = 8);
    # bf16 dots and the three-pass tf32 inverse: 1.366 -> 1.143 and 1.311 ms fwd+bwd, the same
    # collapsed-keys error for the inverse, and a clean 200-step hymo_small run with bf16 dots
    # (fifth session, benchmarks/LOG.md); the backward launches from the fifth session's retune with
    # these precisions at (1,32768,40) (three stages): GPU time -3 to -4 % at all three K = 32 shapes
    # (sixth session). t_bf16: fwd+bwd -5 to -6 % at K = 32 (eighth and ninth sessions); 200-step
    # hymo_small runs with and without it end level (final loss mean over seeds 1-4 -0.001, over
    # those and seeds 42, 7 +0.014 with a per-seed spread of 0.03; ninth session, benchmarks/LOG.md).
    # fwd_prep 3 stages (a full warps x stages grid after the γβ pack, twelfth session): the kernel
    # 0.082 -> 0.067 ms, fwd+bwd 0.914 -> 0.897 ms at (4,4096,40,32,32). local_sub_states (thirteenth
    # session, same run): fwd+bwd 0.898 -> 0.854, 1.783 -> 1.702 (1,32768,40), 1.734 -> 1.647 (8,4096,40),
    # for 256 B of saved state per token and head instead of 32 (+147 MB per layer at (4,4096,40)).
    # states_bf16 (same session): GPU time 0.849 -> 0.804, 1.698 -> 1.599, 1.650 -> 1.553 ms, the
    # saved states halved (128 B per token and head); 200-step hymo_small runs with fp32 states
    # end 0.013 lower on average over seeds 1-4 (per seed +0.025 to -0.051: within the noise,
    # fourteenth session). BT = 256 with many sequences too (fourteenth session, same run, with the
    # state pass's prefetch): GPU time 0.789 -> 0.768 (4,4096,40), 1.537 -> 1.431 (8,4096,40).
    # prefetch_t (sixteenth session, one run): GPU time 0.765 -> 0.751 (4,4096,40), 1.543 -> 1.512 (1,32768,40),
    # 1.427 -> 1.402 (8,4096,40)
    (32, 32): dict(BT=256, BT_FEW=256, BC=16, BZ=64, BV=32, BV_PASS=16,
                   wy_inverse=(1, 1), fwd_prep=(1, 3, 64), state_pass=(4, 3, 16), fwd_out=(1, 3, 32),
                   bwd_prep=(1, 3, 64), bwd_local=(2, 3, 32),
                   bwd_split=False, local_sub_states=True, states_bf16=True, dot_bf16=True, t_bf16=True, inverse_prec="tf32x3", bwd_dstate=(1, 3, 32),
                   bwd_sub=(1, 1, 32), prefetch_t=True),
    # K = V = 64 and 256: not tuned yet
    (64, 64): _UNTUNED,
    # K = V = 128: `bench.py --tune` at (4,4096,16,128,128) on an H200 with dot_bf16, 2026-11-29
    # (tf32 dots 9.47 ms -> bf16 dots 6.69 -> these launches 5.55; t_bf16 5.59 -> 5.35 and 5.52 -> 5.38, eighth and ninth sessions;
    # benchmarks/LOG.md); bwd_local (8, 3, 64) from the twelfth session's full grid: fwd+bwd 5.30 -> 5.05 ms
    # (two value blocks: dq/dk/dg/dβ are fp32 partial sums, their sum included); thirteenth session:
    # local_sub_states 5.047 -> 4.548 ms (4 KB of saved state per token and head, 1.07 GB per layer),
    # the partial sums in one kernel -> 4.27, fwd_out / bwd_prep / bwd_sub from `--tune --full-grid`
    # on that table (4.30 -> 4.08 ms in the tuner), states_bf16 4.273 -> 3.831 ms GPU time (before the
    # retune; the saved states halved); prefetch_t 3.691 -> 3.662 ms GPU time (sixteenth session)
    (128, 128): dict(BT=64, BT_FEW=256, BC=16, BZ=64, BV=64, BV_PASS=32, bwd_split=False, local_sub_states=True,
                     states_bf16=True, dot_bf16=True, t_bf16=True, inverse_prec="tf32x3", prefetch_t=True,
                     wy_inverse=(1, 1), fwd_prep=(4, 3, 128), state_pass=(8, 2, 64), fwd_out=(4, 3, 64),
                     bwd_prep=(4, 3, 64), bwd_local=(8, 3, 64), bwd_dstate=(4, 3, 64), bwd_sub=(8, 2, 64)),
    (256, 256): _UNTUNED,
}

# Overrides for benchmarking/tuning, keyed by (K, V); read by both the real and the fake
# implementations, so change it only between whole forward/backward calls.
TUNING: dict[tuple[int, int], Config] = {}


def config_from_entry(K: int, V: int, NH: int, entry: dict) -> Config:
    """A Config for head dims K, V and NH = sequences × heads from a TABLE-style entry."""
    cap = dict(fwd_prep=triton_next_pow2(K + V), bwd_prep=triton_next_pow2(K + V), fwd_out=V, bwd_local=V,
               bwd_dstate=V, bwd_sub=V, state_pass=V, lh_fwd_h=V, lh_fwd_o=V, lh_bwd_dh=V, lh_bwd_grads=V,
               lh_wu_kernel=V, lh_bwd_dv=V, lh_bwd_dqk=triton_next_pow2(K))
    kc = {}
    for n in KERNELS + KERNELS_LARGE_ALL:
        if n in entry:
            c = KernelCfg(*entry[n])
            if len(entry[n]) < 4 and n.startswith("lh_"):  # the large-head kernels' default cap
                c = dataclasses.replace(c, maxnreg=_LH_NREG)
            kc[n] = dataclasses.replace(c, block=min(c.block, cap[n])) if c.block and n in cap else c
    BZ = entry.get("BZ", 0) or min(64, triton_next_pow2(K + V))
    BV = entry.get("BV", 0) or min(V, 64)
    BV_PASS = entry.get("BV_PASS", 0) or (16 if V <= 64 else 32)
    BT = entry.get("BT", 64) if NH >= 128 else entry.get("BT_FEW", entry.get("BT", 64))
    return Config(BT=BT, BC=entry.get("BC", 16), BZ=min(BZ, triton_next_pow2(K + V)), BV=min(BV, V),
                  BV_PASS=min(BV_PASS, V), bwd_split=bool(entry.get("bwd_split", False)),
                  dot_bf16=bool(entry.get("dot_bf16", False)), large_head=bool(entry.get("large_head", False)),
                  lh_wu=bool(entry.get("lh_wu", False)), lh_split=bool(entry.get("lh_split", False)),
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


def _cdiv(a: int, b: int) -> int:
    # triton.cdiv is a @triton.jit function: ~6 µs of host time per call from Python
    return -(-a // b)


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _num_chunks(B: int, T: int, N: int, varlen: bool, BT: int):
    """Chunks the kernels index (static: an upper bound for packed batches)."""
    return (T + BT - 1) // BT + N if varlen else B * ((T + BT - 1) // BT)


def _varlen_tables(cu_seqlens: torch.Tensor, NC: int, BT: int):
    """Per chunk (first token, end of its sequence) and per sequence its first chunk,
    computed on the device without a host sync; chunks past the real count get (0, 0)."""
    cu = cu_seqlens.to(torch.int64)
    N = cu.numel() - 1
    nch = (cu[1:] - cu[:-1] + BT - 1) // BT
    offs = torch.cat([cu.new_zeros(1), torch.cumsum(nch, 0)])
    ids = torch.arange(NC, device=cu.device)
    seq = torch.searchsorted(offs[1:].contiguous(), ids, right=True).clamp_(max=N - 1)
    t0 = cu[seq] + (ids - offs[seq]) * BT
    valid = ids < offs[-1]
    spans = torch.stack([torch.where(valid, t0, 0), torch.where(valid, cu[seq + 1], 0)], 1)
    return spans.to(torch.int32).contiguous(), offs.to(torch.int32)


def _kw(kc: KernelCfg) -> dict:
    kw = dict(num_warps=kc.num_warps, num_stages=kc.num_stages)
    if kc.maxnreg:
        kw["maxnreg"] = kc.maxnreg
    return kw


def _prec(dtype: torch.dtype) -> str:
    # fp32 inputs: three-pass tf32 (about fp32 accuracy on the tensor cores; a test/debug mode);
    # 16-bit inputs: tf32 on the fp32 intermediates (bf16 values are exact in tf32)
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _common(q, v, cu_seqlens):
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    # head dims are compile-time constants of the kernels: specialise on them when tracing
    # (and on whether N·H is small, which picks the chunk size)
    cfg = get_config(int(K), int(V), 256 if N * H >= 128 else 1)
    NC = _num_chunks(B, T, N, cu_seqlens is not None, cfg.BT)
    return B, T, H, K, V, N, cfg, NC


@dataclasses.dataclass
class Problem:
    """One call's inputs and launch geometry: what every kernel launcher below takes. The
    benchmark's tuner builds one per (shape, BT) and swaps `cfg` per kernel variant."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    cu_seqlens: torch.Tensor | None
    scale: float
    norm: bool
    cfg: Config
    B: int
    T: int
    H: int
    K: int
    V: int
    N: int
    NC: int
    spans: torch.Tensor
    offs: torch.Tensor
    # the γβ pack [NC, H, BT/BC, 2, BC] fp32 of the default path: γ (in-sub-chunk cumsum of g)
    # and β per sub-chunk, contiguous; written by _wy_inverse (forward) and _bwd_prep (backward)
    # for the kernels after them, which would otherwise load g and β as 16 strided values each
    gbp: torch.Tensor | None = None


def large_head_warp_limit(capability: tuple[int, int]) -> int | None:
    """The most warps a large-head kernel may launch with on a GPU of this compute capability
    (None: no limit); see check_large_head_launch."""
    return 2 if capability == (9, 0) else None


def check_large_head_launch(cfg: Config, capability: tuple[int, int]) -> None:
    """Refuse large-head launches with ≥ 4 warps on Hopper (sm_90): on an H200 with Triton 3.6
    most of them fault with an illegal memory access (K = 32 with 32-column value blocks at 4
    warps; K = 128 with 32-column blocks at 4 warps, with 8 warps, and with lh_wu; seventh
    session, kernels/gdn/README.md). It is the class of miscompiled warpgroup (wgmma) code that
    fla avoids the same way on Hopper (its issues #640 and #984, the latter still with Triton
    3.7.1: 2 warps, or no 8 warps); ours fault the same way with Triton 3.7.1 (fourteenth
    session). Two warps (the Config defaults) run no warpgroup MMAs and passed parity there. A
    fault poisons the process's CUDA context, hence an error up front."""
    limit = large_head_warp_limit(capability)
    if not (cfg.large_head or cfg.lh_split) or limit is None:
        return
    wide = [n for n in cfg.kernels() if n.startswith("lh_") and getattr(cfg, n).num_warps > limit]
    if wide:
        raise RuntimeError(
            f"the large-head GDN kernels {wide} are set to >= 4 warps, which fault (illegal memory access) "
            "on Hopper GPUs; set their KernelCfg num_warps to 2 (the Config defaults) or turn "
            "Config.large_head off")


def _overridden(cfg: Config, dot_bf16: bool | None, t_bf16: bool | None, bwd_path: str | None = None) -> Config:
    """cfg with dot_bf16, t_bf16 and the backward path (BWD_PATHS) replaced where given (not
    None): the op's arguments. The large-head path has its own backward and keeps it."""
    given = {n: x for n, x in (("dot_bf16", dot_bf16), ("t_bf16", t_bf16)) if x is not None}
    if bwd_path is not None and bwd_path not in BWD_PATHS:
        raise ValueError(f"unknown bwd_path {bwd_path!r}; choose one of {sorted(BWD_PATHS)} or None (the table's)")
    if bwd_path is not None and not cfg.large_head:
        given.update(BWD_PATHS[bwd_path], lh_split=False)
    return dataclasses.replace(cfg, **given) if given else cfg


def make_problem(q, k, v, g, beta, cu_seqlens, scale, norm, cfg: Config | None = None,
                 dot_bf16: bool | None = None, t_bf16: bool | None = None, bwd_path: str | None = None) -> Problem:
    """dot_bf16, t_bf16 and bwd_path (not None) override the config's choices (the op's arguments)."""
    B, T, H, K, V, N, cfg0, _ = _common(q, v, cu_seqlens)
    cfg = _overridden(cfg or cfg0, dot_bf16, t_bf16, bwd_path)
    if (cfg.large_head or cfg.lh_split) and q.is_cuda:
        check_large_head_launch(cfg, torch.cuda.get_device_capability(q.device))
    NC = _num_chunks(B, T, N, cu_seqlens is not None, cfg.BT)
    if cu_seqlens is None:
        spans = offs = torch.empty(2, dtype=torch.int32, device=q.device)
    else:
        spans, offs = _varlen_tables(cu_seqlens, NC, cfg.BT)
    gbp = None if cfg.large_head else torch.empty(NC, H, cfg.BT // cfg.BC, 2, cfg.BC, dtype=torch.float32,
                                                   device=q.device)
    return Problem(q, k, v, g, beta, cu_seqlens, scale, norm, cfg, B, T, H, K, V, N, NC, spans, offs, gbp)


def _tprec(cfg: Config, dtype: torch.dtype) -> str:
    # the dots with T = (I + A)⁻¹: its entries are sums that cancel when keys collapse (see
    # _unit_lower_inverse), so they are rounded to bf16 only with Config.t_bf16
    return "bf16" if cfg.t_bf16 and cfg.dot_bf16 and dtype == torch.bfloat16 else _prec(dtype)


def saved_t_dtype(cfg: Config, dtype: torch.dtype) -> torch.dtype:
    """dtype of the saved T for inputs of this dtype: bf16 where every dot with it rounds it to
    bf16 anyway (the default path with t_bf16), which halves the bytes the four kernels reading it load; else fp32."""
    return torch.bfloat16 if _tprec(cfg, dtype) == "bf16" and not cfg.large_head else torch.float32


def saved_states_dtype(cfg: Config, dtype: torch.dtype) -> torch.dtype:
    """dtype of the saved start states for inputs of this dtype: bf16 with Config.states_bf16 where
    every dot on them rounds them to bf16 (bf16 dots, the default path); else fp32."""
    bf16 = (cfg.states_bf16 and cfg.dot_bf16 and dtype == torch.bfloat16
            and not (cfg.large_head or cfg.lh_split))
    return torch.bfloat16 if bf16 else torch.float32


def _geom(p: Problem) -> dict:
    # PREC: the dots on inputs, states and their gradients; TPREC: those with T
    prec = "bf16" if p.cfg.dot_bf16 and p.q.dtype == torch.bfloat16 else _prec(p.q.dtype)
    return dict(H=p.H, K=p.K, BT=p.cfg.BT, BC=p.cfg.BC, IS_VARLEN=p.cu_seqlens is not None,
                NORM_QK=p.norm, PREC=prec, TPREC=_tprec(p.cfg, p.q.dtype))


def run_wy_inverse(p: Problem) -> torch.Tensor:
    """T = (I + A)⁻¹ of every sub-chunk, row by row beside its tokens ([B, T, H, BC]; bf16 or
    fp32, saved_t_dtype)."""
    c = p.cfg
    tinv = torch.empty(p.B, p.T, p.H, c.BC, dtype=saved_t_dtype(c, p.q.dtype), device=p.q.device)
    _kern._wy_inverse_kernel[(p.NC, p.H, c.BT // c.BC)](
        p.k, p.g, p.beta, tinv, p.gbp, p.spans, p.T, LOG2_BC=int(math.log2(c.BC)), INV_PREC=c.inverse_prec,
        **_geom(p), **_kw(c.wy_inverse))
    return tinv


def run_fwd_prep(p: Problem, tinv: torch.Tensor) -> torch.Tensor:
    """[M | N] of every chunk ([NC, H, K, K + V] fp32)."""
    BZ = p.cfg.tile("fwd_prep")
    mn = torch.empty(p.NC, p.H, p.K, p.K + p.V, dtype=torch.float32, device=p.q.device)
    _kern._fwd_prep_kernel[(p.NC, p.H, _cdiv(p.K + p.V, BZ))](
        p.k, p.v, p.gbp, tinv, mn, p.spans, p.T, V=p.V, BZ=BZ, **_geom(p), **_kw(p.cfg.fwd_prep))
    return mn


def run_state_pass(p: Problem, ab: torch.Tensor, x0: torch.Tensor | None, reverse: bool):
    """The sequential pass over chunks: (per-chunk states [NC·slots, H, K, V], last state
    [N, H, K, V]); with slots > 1 (the forward's sub-chunk states, the split backward's
    sub-chunk gradients) it fills the first slot of each chunk."""
    BV = p.cfg.tile("state_pass")
    slots = p.cfg.slots if not reverse or p.cfg.bwd_split else 1
    dtype = torch.float32 if reverse else saved_states_dtype(p.cfg, p.q.dtype)
    states = torch.empty(p.NC * slots, p.H, p.K, p.V, dtype=dtype, device=p.q.device)
    xT = torch.empty(p.N, p.H, p.K, p.V, dtype=torch.float32, device=p.q.device)
    _kern._state_pass_kernel[(p.N, p.H, _cdiv(p.V, BV))](
        ab, states, x0 if x0 is not None else xT, xT, p.offs, p.T, H=p.H, K=p.K, V=p.V, BT=p.cfg.BT, BV=BV,
        REVERSE=reverse, HAS_X0=x0 is not None, IS_VARLEN=p.cu_seqlens is not None, PREC=_prec(p.q.dtype),
        SLOTS=slots, **_kw(p.cfg.state_pass))
    return states, xT


def run_fwd_out(p: Problem, tinv: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """o; with slots > 1 it also fills the other sub-chunk slots of `states` in place."""
    BV = p.cfg.tile("fwd_out")
    o = torch.empty(p.B, p.T, p.H, p.V, dtype=p.v.dtype, device=p.q.device)
    save = dict(SAVE_SUB=True, NS=p.cfg.slots) if p.cfg.slots > 1 else {}
    _kern._fwd_out_kernel[(p.NC, p.H, _cdiv(p.V, BV))](
        p.q, p.k, p.v, p.gbp, tinv, o, states, p.spans, p.T, p.scale, V=p.V, BV=BV, **_geom(p),
        **save, **_kw(p.cfg.fwd_out))
    return o


def run_bwd_prep(p: Problem, tinv: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """[Mᵀ | R] of every chunk ([NC, H, K, K + V] fp32)."""
    BZ = p.cfg.tile("bwd_prep")
    mr = torch.empty(p.NC, p.H, p.K, p.K + p.V, dtype=torch.float32, device=p.q.device)
    _kern._bwd_prep_kernel[(p.NC, p.H, _cdiv(p.K + p.V, BZ))](
        p.q, p.k, p.g, p.beta, tinv, do, mr, p.gbp, p.spans, p.T, p.scale, V=p.V, BZ=BZ, **_geom(p),
        **_kw(p.cfg.bwd_prep))
    return mr


def _grad_buffers(p: Problem, NV: int):
    """dq, dk, dv, dg, dβ outputs of the gradient kernels; with several value blocks,
    dq/dk/dg/dβ are fp32 partial sums, one slab per block ([NV, ...])."""
    dev, f32 = p.q.device, torch.float32
    B, T, H, K = p.B, p.T, p.H, p.K
    part_dtype = f32 if NV > 1 else None
    dq = torch.empty(NV, B, T, H, K, dtype=part_dtype or p.q.dtype, device=dev)
    dk = torch.empty(NV, B, T, H, K, dtype=part_dtype or p.k.dtype, device=dev)
    dv = torch.empty(B, T, H, p.V, dtype=p.v.dtype, device=dev)
    dg = torch.empty(NV, B, T, H, dtype=part_dtype or p.g.dtype, device=dev)
    db = torch.empty(NV, B, T, H, dtype=part_dtype or p.beta.dtype, device=dev)
    return dq, dk, dv, dg, db


_SUM_BLOCK = 4096


def _summed(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Σ over the leading (value block) dim of fp32 partial sums, in `dtype`, in one kernel."""
    out = torch.empty(part.shape[1:], dtype=dtype, device=part.device)
    N = out.numel()
    _kern._sum_parts_kernel[(_cdiv(N, _SUM_BLOCK),)](part, out, N, NV=part.shape[0], BLOCK=_SUM_BLOCK,
                                                       num_warps=4)
    return out


def _sum_parts(p: Problem, dq, dk, dv, dg, db):
    if dq.shape[0] > 1:
        return (_summed(dq, p.q.dtype), _summed(dk, p.k.dtype), dv, _summed(dg, p.g.dtype),
                _summed(db, p.beta.dtype))
    return dq[0], dk[0], dv, dg[0], db[0]


def run_bwd_local(p: Problem, tinv, do, states, dstates):
    """(dq, dk, dv, dg, dβ) from each chunk's start state (or with local_sub_states every
    sub-chunk's) and end-state gradient."""
    BV = p.cfg.tile("bwd_local")
    NV = _cdiv(p.V, BV)
    NS = p.cfg.BT // p.cfg.BC
    B, T, H, K = p.B, p.T, p.H, p.K
    sub = p.cfg.local_sub_states
    # the forward sweep's per-program scratch of sub-chunk start states (none when they were saved)
    scratch = states if sub else torch.empty(p.NC, H, NV, NS, K, BV, dtype=torch.float32, device=p.q.device)
    dq, dk, dv, dg, db = grads = _grad_buffers(p, NV)
    _kern._bwd_local_kernel[(p.NC, H, NV)](
        p.q, p.k, p.v, p.gbp, tinv, do, states, dstates, scratch, dq, dk, dv, dg, db, p.spans, p.T,
        p.scale, B * T * H * K, B * T * H, V=p.V, BV=BV, NV=NV, NS=NS, SUB_STATES=sub,
        PREFETCH_T=p.cfg.prefetch_t, **_geom(p), **_kw(p.cfg.bwd_local))
    return _sum_parts(p, *grads)


def run_bwd_dstate(p: Problem, tinv, do, dsub) -> torch.Tensor:
    """Split path: every sub-chunk's end-state gradient, in place in `dsub` ([NC·NS, H, K, V],
    whose first slot per chunk holds the chunk's end-state gradient from the reverse pass)."""
    BV = p.cfg.tile("bwd_dstate")
    _kern._bwd_dstate_kernel[(p.NC, p.H, _cdiv(p.V, BV))](
        p.q, p.k, p.gbp, tinv, do, dsub, p.spans, p.T, p.scale, V=p.V, BV=BV, NS=p.cfg.BT // p.cfg.BC,
        **_geom(p), **_kw(p.cfg.bwd_dstate))
    return dsub


def run_bwd_sub(p: Problem, tinv, do, sub_states, dsub):
    """Split path: (dq, dk, dv, dg, dβ), one program per sub-chunk, from its saved start
    state and end-state gradient."""
    BV = p.cfg.tile("bwd_sub")
    NV = _cdiv(p.V, BV)
    NS = p.cfg.BT // p.cfg.BC
    B, T, H, K = p.B, p.T, p.H, p.K
    dq, dk, dv, dg, db = grads = _grad_buffers(p, NV)
    _kern._bwd_sub_kernel[(p.NC * NS, H, NV)](
        p.q, p.k, p.v, p.gbp, tinv, do, sub_states, dsub, dq, dk, dv, dg, db, p.spans, p.T,
        p.scale, B * T * H * K, B * T * H, V=p.V, BV=BV, NS=NS, **_geom(p), **_kw(p.cfg.bwd_sub))
    return _sum_parts(p, *grads)


def _lh_geom(p: Problem) -> dict:
    g = _geom(p)
    del g["BC"]
    return g


def run_lh_inverse(p: Problem) -> torch.Tensor:
    """Large-head path: T = (I + A)⁻¹ of every chunk, row by row beside its tokens ([B, T, H, BT] fp32)."""
    c, f32 = p.cfg, torch.float32
    tinv = torch.empty(p.B, p.T, p.H, c.BT, dtype=f32, device=p.q.device)
    gcum = torch.empty(p.B, p.T, p.H, dtype=f32, device=p.q.device)  # scratch: the chunks' γ
    geom = _lh_geom(p)
    _lh._lh_inverse_kernel[(p.NC, p.H)](
        p.k, p.g, p.beta, tinv, gcum, p.spans, p.T, BC=c.BC, LOG2_BC=int(math.log2(c.BC)),
        INV_PREC=c.inverse_prec, **{n: geom[n] for n in ("H", "K", "BT", "IS_VARLEN", "NORM_QK", "TPREC")},
        **_kw(c.lh_inverse))
    return tinv


def run_lh_wu(p: Problem, tinv):
    """Large-head path with Config.lh_wu: (W, U) = (T X, T Y) of every chunk, fp32."""
    w = torch.empty(p.B, p.T, p.H, p.K, dtype=torch.float32, device=p.q.device)
    u = torch.empty(p.B, p.T, p.H, p.V, dtype=torch.float32, device=p.q.device)
    BV = p.cfg.tile("lh_wu_kernel")
    geom = _lh_geom(p)
    _lh._lh_wu_kernel[(p.NC, p.H, _cdiv(p.V, BV))](
        p.k, p.v, p.g, p.beta, tinv, w, u, p.spans, p.T, V=p.V, BV=BV,
        **{n: geom[n] for n in ("H", "K", "BT", "IS_VARLEN", "NORM_QK", "TPREC")}, **_kw(p.cfg.lh_wu_kernel))
    return w, u


def run_lh_fwd_h(p: Problem, tinv, h0, wu=None):
    """Large-head path, the forward pass: (chunk start states [NC, H, K, V], final states [N, H, K, V])."""
    states = torch.empty(p.NC, p.H, p.K, p.V, dtype=torch.float32, device=p.q.device)
    final = torch.empty(p.N, p.H, p.K, p.V, dtype=torch.float32, device=p.q.device)
    BV = p.cfg.tile("lh_fwd_h")
    w, u = wu or (tinv, tinv)
    _lh._lh_fwd_h_kernel[(p.N, p.H, _cdiv(p.V, BV))](
        p.q, p.k, p.v, p.g, p.beta, tinv, w, u, states, h0 if h0 is not None else final, final, p.spans, p.offs,
        p.T, p.scale, V=p.V, BV=BV, HAS_X0=h0 is not None, HAS_WU=wu is not None,
        **_lh_geom(p), **_kw(p.cfg.lh_fwd_h))
    return states, final


def run_lh_fwd_o(p: Problem, tinv, states, wu=None) -> torch.Tensor:
    o = torch.empty(p.B, p.T, p.H, p.V, dtype=p.v.dtype, device=p.q.device)
    BV = p.cfg.tile("lh_fwd_o")
    w, u = wu or (tinv, tinv)
    _lh._lh_fwd_o_kernel[(p.NC, p.H, _cdiv(p.V, BV))](
        p.q, p.k, p.v, p.g, p.beta, tinv, w, u, states, o, p.spans, p.T, p.scale, V=p.V, BV=BV,
        HAS_WU=wu is not None, **_lh_geom(p), **_kw(p.cfg.lh_fwd_o))
    return o


def run_lh_bwd_dh(p: Problem, tinv, do, dht, wu=None):
    """Large-head path, the reverse pass: (chunk end-state gradients [NC, H, K, V], dh0 [N, H, K, V])."""
    dstates = torch.empty(p.NC, p.H, p.K, p.V, dtype=torch.float32, device=p.q.device)
    dh0 = torch.empty(p.N, p.H, p.K, p.V, dtype=torch.float32, device=p.q.device)
    BV = p.cfg.tile("lh_bwd_dh")
    w, u = wu or (tinv, tinv)
    _lh._lh_bwd_dh_kernel[(p.N, p.H, _cdiv(p.V, BV))](
        p.q, p.k, p.v, p.g, p.beta, tinv, w, u, do, dstates, dht if dht is not None else dh0, dh0, p.spans,
        p.offs, p.T, p.scale, V=p.V, BV=BV, HAS_DHT=dht is not None, HAS_WU=wu is not None,
        **_lh_geom(p), **_kw(p.cfg.lh_bwd_dh))
    return dstates, dh0


def run_lh_bwd_grads(p: Problem, tinv, do, states, dstates, wu=None):
    """Large-head path: (dq, dk, dv, dg, dβ) from each chunk's start state and end-state gradient."""
    dq, dk, dv, dg, db = (torch.empty_like(x) for x in (p.q, p.k, p.v, p.g, p.beta))
    w, u = wu or (tinv, tinv)
    _lh._lh_bwd_grads_kernel[(p.NC, p.H)](
        p.q, p.k, p.v, p.g, p.beta, tinv, w, u, do, states, dstates, dq, dk, dv, dg, db, p.spans, p.T, p.scale,
        V=p.V, BV=p.cfg.tile("lh_bwd_grads"), HAS_WU=wu is not None, **_lh_geom(p),
        **_kw(p.cfg.lh_bwd_grads))
    return dq, dk, dv, dg, db


def run_lh_bwd_split(p: Problem, tinv, do, states, dstates, wu=None):
    """Config.lh_split: (dq, dk, dv, dg, dβ) from each chunk's start state, end-state gradient
    and chunk-wide T, in three kernels (_lh_bwd_dv, _lh_bwd_dqk, _lh_bwd_finish)."""
    B, T, H, K, V, dev, f32 = p.B, p.T, p.H, p.K, p.V, p.q.device, torch.float32
    NBH = B * T * H
    BV = p.cfg.tile("lh_bwd_dv")
    BK = min(p.cfg.tile("lh_bwd_dqk"), triton_next_pow2(K))
    NK = _cdiv(K, BK)
    geom = _lh_geom(p)
    dv = torch.empty_like(p.v)
    vn, dy = (torch.empty(B, T, H, V, dtype=f32, device=dev) for _ in range(2))
    rqk = torch.empty(2, NBH, dtype=f32, device=dev)  # the rows' l2norm factors of k and q
    w, u = wu or (tinv, tinv)
    _lh._lh_bwd_dv_kernel[(p.NC, H, _cdiv(V, BV))](
        p.q, p.k, p.v, p.g, p.beta, tinv, w, u, do, states, dstates, dv, vn, dy, rqk, p.spans, T, p.scale,
        NBH, V=V, BV=BV, HAS_WU=wu is not None, **geom, **_kw(p.cfg.lh_bwd_dv))
    dq32, dk32 = (torch.empty(B, T, H, K, dtype=f32, device=dev) for _ in range(2))
    dgp, dbp = (torch.empty(NK, NBH, dtype=f32, device=dev) for _ in range(2))
    dglp = torch.empty(NK, p.NC, H, dtype=f32, device=dev)
    _lh._lh_bwd_dqk_kernel[(NK, p.NC, H)](
        p.q, p.k, p.v, p.g, p.beta, rqk, do, states, dstates, vn, dy, dq32, dk32, dgp, dbp, dglp, p.spans, T,
        p.scale, NBH, p.NC, V=V, BK=BK, BV=p.cfg.BV, **{n: geom[n] for n in geom if n != "TPREC"},
        **_kw(p.cfg.lh_bwd_dqk))
    dq, dk, dg, db = (torch.empty_like(x) for x in (p.q, p.k, p.g, p.beta))
    _lh._lh_bwd_finish_kernel[(p.NC, H)](
        p.q, p.k, dq32, dk32, dgp, dbp, dglp, dq, dk, dg, db, p.spans, T, NBH, p.NC, NK=NK,
        **{n: geom[n] for n in ("H", "K", "BT", "IS_VARLEN", "NORM_QK")}, **_kw(p.cfg.lh_bwd_finish))
    return dq, dk, dv, dg, db


def _forward(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, dot_bf16=None, t_bf16=None,
             bwd_path=None):
    p = make_problem(q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm, dot_bf16=dot_bf16, t_bf16=t_bf16,
                     bwd_path=bwd_path)
    if p.cfg.large_head:
        tinv = run_lh_inverse(p)
        wu = run_lh_wu(p, tinv) if p.cfg.lh_wu else None
        states, final_state = run_lh_fwd_h(p, tinv, initial_state, wu)
        return run_lh_fwd_o(p, tinv, states, wu), final_state, states, tinv
    tinv = run_wy_inverse(p)  # saved for the backward
    mn = run_fwd_prep(p, tinv)
    # saved for the backward: chunk start states [NC, H, K, V], or on the split path every
    # sub-chunk's start state [NC·NS, H, K, V] (the pass fills slot 0 per chunk, _fwd_out the rest)
    states, final_state = run_state_pass(p, mn, initial_state, reverse=False)
    o = run_fwd_out(p, tinv, states)
    return o, final_state, states, tinv


def _backward(q, k, v, g, beta, initial_state, cu_seqlens, states, tinv, do, dht, scale, use_qk_l2norm,
              dot_bf16=None, t_bf16=None, bwd_path=None):
    p = make_problem(q, k, v, g, beta, cu_seqlens, scale, use_qk_l2norm, dot_bf16=dot_bf16, t_bf16=t_bf16,
                     bwd_path=bwd_path)
    if (states.shape[0] != p.NC * p.cfg.slots or tinv.shape[-1] != p.cfg.t_width
            or tinv.dtype != saved_t_dtype(p.cfg, q.dtype) or states.dtype != saved_states_dtype(p.cfg, q.dtype)):
        raise RuntimeError(
            "gdn_chunk_bwd: the saved states do not match the launch config (chunk.TUNING or chunk.TABLE "
            "changed between the forward and the backward?)")
    if p.cfg.large_head:
        wu = run_lh_wu(p, tinv) if p.cfg.lh_wu else None  # recomputed, not saved
        dstates, dh0 = run_lh_bwd_dh(p, tinv, do, dht, wu)
        grads = run_lh_bwd_split if p.cfg.lh_split else run_lh_bwd_grads
        return (*grads(p, tinv, do, states, dstates, wu), dh0)
    mr = run_bwd_prep(p, tinv, do)
    # split path: dstates has one slot per sub-chunk; the pass fills slot 0 of each chunk with
    # the chunk's end-state gradient, _bwd_dstate the sub-chunk end-state gradients
    dstates, dh0 = run_state_pass(p, mr, dht, reverse=True)
    if p.cfg.bwd_split:
        run_bwd_dstate(p, tinv, do, dstates)
        dq, dk, dv, dg, db = run_bwd_sub(p, tinv, do, states, dstates)
    elif p.cfg.lh_split:  # the chunk-wide T of the large-head path, built here rather than saved
        dq, dk, dv, dg, db = run_lh_bwd_split(p, run_lh_inverse(p), do, states, dstates)
    else:
        dq, dk, dv, dg, db = run_bwd_local(p, tinv, do, states, dstates)
    return dq, dk, dv, dg, db, dh0


# ---------------------------------------------------------------------------------------------
# torch.library registration
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("hymo_kernels::gdn_chunk_fwd", mutates_args=())
def gdn_chunk_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    use_qk_l2norm: bool,
    dot_bf16: bool | None = None,
    t_bf16: bool | None = None,
    bwd_path: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (o, final_state, and for the backward: saved states, sub-chunk inverses). The
    saved states are the chunk start states [NC, H, K, V], or with Config.bwd_split or
    local_sub_states the start state of every sub-chunk [NC·BT/BC, H, K, V], in bf16 with
    Config.states_bf16 (same schema; the shape and dtype follow the config)."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    h0 = initial_state.contiguous() if initial_state is not None else None
    return _forward(q, k, v, g, beta, h0, cu_seqlens, scale, use_qk_l2norm, dot_bf16, t_bf16, bwd_path)


@gdn_chunk_fwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, dot_bf16=None, t_bf16=None,
      bwd_path=None):
    B, T, H, K, V, N, cfg, NC = _common(q, v, cu_seqlens)
    cfg = _overridden(cfg, dot_bf16, t_bf16, bwd_path)
    return (
        v.new_empty(B, T, H, V),
        q.new_empty(N, H, K, V, dtype=torch.float32),
        q.new_empty(NC * cfg.slots, H, K, V, dtype=saved_states_dtype(cfg, q.dtype)),
        q.new_empty(B, T, H, cfg.t_width, dtype=saved_t_dtype(cfg, q.dtype)),
    )


@torch.library.custom_op("hymo_kernels::gdn_chunk_bwd", mutates_args=())
def gdn_chunk_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    states: torch.Tensor,
    tinv: torch.Tensor,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    scale: float,
    use_qk_l2norm: bool,
    dot_bf16: bool | None = None,
    t_bf16: bool | None = None,
    bwd_path: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv, dg, dbeta, dh0); dh0 is computed whether or not h0 was given."""
    # gradients of a .sum() arrive as stride-0 expands
    do = do.contiguous()
    dht = dht.contiguous() if dht is not None else None
    return _backward(q, k, v, g, beta, initial_state, cu_seqlens, states, tinv, do, dht, scale, use_qk_l2norm,
                     dot_bf16, t_bf16, bwd_path)


@gdn_chunk_bwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, states, tinv, do, dht, scale, use_qk_l2norm, dot_bf16=None,
      t_bf16=None, bwd_path=None):
    B, T, H, K, V, N, cfg, NC = _common(q, v, cu_seqlens)
    return (
        torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
        torch.empty_like(beta), q.new_empty(N, H, K, V, dtype=torch.float32),
    )


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, dot_bf16, t_bf16, bwd_path = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, output[2], output[3])
    ctx.scale = scale
    ctx.use_qk_l2norm = use_qk_l2norm
    ctx.dot_bf16, ctx.t_bf16, ctx.bwd_path = dot_bf16, t_bf16, bwd_path
    # no zero gradients for the outputs nobody differentiates (the saved states and T, often the
    # final state): autograd would fill them, ~60 MB per call at the HyMo shape
    ctx.set_materialize_grads(False)


def _input_grads(ctx, do, dht, bwd):
    """The backward of both paths (bwd: the custom op gdn_chunk_bwd or _backward)."""
    q, k, v, g, beta, initial_state, cu_seqlens, states, tinv = ctx.saved_tensors
    do = torch.zeros_like(v) if do is None else do.contiguous()  # a .sum()'s gradient is a stride-0 expand
    dht = dht.contiguous() if dht is not None else None
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    dq, dk, dv, dg, db, dh0 = bwd(q, k, v, g, beta, initial_state, cu_seqlens, states, tinv, do, dht, ctx.scale,
                                  ctx.use_qk_l2norm, ctx.dot_bf16, ctx.t_bf16, ctx.bwd_path)
    return dq, dk, dv, dg, db, (dh0 if initial_state is not None else None), None, None, None, None, None, None


def _autograd_backward(ctx, do, dht, _dstates, _dtinv):
    return _input_grads(ctx, do, dht, gdn_chunk_bwd)


gdn_chunk_fwd.register_autograd(_autograd_backward, setup_context=_setup_context)


class _EagerGDN(torch.autograd.Function):
    """The eager path: the custom ops' launches in a plain autograd.Function. Through the custom
    ops a fwd+bwd cost an H200 host 0.3-0.6 ms more at the HyMo shape (two runs of host_probe,
    benchmarks/LOG.md), and the host time was above the kernels' GPU time; torch.compile keeps the
    custom ops (chunk_gated_delta_rule picks)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, dot_bf16, t_bf16, bwd_path):
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        h0 = initial_state.contiguous() if initial_state is not None else None
        o, final_state, states, tinv = _forward(q, k, v, g, beta, h0, cu_seqlens, scale, use_qk_l2norm, dot_bf16,
                                                t_bf16, bwd_path)
        ctx.save_for_backward(q, k, v, g, beta, h0, cu_seqlens, states, tinv)
        ctx.scale, ctx.use_qk_l2norm = scale, use_qk_l2norm
        ctx.dot_bf16, ctx.t_bf16, ctx.bwd_path = dot_bf16, t_bf16, bwd_path
        ctx.set_materialize_grads(False)
        return o, final_state

    @staticmethod
    def backward(ctx, do, dht):
        return _input_grads(ctx, do, dht, _backward)


# ---------------------------------------------------------------------------------------------
# public entry point
# ---------------------------------------------------------------------------------------------


def unavailable(device_type: str) -> str | None:
    """Why the Triton backend cannot run on tensors of this device type here (None: it can)."""
    if _kern is None:
        return f"needs Triton, which failed to import ({_TRITON_ERROR!r})"
    if device_type != "cuda" and not _INTERPRET:
        return (f"needs CUDA tensors (got {device_type}), or TRITON_INTERPRET=1 set before importing "
                "hymo_kernels to run the kernels in Triton's (slow) CPU interpreter")
    return None


def _check_runnable(q: torch.Tensor) -> None:
    if why := unavailable(q.device.type):
        raise RuntimeError(f"the Triton GDN backend {why}; {_HINT}")


def _check_shapes_traced(q, k, v, g, beta, initial_state, cu_seqlens) -> None:
    """Shape-only validation while torch.compile traces (cu_seqlens values are not readable)."""
    B, T, H, K = q.shape
    if k.shape != q.shape or v.shape[:3] != (B, T, H) or g.shape != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError("expected q, k [B, T, H, K], v [B, T, H, V], g and beta [B, T, H]")
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch must be packed into B = 1, got B = {B}")
    N = cu_seqlens.shape[0] - 1
    if initial_state is not None and initial_state.shape != (N, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must be [N, H, K, V] = {(N, H, K, v.shape[-1])}")


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    dot_bf16: bool | None = None,
    t_bf16: bool | None = None,
    bwd_path: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule, chunked Triton kernels with a hand-written backward.

    Args:
        q, k: [B, T, H, K] read and write keys, bf16/fp16/fp32 (K and V powers of two, 16..256).
        v: [B, T, H, V] values.
        g: [B, T, H] log decay (≤ 0).
        beta: [B, T, H] write strength in (0, 1).
        scale: multiplies q.
            Default: K ** -0.5.
        initial_state: [N, H, K, V] state before the first token of each sequence (fp32 math).
            Default: None (zeros).
        output_final_state: also return the [N, H, K, V] fp32 state after each sequence.
            Default: False.
        cu_seqlens: [N + 1] cumulative document lengths of a packed batch (B must be 1).
            Default: None.
        use_qk_l2norm_in_kernel: L2-normalise q and k (eps 1e-6) inside the kernels.
            Default: False.
        dot_bf16: with bf16 inputs, run the dots on bf16 operands (``Config.dot_bf16``; not
            the WY inverse's): True, False, or None for the launch table's choice.
            Default: None.
        t_bf16: with dot_bf16 on, the dots with T = (I + A)⁻¹ on bf16 operands too
            (``Config.t_bf16``): True, False, or None for the launch table's choice.
            Default: None.
        bwd_path: the backward (``BWD_PATHS``): "local_sub" saves every 16-token sub-chunk's
            start state for it (K·V per 16 tokens and head, bf16 with bf16 dots: BT / 16 times
            what "local" saves, 16x at K = 32; the table's choice at K = 32 and 128, 5-10 % faster
            on an H200); "local" saves the chunk start states only and re-runs each chunk's
            forward in the backward; "split" saves what "local_sub" saves, with a parallel
            gradient kernel (slower).
            None: the launch table's choice. The large-head path keeps its own.
            Default: None.

    Returns:
        o: [B, T, H, V] in v's dtype; final_state: [N, H, K, V] fp32, or None.
    """
    _check_runnable(q)
    if cu_seqlens is not None and torch.compiler.is_compiling():
        _check_shapes_traced(q, k, v, g, beta, initial_state, cu_seqlens)
    else:
        check_gdn_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    K, V = q.shape[-1], v.shape[-1]
    for name, d in (("K", K), ("V", V)):
        if d not in (16, 32, 64, 128, 256):
            raise ValueError(f"{name} = {d}: the Triton GDN kernels need a power of two in 16..256")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {q.dtype}: use float32, bfloat16 or float16")
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(torch.int32)
    scale = K**-0.5 if scale is None else float(scale)
    args = (q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm_in_kernel, dot_bf16, t_bf16, bwd_path)
    if torch.compiler.is_compiling():
        o, final_state, _, _ = gdn_chunk_fwd(*args)
    else:
        o, final_state = _EagerGDN.apply(*args)
    return o, (final_state if output_final_state else None)


__all__ = [
    "BWD_PATHS", "KERNELS", "KERNELS_LOCAL", "KERNELS_SPLIT", "TABLE", "TUNING", "Config", "KernelCfg", "Problem",
    "chunk_gated_delta_rule", "config_from_entry",
    "gdn_chunk_bwd", "gdn_chunk_fwd", "get_config", "make_problem",
]
