"""Training-step throughput of HyMo against TorchTitan's own models, through the real train loop.

    python -m benchmarks.train_bench                                   # the default runs, one GPU
    python -m benchmarks.train_bench --runs hymo_750m:16 dsv3_8:16 --steps 12
    python -m benchmarks.train_bench --runs hymo_750m:max --mem-cap-gib 80
    python -m benchmarks.train_bench --runs hymo_750m:8 hymo_750m:8::v dsv3_32:4 --variant v="--hymo.gdn_bwd_path local"
    python -m benchmarks.train_bench --runs hymo_750m:8:none hymo_750m:8:none:old --tree old=/tmp/old
    python -m benchmarks.train_bench --dry                             # CPU: the tiny flavors, 3 steps

Each run is ``NGPU=1 ./run_train.sh`` (one process; FSDP2 and compile as the config says) with
seq 4096 (64 in the dry mode), one microbatch per step (global batch = local batch), no
checkpoints and no validation, every step logged; TorchTitan's models train with its AdamW
(lr 3e-4), HyMo with its config's optimizers; ``benchmarks.peers`` is imported into every
run (TorchTitan's models at HyMo's shapes, and the optimizer-step timer). A run spec is
``PRESET[:BATCH[:AC[:VARIANT]]]`` (``--global-batch`` sets the sequences per optimizer step, i.e.
gradient accumulation, for every run): BATCH a number, or ``max`` for the largest of ``--batches`` whose run
fits under ``--mem-cap-gib`` (tried in increasing order, stopping at the first that does not);
AC ``none`` | ``selective`` | ``full`` (default, or left empty: the preset's); VARIANT the name of a
``--variant NAME="ARGS"``: run_train.sh arguments for that run alone (arguments after ``--`` go
to every run, the peers' included). So one call times a HyMo setting beside the shipped one and
the peers, e.g. ``--runs hymo_750m:8:none hymo_750m:8:none:lean dsv3_32:4 --variant
lean="--hymo.gdn_mixer_saves inputs"``; the table then also gives each variant run's tokens/s
over the run of the same preset, batch and AC without a variant. A ``--tree NAME=DIR`` is a
variant of code instead of arguments: the runs whose spec ends in ``:NAME`` run DIR's
run_train.sh from DIR, with DIR's code and kernels first on the path, so its configs, its
``benchmarks.peers`` and its launcher too (DIR a copy of the repository at another revision,
e.g. ``git archive REV | tar -x -C DIR``; this checkout's data/brown and assets/tokenizer are
linked into it where it has none, the one write into DIR), so a code change is timed beside the
code before it in one call: ``--runs hymo_750m:8:none hymo_750m:8:none:base --tree
base=/tmp/base``. Every run's ``python3`` is the interpreter that runs this script.

The output starts with the date, the GPU and driver, the versions of torch, Triton and
TorchTitan, and the code each run executes (a fingerprint of its files, and its git commit where
it has one). Per run, over the steps after ``--warmup`` (compile and allocator warm-up): median tokens/s,
TFLOP/s and MFU as TorchTitan logs them, i.e. num_flops_per_token × tokens/s against the GPU's
peak (989 TFLOP/s bf16 dense for an H100/H200; TorchTitan's get_peak_flops), with each model's
own get_nparams_and_flops: TorchTitan's 6 × active non-embedding parameters + 6 × layers ×
heads × (qk + v head dims) × seq for its models; HyMo's hymo_recipes/model/counts.py adds the
tied head once per MTP head and the GDN recurrence as the chunked algorithm executes it. Peak
memory is TorchTitan's (the allocator's peak reserved bytes). The optimizer share is the
optimizer step's time (CUDA events) over the step time (tokens / tokens/s). Then each variant
or tree run over the same run without it: the ratio of the medians and the step-by-step ratios
(median, min and max over the timed steps both runs logged; both read the same batches, so these
leave out the batches' own effect on the step time), and each HyMo run's tokens/s over each
peer run's at the same batch and over every peer run.

On a GPU, ``nvidia-smi`` samples the first visible GPU's SM clock, power draw and temperature
every 250 ms while a run trains; the table gives their medians (temperature: maximum) over the
timed steps, placed by the log's timestamps: a clock below the GPU's maximum under a power
draw at its limit says the run was power-capped, so its kernels ran slower than in a short
profile.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# model presets: the TOML of a HyMo run, or (TorchTitan model name, flavor) for a peer
PRESETS = {
    "hymo_750m": dict(config="train_configs/hymo_750m.toml", ac="selective"),
    "hymo_small": dict(config="train_configs/hymo_small.toml", ac="none"),
    "dsv3_8": dict(model=("deepseek_v3", "hymo_mla8"), ac="none"),
    "dsv3_32": dict(model=("deepseek_v3", "hymo_mla32"), ac="none"),
    "llama3_450m": dict(model=("llama3", "450m"), ac="none"),
    # the CPU dry run's
    "hymo_debug": dict(config="train_configs/debug_model.toml", ac="none", dry=True),
    "dsv3_tiny": dict(model=("deepseek_v3", "hymo_mla_tiny"), ac="none", dry=True),
    "llama3_tiny": dict(model=("llama3", "450m_tiny"), ac="none", dry=True),
}
DEFAULT_RUNS = ["hymo_750m:4", "hymo_750m:16", "dsv3_8:4", "dsv3_8:16", "dsv3_32:4", "llama3_450m:16"]
DRY_RUNS = ["hymo_debug:2", "dsv3_tiny:2", "llama3_tiny:2"]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.naninf]+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)"
                   r".*?tflops:\s*([\d,.]+).*?mfu:\s*([\d.]+)%")
_OPT = re.compile(r"bench: optimizer_step_ms=([\d.]+)")
# TorchTitan's log records: "[titan] 2026-12-01 10:02:38,135 - root - INFO - ... step: 7 ..."
_STEP_TIME = re.compile(r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?step:\s*(\d+)\s+loss:")
_SMI_FIELDS = "timestamp,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu"
_PEER_TOML = """\
[job]
description = "benchmark peer {model}:{flavor}"
[model]
name = "{model}"
flavor = "{flavor}"
hf_assets_path = "./assets/tokenizer"
[training]
dataset = "brown"
[optimizer]
name = "AdamW"
lr = 3e-4
[lr_scheduler]
warmup_steps = 2
[compile]
enable = {compile}
[hymo]
document_masking = false
"""


@dataclasses.dataclass
class Run:
    preset: str
    batch: int
    ac: str
    steps: list[dict] = dataclasses.field(default_factory=list)
    opt_ms: list[float] = dataclasses.field(default_factory=list)
    seq: int = 4096
    global_batch: int = 0  # 0: the local batch (one microbatch per step)
    error: str = ""
    seconds: float = 0.0
    gpu: dict | None = None  # GpuSampler.summary over the timed steps
    variant: str = ""  # a --variant or --tree name: its arguments or its code for this run alone
    extra: list[str] = dataclasses.field(default_factory=list)
    tree: Path | None = None  # a --tree's copy of the repository that this run runs from

    @property
    def name(self) -> str:
        return f"{self.preset}:{self.batch}:{self.ac}" + (f":{self.variant}" if self.variant else "")

    @property
    def is_hymo(self) -> bool:
        return "config" in PRESETS[self.preset]

    def median(self, key: str, warmup: int) -> float:
        vals = [s[key] for s in self.steps if s["step"] > warmup]
        return statistics.median(vals) if vals else float("nan")

    def peak_gib(self) -> float:
        return max((s["mem"] for s in self.steps), default=float("nan"))


def parse_log(text: str) -> tuple[list[dict], list[float]]:
    """The logged steps (step, loss, mem GiB, tps, tflops, mfu) and optimizer-step times (ms)."""
    steps, opt = [], []
    for line in _ANSI.sub("", text).splitlines():
        if m := _STEP.search(line):
            steps.append(dict(step=int(m[1]), loss=float(m[2]), mem=float(m[3]), tps=float(m[4].replace(",", "")),
                              tflops=float(m[5].replace(",", "")), mfu=float(m[6])))
        elif m := _OPT.search(line):
            opt.append(float(m[1]))
    return steps, opt


def step_times(text: str) -> dict[int, datetime]:
    """When each step was logged (TorchTitan's record time)."""
    out = {}
    for line in _ANSI.sub("", text).splitlines():
        if m := _STEP_TIME.search(line):
            out[int(m[2])] = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f")
    return out


class GpuSampler:
    """``nvidia-smi`` sampling a GPU's clocks, power and temperature in the background while a
    run trains, into a temporary file (a pipe read only at the end would fill and stall it);
    nothing where there is no ``nvidia-smi``. The GPU is the first entry of
    CUDA_VISIBLE_DEVICES, else 0, as nvidia-smi numbers them (the runs here use one GPU)."""

    def __init__(self, interval_ms: int = 250):
        self.interval_ms = interval_ms
        self.proc = None
        self.out = None
        self.text = ""

    def __enter__(self):
        smi = shutil.which("nvidia-smi")
        if smi is not None:
            gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
            self.out = tempfile.TemporaryFile(mode="w+")
            self.proc = subprocess.Popen([smi, "-i", gpu, f"--query-gpu={_SMI_FIELDS}", "--format=csv,noheader,nounits",
                                          f"--loop-ms={self.interval_ms}"], stdout=self.out,
                                         stderr=subprocess.STDOUT, text=True)
        return self

    def __exit__(self, *exc):
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.out.seek(0)
        self.text = self.out.read()
        self.out.close()

    @staticmethod
    def samples(text: str) -> list[tuple[datetime, list[float]]]:
        """(time, [SM MHz, max SM MHz, W, W limit, °C]) per line with a timestamp and five
        fields; a field nvidia-smi cannot read ("[N/A]") is NaN."""
        out = []
        for line in text.splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != 6:
                continue
            try:
                when = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
            except ValueError:  # a header or an error line
                continue
            values = []
            for p in parts[1:]:
                try:
                    values.append(float(p))
                except ValueError:
                    values.append(float("nan"))
            out.append((when, values))
        return out

    @classmethod
    def summary(cls, text: str, start: datetime, end: datetime) -> dict | None:
        """Medians of the SM clock and power and the maximum temperature between start and end
        (each over the samples that read it; NaN where none did); None without samples there."""
        inside = [v for t, v in cls.samples(text) if start <= t <= end]
        if not inside:
            return None
        col = [[x for x in c if x == x] for c in zip(*inside)]
        nan = float("nan")

        def med(c):
            return statistics.median(c) if c else nan

        return dict(sm_mhz=med(col[0]), max_mhz=max(col[1], default=nan), watts=med(col[2]),
                    limit_w=max(col[3], default=nan), temp_c=max(col[4], default=nan), n=len(inside))


def parse_spec(spec: str, dry: bool, variants: dict | None = None) -> tuple[str, str, str | None, str]:
    """(preset, batch, AC or None, variant name or "") of a run spec; a bad one exits in one line.
    ``variants``: the --variant and --tree names."""
    parts = spec.split(":")
    if not 1 <= len(parts) <= 4 or parts[0] not in PRESETS:
        raise SystemExit(f"train_bench: bad run spec {spec!r}: PRESET[:BATCH[:AC[:VARIANT]]] with PRESET one of "
                         f"{sorted(PRESETS)}")
    preset, batch, ac = parts[0], (parts[1] if len(parts) > 1 else "4"), (parts[2] or None if len(parts) > 2 else None)
    variant = parts[3] if len(parts) > 3 else ""
    if PRESETS[preset].get("dry", False) != dry:
        raise SystemExit(f"train_bench: preset {preset!r} is {'not ' if dry else ''}for the CPU dry run "
                         f"({'--dry' if not dry else 'drop --dry'})")
    if batch != "max" and not (batch.isdigit() and int(batch) > 0):
        raise SystemExit(f"train_bench: bad batch {batch!r} in {spec!r}: a positive number or 'max'")
    if ac not in (None, "none", "selective", "full"):
        raise SystemExit(f"train_bench: bad activation checkpointing {ac!r} in {spec!r}: none, selective or full")
    if len(parts) > 3 and not variant:
        raise SystemExit(f"train_bench: empty VARIANT in {spec!r}: name a --variant after the last ':', or drop it")
    if len(parts) > 3 and variant not in (variants or {}):
        known = ", ".join(sorted(variants or {})) or "none given"
        raise SystemExit(f"train_bench: unknown variant {variant!r} in {spec!r}: give it as --variant "
                         f"{variant}=\"ARGS\" or --tree {variant}=DIR (variants: {known})")
    return preset, batch, ac, variant


def _named(text: str, form: str) -> tuple[str, str]:
    """``NAME=REST`` -> (NAME, REST), NAME of letters, digits, _ . - and REST not empty."""
    name, sep, rest = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or not rest:
        raise argparse.ArgumentTypeError(f"{text!r}: give {form} with NAME of letters, digits, _ . -")
    return name, rest


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``NAME=ARGS`` -> (NAME, ARGS split as a shell would)."""
    name, rest = _named(text, 'NAME="ARGS"')
    try:
        words = shlex.split(rest)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    if not words:
        raise argparse.ArgumentTypeError(f"{text!r}: no arguments after '='")
    return name, words


def parse_tree(text: str) -> tuple[str, Path]:
    """``NAME=DIR`` -> (NAME, DIR) for a copy of the repository with its run_train.sh and kernels."""
    name, rest = _named(text, "NAME=DIR")
    tree = Path(rest).expanduser().resolve()
    if tree == REPO:
        raise argparse.ArgumentTypeError(f"{text!r}: {tree} is this checkout: give a copy at another revision")
    for need in ("run_train.sh", "kernels/__init__.py"):
        if not (tree / need).is_file():
            raise argparse.ArgumentTypeError(f"{text!r}: {tree} has no {need}: give a copy of the repository")
    return name, tree


def link_tree(name: str, tree: Path, workdir: Path) -> None:
    """Readies a --tree before the first run: its kernels linked under their import name in a
    folder of its own (workdir/trees/NAME), this checkout's data and tokenizer linked into the
    tree where it has none. A link that cannot be made exits in one line."""
    site = workdir / "trees" / name
    try:
        site.mkdir(parents=True, exist_ok=True)
        (site / "hymo_kernels").symlink_to(tree / "kernels")
        for rel in ("data/brown", "assets/tokenizer"):
            if (REPO / rel).exists() and not os.path.lexists(tree / rel):
                (tree / rel).parent.mkdir(parents=True, exist_ok=True)
                (tree / rel).symlink_to(REPO / rel)
    except OSError as e:
        raise SystemExit(f"train_bench: --tree {name}={tree}: {e}") from None


# what decides a run's speed besides the machine: the code a fingerprint covers
_CODE = ("run_train.sh", "hymo_recipes", "kernels", "train_configs", "benchmarks/peers.py", "scripts")


def code_fingerprint(root: Path) -> str:
    """A short hash of the code a run from ``root`` executes (the Python, shell and TOML files
    under _CODE, by path and content), so a table names the code it timed even where a copy has
    no git history; with git, also the commit and whether the files differ from it."""
    import hashlib

    h = hashlib.sha1()
    for top in _CODE:
        base = root / top
        files = [base] if base.is_file() else sorted(base.rglob("*")) if base.is_dir() else []
        for f in files:
            if f.is_file() and f.suffix in (".py", ".sh", ".toml") and "__pycache__" not in f.parts:
                h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    out = f"fingerprint {h.hexdigest()[:10]}"
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=10)
        if rev.returncode == 0 and Path(top.stdout.strip()).resolve() == root.resolve():
            dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", *_CODE],
                                   capture_output=True, text=True, timeout=30).stdout.strip()
            out = f"git {rev.stdout.strip()}{' with uncommitted changes' if dirty else ''}, {out}"
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def environment() -> str:
    """The date, the GPU (nvidia-smi's name and driver, where there is one) and the versions of
    torch, Triton and TorchTitan, for the first line of the output."""
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    gpu = "no GPU"
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            q = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
            first = q.stdout.strip().splitlines()[:1]
            if q.returncode == 0 and first:
                name, _, driver = first[0].partition(",")
                gpu = f"{name.strip()} (driver {driver.strip()})"
        except (OSError, subprocess.SubprocessError):
            pass
    when = datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return (f"{when}; {gpu}; torch {version('torch')}, triton {version('triton')}, "
            f"torchtitan {version('torchtitan')}")


def _failure_line(text: str) -> str:
    """The line that names a failed run's cause: HyMo's one-line config error, else the last exception."""
    lines = [re.sub(r"^(\[rank\d+\]:)+", "", _ANSI.sub("", line)).strip() for line in text.splitlines()]
    named = [line for line in lines if line.startswith("hymo:") or re.match(r"\w+(Error|Exception)\b", line)]
    return (named or [line for line in lines if line.strip()] or ["no output"])[-1][:300]


def command(run: Run, args, workdir: Path) -> tuple[list[str], dict, Path]:
    """(the run's command, its environment, the folder it runs in)."""
    p = PRESETS[run.preset]
    root = run.tree or REPO
    if "config" in p:
        config = p["config"]
    else:
        model, flavor = p["model"]
        config = str(workdir / f"{run.preset}.toml")
        Path(config).write_text(_PEER_TOML.format(model=model, flavor=flavor,
                                                  compile="false" if args.dry else "true"))
    extra = [
        "--experimental.custom_import", "benchmarks.peers",
        "--training.local_batch_size", str(run.batch), "--training.global_batch_size",
        str(run.global_batch or run.batch),
        "--training.seq_len", str(run.seq), "--training.steps", str(args.steps),
        "--metrics.log_freq", "1", "--metrics.no-enable-tensorboard", "--checkpoint.no-enable",
        "--validation.no-enable", "--job.dump_folder", str(workdir / run.preset),
        "--activation_checkpoint.mode", run.ac, "--debug.seed", "42",
    ]
    if args.dry:
        extra += ["--training.mixed_precision_param", "float32"]
    # a tree's kernels and code (its benchmarks.peers too) ahead of everything on the path; the
    # run's python3 is this interpreter, whose environment has torch and the wheels (a tree has
    # no .venv of its own for its run_train.sh to find)
    first = [str(workdir / "trees" / run.variant), str(run.tree)] if run.tree else [str(REPO)]  # link_tree's
    env = dict(os.environ, NGPU="1", LOG_RANK="0", CONFIG_FILE=config,
               PATH=os.pathsep.join(filter(None, [str(Path(sys.executable).parent), os.environ.get("PATH")])),
               PYTHONPATH=os.pathsep.join(filter(None, [*first, os.environ.get("PYTHONPATH")])))
    return ["bash", str(root / "run_train.sh"), *extra, *args.extra, *run.extra], env, root


def execute(run: Run, args, workdir: Path, log_dir: Path | None) -> Run:
    cmd, env, cwd = command(run, args, workdir)
    start = time.monotonic()
    with GpuSampler() as sampler:
        try:
            proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=args.run_timeout)
            text, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            text = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
            rc = "timeout"
    run.seconds = time.monotonic() - start
    if log_dir is not None:
        (log_dir / f"{run.name.replace(':', '_')}.log").write_text(text)
    run.steps, run.opt_ms = parse_log(text)
    when = step_times(text)
    if args.warmup in when and max(when) > args.warmup:
        run.gpu = GpuSampler.summary(sampler.text, when[args.warmup], when[max(when)])
        if run.gpu is None and sampler.proc is not None:
            first = next((line for line in sampler.text.splitlines() if line.strip()), "no output")
            print(f"train_bench: {run.name}: no GPU sample in the timed steps (nvidia-smi: {first[:200]})", flush=True)
    if rc != 0:
        oom = "OutOfMemoryError" in text or "CUDA out of memory" in text
        run.error = "out of memory" if oom else f"exit {rc}: {_failure_line(text)}"
    elif len(run.steps) < args.steps:
        run.error = f"logged {len(run.steps)} of {args.steps} steps"
    return run


def run_spec(spec: str, args, workdir: Path, log_dir: Path | None) -> list[Run]:
    preset, batch, ac, variant = parse_spec(spec, args.dry, args.names)
    ac = ac or PRESETS[preset]["ac"]
    seq = 64 if args.dry else args.seq_len
    kw = dict(seq=seq, global_batch=args.global_batch, variant=variant, extra=list(args.variants.get(variant, [])),
              tree=args.trees.get(variant))
    if batch != "max":
        return [execute(Run(preset, int(batch), ac, **kw), args, workdir, log_dir)]
    tried = []
    for b in args.batches:
        r = execute(Run(preset, b, ac, **kw), args, workdir, log_dir)
        tried.append(r)
        print(f"train_bench: {r.name}: {r.error or f'{r.peak_gib():.1f} GiB'}", flush=True)
        if r.error or r.peak_gib() > args.mem_cap_gib:
            break
    fits = [r for r in tried if not r.error and r.peak_gib() <= args.mem_cap_gib]
    return fits[-1:] if fits else tried[:1]


def paired_ratios(run: Run, base: Run, warmup: int) -> list[float]:
    """tokens/s of ``run`` over ``base`` step by step, over the timed steps both logged. Both
    runs read the same batches in the same order, so a step's ratio leaves out what the batch
    does to the step time (packed documents change the attention's and the GDN's work): a
    variant that is faster at every step (min > 1) is faster beyond that noise, which a ratio of
    medians over a few steps cannot say."""
    a = {s["step"]: s["tps"] for s in run.steps if s["step"] > warmup}
    b = {s["step"]: s["tps"] for s in base.steps if s["step"] > warmup}
    return [a[k] / b[k] for k in sorted(a.keys() & b.keys()) if b[k] > 0]


def table(runs: list[Run], warmup: int) -> str:
    rows = ["| run | tokens/s | TFLOP/s | MFU % | peak GiB | optimizer ms (share) | SM MHz (max), W (limit), °C | note |",
            "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if r.error and not r.steps:
            rows.append(f"| {r.name} | – | – | – | – | – | – | {r.error} |")
            continue
        g = r.gpu
        gpu = (f"{g['sm_mhz']:.0f} ({g['max_mhz']:.0f}), {g['watts']:.0f} ({g['limit_w']:.0f}), {g['temp_c']:.0f}"
               if g else "–")
        tps = r.median("tps", warmup)
        opt = statistics.median(r.opt_ms[warmup:]) if len(r.opt_ms) > warmup else float("nan")
        step_ms = 1e3 * (r.global_batch or r.batch) * r.seq / tps if tps == tps and tps > 0 else float("nan")
        share = 100 * opt / step_ms if step_ms == step_ms else float("nan")
        rows.append(f"| {r.name} | {tps:,.0f} | {r.median('tflops', warmup):.1f} | {r.median('mfu', warmup):.1f} | "
                    f"{r.peak_gib():.1f} | {opt:.1f} ({share:.1f} %) | {gpu} | {r.error} |")
    hymo = [r for r in runs if r.is_hymo and r.steps]
    peers = [r for r in runs if not r.is_hymo and r.steps]
    pairs = [(r, b) for r in runs if r.variant and r.steps for b in runs
             if not b.variant and b.steps and (b.preset, b.batch, b.ac) == (r.preset, r.batch, r.ac)]
    if pairs:
        rows += ["", "| variant run / the same run without it | tokens/s ratio | step by step: median (min – max), steps |",
                 "|---|---|---|"]
        for r, b in pairs:
            by_step = paired_ratios(r, b, warmup)
            spread = (f"{statistics.median(by_step):.3f} ({min(by_step):.3f} – {max(by_step):.3f}), {len(by_step)}"
                      if by_step else "–")
            rows.append(f"| {r.name} / {b.name} | {r.median('tps', warmup) / b.median('tps', warmup):.3f} | {spread} |")
    if hymo and peers:
        rows += ["", "| HyMo run / peer run | tokens/s ratio |", "|---|---|"]
        for h in hymo:
            for p in peers:
                same = " (same batch)" if p.batch == h.batch else ""
                rows.append(f"| {h.name} / {p.name}{same} | {h.median('tps', warmup) / p.median('tps', warmup):.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=textwrap.dedent(f"presets: {', '.join(sorted(PRESETS))}"))
    ap.add_argument("--runs", nargs="+",
                    help=f"run specs PRESET[:BATCH[:AC[:VARIANT]]] (default: {' '.join(DEFAULT_RUNS)})")
    ap.add_argument("--variant", type=parse_variant, action="append", default=[], metavar='NAME="ARGS"',
                    help="run_train.sh arguments for the runs whose spec ends in :NAME (repeatable)")
    ap.add_argument("--tree", type=parse_tree, action="append", default=[], metavar="NAME=DIR",
                    help="a copy of the repository that the runs whose spec ends in :NAME run from (repeatable)")
    ap.add_argument("--dry", action="store_true", help="CPU: tiny flavors, seq 64, fp32, no compile")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 12; 3 with --dry)")
    ap.add_argument("--warmup", type=int, default=None, help="steps left out of the medians (default 6; 1 with --dry)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--global-batch", type=int, default=0,
                    help="sequences per optimizer step for every run (gradient accumulation over local batches; "
                         "default: one microbatch per step)")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 12, 16, 24, 32],
                    help="batches tried for BATCH = max, in increasing order (default 4,8,12,16,24,32)")
    ap.add_argument("--mem-cap-gib", type=float, default=80.0, help="memory cap for BATCH = max (GiB)")
    ap.add_argument("--run-timeout", type=float, default=480.0, help="seconds per run")
    ap.add_argument("--log-dir", type=Path, default=None, help="keep each run's log here")
    ap.add_argument("extra", nargs="*", help="after --: more run_train.sh arguments for every run")
    args = ap.parse_args(argv)
    args.steps = args.steps or (3 if args.dry else 12)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.dry else 6)
    if args.warmup >= args.steps:
        ap.error(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}")
    named = [("--variant", n) for n, _ in args.variant] + [("--tree", n) for n, _ in args.tree]
    for flag, name in named:
        flags = {f for f, n in named if n == name}
        if len(flags) > 1:
            ap.error(f"{name} is given as both --variant and --tree")
        if sum(n == name for _, n in named) > 1:
            ap.error(f"{flag} {name} is given twice")
    args.variants, args.trees = dict(args.variant), dict(args.tree)
    args.names = {**args.variants, **args.trees}
    specs = args.runs or (DRY_RUNS if args.dry else DEFAULT_RUNS)
    used = {parse_spec(s, args.dry, args.names)[3] for s in specs}  # every spec checked before the first run
    for flag, name in named:
        if name not in used:
            print(f"train_bench: {flag} {name} is not used by any run spec", flush=True)
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    print(f"train_bench: {environment()}", flush=True)
    print(f"train_bench: code: this checkout ({code_fingerprint(REPO)})"
          + "".join(f"; --tree {n} = {t} ({code_fingerprint(t)})" for n, t in args.trees.items()), flush=True)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="train_bench_") as tmp:
        for name, tree in args.trees.items():
            link_tree(name, tree, Path(tmp))
        for spec in specs:
            for r in run_spec(spec, args, Path(tmp), args.log_dir):
                runs.append(r)
                print(f"train_bench: {r.name} done in {r.seconds:.0f} s{': ' + r.error if r.error else ''}", flush=True)
    print(table(runs, args.warmup))
    return 1 if any(r.error for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
