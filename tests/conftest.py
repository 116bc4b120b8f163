"""The suite runs on three pytest-xdist workers (``-n 3`` in ``setup.cfg``), longest tests first.

A launch of ranks leaves the cores idle, or spinning, much of its time
(ranks wait on each other; TensorFlow's first calls trace and compile one
rank after another), so several tests at once fill the machine: on 2 cores
three workers were faster than two or four, and spent less CPU time
(docs/suite_time.md has the figures). What a test measures in seconds must not share the cores: a test
marked ``alone`` (CPU time, measured speed) waits until the other workers'
tests have ended, and no test starts beside it. (A test under a short stall
timeout sets it after a first fit, when every rank's programs are traced:
``mpi_scripts/stall.py``.) A bound on how soon a job ends after a failure is measured
from the failure (``Launch.seconds_after``), not from the launch, and runs
beside others.

Every process the tests start shares one XLA cache on disk (TensorFlow's
``--tf_xla_persistent_cache_directory``): a program another process already
compiled from the same HLO is loaded instead of compiled again. The launches
share the unsplit reference models' trained results the same way
(``$KERAS_PIPE_TEST_REFERENCES``, ``tests/mpi_scripts/common.py``).

The tests ``tests/longest_first.txt`` names run before the rest, longest
first (a whole run with ``--record-longest-first`` writes it), so that no
long test starts last on one worker while the others have nothing left;
``alone`` tests run at the end, when the tests beside them are short ones
(a worker is given one test at a time: ``--maxschedchunk 1``).
"""

from __future__ import annotations

import collections
import fcntl
import inspect
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# The tests that run first, longest first (seconds, then the test's id): written by a whole run with
# ``--record-longest-first``, never by hand (docs/suite_time.md). A test it does not name runs after those it names.
LONGEST_FIRST_FILE = Path(__file__).with_name("longest_first.txt")
RECORDED_ABOVE = 10.0  # (seconds: a test shorter than that is left out of the file)


def longest_first() -> dict[str, int]:
    """``{test id: its place}`` from :data:`LONGEST_FIRST_FILE` (empty where there is none)."""
    try:
        lines = LONGEST_FIRST_FILE.read_text().splitlines()
    except OSError:
        return {}
    ids = [line.split(None, 1)[1] for line in lines if line.strip() and not line.startswith("#")]
    return {test: place for place, test in enumerate(ids)}


XLA_CACHE = "--tf_xla_persistent_cache_directory"


def pytest_addoption(parser):
    parser.addoption(
        "--slow",
        action="store_true",
        default=os.environ.get("KERAS_PIPE_SLOW", "") not in ("", "0"),
        help="also run the tests marked slow (the layouts and families the default suite leaves to this tier; "
        "KERAS_PIPE_SLOW=1 does the same)",
    )
    parser.addoption(
        "--record-longest-first",
        action="store_true",
        default=False,
        help=f"write each test's seconds to tests/{LONGEST_FIRST_FILE.name}, longest first (the order the next runs "
        "start the tests in; record it on a whole default run)",
    )


def pytest_report_header(config):
    if not config.getoption("--slow"):
        return "keras_pipe: the tests marked slow are left out (--slow or KERAS_PIPE_SLOW=1 runs them too)"
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: measures time; runs with no other test at once under pytest-xdist")
    config.addinivalue_line(
        "markers",
        "slow: a further layout or family of a behaviour the default suite already shows on another; "
        "left out unless --slow (the suite's time: docs/suite_time.md)",
    )
    config.addinivalue_line(
        "markers", "mpi: launches ranks under mpirun (given to every such test; `-m 'not mpi'` is the fast tier)"
    )
    if XLA_CACHE not in os.environ.get("TF_XLA_FLAGS", ""):
        # TensorFlow's own disk cache of XLA programs, for every process the session starts: most
        # launches compile programs another has compiled (the same test models, the same stages), and
        # compiling is most of a small model's first steps (the equivalence script's models: 12 s of
        # a first fit with XLA, 4 without). A program is loaded only where its HLO is the same.
        directory = tempfile.mkdtemp(prefix="keras_pipe_tests_xla_")
        os.environ["TF_XLA_FLAGS"] = f"{os.environ.get('TF_XLA_FLAGS', '')} {XLA_CACHE}={directory}".strip()
        config._keras_pipe_xla_cache = directory  # (the controller's, removed at its end; workers inherit it)
    if "KERAS_PIPE_TEST_REFERENCES" not in os.environ:
        # The unsplit models' trained results, kept once a session (tests/mpi_scripts/common.py, _remembered):
        # launches on other rank counts train the same references from the same weights and data.
        directory = tempfile.mkdtemp(prefix="keras_pipe_tests_references_")
        os.environ["KERAS_PIPE_TEST_REFERENCES"] = directory
        config._keras_pipe_references = directory


def pytest_unconfigure(config):
    for name in ("_keras_pipe_xla_cache", "_keras_pipe_references"):
        directory = getattr(config, name, None)
        if directory:
            shutil.rmtree(directory, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--slow"):
        slow = [item for item in items if item.get_closest_marker("slow") is not None]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if item.get_closest_marker("slow") is None]
    for item in items:
        if _launches_ranks(item):
            item.add_marker(pytest.mark.mpi)

    order = longest_first()

    def rank(item):
        if item.get_closest_marker("alone") is not None:
            return len(order) + 1  # last: then the other worker's tests are short ones
        return order.get(item.nodeid, len(order))

    items.sort(key=rank)  # stable: each file's own order is kept


_SECONDS: collections.Counter = collections.Counter()


def pytest_runtest_logreport(report):
    """Each test's seconds, setup to teardown (on the controller under xdist: the workers' reports reach it)."""
    _SECONDS[report.nodeid] += report.duration


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if not config.getoption("--record-longest-first") or hasattr(config, "workerinput"):
        return
    recorded = sorted(((s, test) for test, s in _SECONDS.items() if s >= RECORDED_ABOVE), reverse=True)
    header = (
        "# Written by `python -m pytest --record-longest-first` (tests/conftest.py): each test's seconds on the run\n"
        "# that wrote it, longest first; the suite starts them in this order. Never edit it by hand.\n"
    )
    LONGEST_FIRST_FILE.write_text(header + "".join(f"{s:8.1f} {test}\n" for s, test in recorded))


_LAUNCHING = ("run_mpi(", "mpirun")


def _launches_ranks(item) -> bool:
    """Whether a test starts ranks: its function, or a function of its module it calls, names ``run_mpi`` or
    ``mpirun`` (the tests in one process are the fast tier)."""
    function = getattr(item, "function", None)
    if function is None:
        return False
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    helpers = getattr(item.module, "_keras_pipe_launching_helpers", None)
    if helpers is None:
        helpers = set()
        for name, value in vars(item.module).items():
            if inspect.isfunction(value) and value.__module__ == item.module.__name__:
                try:
                    if any(text in inspect.getsource(value) for text in _LAUNCHING):
                        helpers.add(name)
                except (OSError, TypeError):
                    pass
        item.module._keras_pipe_launching_helpers = helpers
    return any(text in source for text in _LAUNCHING) or any(f"{name}(" in source for name in helpers)


@pytest.fixture(autouse=True)
def _alone_or_beside_others(request, tmp_path_factory):
    """A shared lock for every test, an exclusive one for ``alone`` tests; a turnstile lets no test overtake one."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    common = tmp_path_factory.getbasetemp().parent  # the session's, shared by its workers
    alone = request.node.get_closest_marker("alone") is not None
    with open(common / "turnstile.lock", "a") as turnstile, open(common / "alone.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
