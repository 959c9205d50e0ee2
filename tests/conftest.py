import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from tests.fallbacks import watching

# Two cores: keep torch from oversubscribing them (pytest-xdist's workers share them), and
# hypothesis fast but meaningful.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _WORKERS))
settings.register_profile(
    "fp16fx",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# HYPOTHESIS_PROFILE=thorough: many more examples, for a soak before a release.
settings.register_profile("thorough", parent=settings.get_profile("fp16fx"), max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fp16fx"))


# The slowest files first (measured on 2 cores; each holds multi-process or compile-heavy
# runs): pytest-xdist hands a worker the next file as it frees, so a slow file collected last
# would run alone at the end while the other worker idles.
SLOWEST_FILES = (
    "test_train_distributed.py",
    "test_examples.py",
    "test_precision.py",
    "test_train.py",
    "test_fsdp.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = {name: place for place, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(SLOWEST_FILES)))  # stable


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _compiled_steps_stay_compiled(request):
    """Fails a test in which an FP16_Optimizer fell back to stepping eagerly because
    torch.compile failed (``tests/fallbacks.py``). A test that means to fall back is marked
    ``compile_fallback``."""
    with watching() as fallbacks:
        yield fallbacks
    if fallbacks.messages and request.node.get_closest_marker("compile_fallback") is None:
        pytest.fail(f"the facade stepped eagerly: {fallbacks.messages[0]}")
