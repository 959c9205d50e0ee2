"""The ``fp16fx train`` command line: flags in, summary table out, one-line errors.

Registered into ``fp16fx``'s CLI by :func:`add_parser`; also runs as ``python -m fp16fx.train``.
Data-parallel two ways, both ending in :func:`train_and_report` in every process:
``--nproc-per-node N`` starts N local processes with torch's launcher
(:func:`fp16fx.train.parallel.launch`), and ``torchrun ... -m fp16fx.train`` runs this module
in the processes torchrun started (recognised by its environment variables).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Sequence

from fp16fx import cli
from fp16fx.precision import MASTERS, MOMENTS
from fp16fx.scaling import check_scale
from fp16fx.train.checkpoint import CheckpointError
from fp16fx.train.config import SetupError, TrainConfig, check_processes, resolve_device
from fp16fx.train.data import DATASETS, DataError
from fp16fx.train.loop import SCHEDULES
from fp16fx.train.models import MODELS, ModelError
from fp16fx.train.parallel import Processes, WorkerError, launch, process_group
from fp16fx.train.report import PlotError, format_summary, save_plot
from fp16fx.train.session import preflight, train
from fp16fx.train.steppers import APIS, LossScale, StateMismatchError

__all__ = [
    "USER_ERRORS",
    "add_arguments",
    "add_parser",
    "config_from_args",
    "main",
    "run",
    "train_and_report",
]

#: Top-level modules of the ``train`` extra, imported lazily when a run needs them.
TRAIN_EXTRA_MODULES = frozenset({"sklearn", "torchvision", "tqdm"})

#: Errors caused by the user's flags or files: reported as one line, no traceback.
USER_ERRORS = (
    CheckpointError,
    DataError,
    ModelError,
    PlotError,
    SetupError,
    StateMismatchError,
)

DESCRIPTION = """\
Train a real model on a real task in FP16 with dynamic loss scaling, through fp16fx.

With no flags: a small CNN learns scikit-learn's bundled handwritten digits (no download) in
FP16 (BatchNorm kept FP32) with fp16fx.FP16_Optimizer over Adam, in well under two minutes on
a laptop CPU, and prints the test accuracy. The recipe fp16fx was made for:

  fp16fx train --model resnet18 --dataset cifar10 --data-dir DIR   # torchvision's CIFAR10 format

Data-parallel on one machine (gloo on CPUs, one GPU per process with NCCL):

  fp16fx train --nproc-per-node 2                       # or, the same training:
  torchrun --standalone --nproc-per-node 2 -m fp16fx.train

Nothing is ever downloaded: no data, no pretrained weights."""


def _loss_scale(text: str) -> LossScale:
    if text == "dynamic":
        return "dynamic"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'dynamic' nor a number") from None
    try:
        check_scale("a static loss scale", value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value


def _listing(table: dict[str, object]) -> str:
    return "; ".join(f"{name}: {getattr(spec, 'description', '')}" for name, spec in table.items())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``fp16fx train``'s options to ``parser``."""
    what = parser.add_argument_group("what to train")
    what.add_argument("--model", default="cnn", help=f"default cnn. {_listing(MODELS)}")
    what.add_argument("--dataset", default="digits", help=f"default digits. {_listing(DATASETS)}")
    what.add_argument(
        "--data-dir", metavar="DIR", help="where the local copy of --dataset cifar10 lives"
    )
    what.add_argument(
        "--limit",
        type=int,
        metavar="N",
        help="use only the first N training and N test images (smoke runs)",
    )

    how = parser.add_argument_group("how")
    how.add_argument(
        "--api",
        choices=APIS,
        default="facade",
        help="facade: apex-compatible fp16fx.FP16_Optimizer (default); functional: "
        "fp16fx.init/step with torch.func.functional_call",
    )
    how.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    how.add_argument("--epochs", type=int, help="default: the data set's (digits 6)")
    how.add_argument("--batch-size", type=int, help="default: the data set's (digits 32)")
    how.add_argument("--lr", type=float, help="Adam's peak learning rate (digits: 3e-3)")
    how.add_argument(
        "--lr-schedule",
        choices=SCHEDULES,
        default="cosine",
        help="cosine decay to 0 over the run (default) or constant",
    )
    how.add_argument(
        "--seed", type=cli.seed, default=0, help="model init and batch order (default 0)"
    )
    how.add_argument(
        "--loss-scale",
        type=_loss_scale,
        default="dynamic",
        metavar="dynamic|NUMBER",
        help="dynamic loss scaling (default) or a static scale such as 128",
    )
    how.add_argument(
        "--masters",
        "--master",  # the API's name; torchrun's parser refuses it as ambiguous
        dest="master",
        choices=MASTERS,
        help="fp32: an FP32 master copy of every FP16 param; compensated: no FP32 copy, the "
        "FP16 param plus an int8 correction carry the master (with --api functional the "
        "params then move into flat buckets). Default: fp32, or with --resume the "
        "checkpoint's (given, it converts the checkpoint's state). Under torchrun spell it "
        "--masters: torchrun refuses --master as an ambiguous abbreviation of its "
        "--master-addr and --master-port",
    )
    how.add_argument(
        "--moments",
        choices=MOMENTS,
        help="how Adam's moments are stored between steps: fp32, bf16 or int8 (block-scaled); "
        "the math is FP32 either way. Default: fp32, or with --resume the checkpoint's "
        "(given, it converts the checkpoint's state)",
    )
    how.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile the step with torch.compile: FP16_Optimizer's compiled fast path, or "
        "fp16fx.compile_step(inplace=True) instead of the pure fp16fx.step (default: on with "
        "CUDA; off on a CPU, where compiling costs more time than it saves for small models)",
    )
    how.add_argument(
        "--compare-fp32",
        action="store_true",
        help="also train the same model in FP32 (torch.optim.Adam) and compare",
    )
    how.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="train data-parallel in N local processes (torch's launcher, as torchrun "
        "--standalone): each takes --batch-size images of every step's N x --batch-size, the "
        "gradients are averaged (DDP, or fdist.average_grads with --api functional); one GPU "
        "per process on CUDA, gloo on CPUs. Rank 0 logs, saves and prints the table. "
        "Default: this process alone (or the processes torchrun started)",
    )

    how.add_argument(
        "--fsdp",
        action="store_true",
        help="with --nproc-per-node N (or torchrun): shard the FP32 model with FSDP2 "
        "(fully_shard, FP16 compute; with --masters compensated the FP16 model) instead of "
        "DDP on an FP16 model; FP16_Optimizer steps each process's shards, every process "
        "agreeing on skips and the gradient norm",
    )

    out = parser.add_argument_group("output")
    out.add_argument(
        "--save",
        metavar="PATH",
        help="write a checkpoint after every epoch; PATH must not exist yet, unless it is the "
        "--resume checkpoint or an empty file (refused before training: nothing is replaced)",
    )
    out.add_argument(
        "--resume",
        metavar="PATH",
        help="continue from this checkpoint (of the same --model, --dataset, --api, --seed, "
        "--fsdp, --loss-scale, --batch-size, --lr, --lr-schedule and --limit; --epochs may "
        "grow). It keeps the checkpoint's --masters and --moments; given others, its "
        "optimizer state is converted to them",
    )
    out.add_argument(
        "--plot", metavar="FILE.png", help="save loss/accuracy/loss-scale curves (matplotlib)"
    )
    out.add_argument(
        "--quiet", action="store_true", help="no progress bars and no log lines, only the table"
    )


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``train`` subcommand on ``subparsers``; its handler is :func:`run`."""
    parser = subparsers.add_parser(
        "train",
        help="train a model in FP16 with fp16fx (default: a CNN on handwritten digits)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(handler=run)
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Returns the session settings of parsed ``fp16fx train`` arguments."""
    return TrainConfig(
        model=args.model,
        dataset=args.dataset,
        data_dir=args.data_dir,
        api=args.api,
        device=args.device,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        lr_schedule=args.lr_schedule,
        seed=args.seed,
        loss_scale=args.loss_scale,
        master=args.master,
        moments=args.moments,
        compile=args.compile,
        limit=args.limit,
        compare_fp32=args.compare_fp32,
        save=args.save,
        resume=args.resume,
        progress=not args.quiet and sys.stderr.isatty(),
        plot=args.plot,
        fsdp=args.fsdp,
    )


@contextlib.contextmanager
def _log_to_stderr(quiet: bool) -> Iterator[None]:
    """Shows the ``fp16fx`` logger's INFO lines on stderr for the duration (unless quiet)."""
    log = logging.getLogger("fp16fx")
    if quiet or log.handlers:  # quiet, or the embedding program set up logging itself
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("fp16fx: %(message)s"))
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)


def _fail(message: str) -> int:
    print(f"fp16fx train: error: {message}", file=sys.stderr)
    return 1


def train_and_report(config: TrainConfig, quiet: bool) -> None:
    """Trains ``config`` in this process and, on rank 0, prints the table and saves the plot.

    Alone, or as one of the processes torchrun (or ``--nproc-per-node``) started: then it
    joins their process group for the run, and the other ranks log nothing. Raises what
    :func:`~fp16fx.train.session.train` and :func:`~fp16fx.train.report.save_plot` raise.
    """
    processes = Processes.from_env()
    with contextlib.ExitStack() as stack:
        if processes is not None:
            stack.enter_context(process_group(processes, resolve_device(config.device).type))
        main = processes is None or processes.is_main
        stack.enter_context(_log_to_stderr(quiet or not main))
        result = train(config)
    if not main:
        return
    sys.stdout.write("\n" + format_summary(result.title, result.runs))
    if config.plot is not None:
        save_plot(config.plot, result.runs)
        print(f"plot saved to {config.plot}")
    sys.stdout.flush()  # before a launched process exits, so rank 0's table is never lost


#: The torchrun variables that hold a count or a port: a non-negative integer.
_INTEGER_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")


def _check_environment() -> None:
    """Raises SetupError naming a torchrun variable set to no non-negative integer (reading
    it ended in int()'s traceback)."""
    for name in _INTEGER_VARIABLES:
        text = os.environ.get(name)
        if text is not None and not text.strip().isdecimal():
            raise SetupError(
                f"the environment's {name} is {text!r}, not a non-negative integer: start the "
                "processes with torchrun (which sets it), or unset it"
            )


def _start(config: TrainConfig, args: argparse.Namespace) -> None:
    """Trains ``config`` here, in the processes torchrun started, or in new ones."""
    _check_environment()
    started = Processes.from_env()
    nproc = args.nproc_per_node
    if started is not None:  # under torchrun: its processes are the ones to use
        missing = [
            name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ
        ]
        if missing:
            raise SetupError(
                f"WORLD_SIZE is set but {', '.join(missing)} not: start the processes with "
                "torchrun (which sets them all), or unset WORLD_SIZE"
            )
        if nproc is not None and nproc != started.local_size:
            raise SetupError(
                f"--nproc-per-node {nproc}, but torchrun started {started.local_size} processes "
                "per node: give the count to torchrun only"
            )
        check_processes(started.local_size, resolve_device(config.device))
    elif nproc is not None:
        check_processes(nproc, resolve_device(config.device))
        if nproc > 1:
            preflight(config, nproc)  # bad flags or files: one line now, no processes started
            launch(train_and_report, (config, args.quiet), nproc)
            return
    train_and_report(config, args.quiet)


def _report_worker(exc: WorkerError) -> int:
    if exc.kind in {error.__name__ for error in USER_ERRORS}:
        return _fail(exc.message)  # all processes failed alike; this is the first one's
    sys.stderr.write(exc.traceback)
    return _fail(str(exc))


def _file_identity(path: str | None) -> tuple[int, int] | None:
    """Returns the inode and modification time of the file at ``path`` (None: no file). An
    atomic save replaces the file, so a save changes both."""
    if path is None:
        return None
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_ino, info.st_mtime_ns


def _last_checkpoint(config: TrainConfig, saved_before: tuple[int, int] | None) -> str:
    """Says where an interrupted run can resume from: its ``--save`` if this run wrote it
    (the file changed since it started, when it was ``saved_before``), else its ``--resume``.
    Rank 0 alone saves, so under torchrun the others say nothing of it (the file may be on
    another machine)."""
    env = Processes.from_env()
    if config.save is None or (env is not None and not env.is_main):
        return ""
    now = _file_identity(config.save)
    if now is not None and now != saved_before:
        return f"; the last checkpoint is {config.save}"
    since = f"; {config.resume} is the last checkpoint" if config.resume else ""
    return f"; no epoch finished, so nothing was saved to {config.save}{since}"


def run(args: argparse.Namespace) -> int:
    """Run ``fp16fx train`` with parsed ``args``; print the summary; return the exit code.

    Every expected failure (bad names, missing data, bad checkpoint, unwritable path, no
    matplotlib for ``--plot``, more processes than GPUs) prints one line on stderr and returns
    1; Ctrl-C returns 130. Under torchrun, each process reports its own failure.
    """
    config = config_from_args(args)
    saved_before = _file_identity(config.save)
    try:
        _start(config, args)
    except USER_ERRORS as exc:
        return _fail(str(exc))
    except WorkerError as exc:
        return _report_worker(exc)
    except ModuleNotFoundError as exc:
        module = (exc.name or "").partition(".")[0]
        if module not in TRAIN_EXTRA_MODULES:
            raise
        return _fail(
            f"the '{module}' module is missing: fp16fx train needs the 'train' extra "
            "(pip install 'fp16fx[train]')"
        )
    except KeyboardInterrupt:
        last = _last_checkpoint(config, saved_before)
        print(f"\nfp16fx train: interrupted{last}", file=sys.stderr)
        return 130
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m fp16fx.train``: parse ``argv`` and :func:`run`."""
    parser = argparse.ArgumentParser(
        prog="python -m fp16fx.train",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
