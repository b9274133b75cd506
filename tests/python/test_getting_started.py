"""docs/getting-started.md as a user runs it: every ```bash block of the page, in order, in an empty folder, with
`megacore` and `python` meaning this interpreter's megacore (CPU ranks here; GPUs where four are visible)."""

import json
import os
import re
import subprocess
import sys

import pytest

import megacore as mc

DOC = os.path.join(os.environ.get("MEGACORE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", "..")),
                   "docs", "getting-started.md")


def _blocks():
    return re.findall(r"```bash\n(.*?)```", open(DOC).read(), flags=re.S)


def test_the_page_has_the_whole_path():
    text = "\n".join(_blocks())
    for step in ("megacore preprocess", "megacore train --recipe tiny ", "megacore train --recipe tiny_finetune",
                 "megacore convert megacore-to-hf"):
        assert step in text, step


@pytest.mark.skipif(not mc.comm.mpi_available(), reason="built without MPI (the runs use CPU ranks)")
def test_getting_started_commands_run_as_written(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, cmd in (("megacore", f'exec "{sys.executable}" -m megacore.cli "$@"'),
                      ("python", f'exec "{sys.executable}" "$@"')):
        (bindir / name).write_text(f"#!/bin/sh\n{cmd}\n")
        (bindir / name).chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}")
    for i, block in enumerate(_blocks()):
        p = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=work, env=env, capture_output=True,
                           text=True, timeout=900)
        assert p.returncode == 0, f"block {i}:\n{block}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}"
    # The fine-tuning run trained one epoch and validated on its held-out examples.
    rows = [json.loads(line) for line in open(work / "runs" / "tiny_finetune" / "logs" / "metrics.jsonl")]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) >= 5 and any("val_loss" in r for r in rows)
    assert steps[-1]["loss"] < steps[0]["loss"]
