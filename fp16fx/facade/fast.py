"""The fast path: SGD/Adam/AdamW param groups stepped by fp16fx's core over flat buffers.

Layer: ``facade`` (docs/design.md). No optimizer math and no buffer handling of its own: the
params move into :class:`~fp16fx.flat.FlatParams` (one flat buffer per param group and dtype,
``p.data`` and ``p.grad`` become views), the param groups become the core's transform
(:mod:`fp16fx.facade.groups`), and every step is the functional API's in-place step --
``fp16fx.compile_step(inplace=True)`` -- on an ``fp16fx.init`` state over those params; with
``shard=...``, ``fp16fx.distributed``'s sharded state and step; on an FSDP2 model, the params
stay FSDP's DTensor shards (:class:`~fp16fx.distributed.fsdp.FSDPParams`) and the state is
over their local shards. What this module adds is the translation: hyperparameters read from
``param_groups`` before each step (and written where they changed:
:class:`~fp16fx.facade.groups.Written`), and the state shown and loaded in torch.optim's
per-param format (:mod:`fp16fx.facade.fast_state`'s functions). What it takes over from the
wrapped optimizer is read and checked first, in :mod:`fp16fx.facade.takeover`; what it knows
of the current grads is a :class:`~fp16fx.facade.grads.FastGrads`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

import fp16fx.distributed as fdist
from fp16fx import checkpoint
from fp16fx.compile import COMPILE_ERRORS, StepFunction, compile_step
from fp16fx.consensus import Consensus
from fp16fx.distributed import fsdp
from fp16fx.distributed.fsdp import FSDPParams
from fp16fx.facade import fast_state, torch_state
from fp16fx.facade.grads import FastGrads, GradFacts, GradStamp
from fp16fx.facade.groups import (
    GroupSpec,
    Unsupported,
    Written,
    build_transform,
    check_structure_unchanged,
    group_spec,
)
from fp16fx.facade.policy import Scaler
from fp16fx.facade.takeover import NOT_SHARDED, read_optimizer, refuse_shared
from fp16fx.facade.torch_state import PerParamState
from fp16fx.flat import FlatParams, put_back_on_failure
from fp16fx.precision import Precision, encode_moments
from fp16fx.scaling import GradCheck, all_finite, unscale
from fp16fx.state import FP32, MixedPrecisionState, init, recut
from fp16fx.step import StepInfo
from fp16fx.transforms import GradientTransformation, clip_coefficient
from fp16fx.transforms.primitives import NO_CLIP

logger = logging.getLogger("fp16fx")


class FastEngine:
    """Steps an SGD/Adam/AdamW's param groups with fp16fx's core (stateful).

    Built over ``trainable[k]``, the params of group ``k`` that require grad (any mix of FP16,
    BF16, FP32 on one device). Unsharded, FP16/BF16 params get FP32 masters (views of the
    core state's flat masters; ``entry(p)`` is what the param group holds for ``p``). With
    ``shard`` a process group (None: the world), each rank keeps 1/d of the masters and
    moments and the param groups keep the model's params. ``precision``: how the core state
    stores masters and moments (:mod:`fp16fx.precision`); with compensated masters there is
    no FP32 copy, and the param groups keep the model's params too.

    Raises Unsupported or ValueError, before changing anything, where
    :func:`~fp16fx.facade.takeover.read_optimizer` refuses the optimizer.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        trainable: Sequence[Sequence[torch.Tensor]],
        scaler: Scaler,
        *,
        compiled: bool,
        names: Mapping[int, str],
        consensus: Consensus | None = None,
        shard: Any = NOT_SHARDED,
        precision: Precision = FP32,
    ) -> None:
        taken = read_optimizer(optimizer, trainable, names, shard=shard, consensus=consensus)
        params, transform = taken.params, taken.transform
        self.optimizer, self.kind, self.scaler = optimizer, taken.kind, scaler
        self.specs, self.labels = taken.specs, taken.labels
        self.names = names  # {id(param): readable name}, for errors
        self.step_fn = (
            compile_step(inplace=True)
            if compiled
            else StepFunction(inplace=True, compile_options=None)
        )
        self.sharded: fdist.ShardedState | None = None
        self.fsdp = taken.fsdp
        if shard is NOT_SHARDED:
            self.flat = (
                FSDPParams(params)
                if self.fsdp
                else FlatParams(params, self.labels, precision.multiple)
            )
            self._state = self._init(transform, consensus, precision)
        else:
            self.sharded = fdist.init_sharded(
                params,
                transform,
                scaler.policy,
                group=shard,
                master=precision.master,
                moments=precision.moments,
                names=[names[id(p)] for p in params],
                agreed=taken.agreed,
            )
            self.flat = self.sharded.flat
        self.state = self.state.replace(loss_scale=scaler.state)  # one scale, the facade's
        self._written = Written.built(self.specs, optimizer.param_groups)
        self._fast_grads = FastGrads(self.grad_stamp, scaler, sharded=self.sharded is not None)
        self.last_info: StepInfo | None = None
        self._entries = self._make_entries()
        # {id(param): torch-format tensors its group's structure does not use now}, kept as
        # torch.optim keeps them (amsgrad or momentum off, then on again, resumes them)
        self._dormant: dict[int, dict[str, torch.Tensor]] = {}

    # -- the state ---------------------------------------------------------------------

    @property
    def state(self) -> MixedPrecisionState:
        """The core state: over the params (unsharded) or over this rank's slices."""
        return self._state if self.sharded is None else self.sharded.shard

    @state.setter
    def state(self, value: MixedPrecisionState) -> None:
        if self.sharded is None:
            self._state = value
        else:
            self.sharded.shard = value

    def _init(
        self, transform: GradientTransformation, consensus: Consensus | None, precision: Precision
    ) -> MixedPrecisionState:
        return init(
            self.flat.params,
            transform,
            self.scaler.policy,
            consensus=consensus,
            master=precision.master,
            moments=precision.moments,
        )

    @property
    def compact(self) -> bool:
        """Whether the state keeps compact precision (compensated masters or short moments)."""
        return self.state.precision != FP32

    @property
    def groups_hold_params(self) -> bool:
        """Whether the param groups hold the model's params (no FP32 master to hold)."""
        return self.sharded is not None or self.state.precision.compensated

    def fp32_masters(self, state: MixedPrecisionState | None = None) -> dict[int, torch.Tensor]:
        """Returns ``{id(param): FP32 master}`` for every FP16/BF16 param (unsharded) of
        ``state`` (None: the engine's): the entries, or in a compensated state the masters
        decoded (new tensors); :func:`fast_state.fp32_masters`."""
        return fast_state.fp32_masters(self.flat.params, self.state if state is None else state)

    def saved_state(self) -> MixedPrecisionState:
        """Returns the core state (sharded: this rank's shard) as a checkpoint keeps it, a
        written param's master in copies (:func:`fast_state.saved_state`; one sync). The
        engine's state is not touched, so saving leaves the run as it was."""
        return fast_state.saved_state(self.state)

    def forget_written(self) -> None:
        """Makes the next step write every param group number and the clipping threshold into
        the core, after a load wrote the checkpoint's into it: a number then set back to the
        value last written before the load would otherwise be taken as written already."""
        self._written = self._written.forgotten()

    def _make_entries(self) -> dict[int, torch.Tensor]:
        return fast_state.entries(self.flat.params, self.state, self.groups_hold_params)

    def entry(self, param: torch.Tensor) -> torch.Tensor:
        """Returns what the param group holds for model param ``param`` (its FP32 master)."""
        return self._entries[id(param)]

    def _entries_in_order(self) -> list[torch.Tensor]:
        """Returns each param's entry (:meth:`entry`), in ``flat.params`` order."""
        return [self.entry(p) for p in self.flat.params]

    def _param_specs(self) -> list[GroupSpec]:
        """Returns each param's group structure, in ``flat.params`` order."""
        return [self.specs[label] for label in self.labels]

    def require_unsharded(self, what: str) -> None:
        """Raises RuntimeError naming ``what`` on a sharded engine, which holds no whole
        per-param state nor whole averaged grads."""
        if self.sharded is not None:
            raise RuntimeError(
                f"{what} is not available on a sharded FP16_Optimizer: each rank keeps only "
                "its 1/d slice of every flat bucket's masters, moments and averaged gradients. "
                "Use state_dict() (this rank's shard) and fp16fx.facade.consolidate_state_dict."
            )

    def _require_whole(self, what: str) -> None:
        if self.fsdp:
            raise RuntimeError(
                f"{what} is not available on an FSDP2 model's FP16_Optimizer: each rank holds "
                "its shard of every param's state. Use state_dict()/load_state_dict() with "
                "torch.distributed.checkpoint (docs/distributed.md)."
            )

    def export(self) -> PerParamState:
        """Returns the optimizer state in torch.optim's per-param format (one sync).

        Keyed by param-group entry; moments are views of the live buffers, as torch's own
        ``state_dict`` holds references. Params that never took a step have no entry.
        """
        self.require_unsharded("the per-param optimizer state (optimizer.state)")
        groups = self.optimizer.param_groups
        on_device = [groups[k].get("capturable") or groups[k].get("fused") for k in self.labels]
        device = self.scaler.state.scale.device
        devices = [device if here else None for here in on_device]
        entries = self._entries_in_order()
        return fast_state.export(self.state, self.flat.params, entries, devices, self._dormant)

    def segment_marks(self) -> torch.Tensor:
        """Returns, per param in ``flat.params`` order, the index of the core's segment that
        holds it, as one int64 tensor (:func:`fast_state.segment_marks`; a checkpoint carries
        them, ``param_segments``)."""
        return fast_state.segment_marks(self.state)

    def check_state(self, per_param: PerParamState) -> None:
        """Raises ValueError if a param's torch-format state in ``per_param`` does not fit it
        (:func:`fast_state.check_state`)."""
        fast_state.check_state(
            self.kind, self.flat.params, self._entries_in_order(), per_param, self.names
        )

    def load(
        self,
        per_param: PerParamState,
        masters: Mapping[int, torch.Tensor],
        policy: Any,
        segments: torch.Tensor | None = None,
        specs: list[GroupSpec] | None = None,
        applied_steps: torch.Tensor | None = None,
    ) -> None:
        """Loads torch-format state ``per_param`` (keyed by param-group entry) and the FP32
        ``masters`` given (``{id(model param): value}``; the others keep theirs, or sharded,
        take their param's value) under loss-scale ``policy``. The FP16/BF16 params are set to
        their masters rounded. ``segments`` (:meth:`segment_marks`' form) cuts the core's
        state where they change, beside the cuts the step counts make. ``specs``: the groups'
        new structure, if it changed (the transform is rebuilt for it, :meth:`_set_specs`).
        ``applied_steps``: the core's count of applied steps (compact precision's dither
        reads it), if saved.

        Raises ValueError, before changing anything, when a state does not fit its param (or,
        sharded, a bucket's params have different step counts).
        """
        self._require_whole("loading torch.optim-format state")
        specs = self.specs if specs is None else specs
        self.check_state(per_param)
        kept = (self.state, self.specs, self._written)
        try:
            self._set_specs(specs)
            self._load(per_param, masters, policy, segments)
        except BaseException:
            self.state, self.specs, self._written = kept
            raise
        if applied_steps is not None:
            self.state.count.copy_(applied_steps)
        if self.sharded is None:
            self._dormant = torch_state.unused(
                per_param, self.flat.params, self._entries_in_order(), self._param_specs()
            )

    def load_fsdp(self, saved: Mapping[str, Any], policy: Any, scale: torch.Tensor | None) -> None:
        """Loads an FSDP2 optimizer's core state ``saved`` (``FP16_Optimizer.state_dict()``'s
        ``"state"``: :func:`fp16fx.distributed.fsdp.state_dict`'s form) under loss-scale
        ``policy``, with its loss scale ``scale``, which the caller checked (None: the core's
        load names what ``saved`` holds there). Raises, before changing anything, where it
        does not fit."""
        if scale is not None:  # the facade's own, as in _load: the core loads beside the first
            first = policy.init(self.scaler.state.scale.device).scale
            saved = {**saved, "loss_scale": {**saved["loss_scale"], "scale": first}}
        state = self.state
        try:
            self.state = fsdp.load_state_dict(state.replace(policy=policy), saved, self.flat.params)
        except BaseException:
            self.state = state
            raise
        if scale is not None:
            self.scaler.state.scale.copy_(scale)
        self.scaler.policy = policy
        self.forget_written()

    def _load(
        self,
        per_param: PerParamState,
        masters: Mapping[int, torch.Tensor],
        policy: Any,
        segments: torch.Tensor | None,
    ) -> None:
        """:meth:`load`'s work, for the current specs; raising, it may have replaced
        ``self.state`` (never written into its tensors), which :meth:`load` puts back."""
        if self.sharded is None:
            template = checkpoint.state_dict(self.state)
        else:
            template = fdist.checkpoint.template(self.sharded, canonical=True)
        sd, first = fast_state.core_state_dict(
            template,
            per_param,
            masters,
            policy,
            params=self.flat.params,
            entries=self._entries_in_order(),
            specs=self._param_specs(),
            precision=self.state.precision,
            device=self.scaler.state.scale.device,
            names=self.names,
            sharded=self.sharded is not None,
        )
        self.state = self.state.replace(policy=policy, loss_scale=first)
        if self.sharded is None:
            if segments is not None:
                self.state = recut(self.state, self.state.layout.recut(segments.tolist()))
            self.state = checkpoint.load_state_dict(self.state, sd)
        else:
            fdist.load_state_dict(self.sharded, sd)
        self.state = self.state.replace(loss_scale=self.scaler.state)

    # -- changing the groups -------------------------------------------------------------

    def restructure(self, specs: list[GroupSpec], per_param: PerParamState) -> None:
        """Rebuilds the transform for new group ``specs`` and loads ``per_param``; masters and
        the loss scale stay. Raises ValueError, before changing anything, if it does not fit
        (a sharded engine: any new structure; it keeps the one it was built with)."""
        if self.sharded is not None:
            self.check_structure(specs)
            return
        self.check_state(per_param)
        masters = self.fp32_masters(self.saved_state())  # written weights' in copies
        self.load(per_param, masters, self.state.policy, self.segment_marks(), specs)

    def _set_specs(self, specs: list[GroupSpec]) -> None:
        """Rebuilds the transform for new group ``specs`` (if they changed), its state fresh
        (masters stay).

        Raises ValueError for a sharded engine, whose structure is fixed (an FSDP2 one loads
        no torch-format state, and checks its structure before a rebuild).
        """
        if specs == self.specs:
            return
        if self.sharded is not None:
            self.check_structure(specs)
            return
        groups = self.optimizer.param_groups
        transform = build_transform(specs, groups, self.labels)
        state = self.state
        opt_state = encode_moments(transform.init(state.decoded_masters()), state.precision)
        self.state = state.replace(optimizer=transform, opt_state=opt_state)
        self.specs = specs
        self._written = Written.built(specs, groups)

    @property
    def whose(self) -> str:
        """Names the optimizer in errors of a sharded or FSDP2 engine."""
        return "an FSDP2 model's FP16_Optimizer" if self.fsdp else "a sharded FP16_Optimizer"

    def check_structure(self, specs: list[GroupSpec], loading: bool = False) -> None:
        """Raises ValueError, naming the group and its structures, if a sharded or FSDP2
        engine's groups change structure (``loading``: to a state dict's groups;
        :func:`~fp16fx.facade.groups.check_structure_unchanged`)."""
        check_structure_unchanged(specs, self.specs, self.whose, loading)

    def add_group(
        self, params: Sequence[torch.Tensor], names: Mapping[int, str]
    ) -> dict[int, torch.Tensor]:
        """Adds the last param group (already appended to the wrapped optimizer) over
        ``params``; returns ``{id(old entry): new entry}`` for every param already trained.
        ``names``: the new group's params' readable names (``{id(param): name}``).

        Every param moves into new flat buffers; the core state is rebuilt and keeps every
        master, moment and count (one recompile).
        """
        if self.sharded is not None or self.fsdp:
            raise ValueError(
                f"{self.whose} cannot add a param group; give every group to the wrapped "
                "optimizer before building the FP16_Optimizer"
            )
        if self.state.consensus is None:
            refuse_shared([*self.flat.params, *params], {**self.names, **names})
        groups = self.optimizer.param_groups
        spec = group_spec(self.kind, groups[-1], len(groups) - 1)
        specs = [*self.specs, spec]
        labels = [*self.labels, *[len(groups) - 1] * len(params)]
        transform = build_transform(specs, groups, labels)
        saved = self.export()
        segments = self.segment_marks()
        segments = torch.cat([segments, segments.new_full((len(params),), -1)])  # new buckets
        # Each written param's master in copies (saved_state), so that a refusal leaves the
        # live masters as they were.
        masters = self.fp32_masters(self.saved_state())
        clip, made_at = self.grad_facts.clip_norm(), self.grad_facts.made_at()
        old = list(self.flat.params)
        old_entries = [self.entry(p) for p in old]
        kept = (self.flat, self.labels, self.specs, self._written, self.state, self._entries)
        kept_names = self.names
        with put_back_on_failure([*old, *params]):
            try:
                self.names = {**self.names, **names}
                self.flat = FlatParams([*old, *params], labels, self.state.precision.multiple)
                self.labels, self.specs = labels, specs
                self._written = Written.built(specs, groups)  # and the clip "none" again
                count = self.state.count.clone()  # the dither's, which goes on
                state = self._init(transform, self.state.consensus, self.state.precision)
                self.state = state.replace(loss_scale=self.scaler.state)
                self._entries = self._make_entries()
                moved = {id(e): self.entry(p) for p, e in zip(old, old_entries)}
                per_param = {moved[id(e)]: s for e, s in saved.items()}
                self.load(per_param, masters, self.scaler.policy, segments, applied_steps=count)
            except BaseException:
                self.flat, self.labels, self.specs, self._written, self.state, self._entries = kept
                self.names = kept_names
                raise
        # The grads moved into new buffers: the same grads, but a check must read them there.
        self._fast_grads.regrouped(clip, made_at)  # an agreed norm left the new group out
        if clip != NO_CLIP and self.distributed:
            self.check()
        return moved

    # -- stepping ------------------------------------------------------------------------

    def sync_groups(self, max_norm: float) -> None:
        """Writes the param groups' current numbers, and the clipping threshold ``max_norm``
        (:meth:`GradFacts.clip_norm`), into the core's tensors (no sync, unless a group holds
        a number as a tensor: reading it syncs).

        A changed structural option (momentum on/off, nesterov, amsgrad) rebuilds the
        transform (one recompile); one the core lacks (maximize) raises Unsupported (on a
        sharded or FSDP2 engine, whose state the generic path cannot take over: ValueError).
        """
        groups = self.optimizer.param_groups
        try:
            specs = [group_spec(self.kind, g, k) for k, g in enumerate(groups)]
        except Unsupported as err:
            if self.sharded is None and not self.fsdp:
                raise
            raise ValueError(f"{self.whose} cannot run this: {err}") from None
        if specs != self.specs:
            logger.info("fp16fx: a param group's structure changed; rebuilding the fast path")
            if self.fsdp:
                self.check_structure(specs)
            self.restructure(specs, self.export() if self.sharded is None else {})
        self._written.write(self.state.opt_state, self.specs, groups, max_norm)

    def grads(self) -> list[torch.Tensor | None]:
        """Returns each trained param's grad, a view of its flat buffer (None: it has none).

        Raises ValueError for a sharded engine when a param has none (this rank's check, before
        any collective: the other ranks wait in the reduce-scatter, unless they raise too).
        """
        try:
            grads = self.flat.grads()
        except TypeError as err:  # a sparse gradient: the generic path takes it
            raise Unsupported(str(err)) from None
        if self.sharded is not None and None in grads:
            p = self.flat.params[grads.index(None)]
            raise ValueError(
                f"{self.names.get(id(p), 'a param')} has no gradient; a sharded FP16_Optimizer "
                "steps every param in every step (its bucket keeps one step count). Give it a "
                "zero gradient, or set requires_grad=False before building the optimizer"
            )
        return grads

    def _scatter(self) -> list[torch.Tensor]:
        """Returns this rank's slices of the mean gradient (one reduce-scatter per step)."""
        sharded = self.sharded
        assert sharded is not None
        return self._fast_grads.scattered(lambda: fdist.reduce_grads(sharded, self.grads()))

    def _compiling(self, run: Callable[[], Any]) -> Any:
        """Returns ``run()``; if torch.compile cannot compile (before anything ran), logs it
        once and runs it again with the same core, eagerly, from then on."""
        try:
            return run()
        except COMPILE_ERRORS as err:
            logger.warning("fp16fx: torch.compile failed (%s); stepping eagerly", err)
            self.step_fn = StepFunction(inplace=True, compile_options=None)
            return run()

    def step(self) -> StepInfo:
        """Runs the core on the current grads (skipped exactly on inf/NaN); returns its info.

        Grads that nothing wrote since the last step are stepped again, as apex stepped its
        masters' grads again: unscaled by the loss scale they were made with
        (:meth:`FastGrads.scale_of_the_grads`), the scale then moving on from where it is.
        """
        with self._fast_grads.scale_of_the_grads() as swapped:
            clip = self.grad_facts.clip_norm()
            self.sync_groups(clip)
            if self.sharded is None:
                grads = self.grads()
                self.state, info = self._compiling(lambda: self.step_fn(self.state, grads))
            else:
                shards, sharded = self._scatter(), self.sharded
                info = self._compiling(lambda: fdist.step_shards(sharded, shards, self.step_fn))
        if swapped:  # the policy moves on from its own state, not from the grads' scale
            info = info._replace(loss_scale_floored=self.scaler.adjust(info.finite))
        else:  # the core moved it
            self.scaler.count(info.finite, info.loss_scale_floored)
        self.last_info = info
        self._fast_grads.stepped(info, clip)
        return info

    def grad_stamp(self) -> GradStamp:
        """Returns the trained params' gradients now, to tell later whether any changed."""
        if isinstance(self.flat, FlatParams):
            return GradStamp(self.flat.params, self.flat.grad_views, self.flat.grad_buffers)
        return GradStamp(self.flat.params)

    @property
    def grad_facts(self) -> GradFacts:
        """What the engine knows of the current grads (:class:`GradFacts`): their clip, the
        loss scale they were made with, their cached check."""
        return self._fast_grads.facts

    def keep_scale_of_the_grads(self) -> None:
        """Makes the current grads keep the loss scale they were made with (the current one,
        unless they carry one already), which is about to be set by hand
        (:meth:`FastGrads.keep_scale`; sharded, they take the new one)."""
        self._fast_grads.keep_scale(self.flat.collect_grads)

    @property
    def distributed(self) -> bool:
        """Whether a check is a collective (a consensus across processes)."""
        return self.sharded is not None or self.state.consensus is not None

    def check(self) -> GradCheck:
        """Returns the check of the current unscaled grads (0-d tensors); sharded, of
        the mean grads. Unless across processes, cached while the grads are unchanged. Across
        processes it is a collective, called by every rank (``clip_master_grads``;
        ``add_param_group`` with a clip pending), and runs anew each time: a cache would hold
        on some ranks only, where one rank alone wrote its grads. A read one rank makes alone
        gets :meth:`agreed` instead."""
        if (checked := self._fast_grads.cached(self.distributed)) is not None:
            return checked
        with self._fast_grads.scale_of_the_grads():
            grads = self.grads() if self.sharded is None else self._scatter()
            checked = self._compiling(lambda: self.step_fn.check(self.state, grads))
        self._fast_grads.remember(checked, self.distributed)
        return checked

    def agreed(self) -> GradCheck:
        """Returns :meth:`check`'s result for a read one rank may make alone: across
        processes, that of the last check every rank made (a clip's or the step's; a check
        made now if none was since the last ``zero_grad``)."""
        agreed = self._fast_grads.last_agreed(self.distributed)
        return self.check() if agreed is None else agreed

    def last_agreed(self) -> GradCheck | None:
        """Returns the last check every rank made of these grads (a clip's or the step's),
        with no collective; None on one process, or where none was made since the last
        ``zero_grad``."""
        return self._fast_grads.last_agreed(self.distributed)

    def local_finite(self) -> bool:
        """Returns whether this rank's current grads are all finite (one sync, no collective):
        across processes, while they are the grads a clip checked, the check every rank
        agreed on there, so that every rank reads the same (sharded, once the clip
        reduce-scattered them, the mean grads')."""
        if self._fast_grads.reduced:  # reduce-scattered by a clip: its agreed check
            return bool(self.agreed().finite)
        if (agreed := self._fast_grads.agreed_of_these()) is not None:
            return bool(agreed.finite)
        try:
            self.flat.collect_grads()
        except TypeError:  # a sparse grad, which no flat buffer holds (a step hands it over)
            return all_finite(p.grad for p in self.flat.params if p.grad is not None)
        return all_finite(self.flat.grad_buffers)

    def forget_check(self) -> None:
        """Forgets the cached check (new grads arrived); raises RuntimeError if a sharded
        engine's grads were reduce-scattered since the last step
        (:meth:`FastGrads.forget_check`)."""
        self._fast_grads.forget_check()

    def unscaled_grads(self) -> dict[torch.Tensor, torch.Tensor]:
        """Returns ``{entry: unscaled FP32 grad}`` for every trained param with a grad,
        clipped as the next step clips them if ``clip_master_grads`` asked for it. Unsharded
        only: the caller refuses a sharded engine first (:meth:`require_unsharded`), before it
        reads the grads' overflow."""
        assert self.sharded is None  # (its grads here: this rank's own, not yet averaged)
        made_at = self.grad_facts.made_at()
        scale = self.scaler.state.scale if made_at is None else made_at
        pairs = [(p, g) for p, g in zip(self.flat.params, self.grads()) if g is not None]
        unscaled = unscale([g for _, g in pairs], scale)
        max_norm = self.grad_facts.clip_norm()
        if max_norm != NO_CLIP:  # as the step will clip them
            coef = clip_coefficient(max_norm, self.agreed().norm).float()
            unscaled = [u * coef for u in unscaled]
        return {self.entry(p): u for (p, _), u in zip(pairs, unscaled)}

    def check_params(self) -> None:
        """Raises RuntimeError if a model param was moved out of its flat buffer."""
        i = self.flat.moved()
        if i is not None:
            raise RuntimeError(
                f"{self.names.get(id(self.flat.params[i]), 'a param')} no longer lives in "
                "FP16_Optimizer's flat buffer: its .data was replaced (e.g. by model.half(), "
                "model.to(...), or load_state_dict(..., assign=True)) after the optimizer was "
                "built. Convert and move the model first, then build the FP16_Optimizer."
            )

    def zero_grad(self, set_to_none: bool) -> None:
        self.flat.zero_grads(set_to_none)
        self._fast_grads.zeroed()


__all__ = ["FastEngine"]
