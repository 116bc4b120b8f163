"""The schedules side by side on the simulator's clock: a chart, the bubble and the memory of each.

A whole stage's forward, input gradient and weight gradient take 2 ticks
each; a chunk's (with two chunks a rank) 1; then the lists the executors
run, with their messages, for 1F1B and ZB-V. Prints the Markdown of
``docs/schedules.md`` (``tests/schedules/test_virtual.py`` checks the two agree):

    python benchmarks/schedules.py --ranks 4 --microbatches 8 > docs/schedules.md
"""

from __future__ import annotations

import argparse

from keras_pipe.schedules import format_actions, lower, max_held, one_f_one_b, zero_bubble_h1
from keras_pipe.schedules.simulator import bubble, durations_of, gantt, makespan
from keras_pipe.schedules.virtual import interleaved_one_f_one_b, loop_placement, v_placement
from keras_pipe.schedules.zero_bubble import zero_bubble_v


def durations(ticks: int) -> dict:
    return durations_of(ticks, ticks, ticks)


def report(p: int, m: int) -> str:
    rows = [
        ("1F1B", one_f_one_b(p, m), 1, None, "yes"),
        ("ZB-H1", zero_bubble_h1(p, m), 1, None, "yes"),
        (
            "interleaved 1F1B, v = 2",
            interleaved_one_f_one_b(p, m, 2),
            2,
            loop_placement(p, 2),
            'yes: `schedule="interleaved-1f1b"`',
        ),
        ("ZB-V", zero_bubble_v(p, m), 2, v_placement(p), 'yes: `schedule="zb-v"`'),
    ]
    lines = [
        f"# Schedules on the simulator's clock: {p} ranks, {m} micro-batches",
        "",
        "Made by `python benchmarks/schedules.py` from `keras_pipe.schedules` (`schedule`, `virtual` and",
        "`simulator`): the same plain data the executor walks. A whole stage's forward (F), input",
        "gradient (I) and weight gradient (W) take 2 ticks each (B = I + W); with two chunks a rank each",
        "chunk's take 1, chunk 1 in lower case; `.` is a tick the rank waits. Memory: the most micro-batches",
        "a rank holds from its forward to its weight gradient, in whole-stage micro-batches (chunks count",
        "half), on the rank that holds the most.",
        "",
        "| schedule | ticks | bubble | memory | runs in `PipelineModel` |",
        "|---|---|---|---|---|",
    ]
    charts = []
    for name, plan, chunks, placement, runs in rows:
        ticks = makespan(plan, durations(2 // chunks), placement)
        idle = bubble(plan, durations(2 // chunks), placement)
        held = max(max_held(actions) for actions in plan) / chunks
        lines.append(f"| {name} | {ticks:g} | {idle:.0%} | {held:g} | {runs} |")
        charts += ["", f"{name}:", "", "```", gantt(plan, durations(2 // chunks), placement), "```"]
    return "\n".join(lines + charts + lowered()) + "\n"


def lowered(p: int = 2, m: int = 4) -> list[str]:
    """The lists the executors run (the schedule with its messages: ``keras_pipe.schedules.lower``), as lines."""
    lines = [
        "",
        f"## What each rank runs: the lowered lists, {p} ranks, {m} micro-batches",
        "",
        "The executor runs a schedule with its messages as actions of their own (`keras_pipe.schedules.lower`,",
        "as torch's pipelining lowers its schedules): `RECV_F` right before the action that reads a stage's",
        "inputs, `SEND_F` right after a forward whose outputs another stage reads, `RECV_B` before a backward",
        "that needs its outputs' gradients, `SEND_B` after one that computed its inputs'. A send starts at",
        "once, a receive waits; `simulate` runs exactly these lists, matching each receive to its peer's send",
        "in the order sent. The last stage's forwards are kinds of their own outside the fused `FB`/`FI`:",
        "`FL` (evaluation: the loss too) and `FH` (a loss over the whole batch: terms and divisors summed),",
        "whose backwards get `SEED` where other stages' get `RECV_B`.",
    ]
    for name, plan, placement in [
        ("1F1B", one_f_one_b(p, m), None),
        ("ZB-V (`@1`: chunk 1, the V's way back)", zero_bubble_v(p, m), v_placement(p)),
    ]:
        lines += ["", f"{name}:", "", "```"]
        lines += [f"rank {r}: {format_actions(actions)}" for r, actions in enumerate(lower(plan, placement))]
        lines += ["```"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    print(report(args.ranks, args.microbatches), end="")


if __name__ == "__main__":
    main()
