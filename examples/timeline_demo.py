"""Record one training step of a pipeline and draw it.

    mpirun -n 3 python examples/timeline_demo.py --schedule 1f1b --out timeline_1f1b.json
    mpirun -n 4 python examples/timeline_demo.py --num-stages 2 --out timeline_2x2.json   # 2 replicas

Rank 0 writes the Chrome trace (open it in https://ui.perfetto.dev) and a PNG
Gantt chart beside it, and prints the measured and theoretical bubble.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_pipe import (
    PipelineModel,  # noqa: E402
    PipelineTimeline,  # noqa: E402
)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--schedule", default="1f1b", choices=["1f1b", "gpipe", "zb-h1", "auto", "interleaved-1f1b", "zb-v"]
    )
    parser.add_argument("--microbatches", type=int, default=6)
    parser.add_argument("--num-stages", type=int, default=None, help="stages per pipeline (replicas: ranks / stages)")
    parser.add_argument("--out", default="timeline.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * 6, 256)).astype("float32")
    y = rng.integers(0, 10, size=len(x))
    layers = [keras.Input((256,))] + [keras.layers.Dense(512, activation="relu") for _ in range(6)]
    model = PipelineModel(
        layers + [keras.layers.Dense(10)],
        num_microbatches=args.microbatches,
        schedule=args.schedule,
        num_stages=args.num_stages,
    )
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[PipelineTimeline(args.out, steps=[3, 4])])


if __name__ == "__main__":
    main()
