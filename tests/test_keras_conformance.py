"""The installed Keras' own model tests, against PipelineModel, on 1 rank and under mpirun -n 2.

The tests are Keras' (from the installed wheel): ``sequential_test.py`` and
``trainer_test.py`` (group ``sequential``); ``functional_test.py``, ``model_test.py``,
``cloning_test.py`` and ``variable_mapping_test.py`` (``functional``); both in one
launch on two ranks (``models``), each in its own on one; the callback
tests (``keras/src/callbacks/*_test.py`` but ``orbax_checkpoint_test.py``; ``tensorboard_test.py``
in a launch of its own, in the slow tier) in a third, each run through the plugin ``tests/keras_conformance.py``, which
substitutes the pipeline for ``Sequential``, the trainer tests' module-level
models, and the ``Functional`` models ``Model(inputs, outputs)`` makes. Each
test not in ``keras_conformance_expected.txt`` must pass, and each that is
must fail (on one rank, a strict ``xfail``): the list is what a pipeline
cannot honour, each with its reason. Two ranks run each test function once
(its first parameters; one rank runs them all): 58 of the 148 Sequential and
trainer tests, a quarter of the time; 79 of the 114 Functional and model tests
(and 9 of cloning_test.py's 17, and variable_mapping_test.py's one); 54 of the 55
callback tests (TensorBoard's 15 more in the slow tier).
"""

import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import keras
import pytest
from mpi import ROOT, SITE, children_cpu, log_launch, mpirun_path

TESTS = Path(__file__).parent
KERAS_SRC = Path(keras.__file__).parent / "src"
KERAS_TESTS = {  # one launch each
    "sequential": [KERAS_SRC / "models" / "sequential_test.py", KERAS_SRC / "trainers" / "trainer_test.py"],
    "functional": [
        KERAS_SRC / "models" / name
        for name in ("functional_test.py", "model_test.py", "cloning_test.py", "variable_mapping_test.py")
    ],
    "callbacks": sorted(
        path
        for path in (KERAS_SRC / "callbacks").glob("*_test.py")
        if path.name not in ("orbax_checkpoint_test.py", "tensorboard_test.py")
    ),
    # (a launch of its own in the slow tier: 15 of the 70 tests, TensorBoard's writing and profiling most of their
    # time; the pipeline's TensorBoard, histograms and embeddings written by rank 0, is callback_families.py's)
    "tensorboard": [KERAS_SRC / "callbacks" / "tensorboard_test.py"],
}
# the two ranks' launch of the models' and trainer's tests: both groups in one (one start of the ranks, one
# collection of Keras' test modules: about 20 s of CPU)
KERAS_TESTS["models"] = KERAS_TESTS["sequential"] + KERAS_TESTS["functional"]
# Tests that must pass, at least: (of 148 and 58 Sequential and trainer tests; of 114 and 79 Functional and model
# tests, most of the others listed "FIXING:" in keras_conformance_expected.txt, for now)
PASSING = {
    ("sequential", 1): 140,
    ("sequential", 2): 50,
    ("functional", 1): 110,
    ("functional", 2): 62,
    ("callbacks", 1): 54,
    ("callbacks", 2): 49,
    ("tensorboard", 1): 15,
}
PASSING["models", 2] = PASSING["sequential", 2] + PASSING["functional", 2]


def run_keras_tests(nprocs: int, directory: Path, timeout: float, group: str = "sequential") -> list[dict]:
    """Runs Keras' tests of ``group`` with the plugin; each rank's results as ``{test: outcome}``."""
    report = directory / ("rank-RANK.xml" if nprocs > 1 else "rank-0.xml")
    command = [sys.executable, "-m", "pytest", "-p", "keras_conformance", "-q", "-p", "no:cacheprovider", "-n", "0"]
    # (--capture=sys: a rank that aborts the job says why on the launch's stderr, not in pytest's lost capture)
    command += ["--capture=sys"]
    command += ["-o", "junit_family=xunit1", "--junitxml", str(report), *map(str, KERAS_TESTS[group])]
    if nprocs > 1:
        command = [mpirun_path(), "-n", str(nprocs), *command]
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1", KERAS_BACKEND="tensorflow")
    # (SITE: Keras' tests start without sklearn and matplotlib, as the scripts' ranks do; neither file uses them)
    environment["PYTHONPATH"] = os.pathsep.join([str(SITE), str(TESTS), str(ROOT), environment.get("PYTHONPATH", "")])
    cpu, start = children_cpu(), time.monotonic()
    process = subprocess.run(
        command, cwd=TESTS, env=environment, capture_output=True, text=True, timeout=timeout, start_new_session=True
    )
    log_launch(nprocs, "pytest -p keras_conformance", (group,), time.monotonic() - start, children_cpu() - cpu)
    results = []
    for rank in range(nprocs):
        path = directory / f"rank-{rank}.xml"
        assert path.exists(), process.stdout[-6000:] + process.stderr[-6000:]
        results.append(_outcomes(path))
    return results, process.stdout + process.stderr


def _outcomes(path: Path) -> dict:
    outcomes = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        module = Path(case.get("file") or case.get("classname")).name
        name = f"{module}::{case.get('classname').split('.')[-1]}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            skipped = case.find("skipped")
            outcome = "xfailed" if "xfail" in (skipped.get("type", "") + skipped.get("message", "")) else "skipped"
        else:
            outcome = "passed"
        outcomes[name.replace("sequential_test.py", "sequential_test.py")] = outcome
    return outcomes


# (one rank runs every parameter of every test, two ranks each test once, cutting every model the tests build. The
# default suite: the models' and trainer's tests on two ranks, the callbacks' on one, whose own pipeline launches
# (tests/model/test_callbacks.py) cut on four; the slow tier the others)
SLOW = {("sequential", 1), ("functional", 1), ("callbacks", 2), ("tensorboard", 1)}
LAUNCHES = [("models", 2), ("callbacks", 1), *sorted(SLOW)]


@pytest.mark.parametrize(
    "group, nprocs",
    [pytest.param(group, n, marks=pytest.mark.slow) if (group, n) in SLOW else (group, n) for group, n in LAUNCHES],
    ids=lambda value: str(value),
)
def test_keras_own_tests_pass_against_the_pipeline(group, nprocs, tmp_path):
    results, output = run_keras_tests(nprocs, tmp_path, timeout=900, group=group)
    first = results[0]
    failed = sorted(name for name, outcome in first.items() if outcome == "failed")
    assert not failed, f"{len(failed)} of Keras' own tests failed on {nprocs} rank(s): {failed}\n{output[-8000:]}"
    for rank, other in enumerate(results[1:], start=1):
        assert other == first, f"rank {rank} saw other results than rank 0"
    passed = sum(outcome == "passed" for outcome in first.values())
    print(f"{passed} of {len(first)} of Keras' {group} tests passed on {nprocs} rank(s)")
    assert passed >= PASSING[group, nprocs], (passed, len(first))
