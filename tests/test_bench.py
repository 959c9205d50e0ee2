"""Tests of ``fp16fx bench``: presets, the roofline model, baseline correctness, output, CLI.

Speed is never asserted; nothing large is compiled.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import json
import os
import statistics
import weakref
from math import prod

import optree
import pytest
import torch
import torchvision

from fp16fx.bench import command, harness, interleave, measure, presets
from fp16fx.bench.baselines import ApexStyleRunner, TorchCompiledRunner, TorchFusedRunner
from fp16fx.bench.harness import BenchOptions, run_bench, select_runners
from fp16fx.bench.report import format_report, to_json
from fp16fx.bench.runner import BenchConfig, Runner, register_runner, runner_classes
from fp16fx.tree import storage_bytes

TINY_SHAPES = [(7,), (5, 3), (4, 2, 3, 3), (1,)]
COMPACT = "fp16fx-compensated-int8"


@pytest.fixture(autouse=True)
def _small_copy_buffers(monkeypatch):
    """A run measures the copy bandwidth over 256 MiB buffers by default, a second each time;
    these tests check what a run does with the figure, not the figure: 16 MiB buffers."""
    measured = measure.copy_bandwidth

    def copy_bandwidth(device, buffer_bytes=None, reps=20):
        return measured(device, buffer_bytes or 16 << 20, reps)

    monkeypatch.setattr(measure, "copy_bandwidth", copy_bandwidth)


# --- presets -------------------------------------------------------------------------------


def test_resnet18_preset_is_torchvision_resnet18() -> None:
    p = presets.preset("resnet18")
    assert (p.num_params, p.num_leaves) == (11_689_512, 62)
    with torch.device("meta"):
        model = torchvision.models.resnet18()
    assert list(p.shapes) == [tuple(param.shape) for param in model.parameters()]


def test_gpt2_preset_is_gpt2_small_with_tied_head() -> None:
    p = presets.preset("gpt2")
    assert (p.num_params, p.num_leaves) == (124_439_808, 148)
    assert p.shapes[:2] == ((50257, 768), (1024, 768))
    assert p.shapes[2:14] == (
        (768,), (768,), (768, 2304), (2304,), (768, 768), (768,),
        (768,), (768,), (768, 3072), (3072,), (3072, 768), (768,),
    )  # fmt: skip


def test_many_small_preset_has_2000_varied_leaves_and_10m_params() -> None:
    p = presets.preset("many-small")
    assert (p.num_params, p.num_leaves) == (10_000_000, 2000)
    assert len(set(p.shapes)) >= 30
    assert max(prod(s) for s in p.shapes) < 100_000


def test_custom_shapes_split_evenly() -> None:
    shapes = presets.custom_shapes(10_003, 4)
    assert sorted(prod(s) for s in shapes) == [2500, 2501, 2501, 2501]
    with pytest.raises(ValueError, match="leaves"):
        presets.custom_shapes(3, 4)


def test_unknown_preset_names_the_choices() -> None:
    with pytest.raises(ValueError, match="resnet18"):
        presets.preset("resnet50")


def test_param_set_is_fp16_with_scaled_grads_attached() -> None:
    params, grads = presets.make_param_set(TINY_SHAPES, loss_scale=2.0**16, seed=3)
    again, _ = presets.make_param_set(TINY_SHAPES, loss_scale=2.0**16, seed=3)
    assert all(p.dtype == torch.float16 and p.grad is g for p, g in zip(params, grads))
    assert all(torch.equal(a, b) for a, b in zip(params, again))
    assert all(torch.isfinite(g).all() for g in grads)
    assert max(g.abs().max().item() for g in grads) > 1.0  # scaled, not raw 1e-4 grads


# --- roofline and accounting ---------------------------------------------------------------


def test_roofline_is_30_bytes_per_param() -> None:
    assert measure.ROOFLINE_BYTES_PER_PARAM == 2 + 4 + 4 + 4 + 4 + 4 + 4 + 2 + 2
    assert measure.roofline_bytes(11_689_512) == 30 * 11_689_512


def test_storage_bytes_counts_each_storage_once() -> None:
    flat = torch.zeros(100)
    views = [flat[:50], flat[50:], flat]
    assert storage_bytes([*views, torch.zeros(10, dtype=torch.float16)]) == 400 + 20


# --- baselines are real optimizers ---------------------------------------------------------


def _reference_masters(shapes, cfg: BenchConfig, steps: int) -> list[torch.Tensor]:
    """torch.optim.Adam on FP32 masters fed the unscaled grads."""
    params, grads = presets.make_param_set(shapes, loss_scale=cfg.loss_scale, dtype=cfg.dtype)
    masters = [p.detach().float() for p in params]
    for m, g in zip(masters, grads):
        m.grad = g.float() / cfg.loss_scale
    opt = torch.optim.Adam(masters, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    for _ in range(steps):
        opt.step()
    return masters


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("runner_cls", [TorchFusedRunner, ApexStyleRunner])
def test_baseline_matches_torch_adam_on_fp32_masters(runner_cls: type[Runner], dtype) -> None:
    cfg = BenchConfig(dtype=dtype)
    params, grads = presets.make_param_set(TINY_SHAPES, loss_scale=cfg.loss_scale, dtype=dtype)
    runner = runner_cls(cfg)
    runner.setup(params, grads)
    for _ in range(4):
        runner.step()
    expected = _reference_masters(TINY_SHAPES, cfg, steps=4)
    for got, want in zip(runner.masters(), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for p, m in zip(params, runner.masters()):  # the FP16/BF16 params carry the new weights
        assert p.dtype == dtype and torch.equal(p, m.to(dtype))
    assert storage_bytes(runner.persistent_tensors()) >= 20 * sum(prod(s) for s in TINY_SHAPES)


@pytest.mark.parametrize("runner_cls", [TorchFusedRunner, ApexStyleRunner])
def test_baseline_skips_the_step_when_a_grad_holds_inf(runner_cls: type[Runner]) -> None:
    params, grads = presets.make_param_set(TINY_SHAPES)
    runner = runner_cls(BenchConfig())
    runner.setup(params, grads)
    runner.step()
    masters = [m.clone() for m in runner.masters()]
    fp16 = [p.clone() for p in params]
    grads[2].view(-1)[5] = float("inf")
    runner.step()
    assert all(torch.equal(a, b) for a, b in zip(masters, runner.masters()))
    assert all(torch.equal(a, b) for a, b in zip(fp16, params))
    grads[2].view(-1)[5] = 0.0
    runner.step()
    assert not torch.equal(masters[0], runner.masters()[0])


@pytest.mark.compile
def test_compiled_torch_baseline_matches_torch_adam_on_fp32_masters() -> None:
    cfg = BenchConfig()
    params, grads = presets.make_param_set(TINY_SHAPES[:2], loss_scale=cfg.loss_scale)
    runner = TorchCompiledRunner(cfg)
    runner.setup(params, grads)
    for _ in range(3):
        runner.step()
    expected = _reference_masters(TINY_SHAPES[:2], cfg, steps=3)
    for got, want in zip(runner.masters(), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


# --- harness, registry, output -------------------------------------------------------------


def _tiny_run(only: list[str], compile_times: bool = False, **options):
    opts = BenchOptions(
        presets=[presets.Preset("tiny", tuple(TINY_SHAPES))],
        only=only,
        steps=options.pop("steps", 2),
        warmup=options.pop("warmup", 1),
        compile_times=compile_times,
        copy_buffer_bytes=16 << 20,
        **options,
    )
    return run_bench(opts)


def test_json_document_has_the_documented_fields() -> None:
    doc = json.loads(to_json(_tiny_run(["torch-fused", "apex-style"])))
    for key in ("schema", "device", "threads", "copy_bandwidth_gbps", "presets", "steps"):
        assert key in doc
    (preset,) = doc["presets"]
    assert preset["params"] == sum(prod(s) for s in TINY_SHAPES)
    assert preset["roofline_bytes"] == 30 * preset["params"]
    names = [r["name"] for r in preset["results"]]
    assert names == ["roofline", "torch-fused", "apex-style"]
    fields = {
        "ms_per_step", "gbps", "fraction_of_roofline", "speedup_vs_torch_fused",
        "speedup_vs_apex_style", "cold_compile_s", "warm_compile_s", "recompiles",
        "peak_mem_bytes", "persistent_bytes_per_param", "status", "notes",
    }  # fmt: skip
    for row in preset["results"]:
        assert fields <= row.keys()
    fused = preset["results"][1]
    assert fused["status"] == "ok" and fused["speedup_vs_torch_fused"] == 1.0
    assert fused["persistent_bytes_per_param"] >= 20.0
    assert fused["recompiles"] == 0


def _register_broken(runner_name: str, error: Exception) -> type[Runner]:
    """Registers a contender whose setup raises ``error``."""

    @register_runner
    class Broken(Runner):
        name = runner_name
        label = "always fails"
        order = 99

        def setup(self, params, grads) -> None:
            raise error

        def step(self) -> None: ...

        def persistent_tensors(self):
            return []

    return Broken


def test_the_report_names_the_step_and_the_warm_up_steps_that_ran() -> None:
    """The header once said "Adam (lr 1e-3)" whatever the config, and ``--warmup 0`` was
    reported as 0 while a compiled contender ran one: every contender now runs at least one,
    and the report and JSON say what ran."""
    calls: list[str] = []

    @register_runner
    class Counting(TorchFusedRunner):
        name = "test-counting"
        compiled = False

        def step(self) -> None:
            calls.append("step")
            super().step()

    config = BenchConfig(lr=0.01, betas=(0.8, 0.99), eps=1e-6)
    result = _tiny_run(["test-counting"], warmup=0, config=config)
    assert len(calls) == 1 + result.presets[0].results[1].steps
    doc = json.loads(to_json(result))
    assert (doc["warmup"], doc["lr"], doc["betas"], doc["eps"]) == (1, 0.01, [0.8, 0.99], 1e-6)
    text = format_report(result)
    assert "after 1 warm-up" in text and "Adam (lr 0.01, betas (0.8, 0.99), eps 1e-06)" in text


def test_registered_runner_joins_and_a_failing_one_is_reported() -> None:
    """The table shows an error on one line, cut at 160 characters (a compile error's once
    ran on across the table, its cause on the second line and stack frames after); the JSON
    keeps all of it."""

    class BackendCompilerFailed(RuntimeError):
        """torch._dynamo's, whose message's shape this one's follows."""

    cause = "RuntimeError: InvalidCxxCompiler: No working C++ compiler found"
    message = f"backend='inductor' raised:\n{cause}\n\nfrom user code:\n" + "  File x.py\n" * 20
    broken = _register_broken("test-broken", BackendCompilerFailed(message))
    assert broken in select_runners(None)
    result = _tiny_run(["test-broken", "torch-fused"])
    rows = {r.name: r for r in result.presets[0].results}
    assert rows["test-broken"].status == "error"
    assert rows["test-broken"].reason == f"BackendCompilerFailed: {message}"
    assert rows["torch-fused"].status == "ok"
    (line,) = [line for line in format_report(result).splitlines() if "test-broken" in line]
    shown = f"error: BackendCompilerFailed: backend='inductor' raised: {cause} from user code:"
    assert shown in line and line.endswith("...") and len(line.split("error: ")[1]) == 160


def test_the_roofline_rows_name_cannot_be_registered() -> None:
    """A contender named "roofline" once broke every run (two rows of that name) and took
    ``--only roofline``."""

    class Roofline(TorchFusedRunner):
        name = "roofline"

    with pytest.raises(ValueError, match="'roofline' names the report's roofline row"):
        register_runner(Roofline)
    assert Roofline not in runner_classes()


def test_a_run_thaws_the_objects_it_froze_out_of_garbage_collection(monkeypatch) -> None:
    """A run freezes the objects from before it, so that its collections skip them; frozen
    after it, they would never be collected. Also when it is interrupted; and a process that
    froze objects itself keeps them frozen, and no more."""
    assert gc.get_freeze_count() == 0
    _tiny_run(["torch-fused"])
    assert gc.get_freeze_count() == 0
    frozen = []

    def interrupted(*args):
        frozen.append(gc.get_freeze_count())
        raise KeyboardInterrupt

    monkeypatch.setattr(harness, "_measure", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _tiny_run(["torch-fused"])
    assert gc.get_freeze_count() == 0 and frozen[0] > 0  # frozen while it measured
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        with pytest.raises(KeyboardInterrupt):
            _tiny_run(["torch-fused"])
        # Neither frozen again (the run's own objects would join) nor thawed (0); a frozen
        # object that dies leaves the count, so it may end a little lower.
        assert 0 < gc.get_freeze_count() <= frozen[1] <= before
    finally:
        gc.unfreeze()


def test_the_command_fails_when_every_contender_failed(capsys) -> None:
    """It once exited 0 with nothing measured (e.g. params too many to allocate)."""
    _register_broken("test-broken-cli", MemoryError("no room"))
    argv = ["--params", "1000", "--leaves", "2", "--steps", "1", "--warmup", "0", "--quiet"]
    assert command.main([*argv, "--only", "test-broken-cli"]) == 1
    out, err = capsys.readouterr()
    assert "MemoryError: no room" in out and "every contender failed" in err
    assert "Traceback" not in err  # once printed under --quiet too
    assert command.main([*argv, "--only", "test-broken-cli", "--only", "torch-fused"]) == 0
    assert command.main([*argv[:-1], "--only", "test-broken-cli"]) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err  # as progress


@pytest.mark.compile
def test_compiled_runner_gets_cold_and_warm_compile_times(monkeypatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/nonexistent/user-cache")
    cache_dirs: list[str] = []

    @register_runner
    class TinyCompiled(Runner):
        name = "test-tiny-compiled"
        label = "a trivial compiled step"
        order = 98
        compiled = True

        def setup(self, params, grads) -> None:
            self.params = params
            cache_dirs.append(os.environ["TORCHINDUCTOR_CACHE_DIR"])
            self.fn = torch.compile(lambda x: x.mul_(1.0), fullgraph=True)

        @torch.no_grad()
        def step(self) -> None:
            self.fn(self.params[0])

        def persistent_tensors(self):
            return self.params

    result = _tiny_run(["test-tiny-compiled"], compile_times=True)
    row = result.presets[0].results[1]
    assert row.status == "ok", row.reason
    assert row.cold_compile_s is not None and row.cold_compile_s >= 0
    assert row.warm_compile_s is not None and row.warm_compile_s >= 0
    assert row.recompiles == 0
    cold_dir, warm_dir = cache_dirs  # one cold and one warm compile, sharing a fresh cache
    assert cold_dir == warm_dir and "fp16fx-bench-inductor-" in cold_dir
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/nonexistent/user-cache"  # restored


def test_unknown_contender_is_rejected_with_the_choices() -> None:
    with pytest.raises(ValueError, match="torch-fused"):
        select_runners(["nope"])


def test_fp16fx_runners_are_registered() -> None:
    names = {cls.name for cls in select_runners(None)}
    assert {"fp16fx-compiled", "fp16fx-facade", "fp16fx-eager"} <= names


def test_list_names_every_registered_contender_and_marks_the_opt_in_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert command.main(["--list"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert set(rows) == {"roofline", *(cls.name for cls in runner_classes())}
    for cls in runner_classes():
        assert ("[not in the default set]" in rows[cls.name]) == (not cls.default)
    assert "[not in the default set]" in rows["fp16fx-compiled-leaves"]
    assert command.main(["--list", "--json"]) == 0  # once the text list
    listed = json.loads(capsys.readouterr().out)["contenders"]
    assert [c["name"] for c in listed] == [cls.name for cls in runner_classes()]
    named = {c["name"]: c for c in listed}
    assert not named["fp16fx-compiled-leaves"]["default"]
    assert named["fp16fx-compensated-int8"]["moved_bytes_per_param"]["float16"] < 30


#: Each fp16fx contender's masters, after a few steps, against torch.optim.Adam's: per value,
#: ``steps * (lr * moments + |w| * rest)``. ``rest``: a compensated master's correction unit
#: relative to its weight (2**-8 of an FP16 ulp, 2**-16 of a BF16 one: at most 2**-18 and
#: 2**-23 of |w|), by which each step's stochastic rounding may land off. ``moments``: BF16
#: moments are rounded to 2**-8 relative, which moves an update by about 2**-7 of lr at
#: most; an int8 moment's error is relative to its block's largest value, so a small one can
#: move its update by a large part of lr (a quarter: 4x the largest seen). FP32 masters and
#: moments: the baselines' 1e-6.
_OFF_BY = {"fp32": 0.0, "bf16": 2.0**-7, "int8": 0.25}


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "runner_cls",
    [c for c in runner_classes() if c.name.startswith("fp16fx")],
    ids=lambda cls: cls.name,
)
def test_fp16fx_contenders_step_as_torch_adam(runner_cls: type[Runner], dtype) -> None:
    """A contender doing other or less work would show as a speed-up: each must take the
    baselines' steps (an fp16fx one once ignored the config's betas and eps)."""
    cfg = BenchConfig(dtype=dtype, betas=(0.8, 0.99), eps=1e-6)  # not fp16fx.adam's defaults
    params, grads = presets.make_param_set(TINY_SHAPES, loss_scale=cfg.loss_scale, dtype=dtype)
    runner = runner_cls(cfg)
    runner.setup(params, grads)
    steps = 4
    for _ in range(steps):
        runner.step()
    compensated = getattr(runner_cls, "master", "fp32") == "compensated"
    rest = (2.0**-18 if dtype == torch.float16 else 2.0**-23) if compensated else 0.0
    moments = _OFF_BY[getattr(runner_cls, "moments", "fp32")]
    expected = _reference_masters(TINY_SHAPES, cfg, steps=steps)
    for got, want in zip(runner.masters(), expected, strict=True):
        bound = 1e-6 + steps * (cfg.lr * moments + want.abs().clamp(min=2.0**-14) * rest)
        assert ((got - want).abs() <= bound).all(), (got - want).abs().max()
    assert storage_bytes(runner.persistent_tensors()) >= 7 * sum(prod(s) for s in TINY_SHAPES)


def test_the_buffers_an_in_place_step_keeps_count_as_persistent() -> None:
    """Over separate leaves, the in-place step packs the grads, and the params it writes,
    into two FP16 buffers it keeps from step to step: 4 B/param the column once left out."""
    (runner_cls,) = (c for c in runner_classes() if c.name == "fp16fx-compiled-leaves")
    params, grads = presets.make_param_set(TINY_SHAPES)
    runner = runner_cls(BenchConfig())
    runner.setup(params, grads)
    runner.step()
    state_and_grads = storage_bytes(optree.tree_leaves((runner.state, runner.grad_tree)))
    n = sum(prod(s) for s in TINY_SHAPES)
    assert storage_bytes(runner.persistent_tensors()) == state_and_grads + 2 * 2 * n


def test_p90_is_a_measured_time_by_nearest_rank() -> None:
    assert measure.median_min_p90(range(1, 11)) == (5.5, 1, 9)  # not the slowest of 10
    assert measure.median_min_p90(range(1, 71))[2] == 63  # the 63rd of 70
    assert measure.median_min_p90([3.0]) == (3.0, 3.0, 3.0)
    # Over rounds, the median round's: of two, the higher (their mean, 3.0, was no step's).
    rounds = [harness.ContenderResult("c", "c", "fp16fx", ms_per_step=1, min_ms=1, p90_ms=p)
              for p in (2.0, 4.0)]  # fmt: skip
    assert harness._merge_rounds(rounds).p90_ms == 4.0


# --- CLI -----------------------------------------------------------------------------------

CLI_ARGS = [
    "bench", "--params", "10000", "--leaves", "4", "--steps", "3", "--warmup", "1",
    "--only", "torch-fused", "--only", "apex-style", "--no-compile-times",
]  # fmt: skip


def test_cli_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    from fp16fx import cli

    assert cli.main(CLI_ARGS) == 0
    out, err = capsys.readouterr()
    assert "10,000 params in 4 leaves" in out
    assert "copy bandwidth" in out and "roofline" in out
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("contender"))
    for column in ("ms/step", "GB/s", "×torch", "×apex", "peak MB", "B/param"):
        assert column in header
    assert any("[torch-fused]" in line for line in lines)
    assert any("[apex-style]" in line for line in lines)
    assert "apex-style" in err  # progress goes to stderr


def test_cli_json_is_one_document(capsys: pytest.CaptureFixture[str]) -> None:
    assert command.main([*CLI_ARGS[1:], "--json", "--quiet"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["presets"][0]["leaves"] == 4
    assert err == ""


def test_cli_dtype_bfloat16_steps_bf16_params(capsys: pytest.CaptureFixture[str]) -> None:
    args = [*CLI_ARGS[1:], "--dtype", "bfloat16", "--only", "fp16fx-eager"]
    assert command.main(args) == 0
    out, _ = capsys.readouterr()
    assert "eps 1e-08) on BF16 params" in out and "[fp16fx-eager]" in out
    assert command.main([*args, "--json", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["dtype"] == "bfloat16"
    assert {r["status"] for r in doc["presets"][0]["results"]} == {"ok"}


def test_a_compact_contender_keeps_and_moves_one_byte_more_per_param_on_bf16() -> None:
    """A BF16 param's correction is int16, an FP16 one's int8: the compact contender's kept
    bytes and its own roofline (read and written: 2 bytes) follow the dtype."""
    rows = {}
    for dtype in (torch.float16, torch.bfloat16):
        doc = json.loads(to_json(_tiny_run([COMPACT], config=BenchConfig(dtype=dtype))))
        (rows[dtype],) = (r for r in doc["presets"][0]["results"] if r["name"] == COMPACT)
    fp16, bf16 = rows[torch.float16], rows[torch.bfloat16]
    assert fp16["status"] == bf16["status"] == "ok"
    assert (fp16["moved_bytes_per_param"], bf16["moved_bytes_per_param"]) == (14.0, 16.0)
    assert bf16["label"].endswith("int8 moments (16 B/param roof)")
    kept = bf16["persistent_bytes_per_param"] - fp16["persistent_bytes_per_param"]
    n = sum(prod(s) for s in TINY_SHAPES)
    padded = -(-n // 256) * 256  # the state covers the bucket padded to whole int8 blocks
    assert kept * n == pytest.approx(padded)  # one byte more per value


def test_bench_config_refuses_other_dtypes() -> None:
    with pytest.raises(ValueError, match=r"FP16 or BF16 params, not torch\.float32"):
        BenchConfig(dtype=torch.float32)


def test_cli_rejects_params_without_leaves() -> None:
    with pytest.raises(SystemExit, match="--leaves"):
        command.main(["--params", "1000"])


def test_rounds_alternate_the_order_and_pair_each_ratio_within_its_round(monkeypatch) -> None:
    order, fused_ms = [], [1.0, 2.0, 4.0]
    measure_one = harness._measure

    def spy(cls, *args):
        order.append((args[-1], cls.name))
        result = measure_one(cls, *args)
        if cls.name == "torch-fused":  # scripted, so that the pairing of ratios shows
            result.ms_per_step = fused_ms[args[-1]]
        return result

    # Each round measures the copy bandwidth again (after the run's first measurement).
    bandwidths = iter([40.0, 10.0, 40.0, 20.0])
    copy_bandwidth = measure.copy_bandwidth
    monkeypatch.setattr(harness, "_measure", spy)
    monkeypatch.setattr(
        measure,
        "copy_bandwidth",
        lambda *a: dataclasses.replace(copy_bandwidth(*a), gbps=next(bandwidths)),
    )
    result = _tiny_run(["torch-fused", "apex-style"], rounds=3)
    assert order == [
        (0, "torch-fused"), (0, "apex-style"),
        (1, "apex-style"), (1, "torch-fused"),
        (2, "torch-fused"), (2, "apex-style"),
    ]  # fmt: skip
    (preset,) = result.presets
    rows = {r.name: r for r in preset.results}
    assert rows["apex-style"].steps == 3 * 2 and result.rounds == 3
    assert rows["torch-fused"].speedup_vs_torch_fused == 1.0
    u = preset.roofline_bytes / 40e9 * 1e3  # the roofline at 40 GB/s, in ms
    assert preset.roofline_ms == pytest.approx(2 * u) and preset.copy_bandwidth_gbps == 20
    # Rounds' rooflines 4u, u, 2u against 1, 2, 4 ms: the median ratio is u/2 (the ratio of
    # the medians would be 2u / 2 = u).
    assert rows["torch-fused"].fraction_of_roofline == pytest.approx(u / 2)
    report = format_report(result)
    assert "3 rounds in alternating order" in report
    assert "at the median of 3 rounds' copy times" in report
    assert "median of the rounds' medians" in report
    # With --interleave the loop's times replace the rounds': the header once said both.
    both = format_report(dataclasses.replace(result, interleaved=True))
    assert "every time and ratio is the interleaved loop's" in both
    assert "median of the rounds' medians" not in both
    # The median of the rounds' ratios, not the ratio of the medians (20 / 5 = 4).
    assert harness._median_ratio([10.0, 20.0, 30.0], [5.0, 5.0, 30.0]) == 2.0


def test_interleaved_timing_steps_every_contender_in_each_iteration(monkeypatch) -> None:
    calls = []
    for cls in (TorchFusedRunner, ApexStyleRunner):
        original = cls.step

        def spy(self, _original=original, _name=cls.name):
            calls.append(_name)
            return _original(self)

        monkeypatch.setattr(cls, "step", spy)
    copy_step = interleave._CopyProbe.step
    monkeypatch.setattr(
        interleave._CopyProbe, "step", lambda self: (calls.append("copy"), copy_step(self))
    )
    times = iter([4.0, 2.0, 6.0, 2.0, 2.0, 8.0, 5.0, 2.0, 6.0, 3.0, 6.0, 6.0])

    class ScriptedTimer(measure.StepTimer):  # runs every step, reports scripted seconds
        def seconds(self):
            return [next(times) for _ in range(4)]

    monkeypatch.setattr(interleave, "StepTimer", ScriptedTimer)
    result = _tiny_run(["torch-fused", "apex-style"], steps=4, interleave=True)
    # The last 12 steps are the interleaved ones, the copy probe first, the contenders' order
    # rotating: each follows the copy as often as the others.
    order = ["copy", "torch-fused", "apex-style"]
    assert calls[-12:] == [*order, "copy", "apex-style", "torch-fused"] * 2
    (preset,) = result.presets
    rows = {r.name: r for r in preset.results}
    # Seconds per iteration, by timer: copy 4 2 6 2, torch-fused 2 8 5 2, apex-style 6 3 6 6.
    # The roofline of iteration i is copy_i * 30 B/param * params / (2 * copy buffer bytes).
    per_copy_s = 30 * preset.params / (2 * (16 << 20)) * 1e3
    assert rows["roofline"].ms_per_step == pytest.approx(3 * per_copy_s)
    assert preset.roofline_ms == pytest.approx(3 * per_copy_s)
    # Fractions and speed-ups are medians of same-iteration ratios, not ratios of medians.
    roof = [4 * per_copy_s, 2 * per_copy_s, 6 * per_copy_s, 2 * per_copy_s]
    fused, apex = [2e3, 8e3, 5e3, 2e3], [6e3, 3e3, 6e3, 6e3]
    median = statistics.median
    assert rows["torch-fused"].fraction_of_roofline == pytest.approx(
        median(r / t for r, t in zip(roof, fused))
    )
    assert rows["apex-style"].speedup_vs_torch_fused == pytest.approx(
        median(f / a for f, a in zip(fused, apex))
    )
    assert rows["torch-fused"].speedup_vs_torch_fused == 1.0 and rows["apex-style"].steps == 4
    report = format_report(result)
    assert result.interleaved and "timed in each interleaved iteration" in report


@pytest.mark.parametrize("contenders", [1, 2, 3, 5])
def test_the_interleaved_order_gives_each_contender_every_place_equally_often(contenders):
    names = ["copy", *(f"c{k}" for k in range(contenders))]
    orders = [interleave._order(names, i) for i in range(2 * contenders)]
    assert all(order[0] == "copy" and sorted(order) == sorted(names) for order in orders)
    for place in range(1, contenders + 1):  # the place right after the copy included
        taken = collections.Counter(order[place] for order in orders)
        assert taken == {name: 2 for name in names[1:]}


def test_a_contender_that_raises_in_the_interleaved_loop_leaves_it_to_the_others(
    monkeypatch,
) -> None:
    """Every state is alive at once there, so running out of memory is likely: the others'
    loop goes on, and the contender keeps its first-pass times, with a note."""
    setup, step, fused_step = ApexStyleRunner.setup, ApexStyleRunner.step, TorchFusedRunner.step
    setups, failed, failed_alive = [], [], []

    def counted_setup(self, params, grads):
        setups.append(weakref.ref(self))
        setup(self, params, grads)

    def failing_step(self):  # the interleaved instance (set up last) fails after its warm-up
        self.steps_taken = getattr(self, "steps_taken", 0) + 1
        if len(setups) == 2 and self.steps_taken > 1:
            failed.append(weakref.ref(self))
            raise MemoryError("simulated\n  on two lines")
        step(self)

    def watching_step(self):  # is the failed instance's memory still held?
        if failed:
            gc.collect()
            failed_alive.append(failed[0]() is not None)
        fused_step(self)

    monkeypatch.setattr(ApexStyleRunner, "setup", counted_setup)
    monkeypatch.setattr(ApexStyleRunner, "step", failing_step)
    monkeypatch.setattr(TorchFusedRunner, "step", watching_step)
    result = _tiny_run(["torch-fused", "apex-style"], steps=6, interleave=True)
    assert failed_alive and not any(failed_alive)
    rows = {r.name: r for r in result.presets[0].results}
    assert rows["torch-fused"].steps == 6 and not rows["torch-fused"].notes
    # A baseline that raised keeps its column: its first pass against the loop's times.
    assert rows["torch-fused"].speedup_vs_apex_style is not None
    apex = rows["apex-style"]
    assert apex.status == "ok" and apex.steps == 6 and apex.ms_per_step > 0  # the first pass
    assert apex.notes == [
        "raised in the interleaved loop (MemoryError: simulated on two lines): its times are "
        "the first pass's, and its ratios set them against the loop's"
    ]


def test_a_time_budget_that_cuts_the_interleaved_loop_short_says_so() -> None:
    result = _tiny_run(["torch-fused"], steps=40, interleave=True, time_budget_s=1e-6)
    (fused,) = (r for r in result.presets[0].results if r.name == "torch-fused")
    assert fused.steps == 5  # MIN_TIMED_STEPS, of the loop: the first pass's note is gone
    assert fused.notes == [
        "5 of 40 interleaved iterations timed (time budget 1e-06 s per contender)"
    ]


def test_a_compiled_contender_measured_again_compiles_again() -> None:
    """Each round makes a new instance: without a reset between them, Dynamo's recompile
    limit (8 by default) was reached and the contender quietly ran eagerly."""
    before = measure.graphs_compiled()
    with torch._dynamo.config.patch(recompile_limit=1):  # (monkeypatch's undo deletes it)
        result = _tiny_run(["torch-compiled"], rounds=2)
    assert result.presets[0].results[1].status == "ok"
    assert measure.graphs_compiled() - before >= 2
