"""``fp16fx train --fsdp``: the facade stepper on a model sharded by FSDP2, and its checkpoints.

Each process keeps its shard of every param and of the optimizer's state; the stepper's
:meth:`FSDPStepper.state_dict` gathers them into whole tensors (every process takes part, rank
0 writes the file), and :meth:`FSDPStepper.load_state_dict` cuts each process's shard back out
of them. So an ``--fsdp`` checkpoint is one ``fp16fx train`` file like any other: written
atomically, read with ``torch.load(weights_only=True)``, and resumed at any number of
processes and in any ``--masters`` / ``--moments``. The gathering costs the whole model and its FP32 optimizer state on each process
while the dict lives: fine for the models ``fp16fx train`` trains. A model that needs FSDP2 to
fit at all checkpoints through ``torch.distributed.checkpoint`` instead, each rank writing its
own part (``examples/fsdp2_fp16.py``, docs/distributed.md).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from fp16fx.train.models import to_half
from fp16fx.train.steppers import (
    FP16_MODEL,
    FacadeStepper,
    LossScale,
    StateMismatchError,
    StepOutput,
)

__all__ = ["FSDPStepper"]


class FSDPStepper(FacadeStepper):
    """``fp16fx.FP16_Optimizer`` over ``torch.optim.Adam`` on a model sharded by FSDP2
    (``fully_shard``, FP16 compute, FP32 gradient reduction): each process keeps its shard of
    every param and of the moments.

    The model is FP32 (each shard its own master), or with compensated masters FP16 (apex's
    ``network_to_half``: the corrections carry the shards' masters). Each layer is an FSDP
    group of its own, BatchNorm computing in FP32 (as ``network_to_half`` keeps it).
    Evaluation runs an unsharded replica loaded with the gathered params, so processes with
    different numbers of test batches never wait on each other's all-gathers.
    """

    collective_state_dict = True

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        loss_scale: LossScale,
        compile: bool = True,
        master: str = "fp32",
        moments: str = "fp32",
    ) -> None:
        # The network is the module that holds the weights, keyed alike at any precision (to_half
        # puts it behind an input cast): a checkpoint resumes in another one.
        self._network, self._replica_network = model, copy.deepcopy(model)
        self._replica = self._replica_network
        if master == "compensated":
            model, self._replica = to_half(model), to_half(self._replica_network)
        half = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
        full = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for module in model.modules():  # one FSDP group per layer; BatchNorm computes in FP32
            if module is not model and any(True for _ in module.parameters(recurse=False)):
                bn = isinstance(module, nn.modules.batchnorm._BatchNorm)
                fully_shard(module, mp_policy=full if bn else half)
        fully_shard(model, mp_policy=half)
        super().__init__(model, lr, loss_scale, compile=compile, master=master, moments=moments)
        shards = "FP16 model, FSDP2" if master == "compensated" else "FP32 model, FSDP2"
        self.label = self.label.replace(FP16_MODEL, f"{shards} (FP16 compute)")
        self._replica_fresh = False

    def train_step(self, images: torch.Tensor, labels: torch.Tensor) -> StepOutput:
        self._replica_fresh = False
        return super().train_step(images, labels)

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        if not self._replica_fresh:  # every process's first test batch: gather once
            self._replica_network.load_state_dict(self._gathered_weights())
            self._replica_fresh = True
        self._replica.train(self.model.training)
        return self._replica(images.float())

    @property
    def weights(self) -> nn.Module:
        """The network inside the model: its weights' names do not depend on the precision."""
        return self._network

    def state_dict(self) -> dict[str, Any]:
        """Returns the network's and the optimizer's state dicts with every DTensor gathered
        into a whole CPU tensor (every process calls it). The optimizer's is its DCP dict
        (docs/distributed.md): in FP32 terms whatever the precision, so a checkpoint resumes
        in any ``--masters`` / ``--moments``."""
        return {
            "model": self._gathered_weights(),
            "optimizer": _map_tensors(_whole, self.optimizer.state_dict()),
        }

    def _gathered_weights(self) -> dict[str, torch.Tensor]:
        return _map_tensors(_whole, self.weights.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a :meth:`state_dict` saved at any number of processes: each DTensor's
        shard is cut out of the whole tensor saved (every process calls it)."""
        model = _shards_like(self.weights.state_dict(), state["model"])
        optimizer = _shards_like(self.optimizer.state_dict(), state["optimizer"])
        super().load_state_dict({"model": model, "optimizer": optimizer})
        self._replica_fresh = False


def _whole(t: torch.Tensor) -> torch.Tensor:
    """Returns ``t`` (a DTensor gathered) as a whole tensor on the CPU."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def _map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """Returns ``tree`` (nested dicts, lists and tuples) with ``fn`` applied to its tensors."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {key: _map_tensors(fn, value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_tensors(fn, value) for value in tree)
    return tree


def _shards_like(template: Any, saved: Any, where: str = "") -> Any:
    """Returns ``saved`` (nested dicts) with each tensor at a key where ``template`` holds a
    DTensor made a DTensor laid out like it: this process's shard of the saved whole tensor,
    in the saved dtype. A key of a param's entry that ``template`` lacks (an FP16 param's
    ``master``, loaded where the params are FP32) is laid out like the entry's ``param``.
    Everything else is ``saved``'s own, for the loader to check and convert."""
    if isinstance(saved, torch.Tensor) and isinstance(template, DTensor):
        if saved.shape != template.shape:
            raise StateMismatchError(
                f"the checkpoint's {where or 'tensor'} has shape {tuple(saved.shape)}, this "
                f"run's {tuple(template.shape)}"
            )
        # Every process holds the whole tensor: each keeps its own shard, nothing is sent.
        return distribute_tensor(
            saved.to(template.device), template.device_mesh, template.placements, src_data_rank=None
        )
    if isinstance(saved, dict) and isinstance(template, dict):
        like = template.get("param")
        return {
            key: _shards_like(template.get(key, like), value, f"{where}[{key!r}]")
            for key, value in saved.items()
        }
    return saved
