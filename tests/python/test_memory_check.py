"""trainer.memory_check: before GPU ranks start, the recipe's layout is checked against the GPUs' memory by
`megacore plan`'s estimate (refused when it does not fit, with the layout `plan --fit` picks; a warning when it fits
with little to spare). The GPU's size is injected through MEGACORE_GPU_MEMORY_GIB, so this runs on CPU machines;
no 8B model is built (the refusal comes before any rank)."""

import os
import re
import types

import pytest

import megacore as mc
from megacore import _proc, cli, executors, train

# Llama-3-8B at seq 8192 on 4 GPUs with TP 1 (ZeRO-1 over DP 4): far over 80 GiB per GPU.
TP1 = ["--recipe", "llama3_8b", "--nproc-per-node", "4", "--set", "parallel.tp=1", "--set", "parallel.sp=false",
       "--set", "parallel.zero=true", "--set", 'data.paths=["embedded"]', "--set", "data.tokenizer=byte"]
GPU = ["--set", "trainer.device=cuda"]


@pytest.fixture
def no_ranks(monkeypatch, tmp_path):
    """Runs in an empty folder; starting any process (launcher, mpirun, rank) fails the test."""
    monkeypatch.chdir(tmp_path)

    def refuse(*a, **k):
        raise AssertionError(f"a process was started: {a}")
    monkeypatch.setattr(_proc, "call", refuse)
    monkeypatch.setattr(_proc, "popen", refuse)
    return tmp_path


def _recipe(args):
    a = cli.build_parser().parse_args(["train"] + args)
    return cli.load_recipe(a.recipe, a.config, a.set, a.nproc_per_node, a.nodes)


def test_refuses_a_layout_that_does_not_fit_before_any_rank_starts(no_ranks, monkeypatch, capsys):
    monkeypatch.setenv(cli.GPU_MEMORY_ENV, "80")
    assert cli.main(["train"] + TP1 + GPU) == 1
    err = capsys.readouterr().err
    r = cli.plan_recipe(_recipe(TP1 + GPU), 80.0)
    est = r["total_bytes"] / 2**30
    assert est > 80  # the case being tested: it cannot fit at all
    assert f"estimated {est:.1f} GiB per GPU" in err and "GPU's 80.0 GiB" in err, err
    # The fix is the layout fit_layout picks for these GPUs, spelled as --set flags, and it does fit.
    f = cli.fit_recipe(_recipe(TP1 + GPU), 80.0)
    assert cli.fit_flags(f) in err and "trainer.memory_check=warn" in err, err
    fixed = _recipe(TP1 + GPU + cli.fit_flags(f).split())
    assert fixed.parallel.tensor_model_parallel_size == f["tp"] > 1
    assert cli.check_memory(fixed, 80.0)["fits"]
    assert list(no_ranks.iterdir()) == []  # no recipe.json, log or checkpoint folder written
    # A dry run is refused the same way (the printed command would fail).
    assert cli.main(["train"] + TP1 + GPU + ["--dryrun"]) == 1
    assert list(no_ranks.iterdir()) == []


def test_warns_once_when_it_fits_with_little_to_spare(no_ranks, monkeypatch, capsys):
    tp4 = TP1 + GPU + ["--set", "parallel.tp=4", "--set", "parallel.sp=true", "--set", "trainer.recompute=selective"]
    est = cli.plan_recipe(_recipe(tp4))["total_bytes"] / 2**30
    # A GPU on which the estimate fits under plan's headroom (12 %) with 3 % of the GPU to spare (< 5 %).
    gpu = est / 0.85
    c = cli.check_memory(_recipe(tp4), gpu)
    assert c["fits"] and c["tight"] and c["usable_gib"] - est == pytest.approx(0.03 * gpu)
    monkeypatch.setenv(cli.GPU_MEMORY_ENV, f"{gpu}")
    assert cli.main(["train"] + tp4 + ["--dryrun"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "fits with" in warnings[0], warnings
    # Plenty of room: no warning.
    monkeypatch.setenv(cli.GPU_MEMORY_ENV, f"{est / 0.6}")
    assert cli.main(["train"] + tp4 + ["--dryrun"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_warn_and_off_let_the_user_launch(no_ranks, monkeypatch, capsys):
    monkeypatch.setenv(cli.GPU_MEMORY_ENV, "80")
    assert cli.main(["train"] + TP1 + GPU + ["--set", "trainer.memory_check=warn", "--dryrun"]) == 0
    err = capsys.readouterr().err
    assert "warning:" in err and "needs an estimated" in err and cli.fit_flags(cli.fit_recipe(_recipe(TP1), 80.0)) in err, err
    assert cli.main(["train"] + TP1 + GPU + ["--set", "trainer.memory_check=off", "--dryrun"]) == 0
    assert "needs an estimated" not in capsys.readouterr().err
    with pytest.raises(mc.ConfigError, match="memory_check"):
        _recipe(TP1 + ["--set", "trainer.memory_check=maybe"]).validate(check_paths=False)


def test_cpu_ranks_are_never_checked(no_ranks, monkeypatch, capsys):
    monkeypatch.setenv(cli.GPU_MEMORY_ENV, "80")
    assert cli.main(["train"] + TP1 + ["--cpu", "--dryrun"]) == 0
    assert "needs an estimated" not in capsys.readouterr().err
    if not mc.cuda_available():  # device auto on a machine without GPUs: CPU ranks
        assert cli.main(["train"] + TP1 + ["--dryrun"]) == 0
        assert "needs an estimated" not in capsys.readouterr().err


def test_cluster_executors_check_a_given_gpu_size(no_ranks, monkeypatch, capsys):
    r = _recipe(TP1)
    # The submit host's GPUs are not the nodes': without a size nothing is checked here (the ranks check theirs).
    monkeypatch.delenv(cli.GPU_MEMORY_ENV, raising=False)
    assert executors.SlurmExecutor(dryrun=True, job_dir=str(no_ranks / "job")).launch(r) == 0
    capsys.readouterr()
    monkeypatch.setenv(cli.GPU_MEMORY_ENV, "80")
    fix = re.escape(cli.fit_flags(cli.fit_recipe(r, 80.0)))
    with pytest.raises(mc.ConfigError, match=fix):
        executors.SlurmExecutor(dryrun=True, job_dir=str(no_ranks / "job")).launch(r)
    with pytest.raises(mc.ConfigError, match=fix):
        executors.KubernetesExecutor(dryrun=True).launch(r)


def test_gpu_ranks_check_their_own_gpu_and_print_the_estimate(monkeypatch, capsys):
    world = types.SimpleNamespace(rank=0, size=4, backend="nccl")
    monkeypatch.setenv(cli.GPU_MEMORY_ENV, "80")
    monkeypatch.delenv(cli.MEMORY_CHECKED_ENV, raising=False)
    with pytest.raises(mc.ConfigError, match="needs an estimated"):
        train._check_gpu_memory(_recipe(TP1), world)
    fits = _recipe(TP1 + ["--set", "parallel.tp=4", "--set", "parallel.sp=true"])
    train._check_gpu_memory(fits, world)
    est = cli.plan_recipe(fits)["total_bytes"] / 2**30
    out = capsys.readouterr().out
    assert f"plan estimates {est:.1f} GiB" in out and "of the GPU's 80.0 GiB" in out, out
    train._check_gpu_memory(fits, types.SimpleNamespace(rank=1, size=4, backend="nccl"))
    assert capsys.readouterr().out == ""  # rank 0 alone prints it


def test_gpu_memory_size_from_the_environment(monkeypatch):
    monkeypatch.setenv(cli.GPU_MEMORY_ENV, "79.5")
    assert cli.gpu_memory_gib() == 79.5
    monkeypatch.setenv(cli.GPU_MEMORY_ENV, "lots")
    with pytest.raises(mc.ConfigError, match=cli.GPU_MEMORY_ENV):
        cli.gpu_memory_gib()
    monkeypatch.delenv(cli.GPU_MEMORY_ENV)
    if mc.cuda_available():
        assert cli.gpu_memory_gib([0]) == mc.cuda_device_total_memory(0) / 2**30 > 1
    else:
        assert cli.gpu_memory_gib() is None


def test_finetune_is_refused_before_the_import_writes_anything(no_ranks, monkeypatch):
    import json

    hf = no_ranks / "hf"
    hf.mkdir()
    # Llama-3-8B's shapes (no weights: the refusal comes before they would be read).
    (hf / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0}))
    data = no_ranks / "train.jsonl"
    data.write_text("".join(json.dumps({"input": f"q{i}", "output": f"a{i}"}) + "\n" for i in range(8)))
    monkeypatch.setenv(cli.GPU_MEMORY_ENV, "80")
    out = no_ranks / "out"
    # Full fine-tuning of 8B parameters on one 80 GiB GPU: ~150 GiB of weights, gradients and AdamW state.
    with pytest.raises(mc.ConfigError, match="no layout of 1 GPUs fits"):
        mc.finetune(str(hf), str(data), peft=None, trainer={"devices": 1, "device": "cuda"}, output_path=str(out))
    assert not out.exists()


@pytest.mark.gpu
def test_real_gpu_memory_refuses_an_8b_tp1_layout(no_ranks, monkeypatch, capsys):
    monkeypatch.delenv(cli.GPU_MEMORY_ENV, raising=False)
    gib = mc.cuda_device_total_memory(0) / 2**30
    assert 8 < gib < 1024
    if gib > 200:
        pytest.skip(f"a {gib:.0f} GiB GPU holds the TP 1 layout")
    assert cli.main(["train"] + TP1 + ["--nproc-per-node", "1"]) == 1
    # The recipe is built for this GPU's memory, and no layout of one GPU holds 8B parameters' training state.
    assert f"no layout of 1 GPUs fits {gib:g} GiB" in capsys.readouterr().err
    assert list(no_ranks.iterdir()) == []


def test_lora_runs_are_not_checked():
    # plan counts gradients and AdamW state for all 8B weights; a LoRA run keeps them for its adapters only.
    r = _recipe(TP1 + GPU)
    with pytest.raises(mc.ConfigError, match="needs an estimated"):
        cli.enforce_memory_check(r, 80.0)
    r.peft.scheme = "lora"
    assert cli.enforce_memory_check(r, 80.0) is None


DATA = ["--set", 'data.paths=["embedded"]', "--set", "data.tokenizer=byte"]


def _dry_run_layout(no_ranks, args):
    """`megacore train ... --dryrun`: its exit status and the TP, PP, ZeRO-1 of the recipe.json it wrote."""
    import json

    rc = cli.main(["train", "--recipe", "llama3_8b", "--dryrun"] + DATA + args)
    f = no_ranks / "runs" / "llama3_8b_pretrain" / "logs" / "recipe.json"
    p = json.loads(f.read_text())["parallel"] if rc == 0 else {}
    return rc, tuple(p.get(k) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                        "use_distributed_optimizer"))


def test_train_fits_the_recipe_to_the_gpus_it_will_use(no_ranks, monkeypatch, capsys):
    # The size of this job's GPUs (here MEGACORE_GPU_MEMORY_GIB; on a GPU host, the local GPUs') picks the layout:
    # TP 2 + SP with ZeRO-1 over DP 2 and full recompute of its first layers on 4 × 80 GiB, TP 1 with ZeRO-1 over DP 4
    # on 4 × 140 GiB. trainer.device=cuda makes the launcher run its memory check for those GPUs even here: the fitted
    # layout passes it; on 80 GiB it is the fewest recomputed layers that fit, so it fits with little to spare (one
    # warning, no refusal).
    for gib, layout, tight in (("80", (2, 1, True), True), ("139.8", (1, 1, True), False)):
        monkeypatch.setenv(cli.GPU_MEMORY_ENV, gib)
        assert _dry_run_layout(no_ranks, ["--nproc-per-node", "4"] + GPU) == (0, layout)
        err = capsys.readouterr().err
        notes = [line for line in err.splitlines() if "layout fitted for" in line]
        assert len(notes) == 1 and f"fitted for {float(gib):.1f} GiB GPUs ({cli.GPU_MEMORY_ENV})" in notes[0], err
        warnings = [line for line in err.splitlines() if "warning" in line]
        assert len(warnings) == tight and all("fits with" in w for w in warnings), err
    # CPU ranks keep the recipe's documented 80 GiB layout whatever the GPUs.
    assert _dry_run_layout(no_ranks, ["--nproc-per-node", "4", "--cpu"]) == (0, (2, 1, True))
    assert "80.0 GiB GPUs (CPU ranks" in capsys.readouterr().err
    assert _dry_run_layout(no_ranks, ["--nproc-per-node", "4", "--set", "trainer.device=cpu"]) == (0, (2, 1, True))
    capsys.readouterr()
    # --set still pins a layout; the memory check then judges it (TP 1 does not fit 80 GiB: refused).
    monkeypatch.setenv(cli.GPU_MEMORY_ENV, "80")
    assert _dry_run_layout(no_ranks, ["--nproc-per-node", "4", "--set", "parallel.tp=1", "--set", "parallel.sp=false",
                                      "--set", "parallel.zero=true"] + GPU)[0] == 1
    assert "--set made it TP 1 × PP 1 + ZeRO-1" in capsys.readouterr().err


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_fitted_layout_passes_the_memory_check_on_that_card(no_ranks, monkeypatch, capsys, n):
    # Sizes from a 48 GiB card to a 192 GiB one: the recipe either launches (fitted under the check's own headroom)
    # or is refused while it is built, naming the smallest estimate; the check never refuses what the fit chose.
    for gib in (48, 64, 79.2, 80, 94, 120, 139.8, 192):
        monkeypatch.setenv(cli.GPU_MEMORY_ENV, str(gib))
        rc, _ = _dry_run_layout(no_ranks, ["--nproc-per-node", str(n)] + GPU)
        err = capsys.readouterr().err
        assert rc == 0 or f"no layout of {n} GPUs fits {gib:g} GiB" in err, (gib, err)
        assert "needs an estimated" not in err, (gib, err)
