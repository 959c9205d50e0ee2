"""apex-compatible stateful objects on fp16fx's core (docs/design.md layer ``facade``).

``FP16_Optimizer`` is apex's ``apex.fp16_utils.FP16_Optimizer``: same constructor, methods,
attributes and checkpoint keys, with a compiled fast path for SGD/Adam/AdamW. See
docs/migration.md.
"""

from fp16fx.facade.checkpoint import consolidate_state_dict
from fp16fx.facade.optimizer import FP16_Optimizer

__all__ = ["FP16_Optimizer", "consolidate_state_dict"]
