"""The README's two commands stay runnable: CI runs the test one, a test runs the demo."""

import re
from pathlib import Path

from mpi import run_mpi

ROOT = Path(__file__).parent.parent


def readme_commands() -> list[str]:
    first_section = ROOT.joinpath("README.md").read_text().split("\n## ")[1]
    return re.findall(r"```bash\n(.*?)\n```", first_section, re.S)


def test_readme_gives_exactly_two_commands_and_ci_runs_the_test_one():
    demo, tests = readme_commands()
    assert "examples/train_digits.py" in demo and "mpirun -n 4" in demo
    assert "pytest" in tests
    assert tests in ROOT.joinpath(".ci", "run").read_text().splitlines()


def test_demo_trains_on_four_ranks():
    script = ROOT / "examples" / "train_digits.py"
    launch = run_mpi(4, str(script), "--epochs", "3", timeout=480)
    assert launch.returncode == 0, launch.output
    assert len(launch.lines_with("Epoch 3/3")) == 1, launch.output  # rank 0 alone prints
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", launch.output).group(1))
    assert accuracy > 0.6, launch.output
