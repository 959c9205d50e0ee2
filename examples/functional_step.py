"""fp16fx's pure API: train an FP16 MLP with torch.func and a compiled, in-place step.

What it shows, in order:

1. ``fp16fx.init`` over a plain dict of FP16 params (taken from an ``nn.Module``): the FP32
   master copy, Adam's moments and the dynamic loss scale live in one state of tensors.
2. Gradients from ``torch.func``: ``grad`` of a loss written with ``functional_call``, scaled
   with ``fp16fx.scale_loss`` so that small FP16 gradients do not underflow.
3. ``fp16fx.compile_step(inplace=True)``: one fused step that writes into the state's tensors
   (and so into the module's own params), skipping exactly on inf/NaN gradients (one
   overflow is simulated half way).
4. A learning-rate schedule: ``fp16fx.set_hyperparams(state, lr=..., inplace=True)`` changes a
   tensor in the state, so the compiled step is never recompiled (the count is printed).

Run: ``python examples/functional_step.py [--steps 150] [--no-compile]``. The task is
synthetic (labels from a fixed random "teacher"), so it needs nothing but torch.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.func import functional_call, grad

import fp16fx


def make_task(n: int, dim: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(inputs, labels)``: Gaussian inputs labelled by a fixed random linear teacher."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(dim, classes, generator=g)
    x = torch.randn(n, dim, generator=g)
    return x, (x @ teacher).argmax(dim=1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fused compile_step(inplace=True) (default) or the pure fp16fx.step",
    )
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size"):  # counts: at least 1
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not (math.isfinite(args.lr) and args.lr >= 0):  # fp16fx's rule for lr: 0 stands still
        parser.error(f"--lr must be a finite number >= 0, got {args.lr}")
    torch.manual_seed(0)

    x, y = make_task(5120, 32, 4, seed=1)
    x_train, y_train, x_test, y_test = x[:4096], y[:4096], x[4096:], y[4096:]

    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4)).half()
    params = {name: p.detach() for name, p in model.named_parameters()}  # FP16 tensors

    # 1. The training state: FP16 params -> FP32 masters, Adam moments, dynamic loss scale.
    state = fp16fx.init(params, fp16fx.adam(args.lr))

    # 2. Gradients of the *scaled* loss, with torch.func. The loss scale is read from the
    #    state at each call: a tensor, so nothing is baked into any graph.
    def scaled_loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):
        logits = functional_call(model, p, (x.half(),))
        loss = F.cross_entropy(logits.float(), y)
        return fp16fx.scale_loss(state, loss), loss.detach()

    grad_fn = grad(scaled_loss, has_aux=True)  # -> (FP16 grads dict, unscaled loss)

    # 3. The step: compiled and in place, or the pure reference.
    step = fp16fx.compile_step(inplace=True) if args.compile else fp16fx.step

    gen = torch.Generator().manual_seed(0)
    graphs_after_first_step = 0
    start = time.perf_counter()
    for i in range(args.steps):
        # 4. Cosine learning-rate schedule: an in-place tensor write, no recompile.
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * i / args.steps))
        fp16fx.set_hyperparams(state, lr=lr, inplace=True)

        idx = torch.randint(0, len(x_train), (args.batch_size,), generator=gen)
        grads, loss = grad_fn(state.params, x_train[idx], y_train[idx])
        before = None
        if i == args.steps // 2:
            # Simulate an FP16 overflow: the step is skipped exactly, the loss scale halves.
            grads["0.weight"] = torch.full_like(grads["0.weight"], math.inf)
            before = {name: p.clone() for name, p in state.params.items()}
        state, info = step(state, grads)  # in place: the same state object comes back
        if not info["finite"]:  # a host sync; fine in an example
            scale = state.loss_scale.scale.item()
            print(f"step {i + 1:4d}  overflow: step skipped; loss scale now {scale:g}")
            if before is not None:  # the simulated one: were the params left alone?
                unchanged = all(torch.equal(before[k], p) for k, p in state.params.items())
                print(f"           params unchanged: {unchanged}")

        if i == 0:
            graphs_after_first_step = counters["stats"]["unique_graphs"]
            what = "compiling the step" if args.compile else "eager"
            print(f"step 1 ({what}): {time.perf_counter() - start:.1f} s")
        if (i + 1) % max(args.steps // 6, 1) == 0:
            # .item()/.tolist() sync with the device: do it only when printing.
            print(
                f"step {i + 1:4d}  loss {loss.item():.4f}  lr {lr:.2e}  "
                f"loss scale {state.loss_scale.scale.item():g}  "
                f"finite {bool(info['finite'])}  grad norm {info['grad_norm'].item():.3f}"
            )

    with torch.no_grad():
        logits = functional_call(model, state.params, (x_test.half(),))
        accuracy = (logits.argmax(dim=1) == y_test).float().mean().item()
    recompiles = counters["stats"]["unique_graphs"] - graphs_after_first_step
    applied = int(state.count)
    print(f"test accuracy {100 * accuracy:.1f}% after {args.steps} steps ({applied} applied)")
    print(f"{time.perf_counter() - start:.1f} s; recompiles after the first step: {recompiles}")
    # In place, the step wrote into the module's own params; the pure step made new tensors.
    shared = all(p.data_ptr() == state.params[n].data_ptr() for n, p in model.named_parameters())
    print(f"the module's params are the state's: {shared}")


if __name__ == "__main__":
    main()
