"""Consensus and DDP on CPU/gloo: 2 processes on localhost, spawned by each test.

Workers are module-level functions (``torch.multiprocessing.spawn`` pickles them by name); each
writes what it saw to ``out/rank{r}.pt`` and the test compares the files.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optree
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fp16fx
import fp16fx.distributed as fdist
from fp16fx import flat
from fp16fx.compile import StepFunction, compile_step
from tests.fallbacks import watching

STEPS = 20
BATCH = 8  # per rank


def _entry(rank: int, world: int, store: str, timeout_s: float, fn: Callable, args: tuple) -> None:
    faulthandler.enable()  # a rank that aborts in C++ shows where its Python was
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        with watching() as fallbacks:
            fn(rank, world, *args)
        assert not fallbacks.messages, f"rank {rank} stepped eagerly: {fallbacks.messages[0]}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Done and saved: leave without the interpreter's teardown, as a forkserver child (those
    # of `fp16fx train`) does. There, rarely, torch 2.14 aborts a rank whose work is saved
    # ("terminate called without an active exception": a joinable C++ thread destroyed).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable, world: int, *args: Any, timeout_s: float = 30.0) -> None:
    """Runs ``fn(rank, world, *args)`` in ``world`` gloo processes; raises if one fails.

    They meet through a new file, not a port: a free port found here would stay free for
    seconds, until rank 0 binds it, and a test file running beside this one (pytest-xdist)
    may take it meanwhile."""
    with tempfile.TemporaryDirectory(prefix="fp16fx-spawn-") as where:
        store = os.path.join(where, "rendezvous")
        mp.spawn(_entry, args=(world, store, timeout_s, fn, args), nprocs=world, join=True)


def results(out: Path, world: int) -> list[dict[str, Any]]:
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world)]


def assert_nearly_bitwise(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Params of two runs that differ in a rounding only (a compiled step against an eager
    one: Inductor's square root is correctly rounded, eager's on x86 is not; a sum taken in
    another order): equal but for a value or two one unit in the last place apart, where a
    wrong hyperparameter moves many values by many units."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0.0)
        return
    apart = got != expected
    step_up = torch.nextafter(expected, torch.full_like(expected, math.inf))
    step_down = torch.nextafter(expected, torch.full_like(expected, -math.inf))
    assert ((got == step_up) | (got == step_down))[apart].all()
    assert int(apart.sum()) <= 2


def make_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def batch(step: int, rank: int, world: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Returns rank ``rank``'s slice of step ``step``'s global batch (rank=None: all of it)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH * world, 8, generator=g).to(dtype)
    y = torch.randn(BATCH * world, 4, generator=g).to(dtype)
    if rank is None:
        return x, y
    part = slice(rank * BATCH, (rank + 1) * BATCH)
    return x[part], y[part]


def train_facade(
    model: nn.Module,
    rank: int | None,
    world: int,
    dtype: torch.dtype,
    *,
    fault: str | None = None,
    process_group: Any = "auto",
    compiled: bool = False,
    path: str = "auto",
    average: bool = False,
) -> dict[str, Any]:
    """Trains ``model`` (maybe DDP-wrapped) with FP16_Optimizer(Adam); returns what it saw.

    ``fault``: at step 5 rank 1's grads get an inf "before" DDP's all-reduce (a grad hook)
    or "after" it (written into ``p.grad`` once backward returned); "between_clips": every
    step clips twice, at step 5 rank 1 writes the inf between the two clips, and rank 0
    alone then reads the unscaled grads, before and after the step; "after_unscale": rank 1
    alone writes its grads once they were unscaled (at step 5 an inf, at the others a write
    of nothing), then every rank calls ``update_master_grads()`` again, which unscales on
    rank 1 alone: no collective (the step agrees).
    """
    params = list(model.parameters())
    opt = fp16fx.FP16_Optimizer(
        torch.optim.Adam(params, lr=1e-2),
        dynamic_loss_scale=dtype == torch.float16,
        verbose=False,
        compiled=compiled,
        process_group=process_group,
        path=path,
    )
    scales, views, alone, read_after_the_clip = [], [], 0, []
    for i in range(STEPS):
        x, y = batch(i, rank, world, dtype)
        opt.zero_grad()
        handle = None
        if fault == "before" and i == 5 and rank == 1:
            handle = params[0].register_hook(lambda g: torch.full_like(g, float("inf")))
        loss = F.mse_loss(model(x).float(), y.float())
        opt.backward(loss, update_master_grads=False)
        if handle is not None:
            handle.remove()
        if fault == "after" and i == 5 and rank == 1:
            params[0].grad[0, 0] = float("inf")
        if average:  # data parallel without DDP
            fdist.average_grads([p.grad for p in params])
        opt.update_master_grads()
        if fault == "after_unscale":  # only rank 1 knows its grads changed
            if rank == 1:
                params[0].grad[0, 0] = float("inf") if i == 5 else params[0].grad[0, 0]
            with counting_all_reduces() as calls:
                opt.update_master_grads()
            alone += len(calls)
        if fault == "between_clips":  # rank 1 alone sees new grads at the second clip
            opt.clip_master_grads(0.1)
            if i == 5 and rank == 1:
                params[0].grad[0, 0] = float("inf")
            opt.clip_master_grads(0.05)
            if i == 5:  # every rank reads the clip's agreed check (rank 0's own grads: finite)
                with counting_all_reduces() as calls:
                    read_after_the_clip += [opt.overflow, opt.inspect_master_grad_data()]
                alone += len(calls)
            if rank == 0:  # a read one rank makes alone: the clip's agreed check
                with counting_all_reduces() as calls:
                    opt.inspect_master_grad_data()
                alone += len(calls)
        flat = getattr(opt._engine, "flat", None)  # the generic path has none
        views.append(  # after backward: are the grads still the facade's flat views?
            flat is not None
            and len(flat.params) > 0
            and all(p.grad is v for p, v in zip(flat.params, flat.grad_views))
        )
        opt.step()
        if fault == "between_clips" and rank == 0:  # alone again: the step's agreed check
            with counting_all_reduces() as calls:
                opt.inspect_master_grad_data()
            alone += len(calls)
        scales.append(opt.loss_scale)
    return {
        "params": [p.detach().clone() for p in params],
        "masters": [m.detach().clone() for g in opt.param_groups for m in g["params"]],
        "scales": torch.tensor(scales),
        "skipped": opt.skipped_steps,
        "grads_are_views": views[1:],  # step 0 creates the grads; the facade then binds them
        "path": opt.path,
        "read_after_the_clip": read_after_the_clip,
        # by reads one rank made alone, or unscaling one rank did alone: none is a collective
        "all_reduces_alone": alone,
    }


def functional(rank: int, world: int, compiled: bool, ddp: bool = True) -> dict[str, Any]:
    """DDP with the functional API: grads land (averaged) in the state's flat grad buffers;
    at step 3 rank 0's grads get a NaN after DDP's all-reduce. ``ddp=False``: no DDP, the
    grads are averaged by ``fdist.average_grads`` (one all-reduce per flat buffer)."""
    model = make_model(torch.float16)
    params = list(model.parameters())
    if ddp:
        model = DDP(model)
    elif rank == 1:  # fdist.init broadcasts rank 0's params, as DDP(model) does
        with torch.no_grad():
            params[0].add_(1)
    state = fdist.init(params, fp16fx.adam(1e-2), buckets=True)
    assert state.consensus is not None
    grads = fp16fx.grad_buffers(state)
    for p, g in zip(params, grads):
        p.grad = g
    if compiled:
        step = compile_step(inplace=True)
    else:
        step = StepFunction(inplace=True, compile_options=None)

    finite = []
    for i in range(6):
        x, y = batch(i, rank, world, torch.float16)
        for g in grads:
            g.zero_()
        loss = F.mse_loss(model(x).float(), y.float())
        fp16fx.scale_loss(state, loss).backward()
        if not ddp:
            fdist.average_grads(grads)
        if i == 3 and rank == 0:
            grads[1][0] = float("nan")
        state, info = step(state, grads)
        finite.append(bool(info["finite"]))
    return {"params": [p.detach().clone() for p in params], "finite": finite}


def failed_step(opt: Any, start: float) -> dict[str, Any]:
    """Returns the error ``opt.step()`` raised ("no error" if none) and the seconds since
    ``start``: what a rank reports when another dies or hangs."""
    try:
        opt.step()
    except RuntimeError as err:
        message = str(err)
    else:
        message = "no error"
    return {"message": message, "seconds": time.monotonic() - start}


def die(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 dies after backward, before its step's consensus all-reduce."""
    model = DDP(make_model(torch.float16))
    opt = fp16fx.FP16_Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), verbose=False, compiled=False
    )
    x, y = batch(0, rank, world, torch.float16)
    opt.backward(F.mse_loss(model(x).float(), y.float()))
    if rank == 1:
        os._exit(0)
    start = time.monotonic()
    return failed_step(opt, start)


def hang(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 hangs (stays alive, never steps); rank 0's step fails after the gloo timeout.

    Runs on its own process group, so the world group stays usable afterwards."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=HANG_TIMEOUT_S))
    model = DDP(make_model(torch.float16))
    opt = fp16fx.FP16_Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        verbose=False,
        compiled=False,
        process_group=group,
    )
    x, y = batch(0, rank, world, torch.float16)
    opt.backward(F.mse_loss(model(x).float(), y.float()))
    start = time.monotonic()
    if rank == 1:
        time.sleep(HANG_TIMEOUT_S + 3)
        return {}
    return failed_step(opt, start)


def lone_read_after_add_group(rank: int, world: int) -> dict[str, Any]:
    """A group added on every rank after a clip, then the unscaled grads read on rank 0
    alone: the clip's agreed norm left the new group out, and the read once ran the
    consensus alone (rank 1's step all-reduce paired with it; rank 0's step timed out)."""
    model = DDP(make_model(torch.float16))
    first, second = model.module[0], model.module[2]
    opt = fp16fx.FP16_Optimizer(
        torch.optim.Adam(first.parameters(), lr=1e-2), verbose=False, compiled=False
    )
    x, y = batch(0, rank, world, torch.float16)
    opt.backward(F.mse_loss(model(x).float(), y.float()))
    opt.clip_master_grads(1e-3)
    opt.add_param_group({"params": list(second.parameters())})
    alone = 0
    if rank == 0:
        with counting_all_reduces() as calls:
            opt.inspect_master_grad_data()
        alone = len(calls)
    opt.step()
    return {"all_reduces_alone": alone, "params": [p.detach().clone() for p in model.parameters()]}


def add_group_on_ranks_apart(rank: int, world: int) -> dict[str, Any]:
    """Groups added on every rank (generic path) while the ranks' grads differ: rank 1 alone
    wrote the first group's grads since they were unscaled, and the last group's params have
    grads on rank 1 alone; the second group's grads overflowed on every rank. Each
    ``add_param_group`` once ran the consensus only on the ranks that had new grads to
    check; now none does (the step agrees)."""
    model = DDP(nn.Sequential(make_model(torch.float16), nn.Linear(4, 4).half()))
    first, second, third = model.module[0][0], model.module[0][2], model.module[1]
    opt = fp16fx.FP16_Optimizer(
        torch.optim.Adam(first.parameters(), lr=1e-2), verbose=False, path="generic"
    )
    x, y = batch(0, rank, world, torch.float16)
    opt.backward(F.mse_loss(model(x).float(), y.float()))
    if rank == 1:
        first.weight.grad.add_(0)
    second.weight.grad[0, 0] = float("inf")  # on every rank: the step skips on every rank
    collectives = []
    for layer in (second, third):
        if rank == 0 and layer is third:
            layer.zero_grad(set_to_none=True)
        with counting_all_reduces() as calls:
            opt.add_param_group({"params": list(layer.parameters())})
        collectives.append(len(calls))
    opt.step()
    return {"collectives": collectives, "skipped": opt.skipped_steps, "path": opt.path}


def switch_on_ranks_apart(rank: int, world: int) -> dict[str, Any]:
    """A switch to the generic path (``clip_master_grads(norm_type=1)``) on every rank, after
    rank 1 alone wrote the grads a step stepped: only rank 0 still knew them as stepped, and
    it alone unscales them at the switch (no collective: the clip agrees)."""
    model = DDP(make_model(torch.float16))
    opt = fp16fx.FP16_Optimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2), verbose=False, compiled=False
    )
    x, y = batch(0, rank, world, torch.float16)
    opt.backward(F.mse_loss(model(x).float(), y.float()))
    opt.step()
    if rank == 1:
        next(model.parameters()).grad.add_(0)
    with counting_all_reduces() as calls:
        opt.clip_master_grads(1.0, norm_type=1)
    collectives = len(calls)
    opt.step()
    return {
        "collectives": collectives,
        "path": opt.path,
        "params": [p.detach().clone() for p in model.parameters()],
    }


def clip_on_ranks_apart(rank: int, world: int) -> dict[str, Any]:
    """The generic path (RMSprop) clips where the ranks' grads differ after DDP averaged
    them (rank 1's doubled, as a rank-local hook might): every rank clips by the norm the
    ranks agree on, their largest, and returns it, by the L2 norm and by another alike (each
    rank once clipped by its own norm and returned it)."""
    found: dict[str, Any] = {}
    for norm_type in (2.0, math.inf):
        model = DDP(make_model(torch.float16))
        opt = fp16fx.FP16_Optimizer(torch.optim.RMSprop(model.parameters()), verbose=False)
        x, y = batch(0, rank, world, torch.float16)
        opt.backward(F.mse_loss(model(x).float(), y.float()), update_master_grads=False)
        if rank == 1:
            for p in model.parameters():
                p.grad.mul_(2)
        opt.update_master_grads()
        own = torch.nn.utils.get_total_norm(opt.inspect_master_grad_data()[0], norm_type)
        norm = opt.clip_master_grads(1e-3, norm_type)
        clipped = torch.nn.utils.get_total_norm(opt.inspect_master_grad_data()[0], norm_type)
        found[norm_type] = {"own": float(own), "returned": norm, "clipped": float(clipped)}
    found["path"] = opt.path
    # A switch with a fast-path clip pending (made by the ranks' norm) clips by that norm
    # too: each rank once clipped by its own at the switch.
    model = DDP(make_model(torch.float16))
    opt = fp16fx.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    x, y = batch(0, rank, world, torch.float16)
    opt.backward(F.mse_loss(model(x).float(), y.float()))
    if rank == 1:
        for p in model.parameters():
            p.grad.mul_(2)
    norm = opt.clip_master_grads(1e-3)
    opt.clip_master_grads(1e9, norm_type=math.inf)  # the switch; clips nothing more
    clipped = torch.nn.utils.get_total_norm(opt.inspect_master_grad_data()[0])
    found["switched"] = {"returned": norm, "clipped": float(clipped), "path": opt.path}
    return found


def refused_replicated_init(rank: int, world: int) -> list[tuple[str, bool]]:
    """fdist.init without shard refused: each rank's error, and whether its params kept their
    own values (the broadcast came before the checks: a bad optimizer left every rank with
    rank 0's values, and a transposed param took them in its own shape)."""

    def labels(params: Any) -> Any:  # a user's function, failing on rank 1 alone
        return {"w": 0} if rank == 0 else {}["missing"]

    outcomes = []
    for optimizer, shape in [
        ("adam", (2, 3)),
        (fp16fx.adam(), (2, 3) if rank == 0 else (3, 2)),
        (fp16fx.multi_transform([fp16fx.adam()], labels), (2, 3)),
    ]:
        params = {"w": torch.full(shape, float(rank + 1), dtype=torch.float16)}
        try:
            fdist.init(params, optimizer)
            error = "accepted"
        except Exception as err:  # whatever each rank raises is the result
            error = f"{type(err).__name__}: {err}"
        outcomes.append((error, bool((params["w"] == rank + 1).all())))
    return outcomes


@contextlib.contextmanager
def counting_all_reduces() -> Iterator[list[None]]:
    """Counts the all-reduces made within it (the found-inf consensus is one)."""
    calls: list[None] = []
    all_reduce = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(None)
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted
    try:
        yield calls
    finally:
        dist.all_reduce = all_reduce


HANG_TIMEOUT_S = 3

SCENARIOS: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "ddp_fp32": lambda r, w: train_facade(DDP(make_model(torch.float32)), r, w, torch.float32),
    "ddp_fp16": lambda r, w: train_facade(DDP(make_model(torch.float16)), r, w, torch.float16),
    "facade_average_grads": lambda r, w: train_facade(
        make_model(torch.float16), r, w, torch.float16, average=True
    ),
    # A model handed to spawned workers sits in shared memory (here: shared by hand)
    "ddp_fp16_shared": lambda r, w: train_facade(
        DDP(make_model(torch.float16).share_memory()), r, w, torch.float16
    ),
    "ddp_fp16_bucket_view": lambda r, w: train_facade(
        DDP(make_model(torch.float16), gradient_as_bucket_view=True), r, w, torch.float16
    ),
    "inf_before_ddp": lambda r, w: train_facade(
        DDP(make_model(torch.float16)), r, w, torch.float16, fault="before"
    ),
    "inf_after_ddp": lambda r, w: train_facade(
        DDP(make_model(torch.float16)), r, w, torch.float16, fault="after", compiled=True
    ),
    "inf_between_clips": lambda r, w: train_facade(
        DDP(make_model(torch.float16)), r, w, torch.float16, fault="between_clips"
    ),
    "inf_after_ddp_generic": lambda r, w: train_facade(
        DDP(make_model(torch.float16)), r, w, torch.float16, fault="after", path="generic"
    ),
    "inf_after_unscale_generic": lambda r, w: train_facade(
        DDP(make_model(torch.float16)), r, w, torch.float16, fault="after_unscale", path="generic"
    ),
    "add_group_on_ranks_apart": add_group_on_ranks_apart,
    "switch_on_ranks_apart": switch_on_ranks_apart,
    "clip_on_ranks_apart": clip_on_ranks_apart,
    "inf_after_ddp_no_consensus": lambda r, w: train_facade(
        DDP(make_model(torch.float16)), r, w, torch.float16, fault="after", process_group=None
    ),
    "lone_read_after_add_group": lone_read_after_add_group,
    "refused_replicated_init": refused_replicated_init,
    "functional_eager": lambda r, w: functional(r, w, compiled=False),
    "functional_compiled": lambda r, w: functional(r, w, compiled=True),
    "functional_average_grads": lambda r, w: functional(r, w, compiled=False, ddp=False),
    "hang": hang,
    "die": die,  # last: it breaks the group
}


def scenarios_worker(rank: int, world: int, out: str) -> None:
    found = {}
    for name, run in SCENARIOS.items():
        found[name] = run(rank, world)
        torch.save(found, Path(out) / f"rank{rank}.pt")  # "die" ends rank 1 before its save


@pytest.fixture(scope="module")
def replicated(tmp_path_factory) -> list[dict[str, Any]]:
    """Every scenario above, run once by 2 gloo processes (one spawn: imports cost ~6 s)."""
    out = tmp_path_factory.mktemp("replicated")
    spawn(scenarios_worker, 2, str(out), timeout_s=20)
    return results(out, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_ddp_facade_matches_single_process_over_the_whole_batch(replicated, dtype):
    name = "ddp_fp32" if dtype == torch.float32 else "ddp_fp16"
    r0, r1 = (r[name] for r in replicated)
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)
    single = train_facade(make_model(dtype), None, 2, dtype, process_group=None)
    # FP32: only the order of the batch sum differs. FP16: DDP averages FP16 grads (one
    # rounding per step), so the masters agree to FP16 gradient precision.
    atol = 1e-6 if dtype == torch.float32 else 2e-3
    for a, b in zip(r0["masters"], single["masters"]):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)
    assert r0["skipped"] == single["skipped"] == 0
    # DDP (gradient_as_bucket_view=False) copies its averaged grads into p.grad in place: the
    # facade's flat grad buffer keeps being the grads, no extra copy.
    assert all(r0["grads_are_views"])


def test_a_ddp_worker_given_a_shared_model_trains_its_own_copy_on_the_fast_path(replicated):
    """With a process_group the processes agree as one job: each trains its own copy, moved
    into the fast path's buffers (processes sharing one model without one, as Hogwild's
    do, take the generic path: tests/test_misuse.py)."""
    for ranks in replicated:
        shared, plain = ranks["ddp_fp16_shared"], ranks["ddp_fp16"]
        assert all(shared["grads_are_views"])
        assert all(torch.equal(a, b) for a, b in zip(shared["params"], plain["params"]))


def test_ddp_gradient_as_bucket_view_costs_a_copy_but_not_correctness(replicated):
    """DDP re-points every ``p.grad`` at its own bucket in each backward; the facade copies
    them into its flat buffer (one extra read and write of the FP16 grads per step)."""
    plain, views = replicated[0]["ddp_fp16"], replicated[0]["ddp_fp16_bucket_view"]
    for a, b in zip(plain["masters"], views["masters"]):
        assert torch.equal(a, b)
    assert not any(views["grads_are_views"])


@pytest.mark.parametrize(
    "name",
    [
        "inf_before_ddp",
        "inf_after_ddp",
        "inf_between_clips",
        "inf_after_ddp_generic",
        "inf_after_unscale_generic",
    ],
)
def test_an_inf_on_one_rank_skips_every_rank(replicated, name):
    """inf_after_ddp runs the facade's compiled step (the consensus is traced into it);
    inf_after_ddp_generic the generic path (torch's Adam on the masters); in
    inf_between_clips only rank 1's grads changed since the first clip's consensus (its
    cached result once left rank 1 alone in the second clip's collective), and after the
    second every rank reads its agreed overflow; in
    inf_after_unscale_generic only rank 1's since they were unscaled (rank 1 alone once ran
    a collective in the second ``update_master_grads()``)."""
    r0, r1 = (r[name] for r in replicated)
    assert r0["path"] == r1["path"] == ("generic" if name.endswith("generic") else "fast")
    assert r0["all_reduces_alone"] == r1["all_reduces_alone"] == 0
    assert r0["skipped"] == r1["skipped"] == 1
    assert torch.equal(r0["scales"], r1["scales"])
    assert r0["scales"][5] == r0["scales"][4] / 2
    for a, b in zip(r0["params"] + r0["masters"], r1["params"] + r1["masters"]):
        assert torch.equal(a, b)
    if name == "inf_between_clips":  # once False and the grads on rank 0, its own being finite
        assert r0["read_after_the_clip"] == r1["read_after_the_clip"] == [True, None]


def test_a_read_on_one_rank_after_a_group_is_added_is_no_collective(replicated):
    r0, r1 = (r["lone_read_after_add_group"] for r in replicated)
    assert r0["all_reduces_alone"] == 0
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"], strict=True))


def test_add_param_group_on_the_generic_path_is_no_collective(replicated):
    for found in replicated:
        assert found["add_group_on_ranks_apart"] == {
            "collectives": [0, 0],
            "skipped": 1,  # rank 1 too, which found no inf of its own
            "path": "generic",
        }


def test_a_switch_to_the_generic_path_is_as_many_collectives_on_every_rank(replicated):
    r0, r1 = (r["switch_on_ranks_apart"] for r in replicated)
    # the clip's two agreements: of the check, and of the L1 norm (the consensus's is L2)
    assert r0["collectives"] == r1["collectives"] == 2
    assert r0["path"] == r1["path"] == "generic"
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"], strict=True))


def test_the_generic_path_clips_every_rank_by_the_agreed_norm(replicated):
    r0, r1 = (r["clip_on_ranks_apart"] for r in replicated)
    assert r0["path"] == r1["path"] == "generic"
    for norm_type in (2.0, math.inf):
        own0, own1 = r0[norm_type]["own"], r1[norm_type]["own"]
        assert own1 == pytest.approx(2 * own0, rel=1e-6) and own0 > 1e-3
        assert r0[norm_type]["returned"] == r1[norm_type]["returned"]
        assert r0[norm_type]["returned"] == pytest.approx(own1, rel=1e-5)
        assert r1[norm_type]["clipped"] == pytest.approx(1e-3, rel=1e-4)
        assert r0[norm_type]["clipped"] == pytest.approx(0.5e-3, rel=1e-4)
    s0, s1 = r0["switched"], r1["switched"]
    assert s0["path"] == s1["path"] == "generic" and s0["returned"] == s1["returned"]
    assert (s0["clipped"], s1["clipped"]) == pytest.approx((0.5e-3, 1e-3), rel=1e-4)


def test_a_replicated_init_checks_every_rank_before_the_broadcast(replicated):
    for found in replicated:
        (optimizer, kept_values), (shapes, kept_shape), (_, kept_labels) = found[
            "refused_replicated_init"
        ]
        assert "optimizer must be an fp16fx transform" in optimizer and kept_values
        assert "rank 1 of the group has params['w'] as float16[3, 2]" in shapes and kept_shape
        assert kept_labels
    rank_0, rank_1 = (found["refused_replicated_init"][2][0] for found in replicated)
    assert rank_1 == "KeyError: 'missing'"  # its own error; the other rank once waited for it
    assert rank_0 == "ValueError: rank 1 of the group refused its arguments: 'missing'"


def test_without_consensus_an_inf_after_ddp_splits_the_ranks(replicated):
    r0, r1 = (r["inf_after_ddp_no_consensus"] for r in replicated)
    assert (r0["skipped"], r1["skipped"]) == (0, 1)
    assert not torch.equal(r0["scales"], r1["scales"])


@pytest.mark.parametrize("name", ["functional_eager", "functional_compiled"])
def test_functional_step_with_ddp_and_consensus(replicated, name):
    """Compiled: Dynamo traces the consensus' all_reduce into the fullgraph step (gloo)."""
    r0, r1 = (r[name] for r in replicated)
    assert r0["finite"] == r1["finite"] == [True, True, True, False, True, True]
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)


def test_average_grads_without_ddp_equals_ddp(replicated):
    """One all-reduce of fp16fx's flat grad buffer does what DDP does, without its buckets."""
    for r in replicated:
        ddp, own = r["functional_eager"], r["functional_average_grads"]
        assert own["finite"] == ddp["finite"]
        for a, b in zip(own["params"], ddp["params"]):
            assert torch.equal(a, b)


def test_average_grads_with_the_facade_equals_ddp(replicated):
    for r in replicated:
        ddp, own = r["ddp_fp16"], r["facade_average_grads"]
        for a, b in zip(own["masters"] + own["params"], ddp["masters"] + ddp["params"]):
            assert torch.equal(a, b)
        assert all(own["grads_are_views"])  # the facade's flat buffers, reduced in place


def test_a_dead_rank_fails_the_others_at_once(replicated):
    report = replicated[0]["die"]
    assert "fp16fx: the found-inf consensus of a step failed on rank 0 of 2" in report["message"]
    assert "Connection reset by peer" in report["message"] or "closed" in report["message"]
    assert report["seconds"] < 30


def test_a_hung_rank_fails_the_others_after_the_timeout(replicated):
    report = replicated[0]["hang"]
    assert "found-inf consensus" in report["message"]
    assert "imed out" in report["message"] or "imeout" in report["message"], report["message"]
    assert HANG_TIMEOUT_S - 0.5 < report["seconds"] < HANG_TIMEOUT_S + 20


def test_a_state_keeps_its_consensus_through_flatten_and_unflatten():
    consensus = fdist.Consensus(sharded=True)
    state = fp16fx.init({"w": torch.ones(3, dtype=torch.float16)}, fp16fx.sgd(0.1))
    state = state.replace(consensus=consensus)
    leaves, spec = optree.tree_flatten(state)
    again = optree.tree_unflatten(spec, leaves)
    assert again.consensus == consensus and hash(again.consensus) == hash(consensus)
    assert state.replace(count=state.count).consensus is consensus


def test_without_torch_distributed_there_is_no_consensus():
    assert not dist.is_initialized()
    assert fdist.default_consensus("auto") is None
    assert fdist.default_consensus(None) is None
    assert fdist.init({"w": torch.ones(2)}, fp16fx.sgd(0.1)).consensus is None
    with pytest.raises(ValueError, match="'auto', None or a group"):
        fdist.default_consensus("world")
    with pytest.raises(TypeError, match=r"a torch\.distributed process group, got True"):
        fdist.default_consensus(True)
    with pytest.raises(RuntimeError, match="not initialized"):  # a group made by hand
        fdist.default_consensus(dist.ProcessGroup(dist.HashStore(), 0, 1))
    with pytest.raises(ValueError, match="nothing to shard across"):
        fdist.init({"w": torch.ones(2)}, fp16fx.sgd(0.1), shard=True)
    params = {"w": torch.ones(2, dtype=torch.float16)}
    with pytest.raises(ValueError, match="process group has not been initialized"):
        fdist.init_sharded(params, fp16fx.sgd(0.1))  # torch's error, not an fp16fx assert


def test_sharded_and_unsharded_calls_given_the_other_state_say_which_call_to_use():
    """An unsharded state (fdist.init(..., shard=False)'s) in fdist's sharded calls once
    raised AttributeError: 'MixedPrecisionState' object has no attribute 'flat'."""
    state = fdist.init({"w": torch.ones(4, dtype=torch.float16)}, fp16fx.sgd(0.1))
    grads = {"w": torch.ones(4, dtype=torch.float16)}
    calls = {
        "fdist.sharded_step": ("fp16fx.step", lambda: fdist.sharded_step(state, grads)),
        "fdist.grad_buffers": ("fp16fx.grad_buffers", lambda: fdist.grad_buffers(state)),
        "fdist.state_dict": ("fp16fx.state_dict", lambda: fdist.state_dict(state)),
        "fdist.load_state_dict": (
            "fp16fx.load_state_dict",
            lambda: fdist.load_state_dict(state, fp16fx.state_dict(state)),
        ),
    }
    for name, (instead, call) in calls.items():
        expected = f"^{re.escape(name)} expects the ShardedState .*use {re.escape(instead)}\\)$"
        with pytest.raises(TypeError, match=expected):
            call()
    # A ShardedState (here its one attribute that matters) in an unsharded call:
    with pytest.raises(TypeError, match=r"set_hyperparams .* pass its \.shard"):
        fp16fx.set_hyperparams(SimpleNamespace(shard=state), lr=0.1)


def test_fdist_init_passes_compact_precision_on_and_checks_its_names_first():
    """fdist.init passes master=/moments= on to fp16fx.init (two processes: the compact runs
    of test_train_distributed and test_distributed_sharded); in one process, an unknown
    name is refused before the sharding (across processes, every rank checks the names
    together: test_distributed_sharded)."""
    compact = {"master": "compensated", "moments": "int8"}
    w = torch.ones(300, dtype=torch.float16)
    state = fdist.init({"w": w}, fp16fx.adam(0.1), buckets=True, **compact)
    assert (state.precision.master, state.precision.moments) == ("compensated", "int8")
    assert state.master_segments[0].dtype == torch.int8  # the correction: no FP32 copy
    params = {"w": torch.ones(2, dtype=torch.float16)}
    with pytest.raises(ValueError, match="moments must be one of"):
        fdist.init(params, fp16fx.sgd(0.1), shard=True, moments="int4")
    with pytest.raises(ValueError, match="nothing to shard across"):
        fdist.init(params, fp16fx.sgd(0.1), shard=True, **compact)


def test_average_grads_sees_a_flat_buffer_as_one_tensor():
    params = {"a": torch.ones(3, 2, dtype=torch.float16), "b": torch.ones(5, dtype=torch.float16)}
    grads = fp16fx.grad_buffers(fp16fx.init(params, fp16fx.sgd(0.1), buckets=True))
    whole = flat.whole_storage(list(grads.values()))
    assert whole is not None and whole.shape == (11,)
    assert flat.whole_storage([grads["a"]]) is None  # part of a buffer: reduced on its own
    assert flat.whole_storage([torch.ones(2), torch.ones(2)]) is None


def test_loose_grads_are_coalesced_per_dtype_into_runs_of_at_most_25_mb():
    from fp16fx.distributed.api import _COALESCE_BYTES, _coalesced_runs

    half = [torch.zeros(4 << 20, dtype=torch.float16) for _ in range(4)]  # 8 MB each
    loose = [half[0], torch.zeros(3), half[1], half[2], torch.zeros(0), half[3]]
    runs = _coalesced_runs(loose)
    assert [[t.dtype for t in run] for run in runs] == [
        [torch.float16] * 3, [torch.float32] * 2, [torch.float16],
    ]  # fmt: skip
    assert all(sum(t.nbytes for t in run) <= _COALESCE_BYTES for run in runs)
    assert sorted(id(t) for run in runs for t in run) == sorted(map(id, loose))
