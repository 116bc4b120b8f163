"""Tracing: the one hook through which the executor reports what it spends its time on.

The executor calls ``tracer.span(name, microbatch, start, end)`` after each
piece of a step (a forward, a backward, a send, a wait for a receive, the
optimizer update, ...), with ``time.perf_counter()`` times; ``microbatch`` is
``-1`` for work of the whole step. No tracer, no cost: the executor checks
for ``None`` first. :class:`~keras_pipe.model.timeline.PipelineTimeline` and the
benchmarks use :class:`SpanRecorder`.

Example:

```python
recorder = SpanRecorder()
model.tracer = recorder
model.train_on_batch(x, y)
model.tracer = None
print(recorder.spans[:3])  # [(name, step, microbatch, start, end), ...]
```
"""

from __future__ import annotations

from typing import Protocol


class Tracer(Protocol):
    """Anything with this method can be set as ``PipelineModel.tracer``."""

    def span(self, name: str, step: int, microbatch: int, start: float, end: float) -> None: ...


class SpanRecorder:
    """Keeps every span as a tuple ``(name, step, microbatch, start, end)``."""

    def __init__(self):
        self.spans: list[tuple] = []

    def span(self, name: str, step: int, microbatch: int, start: float, end: float) -> None:
        self.spans.append((name, step, microbatch, start, end))

    def take(self) -> list[tuple]:
        """The spans recorded so far, forgetting them."""
        spans, self.spans = self.spans, []
        return spans
