"""The module paths of 0.2 still import, through one table (keras_pipe/moved.py), each with a DeprecationWarning."""

import importlib
import sys
from pathlib import Path

import pytest

from keras_pipe.moved import MOVED

OLD_PATHS = {
    "keras_pipe.timeline": "keras_pipe.model.timeline",
    "keras_pipe.engine.timeline": "keras_pipe.model.timeline",
    "keras_pipe.tracing": "keras_pipe.engine.tracing",
    "keras_pipe.schedule": "keras_pipe.schedules",
    "keras_pipe.cost": "keras_pipe.schedules.cost",
    "keras_pipe.layout": "keras_pipe.mpi.layout",
    "keras_pipe.devices": "keras_pipe.mpi.devices",
}


def fresh_import(old):
    """Imports ``old`` as a script would the first time (the warning comes once: the module is then cached)."""
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{old} is .* since keras_pipe 0\.3") as caught:
        module = importlib.import_module(old)
    return module, caught


def test_the_table_is_the_one_tested_here():
    assert {old: new for old, (new, _) in MOVED.items()} == OLD_PATHS


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_the_old_path_is_the_new_module_and_warns(old):
    module, _ = fresh_import(old)
    assert module is importlib.import_module(OLD_PATHS[old])
    assert module.__spec__.name == OLD_PATHS[old]  # (the new module's own spec, not the alias's)


def test_the_warning_points_at_the_line_that_imports():
    sys.modules.pop("keras_pipe.cost", None)
    with pytest.warns(DeprecationWarning) as caught:
        import keras_pipe.cost  # noqa: F401
    assert caught[0].filename == __file__, caught[0].filename


def test_no_old_path_is_a_file_any_more():
    root = Path(importlib.import_module("keras_pipe").__file__).parent.parent
    for old in OLD_PATHS:
        path = root.joinpath(*old.split("."))
        assert not path.with_suffix(".py").exists() and not path.is_dir(), path


def test_the_documented_names():
    for old in ("keras_pipe.cost", "keras_pipe.devices", "keras_pipe.schedule", "keras_pipe.timeline"):
        fresh_import(old)
    import keras_pipe
    from keras_pipe.cost import choose_num_stages
    from keras_pipe.devices import choose_gpu
    from keras_pipe.schedule import Kind, make_schedule, one_f_one_b, zero_bubble_h1
    from keras_pipe.timeline import PipelineTimeline

    assert PipelineTimeline is keras_pipe.PipelineTimeline
    assert PipelineTimeline.__module__ == "keras_pipe.model.timeline"
    assert [str(a) for a in make_schedule("1f1b", 2, 2)[0]] == ["F0", "F1", "B0", "B1"]
    assert one_f_one_b(2, 2) == make_schedule("1f1b", 2, 2) and zero_bubble_h1(2, 2)[0][0].kind is Kind.FORWARD
    assert callable(choose_gpu) and callable(choose_num_stages)
