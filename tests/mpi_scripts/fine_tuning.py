"""Fine-tuning, as users write it, pipelined against the unsplit model from the same weights (issue 46).

Run as ``mpirun -n P python fine_tuning.py [CASE ...]``; prints ``FINE-TUNING OK <case> rank <R>`` per rank and case.
Cases (AdamW, 4 micro-batches unless said):

``child``: a composite layer (a ``Layer`` whose ``call()`` runs two ``Dense``) frozen, then one of its children
unfrozen (``block.trainable = False; block.a.trainable = True``): Keras trains the child, as it decides trainability
per variable. ``lora``: every layer frozen, then LoRA enabled at every depth, as keras_hub's
``Backbone.enable_lora`` does it (the target unfrozen, then ``enable_lora``): on an ``Embedding`` and a ``Dense`` at
the top and on an ``EinsumDense`` and a ``Dense`` inside a frozen composite layer; under 1F1B and under ZB-H1 (the
split backward's batched ``W`` takes the LoRA kernels). ``qlora``: the same after ``quantize("int8")``. ``guide``:
Keras' transfer-learning guide, its two phases: ``base.trainable = False``, ``base(x, training=False)``, a new head,
fit; then ``base.trainable = True``, ``compile()`` with a small rate, fit again (one micro-batch: Keras 3's ``fit``
gives the nested call ``training=True`` in the second phase, so batch normalization normalises with the batch's
statistics, which micro-batches would split; with several, every rank warns at that ``compile()``).
``guide_subclassed``: the same written as a subclassed model whose ``call()`` passes ``training=False`` to the
backbone: Keras keeps a caller's argument there, so the backbone stays in inference mode in both phases, on 4
micro-batches. ``guide_unallocated``: the guide's model created inside ``keras_pipe.unallocated()``, its weights
loaded from a file (each rank reading its own) and its base frozen before the pipeline allocates it, then unfrozen:
it trains; with AdamW excluding variables from weight decay by name (``var_names``), which the names the pipeline
gives the variables it allocates must match as Keras' do. ``llama_lora``: keras_hub's ``LlamaCausalLM`` with
``backbone.enable_lora(4)``; ``llama_lora_auto``: the same under ``schedule="auto"`` taking ZB-V, which cuts the
model again after the first step's timing (2 ranks).
``unseeded_shared``: each rank its own seed, the model created inside ``keras_pipe.unallocated()`` and pipelined
with interleaved 1F1B, its embedding held by two ranks. ``preset``: a ``LlamaCausalLM`` saved with
``save_to_preset`` (rank 0), opened with ``from_preset`` inside ``keras_pipe.unallocated()`` and pipelined: each
rank reads only its own stage's weights from the file, and predicts what the preset model predicts; ``generate()``
gives the preset model's tokens.
"""

import os
import sys
import tempfile
import warnings

import keras
import numpy as np
from common import RANK, SIZE, assert_close, digest, forced_pick, on_rank_0, tiny_llama  # (of VOCAB = 40 tokens)
from mpi4py import MPI

import keras_pipe
from keras_pipe import PipelineConfigError, PipelineModel

VOCAB, LENGTH = 40, 12
rng = np.random.default_rng(3)
tokens = rng.integers(1, VOCAB, size=(48, LENGTH)).astype("int32")
classes = (tokens[:, 0] % 3).astype("int32")
features = rng.normal(size=(48, 12)).astype("float32")
FIT = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)


@keras.saving.register_keras_serializable(package="fine_tuning")
class Block(keras.layers.Layer):
    """A composite layer: its call() runs two layers that hold weights (kept whole by the cut)."""

    def __init__(self, width, einsum=False, **kwargs):
        super().__init__(**kwargs)
        self.width, self.einsum = width, einsum
        if einsum:
            self.a = keras.layers.EinsumDense("abc,cd->abd", output_shape=(None, width), bias_axes="d", name="a")
        else:
            # (regularized: Keras counts the regularizer of a trainable child under a frozen parent)
            self.a = keras.layers.Dense(width, activation="relu", kernel_regularizer="l2", name="a")
        self.b = keras.layers.Dense(width, activation="tanh", name="b")

    def build(self, shape):
        self.a.build(shape)
        self.b.build((*shape[:-1], self.width))

    def call(self, x):
        return self.b(self.a(x))

    def compute_output_shape(self, shape):
        return (*shape[:-1], self.width)

    def get_config(self):
        return {**super().get_config(), "width": self.width, "einsum": self.einsum}


def adamw(rate=1e-2):
    return dict(
        optimizer=keras.optimizers.AdamW(rate),
        loss="sparse_categorical_crossentropy",
        metrics=["sparse_categorical_accuracy"],
        jit_compile=False,
    )


def freeze_all(model):
    for layer in model._flatten_layers(include_self=False):
        layer.trainable = False


def compare(
    case, make, prepare, phases, x, y, tolerance=(2e-5, 2e-6), unallocated=False, reference_key=None, **pipeline_args
):
    """Trains the unsplit model (rank 0) and the pipeline from the same weights through ``phases``; compares.

    ``prepare(model)`` freezes and adds LoRA (before the weights are copied, so that LoRA's random initial
    kernels are the same too); each phase is ``(change(model), compile_args)``: what the user changes between
    two ``fit()`` calls, then ``compile()`` again, as Keras asks. ``unallocated``: the pipeline's model is created
    inside ``keras_pipe.unallocated()`` and loads the weights from a file (rank 0's), then is prepared.
    ``reference_key`` (``case`` if not given) names the unsplit model's training, which launches on other rank
    counts and other schedules share (``common.on_rank_0``); rank 0's reference ends trained either way.
    """
    keras.utils.set_random_seed(11)
    reference = make()
    prepare(reference)
    initial = [np.array(w) for w in reference.get_weights()]
    if unallocated:  # (created without memory, the weights loaded from a file each rank reads its part of)
        path = os.path.join(tempfile.gettempdir(), f"keras_pipe_fine_tuning_{os.getppid()}.weights.h5")
        on_rank_0(reference.save_weights, path)
        with keras_pipe.unallocated():
            handed_in = make()
            handed_in.load_weights(path)
        prepare(handed_in)
    else:
        keras.utils.set_random_seed(11)
        handed_in = make()
        prepare(handed_in)
        handed_in.set_weights(initial)

    trained_here = []

    def run():
        trained_here.append(True)
        results = []
        for change, compile_args in phases:
            change(reference)
            reference.compile(**compile_args())
            history = reference.fit(x, y, **FIT).history
            results.append((history, reference.get_weights()))
        return results, reference.predict(x, batch_size=16, verbose=0)

    expected, predicted = on_rank_0(run, key=f"{reference_key or case} {digest(initial, x, y)}")
    if RANK == 0 and not trained_here:  # (trained by another launch: this rank's reference as if trained here)
        for change, _ in phases:
            change(reference)
        reference.set_weights(expected[-1][1])
    model = PipelineModel.from_model(handed_in, **pipeline_args)
    for k, (change, compile_args) in enumerate(phases):
        change(handed_in)
        model.compile(**compile_args())
        history = model.fit(x, y, **FIT).history
        want_history, want_weights = expected[k]
        rtol, atol = tolerance
        for key in want_history:
            assert_close(history[key], want_history[key], f"{case} phase {k} history {key}", rtol, atol)
        moved = 0
        for i, (a, b, start, variable) in enumerate(zip(model.get_weights(), want_weights, initial, reference.weights)):
            assert_close(a, b, f"{case} phase {k} weight {i} ({variable.path})", 5 * rtol, 15 * atol)
            moved += not np.allclose(b, start)
        assert moved, f"{case} phase {k}: no weight moved in the unsplit model either"
    keras.tree.map_structure(
        lambda a, b: assert_close(a, b, f"{case} predict", rtol, atol),
        model.predict(x, batch_size=16, verbose=0),
        predicted,
    )
    return model, reference


def keep(model):
    return None


def child(case):
    def make():
        inputs = keras.Input((12,))
        # (wide enough around the block that, on up to 4 ranks, the cut keeps it whole: a unit whose
        # own flag is False holding a child whose flag is True)
        h = keras.layers.Dense(64, activation="relu", name="first")(inputs)
        h = keras.layers.Dense(16, activation="relu", name="second")(h)
        h = Block(16, name="block")(h)
        outputs = keras.layers.Dense(3, activation="softmax", name="head")(h)
        return keras.Model(inputs, outputs)

    def prepare(model):
        block = model.get_layer("block")
        block.trainable = False
        block.a.trainable = True  # (Keras trains it: its variables' flags are set again)

    model, reference = compare(case, make, prepare, [(keep, adamw)], features, classes, num_microbatches=4)
    trained = {v.path for v in reference.trainable_variables}
    assert any("block/a" in p for p in trained) and not any("block/b" in p for p in trained), trained


def lora_model():
    tokens_in = keras.Input((LENGTH,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 16, name="embedding")(tokens_in)
    h = Block(16, einsum=True, name="block")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    h = keras.layers.Dense(16, activation="relu", name="dense")(h)
    outputs = keras.layers.Dense(3, activation="softmax", name="head")(h)
    return keras.Model(tokens_in, outputs)


def enable_lora(model, quantize=False):
    if quantize:
        model.quantize("int8", filters=lambda layer: layer.name != "head")
    freeze_all(model)
    block = model.get_layer("block")
    for layer in (model.get_layer("embedding"), block.a, block.b, model.get_layer("dense")):
        layer.trainable = True  # (as Backbone.enable_lora: the target unfrozen, then LoRA on it)
        layer.enable_lora(2)
    model.get_layer("head").trainable = True  # (a new head, trained whole)


def lora(case, quantize=False):
    for schedule in ("1f1b", "zb-h1"):
        _, reference = compare(
            f"{case} {schedule}",
            lora_model,
            lambda m: enable_lora(m, quantize),
            [(keep, adamw)],
            tokens,
            classes,
            tolerance=(5e-5, 1e-5) if quantize else (2e-5, 2e-6),
            reference_key=case,  # (one unsplit model for both schedules)
            num_microbatches=4,
            schedule=schedule,
        )
        trained = [v.path for v in reference.trainable_variables]
        assert sum("lora" in p for p in trained) == 8 and "embedding/embeddings" not in trained, trained


def qlora(case):
    lora(case, quantize=True)


def guide_base():
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", name="conv_a")(inputs)
    h = keras.layers.BatchNormalization(name="bn_a")(h)
    h = keras.layers.Activation("relu")(h)
    h = keras.layers.Conv2D(8, 3, padding="same", name="conv_b")(h)
    h = keras.layers.BatchNormalization(name="bn_b")(h)
    h = keras.layers.Activation("relu")(h)
    return keras.Model(inputs, h, name="base")


def guide_phases(base_of):
    def freeze(model):
        base_of(model).trainable = False

    def unfreeze(model):
        base_of(model).trainable = True

    return [(freeze, lambda: adamw(1e-2)), (unfreeze, lambda: adamw(1e-4))]


images = rng.normal(size=(48, 8, 8, 3)).astype("float32")


def guide(case):
    def make():
        base = guide_base()
        inputs = keras.Input((8, 8, 3))
        h = base(inputs, training=False)
        h = keras.layers.GlobalAveragePooling2D()(h)
        outputs = keras.layers.Dense(3, activation="softmax", name="head")(h)
        return keras.Model(inputs, outputs)

    compare(case, make, keep, guide_phases(lambda m: m.get_layer("base")), images, classes, num_microbatches=1)
    # several micro-batches: batch normalization trains again in the second phase, which every rank says
    keras.utils.set_random_seed(11)
    handed_in = make()
    handed_in.get_layer("base").trainable = False  # (frozen before the pipeline is made, as in the guide)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PipelineModel.from_model(handed_in, num_microbatches=2)
        model.compile(**adamw())
    assert not [w for w in caught if "BatchNormalization" in str(w.message)], [str(w.message) for w in caught]
    handed_in.get_layer("base").trainable = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile(**adamw(1e-4))
    assert [w for w in caught if "BatchNormalization" in str(w.message)], [str(w.message) for w in caught]


@keras.saving.register_keras_serializable(package="fine_tuning")
class Classifier(keras.Model):
    """The guide's model written as a subclass: the backbone called with training=False in call()."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.base = guide_base()
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.head = keras.layers.Dense(3, activation="softmax", name="head")

    def call(self, x, training=None):
        return self.head(self.pool(self.base(x, training=False)))


def guide_unallocated(case):
    """The guide's model created inside unallocated(), its weights loaded from a file and its base frozen before the
    pipeline gives it memory: its variables are allocated frozen (TensorFlow's own flag False), then unfrozen."""

    def make():
        base = guide_base()
        inputs = keras.Input((8, 8, 3))
        h = keras.layers.GlobalAveragePooling2D()(base(inputs, training=False))
        return keras.Model(inputs, keras.layers.Dense(3, activation="softmax", name="head")(h))

    def freeze(model):
        model.get_layer("base").trainable = False

    def adamw_excluding(rate):
        # (AdamW's usual "no decay for normalization and this layer", by name: Keras' TensorFlow optimizers match
        # the tf.Variable's name, which is its path where Keras builds the layer; here the pipeline gives the
        # variables memory, so it must name them so; a large decay makes a wrong match show in the weights)
        arguments = adamw(rate)
        arguments["optimizer"] = keras.optimizers.AdamW(rate, weight_decay=0.5)
        arguments["optimizer"].exclude_from_weight_decay(var_names=["bn_", "head/kernel"])
        return arguments

    rates = (1e-2, 1e-4)  # (guide_phases' own: its freezing, then unfreezing, with this optimizer)
    guide = guide_phases(lambda m: m.get_layer("base"))
    phases = [(change, lambda rate=rate: adamw_excluding(rate)) for (change, _), rate in zip(guide, rates)]
    model, _ = compare(case, make, freeze, phases, images, classes, unallocated=True, num_microbatches=1)
    for variable in model.weights:
        if not keras_pipe.compat.unallocated(variable):
            assert variable.value.name == f"{variable.path}:0", (variable.value.name, variable.path)


def guide_subclassed(case):
    def make():
        model = Classifier()
        model(images[:1])  # (built by a call: build() alone leaves the head unbuilt)
        return model

    compare(case, make, keep, guide_phases(lambda m: m.base), images, classes, num_microbatches=4)


def lm_compile(rate=1e-2):
    return dict(
        optimizer=keras.optimizers.AdamW(rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
        jit_compile=False,
    )


def shifted(ids):
    return np.concatenate([ids[:, 1:], np.zeros((len(ids), 1), ids.dtype)], axis=1)


def compare_llama_lora(case, **pipeline_args):
    """keras_hub's ``LlamaCausalLM`` with ``backbone.enable_lora(4)``, pipelined, against the unsplit model."""
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    return compare(
        case,
        tiny_llama,
        lambda m: m.backbone.enable_lora(4),
        [(keep, lm_compile)],
        x,
        shifted(tokens),
        tolerance=(5e-5, 1e-5),
        reference_key="llama_lora",  # (also llama_lora_auto's)
        num_microbatches=4,
        **pipeline_args,
    )


def saved_lora(case, model, reference, x):
    """What a trained LoRA pipeline writes (``save_lora_weights``, ``save_to_preset``, ``save``) is what Keras and
    keras_hub write and read, and a new pipeline reads the ``.lora.h5`` file back."""
    trained = [v.path for v in reference.trainable_variables]
    assert trained and all("lora" in p for p in trained), trained
    # the LoRA kernels of every stage, in keras_hub's own file: written by rank 0, read by each rank for its stage
    directory = tempfile.gettempdir()
    mine, theirs = (os.path.join(directory, f"keras_pipe_{name}_{os.getppid()}.lora.h5") for name in ("pipe", "keras"))
    model.save_lora_weights(mine)
    if RANK == 0:  # (rank 0's reference is the trained one)
        reference.backbone.save_lora_weights(theirs)
        import h5py

        with h5py.File(mine) as a, h5py.File(theirs) as b:
            names = _names(a)
            assert names and sorted(names) == sorted(_names(b)), (names, _names(b))
            for name in names:
                if isinstance(a[name], h5py.Dataset):
                    assert_close(a[name][()], b[name][()], f"{case}: {name} in the .lora.h5 file")
    # the trained pipeline as a keras_hub preset: rank 0 writes it, plain keras_hub opens it
    preset_dir = os.path.join(directory, f"keras_pipe_trained_preset_{os.getppid()}")
    model.save_to_preset(preset_dir)
    predicted = model.predict(x, batch_size=16, verbose=0)
    saved = os.path.join(directory, f"keras_pipe_trained_{os.getppid()}.keras")
    model.save(saved)  # (Keras writes the LoRA kernels merged into the kernels, as for the unsplit model)
    if RANK == 0:
        import keras_hub

        reopened = keras_hub.models.LlamaCausalLM.from_preset(preset_dir, preprocessor=None)
        assert_close(reopened.predict(x, batch_size=16, verbose=0), predicted, f"{case}: the saved preset")
        loaded = keras.models.load_model(saved)
        assert_close(loaded.predict(x, batch_size=16, verbose=0), predicted, f"{case}: model.save()")
    keras.utils.set_random_seed(11)  # (the same frozen weights as the trained model's)
    fresh = tiny_llama()
    keras.utils.set_random_seed(12)  # (other LoRA kernels than the trained ones: the file's must win)
    fresh.backbone.enable_lora(4)
    loaded = PipelineModel.from_model(fresh, num_microbatches=4)
    loaded.load_lora_weights(mine)
    assert_close(loaded.predict(x, batch_size=16, verbose=0), predicted, case)


def llama_lora(case):
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    model, reference = compare_llama_lora(case)
    saved_lora(case, model, reference, x)
    # LoRA enabled on the model handed in after the pipeline was made: refused on every rank at compile()
    keras.utils.set_random_seed(11)
    handed_in = tiny_llama()
    model = PipelineModel.from_model(handed_in, num_microbatches=2)
    handed_in.backbone.enable_lora(2)
    try:
        model.compile(**lm_compile())
    except PipelineConfigError as error:
        assert "enable_lora" in str(error), error
    else:
        raise AssertionError("LoRA enabled after from_model was not refused")


def _names(group) -> list:
    names = []
    group.visit(names.append)
    return names


def llama_lora_auto(case):
    """``backbone.enable_lora`` under ``schedule="auto"`` taking ZB-V: the first step's timing holds both cuts, then
    the model is cut again and every chunk decides trainability per variable as Keras does: the LoRA kernels train
    (with ZB-V's split backward), the frozen kernels stay, and training equals the unsplit model's."""
    with forced_pick("zb-v"):
        model, reference = compare_llama_lora(case, schedule="auto")
    picker = model.engine.picker
    assert picker.picked == "zb-v" and len(model.engine.chunks) == 2, picker.describe()
    mine = {v.path for v in model.engine.trainable_variables}
    assert mine and all("lora" in p for p in mine), mine
    saved_lora(case, model, reference, {"token_ids": tokens, "padding_mask": np.ones_like(tokens)})


def unseeded_shared(case):
    """An unseeded script (each rank its own initial values) creating keras_hub's ``LlamaCausalLM`` inside
    ``keras_pipe.unallocated()``, pipelined with interleaved 1F1B: the token embedding is on the first and the last
    virtual stage, which are on two ranks. Both copies start from the first holder's values (they did not: rank
    ``P - 1`` kept its own, so the two uses of one weight differed), and training equals the unsplit model started
    from the pipeline's ``get_weights()``."""
    keras.utils.set_random_seed(100 + RANK)
    with keras_pipe.unallocated():
        lm = tiny_llama()
    model = PipelineModel.from_model(lm, schedule="interleaved-1f1b", num_microbatches=4)
    embedding = lm.backbone.token_embedding
    held = [None if keras_pipe.compat.unallocated(v) else np.array(v.numpy()) for v in embedding.weights]
    copies = [values for values in MPI.COMM_WORLD.allgather(held) if values[0] is not None]
    assert len(copies) == 2, f"the embedding is held by {len(copies)} ranks"
    for values in copies[1:]:
        for a, b, variable in zip(values, copies[0], embedding.weights):
            assert_close(a, b, f"{case}: {variable.path} on its two holders", 0, 0)
    initial = model.get_weights()
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    y = shifted(tokens)

    def run():
        reference = tiny_llama()
        reference.set_weights(initial)
        reference.compile(**lm_compile())
        history = reference.fit(x, y, **FIT).history
        return history, reference.get_weights()

    want_history, want_weights = on_rank_0(run)
    model.compile(**lm_compile())
    history = model.fit(x, y, **FIT).history
    for key in want_history:
        assert_close(history[key], want_history[key], f"{case} history {key}", 5e-5, 1e-5)
    for i, (a, b) in enumerate(zip(model.get_weights(), want_weights)):
        assert_close(a, b, f"{case} weight {i}", 2.5e-4, 1.5e-4)


def preset(case):
    import keras_hub

    directory = os.path.join(tempfile.gettempdir(), f"keras_pipe_preset_{os.getppid()}")

    def save():
        keras.utils.set_random_seed(5)
        model = tiny_llama()
        model.backbone.save_to_preset(directory)
        x = {"token_ids": tokens[:8], "padding_mask": np.ones_like(tokens[:8])}
        loaded = keras_hub.models.LlamaCausalLM.from_preset(directory, preprocessor=None)
        loaded.compile(sampler="greedy")
        return model.predict(x, verbose=0), loaded.predict(x, verbose=0), loaded.generate(prompts, stop_token_ids=None)

    prompts = {
        "token_ids": np.where(np.arange(LENGTH) < 3, tokens[:4], 0),
        "padding_mask": np.arange(LENGTH) < [[3]] * 4,
    }
    expected, reloaded, generated = on_rank_0(save)
    assert_close(reloaded, expected, "the preset opened in plain keras_hub")
    keras.utils.set_random_seed(99)  # (other initial values than the preset's: they must not be what trains)
    with keras_pipe.unallocated():
        lm = keras_hub.models.LlamaCausalLM.from_preset(directory, preprocessor=None)
    held = [v for v in lm.weights if not keras_pipe.compat.unallocated(v)]
    assert not held, f"weights held before the pipeline: {[v.path for v in held][:3]}"
    model = PipelineModel.from_model(lm, num_microbatches=2)
    x = {"token_ids": tokens[:8], "padding_mask": np.ones_like(tokens[:8])}
    assert_close(model.predict(x, batch_size=8, verbose=0), expected, f"{case}: predictions of the preset's weights")
    stage = [v for v in lm.weights if not keras_pipe.compat.unallocated(v)]
    total = sum(int(np.prod(v.shape)) for v in lm.weights)
    mine = sum(int(np.prod(v.shape)) for v in stage)
    if SIZE > 1:
        assert mine < total, (mine, total)
    lm.sampler = keras_hub.samplers.GreedySampler()  # (what compile(sampler="greedy") sets on the task)
    actual = model.generate(prompts, stop_token_ids=None)
    for key in ("token_ids", "padding_mask"):
        np.testing.assert_array_equal(actual[key], generated[key], err_msg=f"rank {RANK}: {case}: generate {key}")


CASES = dict(
    child=child,
    lora=lora,
    qlora=qlora,
    guide=guide,
    guide_subclassed=guide_subclassed,
    guide_unallocated=guide_unallocated,
    llama_lora=llama_lora,
    llama_lora_auto=llama_lora_auto,
    unseeded_shared=unseeded_shared,
    preset=preset,
)

if __name__ == "__main__":
    for name in sys.argv[1:] or list(CASES):
        CASES[name](name)
        MPI.COMM_WORLD.Barrier()
        print(f"FINE-TUNING OK {name} rank {RANK}", flush=True)
