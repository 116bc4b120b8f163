"""Internal: what crosses between a stage and its neighbours — activations, their gradients, targets.

Every point-to-point message of the pipeline goes through here, on the
pipeline's communicator (rank = stage). Tensors travel as raw buffers of a
shape and dtype the receiver knows from the layer specs; only the number of
rows is read from the message, and checked against the micro-batch the
receiver expects, so ranks given different data stop with an error instead
of training on the wrong rows.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_pipe.comm import TAG_ACTIVATION, TAG_GRADIENT, TAG_TARGETS, Communicator
from keras_pipe.errors import RankMismatchError


class Links:
    """A stage's messages to and from its neighbours.

    Args:
        comm: the pipeline's communicator (rank = stage).
        input_spec, output_spec: ``(shape, dtype)`` of the stage's input and output.
    """

    def __init__(self, comm: Communicator, input_spec, output_spec, input_mask=None):
        self.comm = comm
        self.stage = comm.rank
        self.num_stages = comm.size
        self.input_spec = input_spec
        self.output_spec = output_spec
        self.input_mask = input_mask  # shape of the Keras mask the input carries, or None

    def send_activation(self, y) -> None:
        """Sends the stage's output; ``(output, mask)`` sends the Keras mask after it (one byte per entry)."""
        y, mask = y if isinstance(y, tuple) else (y, None)
        self.comm.send(_host(y), self.stage + 1, TAG_ACTIVATION)
        if mask is not None:
            self.comm.send(_host(mask).view(np.uint8), self.stage + 1, TAG_ACTIVATION)

    def receive_activation(self, rows: int):
        """The previous stage's output; ``(output, mask)`` where a Keras mask rides with it."""
        x = self._receive(self.stage - 1, TAG_ACTIVATION, self.input_spec, rows)
        if self.input_mask is None:
            return x
        mask = self._receive(self.stage - 1, TAG_ACTIVATION, (self.input_mask, "uint8"), rows)
        return x, tf.cast(mask, tf.bool)

    def send_gradient(self, grad) -> None:
        self.comm.send(_host(grad), self.stage - 1, TAG_GRADIENT)

    def receive_gradient(self, rows: int):
        return self._receive(self.stage + 1, TAG_GRADIENT, self.output_spec, rows)

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


def _host(tensor) -> np.ndarray:
    """The tensor's bytes in host memory (on the CPU, ``numpy()`` shares them without a copy)."""
    return tensor.numpy() if hasattr(tensor, "numpy") else np.asarray(tensor)
