"""Running a command whose processes torch may abort at exit, after their work is done."""

from __future__ import annotations

import subprocess
from typing import Any

from tests.fallbacks import FALLBACK

#: What torch 2.14 prints when, rarely, it aborts a gloo process at interpreter exit, after the
#: script's last line ran (a joinable C++ thread destroyed; pytorch/pytorch#179291).
TEARDOWN_ABORT = "terminate called without an active exception"


def run_to_a_clean_exit(
    command: list[str], finished: str, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """Returns ``subprocess.run(command, ...)``'s result (text, output captured), run again up
    to twice when it printed ``finished`` and then hit torch's teardown abort: the caller still
    asserts a clean exit, which one run in three must reach. Fails if the facade fell back to
    an eager step (``tests/fallbacks.py``)."""
    for _ in range(3):
        done = subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)
        if done.returncode == 0 or not (finished in done.stdout and TEARDOWN_ABORT in done.stderr):
            break
    assert FALLBACK not in done.stderr, done.stderr[-3000:]  # a compiled step ran eagerly
    return done
