"""Data-parallel ``fp16fx train``: which process this is, its process group, and the launcher.

Layer: ``cli`` (docs/design.md). The transport is ``torch.distributed`` and the launcher is torch's
own (``torch.distributed.launcher.api.elastic_launch``, what ``torchrun`` runs); this module
only wires them to the training session:

* :class:`Processes`: this process's rank among ``size``, and the few collectives a session
  needs besides the gradient average (which DDP or ``fp16fx.distributed`` does): the mean of
  the losses, a sum of test counts, rank 0's BatchNorm buffers, and a check that the replicas
  ended equal.
* :func:`process_group`: ``init_process_group`` for a process torchrun (or :func:`launch`)
  started: gloo on CPUs, NCCL on GPUs (one per local rank), with a timeout.
* :func:`launch`: ``fp16fx train --nproc-per-node N``: N local processes each running one
  function; a failure in any of them stops the others and comes back as :class:`WorkerError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["SINGLE", "TIMEOUT", "Processes", "WorkerError", "launch", "process_group"]

#: How long a collective waits for a missing peer before failing: a hung rank then ends the
#: run with an error instead of blocking the others forever (a dead one fails them at once).
#: Long enough for rank 0 to write a ResNet-18 checkpoint while the others wait.
TIMEOUT = datetime.timedelta(minutes=5)

#: The loggers of torch's launcher, silenced while it runs: on a failure they repeat, as
#: glog lines, what :class:`WorkerError` reports in one line.
_LAUNCHER_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")


@dataclasses.dataclass(frozen=True)
class Processes:
    """This process among the ``size`` processes training one model together.

    Attributes:
      rank, size: this process's index and how many there are (``torch.distributed``'s).
      local_rank, local_size: the same on this machine (which GPU is this process's).
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1

    @classmethod
    def from_env(cls) -> Processes | None:
        """Returns the processes torchrun (or :func:`launch`) started, from the variables it
        sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``); None outside."""
        environ = os.environ
        if "WORLD_SIZE" not in environ:
            return None
        size = int(environ["WORLD_SIZE"])
        rank = int(environ.get("RANK", "0"))
        return cls(
            rank=rank,
            size=size,
            local_rank=int(environ.get("LOCAL_RANK", str(rank))),
            local_size=int(environ.get("LOCAL_WORLD_SIZE", str(size))),
        )

    @classmethod
    def current(cls) -> Processes:
        """Returns the processes of the initialized ``torch.distributed``, else one process."""
        if not (dist.is_available() and dist.is_initialized()):
            return SINGLE
        env = cls.from_env()
        rank, size = dist.get_rank(), dist.get_world_size()
        if env is None:  # initialized by the embedding program without torchrun's variables
            return cls(rank, size, rank, size)
        return cls(rank, size, env.local_rank, env.local_size)

    @property
    def is_main(self) -> bool:
        """True on rank 0, the process that logs, saves and reports."""
        return self.rank == 0

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """Returns the elementwise mean of ``values`` over the processes."""
        return values if self.size == 1 else self.sum(values) / self.size

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Returns the elementwise sum of ``values`` over the processes (``values`` itself for
        one process, else a new tensor)."""
        if self.size == 1:
            return values
        total = values.clone()
        dist.all_reduce(total)
        return total

    def broadcast_buffers(self, module: nn.Module) -> None:
        """Overwrites ``module``'s buffers (BatchNorm statistics) with rank 0's, in place.

        Training keeps each process's running statistics of its own batches; evaluating and
        saving use rank 0's everywhere, as DDP does at every forward.
        """
        if self.size == 1:
            return
        with torch.no_grad():
            for buffer in module.buffers():
                dist.broadcast(buffer, src=0)

    def replicas_equal(self, tensors: Iterable[torch.Tensor]) -> bool:
        """Returns True when every process holds bitwise the same ``tensors`` as rank 0.

        One broadcast per tensor, at the end of a run: a check that data parallelism kept the
        replicas identical, which DDP and the found-inf consensus promise.
        """
        if self.size == 1:
            return True
        tensors = list(tensors)
        differ = torch.zeros((), device=tensors[0].device)
        for t in tensors:
            reference = t.detach().clone()
            dist.broadcast(reference, src=0)
            # Bits, not values: NaN == NaN here, and -0.0 differs from 0.0.
            if not torch.equal(_bits(reference), _bits(t.detach())):
                differ.fill_(1)
        dist.all_reduce(differ, op=dist.ReduceOp.MAX)
        return not bool(differ.item())


#: One process, no ``torch.distributed``.
SINGLE = Processes()


def _bits(t: torch.Tensor) -> torch.Tensor:
    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if t.dtype.is_floating_point:
        return t.contiguous().view(integer[t.element_size()])
    return t


@contextlib.contextmanager
def process_group(processes: Processes, device_type: str) -> Iterator[None]:
    """Initializes ``torch.distributed`` for ``processes`` for the duration, then destroys it.

    ``device_type`` ``"cuda"``: NCCL, and this process's GPU is ``cuda:LOCAL_RANK``;
    ``"cpu"``: gloo. Rendezvous through torchrun's ``MASTER_ADDR``/``MASTER_PORT``; every
    collective fails after :data:`TIMEOUT` if a peer does not join.
    """
    if device_type == "cuda":
        torch.cuda.set_device(processes.local_rank)
    if "OMP_NUM_THREADS" not in os.environ:
        # torchrun sets 1; launch() keeps the parent's environment: share the cores instead
        # of every process starting one thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes.local_size))
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=TIMEOUT)
    try:
        yield
    finally:
        dist.destroy_process_group()


class WorkerError(Exception):
    """A process started by :func:`launch` failed.

    Attributes:
      rank: the first process that failed.
      kind: the class name of its exception (``"CheckpointError"``), or ``""`` when it died
        without one (a signal, ``os._exit``).
      message: the exception's message, or how the process ended.
      traceback: the process's Python traceback (``""`` when there is none).
    """

    def __init__(self, rank: int, kind: str, message: str, traceback: str = "") -> None:
        super().__init__(f"process {rank} failed: {f'{kind}: ' if kind else ''}{message}")
        self.rank, self.kind, self.message, self.traceback = rank, kind, message, traceback


def _worker_error(rank: int, failure: Any) -> WorkerError:
    """Returns the :class:`WorkerError` of one of torch elastic's ``ProcessFailure``."""
    recorded = failure.message
    if isinstance(recorded, dict):  # what torch elastic's @record wrote from the exception
        kind, _, message = str(recorded.get("message", "")).partition(": ")
        traceback = str(recorded.get("extraInfo", {}).get("py_callstack", ""))
        return WorkerError(rank, kind, message, traceback)
    return WorkerError(rank, "", f"exit code {failure.exitcode} ({recorded})")


@contextlib.contextmanager
def _launcher_logs_silenced() -> Iterator[None]:
    # Every module of torch elastic sets its logger's own level: silence each one.
    names = [name for name in logging.root.manager.loggerDict if name.startswith(_LAUNCHER_LOGGERS)]
    loggers = [logging.getLogger(name) for name in names]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def launch(entrypoint: Callable[..., None], args: tuple[Any, ...], nproc: int) -> None:
    """Runs ``entrypoint(*args)`` in ``nproc`` new local processes, as torchrun would.

    The processes are forked from a fresh server process that imported ``__main__`` once
    (``forkserver``: no state of this process is inherited, no import is paid N times;
    ``entrypoint`` and ``args`` must pickle). They find each other through a c10d store on a
    free localhost port (torchrun's ``--standalone``), get torchrun's environment variables
    and inherit this process's stdout and stderr. When one raises or dies, the others are
    stopped.

    Raises:
      WorkerError: a process failed (the first one's exception, message and traceback).
      KeyboardInterrupt: the launcher was interrupted (Ctrl-C or a termination signal).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The launcher's per-process error files live here, and go when the run ends.
    with tempfile.TemporaryDirectory(prefix="fp16fx-train-") as logs:
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc,
            run_id=uuid.uuid4().hex,
            rdzv_backend="c10d",
            rdzv_endpoint="localhost:0",
            max_restarts=0,
            start_method="forkserver",
            logs_specs=DefaultLogsSpecs(log_dir=logs),
        )
        with _launcher_logs_silenced():
            try:
                elastic_launch(config, entrypoint)(*args)
            except ChildFailedError as exc:
                raise _worker_error(*exc.get_first_failure()) from None
            except SignalException:
                raise KeyboardInterrupt from None
