"""A rank waiting 10 s for its neighbour must not burn a core (MPICH's Recv would)."""

import time

import numpy as np
from common import RANK

from keras_pipe.mpi.comm import TAG_ACTIVATION, Communicator

comm = Communicator()
comm.barrier()
if RANK == 0:
    time.sleep(10)
    comm.send(np.arange(12, dtype="float32").reshape(3, 4), dest=1, tag=TAG_ACTIVATION)
    comm.flush()
else:
    cpu, wall = time.process_time(), time.monotonic()
    array = comm.recv(0, TAG_ACTIVATION, (4,), "float32")
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    assert array.shape == (3, 4) and array[2, 3] == 11
    print(f"WAITED wall {wall:.2f} s cpu {cpu:.3f} s", flush=True)
comm.barrier()
