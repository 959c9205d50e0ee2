"""``fp16fx train``: a real model learning a real task in FP16, through fp16fx's public APIs.

Layer: ``cli`` (docs/design.md). This package holds no library logic: it trains with the
apex-compatible ``fp16fx.FP16_Optimizer`` or the functional ``fp16fx.step``, and adds data
sets, models, a loop with progress and history, checkpoints and reports around them.

Run it as ``fp16fx train`` (or ``python -m fp16fx.train``); data-parallel as
``fp16fx train --nproc-per-node N`` or ``torchrun ... -m fp16fx.train``
(:mod:`fp16fx.train.parallel`); or from Python::

    from fp16fx.train import TrainConfig, train
    result = train(TrainConfig(epochs=3))
    print(result.runs[0].history.test_accuracy)
"""

from fp16fx.train.command import add_parser, main
from fp16fx.train.config import TrainConfig
from fp16fx.train.session import TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "add_parser", "main", "train"]
