"""The executor replays a schedule against a fake compute and fake links: the order of calls, no MPI."""

import numpy as np
import pytest

from keras_pipe.engine.batch import Batch
from keras_pipe.engine.executor import Executor
from keras_pipe.engine.step_end import clip_scale, whole_model_scale
from keras_pipe.schedules import FORWARD_LOSS, forward_only, gpipe, lower, make_schedule


class FakeGradients:
    empty = True

    def result(self):
        return ["g"]


class FakeCompute:
    def __init__(self, log, split):
        self.log = log
        self.split = split
        self.trainable_variables = [object()]  # (a weight of its own: two fakes share none)
        self.has_weight_regularizers = False
        self.gradients = FakeGradients()

    def recomputes(self, i, num_microbatches):
        return False

    def begin_step(self):
        pass

    def end_step(self):
        pass

    def forward(self, i, inputs, training, recompute=False):
        self.log.append(f"F{i}")
        return [np.zeros(1)], 0.0

    def forward_backward(self, i, loss, inputs, y, sample_weight, coefficients):
        self.log.append(f"{'FI' if self.split else 'FB'}{i}")
        return 0.5, np.zeros(1), [np.zeros(1)], [np.zeros(1)]

    def backward(self, i, grads, scale):
        self.log.append(f"{'I' if self.split else 'B'}{i}")
        return [np.zeros(1)]

    def weights(self, microbatches, scale, regularize, optimizer, loss_scale=1.0, counts=True):
        update = ("+update" + ("" if counts else " uncounted")) if optimizer else ""
        self.log.append(f"W{'-'.join(map(str, microbatches))}" + update)

    def apply(self, optimizer, grads=None, scale=None):
        self.log.append("update")

    def forget_step(self):
        self.log.append("forget")


class FakeLinks:
    def __init__(self, log):
        self.log = log

    def send_activations(self, outputs):
        self.log.append("send activation")

    def receive_activations(self, rows):
        self.log.append("receive activation")
        return [np.zeros((rows, 1))]

    def send_gradients(self, grads):
        self.log.append("send gradient")

    def receive_gradients(self, rows):
        self.log.append("receive gradient")
        return [np.zeros((rows, 1))]

    def progress(self):
        pass


class Status:
    doing = ""
    in_step = False


class OneTerm:
    """A loss of one term (what the executor reads of a MicrobatchLoss)."""

    size = 1


def replay(schedule_name, stage, num_stages, m, split):
    log = []
    actions = lower(make_schedule(schedule_name, num_stages, m, split))[stage]
    executor = Executor(
        FakeCompute(log, split),
        FakeLinks(log),
        None,
        is_first=stage == 0,
        is_last=stage == num_stages - 1,
        status=Status(),
        where=f"stage {stage}",
    )
    executor.run(actions, training_batch(m))
    return log


def training_batch(m: int, optimizer="adam") -> Batch:
    """A training batch of ``m`` micro-batches of 4 rows, one loss term."""
    return Batch(
        phase="train",
        batch_size=4 * m,
        bounds=[(4 * i, 4 * i + 4) for i in range(m)],
        x=[np.zeros((4 * m, 1))],
        y=np.zeros(4 * m),
        loss=OneTerm(),
        shares=np.full((m, 1), 1.0 / m),
        term_weights=np.ones(1),
        optimizer=optimizer,
    )


def test_one_f_one_b_first_stage():
    assert replay("1f1b", 0, 2, 3, split=False) == [
        "F0", "send activation",
        "F1", "send activation",
        "receive gradient", "B0",
        "F2", "send activation",
        "receive gradient", "B1",
        "receive gradient", "B2",
        "update",
    ]  # fmt: skip


def test_one_f_one_b_last_stage_fuses_forward_and_backward():
    assert replay("1f1b", 1, 2, 2, split=False) == [
        "receive activation", "FB0", "send gradient",
        "receive activation", "FB1", "send gradient",
        "update",
    ]  # fmt: skip


def test_gpipe_middle_stage_runs_every_forward_first():
    assert replay("gpipe", 1, 3, 2, split=False) == [
        "receive activation", "F0", "send activation",
        "receive activation", "F1", "send activation",
        "receive gradient", "B0", "send gradient",
        "receive gradient", "B1", "send gradient",
        "update",
    ]  # fmt: skip


def test_split_backward_ends_with_one_weight_pass_that_updates():
    assert replay("1f1b", 0, 2, 2, split=True) == [
        "F0", "send activation",
        "F1", "send activation",
        "receive gradient", "I0",
        "receive gradient", "I1",
        "W0-1+update",
    ]  # fmt: skip


def test_zero_bubble_places_weight_passes_where_the_stage_would_wait():
    # (the last stage holds its first W back, its I going upstream sooner: then one W for both)
    log = replay("zb-h1", 1, 2, 2, split=True)
    assert log == [
        "receive activation",
        "FI0",
        "send gradient",
        "receive activation",
        "FI1",
        "send gradient",
        "W0-1+update",
    ]


def test_a_failing_action_leaves_nothing_behind():
    class Failing(FakeCompute):
        def backward(self, i, grad, scale):
            raise RuntimeError("boom")

    log = []
    executor = Executor(
        Failing(log, False), FakeLinks(log), None, is_first=True, is_last=False, status=Status(), where="stage 0"
    )
    batch = Batch(phase="train", batch_size=4, bounds=[(0, 4)], x=[np.zeros((4, 1))], optimizer="adam")
    with pytest.raises(RuntimeError, match="boom"):
        executor.run(lower(make_schedule("1f1b", 2, 1))[0], batch)
    assert log[-1] == "forget"
    assert executor.step == 1


def test_a_masked_mean_loss_is_seeded_once_the_whole_batch_is_counted():
    # Micro-batches of 2 and 6 unmasked entries, losses 1.0 and 0.5 per entry:
    # the batch's loss is (2 * 1.0 + 6 * 0.5) / 8, and each micro-batch's summed
    # loss is seeded with 1/8, not weighted by its rows.
    class Counting(FakeCompute):
        def forward_head(self, i, loss, inputs, y, sample_weight, training, recompute=False):
            self.log.append(f"F{i}")
            divisor = [2.0, 6.0][i]
            return np.array([[1.0, 0.5][i] * divisor]), np.array([divisor]), [np.zeros(1)], 0.0

        def backward(self, i, grads, scale):
            self.log.append(f"B{i} seed {float(np.asarray(grads[0])[0])}")
            return [np.zeros(1)]

    log = []
    executor = Executor(
        Counting(log, False), FakeLinks(log), None, is_first=False, is_last=True, status=Status(), where="stage 1"
    )
    batch = Batch(
        phase="train",
        batch_size=8,
        bounds=[(0, 4), (4, 8)],
        x=[np.zeros((8, 1))],
        y=np.zeros(8),
        loss=OneTerm(),
        shares=np.full((2, 1), 0.5),
        term_weights=np.ones(1),
        optimizer="adam",
        whole_batch_loss=True,
    )
    result = executor.run(lower(gpipe(2, 2, whole_batch_loss=True))[1], batch)
    assert log == [
        "receive activation", "F0", "receive activation", "F1",
        "B0 seed 0.125", "send gradient", "B1 seed 0.125", "send gradient",
        "update",
    ]  # fmt: skip
    assert result.loss_part == pytest.approx(5.0 / 8)


def test_evaluation_computes_the_loss_in_the_last_stages_own_forward():
    class Evaluating(FakeCompute):
        def forward_loss(self, loss, inputs, y, sample_weight, coefficients):
            self.log.append(f"FL rows {len(y)}")
            return 0.25, np.ones(1), [np.zeros(1)]

    log = []
    executor = Executor(
        Evaluating(log, False), FakeLinks(log), None, is_first=False, is_last=True, status=Status(), where="stage 1"
    )
    batch = training_batch(2)
    batch.phase = "test"
    result = executor.run(lower(forward_only(2, 2, FORWARD_LOSS))[1], batch)
    assert log == ["receive activation", "FL rows 4", "receive activation", "FL rows 4"]
    assert result.loss_part == 0.5 and list(result.terms) == [1.0]  # (each micro-batch's terms at its share)


def test_the_whole_models_gradient_scale():
    assert clip_scale(16.0, 2.0) == 0.5  # norm 4 clipped to 2
    assert clip_scale(1.0, 2.0) == 1.0
    assert str(whole_model_scale(None, float("inf"), 1.0)) == "nan"  # a non-finite stage: every stage skips


def test_examples():
    import doctest

    from keras_pipe.engine import step_end

    assert doctest.testmod(step_end).failed == 0
