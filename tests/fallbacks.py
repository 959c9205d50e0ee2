"""Watching for the facade's fall back to an eager step.

When ``torch.compile`` fails, ``FP16_Optimizer`` logs "torch.compile failed ...; stepping
eagerly" and carries on, so a test of its compiled step would pass on the eager one. The
suite's fixture (``conftest.py``) and its spawned ranks (``test_distributed._entry``) fail on
that warning instead."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


class CompileFallbacks(logging.Handler):
    """Collects the fallback warnings of the ``fp16fx`` logger while installed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "torch.compile failed" in record.getMessage():
            self.messages.append(record.getMessage())


@contextlib.contextmanager
def watching() -> Iterator[CompileFallbacks]:
    """Yields a :class:`CompileFallbacks` installed on the ``fp16fx`` logger."""
    handler = CompileFallbacks()
    logger = logging.getLogger("fp16fx")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
