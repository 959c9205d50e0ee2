"""The baselines users would pick instead of fp16fx, as :class:`~fp16fx.bench.runner.Runner` s.

All three keep FP32 master copies of the FP16 params (PyTorch's optimizers keep none of their
own for FP16 params) and run Adam on them:

* ``torch-fused`` — the best torch-native recipe: copy the FP16 grads into FP32 master grads,
  unscale them and learn "all finite" in one sync-free kernel
  (``torch._amp_foreach_non_finite_check_and_unscale_``, what ``GradScaler.unscale_`` runs),
  step ``torch.optim.AdamW(fused=True, weight_decay=0)`` (= Adam) which skips on device when
  ``found_inf`` is set, and copy the masters back into the FP16 params (``_foreach_copy_``).
* ``torch-compiled`` — the same around PyTorch's compiled-optimizer recipe: ``lr`` as a 0-d
  tensor and ``torch.compile(fullgraph=False)`` around ``opt.step()``. Compiled non-fused
  optimizers cannot take ``found_inf``, so it skips as ``GradScaler.step`` does for them: one
  ``found_inf.item()`` host sync per step.
* ``apex-style`` — apex ``fp16_utils.FP16_Optimizer``'s published algorithm: a per-tensor
  overflow check with a host sync each (``float(g.float().sum())`` as apex's
  ``_has_inf_or_nan``), then per-tensor grad copies into FP32 master grads, per-tensor
  ``mul_(1/scale)``, ``torch.optim.Adam(foreach=True)`` on the masters and per-tensor copies
  back to the FP16 params.

Persistent state of each: FP16 param + grad (4 B/param) and FP32 master, master grad, m and v
(16 B/param) = 20 B/param.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from fp16fx.bench.runner import Runner, register_runner

__all__ = ["ApexStyleRunner", "TorchCompiledRunner", "TorchFusedRunner"]


def _optimizer_tensors(opt: torch.optim.Optimizer) -> list[Tensor]:
    """Return the tensors in ``opt.state`` (moments, step counts)."""
    return [v for state in opt.state.values() for v in state.values() if isinstance(v, Tensor)]


class _MasterCopyRunner(Runner):
    """Shared bookkeeping of the torch-native baselines: FP32 masters and master grads.

    Per step: ``_foreach_copy_`` FP16 grads → FP32 master grads; one fused
    non-finite-check-and-unscale kernel over them (sets ``found_inf``, no host sync); the
    subclass's optimizer step; ``_foreach_copy_`` masters → FP16 params.
    """

    baseline = True

    def setup(self, params: list[Tensor], grads: list[Tensor]) -> None:
        device = params[0].device
        self.params = params
        self.grads = grads
        self.master = [p.detach().to(torch.float32, copy=True) for p in params]
        self.master_grads = [torch.empty_like(m) for m in self.master]
        for m, g in zip(self.master, self.master_grads, strict=True):
            m.grad = g
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self.inv_scale = torch.full((), 1.0 / self.config.loss_scale, device=device)
        self.opt = self._make_optimizer(self.master)

    def _make_optimizer(self, master: list[Tensor]) -> torch.optim.Optimizer:
        raise NotImplementedError

    def _unscale_into_master_grads(self) -> None:
        torch._foreach_copy_(self.master_grads, self.grads)
        self.found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(
            self.master_grads, self.found_inf, self.inv_scale
        )

    def _copy_back(self) -> None:
        torch._foreach_copy_(self.params, self.master)

    def persistent_tensors(self) -> Iterable[Tensor]:
        return [
            *self.params,
            *self.grads,
            *self.master,
            *self.master_grads,
            self.found_inf,
            self.inv_scale,
            *_optimizer_tensors(self.opt),
        ]

    def masters(self) -> list[Tensor]:
        return self.master


@register_runner
class TorchFusedRunner(_MasterCopyRunner):
    """Baseline 4: sync-free unscale + ``AdamW(fused=True)`` on FP32 masters.

    Falls back to ``foreach=True`` (with a GradScaler-style ``found_inf.item()`` host check,
    noted in the report) where the fused kernel is not available for the device.
    """

    name = "torch-fused"
    label = "torch AdamW(fused) + masters"
    order = 40

    def _make_optimizer(self, master: list[Tensor]) -> torch.optim.Optimizer:
        cfg = self.config
        kwargs = {"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps, "weight_decay": 0.0}
        try:
            opt = torch.optim.AdamW(master, fused=True, **kwargs)
            self.fused = True
        except (RuntimeError, ValueError) as exc:
            opt = torch.optim.AdamW(master, foreach=True, **kwargs)
            self.fused = False
            self.notes.append(f"fused=True unavailable ({exc}); used foreach + host check")
        if self.fused:
            # What GradScaler.step hands a fused optimizer: it skips on device if found_inf.
            opt.found_inf = self.found_inf  # type: ignore[attr-defined]
            opt.grad_scale = None  # type: ignore[attr-defined]
        return opt

    @torch.no_grad()
    def step(self) -> None:
        self._unscale_into_master_grads()
        if self.fused or not self.found_inf.item():
            self.opt.step()
        self._copy_back()


@register_runner
class TorchCompiledRunner(_MasterCopyRunner):
    """Baseline 5: ``torch.compile``d ``AdamW.step`` on FP32 masters, lr a 0-d tensor.

    PyTorch's compiled-optimizer recipe (default implementation for the device, compiled
    with ``fullgraph=False``); the step is skipped after a ``found_inf.item()`` host check
    like ``GradScaler.step`` does for optimizers that cannot take ``found_inf``.
    """

    name = "torch-compiled"
    label = "torch.compile(AdamW.step) + masters"
    order = 50
    compiled = True

    def _make_optimizer(self, master: list[Tensor]) -> torch.optim.Optimizer:
        cfg = self.config
        lr = torch.tensor(cfg.lr, device=master[0].device)
        opt = torch.optim.AdamW(master, lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=0.0)

        @torch.compile(fullgraph=False)
        def compiled_step() -> None:
            opt.step()

        self._compiled_step: Callable[[], None] = compiled_step
        return opt

    @torch.no_grad()
    def step(self) -> None:
        self._unscale_into_master_grads()
        if not self.found_inf.item():
            self._compiled_step()
        self._copy_back()


def _has_inf_or_nan(x: Tensor) -> bool:
    """Return whether ``x`` holds inf/nan, as apex did: an FP32 sum read back to the host."""
    total = float(x.float().sum())
    return total in (float("inf"), float("-inf")) or total != total


@register_runner
class ApexStyleRunner(Runner):
    """Baseline 6: apex ``FP16_Optimizer``'s algorithm, host-side overflow check per tensor.

    Per step (apex's ``update_master_grads`` then ``step``): if any grad holds inf/nan
    (checked tensor by tensor, each a host sync, stopping at the first bad one) the step is
    skipped and nothing changes; otherwise each FP16 grad is copied into its FP32 master
    grad and multiplied by ``1/scale``, ``Adam(foreach=True)`` steps the masters, and each
    master is copied back into its FP16 param.
    """

    name = "apex-style"
    label = "apex-style loop (host overflow check)"
    order = 60
    baseline = True

    def setup(self, params: list[Tensor], grads: list[Tensor]) -> None:
        cfg = self.config
        self.params = params
        self.grads = grads
        self.master = [p.detach().to(torch.float32, copy=True) for p in params]
        for m in self.master:
            m.grad = torch.empty_like(m)
        self.opt = torch.optim.Adam(
            self.master, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=True
        )
        self.overflow = False
        self.skipped_steps = 0

    @torch.no_grad()
    def step(self) -> None:
        self.overflow = any(_has_inf_or_nan(g) for g in self.grads)
        if self.overflow:
            self.skipped_steps += 1
            return
        inv_scale = 1.0 / self.config.loss_scale
        for m, g in zip(self.master, self.grads, strict=True):
            m.grad.copy_(g)  # type: ignore[union-attr]
        for m in self.master:
            m.grad.mul_(inv_scale)  # type: ignore[union-attr]
        self.opt.step()
        for p, m in zip(self.params, self.master, strict=True):
            p.copy_(m)

    def persistent_tensors(self) -> Iterable[Tensor]:
        master_grads = [m.grad for m in self.master if m.grad is not None]
        return [
            *self.params,
            *self.grads,
            *self.master,
            *master_grads,
            *_optimizer_tensors(self.opt),
        ]

    def masters(self) -> list[Tensor]:
        return self.master
