"""FP16 training of an FSDP2 (``fully_shard``) model with fp16fx's loss scaling, and a DCP
checkpoint resumed mid-run.

It runs on CPU (gloo) or GPUs (nccl)::

    torchrun --nproc-per-node 2 examples/fsdp2_fp16.py --steps 40
    torchrun --nproc-per-node 2 examples/fsdp2_fp16.py --masters compensated --moments int8

FSDP2 keeps each parameter as an FP32 DTensor shard (its own master) and computes in FP16
(``MixedPrecisionPolicy(param_dtype=torch.float16)``); its gradients arrive reduce-scattered
in FP32. ``FP16_Optimizer`` scales the loss, and its compiled step unscales the local grad
shards, agrees "all finite" and the global grad norm with every rank in one all-reduce, clips,
and applies AdamW -- or skips the step on every rank -- with no host sync.

With ``--masters compensated`` the shards are FP16 (``model.half()`` before ``fully_shard``)
and carry their masters in a 1-byte correction each: no FP32 copy (docs/precision.md;
``--moments bf16`` or ``int8`` store AdamW's moments compactly too).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fp16fx
from fp16fx.precision import MASTERS, MOMENTS

BATCH, WIDTH = 64, 64


def build(master: str, moments: str) -> tuple[nn.Module, fp16fx.FP16_Optimizer]:
    """Returns the sharded model and its optimizer (the same on every rank: seeded)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, 1)
    )
    if master == "compensated":
        model = model.half()  # FP16 shards: their corrections carry the masters
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    opt = fp16fx.FP16_Optimizer(
        inner, dynamic_loss_scale=True, verbose=False, master=master, moments=moments
    )
    return model, opt


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns this rank's part of step ``step``'s batch of a fixed regression task."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, 16, generator=g)
    y = torch.sin(x[:, :4].sum(dim=1, keepdim=True))
    part = BATCH // dist.get_world_size()
    rank = dist.get_rank()
    return x[rank * part : (rank + 1) * part], y[rank * part : (rank + 1) * part]


def train(model: nn.Module, opt: fp16fx.FP16_Optimizer, steps: range) -> float:
    loss = torch.zeros(())  # the last step's
    for step in steps:
        x, y = batch(step)
        opt.zero_grad()
        loss = F.mse_loss(model(x).float(), y)
        opt.backward(loss)  # scaled in FP32; FSDP reduce-scatters the grads
        opt.clip_master_grads(1.0)  # the global norm across every rank's shards
        opt.step()  # skipped on every rank if any rank's shard overflowed
        if dist.get_rank() == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1:4d}  loss {loss.item():.4f}  loss scale {opt.loss_scale:g}")
    return loss.item()


def checkpoint(model: nn.Module, opt: fp16fx.FP16_Optimizer) -> dict:
    """The dict DCP saves, or loads into in place: DTensors it reshards to any world size."""
    return {"model": get_model_state_dict(model), "optim": opt.state_dict()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    # --masters, not --master: torchrun refuses --master as ambiguous (--master-addr, -port).
    parser.add_argument("--masters", choices=MASTERS, default="fp32")
    parser.add_argument("--moments", choices=MOMENTS, default="fp32")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if "RANK" not in os.environ:
        parser.error(
            "run it under torchrun: torchrun --nproc-per-node 2 examples/fsdp2_fp16.py ..."
        )
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    half = args.steps // 2
    model, opt = build(args.masters, args.moments)
    train(model, opt, range(half))
    where = tempfile.mkdtemp() if dist.get_rank() == 0 else None
    try:
        shared = [where]
        dist.broadcast_object_list(shared)  # one checkpoint directory for every rank
        dcp.save(checkpoint(model, opt), checkpoint_id=shared[0])
        final = train(model, opt, range(half, args.steps))

        model, opt = build(args.masters, args.moments)  # a fresh run, resumed from it
        sd = checkpoint(model, opt)
        dcp.load(sd, checkpoint_id=shared[0])
        dist.barrier()  # every rank has read the checkpoint: rank 0 may remove it
        set_model_state_dict(model, sd["model"])
        opt.load_state_dict(sd["optim"])
        resumed = train(model, opt, range(half, args.steps))
        if dist.get_rank() == 0:
            print(f"resumed from step {half}: final loss {resumed:.6f} "
                  f"(uninterrupted {final:.6f}), same: {resumed == final}; "
                  f"skipped steps {opt.skipped_steps}")  # fmt: skip
    finally:
        if where is not None:  # rank 0's, also when the run failed
            shutil.rmtree(where, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
