"""Executors: where a recipe runs. The same recipe runs unchanged on each.

* ``LocalExecutor(nproc_per_node=N)``: starts the ranks on this machine through ``megacore.launch`` (GPU ranks,
  or CPU ranks through mpirun when there is no GPU).
* ``SlurmExecutor(...)``: writes an sbatch script (one task per GPU, srun sets the rank environment that
  ``megacore.comm.init_from_env`` reads; ``cpu=True``: CPU ranks joined by MPI through ``srun --mpi=pmix``) and
  submits it; ``dryrun=True`` only prints it.
* ``KubernetesExecutor(...)``: renders a Kubeflow ``PyTorchJob`` (master + workers, one pod per node, GPU limits,
  NCCL environment, a memory-backed /dev/shm) and applies it with kubectl; ``dryrun=True`` only prints it.

Every rank of a job gets the same ``MEGACORE_STORE_TOKEN``, the secret rank 0's rendezvous store asks of each
connection (docs/comm.md): ``megacore.launch`` makes it for local runs, the Slurm script makes it when the job
starts (so it is in no file), and the Kubernetes executor puts a fresh one in a Secret of the job.

Every executor validates the recipe first (``Recipe.validate``) and checks that its layout fits the GPUs by
`megacore plan`'s memory estimate (``trainer.memory_check``: the local GPUs, or for Slurm and Kubernetes a size given
in MEGACORE_GPU_MEMORY_GIB; each GPU rank also checks its own GPU as it starts), then writes it as JSON next to the
run's logs and hands each rank ``python -m megacore.train --config <that file>``, so a run is reproducible from its config.

``run(recipe, executor)`` is ``megacore.run``.
"""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

from . import _proc
from .errors import ConfigError


#: A launcher's per-process variables (torchrun, megacore.launch); see megacore.comm.init_from_env.
_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")


def _entry(config_path: str) -> list[str]:
    return ["-m", "megacore.train", "--config", config_path]


def _sized(recipe, nodes: int, gpus_per_node: int):
    """A copy of the recipe with the executor's sizes (0 keeps the recipe's own)."""
    r = recipe.copy()
    if nodes:
        r.resources.num_nodes = nodes
    if gpus_per_node:
        r.resources.num_gpus_per_node = gpus_per_node
    return r


def _config_path(recipe, base_dir: str | None = None) -> str:
    d = base_dir or recipe.logging.log_dir or os.path.join("runs", recipe.name)
    return os.path.join(d, "recipe.json")


def _check_memory(recipe, local: bool, nproc: int = 0, warn=None) -> bool:
    """``trainer.memory_check`` before GPU ranks start (cli.enforce_memory_check): refuses a layout whose `plan`
    estimate does not fit the GPUs, warns when it is tight. ``local``: the ranks use this machine's GPUs (the
    recipe's device is cuda, or auto with GPUs visible); otherwise (cluster nodes) only a size given in
    MEGACORE_GPU_MEMORY_GIB is checked here, and each rank checks its own GPU when it starts (megacore.train).
    Returns whether it checked."""
    from . import cli

    if recipe.trainer.device == "cpu" or recipe.trainer.memory_check == "off":
        return False
    if local:
        if recipe.trainer.device == "auto":
            from .launch import _gpu_count

            if _gpu_count() == 0:
                return False  # CPU ranks
        gib = cli.gpu_memory_gib(range(nproc))
    else:
        gib = cli.gpu_memory_gib() if os.environ.get(cli.GPU_MEMORY_ENV) else None
    return cli.enforce_memory_check(recipe, gib, warn) is not None


def _cpu_ranks(recipe, who: str):
    """CPU ranks train on the CPU even where GPUs are visible: trainer.device becomes cpu."""
    if recipe.trainer.device == "cuda":
        raise ConfigError(f"{who} runs CPU ranks, but the recipe sets trainer.device = cuda; set it to auto or cpu, "
                          "or drop cpu=True")
    recipe.trainer.device = "cpu"


@dataclass
class LocalExecutor:
    """Ranks on this machine. ``nproc_per_node`` defaults to the recipe's ``resources.num_gpus_per_node``;
    ``cpu=True`` forces CPU ranks even when GPUs are visible."""

    nproc_per_node: int | None = None
    cpu: bool = False
    env: dict = field(default_factory=dict)

    def _prepare(self, recipe):
        recipe = _sized(recipe, 1, self.nproc_per_node or 0)  # one node: this one
        if self.cpu:
            _cpu_ranks(recipe, "LocalExecutor(cpu=True)")
        return recipe

    def check_memory(self, recipe, warn=None) -> bool:
        """``trainer.memory_check`` for this machine's GPUs alone (``launch`` does it too): raises ConfigError when
        the layout does not fit; returns whether GPUs were checked."""
        recipe = self._prepare(recipe)
        return _check_memory(recipe, local=not self.cpu, nproc=recipe.resources.num_gpus_per_node, warn=warn)

    def launch(self, recipe, dryrun: bool = False) -> int:
        recipe = self._prepare(recipe)
        n = recipe.resources.num_gpus_per_node
        for w in recipe.validate():
            print(f"megacore: warning: {w}", file=sys.stderr)
        if not self.cpu and recipe.trainer.device != "cpu":
            from .launch import _gpu_count

            gpus = _gpu_count()
            if 0 < gpus < n:
                p = recipe.parallel
                msg = (f"the recipe runs {n} ranks on this machine (resources.num_gpus_per_node = {n}; TP "
                       f"{p.tensor_model_parallel_size} x PP {p.pipeline_model_parallel_size} x CP "
                       f"{p.context_parallel_size} x DP {recipe.data_parallel_size}), but {gpus} GPU"
                       f"{'s are' if gpus > 1 else ' is'} visible and each GPU rank needs one of its own; run it on "
                       f"{gpus} (`megacore train --nproc-per-node {gpus}`, which sizes a small recipe's layout to the "
                       f"GPUs; `megacore finetune --devices {gpus}`; LocalExecutor(nproc_per_node={gpus}) in Python), "
                       f"set a layout that fits, or use CPU ranks (--cpu)")
                if not dryrun:
                    raise ConfigError(msg)
                print(f"megacore: warning: {msg}", file=sys.stderr)
        checked = _check_memory(recipe, local=not self.cpu, nproc=n)
        cfg = os.path.abspath(_config_path(recipe))
        cmd = [sys.executable, "-m", "megacore.launch", "--nproc-per-node", str(n)] + (["--cpu"] if self.cpu else []) \
            + (["--max-restarts", str(recipe.trainer.max_restarts)] if recipe.trainer.max_restarts else []) \
            + ["-m", "megacore.train", "--config", cfg]
        # The recipe file is written in a dry run too: the printed command reads it, so it works when pasted.
        os.makedirs(os.path.dirname(cfg) or ".", exist_ok=True)
        recipe.to_json(cfg)
        if dryrun:
            print(f"megacore: wrote the recipe to {cfg}; the command below runs it", file=sys.stderr)
            print(" ".join(shlex.quote(c) for c in cmd))
            return 0
        # The launcher (and through it mpirun and the ranks) is passed this process's SIGTERM/SIGINT/SIGUSR1 and
        # dies with it: stopping `megacore train` stops the whole job.
        from .cli import MEMORY_CHECKED_ENV

        env = dict(os.environ, **{k: str(v) for k, v in self.env.items()})
        if checked:
            env[MEMORY_CHECKED_ENV] = "1"  # the ranks print the estimate without repeating the warning
        return _proc.call(cmd, env=env)


@dataclass
class SlurmExecutor:
    """An sbatch job of ``nodes`` × ``gpus_per_node`` tasks (taken from the recipe's resources when 0), one rank per
    task, started by ``srun`` inside the allocation.

    GPU ranks (the default) get ``--gpus-per-node`` and bootstrap NCCL through MASTER_ADDR/MASTER_PORT (the first
    node of the allocation, a port derived from the job id); ``cpu=True`` runs CPU ranks instead: no GPUs are asked
    for, the recipe's ``trainer.device`` becomes ``cpu`` and srun starts the ranks with ``--mpi=pmix`` so that each
    one joins MPI_COMM_WORLD through Slurm's PMIx server (Open MPI built with PMIx, as Debian's and most sites' are).

    The job runs with the submitting shell's environment (sbatch exports it by default): the python that runs
    ``megacore.train`` on the nodes is ``python`` (default: this interpreter, ``sys.executable``, or ``python``
    inside a container) and must import megacore there: an installed package, or PYTHONPATH passed through
    ``env``. ``job_dir`` (default: the recipe's ``logging.log_dir``) must be on a filesystem every node sees; the
    ranks report to ``<job_dir>/.megacore-job-<id>``. With ``trainer.max_restarts = N`` the script starts a failed
    attempt's ranks again within the allocation (``MEGACORE_RESTART=<n>``: they resume from the latest checkpoint),
    up to N times, as long as each attempt got further than the one before (the rule of ``megacore.launch``).

    Preemption and time limits: the script asks for ``--signal=TERM@120`` (``signal``; "" leaves it out): 120 s
    before the time limit Slurm sends SIGTERM to every task, and the ranks finish the current step, save a
    checkpoint and exit 0 (``megacore.train`` traps SIGTERM and SIGUSR1 and the ranks agree on the step to stop
    after). Give the time a checkpoint save takes on your model; the job is killed at the limit regardless.
    Resubmitting the same recipe resumes from the newest checkpoint (``checkpoint.resume = auto``)."""

    account: str = ""
    partition: str = ""
    time: str = "04:00:00"
    #: sbatch ``--signal``: which signal to send the tasks how long before the time limit ("" = none).
    signal: str = "TERM@120"
    nodes: int = 0
    gpus_per_node: int = 0
    job_name: str = ""
    #: CPU ranks (MPI through srun --mpi=pmix) instead of one GPU per task.
    cpu: bool = False
    #: srun's ``--mpi`` plugin for CPU ranks (``srun --mpi=list`` shows the site's).
    mpi: str = "pmix"
    #: The interpreter on the nodes; "" = ``sys.executable`` on the host, ``python`` inside a container.
    python: str = ""
    #: Container image (pyxis/enroot ``--container-image``); empty runs on the host environment.
    container_image: str = ""
    container_mounts: list = field(default_factory=list)
    #: Directory shared by all nodes where the recipe, the sbatch script and Slurm's output are written.
    job_dir: str = ""
    env: dict = field(default_factory=dict)
    dryrun: bool = False

    def _job_dir(self, recipe) -> str:
        return os.path.abspath(self.job_dir or os.path.dirname(_config_path(recipe)))

    def _prepare(self, recipe):
        recipe = _sized(recipe, self.nodes, self.gpus_per_node)
        if self.cpu:
            _cpu_ranks(recipe, "SlurmExecutor(cpu=True)")
        return recipe

    def script(self, recipe) -> str:
        recipe = self._prepare(recipe)
        nodes, gpn = recipe.resources.num_nodes, recipe.resources.num_gpus_per_node
        job_dir = self._job_dir(recipe)
        cfg = os.path.join(job_dir, "recipe.json")
        lines = ["#!/bin/bash", f"#SBATCH --job-name={self.job_name or 'megacore-' + recipe.name}",
                 f"#SBATCH --nodes={nodes}", f"#SBATCH --ntasks-per-node={gpn}"]
        if not self.cpu:
            lines.append(f"#SBATCH --gpus-per-node={gpn}")
        lines += ["#SBATCH --exclusive", f"#SBATCH --time={self.time}", f"#SBATCH --output={job_dir}/slurm-%j.out"]
        if self.account:
            lines.append(f"#SBATCH --account={self.account}")
        if self.partition:
            lines.append(f"#SBATCH --partition={self.partition}")
        if self.signal:
            lines += [f"#SBATCH --signal={self.signal}",
                      "# The ranks trap the signal: they finish the step, save a checkpoint and exit 0; resubmit to resume."]
        lines += ["set -euo pipefail"]
        if self.cpu:
            lines.append("# CPU ranks: srun starts them as MPI processes (PMIx); each reads its rank from MPI.")
        else:
            lines += ["# Rendezvous: the first node of the allocation; ranks come from SLURM_PROCID.",
                      'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                      "# A port of this job's own, so that jobs sharing a node do not meet on one port.",
                      "export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}",
                      "export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}",
                      "# The secret rank 0's rendezvous store asks of every rank; srun passes it to the tasks.",
                      "export MEGACORE_STORE_TOKEN=${MEGACORE_STORE_TOKEN:-$(od -An -N32 -tx1 /dev/urandom | tr -d ' \\n')}"]
        for k, v in sorted(self.env.items()):
            lines.append(f"export {k}={shlex.quote(str(v))}")
        srun = ["srun", "--kill-on-bad-exit=1", "--cpu-bind=none"]
        if self.cpu:
            srun.append(f"--mpi={self.mpi}")
        if self.container_image:
            srun.append(f"--container-image={self.container_image}")
            mounts = list(self.container_mounts) + [f"{job_dir}:{job_dir}"]
            srun.append("--container-mounts=" + ",".join(mounts))
        python = self.python or ("python" if self.container_image else sys.executable)
        cmd = " ".join(srun + [shlex.quote(python), "-u"] + [shlex.quote(a) for a in _entry(cfg)])
        # The job's folder for the ranks' reports (errors, rank 0's last completed step), on the file system every
        # node shares with job_dir.
        lines += ["# The ranks' reports (errors, rank 0's last step) go to a folder of this job beside the recipe.",
                  f'export MEGACORE_JOB_DIR={shlex.quote(job_dir)}/.megacore-job-"$SLURM_JOB_ID"',
                  'mkdir -p "$MEGACORE_JOB_DIR"']
        n = int(recipe.trainer.max_restarts or 0)
        if n <= 0:
            lines.append(cmd)
            return "\n".join(lines) + "\n"
        # trainer.max_restarts within the allocation, by the rule megacore.launch follows locally: a failed attempt
        # starts every rank again (MEGACORE_RESTART=<n>: they resume from the latest checkpoint under
        # checkpoint.save_dir), as long as it got further than the attempt before.
        lines += [f"# trainer.max_restarts = {n}: a failed attempt starts every rank again (MEGACORE_RESTART=<n>; they "
                  "resume from the latest checkpoint), as long as it got further than the one before.",
                  "restart=0",
                  "last=-1",
                  "while true; do",
                  "  rc=0",
                  f'  MEGACORE_RESTART="$restart" {cmd} || rc=$?',
                  '  if [ "$rc" -eq 0 ]; then exit 0; fi',
                  '  step=$(cat "$MEGACORE_JOB_DIR/step" 2>/dev/null || echo -1)',
                  # the first failure is always restarted (it may come before any step); later ones need progress
                  '  stalled=0',
                  '  if [ "$restart" -gt 0 ] && [ "$step" -le "$last" ]; then stalled=1; fi',
                  f'  if [ "$restart" -ge {n} ] || [ "$stalled" -eq 1 ]; then',
                  f'    echo "megacore: job failed (code $rc, last completed step $step) after $restart of {n} restarts'
                  '$( [ "$stalled" -eq 1 ] && echo ": no progress since the attempt before")" >&2',
                  '    exit "$rc"',
                  "  fi",
                  "  restart=$((restart + 1))",
                  "  last=$step",
                  f'  echo "megacore: attempt failed (code $rc) after step $step; restart $restart of {n}" >&2',
                  '  rm -f "$MEGACORE_JOB_DIR"/error.rank* "$MEGACORE_JOB_DIR"/ready.rank*',
                  "done"]
        return "\n".join(lines) + "\n"

    def submit(self, recipe) -> str:
        """Validates the recipe, writes it, the script (job.sbatch) and submits it; returns Slurm's job id. The
        job's output goes to ``<job_dir>/slurm-<id>.out``."""
        recipe = self._prepare(recipe)
        for w in recipe.validate():
            print(f"megacore: warning: {w}", file=sys.stderr)
        _check_memory(recipe, local=False)
        text = self.script(recipe)
        job_dir = self._job_dir(recipe)
        os.makedirs(job_dir, exist_ok=True)
        recipe.to_json(os.path.join(job_dir, "recipe.json"))
        path = os.path.join(job_dir, "job.sbatch")
        with open(path, "w") as f:
            f.write(text)
        if shutil.which("sbatch") is None:
            raise ConfigError(f"sbatch is not on PATH; the script is at {path} (submit it from a Slurm login node) "
                              "or use dryrun=True")
        # The job inherits this environment (sbatch --export=ALL); a submitting process that is itself a rank (an
        # MPI singleton, a torchrun worker) must not hand its identity to the job's ranks, which read theirs first.
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("OMPI_", "PMIX_", "PMI_", "TORCHELASTIC_")) and k not in _RANK_VARS}
        p = subprocess.run(["sbatch", "--parsable", path], capture_output=True, text=True, env=env)
        if p.returncode != 0:
            raise ConfigError(f"sbatch {path} failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
        return p.stdout.strip().split(";")[0]  # "<id>" or "<id>;<cluster>"

    def launch(self, recipe, dryrun: bool | None = None) -> int:
        if self.dryrun if dryrun is None else dryrun:
            recipe = self._prepare(recipe)
            for w in recipe.validate(check_paths=False):
                print(f"megacore: warning: {w}", file=sys.stderr)
            _check_memory(recipe, local=False)
            print(self.script(recipe), end="")
            return 0
        job = self.submit(recipe)
        print(f"Submitted batch job {job} (output: {self._job_dir(recipe)}/slurm-{job}.out)")
        return 0


@dataclass
class KubernetesExecutor:
    """A Kubeflow PyTorchJob: one pod per node (1 Master + nodes-1 Workers), each starting
    ``megacore.launch --nproc-per-node <gpus>`` with the PyTorchJob's MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE
    (RANK and WORLD_SIZE there count pods, i.e. nodes). The recipe travels in a ConfigMap mounted at
    /etc/megacore."""

    image: str = "megacore:latest"
    namespace: str = "default"
    nodes: int = 0
    gpus_per_node: int = 0
    name: str = ""
    shm_size: str = "64Gi"
    cpu: str = ""
    memory: str = ""
    env: dict = field(default_factory=dict)
    #: Extra volumes (dicts in the Kubernetes schema) and their mounts, e.g. a PVC for data and checkpoints.
    volumes: list = field(default_factory=list)
    volume_mounts: list = field(default_factory=list)
    dryrun: bool = False

    def manifests(self, recipe) -> list[dict]:
        rec = _sized(recipe, self.nodes, self.gpus_per_node)
        nodes, gpn = rec.resources.num_nodes, rec.resources.num_gpus_per_node
        name = (self.name or f"megacore-{recipe.name}").lower().replace("_", "-")
        cm_name = f"{name}-recipe"
        config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                      "metadata": {"name": cm_name, "namespace": self.namespace},
                      "data": {"recipe.json": rec.to_json()}}
        secret_name = f"{name}-store-token"
        # Every pod's launcher must hand its ranks the same token, so it is made once here, kept in a Secret
        # (readable only by who may read the job's Secrets) rather than in the job's spec.
        secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                  "metadata": {"name": secret_name, "namespace": self.namespace},
                  "stringData": {"token": secrets.token_hex(32)}}
        env = [{"name": "NCCL_NVLS_ENABLE", "value": "0"}, {"name": "NCCL_DEBUG", "value": "WARN"},
               {"name": "PYTHONUNBUFFERED", "value": "1"},
               {"name": "MEGACORE_STORE_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": secret_name, "key": "token"}}}]
        env += [{"name": k, "value": str(v)} for k, v in sorted(self.env.items())]
        command = ["bash", "-c", "exec python -m megacore.launch --nproc-per-node " + str(gpn) + " --nnodes " +
                   str(nodes) + " --node-rank ${RANK} --master-addr ${MASTER_ADDR} --master-port ${MASTER_PORT} " +
                   " ".join(_entry("/etc/megacore/recipe.json"))]
        limits = {"nvidia.com/gpu": gpn}
        if self.cpu:
            limits["cpu"] = self.cpu
        if self.memory:
            limits["memory"] = self.memory
        container = {"name": "pytorch", "image": self.image, "imagePullPolicy": "IfNotPresent", "command": command,
                     "env": env, "resources": {"limits": limits, "requests": dict(limits)},
                     "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                                      {"name": "recipe", "mountPath": "/etc/megacore", "readOnly": True}]
                     + list(self.volume_mounts)}
        volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": self.shm_size}},
                   {"name": "recipe", "configMap": {"name": cm_name}}] + list(self.volumes)

        def replica(n):
            return {"replicas": n, "restartPolicy": "OnFailure",
                    "template": {"spec": {"containers": [container], "volumes": volumes}}}

        specs = {"Master": replica(1)}
        if nodes > 1:
            specs["Worker"] = replica(nodes - 1)
        job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
               "metadata": {"name": name, "namespace": self.namespace, "labels": {"app": "megacore"}},
               "spec": {"runPolicy": {"cleanPodPolicy": "None", "backoffLimit": 0},
                        "pytorchReplicaSpecs": specs}}
        return [config_map, secret, job]

    def render(self, recipe) -> str:
        from .recipes.config import _yaml

        return "---\n".join(_yaml().safe_dump(m, sort_keys=False) for m in self.manifests(recipe))

    def launch(self, recipe, dryrun: bool | None = None) -> int:
        recipe = _sized(recipe, self.nodes, self.gpus_per_node)
        for w in recipe.validate(check_paths=False):
            print(f"megacore: warning: {w}", file=sys.stderr)
        if recipe.trainer.max_restarts:
            # Each pod runs megacore.launch for its own node, so a launcher-side restart would restart one node's
            # ranks only; the PyTorchJob ends on the first failure (backoffLimit 0).
            print(f"megacore: warning: trainer.max_restarts = {recipe.trainer.max_restarts} is not applied to a "
                  "PyTorchJob (it ends on the first failure): resubmit it to resume from the latest checkpoint, or "
                  "run on Slurm (SlurmExecutor) or one node (megacore.launch), which restart failed attempts",
                  file=sys.stderr)
        _check_memory(recipe, local=False)
        text = self.render(recipe)
        if self.dryrun if dryrun is None else dryrun:
            print(text, end="")
            return 0
        if shutil.which("kubectl") is None:
            raise ConfigError("kubectl is not on PATH; install it and point it at the cluster, or use dryrun=True "
                              "and apply the printed manifest yourself")
        return subprocess.run(["kubectl", "apply", "-f", "-"], input=text.encode()).returncode


def run(recipe, executor=None, dryrun: bool = False) -> int:
    """Validates the recipe and runs it with the executor (default: LocalExecutor of the recipe's GPU count)."""
    executor = executor or LocalExecutor()
    return executor.launch(recipe, dryrun=dryrun) if dryrun else executor.launch(recipe)


__all__ = ["LocalExecutor", "SlurmExecutor", "KubernetesExecutor", "run"]
