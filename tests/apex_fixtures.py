"""Stand-ins for apex's loss-scaler classes, for writing apex-era checkpoints in tests.

The classes carry apex's module paths, so ``torch.save`` pickles them by those names; the fake
``apex.*`` modules exist in ``sys.modules`` only inside :func:`fake_apex`, so every load in a
test happens with apex not importable.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

APEX_MODULES = (
    "apex",
    "apex.amp",
    "apex.amp.scaler",
    "apex.fp16_utils",
    "apex.fp16_utils.loss_scaler",
)


def apex_class(module: str, name: str) -> type:
    """Returns an empty class that pickles as ``module.name``."""
    return type(name, (), {"__module__": module, "__qualname__": name})


AMP_SCALER = apex_class("apex.amp.scaler", "LossScaler")
LEGACY_DYNAMIC = apex_class("apex.fp16_utils.loss_scaler", "DynamicLossScaler")
LEGACY_STATIC = apex_class("apex.fp16_utils.loss_scaler", "LossScaler")
NOT_A_SCALER = apex_class("apex.amp.scaler", "Evil")


def instance(cls: type, **attrs) -> object:
    """Returns an instance of ``cls`` holding ``attrs``, as unpickling an apex object would."""
    obj = object.__new__(cls)
    obj.__dict__.update(attrs)
    return obj


@contextlib.contextmanager
def fake_apex() -> Iterator[None]:
    """Makes the stand-ins picklable by their apex paths, for the duration only."""
    assert not any(name in sys.modules for name in APEX_MODULES)
    modules = {name: types.ModuleType(name) for name in APEX_MODULES}
    for cls in (AMP_SCALER, LEGACY_DYNAMIC, LEGACY_STATIC, NOT_A_SCALER):
        setattr(modules[cls.__module__], cls.__qualname__, cls)
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name in APEX_MODULES:
            del sys.modules[name]
    assert importlib.util.find_spec("apex") is None


def save(obj: object, path, **torch_save_args: Any) -> None:
    """``torch.save`` with the apex stand-ins importable."""
    with fake_apex():
        torch.save(obj, path, **torch_save_args)
