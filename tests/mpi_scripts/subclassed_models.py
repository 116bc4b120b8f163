"""Subclassed Keras models and layers for tests/test_subclassed.py and subclassed.py (no MPI at import).

The question the project was born from wrote its model as subclassed
``keras.Model``s (``Block``, ``Net``, narrower here); the others are a
ResNet-style model (residual adds in ``call``), a keras_hub layer inside a
subclassed model, and models whose ``call()`` cannot be traced: each of
those is refused, and the line it is refused at is marked ``# REFUSED``.
"""

import keras
import numpy as np
import tensorflow as tf

L = keras.layers


class Block(keras.Model):
    def __init__(self, width=16, **kwargs):
        super().__init__(**kwargs)
        self.d1 = L.Dense(width, activation="relu")
        self.d2 = L.Dense(width, activation="relu")

    def call(self, x):
        return self.d2(self.d1(x))


class Net(keras.Model):
    """The question's model: an input layer, four residual blocks, a head."""

    def __init__(self, width=16, blocks=4, classes=3, **kwargs):
        super().__init__(**kwargs)
        self.inp = L.Dense(width, activation="relu")
        self.blocks = [Block(width) for _ in range(blocks)]
        self.head = L.Dense(classes, activation="softmax")

    def call(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def blocks_model(features=12, width=16, classes=3):
    """The question's model as three subclassed blocks in a Functional model (each block expanded)."""
    inputs = keras.Input((features,))
    x = L.Dense(width, activation="relu")(inputs)
    for _ in range(3):
        x = x + Block(width)(x)
    return keras.Model(inputs, L.Dense(classes, activation="softmax")(x))


class ResidualUnit(keras.layers.Layer):
    def __init__(self, channels, **kwargs):
        super().__init__(**kwargs)
        self.conv1 = L.Conv2D(channels, 3, padding="same", activation="relu")
        self.conv2 = L.Conv2D(channels, 3, padding="same")
        self.norm = L.LayerNormalization()

    def call(self, x):
        return keras.ops.relu(self.norm(x + self.conv2(self.conv1(x))))


class ResNet(keras.Model):
    """ResNet-style: a stem, residual units (adds in call), pooling, a head."""

    def __init__(self, channels=8, units=3, classes=3, **kwargs):
        super().__init__(**kwargs)
        self.stem = L.Conv2D(channels, 3, padding="same", activation="relu")
        self.units = [ResidualUnit(channels) for _ in range(units)]
        self.pool = L.GlobalAveragePooling2D()
        self.head = L.Dense(classes, activation="softmax")

    def call(self, images):
        x = self.stem(images)
        for unit in self.units:
            x = unit(x)
        return self.head(self.pool(x))


class HubClassifier(keras.Model):
    """Token ids through an embedding, two keras_hub TransformerEncoders, pooling, a head."""

    def __init__(self, vocabulary=40, width=16, classes=3, **kwargs):
        import keras_hub

        super().__init__(**kwargs)
        self.embed = L.Embedding(vocabulary, width)
        self.encoders = [keras_hub.layers.TransformerEncoder(32, 2, dropout=0.0) for _ in range(2)]
        self.pool = L.GlobalAveragePooling1D()
        self.head = L.Dense(classes, activation="softmax")

    def call(self, tokens):
        x = self.embed(tokens)
        for encoder in self.encoders:
            x = encoder(x)
        return self.head(self.pool(x))


class TensorIf(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d = L.Dense(3)

    def call(self, x):
        if keras.ops.sum(x) > 0:  # REFUSED
            return self.d(x)
        return self.d(-x)


class RawTf(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d = L.Dense(3)

    def call(self, x):
        return tf.nn.softmax(self.d(x))  # REFUSED


class Mutates(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d = L.Dense(3)

    def call(self, x):
        y = self.d(x)
        self.last_output = y  # REFUSED
        return y


class Appends(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d = L.Dense(3)
        self.seen = []

    def call(self, x):  # REFUSED (no one line: the list is compared before and after)
        self.seen.append(x)
        return self.d(x)


class Counts(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d = L.Dense(3)
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="calls")

    def call(self, x):
        self.calls.assign_add(1.0)  # REFUSED
        return self.d(x)


class TrainingBranch(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d = L.Dense(3)
        self.noise = L.GaussianNoise(0.1)

    def call(self, x, training=None):
        if training:
            x = self.noise(x)
        return self.d(x)


class PythonRandom(keras.Model):
    """Traces (a Python number is a constant of the graph), but the real call draws another each time."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d = L.Dense(3)

    def call(self, x):
        return self.d(x) * float(np.random.uniform(1.0, 2.0))


class OpaqueStack(keras.layers.Layer):
    """A composite layer whose call runs a raw tf op: kept whole, with a note in the summary."""

    def __init__(self, width=16, **kwargs):
        super().__init__(**kwargs)
        self.inner = [L.Dense(width, activation="relu") for _ in range(3)]

    def call(self, x):
        for layer in self.inner:
            x = layer(x)
        return tf.identity(x)

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.inner[-1].units)


class Stack(keras.layers.Layer):
    """A composite layer whose call traces: expanded where it holds more than a stage's share."""

    def __init__(self, width=16, depth=4, **kwargs):
        super().__init__(**kwargs)
        self.inner = [L.Dense(width, activation="relu") for _ in range(depth)]

    def call(self, x):
        for layer in self.inner:
            x = x + layer(x)
        return x


def stack_model(layer, features=12, width=16, classes=3):
    inputs = keras.Input((features,))
    x = L.Dense(width, activation="relu")(inputs)
    return keras.Model(inputs, L.Dense(classes, activation="softmax")(layer(x)))


def vit_classifier(layers=2, width=16):
    """keras_hub's ViT as hub.py builds it: its ViTEncoder holds every transformer block."""
    import keras_hub

    backbone = keras_hub.models.ViTBackbone(
        image_shape=(8, 8, 3), patch_size=4, num_layers=layers, num_heads=2, hidden_dim=width, mlp_dim=32
    )
    return keras_hub.models.ViTImageClassifier(backbone=backbone, num_classes=3, preprocessor=None)
