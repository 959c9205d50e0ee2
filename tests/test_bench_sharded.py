"""Tests of ``fp16fx bench --world-sizes``: the sharded step measured per rank in gloo workers.

Speed is never asserted. The one spawning test runs two processes on a tiny preset (~10-20 s on
two cores, most of it starting the processes and compiling the shard's step).
"""

from __future__ import annotations

import json
import math

import pytest

import fp16fx
import fp16fx.distributed as fdist
from fp16fx.bench import command, sharded_worker
from fp16fx.bench.presets import Preset, custom_shapes, make_param_set
from fp16fx.bench.runner import BenchConfig
from fp16fx.bench.sharded import (
    ShardedOptions,
    format_sharded_report,
    run_sharded,
    sharded_to_json,
)

# 1,001 params: at d = 2 a slice is 501 values, so the flat buffers carry one value of padding.
TINY = Preset("tiny", tuple(custom_shapes(1001, 3)))


def _scalar_bytes() -> int:
    """Return the bytes of an Adam state's 0-d tensors (hyperparameters, loss scale, counts).

    Taken from the unsharded state, whose other tensors are exactly 16 B/param; the sharded
    state's slice holds the same scalars.
    """
    cfg = BenchConfig()
    params, _ = make_param_set(TINY.shapes, loss_scale=cfg.loss_scale)
    state = fp16fx.init(
        params, fp16fx.adam(lr=cfg.lr), fp16fx.StaticLossScale(cfg.loss_scale), buckets=True
    )
    grads = fp16fx.grad_buffers(state)
    return fdist.persistent_bytes(state, grads) - 16 * TINY.num_params


def test_bytes_per_param_per_rank_are_the_measured_tensors_at_d2() -> None:
    d, n = 2, TINY.num_params
    # One warm-up step asked for: the budget was planned from the compiling one, 5 timed.
    opts = ShardedOptions([TINY], world_sizes=[d], steps=12, warmup=1, timeout_s=60.0)
    result = run_sharded(opts)

    assert result.warmup == 2  # as run, and the header and JSON say
    (preset,) = result.presets
    assert [(r.world_size, r.rank) for r in preset.ranks] == [(d, 0), (d, 1)]
    s = math.ceil(n / d)  # every rank's slice; the flat FP16 buffers hold d * s values
    expected = 2 * d * s + 2 * d * s + (4 + 4 + 4) * s + _scalar_bytes()
    for r in preset.ranks:
        assert r.sharded and r.step == "compiled" and r.threads >= 1
        assert r.steps == 12 and 0 < r.min_ms <= r.ms_per_step
        assert r.comm_ms is not None and r.comm_ms > 0
        assert r.persistent_bytes == expected
        assert r.bytes_per_param == expected / n == pytest.approx(4 + 12 / d, abs=0.1)
        assert r.formula_bytes_per_param == 4 + 12 / d
    table = format_sharded_report(result)
    assert f"{expected / n:.2f}" in table and "10.00" in table
    doc = json.loads(sharded_to_json(result))
    assert doc["benchmark"] == "sharded"
    assert doc["presets"][0]["ranks"][1]["persistent_bytes"] == expected


def test_compact_sharded_bytes_per_param_at_d2_through_the_cli(capsys) -> None:
    """``--masters compensated --moments int8``: each rank keeps the whole FP16 params and
    grads and its slice of 1-byte corrections, int8 codes and their FP32 block scales; the
    flat buffers are padded to d whole blocks per slice (1,001 values: 1,024)."""
    code = command.main(
        [
            *("--params", "1001", "--leaves", "3", "--world-sizes", "2", "--steps", "2"),
            *("--warmup", "1", "--masters", "compensated", "--moments", "int8", "--json"),
        ]
    )
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["master"], doc["moments"]) == ("compensated", "int8")
    assert doc["divided_bytes_per_param"] == 1 + 2 * (1 + 4 / 256)
    padded, s = 1024, 512
    kept = 2 * padded + 2 * padded + (1 + 1 + 1) * s + 2 * (s // 256) * 4 + _scalar_bytes()
    ranks = [r for r in doc["presets"][0]["ranks"] if r["world_size"] == 2]
    assert len(ranks) == 2
    for r in ranks:
        assert r["persistent_bytes"] == kept
        assert r["formula_bytes_per_param"] == 4 + doc["divided_bytes_per_param"] / 2


def test_the_sharded_bench_steps_the_configs_adam() -> None:
    """Its Adam took the config's lr alone (betas and eps: Adam's defaults)."""
    cfg = BenchConfig(lr=0.5, betas=(0.5, 0.6), eps=1e-3)
    job = sharded_worker.Job("tiny", TINY.shapes, 1, 1, 1, 0, None, 0, cfg, 60.0, "")
    params, _ = make_param_set(TINY.shapes, loss_scale=cfg.loss_scale)
    state, _, _ = sharded_worker._build(job, params)
    wanted = {"lr": 0.5, "betas": (0.5, 0.6), "eps": 1e-3, "weight_decay": 0.0}
    assert fp16fx.get_hyperparams(state) == wanted


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world-sizes", "0,2"], "world sizes must be integers >= 1, like 2,4; got '0,2'"),
        (["--world-sizes", "2", "--only", "torch-fused"], "--only"),
        (["--world-sizes", "2", "--device", "cuda"], "CPU"),
        (["--moments", "int8"], "--world-sizes"),
        (["--world-sizes", "2", "--masters", "half"], "invalid choice: 'half'"),
        # Not only --world-sizes': torch's own error once named no option; -1 s was taken.
        (["--threads", "0"], "argument --threads: must be an integer >= 1, got 0"),
        # 100,000 threads once crashed the process without a word.
        (["--threads", "100000"], "argument --threads: must be at most the"),
        (["--time-budget", "-1"], "argument --time-budget: must be a finite number >= 0"),
        # Once a traceback per contender, and exit 0.
        (["--seed", str(10**23)], "argument --seed: 100000000000000000000000 is outside"),
        (["--steps", "0"], "argument --steps: must be an integer >= 1, got 0"),
        (["--warmup", "-1"], "argument --warmup: must be an integer >= 0, got -1"),
        (["--rounds", "0"], "argument --rounds: must be an integer >= 1, got 0"),
        # Once ignored silently: the sharded measurement has none of these.
        (["--world-sizes", "2", "--rounds", "3"], "drop --rounds"),
        (["--world-sizes", "2", "--rounds", "2", "--interleave"], "drop --rounds, --interleave"),
        (["--world-sizes", "2", "--no-compile-times"], "times no compiles; drop --no-compile-t"),
    ],
)
def test_cli_rejects_bad_arguments_before_spawning_or_measuring(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as excinfo:
        command.main([*argv, "--params", "1000", "--leaves", "2"])
    # argparse's usage errors exit with 2 on stderr; the command's own with their message.
    code = excinfo.value.code
    assert (code == 2 and message in capsys.readouterr().err) or message in str(code)
