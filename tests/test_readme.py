"""The README: its two commands stay runnable (CI runs the test one, a test runs the demo), it stays short, and it
links every docs/ page, where the detail lives (docs/training.md, models.md, errors.md, ...)."""

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


def test_readme_is_short_and_links_every_docs_page():
    readme = ROOT.joinpath("README.md").read_text()
    assert len(readme.splitlines()) <= 250, "the detail goes in a docs/ page, linked from the README"
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)\)", readme))
    pages = {f"docs/{page.name}" for page in ROOT.joinpath("docs").glob("*.md")}
    assert pages <= linked, f"not linked from the README: {sorted(pages - linked)}"


def test_every_relative_link_of_the_readme_and_docs_resolves():
    for page in [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(ROOT.joinpath("docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", page.read_text()):
            assert page.parent.joinpath(target).exists(), f"{page.name} links {target}, which does not exist"


def test_readme_names_the_public_api_and_every_environment_variable():
    """What a user imports and sets is on the front page; the detail is in the docs pages it links."""
    import keras_pipe

    readme = ROOT.joinpath("README.md").read_text()
    for package in ("keras_pipe.schedules", "keras_pipe.mpi"):
        assert f"`{package}`" in readme, package
    for name in keras_pipe.__all__:
        assert name == "__version__" or f"`{name}`" in readme, name
    read = set(re.findall(r"KERAS_PIPE_[A-Z_]+", " ".join(p.read_text() for p in ROOT.glob("keras_pipe/**/*.py"))))
    assert read and all(f"`{variable}" in readme for variable in read), read


def test_demo_trains_on_four_ranks():
    script = ROOT / "examples" / "train_digits.py"
    launch = run_mpi(4, str(script), "--epochs", "3", timeout=480)
    assert launch.returncode == 0, launch.output
    assert len(launch.lines_with("Epoch 3/3")) == 1, launch.output  # rank 0 alone prints
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", launch.output).group(1))
    assert accuracy > 0.6, launch.output
