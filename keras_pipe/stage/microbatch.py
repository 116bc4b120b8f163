"""Cutting a batch into replicas' shares and micro-batches: sizes and boundaries."""

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
    return _even_sizes(batch_size, min(num_microbatches, batch_size))


def microbatch_bounds(batch_size: int, num_microbatches: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each micro-batch inside the batch.

    >>> microbatch_bounds(5, 2)
    [(0, 3), (3, 5)]
    """
    return bounds_of(microbatch_sizes(batch_size, num_microbatches))


def replica_bounds(batch_size: int, num_replicas: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each replica's share of a global batch, as even as possible.

    The first ``batch_size % R`` replicas get one sample more; with fewer
    samples than replicas the last replicas get an empty share.

    >>> replica_bounds(10, 4)
    [(0, 3), (3, 6), (6, 8), (8, 10)]
    >>> replica_bounds(1, 2)
    [(0, 1), (1, 1)]
    """
    return bounds_of(_even_sizes(batch_size, num_replicas))


def _even_sizes(total: int, parts: int) -> list[int]:
    """``parts`` sizes summing to ``total``, the first ``total % parts`` one larger."""
    base, extra = divmod(total, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def bounds_of(sizes) -> list[tuple[int, int]]:
    """``(start, stop)`` of consecutive parts of the given sizes (micro-batches, replicas' shares, stages).

    >>> bounds_of([2, 3])
    [(0, 2), (2, 5)]
    """
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds
