"""The module paths the docs named before the packages still work: one module under both names."""

import importlib

import pytest

OLD_PATHS = {
    "keras_pipe.timeline": "keras_pipe.engine.timeline",
    "keras_pipe.tracing": "keras_pipe.engine.tracing",
    "keras_pipe.schedule": "keras_pipe.schedules.schedule",
    "keras_pipe.cost": "keras_pipe.schedules.cost",
    "keras_pipe.layout": "keras_pipe.mpi.layout",
    "keras_pipe.devices": "keras_pipe.mpi.devices",
}


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_the_old_path_is_the_new_module(old):
    assert importlib.import_module(old) is importlib.import_module(OLD_PATHS[old])


def test_the_documented_names():
    from keras_pipe.cost import choose_num_stages
    from keras_pipe.devices import choose_gpu
    from keras_pipe.schedule import Kind, make_schedule, one_f_one_b, zero_bubble_h1
    from keras_pipe.timeline import PipelineTimeline

    assert PipelineTimeline.__module__ == "keras_pipe.engine.timeline"
    assert [str(a) for a in make_schedule("1f1b", 2, 2)[0]] == ["F0", "F1", "B0", "B1"]
    assert one_f_one_b(2, 2) == make_schedule("1f1b", 2, 2) and zero_bubble_h1(2, 2)[0][0].kind is Kind.FORWARD
    assert callable(choose_gpu) and callable(choose_num_stages)
