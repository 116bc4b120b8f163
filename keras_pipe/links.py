"""Internal: what crosses between a stage and its neighbours — activations, their gradients, targets.

Every point-to-point message of the pipeline goes through here, on the
pipeline's communicator (rank = stage). Tensors travel as raw buffers of a
shape and dtype the receiver knows from the layer specs; only the number of
rows is read from the message, and checked against the micro-batch the
receiver expects, so ranks given different data stop with an error instead
of training on the wrong rows.
"""

from __future__ import annotations

from typing import NamedTuple

import keras
import numpy as np
import tensorflow as tf

from keras_pipe.comm import TAG_ACTIVATION, TAG_GRADIENT, TAG_TARGETS, Communicator
from keras_pipe.errors import RankMismatchError


class Links:
    """A stage's messages to and from its neighbours.

    Args:
        comm: the pipeline's communicator (rank = stage).
        input_template, output_template: the stage's input and output as ``KerasTensor``s:
            one, or a tuple, list or dict of them (each crosses as a message of its own).
        input_mask: the shape of the Keras mask that rides with a single input tensor, or ``None``.
    """

    def __init__(self, comm: Communicator, input_template, output_template, input_mask=None):
        self.comm = comm
        self.stage = comm.rank
        self.num_stages = comm.size
        self.input_template = input_template
        self.input_specs = _specs(input_template)
        # gradients come back for the floating-point tensors only
        self.output_gradient_specs = [s for s in _specs(output_template) if tf.as_dtype(s[1]).is_floating]
        self.several_outputs = not isinstance(output_template, keras.KerasTensor)
        self.input_mask = input_mask

    def send_activation(self, y) -> None:
        """Sends the stage's output, each tensor of a structure in turn; a ``Masked`` one's mask after it."""
        mask = None
        if isinstance(y, Masked):
            y, mask = y
        for tensor in tf.nest.flatten(y):
            self.comm.send(_host(tensor), self.stage + 1, TAG_ACTIVATION)
        if mask is not None:
            self.comm.send(_host(mask).view(np.uint8), self.stage + 1, TAG_ACTIVATION)

    def receive_activation(self, rows: int):
        """The previous stage's output (a structure where it is one); ``Masked`` where a Keras mask rides with it."""
        tensors = [self._receive(self.stage - 1, TAG_ACTIVATION, spec, rows) for spec in self.input_specs]
        if not isinstance(self.input_template, keras.KerasTensor):
            return tf.nest.pack_sequence_as(self.input_template, tensors)
        x = tensors[0]
        if self.input_mask is None:
            return x
        mask = self._receive(self.stage - 1, TAG_ACTIVATION, (self.input_mask, "uint8"), rows)
        return Masked(x, tf.cast(mask, tf.bool))

    def send_gradient(self, grad) -> None:
        """Sends the input gradient: one tensor, or a list (one per floating-point input tensor)."""
        for tensor in grad if isinstance(grad, list) else [grad]:
            self.comm.send(_host(tensor), self.stage - 1, TAG_GRADIENT)

    def receive_gradient(self, rows: int):
        """The output gradient: one tensor, or a list where the stage returns several."""
        grads = [self._receive(self.stage + 1, TAG_GRADIENT, spec, rows) for spec in self.output_gradient_specs]
        return grads if self.several_outputs else grads[0]

    def progress(self) -> None:
        """Lets MPI move pending sends along."""
        self.comm.progress()

    def _receive(self, source, tag, spec, rows):
        shape, dtype = spec
        array = self.comm.recv(source, tag, tuple(shape[1:]), tf.as_dtype(dtype).as_numpy_dtype)
        if array.shape[0] != rows:
            raise RankMismatchError(
                f"rank {self.comm.world_rank} expected a micro-batch of {rows} samples from rank "
                f"{self.comm.world_rank_of(source)} but got {array.shape[0]}: the ranks were given batches of "
                "different sizes. Give every rank the same data sizes and batch_size."
            )
        return tf.convert_to_tensor(array)

    # -- targets --------------------------------------------------------

    def send_targets(self, y, sample_weight) -> None:
        """First stage: labels and sample weights go straight to the last stage."""
        for array in (y, sample_weight):
            if array is not None:
                self.comm.send(np.asarray(array), self.num_stages - 1, TAG_TARGETS)

    def receive_targets(self, y_like, sample_weight_like, batch_size: int):
        """Last stage: the labels and sample weights the first stage paired with its inputs."""
        received = []
        for like in (y_like, sample_weight_like):
            if like is None:
                received.append(None)
                continue
            like = np.asarray(like)
            array = self.comm.recv(0, TAG_TARGETS, like.shape[1:], like.dtype)
            if array.shape[0] != batch_size:
                raise RankMismatchError(
                    f"rank {self.comm.world_rank} has a batch of {batch_size} samples but rank "
                    f"{self.comm.world_rank_of(0)} sent targets for {array.shape[0]}: the ranks were given "
                    "different data. Give every rank the same data sizes and batch_size."
                )
            received.append(array)
        return tuple(received)


class Masked(NamedTuple):
    """Activations and the Keras mask that rides with them (``Embedding(mask_zero=True)``, ``Masking``)."""

    tensor: object
    mask: object


def _specs(template) -> list:
    """``(shape, dtype)`` of each tensor of a ``KerasTensor`` structure, in ``tf.nest`` order."""
    return [(tuple(t.shape), str(t.dtype)) for t in tf.nest.flatten(template)]


def _host(tensor) -> np.ndarray:
    """The tensor's bytes in host memory (on the CPU, ``numpy()`` shares them without a copy)."""
    return tensor.numpy() if hasattr(tensor, "numpy") else np.asarray(tensor)
