"""apex's ``apex.fp16_utils.fp16_optimizer`` module path, for scripts that import
``FP16_Optimizer`` from it (layer: fp16_utils; the class lives in :mod:`fp16fx.facade`)."""

from fp16fx.facade import FP16_Optimizer

__all__ = ["FP16_Optimizer"]
