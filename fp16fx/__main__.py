"""``python -m fp16fx``: the ``fp16fx`` command (:mod:`fp16fx.cli`)."""

from fp16fx.cli import main

raise SystemExit(main())
