"""Internal: what ``schedule="auto"`` needs to time candidates that cut the model differently.

ZB-V holds two chunks a rank, placed in a V (rank 0 holds the first and the
last of ``2P`` virtual stages); 1F1B and ZB-H1 hold one stage a rank. To
time both kinds on this job, the engine holds both cuts for the first
training step (:class:`keras_pipe.engine.picking.SchedulePicking`): its
timing steps are not training steps, so each runs with a copy of the
optimizer (:func:`timing_optimizer`) and, when the timing ends, every
variable this rank held is put back as it was (:class:`Snapshot`). The
weights the other cut places on another rank travel there once, from the
rank that holds them (:func:`move_weights`); when the pick is made, each
rank frees what the picked cut does not place on it.

The same job, ``schedule="1f1b"`` against ``"zb-v"``, gives the same
weights to round-off (each is exact against ``keras.Sequential``), so
which one ``"auto"`` picks changes the speed, never the training.
"""

from __future__ import annotations

import keras
import numpy as np

from keras_pipe import compat


def timing_optimizer(optimizer):
    """A fresh optimizer of ``optimizer``'s class and configuration: the timing steps update with it.

    Its update costs what the user's does; the user's own optimizer is built
    only once the pick is made, on the variables the picked cut places here.
    One that cannot be made from its configuration (a custom class without
    ``from_config``) is timed with plain SGD: the schedules' differences,
    not the update, decide the pick.
    """
    try:
        return optimizer.__class__.from_config(optimizer.get_config())
    except Exception:  # (a user's class: its configuration is its own)
        return keras.optimizers.SGD()


class Snapshot:
    """The values of some variables (the allocated ones), to put back after the timing steps."""

    def __init__(self, layers):
        seen = set()
        self.values = []
        for layer in layers:
            for variable in layer.variables:
                if id(variable) in seen or compat.unallocated(variable):
                    continue
                seen.add(id(variable))
                self.values.append((variable, np.array(variable.numpy())))

    def restore(self) -> None:
        for variable, value in self.values:
            variable.assign(value)


def move_weights(pipeline, units: dict, owners: dict, holders: dict, stage: int) -> None:
    """Each unit's variables, from the pipeline rank that holds them, to the ranks that hold them next (collective).

    ``units``: name to layer, in the graph's order (the same on every rank);
    ``owners``: each unit's rank now; ``holders``: the set of ranks that
    hold it next (allocated there already). A unit that stays is not sent.
    """
    for unit, layer in units.items():
        owner, receivers = owners[unit], holders[unit] - {owners[unit]}
        if not receivers:
            continue
        for variable in layer.variables:
            if stage == owner:
                array = np.asarray(variable.numpy())
            else:
                array = np.empty(tuple(variable.shape), np.dtype(variable.dtype))
            array = pipeline.bcast_array(array, root=owner)
            if stage in receivers and compat.unallocated(variable):  # (released: a model handed in built)
                compat.allocate_with(variable, array)
            elif stage in receivers:
                variable.assign(array)
