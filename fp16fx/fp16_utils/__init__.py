"""Every name of apex's ``apex.fp16_utils``, so that a script changes one import line::

    from fp16fx.fp16_utils import FP16_Optimizer, network_to_half   # was: from apex.fp16_utils

The helpers come from :mod:`fp16fx.fp16_utils.fp16util`, as apex's did. See
docs/migration.md for what each name maps to and what changed.
"""

from fp16fx.fp16_utils import fp16util
from fp16fx.fp16_utils.fp16_optimizer import FP16_Optimizer  # sets .fp16_optimizer, as apex's
from fp16fx.fp16_utils.fp16util import *  # noqa: F403 (apex's __init__ reads the same)
from fp16fx.fp16_utils.loss_scaler import DynamicLossScaler, LossScaler

__all__ = ["DynamicLossScaler", "FP16_Optimizer", "LossScaler", *fp16util.__all__]
