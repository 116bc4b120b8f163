"""Imported at start-up by every rank the tests launch (``tests/mpi.py`` puts this directory on ``PYTHONPATH``).

``import keras`` imports scikit-learn (for ``keras.wrappers``) and matplotlib
(for ``keras.visualization``) whenever they are installed, and the test extra
installs both (the demo reads scikit-learn's digits; the timeline draws with
matplotlib). No script in ``tests/mpi_scripts`` uses either, yet each rank
paid for importing them: about 1.1 s of CPU a rank in a four-rank launch
(17 against 21.5 s for the launch's start), some 180 s of a suite's CPU over
its ~170 ranks (docs/suite_time.md). Here they are not
importable, as on a machine without them, which Keras supports (both are
optional to it). The examples the tests launch (``examples/``) keep them.
"""

import sys

BLOCKED = ("sklearn", "matplotlib")


class _NotForTestRanks:
    """A finder that refuses the blocked packages with an error saying why."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(
                f"{name} is not importable in the ranks the tests launch (tests/site/sitecustomize.py: they start "
                "faster without it); launch the script from examples/ or drop it from BLOCKED if a test needs it",
                name=name,
            )
        return None


sys.meta_path.insert(0, _NotForTestRanks())
