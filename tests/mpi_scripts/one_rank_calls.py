"""A collective method called on some ranks only fails at once, naming the method.

Usage: one_rank_calls.py TMPDIR save|different.
``save``: rank 0 alone calls ``model.save`` (the Horovod idiom) while the
others finish their script; ``different``: rank 0 calls ``evaluate`` while
the others call ``predict``. Rank 0 prints ``SAVING AT <time.time()>`` before
its ``save``, for the test to measure from.
"""

import sys
import time

from common import RANK, compile_args, data, layers

from keras_pipe import PipelineModel, RankMismatchError

tmp, mode = sys.argv[1], sys.argv[2]
x, y, _ = data(n=64)
model = PipelineModel(layers(), num_microbatches=2)
model.compile(**compile_args())
model.fit(x, y, batch_size=32, epochs=1, verbose=0)

if mode == "save":
    if RANK == 0:
        print(f"SAVING AT {time.time()}", flush=True)
        model.save(f"{tmp}/model.keras")  # raises at once: the other ranks finished their script
    print(f"rank {RANK} reached the end", flush=True)
else:
    try:
        if RANK == 0:
            model.evaluate(x, y, verbose=0)
        else:
            model.predict(x, verbose=0)
    except RankMismatchError as error:
        print(f"MISMATCH rank {RANK}: {error}", flush=True)
print(f"ONE RANK CALLS done rank {RANK}", flush=True)
