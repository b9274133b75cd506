"""Executors: the Slurm script and the Kubeflow PyTorchJob manifest are rendered from a recipe and checked
field by field (the manifest against the PyTorchJob v1 schema's required structure)."""

import json
import os

import pytest

from megacore import executors, recipes
from megacore.errors import ConfigError


def test_slurm_dry_run_script(capsys):
    r = recipes.llama32_1b.pretrain_recipe(num_nodes=2, num_gpus_per_node=8)
    ex = executors.SlurmExecutor(account="acct", partition="gpu", time="01:00:00", job_dir="/shared/run1",
                                 container_image="nvcr.io/x/megacore:1", env={"NCCL_IB_HCA": "mlx5"}, dryrun=True)
    assert ex.launch(r) == 0
    s = capsys.readouterr().out
    lines = s.splitlines()
    assert lines[0] == "#!/bin/bash"
    for want in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --account=acct", "#SBATCH --partition=gpu", "#SBATCH --time=01:00:00",
                 "export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}", "export NCCL_IB_HCA=mlx5"):
        assert want in lines, want
    (srun,) = [line for line in lines if line.startswith("srun ")]
    assert "--container-image=nvcr.io/x/megacore:1" in srun and "/shared/run1:/shared/run1" in srun
    assert srun.endswith("python -u -m megacore.train --config /shared/run1/recipe.json")
    # srun gives every task SLURM_PROCID/SLURM_NTASKS, which megacore.comm.init_from_env reads
    assert "MASTER_ADDR=$(scontrol show hostnames" in s
    # The store token is made when the job starts (srun passes it on), so no file holds it.
    (tok,) = [line for line in lines if line.startswith("export MEGACORE_STORE_TOKEN=")]
    assert "/dev/urandom" in tok and lines.index(tok) < lines.index(srun)


def test_slurm_refuses_an_invalid_recipe_before_writing_anything(tmp_path):
    r = recipes.tiny.pretrain_recipe()
    r.parallel.tensor_model_parallel_size = 3
    with pytest.raises(ConfigError, match="not divisible by TP×PP×CP"):
        executors.SlurmExecutor(job_dir=str(tmp_path / "job"), nodes=1, gpus_per_node=4).launch(r)
    assert not (tmp_path / "job").exists()


def _check_container(c, gpus):
    assert c["name"] == "pytorch"  # the Kubeflow training operator finds the container by this name
    assert isinstance(c["image"], str) and c["image"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
    assert env["NCCL_NVLS_ENABLE"] == "0"
    # Every pod's ranks get the job's store token from its Secret, not from the job spec.
    assert env["MEGACORE_STORE_TOKEN"]["secretKeyRef"]["key"] == "token"
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts["/dev/shm"] == "dshm" and mounts["/etc/megacore"] == "recipe"
    cmd = " ".join(c["command"])
    assert f"--nproc-per-node {gpus}" in cmd and "--node-rank ${RANK}" in cmd
    assert "--master-addr ${MASTER_ADDR}" in cmd and "--config /etc/megacore/recipe.json" in cmd


def test_kubernetes_manifest_follows_the_pytorchjob_schema():
    r = recipes.llama32_1b.pretrain_recipe(num_nodes=3, num_gpus_per_node=8)
    ex = executors.KubernetesExecutor(image="registry/megacore:1", namespace="ml", memory="500Gi")
    cm, secret, job = ex.manifests(r)
    assert cm["kind"] == "ConfigMap" and cm["apiVersion"] == "v1"
    assert secret["kind"] == "Secret" and secret["metadata"]["namespace"] == "ml"
    token = secret["stringData"]["token"]
    assert len(token) == 64 and int(token, 16) >= 0  # 32 random bytes in hex
    assert ex.manifests(r)[1]["stringData"]["token"] != token  # a fresh one per job
    saved = json.loads(cm["data"]["recipe.json"])
    assert saved["resources"] == {"num_nodes": 3, "num_gpus_per_node": 8}
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert job["metadata"]["name"] == "megacore-llama32-1b-pretrain" and job["metadata"]["namespace"] == "ml"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"}
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 2
    for spec in specs.values():
        assert spec["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode")
        pod = spec["template"]["spec"]
        (c,) = pod["containers"]
        _check_container(c, 8)
        vols = {v["name"]: v for v in pod["volumes"]}
        assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
        assert vols["recipe"]["configMap"]["name"] == cm["metadata"]["name"]
        (tok,) = [e for e in c["env"] if e["name"] == "MEGACORE_STORE_TOKEN"]
        assert tok["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
    assert job["spec"]["runPolicy"]["cleanPodPolicy"] in ("None", "All", "Running")


def test_kubernetes_dry_run_prints_yaml(capsys):
    yaml = pytest.importorskip("yaml")
    r = recipes.tiny.pretrain_recipe(num_nodes=1, num_gpus_per_node=4)
    assert executors.KubernetesExecutor(dryrun=True).launch(r) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs] == ["ConfigMap", "Secret", "PyTorchJob"]
    assert set(docs[2]["spec"]["pytorchReplicaSpecs"]) == {"Master"}  # one node: no workers


def test_local_dry_run_command(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = recipes.tiny.pretrain_recipe()
    assert executors.LocalExecutor(nproc_per_node=4, cpu=True).launch(r, dryrun=True) == 0
    out = capsys.readouterr().out
    cfg = os.path.join(str(tmp_path), "runs/tiny_pretrain/logs/recipe.json")
    assert f"-m megacore.launch --nproc-per-node 4 --cpu -m megacore.train --config {cfg}" in out
    assert os.path.isfile(cfg)  # the command reads it: a dry run writes it


def test_more_ranks_than_gpus_is_refused_before_launch(capsys, tmp_path, monkeypatch):
    """On a machine with fewer GPUs than the recipe's ranks (tiny: TP 2 x PP 2 on 4), `megacore train` is refused
    before any rank starts, naming the layout and the fixes (every rank would otherwise fail in NCCL's init with
    two ranks on one GPU); a dry run warns; --cpu and --nproc-per-node 1 are not refused."""
    from megacore import cli, launch

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launch, "_gpu_count", lambda: 1)
    r = recipes.tiny.pretrain_recipe()
    with pytest.raises(ConfigError, match=r"runs 4 ranks .*TP 2 x PP 2 x CP 1 x DP 1.*1 GPU is visible.*"
                                          r"--nproc-per-node 1.*--cpu"):
        executors.LocalExecutor().launch(r)
    assert not os.path.exists(tmp_path / "runs/tiny_pretrain/logs/recipe.json")  # nothing written
    r.parallel.tensor_model_parallel_size = r.parallel.pipeline_model_parallel_size = 1  # DP 4: still 4 ranks
    with pytest.raises(ConfigError, match=r"TP 1 x PP 1 x CP 1 x DP 4"):
        executors.LocalExecutor().launch(r)
    assert executors.LocalExecutor().launch(recipes.tiny.pretrain_recipe(), dryrun=True) == 0
    assert "warning: the recipe runs 4 ranks" in capsys.readouterr().err
    # From the CLI as getting-started gives it: an error (exit status 1), no rank started.
    assert cli.main(["train", "--recipe", "tiny", "--set", "trainer.max_steps=20"]) == 1
    err = capsys.readouterr().err
    assert "1 GPU is visible" in err and "--nproc-per-node 1" in err
    # The fixes it names pass this check: CPU ranks, and one rank (the recipe's layout follows it).
    assert executors.LocalExecutor(cpu=True).launch(recipes.tiny.pretrain_recipe(), dryrun=True) == 0
    assert cli.main(["train", "--recipe", "tiny", "--nproc-per-node", "1", "--dryrun"]) == 0
    out = capsys.readouterr()
    assert "--nproc-per-node 1 -m megacore.train" in out.out and "warning: the recipe runs" not in out.err
    one = json.load(open(tmp_path / "runs/tiny_pretrain/logs/recipe.json"))
    assert one["parallel"]["tensor_model_parallel_size"] == one["parallel"]["pipeline_model_parallel_size"] == 1


def test_slurm_cpu_ranks_script():
    r = recipes.tiny.pretrain_recipe(num_gpus_per_node=2)
    s = executors.SlurmExecutor(cpu=True, job_dir="/shared/cpu").script(r)
    assert "#SBATCH --ntasks-per-node=2" in s and "--gpus-per-node" not in s and "MASTER_ADDR" not in s
    (srun,) = [line for line in s.splitlines() if line.startswith("srun ")]
    assert "--mpi=pmix" in srun and "--container" not in srun
    assert srun.endswith(" -u -m megacore.train --config /shared/cpu/recipe.json")
    r.trainer.device = "cuda"
    with pytest.raises(ConfigError, match="trainer.device = cuda"):
        executors.SlurmExecutor(cpu=True).script(r)


def test_slurm_submit_writes_the_job_and_strips_rank_variables(tmp_path, monkeypatch):
    """submit() writes recipe.json and job.sbatch to the job dir (default: the recipe's log_dir) and calls sbatch
    without the submitting process's own rank variables (an MPI singleton's or a torchrun worker's), which the job's
    ranks would otherwise read before Slurm's."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "sbatch"
    fake.write_text('#!/bin/sh\nenv > "$(dirname "$0")/env.txt"\necho "$@" > "$(dirname "$0")/args.txt"\necho 42\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    for k, v in {"OMPI_COMM_WORLD_SIZE": "1", "PMIX_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "KEEP_ME": "1"}.items():
        monkeypatch.setenv(k, v)
    r = recipes.tiny.pretrain_recipe(num_gpus_per_node=2, dir=str(tmp_path / "run"))
    r.parallel.pipeline_model_parallel_size = 1
    ex = executors.SlurmExecutor(cpu=True)
    assert ex.submit(r) == "42"
    job_dir = tmp_path / "run" / "logs"
    assert (bindir / "args.txt").read_text().split() == ["--parsable", str(job_dir / "job.sbatch")]
    assert (job_dir / "job.sbatch").read_text() == ex.script(r)
    assert json.loads((job_dir / "recipe.json").read_text())["trainer"]["device"] == "cpu"
    env = dict(line.split("=", 1) for line in (bindir / "env.txt").read_text().splitlines() if "=" in line)
    assert "KEEP_ME" in env
    assert not {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "RANK", "WORLD_SIZE"} & set(env)


@pytest.mark.parametrize("outcomes,code,restarts", [
    # (exit code, rank 0's last step) per attempt: fails at 3, fails at 5 (progress), then succeeds
    ([(1, 3), (1, 5), (0, 7)], 0, ["0", "1", "2"]),
    # fails at 3, then at 3 again: no progress, the job ends with the attempt's code
    ([(1, 3), (7, 3)], 7, ["0", "1"]),
    # out of restarts (2): three attempts with progress, all failing
    ([(1, 2), (1, 4), (5, 6)], 5, ["0", "1", "2"]),
    # the first attempt fails before any step (rank 0 recorded none): restarted all the same, as megacore.launch does
    ([(1, -1), (0, 4)], 0, ["0", "1"]),
])
def test_slurm_script_restarts_failed_attempts_like_the_local_launcher(tmp_path, outcomes, code, restarts):
    """trainer.max_restarts on Slurm: the job script starts the ranks again within the allocation while each attempt
    gets further (rank 0's last step, in the job's folder) and restarts remain. The script runs here with a stand-in
    srun that records MEGACORE_RESTART and plays one attempt's outcome."""
    import subprocess

    r = recipes.tiny.pretrain_recipe(num_gpus_per_node=2, dir=str(tmp_path / "run"))
    r.parallel.pipeline_model_parallel_size = 1
    r.trainer.max_restarts = 2
    job_dir = tmp_path / "job"
    script = executors.SlurmExecutor(cpu=True, job_dir=str(job_dir)).script(r)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    plan = tmp_path / "plan.txt"
    plan.write_text("".join(f"{c} {s}\n" for c, s in outcomes))
    (bindir / "srun").write_text(
        '#!/bin/bash\n'
        f'echo "$MEGACORE_RESTART" >> {tmp_path}/restarts.txt\n'
        f'n=$(wc -l < {tmp_path}/restarts.txt)\n'
        f'read -r code step < <(sed -n "${{n}}p" {plan})\n'
        'if [ "$step" -ge 0 ]; then echo "$step" > "$MEGACORE_JOB_DIR/step"; fi\n'
        'touch "$MEGACORE_JOB_DIR/error.rank1.json"\n'
        'exit "$code"\n')
    (bindir / "srun").chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", SLURM_JOB_ID="77")
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == code, p.stdout + p.stderr
    assert (tmp_path / "restarts.txt").read_text().split() == restarts
    assert (job_dir / ".megacore-job-77").is_dir()
    if code:
        assert "megacore: job failed (code" in p.stderr, p.stderr
        assert ("no progress since the attempt before" in p.stderr) == (outcomes[-1][1] == outcomes[-2][1]), p.stderr
    assert p.stderr.count("megacore: attempt failed") == len(restarts) - 1, p.stderr


def test_slurm_script_without_restarts_runs_srun_once():
    r = recipes.tiny.pretrain_recipe(num_gpus_per_node=2)
    r.trainer.max_restarts = 0
    s = executors.SlurmExecutor(cpu=True, job_dir="/shared/cpu").script(r)
    assert "while true" not in s and sum(line.startswith("srun ") for line in s.splitlines()) == 1
    assert 'export MEGACORE_JOB_DIR=/shared/cpu/.megacore-job-"$SLURM_JOB_ID"' in s
