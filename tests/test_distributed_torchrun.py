"""The torchrun scripts of docs/distributed.md run as documented (2 gloo processes)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "distributed.md"
SCRIPTS = dict(re.findall(r"<!-- torchrun: (\S+) -->\n```python\n(.*?)```", DOC.read_text(), re.S))


def test_the_doc_has_its_scripts():
    assert set(SCRIPTS) == {"ddp_facade.py", "facade_sharded.py", "sharded.py"}


#: What torch 2.14 prints when, rarely, it aborts a gloo process at interpreter exit, after the
#: script's last line ran (a joinable C++ thread destroyed; pytorch/pytorch#179291).
TEARDOWN_ABORT = "terminate called without an active exception"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_torchrun_script_from_the_docs(tmp_path, name):
    script = tmp_path / name
    script.write_text(SCRIPTS[name])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(script)]
    for _ in range(3):  # a run that finished and then hit torch's teardown abort runs again
        done = subprocess.run(
            command, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
        )
        if done.returncode == 0 or not ("ok:" in done.stdout and TEARDOWN_ABORT in done.stderr):
            break
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "ok:" in done.stdout
