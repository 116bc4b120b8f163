"""``schedule="auto"``: the training schedule picked by timing the candidates' steps on this job.

Which schedule trains fastest depends on what the simulator cannot see: a
``W`` batched over several micro-batches (1F1B) pays the work proportional
to the weights once, a ``W`` a micro-batch (ZB-H1) fills the bubbles but
pays it ``m`` times and makes smaller matrix products; which of the two
wins depends on the model, the micro-batch size and the machine (the
figures in issue 21: at batch 256 ZB-H1 simulates the smaller bubble and
trains at 0.78x 1F1B's speed). So ``"auto"`` measures instead of guessing:
its first training step times the candidates on its batch (warm-up steps,
then timed steps of each in turn), then every rank takes the schedule whose
median timed step was fastest, from the same numbers (each step's time is
its slowest rank's), so all ranks agree. None of the timing steps trains:
each updates a copy of the optimizer, and every weight is put back before
the batch's real step (``keras_pipe.engine.recut``).

The candidates are ``"1f1b"`` and ``"zb-h1"``, both at 1F1B's activation
memory, and ``"zb-v"``: two chunks a rank placed in a V, so another cut of
the model, which the engine builds beside the first for the timing (each
rank holds up to both cuts' weights for that step) and keeps if picked.
ZB-V is left out where the model is not the engine's to cut into ``2P``
virtual stages (``balance`` or ``split_before`` given, fewer layers than
``2P``), and ``summary()`` says why. ``"gpipe"`` is not one: its bubble is
1F1B's and it holds every micro-batch's activations; nor is
``"interleaved-1f1b"``, whose rounds need ``m`` a multiple of ``P``.

``num_microbatches="auto"`` times the numbers of micro-batches too
(:func:`microbatch_candidates`: ``P``, ``2P`` and ``4P``): fewer, wider
micro-batches make cheaper matrix products per row (on one core a rank, a
16-row product costs about twice a 256-row one's per row) and a larger
bubble; which wins is measured the same way, on every pair of schedule and
``m``. Only where ``m`` changes nothing but round-off: the pipeline refuses
it for a model whose batch normalization computes statistics per
micro-batch.

>>> picker = SchedulePicker(num_stages=2, num_microbatches=4, warmup=1, timed=1)
>>> picker.current(), picker.steps_left()
('1f1b', 4)
>>> for seconds in (0.9, 0.9, 0.002, 0.001):  # a warm-up step of each, then a timed step of each
...     if picker.record(seconds):
...         picked = picker.decide([picker.times])  # every rank's times: one rank here
>>> picker.describe()
'auto: zb-h1 (median step 1.0 ms against 1f1b 2.0 ms; simulated bubble 7.7%)'
"""

from __future__ import annotations

import statistics

from keras_pipe.schedules import schedule
from keras_pipe.schedules.simulator import DURATIONS, bubble

CANDIDATES = ("1f1b", "zb-h1")
# The candidate that cuts the model otherwise (two chunks a rank, in a V): timed only where the model can be cut
# for it (the engine drops it otherwise, naming why)
OTHER_CUT = "zb-v"
WARMUP_ROUNDS = 2  # steps of each candidate before timing: tracing, the first step's W per micro-batch
TIMED_ROUNDS = 3  # timed steps of each, alternated; the median counts (one step slowed by the machine does not)


def schedule_candidates(num_stages: int) -> tuple[str, ...]:
    """The schedules ``schedule="auto"`` times on ``num_stages`` stages: :data:`CANDIDATES`, and
    :data:`OTHER_CUT` on more than one stage."""
    return CANDIDATES + ((OTHER_CUT,) if num_stages > 1 else ())


def microbatch_candidates(num_stages: int) -> tuple[int, ...]:
    """The numbers of micro-batches ``num_microbatches="auto"`` times: ``P``, ``2P``, ``4P`` (1 on one stage).

    Each a multiple of ``P`` (interleaved 1F1B's whole rounds). Below ``P``
    a stage idles for most of the step; above ``4P`` the bubble is under
    a sixteenth of 1F1B's at ``P`` while each product gets thinner still.

    >>> microbatch_candidates(2), microbatch_candidates(1)
    ((2, 4, 8), (1,))
    """
    return (1,) if num_stages == 1 else (num_stages, 2 * num_stages, 4 * num_stages)


class SchedulePicker:
    """Which candidate each of the first training steps runs, their times, and the pick.

    ``current()`` is the schedule of the next training step and
    ``microbatches()`` its number of micro-batches; ``record(s)`` notes its
    duration and says when the last timed step is in, when the caller
    gathers every rank's :attr:`times` and calls :meth:`decide`.

    ``microbatch_counts``: the numbers of micro-batches to time
    (``num_microbatches="auto"``; each candidate schedule with each, a
    candidate named ``"1f1b m=4"``); ``None``: ``num_microbatches`` alone.
    """

    def __init__(
        self,
        num_stages: int,
        num_microbatches: int | None,
        candidates=CANDIDATES,
        warmup: int = WARMUP_ROUNDS,
        timed: int = TIMED_ROUNDS,
        microbatch_counts=None,
    ):
        self.num_stages = num_stages
        counts = tuple(microbatch_counts or (num_microbatches,))
        if len(counts) == 1:  # one m: a candidate is its schedule's name
            self._choices = {name: (name, counts[0]) for name in candidates}
        else:
            self._choices = {f"{name} m={m}": (name, m) for name in candidates for m in counts}
        self._rounds = (warmup, timed)
        self.dropped: dict[str, str] = {}  # a schedule left out, and why (engine: ZB-V where the model has no V cut)
        self._plan_rounds()
        self.times: dict[str, list[float]] = {name: [] for name in self.candidates}
        self.typical: dict[str, float] = {}
        # One stage has no bubble to fill: 1F1B's order is the forward and backward of each micro-batch.
        self.picked: str | None = self.candidates[0] if num_stages == 1 else None

    def _plan_rounds(self) -> None:
        warmup, timed = self._rounds
        self.candidates = tuple(self._choices)
        self._warmup = warmup * len(self.candidates)
        self._plan = list(self.candidates) * (warmup + timed)
        self._step = 0

    def schedules(self) -> tuple[str, ...]:
        """The candidates' schedules, each once, in order."""
        return tuple(dict.fromkeys(name for name, _ in self._choices.values()))

    def drop(self, name: str, why: str) -> None:
        """Leaves schedule ``name`` out of the candidates (before any is timed), saying ``why`` in :meth:`describe`.

        >>> picker = SchedulePicker(2, 4, candidates=("1f1b", "zb-v"))
        >>> picker.drop("zb-v", "no V cut"); picker.candidates
        ('1f1b',)
        """
        self._choices = {key: choice for key, choice in self._choices.items() if choice[0] != name}
        self.times = {key: times for key, times in self.times.items() if key in self._choices}
        self.dropped[name] = why
        self._plan_rounds()

    def current(self) -> str:
        """The schedule the next training step runs."""
        return self._choices[self.candidate()][0]

    def microbatches(self) -> int:
        """The number of micro-batches of the next step (training, evaluation, prediction: the pick's, once made)."""
        return self._choices[self.candidate()][1]

    def candidate(self) -> str:
        """The candidate the next training step runs (its schedule's name, with ``" m=4"`` where ``m`` is timed too)."""
        if self.picked:
            return self.picked
        return self._plan[self._step] if self._step < len(self._plan) else self.candidates[0]

    def steps_left(self) -> int:
        return 0 if self.picked else len(self._plan) - self._step

    def record(self, seconds: float) -> bool:
        """Notes the duration of the step :meth:`current` named; ``True`` once every candidate is timed."""
        if self.picked:
            return False
        if self._step >= self._warmup:
            self.times[self._plan[self._step]].append(float(seconds))
        self._step += 1
        return self._step == len(self._plan)

    def decide(self, everyone: list[dict]) -> str:
        """Picks from every rank's :attr:`times` (the same lists on every rank give the same pick)."""
        for name in self.candidates:
            steps = zip(*(times[name] for times in everyone))
            self.typical[name] = statistics.median(max(ranks) for ranks in steps)
        self.picked = min(self.candidates, key=lambda name: (self.typical[name], self.candidates.index(name)))
        return self.picked

    def describe(self) -> str:
        """What ``summary()`` says: the pick, the times it came from, and its simulated bubble."""
        if self.picked is None:
            *others, last = self.candidates
            timing = f"{', '.join(others)} and {last}" if others else last
            return f"auto: not picked yet (the first training step times {timing}{self._left_out()})"
        name, m = self._choices[self.picked]
        bubble = simulated_bubble(name, self.num_stages, m)
        if not self.typical:
            return f"auto: {self.picked} (one stage; simulated bubble {100 * bubble:.1f}%)"
        others = ", ".join(f"{name} {1e3 * s:.1f} ms" for name, s in self.typical.items() if name != self.picked)
        return (
            f"auto: {self.picked} (median step {1e3 * self.typical[self.picked]:.1f} ms against {others}; "
            f"simulated bubble {100 * bubble:.1f}%{self._left_out()})"
        )

    def _left_out(self) -> str:
        return "".join(f"; {name} not timed: {why}" for name, why in self.dropped.items())


def simulated_bubble(name: str, num_stages: int, num_microbatches: int) -> float:
    """The idle share of the stages' time on the simulator's clock (F, I and W a tick each)."""
    chunks = schedule.default_chunks(name)
    plan = schedule.make_schedule(name, num_stages, num_microbatches, split_backward=True, num_chunks=chunks)
    return bubble(plan, DURATIONS, schedule.placement(name, num_stages, chunks))
