"""The params an FP16_Optimizer trains: readable names, checks, masters put in their groups.

Layer: ``facade`` (docs/design.md).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import torch

from fp16fx import dtensors, tree


def param_names(optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """Returns ``{id(param): readable name}`` for error messages, e.g.
    ``param 'fc.weight' (param_groups[0]['params'][3])`` when the groups carry names."""
    names = {}
    for k, group in enumerate(optimizer.param_groups):
        given = group.get("param_names")
        for i, p in enumerate(group["params"]):
            where = f"param_groups[{k}]['params'][{i}]"
            names[id(p)] = f"param {given[i]!r} ({where})" if given else where
    return names


def check_unique(groups: list[dict[str, Any]], first: int = 0) -> None:
    """Raises ValueError, naming both of its places, if a param is listed twice in one group
    (torch.optim warns and steps it twice; its two entries would share one master here).
    ``groups`` are param groups ``first``, ``first + 1``, ..."""
    for k, group in enumerate(groups, start=first):
        seen: dict[int, int] = {}
        for i, p in enumerate(group["params"]):
            if id(p) in seen:
                raise ValueError(
                    f"param_groups[{k}]['params'][{i}] is param_groups[{k}]['params']"
                    f"[{seen[id(p)]}] again: a param listed twice in a group would be stepped "
                    "twice; list it once"
                )
            seen[id(p)] = i


def check_trainable(
    params: list[torch.Tensor], names: dict[int, str], device: torch.device | None = None
) -> None:
    """Raises TypeError/ValueError, naming the param by its place in the param groups, unless
    ``params`` pass :func:`fp16fx.tree.check_trainable` (on ``device``, if given)."""
    tree.check_trainable(
        [names.get(id(p), f"param {i}") for i, p in enumerate(params)], params, device
    )


def replace_params(
    optimizer: torch.optim.Optimizer,
    group: dict[str, Any],
    params: list[torch.Tensor],
    masters: list[torch.Tensor],
) -> None:
    """Puts each param's master in its place in ``group`` and moves its existing state over."""
    master_of = {id(p): m for p, m in zip(params, masters)}
    for i, p in enumerate(group["params"]):
        master = master_of.get(id(p))
        if master is None or master is p:
            continue
        group["params"][i] = master
        if p in optimizer.state:
            optimizer.state[master] = optimizer.state.pop(p)


@dataclasses.dataclass
class ParamSet:
    """What an ``FP16_Optimizer`` trains, group by group.

    Attributes:
      trainable: per param group, its params that require grad (the model's tensors).
      masters: per param group, what the group holds for each of them (an FP32 master for an
        FP16/BF16 param, the param itself for an FP32 one).
      frozen: the params that had ``requires_grad=False`` when it was built (never trained).
      names: ``{id(param): readable name}``, for errors.
      held: per param group, the tensors its ``'params'`` list holds, trained or frozen, as
        the FP16_Optimizer left it (masters in place of the params they stand for).
      kinds: per trained param (groups in order), its dtype, shape and device when it was
        added: what :meth:`check_data` compares.
    """

    trainable: list[list[torch.Tensor]]
    masters: list[list[torch.Tensor]]
    frozen: list[torch.Tensor]
    names: dict[int, str]
    held: list[list[torch.Tensor]]
    kinds: list[tuple[torch.dtype, torch.Size, torch.device]] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.kinds = [_kind(p) for params in self.trainable for p in params]

    def known(self) -> set[int]:
        """Returns the ids of every param it holds, trained or frozen."""
        return {id(p) for p in self.frozen} | {id(p) for ps in self.trainable for p in ps}

    def add(
        self,
        params: list[torch.Tensor],
        masters: list[torch.Tensor],
        group: dict[str, Any],
        names: dict[int, str],
    ) -> None:
        """Records a new param group: ``params`` (requiring grad) with their ``masters``."""
        self.trainable.append(params)
        self.kinds.extend(map(_kind, params))
        self.masters.append(masters)
        self.frozen.extend(p for p in group["params"] if not p.requires_grad)
        self.names.update(names)
        self.held.append(list(group["params"]))

    def move_masters(self, moved: dict[int, torch.Tensor]) -> None:
        """Records that the groups now hold ``moved[id(old)]`` wherever they held ``old``."""
        self.masters = [[moved.get(id(m), m) for m in ms] for ms in self.masters]
        self.held = [[moved.get(id(t), t) for t in ts] for ts in self.held]

    def master_of(self) -> dict[int, torch.Tensor]:
        """Returns ``{id(param): its master}`` over every group."""
        return {id(p): m for ps, ms in zip(self.trainable, self.masters) for p, m in zip(ps, ms)}

    def check_unchanged(self, groups: Sequence[dict[str, Any]]) -> None:
        """Raises before a step, if the optimizer would not step some params as it steps the
        others: ValueError if ``groups`` (its param groups) gained or lost a group or a param
        other than by ``add_param_group`` (a group appended by hand: the fast path never
        stepped it, the generic one stepped it without a master, its grads still scaled), or
        if a group's ``'params'`` hold another tensor in some place (groups reordered, params
        swapped or replaced: the fast path reads each group's numbers by its place and would
        step a param with another group's lr); RuntimeError, naming it, if a param frozen
        when it was built has a gradient now (it was unfrozen since: it would not be
        trained)."""
        sizes, held_sizes = [len(group["params"]) for group in groups], list(map(len, self.held))
        if sizes != held_sizes:
            raise ValueError(
                f"the param groups changed after the FP16_Optimizer was built: its groups held "
                f"{held_sizes} params, they now hold {sizes}. Add a group with add_param_group "
                "and leave each group's 'params' as they are (or build a new FP16_Optimizer)"
            )
        for k, (group, held) in enumerate(zip(groups, self.held)):
            # Every step: a scan in C (map) first, the place found only when one differs
            if any(map(operator.is_not, group["params"], held)):
                i = next(i for i, (t, h) in enumerate(zip(group["params"], held)) if t is not h)
                raise ValueError(
                    f"the param groups changed after the FP16_Optimizer was built: "
                    f"param_groups[{k}]['params'][{i}] holds another tensor than the one it "
                    "put there (groups reordered, or params swapped or replaced). Leave each "
                    "group's 'params' as they are (or build a new FP16_Optimizer)"
                )
        for p in self.frozen:
            if p.requires_grad and p.grad is not None:
                raise RuntimeError(
                    f"{self.names.get(id(p), 'a param')} had requires_grad=False when "
                    "the FP16_Optimizer was built and now has a gradient; FP16_Optimizer does "
                    "not train it. Build the FP16_Optimizer after unfreezing (and load_state_dict)."
                )

    def check_data(self) -> None:
        """Raises RuntimeError, naming the first, where a trained param's data has another
        dtype, shape or device than when it was added: on the generic path an FP32 param is
        its own master, which ``model.half()`` would turn into an FP16 param stepped without
        one (the fast path finds a param moved out of its flat buffer instead)."""
        params = [p for group in self.trainable for p in group]
        for p, kind in zip(params, self.kinds, strict=True):
            if _kind(p) != kind:
                dtype, shape, device = kind
                raise RuntimeError(
                    f"{self.names.get(id(p), 'a param')} was {dtype} {tuple(shape)} on {device} "
                    f"when FP16_Optimizer took it, and is {p.dtype} {tuple(p.shape)} on "
                    f"{p.device} now: its .data was replaced (e.g. by model.half() or "
                    "model.to(...)). Convert and move the model first, then build the "
                    "FP16_Optimizer."
                )

    def reached_nothing(self) -> RuntimeError:
        """Returns the error for a loss whose backward reached none of the trained params."""
        trained = [p for ps in self.trainable for p in ps]
        first = self.names.get(id(trained[0]), "a param") if trained else "none"
        fsdp = (
            " On FSDP2, model.set_requires_gradient_sync(False) also writes no gradient until "
            "the synced backward: for the micro-batches before it, backpropagate "
            "(loss.float() * optimizer.loss_scale) yourself, and optimizer.backward the last."
            if dtensors.has_dtensors(trained)
            else ""
        )
        return RuntimeError(
            f"optimizer.backward(loss): the loss reached none of the {len(trained)} params this "
            f"FP16_Optimizer trains ({first}, ...). Were the model's params replaced after it "
            "was built -- load_state_dict(..., assign=True), model.to(...), fully_shard(...), "
            "a new module? "
            "Build the FP16_Optimizer after that, or load weights with assign=False." + fsdp
        )


def _kind(param: torch.Tensor) -> tuple[torch.dtype, torch.Size, torch.device]:
    return param.dtype, param.shape, param.device
