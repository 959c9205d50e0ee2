"""An apex ``fp16_utils`` script, migrated to fp16fx by changing one import line.

Everything below the import is written exactly as for ``apex.fp16_utils``: ``network_to_half``,
``FP16_Optimizer`` wrapping a ``torch.optim`` optimizer, ``optimizer.backward(loss)``,
``optimizer.step()``, ``optimizer.loss_scale``, ``optimizer.overflow``, ``state_dict()``. It
trains the same small model twice, with a static and with a dynamic loss scale, on a synthetic
regression task (torch only, a few seconds on a CPU).

Run: ``python examples/migrate_from_apex.py [--steps 300]``.
"""

from __future__ import annotations

import argparse
import io

import torch
from torch import nn

# from apex.fp16_utils import FP16_Optimizer, network_to_half
from fp16fx.fp16_utils import FP16_Optimizer, network_to_half


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 1))


def train(optimizer_kwargs: dict, steps: int, label: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(2048, 16)
    y = torch.tanh(0.25 * x @ torch.randn(16, 1))  # the target: a smooth function of x

    model = network_to_half(make_model())  # FP16 weights, BatchNorm FP32, FP16 input cast
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    optimizer = FP16_Optimizer(optimizer, **optimizer_kwargs)

    skipped = 0
    for step in range(steps):
        idx = torch.randint(0, len(x), (64,))
        optimizer.zero_grad()
        out = model(x[idx])
        loss = nn.functional.mse_loss(out.float(), y[idx])
        if step == steps // 2:
            # Make this one step overflow, as a too-large loss scale would: it is skipped.
            optimizer.backward(loss * float("inf"))
        else:
            optimizer.backward(loss)  # instead of loss.backward()
        optimizer.step()  # skipped when the gradients overflowed
        skipped += int(optimizer.overflow)
        if (step + 1) % max(steps // 3, 1) == 0:
            model.eval()
            with torch.no_grad():
                full_loss = nn.functional.mse_loss(model(x).float(), y).item()
            model.train()
            print(
                f"  {label} step {step + 1}: loss {full_loss:.4f} (all {len(x)} points), "
                f"loss scale {optimizer.loss_scale:g}, skipped so far {skipped}"
            )

    # apex checkpoints: the optimizer's state_dict holds the FP32 masters and the scaler.
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)  # tensors and primitives only
    optimizer.load_state_dict(checkpoint["optimizer"])
    print(f"  {label}: checkpoint of {buffer.getbuffer().nbytes:,} bytes saved and reloaded")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    print("static loss scale 128:")
    train({"static_loss_scale": 128.0}, args.steps, "static")
    print("dynamic loss scale (starts at 2**16, halves on overflow):")
    train({"dynamic_loss_scale": True}, args.steps, "dynamic")


if __name__ == "__main__":
    main()
