"""Internal: variables without memory: released, never allocated, lent a value, and the weights files loaded into them.

Every rank builds every layer of the model (shapes only) and holds memory for
its own stage's weights alone. The shims here refer to each other, and stay
together: :func:`unallocated_scope` creates variables with no value and
defers the weights files loaded into them (keras_hub's ``from_preset``) until
each rank holds its own (:func:`held_only_loading`); :func:`release_variable`
frees another stage's; :func:`lent_values` gives them a value for a moment;
:func:`allocating_scope` leaves the scope for a moment.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import tensorflow as tf

from keras_pipe.compat.saving import entry_value_into
from keras_pipe.compat.tensors import assign_in_place


def unallocated(variable) -> bool:
    """Whether a Keras variable has a shape but no value (created in an unallocated scope, or released)."""
    return getattr(variable, "_value", None) is None


def release_variable(variable) -> None:
    """Frees a Keras variable's value, keeping its shape and dtype (``KerasVariable._value``, Keras 3.0-3.15).

    Why: a model handed in built has every stage's weights on every rank;
    each rank frees those of the stages it does not run (and never allocates
    those of a model built here). Reading it on this rank is an error that
    says so.
    """
    path = variable.path
    if getattr(variable, "_keras_pipe_initializer", False) is not False:
        return  # released before

    def elsewhere(shape, dtype=None):
        raise RuntimeError(
            f"{path} belongs to another stage of the pipeline; this rank does not hold it (model.get_weights() "
            "gathers every stage's weights). A model handed to PipelineModel.from_model or from_sequential gives "
            "the pipeline its layers, and each rank keeps its own stage's weights: use the pipeline from then on "
            "(pipeline.to_keras() is the whole model again, on rank 0)."
        )

    # An unallocated variable would give its initializer's values when read: it raises instead, and
    # keeps the initializer in case this rank comes to hold it (a one-rank model rebuilt).
    variable._keras_pipe_initializer = variable._initializer if unallocated(variable) else None
    variable._value = None
    variable._initializer = elsewhere


def restore_initializer(variable) -> None:
    """Undoes :func:`release_variable` of a variable never allocated here, so that it can be allocated."""
    initializer = getattr(variable, "_keras_pipe_initializer", False)
    if initializer is not False:
        variable._initializer = initializer
        del variable._keras_pipe_initializer


def named_as_built(variable):
    """The TensorFlow name scope under which ``variable``'s ``tf.Variable`` is named ``<its Keras path>:0``.

    Why: a layer Keras builds eagerly creates its ``tf.Variable`` inside its
    name scopes, so the name is the variable's path
    (``transformer_layer_0/self_attention_layer_norm/gamma:0``); one created
    later, from its initializer (unallocated, released, lent), would be named
    after whatever scope is current then (``gamma:0``). Keras' TensorFlow
    optimizers match ``exclude_from_weight_decay(var_names=...)`` against
    that name: AdamW's usual "no decay for layer norms and biases" must see the
    path, as in the unsplit model. ``tf.name_scope`` with a trailing ``/`` is
    absolute, and ``tf.init_scope`` keeps it.
    """
    parent = variable.path.rpartition("/")[0]
    return tf.name_scope(parent + "/") if parent else contextlib.nullcontext()


def allocate_with(variable, value) -> None:
    """Gives a variable without memory (released, or never allocated) ``value``, its own from now on
    (``KerasVariable._initialize``, Keras 3.0-3.15).

    Why: ``schedule="auto"`` picking a schedule that cuts the model otherwise
    gives a rank weights another rank held until then.
    """
    restore_initializer(variable)
    with allocating_scope(), tf.init_scope(), named_as_built(variable):
        variable._initialize(value)


@contextlib.contextmanager
def lent_values(variables):
    """The unallocated ones of ``variables`` hold a value (zeros, until assigned) inside; none again after.

    Why: saving a model whose layers Keras cannot rebuild from their configs
    (a custom layer not registered, or whose ``get_config`` misses an
    argument) writes rank 0's own layer objects, as ``keras.Sequential``
    would: for that moment they hold every stage's weights. Afterwards each
    is as :func:`release_variable` left it (``KerasVariable._value`` and
    ``_initializer``, Keras 3.0-3.15).
    """
    lent = []
    try:
        with allocating_scope(), tf.init_scope():
            for variable in variables:
                if unallocated(variable) and all(variable is not other for other, _, _ in lent):
                    kept = variable.__dict__.get("_keras_pipe_initializer", lent)
                    lent.append((variable, variable._initializer, kept))
                    with named_as_built(variable):
                        variable._initialize(np.zeros(tuple(variable.shape), np.dtype(variable.dtype)))
        yield
    finally:
        for variable, initializer, kept in lent:
            variable._value = None
            variable._initializer = initializer
            if kept is lent:
                variable.__dict__.pop("_keras_pipe_initializer", None)
            else:
                variable._keras_pipe_initializer = kept


@contextlib.contextmanager
def allocating_scope():
    """Leaves :func:`unallocated_scope` for a moment (Keras' ``StatelessScope`` stack, Keras 3.0-3.15).

    Why: a layer whose output shape Keras cannot infer symbolically is
    called once on a real tensor, which no stateless scope may see.
    """
    from keras.src.backend.common import global_state

    scope = global_state.get_global_attribute("stateless_scope")
    global_state.set_global_attribute("stateless_scope", None)
    try:
        yield
    finally:
        global_state.set_global_attribute("stateless_scope", scope)


@contextlib.contextmanager
def unallocated_scope():
    """A ``keras.StatelessScope`` whose new variables are never allocated (Keras' ``global_state``
    ``"uninitialized_variables"`` list, Keras 3.0-3.15).

    Why: every rank builds every layer of the model, shapes only. A plain
    ``StatelessScope`` allocates the variables created inside it on exit, and
    ``initialize_variables=False`` leaves them on a list the next scope
    allocates: either way the whole model's weights on every rank, which a
    pipeline exists to avoid. This scope takes them off the list again. A
    variable created from a value rather than an initializer, which a
    ``StatelessScope`` refuses, is allocated (``Variable.__init__`` wrapped
    for the scope's duration).
    """
    from keras.src.backend.common import global_state
    from keras.src.backend.common.variables import Variable

    before = list(global_state.get_global_attribute("uninitialized_variables") or [])
    original = Variable.__init__

    def create(variable, initializer, *args, **kwargs):
        # A variable created from a value, not an initializer (an optimizer's iteration count,
        # which keras_hub's task models create as they compile themselves), cannot wait: a
        # StatelessScope refuses it. It is small: it is allocated as it is.
        if callable(initializer) or isinstance(initializer, str):
            return original(variable, initializer, *args, **kwargs)
        with allocating_scope():
            return original(variable, initializer, *args, **kwargs)

    Variable.__init__ = create
    try:
        with keras.StatelessScope(initialize_variables=False), _deferring_weight_loads():
            yield
    finally:
        Variable.__init__ = original
        global_state.set_global_attribute("uninitialized_variables", before)


DEFERRED_LOADS = "_keras_pipe_deferred_loads"


@contextlib.contextmanager
def _deferring_weight_loads():
    """Weights files loaded into a model without memory are recorded on it, not read (``saving_lib.load_weights_only``,
    which ``Model.load_weights`` and ``keras.saving.load_weights`` call for ``.weights.h5``, ``.weights.json`` and
    ``.keras`` files, Keras 3.0-3.15).

    Why: keras_hub's ``from_preset`` builds the model, then loads the
    preset's weights file into it; inside a ``StatelessScope`` each assign
    would go to the scope and be dropped, and the pipeline would train the
    initializers' values. Recorded (``DEFERRED_LOADS``: ``(filepath,
    skip_mismatch, objects_to_skip)``), each load is run once the pipeline
    has given each rank its own stage's memory, reading only what that rank
    holds (:func:`held_only_loading`).
    """
    from keras.src.saving import saving_lib

    original = saving_lib.load_weights_only

    def defer(model, filepath, skip_mismatch=False, objects_to_skip=None):
        if not any(unallocated(v) for v in model.weights):
            return original(model, filepath, skip_mismatch=skip_mismatch, objects_to_skip=objects_to_skip)
        loads = model.__dict__.get(DEFERRED_LOADS, [])
        object.__setattr__(model, DEFERRED_LOADS, [*loads, (str(filepath), skip_mismatch, objects_to_skip)])
        return None

    saving_lib.load_weights_only = defer
    try:
        yield
    finally:
        saving_lib.load_weights_only = original


class _Stored:
    """A value of a weights file, read only when a variable this rank holds takes it (``numpy.asarray`` reads it)."""

    def __init__(self, read):
        self.read = read

    def __array__(self, dtype=None, copy=None):
        value = np.asarray(self.read())
        return value if dtype is None else value.astype(dtype)

    def __getitem__(self, key):  # (``store["rank"][()]``, as keras_hub reads a scalar)
        return np.asarray(self.read())[key]


@contextlib.contextmanager
def held_only_loading(allocate=None):
    """While Keras loads a weights file: only the variables this rank holds are read and assigned
    (``saving_lib.H5IOStore.__getitem__``, its sharded subclass's, and ``KerasVariable.assign``, Keras 3.12-3.15).
    ``allocate(shape, dtype)``: an array whose buffer TensorFlow can borrow, for each value read, which is then
    copied into the variable's own buffer (:func:`~keras_pipe.compat.tensors.read_into`,
    :func:`~keras_pipe.compat.tensors.assign_in_place`); ``None``: read and assigned as Keras does.

    Why: every rank walks the whole model as Keras does (the file's layout
    is the model's), but a variable of another stage has no memory here and
    its bytes are left in the file, so that a rank never holds more than its
    own stage and the one value being read.

    Yields a set that collects the ``id`` of every variable the file gives a
    value, held here or not (the same walk on every rank).
    """
    from keras.src.backend.common.variables import Variable
    from keras.src.saving import saving_lib

    stores = [saving_lib.H5IOStore, saving_lib.ShardedH5IOStore]
    reads = {store: store.__dict__["__getitem__"] for store in stores if "__getitem__" in store.__dict__}
    assign = Variable.assign

    reading = []  # (a read under way: the sharded store's read calls its base class's, which must read now)

    def lazy_of(read):
        def lazy(store, key):
            if reading:
                if allocate is not None and read is reads.get(saving_lib.H5IOStore):  # (the base read: the file's)
                    value = entry_value_into(store._h5_entry_group, key, allocate)
                    if value is not None:
                        return value
                return read(store, key)
            group = store._h5_entry_group  # (the store is one object moved from entry to entry)

            def read_now():
                current = store._h5_entry_group
                store._h5_entry_group = group
                reading.append(True)
                try:
                    return read(store, key)
                finally:
                    reading.pop()
                    if store._h5_entry_group is group:  # (a sharded store that went to another shard came back itself)
                        store._h5_entry_group = current

            return _Stored(read_now)

        return lazy

    visited = set()

    def held_assign(variable, value):
        visited.add(id(variable))
        if unallocated(variable):
            return variable  # (another stage's: its value stays in the file)
        if isinstance(value, _Stored):
            value = value.read()
            if allocate is not None and assign_in_place(variable, value):
                return value
        return assign(variable, value)

    for store, read in reads.items():
        store.__getitem__ = lazy_of(read)
    Variable.assign = held_assign
    try:
        yield visited
    finally:
        for store, read in reads.items():
            store.__getitem__ = read
        Variable.assign = assign


def initialize_deferred(variable) -> None:
    """Gives an unallocated variable memory and its initial value, where it has an initializer
    (``Variable._initializer`` and ``_deferred_initialize``, Keras 3.0-3.15)."""
    if variable._initializer is not None:
        variable._deferred_initialize()
