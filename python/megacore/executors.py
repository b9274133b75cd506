"""Executors: where a recipe runs. The same recipe runs unchanged on each.

* ``LocalExecutor(nproc_per_node=N)``: starts the ranks on this machine through ``megacore.launch`` (GPU ranks,
  or CPU ranks through mpirun when there is no GPU).
* ``SlurmExecutor(...)``: writes an sbatch script (one task per GPU, srun sets the rank environment that
  ``megacore.comm.init_from_env`` reads) and submits it; ``dryrun=True`` only prints it.
* ``KubernetesExecutor(...)``: renders a Kubeflow ``PyTorchJob`` (master + workers, one pod per node, GPU limits,
  NCCL environment, a memory-backed /dev/shm) and applies it with kubectl; ``dryrun=True`` only prints it.

Every rank of a job gets the same ``MEGACORE_STORE_TOKEN``, the secret rank 0's rendezvous store asks of each
connection (docs/comm.md): ``megacore.launch`` makes it for local runs, the Slurm script makes it when the job
starts (so it is in no file), and the Kubernetes executor puts a fresh one in a Secret of the job.

Every executor validates the recipe first (``Recipe.validate``), writes it as JSON next to the run's logs and
hands each rank ``python -m megacore.train --config <that file>``, so a run is reproducible from its config.

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

from .errors import ConfigError


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


@dataclass
class LocalExecutor:
    """Ranks on this machine. ``nproc_per_node`` defaults to the recipe's ``resources.num_gpus_per_node``;
    ``cpu=True`` forces CPU ranks even when GPUs are visible."""

    nproc_per_node: int | None = None
    cpu: bool = False
    env: dict = field(default_factory=dict)

    def launch(self, recipe, dryrun: bool = False) -> int:
        recipe = _sized(recipe, 1, self.nproc_per_node or 0)  # one node: this one
        n = recipe.resources.num_gpus_per_node
        for w in recipe.validate():
            print(f"megacore: warning: {w}", file=sys.stderr)
        cfg = _config_path(recipe)
        cmd = [sys.executable, "-m", "megacore.launch", "--nproc-per-node", str(n)] + (["--cpu"] if self.cpu else []) \
            + ["-m", "megacore.train", "--config", cfg]
        if dryrun:
            print(" ".join(shlex.quote(c) for c in cmd))
            return 0
        os.makedirs(os.path.dirname(cfg), exist_ok=True)
        recipe.to_json(cfg)
        return subprocess.call(cmd, env=dict(os.environ, **{k: str(v) for k, v in self.env.items()}))


@dataclass
class SlurmExecutor:
    """An sbatch job of ``nodes`` × ``gpus_per_node`` tasks (taken from the recipe's resources when 0)."""

    account: str = ""
    partition: str = ""
    time: str = "04:00:00"
    nodes: int = 0
    gpus_per_node: int = 0
    job_name: str = ""
    #: Container image (pyxis/enroot ``--container-image``); empty runs on the host environment.
    container_image: str = ""
    container_mounts: list = field(default_factory=list)
    #: Directory shared by all nodes where the recipe and logs are written.
    job_dir: str = ""
    env: dict = field(default_factory=dict)
    dryrun: bool = False

    def _job_dir(self, recipe) -> str:
        return self.job_dir or os.path.abspath(os.path.join("runs", recipe.name))

    def script(self, recipe) -> str:
        recipe = _sized(recipe, self.nodes, self.gpus_per_node)
        nodes, gpn = recipe.resources.num_nodes, recipe.resources.num_gpus_per_node
        job_dir = self._job_dir(recipe)
        cfg = os.path.join(job_dir, "recipe.json")
        lines = ["#!/bin/bash", f"#SBATCH --job-name={self.job_name or 'megacore-' + recipe.name}",
                 f"#SBATCH --nodes={nodes}", f"#SBATCH --ntasks-per-node={gpn}", f"#SBATCH --gpus-per-node={gpn}",
                 "#SBATCH --exclusive", f"#SBATCH --time={self.time}",
                 f"#SBATCH --output={job_dir}/slurm-%j.out"]
        if self.account:
            lines.append(f"#SBATCH --account={self.account}")
        if self.partition:
            lines.append(f"#SBATCH --partition={self.partition}")
        lines += ["set -euo pipefail", "# Rendezvous: the first node of the allocation; ranks come from SLURM_PROCID.",
                  'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                  "export MASTER_PORT=${MASTER_PORT:-29500}", "export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}",
                  "# The secret rank 0's rendezvous store asks of every rank; srun passes it to the tasks.",
                  "export MEGACORE_STORE_TOKEN=${MEGACORE_STORE_TOKEN:-$(od -An -N32 -tx1 /dev/urandom | tr -d ' \\n')}"]
        for k, v in sorted(self.env.items()):
            lines.append(f"export {k}={shlex.quote(str(v))}")
        srun = ["srun", "--kill-on-bad-exit=1", "--cpu-bind=none"]
        if self.container_image:
            srun.append(f"--container-image={self.container_image}")
            mounts = list(self.container_mounts) + [f"{job_dir}:{job_dir}"]
            srun.append("--container-mounts=" + ",".join(mounts))
        lines.append(" ".join(srun + ["python", "-u"] + _entry(cfg)))
        return "\n".join(lines) + "\n"

    def launch(self, recipe, dryrun: bool | None = None) -> int:
        recipe = _sized(recipe, self.nodes, self.gpus_per_node)
        for w in recipe.validate(check_paths=not (self.dryrun if dryrun is None else dryrun)):
            print(f"megacore: warning: {w}", file=sys.stderr)
        text = self.script(recipe)
        if self.dryrun if dryrun is None else dryrun:
            print(text, end="")
            return 0
        job_dir = self._job_dir(recipe)
        os.makedirs(job_dir, exist_ok=True)
        recipe.to_json(os.path.join(job_dir, "recipe.json"))
        path = os.path.join(job_dir, "job.sbatch")
        with open(path, "w") as f:
            f.write(text)
        if shutil.which("sbatch") is None:
            raise ConfigError(f"sbatch is not on PATH; the script is at {path} (submit it from a Slurm login node) "
                              "or use dryrun=True")
        return subprocess.call(["sbatch", path])


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
