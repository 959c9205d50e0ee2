"""apex's ``FP16_Optimizer``, running on fp16fx's core.

Layer: ``facade`` (docs/design.md): a stateful, apex-compatible object. It owns no optimizer
math and no loss-scale math; it chooses an engine (``fast``: the functional API's compiled step
over flat buffers, :mod:`fp16fx.facade.fast`; ``generic``: the wrapped optimizer on FP32
masters, :mod:`fp16fx.facade.generic`) and keeps apex's methods, attributes and checkpoint
keys. Its few states between two steps live in one :class:`~fp16fx.facade.phase.Phase`.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch

from fp16fx import dtensors
from fp16fx.consensus import default_consensus
from fp16fx.distributed import fsdp
from fp16fx.distributed.agreement import loading_together
from fp16fx.facade import checkpoint, closure, loading
from fp16fx.facade.engines import Engine, build_engine, check_path, handover, shard_group
from fp16fx.facade.fast import FastEngine
from fp16fx.facade.generic import GenericEngine
from fp16fx.facade.groups import Unsupported
from fp16fx.facade.params import (
    ParamSet,
    check_trainable,
    check_unique,
    param_names,
    replace_params,
)
from fp16fx.facade.phase import Phase
from fp16fx.facade.policy import Scaler, policy_from_args
from fp16fx.facade.reporting import OverflowReporter, describe
from fp16fx.facade.takeover import NOT_SHARDED, initializing_together_if_sharded
from fp16fx.flat import put_back_on_failure
from fp16fx.precision import Precision
from fp16fx.scaling import DynamicLossScale, check_scale, scale_fault
from fp16fx.step import StepInfo
from fp16fx.transforms import check_hyperparam
from fp16fx.transforms.primitives import NO_CLIP

logger = logging.getLogger("fp16fx")
Path = Literal["auto", "fast", "generic"]


class FP16_Optimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer for FP16/BF16 models: FP32 masters, loss scaling, skipped overflows.

    A drop-in replacement for apex's ``apex.fp16_utils.FP16_Optimizer``; change the import::

        from fp16fx.fp16_utils import FP16_Optimizer, network_to_half   # was: apex.fp16_utils

        model = network_to_half(model)                # FP16 except BatchNorm
        optimizer = FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                   dynamic_loss_scale=True)
        for x, y in data:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            optimizer.backward(loss)                  # instead of loss.backward()
            optimizer.clip_master_grads(1.0)          # optional
            optimizer.step()                          # skipped if the grads overflowed
            scheduler.step()                          # any torch.optim.lr_scheduler works

    Each FP16/BF16 param the wrapped optimizer holds gets an FP32 master that replaces it in
    ``param_groups`` (as in apex); FP32 params are their own masters; params with
    ``requires_grad=False`` are left alone. A param whose grad is None in a step is not
    updated and its optimizer state is untouched. A param written between steps (``model.
    load_state_dict``, a weight clamp) keeps the written value: its master takes it exactly.

    Two engines, chosen at construction (``path``; ``self.path`` says which one runs):

    * ``"fast"`` -- when the wrapped optimizer is exactly ``torch.optim.SGD``, ``Adam`` or
      ``AdamW`` without ``maximize``/``differentiable``. The model's params and grads move into
      one flat buffer per (param group, dtype) (``p.data`` and ``p.grad`` become views) and
      each step is ``fp16fx.compile_step(inplace=True)`` over them (unscale, check, clip,
      update, cast, skip, adjust the scale) with no host-device sync. Hyperparameters are read
      from ``param_groups`` every step into tensors: LR schedulers never recompile.
    * ``"generic"`` -- anything else (LBFGS, RMSprop, your own optimizer): apex's algorithm,
      the wrapped optimizer stepping FP32 masters; one bool is read on the host per step to
      decide the skip (as torch's GradScaler does).

    Both move the loss scale once per ``step()``, so gradients accumulated over several
    ``backward`` calls all carry one scale.

    On an FSDP2 model (``fully_shard``: DTensor params) both step each rank's local shards in
    place -- FP32 shards are their own masters -- and every rank agrees the skip and the global
    grad norm in one all-reduce over the mesh (``process_group=group`` picks the group);
    ``state_dict()`` is then a dict for ``torch.distributed.checkpoint`` (docs/distributed.md).

    Between two steps it is in one :class:`~fp16fx.facade.phase.Phase`: whether the grads
    are new, unscaled or already stepped, and what ``overflow`` reads (the table there).

    Args:
      init_optimizer: the ``torch.optim.Optimizer`` to wrap (built on the model's params).
      static_loss_scale: the fixed loss scale when ``dynamic_loss_scale`` is False.
      dynamic_loss_scale: back off on overflow and grow after a run of clean steps.
      dynamic_loss_args: apex's ``init_scale``, ``scale_factor``, ``scale_window``,
        ``min_loss_scale``, ``max_loss_scale`` and/or :class:`~fp16fx.DynamicLossScale`'s
        fields (``hysteresis``, ...). Defaults are apex's: 2**16, window 2000, ceiling 2**24,
        no floor (2**-126, see :mod:`fp16fx.facade.policy`).
      verbose: log skipped steps (rate-limited, logger ``fp16fx``); False silences them.
      path: ``"auto"`` (fast when possible), ``"fast"`` (error if not possible), ``"generic"``.
        An optimizer built with no param that requires grad takes the generic path, and
        keeps it when ``add_param_group`` adds some.
      compiled: run the fast path's step through ``torch.compile`` (False: the same core,
        eagerly; for debugging).
      report_interval: read the device-side overflow counters and log every this many steps.
      process_group: found-inf consensus across processes (:mod:`fp16fx.distributed`):
        ``"auto"`` turns it on when torch.distributed is initialized with more than one
        process, ``None`` turns it off, a process group scopes it to that group. With it,
        every process skips or applies each step together, on the device. (On an FSDP2
        model it is always on, over the mesh's group unless one is given.)
      shard: ``True`` (the world group) or a process group: ZeRO-1 sharding with
        ``fp16fx.distributed``'s sharded state (docs/distributed.md). Each of d ranks keeps the
        whole FP16 params and grads but only its 1/d of the FP32 masters and moments (Adam:
        4 + 12/d bytes per param instead of 16; 4 + 3/d with ``master="compensated",
        moments="int8"``). Do not wrap the model in DDP: ``step()`` averages the ranks' grads
        itself (reduce-scatter), steps its slice (skip and global norm agreed by all ranks)
        and all-gathers the params, so every rank ends with the same params; they are
        broadcast from the first rank when it is built. Fast path only (SGD/Adam/AdamW).
        ``clip_master_grads`` is then a collective (every rank calls it); every trained param
        needs a gradient in every step; ``state`` and ``inspect_master_grad_data()`` raise
        (no rank holds them whole); ``param_groups`` keep the model's params;
        ``state_dict()`` is this rank's shard, and ``load_state_dict`` takes every rank's
        dicts (any world size) or an apex-format dict
        (:func:`fp16fx.facade.consolidate_state_dict` makes one).
      master, moments: how the state is stored between steps (docs/precision.md).
        ``master="compensated"`` keeps no FP32 copy: each FP16/BF16 param plus a short
        correction carries its master, and the param groups hold the model's params.
        ``moments="bf16"`` or ``"int8"`` stores Adam's moments or SGD's momentum compactly.
        Fast path only (SGD/Adam/AdamW): unsharded, with ``shard``, or on an FSDP2 model's
        FP16 shards (each with its own correction); unsharded, ``state`` and
        ``state_dict()`` show the masters and moments decoded to FP32 (copies), so the
        checkpoint is apex's format (sharded, ``consolidate_state_dict`` decodes them).
    """

    def __init__(
        self,
        init_optimizer: torch.optim.Optimizer,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: Mapping[str, Any] | None = None,
        verbose: bool = True,
        *,
        path: Path = "auto",
        compiled: bool = True,
        report_interval: int = 100,
        process_group: Any = "auto",
        shard: Any = False,
        master: str = "fp32",
        moments: str = "fp32",
    ) -> None:
        group = shard_group(shard)
        # Sharded, a rank refusing alone would leave the others waiting for it to broadcast:
        # these checks and the sharded init's (in build_engine) are one agreement.
        with initializing_together_if_sharded(group):
            if isinstance(init_optimizer, FP16_Optimizer):
                raise TypeError("init_optimizer is already an FP16_Optimizer; wrap the inner one")
            if not isinstance(init_optimizer, torch.optim.Optimizer):
                raise TypeError(
                    "FP16_Optimizer wraps a torch.optim.Optimizer, e.g. FP16_Optimizer("
                    f"torch.optim.SGD(model.parameters(), lr=0.1)); got {init_optimizer!r}"
                )
            check_path(path, process_group, group)
            precision = Precision(master, moments)  # checks the names
            policy = policy_from_args(static_loss_scale, dynamic_loss_scale, dynamic_loss_args)
            self._reporter = OverflowReporter(verbose=verbose, interval=report_interval)
            names = param_names(init_optimizer)
            groups = init_optimizer.param_groups
            check_unique(groups)
            trainable = [[p for p in g["params"] if p.requires_grad] for g in groups]
            trained = [p for params in trainable for p in params]
            check_trainable(trained, names)
            every = [*trained, *(p for g in groups for p in g["params"])]
            device = every[0].device if every else torch.device("cpu")  # a group may be empty
            stats = torch.zeros(2, dtype=torch.int64, device=device)
            consensus = default_consensus(process_group) if group is NOT_SHARDED else None
            self._scaler = Scaler(policy, policy.init(device), stats, consensus)
            self.optimizer = init_optimizer
            self.verbose = verbose
            self._init_hooks()
            with put_back_on_failure(trained):
                engine, masters = build_engine(
                    init_optimizer, trainable, self._scaler,
                    path=path, compiled=compiled, shard=group, names=names, precision=precision,
                )  # fmt: skip
        frozen = [p for g in groups for p in g["params"] if not p.requires_grad]
        held = [list(group["params"]) for group in groups]
        self._params = ParamSet(
            trainable=trainable, masters=masters, frozen=frozen, names=names, held=held
        )
        self._engine: Engine = engine
        self._phase = Phase()

    def _init_hooks(self) -> None:
        """Sets up what torch.optim.Optimizer's own __init__ would (hooks, profiling)."""
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = (
            OrderedDict()
        )
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = (
            OrderedDict()
        )
        self._patch_step_function()

    # -- what torch.optim.Optimizer has -------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The wrapped optimizer's param groups (FP32 masters in place of FP16/BF16 params)."""
        return self.optimizer.param_groups

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @property
    def state(self) -> dict[torch.Tensor, Any]:  # type: ignore[override]
        """The per-param optimizer state, keyed by the param groups' tensors (as in apex).

        On the fast path this is a snapshot built from the core's state (moments are views
        of the live buffers); on the generic path the wrapped optimizer's own ``state``.
        A sharded optimizer raises RuntimeError: each rank holds 1/d of every bucket's state.
        """
        if isinstance(self._engine, FastEngine):  # a defaultdict, as torch.optim's
            return defaultdict(dict, {**self.optimizer.state, **self._engine.export()})
        return self.optimizer.state

    @property
    def path(self) -> str:
        """``"fast"`` (the core over flat buffers) or ``"generic"`` (the wrapped optimizer)."""
        return "fast" if isinstance(self._engine, FastEngine) else "generic"

    @property
    def sharded(self) -> bool:
        """Whether this rank keeps only its 1/d of the masters and moments (``shard=...``)."""
        return isinstance(self._engine, FastEngine) and self._engine.sharded is not None

    @property
    def dynamic_loss_scale(self) -> bool:
        return isinstance(self._scaler.policy, DynamicLossScale)

    @property
    def loss_scale(self) -> float:
        """The current loss scale (reading it syncs with the device; setting it does not, but
        for a one-element tensor on the device, which it reads).

        Set between ``backward`` and ``step``, it leaves the current grads as they were made:
        they are unscaled by the scale they were made with, as apex unscaled them at backward
        (not on a sharded optimizer, whose step unscales its reduce-scattered grads by the
        current scale).

        A dynamic scale must be set within its bounds, ``[min_loss_scale, max_loss_scale]``:
        a value outside raises ValueError, the scale unchanged (only ``init_scale`` is
        clamped into them, as apex clamped it). A static scale takes any value > 0 that FP32
        holds as a normal number, as apex's did, and a checkpoint keeps it. A checkpoint's
        scale loads as saved: an apex scaler's may lie outside the bounds fp16fx reads from it
        (below a legacy scaler's floor of 1, or past an amp bound moved inwards to a power of
        two) and moves by the policy's rule from there: an overflow lifts one below the floor
        to it, as apex's did, and a growth lowers one above the ceiling to it.
        """
        return float(self._scaler.state.scale)

    @loss_scale.setter
    def loss_scale(self, value: float | torch.Tensor) -> None:
        if isinstance(value, torch.Tensor) and value.numel() == 1:  # as clip_master_grads takes
            value = value.item()
        check_scale("loss_scale", value)
        policy = self._scaler.policy
        if isinstance(policy, DynamicLossScale) and scale_fault(policy, value) is not None:
            raise ValueError(
                f"loss_scale must lie within the dynamic loss scale's bounds, min_loss_scale "
                f"{policy.min_scale:g} to max_loss_scale {policy.max_scale:g}, got {value!r}"
            )
        self._engine.keep_scale_of_the_grads()  # in any phase: grads outlive a step or a load
        self._scaler.state.scale.fill_(float(value))

    @property
    def overflow(self) -> bool:
        """Whether the latest gradients held inf/NaN (computed when read: one sync)."""
        if self._phase.overflow is not None:
            return self._phase.overflow
        engine = self._engine
        if self._phase.grads == "fresh":  # read, not unscaled: more may accumulate on them
            return not engine.local_finite()
        if isinstance(engine, GenericEngine):
            unscaled = self._phase.grads == "unscaled"
            return not (engine.finite() if unscaled else engine.stepped_finite())
        return engine.last_info is not None and not bool(engine.last_info.finite)

    @overflow.setter
    def overflow(self, value: bool) -> None:
        self._phase.overflow = bool(value)

    @property
    def first_closure_call_this_step(self) -> bool:
        """apex's flag: the closure of the current ``step`` has not run yet."""
        return self._phase.first_closure_call

    @first_closure_call_this_step.setter
    def first_closure_call_this_step(self, value: bool) -> None:
        self._phase.first_closure_call = bool(value)

    @property
    def skipped_steps(self) -> int:
        """The number of steps skipped for inf/NaN gradients so far (reading it syncs)."""
        return self._reporter.skipped_total + int(self._scaler.stats[0])

    @property
    def fp16_groups(self) -> list[list[torch.Tensor]]:
        """apex's: per param group, its trained FP16/BF16 model params."""
        return [[p for p in ps if p.dtype != torch.float32] for ps in self._params.trainable]

    @property
    def fp32_from_fp16_groups(self) -> list[list[torch.Tensor]]:
        """apex's: per param group, the FP32 masters of :attr:`fp16_groups` (the tensors the
        groups hold for them, live). Raises where there are none to hold: compensated masters
        and sharded ones are read whole from ``state_dict()["fp32_from_fp16"]``."""
        pairs = list(zip(self._params.trainable, self._params.masters))
        if any(m is p for ps, ms in pairs for p, m in zip(ps, ms) if p.dtype != torch.float32):
            raise RuntimeError(
                "this FP16_Optimizer holds no FP32 master tensors (master='compensated', or "
                "sharded): read the masters from state_dict()['fp32_from_fp16']"
            )
        return [[m for p, m in zip(ps, ms) if p.dtype != torch.float32] for ps, ms in pairs]

    @property
    def fp32_from_fp32_groups(self) -> list[list[torch.Tensor]]:
        """apex's: per param group, its trained FP32 params (their own masters)."""
        return [[p for p in ps if p.dtype == torch.float32] for ps in self._params.trainable]

    def __getstate__(self) -> Any:
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    def __repr__(self) -> str:
        return describe(self.optimizer, self._engine, self._params, self._scaler)

    # -- apex's API ----------------------------------------------------------------------

    def backward(
        self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False
    ) -> None:
        """Backpropagates ``loss`` (in FP32) times the loss scale; then ``update_master_grads``.

        Use instead of ``loss.backward()``. For gradient accumulation call
        ``backward(loss, update_master_grads=False)`` per micro-batch, then
        ``update_master_grads()`` once before ``step()`` (or keep the default: the scale
        moves once per step, so each call's grads carry the same scale either way).
        """
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            what = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else loss
            raise TypeError(f"backward expects the loss as a one-element tensor, got {what!r}")
        if isinstance(self._engine, FastEngine):
            self._engine.forget_check()
        before = self._engine.grad_stamp()
        (loss.float() * self._scaler.state.scale).backward(retain_graph=retain_graph)
        if before.unchanged():
            raise self._params.reached_nothing()
        self._phase.new_grads()
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Makes the model grads the next step's (unscaled, checked) gradient.

        Generic path: copies them, unscaled, into the FP32 masters' grads and checks them, as
        apex did (the scale moves in ``step()``; across processes, the step agrees on the
        ranks' checks). Fast path: the grads already sit in the flat buffer, and the step
        unscales and checks them.
        """
        self._phase.new_grads()
        if isinstance(self._engine, GenericEngine):
            self._engine.update_master_grads()
            self._phase.grads = "unscaled"
        else:
            self._engine.forget_check()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Applies the update from the current grads, or skips it if they overflowed.

        With a ``closure`` (which must call ``zero_grad()`` and ``optimizer.backward(loss)``
        and return the loss) the closure is re-run until its gradients are finite, as in apex;
        when they cannot become finite (static scale, or scale at its minimum) it raises
        FloatingPointError. Each overflow backs the scale off before the re-run; the step
        then counts once toward the scale window, however many times the wrapped optimizer
        (LBFGS) called the closure. Grads produced without ``backward`` (e.g.
        ``loss.backward()``) are taken as grads of the scaled loss.
        """
        if closure is not None:
            before = self._engine.grad_stamp()
            try:
                return self._step_with_closure(closure)
            except BaseException:
                if not before.unchanged():  # it made grads, then raised: they are spent
                    self._phase.grads = "stale"
                raise
        if isinstance(self._engine, FastEngine):
            try:
                self._fast_step()
            except Unsupported as err:
                self._handover(err)
            else:
                self._phase.overflow = None
                return self._stepped(None)
        else:
            self._check_unchanged()
        self._phase.overflow = None
        engine = self._engine
        assert isinstance(engine, GenericEngine)
        if self._phase.grads != "unscaled":  # also grads made without backward()
            engine.update_master_grads()
        engine.resync_masters()
        engine.agree()
        return self._stepped(engine.step())

    def _check_unchanged(self) -> None:
        """Raises, before a step, where the param groups changed behind this optimizer's back
        (:meth:`ParamSet.check_unchanged`), or on the generic path a param's data
        (:meth:`ParamSet.check_data`; the fast path checks its flat buffers instead)."""
        self._params.check_unchanged(self.param_groups)
        if isinstance(self._engine, GenericEngine):
            self._params.check_data()

    def _fast_step(self) -> StepInfo:
        """Runs the fast engine's step on the current grads, after the checks that refuse to
        step them (a param frozen at build time that has a grad now, a param moved out of
        its flat buffer). Raises Unsupported, before anything changed, to hand over."""
        self._check_unchanged()
        fast = self._engine
        if not isinstance(fast, FastEngine):  # a closure's add_param_group switched paths
            raise Unsupported("the closure switched to it")
        fast.check_params()
        return fast.step()

    def _step_with_closure(self, fn: Callable[[], Any]) -> Any:
        first_loss = closure.NOT_RUN
        if isinstance(self._engine, FastEngine):
            try:
                loss = closure.fast_step(
                    fn, self._fast_step, self._phase, self._scaler, self._stepped
                )
            except closure.HandOver as handing:
                if isinstance(self._engine, FastEngine):
                    self._handover(handing.reason)
                first_loss = handing.loss  # its grads are in place: the generic step reads them
            else:
                self._phase.grads = "stale"
                return loss
        engine = self._engine
        assert isinstance(engine, GenericEngine)
        engine.resync_masters()
        result = closure.generic_step(
            fn, engine, self._phase, self._scaler, self._check_unchanged, first_loss
        )
        return self._stepped(result)

    def update(self, closure: Callable[[], Any] | None = None) -> Any:
        """Alias of :meth:`step` (a widely copied apex tutorial calls ``optimizer.update()``)."""
        return self.step(closure)

    def _stepped(self, result: Any) -> Any:
        self._phase.grads = "stale"
        self._reporter.stepped(self._scaler.stats, self._scaler.state.scale)
        return result

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> float:
        """Returns the total norm of the unscaled grads (-1 on overflow); clips to ``max_norm``.

        As apex (and ``torch.nn.utils.clip_grad_norm_``): the norm is over all masters' grads,
        and grads are scaled by ``max_norm / (norm + 1e-6)`` when that is below 1. Returning a
        Python float syncs with the device (inherent to the API). On the fast path the clipping
        itself is folded into the next ``step()``, which reuses its own norm: no extra pass; a
        second call sees the grads the first clipped and returns their norm, as apex's did.
        A ``norm_type`` other than 2 moves the optimizer to the generic path (a sharded or
        FSDP2 one, which has none, raises ValueError). Across processes every rank clips by
        the norm the ranks agree on and returns it (docs/distributed.md). ``max_norm`` is a
        number > 0 (numpy's too) or a one-element tensor, as ``clip_grad_norm_`` takes; inf,
        or the largest float (``sys.float_info.max``), means no clip, even where the norm is
        inf. (``clip_grad_norm_`` also takes 0 and negative numbers, which zero the grads or
        flip their sign: ValueError here, nothing changed.)
        """
        try:  # the rule of clip_by_global_norm's max_norm
            max_norm = check_hyperparam("max_norm", max_norm)
        except (TypeError, ValueError):
            if not _is_positive_infinity(max_norm):
                raise ValueError(
                    f"max_norm must be a finite number > 0 (or inf: no clip), got {max_norm!r}"
                ) from None
            max_norm = NO_CLIP  # clip_grad_norm_'s "no clip", as the core spells it
        try:
            order = float(norm_type)  # as torch's clip_grad_norm_, which takes "inf" too
        except (TypeError, ValueError):
            order = math.nan
        if isinstance(norm_type, bool) or math.isnan(order):
            raise ValueError(f"norm_type must be a number (2, 1, inf...), got {norm_type!r}")
        if isinstance(self._engine, FastEngine):
            if order == 2.0:
                try:
                    finite, norm = self._engine.check()
                except Unsupported as err:  # a sparse grad, which the generic path takes
                    self._handover(err)
                else:
                    self._phase.new_grads()  # overflow reads these grads
                    if not bool(finite):
                        return -1.0
                    return float(self._engine.grad_facts.clip(float(max_norm), norm))
            elif self.sharded or self._engine.fsdp:
                raise ValueError(f"{self._engine.whose} clips by the L2 norm (norm_type=2) only")
            else:
                self._handover(Unsupported(f"clip_master_grads(norm_type={norm_type!r})"))
        engine = self._engine
        assert isinstance(engine, GenericEngine)
        engine.check_norm_type(order)  # before the grads are unscaled: nothing changes
        if self._phase.grads != "unscaled":
            self.update_master_grads()
        self._phase.overflow = None  # overflow reads these grads
        engine.agree()
        return engine.clip(max_norm, order)

    def zero_grad(
        self, set_grads_to_None: bool = False, *, set_to_none: bool | None = None
    ) -> None:
        """Zeroes the grads of the model params and masters in place, or sets them to None.

        ``set_to_none`` (torch's spelling) overrides apex's ``set_grads_to_None``. Zeroing in
        place (the default) keeps the fast path's grads as views of its flat buffer; setting
        them to None costs one extra copy of each grad in the next step.
        """
        to_none = set_grads_to_None if set_to_none is None else set_to_none
        self._engine.zero_grad(to_none)
        for p in self._params.frozen:
            if to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self._phase.grads = "stale"

    def inspect_master_grad_data(self) -> list[list[torch.Tensor | None]] | None:
        """Returns per param group the unscaled FP32 grad of each param (None: no grad).

        Returns None (and logs a warning) when the current grads overflowed, as apex did.
        A sharded optimizer raises RuntimeError, overflow or not (every rank alike: a rank
        reads its own grads' overflow): the averaged grads exist only as slices.
        """
        if isinstance(self._engine, FastEngine):
            self._engine.require_unsharded("inspect_master_grad_data()")
        if self.overflow:
            logger.warning(
                "fp16fx: inspect_master_grad_data called while the gradients overflowed; "
                "returning None"
            )
            return None
        if isinstance(self._engine, FastEngine):
            try:
                grads = self._engine.unscaled_grads()
            except Unsupported as err:  # a sparse grad, which the generic path takes
                self._handover(err)
        engine = self._engine
        if isinstance(engine, GenericEngine):  # the masters' grads, or what they will be
            grads = engine.unscaled_grads(fresh=self._phase.grads == "fresh")
        return [[grads.get(p) for p in group["params"]] for group in self.param_groups]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a param group, as ``torch.optim.Optimizer.add_param_group`` (apex lacked it).

        Its FP16/BF16 params get FP32 masters; on the fast path every param moves into new
        flat buffers (one recompile; the masters of the other groups become new tensors).
        """
        n = len(self.param_groups)
        self.optimizer.add_param_group(param_group)  # torch's checks, defaults filled in
        try:
            group = self.param_groups[n]
            # The groups hold masters (or fast-path entries) for the params trained so far
            names = {**self._params.names, **param_names(self.optimizer)}
            check_unique([group], first=n)
            known = self._params.known()
            again = [names[id(p)] for p in group["params"] if id(p) in known]
            if again:  # torch cannot see it: the groups hold its master, not the param itself
                raise ValueError(
                    f"some parameters appear in more than one parameter group: {again[0]} is "
                    "already trained by this FP16_Optimizer"
                )
            params = [p for p in group["params"] if p.requires_grad]
            trained = [p for ps in self._params.trainable for p in ps]
            every = [*trained, *params]
            check_trainable(every, names, self._scaler.state.scale.device)
            # FSDP2: all DTensors of one mesh or none, as when it was built (the fast path
            # refuses the group after this; torch's optimizer would take it, then every step
            # would raise)
            dtensors.local_shards(every, name_of=lambda i: names[id(every[i])])
            moved: dict[int, torch.Tensor] = {}
            if isinstance(self._engine, FastEngine):
                try:
                    moved = self._engine.add_group(params, names)
                except Unsupported as err:
                    self._handover(err)
            if isinstance(self._engine, FastEngine):
                masters = [self._engine.entry(p) for p in params]
            else:
                masters = GenericEngine.make_masters(params)
                self._engine.add_group(params, masters)
        except BaseException:
            self.optimizer.param_groups.pop()
            raise
        for old_group in self.param_groups[:n]:
            old_group["params"] = [moved.get(id(e), e) for e in old_group["params"]]
        self._params.move_masters(moved)
        replace_params(self.optimizer, group, params, masters)
        self._params.add(params, masters, group, names)
        if self._phase.grads == "stale" and any(p.grad is not None for p in params):
            self._phase.new_grads()  # grads no step has seen arrived with the group

    def state_dict(self) -> dict[str, Any]:
        """Returns apex's checkpoint dict; only tensors and Python primitives (weights_only).

        Keys: ``optimizer_state_dict`` (the wrapped optimizer's, masters in place of FP16
        params), ``fp32_from_fp16`` (per group, the FP32 masters), ``loss_scaler`` (a plain
        dict: scale, growth tracker, hysteresis counter, policy), ``dynamic_loss_scale``,
        ``overflow``, ``first_closure_call_this_step``; fp16fx's ``trainable`` and, on the
        fast path, ``applied_steps`` and ``param_segments``
        (:mod:`fp16fx.facade.checkpoint`). Some tensors are references to the live state, as
        in torch.optim, others copies (step counts; in compact precision the decoded masters
        and moments): save or copy the dict before stepping again. A sharded
        optimizer returns this rank's shard instead (:mod:`fp16fx.facade.checkpoint`). On an
        FSDP2 model it returns the dict for ``torch.distributed.checkpoint`` (DTensors laid
        out like the params; ``dcp.load`` into it, then pass it to :meth:`load_state_dict`).
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():  # as torch.optim
            pre_hook(self)
        flags = {
            "overflow": self.overflow,
            "first_closure_call_this_step": self._phase.first_closure_call,
        }
        state_dict = checkpoint.state_dict(
            self.optimizer, self._engine, self._params, self._scaler, flags
        )
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            returned = post_hook(self, state_dict)
            state_dict = state_dict if returned is None else returned
        return state_dict

    def load_state_dict(self, state_dict: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Loads a dict from :meth:`state_dict`, from apex's ``FP16_Optimizer.state_dict()``
        (as ``fp16fx.load_apex_checkpoint`` returns it, or with apex scaler objects), or the
        list of every rank's dicts of a sharded optimizer (saved at any world size), or
        raises ValueError/TypeError naming the entry that does not fit -- then nothing changed.
        On an FSDP2 model: the DCP dict, filled by ``dcp.load``, or gathered whole by
        ``fp16fx.distributed.fsdp.full_state_dict`` (each rank takes its shard).

        The FP16/BF16 model params are set from the loaded masters. The load hooks run as in
        torch.optim (``register_load_state_dict_pre_hook``'s get a shallow copy of the dict,
        and may return another). Sharded or on FSDP2, every rank loads or none does: a pre-hook
        that raises on one rank makes every rank raise, as a dict one rank refuses does. The
        pre-hooks run just before the ranks agree, so a hook may load another optimizer; a
        hook that runs a collective must run it on every rank, after no hook raised on one.
        """
        refusal = None
        try:  # before the ranks' agreement, not in it: a hook may load (and agree) itself
            state_dict = self._pre_hooked(state_dict)
        except Exception as err:
            refusal = err
        try:  # Sharded or FSDP2, with the core's load beneath: every rank loads, or none does.
            with loading_together(self._load_group()):
                if refusal is not None:
                    raise refusal
                phase = self._load_on_this_rank(state_dict)
        finally:
            del refusal  # its traceback holds this frame: no cycle keeping the dict alive
        self._phase = phase
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _pre_hooked(self, state_dict: Any) -> Any:
        """Returns what the load pre-hooks make of a shallow copy of ``state_dict`` (as
        torch.optim: a hook may edit the copy, not the caller's dict, or return another)."""
        if isinstance(state_dict, Mapping):
            state_dict = dict(state_dict)
        elif isinstance(state_dict, (list, tuple)):
            state_dict = list(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            returned = pre_hook(self, state_dict)
            state_dict = state_dict if returned is None else returned
        return state_dict

    def _load_group(self) -> Any:
        """The process group whose ranks load a checkpoint together (None: this rank alone)."""
        engine = self._engine
        if not isinstance(engine, FastEngine):
            return None
        if engine.fsdp:
            return fsdp.mesh_group(engine.flat.params)
        return None if engine.sharded is None else engine.sharded.sharding.process_group

    def _load_on_this_rank(
        self, state_dict: Mapping[str, Any] | Sequence[Mapping[str, Any]]
    ) -> Phase:
        """Loads ``state_dict`` and returns the phase it puts the optimizer in (its flags; the
        grads are as they were), or raises having changed nothing."""
        engine = self._engine
        checkpoint.refuse_the_generic_path_on_fsdp2(
            self.optimizer, engine, self._params, "load_state_dict()"
        )
        if checkpoint.steps_fsdp2_shards(engine) or (
            isinstance(state_dict, Mapping) and state_dict.get("format") == checkpoint.FSDP_FORMAT
        ):
            loading.load_fsdp(self.optimizer, engine, self._params, state_dict)
            return Phase(
                grads=self._phase.grads,
                overflow=state_dict["overflow"],
                first_closure_call=state_dict["first_closure_call_this_step"],
            )
        if isinstance(state_dict, (list, tuple)) and all(
            isinstance(d, Mapping) for d in state_dict
        ):  # every rank's dict of a sharded run
            state_dict = checkpoint.consolidate_state_dict(state_dict)
        plan = loading.parse(self.optimizer, engine, self._params, state_dict)
        try:
            loading.load(self.optimizer, engine, self._params, self._scaler, plan)
        except Unsupported as err:  # the loaded groups need the generic path
            self._handover(err, keep_state=False)
            loading.load(self.optimizer, self._engine, self._params, self._scaler, plan)
        return Phase(
            grads=self._phase.grads,
            overflow=plan.overflow,
            first_closure_call=plan.first_closure_call,
        )

    # -- internals -----------------------------------------------------------------------

    def _handover(self, reason: Exception | str, *, keep_state: bool = True) -> None:
        """Switches from the fast to the generic path (:func:`~fp16fx.facade.engines.handover`)."""
        fast = self._engine
        assert isinstance(fast, FastEngine)
        # The grads' scale and a pending clip belong to the grads, which outlive a load too.
        max_norm, made_at = fast.grad_facts.clip_norm(), fast.grad_facts.made_at()
        self._engine = generic = handover(fast, self._params, reason, keep_state=keep_state)
        if max_norm != NO_CLIP or made_at is not None:
            # The masters' grads as the fast step would have read them (grads stepped before
            # by the scale they were made with), and clipped as it would have clipped them.
            generic.update_master_grads(made_at)
            if max_norm != NO_CLIP:
                # Across processes, by the norm the ranks agreed for it (no collective here:
                # a switch may be one rank's alone); its own would clip the ranks apart.
                agreed = fast.last_agreed()
                if agreed is not None:
                    generic.take_agreed(agreed)
                generic.clip(max_norm, 2.0)
            if self._phase.grads == "fresh":  # as update_master_grads() would leave them;
                self._phase.grads = "unscaled"  # stepped ones stay stale: new ones count


def _is_positive_infinity(value: Any) -> bool:
    """Whether ``value`` is +inf: a Python or NumPy real number, or a one-value real tensor
    that holds a value (read: one sync)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_meta or not value.dtype.is_floating_point:
            return False
        value = value.item()
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == math.inf
