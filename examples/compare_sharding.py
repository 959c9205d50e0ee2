"""Measures DDP + fp16fx, fp16fx's own sharded state (ZeRO-1) and FSDP2 + fp16fx at one world
size: persistent bytes per param per rank and time per training step.

Run once per mode and d::

    torchrun --nproc-per-node 2 examples/compare_sharding.py --mode fsdp2

Modes (every one trains the same MLP with ``FP16_Optimizer(torch.optim.AdamW(...))``):

* ``ddp``: FP16 params (``model.half()``) in DDP; every rank keeps the whole FP32 masters and
  moments (fp16fx's flat buffers).
* ``sharded``: FP16 params, no DDP, ``FP16_Optimizer(..., shard=True)``: each rank keeps 1/d
  of the masters and moments (at d = 1: the unsharded facade).
* ``fsdp2``: FP32 params sharded by ``fully_shard`` (their own masters), FP16 compute; with
  ``--masters compensated``, FP16 params (``model.half()`` before ``fully_shard``).

``--masters compensated --moments int8`` stores the optimizer state compactly
(docs/precision.md): no FP32 copy of the params, 1-byte moments.

Bytes: every distinct tensor storage a rank holds between steps -- the model's params and
grads (local shards under FSDP2) and the optimizer's fp16fx state -- divided by the model's
param count. DDP's own gradient buckets (2 more bytes per FP16 param) and FSDP2's transient
unsharded params are not counted. Time: the median of ``--steps`` forward+backward+step
iterations after 3 warm-up ones, the slowest rank's, and of the ``optimizer.step()`` calls in
them (with ``shard=True`` that includes the reduce-scatter and all-gather; DDP and FSDP2
communicate in backward). ``--mode fsdp2 --check-pass`` also times
the step's check pass through DTensor ops against fp16fx's way, on the local shards.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import fp16fx
import fp16fx.distributed
from fp16fx.precision import MASTERS, MOMENTS


def build(
    mode: str, width: int, depth: int, master: str, moments: str
) -> tuple[nn.Module, fp16fx.FP16_Optimizer]:
    torch.manual_seed(0)
    layers = [nn.Linear(width, width) for _ in range(depth)]
    model = nn.Sequential(*[m for layer in layers for m in (layer, nn.Tanh())])
    if mode == "fsdp2":
        policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
        if master == "compensated":  # FP16 shards, whose masters the corrections carry
            model = model.half()
            policy = MixedPrecisionPolicy(param_dtype=torch.float16)
        for layer in layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        wrapped = model
    else:
        model = model.half()
        wrapped = DDP(model) if mode == "ddp" else model
    shard = mode == "sharded" and dist.get_world_size() > 1
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt = fp16fx.FP16_Optimizer(
        inner, dynamic_loss_scale=True, shard=shard, master=master, moments=moments
    )
    return wrapped, opt


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def persistent_bytes(model: nn.Module, opt: fp16fx.FP16_Optimizer) -> int:
    """The bytes of every distinct storage of the params, grads and the optimizer's state."""
    found = [_local(p.detach()) for p in model.parameters()]
    found += [_local(p.grad) for p in model.parameters() if p.grad is not None]
    core = opt._engine.state  # the fast path's fp16fx state (no copies; a state dict may be)
    found += [t for t in optree.tree_leaves(core) if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in found}
    return sum(storages.values())


def check_pass_ms(model: nn.Module, repeats: int = 20) -> tuple[float, float]:
    """Returns the eager ms of the step's check pass (unscale, largest magnitude, global norm,
    agreed by every rank) on an FSDP2 model's grads: through DTensor ops (a collective per
    reduction), and as fp16fx runs it, on the local shards with one all-reduce."""
    grads = [p.grad for p in model.parameters()]
    scale = torch.tensor(1024.0)
    consensus = fp16fx.distributed.Consensus(sharded=True)

    def through_dtensor_ops() -> None:
        unscaled = [g * torch.reciprocal(scale) for g in grads]
        largest = torch.stack([u.abs().amax().full_tensor() for u in unscaled]).amax()
        norms = torch.stack([torch.linalg.vector_norm(u).full_tensor() for u in unscaled])
        torch.isfinite(largest), torch.linalg.vector_norm(norms)

    def on_local_shards() -> None:
        checked = fp16fx.unscale_and_check([_local(g) for g in grads], scale)
        consensus(checked.finite, checked.norm)

    found = []
    for run in (through_dtensor_ops, on_local_shards):
        times = []
        for i in range(repeats + 3):
            dist.barrier()
            start = time.perf_counter()
            run()
            if i >= 3:
                times.append(time.perf_counter() - start)
        found.append(statistics.median(times) * 1e3)
    return found[0], found[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["ddp", "sharded", "fsdp2"], required=True)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="samples per rank")
    parser.add_argument("--steps", type=int, default=10)
    # --masters, not --master: torchrun refuses --master as ambiguous (--master-addr, -port).
    parser.add_argument("--masters", choices=MASTERS, default="fp32")
    parser.add_argument("--moments", choices=MOMENTS, default="fp32")
    parser.add_argument(
        "--check-pass",
        action="store_true",
        help="fsdp2: also time the step's check pass through DTensor ops vs on local shards",
    )
    args = parser.parse_args()
    for name in ("width", "depth", "batch", "steps"):  # counts: at least 1
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.check_pass and args.mode != "fsdp2":
        parser.error(
            f"--check-pass times FSDP2's check pass: it needs --mode fsdp2, not {args.mode}"
        )
    if "RANK" not in os.environ:
        parser.error(
            "run it under torchrun: torchrun --nproc-per-node 2 examples/compare_sharding.py ..."
        )
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    model, opt = build(args.mode, args.width, args.depth, args.masters, args.moments)
    n = args.width * (args.width + 1) * args.depth
    dtype = torch.float32 if args.mode == "fsdp2" else torch.float16  # FSDP2 casts it
    x = torch.randn(args.batch, args.width).to(dtype)
    times: list[float] = []
    step_times: list[float] = []
    for i in range(args.steps + 3):
        start = time.perf_counter()
        opt.zero_grad()
        opt.backward(F.mse_loss(model(x).float(), x.float()))
        before_step = time.perf_counter()
        opt.step()
        after_step = time.perf_counter()
        dist.barrier()
        if i >= 3:
            times.append(time.perf_counter() - start)
            step_times.append(after_step - before_step)
    per_rank: list[Any] = [None] * world
    mine = (
        persistent_bytes(model, opt) / n,
        statistics.median(times) * 1e3,
        statistics.median(step_times) * 1e3,
    )
    dist.all_gather_object(per_rank, mine)
    if dist.get_rank() == 0:
        bytes_per_param = max(r[0] for r in per_rank)
        ms, step_ms = max(r[1] for r in per_rank), max(r[2] for r in per_rank)
        precision = f" (masters {args.masters}, moments {args.moments})"
        print(f"{args.mode}{precision} d={world} params={n:,}: "
              f"{bytes_per_param:.2f} bytes/param/rank, "
              f"{ms:.1f} ms/step of which {step_ms:.1f} ms in optimizer.step() "
              f"(path {opt.path}, skipped {opt.skipped_steps})")  # fmt: skip
    if args.mode == "fsdp2" and args.check_pass:
        dtensor_ms, local_ms = check_pass_ms(model)
        if dist.get_rank() == 0:
            print(f"check pass, eager: {dtensor_ms:.2f} ms through DTensor ops, "
                  f"{local_ms:.2f} ms on the local shards")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
