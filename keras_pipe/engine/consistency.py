"""Cross-rank agreement: one model, one configuration, one sequence of steps.

Every rank runs the same script, but nothing forces the ranks to build the
same layers, pass the same ``fit()`` arguments or read data of the same
size. A disagreement would otherwise show up as a hang (one rank waits for a
message that never comes) or, worse, as silently wrong training. Each rank
therefore shares a fingerprint of its configuration when ``fit``,
``evaluate`` or ``predict`` starts (the model's, made by
:mod:`keras_pipe.model.fingerprint`), and a small header before every step;
any difference is an error on every rank naming the ranks and the field.
"""

from __future__ import annotations

import hashlib

import numpy as np

from keras_pipe.errors import PipelineDataError, RankMismatchError
from keras_pipe.mpi.comm import Communicator

PHASES = {"train": 1, "test": 2, "predict": 3, "end": 4}
_PHASE_NAMES = {code: name for name, code in PHASES.items()}
FOLLOWS = -1  # a step header's state: this rank does not read the call's data, the readers' batch is its own
FAILED = 2  # a step header's state: reading the batch raised


class StepAgreement:
    """Before every step, the ranks compare (phase, call, step, has data, batch size).

    One small all-gather per step: a rank whose data ran out, or that moved
    on to another call, is found at once instead of leaving its neighbours
    waiting. With replicas, the ranks that read inputs (``data_ranks``, the
    first stages) also compare a digest of their batch: replicas train on
    shares of one global batch, so they must all have read the same one.
    """

    def __init__(self, comm: Communicator, data_ranks: list[int] | None = None):
        self.comm = comm
        self.call = 0
        self.step = 0
        self.data_ranks = list(data_ranks or [])
        self.key = 0  # the digest of the batch description the followers hold
        self.description = None
        self.shares = None  # the latest step's rows of each replica, where each read its own (else None)

    def begin_call(self) -> None:
        self.call += 1
        self.step = 0

    def agree(self, phase: str, has_data: bool, batch_size: int, digest: int = 0) -> None:
        """Every rank has a batch of ``batch_size`` (or none): the step's header, compared on every rank."""
        self.draw(phase, int(has_data), batch_size, digest)

    def draw(
        self,
        phase: str,
        state: int,
        batch_size: int = 0,
        digest: int = 0,
        description=None,
        key: int = 0,
        error: str | None = None,
        joined: bool = False,
    ) -> tuple[bool, int, object]:
        """One step's header on every rank; returns the readers' ``(has data, batch size, description)``.

        ``state``: ``1`` (a batch), ``0`` (no more data), :data:`FOLLOWS` (this
        rank does not read this call's data: the readers' batch is its own) or
        :data:`FAILED` (reading raised; ``error`` says what). A reader gives
        ``description`` (JSON: its batch's structure, dtypes and shapes, what a
        follower builds its stand-in from) and ``key``, a digest of it: the
        description travels only when a follower has not seen it yet. A read
        that failed on any rank is a :class:`PipelineDataError` on every rank.

        ``joined``: each replica's first stage read its own share of the step
        (``distribute_datasets_from_function``): the batch size returned is
        the global batch's, the shares' sum, and ``shares`` holds each
        replica's rows (replica 0's may not be empty where another's is not).
        """
        header = np.array([PHASES[phase], self.call, self.step, state, batch_size, digest, key, int(joined)], np.int64)
        self.comm.doing = f"{phase} step {self.step}: checking that every rank has a batch"
        everyone = self.comm.allgather_array(header)
        self.step += 1
        readers = [rank for rank in range(len(everyone)) if everyone[rank, 3] != FOLLOWS]
        failed = [rank for rank in readers if everyone[rank, 3] == FAILED]
        if failed:
            text = self.comm.bcast_json(error if self.comm.rank == failed[0] else None, root=failed[0])
            raise PipelineDataError(
                f"rank {self.comm.world_rank_of(failed[0])}, which reads the data, could not read its batch for "
                f"{_PHASE_NAMES[int(header[0])]} step {self.step - 1}: {text}"
            )
        same_step = (everyone[:, :3] == everyone[0, :3]).all()
        if not same_step or not (everyone[readers, 7] == everyone[readers[0], 7]).all():
            self._out_of_step(everyone)
        self.shares = None
        if everyone[readers[0], 7]:
            return self._joined(everyone, description)
        if not (everyone[readers, 3:5] == everyone[readers[0], 3:5]).all():
            self._out_of_step(everyone)
        self._compare_digests(everyone, header)
        root = readers[0]
        if len(readers) < len(everyone) and everyone[root, 6] != self.key:
            self.description = self.comm.bcast_json(description if self.comm.rank == root else None, root=root)
            self.key = int(everyone[root, 6])
        return bool(everyone[root, 3]), int(everyone[root, 4]), self.description

    def _joined(self, everyone, description) -> tuple[bool, int, object]:
        """A step whose replicas each read their own share: the global batch's size, checked against the shares."""
        readers = self.data_ranks
        sizes = [int(everyone[rank, 4]) for rank in readers]
        total = sum(sizes)
        step = f"{_PHASE_NAMES[int(everyone[0, 0])]} step {self.step - 1}"
        if total == 0:
            return False, 0, self.description
        if sizes[0] == 0:
            raise RankMismatchError(
                f"at {step} replica 0's data had ended while replicas {[r for r, n in enumerate(sizes) if n]} "
                f"still read batches (of {sizes} rows; ranks {readers}): a replica's data may end before the "
                "first replica's, not after it. Give every replica as many batches (tf.data's "
                "shard(input_context.num_input_pipelines, input_context.input_pipeline_id) leaves the extra ones "
                "on the first replicas)."
            )
        self.shares = tuple(sizes)
        root = readers[0]
        keys = {int(everyone[rank, 6]) for rank in readers if everyone[rank, 4] > 0}
        if len(keys) > 1:
            raise RankMismatchError(
                f"the replicas' batches at {step} differ in structure, dtype or shape (ranks {readers}): every "
                "replica's dataset function must make batches of the same kind."
            )
        if everyone[root, 6] != self.key:  # (followers, and a replica whose share is empty, build stand-ins)
            self.description = self.comm.bcast_json(description if self.comm.rank == root else None, root=root)
            self.key = int(everyone[root, 6])
        return True, total, self.description

    def _compare_digests(self, everyone, header) -> None:
        digests = {int(everyone[rank, 5]) for rank in self.data_ranks}
        if len(digests) <= 1:
            return
        raise (
            RankMismatchError(
                f"the replicas read different batches at {_PHASE_NAMES[int(header[0])]} step {self.step - 1} "
                f"(batch digests of the first stages, ranks {self.data_ranks}: "
                f"{[format(int(everyone[r, 5]) & 0xFFFFFFFF, '08x') for r in self.data_ranks]}). Each replica "
                "trains on its share of one global batch, so every rank must read the same batches in the "
                "same order: give every rank the same data, and shuffle alike (fit() seeds TensorFlow's "
                "shuffling on every rank when no global seed is set; a tf.data pipeline or generator must "
                "use a fixed seed), or pass shuffle=False."
            )
        )

    def _out_of_step(self, everyone) -> None:
        rows = []
        for rank, (code, call, step, data, size, *_) in enumerate(everyone.tolist()):
            state = f"{_PHASE_NAMES.get(code, code)}, call {call}, step {step}, " + (
                "following the first stage's batch"
                if data == FOLLOWS
                else (f"batch of {size}" if data else "no more data")
            )
            rows.append(f"  rank {rank}: {state}")
        raise (
            RankMismatchError(
                "the ranks are out of step:\n" + "\n".join(rows) + "\nThe ranks' data must give the same number "
                "of batches of the same sizes (same data size, batch_size and steps), and every rank must make "
                "the same fit()/evaluate()/predict() calls."
            )
        )


# fit/evaluate/predict arguments that must agree on every rank (the data's
# size is compared through its length; its order may differ).
COMPARED_ARGUMENTS = (
    "x",
    "y",
    "sample_weight",
    "batch_size",
    "epochs",
    "steps_per_epoch",
    "validation_split",
    "validation_data",
    "validation_steps",
    "validation_batch_size",
    "validation_freq",
    "initial_epoch",
    "steps",
    "class_weight",
)


def batch_digest(data) -> int:
    """An order-sensitive digest of a batch's inputs and targets, as an int64."""
    digest = hashlib.blake2b(digest_size=8)
    for item in _flatten(data):
        array = np.ascontiguousarray(item.numpy() if hasattr(item, "numpy") else np.asarray(item))
        digest.update(str((array.shape, array.dtype.str)).encode())
        digest.update(array.reshape(-1).view(np.uint8))
    return int(np.frombuffer(digest.digest(), np.int64)[0])


def _flatten(data):
    if data is None:
        return []
    if isinstance(data, (list, tuple)):
        return [leaf for item in data for leaf in _flatten(item)]
    if isinstance(data, dict):
        return [leaf for key in sorted(data) for leaf in _flatten(data[key])]
    return [data]


def describe_argument(value):
    """A JSON-friendly summary: sizes of arrays, plain values as they are."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [describe_argument(v) for v in value]
    if isinstance(value, dict):
        return {str(k): describe_argument(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    described = getattr(value, "keras_pipe_described", None)  # (a follower: the kind of data it stands for)
    if described is not None:
        return described
    shape = getattr(value, "shape", None)
    if shape is not None:
        return {"shape": [None if d is None else int(d) for d in shape]}
    return type(value).__name__  # a dataset or generator: its batches are checked step by step
