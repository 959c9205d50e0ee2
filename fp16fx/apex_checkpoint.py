"""Load checkpoints written by apex's ``FP16_Optimizer`` without apex and without running pickles.

apex's ``FP16_Optimizer.state_dict()`` stores its loss scaler as a pickled *object*, so a plain
``torch.load(..., weights_only=True)`` refuses the file and ``weights_only=False`` would run
whatever code the pickle names. ``load_apex_checkpoint`` takes the safe road: the weights-only
unpickler, with exactly three extra globals allowed -- the apex scaler class paths -- each mapped
to an inert stand-in class defined here that only stores attributes. Every other global the
file names is refused before anything is called.

How the mapping works (torch >= 2.5): ``torch.serialization.safe_globals`` accepts
``(obj, "module.qualname")`` pairs; the weights-only unpickler resolves a pickle's
``GLOBAL module name`` by looking the string ``"module.name"`` up among those pairs, builds the
object with ``cls.__new__(cls)`` (NEWOBJ) and hands the pickled attribute dict to
``__setstate__`` (BUILD). The stand-ins define that ``__setstate__`` to accept only a dict of
plain attribute names.
"""

from __future__ import annotations

import _compat_pickle
import io
import os
import pickle
import re
import zipfile
from typing import IO, Any

import torch

from fp16fx.saved_format import as_number

__all__ = ["ApexCheckpointError", "apex_scaler_to_dict", "load_apex_checkpoint"]


class ApexCheckpointError(pickle.UnpicklingError, ValueError):
    """The file is not a loadable apex FP16_Optimizer checkpoint (``global_name``: the culprit)."""

    def __init__(self, message: str, global_name: str | None = None) -> None:
        super().__init__(message)
        self.global_name = global_name


class _ApexScalerStandIn:
    """An inert holder for a pickled apex scaler's attributes; it has no behaviour at all."""

    apex_path = ""
    format = ""

    def __setstate__(self, state: object) -> None:
        if not isinstance(state, dict) or not all(
            isinstance(k, str) and k.isidentifier() and not k.startswith("__") for k in state
        ):
            raise ApexCheckpointError(
                f"the pickled state of {self.apex_path} is not a dict of attribute names; "
                "the file is not an apex FP16_Optimizer checkpoint"
            )
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"<stand-in for {self.apex_path} {self.__dict__}>"


class _AmpLossScaler(_ApexScalerStandIn):
    apex_path = "apex.amp.scaler.LossScaler"
    format = "apex.amp"


class _LegacyDynamicLossScaler(_ApexScalerStandIn):
    apex_path = "apex.fp16_utils.loss_scaler.DynamicLossScaler"
    format = "apex.fp16_utils.dynamic"


class _LegacyLossScaler(_ApexScalerStandIn):
    apex_path = "apex.fp16_utils.loss_scaler.LossScaler"
    format = "apex.fp16_utils.static"


_STAND_INS = (_AmpLossScaler, _LegacyDynamicLossScaler, _LegacyLossScaler)
_FORMAT_BY_PATH = {cls.apex_path: cls.format for cls in _STAND_INS}


def _attr(obj: object, name: str) -> Any:
    if not hasattr(obj, name):
        path = getattr(obj, "apex_path", None) or type(obj).__qualname__
        raise ApexCheckpointError(f"apex scaler {path} has no attribute {name!r}")
    return getattr(obj, name)


def _number(obj: object, name: str, kind: type[int] | type[float]) -> Any:
    """Returns the scaler's attribute ``name`` as a ``kind``: a float as it is (inf, NaN and
    0 too: the optimizer's load judges the numbers, by name), a counter only if it is a
    whole number."""
    value = _attr(obj, name)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    try:
        return as_number(value, kind)
    except TypeError:
        raise ApexCheckpointError(
            f"apex scaler attribute {name!r} is {value!r}, not a number"
        ) from None
    except ValueError:
        raise ApexCheckpointError(
            f"apex scaler attribute {name!r} is {value!r}, not a count"
        ) from None


def apex_scaler_to_dict(obj: object) -> dict[str, Any]:
    """Returns a plain dict describing an apex loss-scaler object (stand-in or real apex class).

    Schema (every value a Python primitive; attributes apex stored beyond these, such as amp's
    ``_overflow_buf`` tensor, are dropped):

    - all formats: ``"format"`` (str), ``"loss_scale"`` (float), ``"dynamic"`` (bool)
    - ``format == "apex.amp"`` (``apex.amp.scaler.LossScaler``) adds ``"unskipped"`` (int,
      clean steps since the last change), ``"scale_window"`` (int, from ``_scale_seq_len``),
      ``"min_loss_scale"`` (float, or None: no floor; apex before June 2019 kept none),
      ``"max_loss_scale"`` (float), ``"has_overflow"``
      (bool; False if absent); ``"dynamic"`` is the scaler's own flag.
    - ``format == "apex.fp16_utils.dynamic"`` (legacy ``DynamicLossScaler``) adds
      ``"cur_iter"``, ``"last_overflow_iter"``, ``"scale_window"`` (ints) and
      ``"scale_factor"`` (float); ``"dynamic"`` is True.
    - ``format == "apex.fp16_utils.static"`` (legacy ``LossScaler``): ``"dynamic"`` is False.

    Raises:
        ApexCheckpointError: ``obj`` is not an apex scaler, misses a required attribute, or
            holds a value that is not a number (or a counter that is not a whole number).
            The numbers themselves are judged where the dict is loaded
            (``FP16_Optimizer.load_state_dict``): a run whose scale underflowed to 0 still
            gives back the file's other entries, such as the model.
    """
    cls = type(obj)
    fmt = getattr(cls, "format", "") if issubclass(cls, _ApexScalerStandIn) else ""
    fmt = fmt or _FORMAT_BY_PATH.get(f"{cls.__module__}.{cls.__qualname__}", "")
    if fmt == "apex.amp":
        # amp's scaler had no floor until June 2019 (apex b82c6bd7): a checkpoint from before
        # lacks the attribute, which then means what None means.
        min_scale = getattr(obj, "_min_loss_scale", None)
        return {
            "format": fmt,
            "loss_scale": _number(obj, "_loss_scale", float),
            "dynamic": bool(_attr(obj, "dynamic")),
            "unskipped": _number(obj, "_unskipped", int),
            "scale_window": _number(obj, "_scale_seq_len", int),
            "min_loss_scale": None if min_scale is None else _number(obj, "_min_loss_scale", float),
            "max_loss_scale": _number(obj, "_max_loss_scale", float),
            "has_overflow": bool(getattr(obj, "_has_overflow", False)),
        }
    if fmt == "apex.fp16_utils.dynamic":
        return {
            "format": fmt,
            "loss_scale": _number(obj, "cur_scale", float),
            "dynamic": True,
            "cur_iter": _number(obj, "cur_iter", int),
            "last_overflow_iter": _number(obj, "last_overflow_iter", int),
            "scale_factor": _number(obj, "scale_factor", float),
            "scale_window": _number(obj, "scale_window", int),
        }
    if fmt == "apex.fp16_utils.static":
        return {"format": fmt, "loss_scale": _number(obj, "cur_scale", float), "dynamic": False}
    raise ApexCheckpointError(f"{cls.__module__}.{cls.__qualname__} is not an apex loss scaler")


def _replace_scalers(obj: Any, seen: set[int]) -> Any:
    """Returns ``obj`` with every stand-in scaler inside dicts/lists/tuples replaced by its dict."""
    if isinstance(obj, _ApexScalerStandIn):
        return apex_scaler_to_dict(obj)
    if id(obj) in seen or not isinstance(obj, (dict, list, tuple)):
        return obj
    seen.add(id(obj))
    if isinstance(obj, tuple):
        return tuple(_replace_scalers(v, seen) for v in obj)
    for key in obj.keys() if isinstance(obj, dict) else range(len(obj)):
        obj[key] = _replace_scalers(obj[key], seen)
    return obj


def _python3_name(name: str) -> str:
    """Returns the Python 3 path of a global as torch's error message spells it.

    torch drops the ``builtins.`` prefix (``GLOBAL eval``), and protocol-2 pickles write some
    modules under their Python 2 names (``commands.call`` for ``subprocess.call``).
    """
    if "." not in name:
        return f"builtins.{name}"
    module, attr = name.rsplit(".", 1)
    if (module, attr) in _compat_pickle.NAME_MAPPING:
        return ".".join(_compat_pickle.NAME_MAPPING[(module, attr)])
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{attr}"


def _refusal(err: pickle.UnpicklingError, source: object) -> ApexCheckpointError:
    """Returns the error to raise for a file the weights-only unpickler refused."""
    match = re.search(r"GLOBAL (\S+)", str(err))
    if match is None:
        return ApexCheckpointError(
            f"{source!r} could not be loaded safely; it is not an apex FP16_Optimizer "
            f"checkpoint (weights-only unpickler: {err})"
        )
    name = _python3_name(match.group(1))
    return ApexCheckpointError(
        f"{source!r} names the global {name}, which is not allowed: the file is not an apex "
        "FP16_Optimizer checkpoint, and it was not executed",
        global_name=name,
    )


#: How torch's legacy (unzipped) format begins when pickled with protocol 0 or 1: its magic
#: number, pickled (protocol 2 begins with PROTO, ``0x80``, instead).
_LEGACY_BEFORE_PROTOCOL_2 = pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=0)


def _pickled_before_protocol_2(source: str | os.PathLike[str] | IO[bytes], start: int) -> bool:
    """Whether ``source`` (a file object: from offset ``start``) is a torch checkpoint pickled
    with protocol 0 or 1: a zip archive whose ``data.pkl`` does not start with PROTO, or the
    legacy format begun by its magic number in those protocols' form."""
    try:
        if isinstance(source, (str, os.PathLike)):
            with open(source, "rb") as file:
                head = file.read(len(_LEGACY_BEFORE_PROTOCOL_2))
        else:
            source.seek(start)
            head = source.read(len(_LEGACY_BEFORE_PROTOCOL_2))
            source.seek(start)
        if head.startswith(b"PK"):  # a zip archive
            with zipfile.ZipFile(source) as archive:
                name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
                return archive.read(name)[:1] not in (b"", b"\x80")
    except (OSError, StopIteration, zipfile.BadZipFile, AttributeError):
        return False
    return head == _LEGACY_BEFORE_PROTOCOL_2


def _seekable(file: IO[bytes]) -> bool:
    seekable = getattr(file, "seekable", None)
    return seekable is None or bool(seekable())


def _tell(file: IO[bytes]) -> int:
    """Returns ``file``'s position (0 where it cannot tell: torch.load then refuses it)."""
    try:
        return file.tell()
    except (OSError, AttributeError):
        return 0


def load_apex_checkpoint(
    path_or_file: str | os.PathLike[str] | IO[bytes],
    map_location: Any = None,
) -> dict[str, Any]:
    """Returns an apex ``FP16_Optimizer`` checkpoint dict with its scaler as a plain dict.

    The file is read by ``torch.load(..., weights_only=True)`` with only the apex scaler classes
    added to the allowed globals, so neither apex nor trust in the file is needed. Every apex
    scaler object in the loaded dict (under ``"loss_scaler"`` for a bare
    ``FP16_Optimizer.state_dict()``, or nested deeper, e.g. ``ckpt["optimizer"]["loss_scaler"]``)
    is replaced by ``apex_scaler_to_dict(scaler)``; see that function for the schema. The other
    apex keys are returned as loaded: ``dynamic_loss_scale`` and ``overflow`` and
    ``first_closure_call_this_step`` (bools), ``optimizer_state_dict`` (the wrapped optimizer's
    state dict) and ``fp32_from_fp16`` (per param group, a list of FP32 master tensors).

    Args:
        path_or_file: a path or a binary file object, as for ``torch.load``.
        map_location: as for ``torch.load``; pass ``"cpu"`` to load a CUDA checkpoint (apex's
            amp scaler holds a CUDA ``_overflow_buf``) on a machine without a GPU.

    Raises:
        FileNotFoundError: the path does not exist.
        TypeError: ``path_or_file`` is neither a path nor a seekable binary file.
        ApexCheckpointError: the file is no torch checkpoint (empty, truncated, text...),
            its pickle names any global beyond tensors, torch's default weights-only allowlist
            and the apex scaler classes (the name is in the message and in
            ``.global_name``), or its top level is not a dict. Nothing it names is called.
    """
    if isinstance(path_or_file, (str, os.PathLike)):
        if not os.path.exists(path_or_file):
            raise FileNotFoundError(f"apex checkpoint not found: {os.fspath(path_or_file)}")
    elif isinstance(path_or_file, io.TextIOBase) or not hasattr(path_or_file, "read"):
        raise TypeError(
            "load_apex_checkpoint expects a path or a file opened in binary mode ('rb'), got "
            f"{path_or_file!r}"
        )
    elif not (hasattr(path_or_file, "seek") and _seekable(path_or_file)):
        raise TypeError(
            f"load_apex_checkpoint expects a seekable file (torch.load reads a checkpoint's "
            f"parts out of order), got {path_or_file!r}: read it into io.BytesIO first"
        )
    allowed = [(cls, cls.apex_path) for cls in _STAND_INS]
    start = 0 if isinstance(path_or_file, (str, os.PathLike)) else _tell(path_or_file)
    try:
        with torch.serialization.safe_globals(allowed):
            loaded = torch.load(path_or_file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        refusal = _refusal(err, path_or_file)
        unnamed = refusal.global_name in (None, "copyreg._reconstructor")
        if unnamed and _pickled_before_protocol_2(path_or_file, start):
            raise ApexCheckpointError(
                f"{path_or_file!r} was pickled with protocol 0 or 1, which the weights-only "
                "unpickler cannot read (it rebuilds objects through globals it does not "
                "allow), so fp16fx cannot load it safely. If it is an apex checkpoint, load "
                "it where apex is installed and save it again with torch.save's default "
                "protocol. Nothing in it was executed",
                global_name=refusal.global_name,
            ) from err
        raise refusal from err
    except (EOFError, IndexError, KeyError, ValueError) as err:  # torch.load on other files
        raise ApexCheckpointError(
            f"{path_or_file!r} is not a torch checkpoint, so not an apex FP16_Optimizer one "
            f"({type(err).__name__}: {err})"
        ) from err
    except RuntimeError as err:  # a truncated archive; or a CUDA one without map_location="cpu"
        raise ApexCheckpointError(f"{path_or_file!r} could not be read: {err}") from err
    if not isinstance(loaded, dict):
        raise ApexCheckpointError(
            f"{path_or_file!r} holds a {type(loaded).__name__}, not a dict: it is not an apex "
            "FP16_Optimizer checkpoint"
        )
    return _replace_scalers(loaded, set())
