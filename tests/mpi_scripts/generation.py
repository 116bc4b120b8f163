"""``generate()`` on pipelined keras_hub causal language models, against the unsplit model's on the same weights.

Run as ``mpirun -n P python generation.py [CASE ...]``; prints ``GENERATE OK
<case>`` per rank and case. Every model is small, built from constructor
arguments on every rank with the same seed (nothing is downloaded); the
unsplit model's ``generate()`` runs on every rank (a few milliseconds). Each
comparison is of keras_hub's whole output (``token_ids`` and
``padding_mask``), with prompts of different lengths in one batch. Cases:

``families``: greedy decoding of GPT-2, Llama, Mistral and Gemma
(``more_families``: Falcon, GPT-NeoX, Llama 3, Mixtral, Qwen3, Qwen-MoE, Qwen3-MoE, GPT-OSS and SmolLM3;
``each_call``: GPT-2, Llama, Gemma, Phi-3, OPT and Bloom, each way a family's
pieces are called; ``like_llama``: Mistral and Qwen) with the default number of groups (what differs between families is
how their pieces are called; the loop is the same); then GPT-2 with one
group, and Llama with a stop token taken from its greedy output (row 0
stops early, others run on) and ``strip_prompt=True``. ``sampling``: a
seeded top-k sampler on GPT-2, twice in a row (the seed generator's state
carries over as in the unsplit model), and a seeded top-p one on Llama. ``lora``: a Llama backbone with LoRA
enabled, its LoRA kernels non-zero. ``callback``: ``generate()`` from a
callback's ``on_epoch_end`` during ``fit``, against the unsplit model given
the pipeline's trained weights. ``refused``: a family not checked (a subclass of a checked one), a
placement that goes back to an earlier rank (ZB-V) and a beam sampler, each
refused on every rank. ``dataset``: prompts given as a batched ``tf.data.Dataset``
(keras_hub generates batch by batch and joins the outputs). ``int8``: a Llama
backbone quantized to int8 (``backbone.quantize("int8")``) before the pipeline is
made. ``replicas``: ``num_stages`` half the ranks (two replicas: on two ranks, one
stage each), each replica generating its share of the batch, every rank returning the unsplit model's
tokens: greedy, with stop tokens that end one replica's rows before the other's, and seeded top-k; prompts
that differ between the replicas are refused on every rank. ``seq2seq``: BART and T5 (encoder once, then the decoder
token by token with its self- and cross-attention caches; T5's relative position bias travelling between the ranks)
greedy and with a stop token, T5's seeded top-k, and a T5 made inside ``unallocated()`` whose last rank holds every
weight (``seq2seq_more``: BART's seeded top-k, T5 with its head untied).
"""

import sys

import keras
import keras_hub
import numpy as np
import tensorflow as tf
from common import RANK, SIZE

import keras_pipe
from keras_pipe import PipelineModel
from keras_pipe.errors import PipelineConfigError

VOCAB, LENGTH, DIM = 48, 12, 16
LAYERS = max(3, SIZE)  # (every stage holds a decoder layer)
rng = np.random.default_rng(3)
prompt_lengths = np.array([3, 6, 2, 5, 4, 7, 3])
prompts = rng.integers(1, VOCAB, size=(len(prompt_lengths), LENGTH)).astype("int32")
prompt_mask = np.arange(LENGTH)[None, :] < prompt_lengths[:, None]
prompts[~prompt_mask] = 0  # padded at the end, as keras_hub's preprocessors pad


def inputs():
    return {"token_ids": prompts.copy(), "padding_mask": prompt_mask.copy()}


# Each family tiny, from constructor arguments: its backbone's and causal LM's class names and its own arguments
COMMON = dict(vocabulary_size=VOCAB, num_layers=LAYERS, hidden_dim=DIM, intermediate_dim=32)
GROUPED = dict(num_query_heads=2, num_key_value_heads=1)
FAMILIES = {
    "gpt2": ("GPT2", dict(num_heads=2, dropout=0.0, max_sequence_length=LENGTH)),
    "llama": ("Llama", GROUPED),
    "mistral": ("Mistral", dict(GROUPED, sliding_window=LENGTH)),
    "gemma": ("Gemma", dict(GROUPED, head_dim=8)),
    "qwen": ("Qwen", GROUPED),
    "phi3": ("Phi3", GROUPED),
    "opt": ("OPT", dict(num_heads=2, dropout=0.0, max_sequence_length=LENGTH)),
    "bloom": ("Bloom", dict(num_heads=2)),
    "falcon": ("Falcon", dict(num_attention_heads=2)),
    "gpt_neox": ("GPTNeoX", dict(num_heads=2, max_sequence_length=LENGTH)),
    "llama3": ("Llama3", GROUPED),
    "mixtral": ("Mixtral", dict(GROUPED, num_experts=4, top_k=2, sliding_window=LENGTH)),
    "qwen3": ("Qwen3", dict(GROUPED, head_dim=8)),
    "qwen_moe": (
        "QwenMoe",
        dict(GROUPED, moe_intermediate_dim=16, shared_expert_intermediate_dim=16, num_experts=4, top_k=2),
    ),
    "qwen3_moe": ("Qwen3Moe", dict(GROUPED, head_dim=8, moe_intermediate_dim=16, num_experts=4, top_k=2)),
    "gpt_oss": ("GptOss", dict(GROUPED, num_experts=4, top_k=2, head_dim=8, sliding_window=LENGTH)),
    "smollm3": (
        "SmolLM3",
        dict(
            num_attention_heads=2,
            num_key_value_heads=1,
            attention_bias=False,
            attention_dropout=0.0,
            rope_layer_enabled_list=([True, False] * LAYERS)[:LAYERS],
            layer_types=["attention"] * LAYERS,
            mlp_bias=False,
            layer_norm_epsilon=1e-6,
            max_position_embeddings=LENGTH,
            rope_theta=10000.0,
            partial_rotary_factor=1.0,
        ),
    ),
}


def family(name):
    """A function that makes family ``name``'s causal LM (``preprocessor=None``: tokens in, tokens out)."""
    prefix, arguments = FAMILIES[name]

    def make():
        backbone = getattr(keras_hub.models, f"{prefix}Backbone")(**COMMON, **arguments)
        return getattr(keras_hub.models, f"{prefix}CausalLM")(backbone=backbone, preprocessor=None)

    make.__name__ = name
    return make


gpt2, llama, mistral, gemma, qwen, phi3, opt, bloom, *others = (family(name) for name in FAMILIES)


def pair(make, sampler="greedy", prepare=None, **pipeline):
    """The unsplit model and a pipeline of a second one with the same weights (``prepare`` runs on both)."""
    made = []
    for _ in range(2):
        keras.utils.set_random_seed(5)
        task = make()
        if prepare is not None:
            prepare(task)
        task.compile(sampler=sampler() if callable(sampler) else sampler)
        made.append(task)
    reference, handed_in = made
    return reference, PipelineModel.from_model(handed_in, **pipeline)


def same(actual, expected, what):
    assert sorted(actual) == sorted(expected), (what, sorted(actual))
    for key in expected:
        a, b = np.asarray(actual[key]), np.asarray(expected[key])
        assert a.dtype == b.dtype, (RANK, what, key, a.dtype, b.dtype)
        assert np.array_equal(a, b), f"rank {RANK}: {what} {key}\n{a}\n{b}"


def families(case, makes=(gpt2, llama, mistral, gemma)):
    for make in makes:
        reference, model = pair(make)
        expected = reference.generate(inputs(), stop_token_ids=None)
        same(model.generate(inputs(), stop_token_ids=None), expected, f"{make.__name__} greedy")
        if make is gpt2:
            same(model.generate(inputs(), stop_token_ids=None, num_groups=1), expected, f"{make.__name__} 1 group")
        if make is llama:  # a stop token that row 0 generates early; the rows without it run to the end
            stop = [int(expected["token_ids"][0, prompt_lengths[0] + 1])]
            expected = reference.generate(inputs(), stop_token_ids=stop, strip_prompt=True)
            actual = model.generate(inputs(), stop_token_ids=stop, strip_prompt=True)
            same(actual, expected, f"{make.__name__} stop")
            assert not expected["padding_mask"][0].all(), expected  # (row 0 did stop)


def sampling(case):
    """A seeded top-k sampler on GPT-2, twice in a row (the seed generator's state carries over), top-p on Llama."""
    runs = [
        (gpt2, lambda: keras_hub.samplers.TopKSampler(k=5, seed=7), 2),
        (llama, lambda: keras_hub.samplers.TopPSampler(p=0.9, seed=7), 1),
    ]
    for make, sampler, calls in runs:
        reference, model = pair(make, sampler)
        for call in range(calls):
            expected = reference.generate(inputs(), stop_token_ids=None)
            actual = model.generate(inputs(), stop_token_ids=None, num_groups=3)
            same(actual, expected, f"{make.__name__} {type(reference.sampler).__name__} call {call}")


def lora(case):
    def enable(task):
        task.backbone.enable_lora(2)
        for variable in task.backbone.weights:  # (LoRA's B kernels start at zero: give them values)
            if "lora_kernel_b" in variable.path:
                variable.assign(np.random.default_rng(1).normal(0, 0.5, variable.shape).astype("float32"))

    reference, model = pair(llama, prepare=enable)
    assert any("lora" in v.path for v in model.trainable_variables) or not model.trainable_variables
    same(model.generate(inputs(), stop_token_ids=None), reference.generate(inputs(), stop_token_ids=None), "lora")


def callback(case):
    reference, model = pair(gpt2)
    seen = []

    class Generating(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(self.model.generate(inputs(), stop_token_ids=None))
            reference.set_weights(self.model.get_weights())  # (collective, as generate is)
            same(seen[-1], reference.generate(inputs(), stop_token_ids=None), f"callback epoch {epoch}")

    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    x = inputs()
    targets = np.concatenate([prompts[:, 1:], np.zeros((len(prompts), 1), "int32")], axis=1)
    model.fit(x, targets, batch_size=len(prompts), epochs=2, verbose=0, callbacks=[Generating()])
    assert len(seen) == 2 and not np.array_equal(seen[0]["token_ids"], seen[1]["token_ids"]), seen


def refused(case):
    def refuses(call, words):
        try:
            call()
        except PipelineConfigError as error:
            assert words in str(error), error
        else:
            raise AssertionError(f"rank {RANK}: not refused: {words}")

    class OwnLlama(keras_hub.models.LlamaCausalLM):  # (a subclass may call its pieces otherwise: not checked)
        pass

    keras.utils.set_random_seed(5)
    backbone = keras_hub.models.LlamaBackbone(**COMMON, **GROUPED)
    model = PipelineModel.from_model(OwnLlama(backbone=backbone, preprocessor=None))
    refuses(lambda: model.generate(inputs(), stop_token_ids=None), "this pipeline's model is a OwnLlama")
    reference, model = pair(gpt2, lambda: keras_hub.samplers.BeamSampler(num_beams=2))
    refuses(lambda: model.generate(inputs(), stop_token_ids=None), "the task's sampler is a BeamSampler")
    if SIZE > 1:
        keras.utils.set_random_seed(5)
        model = PipelineModel.from_model(gpt2(), schedule="zb-v")
        refuses(lambda: model.generate(inputs(), stop_token_ids=None), "Cut the model with one chunk a rank")


def dataset(case):
    reference, model = pair(gpt2)
    prompts_in = tf.data.Dataset.from_tensor_slices(inputs()).batch(3)  # (batches of 3, 3 and 1)
    same(model.generate(prompts_in, stop_token_ids=None), reference.generate(prompts_in, stop_token_ids=None), case)


def int8(case):
    reference, model = pair(llama, prepare=lambda task: task.backbone.quantize("int8"))
    assert any(v.dtype == "int8" for v in reference.weights), [v.dtype for v in reference.weights]
    same(model.generate(inputs(), stop_token_ids=None), reference.generate(inputs(), stop_token_ids=None), case)


def replicas(case):
    """Two replicas, each generating its share of the batch (rows 0-3 and 4-6), every rank returning all of it."""
    reference, model = pair(gpt2, num_stages=max(1, SIZE // 2))
    assert model.engine.num_replicas == SIZE // model.engine.num_stages == 2, model.engine.num_replicas
    expected = reference.generate(inputs(), stop_token_ids=None)
    same(model.generate(inputs(), stop_token_ids=None), expected, case)
    # Stop tokens that end replica 0's rows first (each one's first new token): it goes on writing tokens into its
    # finished rows, as the unsplit model's loop does, until replica 1's rows are done too.
    stop = sorted({int(expected["token_ids"][row, prompt_lengths[row]]) for row in range(4)})
    expected = reference.generate(inputs(), stop_token_ids=stop)
    assert not expected["padding_mask"][:4, -1].any() and expected["padding_mask"][4:, -1].any(), expected
    same(model.generate(inputs(), stop_token_ids=stop), expected, f"{case} stop")
    same(
        model.generate(inputs(), stop_token_ids=[int(prompts[0, 0])]),
        reference.generate(inputs(), stop_token_ids=[int(prompts[0, 0])]),
        f"{case} prompt token",
    )
    # Seeded top-k, twice (the seed generator's state carries over on every replica)
    reference, model = pair(gpt2, lambda: keras_hub.samplers.TopKSampler(k=5, seed=7), num_stages=max(1, SIZE // 2))
    for call in range(2):
        expected = reference.generate(inputs(), stop_token_ids=None)
        same(model.generate(inputs(), stop_token_ids=None), expected, f"{case} top-k call {call}")
    # Every rank must give the same prompts: one replica's differ, an error on every rank
    changed = inputs()
    if model.engine.replica == 1:
        changed["token_ids"][0, 0] += 1
    try:
        model.generate(changed, stop_token_ids=None)
    except PipelineConfigError as error:
        assert "the replicas were given different prompts" in str(error), error
    else:
        raise AssertionError("different prompts on the replicas were not refused")


def seq2seq(case, more=False):
    """BART and T5 (encoder once, decoder by token): greedy and a stop token, T5's seeded top-k, T5 made inside
    unallocated(), against the unsplit model; ``more``: BART's seeded top-k and T5's untied head instead."""
    encoder_lengths = np.array([5, 9, 3, 10, 7, 2, 6])
    encoder_mask = np.arange(10)[None, :] < encoder_lengths[:, None]
    encoder_ids = np.where(encoder_mask, rng_bart.integers(1, VOCAB, size=encoder_mask.shape), 0).astype("int32")

    def bart_inputs():
        return {
            "encoder_token_ids": encoder_ids.copy(),
            "encoder_padding_mask": encoder_mask.copy(),
            "decoder_token_ids": prompts.copy(),
            "decoder_padding_mask": prompt_mask.copy(),
        }

    both = dict(num_layers=LAYERS, num_heads=2, hidden_dim=DIM, intermediate_dim=32, dropout=0.0)

    def bart():
        backbone = keras_hub.models.BartBackbone(vocabulary_size=VOCAB, max_sequence_length=LENGTH, **both)
        return keras_hub.models.BartSeq2SeqLM(backbone=backbone, preprocessor=None)

    def t5(tied=True, vocabulary=VOCAB):
        backbone = keras_hub.models.T5Backbone(vocabulary_size=vocabulary, tie_embedding_weights=tied, **both)
        return keras_hub.models.T5Seq2SeqLM(backbone=backbone, preprocessor=None)

    def t5_untied():
        return t5(tied=False)

    def strong_bias(task):
        """Each stack's relative position bias made large (as trained T5's are, next to its tiny initial one), so
        that a layer given none in its place (the bias not travelling between the ranks) changes the tokens."""
        if isinstance(task, keras_hub.models.T5Seq2SeqLM):
            backbone = task.backbone
            for k, layer in enumerate([backbone.encoder_transformer_layers[0], backbone.decoder_transformer_layers[0]]):
                table = layer.self_attention.relative_attention_bias
                table.assign(np.random.default_rng(k).normal(0.0, 4.0, table.shape).astype(table.dtype))

    # (on two ranks the balanced cut puts each stack whole on one rank: T5's cut inside its decoder, so that the
    # decoder's bias travels, in the prefill and at each step; on three and four ranks both stacks' biases travel)
    inside = dict(split_before=["transformer_decoder_layer_1"]) if SIZE == 2 else {}

    def top_k(make, cut):
        reference, model = pair(make, lambda: keras_hub.samplers.TopKSampler(k=5, seed=7), strong_bias, **cut)
        for call in range(2):
            expected = reference.generate(bart_inputs(), stop_token_ids=None)
            actual = model.generate(bart_inputs(), stop_token_ids=None, num_groups=2)
            same(actual, expected, f"{case} {make.__name__} top-k {call}")

    if more:  # (BART's seeded top-k; T5's head without the tied embedding's scaling)
        top_k(bart, {})
        reference, model = pair(t5_untied, prepare=strong_bias, **inside)
        expected = reference.generate(bart_inputs(), stop_token_ids=None)
        same(model.generate(bart_inputs(), stop_token_ids=None), expected, f"{case} t5 untied greedy")
        return
    for make in (bart, t5):
        name = make.__name__
        cut = inside if make is t5 else {}
        reference, model = pair(make, prepare=strong_bias, **cut)
        expected = reference.generate(bart_inputs(), stop_token_ids=None)
        same(model.generate(bart_inputs(), stop_token_ids=None), expected, f"{case} {name} greedy")
        stop = [int(expected["decoder_token_ids"][0, prompt_lengths[0] + 1])]
        expected = reference.generate(bart_inputs(), stop_token_ids=stop)
        same(model.generate(bart_inputs(), stop_token_ids=stop), expected, f"{case} {name} stop")
        assert not expected["decoder_padding_mask"][0].all(), expected  # (row 0 did stop)
    top_k(t5, inside)  # (the bias at each step of a seeded draw: greedy tokens of a tiny model barely depend on it)

    # T5 made inside unallocated(), its vocabulary wide and its layers small: the balanced cut gives the last rank
    # every weight (the token embedding tied to the head) and the first the embedding alone, so one rank has all
    # its weights allocated and the others not; the ranks must still take one path (they once waited on each other)
    def t5_wide():
        task = t5(vocabulary=4000)
        task.compile(sampler="greedy")
        return task

    keras.utils.set_random_seed(5)
    expected = t5_wide().generate(bart_inputs(), stop_token_ids=None)
    keras.utils.set_random_seed(5)
    with keras_pipe.unallocated():
        wide = t5_wide()
    model = PipelineModel.from_model(wide)
    same(model.generate(bart_inputs(), stop_token_ids=None), expected, f"{case} t5 unallocated")


rng_bart = np.random.default_rng(4)

CASES = {
    "seq2seq": seq2seq,
    "seq2seq_more": lambda case: seq2seq(case, more=True),
    "families": families,
    # (keras_hub's other families with a call_with_cache of these shapes: Falcon's and GPT-NeoX's own cache keyword
    # or embedding, the rest called as Llama is)
    "more_families": lambda case: families(case, others),
    # (each way a family's pieces are called: GPT-2's, Llama's, Gemma's embedding and cache, Phi-3's cache, OPT's
    # embedding; Mistral and Qwen call theirs as Llama does)
    "each_call": lambda case: families(case, (gpt2, llama, gemma, phi3, opt, bloom)),
    "like_llama": lambda case: families(case, (mistral, qwen)),
    "sampling": sampling,
    "lora": lora,
    "callback": callback,
    "refused": refused,
    "dataset": dataset,
    "int8": int8,
    "replicas": replicas,
}
if __name__ == "__main__":
    for name in sys.argv[1:] or list(CASES):
        CASES[name](name)
        print(f"GENERATE OK {name} rank {RANK}", flush=True)
