"""Cutting a batch into micro-batches: sizes and boundaries."""

from __future__ import annotations


def microbatch_sizes(batch_size: int, num_microbatches: int) -> list[int]:
    """Sizes of the micro-batches a batch is cut into, as even as possible.

    The first ``batch_size % m`` micro-batches get one sample more; a batch
    smaller than ``num_microbatches`` gives one micro-batch per sample.

    Example:

    >>> microbatch_sizes(50, 4)
    [13, 13, 12, 12]
    >>> microbatch_sizes(3, 4)
    [1, 1, 1]
    """
    if batch_size < 1:
        raise ValueError(f"a batch needs at least one sample, got batch_size={batch_size}.")
    m = min(num_microbatches, batch_size)
    base, extra = divmod(batch_size, m)
    return [base + 1 if i < extra else base for i in range(m)]


def microbatch_bounds(batch_size: int, num_microbatches: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each micro-batch inside the batch.

    >>> microbatch_bounds(5, 2)
    [(0, 3), (3, 5)]
    """
    bounds, start = [], 0
    for size in microbatch_sizes(batch_size, num_microbatches):
        bounds.append((start, start + size))
        start += size
    return bounds
