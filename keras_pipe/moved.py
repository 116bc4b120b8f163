"""The module paths of earlier releases: one table, each old path importing its new module with a DeprecationWarning.

keras_pipe 0.3 put its modules in packages, one a layer, and
``PipelineTimeline`` beside the other Keras-facing code. A script that
imports an old path still gets the module it names, and a warning saying
where its names are now; the old paths go in 0.4 (CHANGELOG.md).

Example:

```python
from keras_pipe.cost import choose_num_stages   # DeprecationWarning: ... keras_pipe.schedules.cost
```
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old path: (the module it now is, where its public names are imported from since 0.3)
MOVED = {
    "keras_pipe.timeline": ("keras_pipe.model.timeline", "keras_pipe (PipelineTimeline)"),
    "keras_pipe.engine.timeline": ("keras_pipe.model.timeline", "keras_pipe (PipelineTimeline)"),
    "keras_pipe.tracing": ("keras_pipe.engine.tracing", "keras_pipe (SpanRecorder, Tracer)"),
    "keras_pipe.schedule": ("keras_pipe.schedules", "keras_pipe.schedules"),
    "keras_pipe.cost": ("keras_pipe.schedules.cost", "keras_pipe.schedules"),
    "keras_pipe.layout": ("keras_pipe.mpi.layout", "keras_pipe.mpi (Layout)"),
    "keras_pipe.devices": ("keras_pipe.mpi.devices", "keras_pipe.mpi (choose_gpu)"),
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path of :data:`MOVED` and loads its new module."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new, names = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} is {new} since keras_pipe 0.3, and goes in 0.4: import its names from {names}.",
            DeprecationWarning,
            stacklevel=2,  # (the line that imports: warnings skips importlib's own frames)
        )
        module = importlib.import_module(new)  # (the module itself: what one name sets, the other sees)
        spec.loader_state = module.__spec__  # (importlib sets the old path's spec on it: exec_module puts this back)
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # (already executed, under its new name)


def install() -> None:
    """Lets the old paths import; once.

    First among the finders: it answers only for the table's paths, none of
    which is a file (tests/test_old_paths.py), and a finder before it (an
    editable install's, a stale copy of 0.2 elsewhere on the path) could
    otherwise find an old alias module.
    """
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
