"""Process plumbing shared by the CLI, the launcher and the ranks: children that cannot outlive their parent,
signals passed down the chain (CLI → launcher → mpirun or ranks), and the per-job folder where ranks report
their error and progress (``MEGACORE_JOB_DIR``) so the launcher can name the first failure once."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time

JOB_DIR_ENV = "MEGACORE_JOB_DIR"
_PR_SET_PDEATHSIG = 1


def _die_with_parent(sig: int):
    parent = os.getpid()

    def preexec():
        # Linux: `sig` reaches the child when the process that started it ends, even by SIGKILL, so a launcher
        # that is killed leaves no orphaned ranks behind. Elsewhere the launcher's own handlers have to do.
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        except (OSError, AttributeError):
            pass
        if os.getppid() != parent:  # the parent is already gone
            os._exit(1)
    return preexec


def popen(cmd, env=None, death_signal: int = signal.SIGTERM) -> subprocess.Popen:
    """Starts `cmd` in a session of its own (a Ctrl-C at the terminal reaches only the top process, which
    passes it on exactly once) that receives `death_signal` if this process dies."""
    return subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent(death_signal))


def call(cmd, env=None) -> int:
    """Runs `cmd` to completion, passing SIGTERM, SIGINT and SIGUSR1 on to it; returns its exit code
    (128 + signal when a signal ended it, as a shell reports it)."""
    p = popen(cmd, env=env)
    forwarded = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    old = {s: signal.signal(s, lambda sig, _f: p.poll() is None and p.send_signal(sig)) for s in forwarded}
    try:
        while True:
            try:
                rc = p.wait()
                break
            except InterruptedError:
                continue
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 128 - rc if rc < 0 else rc


def rank_from_env() -> int:
    for k in ("RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if os.environ.get(k, "").isdigit():
            return int(os.environ[k])
    return 0


def report_error(rank: int, message: str, failed_rank=None) -> None:
    """Records this rank's error for the launcher (no-op outside a launcher that asked for it). `failed_rank`: the
    error only passes on another rank's failure (megacore.PeerIOError); the launcher names that rank's own report
    before this one."""
    d = os.environ.get(JOB_DIR_ENV)
    if not d:
        return
    report = {"rank": rank, "time": time.time(), "host": socket.gethostname(), "error": message}
    if failed_rank is not None:
        report["failed_rank"] = failed_rank
    tmp = os.path.join(d, f"error.rank{rank}.json.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(report, f)
        os.replace(tmp, os.path.join(d, f"error.rank{rank}.json"))  # a reader never sees half a report
    except OSError:
        pass  # the report is a courtesy; the exit code still says the rank failed


def wait_for_error_report(rank: int, timeout: float) -> None:
    """Waits up to `timeout` s for `rank`'s error report in the launcher's job folder (without a launcher: sleeps
    `timeout` s), so that a rank passing on another's failure does not end the job before that rank has said why:
    an MPI abort or the launcher's stop would cut its report and its message off."""
    d = os.environ.get(JOB_DIR_ENV)
    deadline = time.monotonic() + timeout
    path = os.path.join(d, f"error.rank{rank}.json") if d else None
    while time.monotonic() < deadline:
        if path is not None and os.path.exists(path):
            return
        time.sleep(0.02)


def report_progress(step: int) -> None:
    """Rank 0 records the last completed step, so the launcher knows whether a restarted job advanced."""
    d = os.environ.get(JOB_DIR_ENV)
    if not d:
        return
    tmp = os.path.join(d, "step.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(str(step))
        os.replace(tmp, os.path.join(d, "step"))
    except OSError:
        pass


def report_ready(rank: int) -> None:
    """This rank handles the stop signals now (megacore.train.guarded): the launcher may pass a stop request on
    (before, the signal's default action would end the rank mid-start-up). No-op outside a launcher."""
    d = os.environ.get(JOB_DIR_ENV)
    if not d:
        return
    try:
        open(os.path.join(d, f"ready.rank{rank}"), "w").close()
    except OSError:
        pass


def ready_ranks(job_dir: str) -> int:
    """How many ranks of the current attempt reported themselves ready (report_ready)."""
    try:
        return sum(1 for n in os.listdir(job_dir) if n.startswith("ready.rank"))
    except OSError:
        return 0


def read_progress(job_dir: str) -> int:
    try:
        with open(os.path.join(job_dir, "step")) as f:
            return int(f.read().strip() or -1)
    except (OSError, ValueError):
        return -1


def first_error(job_dir: str):
    """(rank, message) of the earliest error report in `job_dir`, or None."""
    reports = []
    try:
        names = os.listdir(job_dir)
    except OSError:
        return None
    for n in names:
        if n.startswith("error.rank") and n.endswith(".json"):
            try:
                with open(os.path.join(job_dir, n)) as f:
                    reports.append(json.load(f))
            except (OSError, ValueError):
                continue
    if not reports:
        return None
    # A rank's own failure before any report that only passes another's on (a PeerIOError names the rank that failed)
    r = min(reports, key=lambda r: ("failed_rank" in r, r.get("time", 0), r.get("rank", 0)))
    return r.get("rank"), r.get("error", "")


def clear_reports(job_dir: str) -> None:
    for n in os.listdir(job_dir):
        if n.startswith(("error.rank", "ready.rank")):
            try:
                os.remove(os.path.join(job_dir, n))
            except OSError:
                pass


def write_stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
