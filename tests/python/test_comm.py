"""Collectives and the process grid from Python, on several ranks through megacore.launch."""

import os
import subprocess
import sys

import pytest

import megacore as mc

HERE = os.path.dirname(os.path.abspath(__file__))


def _launch(nproc, *args, cpu=True, timeout=240):
    cmd = [sys.executable, "-m", "megacore.launch", "--nproc-per-node", str(nproc)]
    cmd += ["--cpu"] if cpu else []
    cmd += list(args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))


@pytest.mark.skipif(not mc.comm.mpi_available(), reason="built without MPI")
@pytest.mark.parametrize("nproc", [2, 4])
def test_cpu_collectives_and_grid_on_ranks(nproc):
    p = _launch(nproc, os.path.join(HERE, "ranks", "comm_check.py"), "cpu")
    assert p.returncode == 0, p.stdout + p.stderr
    for r in range(nproc):
        assert f"rank {r} ok" in p.stdout


@pytest.mark.gpu
def test_gpu_collectives_and_grid_on_ranks():
    n = mc.cuda_device_count()
    if n < 2:
        pytest.skip("needs 2 GPUs")
    p = _launch(n, os.path.join(HERE, "ranks", "comm_check.py"), "cuda", cpu=False)
    assert p.returncode == 0, p.stdout + p.stderr
    for r in range(n):
        assert f"rank {r} ok" in p.stdout


def test_grid_layout_from_python():
    L = mc.parallel.GridLayout(mc.parallel.ParallelConfig(tensor=2, pipeline=2), 8)
    assert L.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert L.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert L.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert L.sizes["dp"] == 2 and L.coordinates(5) == {**L.coordinates(5), "tp": 1, "pp": 1}
    with pytest.raises(mc.ConfigError, match=r"world_size 6 is not divisible by TP\(4\)"):
        mc.parallel.GridLayout(mc.parallel.ParallelConfig(tensor=4), 6)
    with pytest.raises(mc.ConfigError, match=r"EP\(3\) must divide DP×CP\(4\)"):
        mc.parallel.GridLayout(mc.parallel.ParallelConfig(expert=3), 4)
    assert "tp" in mc.parallel.group_kinds()


def test_launcher_rejects_bad_arguments():
    p = subprocess.run([sys.executable, "-m", "megacore.launch", "--nproc-per-node", "0", "x.py"],
                       capture_output=True, text=True)
    assert p.returncode != 0 and "--nproc-per-node must be >= 1" in p.stderr
    p = subprocess.run([sys.executable, "-m", "megacore.launch", "--nnodes", "2", "--node-rank", "2", "x.py"],
                       capture_output=True, text=True)
    assert p.returncode != 0 and "--node-rank 2 must be in [0, 2)" in p.stderr


def test_launcher_stops_all_ranks_when_one_fails(tmp_path):
    # GPU-style launch path (no mpirun): rank 1 exits 7 at once, rank 0 would sleep for a minute.
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(7)\ntime.sleep(60)\n")
    import time
    t0 = time.monotonic()
    from megacore import launch
    rc = launch.main(["--nproc-per-node", "2", "--grace", "1", "--master-port", "29533", str(script)]
                     if mc.cuda_available() else ["--nproc-per-node", "2", "--grace", "1", str(script)])
    if not mc.cuda_available():
        # CPU launches go through mpirun, which also stops the job when a rank fails.
        assert rc != 0
        return
    assert rc == 7 and time.monotonic() - t0 < 30


def test_flight_record_lists_a_communicators_last_operations():
    if not mc.comm.mpi_available():
        pytest.skip("needs MPI")
    import numpy as np

    w = mc.comm.init_from_env("cpu", name="flight_py")
    t = mc.from_numpy(np.ones(8, dtype=np.float32))
    for _ in range(3):
        w.all_reduce(t)
    w.barrier()
    lines = [x for x in mc.comm.flight_record(2).splitlines() if "group 'flight_py'" in x]
    assert len(lines) == 1, mc.comm.flight_record()
    assert "rank 0: 4 collectives, 0 p2p batches; last: #3 all_reduce 32 B (took" in lines[0], lines[0]
    assert "#4 barrier 0 B (took" in lines[0] and "#2 " not in lines[0], lines[0]
