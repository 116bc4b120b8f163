"""The process-wide lifecycle: what keras_pipe sets up once, and when.

Importing keras_pipe communicates with no other rank. It sizes
TensorFlow's thread pools from the launcher's environment (see
:mod:`keras_pipe.mpi.threads`), as that must happen before TensorFlow's first
op. :func:`init` installs the failure hook that ends the whole job when any
rank raises; the first ``PipelineModel`` calls it, and a script may call it
first thing to cover its own first lines too.
"""

from __future__ import annotations

from keras_pipe.mpi.failure import install_excepthook
from keras_pipe.mpi.threads import configure_threads


def init() -> None:
    """Prepares this process for keras_pipe (idempotent, no communication).

    Sizes TensorFlow's thread pools if the launcher says how many ranks
    share the host (and it was not done at import), and makes an uncaught
    exception on this rank abort every rank of the job, naming this one.

    Example:

    ```python
    import keras_pipe
    keras_pipe.init()      # first thing in the script: any later error ends the whole job
    ```
    """
    configure_threads(warn=False)
    install_excepthook()
