"""The README's two commands exist, CI runs the test command verbatim, and the paths it names exist."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = "./scripts/setup.sh && . .venv/bin/activate && ./run_train.sh"
TEST = "./scripts/setup.sh && . .venv/bin/activate && pytest -q -n 2 --dist loadfile"
# the repository's source folders; paths under outputs/, data/, assets/, .venv/ are made by a run
SOURCE_DIRS = ("hymo_recipes", "kernels", "benchmarks", "scripts", "train_configs", "tests", r"\.ci")


def test_readme_opens_with_the_two_commands():
    readme = (REPO / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).splitlines()
    assert first_block == [TRAIN, TEST]


def test_ci_runs_the_readme_test_command():
    assert f"bash -c '{TEST}'" in (REPO / ".ci" / "run").read_text()


def test_scripts_are_executable():
    for script in ("run_train.sh", "scripts/setup.sh", "scripts/gpu_smoke.sh", "scripts/gpu_tests.sh",
                   "benchmarks/optim_compare.sh", "benchmarks/scaling.sh", "benchmarks/ab_seeds.sh",
                   "benchmarks/step_profile.sh", "benchmarks/gdn/ncu_profile.sh", ".ci/run"):
        assert (REPO / script).stat().st_mode & 0o111, script


def test_every_path_the_readme_names_exists():
    readme = (REPO / "README.md").read_text()
    pattern = rf"(?<![\w/.-])(?:\./)?((?:{'|'.join(SOURCE_DIRS)})/[\w./-]*)"
    paths = {p.rstrip(".") for p in re.findall(pattern, readme)}
    assert len(paths) > 10, paths  # the pattern still finds the README's paths
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, f"README.md names paths that do not exist: {missing}"
