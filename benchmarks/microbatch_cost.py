"""What a micro-batch's rows cost: one stage's forward and backward at several micro-batch sizes, per row.

    python benchmarks/microbatch_cost.py                       # 4 x Dense(1024), one thread
    python benchmarks/microbatch_cost.py --width 2048 --layers 2 --rows 8 16 64 256

A pipeline cuts each batch into ``m`` micro-batches, and every micro-batch's
forward and input gradient read the stage's weights again: with small
micro-batches the matrix products are thin, and the work proportional to the
weights (reading them, packing them for the product, each program's call)
is paid ``2 m`` times a step where ``Sequential`` pays it twice. This script
times that on this machine: one stage (``--layers`` x ``Dense(--width)``,
relu, as the balanced chain of ``throughput.py`` puts on each of two ranks),
each program compiled with XLA and as a plain graph, called on
micro-batches of each ``--rows``; rounds alternate the configurations and
the median is shown. "per row vs largest" is the cost of a row against its
cost in the largest micro-batch: what cutting a batch into micro-batches of
that size multiplies the stage's compute by.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    parser.add_argument("--threads", type=int, default=1, help="TensorFlow's intra-op threads (a rank's share)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=50, help="calls timed per configuration and round")
    args = parser.parse_args()

    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    weights = [tf.Variable(tf.random.normal((args.width, args.width)) * 0.03) for _ in range(args.layers)]

    def forward(x):
        for w in weights:
            x = tf.nn.relu(tf.matmul(x, w))
        return x

    def forward_backward(x, g):
        # (the output's gradient is an argument, as the pipeline's backward receives it: a constant one,
        # ones_like say, would be folded into the program by XLA, which is not what the pipeline runs)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = forward(x)
        return tape.gradient(y, [x] + weights, output_gradients=g)

    programs = {}
    for pass_name, function, operands in (("forward", forward, 1), ("forward+backward", forward_backward, 2)):
        for compiler, jit in (("XLA", True), ("graph", False)):
            traced = tf.function(function, jit_compile=jit, autograph=False)
            for rows in args.rows:
                given = [tf.random.normal((rows, args.width)) for _ in range(operands)]
                concrete = traced.get_concrete_function(*given)
                concrete(*given)  # compile and warm up
                programs[(pass_name, compiler, rows)] = (concrete, given)

    times = {key: [] for key in programs}
    for _ in range(args.rounds):
        for key, (concrete, given) in programs.items():
            began = time.perf_counter()
            for _ in range(args.calls):
                result = concrete(*given)
            tf.nest.flatten(result)[0].numpy()
            times[key].append((time.perf_counter() - began) / args.calls)

    weight_mib = args.layers * args.width * args.width * 4 / 2**20
    print(
        f"one stage: {args.layers} x Dense({args.width}), relu; {weight_mib:.0f} MiB of weights; "
        f"{args.threads} thread(s); median of {args.rounds} alternated rounds of {args.calls} calls"
    )
    print(f"{'pass':<18} {'compiler':<8} {'rows':>6} {'ms per call':>12} {'us per row':>11} {'per row vs largest':>19}")
    largest = max(args.rows)
    for (pass_name, compiler, rows), spent in times.items():
        median = statistics.median(spent)
        per_row = median / rows
        reference = statistics.median(times[(pass_name, compiler, largest)]) / largest
        print(
            f"{pass_name:<18} {compiler:<8} {rows:>6} {1e3 * median:12.2f} {1e6 * per_row:11.1f} "
            f"{per_row / reference:18.2f}x"
        )


if __name__ == "__main__":
    main()
