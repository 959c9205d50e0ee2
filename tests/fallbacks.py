"""Watching for the facade's fall back to an eager step.

When ``torch.compile`` fails, ``FP16_Optimizer`` logs "torch.compile failed ...; stepping
eagerly" and carries on, so a test of its compiled step would pass on the eager one. The
suite's fixture (``conftest.py``), its spawned ranks (``test_distributed._entry``) and its
subprocesses (``processes.run_to_a_clean_exit``, ``test_examples.run_example``) fail on that
warning instead."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

#: What the facade's warning says; a subprocess test finds it on the child's stderr (Python's
#: last-resort handler, or ``fp16fx train``'s own, prints it there).
FALLBACK = "torch.compile failed"


class CompileFallbacks(logging.Handler):
    """Collects the fallback warnings of the ``fp16fx`` loggers while installed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("fp16fx") and FALLBACK in record.getMessage():
            self.messages.append(record.getMessage())


@contextlib.contextmanager
def watching() -> Iterator[CompileFallbacks]:
    """Yields a :class:`CompileFallbacks` installed on the root logger, which the ``fp16fx``
    logger's records reach. (Not on that logger itself: ``fp16fx train`` adds its own
    handler there only if it has none, and would take this one for the program's.)"""
    handler = CompileFallbacks()
    logger = logging.getLogger()
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
