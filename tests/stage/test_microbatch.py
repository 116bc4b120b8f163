"""Cutting batches into micro-batches."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keras_pipe.stage.microbatch import microbatch_bounds, microbatch_sizes


def test_uneven_sizes_as_documented():
    assert microbatch_sizes(50, 4) == [13, 13, 12, 12]
    assert microbatch_sizes(64, 4) == [16, 16, 16, 16]


def test_small_batch_gives_one_sample_per_microbatch():
    assert microbatch_sizes(3, 4) == [1, 1, 1]


def test_empty_batch_is_refused():
    with pytest.raises(ValueError, match="at least one sample"):
        microbatch_sizes(0, 2)


@given(st.integers(1, 10_000), st.integers(1, 64))
def test_bounds_cover_the_batch_once(batch, m):
    bounds = microbatch_bounds(batch, m)
    assert bounds[0][0] == 0 and bounds[-1][1] == batch
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [stop - start for start, stop in bounds]
    assert len(sizes) == min(batch, m)
    assert max(sizes) - min(sizes) <= 1
