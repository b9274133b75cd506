"""megacore.launch hands every rank it starts the job's rendezvous-store token (docs/comm.md), names the rank that
failed first, stops the others, and passes stop signals on to the ranks."""

import re
import signal
import subprocess
import sys
import time

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


def test_more_gpu_ranks_than_gpus_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "_gpu_count", lambda: 1)
    script = tmp_path / "rank.py"
    script.write_text("import pathlib, sys; pathlib.Path(sys.argv[1]).write_text('started')\n")
    with pytest.raises(SystemExit, match=r"--nproc-per-node 4 starts 4 GPU ranks, but this node has 1 visible GPU "
                                         r"and each GPU rank needs one of its own; start at most 1 .*--cpu"):
        launch.main(["--nproc-per-node", "4", str(script), str(tmp_path / "flag")])
    assert not (tmp_path / "flag").exists()


# The GPU path's supervision (ranks started by the launcher itself), with CPU scripts standing in for ranks.
GPU_PATH = ("import sys; from megacore import launch; launch._gpu_count = lambda: 2; "
            "sys.exit(launch.main(sys.argv[1:]))")
FAILING_RANK = ("import os, sys, time, pathlib\n"
                "from megacore import _C, train\n"
                "_C.train.install_stop_signal_handlers()  # as megacore.train does: SIGTERM alone does not end it\n"
                "pathlib.Path(sys.argv[1], os.environ['RANK']).write_text('up')\n"
                "if os.environ['RANK'] == '1':\n"
                "    time.sleep(0.5)\n"
                "    train.fail_fast(ValueError('boom on rank 1'))\n"
                "time.sleep(120)\n")
STOPPING_RANK = ("import os, sys, time, pathlib\n"
                 "from megacore import _C\n"
                 "_C.train.install_stop_signal_handlers()\n"
                 "out = pathlib.Path(sys.argv[1], os.environ['RANK'])\n"
                 "out.write_text('up')\n"
                 "t = time.monotonic()\n"
                 "while not _C.train.stop_requested() and time.monotonic() - t < 60:\n"
                 "    time.sleep(0.05)\n"
                 "out.write_text(f'stopped {_C.train.stop_requested()}')\n")


def _gpu_launch(tmp_path, body, *extra):
    script = tmp_path / "rank.py"
    script.write_text(body)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-c", GPU_PATH, "--nproc-per-node", "2", *extra, str(script), str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), out


def _wait_up(p, out, n=2):
    deadline = time.monotonic() + 30
    while len([f for f in out.iterdir() if f.read_text() == "up"]) < n:
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.05)


def test_a_failing_rank_is_named_once_and_the_others_are_stopped(tmp_path):
    t0 = time.monotonic()
    p, _ = _gpu_launch(tmp_path, FAILING_RANK, "--grace", "1")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 1, err
    assert time.monotonic() - t0 < 20, err  # rank 0 ignores SIGTERM while training: it is killed after --grace
    summary = [line for line in err.splitlines() if line.startswith("megacore.launch: job failed")]
    assert summary == ["megacore.launch: job failed: rank 1 failed first: ValueError: boom on rank 1"], err


def test_sigterm_to_the_launcher_asks_every_rank_to_stop(tmp_path):
    p, out = _gpu_launch(tmp_path, STOPPING_RANK)
    _wait_up(p, out)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert [(out / r).read_text() for r in ("0", "1")] == [f"stopped {int(signal.SIGTERM)}"] * 2


def test_a_stop_during_the_ranks_start_up_waits_until_they_handle_it(tmp_path):
    # Ranks that take 2 s to install their stop handlers (importing a large package, building a model) and then
    # report ready as megacore.train does; the launcher is asked to stop while they start. Passed on at once the
    # SIGTERM would end them (its default action); held back, it reaches their handlers and they stop cleanly.
    body = ("import os, sys, time, pathlib\n"
            "pathlib.Path(sys.argv[1], os.environ['RANK']).write_text('starting')\n"
            "time.sleep(2)\n"
            + STOPPING_RANK.replace("_C.train.install_stop_signal_handlers()\n",
                                    "_C.train.install_stop_signal_handlers()\n"
                                    "from megacore import _proc\n"
                                    "_proc.report_ready(int(os.environ['RANK']))\n"))
    p, out = _gpu_launch(tmp_path, body)
    deadline = time.monotonic() + 30
    while len(list(out.iterdir())) < 2:
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert [(out / r).read_text() for r in ("0", "1")] == [f"stopped {int(signal.SIGTERM)}"] * 2


def test_a_second_interrupt_ends_the_ranks_at_once(tmp_path):
    # Ranks that never reach the end of a step: the first Ctrl-C asks, the second ends them.
    p, out = _gpu_launch(tmp_path, STOPPING_RANK.replace("while not _C.train.stop_requested() and", "while"))
    _wait_up(p, out)
    p.send_signal(signal.SIGINT)
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130, err  # as docs/training.md says
    assert "second interrupt" in err
    assert [(out / r).read_text() for r in ("0", "1")] == ["up", "up"]
