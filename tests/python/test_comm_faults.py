"""Failures become errors, not hangs: a rank that dies makes the others raise CommError and exit
non-zero within the timeout (each case is bounded by a subprocess timeout that fails the test)."""

import os
import re
import shutil
import subprocess
import sys

import pytest

import megacore as mc

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "ranks", "fault_check.py")
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")

needs_mpi = pytest.mark.skipif(not mc.comm.mpi_available() or shutil.which("mpirun") is None,
                               reason="needs MPI and mpirun")


def _survivors_raised(out, ranks, timeout):
    for r in ranks:
        m = re.search(rf"rank {r} CommError after ([0-9.]+) s: (.*)", out)
        assert m, f"rank {r} did not raise CommError:\n{out}"
        assert float(m.group(1)) <= timeout + 5.0, m.group(0)
        assert "group 'world'" in m.group(2) and "all_reduce" in m.group(2)
    assert "NO ERROR" not in out


@needs_mpi
def test_cpu_rank_crash_gives_commerror_on_every_other_rank():
    # mpirun is told not to kill the job itself, so megacore's own timeout has to end it.
    cmd = ["mpirun", "--oversubscribe", "--mca", "orte_abort_on_non_zero_status", "0", "-np", "4",
           sys.executable, "-u", SCRIPT, "cpu", "exit", "5"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV)
    out = p.stdout + p.stderr
    _survivors_raised(out, [0, 2, 3], 5.0)


@needs_mpi
def test_cpu_rank_killed_ends_the_job_without_hanging():
    # SIGKILL: Open MPI's mpirun stops the job at once and reports the signal; no rank is left waiting.
    cmd = ["mpirun", "--oversubscribe", "-np", "3", sys.executable, "-u", SCRIPT, "cpu", "kill", "30"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=ENV)
    assert p.returncode != 0
    assert "NO ERROR" not in p.stdout


@pytest.mark.gpu
def test_gpu_rank_killed_gives_commerror_on_every_other_rank():
    n = mc.cuda_device_count()
    if n < 2:
        pytest.skip("needs 2 GPUs")
    # The launcher's grace period is longer than the NCCL timeout, so the survivors must end themselves.
    cmd = [sys.executable, "-m", "megacore.launch", "--nproc-per-node", str(n), "--grace", "90", SCRIPT,
           "cuda", "kill", "10"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=ENV)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    _survivors_raised(out, [r for r in range(n) if r != 1], 10.0)
