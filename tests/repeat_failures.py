"""Repeats the fail-fast launches many times on a loaded machine; every run must show the failing rank's message.

A failure message that reaches the terminal in 19 runs of 20 fails somebody's
CI every week, so this is checked by repetition, with other processes
competing for the cores (the launcher must still forward what the failing rank
wrote before the job is torn down).

Usage: python tests/repeat_failures.py [--runs 21] [--load 2] [--stall | --collective | --matrix [--case C]]

Each run is one of the tests' own functions, with its assertions: the failing
rank's message shown, the job ended within 60 s. Prints one line per run and a
summary; exits 1 if any run failed. With ``--stall``, the runs are the stall tests
instead (a hanging rank, a hanging replica, a killed rank under hydra and under
a launcher that lets the survivors speak), each run one of those tests with its
own assertions (its bound in seconds after the rank stops included). With
``--collective``, errors raised on every rank: one caught and raised anew
(rank 0 hearing of the first late) and a damaged BackupAndRestore backup, which
hung a CI run before each round of the check took one announcement a rank.
With ``--matrix``, the fault matrix of ``test_failure_matrix.py`` (launch line x
failure point x ranks) and the out-of-step calls of ``test_out_of_step.py``;
``--case 2-python-script`` repeats one of its cases only (``2-m-later``: under
``python -m keras_pipe``); ``--table [CASE ...]`` launches each case once with the
default timeouts and prints docs/failures.md's rows.
"""

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).parent
for folder in (TESTS, TESTS / "model", TESTS / "mpi"):  # (the tests of a package live in its folder)
    sys.path.insert(0, str(folder))
import test_bad_input  # noqa: E402
import test_callbacks  # noqa: E402
import test_failure  # noqa: E402
import test_failure_matrix  # noqa: E402
import test_out_of_step  # noqa: E402

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
MATRIX = [(test_failure_matrix.test_a_failing_rank_ends_the_job_naming_itself, c) for c in test_failure_matrix.CASES]
MATRIX += [
    (test_out_of_step.test_ranks_in_different_collective_methods_raise_at_once_naming_both, ()),
    (test_out_of_step.test_an_error_inside_a_call_on_one_rank_ends_the_job_naming_it, ()),
]


def case_name(test, args) -> str:
    if args and not isinstance(args[0], str):
        # (a matrix case: 2-python-script, 2-m-later under python -m keras_pipe)
        return "-".join(str(a).replace("python -m keras_pipe", "m") for a in args)
    return args[0] if args and isinstance(args[0], str) else test.__name__.removeprefix("test_")[:40]


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
    return case_name(test, args), problem, time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--load", type=int, default=2, help="busy processes competing for the cores")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--stall", action="store_true", help="repeat the stall tests instead")
    which.add_argument("--collective", action="store_true", help="repeat errors raised on every rank instead")
    which.add_argument("--matrix", action="store_true", help="repeat the fault matrix's cases instead")
    parser.add_argument("--case", help="with --matrix: one case only, e.g. 2-python-script")
    parser.add_argument(
        "--table",
        nargs="*",
        metavar="RANKS-RUNNER-MODE",
        help="launch these matrix cases (every combination if none) once each with the default timeouts and "
        "print docs/failures.md's rows: seconds from the failure to the end, whether rank 1 was named",
    )
    args = parser.parse_args()
    if args.table is not None:
        return table(args.table, args.load)
    tests = STALL if args.stall else COLLECTIVE if args.collective else MATRIX if args.matrix else FAIL_FAST
    if args.case:
        tests = [(test, case) for test, case in tests if case_name(test, case) == args.case]
        if not tests:
            parser.error(f"no case {args.case!r}: {', '.join(case_name(t, c) for t, c in MATRIX)}")
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


def table(cases: list[str], load: int) -> int:
    """One launch per case with the default timeouts (KERAS_PIPE_START_TIMEOUT unset): a row of docs/failures.md."""
    every = [
        (n, runner, mode)
        for runner in test_failure_matrix.RUNNERS
        for mode in test_failure_matrix.MESSAGES
        for n in (2, 3, 4)
    ]
    chosen = [c for c in every if not cases or case_name(None, c) in cases]
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(load)]
    try:
        for nprocs, runner, mode in chosen:
            try:
                launch, seconds, named = test_failure_matrix.failure_case(nprocs, runner, mode, start_timeout=None)
                ended = f"{seconds:5.1f} s, exit {launch.returncode}"
            except AssertionError as error:  # (the launch's own timeout, or no failure seen)
                ended, named = f"did not end: {str(error).splitlines()[0][:60]}", False
                sys.stderr.write(f"{case_name(None, (nprocs, runner, mode))}:\n{str(error)[-3000:]}\n")
            print(f"| `{runner}` | {mode} | {nprocs} | {ended} | {'yes' if named else 'NO'} |", flush=True)
    finally:
        for burner in burners:
            burner.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
