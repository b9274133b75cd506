"""Recipes: editable dataclasses, validated as a whole before launch, serialised and restored exactly."""

import json

import pytest

import megacore as mc
from megacore import cli, recipes
from megacore.errors import ConfigError
from megacore.recipes import Recipe


def test_recipes_build_and_validate():
    for name in recipes.RECIPES:
        r = recipes.get(name)
        assert isinstance(r, Recipe)
        r.validate(check_paths=False)
    tiny = recipes.tiny.pretrain_recipe()
    assert tiny.parallel.tensor_model_parallel_size == 2 and tiny.parallel.pipeline_model_parallel_size == 2
    assert tiny.world_size == 4 and tiny.data_parallel_size == 1 and tiny.num_microbatches == 4
    assert tiny.validate() == []  # embedded corpus: no paths to check


def test_model_config_mirrors_the_cpp_presets():
    m = recipes.ModelConfig.from_preset("llama32_1b")
    c = m.to_transformer_config("bf16")
    ref = mc.model.llama32_1b()
    for f in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "vocab_size", "tie_word_embeddings", "rope_theta"):
        assert getattr(c, f) == getattr(ref, f), f
    assert str(c.rope_scaling.type) == str(ref.rope_scaling.type)
    assert mc.model.parameter_count(c)["total"] == mc.model.parameter_count(ref)["total"]
    assert c.params_dtype == "bf16"


def test_round_trip_json_and_yaml(tmp_path):
    r = recipes.llama3_8b.pretrain_recipe(num_nodes=2, num_gpus_per_node=8)
    r.set("parallel.pp", "2").set("optim.lr", "1e-4").set("parallel.pipeline_layout", "[15, 17]")
    r.to_json(str(tmp_path / "r.json"))
    back = Recipe.from_file(str(tmp_path / "r.json"))
    assert back == r
    assert back.parallel.pipeline_layout == [15, 17]
    pytest.importorskip("yaml")
    r.to_yaml(str(tmp_path / "r.yaml"))
    assert Recipe.from_file(str(tmp_path / "r.yaml")) == r


def test_set_converts_types_and_knows_aliases():
    r = recipes.tiny.pretrain_recipe()
    r.apply_overrides(["parallel.tp=4", "parallel.sp=true", "data.gbs=32", "optim.lr=0.01", "trainer.steps=7",
                       "data.paths=0.3,a,0.7,b"])
    assert r.parallel.tensor_model_parallel_size == 4 and r.parallel.sequence_parallel is True
    assert r.data.global_batch_size == 32 and r.optim.lr == 0.01 and r.trainer.max_steps == 7
    assert r.data.paths == [0.3, "a", 0.7, "b"]


@pytest.mark.parametrize("item,needle", [
    ("parallel.tensor=2", "unknown field 'tensor' in recipe section 'parallel'"),
    ("paralel.tp=2", "unknown recipe section 'paralel'"),
    ("parallel.tp=two", "parallel.tensor_model_parallel_size must be an integer"),
    ("parallel.sp=maybe", "must be true or false"),
    ("lr=1", "must be section.field"),
    ("optim.lr", "must be key=value"),
])
def test_bad_overrides_name_the_field(item, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        recipes.tiny.pretrain_recipe().apply_overrides([item])


def test_unknown_fields_in_files_are_refused(tmp_path):
    d = recipes.tiny.pretrain_recipe().to_dict()
    d["optim"]["learning_rate"] = 1.0
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="unknown field.*'learning_rate'.*recipe.optim"):
        Recipe.from_file(str(p))
    with pytest.raises(ConfigError, match="cannot read recipe file"):
        Recipe.from_file(str(tmp_path / "missing.json"))


@pytest.mark.parametrize("changes,needle", [
    ({"resources.num_gpus_per_node": 6}, "world size 6 .* not divisible by TP×PP×CP = 2×2×1 = 4"),
    ({"data.global_batch_size": 10}, "10 is not divisible by micro_batch_size × DP = 4 × 1"),
    ({"model.num_layers": 5, "parallel.pipeline_head_cost": 0.0}, "5 layers cannot be split evenly over PP×VP = 2×1"),
    ({"parallel.pipeline_layout": [1, 2]}, "sums to 3 layers but the model has 4"),
    ({"parallel.pipeline_layout": [4]}, "has 1 entries but PP×VP = 2"),
    ({"data.prefetch": 0}, "data.prefetch: must be a positive integer"),
    ({"parallel.overlap_param_gather": True}, "overlap_param_gather: needs parallel.use_distributed_optimizer"),
    ({"parallel.tp_comm_stream_priority": 1}, "tp_comm_stream_priority: is 1; CUDA stream priorities are 0 .* or negative"),
    ({"parallel.tp_comm_overlap_forward": True}, "tp_comm_overlap_forward: overlaps the sequence-parallel .* needs "
     "parallel.sequence_parallel = true"),
    ({"parallel.pipeline_head_cost": -2.0}, "pipeline_head_cost: must be a finite number of layers >= 0, or -1"),
    ({"parallel.pipeline_embedding_cost": float("nan")}, "pipeline_embedding_cost must be a number, got 'nan'"),
    ({"parallel.pipeline_layout": [2, 2], "parallel.pipeline_head_cost": 1.0}, "not both"),
    ({"parallel.vp": 2, "data.global_batch_size": 12, "data.micro_batch_size": 4},
     "number of micro-batches \\(3\\) to be a multiple of PP = 2"),
    ({"parallel.tp": 1, "parallel.sp": True}, "sequence_parallel: needs tensor_model_parallel_size > 1"),
    ({"data.seq_length": 4096}, "exceeds model.max_position_embeddings"),
    ({"data.paths": ["/nonexistent/corpus"]}, "'/nonexistent/corpus' has no /nonexistent/corpus.bin"),
    ({"model.vocab_size": 100}, "smaller than the byte tokenizer"),
    ({"optim.lr_decay_style": "exp"}, "'exp' is not one of constant, linear, cosine, wsd"),
    ({"trainer.precision": "fp8"}, "'fp8' is not one of auto, f32, bf16, f16"),
    ({"trainer.recompute": "bogus"}, "trainer.recompute 'bogus' is not one of none, selective, full"),
    ({"trainer.recompute_num_layers": 1}, "trainer.recompute_num_layers: 1 limits full recompute to the first layers "
                                          "of each model chunk, but trainer.recompute is none; set trainer.recompute = full"),
    ({"trainer.recompute": "full", "trainer.recompute_num_layers": 3},  # tiny: 4 layers over PP 2
     "trainer.recompute_num_layers: 3 exceeds the 2 layers of the largest model chunk .*; give at most 2"),
    ({"model.normalization": "BatchNorm"}, "model.normalization 'BatchNorm' is not one of RMSNorm, LayerNorm"),
    ({"model.num_query_groups": 3}, "model:"),
    ({"checkpoint.resume": "/nonexistent/step_5"}, "is not a checkpoint directory"),
    ({"model.num_moe_experts": 4, "parallel.ep": 3}, "EP = 3 does not divide DP×CP = 1×1 = 1 .*; set ep to a divisor of 1"),
    ({"model.num_moe_experts": 4, "resources.num_gpus_per_node": 12, "parallel.ep": 3},
     "num_moe_experts 4 is not divisible by EP = 3; .* use an EP that divides 4"),
    ({"model.num_moe_experts": 4, "model.moe_router_topk": 5}, "moe_router_topk is 5; .* set moe_router_topk in \\[1, 4\\]"),
    ({"model.num_moe_experts": 4, "model.moe_expert_capacity_factor": -1.0},
     "moe_expert_capacity_factor is -1; set a positive factor .* or 0 for dropless routing"),
    ({"model.num_moe_experts": 4, "model.moe_layer_freq": 0}, "moe_layer_freq is 0; set it to k >= 1"),
    ({"model.num_moe_experts": 4, "model.moe_ffn_hidden_size": 33}, "not divisible by expert-TP = 2; round it"),
    ({"model.moe_aux_loss_coeff": 0.01}, "moe_aux_loss_coeff is 0.01 but num_moe_experts is 0 .* set num_moe_experts"),
    ({"parallel.ep": 2, "resources.num_gpus_per_node": 8},
     "expert parallelism \\(EP = 2\\) .* num_moe_experts is 0; set parallel.expert_model_parallel_size \\(ep\\) to 1"),
    ({"model.moe_router_score_function": "relu"}, "'relu' is not one of softmax, sigmoid"),
    ({"model.moe_token_dispatcher_type": "flex"}, "'flex' is not one of alltoall, allgather"),
    ({"parallel.etp": -1}, "expert_tensor_parallel_size: must be a positive integer, or 0 for the TP size"),
])
def test_bad_recipes_fail_before_launch_naming_field_and_fix(changes, needle):
    r = recipes.tiny.pretrain_recipe()
    with pytest.raises(ConfigError, match=needle):  # refused by set() (a value the field never accepts) or validate()
        for k, v in changes.items():
            r.set(k, v)
        r.validate()


def test_moe_recipe_fields_validate_and_count_active_parameters():
    r = recipes.tiny.pretrain_recipe()
    r.set("resources.num_gpus_per_node", 8)  # TP 2 × PP 2 × DP 2
    r.set("model.num_moe_experts", 4)
    r.set("parallel.ep", 2)
    r.set("parallel.etp", 1)
    r.set("model.moe_router_score_function", "sigmoid")
    r.set("model.moe_token_dispatcher_type", "allgather")
    assert r.validate(check_paths=False) == []
    assert json.loads(r.to_json())["parallel"]["expert_tensor_parallel_size"] == 1
    c = r.model.to_transformer_config()
    assert c.num_moe_experts == 4 and c.moe_router_topk == 2
    counts = mc.model.parameter_count(c)
    expert = 3 * c.hidden_size * c.ffn_size  # SwiGLU gate, up, down
    assert counts["active"] == counts["total"] - c.num_layers * (4 - 2) * expert
    dense = mc.model.parameter_count(recipes.tiny.pretrain_recipe().model.to_transformer_config())
    assert counts["total"] == dense["total"] + c.num_layers * (3 * expert + 4 * c.hidden_size)


@pytest.mark.parametrize("section,field,value,needle", [
    ("trainer", "recompute", "bogus", "trainer.recompute 'bogus' is not one of none, selective, full"),
    ("trainer", "precision", "fp8", "'fp8' is not one of auto, f32, bf16, f16"),
    ("optim", "lr_decay_style", "exp", "'exp' is not one of constant, linear, cosine, wsd"),
    ("data", "seq_length", "long", "data.seq_length must be an integer"),
])
def test_values_assigned_directly_are_checked_at_validation(section, field, value, needle):
    r = recipes.tiny.pretrain_recipe()
    setattr(getattr(r, section), field, value)  # plain attribute assignment bypasses set()
    with pytest.raises(ConfigError, match=needle):
        r.validate()


def test_head_cost_balances_a_split_that_is_not_even():
    r = recipes.tiny.pretrain_recipe()
    r.set("model.num_layers", 5)
    r.validate()  # the head cost derived from the model balances the split
    r.set("parallel.pipeline_head_cost", 0.0).set("parallel.pipeline_embedding_cost", 0.0)
    with pytest.raises(ConfigError, match="pipeline_head_cost"):  # the message names the balancing option
        r.validate()
    r.set("parallel.pipeline_head_cost", 1.0)
    r.validate()
    assert cli.plan(r.model.to_transformer_config("f32", False, "selective"), r.world_size, 2, 2,
                    pipeline_head_cost=1.0)["stage_layers"] == [3, 2]


def test_resume_from_a_checkpoint_of_another_model_is_refused(tmp_path):
    ck = tmp_path / "step_10"
    ck.mkdir()
    other = recipes.tiny.pretrain_recipe()
    other.model.hidden_size = 256
    # the trainer stores its recipe as the "recipe" JSON blob of metadata.json
    (ck / "metadata.json").write_text(json.dumps({"format": "megacore-distributed-checkpoint", "json": {"recipe": other.to_dict()}}))
    r = recipes.tiny.pretrain_recipe()
    r.checkpoint.resume = str(ck)
    with pytest.raises(ConfigError, match="holds another model \\(hidden_size 256 vs 128"):
        r.validate()
    same = recipes.tiny.pretrain_recipe()
    (ck / "metadata.json").write_text(json.dumps({"format": "megacore-distributed-checkpoint",
                                                  "json": {"recipe": same.to_dict()}}))
    r.validate()
    r.checkpoint.resume = str(tmp_path)  # a root: resolved through `latest`
    (tmp_path / "latest").write_text("step_10\n")
    r.validate()


def test_few_microbatches_for_the_pipeline_warn():
    r = recipes.tiny.pretrain_recipe()
    r.data.global_batch_size = 4  # one micro-batch for PP = 2
    (w,) = r.validate()
    assert "only 1 micro-batches for PP = 2" in w and "50%" in w


def test_unknown_recipe_name():
    with pytest.raises(ConfigError, match="unknown recipe 'llama9'"):
        recipes.get("llama9")


def test_recipe_layout_follows_the_gpus_given(capsys):
    # `train --nproc-per-node N` and `plan --world-size N` build the recipe for N GPUs: Llama-3-8B's layout is the one
    # plan --fit picks for N GPUs of the memory given (TP 2 + ZeRO-1 with block recompute on 4 × 80 GiB, TP 1 + ZeRO-1 on 4 × 140 GiB), not its
    # default 8-GPU layout with fewer data-parallel replicas.
    for n in (2, 4, 8, 16):
        for gib in (None, 80.0, 96.0, 120.0, 140.0, 192.0):
            r = cli.load_recipe("llama3_8b", None, [], n, None, gpu_memory_gib=gib)
            fit = cli.fit_layout("llama3_8b", n, gib or 80.0, 8192)  # the model preset: same shapes as the recipe's
            assert r.world_size == n
            assert (r.parallel.tensor_model_parallel_size, r.parallel.pipeline_model_parallel_size,
                    r.parallel.sequence_parallel, r.parallel.use_distributed_optimizer, r.trainer.recompute,
                    r.trainer.recompute_num_layers) == \
                (fit["tp"], fit["pp"], fit["sequence_parallel"], fit["zero"], fit["recompute"], fit["recompute_num_layers"])
            # Fitted under the headroom the memory check before launch applies: it passes on GPUs of that size.
            assert cli.check_memory(r, gib or 80.0)["fits"], (n, gib)
    assert _layout(cli.load_recipe("llama3_8b", None, [], 4, None)) == (2, 1, 2)  # full recompute of its first layers
    assert _layout(cli.load_recipe("llama3_8b", None, [], 4, None, gpu_memory_gib=140)) == (1, 1, 4)
    # The Python API is deterministic: 80 GiB unless the caller gives the memory.
    assert _layout(recipes.llama3_8b.pretrain_recipe(num_gpus_per_node=4)) == (2, 1, 2)
    assert _layout(recipes.llama3_8b.pretrain_recipe(num_gpus_per_node=4, gpu_memory_gib=140)) == (1, 1, 4)
    assert _layout(recipes.get("llama3_8b_finetune", num_gpus_per_node=4, gpu_memory_gib=140)) == (1, 1, 4)
    assert recipes.takes_gpu_memory("llama3_8b_finetune") and not recipes.takes_gpu_memory("tiny")
    with pytest.raises(ConfigError, match="no layout of 1 GPUs fits 80 GiB"):
        cli.load_recipe("llama3_8b", None, [], 1, None)
    assert cli.main(["plan", "--recipe", "llama3_8b", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "world 4 = TP 2 × CP 1 × DP 2" in out and "layout fitted for 80.0 GiB GPUs (plan's default" in out, out


def test_plan_builds_the_recipe_for_the_gpu_memory_given(capsys):
    assert cli.main(["plan", "--recipe", "llama3_8b", "--world-size", "4", "--gpu-memory-gib", "140", "--no-table"]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if "layout fitted for" in x]
    assert "fitted for 140.0 GiB GPUs (--gpu-memory-gib): TP 1 × PP 1 + ZeRO-1, recompute selective" in line, line
    assert "world 4 = TP 1 × CP 1 × DP 4 × PP 1" in out and "warning" not in out, out
    # --set pins another layout; the line says the recipe's own was changed.
    assert cli.main(["plan", "--recipe", "llama3_8b", "--world-size", "4", "--gpu-memory-gib", "140", "--no-table",
                     "--set", "parallel.tp=2", "--set", "parallel.sp=true"]) == 0
    out = capsys.readouterr().out
    assert "--set made it TP 2 × PP 1 + SP + ZeRO-1" in out and "world 4 = TP 2 × CP 1 × DP 2" in out, out


def test_plan_counts_fp8_weights_and_kept_codes():
    # FP8 adds the cached E4M3 weights and transposes (2 bytes per linear weight element) and, with the gathered
    # input's codes kept under SP at TP 4, one byte per element of the sequence in place of two per chunk element.
    kw = dict(tp=4, seq_length=8192, micro_batch_size=1, sequence_parallel=True, gpu_memory_gib=141)
    base = cli.plan("llama3_8b", 4, **kw)
    fp8 = cli.plan("llama3_8b", 4, fp8="delayed", **kw)
    kept = cli.plan("llama3_8b", 4, fp8="delayed", fp8_keep_gathered_input=True, **kw)
    c = mc.model.llama3_8b()
    h, hd, f = c.hidden_size, c.head_dim, c.ffn_size
    lin = (h * (c.num_attention_heads + 2 * c.query_groups) * hd + c.num_attention_heads * hd * h + 2 * h * f + f * h) / 4
    assert fp8["memory_bytes"]["fp8_weights"] == pytest.approx(2 * c.num_layers * lin)
    assert "fp8_weights" not in base["memory_bytes"]
    t = 8192
    per_layer = (kept["memory_bytes"]["activations"] - fp8["memory_bytes"]["activations"]) / c.num_layers
    assert per_layer == pytest.approx(2 * (1 - 2 / 4) * t * h)
    with pytest.raises(Exception, match="fp8 'fp9' is not none, delayed or current"):
        cli.plan("llama3_8b", 4, fp8="fp9", **kw)


def _layout(r):
    p = r.parallel
    return p.tensor_model_parallel_size, p.pipeline_model_parallel_size, r.data_parallel_size


@pytest.mark.parametrize("n,layout", [(1, (1, 1, 1)), (2, (2, 1, 1)), (4, (2, 2, 1)), (8, (2, 2, 2))])
def test_tiny_layout_is_sized_to_the_ranks(n, layout):
    # TP and PP where the ranks allow them (the recipe shows both on 4 and 8), the same 16 samples per step at every
    # size; `train --nproc-per-node N` and the Python API build the same recipe.
    for r in (recipes.tiny.pretrain_recipe(num_gpus_per_node=n), cli.load_recipe("tiny", None, [], n, None)):
        assert r.world_size == n and _layout(r) == layout
        assert (r.data.global_batch_size, r.data.micro_batch_size) == (16, 4)
        assert r.validate() == []
    # The README's main job on 4 ranks is exactly TP 2 × PP 2, 4 micro-batches of 4.
    if n == 4:
        assert recipes.tiny.pretrain_recipe().num_microbatches == 4


@pytest.mark.parametrize("name", ["tiny_moe", "gpt2_124m", "llama32_1b", "tiny_finetune"])
def test_small_recipes_validate_on_1_2_4_8_gpus(name):
    sets = ["data.sft_path=x.jsonl", "checkpoint.pretrained_checkpoint=ckpt"] if name.endswith("_finetune") else []
    base = cli.load_recipe(name, None, sets, 4, None)
    for n in (1, 2, 4, 8):
        r = cli.load_recipe(name, None, sets, n, None)
        assert r.world_size == n and r.data_parallel_size * r.parallel.tensor_model_parallel_size \
            * r.parallel.pipeline_model_parallel_size == n
        assert r.validate(check_paths=False) == [], (name, n)
        if name != "llama32_1b":  # llama32_1b's global batch is per GPU by design
            assert r.data.global_batch_size == base.data.global_batch_size
    # A size the global batch does not split over is refused before launch, naming the multiple to use.
    with pytest.raises(ConfigError, match="use a multiple of"):
        cli.load_recipe("tiny_moe", None, [], 3, None).validate(check_paths=False)


def test_tiny_moe_keeps_its_global_batch_on_8_ranks():
    r = recipes.tiny_moe.pretrain_recipe(num_gpus_per_node=8)
    assert _layout(r) == (1, 1, 8) and r.data.micro_batch_size == 2 and r.num_microbatches == 1
    assert recipes.tiny_moe.pretrain_recipe().data.micro_batch_size == 4  # 4 ranks: as before
