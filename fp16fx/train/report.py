"""What ``fp16fx train`` shows at the end: the summary table and the optional plot."""

from __future__ import annotations

import dataclasses
import math

from fp16fx.train import outputs
from fp16fx.train.loop import History

__all__ = ["PlotError", "RunSummary", "check_plotting", "format_summary", "save_plot"]


class PlotError(RuntimeError):
    """Plotting is impossible (matplotlib missing, file not writable); the message says why."""


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """One trained model's results, a column of the summary table.

    Attributes:
      name: the column's heading, e.g. ``"FP16"``.
      label: what was trained and how (shown under the table).
      history: the run's :class:`~fp16fx.train.loop.History`.
      processes: how many processes trained it together (data parallelism).
      replicas_equal: whether they all ended with bitwise the same replicated state
        (:meth:`~fp16fx.train.steppers.Stepper.replicated`).
    """

    name: str
    label: str
    history: History
    processes: int = 1
    replicas_equal: bool = True


def _rows(run: RunSummary) -> list[str]:
    h = run.history
    scale = h.final_loss_scale
    return [
        f"{100 * h.test_accuracy:.2f}%",
        f"{h.images_per_second:,.0f}",
        f"{h.skipped} / {h.steps}",
        "-" if math.isnan(scale) else f"{scale:g}",
        f"{h.wall_seconds:.1f} s",
        _describe_processes(run),
    ]


def _describe_processes(run: RunSummary) -> str:
    if run.processes == 1:
        return "1"
    return f"{run.processes}, {'in sync' if run.replicas_equal else 'DIVERGED'}"


#: images/s counts the images of all processes together.
_ROW_NAMES = (
    "test accuracy",
    "images/s",
    "steps skipped",
    "final loss scale",
    "wall time",
    "processes",
)


def format_summary(title: str, runs: list[RunSummary]) -> str:
    """Returns the summary table: one row per measure, one column per run, then a legend."""
    cells = [_rows(run) for run in runs]
    first = max(len(name) for name in _ROW_NAMES)
    widths = [max(len(run.name), *(len(c) for c in col)) for run, col in zip(runs, cells)]
    lines = [title, ""]
    lines.append(" " * first + "".join(f"  {r.name:>{w}}" for r, w in zip(runs, widths)))
    lines.append("-" * first + "".join("  " + "-" * w for w in widths))
    for i, row_name in enumerate(_ROW_NAMES):
        values = "".join(f"  {col[i]:>{w}}" for col, w in zip(cells, widths))
        lines.append(f"{row_name:<{first}}{values}")
    lines.append("")
    lines += [f"{run.name}: {run.label}" for run in runs]
    return "\n".join(lines) + "\n"


def check_plotting(path: str) -> None:
    """Returns None when ``path`` can receive a plot; raises :class:`PlotError` otherwise.

    Called before training, so that a missing matplotlib fails at once, not after the run.
    (Whether the file can be written is checked last, with the checkpoint's:
    :func:`fp16fx.train.outputs.problem`.)
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError(
            "--plot needs matplotlib, which is not installed: pip install 'fp16fx[plot]'"
        ) from None
    if not path.lower().endswith((".png", ".pdf", ".svg")):
        raise PlotError(f"--plot {path}: the file name must end in .png, .pdf or .svg")


def save_plot(path: str, runs: list[RunSummary]) -> None:
    """Writes loss, test accuracy and loss-scale curves of ``runs`` to the image ``path``."""
    check_plotting(path)
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc, ax_scale) = plt.subplots(1, 3, figsize=(15, 4))
    for run in runs:
        h = run.history
        ax_loss.plot(h.step_epochs, h.step_loss, label=run.name)
        ax_acc.plot(
            [e.epoch for e in h.epochs],
            [100 * e.test_accuracy for e in h.epochs],
            marker="o",
            label=run.name,
        )
        if not all(math.isnan(s) for s in h.step_loss_scale):
            ax_scale.plot(h.step_epochs, h.step_loss_scale, label=run.name)
    ax_loss.set(title="training loss", xlabel="epoch", yscale="log")
    ax_acc.set(title="test accuracy (%)", xlabel="epoch")
    ax_scale.set(title="loss scale", xlabel="epoch", yscale="log")
    for ax in (ax_loss, ax_acc, ax_scale):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    try:  # atomically, as a checkpoint: a crash leaves the old image or the new one
        kind = path.rsplit(".", 1)[-1].lower()
        outputs.write_atomic(path, lambda f: fig.savefig(f, dpi=100, format=kind))
    except OSError as exc:
        raise PlotError(f"could not write the plot {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
