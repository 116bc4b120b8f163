"""Each rank's thread pools and whether a waiting rank spins, as plain data (no MPI, no TensorFlow op).

``KERAS_PIPE_THREADS`` set to the host's cores lends a waiting rank's core
to its neighbour (docs/performance.md, "Lending a waiting rank's core"):
then a waiting rank must sleep soon rather than spin on the core it lends.
"""

import pytest

from keras_pipe.mpi import threads


@pytest.fixture
def two_cores(monkeypatch):
    """A 2-core host whose launcher says 2 ranks share it; no pools sized yet in this test's view."""
    monkeypatch.setattr(threads, "host_cores", lambda: 2)
    monkeypatch.setattr(threads, "_configured", None)
    monkeypatch.setenv("MPI_LOCALNRANKS", "2")
    monkeypatch.delenv("KERAS_PIPE_THREADS", raising=False)
    for name in threads.LOCAL_SIZE_VARIABLES[1:]:
        monkeypatch.delenv(name, raising=False)


def test_the_override_is_a_positive_integer_or_unset():
    assert threads.threads_override({}) is None
    assert threads.threads_override({"KERAS_PIPE_THREADS": ""}) is None
    assert threads.threads_override({"KERAS_PIPE_THREADS": "2"}) == 2
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ValueError, match="KERAS_PIPE_THREADS"):
            threads.threads_override({"KERAS_PIPE_THREADS": bad})


def test_by_default_each_rank_has_cores_of_its_own_and_may_spin(two_cores):
    assert threads.cores_to_spare()


def test_lending_the_host_s_cores_makes_a_waiting_rank_sleep_soon(two_cores, monkeypatch):
    monkeypatch.setenv("KERAS_PIPE_THREADS", "2")
    assert not threads.cores_to_spare()  # (two ranks of two threads on two cores: the waiting one's core is lent)


def test_more_ranks_than_cores_never_spin(two_cores, monkeypatch):
    monkeypatch.setenv("MPI_LOCALNRANKS", "4")
    assert not threads.cores_to_spare()
