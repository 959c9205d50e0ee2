"""The accuracy of fp16fx's compact precision against FP32 masters: one command, the table.

fp16fx can keep an optimizer state smaller than FP32 masters and FP32 moments: a *compensated*
master (no FP32 copy: the FP16 param plus an int8 correction carry it) and BF16 or int8
moments. This script measures what that costs in accuracy, on two real tasks that need
nothing but this repository's dependencies and no download, each trained with several seeds
per precision mode against the FP32-master baseline (FP32 master, FP32 moments):

1. ``digits``: ``fp16fx train``'s default task -- a small CNN on scikit-learn's handwritten
   digits, as an FP16 model (FP16 storage and FP16 math, BatchNorm FP32) -- run in this
   process through :func:`fp16fx.train.session.train`. Measured: the test accuracy (360
   images: one image is 0.28 points). Target: the mean within 0.3 points of the baseline's.
2. ``lm``: a character-level language model -- a tiny causal transformer -- trained on
   the Python standard library's own source files (``Lib/*.py`` of the running
   interpreter, a fixed sorted subset; every tenth file held out), with *FP16 storage,
   FP32 math*: the weights fp16fx trains are FP16 tensors, the forward upcasts them to FP32
   (``functional_call`` with ``{name: w.float()}``), the loss is scaled with
   ``fp16fx.scale_loss``, and the gradients reach the optimizer as FP16 tensors (the
   backward of the upcast casts them), so their underflow and overflow are real. The
   functional API: ``fp16fx.init(params, fp16fx.adamw(lr), buckets=True, master=...,
   moments=...)`` and ``fp16fx.step``. Measured: the cross-entropy on the held-out text in
   nats per character. Target: the mean within 1% of the baseline's.

Every mode trains the same steps on the same batches from the same initial weights for a
given seed. The table gives per mode the mean and the sample standard deviation over the
seeds, the difference of the means against the baseline, whether it meets the target, and
each seed's value.

Run (the default, 3 seeds x 4 modes on both tasks, takes about half an hour on 2 CPU cores)::

    python examples/precision_table.py
    python examples/precision_table.py --only lm --seeds 5 --steps 600
    python examples/precision_table.py --modes fp32,compensated+int8
    python examples/precision_table.py --quick --seeds 1       # a tiny smoke configuration

A mode is ``MASTER[+MOMENTS]``: MASTER ``fp32`` or ``compensated``, MOMENTS ``fp32`` (the
default), ``bf16`` or ``int8``. The baseline ``fp32`` always runs, first.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad

import fp16fx
from fp16fx.precision import MASTERS, MOMENTS
from fp16fx.train import TrainConfig, train
from fp16fx.train.data import load_dataset
from fp16fx.train.steppers import DEFAULT_PRECISION

#: The modes measured by default: the baseline first.
DEFAULT_MODES = ("fp32", "compensated", "compensated+bf16", "compensated+int8")

#: The targets: digits' accuracy in points, the LM's eval loss relative to the baseline's.
DIGITS_TARGET_POINTS = 0.3
LM_TARGET_RELATIVE = 0.01


# -- modes and statistics ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Mode:
    """A precision of the optimizer state: where the masters live, how the moments are kept."""

    master: str = DEFAULT_PRECISION["master"]
    moments: str = DEFAULT_PRECISION["moments"]

    @property
    def name(self) -> str:
        """``"fp32"``, ``"compensated"``, ``"compensated+int8"``: moments only when not FP32."""
        if self.moments == DEFAULT_PRECISION["moments"]:
            return self.master
        return f"{self.master}+{self.moments}"

    @property
    def is_baseline(self) -> bool:
        return self == BASELINE

    def keywords(self) -> dict[str, str]:
        """Returns the ``master``/``moments`` keywords that differ from the defaults: none for
        the baseline, so that it runs on any fp16fx, with or without compact precision."""
        given = {"master": self.master, "moments": self.moments}
        return {k: v for k, v in given.items() if v != DEFAULT_PRECISION[k]}


BASELINE = Mode()


def parse_modes(text: str) -> list[Mode]:
    """Returns the modes of ``--modes`` (``"fp32,compensated+int8"``), the baseline first."""
    modes = [BASELINE]
    for item in text.split(","):
        master, _, moments = item.strip().partition("+")
        moments = moments or DEFAULT_PRECISION["moments"]
        if master not in MASTERS or moments not in MOMENTS:
            raise argparse.ArgumentTypeError(
                f"bad mode {item.strip()!r}: give MASTER[+MOMENTS], MASTER one of "
                f"{', '.join(MASTERS)}, MOMENTS one of {', '.join(MOMENTS)}"
            )
        mode = Mode(master, moments)
        if mode not in modes:
            modes.append(mode)
    return modes


def check_modes(modes: Sequence[Mode], facade: bool) -> None:
    """Returns None when this fp16fx builds a state of every mode (``fp16fx.init``, and
    ``FP16_Optimizer`` when ``facade``) on a tiny FP16 param; exits with the reason otherwise,
    before anything trains."""
    for mode in modes:
        if mode.is_baseline:
            continue
        param = torch.zeros(8, dtype=torch.float16)
        try:
            fp16fx.init({"w": param}, fp16fx.adamw(), buckets=True, **mode.keywords())
            if facade:
                adam = torch.optim.Adam([nn.Parameter(param.clone())])
                fp16fx.FP16_Optimizer(adam, verbose=False, **mode.keywords())
        except (TypeError, ValueError, NotImplementedError) as exc:
            raise SystemExit(
                f"precision_table: this fp16fx cannot run mode {mode.name!r}: "
                f"{type(exc).__name__}: {exc}"
            ) from None


@dataclasses.dataclass(frozen=True)
class Runs:
    """One mode's results: a value per seed and the seconds each run took."""

    mode: Mode
    values: list[float]
    seconds: list[float]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def std(self) -> float:
        """The sample standard deviation over the seeds (NaN with one seed)."""
        return statistics.stdev(self.values) if len(self.values) > 1 else math.nan


def _pm(mean: float, std: float, digits: int) -> str:
    spread = "n/a" if math.isnan(std) else f"{std:.{digits}f}"
    return f"{mean:.{digits}f} ± {spread}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Returns a markdown table (numbers right-aligned: every column but the first two)."""
    align = ["---", "---"] + ["---:"] * (len(header) - 2)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def measure(
    modes: Sequence[Mode], seeds: Sequence[int], run_one: Callable[[Mode, int], tuple[float, str]]
) -> list[Runs]:
    """Returns each mode's :class:`Runs` after calling ``run_one(mode, seed) -> (value, what
    to print)`` for each seed, printing a line per run as it ends."""
    results = []
    for mode in modes:
        values, seconds = [], []
        for seed in seeds:
            start = time.perf_counter()
            value, shown = run_one(mode, seed)
            seconds.append(time.perf_counter() - start)
            values.append(value)
            print(f"  {mode.name:<17} seed {seed}: {shown} ({seconds[-1]:.1f} s)", flush=True)
        results.append(Runs(mode, values, seconds))
    return results


# -- (a) digits: fp16fx train ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DigitsSetup:
    """``fp16fx train``'s settings for every digits run (None: the command's defaults)."""

    api: str = "facade"
    device: str = "cpu"
    epochs: int | None = None
    limit: int | None = None


class DigitsRunner:
    """Runs ``fp16fx train`` (the default task) in this process, one mode and seed at a time.

    Attributes:
      title: what the last run trained (model, data, epochs, steps, lr), without its seed.
      label: how the baseline trained (the stepper's label).
    """

    def __init__(self, setup: DigitsSetup) -> None:
        self.setup = setup
        self.title = ""
        self.label = ""
        test = len(load_dataset("digits").test)
        self.test_images = test if setup.limit is None else min(setup.limit, test)

    def __call__(self, mode: Mode, seed: int) -> tuple[float, str]:
        config = TrainConfig(
            api=self.setup.api,
            device=self.setup.device,
            epochs=self.setup.epochs,
            limit=self.setup.limit,
            seed=seed,
            master=mode.master,
            moments=mode.moments,
        )
        result = train(config)
        run = result.runs[0]
        self.title = result.title.removeprefix("fp16fx train: ").rsplit(", seed", 1)[0]
        if mode.is_baseline:
            self.label = run.label
        history = run.history
        shown = (
            f"test accuracy {100 * history.test_accuracy:.2f}%, "
            f"{history.skipped}/{history.steps} steps skipped"
        )
        return history.test_accuracy, shown


def _rows(
    results: list[Runs],
    *,
    scale: float,
    decimals: int,
    change: Callable[[float, float], float],
    unit: str,
    target: float,
) -> list[list[str]]:
    """Returns one table row per mode: master, moments, the mean ± std and each seed's value
    (times ``scale``), the mean's ``change`` from the baseline's (in ``unit``), whether that
    is within ``target``, and the seconds per run."""
    base = results[0].mean
    rows = []
    for runs in results:
        delta = change(runs.mean, base)
        rows.append(
            [
                _master_cell(runs.mode),
                runs.mode.moments,
                _pm(scale * runs.mean, scale * runs.std, decimals),
                "—" if runs.mode.is_baseline else f"{delta:+.2f}{unit}",
                "—" if runs.mode.is_baseline else _yes(abs(delta) <= target),
                ", ".join(f"{scale * v:.{decimals}f}" for v in runs.values),
                _s_per_run(runs),
            ]
        )
    return rows


def digits_section(runner: DigitsRunner, results: list[Runs]) -> str:
    """Returns the digits section of the report: heading, what ran, the table."""
    rows = _rows(
        results,
        scale=100,
        decimals=2,
        change=lambda mean, base: 100 * (mean - base),
        unit="",
        target=DIGITS_TARGET_POINTS,
    )
    header = [
        "master",
        "moments",
        "test accuracy % (mean ± std)",
        "Δ mean (points)",
        f"within {DIGITS_TARGET_POINTS} points",
        "per seed (%)",
        "s/run",
    ]
    return "\n".join(
        [
            "### Digits: `fp16fx train` test accuracy",
            "",
            f"{runner.title}; {_seeds_text(results)}.",
            f"Numerics: **FP16 storage, FP16 math** (`fp16fx train`'s FP16 model, BatchNorm "
            f"FP32). Optimizer: {runner.label.split(';')[0]}, plus the mode's precision.",
            f"Target: the mean within {DIGITS_TARGET_POINTS} points of the FP32-master "
            f"baseline's (one test image is {100 / runner.test_images:.2f} points).",
            "",
            markdown_table(header, rows),
        ]
    )


# -- (b) a character-level language model on the standard library's source ------------------


@dataclasses.dataclass(frozen=True)
class LMSetup:
    """The language model, its text and its training (the same for every mode and seed).

    Attributes:
      text_bytes: how much of the standard library's source to read (train and held out).
      held_out_every: every n-th file (in sorted order) is held out for evaluation.
      width, layers, heads, context: the transformer (context: characters per window).
      batch, steps, lr, warmup, beta2, weight_decay: training: AdamW (beta1 0.9), linear
        warmup, then cosine decay to 0.
      eval_windows: held-out windows of ``context`` characters the eval loss averages.
      compile: step with ``fp16fx.compile_step(inplace=True)`` instead of ``fp16fx.step``.
    """

    text_bytes: int = 3_000_000
    held_out_every: int = 10
    width: int = 128
    layers: int = 2
    heads: int = 4
    context: int = 128
    batch: int = 32
    steps: int = 400
    lr: float = 3e-3
    warmup: int = 40
    beta2: float = 0.99
    weight_decay: float = 0.01
    eval_windows: int = 512
    compile: bool = False


#: ``--quick``: a few seconds per run, for smoke tests (the loss means little).
QUICK_LM = LMSetup(
    text_bytes=300_000,
    width=32,
    layers=1,
    heads=2,
    context=32,
    batch=8,
    steps=20,
    warmup=4,
    eval_windows=16,
)


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The text, as bytes (the sources are ASCII but for a few characters: a byte is a
    character), split by file into training and held-out text."""

    train: torch.Tensor
    held_out: torch.Tensor
    description: str


def load_corpus(setup: LMSetup) -> Corpus:
    """Returns the first ``setup.text_bytes`` of this interpreter's ``Lib/*.py`` (the files
    in sorted order, whole), every ``held_out_every``-th file held out."""
    lib = os.path.dirname(os.__file__)
    names = sorted(name for name in os.listdir(lib) if name.endswith(".py"))
    train_parts, held_parts, size = [], [], 0
    for i, name in enumerate(names):
        if size >= setup.text_bytes:
            break
        with open(os.path.join(lib, name), "rb") as f:
            data = f.read()
        held = i % setup.held_out_every == setup.held_out_every - 1
        (held_parts if held else train_parts).append(data)
        size += len(data)
    train_text, held_text = b"".join(train_parts), b"".join(held_parts)
    if len(held_text) < setup.context + 1 or len(train_text) < setup.context + 1:
        raise SystemExit(f"too little text in {lib}: {size:,} bytes")
    ascii_share = sum(b < 128 for b in train_text + held_text) / size
    version = platform.python_version()
    description = (
        f"{size / 1e6:.2f} MB of {platform.python_implementation()} {version}'s `Lib/*.py` "
        f"(the first {len(train_parts) + len(held_parts)} files in sorted order, "
        f"{100 * ascii_share:.3f}% ASCII; one byte = one character): "
        f"{len(train_text) / 1e6:.2f} MB train, every {setup.held_out_every}th file held out "
        f"({len(held_parts)} files, {len(held_text) / 1e3:.0f} kB)"
    )
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
    return Corpus(as_tensor(train_text), as_tensor(held_text), description)


class Block(nn.Module):
    """A pre-LayerNorm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyLM(nn.Module):
    """A character (byte) level causal transformer: 256 symbols in, 256 logits out."""

    def __init__(self, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256)
        # GPT-2's initialization: N(0, 0.02), residual outputs scaled down by depth.
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = (
                    0.02 / math.sqrt(2 * layers)
                    if name.endswith(("proj.weight", "out.weight"))
                    else 0.02
                )
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def fp32_math(model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Returns ``model(x)`` computed in FP32 from FP16 ``params``: the forward upcasts each,
    and the backward of the upcast returns FP16 gradients."""
    return functional_call(model, {name: w.float() for name, w in params.items()}, (x,))


class LMRunner:
    """Trains and evaluates the language model, one mode and seed at a time."""

    def __init__(self, setup: LMSetup, device: torch.device) -> None:
        self.setup = setup
        self.device = device
        self.corpus = load_corpus(setup)
        self.train_text = self.corpus.train.to(device)
        self.eval_batches = self._eval_windows()
        self.params = sum(p.numel() for p in self._model().parameters())
        self.unigram = self._unigram_loss()

    def _model(self) -> TinyLM:
        s = self.setup
        return TinyLM(s.width, s.layers, s.heads, s.context).half().to(self.device)

    def _eval_windows(self) -> list[torch.Tensor]:
        """Returns the held-out windows (context + 1 bytes each, evenly spaced), in batches."""
        s, text = self.setup, self.corpus.held_out
        last = len(text) - s.context - 1
        count = min(s.eval_windows, last + 1)
        starts = torch.linspace(0, last, count).long()
        windows = text[starts[:, None] + torch.arange(s.context + 1)].long().to(self.device)
        return list(windows.split(64))

    def _unigram_loss(self) -> float:
        """Returns the eval loss of the training text's byte frequencies (add-one)."""
        counts = torch.bincount(self.corpus.train.long(), minlength=256).double() + 1
        logp = (counts / counts.sum()).log().to(self.device)
        targets = torch.cat([w[:, 1:].reshape(-1) for w in self.eval_batches])
        return -logp[targets].mean().item()

    def lr(self, step: int) -> float:
        """Returns the learning rate of step ``step``: linear warmup, then cosine to 0."""
        s = self.setup
        if step < s.warmup:
            return s.lr * (step + 1) / s.warmup
        progress = (step - s.warmup) / max(s.steps - s.warmup, 1)
        return s.lr * 0.5 * (1 + math.cos(math.pi * progress))

    def evaluate(self, model: nn.Module, params: dict[str, torch.Tensor]) -> float:
        """Returns the mean cross-entropy (nats per character) on the held-out windows."""
        total, count = 0.0, 0
        with torch.no_grad():
            for window in self.eval_batches:
                logits = fp32_math(model, params, window[:, :-1])
                loss = F.cross_entropy(
                    logits.flatten(0, 1), window[:, 1:].flatten(), reduction="sum"
                )
                total += loss.item()
                count += window[:, 1:].numel()
        return total / count

    def __call__(self, mode: Mode, seed: int) -> tuple[float, str]:
        s = self.setup
        torch.manual_seed(seed)
        model = self._model()
        # The module's own params: buckets=True re-points them at views of its flat buffer.
        params = dict(model.named_parameters())
        state = fp16fx.init(
            params,
            fp16fx.adamw(s.lr, betas=(0.9, s.beta2), weight_decay=s.weight_decay),
            buckets=True,
            **mode.keywords(),
        )
        step = fp16fx.compile_step(inplace=True) if s.compile else fp16fx.step

        def scaled_loss(
            params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            loss = F.cross_entropy(fp32_math(model, params, x).flatten(0, 1), y.flatten())
            return fp16fx.scale_loss(state, loss), loss.detach()

        grad_fn = grad(scaled_loss, has_aux=True)
        batches = torch.Generator().manual_seed(seed)
        offsets = torch.arange(s.context + 1, device=self.device)
        skipped = torch.zeros((), dtype=torch.int64, device=self.device)
        recent = []
        for i in range(s.steps):
            starts = torch.randint(
                0, len(self.train_text) - s.context - 1, (s.batch, 1), generator=batches
            )
            chunk = self.train_text[starts.to(self.device) + offsets].long()
            fp16fx.set_hyperparams(state, lr=self.lr(i), inplace=True)
            grads, loss = grad_fn(state.params, chunk[:, :-1], chunk[:, 1:])
            state, info = step(state, grads)
            skipped += ~info.finite
            if i >= s.steps - 20:
                recent.append(loss)
        eval_loss = self.evaluate(model, state.params)
        scale = state.loss_scale.scale.item()
        shown = (
            f"eval loss {eval_loss:.4f} nats/char (train {torch.stack(recent).mean():.3f}), "
            f"{skipped.item()}/{s.steps} steps skipped, loss scale {scale:g}"
        )
        return eval_loss, shown


def lm_section(runner: LMRunner, results: list[Runs]) -> str:
    """Returns the language model's section of the report: heading, what ran, the table."""
    s = runner.setup
    rows = _rows(
        results,
        scale=1,
        decimals=4,
        change=lambda mean, base: 100 * (mean - base) / base,
        unit="%",
        target=100 * LM_TARGET_RELATIVE,
    )
    header = [
        "master",
        "moments",
        "eval loss, nats/char (mean ± std)",
        "Δ mean (relative)",
        f"within {100 * LM_TARGET_RELATIVE:g}%",
        "per seed",
        "s/run",
    ]
    step = "fp16fx.compile_step(inplace=True)" if s.compile else "fp16fx.step"
    return "\n".join(
        [
            "### Character-level language model on the Python standard library's source",
            "",
            f"A causal transformer ({s.layers} layers, width {s.width}, {s.heads} heads, "
            f"{runner.params:,} params, context {s.context} characters); {s.steps} steps of "
            f"{s.batch} x {s.context} characters; `fp16fx.adamw` (lr {s.lr:g}, betas (0.9, "
            f"{s.beta2:g}), weight decay {s.weight_decay:g}, {s.warmup} warmup steps, cosine "
            f"decay to 0) through `fp16fx.init(..., buckets=True)` and `{step}`, dynamic loss "
            f"scale; {_seeds_text(results)}.",
            "Numerics: **FP16 storage, FP32 math**: the trained weights are FP16 tensors, the "
            "forward upcasts them to FP32, the loss is scaled (`fp16fx.scale_loss`), and the "
            "gradients reach the optimizer as FP16 tensors.",
            f"Text: {runner.corpus.description}. Eval: the cross-entropy on "
            f"{sum(len(w) for w in runner.eval_batches)} held-out windows "
            f"({sum(w[:, 1:].numel() for w in runner.eval_batches):,} predicted characters); "
            f"a unigram model (the training text's byte frequencies) scores "
            f"{runner.unigram:.4f} nats/char there.",
            f"Target: the mean within {100 * LM_TARGET_RELATIVE:g}% of the FP32-master baseline's.",
            "",
            markdown_table(header, rows),
        ]
    )


# -- the report -------------------------------------------------------------------------------


def _master_cell(mode: Mode) -> str:
    return mode.master + (" (baseline)" if mode.is_baseline else "")


def _seeds_text(results: list[Runs]) -> str:
    n = len(results[0].values)
    return f"{n} seed{'s' if n != 1 else ''} per mode, the same seeds for every mode"


def _s_per_run(runs: Runs) -> str:
    return f"{statistics.fmean(runs.seconds):.0f}"


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="A mode is MASTER[+MOMENTS]: MASTER fp32 or compensated, MOMENTS fp32 (default), "
        "bf16 or int8. The baseline fp32 always runs.",
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds per mode: 0..N-1 (default 3)")
    parser.add_argument(
        "--modes",
        type=parse_modes,
        default=parse_modes(",".join(DEFAULT_MODES)),
        help=f"comma-separated precision modes (default: {','.join(DEFAULT_MODES)})",
    )
    parser.add_argument("--only", choices=("digits", "lm"), help="run one of the two studies")
    parser.add_argument("--steps", type=int, help="language model: training steps (default 400)")
    parser.add_argument("--quick", action="store_true", help="a tiny configuration (smoke tests)")
    parser.add_argument(
        "--digits-api",
        choices=("facade", "functional"),
        default="facade",
        help="the API fp16fx train uses on digits (default facade: FP16_Optimizer)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="language model: step with fp16fx.compile_step(inplace=True), not fp16fx.step",
    )
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        parser.error(f"--device {args.device!r} is no device torch knows (cpu or cuda)")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {args.device!r}: this script runs on cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"--device {args.device!r}: CUDA is not available here (use cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            parser.error(
                f"--device {args.device!r}: there is no such GPU here "
                f"({torch.cuda.device_count()} visible)"
            )
    seeds = list(range(args.seeds))
    logging.getLogger("fp16fx").setLevel(logging.WARNING)  # the runs' own log lines: not shown

    check_modes(args.modes, facade=args.only != "lm" and args.digits_api == "facade")
    start = time.perf_counter()
    print(
        f"precision table: modes {', '.join(m.name for m in args.modes)}; seeds "
        f"{', '.join(map(str, seeds))}; Python {platform.python_version()}, torch "
        f"{torch.__version__}, {device}, {torch.get_num_threads()} threads"
        + ("; --quick" if args.quick else ""),
        flush=True,
    )
    sections = []
    if args.only in (None, "digits"):
        setup = DigitsSetup(api=args.digits_api, device=str(device))  # cuda:1 too
        if args.quick:
            setup = dataclasses.replace(setup, epochs=1, limit=256)
        runner = DigitsRunner(setup)
        print(f"digits: fp16fx train, {setup.api} API", flush=True)
        sections.append(digits_section(runner, measure(args.modes, seeds, runner)))
    if args.only in (None, "lm"):
        lm_setup = QUICK_LM if args.quick else LMSetup()
        if args.steps is not None:
            lm_setup = dataclasses.replace(
                lm_setup, steps=args.steps, warmup=min(lm_setup.warmup, args.steps)
            )
        lm_setup = dataclasses.replace(lm_setup, compile=args.compile)
        runner = LMRunner(lm_setup, device)
        print(
            f"language model: {runner.params:,} params, {lm_setup.steps} steps; "
            f"unigram eval loss {runner.unigram:.4f} nats/char",
            flush=True,
        )
        sections.append(lm_section(runner, measure(args.modes, seeds, runner)))
    minutes = (time.perf_counter() - start) / 60
    print("\n## fp16fx compact precision: accuracy against FP32 masters\n")
    print("\n\n".join(sections))
    print(
        f"\nMean ± sample standard deviation over the seeds; Δ: the difference of the means "
        f"against the baseline's (with n seeds, about std x sqrt(2/n) of it is noise). "
        f"Python {platform.python_version()}, torch {torch.__version__}, {device}, "
        f"{torch.get_num_threads()} threads; {minutes:.1f} minutes in all."
    )


if __name__ == "__main__":
    sys.exit(main())
