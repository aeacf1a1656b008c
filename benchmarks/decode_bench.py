"""Cached decoding of HyMo (hymo_recipes/model/decode.py) beside Hugging Face's Qwen3-Next at a matched shape.

    python -m benchmarks.decode_bench                          # one H200: batch 1 and 64, context 1K, 8K, 32K
    python -m benchmarks.decode_bench --batches 1 --contexts 1024 8192 --steps 32
    python -m benchmarks.decode_bench --models hymo --hymo-prefill per-seq
    python -m benchmarks.decode_bench --dry                    # CPU: the debug flavor, tiny Qwen3-Next, seconds

The models, random init, bf16 on CUDA (fp32 in the dry mode), one after the other on the device:
- ``hymo``: ``HymoModel`` of the ``750m`` flavor (``debugmodel`` with --dry), GDN backend
  "triton" on the GPU (the chunked PyTorch reference on the CPU), decoded with ``HymoDecoder``:
  ``prefill`` (the prompts packed into one row with cu_seqlens; GDN state + conv inputs and the
  MLA latent cache kept), then ``step`` per token (GDN O(1), MLA by weight absorption over the
  latents). ``moe_capacity_factor`` is set to 0 (the decoder is dropless anyway; it makes the
  full forward of the guard dropless too) and ``max_seq_len`` to cover the longest run (only the
  RoPE table's length; no parameter changes).
- ``hf``: transformers' ``Qwen3NextForCausalLM`` from a ``Qwen3NextConfig`` derived from the
  same HyMo args: hidden size, layers, vocabulary, tied head; GDN ("linear_attention") at HyMo's
  GDN layers (3:1), 40 heads of K = V = 32, conv 4; full attention at HyMo's MLA layers, 16
  heads, 4 KV heads, head dim 128 (= HyMo's qk nope + rope; partial RoPE on 32 of them, HyMo's
  rope dim); MoE (16 experts, top 2, expert and shared-expert width 2304) on the attention
  layers only and no FFN on the GDN layers (``mlp_only_layers`` with ``intermediate_size``
  = HyMo's ``gdn_ffn_dim`` = 0: a zero-width MLP), as HyMo. Left unmatched: Qwen3-Next's
  attention output gate and q/k norms, its shared-expert gate, GQA attention instead of MLA,
  and no MTP heads (HyMo's are built but not run in decoding). Decoded as ``generate`` does:
  a ``DynamicCache(config=...)`` (per GDN layer conv + recurrent state, per attention layer K/V
  grown by ``torch.cat`` each step) passed under the name the installed forward takes (``cache``
  in recent transformers 5 releases, ``past_key_values`` before: an unknown keyword would be
  swallowed by ``**kwargs`` and decode without a cache) with ``use_cache=True`` and
  ``logits_to_keep=1``.
  Its kernels are resolved when transformers imports the model (the run prints the choice):
  with flash-linear-attention importable, fla's ``chunk_gated_delta_rule`` (prefill) and
  ``fused_recurrent_gated_delta_rule`` (decode); the short conv is the ``causal-conv1d``
  package's ``causal_conv1d_fn`` / ``causal_conv1d_update`` if installed, else HF's PyTorch
  fallbacks (depthwise ``F.conv1d`` / cat + conv per step); attention through SDPA; experts per
  ``config._experts_implementation``. Without fla, HF runs its PyTorch reference recurrences
  (much slower): a GPU run without fla compares against the fallback, not the peer.

Per model, batch B and context C (random prompt tokens, the same for both models): a warm-up
prefill at min(C, 1024) and a few steps; the prefill of B × C tokens (median of
``--prefill-iters``, CUDA events; host clock on the CPU); ``--warmup`` untimed steps, then
``--steps`` timed steps, one token per sequence (greedy: each step feeds the argmax of the last
logits): decode ms/token is their median, tokens/s = B / that. Cache MiB: HyMo's
``DecodeCache`` after the prefill as its ``nbytes_per_sequence`` counts it (GDN fp32 states and
conv inputs, MLA latents + rope keys of the C held tokens; the decoder's preallocated room for
the coming steps not counted) × B; HF's cache object, every tensor it holds after the prefill.
Peak GiB: ``torch.cuda.max_memory_allocated`` over the timed prefill and steps (weights included;
"–" on the CPU). The table ends with HyMo/HF per (batch, context). Then, computed from the
args at each context: the bytes per sequence of HyMo's cache, of the all-MLA model of HyMo's
depth with the same latent cache, and of that model with a full per-head K/V cache; HyMo's
formula is checked against every HyMo row's measured cache (a mismatch fails the row).

HyMo's prefill of equal-length prompts (``HymoDecoder.prefill``'s ``max_tokens``):
``--hymo-prefill packed`` runs all B prompts in one row of T = B·C tokens (MLA attends within
each prompt through flex attention with a block mask on the GPU, SDPA with a dense [T, T] mask
on the CPU); ``per-seq`` one forward per prompt, the caches concatenated along the batch (the
decoding is then the same); ``auto`` (default) as many prompts per forward as fit in 32768
tokens (the decoder's default), bounding each forward's activations. An out-of-memory row is
reported, not fatal.

Guard: at the smallest (batch, context) each model's last decode logits must match a full
forward on the same tokens (prompt + fed tokens) within ``--tol`` (relative L2; default 1e-3 in
fp32, 0.15 in bf16, where the cached path and the full forward round differently: chunked
against recurrent GDN, absorbed against expanded MLA, and a router tie may flip an expert; the
prefill alone already differs from the full forward by several percent at 750m, so ``--dtype
fp32`` is the exact check of the cache on the GPU), that error must
be under half the change the same fed tokens' logits show after another prompt (so a cache that
loses the prompt cannot pass), and the cache must hold C + fed tokens; for HyMo also the
per-prompt prefill must decode as the packed one (2 prompts, 2 steps). A failed guard, a failed
row (out of memory included) or non-finite logits exit 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import statistics
import sys
import time
import warnings

import torch

MODELS = ("hymo", "hf")


def log(msg: str) -> None:
    print(f"decode_bench: {msg}", flush=True)


@dataclasses.dataclass
class Row:
    model: str
    batch: int
    context: int
    prefill_ms: float = float("nan")
    decode_ms: float = float("nan")
    cache_mib: float = float("nan")
    peak_gib: float = float("nan")
    note: str = ""

    @property
    def tokens_s(self) -> float:
        return 1e3 * self.batch / self.decode_ms


class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn):
        """(fn's result, its time in ms)."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            return out, start.elapsed_time(end)
        t0 = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - t0) * 1e3


# -- the models ------------------------------------------------------------------------------------

def hymo_args(flavor: str, device: torch.device, max_len: int):
    from hymo_recipes.generate import with_backend
    from hymo_recipes.model import hymo_flavors

    args = dataclasses.replace(hymo_flavors[flavor], moe_capacity_factor=0.0,
                               max_seq_len=max(hymo_flavors[flavor].max_seq_len, max_len))
    if device.type == "cuda":
        return dataclasses.replace(args, gdn_backend="triton")
    return with_backend(args, device)


def build_hymo(args, device: torch.device, dtype: torch.dtype):
    """As generate.load_model builds it, with random weights: parameters in dtype, buffers fp32."""
    from hymo_recipes.model import HymoModel

    torch.manual_seed(0)
    with torch.device("meta"):
        model = HymoModel(args)
    model = model.to_empty(device=device)
    model.init_weights(buffer_device=device)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model.eval()


def qwen3_next_config(a, max_len: int):
    """A Qwen3NextConfig at HyMo args ``a``'s shape (module docstring)."""
    from transformers import Qwen3NextConfig

    head_dim = a.qk_nope_head_dim + a.qk_rope_head_dim
    mla = set(a.mla_layers)
    return Qwen3NextConfig(
        vocab_size=a.vocab_size, hidden_size=a.dim, num_hidden_layers=a.n_layers, rms_norm_eps=a.norm_eps,
        tie_word_embeddings=True, max_position_embeddings=max_len,
        layer_types=["full_attention" if i in mla else "linear_attention" for i in range(a.n_layers)],
        num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads, head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta},
        partial_rotary_factor=a.qk_rope_head_dim / head_dim,
        linear_num_key_heads=a.gdn_n_heads, linear_num_value_heads=a.gdn_n_heads,
        linear_key_head_dim=a.gdn_head_dim, linear_value_head_dim=a.gdn_v_head_dim,
        linear_conv_kernel_dim=a.gdn_conv_size,
        num_experts=a.moe_num_experts, num_experts_per_tok=a.moe_top_k, moe_intermediate_size=a.moe_inter_dim,
        shared_expert_intermediate_size=a.moe_inter_dim * a.moe_num_shared_experts, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[i for i in range(a.n_layers) if i not in mla],
        intermediate_size=a.gdn_ffn_dim, initializer_range=a.init_std, use_cache=True,
    )


def build_hf(config, device: torch.device, dtype: torch.dtype):
    from transformers import Qwen3NextForCausalLM

    torch.manual_seed(0)
    with torch.device(device), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors")  # the zero-width MLPs
        model = Qwen3NextForCausalLM._from_config(config, attn_implementation="sdpa")
    return model.to(dtype).eval()


def hf_kernels() -> dict[str, str]:
    """The implementation transformers resolved for each of Qwen3-Next's kernel entry points."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    out = {}
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update"):
        fn, impl = getattr(m, name), None
        for _ in range(4):  # through the hub-kernel wrapper to the fallback wrapper's closure
            try:
                impl = inspect.getclosurevars(fn).nonlocals.get("implementation")
            except (TypeError, ValueError):  # a builtin or C function: nothing to unwrap
                impl = None
            if impl is not None or not hasattr(fn, "__wrapped__"):
                break
            fn = fn.__wrapped__
        impl = impl or fn
        out[name] = f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', impl)}"
    return out


def n_params(model, skip: str | None = None) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if skip is None or not n.startswith(skip))


# -- caches ----------------------------------------------------------------------------------------

def hymo_cache_bytes(cache) -> int:
    return sum(cache.nbytes_per_sequence().values()) * cache.lengths.numel()


def hf_cache_bytes(cache) -> int:
    seen, total = set(), 0
    for layer in cache.layers:
        tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
        for states in ("conv_states", "recurrent_states"):
            tensors += list((getattr(layer, states, None) or {}).values())
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.numel() and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def hymo_prefill(decoder, prompts: torch.Tensor, capacity: int, mode: str, packed_max: int):
    """HymoDecoder.prefill of prompts [B, C]: one packed forward, one per prompt, or (auto) as
    many prompts per forward as fit in ``packed_max`` tokens, the caches concatenated along the
    batch -> (last logits [B, V], DecodeCache, mode used)."""
    B, C = prompts.shape
    max_tokens = {"packed": None, "per-seq": 1, "auto": packed_max}[mode]
    logits, cache = decoder.prefill(list(prompts), capacity=capacity, max_tokens=max_tokens)
    if mode == "auto":
        per = max(1, packed_max // C)
        mode = "packed" if B <= per else f"{per} per forward"
    return logits, cache, mode


def hf_cache_keyword(model) -> str:
    """The name the installed transformers' forward takes the cache under (module docstring)."""
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise RuntimeError(f"{type(model).__name__}.forward takes neither cache nor past_key_values")


class Runner:
    """prefill(prompts) -> (logits, cache, note); step(tokens, cache) -> logits; full(tokens) -> last logits."""

    def __init__(self, name: str, model, vocab_size: int, hymo_prefill: str, packed_max: int):
        self.name, self.model, self.vocab_size = name, model, vocab_size
        self.hymo_prefill, self.packed_max = hymo_prefill, packed_max
        if name == "hymo":
            from hymo_recipes.model.decode import HymoDecoder

            self.decoder = HymoDecoder(model)
        else:
            self.cache_kw = hf_cache_keyword(model)

    @torch.no_grad()
    def prefill(self, prompts: torch.Tensor, capacity: int):
        if self.name == "hymo":
            return hymo_prefill(self.decoder, prompts, capacity, self.hymo_prefill, self.packed_max)
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=prompts, **{self.cache_kw: cache}, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1], cache, ""

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        if self.name == "hymo":
            return self.decoder.step(tokens, cache)
        return self.model(input_ids=tokens[:, None], **{self.cache_kw: cache}, use_cache=True,
                          logits_to_keep=1).logits[:, -1]

    @torch.no_grad()
    def full(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.name == "hymo":
            return self.model(tokens)[0][:, -1]
        return self.model(input_ids=tokens, use_cache=False, logits_to_keep=1).logits[:, -1]

    def cache_bytes(self, cache) -> int:
        return hymo_cache_bytes(cache) if self.name == "hymo" else hf_cache_bytes(cache)

    def held(self, cache) -> int:
        return cache.max_length if self.name == "hymo" else cache.get_seq_length()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def guard(runner: Runner, tokens: torch.Tensor, C: int, last: torch.Tensor, cache, tol: float) -> str:
    """'' if the cached decode's last logits match a full forward on tokens [B, C + fed] (module
    docstring), else why not. The context's weight: the same fed tokens after another prompt."""
    full = runner.full(tokens)
    other = tokens.clone()
    other[:, :C] = torch.randint(0, runner.vocab_size, (tokens.shape[0], C), generator=torch.Generator().manual_seed(7))
    err, ctx = rel(last, full), rel(runner.full(other), full)
    log(f"guard {runner.name}: cached vs full forward rel. L2 {err:.2e} (tol {tol:.2g}); after another prompt {ctx:.2e}")
    why = []
    if not err <= tol:
        why.append(f"cached logits off by {err:.2e} > {tol:.2g}")
    if not err < 0.5 * ctx:
        why.append(f"error {err:.2e} not under half the other prompt's {ctx:.2e}")
    if runner.held(cache) != tokens.shape[1]:
        why.append(f"the cache holds {runner.held(cache)} tokens, {tokens.shape[1]} were fed")
    return "; ".join(why)


def guard_per_seq(runner: Runner, C: int, device, tol: float) -> str:
    """'' if HyMo's per-prompt prefill (caches concatenated) decodes as the packed one: 2 prompts, 2 steps."""
    prompts = torch.randint(0, runner.vocab_size, (2, C), generator=torch.Generator().manual_seed(8)).to(device)
    out = {}
    for mode in ("packed", "per-seq"):
        logits, cache, _ = hymo_prefill(runner.decoder, prompts, C + 3, mode, runner.packed_max)
        first = logits
        for _ in range(2):
            logits = runner.decoder.step(logits.argmax(-1), cache)
        out[mode] = first, logits
    errs = [rel(a, b) for a, b in zip(out["per-seq"], out["packed"])]
    log(f"guard hymo per-seq prefill: vs packed, prefill logits rel. L2 {errs[0]:.2e}, after 2 steps {errs[1]:.2e}")
    return "" if max(errs) <= tol else f"per-seq prefill off the packed one by {max(errs):.2e} > {tol:.2g}"


def run_row(runner: Runner, B: int, C: int, args, device, do_guard: bool) -> Row:
    row = Row(runner.name, B, C)
    timer = Timer(device)
    gen = torch.Generator().manual_seed(1000 * B + C)
    prompts = torch.randint(0, runner.vocab_size, (B, C), generator=gen).to(device)
    capacity = C + args.warmup + args.steps + 1
    try:
        # warm-up: kernels compiled / tuned, allocator grown
        wc = min(C, args.warmup_context)
        logits, cache, _ = runner.prefill(prompts[:, :wc], wc + args.warmup + 1)
        for _ in range(args.warmup):
            logits = runner.step(logits.argmax(-1), cache)
        del logits, cache
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.prefill_iters):
            cache = None  # the previous prefill's cache freed before the next
            (logits, cache, mode), ms = timer(lambda: runner.prefill(prompts, capacity))
            times.append(ms)
        row.prefill_ms = statistics.median(times)
        row.note = mode
        row.cache_mib = runner.cache_bytes(cache) / 2**20
        fed, times = [], []
        for i in range(args.warmup + args.steps):
            nxt = logits.argmax(-1)
            fed.append(nxt)
            logits, ms = timer(lambda: runner.step(nxt, cache))
            if i >= args.warmup:
                times.append(ms)
        row.decode_ms = statistics.median(times)
        if device.type == "cuda":
            row.peak_gib = torch.cuda.max_memory_allocated() / 2**30
        if not math.isfinite(float(logits.float().abs().max())):
            row.note = "non-finite logits"
        elif do_guard:
            tokens = torch.cat([prompts, torch.stack(fed, dim=1)], dim=1)
            why = guard(runner, tokens, C, logits, cache, args.tol)
            if runner.name == "hymo":
                why = "; ".join(filter(None, [why, guard_per_seq(runner, C, device, args.tol)]))
            row.note = f"GUARD FAILED: {why}" if why else ", ".join(filter(None, [row.note, "guard ok"]))
    except torch.OutOfMemoryError:
        row.note = "out of memory"
    except Exception as e:  # noqa: BLE001  (a row that fails is reported, not fatal)
        row.note = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    finally:
        cache = logits = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def cache_per_sequence(a, context: int, elem: int) -> dict[str, int]:
    """Bytes one sequence of ``context`` tokens keeps, computed from HyMo args ``a`` (activations
    of ``elem`` bytes): HyMo's cache (its GDN layers' fp32 state and W - 1 conv inputs, fixed;
    its MLA layers' latent + rope key per token), the all-MLA model of HyMo's depth with the
    same latent cache (every layer an MLA layer), and that model with a full per-head K/V cache
    (no weight absorption: keys of qk_nope + qk_rope and values of v_head_dim per head)."""
    n_mla = len(a.mla_layers)
    n_gdn = a.n_layers - n_mla
    H, K, V = a.gdn_n_heads, a.gdn_head_dim, a.gdn_v_head_dim
    gdn = n_gdn * (H * K * V * 4 + (a.gdn_conv_size - 1) * (2 * H * K + H * V) * elem)
    latent = (a.kv_lora_rank + a.qk_rope_head_dim) * elem
    full = a.n_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim) * elem
    return {"hymo": gdn + n_mla * latent * context, "all_mla_latent": a.n_layers * latent * context,
            "all_mla_full_kv": a.n_layers * full * context}


def n_layers_note(a) -> str:
    return (f"HyMo: {a.n_layers - len(a.mla_layers)} GDN + {len(a.mla_layers)} MLA layers; the all-MLA model: "
            f"{a.n_layers} MLA layers of the same shape")


def cache_table(a, contexts: list[int], elem: int) -> str:
    out = ["| context | HyMo cache MiB / sequence | all-MLA latent cache | all-MLA full K/V cache | "
           "HyMo / latent | HyMo / full K/V |", "|---|---|---|---|---|---|"]
    for c in contexts:
        b = cache_per_sequence(a, c, elem)
        h, lat, full = (b[k] / 2**20 for k in ("hymo", "all_mla_latent", "all_mla_full_kv"))
        out.append(f"| {c} | {h:.2f} | {lat:.2f} | {full:.2f} | {h / lat:.2f}x | {h / full:.3f}x |")
    return "\n".join(out)


def _f(x: float, spec: str, suffix: str = "") -> str:
    return f"{x:{spec}}{suffix}" if math.isfinite(x) else "–"


def table(rows: list[Row]) -> str:
    out = ["| model | batch | context | prefill ms | decode ms/token | tokens/s | cache MiB | peak GiB | note |",
           "|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r.batch, r.context) for r in rows})
    for b, c in keys:
        by = {r.model: r for r in rows if (r.batch, r.context) == (b, c)}
        for r in by.values():
            out.append(f"| {r.model} | {b} | {c} | {_f(r.prefill_ms, '.2f')} | {_f(r.decode_ms, '.3f')} | "
                       f"{_f(r.tokens_s, '.1f')} | {_f(r.cache_mib, '.2f')} | {_f(r.peak_gib, '.2f')} | {r.note} |")
        if "hymo" in by and "hf" in by:
            h, f = by["hymo"], by["hf"]
            ratios = [h.prefill_ms / f.prefill_ms, h.decode_ms / f.decode_ms, h.tokens_s / f.tokens_s,
                      h.cache_mib / f.cache_mib, h.peak_gib / f.peak_gib]
            out.append(f"| HyMo/HF | {b} | {c} | " + " | ".join(_f(x, ".2f", "x") for x in ratios) + " | |")
    return "\n".join(out)


def versions(device: torch.device) -> None:
    import transformers

    def version(mod: str) -> str:
        try:
            return __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            return f"not importable ({type(e).__name__})"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log(f"device {name} | torch {torch.__version__} | transformers {transformers.__version__} | triton "
        f"{version('triton')} | fla {version('fla')} | causal_conv1d {version('causal_conv1d')}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry", action="store_true", help="CPU, fp32: the debug flavor, a tiny Qwen3-Next, tiny contexts")
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--flavor", default=None, help="HyMo flavor (default 750m; debugmodel with --dry)")
    ap.add_argument("--batches", nargs="+", type=int, default=None, help="default 1 64 (1 2 with --dry)")
    ap.add_argument("--contexts", nargs="+", type=int, default=None, help="prompt tokens (default 1024 8192 32768; "
                                                                          "16 32 with --dry)")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps (default 64; 3 with --dry)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed decode steps first (default 5; 1 with --dry)")
    ap.add_argument("--warmup-context", type=int, default=1024, help="prompt tokens of the warm-up prefill (at most C)")
    ap.add_argument("--prefill-iters", type=int, default=1, help="timed prefills per row (median)")
    ap.add_argument("--hymo-prefill", choices=("auto", "packed", "per-seq"), default="auto",
                    help="HyMo's prefill: one packed call, one call per prompt, or packed up to --packed-max-tokens")
    ap.add_argument("--packed-max-tokens", type=int, default=None,
                    help="auto's tokens per prefill forward (default: the decoder's PREFILL_MAX_TOKENS; 32 with --dry, "
                         "so both paths run)")
    ap.add_argument("--tol", type=float, default=None, help="guard's relative L2 tolerance (default 0.15 bf16, 1e-3 fp32)")
    ap.add_argument("--no-guard", dest="guard", action="store_false")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                    help="parameters and activations (default bf16 on the GPU, fp32 with --dry; fp32 on the GPU "
                         "separates bf16 rounding from a cache error in the guard)")
    args = ap.parse_args(argv)
    dry = args.dry
    args.flavor = args.flavor or ("debugmodel" if dry else "750m")
    args.batches = args.batches or ([1, 2] if dry else [1, 64])
    args.contexts = args.contexts or ([16, 32] if dry else [1024, 8192, 32768])
    args.steps = args.steps or (3 if dry else 64)
    args.warmup = args.warmup if args.warmup is not None else (1 if dry else 5)
    from hymo_recipes.model.decode import PREFILL_MAX_TOKENS

    args.packed_max_tokens = args.packed_max_tokens or (32 if dry else PREFILL_MAX_TOKENS)
    if dry:
        if args.dtype == "bf16":
            sys.exit("decode_bench: --dry runs fp32 (bf16 on the CPU is not what the GPU computes)")
        device, dtype = torch.device("cpu"), torch.float32
        torch.set_num_threads(min(torch.get_num_threads(), 2))
    else:
        if not torch.cuda.is_available():
            sys.exit("decode_bench: no CUDA GPU; run with --dry on a CPU")
        device, dtype = torch.device("cuda"), torch.float32 if args.dtype == "fp32" else torch.bfloat16
    args.tol = args.tol if args.tol is not None else (1e-3 if dtype == torch.float32 else 0.15)
    versions(device)
    max_len = max(args.contexts) + args.warmup + args.steps + 1
    hargs = hymo_args(args.flavor, device, max_len)
    small = (min(args.batches), min(args.contexts))
    log(f"{str(dtype).removeprefix('torch.')}, batches {args.batches}, contexts {args.contexts}, {args.warmup} + "
        f"{args.steps} steps, HyMo prefill {args.hymo_prefill}; guard at batch {small[0]}, context {small[1]}")

    rows: list[Row] = []
    counts = {}
    for name in args.models:
        if name == "hymo":
            model = build_hymo(hargs, device, dtype)
            counts[name] = (n_params(model), n_params(model, skip="mtp_heads"))
            log(f"hymo: flavor {args.flavor}, {counts[name][0]:,} parameters ({counts[name][1]:,} without the MTP "
                f"heads), GDN backend {hargs.gdn_backend}")
        else:
            config = qwen3_next_config(hargs, max_len)
            model = build_hf(config, device, dtype)
            counts[name] = (n_params(model), n_params(model))
            log(f"hf: Qwen3NextForCausalLM, {counts[name][0]:,} parameters, attention "
                f"{model.config._attn_implementation}, experts {getattr(model.config, '_experts_implementation', '?')}")
            for k, v in hf_kernels().items():
                log(f"hf: {k} -> {v}")
        runner = Runner(name, model, hargs.vocab_size, args.hymo_prefill, args.packed_max_tokens)
        for B in args.batches:
            for C in args.contexts:
                r = run_row(runner, B, C, args, device, args.guard and (B, C) == small)
                log(f"{name} batch {B} context {C}: prefill {r.prefill_ms:.2f} ms, decode {r.decode_ms:.3f} ms/token"
                    f"{', ' + r.note if r.note else ''}")
                rows.append(r)
        del runner, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    elem = torch.finfo(dtype).bits // 8
    for r in rows:  # the formula against the caches the runs held after their prefill
        want = cache_per_sequence(hargs, r.context, elem)["hymo"] * r.batch / 2**20
        if r.model == "hymo" and math.isfinite(r.cache_mib) and abs(r.cache_mib - want) > 1e-6 * want:
            r.note = f"failed: cache {r.cache_mib:.3f} MiB, computed {want:.3f}"
    print(table(rows))
    print(f"Per-sequence cache, computed ({n_layers_note(hargs)}; {elem}-byte activations, fp32 GDN states):")
    print(cache_table(hargs, args.contexts, elem))
    if len(counts) == 2:
        print(f"parameters: hymo {counts['hymo'][0]:,} ({counts['hymo'][1]:,} without MTP), hf {counts['hf'][0]:,}")
    bad = [r for r in rows if not math.isfinite(r.decode_ms) or "FAILED" in r.note or r.note.startswith(("failed",
                                                                                                        "non-finite"))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
