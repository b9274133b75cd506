"""Starts the ranks of one node: ``python -m megacore.launch --nproc-per-node N script.py [args]``.

Each child gets the torchrun-style environment that ``megacore.comm.init_from_env`` reads (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT) and the job's store token
(MEGACORE_STORE_TOKEN: 32 random bytes in hex, made here unless the environment already has one, which a
launch on several nodes needs so that every node passes the same). On a machine without
a visible GPU (or with ``--cpu``) the ranks are CPU ranks, which communicate through MPI, so the launcher
hands them to ``mpirun`` instead. If any rank fails, the others are stopped after ``--grace`` seconds and
the launcher exits with the failing rank's code: a job never hangs on a dead rank.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time


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


def _run_mpi(a, nproc: int) -> int:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        sys.stderr.write("megacore.launch: CPU ranks need Open MPI's mpirun (apt-get install openmpi-bin), or run "
                         "on a machine with GPUs\n")
        return 2
    if a.nnodes > 1:
        sys.stderr.write("megacore.launch: multi-node CPU runs go through mpirun or srun directly\n")
        return 2
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # mpirun's own variables describe the ranks
    if a.cpu:
        # --cpu means CPU ranks even where GPUs are visible: hidden from the ranks, device 'auto' picks the CPU
        # (and MPI) as it does on a machine without GPUs.
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(nproc)] + _command(a)
    return subprocess.call(cmd, env=env)


def main(argv=None) -> int:
    a = parse_args(argv)
    # Whether the user watches a terminal is known here, not in the ranks (mpirun gives them a pty even when
    # this launcher writes to a file or a pipe); the trainer draws its progress bar only then.
    os.environ.setdefault("MEGACORE_STDOUT_IS_TTY", "1" if sys.stdout.isatty() else "0")
    gpus = 0 if a.cpu else _gpu_count()
    nproc = a.nproc_per_node or max(gpus, 1)
    if gpus == 0:
        return _run_mpi(a, nproc)
    token = store_token(a.nnodes)
    port = a.master_port or _free_port()
    world = nproc * a.nnodes
    procs = []
    # A launcher started from an MPI process (an Open MPI singleton, e.g. a test that used the CPU backend, or a
    # job step under mpirun) must not hand its MPI identity to the ranks it spawns: they would see "rank 0 of 1"
    # from MPI next to the rank this launcher gives them.
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    for local in range(nproc):
        rank = a.node_rank * nproc + local
        env = dict(base, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                   LOCAL_WORLD_SIZE=str(nproc), NODE_RANK=str(a.node_rank), GROUP_RANK=str(a.node_rank),
                   MASTER_ADDR=a.master_addr, MASTER_PORT=str(port), MEGACORE_STORE_TOKEN=token)
        procs.append(subprocess.Popen(_command(a), env=env))

    def stop_all(sig=signal.SIGTERM):
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)

    signal.signal(signal.SIGTERM, lambda *_: stop_all())
    failed = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad and failed is None:
                failed = bad[0]
                sys.stderr.write(f"megacore.launch: local rank {failed[0]} exited with code {failed[1]}; "
                                 f"stopping the other ranks in {a.grace:.0f} s\n")
                deadline = time.monotonic() + a.grace
            if all(c is not None for c in codes):
                break
            if failed is not None and time.monotonic() > deadline:
                stop_all()
                time.sleep(1.0)
                stop_all(signal.SIGKILL)
            time.sleep(0.1)
    except KeyboardInterrupt:
        stop_all(signal.SIGINT)
        for p in procs:
            p.wait()
        return 130
    if failed is not None:
        return failed[1] if failed[1] > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
