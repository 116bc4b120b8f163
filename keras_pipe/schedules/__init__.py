"""Schedules as plain data: 1F1B, GPipe, zero-bubble, interleaved, and what runs them on paper.

The actions of a schedule (:mod:`.actions`), the one-chunk schedules
(:mod:`.one_chunk`), the virtual stages' (:mod:`.virtual`) and zero-bubble
ones (:mod:`.zero_bubble`), the names that make each (:mod:`.schedule`), their
messages added as actions (:mod:`.lowering`: what each rank's executor runs),
the simulator's ideal clock (:mod:`.simulator`), ``schedule="auto"``
(:mod:`.auto`) and the cost model of a step (:mod:`.cost`). No tensors, no
MPI: generated and checked in one process.

The schedule vocabulary is exported here (``__all__``): a user needs no
module path. Example:

>>> from keras_pipe.schedules import make_schedule, format_schedule
>>> print(format_schedule(make_schedule("1f1b", 2, 3)))
stage 0: F0 F1 B0 F2 B1 B2
stage 1: FB0 FB1 FB2

A bottom layer: it imports only the root modules (:mod:`keras_pipe.errors`);
never :mod:`keras_pipe.mpi` nor any layer above. This ``__init__`` imports
its own modules only, to export their public names.
"""

from keras_pipe.schedules.actions import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FORWARD_BACKWARD,
    FORWARD_HEAD,
    FORWARD_INPUT,
    FORWARD_LOSS,
    RECV_B,
    RECV_F,
    SEED,
    SEND_B,
    SEND_F,
    Action,
    Holding,
    Kind,
    act,
    format_actions,
    max_held,
    max_in_flight,
)
from keras_pipe.schedules.cost import Estimate, Machine, Workload, choose_num_stages, estimate, layouts
from keras_pipe.schedules.lowering import computing, lower
from keras_pipe.schedules.one_chunk import forward_only, gpipe, one_f_one_b
from keras_pipe.schedules.schedule import (
    CHUNKED_SCHEDULES,
    SCHEDULES,
    default_chunks,
    hold_for,
    make_schedule,
    placement,
)
from keras_pipe.schedules.simulator import bubble, durations_of, format_schedule, gantt, makespan, simulate
from keras_pipe.schedules.virtual import interleaved_one_f_one_b
from keras_pipe.schedules.zero_bubble import zero_bubble_h1, zero_bubble_v

__all__ = [
    # the vocabulary: kinds of action, actions, what a stage holds
    "Kind",
    "FORWARD",
    "BACKWARD",
    "BACKWARD_INPUT",
    "BACKWARD_WEIGHT",
    "FORWARD_BACKWARD",
    "FORWARD_INPUT",
    "FORWARD_LOSS",
    "FORWARD_HEAD",
    "SEND_F",
    "RECV_F",
    "SEND_B",
    "RECV_B",
    "SEED",
    "Action",
    "act",
    "Holding",
    "hold_for",
    "format_actions",
    "max_held",
    "max_in_flight",
    # the schedules, by name and by function
    "SCHEDULES",
    "CHUNKED_SCHEDULES",
    "make_schedule",
    "placement",
    "default_chunks",
    "gpipe",
    "one_f_one_b",
    "forward_only",
    "zero_bubble_h1",
    "zero_bubble_v",
    "interleaved_one_f_one_b",
    # the messages as actions: the lists the executor runs
    "lower",
    "computing",
    # on paper: the simulator's clock
    "simulate",
    "makespan",
    "bubble",
    "gantt",
    "format_schedule",
    "durations_of",
    # the cost model of a step: stages or replicas
    "Machine",
    "Workload",
    "Estimate",
    "estimate",
    "layouts",
    "choose_num_stages",
]
