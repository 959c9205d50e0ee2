"""``python -m fp16fx.train``: the ``fp16fx train`` command without the ``fp16fx`` wrapper."""

from fp16fx.train.command import main

raise SystemExit(main())
