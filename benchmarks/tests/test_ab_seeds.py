"""benchmarks/ab_seeds.sh end to end on CPU (DRY=1: the debug config, two 2-step runs)."""

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench
REPO = Path(__file__).resolve().parents[2]


def run_script(tmp_path, **env):
    full = dict(os.environ, DRY="1", OUT=str(tmp_path / "out"), RUN_DIR=str(tmp_path / "runs"), **env)
    return subprocess.run(["bash", "benchmarks/ab_seeds.sh"], cwd=REPO, env=full, capture_output=True, text=True)


def with_sitecustomize(tmp_path, code: str) -> str:
    """A PYTHONPATH whose first folder holds a sitecustomize.py of ``code`` (every Python process
    of a run executes it at start)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(code)
    return os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))


def test_two_settings_one_seed_table(tmp_path):
    # every Python process of a run records its AB_TAG (A_ENV / B_ENV), so the marker shows which
    # setting's environment each run got
    marker = tmp_path / "marker"
    pythonpath = with_sitecustomize(tmp_path, "import os\nif 'AB_TAG' in os.environ:\n"
                                              f"    open({str(marker)!r}, 'a').write(os.environ['AB_TAG'] + '\\n')\n")
    res = run_script(tmp_path, STEPS="2", SEEDS="3", A_NAME="lr3", A_ARGS="--optimizer.lr 3e-4",
                     B_NAME="lr1", B_ARGS="--optimizer.lr 1e-4", A_ENV="AB_TAG=a", B_ENV="AB_TAG=b",
                     PYTHONPATH=pythonpath)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1] for line in res.stdout.splitlines() if line.startswith(("lr3@3", "lr1@3"))}
    assert set(rows) == {"lr3@3", "lr1@3"}
    line = next(x for x in res.stdout.splitlines() if x.startswith("lr1 minus lr3, final loss per seed: 3: "))
    diff = float(line.split("seed: 3: ")[1].split(";")[0])
    assert abs(diff - (float(rows["lr1@3"]) - float(rows["lr3@3"]))) < 2e-4  # the rows are rounded
    # both runs trained with their own setting (the learning rates differ, so the losses do)
    assert rows["lr3@3"] != rows["lr1@3"]
    assert (tmp_path / "out" / "table.txt").read_text().count("@3") == 2
    assert sorted(p.name for p in (tmp_path / "out").glob("*.log")) == ["lr1_s3.log", "lr3_s3.log"]
    # A ran first (one device), then B; the table script runs with neither tag
    tags = marker.read_text().split()
    assert tags and tags == sorted(tags) and set(tags) == {"a", "b"}, tags


def test_bad_labels_are_refused_before_any_run(tmp_path):
    for env in (dict(A_NAME="a b"), dict(B_NAME="x@1"), dict(A_NAME="same", B_NAME="same"), dict(B_ENV="X=1 nope"),
                dict(A_ENV="1X=2")):
        res = run_script(tmp_path, **env)
        assert res.returncode == 2 and "ab_seeds:" in res.stderr, env
    assert not (tmp_path / "runs").exists()


def test_pack_leaves_the_table_and_one_archive(tmp_path):
    import tarfile

    res = run_script(tmp_path, STEPS="1", SEEDS="5", A_NAME="x", B_NAME="y", PACK="1")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["runs.tar.gz", "table.txt"]
    assert "x@5" in (out / "table.txt").read_text() and "y@5" in (out / "table.txt").read_text()
    with tarfile.open(out / "runs.tar.gz") as tar:
        names = tar.getnames()
    assert {"x_s5.log", "y_s5.log"} <= set(names) and any(n.startswith("tb_x_s5") for n in names), names


def test_a_tree_runs_its_own_code(tmp_path):
    # A runs from a copy of the repository, B from this one; every Python process records at exit
    # its setting (AB_TAG), its working folder and where the hymo_recipes and hymo_kernels it
    # imported live: A's from the copy, B's from this repository
    tree = tmp_path / "tree"
    tree.mkdir()
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    marker = tmp_path / "marker"
    pythonpath = with_sitecustomize(
        tmp_path,
        "import atexit, os, sys\n"
        "def _record():\n"
        "    mods = [sys.modules.get(n) for n in ('hymo_recipes', 'hymo_kernels')]\n"
        "    if 'AB_TAG' in os.environ and all(mods):\n"
        f"        with open({str(marker)!r}, 'a') as f:\n"
        "            f.write(' '.join([os.environ['AB_TAG'], os.getcwd()] + [os.path.realpath(m.__file__)\n"
        "                                                                  for m in mods]) + '\\n')\n"
        "atexit.register(_record)\n")
    res = run_script(tmp_path, STEPS="1", SEEDS="2", A_NAME="old", B_NAME="new", A_TREE=str(tree),
                     A_ENV="AB_TAG=a", B_ENV="AB_TAG=b", PYTHONPATH=pythonpath)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "old@2" in res.stdout and "new@2" in res.stdout and f"tree {tree}" in res.stdout
    records = [line.split() for line in marker.read_text().splitlines()]
    assert {r[0] for r in records} == {"a", "b"}, records
    for tag, cwd, recipes, kernels in records:
        root = tree if tag == "a" else REPO
        assert Path(cwd) == root, (tag, cwd)
        assert Path(recipes).is_relative_to(root / "hymo_recipes"), (tag, recipes)
        assert Path(kernels).is_relative_to(root / "kernels"), (tag, kernels)


def test_a_tree_that_is_not_a_repository_is_refused(tmp_path):
    res = run_script(tmp_path, A_TREE=str(tmp_path))
    assert res.returncode == 2 and "has no run_train.sh" in res.stderr
    assert not (tmp_path / "runs").exists()


def test_side_by_side_on_one_device(tmp_path):
    # A and B of a seed at once on the one device: the second run starts before the first ends
    marker = tmp_path / "marker"
    pythonpath = with_sitecustomize(
        tmp_path,
        "import atexit, os, time\n"
        "def _note(kind):\n"
        f"    open({str(marker)!r}, 'a').write(f\"{{kind}} {{os.environ['AB_TAG']}} {{time.time()}}\\n\")\n"
        "if 'AB_TAG' in os.environ and os.environ.get('LOCAL_RANK') == '0':\n"
        "    _note('start')\n"
        "    atexit.register(_note, 'end')\n")
    res = run_script(tmp_path, STEPS="1", SEEDS="4", A_NAME="p", B_NAME="q", SIDE_BY_SIDE="1", A_ENV="AB_TAG=a",
                     B_ENV="AB_TAG=b", PYTHONPATH=pythonpath)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "SIDE_BY_SIDE=1" in res.stdout and "p@4" in res.stdout and "q@4" in res.stdout
    times = {(kind, tag): float(t) for kind, tag, t in (line.split() for line in marker.read_text().splitlines())}
    assert times[("start", "b")] < times[("end", "a")] and times[("start", "a")] < times[("end", "b")], times


def test_all_seeds_at_once_on_one_device(tmp_path):
    # SIDE_BY_SIDE=all: both seeds' A and B at once, so every run starts before any run ends
    marker = tmp_path / "marker"
    pythonpath = with_sitecustomize(
        tmp_path,
        "import atexit, os, time\n"
        "def _note(kind):\n"
        f"    open({str(marker)!r}, 'a').write(f\"{{kind}} {{os.environ['AB_TAG']}} {{os.getpid()}} {{time.time()}}\\n\")\n"
        "if 'AB_TAG' in os.environ and os.environ.get('LOCAL_RANK') == '0':\n"
        "    _note('start')\n"
        "    atexit.register(_note, 'end')\n")
    res = run_script(tmp_path, STEPS="1", SEEDS="5 6", A_NAME="p", B_NAME="q", SIDE_BY_SIDE="all",
                     A_ENV="AB_TAG=a", B_ENV="AB_TAG=b", PYTHONPATH=pythonpath)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "SIDE_BY_SIDE=all" in res.stdout and all(f"{s}@{n}" in res.stdout for s in "pq" for n in (5, 6))
    notes = [line.split() for line in marker.read_text().splitlines()]
    starts = [float(t) for kind, _, _, t in notes if kind == "start"]
    ends = [float(t) for kind, _, _, t in notes if kind == "end"]
    assert len(starts) == len(ends) == 4 and sorted(tag for kind, tag, _, _ in notes if kind == "start") == list("aabb")
    assert max(starts) < min(ends), notes


def test_side_by_side_takes_0_1_or_all(tmp_path):
    res = run_script(tmp_path, SIDE_BY_SIDE="yes")
    assert res.returncode == 2 and "SIDE_BY_SIDE is 0, 1 or all" in res.stderr
    assert not (tmp_path / "runs").exists()
