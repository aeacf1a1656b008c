"""The README's two commands exist, and CI runs the test command verbatim."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = "./scripts/setup.sh && . .venv/bin/activate && ./run_train.sh"
TEST = "./scripts/setup.sh && . .venv/bin/activate && pytest -q"


def test_readme_opens_with_the_two_commands():
    readme = (REPO / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).splitlines()
    assert first_block == [TRAIN, TEST]


def test_ci_runs_the_readme_test_command():
    assert f"bash -c '{TEST}'" in (REPO / ".ci" / "run").read_text()


def test_scripts_are_executable():
    for script in ("run_train.sh", "scripts/setup.sh", "scripts/gpu_smoke.sh",
                   "scripts/gpu_optim_compare.sh", "scripts/gpu_scaling.sh",
                   "scripts/gpu_nan_hunt.sh", "scripts/gpu_ab_seeds.sh", ".ci/run"):
        assert (REPO / script).stat().st_mode & 0o111, script
