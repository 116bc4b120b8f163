"""Repeats the fail-fast launches many times on a loaded machine; every run must show the failing rank's message.

A failure message that reaches the terminal in 19 runs of 20 fails somebody's
CI every week, so this is checked by repetition, with other processes
competing for the cores (the launcher must still forward what the failing rank
wrote before the job is torn down).

Usage: python tests/repeat_failures.py [--runs 21] [--load 2] [--stall]

Prints one line per run and a summary; exits 1 if any run lost the message,
did not end, or took over 60 s. With ``--stall``, the runs are the stall tests
instead (a hanging rank, a hanging replica, a killed rank under hydra and under
a launcher that lets the survivors speak), each run one of those tests with its
own assertions (its bound in seconds after the rank stops included).
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import test_bad_input  # noqa: E402
import test_failure  # noqa: E402
from mpi import run_mpi  # noqa: E402

CASES = [
    ("callback", "boom from a callback on rank 2"),
    ("layer", "a layer failed on rank 2"),
    ("data", "the data reader failed on rank 2"),
]
STALL_TESTS = [
    test_bad_input.test_a_hanging_rank_ends_the_job_with_a_report,
    test_bad_input.test_a_hanging_replica_ends_the_job_with_a_report_naming_every_rank,
    test_bad_input.test_a_killed_rank_ends_the_job_within_the_timeout,
    test_failure.test_a_killed_rank_is_named_by_the_survivors,
]


def fail_fast_run(run: int):
    """One fail-fast launch; ``(name, problem or None, seconds)``."""
    where, message = CASES[run % len(CASES)]
    launch = run_mpi(4, "fail_rank.py", "2", where, timeout=120)
    ok = launch.returncode != 0 and launch.seconds < 60 and message in launch.output
    ok = ok and "rank 2 of 4" in launch.output and "finished without noticing" not in launch.output
    return where, None if ok else launch.output, launch.seconds


def stall_run(run: int):
    """One stall test, its own assertions; ``(name, problem or None, seconds)``."""
    test = STALL_TESTS[run % len(STALL_TESTS)]
    start = time.monotonic()
    try:
        test()
        problem = None
    except AssertionError as error:
        problem = str(error)
    return test.__name__.removeprefix("test_")[:40], problem, time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--load", type=int, default=2, help="busy processes competing for the cores")
    parser.add_argument("--stall", action="store_true", help="repeat the stall tests instead")
    args = parser.parse_args()
    one_run = stall_run if args.stall else fail_fast_run
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    failures = []
    try:
        for run in range(args.runs):
            name, problem, seconds = one_run(run)
            print(f"run {run + 1:2d} {name:40s} {'ok' if problem is None else 'FAILED'} ({seconds:.1f} s)", flush=True)
            if problem is not None:
                failures.append((run, problem))
    finally:
        for burner in burners:
            burner.kill()
    print(f"{args.runs - len(failures)} of {args.runs} runs passed (load: {args.load})")
    for run, output in failures:
        print(f"--- run {run + 1}:\n{output}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
