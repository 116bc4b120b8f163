"""The step-time cost model (plain arithmetic) and the module examples."""

import doctest

import pytest

from keras_pipe.mpi import layout
from keras_pipe.schedules import cost
from keras_pipe.schedules.cost import Machine, Workload, choose_num_stages, estimate, layouts


@pytest.mark.parametrize("module", [cost, layout])
def test_examples(module):
    assert doctest.testmod(module).failed == 0


MACHINE = Machine(compute_s_per_sample=1e-3, microbatch_overhead_s=1e-3, grad_s_per_param=1e-9)


def test_one_rank_is_compute_plus_overhead():
    e = estimate(Workload(params=1e6, activation_bytes=1024, batch=64), MACHINE, 1, 1)
    assert e.num_microbatches == 1 and e.bubble == 0
    assert e.step_s == pytest.approx(64 * 1e-3 + 1e-3 + 1e-3)


def test_bubble_is_p_minus_1_over_m_plus_p_minus_1():
    e = estimate(Workload(params=1e6, activation_bytes=1024, batch=64, num_microbatches=6), MACHINE, 3, 1)
    assert e.bubble == pytest.approx(2 / 8)


def test_replicas_divide_compute_and_add_an_allreduce():
    work = Workload(params=1e6, activation_bytes=1024, batch=64)
    one, two = estimate(work, MACHINE, 1, 1), estimate(work, MACHINE, 1, 2)
    assert two.allreduce_s > 0 and one.allreduce_s == 0
    assert two.slot_s < one.slot_s


def test_memory_limit_forces_more_stages():
    work = Workload(params=1e9, activation_bytes=1024, batch=64)
    roomy = choose_num_stages(work, MACHINE, ranks=4)
    tight = choose_num_stages(work, Machine(**{**MACHINE.__dict__, "memory_bytes": 5e9}), ranks=4)
    assert roomy.num_stages < tight.num_stages and tight.fits


def test_layouts_cover_the_divisors():
    assert layouts(6) == [(1, 6), (2, 3), (3, 2), (6, 1)]
