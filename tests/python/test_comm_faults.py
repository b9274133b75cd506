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


@pytest.mark.gpu
def test_gpu_oom_on_rank_0_mid_run_ends_every_rank_within_30_s(tmp_path):
    """Rank 0 of a 2-GPU run (tiny recipe, TP 2) gets a memory limit after step 2, so step 3 raises CUDA
    out-of-memory on it mid-step while rank 1 waits in a collective: every rank must be gone within 30 s,
    the job non-zero, and the launcher must name rank 0's OOM once. Alone:
        python3 -m pytest -q tests/python/test_comm_faults.py -k oom"""
    if mc.cuda_device_count() < 2:
        pytest.skip("needs 2 GPUs")
    import time

    from megacore import recipes
    from test_resilience import wait_for_logged_step

    r = recipes.tiny.pretrain_recipe(dir=str(tmp_path / "oom"))
    r.resources.num_gpus_per_node = 2
    r.parallel.pipeline_model_parallel_size = 1
    r.trainer.max_steps = 20
    r.trainer.generate_tokens = 0
    r.trainer.val_check_interval = 0
    r.data.cache_dir = str(tmp_path / "data")
    cfg = str(tmp_path / "oom.json")
    r.to_json(cfg)
    rank_script = os.path.join(HERE, "ranks", "train_fault.py")
    env = dict(ENV, FAULT_KIND="oom", FAULT_RANK="0", FAULT_STEP="2", CUDA_VISIBLE_DEVICES="0,1")
    proc = subprocess.Popen([sys.executable, "-m", "megacore.launch", "--nproc-per-node", "2", rank_script, cfg],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    limited_at = wait_for_logged_step(proc, r, 2, timeout=300)  # rank 0's memory is limited from here on
    out, err = proc.communicate(timeout=120)
    took = time.monotonic() - limited_at
    assert proc.returncode != 0, out + err
    assert took < 30, (took, err)
    summary = re.findall(r"^megacore\.launch: job failed.*$", err, re.M)
    assert len(summary) == 1, err
    assert summary[0].startswith("megacore.launch: job failed: rank 0 failed first: OutOfMemoryError: CUDA out of "
                                 "memory on cuda:0"), summary
    assert "step 4/" not in out  # nobody trained on
