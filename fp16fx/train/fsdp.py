"""``fp16fx train --fsdp``: the facade stepper on a model sharded by FSDP2, and its checkpoints.

Each process keeps its shard of every param and of the optimizer's state. The stepper's
:meth:`FSDPStepper.state_dict` gathers them into whole tensors
(:func:`fp16fx.distributed.fsdp.full_state_dict`: every process takes part, rank 0 writes the
file), and :meth:`FSDPStepper.load_state_dict` has each process take its own shard back out of
them. So an ``--fsdp`` checkpoint is one ``fp16fx train`` file like any other: written
atomically, read with ``torch.load(weights_only=True)``, and resumed at any number of
processes and in any ``--masters`` / ``--moments``. The gathering costs the whole model and
its FP32 optimizer state on each process while the dict lives: fine for the models ``fp16fx
train`` trains. A model that needs FSDP2 to fit at all checkpoints through
``torch.distributed.checkpoint`` instead, each rank writing its own part
(``examples/fsdp2_fp16.py``, docs/distributed.md).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fp16fx.distributed import fsdp
from fp16fx.train.models import to_half
from fp16fx.train.steppers import (
    FP16_MODEL,
    FacadeStepper,
    LossScale,
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
        # The network holds the weights, keyed alike at any precision (to_half puts it behind
        # an input cast), so a checkpoint resumes in another one; the replica evaluates.
        self._network, self._replica_network = model, copy.deepcopy(model)
        self._replica = self._replica_network
        if master == "compensated":
            model, self._replica = to_half(self._network), to_half(self._replica_network)
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
            "optimizer": fsdp.full_state_dict(self.optimizer.state_dict()),
        }

    def replicated(self) -> list[torch.Tensor]:
        """Returns what the processes share under FSDP2, each holding its own shard of the
        params: the buffers (rank 0's since the last evaluation) and the loss scaler's state,
        which the found-inf consensus keeps alike (reading it syncs, once per run)."""
        device = next(self.weights.parameters()).device  # the shards': the backend's device
        scaler = [self.optimizer.loss_scale, float(self.optimizer.skipped_steps)]
        return [*self.weights.buffers(), torch.tensor(scaler, dtype=torch.float64, device=device)]

    def _gathered_weights(self) -> dict[str, Any]:
        return fsdp.full_state_dict(self.weights.state_dict())

    def _load_weights(self, weights: dict[str, Any]) -> None:
        # A copy: torch's loader replaces the dict's tensors with their shards.
        set_model_state_dict(self.weights, dict(weights), options=_WHOLE)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a :meth:`state_dict` saved at any number of processes, each taking its
        own shard of the whole tensors (every process calls it)."""
        super().load_state_dict(state)
        self._replica_fresh = False


#: How the stepper's checkpoints hold the model: whole tensors, every process a copy.
_WHOLE = StateDictOptions(full_state_dict=True)
