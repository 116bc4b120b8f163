"""Internal: the end of a stage's step — batched weight gradients, weight regularization, the update.

:class:`StageUpdate` works on a stage's step's gradients rather than on
micro-batches (:class:`~keras_pipe.stage.compute.StageCompute` holds one, made
again whenever what trains changes): the batched ``W`` of a split backward
(one pass over many micro-batches, fused with the optimizer update when
nothing else must be known first), the weight regularizers' loss and
gradients (counted once per batch, as Keras does), this stage's share of the
whole model's gradient norm, and the update itself. Everything it reads is
given to its constructor.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from keras_pipe import compat
from keras_pipe.stage import replay
from keras_pipe.stage.gradients import watch_weights


class StageUpdate:
    """The gradient-level work of one stage: ``W`` over many micro-batches, regularization, norms, the update.

    Args:
        variables: the weights that train (``compat.trained_weights``), in order.
        steps: the replayed steps of a split backward (``[]``: recorded); ``W`` replays those that read a weight.
        regularized_layers: the layers whose weight regularizers this stage counts.
        gradients: the step's :class:`~keras_pipe.stage.gradients.GradientSum` of ``variables``.
        program: ``(key, function, random=False) -> program``, the stage's compiled programs.
        weight_bytes: the bytes of ``variables`` (whether the last ``W`` is cut into groups).
    """

    def __init__(self, variables: list, steps: list, regularized_layers: list, gradients, program, weight_bytes: int):
        self.variables = variables
        self.steps = steps
        self.regularized_layers = regularized_layers
        self.gradients = gradients
        self._program = program
        self.weight_bytes = weight_bytes
        self._weighted = [k for k, step in enumerate(steps) if step.variables]
        self._groups: dict = {}  # optimizer id -> (optimizer, how its update is cut: _update_groups)
        self._updates: dict = {}  # a W-and-update program's key -> the program (its closure made once)

    def weights(
        self,
        parts: list,
        activity_scale: float,
        regularize: bool,
        optimizer=None,
        loss_scale: float = 1.0,
        counts: bool = True,
    ) -> None:
        """``W`` of micro-batches: adds their weight gradients (and, if ``regularize``, the weight regularizers').

        ``parts``: each micro-batch's (inputs, output gradients) of every
        weighted step (:meth:`~keras_pipe.stage.backward.StageBackward.take_held`).

        With an ``optimizer`` (the step's last ``W`` and no replica or other
        stage to wait for) the gradients go straight into its update, in the
        same program (one a group of weights on a large stage:
        :meth:`_update_groups`). ``counts``: whether this update counts the
        step in ``optimizer.iterations`` (of a rank's several chunks, each
        updating its own weights, one does).
        """
        if not self.variables:
            return
        # per weighted step, its inputs and output gradients over the micro-batches
        count = len(self._weighted)
        inputs = [[p[k][0] for p in parts] if parts[0][k] is not None else None for k in range(count)]
        grads = [[p[k][1] for p in parts] if parts[0][k] is not None else None for k in range(count)]
        scales = (tf.constant(activity_scale, tf.float32), tf.constant(loss_scale, tf.float32))
        if optimizer is not None and self.gradients.empty:
            groups = self._update_groups(optimizer)
            for number, (positions, indices) in enumerate(groups):
                counted = counts and number == len(groups) - 1
                self._weights_update(optimizer, regularize, counted, positions, indices, number)(
                    [inputs[p] for p in positions], [grads[p] for p in positions], *scales
                )
            return
        weight_grads = self._weight_grads(range(count), range(len(self.variables)), regularize)
        result = self._program(("weights", regularize), weight_grads)(inputs, grads, *scales)
        self.gradients.add(result)
        if optimizer is not None:
            self.apply(optimizer)
            if not counts:
                optimizer.iterations.assign_sub(1)

    def _weight_grads(self, positions, indices, regularize: bool):
        """The traced ``W`` of the weighted steps at ``positions``: the gradients of the variables at ``indices``."""
        variables = [self.variables[i] for i in indices]
        weighted = [self._weighted[p] for p in positions]
        whole = len(variables) == len(self.variables)
        regularized = self.regularized_layers if whole else _owning(self.regularized_layers, variables)

        def weight_grads(inputs, grads, activity_scale, loss_scale):
            full_in, full_g = [None] * len(self.steps), [None] * len(self.steps)
            for position, k in enumerate(weighted):
                full_in[k], full_g[k] = inputs[position], grads[position]
            result = replay.weight_gradients(self.steps, full_in, full_g, activity_scale, variables)
            if regularize:
                regularizers = self._regularization_gradients(variables, regularized)
                result = [
                    g if v.regularizer is None else _plus(g, r * tf.cast(loss_scale, r.dtype))
                    for g, r, v in zip(result, regularizers, variables)
                ]
            return result

        return weight_grads

    def _weights_update(self, optimizer, regularize: bool, counted: bool, positions, indices, number: int):
        """The program of ``W`` and the update of group ``number`` of the stage's weights (see :meth:`_update_groups`).

        ``counted``: whether the update leaves ``optimizer.iterations`` one
        step on (else it takes back what ``apply`` added: one step, several
        updates).
        """
        key = ("weights_update", id(optimizer), regularize, number, counted)
        if key in self._updates:  # (every step: the group's variables and layers are looked up once)
            return self._updates[key]
        variables = [self.variables[i] for i in indices]
        weight_grads = self._weight_grads(positions, indices, regularize)

        def weights_and_update(inputs, grads, activity_scale, loss_scale):
            result = weight_grads(inputs, grads, activity_scale, loss_scale)
            if all(g is None for g in result):  # (Keras' optimizer raises where no weight got a gradient)
                if counted:
                    optimizer.iterations.assign_add(1)
                return
            optimizer.apply(result, variables)
            if not counted:
                optimizer.iterations.assign_sub(1)

        self._updates[key] = self._program(key, weights_and_update)
        return self._updates[key]

    def forget_optimizer(self, optimizer) -> None:
        """Forgets how ``optimizer``'s update is cut and its programs (the stage's ``forget_optimizer``)."""
        self._groups.pop(id(optimizer), None)
        self._updates = {key: program for key, program in self._updates.items() if key[1] != id(optimizer)}

    def _update_groups(self, optimizer) -> list[tuple[list[int], list[int]]]:
        """How the step's last ``W`` and the update are cut into programs: (weighted steps, variables) per program.

        One program creates every weight gradient of the stage before the
        optimizer frees any, where Keras' own step frees each as it applies
        it: on a stage whose weights take most of the memory that is a
        weights' worth more (0.75 GiB on 12 x Dense(4096)). Where the
        optimizer updates each variable from its own gradient alone
        (:func:`separable`), the stage's weighted steps are cut, in order, into
        groups of at least :data:`GROUP_BYTES` of weights (steps sharing a
        weight stay together), each one program that takes its gradients and
        updates its weights; ``iterations`` is counted once. Smaller stages,
        and other optimizers, keep the one program.
        """
        key = id(optimizer)  # (the entry holds the optimizer: its id cannot be another's while it is there)
        if key not in self._groups:
            cut = separable(optimizer) and self.weight_bytes >= 2 * GROUP_BYTES
            groups = _grouped(self._weighted, self.steps, self.variables) if cut else None
            whole = (list(range(len(self._weighted))), list(range(len(self.variables))))
            self._groups[key] = optimizer, groups or [whole]
        return self._groups[key][1]

    def add_regularization(self, loss_scale: float = 1.0) -> tf.Tensor:
        """Adds the weight regularizers' gradients (recorded backward), times ``loss_scale``; returns their loss."""

        def regularization(loss_scale):
            with tf.GradientTape() as tape:
                watch_weights(tape, self.variables)
                loss = self._regularization_loss()
                scaled = loss * loss_scale
            return loss, tape.gradient(scaled, self.variables)

        loss, grads = self._program("regularization_gradients", regularization)(tf.constant(loss_scale, tf.float32))
        self.gradients.add(list(grads))  # (None for a weight without a regularizer: it adds nothing)
        return loss

    def regularization_loss(self) -> tf.Tensor:
        """The loss of this stage's weight regularizers (counted once per batch, as Keras does)."""
        return self._program("regularization", self._regularization_loss)()

    def _regularization_loss(self, layers=None):
        loss = tf.constant(0.0, tf.float32)
        for layer in self.regularized_layers if layers is None else layers:
            for term in compat.weight_regularization_losses(layer):
                loss += tf.cast(term, tf.float32)
        return loss

    def _regularization_gradients(self, variables, layers):
        handles = [compat.variable_handle(v) for v in variables]
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(handles)
            loss = self._regularization_loss(layers)
        grads = tape.gradient(loss, handles)
        return [tf.zeros(v.shape, v.dtype) if g is None else g for g, v in zip(grads, variables)]

    def apply(self, optimizer, grads=None, scale: float | None = None) -> None:
        """One optimizer step with ``grads`` (summed over replicas) or this step's summed gradients.

        ``scale``: multiplies every gradient first (the whole model's ``global_clipnorm``).
        """
        if not self.variables:
            return
        grads = list(grads) if grads is not None else self.gradients.result()
        _apply(self._program, "apply", optimizer, self.variables, grads, scale)
        self.gradients.reset()

    def squared_norm(self, grads, counted=None) -> float:
        """This stage's share of the whole model's squared gradient norm, as Keras' ``global_norm`` counts it.

        Mirrors ``keras/src/optimizers/base_optimizer.py``'s ``global_norm``:
        ``sum(square(g))`` per gradient, where a sparse gradient
        (``IndexedSlices``, an ``Embedding``'s) is squared as it is, so a
        token id repeated in the batch counts once per occurrence. In float64,
        so that a large loss scale cannot overflow the sum. ``counted``: for
        each gradient, whether this stage counts it (a weight several stages
        hold is counted by one).
        """
        grads = [g for g, c in zip(grads, counted or [True] * len(grads)) if c and g is not None]
        if not grads:
            return 0.0

        def squares(*grads):
            return tf.add_n([tf.reduce_sum(tf.square(tf.cast(_values(g), tf.float64))) for g in grads])

        return float(self._program("squared_norm", squares)(*grads))


def apply_together(computes: list, optimizer, grads: list, scale: float | None = None, variables=None) -> None:
    """One optimizer step over the weights of several stage computes (a rank's chunks), in one program.

    ``computes``: :class:`~keras_pipe.stage.compute.StageCompute`\\ s (their
    ``trainable_variables``, ``gradients`` and the first one's compiled
    programs). ``grads[k]``: the summed gradients of ``computes[k]``'s
    trainable variables; or, with ``variables`` (each of the computes'
    weights once, where chunks share some), one gradient a variable. One
    ``apply`` counts one step (``iterations``, a loss scale's counter), as
    the unsplit model's does; ``scale`` multiplies every gradient first.
    """
    if variables is None:
        variables = [v for compute in computes for v in compute.trainable_variables]
        grads = [g for part in grads for g in part]
    _apply(computes[0]._program, "apply_chunks", optimizer, variables, list(grads), scale)
    for compute in computes:
        compute.gradients.reset()


def _apply(program, name: str, optimizer, variables: list, grads: list, scale: float | None) -> None:
    """``optimizer.apply(grads, variables)`` as the stage's program ``name`` (``scaled_`` + ``name`` with a scale)."""

    if all(g is None for g in grads):  # no weight here got a gradient: Keras' optimizer raises there
        count_step(optimizer)  # (for the whole model only): this stage's step is counted
        return

    def update(*grads):
        optimizer.apply(list(grads), variables)

    def scaled_update(scale, *grads):
        optimizer.apply([_scaled(g, scale) for g in grads], variables)

    if scale is None:
        program((name, id(optimizer)), update)(*grads)
    else:
        program((f"scaled_{name}", id(optimizer)), scaled_update)(tf.constant(scale, tf.float32), *grads)


GROUP_BYTES = 64 * 2**20
"""The least weight bytes of one ``W``-and-update program where a stage's update is cut into several."""


def separable(optimizer) -> bool:
    """Whether ``optimizer.apply`` updates each variable from its own gradient alone: it may be applied by parts.

    True for Keras' own optimizers but ``Nadam`` (one ``u_product`` a
    step), unless a setting reads every gradient or weight at once
    (``global_clipnorm``, ``use_ema``, ``gradient_accumulation_steps``) or a
    subclass changes how ``apply`` goes (``LossScaleOptimizer``, which checks
    every gradient is finite first; a user's). ``update_step``, per
    variable, may be anything.
    """
    base = keras.optimizers.Optimizer
    methods = ("apply", "_backend_apply_gradients", "_backend_update_step", "_clip_gradients", "_apply_weight_decay")
    if not isinstance(optimizer, base) or any(getattr(type(optimizer), m) is not getattr(base, m) for m in methods):
        return False
    return not (optimizer.global_clipnorm or optimizer.use_ema or optimizer.gradient_accumulation_steps)


def _grouped(weighted: list[int], steps, variables) -> list[tuple[list[int], list[int]]] | None:
    """:meth:`StageUpdate._update_groups`: (positions in ``weighted``, indices in ``variables``) per group.

    ``None`` where the stage makes fewer than two groups.
    """
    index = {id(v): i for i, v in enumerate(variables)}
    # steps that share a weight (a tied layer called twice) fall into one component
    component = list(range(len(weighted)))

    def root(p):
        while component[p] != p:
            p = component[p]
        return p

    owner: dict = {}
    for p, k in enumerate(weighted):
        for v in steps[k].variables:
            if id(v) in owner:
                component[root(p)] = root(owner[id(v)])
            owner[id(v)] = p
    last = {root(p): p for p in range(len(weighted))}  # each component's last step
    owned = [[index[id(v)] for v in steps[k].variables if owner.get(id(v)) == p] for p, k in enumerate(weighted)]
    reach, closable = 0, []
    for p in range(len(weighted)):
        reach = max(reach, last[root(p)])
        closable.append(reach == p)
    groups = _cut([sum(variable_nbytes(variables[i]) for i in own) for own in owned], closable)
    if len(groups) < 2:
        return None
    result = [(positions, [i for p in positions for i in owned[p]]) for positions in groups]
    placed = {i for _, indices in result for i in indices}
    rest = [i for i in range(len(variables)) if i not in placed]  # a weight no weighted step reads
    result[-1] = (result[-1][0], result[-1][1] + rest)
    return result


def _cut(sizes: list[int], closable: list[bool]) -> list[list[int]]:
    """Positions cut, in order, into groups of at least ``GROUP_BYTES``, each ending where ``closable``.

    >>> _cut([GROUP_BYTES, 1, GROUP_BYTES, 1], [True, False, True, True])
    [[0], [1, 2, 3]]
    """
    groups, positions, size = [], [], 0
    for p, (bytes_, closes) in enumerate(zip(sizes, closable)):
        positions.append(p)
        size += bytes_
        if size >= GROUP_BYTES and closes:
            groups.append(positions)
            positions, size = [], 0
    if positions:
        if groups and size < GROUP_BYTES:
            groups[-1] += positions
        else:
            groups.append(positions)
    return groups


def variable_nbytes(variable) -> int:
    """The bytes of a weight (bfloat16 too: NumPy has no such dtype by name)."""
    return int(np.prod(variable.shape)) * tf.as_dtype(variable.dtype).size


def _owning(layers, variables) -> list:
    """The layers among ``layers`` that hold any of ``variables``."""
    ids = {id(v) for v in variables}
    return [layer for layer in layers if any(id(v) in ids for v in compat.trained_weights(layer))]


def _values(grad):
    """What Keras squares: a sparse gradient's slices as they are, a dense one whole."""
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def _plus(grad, dense):
    """A gradient plus a dense one (a weight regularizer's): dense, as the tape adds them."""
    return dense if grad is None else tf.convert_to_tensor(grad) + dense


def _scaled(grad, scale):
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(scale, grad.values.dtype), grad.indices, grad.dense_shape)
    return grad * tf.cast(scale, grad.dtype)


def count_step(optimizer, finite: bool = True) -> None:
    """What an update does to the optimizer's counters, on a stage with no weights to update.

    Every stage's ``optimizer.iterations`` then counts the model's steps (as
    callbacks and learning-rate schedules read it), and a ``LossScaleOptimizer``
    grows or lowers its scale as on the other stages (``finite``: whether every
    stage's gradients were), as ``keras/src/optimizers/loss_scale_optimizer.py`` does.
    """
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):  # (built by the step, as on every stage)
        if not finite:
            optimizer.step_counter.assign(0)
            optimizer.dynamic_scale.assign(optimizer.dynamic_scale * 0.5)
            return
        if int(optimizer.step_counter) == optimizer.dynamic_growth_steps - 1:
            optimizer.step_counter.assign(0)
            optimizer.dynamic_scale.assign(optimizer.dynamic_scale * 2.0)
        else:
            optimizer.step_counter.assign_add(1)
        optimizer = optimizer.inner_optimizer
    optimizer.iterations.assign_add(1)
