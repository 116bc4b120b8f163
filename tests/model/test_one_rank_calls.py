"""A collective method called on some ranks only is an error within seconds, not a stall."""

from mpi import run_mpi


def test_save_on_rank_zero_alone_fails_at_once_naming_the_method(tmp_path):
    launch = run_mpi(3, "one_rank_calls.py", str(tmp_path), "save", timeout=120)
    assert launch.returncode != 0, launch.output
    # from the save, not the launch's start (TensorFlow's import, slow on a loaded machine): a few s alone
    assert launch.seconds_after("SAVING AT") < 30, launch.output
    assert "ranks [0]: 'save()'; ranks [1, 2]: 'the end of the script'" in launch.output, launch.output
    assert "outside any `if rank == 0:`" in launch.output
    assert not (tmp_path / "model.keras").exists()


def test_different_methods_on_different_ranks_fail_on_every_rank(tmp_path):
    launch = run_mpi(3, "one_rank_calls.py", str(tmp_path), "different", timeout=120)
    assert launch.returncode == 0, launch.output
    assert launch.output.count("ranks [0]: 'evaluate()'; ranks [1, 2]: 'predict()'") == 3, launch.output
    assert launch.output.count("ONE RANK CALLS done") == 3, launch.output
