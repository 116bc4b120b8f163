"""Launching test scripts under a real ``mpirun``, always with a timeout."""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SCRIPTS = Path(__file__).parent / "mpi_scripts"
ROOT = SCRIPTS.parent.parent
SITE = Path(__file__).parent / "site"  # sitecustomize.py: the scripts' ranks start without sklearn and matplotlib


def mpirun_path() -> str:
    """The ``mpirun`` next to this Python (the ``mpich`` wheel's), else the one on ``PATH``."""
    beside = Path(sys.executable).parent / "mpirun"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpirun") or shutil.which("mpiexec")
    if not found:
        raise RuntimeError("no mpirun found; install the test extra pip install -e '.[tf-cpu,mpich,test]'")
    return found


def require_keras_hub() -> None:
    """Fails (never skips) where keras_hub is missing: the tests of code we did not write must run."""
    import importlib.util

    if importlib.util.find_spec("keras_hub") is None:
        raise RuntimeError(
            'keras_hub is not installed; install it as .ci/run does: pip install --no-deps "keras-hub==0.32.*" '
            "(its declared tensorflow-text would pull the full tensorflow beside tensorflow-cpu)"
        )


@dataclass
class Launch:
    returncode: int
    output: str
    seconds: float
    ended: float = 0.0  # time.time() when the job had ended

    def lines_with(self, text: str) -> list[str]:
        return [line for line in self.output.splitlines() if text in line]

    def seconds_after(self, marker: str) -> float:
        """Seconds from when a rank printed ``<marker> <time.time()>`` to the job's end.

        What a test of "ends within N seconds of the failure" must measure: the
        launch's whole duration also counts the ranks' start (TensorFlow's
        import), which a loaded machine slows several times over.
        """
        found = re.search(rf"{re.escape(marker)} (\d+(?:\.\d+)?)", self.output)
        assert found, f"no rank printed {marker!r}:\n{self.output}"
        return self.ended - float(found.group(1))

    def assert_cases(self, marker: str, cases, nprocs: int) -> None:
        """The launch ended well and every rank printed ``marker.format(case)`` for each case; where not, says which
        cases every rank finished and which it did not run (a script stops at its first failing case).

        One case of a script runs alone by hand: ``.venv/bin/mpirun -n P .venv/bin/python tests/mpi_scripts/S CASE``.
        """
        done = [case for case in cases if self.output.count(marker.format(case)) == nprocs]
        missing = [case for case in cases if case not in done]
        if self.returncode == 0 and not missing:
            return
        raise AssertionError(
            f"the launch ended with {self.returncode}; finished on all {nprocs} ranks: {done or 'none'}; "
            f"failed, or not run after a failure: {missing or 'none'}\n{self.output}"
        )


def run_mpi(
    nprocs: int,
    script: str,
    *args: str,
    timeout: float = 300,
    env: dict | None = None,
    mpirun_args: tuple[str, ...] = (),
    rank_env: list[dict] | None = None,
    wrapper: tuple[str, ...] = (),
    python_args: tuple[str, ...] = (),
) -> Launch:
    """Runs ``tests/mpi_scripts/<script>`` on ``nprocs`` ranks; kills the whole job after ``timeout`` s.

    ``mpirun_args`` go before the program (a host file, say); ``rank_env``
    gives each rank variables of its own (an MPMD launch, one rank per part);
    ``wrapper`` comes before Python on each rank's command line (a shell, say),
    ``python_args`` after it (``("-m", "mpi4py")``: mpi4py's runner).
    """
    environment = dict(os.environ)
    environment.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    environment["PYTHONUNBUFFERED"] = "1"
    paths = [str(ROOT), environment.get("PYTHONPATH", "")]
    if not Path(script).is_absolute():  # (tests/mpi_scripts; the examples launched by path keep every import)
        paths.insert(0, str(SITE))
    environment["PYTHONPATH"] = os.pathsep.join(paths)
    environment.update(env or {})
    program = [*wrapper, sys.executable, *python_args, str(SCRIPTS / script), *args]  # absolute paths pass through
    if rank_env is None:
        command = [mpirun_path(), *mpirun_args, "-n", str(nprocs), *program]
    else:
        assert len(rank_env) == nprocs, (len(rank_env), nprocs)
        command = [mpirun_path(), *mpirun_args]
        for rank, variables in enumerate(rank_env):
            command += [":"] if rank else []
            command += ["-n", "1"] + [part for k, v in variables.items() for part in ("-env", k, str(v))] + program
    start = time.monotonic()
    cpu = children_cpu()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        output, _ = process.communicate()
        raise AssertionError(
            f"mpirun -n {nprocs} {script} {' '.join(args)} timed out after {timeout} s:\n{output}"
        ) from None
    launch = Launch(process.returncode, output, time.monotonic() - start, time.time())
    log_launch(nprocs, script, args, launch.seconds, children_cpu() - cpu)
    return launch


def children_cpu() -> float:
    """CPU seconds of this process's children that have ended (and theirs, waited for)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def log_launch(nprocs: int, script: str, args: tuple[str, ...], seconds: float, cpu: float) -> None:
    """One line per launch to ``$KERAS_PIPE_LAUNCH_LOG``, if set: what a launch costs the suite.

    ``cpu`` is the CPU time of the whole job (every rank, waited for by
    ``mpirun``): on a machine the suite keeps busy, the suite's length is the
    sum of these over the cores, so they say where to cut (docs/suite_time.md).
    """
    path = os.environ.get("KERAS_PIPE_LAUNCH_LOG")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
        with open(path, "a") as log:
            ended = time.strftime("%H:%M:%S")  # (when it ended: with ``seconds``, the suite's timeline)
            log.write(f"{cpu:8.1f} cpu {seconds:7.1f} s {ended} -n {nprocs} {script} {' '.join(args)[:60]} | {test}\n")
