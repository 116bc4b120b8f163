"""Internal: what crosses between a stage and the others — activations, their gradients, targets.

Every point-to-point message of the pipeline goes through here, on the
pipeline's communicator (rank = stage). Each crossing of the cut
(:class:`keras_pipe.graph.cut.Crossing`) is sent straight from the stage that
computes the tensor to each stage that reads it: a skip edge over three
stages, or a model input every block reads, costs one message per reader
and nothing on the stages between (relaying it would cost each of them a
receive, a send and the wait in between; see ``benchmarks/crossings.py``).
MPI keeps the messages of one (source, tag) pair in order, so a stage sends
its crossings to each destination in tensor order and the destination
receives them from each source in the same order.

Tensors travel as raw buffers of a dtype the receiver knows from the graph.
Where every dimension but the batch is fixed, only the number of rows is
read from the message, and checked against the micro-batch the receiver
expects; a tensor with a dimension that varies from batch to batch (a text
batch padded to its own length) is preceded by a small header with its
shape. A Keras mask follows its tensor, one byte per entry.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_pipe.errors import RankMismatchError
from keras_pipe.mpi.comm import TAG_ACTIVATION, TAG_GRADIENT, TAG_PROBE, TAG_TARGETS, Communicator
from keras_pipe.stage.compute import Masked

# The dtypes a probe's tensor may have, by their index in its header.
PROBE_DTYPES = (
    "float32", "float64", "float16", "bfloat16", "bool", "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64", "complex64", "complex128",
)  # fmt: skip


class Links:
    """A stage's messages to and from the other stages.

    Args:
        comm: the pipeline's communicator (rank = stage).
        stage: this rank's :class:`~keras_pipe.graph.cut.Stage`.
        tensors: the graph's tensors (shapes and dtypes of what crosses).
        masks: for each tensor, the shape of the Keras mask that rides with it, or ``None``.
    """

    def __init__(self, comm: Communicator, stage, tensors, masks: dict | None = None):
        self.comm = comm
        self.stage = stage
        self.tensors = tensors
        self.num_stages = comm.size
        self.gradient_receives = [c for c in stage.receives if c.gradient]
        self.gradient_sends = [c for c in stage.sends if c.gradient]
        # (several chunks a rank: a stage on this rank too takes the tensor from a mailbox, engine.chunks)
        self._is_local = getattr(comm, "is_local", lambda stage: False)
        self.set_masks(masks or {})

    def set_masks(self, masks: dict) -> None:
        """The mask shape riding with each crossing tensor (measured on real tensors when the pipeline was built)."""
        self.masks = {t: masks.get(t) for t in range(len(self.tensors))}

    # -- activations ----------------------------------------------------

    def send_activations(self, outputs) -> None:
        """Sends each crossing the stage computes to each stage that reads it (``outputs`` in the stage's order)."""
        for crossing, value in zip(self.stage.sends, outputs):
            tensor, mask = (value.tensor, value.mask) if isinstance(value, Masked) else (value, None)
            spec = self.tensors[crossing.tensor]
            for destination in crossing.destinations:
                self._send(tensor, destination, TAG_ACTIVATION, spec.dynamic)
                if mask is not None:
                    self._send(_host(mask).view(np.uint8), destination, TAG_ACTIVATION, spec.dynamic)

    def receive_activations(self, rows: int) -> list:
        """The crossings this stage reads, in the order of ``stage.receives``; ``Masked`` where a mask rides."""
        received = []
        for crossing in self.stage.receives:
            spec = self.tensors[crossing.tensor]
            tensor = self._receive(crossing.source, TAG_ACTIVATION, spec.shape, spec.dtype, rows, spec.dynamic)
            mask_shape = self.masks.get(crossing.tensor)
            if mask_shape is None:
                received.append(tensor)
                continue
            mask = self._receive(crossing.source, TAG_ACTIVATION, mask_shape, "uint8", rows, spec.dynamic)
            received.append(Masked(tensor, tf.cast(mask, tf.bool)))
        return received

    # -- gradients --------------------------------------------------------

    def send_gradients(self, grads) -> None:
        """Sends the gradient of each floating-point tensor this stage read back to the stage that computed it."""
        for crossing, grad in zip(self.gradient_receives, grads):
            self._send(grad, crossing.source, TAG_GRADIENT, self.tensors[crossing.tensor].dynamic)

    def receive_gradients(self, rows: int) -> list:
        """The gradient of each floating-point tensor this stage sent, summed over the stages that read it."""
        summed = []
        for crossing in self.gradient_sends:
            spec = self.tensors[crossing.tensor]
            total = None
            for destination in crossing.destinations:  # summed in stage order, on every run alike
                grad = self._receive(destination, TAG_GRADIENT, spec.shape, spec.dtype, rows, spec.dynamic)
                total = grad if total is None else total + grad
            summed.append(total)
        return summed

    def progress(self) -> None:
        """Lets MPI move pending sends along."""
        self.comm.progress()

    # -- targets --------------------------------------------------------

    def send_targets(self, arrays: list) -> None:
        """First stage: each array of the labels and sample weights, straight to the last stage."""
        for array in arrays:
            self.comm.send(np.asarray(array), self.num_stages - 1, TAG_TARGETS)

    def receive_targets(self, likes: list, batch_size: int) -> list:
        """Last stage: the labels and sample weights the first stage paired with its inputs (shaped as ``likes``)."""
        received = []
        for like in likes:
            like = np.asarray(like)
            array = self.comm.recv(0, TAG_TARGETS, like.shape[1:], like.dtype)
            if array.shape[0] != batch_size:
                raise RankMismatchError(
                    f"rank {self.comm.world_rank} has a batch of {batch_size} samples but rank "
                    f"{self.comm.world_rank_of(0)} sent targets for {array.shape[0]}: the ranks were given "
                    "different data. Give every rank the same data sizes and batch_size."
                )
            received.append(array)
        return received

    # -- the probe: messages that describe themselves ------------------------

    def send_described(self, value, destination: int) -> None:
        """A probe's tensor with its whole shape and its mask's, whatever the graph says (see :mod:`probe`)."""
        tensor, mask = (value.tensor, value.mask) if isinstance(value, Masked) else (value, None)
        tensor = _host(tensor)
        header = [tensor.ndim, *tensor.shape, PROBE_DTYPES.index(str(tensor.dtype)), int(mask is not None)]
        if mask is not None:
            mask = _host(mask).view(np.uint8)
            header += [mask.ndim, *mask.shape]
        self.comm.send(np.asarray(header, np.int64), destination, TAG_PROBE)
        self.comm.send(tensor, destination, TAG_PROBE)
        if mask is not None:
            self.comm.send(mask, destination, TAG_PROBE)

    def receive_described(self, source: int):
        """The tensor :meth:`send_described` sent, in the dtype it had there (the graph's may differ: checked later)."""
        header = [int(h) for h in self.comm.recv(source, TAG_PROBE, (), np.int64)]
        ndim = header[0]
        shape, sent, rest = header[1 : 1 + ndim], PROBE_DTYPES[header[1 + ndim]], header[2 + ndim :]
        tensor = self.comm.recv_exact(source, TAG_PROBE, tuple(shape), tf.as_dtype(sent).as_numpy_dtype)
        if not rest[0]:
            return tf.convert_to_tensor(tensor)
        mask_shape = tuple(rest[2 : 2 + rest[1]])
        mask = self.comm.recv_exact(source, TAG_PROBE, mask_shape, np.uint8)
        return Masked(tf.convert_to_tensor(tensor), tf.convert_to_tensor(mask.astype(bool)))

    # -- raw messages --------------------------------------------------------

    def _send(self, tensor, destination: int, tag: int, dynamic: bool) -> None:
        if self._is_local(destination):
            self.comm.hand_over(tensor, destination, tag)
            return
        array = _host(tensor)
        if dynamic:
            self.comm.send(np.asarray(array.shape, np.int64), destination, tag)
        self.comm.send(array, destination, tag)

    def _receive(self, source: int, tag: int, shape, dtype, rows: int, dynamic: bool):
        if self._is_local(source):
            return self._take(source, tag, shape, dtype, rows)
        if dynamic:
            header = self.comm.recv_exact(source, tag, (len(shape),), np.int64)
            trailing = tuple(int(d) for d in header[1:])
            _check_shape(self.comm, source, shape, header)
        else:
            trailing = tuple(shape[1:])
        array = self.comm.recv(source, tag, trailing, tf.as_dtype(dtype).as_numpy_dtype)
        if array.shape[0] != rows:
            raise RankMismatchError(
                f"rank {self.comm.world_rank} expected a micro-batch of {rows} samples from rank "
                f"{self.comm.world_rank_of(source)} but got {array.shape[0]}: the ranks were given batches of "
                "different sizes. Give every rank the same data sizes and batch_size."
            )
        return _tensor(array)

    def _take(self, source: int, tag: int, shape, dtype, rows: int):
        """A tensor a chunk of this rank handed over, checked as a message is: its rows, shape and dtype."""
        tensor = tf.convert_to_tensor(self.comm.take(source, tag))
        if tensor.shape[0] != rows:
            raise RankMismatchError(
                f"rank {self.comm.world_rank} expected a micro-batch of {rows} samples from virtual stage {source} "
                f"(on the same rank) but got {tensor.shape[0]}"
            )
        _check_shape(self.comm, source, shape, tensor.shape)
        if tensor.dtype != tf.as_dtype(dtype):
            raise RankMismatchError(
                f"rank {self.comm.world_rank} expected {tf.as_dtype(dtype).name} from virtual stage {source} (on the "
                f"same rank) but got {tensor.dtype.name}: the model's graph and its tensors disagree."
            )
        return tensor


def _check_shape(comm, source, shape, header) -> None:
    """A header's shape must fit the graph's (``None`` where a dimension varies)."""
    if len(header) != len(shape) or any(d is not None and int(h) != d for d, h in zip(shape[1:], header[1:])):
        raise RankMismatchError(
            f"rank {comm.world_rank} expected a tensor of shape {tuple(shape)} from rank {comm.world_rank_of(source)} "
            f"but got {tuple(int(h) for h in header)}: the ranks disagree on the model."
        )


# dtypes TensorFlow takes over DLPack (numpy's bfloat16 and bool are not among them)
_WRAPPED = frozenset(["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8"])


def _tensor(array: np.ndarray):
    """A received array as a tensor: over the same buffer (DLPack) where TensorFlow can wrap it, else copied.

    ``Communicator.recv`` allocates on a 64-byte boundary, which TensorFlow
    needs to wrap a buffer; ``tf.convert_to_tensor`` copies every time
    (2.3 ms for a 2048 x 1024 micro-batch of float32, 75 us for 64 x 1024,
    against 1-9 us wrapped), and holds both for a moment.
    """
    if array.size and array.dtype.name in _WRAPPED and array.ctypes.data % 64 == 0 and array.flags.c_contiguous:
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return tf.convert_to_tensor(array)


def _host(tensor) -> np.ndarray:
    """The tensor's bytes in host memory (on the CPU, ``numpy()`` shares them without a copy)."""
    return tensor.numpy() if hasattr(tensor, "numpy") else np.asarray(tensor)
