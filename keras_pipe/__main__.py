"""``python -m keras_pipe script.py [args]``: a script run with MPI started and failures handled before its first line.

Under ``mpirun -n P python -m keras_pipe train.py`` every rank starts MPI and
installs keras_pipe's failure hook (see :mod:`keras_pipe.mpi.failure`) before
``train.py`` runs: an error anywhere in the script, its first line
included, ends the whole job within seconds, naming the rank. Run as plain
``python train.py``, a rank that fails before it starts MPI (before
``import keras_pipe`` or ``from mpi4py import MPI``) leaves the other ranks
inside ``MPI_Init`` under MPICH: those that started MPI through ``import
keras_pipe`` end after the start timeout (:mod:`keras_pipe.mpi.start`), those
whose script imported ``mpi4py`` first wait until the launcher is stopped.
(``python -m mpi4py`` does not start MPI before the script either.)

Example:

```
mpirun -n 4 python -m keras_pipe train.py --epochs 3
```
"""

from __future__ import annotations

import os
import runpy
import sys

import keras_pipe  # noqa: F401 - MPI and the failure hook, then TensorFlow


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        sys.stderr.write("usage: python -m keras_pipe script.py [arguments ...]\n")
        sys.exit(2)
    script = argv[0]
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
