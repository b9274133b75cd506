"""megacore.launch hands every rank it starts the job's rendezvous-store token (docs/comm.md)."""

import re

import pytest

from megacore import launch

RANK_SCRIPT = ("import os, pathlib, sys\n"
               "pathlib.Path(sys.argv[1], os.environ['RANK']).write_text(os.environ.get('MEGACORE_STORE_TOKEN', ''))\n")


def _tokens(tmp_path, monkeypatch, *extra):
    # The GPU path (ranks started by the launcher itself, the path whose ranks use the store), without GPUs.
    monkeypatch.setattr(launch, "_gpu_count", lambda: 2)
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    assert launch.main(["--nproc-per-node", "2", *extra, str(script), str(out)]) == 0
    return [(out / r).read_text() for r in ("0", "1")]


def test_every_rank_gets_the_same_fresh_token(tmp_path, monkeypatch):
    monkeypatch.delenv("MEGACORE_STORE_TOKEN", raising=False)
    first = _tokens(tmp_path, monkeypatch)
    assert first[0] == first[1]
    assert re.fullmatch("[0-9a-f]{64}", first[0])  # 32 random bytes
    assert _tokens(tmp_path, monkeypatch)[0] != first[0]  # one per job


def test_a_token_in_the_environment_is_passed_on(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGACORE_STORE_TOKEN", "shared-by-every-node")
    assert _tokens(tmp_path, monkeypatch) == ["shared-by-every-node"] * 2


def test_several_nodes_need_a_token_from_the_environment(monkeypatch):
    monkeypatch.delenv("MEGACORE_STORE_TOKEN", raising=False)
    monkeypatch.setattr(launch, "_gpu_count", lambda: 2)
    with pytest.raises(SystemExit, match="needs the same MEGACORE_STORE_TOKEN on every node"):
        launch.main(["--nnodes", "2", "--node-rank", "0", "--master-port", "29511", "x.py"])
