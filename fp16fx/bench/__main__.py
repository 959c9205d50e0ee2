"""``python -m fp16fx.bench``: the same as ``fp16fx bench``."""

import sys

from fp16fx.bench.command import main

if __name__ == "__main__":
    sys.exit(main())
