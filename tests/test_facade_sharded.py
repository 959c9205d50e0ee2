"""``FP16_Optimizer(shard=True)`` on CPU/gloo: 2 and 4 processes, uneven last slices, an inf on
one rank, an LR scheduler, checkpoints saved at d=2 and loaded at d=4 and unsharded, memory;
compact precision sharded (d=2)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any
from unittest import mock

import optree
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fp16fx
import fp16fx.distributed as fdist
from fp16fx.facade import FP16_Optimizer, consolidate_state_dict
from fp16fx.facade.checkpoint import FSDP_FORMAT
from tests.test_distributed import assert_nearly_bitwise, results, spawn
from tests.test_facade_checkpoint import assert_same_fingerprint, fingerprint
from tests.test_step import bitwise_equal

STEPS, SAVE_AT, INF_AT, BATCH = 20, 10, 7, 4
LR = {"adam": 1e-2, "sgd": 0.02}
COMPACT = {"master": "compensated", "moments": "int8"}


class Net(nn.Module):
    """63 FP16 values and 3 FP32 ones: uneven slices at d = 2 and d = 4."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3)).half()
        self.gain = nn.Parameter(torch.ones(3))  # FP32: its own master

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x.half()).float() * self.gain


def make_optimizer(model: nn.Module, name: str, **kwargs: Any) -> FP16_Optimizer:
    if name == "adam":
        inner = torch.optim.Adam(model.parameters(), lr=LR[name], weight_decay=1e-3)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=LR[name], momentum=0.9, nesterov=True)
    # A rank's grads (of a quarter batch) overflow at a higher scale than the whole batch's:
    # start low, so that only the injected inf skips a step, on every run alike.
    options = {"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 2.0**10}}
    options = {**options, "verbose": False, "compiled": False, **kwargs}
    return FP16_Optimizer(inner, **options)


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def train(model, opt, steps, rank, world, *, inf=False, schedule=False) -> dict[str, Any]:
    """Trains on rank ``rank``'s part of each global batch (None: all of it; "same": every
    rank the whole batch). ``inf``: rank 1 (and the reference) get an inf at INF_AT."""
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5) if schedule else None
    seen: dict[str, Any] = {"scales": [], "norms": []}
    for i in steps:
        g = torch.Generator().manual_seed(1000 + i)
        x, y = (
            torch.randn(BATCH * world, 8, generator=g),
            torch.randn(BATCH * world, 3, generator=g),
        )
        if isinstance(rank, int):
            x, y = x[rank * BATCH : (rank + 1) * BATCH], y[rank * BATCH : (rank + 1) * BATCH]
        opt.zero_grad()
        opt.backward(F.mse_loss(model(x), y))
        if inf and i == INF_AT and rank in (None, 1):
            model.body[0].weight.grad[0, 0] = float("inf")
        before = params_of(model)
        seen["norms"].append(opt.clip_master_grads(0.5))  # a collective when sharded
        opt.step()
        if i == INF_AT:
            seen["unchanged"] = all(map(torch.equal, before, params_of(model)))
        seen["scales"].append(opt.loss_scale)
        if scheduler is not None:
            scheduler.step()
    seen["params"] = params_of(model)
    seen["lr"] = opt.param_groups[0]["lr"]
    return seen


def versus_unsharded(rank: int, world: int, name: str, compiled: bool = False) -> dict:
    model = Net()
    opt = make_optimizer(model, name, shard=True, compiled=compiled)
    return train(model, opt, range(STEPS), rank, world, inf=name == "adam", schedule=True)


def checkpoint_run(rank: int, world: int, out: Path) -> dict[str, Any]:
    """d=2 saves at SAVE_AT and runs on; d=4 loads the d=2 files, saves again (its count),
    and runs on."""
    model = Net()
    opt = make_optimizer(model, "adam", shard=True)
    count = None
    if world == 2:
        train(model, opt, range(SAVE_AT), "same", 1)
        torch.save(opt.state_dict(), out / f"opt_rank{rank}.pt")
        torch.save(model.state_dict(), out / "model.pt")  # FP32 params are model state
    else:
        model.load_state_dict(torch.load(out / "model.pt", weights_only=True))
        opt.load_state_dict(
            [torch.load(out / f"opt_rank{r}.pt", weights_only=True) for r in (0, 1)]
        )
        count = int(opt.state_dict()["shard"]["shard"]["count"])
    return {"params": train(model, opt, range(SAVE_AT, STEPS), "same", 1)["params"], "count": count}


def damaged_copy_refused(rank: int, world: int) -> dict[str, Any]:
    """A fresh sharded optimizer loading the ranks' dicts, rank 1 alone a damaged copy (a
    negative second moment): each rank's error, and whether its optimizer and model are as they were
    (rank 0 once loaded, and trained on from a mixture of two states)."""
    model = Net()
    opt = make_optimizer(model, "adam", shard=True)
    train(model, opt, range(2), "same", 1)
    shards: list[Any] = [None] * world
    dist.all_gather_object(shards, opt.state_dict())
    if rank == 1:
        for entry in shards[0]["shard"]["shard"]["params"].values():
            for key, value in entry.items():
                if key.endswith(".nu"):
                    value.fill_(-1.0)
    model = Net()
    opt = make_optimizer(model, "adam", shard=True)
    before = fingerprint(model, opt)
    errors = []
    # Then rank 1 alone given another format (an FSDP2 optimizer's dict), refused before the
    # sharded load's checks: the others once waited for it until the timeout.
    for given in (shards, {"format": FSDP_FORMAT} if rank == 1 else shards):
        try:
            opt.load_state_dict(given)
            errors.append("loaded")
        except ValueError as err:
            errors.append(str(err))

    def refuse(_opt: FP16_Optimizer, _state_dict: Any) -> None:
        raise ValueError("a load pre-hook refused it")

    # Then a load pre-hook that raises on rank 1 alone: the others once loaded without it.
    hook = opt.register_load_state_dict_pre_hook(refuse) if rank == 1 else None
    try:
        opt.load_state_dict(shards)
        errors.append("loaded")
    except ValueError as err:
        errors.append(str(err))
    if hook is not None:
        hook.remove()
    # Then a pre-hook that loads another sharded optimizer (an agreement of its own, before
    # this load's): rank 1 refusing the damaged copy once raised alone, the others waiting.
    other = make_optimizer(Net(), "adam", shard=True)
    others: list[Any] = [None] * world
    dist.all_gather_object(others, other.state_dict())
    hook = opt.register_load_state_dict_pre_hook(lambda *_: other.load_state_dict(others))
    try:
        opt.load_state_dict(shards)
        errors.append("loaded")
    except ValueError as err:
        errors.append(str(err))
    hook.remove()
    return {
        "error": errors[0],
        "other_format": errors[1],
        "pre_hook": errors[2],
        "hook_loads": errors[3],
        "unchanged": unchanged(before, model, opt),
    }


def unchanged(before: Any, model: nn.Module, opt: FP16_Optimizer) -> bool:
    """Whether ``model`` and ``opt`` hold what their ``fingerprint`` ``before`` holds."""
    (structure, leaves), (now_structure, now) = before, fingerprint(model, opt)
    return structure == now_structure and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(leaves, now, strict=True)
    )


def stale_copy_refused(rank: int, world: int) -> dict[str, Any]:
    """A fresh momentum SGD optimizer (whose state holds no step counts) loading the ranks'
    dicts saved after 2 steps, rank 1 alone a copy saved a step later, then one whose loss
    scale alone differs, then its lr, then (at a static scale, which counts nothing) an
    unsharded dict and its copy saved a step later: each rank's errors, and whether its
    optimizer and model are as they were (rank 0 once loaded the first two, and trained on
    from a mixture of two states; the last, from an unsharded FP32 dict, until every fast-path
    dict held its count)."""
    saved: dict[str, list[Any]] = {}
    for sharded in (True, False):
        model = Net()
        static = {"dynamic_loss_scale": False, "dynamic_loss_args": None, "static_loss_scale": 2.0}
        static = {} if sharded else static
        opt = make_optimizer(model, "sgd", shard=sharded, **static)
        for steps in (range(2), range(2, 3)):
            train(model, opt, steps, "same", 1)
            shards: list[Any] = [None] * world
            dist.all_gather_object(shards, opt.state_dict())  # copies: pickled
            saved.setdefault("sharded" if sharded else "unsharded", []).append(shards)
    sound, later = saved["sharded"]
    rescaled = [{**d, "loss_scaler": {**d["loss_scaler"], "loss_scale": 1.0}} for d in sound]
    relearned = [{**d, "param_groups": [{**d["param_groups"][0], "lr": 1.0}]} for d in sound]
    unsharded_sound, unsharded_later = (copies[rank] for copies in saved["unsharded"])
    cases: list[tuple[Any, Any]] = [(sound, given) for given in (later, rescaled, relearned)]
    cases.append((unsharded_sound, unsharded_later))
    model = Net()
    opt = make_optimizer(model, "sgd", shard=True)
    before = fingerprint(model, opt)
    errors = []
    for own, stale in cases:
        try:
            opt.load_state_dict(stale if rank == 1 else own)
            errors.append("loaded")
        except ValueError as err:
            errors.append(str(err))
    return {"errors": errors, "unchanged": unchanged(before, model, opt)}


def compact_run(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Compensated masters and int8 moments, sharded: trains to SAVE_AT and saves every
    rank's dict; a second optimizer, on a second model, resumes from them; both run on."""
    model = Net()
    opt = make_optimizer(model, "adam", shard=True, **COMPACT)
    train(model, opt, range(SAVE_AT), "same", 1)
    torch.save(opt.state_dict(), out / f"compact_rank{rank}.pt")
    if rank == 0:
        torch.save(model.state_dict(), out / "compact_model.pt")
    dist.barrier()  # every file is written
    resumed_model = Net()
    resumed_model.load_state_dict(torch.load(out / "compact_model.pt", weights_only=True))
    resumed = make_optimizer(resumed_model, "adam", shard=True, **COMPACT)
    resumed.load_state_dict(
        [torch.load(out / f"compact_rank{r}.pt", weights_only=True) for r in range(world)]
    )
    return {
        "run": train(model, opt, range(SAVE_AT, STEPS), "same", 1)["params"],
        "resumed": train(resumed_model, resumed, range(SAVE_AT, STEPS), "same", 1)["params"],
        "memory": memory(shard=True, **COMPACT),
    }


def prestepped_run(rank: int, world: int, shard: bool) -> list[torch.Tensor]:
    """Wraps an Adam that took one step of its own (its state moves into the facade's core),
    then trains 5 steps on the whole batch."""
    model = Net()
    inner = torch.optim.Adam(model.parameters(), lr=LR["adam"])
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    inner.step()
    options = {"shard": True} if shard else {"process_group": None}
    opt = FP16_Optimizer(inner, dynamic_loss_scale=True, verbose=False, compiled=False, **options)
    return train(model, opt, range(5), "same", 1)["params"]


def written_then_saved(rank: int, world: int, out: Path) -> list[torch.Tensor]:
    """Trains 3 steps, writes the weights (halves them), saves this rank's dict before any
    further step; returns the written weights."""
    model = Net()
    opt = make_optimizer(model, "sgd", shard=True)
    train(model, opt, range(3), "same", 1)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    torch.save(opt.state_dict(), out / f"written_rank{rank}.pt")
    return params_of(model)


def new_structure_refused(rank: int, world: int) -> tuple[str, bool]:
    """A sharded state keeps its structure: amsgrad switched on is refused at the step, with
    a weight written (a NaN) before it -- once adopted into the master first, a NaN for good.
    Returns the error, and whether, the weight written back and amsgrad off again, the run
    goes on bitwise as one never asked."""
    runs, error = [], ""
    for ask in (False, True):
        model = Net()
        opt = make_optimizer(model, "adam", shard=True)
        train(model, opt, range(2), rank, world)
        if ask:
            weight = model.body[0].weight
            written = weight.detach().clone()
            with torch.no_grad():
                weight[0, 0] = torch.nan
            opt.param_groups[0]["amsgrad"] = True
            try:
                train(model, opt, range(2, 3), rank, world)
            except ValueError as err:
                error = str(err)
            opt.param_groups[0]["amsgrad"] = False
            with torch.no_grad():
                weight.copy_(written)
        runs.append(train(model, opt, range(3, 5), rank, world)["params"])
    return error, all(map(torch.equal, *runs))


def kept_bytes(opt: FP16_Optimizer) -> int:
    """Returns the bytes of every tensor the facade keeps between steps."""
    engine = opt._engine
    buffers = [*engine.flat.param_buffers, *engine.flat.grad_buffers]
    return fdist.persistent_bytes(engine.state, buffers)


def memory(shard: bool, **precision: str) -> float:
    model = nn.Linear(1024, 1024).half()
    inner = torch.optim.Adam(model.parameters())
    opt = FP16_Optimizer(inner, compiled=False, shard=shard, **precision)
    opt.backward(model(torch.randn(2, 1024).half()).float().sum())
    opt.step()
    return kept_bytes(opt) / sum(p.numel() for p in model.parameters())


def refusals(rank: int, world: int) -> dict[str, Any]:
    model = Net()
    where = [p.data_ptr() for p in model.parameters()]
    found = {}
    try:
        FP16_Optimizer(torch.optim.RMSprop(model.parameters()), shard=True)
    except ValueError as err:
        found["rmsprop"] = str(err)
    solo = dist.new_group([0])  # every rank takes part in making it
    try:  # rank 1 is no member of it: it once failed inside the agreement (IndexError)
        FP16_Optimizer(torch.optim.Adam(model.parameters()), shard=solo)
    except ValueError as err:
        found["solo"] = str(err)
    if rank == 1:  # torch's value for a non-member: once "got -100", a silent consensus of
        grads = {"w": torch.ones(2)}  # one, or grads divided by -1 (average_grads)
        for key, call in {
            "solo_consensus": lambda: fdist.init(grads, fp16fx.sgd(0.1), process_group=solo),
            "solo_own_consensus": lambda: fdist.Consensus(group=solo),
            "solo_average": lambda: fdist.average_grads(grads, solo),
        }.items():
            try:
                call()
            except ValueError as err:
                found[key] = str(err)
        found["solo_grads_kept"] = torch.equal(grads["w"], torch.ones(2))
    found["untouched"] = where == [p.data_ptr() for p in model.parameters()]
    found["alone"] = refused_on_one_rank(rank)
    # Models that differ in a param after a frozen one: named as the param groups hold it.
    frozen, a = torch.ones(4).half(), torch.ones(5).half().requires_grad_()
    b = torch.ones(5 + rank).half().requires_grad_()
    groups = [{"params": [frozen, a]}, {"params": [b]}]
    try:
        FP16_Optimizer(torch.optim.Adam(groups), shard=True, verbose=False, compiled=False)
    except ValueError as err:
        found["other_model"] = str(err)
    # The facade's checks and the sharded init's are one agreement: one gather.
    with mock.patch.object(dist, "all_gather_object", wraps=dist.all_gather_object) as gather:
        opt = make_optimizer(model, "adam", shard=True)
    found["gathers_at_init"] = gather.call_count
    for what in ("state", "inspect_master_grad_data"):
        try:
            getattr(opt, what)() if what != "state" else opt.state
        except RuntimeError as err:
            found[what] = str(err)
    # Grads that overflowed on rank 1 alone: it once returned None there, the others raising.
    opt.backward(
        F.mse_loss(model(torch.full((2, 8), math.inf if rank == 1 else 1.0)), torch.zeros(2, 3))
    )
    try:
        found["inspect_overflowed"] = repr(opt.inspect_master_grad_data())
    except RuntimeError as err:
        found["inspect_overflowed"] = str(err)
    opt.zero_grad()
    opt.backward(F.mse_loss(model(torch.ones(2, 8)), torch.zeros(2, 3)))
    opt.step()

    def everything() -> list[Any]:
        saved = [t.clone() for t in optree.tree_leaves(opt.state_dict()) if torch.is_tensor(t)]
        return [opt.loss_scale, *params_of(model), *saved]

    stepped = everything()
    try:  # the reduce-scatter averaged the grads in place: a second step would again
        opt.step()
    except RuntimeError as err:
        found["again"] = str(err)
    found["again_unchanged"] = all(
        torch.equal(a, b) if torch.is_tensor(a) else a == b
        for a, b in zip(everything(), stepped, strict=True)
    )
    # A sparse grad needs the generic path, which cannot take a sharded state: it once
    # logged a switch to it, then raised that optimizer.state is not available.
    opt.zero_grad()
    opt.backward(F.mse_loss(model(torch.ones(2, 8)), torch.zeros(2, 3)))
    held = everything()
    model.gain.grad = model.gain.grad.to_sparse()
    try:
        opt.step()
    except ValueError as err:
        found["sparse"] = str(err)
    model.gain.grad = model.gain.grad.to_dense()
    found["sparse_unchanged"] = opt.path == "fast" and all(
        torch.equal(a, b) if torch.is_tensor(a) else a == b
        for a, b in zip(everything(), held, strict=True)
    )
    return found


#: What rank 1 alone gets wrong, and what its refusal says.
ALONE = {
    "master": ({"master": "fp8"}, "master must be one of"),
    "report_interval": ({"report_interval": 0}, "report_interval must be an int"),
    "path": ({"path": "generic"}, "path='generic' cannot shard"),
    "process_group": ({"process_group": None}, "leave process_group='auto'"),
    "meta param": ({}, "is on the meta device"),
    "lr": ({}, "'lr' must be >= 0"),
    "saved state": ({}, "state['exp_avg'] has shape (7,), its param (3,)"),
    "step counts": ({}, "keeps one step count per param group and dtype"),
}

#: What rank 1 alone sets otherwise, each valid: every rank names the difference (ranks once
#: stepped their slices by their own settings, or rank 1 alone took over its state).
APART = {
    "moments": (
        {"moments": "bf16"},
        "rank 1 of the group has moments 'bf16', its first rank 'fp32'",
    ),
    "loss scale": ({"static_loss_scale": 8.0}, "rank 1 of the group has the loss-scale policy"),
    "hyperparameter": ({}, "['lr'] 0.5, its first rank 0.001"),
    "held state": ({}, "rank 1 of the group has the state its optimizer holds for"),
}


def _held(param: torch.Tensor, steps: float) -> dict[str, torch.Tensor]:
    """An Adam's state for ``param`` after ``steps`` steps (zero moments)."""
    moments = {
        name: torch.zeros_like(param, dtype=torch.float32) for name in ("exp_avg", "exp_avg_sq")
    }
    return {"step": torch.tensor(steps), **moments}


def refused_on_one_rank(rank: int) -> dict[str, Any]:
    """Sharded optimizers that rank 1 alone refuses, by the facade's checks of its arguments
    and params, the fast path's of a group's numbers and of the state its optimizer holds
    (``ALONE``), or that rank 1 builds otherwise (``APART``): each rank's error (the others
    once waited for rank 1 until the timeout, or a refused state was found after the
    broadcast), and whether every rank's params stayed where and as they were (each rank's
    own values, so that a broadcast would show)."""
    model = Net()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank)
    before = [(p.data_ptr(), p.clone()) for p in model.parameters()]
    errors = {}
    for case, (options, _) in {**ALONE, **APART}.items():
        inner = torch.optim.Adam(model.parameters(), lr=1e-3)
        mine: dict[str, Any] = {"shard": True, "verbose": False, "compiled": False}
        first, second = inner.param_groups[0]["params"][:2]
        if rank == 1:
            mine.update(options)
            if case == "meta param":
                inner.param_groups[0]["params"][0] = nn.Parameter(torch.ones(5, 8, device="meta"))
            if case == "lr":
                inner.param_groups[0]["lr"] = -1.0
            if case == "hyperparameter":
                inner.param_groups[0]["lr"] = 0.5
            if case == "saved state":
                moments = {"exp_avg": torch.zeros(7), "exp_avg_sq": torch.zeros(7)}
                inner.state[first] = {"step": torch.tensor(1.0), **moments}
            if case == "step counts":  # one flat bucket, two counts: its slices keep one
                inner.state[first], inner.state[second] = _held(first, 2.0), _held(second, 1.0)
            if case == "held state":
                inner.state[first] = _held(first, 1.0)
        try:
            FP16_Optimizer(inner, **mine)
            errors[case] = "accepted"
        except (TypeError, ValueError) as err:
            errors[case] = str(err)
    kept = all(
        p.data_ptr() == ptr and torch.equal(p, value)
        for p, (ptr, value) in zip(model.parameters(), before, strict=True)
    )
    return {"errors": errors, "kept": kept}


def written_after_the_clip(rank: int, world: int) -> dict[str, float]:
    """Grads zeroed on every rank between ``clip_master_grads`` (which reduces them) and
    ``step``: on the reduce-scatter route (NCCL's, forced here) the step once read the copy
    the clip had reduced into, and moved the params; on gloo's all-reduce route it did not.
    Returns how far the params moved, per route."""
    moved = {}
    build = fdist.sharded.Sharding.__init__
    for route in ("reduce_scatter", "all_reduce"):

        def routed(self, group, route=route):
            build(self, group)
            self.scatter_by_all_reduce = route == "all_reduce"

        with mock.patch.object(fdist.sharded.Sharding, "__init__", routed):
            model = Net()
            opt = make_optimizer(model, "sgd", shard=True)
        before = params_of(model)
        g = torch.Generator().manual_seed(7)
        x, y = torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 3, generator=g)
        opt.backward(F.mse_loss(model(x + rank), y))
        opt.clip_master_grads(100.0)  # clips nothing
        for p in model.parameters():
            p.grad.zero_()
        opt.step()
        moved[route] = max((a - b).abs().max().item() for a, b in zip(params_of(model), before))
    return moved


def worker(rank: int, world: int, out: str) -> None:
    found: dict[str, Any] = {name: versus_unsharded(rank, world, name) for name in ("adam", "sgd")}
    found["checkpoint"] = checkpoint_run(rank, world, Path(out))
    found["memory"] = memory(shard=True)
    if world == 2:
        found["compiled"] = versus_unsharded(rank, world, "adam", compiled=True)
        found["refusals"] = refusals(rank, world)
        found["compact"] = compact_run(rank, world, Path(out))
        found["prestepped"] = prestepped_run(rank, world, shard=True)
        found["written"] = written_then_saved(rank, world, Path(out))
        found["new_structure"] = new_structure_refused(rank, world)
        found["damaged_copy"] = damaged_copy_refused(rank, world)
        found["stale_copy"] = stale_copy_refused(rank, world)
        found["written_after_the_clip"] = written_after_the_clip(rank, world)
    torch.save(found, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[Any, Any]:
    """The d=2 run (it writes the checkpoint the d=4 run loads); d=4 is added on demand."""
    out = tmp_path_factory.mktemp("facade_sharded")
    spawn(worker, 2, str(out), timeout_s=60)
    return {2: results(out, 2), "dir": out}


@pytest.fixture(scope="module")
def runs_4(runs) -> dict[Any, Any]:
    spawn(worker, 4, str(runs["dir"]), timeout_s=60)
    runs[4] = results(runs["dir"], 4)
    return runs


def unsharded(name: str, world: int) -> dict[str, Any]:
    model = Net()
    opt = make_optimizer(model, name, process_group=None)
    return train(model, opt, range(STEPS), None, world, inf=name == "adam", schedule=True)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_sharded_facade_equals_the_unsharded_one_on_the_whole_batch(request, world, name):
    runs = request.getfixturevalue("runs" if world == 2 else "runs_4")
    expected = unsharded(name, world)
    assert expected["lr"] == runs[world][0][name]["lr"] == LR[name] / 16  # StepLR moved it
    for r in runs[world]:
        got = r[name]
        for a, b in zip(got["params"], runs[world][0][name]["params"]):
            assert torch.equal(a, b)  # every rank holds the same params
        # The ranks' FP16 grads are averaged in FP16 (DDP's rounding), the reference's come
        # from one backward over the whole batch: equal to FP16 gradient precision (Nesterov
        # momentum carries a rounding on for a few steps).
        for a, b in zip(got["params"], expected["params"]):
            torch.testing.assert_close(a, b, rtol=5e-3, atol=2e-3)
        assert got["scales"] == expected["scales"]
        # clip_master_grads returns the global norm (the root of the slices' summed squares).
        assert got["norms"] == pytest.approx(expected["norms"], rel=2e-3)


def test_grads_written_after_a_clip_reach_the_step_on_either_route(runs):
    for r in runs[2]:
        assert r["written_after_the_clip"] == {"reduce_scatter": 0.0, "all_reduce": 0.0}


def test_an_inf_on_one_rank_skips_every_rank(runs):
    for r in runs[2]:
        got = r["adam"]
        assert got["unchanged"] and got["norms"][INF_AT] == -1.0
        assert got["scales"][INF_AT] == got["scales"][INF_AT - 1] / 2
        assert got["scales"] == runs[2][0]["adam"]["scales"]


def test_compiled_sharded_step_matches_eager(runs):
    for r in runs[2]:
        assert r["compiled"]["scales"] == r["adam"]["scales"]
        for compiled, eager in zip(r["compiled"]["params"], r["adam"]["params"], strict=True):
            assert_nearly_bitwise(compiled, eager)


def test_checkpoint_saved_at_2_loads_at_4_and_unsharded(runs_4):
    """Each step clips, by a global norm whose squares each world size sums in its own order:
    the runs agree to that rounding (bitwise on an AMD EPYC; on an AVX-512 Intel Xeon a value
    of d = 2's run lands one float32 unit apart), the loads themselves exactly."""
    runs = runs_4
    model = Net()
    opt = make_optimizer(model, "adam", process_group=None)
    expected = train(model, opt, range(STEPS), "same", 1)["params"]
    for world in (2, 4):
        for r in runs[world]:
            for a, b, first in zip(
                r["checkpoint"]["params"], expected, runs[world][0]["checkpoint"]["params"]
            ):
                assert torch.equal(a, first)  # every rank holds the same params
                assert_nearly_bitwise(a, b)
    # Unsharded: every rank's dict, consolidated into apex's format (weights_only both ways).
    shards = [torch.load(runs["dir"] / f"opt_rank{r}.pt", weights_only=True) for r in (0, 1)]
    # The count the dicts hold, which a save after the load once gave back as 0.
    assert int(shards[0]["shard"]["shard"]["count"]) == SAVE_AT
    assert [r["checkpoint"]["count"] for r in runs[4]] == [SAVE_AT] * 4
    torch.save(consolidate_state_dict(shards), runs["dir"] / "consolidated.pt")
    whole = torch.load(runs["dir"] / "consolidated.pt", weights_only=True)
    model = Net()
    model.load_state_dict(torch.load(runs["dir"] / "model.pt", weights_only=True))
    opt = make_optimizer(model, "adam", process_group=None)
    opt.load_state_dict(whole)
    again = opt.state_dict()  # the load itself is exact: masters and moments as saved
    assert bitwise_equal(again["fp32_from_fp16"], whole["fp32_from_fp16"])
    saved_state, loaded_state = (d["optimizer_state_dict"]["state"] for d in (whole, again))
    assert bitwise_equal(loaded_state, saved_state)
    for a, b in zip(train(model, opt, range(SAVE_AT, STEPS), "same", 1)["params"], expected):
        assert_nearly_bitwise(a, b)


def test_a_checkpoint_missing_a_rank_is_refused_and_changes_nothing(runs):
    model = Net()
    opt = make_optimizer(model, "adam", process_group=None)
    train(model, opt, range(2), "same", 1)  # moments and a step count to keep
    before = fingerprint(model, opt)
    saved = torch.load(runs["dir"] / "opt_rank1.pt", weights_only=True)
    with pytest.raises(ValueError, match="needs all their dicts"):
        opt.load_state_dict([saved])
    # One rank's dict on its own (not in a list) once got "it has no ['optimizer_state_dict',
    # 'fp32_from_fp16'] entries ... comes from FP16_Optimizer.state_dict()", which it did.
    with pytest.raises(ValueError, match="rank 1's dict of a checkpoint saved by 2 ranks: pass"):
        opt.load_state_dict(saved)
    assert_same_fingerprint(fingerprint(model, opt), before)


def test_a_damaged_copy_on_one_rank_is_loaded_by_no_rank(runs):
    own, told = (r["damaged_copy"] for r in reversed(runs[2]))
    assert "holds negative values" in own["error"]
    assert told["error"] == f"rank 1 refused the dict: {own['error']}"
    assert "saved from an FSDP2 model's FP16_Optimizer; this one is not" in own["other_format"]
    assert own["pre_hook"] == "a load pre-hook refused it"
    assert told["pre_hook"] == "rank 1 refused the dict: a load pre-hook refused it"
    assert (own["hook_loads"], told["hook_loads"]) == (own["error"], told["error"])
    assert told["other_format"] == f"rank 1 refused the dict: {own['other_format']}"
    assert all(r["damaged_copy"]["unchanged"] for r in runs[2])


def test_a_stale_copy_on_one_rank_is_loaded_by_no_rank(runs):
    """Momentum SGD's state holds no step counts: the facade's own entries tell the copies
    apart (its count, its loss scaler, its param groups' numbers), on every rank alike."""
    later, rescaled, relearned, unsharded = runs[2][0]["stale_copy"]["errors"]
    expected = [later, rescaled, relearned, unsharded]
    assert all(r["stale_copy"]["errors"] == expected for r in runs[2]), expected
    assert later.startswith(
        "rank 1 was given another checkpoint than rank 0 (['applied_steps']: 3 there, 2 "
        "on rank 0; a copy saved at another step, or by another run)"
    ), later
    assert rescaled.startswith(
        "rank 1 was given another checkpoint than rank 0 (['loss_scaler']: {"
    ), rescaled
    assert relearned.startswith(
        "rank 1 was given another checkpoint than rank 0 (['optimizer_state_dict']"
        "['param_groups'][0]: {'lr': 1.0, "
    ), relearned
    assert unsharded.startswith(
        "rank 1 was given another checkpoint than rank 0 (['applied_steps']: 3 there, 2 "
    ), unsharded
    assert all(r["stale_copy"]["unchanged"] for r in runs[2])


def test_persistent_bytes_per_param_are_4_plus_12_over_d(runs_4):
    assert memory(shard=False) == pytest.approx(16, abs=1e-3)
    for world in (2, 4):
        for r in runs_4[world]:
            assert r["memory"] == pytest.approx(4 + 12 / world, abs=1e-3)


def test_what_cannot_shard_is_refused_before_anything_changes(runs):
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"torch\.distributed initialized"):
        make_optimizer(Net(), "adam", shard=True)
    found = runs[2][0]["refusals"]
    assert "needs the fast path" in found["rmsprop"] and "RMSprop" in found["rmsprop"]
    assert "nothing to shard across" in found["solo"]
    for key in ("solo", "solo_consensus", "solo_own_consensus", "solo_average"):
        assert "a group this process is not in" in runs[2][1]["refusals"][key]
    assert runs[2][1]["refusals"]["solo_grads_kept"]
    assert found["untouched"]
    rank_0, rank_1 = (r["refusals"]["alone"] for r in runs[2])
    assert rank_0["kept"] and rank_1["kept"]
    for case, (_, refusal) in ALONE.items():
        assert refusal in rank_1["errors"][case], (case, rank_1["errors"][case])
        refused = f"rank 1 of the group refused its arguments: {rank_1['errors'][case]}"
        assert rank_0["errors"][case] == refused, (case, rank_0["errors"][case])
    for case, (_, difference) in APART.items():
        assert difference in rank_0["errors"][case], (case, rank_0["errors"][case])
        assert rank_1["errors"][case] == rank_0["errors"][case]
    assert "optimizer.state" in found["state"]
    for r in runs[2]:
        assert "inspect_master_grad_data" in r["refusals"]["inspect_master_grad_data"]
        assert r["refusals"]["inspect_overflowed"] == r["refusals"]["inspect_master_grad_data"]
    other = "rank 1 of the group has param_groups[1]['params'][0] as float16[6], its first"
    for refused in (r["refusals"]["other_model"] for r in runs[2]):  # it said params[1]
        assert refused.startswith(other), refused
    assert "steps each gradient once" in found["again"] and found["again_unchanged"]
    assert found["gathers_at_init"] == 1
    sparse = "this needs the generic path, which a sharded FP16_Optimizer cannot take"
    assert sparse in found["sparse"] and found["sparse_unchanged"], found["sparse"]
    for error, as_never_asked in (r["new_structure"] for r in runs[2]):
        assert "cannot change the structure of param_groups[0]" in error and as_never_asked


def test_compact_sharded_facade_resumes_bitwise_and_tracks_the_unsharded_one(runs):
    """Compensated masters and int8 moments, sharded at d=2: the ranks stay equal, a run
    resumed from the ranks' dicts steps bitwise like the run that saved them, and both track
    an unsharded compact run (the global norm that clips is summed in another order)."""
    model = Net()
    opt = make_optimizer(model, "adam", process_group=None, **COMPACT)
    unsharded = train(model, opt, range(STEPS), "same", 1)["params"]
    first = runs[2][0]["compact"]
    for r in runs[2]:
        for ours, resumed, rank0 in zip(r["compact"]["run"], r["compact"]["resumed"], first["run"]):
            assert torch.equal(ours, rank0)
            assert torch.equal(ours, resumed)
    for ours, theirs in zip(first["run"], unsharded, strict=True):
        assert_nearly_bitwise(ours, theirs)


def test_consolidation_takes_the_ranks_in_any_order_and_or_s_their_overflow(runs):
    """The flags and param groups were rank 0's only if its dict came first: a rank reads
    ``overflow`` from its own grads until a step agrees on them (the step then skips if any
    rank's held inf/NaN); dicts whose param groups differ are refused."""
    shards = [torch.load(runs["dir"] / f"opt_rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert not any(d["overflow"] for d in shards)
    shards[1] = {**shards[1], "overflow": True}
    forward, backward = consolidate_state_dict(shards), consolidate_state_dict(shards[::-1])
    assert forward["overflow"] and backward["overflow"]
    assert optree.tree_structure(forward) == optree.tree_structure(backward)
    for a, b in zip(optree.tree_leaves(forward), optree.tree_leaves(backward), strict=True):
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b
    groups = [{**g, "lr": 2 * g["lr"]} for g in shards[1]["param_groups"]]
    with pytest.raises(ValueError, match="rank 1's dict has another 'param_groups' than rank 0's"):
        consolidate_state_dict([shards[0], {**shards[1], "param_groups": groups}][::-1])


def test_a_compact_sharded_checkpoint_consolidates_into_an_unsharded_compact_optimizer(runs):
    """The consolidated dict is apex's format, decoded to FP32; an unsharded compact optimizer
    loads it and gives back the same masters and moments, bitwise (its int8 blocks are the
    bucket's, as the ranks' were), and the count its rounding reads."""
    shards = [torch.load(runs["dir"] / f"compact_rank{r}.pt", weights_only=True) for r in (0, 1)]
    whole = consolidate_state_dict(shards)
    assert int(whole["applied_steps"]) == SAVE_AT
    model = Net()
    model.load_state_dict(torch.load(runs["dir"] / "compact_model.pt", weights_only=True))
    opt = make_optimizer(model, "adam", process_group=None, **COMPACT)
    opt.load_state_dict(whole)
    again = opt.state_dict()
    assert int(again["applied_steps"]) == SAVE_AT
    for ours, theirs in zip(again["fp32_from_fp16"][0], whole["fp32_from_fp16"][0]):
        assert torch.equal(ours, theirs)
    saved = whole["optimizer_state_dict"]["state"]
    for key, entry in again["optimizer_state_dict"]["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(entry[name]), torch.as_tensor(saved[key][name]))


def test_compact_sharded_memory_is_4_plus_3_over_d_bytes_per_param(runs):
    """FP16 param and grad whole (4 B), a 1-byte correction and two 1-byte moments and their
    scales (8 B per 256 values) for this rank's half."""
    for r in runs[2]:
        assert r["compact"]["memory"] == pytest.approx(4 + (3 + 8 / 256) / 2, abs=1e-3)


def test_a_sharded_facade_takes_the_state_its_optimizer_already_holds(runs):
    """An Adam that stepped before it was wrapped: its moments and step counts move into the
    ranks' slices, and the run equals the unsharded facade's built the same way, bitwise."""
    expected = prestepped_run(0, 1, shard=False)
    for r in runs[2]:
        for a, b in zip(r["prestepped"], expected):
            assert torch.equal(a, b)


def test_weights_written_before_a_sharded_checkpoint_are_saved_as_written(runs):
    """Each rank adopts its slices of the written params into its masters before saving:
    the consolidated masters are the written weights (they were the old masters, and loading
    the checkpoint set the weights back)."""
    written = runs[2][0]["written"]
    shards = [torch.load(runs["dir"] / f"written_rank{r}.pt", weights_only=True) for r in (0, 1)]
    model = Net()
    opt = make_optimizer(model, "sgd", process_group=None)
    opt.load_state_dict(consolidate_state_dict(shards))
    pairs = [
        (p, w) for p, w in zip(model.parameters(), written, strict=True) if w.dtype == torch.float16
    ]
    assert len(pairs) == 4 and all(torch.equal(p, w) for p, w in pairs)
