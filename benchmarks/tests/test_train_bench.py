"""benchmarks/train_bench.py and benchmarks/gdn_layer_bench.py: log parsing, run specs, the table's
ratios, and each benchmark's CPU dry mode end to end (the code paths the GPU run takes)."""

from types import SimpleNamespace

import pytest

from benchmarks import gdn_layer_bench, train_bench

pytestmark = pytest.mark.bench

LOG = """\
[rank0]:[titan] 2026-12-01 10:02:38,135 - root - INFO - \x1b[31mstep:  7  \x1b[32mloss: 10.59076  \
\x1b[38;2;180;60;0mgrad_norm:  0.9820  \x1b[38;2;54;234;195mmemory: 21.30GiB(15.54%)  \x1b[34mtps: 46,123  \
\x1b[36mtflops: 136.20  \x1b[35mmfu: 13.77%\x1b[39m
[rank0]:[titan] 2026-12-01 10:02:39,965 - root - INFO - bench: optimizer_step_ms=12.500
[rank0]:[titan] 2026-12-01 10:02:39,966 - root - INFO - \x1b[31mstep:  8  \x1b[32mloss: nan  \
\x1b[38;2;180;60;0mgrad_norm:  1.3303  \x1b[38;2;54;234;195mmemory: 22.00GiB(5.54%)  \x1b[34mtps: 47,000  \
\x1b[36mtflops: 139.00  \x1b[35mmfu: 14.05%\x1b[39m
"""


def test_parse_log_reads_titans_step_lines_and_the_timer():
    steps, opt = train_bench.parse_log(LOG)
    assert [s["step"] for s in steps] == [7, 8]
    assert steps[0] == dict(step=7, loss=10.59076, mem=21.30, tps=46123.0, tflops=136.20, mfu=13.77)
    assert steps[1]["loss"] != steps[1]["loss"]  # nan
    assert opt == [12.5]


SMI = """\
2026/12/01 10:02:37.900, 1980, 1980, 650.10, 700.00, 60
2026/12/01 10:02:38.400, 1755, 1980, 699.50, 700.00, 71
[N/A]
2026/12/01 10:02:39.000, 1740, 1980, 700.20, 700.00, 73
2026/12/01 10:02:39.900, 1770, 1980, 698.00, 700.00, 72
2026/12/01 10:02:40.500, 1980, 1980, 120.00, 700.00, 65
"""


def test_gpu_samples_summarised_over_the_timed_steps_only():
    when = train_bench.step_times(LOG)
    assert sorted(when) == [7, 8] and (when[8] - when[7]).total_seconds() == pytest.approx(1.831)
    g = train_bench.GpuSampler.summary(SMI, when[7], when[8])
    # the three samples between steps 7 and 8; the idle ones before and after are left out
    assert g == dict(sm_mhz=1755.0, max_mhz=1980.0, watts=699.5, limit_w=700.0, temp_c=73.0, n=3)
    assert train_bench.GpuSampler.summary(SMI, when[8], when[8]) is None
    run = train_bench.Run("dsv3_8", 4, "none", steps=train_bench.parse_log(LOG)[0], gpu=g)
    assert "| 1755 (1980), 700 (700), 73 |" in train_bench.table([run], warmup=7)


def test_gpu_samples_with_an_unreadable_field_keep_the_others():
    text = "2026/12/01 10:02:38.400, 1755, [N/A], 699.50, [N/A], 71\n2026/12/01 10:02:39.000, 1745, [N/A], 700.50, [N/A], 73\n"
    g = train_bench.GpuSampler.summary(text, train_bench.datetime(2026, 12, 1, 10, 2, 38),
                                       train_bench.datetime(2026, 12, 1, 10, 2, 40))
    assert (g["sm_mhz"], g["watts"], g["temp_c"], g["n"]) == (1750.0, 700.0, 73.0, 2)
    assert g["max_mhz"] != g["max_mhz"] and g["limit_w"] != g["limit_w"]  # NaN: never read


def test_the_sampler_keeps_everything_nvidia_smi_wrote(tmp_path, monkeypatch):
    """A stand-in nvidia-smi writes ~200 KiB at once, then a last line, then waits to be stopped:
    the sampler (output into a file, not a pipe that fills at 64 KiB and stalls the writer) has
    every line, the last included, and stops it."""
    fake = tmp_path / "nvidia-smi"
    sample, last = "2026/12/01 10:02:38.400, 1755, 1980, 699.50, 700.00, 71", "2026/12/01 10:02:39.999, 1111, 1980, 100.00, 700.00, 50"
    fake.write_text(f"#!/usr/bin/env bash\nfor i in $(seq 3500); do echo '{sample}'; done\necho '{last}'\nexec sleep 60\n")
    everything = 3500 * (len(sample) + 1) + len(last) + 1
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{train_bench.os.environ['PATH']}")
    with train_bench.GpuSampler() as sampler:
        deadline = train_bench.time.monotonic() + 20
        while train_bench.time.monotonic() < deadline:
            if train_bench.os.fstat(sampler.out.fileno()).st_size >= everything:
                break
            train_bench.time.sleep(0.1)
    assert sampler.proc.poll() is not None  # stopped
    lines = sampler.text.splitlines()
    assert len(lines) == 3501 and lines[-1] == last


@pytest.mark.parametrize("spec, dry, message", [
    ("nope:4", False, "bad run spec"), ("hymo_750m:0", False, "bad batch"), ("hymo_750m:4:some", False,
                                                                              "bad activation checkpointing"),
    ("hymo_debug:2", False, "for the CPU dry run"), ("hymo_750m:4", True, "not for the CPU dry run"),
    ("hymo_750m:4:none:fast", False, "unknown variant 'fast' .* --variant fast=\"ARGS\" or --tree fast=DIR \\(variants: lean\\)"),
    ("hymo_750m:4:none:lean:x", False, "bad run spec"), ("hymo_750m:4:none:", False, "empty VARIANT"),
])
def test_bad_run_specs_fail_in_one_line(spec, dry, message):
    with pytest.raises(SystemExit, match=message):
        train_bench.parse_spec(spec, dry, {"lean": ["--hymo.gdn_mixer_saves", "inputs"]})


def test_variant_arguments_go_to_their_run_alone(tmp_path):
    """A spec's :VARIANT adds that --variant's arguments to its run only, after the arguments
    every run gets; the run is named with the variant, and the peers get none of them."""
    name, words = train_bench.parse_variant('lean=--hymo.gdn_mixer_saves inputs --hymo.mla_flex_options "a=1, b=2"')
    assert (name, words) == ("lean", ["--hymo.gdn_mixer_saves", "inputs", "--hymo.mla_flex_options", "a=1, b=2"])
    args = SimpleNamespace(dry=False, steps=4, extra=["--training.max_norm", "1"], variants={name: words})
    preset, batch, ac, variant = train_bench.parse_spec("hymo_750m:8:none:lean", False, args.variants)
    run = train_bench.Run(preset, int(batch), ac, variant=variant, extra=args.variants[variant])
    assert run.name == "hymo_750m:8:none:lean"
    cmd, _, cwd = train_bench.command(run, args, tmp_path)
    assert cwd == train_bench.REPO and cmd[1] == str(train_bench.REPO / "run_train.sh")
    assert cmd[-6:] == ["--training.max_norm", "1", *words]
    peer, _, _ = train_bench.command(train_bench.Run("dsv3_32", 4, "none"), args, tmp_path)
    assert peer[-2:] == ["--training.max_norm", "1"] and "--hymo.gdn_mixer_saves" not in peer


def test_variants_reach_their_runs_through_main(monkeypatch, capsys):
    """From the command line: each spec's variant arguments, and no others, reach every run it
    makes (BATCH = max tries several); an empty AC is the preset's; the table sets each variant
    run against the same run without it; an unused --variant is named."""
    seen = []

    def fake_execute(run, args, workdir, log_dir):
        seen.append((run.name, list(run.extra)))
        tps = 100_000.0 if run.variant else 80_000.0
        run.steps = [dict(step=s, loss=1.0, mem=10.0, tps=tps, tflops=1.0, mfu=1.0) for s in (1, 2, 3)]
        return run

    monkeypatch.setattr(train_bench, "execute", fake_execute)
    rc = train_bench.main(["--runs", "hymo_750m:8", "hymo_750m:8::lean", "hymo_750m:max:none:lean", "--steps", "3",
                           "--warmup", "1", "--batches", "4,8", "--variant", "lean=--x 1", "--variant", "spare=--y"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert seen == [("hymo_750m:8:selective", []), ("hymo_750m:8:selective:lean", ["--x", "1"]),
                    ("hymo_750m:4:none:lean", ["--x", "1"]), ("hymo_750m:8:none:lean", ["--x", "1"])]
    assert "| hymo_750m:8:selective:lean / hymo_750m:8:selective | 1.250 |" in out
    assert "--variant spare is not used by any run spec" in out


def _tree(root, files=("run_train.sh", "kernels/__init__.py")):
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("")
    return root


def test_a_tree_run_runs_the_trees_code(tmp_path, monkeypatch):
    """A --tree run starts the tree's run_train.sh in the tree, with the tree's kernels (under
    their import name) and code ahead of everything else on the path and this interpreter's
    folder first on PATH; this checkout's data and tokenizer are linked into a tree that has
    none, and a tree's own are left alone."""
    repo = tmp_path / "repo"
    for rel in ("data/brown", "assets/tokenizer"):
        (repo / rel).mkdir(parents=True)
    monkeypatch.setattr(train_bench, "REPO", repo)
    tree = _tree(tmp_path / "old")
    (tree / "assets" / "tokenizer").mkdir(parents=True)  # the tree's own
    name, got = train_bench.parse_tree(f"old={tree}")
    assert (name, got) == ("old", tree.resolve())
    monkeypatch.setenv("PYTHONPATH", "/site")
    args = SimpleNamespace(dry=False, steps=4, extra=[], variants={}, trees={name: got})
    run = train_bench.Run("hymo_750m", 8, "none", variant=name, tree=got)
    work = tmp_path / "work"
    train_bench.link_tree(name, got, work)
    cmd, env, cwd = train_bench.command(run, args, work)
    assert cwd == got and cmd[1] == str(got / "run_train.sh")
    assert env["PYTHONPATH"].split(":") == [str(work / "trees" / "old"), str(got), "/site"]
    assert env["PATH"].split(":")[0] == str(train_bench.Path(train_bench.sys.executable).parent)
    assert (work / "trees" / "old" / "hymo_kernels").resolve() == got / "kernels"
    assert (got / "data" / "brown").is_symlink() and (got / "data" / "brown").resolve() == repo / "data" / "brown"
    assert not (got / "assets" / "tokenizer").is_symlink()
    plain, env, cwd = train_bench.command(train_bench.Run("hymo_750m", 8, "none"), args, work)
    assert cwd == repo and env["PYTHONPATH"].split(":") == [str(repo), "/site"]


def test_trees_in_folders_of_one_name_keep_their_own_kernels(tmp_path):
    """Two --trees whose folders share a last name each get their own kernels link."""
    a, b = _tree(tmp_path / "x" / "repo"), _tree(tmp_path / "y" / "repo")
    work = tmp_path / "work"
    for name, tree in (("a", a), ("b", b)):
        train_bench.link_tree(name, tree.resolve(), work)
    assert (work / "trees" / "a" / "hymo_kernels").resolve() == a.resolve() / "kernels"
    assert (work / "trees" / "b" / "hymo_kernels").resolve() == b.resolve() / "kernels"


def test_a_tree_whose_links_cannot_be_made_fails_in_one_line(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "data" / "brown").mkdir(parents=True)
    monkeypatch.setattr(train_bench, "REPO", repo)
    tree = _tree(tmp_path / "old")
    (tree / "data").write_text("a file where the data folder should be")
    with pytest.raises(SystemExit, match="--tree old=.*old"):
        train_bench.link_tree("old", tree, tmp_path / "work")


@pytest.mark.parametrize("files, message", [(("kernels/__init__.py",), "has no run_train.sh"),
                                            (("run_train.sh",), "has no kernels/__init__.py")])
def test_a_tree_without_the_repository_is_refused(tmp_path, files, message):
    tree = _tree(tmp_path / "t", files)
    with pytest.raises(train_bench.argparse.ArgumentTypeError, match=message):
        train_bench.parse_tree(f"t={tree}")
    with pytest.raises(train_bench.argparse.ArgumentTypeError, match="NAME=DIR"):
        train_bench.parse_tree(str(tree))


def test_this_checkout_as_a_tree_is_refused():
    with pytest.raises(train_bench.argparse.ArgumentTypeError, match="is this checkout"):
        train_bench.parse_tree(f"self={train_bench.REPO}")


def test_trees_reach_their_runs_through_main(tmp_path, monkeypatch, capsys):
    """From the command line: a spec ending in a --tree's name runs from that tree, the others
    from this checkout, and the table sets the tree's run against the same run without it; a
    name given as both a --variant and a --tree is refused."""
    tree = _tree(tmp_path / "old").resolve()
    seen = []

    def fake_execute(run, args, workdir, log_dir):
        seen.append((run.name, run.tree, list(run.extra)))
        tps = 90_000.0 if run.tree else 100_000.0
        run.steps = [dict(step=s, loss=1.0, mem=10.0, tps=tps, tflops=1.0, mfu=1.0) for s in (1, 2, 3)]
        return run

    monkeypatch.setattr(train_bench, "execute", fake_execute)
    rc = train_bench.main(["--runs", "hymo_750m:8:none", "hymo_750m:8:none:old", "--steps", "3", "--warmup", "1",
                           "--tree", f"old={tree}"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert seen == [("hymo_750m:8:none", None, []), ("hymo_750m:8:none:old", tree, [])]
    assert "| hymo_750m:8:none:old / hymo_750m:8:none | 0.900 |" in out
    with pytest.raises(SystemExit):
        train_bench.main(["--runs", "hymo_750m:8:none:old", "--tree", f"old={tree}", "--variant", "old=--x"])
    assert "old is given as both --variant and --tree" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_bench.main(["--runs", "hymo_750m:8:none:old", "--tree", f"old={tree}", "--tree", f"old={tree}"])
    assert "--tree old is given twice" in capsys.readouterr().err
    train_bench.main(["--runs", "hymo_750m:8:none", "--steps", "3", "--warmup", "1", "--tree", f"old={tree}"])
    assert "--tree old is not used by any run spec" in capsys.readouterr().out


def test_the_code_fingerprint_names_what_a_run_executes(tmp_path):
    """Copies with the same files share a fingerprint; an edit to a kernel, a config or the
    launcher changes it, a file outside the run's code does not; a copy without git history
    says nothing of a commit."""
    def copy(root):
        for rel, text in (("run_train.sh", "echo"), ("kernels/__init__.py", ""), ("kernels/gdn/a.py", "x = 1"),
                          ("hymo_recipes/__init__.py", ""), ("train_configs/m.toml", "[a]"), ("README.md", "r")):
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        return root

    a, b = copy(tmp_path / "a"), copy(tmp_path / "b")
    fa = train_bench.code_fingerprint(a)
    assert fa.startswith("fingerprint ") and fa == train_bench.code_fingerprint(b)
    (b / "README.md").write_text("other")
    assert train_bench.code_fingerprint(b) == fa
    for rel in ("kernels/gdn/a.py", "train_configs/m.toml", "run_train.sh"):
        c = copy(tmp_path / rel.replace("/", "_"))
        (c / rel).write_text("changed")
        assert train_bench.code_fingerprint(c) != fa, rel


def test_the_output_starts_with_the_machine_and_the_code(tmp_path, monkeypatch, capsys):
    tree = _tree(tmp_path / "old").resolve()

    def fake_execute(run, args, workdir, log_dir):
        run.steps = [dict(step=s, loss=1.0, mem=10.0, tps=1.0, tflops=1.0, mfu=1.0) for s in (1, 2, 3)]
        return run

    monkeypatch.setattr(train_bench, "execute", fake_execute)
    train_bench.main(["--runs", "hymo_750m:8:none", "hymo_750m:8:none:old", "--steps", "3", "--warmup", "1",
                      "--tree", f"old={tree}"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("train_bench: ") and "torch " in lines[0] and "torchtitan " in lines[0]
    assert lines[1].startswith("train_bench: code: this checkout (") and f"--tree old = {tree} (fingerprint " in lines[1]


def test_a_variant_given_twice_is_refused(capsys):
    with pytest.raises(SystemExit):
        train_bench.main(["--dry", "--runs", "hymo_debug:2:none:a", "--variant", "a=--x", "--variant", "a=--y"])
    assert "--variant a is given twice" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["lean", "=--x", "le an=--x", "lean=", 'lean="--x'])
def test_bad_variants_are_refused(text):
    with pytest.raises(train_bench.argparse.ArgumentTypeError):
        train_bench.parse_variant(text)


def test_table_ratios_against_each_peer():
    hymo = train_bench.Run("hymo_750m", 4, "none", seq=4096,
                           steps=[dict(step=s, mem=20.0, tps=120_000.0, tflops=300.0, mfu=30.0) for s in (1, 2, 3)],
                           opt_ms=[5.0, 5.0, 5.0])
    peer = train_bench.Run("dsv3_32", 4, "none", seq=4096,
                           steps=[dict(step=s, mem=80.0, tps=40_000.0, tflops=290.0, mfu=29.0) for s in (1, 2, 3)])
    text = train_bench.table([hymo, peer], warmup=1)
    assert "| hymo_750m:4:none / dsv3_32:4:none (same batch) | 3.00 |" in text
    # step time 4 x 4096 / 120,000 s = 136.5 ms, so 5 ms is 3.7 %
    assert "5.0 (3.7 %)" in text


def test_variant_ratios_step_by_step():
    """Step by step: each step's ratio over the same step of the run without the variant (not
    over the step at the same position), over the timed steps both logged, as median, min and
    max; the batches make the steps' times differ far more than the variant does."""
    base_tps = {2: 100_000.0, 3: 130_000.0, 4: 90_000.0, 6: 120_000.0, 7: 110_000.0}
    gain = {2: 1.5, 3: 1.01, 4: 1.04, 5: 1.0, 6: 1.02, 7: 1.06}  # step 2 is a warm-up step
    fast_tps = {s: g * base_tps.get(s, 50_000.0) for s, g in gain.items()}  # step 5 only in the variant
    base = train_bench.Run("hymo_small", 32, "none", seq=4096,
                           steps=[dict(step=s, mem=39.0, tps=t, tflops=1.0, mfu=1.0) for s, t in base_tps.items()])
    fast = train_bench.Run("hymo_small", 32, "none", seq=4096, variant="fast",
                           steps=[dict(step=s, mem=39.0, tps=t, tflops=1.0, mfu=1.0) for s, t in fast_tps.items()])
    assert [round(x, 6) for x in train_bench.paired_ratios(fast, base, warmup=2)] == [1.01, 1.04, 1.02, 1.06]
    text = train_bench.table([base, fast], warmup=2)
    # medians: the variant's over steps 3-7 is 116,600 (step 7), the base's over 3, 4, 6, 7 is 115,000;
    # the step ratios' median is (1.02 + 1.04) / 2 (their mean would be 1.0325)
    assert "| hymo_small:32:none:fast / hymo_small:32:none | 1.014 | 1.030 (1.010 – 1.060), 4 |" in text


@pytest.mark.slow
def test_a_tree_run_imports_the_trees_code(tmp_path, capsys):
    """End to end on the CPU: a dry run from a copy of this checkout whose hymo_recipes and
    kernels print a marker on import logs both markers; the run from this checkout logs none."""
    import subprocess

    tree = tmp_path / "copy"
    tree.mkdir()
    files = subprocess.run(["git", "ls-files", "-z"], cwd=train_bench.REPO, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        dst = tree / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if (train_bench.REPO / rel).is_file():
            dst.write_bytes((train_bench.REPO / rel).read_bytes())
            dst.chmod((train_bench.REPO / rel).stat().st_mode)
    for pkg in ("hymo_recipes", "kernels"):
        with open(tree / pkg / "__init__.py", "a") as f:
            f.write(f"\nprint('TREE-MARKER {pkg}', flush=True)\n")
    logs = tmp_path / "logs"
    rc = train_bench.main(["--dry", "--runs", "hymo_debug:2", "hymo_debug:2::copy", "--tree", f"copy={tree}",
                           "--log-dir", str(logs)])
    assert rc == 0, capsys.readouterr().out
    copy_log = (logs / "hymo_debug_2_none_copy.log").read_text()
    assert "TREE-MARKER hymo_recipes" in copy_log and "TREE-MARKER kernels" in copy_log
    assert "TREE-MARKER" not in (logs / "hymo_debug_2_none.log").read_text()


@pytest.mark.slow
def test_train_bench_dry_run_trains_every_preset_kind(tmp_path, capsys):
    rc = train_bench.main(["--dry", "--log-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    for name in ("hymo_debug:2:none", "dsv3_tiny:2:none", "llama3_tiny:2:none"):
        assert f"train_bench: {name} done" in out
    assert "/ dsv3_tiny:2:none (same batch)" in out
    # every run logged the optimizer timer's line, so the table has a share for each
    assert out.count(" %) |") == 3


def test_gdn_layer_bench_dry_run(capsys):
    assert gdn_layer_bench.main(["--dry"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert {"hymo", "fla", "gemms"} <= set(rows)
    assert "skipped: GPU only" in rows["fla"]
    # the in-projections save x once and o_proj its input: 2 x 64 fp32 values per token
    assert rows["gemms"].split("|")[4].strip() == "0.5"
