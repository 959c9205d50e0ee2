"""Sharded (ZeRO-1 style) state on CPU/gloo: 2 and 4 processes, uneven last shards,
checkpoints saved at d=2 and loaded at d=4, d=1 and, consolidated, into an unsharded state."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import optree
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import fp16fx
import fp16fx.distributed as fdist
from fp16fx import saved_format
from fp16fx.compile import StepFunction
from fp16fx.distributed.agreement import checks_passed, loading_together
from fp16fx.precision import decode_moments
from fp16fx.segments import named_segments
from fp16fx.transforms import GradientTransformation
from tests.test_distributed import assert_nearly_bitwise, results, spawn
from tests.test_step import same_bits

STEPS, SAVE_AT, INF_AT = 20, 10, 7
# 21 + 5 + 13 = 39 FP16 values and 9 FP32 ones: uneven slices at d = 2 and d = 4.
SHAPES = {"a": ((7, 3), torch.float16), "b": ((5,), torch.float16), "c": ((13,), torch.float16)}
SHAPES["d"] = ((3, 3), torch.float32)
# Unscaled grads are randn / 64: a global norm near 0.11, so clipping at 0.05 is active.
OPTIMIZERS = {
    "adam": lambda: fp16fx.adam(1e-2, weight_decay=1e-3),
    "sgd_clip": lambda: fp16fx.chain(
        fp16fx.clip_by_global_norm(0.05), fp16fx.sgd(0.1, momentum=0.9, nesterov=True)
    ),
    # Two param groups (leaves a, c: Adam; b, d: SGD): buckets per (dtype, group).
    "groups": lambda: fp16fx.multi_transform(
        [fp16fx.adam(1e-2), fp16fx.sgd(0.1, momentum=0.9)], labels=[0, 1, 0, 1]
    ),
}


def make_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(shape, generator=g).to(dtype) for k, (shape, dtype) in SHAPES.items()}


def local_grads(step: int, rank: int | None, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """Returns a rank's grads of the scaled loss; ``rank=None``: the same on every rank."""
    g = torch.Generator().manual_seed(100 * step + (0 if rank is None else rank + 1))
    return {
        k: (torch.randn(shape, generator=g) * scale / 64).to(dtype)
        for k, (shape, dtype) in SHAPES.items()
    }


def eager(state, grads):
    return StepFunction(inplace=True, compile_options=None)(state, grads)


def sharded_vs_replicated(rank: int, world: int, name: str) -> dict[str, Any]:
    """Both see the same local grads (different per rank; an inf on rank 1 at INF_AT)."""
    sharded = fdist.init(make_params(), OPTIMIZERS[name](), shard=True)
    replicated = fdist.init(make_params(), OPTIMIZERS[name](), buckets=True)
    finite = []
    for i in range(STEPS):
        grads = local_grads(i, rank, sharded.shard.loss_scale.scale)
        if i == INF_AT and rank == 1:
            grads["b"][2] = float("inf")
        averaged = {}
        for k, g in grads.items():
            averaged[k] = g / world
            dist.all_reduce(averaged[k])
        _, info = fdist.sharded_step(sharded, grads)
        _, ref_info = eager(replicated, averaged)
        finite.append((bool(info["finite"]), bool(ref_info["finite"])))
        assert torch.equal(sharded.shard.loss_scale.scale, replicated.loss_scale.scale)
    return {
        "sharded": {k: v.clone() for k, v in sharded.params.items()},
        "replicated": {k: v.clone() for k, v in replicated.params.items()},
        "finite": finite,
    }


def train_common(state: Any, start: int, stop: int, step: Any) -> None:
    """Steps with the same grads on every rank: their average is exact for any d = 2**k."""
    for i in range(start, stop):
        scale = (state.shard if isinstance(state, fdist.ShardedState) else state).loss_scale.scale
        step(state, local_grads(i, None, scale))


def checkpoint_run(rank: int, world: int, out: Path) -> dict[str, Any]:
    """d=2 saves at SAVE_AT and runs on; d=4 loads the d=2 files and runs on."""
    state = fdist.init(make_params(), OPTIMIZERS["adam"](), shard=True)
    if world == 2:
        train_common(state, 0, SAVE_AT, fdist.sharded_step)
        torch.save(fdist.state_dict(state), out / f"ckpt_rank{rank}.pt")
    else:
        saved = [torch.load(out / f"ckpt_rank{r}.pt", weights_only=True) for r in range(2)]
        fdist.load_state_dict(state, saved)
    train_common(state, SAVE_AT, STEPS, fdist.sharded_step)
    return {k: v.clone() for k, v in state.params.items()}


def compiled_vs_eager(rank: int, world: int) -> dict[str, Any]:
    """The shard's step compiled (the consensus all-reduce traced into it) vs eager."""
    runs = {}
    for how, step in (("eager", eager), ("compiled", fp16fx.compile_step(inplace=True))):
        state = fdist.init(make_params(), OPTIMIZERS["adam"](), shard=True)
        for i in range(4):
            grads = local_grads(i, rank, state.shard.loss_scale.scale)
            if i == 2 and rank == 0:
                grads["a"][0, 0] = float("nan")
            fdist.sharded_step(state, grads, step=step)
        runs[how] = {k: v.clone() for k, v in state.params.items()}
        runs[how + "_count"] = int(state.shard.count)
    return runs


def scatter_routes(rank: int, world: int) -> dict[str, Any]:
    """The grads reduced by reduce-scatter (NCCL's route) and by all-reduce (gloo's)."""
    runs: dict[str, Any] = {}
    for route in ("reduce_scatter", "all_reduce"):
        state = fdist.init(make_params(), OPTIMIZERS["adam"](), shard=True)
        runs["gloo_default"] = state.sharding.scatter_by_all_reduce
        state.sharding.scatter_by_all_reduce = route == "all_reduce"
        for i in range(4):
            grads = local_grads(i, rank, state.shard.loss_scale.scale)
            fdist.sharded_step(state, grads)
        runs[route] = {k: v.clone() for k, v in state.params.items()}
    return runs


def missing_grad(rank: int, world: int) -> dict[str, Any]:
    """A None grad is refused before any collective; the next step works on every rank."""
    state = fdist.init(make_params(), OPTIMIZERS["adam"](), shard=True)
    grads = local_grads(0, None, state.shard.loss_scale.scale)
    message = "no error"
    try:
        fdist.sharded_step(state, {**grads, "b": None})
    except ValueError as err:
        message = str(err)
    fdist.sharded_step(state, grads)
    return {"message": message, "count": int(state.shard.count)}


def memory(rank: int, world: int) -> dict[str, int]:
    """Persistent bytes of a sharded Adam state with its grad buffers, on this rank."""
    params = {"w": torch.zeros(1 << 20, dtype=torch.float16)}
    state = fdist.init(params, fp16fx.adam(1e-3), shard=True)
    grads = fdist.grad_buffers(state)
    return {"bytes": fdist.persistent_bytes(state, grads), "params": 1 << 20}


COMPACT = {"master": "compensated", "moments": "int8"}
#: 1,500 FP16 values: int8 pads the bucket to whole blocks per rank (1,536 at d=2, 2,048 at
#: d=4), so that the values span several ranks' slices; and 21 FP32 ones (their own masters).
COMPACT_SHAPES = {"a": ((40, 30), torch.float16), "b": ((300,), torch.float16)}
COMPACT_SHAPES["c"] = ((7, 3), torch.float32)


def compact_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g).to(d) for k, (s, d) in COMPACT_SHAPES.items()}


def compact_grads(step: int, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same grads of the scaled loss on every rank (their average is exact)."""
    g = torch.Generator().manual_seed(100 * step)
    return {
        k: (torch.randn(s, generator=g) * scale / 64).to(d) for k, (s, d) in COMPACT_SHAPES.items()
    }


def decoded(state: Any) -> dict[str, list[torch.Tensor]]:
    """Returns a state's masters and per-element moments decoded to FP32, per segment."""
    moments = named_segments(decode_moments(state.opt_state, state.precision))
    found = {name: [x.clone() for x in seg] for name, seg in moments if seg[0].ndim == 1}
    return {"masters": [m.clone() for m in state.decoded_masters()], **found}


def compact_run(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Compensated masters and int8 moments, sharded beside replicated, on common grads
    (their average is exact); at SAVE_AT every rank saves its dict, and the d=2 run resumes
    a second state from those dicts; d=4 loads the d=2 files and runs on."""
    sharded = fdist.init(compact_params(), OPTIMIZERS["adam"](), shard=True, **COMPACT)
    replicated = fdist.init(compact_params(), OPTIMIZERS["adam"](), buckets=True, **COMPACT)
    found: dict[str, Any] = {
        "slices_whole_blocks": all((b.padded // world) % 256 == 0 for b in sharded.buckets)
    }
    if world == 2:
        for i in range(SAVE_AT):
            fdist.sharded_step(sharded, compact_grads(i, sharded.shard.loss_scale.scale))
            eager(replicated, compact_grads(i, replicated.loss_scale.scale))
        saved = fdist.state_dict(sharded)
        torch.save(saved, out / f"compact_rank{rank}.pt")
        dist.barrier()  # every rank's file is written
        found["decoded_at_save"] = decoded(sharded.shard)
        resumed = fdist.init(compact_params(), OPTIMIZERS["adam"](), shard=True, **COMPACT)
        files = [torch.load(out / f"compact_rank{r}.pt", weights_only=True) for r in range(world)]
        fdist.load_state_dict(resumed, files)
        found["resumed_as_saved"] = same_tensors(fdist.state_dict(resumed), saved)
        for i in range(SAVE_AT, STEPS):
            fdist.sharded_step(resumed, compact_grads(i, resumed.shard.loss_scale.scale))
        found["resumed"] = {k: v.clone() for k, v in resumed.params.items()}
    else:
        saved = [torch.load(out / f"compact_rank{r}.pt", weights_only=True) for r in range(2)]
        fdist.load_state_dict(sharded, saved)
        for i in range(SAVE_AT):
            eager(replicated, compact_grads(i, replicated.loss_scale.scale))
    for i in range(SAVE_AT, STEPS):
        fdist.sharded_step(sharded, compact_grads(i, sharded.shard.loss_scale.scale))
        eager(replicated, compact_grads(i, replicated.loss_scale.scale))
    found["sharded"] = {k: v.clone() for k, v in sharded.params.items()}
    found["replicated"] = {k: v.clone() for k, v in replicated.params.items()}
    params = {"w": torch.zeros(1 << 20, dtype=torch.float16)}
    state = fdist.init(params, fp16fx.adam(1e-3), shard=True, **COMPACT)
    found["bytes"] = fdist.persistent_bytes(state, fdist.grad_buffers(state))
    load_converted(rank, world, out)
    found["refused"] = refused_load(rank)
    return found


def converting_sources() -> dict[str, Any]:
    """Returns the unsharded checkpoints a sharded compact state cannot copy as stored: a
    compact one whose int8 blocks restart inside a bucket ("a" and "b" each missed a gradient
    once, so their step counts are equal again, and only the blocks show the cut between
    them); one with FP32 masters and moments; and a compact one spliced from two runs ("b"'s
    entry from a run on other grads, whose scale of the block "a" and "b" share is another)."""
    optimizer = fp16fx.adam(1e-2)
    spliced = []
    for first_step in (0, 10):
        state = fp16fx.init(compact_params(), optimizer, buckets=True, **COMPACT)
        for step in range(first_step, first_step + 3):
            state, _ = fp16fx.step(state, compact_grads(step, state.loss_scale.scale))
        spliced.append(fp16fx.checkpoint.state_dict_copy(state))
    spliced[0]["params"]["b"] = spliced[1]["params"]["b"]
    sources = {
        "restarted": fp16fx.init(compact_params(), optimizer, buckets=True, **COMPACT),
        "fp32": fp16fx.init(compact_params(), optimizer, buckets=True),
    }
    for missing in ("a", "b", None):
        for name, state in sources.items():
            grads = compact_grads(0, state.loss_scale.scale)
            grads = {k: None if k == missing else g for k, g in grads.items()}
            sources[name], _ = fp16fx.step(state, grads)
    # Two FP32 masters in the last half unit below the midpoint above their params, one in
    # each rank's half: into compensated precision, their params move one ulp up.
    with torch.no_grad():
        for param, master in ((sources["fp32"].params[k], sources["fp32"].master[k]) for k in "ab"):
            p = param.view(-1)[0].float()
            unit = 2.0 ** (torch.frexp(p).exponent - 11) / 256  # ulp / 256
            master.view(-1)[0] = p + 127.75 * unit
    return {
        **{name: fp16fx.state_dict(state) for name, state in sources.items()},
        "spliced": spliced[0],
    }


def load_converted(rank: int, world: int, out: Path) -> None:
    """Loads each of :func:`converting_sources`' checkpoints into a sharded compact state and
    saves this rank's dict of it."""
    for name, source in converting_sources().items():
        sharded = fdist.init(compact_params(), fp16fx.adam(1e-2), shard=True, **COMPACT)
        fdist.load_state_dict(sharded, source)
        torch.save(fdist.state_dict(sharded), out / f"converted_{name}_{world}_{rank}.pt")
        whole = [b.clone() for b in sharded.flat.param_buffers]
        torch.save(whole, out / f"whole_params_{name}_{world}_{rank}.pt")


def dtype_changed() -> dict[str, bool]:
    """A checkpoint saved over params of other dtypes ("a" FP32 then, FP16 now; "b" FP16
    then, BF16 now) loads into a sharded state as into an unsharded one (it was refused: a
    saved FP32 param has no master): per precision, whether the consolidated dict equals the
    unsharded state's after the same load, bitwise."""

    def params(dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
        return {k: v.to(dtypes.get(k, v.dtype)) for k, v in compact_params().items()}

    before, after = {"a": torch.float32}, {"a": torch.float16, "b": torch.bfloat16}
    source = fp16fx.init(params(before), fp16fx.adam(1e-2), buckets=True)
    for step in range(2):
        grads = {
            k: g.to(p.dtype)
            for (k, g), p in zip(
                compact_grads(step, source.loss_scale.scale).items(), source.params.values()
            )
        }
        source, _ = fp16fx.step(source, grads)
    saved = fp16fx.state_dict(source)
    found = {}
    for name, precision in (("fp32", {}), ("compact", COMPACT)):
        sharded = fdist.init(params(after), fp16fx.adam(1e-2), shard=True, **precision)
        fdist.load_state_dict(sharded, saved)
        unsharded = fp16fx.init(params(after), fp16fx.adam(1e-2), buckets=True, **precision)
        unsharded = fp16fx.load_state_dict(unsharded, saved)
        ours = fdist.consolidate(all_dicts(sharded))["params"]
        found[name] = same_tensors(ours, fp16fx.state_dict(unsharded)["params"])
    return found


def refused_load(rank: int) -> dict[str, Any]:
    """Loads an FP32 checkpoint whose second moment went negative, and a compact one (as the
    state stores it) whose block scales are zero, into a sharded compact state: the errors'
    messages, and whether the state is as it was. Last, the negative moment on rank 1 alone,
    the others given the sound dict (a rank handed a damaged copy): no rank may load; so too
    where rank 1's copy of the state's own dict holds an int8 offset no block starts at, which
    only decoding it finds (found once after the ranks agreed: rank 0 loaded)."""
    sources = converting_sources()
    sd = copy.deepcopy(sources["fp32"])
    sd["params"]["a"]["opt[1].nu"] = -1 - sd["params"]["a"]["opt[1].nu"]
    zero_scales = copy.deepcopy(sources["restarted"])
    scales = zero_scales["params"]["a"]["opt[1].mu.scales"]
    zero_scales["params"]["a"]["opt[1].mu.scales"] = torch.zeros_like(scales)
    past_fp16 = copy.deepcopy(sources["restarted"])  # a pair whose master rounds to -inf
    past_fp16["params"]["a"]["param"].view(-1)[0] = -65504.0
    past_fp16["params"]["a"]["correction"].view(-1)[0] = -128
    sharded = fdist.init(compact_params(), fp16fx.adam(1e-2), shard=True, **COMPACT)
    before = optree.tree_map(  # copies, not views of the state
        lambda x: x.clone() if isinstance(x, torch.Tensor) else x, fdist.state_dict(sharded)
    )
    messages = []
    sound = sources["fp32"]
    alone = sd if rank == 1 else sound
    offset = fdist.consolidate(all_dicts(sharded))
    if rank == 1:
        offset["params"]["a"]["opt[1].mu.offset"] = torch.tensor(300)
    stale = copy.deepcopy(sound)  # rank 1's copy saved a step later: sound, but another one
    if rank == 1:
        stale["count"] += 1
    givens = (sd, zero_scales, past_fp16, fdist.state_dict(sharded), alone, offset, stale)
    for given in givens:
        try:
            fdist.load_state_dict(sharded, given)
            messages.append("loaded")
        except saved_format.StateDictError as err:
            messages.append(str(err))
    with loading_together(dist.group.WORLD):  # a load agreed on, then another in its block
        checks_passed()
        try:
            fdist.load_state_dict(sharded, alone)
            messages.append("loaded")
        except saved_format.StateDictError as err:
            messages.append(str(err))
    try:  # an init inside a load that has not agreed yet, rank 1 refusing the load before it
        with loading_together(dist.group.WORLD):
            if rank == 1:
                raise saved_format.StateDictError("refused before an init")
            fdist.init({"w": torch.ones(4, dtype=torch.float16)}, fp16fx.sgd(0.1))
        messages.append("loaded")
    except (saved_format.StateDictError, RuntimeError) as err:
        messages.append(str(err))
    unchanged = same_tensors(fdist.state_dict(sharded), before)
    return {
        "message": messages[0],
        "zero_scales": messages[1],
        "past_fp16": messages[2],
        "one_rank": messages[3],
        "damaged_copy": messages[4],
        "damaged_offset": messages[5],
        "stale_copy": messages[6],
        "after_an_agreed_load": messages[7],
        "init_in_a_load": messages[8],
        "unchanged": unchanged,
    }


def scalar_params(rank: int, world: int) -> dict[str, Any]:
    """A 0-d param first in its bucket (``s``), in compact precision: an FP32 checkpoint
    loaded into the sharded state and into an unsharded one; the sharded state's own dict
    loaded back; a dict holding a meta tensor in its last param refused."""

    def params() -> dict[str, torch.Tensor]:
        return {"s": torch.tensor(0.5, dtype=torch.float16), "v": torch.linspace(-1, 1, 6).half()}

    def grads(scale: torch.Tensor) -> dict[str, torch.Tensor]:
        g = {"s": torch.tensor(0.25), "v": torch.linspace(0.5, -0.5, 6)}
        return {k: (v * scale / 64).half() for k, v in g.items()}

    source = fp16fx.init(params(), fp16fx.adam(1e-2), buckets=True)
    for _ in range(2):
        source, _ = fp16fx.step(source, grads(source.loss_scale.scale))
    sharded = fdist.init(params(), fp16fx.adam(1e-2), shard=True, **COMPACT)
    fdist.load_state_dict(sharded, fp16fx.state_dict(source))
    unsharded = fp16fx.init(params(), fp16fx.adam(1e-2), buckets=True, **COMPACT)
    fp16fx.load_state_dict(unsharded, fp16fx.state_dict(source))
    converted = fdist.consolidate(all_dicts(sharded))
    fdist.sharded_step(sharded, grads(sharded.shard.loss_scale.scale))
    own = all_dicts(sharded)
    fresh = fdist.init(params(), fp16fx.adam(1e-2), shard=True, **COMPACT)
    fdist.load_state_dict(fresh, own)  # refused once: int8 codes of s taken for step counts
    reloaded = same_tensors(all_dicts(fresh), own)
    meta = fdist.consolidate(own)
    meta["params"]["v"]["param"] = meta["params"]["v"]["param"].to("meta")
    before = all_dicts(fresh)  # copies (pickled), not views of the state
    try:
        fdist.load_state_dict(fresh, meta)
        refused = "loaded"
    except saved_format.StateDictError as err:
        refused = str(err)
    return {
        "converted": same_tensors(converted["params"], fp16fx.state_dict(unsharded)["params"]),
        "reloaded": reloaded,
        "refused": refused,
        "unchanged": same_tensors(all_dicts(fresh), before),
    }


def refused_init(rank: int, world: int) -> list[tuple[str, bool]]:
    """Sharded inits refused for their arguments: each error, and whether the params stayed
    where and as they were (they once moved into flat buffers and took rank 0's values)."""
    outcomes = []
    for optimizer, dtype, options, size in [
        (fp16fx.adam(), torch.float16, {"loss_scale": fp16fx.DynamicLossScale}, 4),  # the class
        (fp16fx.adam(), torch.float32, {"master": "compensated"}, 4),
        ("adam", torch.float16, {}, 4),
        (fp16fx.adam(), torch.float16, {}, 4 - rank),  # a model of another shape per rank
    ]:
        params = {"w": torch.full((size,), float(rank + 1), dtype=dtype)}
        before, storage = params["w"].clone(), params["w"].data_ptr()
        try:
            fdist.init(params, optimizer, shard=True, **options)
            error = "accepted"
        except (TypeError, ValueError) as err:
            error = str(err)
        kept = torch.equal(params["w"], before) and params["w"].data_ptr() == storage
        outcomes.append((error, kept))
    # Refused by rank 1's own check alone (one tensor twice): the others once waited for it
    # in the broadcast.
    w = torch.ones(4, dtype=torch.float16)
    params = {"v": w if rank == 1 else torch.ones(4, dtype=torch.float16), "w": w}
    try:
        fdist.init(params, fp16fx.adam(), shard=True)
        outcomes.append(("accepted", True))
    except (TypeError, ValueError) as err:
        outcomes.append((str(err), True))
    return outcomes


def refused_names_and_dtensors(rank: int, world: int) -> dict[str, list[str]]:
    """fdist.init, sharded and not: an unknown ``moments=`` on rank 1 alone (once refused
    there before the gather, the others waiting for it), and an FSDP2 model's DTensor params
    (once torch's NotImplementedError from the broadcast, unsharded)."""
    found: dict[str, list[Any]] = {"alone": [], "kept": [], "dtensor": []}
    mesh = init_device_mesh("cpu", (world,))
    for shard in (True, False):
        params = {"w": torch.full((4,), float(rank + 1), dtype=torch.float16)}
        before, storage = params["w"].clone(), params["w"].data_ptr()
        try:
            fdist.init(params, fp16fx.adam(), shard=shard, moments="int4" if rank == 1 else "int8")
            found["alone"].append("accepted")
        except ValueError as err:
            found["alone"].append(str(err))
        found["kept"].append(torch.equal(params["w"], before) and params["w"].data_ptr() == storage)
        fsdp = {"w": distribute_tensor(torch.ones(4, 2, dtype=torch.float16), mesh, [Shard(0)])}
        try:
            fdist.init(fsdp, fp16fx.adam(), shard=shard)
            found["dtensor"].append("accepted")
        except TypeError as err:
            found["dtensor"].append(str(err))
    return found


#: fdist.init arguments rank 1 alone sets otherwise, each valid, and how the ranks name it.
APART = {
    "hyperparameter": ({"optimizer": fp16fx.adam(1e-2)}, "opt[2]['lr'] 0.01, its first rank 0.001"),
    "moments": ({"moments": "int8"}, "has moments 'int8', its first rank 'fp32'"),
    "master": ({"master": "compensated"}, "has master 'compensated', its first rank 'fp32'"),
    "optimizer": ({"optimizer": fp16fx.sgd(1e-3)}, "has the optimizer's state entries opt"),
    "policy": ({"loss_scale": fp16fx.DynamicLossScale(init_scale=2.0**10)}, "loss-scale policy"),
    # A flag of the update alone, in no state entry: once unseen, and each rank (or each
    # rank's shard) stepped by its own rule.
    "nesterov": (
        {"base": fp16fx.sgd(1e-3, momentum=0.9), "optimizer": fp16fx.sgd(1e-3, 0.9, nesterov=True)},
        "the update's result on a stand-in (it shows flags no state entry keeps, such as SGD's "
        "nesterov): a value",
    ),
}


def settings_apart(rank: int) -> dict[tuple[str, bool], tuple[str, bool]]:
    """fdist.init, sharded and not, where rank 1 alone builds its state otherwise (ranks once
    stepped by their own settings, or padded their buffers apart): each error, and whether
    the params stayed where and as they were."""
    found = {}
    for shard in (True, False):
        for case, (options, _) in APART.items():
            options = dict(options)
            mine = {"optimizer": options.pop("base", fp16fx.adam(1e-3))}
            mine.update(options if rank == 1 else {})
            params = {"w": torch.full((4,), float(rank + 1), dtype=torch.float16)}
            before, storage = params["w"].clone(), params["w"].data_ptr()
            try:
                fdist.init(params, mine.pop("optimizer"), shard=shard, **mine)
                error = "accepted"
            except ValueError as err:
                error = str(err)
            kept = torch.equal(params["w"], before) and params["w"].data_ptr() == storage
            found[case, shard] = (error, kept)
    return found


class PlainPolicy:
    """A loss-scale policy that is no dataclass (the protocol asks for init and adjust)."""

    def init(self, *args: Any, **kwargs: Any) -> Any:
        return fp16fx.DynamicLossScale().init(*args, **kwargs)

    def adjust(self, *args: Any, **kwargs: Any) -> Any:
        return fp16fx.DynamicLossScale().adjust(*args, **kwargs)


def noisy_sgd() -> GradientTransformation:
    """SGD plus noise drawn from torch's global generator."""
    sgd = fp16fx.sgd(0.1)

    def update(updates: Any, state: Any, params: Any) -> tuple[Any, Any]:
        updates, state = sgd.update(updates, state, params)
        return optree.tree_map(lambda u: u + 1e-3 * torch.randn_like(u), updates), state

    return GradientTransformation(sgd.init, update)


def alike_but_unusual(rank: int) -> list[str]:
    """fdist.init, sharded and not, with arguments alike on every rank that the comparison
    once refused: a policy that is no dataclass, labels that are a plain function, and a
    transform drawing noise on ranks seeded apart (the comparison's stand-in steps once drew
    it, and left the generator moved). Each: the outcome, and whether the generator moved."""
    grouped = fp16fx.multi_transform([fp16fx.adam(1e-3), fp16fx.sgd(0.1)], {"w": 0, "v": 1})
    plain = GradientTransformation(grouped.init, grouped.update, grouped.param_labels.__call__)
    found = []
    for shard in (True, False):
        for optimizer, options in (
            (fp16fx.adam(), {"loss_scale": PlainPolicy()}),
            (plain, {}),
            (noisy_sgd(), {}),
        ):
            params = {"w": torch.ones(300, dtype=torch.float16), "v": torch.ones(5).half()}
            torch.manual_seed(rank)
            generator = torch.get_rng_state()
            try:
                fdist.init(params, optimizer, shard=shard, **options)
                found.append("accepted")
            except (TypeError, ValueError) as err:
                found.append(str(err))
            found[-1] += "" if torch.equal(torch.get_rng_state(), generator) else ", moved"
    return found


def all_dicts(state: Any) -> list[dict[str, Any]]:
    """Every rank's ``fdist.state_dict`` of ``state`` (a collective), copied."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, fdist.state_dict(state))
    return gathered


def same_tensors(a: Any, b: Any) -> bool:
    """Whether two state dicts hold bitwise equal tensors and equal other entries
    (``bitwise_equal`` of tests/test_step, which compares tensors only)."""
    xs, ys = optree.tree_leaves(a), optree.tree_leaves(b)
    pairs = zip(xs, ys)
    return len(xs) == len(ys) and all(
        same_bits(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in pairs
    )


def pre_compact_format() -> dict[str, bool]:
    """A checkpoint saved before compact precision (no "precision" in any dict) loads into a
    sharded state, as the rank dicts and consolidated, as it loads unsharded (the sharded
    loader once refused it as lacking ['precision']): per form, whether the loaded state's
    consolidated params equal the unsharded state's, bitwise."""
    source = fdist.init(compact_params(), fp16fx.adam(1e-2), shard=True)
    fdist.sharded_step(source, compact_grads(0, source.shard.loss_scale.scale))
    shards = all_dicts(source)
    for shard in shards:
        del shard["shard"]["precision"]
    one = fdist.consolidate(shards)
    unsharded = fp16fx.init(compact_params(), fp16fx.adam(1e-2), buckets=True)
    expected = fp16fx.state_dict(fp16fx.load_state_dict(unsharded, one))["params"]
    found = {}
    for name, saved in (("rank dicts", shards), ("consolidated", one)):
        sharded = fdist.init(compact_params(), fp16fx.adam(1e-2), shard=True)
        fdist.load_state_dict(sharded, saved)
        found[name] = same_tensors(fdist.consolidate(all_dicts(sharded))["params"], expected)
    return found


def worker(rank: int, world: int, out: str) -> None:
    out = Path(out)
    found: dict[str, Any] = {name: sharded_vs_replicated(rank, world, name) for name in OPTIMIZERS}
    found["checkpoint"] = checkpoint_run(rank, world, out)
    found["missing_grad"] = missing_grad(rank, world)
    found["routes"] = scatter_routes(rank, world)
    if world == 2:
        found["compiled"] = compiled_vs_eager(rank, world)
    found["memory"] = memory(rank, world)
    found["compact"] = compact_run(rank, world, out)
    found["scalar"] = scalar_params(rank, world)
    found["refused_init"] = refused_init(rank, world)
    found["refused_names_and_dtensors"] = refused_names_and_dtensors(rank, world)
    found["settings_apart"] = settings_apart(rank)
    found["alike_but_unusual"] = alike_but_unusual(rank)
    found["dtype_changed"] = dtype_changed()
    found["pre_compact"] = pre_compact_format()
    torch.save(found, out / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[Any, Any]:
    """The d=2 run (it writes the checkpoint the d=4 run loads); d=4 is added on demand, so
    that no single test pays for both spawns (each takes ~10-35 s on two cores)."""
    out = tmp_path_factory.mktemp("sharded")
    spawn(worker, 2, str(out))
    return {2: results(out, 2), "dir": out}


@pytest.fixture(scope="module")
def runs_4(runs) -> dict[Any, Any]:
    spawn(worker, 4, str(runs["dir"]))
    runs[4] = results(runs["dir"], 4)
    return runs


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sharded_equals_replicated(request, world, name):
    runs = request.getfixturevalue("runs" if world == 2 else "runs_4")
    for r in runs[world]:
        got = r[name]
        assert got["finite"] == [(i != INF_AT, i != INF_AT) for i in range(STEPS)]
        # Adam at d=2: a sum of two FP16 grads is the same in any order: bitwise equal runs.
        # d=4: gloo's reduce-scatter and all-reduce add four FP16 grads in different orders
        # (one FP16 rounding apart). Clipping: the sharded global norm is the root of the
        # ranks' summed float64 squares, the replicated one an FP32 norm (rounding apart).
        exact = world == 2 and name != "sgd_clip"
        tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 2e-3, "atol": 1e-3}
        for k in SHAPES:
            torch.testing.assert_close(got["sharded"][k], got["replicated"][k], **tol)
        for k in SHAPES:  # every rank holds the same params
            assert torch.equal(got["sharded"][k], runs[world][0][name]["sharded"][k])


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_all_reduces_the_grads_and_matches_reduce_scatter(request, world):
    runs = request.getfixturevalue("runs" if world == 2 else "runs_4")
    for r in runs[world]:
        got = r["routes"]
        assert got["gloo_default"]  # gloo's reduce-scatter is the slower route
        # Two FP16 grads add the same either way; four in a route's own order.
        tol = {"rtol": 0, "atol": 0} if world == 2 else {"rtol": 2e-3, "atol": 1e-3}
        for k in SHAPES:
            torch.testing.assert_close(got["all_reduce"][k], got["reduce_scatter"][k], **tol)
            assert torch.equal(got["all_reduce"][k], runs[world][0]["routes"]["all_reduce"][k])


def test_compiled_shard_step_matches_eager(runs):
    for r in runs[2]:
        got = r["compiled"]
        assert got["eager_count"] == got["compiled_count"] == 3  # the NaN step was skipped
        for k in SHAPES:
            assert_nearly_bitwise(got["compiled"][k], got["eager"][k])


def uninterrupted() -> dict[str, torch.Tensor]:
    state = fp16fx.init(make_params(), OPTIMIZERS["adam"](), buckets=True)
    for i in range(STEPS):
        state, _ = eager(state, local_grads(i, None, state.loss_scale.scale))
    return state.params


def test_checkpoint_saved_at_2_loads_at_4_and_1(runs_4):
    runs = runs_4
    expected = uninterrupted()
    for world in (2, 4):
        for r in runs[world]:
            for k in SHAPES:
                assert torch.equal(r["checkpoint"][k], expected[k]), (world, k)
    # d=1, and the unsharded state: load the d=2 files into fp16fx.init(..., buckets=True).
    saved = [torch.load(runs["dir"] / f"ckpt_rank{r}.pt", weights_only=True) for r in range(2)]
    state = fp16fx.init(make_params(), OPTIMIZERS["adam"](), buckets=True)
    state = fp16fx.load_state_dict(state, fdist.consolidate(saved))
    assert int(state.count) == SAVE_AT
    for i in range(SAVE_AT, STEPS):
        state, _ = eager(state, local_grads(i, None, state.loss_scale.scale))
    for k in SHAPES:
        assert torch.equal(state.params[k], expected[k]), k


def test_a_checkpoint_missing_a_rank_is_refused(runs):
    saved = torch.load(runs["dir"] / "ckpt_rank0.pt", weights_only=True)
    state = fp16fx.init(make_params(), OPTIMIZERS["adam"](), buckets=True)
    before = [t.clone() for t in state.master_segments]
    with pytest.raises(ValueError, match="needs all their dicts"):
        fp16fx.load_state_dict(state, fdist.consolidate([saved]))
    assert all(torch.equal(a, b) for a, b in zip(before, state.master_segments))
    # A damaged rank dict (a key missing) once raised a bare KeyError.
    both = [torch.load(runs["dir"] / f"ckpt_rank{r}.pt", weights_only=True) for r in (0, 1)]
    for key in ("rank", "world_size", "buckets"):
        damaged = [{k: v for k, v in d.items() if k != key} for d in both]
        with pytest.raises(ValueError, match=f"a damaged sharded checkpoint: KeyError\\('{key}'"):
            fdist.consolidate(damaged)
        damaged = [both[0], {k: v for k, v in both[1].items() if k != key}]  # rank 1's alone
        with pytest.raises(ValueError, match=f"a damaged sharded checkpoint: KeyError\\('{key}'"):
            fdist.consolidate(damaged)


def test_rank_dicts_of_different_steps_are_refused(runs):
    """Rank files of two checkpoints (one rank's saved later) were joined silently, rank 0's
    count and scalars winning over slices from another step."""
    for change, where in (
        (lambda shard: shard.update(count=shard["count"] + 3), r"\['count'\] = 13, rank 0's 10"),
        (lambda shard: shard["loss_scale"]["scale"].mul_(2), r"\['loss_scale'\]\['scale'\]"),
    ):
        saved = [torch.load(runs["dir"] / f"ckpt_rank{r}.pt", weights_only=True) for r in (0, 1)]
        change(saved[1]["shard"])
        with pytest.raises(ValueError, match=f"rank 1's dict has {where}.*different steps"):
            fdist.consolidate(saved)


def _mu_in_bf16(shard: dict) -> None:
    shard["params"]["0"]["opt[1].mu"] = shard["params"]["0"]["opt[1].mu"].bfloat16()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda shard: shard["precision"].update(moments="bf16"), r"has precision \{.*'bf16'"),
        (lambda shard: shard["policy"].update(growth_interval=7), r"has policy \{.*'growth_in"),
        (_mu_in_bf16, r"has bucket 0's 'opt\[1\].mu' in torch.bfloat16, rank 0's in torch.float32"),
        (lambda shard: shard["params"]["0"].update(master=None), "damaged.*: AttributeError"),
    ],
    ids=["precision", "policy", "dtype", "not-a-tensor"],
)
def test_rank_dicts_of_different_runs_or_damaged_are_refused_by_name(runs, change, message):
    """Rank dicts of runs in other precisions or under other loss-scale policies were joined
    silently (rank 0's won), a slice of another dtype promoted by torch.cat, and a slice that
    is no tensor escaped as a bare AttributeError."""
    saved = [torch.load(runs["dir"] / f"ckpt_rank{r}.pt", weights_only=True) for r in (0, 1)]
    change(saved[1]["shard"])
    with pytest.raises(saved_format.StateDictError, match=message):
        fdist.consolidate(saved)


def test_a_missing_grad_is_refused_before_any_collective(runs):
    for r in runs[2]:
        assert "params['b'] has none" in r["missing_grad"]["message"]
        assert r["missing_grad"]["count"] == 1


def test_persistent_memory_is_4_plus_12_over_d_bytes_per_param(runs_4):
    runs = runs_4
    for world in (2, 4):
        for r in runs[world]:
            per_param = r["memory"]["bytes"] / r["memory"]["params"]
            assert per_param == pytest.approx(4 + 12 / world, abs=1e-3)


@pytest.mark.parametrize("world", [2, 4])
def test_compact_sharded_equals_compact_replicated(request, world):
    """Compensated masters and int8 moments, sharded: every rank ends with the same params,
    bitwise those of a replicated run (the slices' blocks are the buckets' and each value's
    dither hashes its place in the whole bucket), after d=4 resumed from d=2's checkpoint;
    d=2 resumed from its own dicts steps bitwise like the run it was saved from."""
    found = request.getfixturevalue("runs_4" if world == 4 else "runs")[world]
    assert all(r["compact"]["slices_whole_blocks"] for r in found)
    first = found[0]["compact"]
    for r in found:
        for k in COMPACT_SHAPES:
            assert torch.equal(r["compact"]["sharded"][k], first["sharded"][k])
            if world == 2:
                assert r["compact"]["resumed_as_saved"]
                assert torch.equal(r["compact"]["resumed"][k], r["compact"]["sharded"][k])
    for k in COMPACT_SHAPES:
        assert torch.equal(first["sharded"][k], first["replicated"][k]), k


def test_compact_sharded_checkpoint_consolidates_into_an_unsharded_state(runs):
    """The ranks' int8 blocks are the bucket's own: the consolidated dict loads into an
    unsharded compact state whose masters and moments decode to the sharded ones, bitwise."""
    saved = [torch.load(runs["dir"] / f"compact_rank{r}.pt", weights_only=True) for r in (0, 1)]
    state = fp16fx.init(compact_params(), OPTIMIZERS["adam"](), buckets=True, **COMPACT)
    state = fp16fx.load_state_dict(state, fdist.consolidate(saved))
    ranks = [r["compact"]["decoded_at_save"] for r in runs[2]]
    for name, segments in decoded(state).items():
        for k, value in enumerate(segments):
            joined = torch.cat([rank[name][k] for rank in ranks])
            assert torch.equal(value, joined[: value.numel()]), (name, k)


@pytest.mark.parametrize("world", [2, 4])
def test_compact_sharded_memory_is_4_plus_3_over_d_bytes_per_param(request, world):
    """FP16 param and grad whole (4 B), a 1-byte correction and two 1-byte moments (and
    their scales, 8 B per 256 values) for this rank's 1/d."""
    found = request.getfixturevalue("runs_4" if world == 4 else "runs")[world]
    per_param = found[0]["compact"]["bytes"] / (1 << 20)
    assert per_param == pytest.approx(4 + (3 + 8 / 256) / world, abs=1e-3)


def test_a_sharded_state_refuses_a_negative_second_moment_or_one_ranks_dict(runs):
    for found in runs[2]:
        refused = found["compact"]["refused"]
        assert "['a']['opt[1].nu'] holds negative values" in refused["message"]
        zero = "['a']['opt[1].mu.scales'] holds a scale that is not finite"
        assert zero in refused["zero_scales"]
        assert "saved by 2 ranks: pass the list of every rank's dicts" in refused["one_rank"]
        assert "['a']: its master holds values past torch.float16's largest" in refused["past_fp16"]
        assert refused["unchanged"]
    own, told = (found["compact"]["refused"]["damaged_copy"] for found in reversed(runs[2]))
    assert "['a']['opt[1].nu'] holds negative values" in own
    assert told == f"rank 1 refused the dict: {own}"
    nested = [found["compact"]["refused"]["after_an_agreed_load"] for found in runs[2]]
    # Once rank 0's init paired its gather with rank 1's refusal of the load, then waited in a
    # second gather for the load.
    rank_0, rank_1 = (found["compact"]["refused"]["init_in_a_load"] for found in runs[2])
    assert rank_0.startswith("fp16fx cannot agree on an init inside a load"), rank_0
    assert rank_1 == "refused before an init"
    assert nested == [f"rank 1 refused the dict: {own}", own]
    own, told = (found["compact"]["refused"]["damaged_offset"] for found in reversed(runs[2]))
    assert "['a']['opt[1].mu.offset'] is not an int64 in [0, 256)" in own
    assert told == f"rank 1 refused the dict: {own}"
    stale = {found["compact"]["refused"]["stale_copy"] for found in runs[2]}
    assert len(stale) == 1, stale  # every rank refuses, alike
    count = int(converting_sources()["fp32"]["count"])
    assert stale.pop().startswith(
        f"rank 1 was given another checkpoint than rank 0 (['count']: {count + 1} there, "
        f"{count} on rank 0; a copy saved at another step"
    )


def test_a_0d_param_loads_into_a_compact_sharded_state(runs):
    """A 0-d param's saved entries are 0-d too: they were once taken for step counts, spread
    over the bucket's slice (an FP32 checkpoint's), or refused as unequal counts (the state's
    own int8 codes); and a meta tensor was found only after earlier buckets were written."""
    for found in runs[2]:
        scalar = found["scalar"]
        assert scalar["converted"]
        assert scalar["reloaded"]
        assert "['params']['v']['param'] is a meta tensor" in scalar["refused"]
        assert scalar["unchanged"]


def test_a_sharded_init_refuses_bad_arguments_before_moving_the_params(runs):
    for found in runs[2]:
        policy, precision, optimizer, shapes, _ = found["refused_init"]
        assert "loss_scale must be a loss-scale policy" in policy[0] and policy[1]
        assert "these params are all FP32" in precision[0] and precision[1]
        assert "optimizer must be an fp16fx transform" in optimizer[0] and optimizer[1]
        # Refused on every rank (the broadcast once aborted inside gloo, or poured rank 0's
        # values into another shape): DDP refuses such models too.
        assert shapes == (
            "rank 1 of the group has params['w'] as float16[3], its first rank as float16[4]: "
            "every rank must build its state from the same model, optimizer and arguments",
            True,
        )
    (rank_0, _), (rank_1, _) = (found["refused_init"][-1] for found in runs[2])
    assert "same tensor" in rank_1, rank_1
    assert rank_0 == f"rank 1 of the group refused its arguments: {rank_1}"


def test_a_checkpoint_over_params_of_other_dtypes_loads_as_unsharded(runs):
    for found in runs[2]:
        assert found["dtype_changed"] == {"fp32": True, "compact": True}


def test_a_checkpoint_saved_before_compact_precision_loads_into_a_sharded_state(runs):
    for found in runs[2]:
        assert found["pre_compact"] == {"rank dicts": True, "consolidated": True}


def test_fdist_init_refuses_ranks_that_build_their_states_otherwise(runs):
    rank_0, rank_1 = (found["settings_apart"] for found in runs[2])
    for (case, shard), (error, kept) in rank_0.items():
        assert error.startswith("rank 1 of the group has") and APART[case][1] in error, error
        assert rank_1[case, shard] == (error, True) and kept
    for found in runs[2]:
        assert found["alike_but_unusual"] == ["accepted"] * 6


def test_fdist_init_refuses_a_name_on_one_rank_and_dtensors_on_every_rank(runs):
    rank_0, rank_1 = (found["refused_names_and_dtensors"] for found in runs[2])
    for mine, theirs in zip(rank_1["alone"], rank_0["alone"], strict=True):
        assert mine.startswith("moments must be one of")
        assert theirs == f"rank 1 of the group refused its arguments: {mine}"
    assert rank_0["kept"] == rank_1["kept"] == [True, True]  # nothing moved, or broadcast
    for found in (rank_0, rank_1):
        for error in found["dtensor"]:
            assert error.startswith("params['w'] is a DTensor (an FSDP2 model's param)")


@pytest.mark.parametrize("name", ["restarted", "fp32"])
def test_a_converted_load_writes_the_same_whole_params_on_every_rank(runs, name):
    """Each rank encodes only its slice of the masters, but holds the whole params: from an
    FP32 checkpoint, a param whose master's rest rounds to 128 units moves one ulp up, and
    the other ranks' parts kept the saved one until the next step's all-gather."""
    whole = [torch.load(runs["dir"] / f"whole_params_{name}_2_{r}.pt") for r in (0, 1)]
    assert all(torch.equal(a, b) for a, b in zip(*whole))


@pytest.mark.parametrize("name", ["restarted", "fp32", "spliced"])
def test_a_checkpoint_it_cannot_copy_loads_decoded_and_rounded_into_a_compact_shard(runs, name):
    """A compact checkpoint whose int8 blocks restart inside a bucket, or whose leaves save
    one block's scale unlike each other, or an FP32 one, loads into a sharded compact state
    decoded to FP32 and re-encoded: each master to within half a unit of its correction
    (exactly from a compensated one: the same param and correction), each moment to within a
    code of its block (1/127 of the block's largest value), the step counts exactly. (The
    spliced one was copied as stored: one leaf's scale for both, "a"'s moments up to 2% off.)"""
    files = [f"converted_{name}_2_{r}.pt" for r in (0, 1)]
    loaded = fdist.consolidate([torch.load(runs["dir"] / f, weights_only=True) for f in files])
    source = converting_sources()[name]
    for path, entry in source["params"].items():
        ours = saved_format.canonical(loaded["params"][path], 256)
        theirs = saved_format.canonical(entry, 256)
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            if (key == "master" and name != "fp32") or value.ndim == 0:
                assert torch.equal(ours[key], value), (path, key)
            elif key == "master":
                # Half a unit of the param's: ulp / 512, the ulp 2**(e - 11) of the master's
                # binade or, where the param rounded up into the next, twice that.
                unit = torch.ldexp(torch.ones_like(value), torch.frexp(value).exponent - 19)
                assert ((ours[key] - value).abs() <= unit).all(), path
            elif key != "param":
                atol = float(value.abs().max()) / 127
                torch.testing.assert_close(ours[key], value, rtol=0, atol=atol)
