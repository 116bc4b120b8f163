"""Launching test scripts under a real ``mpirun``, always with a timeout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SCRIPTS = Path(__file__).parent / "mpi_scripts"
ROOT = SCRIPTS.parent.parent


def mpirun_path() -> str:
    """The ``mpirun`` next to this Python (the ``mpich`` wheel's), else the one on ``PATH``."""
    beside = Path(sys.executable).parent / "mpirun"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpirun") or shutil.which("mpiexec")
    if not found:
        raise RuntimeError("no mpirun found; install the test extra: pip install -e '.[tf-cpu,mpich,test]'")
    return found


@dataclass
class Launch:
    returncode: int
    output: str
    seconds: float

    def lines_with(self, text: str) -> list[str]:
        return [line for line in self.output.splitlines() if text in line]


def run_mpi(nprocs: int, script: str, *args: str, timeout: float = 300, env: dict | None = None) -> Launch:
    """Runs ``tests/mpi_scripts/<script>`` on ``nprocs`` ranks; kills the whole job after ``timeout`` s."""
    environment = dict(os.environ)
    environment.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    environment["PYTHONUNBUFFERED"] = "1"
    environment["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS.parent.parent), environment.get("PYTHONPATH", "")])
    environment.update(env or {})
    command = [
        mpirun_path(),
        "-n",
        str(nprocs),
        sys.executable,
        str(SCRIPTS / script),
        *args,
    ]  # absolute paths pass through
    start = time.monotonic()
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
    return Launch(process.returncode, output, time.monotonic() - start)
