"""Starts the ranks of one node: ``python -m megacore.launch --nproc-per-node N script.py [args]``.

Each child gets the torchrun-style environment that ``megacore.comm.init_from_env`` reads (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT) and the job's store token
(MEGACORE_STORE_TOKEN: 32 random bytes in hex, made here unless the environment already has one, which a
launch on several nodes needs so that every node passes the same). On a machine without
a visible GPU (or with ``--cpu``) the ranks are CPU ranks, which communicate through MPI, so the launcher
hands them to ``mpirun`` instead.

Failures end the job: a rank that fails reports its error to the job's folder (MEGACORE_JOB_DIR, made here)
and aborts (MPI_Abort under mpirun, which ends every rank); the launcher stops any rank still running after
``--grace`` seconds, prints one line naming the rank that failed first and its error, and exits with that
rank's code. With ``--max-restarts N`` it instead starts every rank again (MEGACORE_RESTART=n), and the ranks
resume from the latest checkpoint, up to N times, as long as each restart gets further than the one before.

Signals: SIGTERM, SIGUSR1 or a first Ctrl-C asks every rank to finish its current step, save a checkpoint and
exit 0 (passed to the ranks as SIGTERM, or to mpirun as SIGUSR1, which it passes on, once every rank has reported
that it handles the signal, ``_proc.report_ready`` as megacore.train does, or ``READY_WAIT_S`` after the ranks
started; a signal's default action would end a rank still starting); a second Ctrl-C (exit 130), or a stop
that takes longer than ``--stop-timeout``, ends them at once. The ranks run in a session of their own and die
with the launcher, so no rank outlives it, even when it is killed.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time

from . import _proc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpu_count() -> int:
    try:
        import megacore

        return megacore.cuda_device_count()
    except Exception:  # noqa: BLE001 - a broken build still launches CPU ranks
        return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m megacore.launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc-per-node", type=int, default=None, help="ranks on this node (default: GPUs, or 1)")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=0, help="default: a free port (single node only)")
    p.add_argument("--cpu", action="store_true", help="CPU ranks through mpirun even if GPUs are visible")
    p.add_argument("--grace", type=float, default=5.0, help="seconds the others get to exit after a rank fails")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart every rank after a failure, up to this many times; the ranks resume from the latest "
                        "checkpoint (megacore.train sets checkpoint.resume = auto on a restart)")
    p.add_argument("--stop-timeout", type=float, default=300.0,
                   help="after SIGTERM/SIGUSR1/Ctrl-C, seconds the ranks get to finish the step and save before they "
                        "are ended")
    p.add_argument("-m", dest="module", action="store_true", help="run script as a module (python -m)")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    for name in ("nproc_per_node", "nnodes"):
        v = getattr(a, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if not 0 <= a.node_rank < a.nnodes:
        p.error(f"--node-rank {a.node_rank} must be in [0, {a.nnodes}); set --nnodes to the number of nodes")
    if a.max_restarts < 0:
        p.error(f"--max-restarts must be >= 0, got {a.max_restarts}")
    if a.nnodes > 1 and a.master_port == 0:
        p.error("--master-port is required with --nnodes > 1 (every node must use the same port)")
    return a


def store_token(nnodes: int) -> str:
    """The secret that rank 0's rendezvous store asks of every rank (see docs/comm.md)."""
    token = os.environ.get("MEGACORE_STORE_TOKEN", "")
    if token:
        return token
    if nnodes > 1:
        # Each node runs its own launcher: a token made here would differ from the other nodes'.
        raise SystemExit("megacore.launch: --nnodes > 1 needs the same MEGACORE_STORE_TOKEN on every node (the secret "
                         "rank 0's store asks of every rank); export one, e.g. "
                         "MEGACORE_STORE_TOKEN=$(openssl rand -hex 32), and pass it to every node's launcher")
    return secrets.token_hex(32)


def _command(a) -> list[str]:
    return [sys.executable, "-u"] + (["-m", a.script] if a.module else [a.script]) + a.script_args


class _Job:
    """The processes of one attempt: the ranks (GPU path) or mpirun (CPU path), with how to ask them to stop
    after the current step (`soft`) and how to end them now (`hard`)."""

    def __init__(self, procs, soft, hard, label):
        self.procs, self.soft_sig, self.hard_sig, self.label = procs, soft, hard, label
        self.started = time.monotonic()

    def send(self, sig):
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass

    def kill(self):
        self.send(self.hard_sig)
        if self.hard_sig != signal.SIGKILL:
            t = time.monotonic() + 10
            while time.monotonic() < t and any(p.poll() is None for p in self.procs):
                time.sleep(0.1)
            self.send(signal.SIGKILL)


def _start_mpi(a, nproc: int, env) -> _Job | int:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        sys.stderr.write("megacore.launch: CPU ranks need Open MPI's mpirun (apt-get install openmpi-bin), or run "
                         "on a machine with GPUs\n")
        return 2
    if a.nnodes > 1:
        sys.stderr.write("megacore.launch: multi-node CPU runs go through mpirun or srun directly\n")
        return 2
    env = dict(env, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # mpirun's own variables describe the ranks
    if a.cpu:
        # --cpu means CPU ranks even where GPUs are visible: hidden from the ranks, device 'auto' picks the CPU
        # (and MPI) as it does on a machine without GPUs.
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(nproc)] + _command(a)
    # mpirun passes SIGUSR1 on to every rank (a stop after the step); on SIGTERM it ends the job itself.
    return _Job([_proc.popen(cmd, env=env)], signal.SIGUSR1, signal.SIGTERM, "mpirun")


def _start_ranks(a, nproc: int, env, token: str, port: int) -> _Job:
    world = nproc * a.nnodes
    procs = []
    # A launcher started from an MPI process (an Open MPI singleton, e.g. a test that used the CPU backend, or a
    # job step under mpirun) must not hand its MPI identity to the ranks it spawns: they would see "rank 0 of 1"
    # from MPI next to the rank this launcher gives them.
    base = {k: v for k, v in env.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    for local in range(nproc):
        rank = a.node_rank * nproc + local
        renv = dict(base, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                    LOCAL_WORLD_SIZE=str(nproc), NODE_RANK=str(a.node_rank), GROUP_RANK=str(a.node_rank),
                    MASTER_ADDR=a.master_addr, MASTER_PORT=str(port), MEGACORE_STORE_TOKEN=token)
        procs.append(_proc.popen(_command(a), env=renv))
    return _Job(procs, signal.SIGTERM, signal.SIGKILL, "rank")


class _Signals:
    """SIGTERM, SIGUSR1 and a first SIGINT ask the job to stop after its current step (the ranks save a
    checkpoint); a second SIGINT, or a stop that takes longer than --stop-timeout, ends it at once."""

    def __init__(self):
        self.stop_at = None   # monotonic time of the first stop request
        self.interrupts = 0
        self.job = None
        self.pending = False  # a stop request not yet passed to the ranks (_wait passes it once they handle it)
        for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(s, self._on)

    def _on(self, sig, _frame):
        if sig == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                _proc.write_stderr("megacore.launch: second interrupt; ending the job now")
                if self.job:
                    self.job.kill()
                return
        if self.stop_at is None:
            self.stop_at = time.monotonic()
            _proc.write_stderr(f"megacore.launch: {signal.Signals(sig).name}: the ranks stop after the current step "
                               "and save a checkpoint (Ctrl-C again to end them now)")
        self.pending = True


# A stop request reaches the ranks once every one has reported that it handles the stop signals
# (_proc.report_ready, from megacore.train): before that the signal's default action would end a rank still
# starting. A rank command that never reports gets it this long after its start.
READY_WAIT_S = 10.0


def _wait(job: _Job, a, sigs: _Signals, job_dir: str, nproc: int):
    """Waits for the attempt to end, passing a stop request on when the ranks can take it; returns (label, index,
    code) of the first failure, or None."""
    failed, deadline = None, None
    while True:
        if sigs.pending and (_proc.ready_ranks(job_dir) >= nproc or time.monotonic() > job.started + READY_WAIT_S):
            sigs.pending = False
            job.send(job.soft_sig)
        codes = [p.poll() for p in job.procs]
        bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if bad and failed is None:
            failed = (job.label,) + bad[0]
            if any(c is None for c in codes) and len(job.procs) > 1:
                _proc.write_stderr(f"megacore.launch: local rank {bad[0][0]} exited with code {bad[0][1]}; stopping "
                                   f"the other ranks in {a.grace:.0f} s")
            deadline = time.monotonic() + a.grace
        if all(c is not None for c in codes):
            return failed
        now = time.monotonic()
        if failed is not None and now > deadline:
            job.kill()  # ranks waiting on a dead peer cannot stop gracefully
        if sigs.stop_at is not None and now > sigs.stop_at + a.stop_timeout:
            _proc.write_stderr(f"megacore.launch: the ranks did not stop within --stop-timeout {a.stop_timeout:.0f} s; "
                               "ending them now")
            sigs.stop_at = float("inf")
            job.kill()
        time.sleep(0.05)


def _describe(failed, job_dir) -> str:
    first = _proc.first_error(job_dir)
    if first is not None:
        return f"rank {first[0]} failed first: {first[1]}"
    label, i, code = failed
    how = f"signal {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else f"code {code}"
    return f"{'local rank ' + str(i) if label == 'rank' else 'mpirun'} exited with {how}"


def main(argv=None) -> int:
    a = parse_args(argv)
    # Whether the user watches a terminal is known here, not in the ranks (mpirun gives them a pty even when
    # this launcher writes to a file or a pipe); the trainer draws its progress bar only then.
    os.environ.setdefault("MEGACORE_STDOUT_IS_TTY", "1" if sys.stdout.isatty() else "0")
    gpus = 0 if a.cpu else _gpu_count()
    nproc = a.nproc_per_node or max(gpus, 1)
    if gpus and nproc > gpus:
        # Rank r takes GPU r % gpus, and NCCL refuses two ranks of one communicator on one GPU: refused here, before
        # any rank starts, instead of by every rank's NCCL init.
        raise SystemExit(f"megacore.launch: --nproc-per-node {nproc} starts {nproc} GPU ranks, but this node has {gpus} "
                         f"visible GPU{'s' if gpus > 1 else ''} and each GPU rank needs one of its own; start at most "
                         f"{gpus} (--nproc-per-node {gpus}), or CPU ranks with --cpu")
    token = port = None
    if gpus > 0:
        token = store_token(a.nnodes)
        port = a.master_port or _free_port()
    own_dir = _proc.JOB_DIR_ENV not in os.environ
    job_dir = os.environ.get(_proc.JOB_DIR_ENV) or tempfile.mkdtemp(prefix="megacore-job-")
    sigs = _Signals()
    restarts, last_step = 0, -1
    try:
        while True:
            env = dict(os.environ, **{_proc.JOB_DIR_ENV: job_dir, "MEGACORE_RESTART": str(restarts)})
            if gpus == 0:
                job = _start_mpi(a, nproc, env)
                if isinstance(job, int):
                    return job
            else:
                if restarts and not a.master_port:
                    port = _free_port()  # the old store's port may linger in TIME_WAIT
                job = _start_ranks(a, nproc, env, token, port)
            sigs.job = job
            if sigs.stop_at is not None:
                sigs.pending = True  # asked to stop between attempts: passed on once the ranks can take it
            failed = _wait(job, a, sigs, job_dir, nproc)
            if failed is None:
                return 0
            what = _describe(failed, job_dir)
            code = failed[2] if failed[2] > 0 else 1
            step = _proc.read_progress(job_dir)
            if sigs.stop_at is not None:
                _proc.write_stderr(f"megacore.launch: job stopped on request: {what}")
                return 130 if sigs.interrupts > 1 else code  # a second Ctrl-C: the shell's code for an interrupt
            if restarts >= a.max_restarts:
                extra = f" after {restarts} restart{'s' if restarts != 1 else ''}" if restarts else ""
                _proc.write_stderr(f"megacore.launch: job failed{extra}: {what}")
                return code
            if restarts and step <= last_step:
                _proc.write_stderr(f"megacore.launch: job failed: {what}; the restarted job made no progress (still "
                                   f"at step {step}), so it is not restarted again")
                return code
            restarts += 1
            last_step = step
            _proc.write_stderr(f"megacore.launch: {what}; restarting every rank from the latest checkpoint "
                               f"(restart {restarts} of {a.max_restarts}, last step reached {step})")
            _proc.clear_reports(job_dir)
    finally:
        if own_dir:
            shutil.rmtree(job_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
