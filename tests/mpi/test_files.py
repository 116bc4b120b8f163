"""Atomic writes (no MPI): a write that fails part way leaves the previous file as it was."""

import os

import pytest

from keras_pipe.mpi.files import atomic_path, describe_unreadable, partial_path, suffix_of


def test_the_partial_file_keeps_the_suffix_keras_reads_the_format_from():
    assert suffix_of("a/b.weights.h5") == ".weights.h5"
    assert suffix_of("m.keras") == ".keras"
    assert partial_path("out/m.weights.h5", pid=3) == "out/.m.keras_pipe-partial-3.weights.h5"


def test_a_failed_write_leaves_the_previous_file_and_no_partial_one(tmp_path):
    target = tmp_path / "m.keras"
    target.write_text("previous")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as temporary:
            open(temporary, "w").write("half")
            raise RuntimeError("the disk is full")
    assert target.read_text() == "previous"
    assert os.listdir(tmp_path) == ["m.keras"]


def test_a_complete_write_replaces_the_file_and_removes_what_a_killed_writer_left(tmp_path):
    target = tmp_path / "m.keras"
    target.write_text("previous")
    (tmp_path / ".m.keras_pipe-partial-999.keras").write_text("left by a killed rank 0")
    with atomic_path(target) as temporary:
        open(temporary, "w").write("new")
    assert target.read_text() == "new"
    assert os.listdir(tmp_path) == ["m.keras"]


def test_a_damaged_file_is_described_as_such_not_as_missing(tmp_path):
    empty = tmp_path / "e.keras"
    empty.write_bytes(b"")
    assert "is empty" in describe_unreadable(empty, ValueError("File not found"))
    junk = tmp_path / "j.weights.h5"
    junk.write_bytes(b"x" * 10)
    assert "exists (10 bytes) but is not a readable .weights.h5 file" in describe_unreadable(junk, OSError("x"))
    assert "does not exist" in describe_unreadable(tmp_path / "none.keras", ValueError("File not found"))
