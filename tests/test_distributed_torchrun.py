"""The torchrun scripts of docs/distributed.md run as documented (2 gloo processes)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.processes import run_to_a_clean_exit

DOC = Path(__file__).resolve().parents[1] / "docs" / "distributed.md"
SCRIPTS = dict(re.findall(r"<!-- torchrun: (\S+) -->\n```python\n(.*?)```", DOC.read_text(), re.S))


def test_the_doc_has_its_scripts():
    assert set(SCRIPTS) == {"ddp_facade.py", "facade_sharded.py", "sharded.py"}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_torchrun_script_from_the_docs(tmp_path, name):
    script = tmp_path / name
    script.write_text(SCRIPTS[name])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(script)]
    done = run_to_a_clean_exit(command, "ok:", cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "ok:" in done.stdout
