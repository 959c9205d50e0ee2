import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Two cores: keep torch from oversubscribing them, and hypothesis fast but meaningful.
torch.set_num_threads(min(2, os.cpu_count() or 1))
settings.register_profile(
    "fp16fx",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# HYPOTHESIS_PROFILE=thorough: many more examples, for a soak before a release.
settings.register_profile("thorough", parent=settings.get_profile("fp16fx"), max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fp16fx"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
