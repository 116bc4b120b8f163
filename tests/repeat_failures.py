"""Repeats the fail-fast launches many times on a loaded machine; every run must show the failing rank's message.

A failure message that reaches the terminal in 19 runs of 20 fails somebody's
CI every week, so this is checked by repetition, with other processes
competing for the cores (the launcher must still forward what the failing rank
wrote before the job is torn down).

Usage: python tests/repeat_failures.py [--runs 21] [--load 2] [--stall | --collective]

Each run is one of the tests' own functions, with its assertions: the failing
rank's message shown, the job ended within 60 s. Prints one line per run and a
summary; exits 1 if any run failed. With ``--stall``, the runs are the stall tests
instead (a hanging rank, a hanging replica, a killed rank under hydra and under
a launcher that lets the survivors speak), each run one of those tests with its
own assertions (its bound in seconds after the rank stops included). With
``--collective``, errors raised on every rank: one caught and raised anew
(rank 0 hearing of the first late) and a damaged BackupAndRestore backup, which
hung a CI run before each round of the check took one announcement a rank.
"""

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import test_bad_input  # noqa: E402
import test_callbacks  # noqa: E402
import test_failure  # noqa: E402

CASES = [
    ("callback", "boom from a callback on rank 2"),
    ("layer", "a layer failed on rank 2"),
    ("data", "the data reader failed on rank 2"),
]
FAIL_FAST = [(test_failure.test_rank_failure_ends_every_rank, case) for case in CASES]
STALL = [
    (test_bad_input.test_a_hanging_rank_ends_the_job_with_a_report, ()),
    (test_bad_input.test_a_hanging_replica_ends_the_job_with_a_report_naming_every_rank, ()),
    (test_bad_input.test_a_killed_rank_ends_the_job_within_the_timeout, ()),
    (test_failure.test_a_killed_rank_is_named_by_the_survivors, ()),
]

COLLECTIVE = [
    (test_failure.test_an_error_caught_and_raised_anew_on_every_rank_is_printed_once_not_waited_on, ()),
    (
        test_callbacks.test_backup_and_restore_killed_while_writing_its_backup_resumes_from_the_last_good_one,
        lambda: (Path(tempfile.mkdtemp(prefix="repeat_backup_")),),  # (a fresh tmp_path each run)
    ),
]


def one_run(tests: list, run: int):
    """One of ``tests``, with its own assertions; ``(name, problem or None, seconds)``."""
    test, args = tests[run % len(tests)]
    args = args() if callable(args) else args
    start = time.monotonic()
    try:
        test(*args)
        problem = None
    except AssertionError as error:
        problem = str(error)
    name = args[0] if args and isinstance(args[0], str) else test.__name__.removeprefix("test_")[:40]
    return name, problem, time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--load", type=int, default=2, help="busy processes competing for the cores")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--stall", action="store_true", help="repeat the stall tests instead")
    which.add_argument("--collective", action="store_true", help="repeat errors raised on every rank instead")
    args = parser.parse_args()
    tests = STALL if args.stall else COLLECTIVE if args.collective else FAIL_FAST
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    failures = []
    try:
        for run in range(args.runs):
            name, problem, seconds = one_run(tests, run)
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
