"""The fast path: SGD/Adam/AdamW param groups stepped by the compiled core over flat buckets.

Layer: ``facade`` (DESIGN.md). No optimizer math here: each param group becomes the core's
transform (:mod:`fp16fx.facade.groups`) and every step is :func:`fp16fx.step.apply_updates_`,
compiled once per process and shared by every ``FP16_Optimizer``, over a few flat tensors.

The core's leaves are *segments*: runs of consecutive params of one
:class:`~fp16fx.facade.buffers.FlatBucket` -- normally one segment per bucket. The core keeps one
step count per leaf, so params whose optimizer state must differ go to different segments: one
that has no gradient in a step (torch.optim leaves it and its state untouched; so does the core
for a leaf whose grad is None), or states loaded with different step counts. Segments are views
of their bucket's flat buffers (params, masters, moments), so re-segmenting moves no memory; it
changes the compiled graph's inputs, which costs one compile per new layout.
"""

from __future__ import annotations

import inspect
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from fp16fx.facade import torch_state
from fp16fx.facade.buffers import FlatBucket, group_buckets
from fp16fx.facade.groups import (
    NO_CLIP,
    GroupSpec,
    Unsupported,
    build_transform,
    fast_kind,
    group_spec,
    group_values,
)
from fp16fx.facade.policy import Scaler
from fp16fx.facade.torch_state import PerParamState, Segment
from fp16fx.scaling import unscale_and_check
from fp16fx.state import MixedPrecisionState, init
from fp16fx.step import Info, apply_updates_, run_step
from fp16fx.transforms import GradientTransformation, TransformState, multi_transform
from fp16fx.transforms import replace_hyperparams as _replace_hyperparams

logger = logging.getLogger("fp16fx")


def apply_and_count(*args: Any) -> Info:
    """:func:`apply_updates_`, then adds this step's (skipped, floored) to ``args[-1]``."""
    *core_args, stats = args
    info = apply_updates_(*core_args)
    stats.add_(torch.stack([~info["finite"], info["loss_scale_floored"]]).to(stats.dtype))
    return info


def finite_and_norm(grads: list[torch.Tensor], scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Returns ``(finite, norm)`` of ``grads`` unscaled by ``scale`` (no consensus)."""
    _, finite, norm = unscale_and_check(grads, scale)
    return finite, norm


_COMPILED: dict[str, Callable[..., Any]] = {}
_COMPILE_ERRORS = tuple(
    getattr(module, name)
    for module, name in (
        (torch._dynamo.exc, "FailOnRecompileLimitHit"),
        (torch._dynamo.exc, "BackendCompilerFailed"),
        (torch._inductor.exc, "InductorError"),
    )
    if hasattr(module, name)
)


def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Returns ``fn`` compiled once per process (every FP16_Optimizer shares its graphs).

    Each layout of buckets and segments is one graph; torch's default limit of 8 graphs per
    function is raised where torch allows it, since a process may build many optimizers.
    """
    if fn.__name__ not in _COMPILED:
        options: dict[str, Any] = {"fullgraph": True, "dynamic": False}
        if "recompile_limit" in inspect.signature(torch.compile).parameters:
            options["recompile_limit"] = 64
        _COMPILED[fn.__name__] = torch.compile(fn, **options)
    return _COMPILED[fn.__name__]


class FastEngine:
    """Steps an SGD/Adam/AdamW's param groups with the compiled core (stateful).

    Built over ``trainable[k]``, the params of group ``k`` that require grad (any mix of FP16,
    BF16, FP32 on one device): they move into flat buckets, FP16/BF16 ones get FP32 masters
    (views of one flat master per bucket; ``entry(p)`` is what the param group holds for ``p``).
    Raises Unsupported, before changing anything, when the core cannot run the optimizer.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        trainable: Sequence[Sequence[torch.Tensor]],
        scaler: Scaler,
        *,
        compiled: bool,
    ) -> None:
        kind = fast_kind(optimizer)
        if kind is None:
            raise Unsupported(f"{type(optimizer).__name__} is not exactly SGD, Adam or AdamW")
        specs = [group_spec(kind, g, k) for k, g in enumerate(optimizer.param_groups)]
        for spec, group in zip(specs, optimizer.param_groups):
            build_transform(spec, group_values(spec, group))  # validates the numbers
        self.optimizer, self.kind, self.scaler, self.compiled = optimizer, kind, scaler, compiled
        self.device = scaler.state.scale.device
        self.count = torch.zeros((), dtype=torch.int64, device=self.device)
        self.specs: list[GroupSpec] = []
        self.transforms: list[GradientTransformation] = []
        self.hyperparams: list[Any] = []
        self._written: list[dict[str, Any]] = []  # the values last written into hyperparams
        self.buckets: list[FlatBucket] = []
        self.masters: list[torch.Tensor] = []  # per bucket: flat FP32 (the params if FP32)
        self.bucket_leaves: list[Any] = []  # per bucket: the flat optimizer state
        self._entries: dict[int, torch.Tensor] = {}
        self.max_norm = NO_CLIP  # clip_master_grads' request for the next step
        self._clip_written = NO_CLIP
        self.last_info: Info | None = None
        self._checked: tuple[torch.Tensor, torch.Tensor] | None = None
        self._build(trainable, specs)

    # -- building ------------------------------------------------------------------------

    def _build(self, trainable: Sequence[Sequence[torch.Tensor]], specs: list[GroupSpec]) -> None:
        """Moves the params into flat buckets and makes their masters and core state."""
        for k, params in enumerate(trainable):
            self._add_group(k, params, specs[k])
        self.rebuild({})

    def _add_spec(self, k: int, spec: GroupSpec) -> None:
        """Makes param group ``k``'s transform and hyperparameter tensors."""
        group = self.optimizer.param_groups[k]
        self.specs.append(spec)
        self.transforms.append(build_transform(spec, group_values(spec, group)))
        self.hyperparams.append(self.transforms[k].init_hyperparams(self.device))
        self._written.append(group_values(spec, group))

    def _add_group(self, k: int, params: Sequence[torch.Tensor], spec: GroupSpec) -> None:
        self._add_spec(k, spec)
        new = group_buckets(k, params)
        if not new:
            return
        # fp16fx.init makes each FP16/BF16 bucket's FP32 master and each bucket's zero state.
        state = init(
            [b.param_buffer for b in new],
            multi_transform(self.transforms, labels=[b.group for b in new]),
            self.scaler.policy,
        )
        for bucket, master, leaf in zip(new, state.master, state.opt_state.leaves):
            self.buckets.append(bucket)
            self.masters.append(master)
            self.bucket_leaves.append(leaf)
            for p, (a, b) in zip(bucket.params, bucket.spans()):
                entry = p if p.dtype == torch.float32 else master[a:b].view(p.shape)
                self._entries[id(p)] = entry.requires_grad_(True)

    def entry(self, param: torch.Tensor) -> torch.Tensor:
        """Returns what the param group holds for model param ``param`` (its FP32 master)."""
        return self._entries[id(param)]

    def _bucket_entries(self, b: int) -> list[torch.Tensor]:
        return [self._entries[id(p)] for p in self.buckets[b].params]

    def add_group(self, k: int, params: Sequence[torch.Tensor]) -> None:
        """Adds param group ``k`` (already appended to the wrapped optimizer): new buckets."""
        group = self.optimizer.param_groups[k]
        spec = group_spec(self.kind, group, k)
        build_transform(spec, group_values(spec, group))
        current = self.export()
        self._add_group(k, params, spec)
        self.rebuild(current)

    def rebuild(self, per_param: PerParamState, has_grad: list[list[bool]] | None = None) -> None:
        """Re-segments the buckets for ``per_param`` (torch's format) and loads it.

        Segment boundaries fall where the params' signatures (step count, momentum buffer or
        not) differ and, given ``has_grad``, where having a gradient this step differs.
        """
        for b, bucket in enumerate(self.buckets):
            spec = self.specs[bucket.group]
            for entry in self._bucket_entries(b):
                torch_state.check(spec, entry, per_param.get(entry, {}))
        signatures = [
            [
                torch_state.signature(self.specs[bucket.group], per_param.get(e, {}))
                for e in self._bucket_entries(b)
            ]
            for b, bucket in enumerate(self.buckets)
        ]
        cuts = []
        for b, bucket in enumerate(self.buckets):
            marks = signatures[b] if has_grad is None else list(zip(signatures[b], has_grad[b]))
            inner = [i for i in range(1, len(bucket)) if marks[i] != marks[i - 1]]
            cuts.append([0, *inner, len(bucket)])
        self._assemble(cuts)
        for seg, leaf in zip(self.segments, self.state.opt_state.leaves):
            bucket, entries = self.buckets[seg.bucket], self._bucket_entries(seg.bucket)
            spans = [(a - seg.start, z - seg.start) for a, z in bucket.spans()[seg.lo : seg.hi]]
            saved = [per_param.get(e, {}) for e in entries[seg.lo : seg.hi]]
            torch_state.fill(leaf, spans, saved, signatures[seg.bucket][seg.lo])

    def restructure(self, specs: list[GroupSpec], per_param: PerParamState) -> None:
        """Rebuilds the transforms for new group ``specs`` and loads ``per_param``."""
        groups = self.optimizer.param_groups
        transforms = [build_transform(s, group_values(s, g)) for s, g in zip(specs, groups)]
        for b, bucket in enumerate(self.buckets):
            for entry in self._bucket_entries(b):
                torch_state.check(specs[bucket.group], entry, per_param.get(entry, {}))
        for k, spec in enumerate(specs):
            if spec != self.specs[k]:
                for b, bucket in enumerate(self.buckets):
                    if bucket.group == k:
                        self.bucket_leaves[b] = transforms[k].init_leaf(self.masters[b], 0)
            self.specs[k], self.transforms[k] = spec, transforms[k]
            self.hyperparams[k] = transforms[k].init_hyperparams(self.device)
            self._written[k] = group_values(spec, groups[k])
        self._clip_written = NO_CLIP
        self.rebuild(per_param)

    def _assemble(self, cuts: list[list[int]]) -> None:
        """Builds the core's state with one leaf per segment (views of the bucket buffers)."""
        params, masters, leaves, labels = [], [], [], []
        self.segments: list[Segment] = []
        self.segment_grads: list[torch.Tensor] = []
        for b, bucket in enumerate(self.buckets):
            whole = cuts[b] == [0, len(bucket)]
            for lo, hi in itertools.pairwise(cuts[b]):
                seg = Segment(b, lo, hi, bucket.offsets[lo], bucket.offsets[hi])
                part = slice(seg.start, seg.end)
                param = bucket.param_buffer if whole else bucket.param_buffer[part]
                if bucket.dtype == torch.float32:
                    master = param  # an FP32 param is its own master
                else:
                    master = self.masters[b] if whole else self.masters[b][part]
                leaf = self.bucket_leaves[b]
                if not whole:
                    leaf = torch_state.slice_leaf(leaf, seg.start, seg.end, bucket.offsets[-1])
                params.append(param)
                masters.append(master)
                leaves.append(leaf)
                labels.append(bucket.group)
                self.segments.append(seg)
                self.segment_grads.append(bucket.grad_buffer if whole else bucket.grad_buffer[part])
        self.cuts = cuts
        self.state = MixedPrecisionState(
            params=params,
            master=masters,
            opt_state=TransformState(hyperparams=tuple(self.hyperparams), leaves=leaves),
            loss_scale=self.scaler.state,
            count=self.count,
            optimizer=multi_transform(self.transforms, labels=labels),
            policy=self.scaler.policy,
            consensus=self.scaler.consensus,
        )

    def export(self) -> PerParamState:
        """Returns the optimizer state in torch.optim's per-param format (one sync).

        Keyed by param-group entry; moments are views of the live buffers, as torch's own
        ``state_dict`` holds references. Params that never took a step have no entry.
        """
        leaves = self.state.opt_state.leaves
        found = [(s, leaf) for s, leaf in zip(self.segments, leaves) if torch_state.stateful(leaf)]
        if not found:
            return {}
        counts = torch.stack([torch_state.stateful(leaf).count for _, leaf in found]).tolist()
        out: PerParamState = {}
        for (seg, leaf), count in zip(found, counts):
            bucket = self.buckets[seg.bucket]
            group = self.optimizer.param_groups[bucket.group]
            on_device = group.get("capturable") or group.get("fused")
            spans = [(a - seg.start, z - seg.start) for a, z in bucket.spans()[seg.lo : seg.hi]]
            entries = self._bucket_entries(seg.bucket)[seg.lo : seg.hi]
            device = self.device if on_device else None
            out.update(torch_state.export(leaf, count, spans, entries, device))
        return out

    # -- stepping ------------------------------------------------------------------------

    def sync_groups(self) -> None:
        """Writes the param groups' current numbers into the core's 0-d tensors (no sync).

        A changed structural option (momentum on/off, nesterov, amsgrad) rebuilds the
        transforms (one recompile); one the core lacks (maximize) raises Unsupported.
        """
        groups = self.optimizer.param_groups
        specs = [group_spec(self.kind, g, k) for k, g in enumerate(groups)]
        if specs != self.specs:
            logger.info("fp16fx: a param group's structure changed; rebuilding the fast path")
            self.restructure(specs, self.export())
        for k, group in enumerate(groups):
            values, written = group_values(self.specs[k], group), self._written[k]
            changed = {
                n: v for n, v in values.items() if isinstance(v, torch.Tensor) or written[n] != v
            }
            if changed:
                _replace_hyperparams(self.hyperparams[k], changed, inplace=True)
                written.update(changed)
        if self.max_norm != self._clip_written:
            for hp in self.hyperparams:
                _replace_hyperparams(hp, {"max_norm": self.max_norm}, inplace=True)
            self._clip_written = self.max_norm

    def gather(self) -> list[torch.Tensor | None]:
        """Returns one grad per segment (None: no param of it has one), re-segmenting if needed."""
        has_grad = [bucket.collect_grads() for bucket in self.buckets]
        if any(len(set(has_grad[s.bucket][s.lo : s.hi])) > 1 for s in self.segments):
            logger.info(
                "fp16fx: some params have no gradient this step; splitting their flat bucket "
                "so that they and their optimizer state stay untouched (one recompile)"
            )
            self.rebuild(self.export(), has_grad)
        return [
            grad if has_grad[seg.bucket][seg.lo] else None
            for seg, grad in zip(self.segments, self.segment_grads)
        ]

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.compiled:
            try:
                return _compiled(fn)(*args)
            except _COMPILE_ERRORS as err:  # nothing ran yet: the step is still to do
                logger.warning("fp16fx: torch.compile failed (%s); stepping eagerly", err)
                self.compiled = False
        return fn(*args)

    def step(self) -> Info:
        """Runs the core on the current grads (skipped exactly on inf/NaN); returns its info."""
        self.sync_groups()
        grads = self.gather()

        def core(*args: Any) -> Info:
            return self._call(apply_and_count, *args, self.scaler.stats)

        _, info = run_step(core, self.state, grads, inplace=True)
        self.last_info, self._checked, self.max_norm = info, None, NO_CLIP
        return info

    def check(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(finite, norm)`` of the current unscaled grads (0-d tensors), cached."""
        if self._checked is None:
            grads = [g for g in self.gather() if g is not None]
            self._checked = self._call(finite_and_norm, grads, self.scaler.state.scale)
        return self._checked

    def local_check(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns :meth:`check`: with replicated grads, this rank's check is every rank's."""
        return self.check()

    def forget_check(self) -> None:
        self._checked = None

    def unscaled_grads(self) -> dict[torch.Tensor, torch.Tensor]:
        """Returns ``{entry: unscaled FP32 grad}`` for every trained param with a grad."""
        pairs = [
            (self._entries[id(p)], p.grad)
            for bucket in self.buckets
            for p in bucket.params
            if p.grad is not None
        ]
        unscaled, _, _ = unscale_and_check([g for _, g in pairs], self.scaler.state.scale)
        return {entry: u for (entry, _), u in zip(pairs, unscaled)}

    def check_params(self, names: dict[int, str]) -> None:
        """Raises RuntimeError if a model param was moved out of its flat buffer."""
        for bucket in self.buckets:
            bucket.check_params(names)

    def zero_grad(self, set_to_none: bool) -> None:
        for bucket in self.buckets:
            bucket.zero_grads(set_to_none)
        self._checked = None

    def hyperparams_now(self) -> list[dict[str, float]]:
        """Returns, per group, the hyperparameters the compiled step reads (syncs)."""
        out = []
        for hp in self.hyperparams:
            flat: dict[str, float] = {}
            for d in optree.tree_leaves(hp, is_leaf=lambda x: isinstance(x, dict)):
                flat.update({name: t.item() for name, t in d.items()})
            out.append(flat)
        return out
