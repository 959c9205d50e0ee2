"""The fast path, sharded: ``FP16_Optimizer(shard=True)`` keeps 1/d of the masters and moments.

Layer: ``facade`` (DESIGN.md). No data movement of its own: the flat buckets are padded to a
multiple of d and handed to :class:`fp16fx.distributed.sharded.Sharding`, the one place that
slices, reduce-scatters and all-gathers (``fdist.sharded_step`` uses it too); the step is the
fast path's compiled core over this rank's slices. One ``step()``, on every rank::

    flat FP16 grad /= d;  shard grad = reduce_scatter(flat grad)   # the mean of every rank's
    core step on my slice (consensus: finite and the L2 norm are global)
    flat FP16 param = all_gather(my slice)                          # every rank: equal params

Each bucket keeps one optimizer state (one step count) for its slice, so every trained param
needs a gradient in every step, and a loaded state must give a bucket's params one step count.
The param groups keep the model's params: there is no whole FP32 master to put there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import optree
import torch
import torch.distributed as dist

from fp16fx.consensus import Consensus
from fp16fx.distributed.sharded import Sharding
from fp16fx.facade import torch_state
from fp16fx.facade.buffers import group_buckets
from fp16fx.facade.fast import FastEngine, apply_and_count, finite_and_norm
from fp16fx.facade.groups import NO_CLIP, GroupSpec, Unsupported, group_spec
from fp16fx.facade.policy import Scaler
from fp16fx.facade.torch_state import PerParamState
from fp16fx.state import MixedPrecisionState, init
from fp16fx.step import Info, run_step
from fp16fx.transforms import TransformState, multi_transform


def shard_group(shard: Any, process_group: Any, path: str) -> tuple[bool, Any]:
    """Returns ``(sharded, group)`` for ``FP16_Optimizer``'s ``shard`` argument.

    Raises:
      ValueError: sharding was asked for but cannot be done (named), before anything changed.
    """
    if shard is False or shard is None:
        return False, None
    if path == "generic":
        raise ValueError("shard=... runs on the fast path only; path='generic' cannot shard")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "shard=... needs torch.distributed initialized (dist.init_process_group) with more "
            "than one process: the masters and moments are split across the processes"
        )
    group = None if shard is True else shard
    if dist.get_world_size(group) == 1:
        raise ValueError("shard=... needs more than one process: there is nothing to shard across")
    if not (isinstance(process_group, str) and process_group == "auto"):
        raise ValueError(
            "with shard=..., the found-inf consensus runs over the shard's group; pass a group "
            "as shard=group and leave process_group='auto'"
        )
    return True, group


class ShardedEngine(FastEngine):
    """The fast path over this rank's slices of padded flat buckets (stateful).

    As :class:`~fp16fx.facade.fast.FastEngine` -- hyperparameters from ``param_groups`` each
    step, the same compiled core -- except that the FP32 masters and optimizer moments exist
    only for this rank's slice of each bucket, and a step reduce-scatters the grads first and
    all-gathers the params after. ``clip_master_grads`` (:meth:`check`) reduce-scatters too: it
    is a collective, and the step then reuses its grads.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        trainable: Sequence[Sequence[torch.Tensor]],
        scaler: Scaler,
        group: Any,
        *,
        compiled: bool,
        names: Mapping[int, str],
    ) -> None:
        self.group, self.names = group, names
        self._scattered: list[torch.Tensor] | None = None  # this step's shard grads, once made
        try:
            super().__init__(optimizer, trainable, scaler, compiled=compiled)
        except Unsupported as err:  # raised before anything changed
            raise ValueError(f"shard=... needs the fast path, which cannot run: {err}") from None

    def _build(self, trainable: Sequence[Sequence[torch.Tensor]], specs: list[GroupSpec]) -> None:
        world = dist.get_world_size(self.group)
        for k, params in enumerate(trainable):
            self._add_spec(k, specs[k])
            self.buckets += group_buckets(k, params, multiple=world)
        self.sharding = Sharding.of([b.param_buffer for b in self.buckets], self.group)
        slices = [b.param_buffer[self.sharding.slice(i)] for i, b in enumerate(self.buckets)]
        optimizer = multi_transform(self.transforms, labels=[b.group for b in self.buckets])
        state = init(slices, optimizer, self.scaler.policy)  # masters and moments of the slices
        self.masters, self.bucket_leaves = list(state.master), list(state.opt_state.leaves)
        self.scaler.consensus = Consensus(group=self.group, sharded=True)
        self.state = MixedPrecisionState(
            params=slices,
            master=self.masters,
            opt_state=TransformState(tuple(self.hyperparams), self.bucket_leaves),
            loss_scale=self.scaler.state,
            count=self.count,
            optimizer=optimizer,
            policy=self.scaler.policy,
            consensus=self.scaler.consensus,
        )
        for bucket in self.buckets:
            for p in bucket.params:
                self._entries[id(p)] = p

    # -- loading -------------------------------------------------------------------------

    def rebuild(self, per_param: PerParamState, has_grad: list[list[bool]] | None = None) -> None:
        """Loads torch-format state ``per_param`` (keyed by model param) into the slices.

        ``has_grad`` must be None: a sharded bucket always steps whole.
        """
        assert has_grad is None
        self.load(per_param, {})

    def load(self, per_param: PerParamState, masters: Mapping[int, torch.Tensor]) -> None:
        """Writes this rank's slice of the whole state given per param (torch's format) and of
        ``masters`` (``{id(param): FP32 value}``; a param without one keeps its value); the
        FP16/BF16 params are set to their masters cast down, as every step leaves them.

        Raises ValueError, before writing anything, when a bucket's params have different step
        counts (a sharded bucket keeps one) or a state does not fit its param.
        """
        counts = []
        for bucket in self.buckets:
            spec = self.specs[bucket.group]
            saved = [per_param.get(p, {}) for p in bucket.params]
            for p, state in zip(bucket.params, saved):
                torch_state.check(spec, p, state)
            found = sorted({torch_state.signature(spec, state) for state in saved})
            if len(found) > 1:
                raise ValueError(
                    f"the params of param group {bucket.group} ({bucket.dtype}) have different "
                    f"step counts {found}; a sharded FP16_Optimizer keeps one per group and dtype"
                )
            counts.append(found[0])
        with torch.no_grad():
            for b, (bucket, count) in enumerate(zip(self.buckets, counts)):
                mine = self.sharding.slice(b)
                full = bucket.param_buffer.to(torch.float32, copy=True)
                for p, (a, z) in zip(bucket.params, bucket.spans()):
                    full[a:z].copy_(masters.get(id(p), p).reshape(-1))
                if bucket.dtype != torch.float32:
                    self.masters[b].copy_(full[mine])
                    bucket.param_buffer.copy_(full)
                leaf = self.transforms[bucket.group].init_leaf(full, 0)
                saved = [per_param.get(p, {}) for p in bucket.params]
                torch_state.fill(leaf, bucket.spans(), saved, count)
                optree.tree_map(
                    lambda dst, src, mine=mine: dst.copy_(src[mine] if src.ndim == 1 else src),
                    self.bucket_leaves[b],
                    leaf,
                )

    def restructure(self, specs: list[GroupSpec], per_param: PerParamState) -> None:
        """Raises ValueError: a sharded optimizer's group structure is fixed when it is built."""
        self.check_structure(specs)

    def check_structure(self, specs: list[GroupSpec]) -> None:
        """Raises ValueError unless ``specs`` are the groups' structures it was built with."""
        if specs != self.specs:
            raise ValueError(
                "a sharded FP16_Optimizer cannot change a param group's structure (momentum "
                "on/off, nesterov, amsgrad, Adam/AdamW) after it was built; build a new one"
            )

    # -- what a sharded optimizer does not have ------------------------------------------

    def _unavailable(self, what: str) -> NoReturn:
        raise RuntimeError(
            f"{what} is not available on a sharded FP16_Optimizer: each rank keeps only its "
            "1/d slice of every flat bucket's masters, moments and averaged gradients. Use "
            "state_dict() (this rank's shard) and fp16fx.facade.consolidate_state_dict(...)."
        )

    def export(self) -> PerParamState:
        """Raises RuntimeError: torch's per-param state does not exist on any one rank."""
        self._unavailable("the per-param optimizer state (optimizer.state)")

    def unscaled_grads(self) -> dict[torch.Tensor, torch.Tensor]:
        """Raises RuntimeError: the averaged grads exist only as slices."""
        self._unavailable("inspect_master_grad_data()")

    def add_group(self, k: int, params: Sequence[torch.Tensor]) -> None:
        """Raises ValueError: the buckets and their slices are fixed when it is built."""
        raise ValueError(
            "a sharded FP16_Optimizer cannot add a param group; give every group to the "
            "wrapped optimizer before building the FP16_Optimizer"
        )

    # -- stepping ------------------------------------------------------------------------

    def sync_groups(self) -> None:
        """As the fast path's, but a structural change or an option the core lacks (maximize)
        raises ValueError: the sharded optimizer has no other path to move to."""
        groups = self.optimizer.param_groups
        try:
            specs = [group_spec(self.kind, g, k) for k, g in enumerate(groups)]
        except Unsupported as err:
            raise ValueError(f"a sharded FP16_Optimizer cannot run this: {err}") from None
        self.check_structure(specs)
        super().sync_groups()

    def _scatter(self) -> list[torch.Tensor]:
        """Returns this rank's slices of the mean gradient (one reduce-scatter per step)."""
        if self._scattered is None:
            for bucket in self.buckets:  # before any collective: no rank is left waiting
                has_grad = bucket.collect_grads()
                if not all(has_grad):
                    p = bucket.params[has_grad.index(False)]
                    name = self.names.get(id(p), "a param")
                    raise ValueError(
                        f"{name} has no gradient; a sharded FP16_Optimizer steps every param "
                        "in every step (its bucket keeps one step count). Give it a zero "
                        "gradient, or set requires_grad=False before building the optimizer"
                    )
            self._scattered = self.sharding.reduce_scatter([b.grad_buffer for b in self.buckets])
        return self._scattered

    def step(self) -> Info:
        """Reduce-scatters the grads, steps this rank's slices (skipped exactly on inf/NaN
        anywhere), all-gathers the params; returns the step's info (no host sync)."""
        self.sync_groups()
        grads = self._scatter()

        def core(*args: Any) -> Info:
            return self._call(apply_and_count, *args, self.scaler.stats)

        _, info = run_step(core, self.state, grads, inplace=True)
        self.sharding.all_gather([b.param_buffer for b in self.buckets])
        self.last_info, self._checked, self._scattered = info, None, None
        self.max_norm = NO_CLIP
        return info

    def check(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the global ``(finite, norm)`` of the mean grads (a collective), cached."""
        if self._checked is None:
            finite, norm = self._call(finite_and_norm, self._scatter(), self.scaler.state.scale)
            self._checked = self.scaler.consensus(finite, norm)
        return self._checked

    def local_check(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(finite, norm)`` of this rank's own grads (no collective), or
        :meth:`check`'s once the grads were reduce-scattered."""
        if self._scattered is not None:
            return self.check()
        for bucket in self.buckets:
            bucket.collect_grads()
        grads = [b.grad_buffer for b in self.buckets]
        return self._call(finite_and_norm, grads, self.scaler.state.scale)

    def forget_check(self) -> None:
        """Raises RuntimeError if the grads were already reduce-scattered (and so divided by
        d in place) without a step or ``zero_grad()`` since: new grads would add to them."""
        if self._scattered is not None:
            raise RuntimeError(
                "the gradients were already reduce-scattered (by clip_master_grads) and so "
                "divided by the world size; call step() or zero_grad() before another backward"
            )
        self._checked = None

    def zero_grad(self, set_to_none: bool) -> None:
        super().zero_grad(set_to_none)
        if set_to_none:  # a param left without a grad must not bring old values into a step
            for bucket in self.buckets:
                bucket.grad_buffer.zero_()
        self._scattered = None
