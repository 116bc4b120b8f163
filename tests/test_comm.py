"""Communication: raw buffers, clear size errors, and waiting without spinning."""

import re

from mpi import run_mpi


def test_waiting_ten_seconds_costs_well_under_a_second_of_cpu():
    launch = run_mpi(2, "idle_wait.py", timeout=120)
    assert launch.returncode == 0, launch.output
    wall, cpu = map(float, re.search(r"WAITED wall ([0-9.]+) s cpu ([0-9.]+) s", launch.output).groups())
    assert wall > 9, launch.output
    assert cpu < 0.5, f"a waiting rank used {cpu:.2f} s of CPU in {wall:.1f} s"
