"""Writing files so that a failure part way leaves the previous file intact.

Everything keras_pipe writes (``save``, ``save_weights``, and through them
``ModelCheckpoint`` and ``BackupAndRestore``) is written beside the target,
under a hidden name with the same suffix (Keras checks it), and renamed over
the target only once complete: ``os.replace`` is atomic on POSIX and
Windows within one filesystem. An exception, a full disk, a file-size limit
or a killed rank 0 part way through leaves the previous file as it was, and
loadable. A temporary file left by a killed writer is removed by the next
successful write of the same target.

A directory (``model.export``'s SavedModel) is written the same way; an
existing one is moved aside, the new one renamed into its place, and the old
one removed: between the two renames the path briefly does not exist.

Remote paths (``gs://``, ``s3://``...) have no rename: they are written in place.

Example:

```python
with atomic_path("model.keras") as temporary:
    sequential.save(temporary)      # "model.keras" changes only if this completes
```
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil

# Keras decides a file's format by its suffix: keep the longest one it knows.
_SUFFIXES = (".weights.h5", ".weights.json", ".keras", ".h5", ".json")
_MARK = ".keras_pipe-partial-"


def suffix_of(filepath: str) -> str:
    """The suffix Keras reads the format from.

    >>> suffix_of("out/model.weights.h5")
    '.weights.h5'
    >>> suffix_of("model.keras")
    '.keras'
    """
    name = os.path.basename(filepath)
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return suffix
    return os.path.splitext(name)[1]


def partial_path(filepath: str, pid: int | None = None) -> str:
    """Where ``filepath`` is written before it is complete: hidden, beside it, with its suffix.

    >>> partial_path("out/model.keras", pid=7)
    'out/.model.keras_pipe-partial-7.keras'
    """
    return _partial(filepath, str(os.getpid() if pid is None else pid))


def _partial(filepath, writer: str) -> str:
    directory, name = os.path.split(os.fspath(filepath))
    suffix = suffix_of(name)
    stem = name[: len(name) - len(suffix)] if suffix else name
    return os.path.join(directory, f".{stem}{_MARK}{writer}{suffix}")


def is_remote(filepath) -> bool:
    return "://" in os.fspath(filepath)


@contextlib.contextmanager
def atomic_path(filepath):
    """Yields the path to write; the write replaces ``filepath`` only if the block completes."""
    filepath = os.fspath(filepath)
    if is_remote(filepath):
        yield filepath
        return
    temporary = partial_path(filepath)
    try:
        yield temporary
        _replace(temporary, filepath)
    except BaseException:
        _remove(temporary)
        raise
    for stale in glob.glob(_partial(glob.escape(filepath), "*")):
        _remove(stale)  # left by a writer that was killed


def _replace(temporary: str, filepath: str) -> None:
    """``os.replace``; a directory over a directory: the old one moved aside first, then removed."""
    if os.path.isdir(temporary) and os.path.isdir(filepath):
        aside = _partial(filepath, f"old-{os.getpid()}")
        os.replace(filepath, aside)
        os.replace(temporary, filepath)
        _remove(aside)
    else:
        os.replace(temporary, filepath)


def _remove(path: str) -> None:
    """Removes a file or a directory tree, if there."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.remove(path)


def write_text(filepath, text: str) -> None:
    """Writes ``text`` to ``filepath`` atomically (local paths) or in place (remote ones)."""
    from keras_pipe import compat

    with atomic_path(filepath) as temporary, compat.file_utils().File(temporary, "w") as f:
        f.write(text)


def copy(source, destination) -> None:
    """Copies ``source`` over ``destination`` atomically (local paths)."""
    from keras_pipe import compat

    with atomic_path(destination) as temporary:
        compat.file_utils().copy(source, temporary)


def describe_unreadable(filepath, error: BaseException) -> str:
    """Why a file could not be read, saying whether it exists: Keras says "File not found" for a damaged file.

    >>> describe_unreadable("/nonexistent/m.keras", OSError("x"))
    '/nonexistent/m.keras does not exist (OSError: x)'
    """
    filepath = os.fspath(filepath)
    cause = f"{type(error).__name__}: {error}"
    if is_remote(filepath):
        return cause
    if not os.path.exists(filepath):
        return f"{filepath} does not exist ({cause})"
    if os.path.isdir(filepath):
        return f"{filepath} is a directory, not a {suffix_of(filepath) or 'model'} file ({cause})"
    size = os.path.getsize(filepath)
    if size and _looks_whole(filepath):
        return f"{filepath}: {cause}"
    what = "is empty" if size == 0 else f"exists ({size} bytes) but is not a readable {suffix_of(filepath)} file"
    return (
        f"{filepath} {what}: it may have been written only in part (by a version of keras_pipe or Keras that "
        f"does not write atomically), or be another kind of file. Keras said: {cause}"
    )


def _looks_whole(filepath: str) -> bool:
    """Whether the file is a complete zip archive (a ``.keras`` file); HDF5 files have no such check."""
    import zipfile

    return suffix_of(filepath) == ".keras" and zipfile.is_zipfile(filepath)
