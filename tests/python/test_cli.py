"""`megacore plan`: the layout, counts and memory estimate of a model and layout, validated up front;
`megacore --version`."""

import pytest
import megacore as mc
from megacore import cli


def test_plan_prints_layout_counts_and_memory(capsys):
    assert cli.main(["plan", "--model", "llama32_1b", "--world-size", "8", "--tp", "2", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert "1.236 B parameters" in out
    assert "world 8 = TP 2 × CP 1 × DP 2 × PP 2" in out
    assert "memory per GPU" in out and "stage 1:" in out
    # one table line per rank, with Megatron-Core's coordinates: rank 5 is tp 1, dp 0, pp 1
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert len(rows) == 8
    assert rows[5][:5] == ["5", "1", "0", "0", "1"]


def test_plan_numbers():
    r = cli.plan("llama3_8b", world_size=8, tp=2, pp=2)
    n = r["parameters"]
    # two stages split for the derived head cost (the first gets more layers), TP-sharded; embedding on the first
    # stage, output layer on the last
    k = r["rank_layers"][0]
    assert k > 16 and sum(r["rank_layers"]) == 32
    assert r["stage_params"][0] == (k * n["per_layer"] + n["embedding"]) / 2
    assert r["busiest_rank"] == 0  # the first stage holds PP micro-batches' activations
    assert r["memory_bytes"]["optimizer"] == 12 * r["stage_params"][0]
    zero = cli.plan("llama3_8b", world_size=8, tp=2, pp=2, zero=True)
    assert zero["memory_bytes"]["optimizer"] == r["memory_bytes"]["optimizer"] / 2  # DP = 2
    sp = cli.plan("llama3_8b", world_size=8, tp=2, pp=2, sequence_parallel=True)
    assert sp["memory_bytes"]["activations"] < r["memory_bytes"]["activations"]
    assert not cli.plan("llama3_8b", world_size=1, gpu_memory_gib=80)["fits"]


def test_plan_counts_the_optimizer_state_precision(capsys):
    f32 = cli.plan("llama32_1b", world_size=4, zero=True)
    b16 = cli.plan("llama32_1b", world_size=4, zero=True, main_params_dtype="bf16", main_grads_dtype="bf16",
                   exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    n = f32["stage_params"][0]
    # 4 + 4 + 4 bytes of state per parameter against 0 + 2 + 2, both over DP 4; main grads 4 against 2
    assert f32["memory_bytes"]["optimizer"] == 12 * n / 4 and b16["memory_bytes"]["optimizer"] == 4 * n / 4
    assert f32["memory_bytes"]["main_grads"] == 4 * n and b16["memory_bytes"]["main_grads"] == 2 * n
    # bf16 grads are reduce-scattered in bf16 into a bf16 shard
    assert b16["memory_bytes"]["grad_reduce"] == f32["memory_bytes"]["grad_reduce"] / 2
    moments = cli.plan("llama32_1b", world_size=4, exp_avg_dtype="bf16")
    assert moments["memory_bytes"]["optimizer"] == 10 * n
    # The recipe's fields reach `megacore plan`.
    assert cli.main(["plan", "--recipe", "llama32_1b", "--set", "optim.main_params_dtype=bf16", "--set",
                     "optim.exp_avg_dtype=bf16", "--set", "optim.exp_avg_sq_dtype=bf16", "--no-table"]) == 0
    out = capsys.readouterr().out
    assert "optimizer" in out
    with pytest.raises(mc.ValueError, match="exp_avg_dtype"):
        cli.plan("llama32_1b", world_size=1, exp_avg_dtype="f16")


def test_plan_balances_stages_for_the_head(capsys):
    even = cli.plan("llama32_1b", world_size=4, pp=4, pipeline_head_cost=0.0)  # both costs 0: the even split
    assert even["stage_layers"] == [4, 4, 4, 4] and even["stage_costs"] == (0.0, 0.0)
    # The head as two layers: the last stage gets one layer fewer, the surplus comes off the earliest stage.
    bal = cli.plan("llama32_1b", world_size=4, pp=4, pipeline_head_cost=2.0)
    assert bal["stage_layers"] == [4, 4, 5, 3] and bal["rank_layers"] == [4, 4, 5, 3]
    n = bal["parameters"]
    assert bal["stage_params"][2] == 5 * n["per_layer"]
    # 16 layers over PP 3 is not even, but can be balanced
    assert cli.main(["plan", "--model", "llama32_1b", "--world-size", "3", "--pp", "3", "--head-cost", "1.5",
                     "--no-table"]) == 0
    out = capsys.readouterr().out
    assert "pipeline layers per stage: 6, 6, 4 (head ≈ 1.5 layers; work per stage 6.0, 6.0, 5.5)" in out
    assert "stage 2: 4 layers (work ≈ 5.5 layers)" in out
    assert cli.plan("llama32_1b", world_size=4, pp=2, vp=2, pipeline_layout=[4, 4, 4, 4])["rank_layers"] == [8, 8]
    # Memory is that of the rank that needs the most: with 2/6/6/2 layers rank 1 holds 6 layers × 3 micro-batches.
    unit = even["memory_bytes"]["activations"] / (4 * 4)  # even split: rank 0, 4 layers × 4 micro-batches
    skew = cli.plan("llama32_1b", world_size=4, pp=4, pipeline_layout=[2, 6, 6, 2])
    assert skew["stage_layers"] == [2, 6, 6, 2]  # explicit counts win over the derived costs
    assert skew["busiest_rank"] == 1
    assert skew["memory_bytes"]["activations"] == pytest.approx(unit * 6 * 3)
    assert skew["memory_bytes"]["weights"] == 2 * skew["stage_params"][1]


def _llama32_1b_head_cost(seq, tp, recompute):
    """The head's matmul FLOPs over a layer's, from Llama 3.2 1B's shapes (h 2048, 32 heads × 64, 8 KV groups, SwiGLU
    FFN 8192, vocab 128256 = a multiple of 128·TP): per token fwd + bwd 6·W per layer plus causal attention 6·h·s,
    6·V·h for the output layer; recompute repeats the forward (a third) of all of it (full) or of attention."""
    h, f, kv, vocab = 2048, 8192, 8 * 64, 128256
    w = h * (h + 2 * kv) + h * h + h * 2 * f + f * h
    attn = 6 * h * seq
    layer = {"none": 6 * w + attn, "selective": 6 * w + attn * 4 / 3, "full": (6 * w + attn) * 4 / 3}[recompute]
    return 6 * vocab * h / layer


@pytest.mark.parametrize("pp,vp,recompute", [(2, 1, "none"), (2, 2, "none"), (4, 1, "none"), (2, 1, "selective"),
                                             (4, 2, "full")])
def test_plan_derives_the_head_cost_and_balances_by_default(pp, vp, recompute):
    """With no layout and no costs given, the llama32_1b recipe's split is the balanced one for the head cost derived
    from its shapes (the same the trainer uses: RunConfig.pipeline_stage_costs)."""
    rec = mc.recipes.llama32_1b.pretrain_recipe(num_gpus_per_node=4)
    rec.set("parallel.pp", pp).set("parallel.vp", vp).set("trainer.recompute", recompute)
    rec.set("data.global_batch_size", 64)
    r = cli.plan_recipe(rec)
    head = _llama32_1b_head_cost(2048, 1, recompute)
    assert r["stage_costs"][0] == 0.0 and r["stage_costs"][1] == pytest.approx(head, rel=1e-12)
    bal = mc.pipeline.PipelineLayout.balanced
    # Per rank the totals are balanced() at VP 1; by virtual stage balanced()'s own split where that evens out the
    # ranks as well (VP 1, and PP 2 × VP 2 here; at PP 4 × VP 2 the head outweighs a 2-layer chunk).
    assert r["rank_layers"] == bal(16, pp, 1, 0.0, head).counts
    if (pp, vp) != (4, 2):
        assert r["stage_layers"] == bal(16, pp, vp, 0.0, head).counts
    assert max(r["rank_work"]) <= max(mc.pipeline.rank_work(bal(16, pp, vp, 0.0, head), 0.0, head))
    if (pp, vp) in ((2, 1), (2, 2)):
        assert r["rank_layers"] == [10, 6]  # 10 vs 6 + ≈ 4 layers of head
    if (pp, vp) == (4, 1):
        assert r["stage_layers"] == [5, 5, 5, 1]
    assert r["rank_work"][-1] == pytest.approx(r["rank_layers"][-1] + head)
    # Explicit costs and an explicit layout win; a head cost of 0 (embedding cost derived: 0) is the even split.
    rec.set("parallel.pipeline_head_cost", 2.0)
    two = cli.plan_recipe(rec)
    assert two["stage_costs"] == (0.0, 2.0) and two["rank_layers"] == bal(16, pp, 1, 0.0, 2.0).counts
    rec.set("parallel.pipeline_head_cost", 0.0)
    assert cli.plan_recipe(rec)["stage_layers"] == [16 // (pp * vp)] * (pp * vp)
    rec.set("parallel.pipeline_head_cost", -1.0).set("parallel.pipeline_layout", [16 - pp * vp + 1] + [1] * (pp * vp - 1))
    assert cli.plan_recipe(rec)["stage_layers"][0] == 16 - pp * vp + 1


def test_plan_refuses_bad_layouts_with_the_fix(capsys):
    assert cli.main(["plan", "--model", "llama3_8b", "--world-size", "6", "--tp", "4"]) == 1
    assert "world_size 6 is not divisible by TP(4)" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "llama3_8b", "--world-size", "8", "--pp", "3"]) == 1
    assert cli.main(["plan", "--model", "nope", "--world-size", "1"]) == 1
    assert "unknown model preset 'nope'" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "tiny_llama", "--world-size", "2", "--sequence-parallel"]) == 1


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"megacore {mc.__version__}"


def test_log_level_from_python():
    before = mc.log_level()
    assert before in ("debug", "info", "warning", "error", "off")
    try:
        mc.set_log_level("debug")
        assert mc.log_level() == "debug"
        mc.set_log_level("WARNING")
        assert mc.log_level() == "warning"
        with pytest.raises(mc.ValueError, match="not one of debug, info, warning, error, off"):
            mc.set_log_level("loud")
    finally:
        mc.set_log_level(before)


def test_log_level_comes_from_the_environment():
    import os
    import subprocess
    import sys

    code = "import megacore as mc; print(mc.log_level())"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for value, want in (("debug", "debug"), ("error", "error"), (None, "info")):
        e = dict(env)
        e.pop("MEGACORE_LOG_LEVEL", None)
        if value:
            e["MEGACORE_LOG_LEVEL"] = value
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == want, r.stderr
    e = dict(env, MEGACORE_LOG_LEVEL="chatty")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=120)
    assert r.stdout.strip() == "info" and "MEGACORE_LOG_LEVEL='chatty' is not one of" in r.stderr


def test_plan_counts_the_logits_on_the_last_stage_and_keeps_headroom():
    r = cli.plan("llama3_8b", world_size=4, tp=2, seq_length=8192, sequence_parallel=True, zero=True)
    vocab = mc.model.padded_vocab_size(r["config"], 2)
    assert r["memory_bytes"]["logits"] == 2 * 2 * 8192 * vocab / 2  # bf16 logits and their gradient, V/TP columns
    two = cli.plan("llama3_8b", world_size=4, tp=2, pp=2, seq_length=8192)
    assert (two["memory_bytes"]["logits"] > 0) == (two["busiest_rank"] == 1)  # only the last stage holds logits
    # ZeRO-1's reduce-scatter output shards: 4 bytes per parameter / DP (f32 reduction).
    assert r["memory_bytes"]["grad_reduce"] == 4 * r["stage_params"][0] / 2
    bf16 = cli.plan("llama3_8b", world_size=4, tp=2, seq_length=8192, sequence_parallel=True, zero=True,
                    grad_reduce_in_bf16=True)
    assert bf16["memory_bytes"]["grad_reduce"] == 2 * r["stage_params"][0] + 2 * r["stage_params"][0] / 2
    # This layout ran out of memory on an 80 GB H100 at 70.7 GiB allocated: the estimate and the headroom kept for
    # what it does not count (default max(4 GiB, 12 %)) must say so.
    assert r["headroom_gib"] == 9.6 and 70 < r["total_bytes"] / 2**30 < 75 and not r["fits"]
    assert cli.plan("llama3_8b", world_size=4, tp=4, seq_length=8192, sequence_parallel=True, zero=True)["fits"]


def test_fit_layout_picks_the_least_model_parallelism_that_fits(capsys):
    four = cli.fit_layout("llama3_8b", 4, 80.0, seq_length=8192)
    # TP 2 + ZeRO over DP 2 fits with full recompute of its first layers (TP 4 is one degree more).
    assert four["plan"]["fits"] and (four["tp"], four["pp"], four["recompute"]) == (2, 1, "full")
    eight = cli.fit_layout("llama3_8b", 8, 80.0, seq_length=8192)
    assert eight["plan"]["fits"] and (eight["tp"], eight["pp"], eight["zero"]) == (2, 1, True)
    assert cli.fit_layout("tiny_llama", 1, 80.0)["tp"] == 1
    with pytest.raises(mc.ConfigError, match="no layout of 1 GPUs fits 24 GiB"):
        cli.fit_layout("llama3_8b", 1, 24.0, seq_length=8192)
    # The 8B recipe's default layout is the fitting one for its GPU count.
    for gpus in (4, 8):
        rec = mc.recipes.llama3_8b.pretrain_recipe(num_gpus_per_node=gpus)
        p = rec.parallel
        r = cli.plan(rec.model.to_transformer_config("bf16", p.sequence_parallel, rec.trainer.recompute), gpus,
                     p.tensor_model_parallel_size, p.pipeline_model_parallel_size, seq_length=rec.data.seq_length,
                     sequence_parallel=p.sequence_parallel, zero=p.use_distributed_optimizer, gpu_memory_gib=80.0,
                     recompute_num_layers=rec.trainer.recompute_num_layers)
        assert r["fits"], (gpus, r["total_bytes"] / 2**30)
    assert cli.main(["plan", "--recipe", "llama3_8b", "--set", "resources.gpus=4", "--set", "parallel.tp=2",
                     "--set", "trainer.recompute=selective", "--set", "trainer.recompute_num_layers=-1",
                     "--fit", "--no-table"]) == 0
    assert cli.fit_flags(four) in capsys.readouterr().out


def _llama3_8b_layer_bytes(seq, tp, full):
    """Saved bytes of one Llama-3-8B layer at TP + SP, bf16, by memory.hpp's count: only the input (h) under full
    recompute; else the sequence tensors (4·h, two f32 norm statistics), Q/K/V, O, fc1 (2·ffn), fc2 input, f32 LSE."""
    h, heads, groups, d, f = 4096, 32, 8, 128, 14336
    if full:
        return seq * h * 2 / tp
    seq_terms = seq * (4 * h * 2 + 2 * 4)
    head_terms = seq * ((heads * d + 2 * groups * d) + heads * d + 2 * f + f) * 2 / tp
    return seq_terms / tp + head_terms + seq * heads * 4 / tp


def test_plan_counts_block_recompute_per_model_chunk():
    # Full recompute of the first N layers of each chunk: those keep their input, the others everything (as none).
    kw = dict(tp=2, seq_length=8192, sequence_parallel=True, zero=True)
    full_cfg = cli._preset_with_recompute("llama3_8b", "full")
    full, kept = _llama3_8b_layer_bytes(8192, 2, True), _llama3_8b_layer_bytes(8192, 2, False)
    assert kept - full == pytest.approx(0.5 * 2**30, rel=0.01)  # what one recomputed layer saves here
    for n in (0, 2, 8, 32):
        r = cli.plan(full_cfg, 4, recompute_num_layers=n, **kw)
        assert r["memory_bytes"]["activations"] == pytest.approx(n * full + (32 - n) * kept, rel=1e-12), n
    every = cli.plan(full_cfg, 4, **kw)["memory_bytes"]["activations"]
    assert every == pytest.approx(32 * full, rel=1e-12)
    assert cli.plan(full_cfg, 4, recompute_num_layers=32, **kw)["memory_bytes"]["activations"] == pytest.approx(every)
    # PP 2 × VP 2: 4 chunks of 8 layers; rank 0 holds 2 of them (N each recomputed) for PP − 0 = 2 micro-batches.
    pp = cli.plan(full_cfg, 4, tp=2, pp=2, vp=2, seq_length=8192, sequence_parallel=True, pipeline_head_cost=0,
                  recompute_num_layers=3)
    assert pp["stage_layers"] == [8, 8, 8, 8]
    acts = [2 * (6 * full + 10 * kept), 1 * (6 * full + 10 * kept)]
    assert pp["memory_bytes"]["activations"] == pytest.approx(acts[pp["busiest_rank"]], rel=1e-12)
    with pytest.raises(ValueError, match="recompute_num_layers 1 needs full recompute"):
        cli.plan("llama3_8b", 4, recompute_num_layers=1, **kw)
    # Through a recipe and the CLI: --set trainer.recompute_num_layers reaches plan_recipe.
    rec = mc.recipes.llama3_8b.pretrain_recipe(num_gpus_per_node=4)
    for k, v in (("parallel.tp", "2"), ("parallel.sp", "true"), ("parallel.zero", "true"),
                 ("trainer.recompute", "full"), ("trainer.recompute_num_layers", "2")):
        rec.set(k, v)
    assert cli.plan_recipe(rec)["memory_bytes"]["activations"] == pytest.approx(2 * full + 30 * kept, rel=1e-12)


def test_fit_layout_recomputes_the_fewest_layers_before_more_model_parallelism(capsys):
    kw = dict(tp=2, seq_length=8192, sequence_parallel=True, zero=True, gpu_memory_gib=80.0)
    assert not cli.plan("llama3_8b", 4, **kw)["fits"]  # TP 2 with selective recompute: just over 80 GiB's usable
    f = cli.fit_layout("llama3_8b", 4, 80.0, seq_length=8192)
    n = f["recompute_num_layers"]
    assert (f["tp"], f["pp"], f["sequence_parallel"], f["zero"], f["recompute"]) == (2, 1, True, True, "full")
    assert 1 <= n <= 8 and f["plan"]["fits"]
    full_cfg = cli._preset_with_recompute("llama3_8b", "full")
    assert cli.plan(full_cfg, 4, recompute_num_layers=n, **kw)["fits"]
    assert n == 1 or not cli.plan(full_cfg, 4, recompute_num_layers=n - 1, **kw)["fits"]  # the fewest that fit
    flags = cli.fit_flags(f)
    assert flags.endswith(f"--set trainer.recompute=full --set trainer.recompute_num_layers={n}"), flags
    assert cli.main(["plan", "--model", "llama3_8b", "--world-size", "4", "--seq-length", "8192", "--fit",
                     "--no-table"]) == 0
    assert f"fitting layout for 80 GiB GPUs: {flags}" in capsys.readouterr().out
    # Selective recompute still wins where it fits (8 GPUs: TP 2 + ZeRO-1); full recompute of every layer is the last
    # resort (a 2-GPU job at 80 GiB: no layout fits with at most a quarter of the layers recomputed).
    eight = cli.fit_layout("llama3_8b", 8, 80.0, seq_length=8192)
    assert (eight["tp"], eight["recompute"], eight["recompute_num_layers"]) == (2, "selective", -1)
    two = cli.fit_layout("llama3_8b", 2, 80.0, seq_length=8192)
    assert (two["recompute"], two["recompute_num_layers"]) == ("full", -1) and two["plan"]["fits"]
    # The recipe takes the fitted layout, and its banner names it.
    rec = cli.load_recipe("llama3_8b", None, [], 4, None)
    assert (rec.parallel.tensor_model_parallel_size, rec.trainer.recompute, rec.trainer.recompute_num_layers) == \
        (2, "full", n)
    rec.validate(check_paths=False)
    assert f"recompute full of the first {n} layer{'' if n == 1 else 's'} per model chunk " \
        f"(trainer.recompute_num_layers={n})" in cli.recipe_layout(rec)


def test_plan_layout_flags_override_a_recipe(capsys):
    assert cli.main(["plan", "--recipe", "llama3_8b", "--set", "resources.gpus=4", "--tp", "4", "--seq-length", "4096",
                     "--no-table"]) == 0
    out = capsys.readouterr().out
    assert "world 4 = TP 4 × CP 1 × DP 1 × PP 1" in out  # --tp was ignored with --recipe before
    assert cli.main(["plan", "--recipe", "llama3_8b", "--set", "resources.gpus=4", "--no-table"]) == 0
    out = capsys.readouterr().out
    assert "world 4 = TP 2 × CP 1 × DP 2 × PP 1" in out and "logits 1.96 GiB" in out and "warning: the estimate" in out


def test_plan_balances_the_pipeline_for_block_recompute(capsys):
    """Block recompute (trainer.recompute_num_layers N) makes only each chunk's first N layers a third dearer, and the
    split is priced that way, as the trainer prices it (RunConfig.pipeline_stage_costs). Llama 3.2 1B's shape cut to
    15 layers over PP 2 at seq 2048: with every layer recomputed the head is ≈ 3.03 (recomputed) layers and the split
    9 + 6 (9 against 9.03); with N = 1 the head is ≈ 4.04 plain layers, each stage costs its layers + 1/3, and 10 + 5
    (10.33 against 9.37) beats 9 + 6 (9.33 against 10.37)."""
    head = _llama32_1b_head_cost(2048, 1, "none")
    cfg = cli._preset_with_recompute("llama32_1b", "full")
    cfg.num_layers = 15
    every = cli.plan(cfg, 2, pp=2)
    assert every["stage_layers"] == [9, 6]
    assert every["stage_costs"][1] == pytest.approx(_llama32_1b_head_cost(2048, 1, "full"), rel=1e-12)
    block = cli.plan(cfg, 2, pp=2, recompute_num_layers=1)
    assert block["stage_layers"] == [10, 5]
    assert block["stage_costs"][0] == 0.0 and block["stage_costs"][1] == pytest.approx(head, rel=1e-12)
    assert block["rank_work"] == pytest.approx([10 + 1 / 3, 5 + 1 / 3 + head], rel=1e-12)
    assert "first 1 layer per chunk recomputed: 4/3" in block["layout_text"]
    # The Python pipeline API takes the same N.
    pl = mc.pipeline
    assert pl.stage_costs_from_model(cfg, 2048, 1, recompute_num_layers=1)[1] == pytest.approx(head, rel=1e-12)
    assert pl.stage_costs_from_model(cfg, 2048, 1) == pl.stage_costs_from_model(cfg, 2048, 1, recompute_num_layers=-1)
    assert pl.choose_layout(15, 2, 1, [], 0.0, head, recompute_num_layers=1).counts == [10, 5]
    assert pl.PipelineLayout.balanced(15, 2, 1, 0.0, head, recompute_num_layers=1).counts == [10, 5]
    assert pl.rank_work(pl.PipelineLayout.from_counts(15, 2, 1, [9, 6]), 0.0, head, 1) == \
        pytest.approx([9 + 1 / 3, 6 + 1 / 3 + head], rel=1e-12)
    with pytest.raises(mc.ConfigError, match="recompute_num_layers 1 limits full recompute"):
        pl.stage_costs_from_model(cli._preset_with_recompute("llama32_1b", "selective"), 2048, 1, 1)
    # `megacore plan` with a recipe: --set trainer.recompute_num_layers reaches the split.
    sets = ["resources.gpus=2", "model.num_layers=15", "parallel.pp=2", "trainer.recompute=full"]
    for n, split in ((-1, (9, 6)), (1, (10, 5))):
        args = ["plan", "--recipe", "llama32_1b", "--no-table"]
        for s in sets + [f"trainer.recompute_num_layers={n}"]:
            args += ["--set", s]
        assert cli.main(args) == 0
        out = capsys.readouterr().out
        assert f"stage 0: {split[0]} layers" in out and f"stage 1: {split[1]} layers" in out, out
