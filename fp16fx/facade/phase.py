"""Where an ``FP16_Optimizer`` is between two steps: its grads' phase, and what ``overflow`` reads.

Layer: ``facade`` (docs/design.md). apex kept this implicitly, in its masters' grads and a
flag or two; fp16fx keeps no FP32 copy of the grads on the fast path, so it names the phase
and moves it on each event:

===============================================  ===================  ==================
event                                            ``phase.grads``      ``overflow`` reads
===============================================  ===================  ==================
built, ``step()``, ``zero_grad()``               stale                the last step's
``load_state_dict(sd)``                          as it was            ``sd["overflow"]``
``backward(loss, update_master_grads=False)``    fresh                these grads (sync)
``add_param_group`` of params holding grads      fresh, if stale      these grads (sync)
``update_master_grads()``, ``backward(loss)``    generic: unscaled    these grads (sync)
``clip_master_grads(n)``                         generic: unscaled    these grads
                                                 fast: fresh
a switch to the generic path with fresh grads    unscaled             these grads
and a clip or a scale of their own pending
``step(closure)``                                stale after;         the last attempt's
                                                 ``first_closure_call`` False while
                                                 the closure re-runs
===============================================  ===================  ==================
"""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass
class Phase:
    """Where an ``FP16_Optimizer`` is between two steps (the table above).

    Attributes:
      grads: ``"stale"`` (none since the last step), ``"fresh"`` (new, not yet unscaled) or
        ``"unscaled"`` (generic path: unscaled into the masters' grads and checked).
      overflow: the value ``overflow`` reads, when known without looking at grads (loaded
        from a state dict, or set); None: computed from the grads when read.
      first_closure_call: apex's flag: the closure of the current ``step`` runs for the first
        time (the generic path refreshes the FP16 params from the masters before later calls).
    """

    grads: Literal["stale", "fresh", "unscaled"] = "stale"
    overflow: bool | None = None
    first_closure_call: bool = True

    def new_grads(self) -> None:
        """Marks new grads: not yet unscaled, ``overflow`` read from them."""
        self.grads, self.overflow = "fresh", None


__all__ = ["Phase"]
