"""Tests for loading apex FP16_Optimizer checkpoints safely, without apex installed.

Fixtures are written with fake ``apex.*`` modules registered in ``sys.modules`` only while
``torch.save`` runs; every load happens after they are removed, so apex is never importable.
"""

from __future__ import annotations

import builtins
import io
import math
import os
import pickle
import re
import subprocess

import numpy as np
import pytest
import torch

from fp16fx.apex_checkpoint import ApexCheckpointError, apex_scaler_to_dict, load_apex_checkpoint
from tests.apex_fixtures import (
    AMP_SCALER,
    LEGACY_DYNAMIC,
    LEGACY_STATIC,
    NOT_A_SCALER,
    instance,
    save,
)


def amp_scaler() -> object:
    return instance(
        AMP_SCALER, _loss_scale=2.0**13, dynamic=True, _unskipped=17, _scale_seq_len=2000,
        _max_loss_scale=2.0**24, _min_loss_scale=None, _has_overflow=False,
        _overflow_buf=torch.zeros(1, dtype=torch.int32),
    )  # fmt: skip


def apex_state_dict(scaler: object) -> dict:
    """An FP16_Optimizer.state_dict() as apex builds it: SGD with momentum over FP32 masters."""
    torch.manual_seed(0)
    masters = [torch.nn.Parameter(torch.randn(3, 2)), torch.randn(4).requires_grad_()]
    sgd = torch.optim.SGD(masters, lr=0.1, momentum=0.9)
    for m in masters:
        m.grad = torch.ones_like(m)
    sgd.step()
    return {
        "loss_scaler": scaler,
        "dynamic_loss_scale": True,
        "overflow": False,
        "first_closure_call_this_step": True,
        "optimizer_state_dict": sgd.state_dict(),
        "fp32_from_fp16": [masters],
    }


def assert_rest_of_state_matches(loaded: dict, original: dict) -> None:
    for key in ("dynamic_loss_scale", "overflow", "first_closure_call_this_step"):
        assert loaded[key] is original[key]
    for got, want in zip(loaded["fp32_from_fp16"][0], original["fp32_from_fp16"][0], strict=True):
        assert got.dtype == torch.float32 and torch.equal(got, want)
    opt, want_opt = loaded["optimizer_state_dict"], original["optimizer_state_dict"]
    assert opt["param_groups"] == want_opt["param_groups"]
    for i in (0, 1):
        got, want = opt["state"][i]["momentum_buffer"], want_opt["state"][i]["momentum_buffer"]
        assert torch.equal(got, want)


def test_amp_era_checkpoint_loads_with_scaler_as_plain_dict(tmp_path):
    original = apex_state_dict(amp_scaler())
    save(original, tmp_path / "amp.pt")
    loaded = load_apex_checkpoint(tmp_path / "amp.pt")
    assert loaded["loss_scaler"] == {
        "format": "apex.amp",
        "loss_scale": 8192.0,
        "dynamic": True,
        "unskipped": 17,
        "scale_window": 2000,
        "min_loss_scale": None,
        "max_loss_scale": 2.0**24,
        "has_overflow": False,
    }
    assert_rest_of_state_matches(loaded, original)


def test_amp_checkpoint_from_before_apex_had_a_scale_floor_loads(tmp_path):
    """apex's amp scaler had no ``_min_loss_scale`` until June 2019: no floor."""
    scaler = amp_scaler()
    del scaler._min_loss_scale
    save(apex_state_dict(scaler), tmp_path / "early.pt")
    loaded = load_apex_checkpoint(tmp_path / "early.pt")
    assert loaded["loss_scaler"]["min_loss_scale"] is None
    assert loaded["loss_scaler"]["loss_scale"] == 8192.0


@pytest.mark.parametrize("protocol", [0, 1])
@pytest.mark.parametrize("zipped", [True, False])
def test_a_protocol_0_or_1_pickle_is_refused_for_its_protocol(tmp_path, protocol, zipped):
    """The weights-only unpickler reads neither protocol: the files of apex's own era (torch's
    legacy format) fail on an opcode, the zipped ones on copyreg's global."""
    path = tmp_path / "old.pt"
    args = dict(pickle_protocol=protocol, _use_new_zipfile_serialization=zipped)
    save(apex_state_dict(amp_scaler()), path, **args)
    with pytest.raises(ApexCheckpointError, match="pickled with protocol 0 or 1"):
        load_apex_checkpoint(path)
    with open(path, "rb") as file, pytest.raises(ApexCheckpointError, match="protocol 0 or 1"):
        load_apex_checkpoint(file)
    offset = io.BytesIO(b"HDR" + path.read_bytes())
    offset.read(3)  # torch.load reads from here
    with pytest.raises(ApexCheckpointError, match="protocol 0 or 1"):
        load_apex_checkpoint(offset)


def test_other_files_and_named_globals_are_not_taken_for_old_protocols(tmp_path):
    """Only a torch checkpoint's own pickle tells its protocol: a JSON or gzip file is no
    checkpoint, and a protocol 1 pickle that names a global is refused by that name."""
    for name, content in {"a.json": b'{"epoch": 3}', "a.gz": b"\x1f\x8b\x08\x00"}.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ApexCheckpointError, match="not an apex FP16_Optimizer"):
            load_apex_checkpoint(tmp_path / name)
    save(apex_state_dict(Malicious(os.system, ("true",))), tmp_path / "m.pt", pickle_protocol=1)
    with pytest.raises(ApexCheckpointError, match="names the global") as info:
        load_apex_checkpoint(tmp_path / "m.pt")
    assert info.value.global_name is not None and "system" in info.value.global_name


def test_legacy_dynamic_checkpoint_loads(tmp_path):
    scaler = instance(
        LEGACY_DYNAMIC, cur_scale=2.0**20, cur_iter=4321, last_overflow_iter=4000,
        scale_factor=2.0, scale_window=1000,
    )  # fmt: skip
    original = apex_state_dict(scaler)
    save(original, tmp_path / "legacy.pt")
    loaded = load_apex_checkpoint(str(tmp_path / "legacy.pt"))
    assert loaded["loss_scaler"] == {
        "format": "apex.fp16_utils.dynamic",
        "loss_scale": 2.0**20,
        "dynamic": True,
        "cur_iter": 4321,
        "last_overflow_iter": 4000,
        "scale_factor": 2.0,
        "scale_window": 1000,
    }
    assert_rest_of_state_matches(loaded, original)


def test_legacy_static_checkpoint_loads_from_a_file_object():
    original = apex_state_dict(instance(LEGACY_STATIC, cur_scale=128))
    original["dynamic_loss_scale"] = False
    buffer = io.BytesIO()
    save(original, buffer)
    buffer.seek(0)
    loaded = load_apex_checkpoint(buffer, map_location="cpu")
    assert loaded["loss_scaler"] == {
        "format": "apex.fp16_utils.static",
        "loss_scale": 128.0,
        "dynamic": False,
    }
    assert type(loaded["loss_scaler"]["loss_scale"]) is float
    assert_rest_of_state_matches(loaded, original)


def test_a_scaler_that_underflowed_to_zero_leaves_the_rest_of_the_file_readable(tmp_path):
    """apex amp's scale, with no floor, could underflow to 0 in a diverging run: the whole
    file was once refused ("not a positive scale"), the model's weights in it with it. The
    optimizer's load judges the scale (test_facade_checkpoint)."""
    scaler = amp_scaler()
    scaler._loss_scale = 0.0
    weights = {"w": torch.randn(3)}
    save({"model": weights, "optimizer": apex_state_dict(scaler)}, tmp_path / "diverged.pt")
    loaded = load_apex_checkpoint(tmp_path / "diverged.pt")
    assert torch.equal(loaded["model"]["w"], weights["w"])
    assert loaded["optimizer"]["loss_scaler"]["loss_scale"] == 0.0


def test_scalers_nested_in_a_training_checkpoint_are_converted(tmp_path):
    checkpoint = {"epoch": 3, "optimizer": apex_state_dict(amp_scaler()), "extra": [amp_scaler()]}
    save(checkpoint, tmp_path / "train.pt")
    loaded = load_apex_checkpoint(tmp_path / "train.pt")
    assert loaded["epoch"] == 3
    assert loaded["optimizer"]["loss_scaler"]["format"] == "apex.amp"
    assert loaded["extra"][0]["loss_scale"] == 8192.0


def test_loading_leaves_torch_safe_globals_unchanged(tmp_path):
    before = torch.serialization.get_safe_globals()
    save(apex_state_dict(amp_scaler()), tmp_path / "ok.pt")
    save({"loss_scaler": instance(NOT_A_SCALER)}, tmp_path / "bad.pt")
    load_apex_checkpoint(tmp_path / "ok.pt")
    with pytest.raises(ApexCheckpointError):
        load_apex_checkpoint(tmp_path / "bad.pt")
    assert torch.serialization.get_safe_globals() == before
    with pytest.raises(pickle.UnpicklingError, match=re.escape("apex.amp.scaler.LossScaler")):
        torch.load(tmp_path / "ok.pt", weights_only=True)  # not allowed outside the loader


class Malicious:
    """Pickles as a call of ``func(*args)``, which an unsafe load would run."""

    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _payloads(marker: str):
    return {
        f"{os.system.__module__}.system": (os.system, (f"touch {marker}",)),
        "builtins.exec": (builtins.exec, (f"open({marker!r}, 'w').close()",)),
        "subprocess.call": (subprocess.call, (["touch", marker],)),
    }


@pytest.mark.parametrize("global_name", sorted(_payloads("m")))
def test_malicious_checkpoint_is_refused_and_never_executed(tmp_path, global_name):
    marker = tmp_path / "pwned"
    func, args = _payloads(str(marker))[global_name]
    path = tmp_path / "evil.pt"
    save(apex_state_dict(Malicious(func, args)), path)
    with pytest.raises(ApexCheckpointError) as info:
        load_apex_checkpoint(path)
    assert info.value.global_name == global_name
    assert global_name in str(info.value)
    assert "not an apex FP16_Optimizer checkpoint" in str(info.value)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the fixture really is an exploit ...
    assert marker.exists()  # ... so the refusal above is what kept it from running


class Unrelated:
    """A harmless class that has no business in an apex checkpoint."""


@pytest.mark.parametrize(
    ("obj", "name"),
    [
        (Unrelated(), f"{Unrelated.__module__}.Unrelated"),
        (instance(NOT_A_SCALER), "apex.amp.scaler.Evil"),
    ],
)
def test_unrelated_class_is_refused_by_name(tmp_path, obj, name):
    save(apex_state_dict(obj), tmp_path / "other.pt")
    with pytest.raises(ApexCheckpointError, match=re.escape(name) + ".*not an apex FP16_Optimizer"):
        load_apex_checkpoint(tmp_path / "other.pt")


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nowhere.pt"
    with pytest.raises(FileNotFoundError, match=re.escape(str(path))):
        load_apex_checkpoint(path)


def test_a_file_that_is_no_torch_checkpoint_is_refused_by_name(tmp_path):
    """Text, an empty file and a truncated checkpoint once raised torch.load's own KeyError,
    EOFError and RuntimeError; a text-mode file or bytes, an AssertionError or
    AttributeError."""
    save(apex_state_dict(amp_scaler()), tmp_path / "whole.pt")
    files = {
        "text.pt": b"epoch 3, loss 0.25\n",
        "empty.pt": b"",
        "truncated.pt": (tmp_path / "whole.pt").read_bytes()[:100],
    }
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ApexCheckpointError, match=re.escape(name) + ".*(not a torch|could)"):
            load_apex_checkpoint(tmp_path / name)
    text_mode = open(tmp_path / "whole.pt")  # noqa: SIM115 -- closed below
    with pytest.raises(TypeError, match=r"binary mode \('rb'\)"):
        load_apex_checkpoint(text_mode)
    text_mode.close()
    with pytest.raises(TypeError, match="a path or a file"):
        load_apex_checkpoint((tmp_path / "whole.pt").read_bytes())
    with open(tmp_path / "whole.pt", "rb") as file:  # once called no torch checkpoint
        stream = io.BufferedReader(Unseekable(file.read()))
    with pytest.raises(TypeError, match=r"expects a seekable file .* io\.BytesIO first"):
        load_apex_checkpoint(stream)


class Unseekable(io.RawIOBase):
    """A stream read from start to end, as a pipe or a socket is."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        chunk = self._data.read(len(buffer))
        buffer[: len(chunk)] = chunk
        return len(chunk)


def test_a_non_dict_checkpoint_is_refused(tmp_path):
    save([amp_scaler()], tmp_path / "list.pt")
    with pytest.raises(ApexCheckpointError, match="list, not a dict"):
        load_apex_checkpoint(tmp_path / "list.pt")


def test_scaler_state_with_dunder_attributes_is_refused(tmp_path):
    AMP_SCALER.__getstate__ = lambda self: {"__class__": "x", "_loss_scale": 1.0}
    try:
        save({"loss_scaler": instance(AMP_SCALER)}, tmp_path / "dunder.pt")
    finally:
        del AMP_SCALER.__getstate__
    with pytest.raises(ApexCheckpointError, match="not an apex FP16_Optimizer checkpoint"):
        load_apex_checkpoint(tmp_path / "dunder.pt")


def test_scaler_to_dict_reports_missing_or_bad_attributes():
    with pytest.raises(ApexCheckpointError, match="'last_overflow_iter'"):
        apex_scaler_to_dict(instance(LEGACY_DYNAMIC, cur_scale=2.0, cur_iter=1))
    with pytest.raises(ApexCheckpointError, match="not a number"):
        apex_scaler_to_dict(instance(LEGACY_STATIC, cur_scale="big"))
    # A counter that is no whole number once failed in Python's words, unnamed ("cannot
    # convert float NaN to integer"), or was truncated (2.5 read as 2).
    for count in (math.nan, math.inf, 2.5):
        legacy = instance(LEGACY_DYNAMIC, cur_scale=2.0, cur_iter=count, last_overflow_iter=0,
                          scale_factor=2.0, scale_window=5)  # fmt: skip
        with pytest.raises(ApexCheckpointError, match=r"'cur_iter' is .*, not a count"):
            apex_scaler_to_dict(legacy)
    huge = apex_scaler_to_dict(instance(LEGACY_STATIC, cur_scale=10**400))  # OverflowError once
    assert huge["loss_scale"] == math.inf  # which the optimizer's load refuses by name
    with pytest.raises(ApexCheckpointError, match="not an apex loss scaler"):
        apex_scaler_to_dict(Unrelated())


def test_scaler_to_dict_accepts_real_apex_classes_and_tensor_values():
    scaler = instance(LEGACY_STATIC, cur_scale=torch.tensor(64.0))
    assert apex_scaler_to_dict(scaler) == {
        "format": "apex.fp16_utils.static",
        "loss_scale": 64.0,
        "dynamic": False,
    }
    # numpy's numbers too (a numpy integer counter was once "not a number")
    legacy = instance(
        LEGACY_DYNAMIC, cur_scale=np.float32(4.0), cur_iter=np.int64(3),
        last_overflow_iter=np.int64(-1), scale_factor=2.0, scale_window=np.int32(5),
    )  # fmt: skip
    read = apex_scaler_to_dict(legacy)
    assert (read["loss_scale"], read["cur_iter"], read["scale_window"]) == (4.0, 3, 5)
    assert type(read["cur_iter"]) is int and type(read["loss_scale"]) is float
