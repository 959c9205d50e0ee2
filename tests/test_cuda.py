"""CUDA: the compiled step captured in one CUDA graph. Skipped on machines without a GPU."""

from __future__ import annotations

import optree
import pytest
import torch
import torch._dynamo

import fp16fx

pytestmark = [
    pytest.mark.compile,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _params(device):
    gen = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(256, 128, generator=gen).half().to(device),
        "b": torch.randn(128, generator=gen).half().to(device),
        "f": torch.randn(64, generator=gen).to(device),
    }


def test_cuda_graph_step_matches_eager_and_never_recompiles():
    torch._dynamo.reset()
    policy = fp16fx.DynamicLossScale(init_scale=2.0**10, growth_interval=2)
    graphed = fp16fx.init(_params("cuda"), fp16fx.adamw(1e-2), policy, buckets=True)
    eager = fp16fx.init(_params("cuda"), fp16fx.adamw(1e-2), policy, buckets=True)
    grads = fp16fx.grad_buffers(graphed)
    step = fp16fx.compile_step(inplace=True, cuda_graph=True)
    gen = torch.Generator().manual_seed(1)
    finite = []
    for i in range(12):
        if i == 3:
            torch._dynamo.config.error_on_recompile = True
        scale = float(graphed.loss_scale.scale)
        for g in optree.tree_leaves(grads):
            g.copy_((torch.randn(g.shape, generator=gen) * scale).to(g.dtype))
        if i == 5:
            grads["b"][7] = float("inf")
        fp16fx.set_hyperparams(graphed, inplace=True, lr=1e-2 / (i + 1))
        eager = fp16fx.set_hyperparams(eager, lr=1e-2 / (i + 1))
        graphed, info = step(graphed, grads)
        finite.append(bool(info["finite"]))
        eager, _ = fp16fx.step(eager, grads)
    torch._dynamo.config.error_on_recompile = False
    assert finite.count(False) == 1 and not finite[5]
    # FP32 leaves (masters, moments, scale) agree closely: the GPU kernel fuses multiply-adds
    # eager rounds twice. An FP16 param is its master rounded, so where two masters that agree
    # to 1e-7 straddle a rounding midpoint the params are one FP16 ulp apart: check instead that
    # each param is exactly its own master rounded.
    for a, b in zip(optree.tree_leaves(graphed), optree.tree_leaves(eager)):
        if a.dtype != torch.float16:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for state in (graphed, eager):
        masters = optree.tree_leaves(state.master)
        for param, master in zip(optree.tree_leaves(state.params), masters):
            assert torch.equal(param, master.to(param.dtype))


def test_facade_fast_path_trains_on_cuda():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    model = model.cuda().half()
    optimizer = fp16fx.FP16_Optimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2), dynamic_loss_scale=True
    )
    x = torch.randn(64, 32, device="cuda").half()
    y = torch.randint(0, 4, (64,), device="cuda")
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        optimizer.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def _snapshot(state) -> list[torch.Tensor]:
    """Every tensor of the state's checkpoint (codes, scales, corrections, params), copied."""
    return [t.clone() for t in optree.tree_leaves(fp16fx.state_dict(state)) if torch.is_tensor(t)]


@pytest.mark.parametrize("moments", ["fp32", "int8"])
def test_compact_cuda_graph_step_skips_bitwise_and_tracks_eager(moments):
    """Compensated masters (and int8 moments) in the CUDA-graph step: an overflowing step
    leaves every stored bit but the loss scale's as it was, and the params follow eager
    steps' (the same dither; Adam's update may round differently by an FP32 ulp)."""
    torch._dynamo.reset()
    policy = fp16fx.DynamicLossScale(init_scale=2.0**10, growth_interval=2)
    half = {k: v for k, v in _params("cuda").items() if v.dtype == torch.float16}

    def make():
        params = {k: v.clone() for k, v in half.items()}
        return fp16fx.init(
            params, fp16fx.adamw(1e-2), policy, buckets=True,
            master="compensated", moments=moments,
        )  # fmt: skip

    graphed, eager = make(), make()
    grads = fp16fx.grad_buffers(graphed)
    step = fp16fx.compile_step(inplace=True, cuda_graph=True)
    gen = torch.Generator().manual_seed(2)
    for i in range(8):
        scale = float(graphed.loss_scale.scale)
        for g in optree.tree_leaves(grads):
            g.copy_((torch.randn(g.shape, generator=gen) * scale).to(g.dtype))
        if i == 4:
            grads["w"][3, 5] = float("inf")
            before = _snapshot(graphed)
        graphed, info = step(graphed, grads)
        eager, _ = fp16fx.step(eager, grads)
        if i == 4:
            assert not bool(info["finite"])
            after = _snapshot(graphed)
            changed = [j for j, (a, b) in enumerate(zip(before, after)) if not torch.equal(a, b)]
            assert len(changed) <= 2  # the loss scale's value and its clean-step counter
            assert all(before[j].numel() == 1 for j in changed)
    for name in half:
        torch.testing.assert_close(
            graphed.params[name].float(), eager.params[name].float(), rtol=2e-3, atol=1e-3
        )
