"""Internal: a tensor with the Keras mask that rides with it, as it crosses a stage boundary."""

from __future__ import annotations

from typing import NamedTuple


class Masked(NamedTuple):
    """A tensor and the Keras mask that rides with it (``Embedding(mask_zero=True)``, ``Masking``)."""

    tensor: object
    mask: object
