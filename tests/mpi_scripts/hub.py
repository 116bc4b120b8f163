"""keras_hub's layers and models, pipelined, against the unsplit model on the same weights and data.

Run as ``mpirun -n P python hub.py [CASE ...]``; prints ``HUB OK <case>`` per
rank and case. Every model is built from constructor arguments (nothing is
downloaded). Cases:

``encoder``: a classifier of ``TokenAndPositionEmbedding(mask_zero=True)``,
two ``TransformerEncoder``s, pooling and a ``Dense``, written as a list of
layers: the padding mask is attached inside ``call()`` on real tensors only,
and must still reach every block and the pooling. ``decoder``: a language
model of the same embedding, ``TransformerDecoder``s and a ``Dense`` head:
its per-token output carries the mask, so the loss is a mean over the whole
batch's real tokens. ``gpt2``: ``GPT2CausalLM`` (its token embedding called
again as the head: one weight on the first and the last stage; its
``padding_mask`` input read by every block). ``bert``: a classifier on
``BertBackbone``'s ``pooled_output``, and a model that trains both of its
outputs with a loss each. ``chunked``: two chunks a rank, the encoder under
ZB-V and BERT's two-output model under interleaved 1F1B. With AdamW, whose
step tells the forms of an embedding's sparse gradient apart (issue 39):
``llama`` (rotary, untied embeddings), ``mixtral`` (mixture of experts),
``vit`` (fixed position ids), ``t5`` (encoder-decoder, one table on two
stages).
"""

import sys
import time
import warnings

import keras
import keras_hub
import numpy as np
from common import RANK, SIZE, assert_close, forced_pick, tiny_llama, trained_on_rank_0

from keras_pipe import PipelineModel

VOCAB, LENGTH, DIM = 40, 12, 16
rng = np.random.default_rng(7)
lengths = rng.integers(3, LENGTH + 1, size=48)
tokens = rng.integers(1, VOCAB, size=(48, LENGTH))
tokens[np.arange(LENGTH)[None, :] >= lengths[:, None]] = 0  # padded at the end, each row to its own length
classes = (tokens[:, 0] % 3).astype("int32")
fit_args = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)


def shifted(ids):
    return np.concatenate([ids[:, 1:], np.zeros((len(ids), 1), ids.dtype)], axis=1)


def compare(case, make, compile_args, x, y, sample_weight=None, tolerance=(2e-5, 2e-6), **pipeline_args):
    """Trains the unsplit model (on rank 0) and the pipeline from the same initial weights; compares everything."""
    data = dict(sample_weight=sample_weight, batch_size=24, verbose=0)
    keras.utils.set_random_seed(11)
    reference = make()
    keras.utils.set_random_seed(11)
    handed_in = make()
    handed_in.set_weights(reference.get_weights())
    reference.compile(**compile_args())  # (every rank builds both, so that auto-named objects stay alike)

    # (a model and compile() compared again, under another schedule or on another rank count, reuse the reference's
    # training: rank 0's training is most of a case's time)
    expected = trained_on_rank_0(
        reference,
        dict(x=x, y=y, sample_weight=sample_weight, **fit_args),
        evaluate=dict(x=x, y=y, **data),
        predict=dict(x=x, batch_size=24),
        key=f"{make.__qualname__} {compile_args.__qualname__}",
    )
    if isinstance(handed_in, keras.Sequential):
        model = PipelineModel.from_sequential(handed_in, **pipeline_args)
    else:
        model = PipelineModel.from_model(handed_in, **pipeline_args)
    model.compile(**compile_args())
    history = model.fit(x, y, sample_weight=sample_weight, **fit_args).history
    rtol, atol = tolerance
    for key in expected["history"]:
        assert_close(history[key], expected["history"][key], f"{case} history {key}", rtol, atol)
    for i, (a, b, variable) in enumerate(zip(model.get_weights(), expected["weights"], reference.weights)):
        if variable.path.endswith("key/bias"):
            # An attention key bias adds the same logit to every key of a query, which the softmax
            # ignores: its gradient is zero but for round-off, which Adam scales into whole steps.
            continue
        assert_close(a, b, f"{case} weight {i} ({variable.path})", 5 * rtol, 15 * atol)
    assert_close(model.evaluate(x, y, **data), expected["evaluate"], f"{case} evaluate", rtol, atol)
    keras.tree.map_structure(
        lambda a, b: assert_close(a, b, f"{case} predict", rtol, atol),
        model.predict(x, batch_size=24, verbose=0),
        expected["predict"],
    )
    return model


def adamw():
    return dict(
        optimizer=keras.optimizers.AdamW(1e-2),
        loss="sparse_categorical_crossentropy",
        metrics=["sparse_categorical_accuracy"],
    )


def encoder(case, **pipeline_args):
    def make():
        return keras.Sequential(
            [
                keras.Input((LENGTH,), dtype="int32"),
                keras_hub.layers.TokenAndPositionEmbedding(VOCAB, LENGTH, DIM, mask_zero=True),
                keras_hub.layers.TransformerEncoder(32, 2),
                keras_hub.layers.TransformerEncoder(32, 2),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(3, activation="softmax"),
            ]
        )

    model = compare(case, make, adamw, tokens, classes, **{"num_microbatches": 4, **pipeline_args})
    if SIZE > 1:  # the mask measured on real tensors crosses every boundary after the embedding
        crossing = [t for t in model.engine.cut.crossings if t.source == 0][0]
        assert model.engine.masks[crossing.tensor] is not None, model.engine.masks


def decoder(case):
    def make():
        return keras.Sequential(
            [
                keras.Input((LENGTH,), dtype="int32"),
                keras_hub.layers.TokenAndPositionEmbedding(VOCAB, LENGTH, DIM, mask_zero=True),
                *[keras_hub.layers.TransformerDecoder(32, 2) for _ in range(3)],
                keras.layers.Dense(VOCAB),
            ]
        )

    def lm():
        return dict(
            optimizer=keras.optimizers.AdamW(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["sparse_categorical_accuracy"],
        )

    targets = shifted(tokens)
    compare(case, make, lm, tokens, targets, num_microbatches=4)


def gpt2(case, **pipeline_args):
    def make():
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=VOCAB,
            num_layers=4,
            num_heads=2,
            hidden_dim=DIM,
            intermediate_dim=32,
            dropout=0.0,
            max_sequence_length=LENGTH,
        )
        return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)

    def lm():
        return dict(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=["sparse_categorical_accuracy"],
        )

    padding = (tokens != 0).astype("int32")
    x = {"token_ids": tokens, "padding_mask": padding}
    targets = shifted(tokens)
    weights = np.concatenate([padding[:, 1:], np.zeros((48, 1), "int32")], axis=1).astype("float32")
    model = compare(case, make, lm, x, targets, sample_weight=weights, **{"num_microbatches": 4, **pipeline_args})
    if SIZE > 1:
        assert "token_embedding" in model.engine.cut.shared, model.engine.cut.shared  # tied: first and last stage


def bert(case, both_only=False, **pipeline_args):
    def backbone():
        return keras_hub.models.BertBackbone(
            vocabulary_size=VOCAB,
            num_layers=2,
            num_heads=2,
            hidden_dim=DIM,
            intermediate_dim=32,
            dropout=0.0,
            max_sequence_length=LENGTH,
        )

    def classifier():
        inner = backbone()
        logits = keras.layers.Dense(3, name="classes")(inner.output["pooled_output"])
        return keras.Model(inner.input, logits)

    def both():
        inner = backbone()
        outputs = {
            "classes": keras.layers.Dense(3, name="classes")(inner.output["pooled_output"]),
            "tokens": keras.layers.Dense(VOCAB, name="tokens")(inner.output["sequence_output"]),
        }
        return keras.Model(inner.input, outputs)

    padding = (tokens != 0).astype("int32")
    x = {"token_ids": tokens, "segment_ids": np.zeros_like(tokens), "padding_mask": padding}

    def one_loss():
        return dict(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["sparse_categorical_accuracy"],
        )

    def two_losses():
        return dict(
            optimizer=keras.optimizers.Adam(1e-2),
            loss={
                "classes": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                "tokens": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            },
            loss_weights={"classes": 1.0, "tokens": 0.5},
            metrics={"classes": ["sparse_categorical_accuracy"]},
        )

    if not both_only:
        compare(case, classifier, one_loss, x, classes, num_microbatches=2, **pipeline_args)
    compare(case, both, two_losses, x, {"classes": classes, "tokens": tokens}, num_microbatches=2, **pipeline_args)


def chunked(case):
    """Two chunks a rank: the encoder under ZB-V (its run-time mask crosses every chunk, once from a rank to
    itself) and BERT's two-output model under interleaved 1F1B; and schedule="auto" taking ZB-V on a Llama, the
    model cut again after the timing, the embedding's two chunks (fine_tuning.py's llama_lora_auto cuts a LoRA
    Llama again so in the default suite)."""
    encoder(case, schedule="zb-v")
    bert(case, schedule="interleaved-1f1b", both_only=True)
    if SIZE == 2:
        with forced_pick("zb-v"):
            model = llama(f"{case} llama auto", schedule="auto")
        assert model.engine.picker.picked == "zb-v" and len(model.engine.chunks) == 2, model.engine.picker.describe()


def adamw_lm(epsilon=1e-7):
    """AdamW (not linear in the gradient: the form of an embedding's sparse gradient decides its step); XLA off,
    as the behaviour under test does not depend on it and four ranks would compile each model's programs.

    ``epsilon``: Adam divides by ``sqrt(v) + epsilon``, so a gradient entry that cancels to round-off (T5's)
    steps by a whole learning rate in one model and another's: a larger one keeps round-off round-off, while a
    gradient in another form (squared slice by slice, or summed first) still moves ``v`` by its own size."""
    return dict(
        optimizer=keras.optimizers.AdamW(1e-2, weight_decay=0.01, epsilon=epsilon),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["sparse_categorical_accuracy"],
        weighted_metrics=[],  # (explicit: keras_hub's tasks would add their own to the unsplit model's)
        jit_compile=False,
    )


def llama(case, **pipeline_args):
    """A rotary-embedding decoder with untied embeddings: its token embedding (a ``ReversibleEmbedding``) looks up
    on the first stage and, as ``reverse_embeddings``, is the last stage's head."""

    def make():
        return tiny_llama(VOCAB, DIM)

    padding = (tokens != 0).astype("int32")
    x = {"token_ids": tokens, "padding_mask": padding}
    return compare(
        case, make, adamw_lm, x, shifted(tokens), tolerance=(5e-5, 1e-5), **{"num_microbatches": 4, **pipeline_args}
    )


def shared_chunks(case):
    """The bubble-closing schedules on language models (issue 49): the token embedding called on the first and the
    last virtual stage. Under ZB-V both are chunks of rank 0 (one weight, two chunks: summed on the rank); under
    interleaved 1F1B they are on the first and the last rank (summed over the ranks). Llama's untied embedding
    (two weights of one layer) and GPT-2's tied one (one weight, looked up and projected with), with AdamW and
    Adam: each weight's gradient reaches the optimizer in the form Keras' step gives it."""
    # (two ranks and four split the four runs between them: each schedule and each embedding on some rank count; the
    # default suite's two ranks the tied embedding in rank 0's two chunks under ZB-V)
    runs = [(llama, "interleaved-1f1b"), (gpt2, "zb-v")] if SIZE <= 2 else [(llama, "zb-v"), (gpt2, "interleaved-1f1b")]
    for make, schedule in runs:
        make(f"{case} {make.__name__} {schedule}", schedule=schedule)


def mixtral(case):
    """A mixture of experts (top-2 routing over 4 experts), untied embeddings.

    Without the router's load-balancing loss: it is a product of two means over the batch's tokens, which no sum
    over micro-batches gives (as batch normalization's statistics); with it, every rank warns at the first batch,
    naming each layer that adds it (keras_pipe.engine.probe.batch_loss_notes)."""

    def make(router_aux_loss_coef=0.0):
        backbone = keras_hub.models.MixtralBackbone(
            vocabulary_size=VOCAB,
            num_layers=2,
            num_query_heads=2,
            num_key_value_heads=1,
            hidden_dim=DIM,
            intermediate_dim=16,
            num_experts=4,
            top_k=2,
            router_aux_loss_coef=router_aux_loss_coef,
        )
        return keras_hub.models.MixtralCausalLM(backbone=backbone, preprocessor=None)

    padding = (tokens != 0).astype("int32")
    # (atol 1e-5: the routed experts' sums of micro-batch-sized products round apart by up to 5.3e-6 on logits near
    # zero where TensorFlow runs Eigen's kernels, not oneDNN's: an AVX2 processor; 2e-6 held on oneDNN's)
    inputs = {"token_ids": tokens, "padding_mask": padding}
    compare(case, make, adamw_lm, inputs, shifted(tokens), tolerance=(2e-5, 1e-5), num_microbatches=4)

    # with the router's loss: a warning naming each decoder layer, on every rank, at the first batch
    keras.utils.set_random_seed(11)
    model = PipelineModel.from_model(make(router_aux_loss_coef=0.02))  # (keras_hub's default)
    model.compile(**adamw_lm())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit({"token_ids": tokens, "padding_mask": padding}, shifted(tokens), batch_size=16, epochs=1, verbose=0)
    notes = [str(w.message) for w in caught if "not a mean over the batch's rows" in str(w.message)]
    assert [n.split()[0] for n in notes] == ["'transformer_layer_0'", "'transformer_layer_1'"], notes


def vit(case):
    """A vision transformer: its position embedding looks up fixed ids (no batch axis), so the whole batch's
    sparse gradient has one slice per position where micro-batches have one each."""

    def make():
        backbone = keras_hub.models.ViTBackbone(
            image_shape=(8, 8, 3),
            patch_size=4,
            num_layers=2,
            num_heads=2,
            hidden_dim=DIM,
            mlp_dim=32,
        )
        return keras_hub.models.ViTImageClassifier(backbone=backbone, num_classes=3, preprocessor=None)

    images = np.random.default_rng(5).normal(size=(48, 8, 8, 3)).astype("float32")
    # (logits to 1e-4: on a host whose oneDNN kernels differ from CI's, AVX-512 with BF16 and VNNI, three of the
    # 144 trained logits differed by up to 3.9e-5 from the unsplit model's, the weights within their tolerance)
    compare(case, make, adamw_lm, images, classes, tolerance=(1e-4, 5e-5), num_microbatches=4)

    # With its preprocessor (resize and rescale, which keras_hub's own fit() applies): refused on every rank, as a
    # pipeline would feed the network the images as given.
    converter = keras_hub.layers.ViTImageConverter(image_size=(8, 8), scale=1 / 255.0)
    task = make()
    task.preprocessor = keras_hub.models.ViTImageClassifierPreprocessor(image_converter=converter)
    try:
        PipelineModel.from_model(task)
        raise AssertionError("a task with a preprocessor was pipelined")
    except ValueError as error:
        assert "holds a preprocessor (ViTImageClassifierPreprocessor)" in str(error), error


def t5(case):
    """An encoder-decoder: the token embedding shared by the encoder and the decoder (two stages looking it up),
    relative position buckets looked up with ids known without the batch; a Dense head."""

    def make():
        inner = keras_hub.models.T5Backbone(
            vocabulary_size=VOCAB,
            num_layers=2,
            num_heads=2,
            hidden_dim=DIM,
            intermediate_dim=32,
            dropout=0.0,
        )
        logits = keras.layers.Dense(VOCAB, name="lm_head")(inner.output["decoder_sequence_output"])
        return keras.Model(inner.input, logits)

    padding = (tokens != 0).astype("int32")
    x = {
        "encoder_token_ids": tokens,
        "encoder_padding_mask": padding,
        "decoder_token_ids": tokens,
        "decoder_padding_mask": padding,
    }
    compare(case, make, lambda: adamw_lm(epsilon=1e-4), x, shifted(tokens), num_microbatches=4)


CASES = {
    "encoder": encoder,
    "decoder": decoder,
    "gpt2": gpt2,
    "bert": bert,
    "bert_two_outputs": lambda case: bert(case, both_only=True),
    "chunked": chunked,
    "shared_chunks": shared_chunks,
    "llama": llama,
    "mixtral": mixtral,
    "vit": vit,
    "t5": t5,
}
for name in sys.argv[1:] or list(CASES):
    started = time.perf_counter()
    CASES[name](name)
    print(f"HUB OK {name} rank {RANK} ({time.perf_counter() - started:.1f} s)", flush=True)
