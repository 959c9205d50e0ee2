"""fp16fx on FSDP2 (``fully_shard``), CPU/gloo: FP16_Optimizer and the functional API on DTensor
params, the found-inf consensus over the mesh, DCP checkpoints resharded 2 -> 1, 2, 4, a dead or
hung rank, no host sync and no recompiles.

One spawned job per world size runs every scenario (imports cost ~6 s a job): d = 2 first (it
writes the checkpoint the others read), then d = 1 (the one-process reference) and d = 4. A
scenario that raises records its error; the tests reading it fail with that error. The model,
``Linear(8, 13) -> Tanh -> Linear(13, 3)``, has 13 and 3 rows: uneven shards at d = 2 (7/6,
2/1) and d = 4 (4/4/4/1, 1/1/1/0: rank 3 holds an empty shard).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optree
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate

import fp16fx
from fp16fx import dtensors
from fp16fx.distributed import fsdp
from tests.test_distributed import failed_step, spawn

IN, HIDDEN, OUT = 8, 13, 3
GLOBAL = 16  # samples per step, split over the ranks
STEPS, SAVE_AT, INF_AT = 10, 5, 3
LR, CLIP = 1e-2, 0.6  # the global grad norm is 0.5..0.9: clipping is active in some steps
INIT_SCALE = 2.0**10
HANG_TIMEOUT_S = 3
#: FP16 compute: each rank's FP16 forward and backward over its part of the batch rounds
#: differently from one over the whole batch (the ranks' FP32 grads are then averaged); after
#: 10 AdamW steps of lr 1e-2 the params agree to FP16 gradient precision (measured: at most
#: 3e-5 apart at d = 2 and 4, an eighth of this), the clip norms to 1.5e-4 relative.
TOL = {"rtol": 1e-3, "atol": 2e-4}
NORM_RTOL = 1e-3
HALF_TOL = {"rtol": 4e-3, "atol": 1e-3}  # FP16 params: within a few ulps
COMPACT = {"master": "compensated", "moments": "int8"}
#: int8 moments against FP32 ones: each AdamW step off by up to ~1% of lr (measured: params
#: 1.1e-3 apart after 10 steps of lr 1e-2).
INT8_TOL = {"rtol": 0, "atol": 3e-3}
#: fp16fx against torch's AdamW in one process: the same FP16 compute, the scale a power of
#: two; only the order of the FP32 update's operations differs (measured: 1.2e-7 apart).
TORCH_TOL = {"rtol": 1e-5, "atol": 1e-6}
MP = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
HALF = MixedPrecisionPolicy(param_dtype=torch.float16)  # FP16 params: cast the inputs only


# -- model, data, helpers ----------------------------------------------------------------------


def sharded(half: bool = False) -> nn.Module:
    """The model under FSDP2: FP32 params (their own masters) computing in FP16, or with
    ``half``, FP16 params (FP16 shards, grads reduced in FP16, FP32 masters kept by fp16fx)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))
    if half:
        model = model.half()
    for module in (model[0], model[2], model):
        fully_shard(module, mp_policy=HALF if half else MP)
    return model


def loss_of(model: nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
    """The loss of rank ``rank``'s part of step ``step``'s global batch, in FP16 compute."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL, IN, generator=g), torch.randn(GLOBAL, OUT, generator=g)
    part = slice(rank * GLOBAL // world, (rank + 1) * GLOBAL // world)
    return F.mse_loss(model(x[part]).float(), y[part])


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every param whole (a collective: every rank calls it)."""
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def shards(model: nn.Module) -> list[torch.Tensor]:
    return [dtensors.local(p).clone() for p in model.parameters()]


def facade(model: nn.Module, inner: Any = None, **kwargs: Any) -> fp16fx.FP16_Optimizer:
    return fp16fx.FP16_Optimizer(
        inner or torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": INIT_SCALE},
        verbose=False,
        **kwargs,
    )


def train(model, opt, steps, rank, world, *, inf_at: int | None = None) -> dict[str, Any]:
    """Steps ``opt`` over ``steps``; at ``inf_at`` rank 1 puts an inf into its local shard of
    ``2.weight``'s grad after backward. Returns the norms clip_master_grads saw, the scales."""
    norms, scales = [], []
    for i in steps:
        opt.zero_grad()
        opt.backward(loss_of(model, i, rank, world), update_master_grads=False)
        if i == inf_at and rank == 1:
            dtensors.local(model[2].weight.grad).view(-1)[0] = float("inf")
        opt.update_master_grads()
        norms.append(opt.clip_master_grads(CLIP))
        opt.step()
        scales.append(opt.loss_scale)
    return {"norms": norms, "scales": scales}


def save(model: nn.Module, opt: fp16fx.FP16_Optimizer, where: Path) -> None:
    sd = {"model": get_model_state_dict(model), "optim": opt.state_dict()}
    dcp.save(sd, checkpoint_id=str(where))


def load(model: nn.Module, opt: fp16fx.FP16_Optimizer, where: Path) -> None:
    sd = {"model": get_model_state_dict(model), "optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=str(where))  # reshards to this world size, in place
    set_model_state_dict(model, sd["model"])
    opt.load_state_dict(sd["optim"])


def attempt(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Runs a scenario; an exception is recorded (the test reading it then fails with it)."""
    try:
        return run()
    except Exception as err:  # reported by the test that reads it
        return {"error": f"{type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}"}


# -- scenarios (run by every rank) -------------------------------------------------------------


def training(rank: int, world: int, where: Path, compiled: bool) -> dict[str, Any]:
    """(1), (3): 10 steps of FP16_Optimizer(AdamW), a DCP checkpoint at step 5 (d = 2 saves
    it; other world sizes load it and train on from it)."""
    model = sharded()
    opt = facade(model, compiled=compiled)
    first = train(model, opt, range(SAVE_AT), rank, world)
    if world == 2:
        save(model, opt, where)
    rest = train(model, opt, range(SAVE_AT, STEPS), rank, world)
    out = {"params": full(model), "norms": first["norms"] + rest["norms"], "repr": repr(opt)}
    again = sharded()
    with torch.no_grad():
        for p in again.parameters():
            dtensors.local(p).zero_()  # the load must write every param
    opt = facade(again, compiled=compiled)
    load(again, opt, where)
    train(again, opt, range(SAVE_AT, STEPS), rank, world)
    return {**out, "resumed": full(again), "path": opt.path}


def training_half(rank: int, world: int, where: Path) -> dict[str, Any]:
    """(1) with FP16 DTensor params: the masters are fp16fx's, the shards their rounding (d = 2
    saves a checkpoint at step 5)."""
    model = sharded(half=True)
    opt = facade(model, compiled=False)
    first = train(model, opt, range(SAVE_AT), rank, world)
    if world == 2:
        save(model, opt, where / "half")
    rest = train(model, opt, range(SAVE_AT, STEPS), rank, world)
    return {"params": full(model), "norms": first["norms"] + rest["norms"], "path": opt.path}


def compact(rank: int, world: int, where: Path) -> dict[str, Any]:
    """FP16 params with compensated masters and int8 moments: 10 steps, a DCP checkpoint at
    step 5 (d = 2 saves it, and a gathered one-file checkpoint), resumed from it at d = 2 and
    4 in the same precision and at d = 1 with FP32 masters; at d = 4 also from
    ``training_half``'s FP32-master checkpoint, and from the gathered file."""
    model = sharded(half=True)
    opt = facade(model, compiled=False, **COMPACT)
    train(model, opt, range(SAVE_AT), rank, world)
    saved = opt.state_dict()["state"]
    if world == 2:
        save(model, opt, where / "compact")
        gathered = {
            "model": fsdp.full_state_dict(get_model_state_dict(model)),
            "optim": fsdp.full_state_dict(opt.state_dict()),
        }
        if rank == 0:
            torch.save(gathered, where / "compact.pt")
    train(model, opt, range(SAVE_AT, STEPS), rank, world)
    entries = saved["params"].values()
    state = fp16fx.init(dict(sharded(half=True).named_parameters()), fp16fx.adamw(LR), **COMPACT)
    out = {
        "params": full(model),
        "repr": repr(opt),
        "precision": saved["precision"],
        "kinds": sorted({(k.split(".")[-1], str(v.dtype)) for e in entries for k, v in e.items()}),
        "corrections": sorted({str(c.dtype) for c in state.master_segments}),
        "correction_numel": sum(c.numel() for c in state.master_segments),
        "param_numel": sum(dtensors.local(p).numel() for p in model.parameters()),
    }

    def resume(checkpoint: str, **precision: str) -> dict[str, torch.Tensor]:
        again = sharded(half=True)
        opt = facade(again, compiled=False, **precision)
        load(again, opt, where / checkpoint)
        train(again, opt, range(SAVE_AT, STEPS), rank, world)
        return full(again)

    def resume_gathered() -> dict[str, torch.Tensor]:
        again = sharded(half=True)
        opt = facade(again, compiled=False, **COMPACT)
        sd = torch.load(where / "compact.pt", weights_only=True)
        set_model_state_dict(again, sd["model"], options=StateDictOptions(full_state_dict=True))
        opt.load_state_dict(sd["optim"])  # each rank takes its shard of the whole tensors
        train(again, opt, range(SAVE_AT, STEPS), rank, world)
        return full(again)

    if world == 1:
        return {**out, "resumed_fp32": resume("compact")}
    if world == 4:
        out["from_fp32"] = resume("half", **COMPACT)
        out["from_gathered"] = resume_gathered()
    return {**out, "resumed": resume("compact", **COMPACT)}


def checkpoint_care(rank: int, world: int, where: Path) -> dict[str, Any]:
    """A DCP checkpoint's edges (FP16 shards, FP32 masters): a weight written before saving
    is saved as written; a load that does not fit (a param frozen since) is refused with
    nothing changed, although ``dcp.load`` filled its dict; after a load, an lr set back to
    the value last written before it is stepped with; the generic path refuses to save and to
    load."""
    model = sharded(half=True)
    opt = facade(model, compiled=False)
    train(model, opt, range(2), rank, world)
    with torch.no_grad():
        for p in model.parameters():
            dtensors.local(p).mul_(0.5)  # written between steps
    written = shards(model)
    saved = opt.state_dict()
    masters = [e["master"] for e in saved["state"]["params"].values()]
    out = {
        "written_saved": all(
            torch.equal(dtensors.local(m).half(), w) for m, w in zip(masters, written, strict=True)
        )
    }
    save(model, opt, where / "care")

    model = sharded(half=True)
    model[2].bias.requires_grad_(False)  # frozen since: the checkpoint trained it
    opt = facade(model, compiled=False)
    train(model, opt, range(1), rank, world)
    before = [t.clone() for t in shards(model)]
    core = [t.clone() for t in optimizer_leaves(opt)]
    try:
        load(model, opt, where / "care")
    except ValueError as err:
        out["refused"] = str(err)
    model_after = shards(model)  # set_model_state_dict loaded the model: the user's own call
    out["optimizer_unchanged"] = all(
        torch.equal(a, b) for a, b in zip(core, optimizer_leaves(opt), strict=True)
    ) and not all(map(torch.equal, before, model_after))

    model = sharded(half=True)
    opt = facade(model, compiled=False)  # lr LR, as the checkpoint's groups had
    opt.param_groups[0]["lr"] = 3 * LR  # written into the core at the first step
    train(model, opt, range(1), rank, world)
    load(model, opt, where / "care")  # the checkpoint's lr LR wins
    opt.param_groups[0]["lr"] = 3 * LR  # the value last written before the load
    train(model, opt, range(1), rank, world)
    out["lr_after_load"] = fp16fx.get_hyperparams(opt._engine.state)["lr"]

    generic = facade(sharded(), torch.optim.RMSprop(sharded().parameters()), compiled=False)
    try:
        generic.state_dict()
    except RuntimeError as err:
        out["generic"] = str(err)
    # Nor loads: an apex-format dict (whole tensors, as an unsharded run saves them) once
    # replaced its DTensor state and lr, and its next step failed in torch; an FSDP2 dict was
    # refused as saved "from an FSDP2 model's FP16_Optimizer; this one is not".
    plain = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))
    unsharded = facade(plain, torch.optim.RMSprop(plain.parameters(), lr=5e-3)).state_dict()
    out["generic_loads"] = []
    for refused in (unsharded, opt.state_dict()):
        try:
            generic.load_state_dict(refused)
        except RuntimeError as err:
            out["generic_loads"].append(str(err))
    out["generic_lr"] = generic.param_groups[0]["lr"]

    # Dicts the unsharded load refuses: once loaded whole here, then failing at the next step
    # (a NaN lr) or raising a bare KeyError (no flag) with the state already replaced.
    core = [t.clone() for t in optimizer_leaves(opt)]
    good = opt.state_dict()
    nan_lr = {**good, "param_groups": [{**good["param_groups"][0], "lr": math.nan}]}
    no_flag = {k: v for k, v in good.items() if k != "overflow"}
    no_trainable = {**good, "trainable": []}  # once unchecked: zip stopped at the shorter
    # Hand-made: once an AttributeError, and "not a DTensor" for a param it does not have.
    entries = good["state"]["params"]
    as_list = {**good, "state": {**good["state"], "params": list(entries.values())}}
    extra = {**entries, "nope": next(iter(entries.values()))}
    extra_param = {**good, "state": {**good["state"], "params": extra}}
    # The second Linear's weight's DTensors under the first's: the message says both layouts.
    first, _, second, _ = entries
    swapped = {**entries, first: entries[second]}
    swapped = {**good, "state": {**good["state"], "params": swapped}}
    # A value only rank 0's shard holds: rank 0 alone saw it, and the other ranks loaded.
    master = entries[first]["master"]
    diverged = dtensors.local(master).clone()
    if rank == 0:
        diverged.view(-1)[0] = math.nan
    one_rank = {**entries, first: {**entries[first], "master": dtensors.like(diverged, master)}}
    one_rank = {**good, "state": {**good["state"], "params": one_rank}}
    # Rank 1 alone given a NaN lr: refused before the state's agreement, rank 0 waited in it.
    one_rank_lr = nan_lr if rank == 1 else good
    # Rank 1 alone given no FSDP2 dict: it took the unsharded load's path, and rank 0 waited.
    one_rank_format = {k: v for k, v in good.items() if k != "format"} if rank == 1 else good
    for name, bad in (
        ("nan_lr", nan_lr),
        ("no_flag", no_flag),
        ("no_trainable", no_trainable),
        ("as_list", as_list),
        ("extra_param", extra_param),
        ("swapped", swapped),
        ("one_rank", one_rank),
        ("one_rank_lr", one_rank_lr),
        ("one_rank_format", one_rank_format),
    ):
        try:
            opt.load_state_dict(bad)
            out[name] = "loaded"
        except ValueError as err:
            out[name] = str(err)
    out["refusals_unchanged"] = all(
        torch.equal(a, b) for a, b in zip(core, optimizer_leaves(opt), strict=True)
    ) and opt.param_groups[0]["lr"] == pytest.approx(3 * LR)

    # Grads made at a scale set by hand, then a load of the state before the set: the step
    # unscales them by the scale they were made with (once by the loaded one, 8x too large).
    twins = []
    for load_after_backward in (True, False):
        model = sharded(half=True)
        opt = facade(model, compiled=False)
        train(model, opt, range(1), rank, world)
        saved = opt.state_dict()
        opt.loss_scale = INIT_SCALE / 8
        opt.zero_grad()
        opt.backward(loss_of(model, 1, rank, world))
        if load_after_backward:
            opt.load_state_dict(saved)
        opt.step()
        twins.append(shards(model))
    out["load_keeps_the_grads_scale"] = all(map(torch.equal, *twins))

    # A static optimizer's scale set by hand (apex's setter takes any) is not its policy's:
    # its checkpoint loads back, where the core's own load refuses a scale no run holds.
    model = sharded(half=True)
    static = fp16fx.FP16_Optimizer(
        torch.optim.AdamW(model.parameters(), lr=LR), static_loss_scale=128.0, verbose=False
    )
    static.loss_scale = 3.0
    hand_set = static.state_dict()
    static.loss_scale = 128.0
    static.load_state_dict(hand_set)
    out["hand_set_scale_loaded"] = static.loss_scale
    return out


def generic_clipped_step(
    rank: int, world: int, max_norm: float, clips: int, grad: float | None = None, norm_type=2.0
) -> tuple[list[float], list[torch.Tensor], str]:
    """One generic-path SGD step of the sharded model, its grads (each value ``grad``, where
    given) clipped ``clips`` times to ``max_norm`` (by the ``norm_type`` norm): the norms the
    clips returned, how far each param's shard moved, and the path the optimizer took."""
    model = sharded()
    start = shards(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = facade(model, sgd, compiled=False, path="generic")
    opt.zero_grad()
    opt.backward(loss_of(model, 0, rank, world), update_master_grads=False)
    if grad is not None:
        with torch.no_grad():
            for p in model.parameters():
                dtensors.local(p.grad).fill_(grad)
    opt.update_master_grads()
    norms = [opt.clip_master_grads(max_norm, norm_type) for _ in range(clips)]
    opt.step()
    return norms, [p - s for p, s in zip(shards(model), start, strict=True)], opt.path


def generic_clip(rank: int, world: int) -> dict[str, Any]:
    """The generic path's clip_master_grads called twice, as ``clip_grad_norm_`` twice: the
    second sees the clipped grads (their norm ``CLIP``) and leaves them alone (it once
    reused the first norm and scaled them again, by 1/100 here), so one step moves the params
    as one clip (but for the second's factor max_norm / (max_norm + 1e-6), torch's too)."""
    once, moved_once, _ = generic_clipped_step(rank, world, CLIP / 100, 1)
    twice, moved_twice, path = generic_clipped_step(rank, world, CLIP / 100, 2)
    # atol: an FP32 ulp of the params (<= 1), whose moves are ~1e-5 here.
    same = [torch.allclose(a, b, rtol=1e-3, atol=2e-7) for a, b in zip(moved_once, moved_twice)]
    # Finite grads whose norm overflows FP32 (1e30 / INIT_SCALE, squared): the first clip
    # zeroes them, as clip_grad_norm_ does, and the second sees zeros (its norm, inf * 0, was
    # once NaN: NaN grads and masters).
    overflowed, moved, _ = generic_clipped_step(rank, world, CLIP, 2, grad=1e30)
    # Another norm is refused, finite grads or not (it once returned -1 where they overflowed).
    other_norms = []
    for grad in (None, math.inf):
        try:
            generic_clipped_step(rank, world, CLIP, 1, grad=grad, norm_type=1.0)
            other_norms.append("clipped")
        except ValueError as err:
            other_norms.append(str(err))
    # Before the grads are unscaled into the FP32 masters (once after: the refusal changed
    # them).
    model = sharded(half=True)
    opt = facade(model, torch.optim.SGD(model.parameters(), lr=0.1), path="generic")
    opt.backward(loss_of(model, 0, rank, world), update_master_grads=False)
    with contextlib.suppress(ValueError):
        opt.clip_master_grads(CLIP, norm_type=1.0)
    unscaled = [p.grad is not None for g in opt.param_groups for p in g["params"]]
    return {
        "other_norms": other_norms,
        "refused_before_unscaling": not any(unscaled),
        "norms": [once, twice],
        "path": path,
        "same_step": all(same),
        "overflowed_norms": overflowed,
        "overflowed_unmoved": not any(m.any() for m in moved),
    }


def accumulation(rank: int, world: int) -> dict[str, Any]:
    """Two micro-batches a step: reduced at each (``optimizer.backward`` both), or only at the
    last (FSDP2's ``set_requires_gradient_sync(False)`` before it: the first backpropagated
    scaled by hand, as docs/distributed.md says, since FSDP2 writes no gradient for it)."""
    runs: dict[str, Any] = {}
    for how in ("synced", "unsynced"):
        model = sharded()
        opt = facade(model, compiled=False)
        for step in range(3):
            opt.zero_grad()
            model.set_requires_gradient_sync(how == "synced")
            first = loss_of(model, 10 * step, rank, world) / 2
            if how == "synced":
                opt.backward(first)
            else:
                (first.float() * opt.loss_scale).backward()
            model.set_requires_gradient_sync(True)
            opt.backward(loss_of(model, 10 * step + 1, rank, world) / 2)
            opt.step()
        runs[how] = full(model)
    model = sharded()
    opt = facade(model, compiled=False)
    model.set_requires_gradient_sync(False)
    try:
        opt.backward(loss_of(model, 0, rank, world))
    except RuntimeError as err:
        runs["message"] = str(err)
    return runs


def optimizer_leaves(opt: fp16fx.FP16_Optimizer) -> list[torch.Tensor]:
    """The tensors the optimizer keeps beside the params: masters, moments, counts, scale."""
    state = opt._engine.state
    kept = (state.master_segments, state.opt_state, state.loss_scale, state.count)
    return [t for t in optree.tree_leaves(kept) if isinstance(t, torch.Tensor)]


def torch_reference(rank: int, world: int) -> dict[str, Any]:
    """(1)'s independent reference: torch's own AdamW and clip_grad_norm_ on the FSDP2 model,
    on the unscaled loss."""
    model = sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    for i in range(STEPS):
        opt.zero_grad()
        loss_of(model, i, rank, world).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {"params": full(model)}


def consensus(rank: int, world: int, compiled: bool, generic: bool) -> dict[str, Any]:
    """(2): an inf in rank 1's local grad shard only: every rank skips, nothing moves."""
    model = sharded()
    inner = torch.optim.RMSprop(model.parameters(), lr=1e-3) if generic else None
    opt = facade(model, inner, compiled=compiled)
    train(model, opt, range(INF_AT), rank, world)
    before = shards(model)
    moments = None if generic else {k: v.to_local().clone() for k, v in _moments(opt)}
    scale = opt.loss_scale
    seen = train(model, opt, [INF_AT], rank, world, inf_at=INF_AT)
    after = shards(model)
    out = {
        "path": opt.path,
        "unchanged": all(map(torch.equal, before, after)),
        "scales": (scale, seen["scales"][-1]),
        "norm": seen["norms"][-1],
        "skipped": opt.skipped_steps,
    }
    if moments is not None:
        now = dict(_moments(opt))
        out["moments_unchanged"] = bool(moments) and all(
            torch.equal(v, now[k].to_local()) for k, v in moments.items()
        )
    return out


def _moments(opt: fp16fx.FP16_Optimizer) -> Iterator[tuple[str, DTensor]]:
    for path, entry in opt.state_dict()["state"]["params"].items():
        for key, value in entry.items():
            if key.startswith("opt") and isinstance(value, DTensor):
                yield f"{path}/{key}", value


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Makes every way of reading a tensor on the host raise (but Dynamo's own reads: while
    compiling, and its guards on 0-d CPU inputs -- a read of a CPU scalar, not a sync)."""
    names = ("item", "cpu", "tolist", "numpy", "__bool__", "__float__", "__int__")
    saved = {name: getattr(torch.Tensor, name) for name in names}

    def refuse(name: str) -> Callable[..., Any]:
        def method(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code
            if torch._guards.CompileContext.try_get() is not None or (
                caller.co_filename == "<string>" and caller.co_name == "guard"
            ):
                return saved[name](*args, **kwargs)
            raise AssertionError(f"host sync in the step: Tensor.{name}")

        return method

    for name in names:
        setattr(torch.Tensor, name, refuse(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def no_sync(rank: int, world: int) -> dict[str, Any]:
    """(5): the compiled steps -- functional and facade -- with the lr changed every step and
    the scale changed by hand and by an overflow, under no_host_sync, counting graphs."""
    from torch._dynamo.utils import counters

    model = sharded()
    params = dict(model.named_parameters())
    state = fp16fx.init(params, fp16fx.adamw(LR), fp16fx.DynamicLossScale(init_scale=INIT_SCALE))
    own_masters = [
        m.data_ptr() == dtensors.local(p).data_ptr()
        for m, p in zip(state.master_segments, [params[k] for k in sorted(params)])
    ]  # the FP32 shards are the masters, no copy (a tree's dict leaves are in key order)
    step = fp16fx.compile_step(inplace=True)
    graphs, finite = [], []
    for i in range(5):
        model.zero_grad(set_to_none=False)
        fp16fx.scale_loss(state, loss_of(model, i, rank, world)).backward()
        fp16fx.set_hyperparams(state, lr=LR / (i + 1), inplace=True)
        if i == 2:
            state.loss_scale.scale.fill_(INIT_SCALE * 4)
        if i == 3 and rank == 0:
            dtensors.local(params["0.bias"].grad)[0] = float("nan")
        with no_host_sync() if i > 0 else contextlib.nullcontext():  # step 0 compiles
            state, info = step(state, {n: p.grad for n, p in params.items()})
        finite.append(info.finite.clone())
        graphs.append(counters["stats"]["unique_graphs"])
    opt = facade(model, compiled=True)
    for i in range(4):
        for group in opt.param_groups:
            group["lr"] = LR / (i + 1)
        opt.zero_grad()
        opt.backward(loss_of(model, i, rank, world))
        with no_host_sync() if i > 0 else contextlib.nullcontext():
            opt.step()
        graphs.append(counters["stats"]["unique_graphs"])
    return {"graphs": graphs, "finite": [bool(f) for f in finite], "own_masters": own_masters}


def refusals(rank: int, world: int) -> dict[str, Any]:
    """Bad input: named errors, nothing changed."""
    model = sharded()
    params = dict(model.named_parameters())
    state = fp16fx.init(params, fp16fx.adamw(LR))
    mesh = params["0.weight"].device_mesh
    seen: dict[str, str] = {}
    before = shards(model)  # values, and where they live: a refusal must not move them
    storages = [dtensors.local(p).data_ptr() for p in model.parameters()]

    def catch(name: str, run: Callable[[], Any]) -> None:
        try:
            run()
        except ValueError as err:
            seen[name] = str(err)
        else:
            seen[name] = "no error"

    partial = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    replicated = DTensor.from_local(torch.ones(3), mesh, [Replicate()])
    catch("partial", lambda: fp16fx.init({**params, "extra": partial}, fp16fx.adamw(LR)))
    catch("replicate", lambda: fp16fx.init({**params, "extra": replicated}, fp16fx.adamw(LR)))
    catch("mixed", lambda: fp16fx.init({**params, "extra": torch.ones(3)}, fp16fx.adamw(LR)))
    catch("buckets", lambda: fp16fx.init(params, fp16fx.adamw(LR), buckets=True))
    catch("shard", lambda: facade(model, shard=True))
    catch("compact", lambda: facade(model, master="compensated", moments="int8"))
    plain_too = torch.optim.AdamW([*model.parameters(), nn.Parameter(torch.ones(3))])
    catch("plain_param", lambda: facade(model, plain_too))
    stepped = torch.optim.AdamW(model.parameters())
    first = next(model.parameters())
    moments = {"exp_avg": torch.zeros_like(first), "exp_avg_sq": torch.zeros_like(first)}
    stepped.state[first] = {"step": torch.tensor(1.0), **moments}
    catch("stepped", lambda: facade(model, stepped))
    seen["stepped_kept"] = str(
        list(stepped.state[first]) == ["step", "exp_avg", "exp_avg_sq"]
        and stepped.param_groups[0]["params"][0] is first
    )
    plain = fp16fx.init({k: dtensors.local(p).clone() for k, p in params.items()}, fp16fx.sgd(1))
    model.zero_grad()
    loss_of(model, 0, rank, world).backward()
    grads = {n: p.grad for n, p in params.items()}
    catch("dtensor_grads_to_plain_state", lambda: fp16fx.step(plain, grads))
    bad = {**grads, "2.bias": DTensor.from_local(torch.ones(3), mesh, [Partial()])}
    catch("partial_grad", lambda: fp16fx.step(state, bad))
    opt = facade(model)
    saved = opt.state_dict()
    saved["param_groups"][0]["amsgrad"] = True
    catch("load_structure", lambda: opt.load_state_dict(saved))
    opt.param_groups[0]["amsgrad"] = True
    catch("structure", opt.step)
    opt.param_groups[0]["amsgrad"] = False
    opt.param_groups.append({**opt.param_groups[0], "params": []})  # by hand: not add_param_group
    catch("appended", opt.step)
    # A plain param added to a generic path's DTensor groups: torch's optimizer took it, and
    # every backward after raised.
    generic = facade(model, torch.optim.RMSprop(model.parameters()), compiled=False)
    catch("added_plain", lambda: generic.add_param_group({"params": [nn.Parameter(torch.ones(3))]}))
    seen["added_plain_kept"] = str(len(generic.param_groups) == 1)
    # And the reverse: a DTensor added to a plain model's groups (once a bare KeyError).
    plain_model = nn.Linear(2, 2).half()  # the groups hold its FP32 masters
    plain_opt = facade(plain_model, torch.optim.RMSprop(plain_model.parameters()))
    catch("added_dtensor", lambda: plain_opt.add_param_group({"params": [first]}))
    seen["added_dtensor_kept"] = str(len(plain_opt.param_groups) == 1)
    in_place = storages == [dtensors.local(p).data_ptr() for p in model.parameters()]
    same = all(map(torch.equal, before, shards(model)))
    seen["unchanged"] = str(in_place and same and int(state.count) == 0)
    return seen


def hang(rank: int, world: int) -> dict[str, Any]:
    """(4): rank 1 hangs after backward; rank 0's step fails after the timeout of the group
    its consensus runs on (its own, so the world group stays usable)."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=HANG_TIMEOUT_S))
    model = sharded()
    opt = facade(model, compiled=False, process_group=group)
    opt.backward(loss_of(model, 0, rank, world))
    start = time.monotonic()
    if rank == 1:
        time.sleep(HANG_TIMEOUT_S + 3)
        return {}
    return failed_step(opt, start)


def die(rank: int, world: int) -> dict[str, Any]:
    """(4): rank 1 dies after backward, before its step; rank 0's step is compiled (``hang``'s
    is eager), so its consensus fails inside the compiled graph, which once raised gloo's
    error bare."""
    model = sharded()
    opt = facade(model)
    opt.backward(loss_of(model, 0, rank, world))
    if rank == 1:
        os._exit(0)
    return failed_step(opt, time.monotonic())


def worker(rank: int, world: int, out: str) -> None:
    where = Path(out) / "checkpoint"
    scenarios: dict[str, Callable[[], dict[str, Any]]]
    if world == 2:
        scenarios = {
            "training": lambda: training(rank, world, where, compiled=True),
            "training_half": lambda: training_half(rank, world, where),
            "compact": lambda: compact(rank, world, where),
            "consensus": lambda: consensus(rank, world, compiled=True, generic=False),
            "consensus_generic": lambda: consensus(rank, world, compiled=False, generic=True),
            "no_sync": lambda: no_sync(rank, world),
            "refusals": lambda: refusals(rank, world),
            "checkpoint_care": lambda: checkpoint_care(rank, world, where),
            "generic_clip": lambda: generic_clip(rank, world),
            "accumulation": lambda: accumulation(rank, world),
            "hang": lambda: hang(rank, world),
            "die": lambda: die(rank, world),  # last: it breaks the group
        }
    else:  # eager: the same core, without a compile per process
        scenarios = {
            "training": lambda: training(rank, world, where, compiled=False),
            "compact": lambda: compact(rank, world, where),
        }
        if world == 1:
            scenarios["torch"] = lambda: torch_reference(rank, world)
            scenarios["training_half"] = lambda: training_half(rank, world, where)
    found: dict[str, Any] = {}
    for name, run in scenarios.items():
        found[name] = attempt(run)
        torch.save(found, Path(out) / f"{world}_rank{rank}.pt")  # "die" ends rank 1 first


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[int, list[dict[str, Any]]]:
    """Every scenario above: the d = 2 job (it saves the checkpoint), then d = 1 and d = 4."""
    out = tmp_path_factory.mktemp("fsdp")
    found = {}
    for world in (2, 1, 4):
        spawn(worker, world, str(out), timeout_s=30)
        found[world] = [
            torch.load(out / f"{world}_rank{r}.pt", weights_only=True) for r in range(world)
        ]
    return found


def ranks(
    jobs: dict[int, Any], world: int, name: str, reporting: int | None = None
) -> list[dict[str, Any]]:
    """Each rank's result of scenario ``name`` at ``world``: from every rank, or from the
    first ``reporting`` (the others died in it)."""
    got = [r[name] for r in jobs[world] if name in r]
    assert len(got) == (world if reporting is None else reporting), (name, world, len(got))
    for r in got:
        assert "error" not in r, r["error"]
    return got


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: Any = None) -> None:
    for name in a:
        torch.testing.assert_close(
            a[name], b[name], **(tol or TOL), msg=lambda m, n=name: f"{n}: {m}"
        )


# -- tests -------------------------------------------------------------------------------------


def test_fsdp2_training_matches_one_process_on_the_whole_batch(jobs):
    one = ranks(jobs, 1, "training")[0]
    close(one["params"], ranks(jobs, 1, "torch")[0]["params"], TORCH_TOL)  # torch's math
    for world in (2, 4):
        got = ranks(jobs, world, "training")
        assert {r["path"] for r in got} == {"fast"}
        assert (
            f"fast path ({'compiled' if world == 2 else 'eager'}), FSDP2 shards over {world}"
            in got[0]["repr"]
        )
        for r in got[1:]:  # every rank holds the same full params
            for name, value in got[0]["params"].items():
                assert torch.equal(r["params"][name], value), name
        close(got[0]["params"], one["params"])
        assert all(r["norms"] == got[0]["norms"] for r in got)  # the global norm, everywhere
        torch.testing.assert_close(got[0]["norms"], one["norms"], rtol=NORM_RTOL, atol=0)


def test_fp16_dtensor_params_train_like_one_process(jobs):
    one = ranks(jobs, 1, "training_half")[0]
    got = ranks(jobs, 2, "training_half")
    assert {r["path"] for r in got} == {"fast"}
    for name, value in got[0]["params"].items():
        assert value.dtype == torch.float16 and torch.equal(got[1]["params"][name], value)
    # FSDP averages FP16 grads in FP16 here: the params agree to an FP16 ulp or two
    close(got[0]["params"], one["params"], HALF_TOL)


def test_compact_precision_trains_fsdp2_shards_and_its_dcp_checkpoints_load_in_any_precision(
    jobs,
):
    two = ranks(jobs, 2, "compact")
    assert "compensated masters and INT8 moments, 0 FP32 values" in two[0]["repr"]
    in_fp32_terms = [
        ("count", "torch.int64"),
        ("master", "torch.float32"),
        ("mu", "torch.float32"),
        ("nu", "torch.float32"),
        ("param", "torch.float16"),
    ]
    for r in two:
        assert r["corrections"] == ["torch.int8"] and r["correction_numel"] == r["param_numel"]
        assert (r["precision"]["master"], r["precision"]["moments"]) == ("fp32", "fp32")
        assert r["kinds"] == in_fp32_terms
        for name, value in two[0]["params"].items():
            assert torch.equal(r["params"][name], value), name  # every rank the same
            assert torch.equal(r["resumed"][name], value), name  # decoded, encoded: bitwise
    half = ranks(jobs, 2, "training_half")[0]["params"]
    close(two[0]["params"], half, INT8_TOL)
    for r in ranks(jobs, 4, "compact"):
        close(r["resumed"], two[0]["params"], INT8_TOL)  # resharded 2 -> 4
        for name, value in r["resumed"].items():  # the gathered file: the same shards
            assert torch.equal(r["from_gathered"][name], value), name
        close(r["from_fp32"], half, INT8_TOL)  # FP32 masters and moments, rounded in
    for r in ranks(jobs, 1, "compact"):
        close(r["resumed_fp32"], two[0]["params"], INT8_TOL)  # into FP32 masters


def test_an_inf_in_one_ranks_grad_shard_skips_every_rank(jobs):
    for name in ("consensus", "consensus_generic"):
        got = ranks(jobs, 2, name)
        assert [r["path"] for r in got] == ["generic" if "generic" in name else "fast"] * 2
        for r in got:
            assert r["unchanged"] and r.get("moments_unchanged", "generic" in name), name
            assert r["scales"] == (INIT_SCALE, INIT_SCALE / 2), name
            assert r["norm"] == -1.0 and r["skipped"] == 1, name


def test_dcp_checkpoint_resumes_bitwise_at_2_and_to_tolerance_at_1_and_4(jobs):
    two = ranks(jobs, 2, "training")
    for r in two:
        for name, value in two[0]["params"].items():
            assert torch.equal(r["resumed"][name], value), name
    for world in (1, 4):
        for r in ranks(jobs, world, "training"):
            close(r["resumed"], two[0]["params"])


def test_a_dead_rank_fails_the_others_at_once(jobs):
    (report,) = ranks(jobs, 2, "die", reporting=1)
    assert "fp16fx: the found-inf consensus of a step failed on rank 0 of 2" in report["message"]
    assert report["seconds"] < 20


def test_a_hung_rank_fails_the_others_after_the_timeout(jobs):
    report = ranks(jobs, 2, "hang")[0]
    assert "found-inf consensus" in report["message"]
    assert "imed out" in report["message"] or "imeout" in report["message"], report["message"]
    assert HANG_TIMEOUT_S - 0.5 < report["seconds"] < HANG_TIMEOUT_S + 20


def test_compiled_steps_never_sync_and_never_recompile(jobs):
    for r in ranks(jobs, 2, "no_sync"):
        assert r["own_masters"] == [True] * 4
        assert r["finite"] == [True, True, True, False, True]
        functional, facade_graphs = r["graphs"][:5], r["graphs"][5:]
        assert len(set(functional)) == 1, r["graphs"]  # compiled at step 0, never again
        assert len(set(facade_graphs)) == 1, r["graphs"]


def test_bad_input_is_refused_by_name_and_changes_nothing(jobs):
    for r in ranks(jobs, 2, "refusals"):
        assert "extra" in r["partial"] and "Shard" in r["partial"]
        assert "extra" in r["replicate"] and "Shard" in r["replicate"]
        assert "extra" in r["mixed"] and "plain" in r["mixed"]
        assert "buckets=False" in r["buckets"]
        assert "FSDP2 shards" in r["shard"]
        assert "all FP32, their own masters" in r["compact"]
        assert "not made from DTensor params" in r["dtensor_grads_to_plain_state"]
        assert "2.bias" in r["partial_grad"] and "Partial" in r["partial_grad"]
        assert r["plain_param"].startswith("param_groups[0]['params'][4] is a plain Parameter")
        assert r["stepped"].startswith("param_groups[0]['params'][0] has state in the optim")
        assert r["stepped_kept"] == "True"  # once wiped, and the groups given FP32 masters
        assert r["structure"] == (
            "an FSDP2 model's FP16_Optimizer cannot change the structure of param_groups[0] "
            "after it was built (now AdamW with amsgrad, built as AdamW); build a new one"
        )
        assert r["load_structure"] == (
            "the state dict does not fit this FP16_Optimizer: the state dict's param_groups[0] "
            "runs AdamW with amsgrad; this optimizer's runs AdamW (an FSDP2 model's "
            "FP16_Optimizer keeps the structure it was built with: build one over such groups "
            "to load it)"
        )
        assert r["appended"].startswith("the param groups changed after the FP16_Optimizer")
        assert r["added_plain"].startswith(
            "param_groups[1]['params'][0] is a plain Parameter among DTensors"
        )
        assert r["added_plain_kept"] == "True"
        assert r["added_dtensor"].startswith(
            "param_groups[0]['params'][0] is a plain Parameter among DTensors"
        )
        assert r["added_dtensor_kept"] == "True"
        assert r["unchanged"] == "True"


def test_a_dcp_checkpoint_saves_written_weights_and_a_misfit_changes_nothing(jobs):
    for r in ranks(jobs, 2, "checkpoint_care"):
        assert r["written_saved"]
        assert "trained the params at [0, 1, 2, 3] of param group 0" in r["refused"]
        assert "those at [0, 1, 2]" in r["refused"]
        assert r["optimizer_unchanged"]
        assert r["lr_after_load"] == pytest.approx(3 * LR)
        assert "generic path" in r["generic"] and "RMSprop" in r["generic"]
        assert len(r["generic_loads"]) == 2 and r["generic_lr"] == 1e-2  # RMSprop's default
        for refusal in r["generic_loads"]:
            assert refusal.startswith("load_state_dict() of an FP16_Optimizer on the generic")
        assert "param group 0: hyperparameter 'lr' must be >= 0, got nan" in r["nan_lr"]
        assert "it has no 'overflow' entry" in r["no_flag"]
        assert "its 'trainable' is []: one list per param group" in r["no_trainable"]
        assert "['params'] is a list, not a dict" in r["as_list"]
        assert "['params'] has ['nope'], which this state does not keep" in r["extra_param"]
        assert "is (3, 13) placed" in r["swapped"]
        assert "its param is (13, 8) placed (Shard(dim=0),)" in r["swapped"]
        assert "['params']['0']['master'] holds inf or NaN" in r["one_rank"]
        assert r["refusals_unchanged"]
        assert r["load_keeps_the_grads_scale"]
        assert r["hand_set_scale_loaded"] == 3.0
    refusals = [r["one_rank"] for r in ranks(jobs, 2, "checkpoint_care")]
    assert not refusals[0].startswith("rank 0 refused")  # its own refusal, and rank 1 names it
    assert refusals[1].startswith("rank 0 refused the dict: the state dict does not fit")
    own, told = (r["one_rank_lr"] for r in reversed(ranks(jobs, 2, "checkpoint_care")))
    assert own.startswith("the state dict does not fit") and "'lr' must be >= 0" in own
    assert told == f"rank 1 refused the dict: {own}"
    own, told = (r["one_rank_format"] for r in reversed(ranks(jobs, 2, "checkpoint_care")))
    assert "it is no FSDP2 model's FP16_Optimizer dict (format None)" in own
    assert told == f"rank 1 refused the dict: {own}"


def test_the_generic_path_clips_twice_as_clip_grad_norm_does(jobs):
    for r in ranks(jobs, 2, "generic_clip"):
        (once,), (first, second) = r["norms"]
        assert r["path"] == "generic" and once == first > CLIP / 100
        assert second == pytest.approx(CLIP / 100, rel=1e-4)
        assert r["same_step"]
        assert r["overflowed_norms"] == [math.inf, 0.0] and r["overflowed_unmoved"]
        assert r["other_norms"] == ["an FSDP2 model's FP16_Optimizer clips by the L2 norm only"] * 2
        assert r["refused_before_unscaling"]


def test_accumulating_without_a_sync_per_micro_batch_steps_as_syncing_each(jobs):
    for r in ranks(jobs, 2, "accumulation"):
        assert "set_requires_gradient_sync(False)" in r["message"]
        assert r["synced"].keys() == r["unsynced"].keys()
        assert all(torch.equal(r["synced"][k], r["unsynced"][k]) for k in r["synced"])


def test_a_dcp_checkpoint_without_segments_loads(tmp_path):
    """DCP loads only into a dict whose every key the checkpoint holds: the FSDP2 dict keeps
    no ``segments`` (fp16fx.state_dict's, which older checkpoints lack; an FSDP2 state is cut
    at every param anyway). One process, plain tensors: DCP and the dict work alike."""

    def state():
        params = {"w": torch.linspace(-1, 1, 8).half()}
        return fp16fx.init(params, fp16fx.adam(1e-3), fp16fx.StaticLossScale(1.0)), params

    saved, params = state()
    saved, _ = fp16fx.step(saved, {"w": torch.ones(8).half()})
    older = {k: v for k, v in fsdp.state_dict(saved, params).items() if k != "segments"}
    dcp.save(older, checkpoint_id=str(tmp_path))
    target, params = state()
    template = fsdp.state_dict(target, params)
    dcp.load(template, checkpoint_id=str(tmp_path))
    loaded = fsdp.load_state_dict(target, template, params)
    assert torch.equal(loaded.master["w"], saved.master["w"])
