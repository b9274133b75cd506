// RunConfig: the single declaration of a run's settings. JSON round trips, the parser refuses unknown
// fields, wrong types and unaccepted names (listing what is accepted), --set resolves aliases, the schema
// carries every field with its doc, and validate() reports every problem of a run at once.
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "test_helpers.hpp"
#include "megacore/train/run_config.hpp"

using namespace megacore;
using namespace megacore::train;
using json = nlohmann::json;

namespace {

std::string config_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "<no ConfigError>";
}

bool has(const std::vector<std::string>& v, const std::string& needle) {
  for (const auto& s : v)
    if (s.find(needle) != std::string::npos) return true;
  return false;
}

}  // namespace

TEST_CASE("RunConfig JSON round-trips every field", "[config]") {
  RunConfig c;
  c.name = "rt";
  c.model = ModelSection::preset("llama32_1b");
  c.parallel.tensor_model_parallel_size = 2;
  c.parallel.pipeline_layout = {3, 5, 4, 4};
  c.data.paths = {0.3, std::string("data/a"), 0.7, std::string("data/b")};
  c.optim.lr_decay_style = optim::LRDecayStyle::WSD;
  c.trainer.recompute = model::RecomputeGranularity::Selective;
  c.trainer.precision = "bf16";
  c.checkpoint.resume = "";
  const std::string text = to_json(c);
  const RunConfig back = run_config_from_json(text);
  CHECK(to_json(back) == text);
  const json j = json::parse(text);
  CHECK(j["model"]["rope_scaling"] == "llama3");
  CHECK(j["model"]["rope_scaling_factor"] == 32.0);
  CHECK(j["model"]["normalization"] == "RMSNorm");
  CHECK(j["data"]["paths"] == json::array({0.3, "data/a", 0.7, "data/b"}));
  CHECK(j["optim"]["lr_decay_style"] == "wsd");
  CHECK(j["trainer"]["recompute"] == "selective");
  CHECK(back.model.rope_scaling.type == model::RopeScalingType::Llama3);
  CHECK(back.model.num_query_groups == 8);
  // Missing fields keep their defaults; enum names are read case-insensitively.
  const RunConfig partial = run_config_from_json(R"({"model": {"normalization": "layernorm"}, "optim": {"lr": 0.01}})");
  CHECK(partial.model.normalization == model::NormType::LayerNorm);
  CHECK(partial.optim.lr == 0.01);
  CHECK(partial.data.seq_length == RunConfig{}.data.seq_length);
}

TEST_CASE("RunConfig parsing refuses what it does not know, listing what it accepts", "[config]") {
  std::string e = config_error([] { run_config_from_json(R"({"trainer": {"recompute": "bogus"}})"); });
  CHECK(e.find("recipe.trainer.recompute 'bogus' is not one of none, selective, full") != std::string::npos);
  e = config_error([] { run_config_from_json(R"({"trainer": {"precision": "fp8"}})"); });
  CHECK(e.find("is not one of auto, f32, bf16, f16") != std::string::npos);
  e = config_error([] { run_config_from_json(R"({"model": {"recompute": "full"}})"); });
  CHECK(e.find("unknown field 'recompute' in recipe.model; valid fields: name, num_layers") != std::string::npos);
  e = config_error([] { run_config_from_json(R"({"modle": {}})"); });
  CHECK(e.find("unknown field 'modle' in recipe; valid fields: name, model, parallel") != std::string::npos);
  e = config_error([] { run_config_from_json(R"({"data": {"seq_length": "long"}})"); });
  CHECK(e.find("recipe.data.seq_length must be an integer") != std::string::npos);
  e = config_error([] { run_config_from_json(R"({"data": {"seq_length": 1.5}})"); });
  CHECK(e.find("must be an integer") != std::string::npos);
  e = config_error([] { run_config_from_json(R"({"parallel": {"sequence_parallel": 1}})"); });
  CHECK(e.find("recipe.parallel.sequence_parallel must be true or false") != std::string::npos);
  e = config_error([] { run_config_from_json(R"({"parallel": {"pipeline_layout": [1, "x"]}})"); });
  CHECK(e.find("recipe.parallel.pipeline_layout[1] must be an integer") != std::string::npos);
  e = config_error([] { run_config_from_json(R"({"data": {"seed": -1}})"); });
  CHECK(e.find("must be a non-negative integer") != std::string::npos);
  e = config_error([] { run_config_from_json("{not json"); });
  CHECK(e.find("not valid JSON") != std::string::npos);
}

TEST_CASE("set_field converts text by the field's type and resolves aliases", "[config]") {
  RunConfig c;
  set_field(c, "parallel.tp", "4");
  set_field(c, "parallel.sp", "on");
  set_field(c, "parallel.pipeline_layout", "1,2,1");
  set_field(c, "data.paths", "[0.5, \"a\", 0.5, \"b\"]");
  set_field(c, "optim.lr", "1e-3");
  set_field(c, "trainer.recompute", "FULL");
  CHECK(c.parallel.tensor_model_parallel_size == 4);
  CHECK(c.parallel.sequence_parallel);
  CHECK(c.parallel.pipeline_layout == std::vector<int64_t>{1, 2, 1});
  CHECK(c.data.paths.size() == 4);
  CHECK(c.optim.lr == 1e-3);
  CHECK(c.trainer.recompute == model::RecomputeGranularity::Full);
  std::string e = config_error([&] { set_field(c, "trainer.recompute", "bogus"); });
  CHECK(e.find("trainer.recompute 'bogus' is not one of none, selective, full") != std::string::npos);
  e = config_error([&] { set_field(c, "model.recompute", "bogus"); });
  CHECK(e.find("unknown field 'recompute' in recipe section 'model'; valid fields:") != std::string::npos);
  e = config_error([&] { set_field(c, "parallel.tq", "2"); });
  CHECK(e.find("(aliases: tp=tensor_model_parallel_size") != std::string::npos);
  e = config_error([&] { set_field(c, "paralel.tp", "2"); });
  CHECK(e.find("unknown recipe section 'paralel'") != std::string::npos);
  e = config_error([&] { set_field(c, "tp", "2"); });
  CHECK(e.find("must be section.field") != std::string::npos);
  e = config_error([&] { set_field(c, "parallel.tp", "two"); });
  CHECK(e.find("parallel.tensor_model_parallel_size must be an integer, got 'two'") != std::string::npos);
}

TEST_CASE("the schema lists every field once, with type, default, doc and accepted values", "[config]") {
  const json s = json::parse(run_config_schema());
  std::vector<std::string> sections;
  for (const auto& sec : s) {
    if (sec["type"] != "section") continue;
    sections.push_back(sec["name"]);
    std::set<std::string> names;
    for (const auto& f : sec["fields"]) {
      CHECK(!f["doc"].get<std::string>().empty());
      CHECK(names.insert(f["name"].get<std::string>()).second);  // no field declared twice
      CHECK(f.contains("default"));
    }
  }
  CHECK(sections == std::vector<std::string>{"model", "parallel", "data", "optim", "trainer", "checkpoint", "logging",
                                             "resources", "peft"});
  auto field = [&](const std::string& sec, const std::string& name) {
    for (const auto& x : s)
      if (x["name"] == sec)
        for (const auto& f : x["fields"])
          if (f["name"] == name) return f;
    return json();
  };
  CHECK(field("trainer", "recompute")["choices"] == json::array({"none", "selective", "full"}));
  CHECK(field("parallel", "tensor_model_parallel_size")["alias"] == "tp");
  CHECK(field("model", "normalization")["type"] == "str");
  CHECK(field("data", "paths")["default"] == json::array({"embedded"}));
  // The C++ defaults are the schema's defaults.
  CHECK(field("optim", "lr")["default"] == RunConfig{}.optim.lr);
}

TEST_CASE("validate reports every problem of a run at once, each with its fix", "[config]") {
  RunConfig c;
  c.resources.num_gpus_per_node = 4;
  c.parallel.tensor_model_parallel_size = 3;           // 4 % 3
  c.parallel.overlap_param_gather = true;              // needs ZeRO
  c.data.seq_length = 1000;                            // > max_position_embeddings 256
  c.optim.min_lr = 1.0;                                // > lr
  c.checkpoint.keep_top_k = 1;                         // needs validation
  const ValidationReport r = validate(c, 4, {.check_paths = false});
  CHECK(has(r.errors, "world size 4 (resources: 1 node(s) × 4) is not divisible by TP×PP×CP"));
  CHECK(has(r.errors, "parallel.overlap_param_gather: needs parallel.use_distributed_optimizer"));
  CHECK(has(r.errors, "data.seq_length: 1000 exceeds model.max_position_embeddings 256"));
  CHECK(has(r.errors, "optim.min_lr"));
  CHECK(has(r.errors, "checkpoint.keep_top_k"));
  CHECK(has(r.errors, "num_attention_heads 4 is not divisible by TP 3"));  // the model's own check, for this TP
  CHECK_THROWS_AS(check(c, 4, {.check_paths = false}), ConfigError);

  RunConfig ok;
  ok.resources.num_gpus_per_node = 4;
  ok.parallel.tensor_model_parallel_size = 2;
  ok.parallel.pipeline_model_parallel_size = 2;
  CHECK(validate(ok, 4, {.check_paths = false}).errors.empty());
  // LoRA: every problem of the peft section, and the base it needs.
  RunConfig lora = ok;
  lora.peft.scheme = "lora";
  lora.peft.dim = 0;
  lora.peft.target_modules = {"q_proj", "qkv"};
  const ValidationReport lr = validate(lora, 4, {.check_paths = false});
  CHECK(has(lr.errors, "peft.target_modules: unknown module 'qkv'; valid names are: q_proj, k_proj"));
  CHECK(has(lr.errors, "peft.dim (the LoRA rank r) is 0"));
  CHECK(has(lr.errors, "checkpoint.pretrained_checkpoint: is empty but peft.scheme = lora"));
  lora.peft.dim = 100000;
  lora.peft.target_modules = {"q_proj"};
  CHECK(has(validate(lora, 4, {.check_paths = false}).errors, "use peft.dim <="));
  lora.peft.dim = 8;
  lora.checkpoint.pretrained_checkpoint = "/nonexistent/base";
  CHECK(validate(lora, 4, {.check_paths = false}).errors.empty());
  CHECK(has(validate(lora, 4, {.check_paths = true}).errors, "checkpoint.pretrained_checkpoint: '/nonexistent/base' does not exist"));
  // One micro-batch per pipeline stage is a warning, not an error.
  ok.data.global_batch_size = 4;
  const ValidationReport w = validate(ok, 4, {.check_paths = false});
  CHECK(w.errors.empty());
  CHECK(has(w.warnings, "pipeline bubble"));
}

TEST_CASE("validate checks trainer.recompute_num_layers: full recompute only, within a model chunk", "[config]") {
  RunConfig c;
  c.resources.num_gpus_per_node = 4;
  c.model.num_layers = 8;
  c.parallel.pipeline_model_parallel_size = 2;
  c.parallel.virtual_pipeline_model_parallel_size = 2;  // 4 chunks of 2 layers
  c.data.global_batch_size = 16;
  c.trainer.recompute_num_layers = 1;
  for (auto g : {model::RecomputeGranularity::None, model::RecomputeGranularity::Selective})
    for (int64_t n : {int64_t(0), int64_t(1), int64_t(-2)}) {
      c.trainer.recompute = g;
      c.trainer.recompute_num_layers = n;
      CHECK(has(validate(c, 4, {.check_paths = false}).errors,
                fmt::format("trainer.recompute_num_layers: {} limits full recompute to the first layers of each model "
                            "chunk, but trainer.recompute is {}; set trainer.recompute = full",
                            n, model::recompute_granularity_name(g))));
    }
  c.trainer.recompute = model::RecomputeGranularity::Full;
  for (int64_t n : {-1, 0, 1, 2}) {
    c.trainer.recompute_num_layers = n;
    CHECK(validate(c, 4, {.check_paths = false}).errors.empty());
  }
  c.trainer.recompute_num_layers = 3;
  CHECK(has(validate(c, 4, {.check_paths = false}).errors,
            "trainer.recompute_num_layers: 3 exceeds the 2 layers of the largest model chunk (PP×VP = 2×2 chunks of "
            "the 8 layers); give at most 2"));
  c.trainer.recompute_num_layers = -2;
  CHECK(has(validate(c, 4, {.check_paths = false}).errors, "trainer.recompute_num_layers: must be >= 0 (or -1"));
  // Uneven chunks (an explicit layout): N counts against the largest.
  c.parallel.pipeline_layout = {3, 1, 1, 3};
  c.trainer.recompute_num_layers = 3;
  CHECK(validate(c, 4, {.check_paths = false}).errors.empty());
  c.trainer.recompute_num_layers = 4;
  CHECK(has(validate(c, 4, {.check_paths = false}).errors, "exceeds the 3 layers of the largest model chunk"));
}

TEST_CASE("validate checks the MoE layout: EP within DP×CP, experts and FFN divisible, no EP without experts",
          "[config][moe]") {
  RunConfig c;
  c.resources.num_gpus_per_node = 8;
  c.parallel.tensor_model_parallel_size = 2;  // DP = 4
  c.model.num_moe_experts = 4;
  c.parallel.expert_model_parallel_size = 4;
  CHECK(validate(c, 8, {.check_paths = false}).errors.empty());
  c.parallel.expert_tensor_parallel_size = 1;  // expert-TP 1 × EP 4 over 8 ranks: expert-DP 2
  CHECK(validate(c, 8, {.check_paths = false}).errors.empty());
  c.parallel.expert_tensor_parallel_size = 0;
  c.parallel.expert_model_parallel_size = 3;
  const ValidationReport r = validate(c, 8, {.check_paths = false});
  CHECK(has(r.errors, "parallel.expert_model_parallel_size: EP = 3 does not divide DP×CP = 4×1 = 4"));
  CHECK(has(r.errors, "set ep to a divisor of 4"));
  CHECK(has(r.errors, "model: num_moe_experts 4 is not divisible by EP = 3"));
  c.parallel.expert_model_parallel_size = 4;
  c.parallel.expert_tensor_parallel_size = 4;  // expert-TP 4 × EP 4 = 16 > 8 ranks
  CHECK(has(validate(c, 8, {.check_paths = false}).errors,
            "parallel.expert_tensor_parallel_size: expert-TP×EP = 4×4 = 16 does not divide the 8 ranks"));
  c.parallel.expert_tensor_parallel_size = -1;
  CHECK(has(validate(c, 8, {.check_paths = false}).errors, "parallel.expert_tensor_parallel_size: must be a positive"));
  // A dense model with EP > 1 or MoE fields set.
  RunConfig dense;
  dense.resources.num_gpus_per_node = 2;
  dense.parallel.expert_model_parallel_size = 2;
  dense.model.moe_aux_loss_coeff = 0.01;
  const ValidationReport d = validate(dense, 2, {.check_paths = false});
  CHECK(has(d.errors, "expert parallelism (EP = 2) splits the experts of MoE layers but num_moe_experts is 0"));
  CHECK(has(d.errors, "moe_aux_loss_coeff is 0.01 but num_moe_experts is 0"));
  // grid_config carries the expert sizes.
  CHECK(c.grid_config().expert == 4);
  CHECK(c.grid_config().expert_tensor == -1);
  RunConfig s;
  set_field(s, "parallel.etp", "2");
  set_field(s, "parallel.ep", "4");
  set_field(s, "model.moe_router_score_function", "sigmoid");
  set_field(s, "model.moe_token_dispatcher_type", "allgather");
  CHECK(s.parallel.expert_tensor_parallel_size == 2);
  CHECK(s.parallel.expert_model_parallel_size == 4);
  CHECK(s.model.moe_router_score_function == model::MoERouterScore::Sigmoid);
  CHECK(s.model.moe_token_dispatcher_type == model::MoETokenDispatcher::AllGather);
  CHECK_THROWS_WITH(set_field(s, "model.moe_router_score_function", "relu"), Catch::Contains("softmax, sigmoid"));
}

TEST_CASE("validate checks the files a run reads, naming how to get them", "[config]") {
  const auto dir = std::filesystem::temp_directory_path() / "megacore_test_run_config";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  RunConfig c;
  c.data.paths = {0.5, (dir / "a").string(), 0.5, (dir / "b").string()};
  std::ofstream(dir / "a.bin") << "x";
  std::ofstream(dir / "a.idx") << "x";
  c.data.tokenizer = "meta-llama/Meta-Llama-3-8B";
  c.checkpoint.resume = (dir / "nope").string();
  ValidationReport r = validate(c, 1);
  CHECK(has(r.errors, "data.paths: '" + (dir / "b").string() + "' has no"));
  CHECK(!has(r.errors, "'" + (dir / "a").string() + "' has no"));
  CHECK(has(r.errors, "data.tokenizer: 'meta-llama/Meta-Llama-3-8B' is not a tokenizer.json file"));
  CHECK(has(r.errors, "save_pretrained"));
  CHECK(has(r.errors, "checkpoint.resume"));
  // Weights must alternate with prefixes and be positive.
  c.data.paths = {0.5, (dir / "a").string(), -1.0, (dir / "a").string()};
  c.data.tokenizer = "byte";
  c.checkpoint.resume = "";
  r = validate(c, 1);
  CHECK(has(r.errors, "data.paths"));
  c.data.paths = {0.5, (dir / "a").string(), (dir / "a").string()};
  CHECK(has(validate(c, 1).errors, "data.paths"));
  std::filesystem::remove_all(dir);
}

namespace {

// A checkpoint directory whose metadata.json holds `blobs` as its JSON blobs ("config" for an import, "recipe" for
// a training run); its path.
std::string write_checkpoint(const std::filesystem::path& dir, const json& blobs) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "metadata.json") << json{{"format", "megacore-distributed-checkpoint"}, {"json", blobs}}.dump();
  return dir.string();
}

// The "config" blob `megacore convert` writes for a Qwen3 of RunConfig's default shape: rope_theta 1e6,
// norm_eps 1e-6, q/k norms.
json qwen3_config() {
  return json{{"num_layers", 4},           {"hidden_size", 128},        {"num_attention_heads", 4},
              {"num_query_groups", 2},     {"ffn_hidden_size", 256},    {"kv_channels", 32},
              {"vocab_size", 259},         {"max_position_embeddings", 256}, {"normalization", "RMSNorm"},
              {"norm_eps", 1e-6},          {"activation", "SwiGLU"},    {"add_bias_linear", false},
              {"tie_word_embeddings", false}, {"position_embedding", "RoPE"}, {"rope_theta", 1e6},
              {"rope_scaling", {{"type", "None"}}}, {"init_method_std", 0.02}, {"params_dtype", "f32"},
              {"qk_layernorm", true}};
}

// Validates `c` loading `ckpt` both ways (checkpoint.resume, checkpoint.pretrained_checkpoint): no error and no
// warning.
void check_silent(RunConfig c, const std::string& ckpt) {
  for (const bool resume : {true, false}) {
    c.checkpoint.resume = resume ? ckpt : "";
    c.checkpoint.pretrained_checkpoint = resume ? "" : ckpt;
    const ValidationReport r = validate(c, 1);
    CHECK(r.errors.empty());
    CHECK(r.warnings.empty());
  }
}

}  // namespace

TEST_CASE("a recipe with the default rope_theta and norm_eps is told about a converted Qwen3 checkpoint's",
          "[config]") {
  const auto dir = std::filesystem::temp_directory_path() / "megacore_test_run_config_rope";
  std::filesystem::remove_all(dir);
  const std::string ckpt = write_checkpoint(dir / "qwen3", {{"config", qwen3_config()}});
  RunConfig c;
  c.checkpoint.save_last = false;  // no warning that nothing is saved
  c.model.qk_layernorm = true;     // the shapes match; rope_theta 10000 and norm_eps 1e-5 stay the defaults
  c.checkpoint.pretrained_checkpoint = ckpt;
  ValidationReport r = validate(c, 1);
  // Fine-tuning: a different norm_eps trains another model; a different rope_theta may extend the context.
  CHECK(has(r.errors, "checkpoint.pretrained_checkpoint: '" + ckpt + "' holds another model (norm_eps 1e-06 vs "
                      "1e-05, checkpoint vs recipe); set model.norm_eps = 1e-06 to train the imported model"));
  CHECK(!has(r.errors, "rope_theta"));
  CHECK(has(r.warnings, "checkpoint.pretrained_checkpoint: '" + ckpt + "' was saved with other RoPE settings "
                        "(rope_theta 1000000 vs 10000, checkpoint vs recipe); set model.rope_theta = 1000000 to "
                        "train the imported model as it was, or keep this value to extend the context on purpose"));
  // Resuming: every difference is an error.
  c.checkpoint.pretrained_checkpoint = "";
  c.checkpoint.resume = ckpt;
  r = validate(c, 1);
  CHECK(has(r.errors, "checkpoint.resume: '" + ckpt + "' holds another model (norm_eps 1e-06 vs 1e-05; rope_theta "
                      "1000000 vs 10000, checkpoint vs recipe); set model.norm_eps = 1e-06, model.rope_theta = "
                      "1000000 to train the imported model, or resume from a checkpoint of this model"));
  CHECK(!has(r.warnings, "rope_theta"));
  // The imported model's values (floats within 1e-9 relative, names in any case): nothing to say.
  c.model.norm_eps = 1e-6;
  c.model.rope_theta = 1e6 * (1 + 1e-12);
  json lower = qwen3_config();
  lower["position_embedding"] = "rope";
  lower["normalization"] = "rmsnorm";
  write_checkpoint(dir / "qwen3", {{"config", lower}});
  check_silent(c, ckpt);
  // A config blob written before these fields existed: nothing to compare them with.
  json old = qwen3_config();
  for (const char* k : {"norm_eps", "rope_theta", "rope_scaling", "normalization", "activation", "position_embedding"})
    old.erase(k);
  write_checkpoint(dir / "qwen3", {{"config", old}});
  c.model.norm_eps = 1e-5;
  c.model.rope_theta = 10000;
  check_silent(c, ckpt);
  std::filesystem::remove_all(dir);
}

TEST_CASE("the RoPE scaling, norm and activation of a checkpoint are compared with the recipe's", "[config]") {
  const auto dir = std::filesystem::temp_directory_path() / "megacore_test_run_config_flavour";
  std::filesystem::remove_all(dir);
  json cfg = qwen3_config();
  cfg["rope_theta"] = 500000.0;
  cfg["rope_scaling"] = {{"type", "Llama3"}, {"factor", 32.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                         {"original_max_position_embeddings", 8192}};
  const std::string ckpt = write_checkpoint(dir / "llama32", {{"config", cfg}});
  RunConfig c;
  c.checkpoint.save_last = false;
  c.model.qk_layernorm = true;
  c.model.norm_eps = 1e-6;
  c.model.rope_theta = 500000;
  c.checkpoint.pretrained_checkpoint = ckpt;
  ValidationReport r = validate(c, 1);
  CHECK(r.errors.empty());
  CHECK(has(r.warnings, "(rope_scaling llama3 vs none, checkpoint vs recipe); set model.rope_scaling = llama3 to "
                        "train the imported model as it was"));
  c.model.rope_scaling.type = model::RopeScalingType::Llama3;  // factor 8 (Llama 3.1) against the checkpoint's 32
  r = validate(c, 1);
  CHECK(r.errors.empty());
  CHECK(has(r.warnings, "(rope_scaling_factor 32 vs 8, checkpoint vs recipe); set model.rope_scaling_factor = 32"));
  c.model.rope_scaling.factor = 32;
  c.model.activation = model::ActivationType::GELU;
  c.model.normalization = model::NormType::LayerNorm;
  c.model.qk_layernorm = false;  // q/k norms are RMSNorms
  r = validate(c, 1);
  CHECK(r.warnings.empty());
  CHECK(has(r.errors, "holds another model (normalization RMSNorm vs LayerNorm; activation SwiGLU vs GELU; "
                      "qk_layernorm true vs false, checkpoint vs recipe); set model.normalization = RMSNorm, "
                      "model.activation = SwiGLU, model.qk_layernorm = true to train the imported model"));
  // Learned positions ignore the RoPE settings.
  json gpt2 = qwen3_config();
  gpt2["position_embedding"] = "Learned";
  gpt2["qk_layernorm"] = false;
  write_checkpoint(dir / "llama32", {{"config", gpt2}});
  RunConfig learned;
  learned.checkpoint.save_last = false;
  learned.model.norm_eps = 1e-6;
  learned.model.position_embedding = model::PositionEmbeddingType::Learned;
  check_silent(learned, ckpt);
  std::filesystem::remove_all(dir);
}

TEST_CASE("resuming from a training run's checkpoint with another rope_theta or norm_eps is refused", "[config]") {
  const auto dir = std::filesystem::temp_directory_path() / "megacore_test_run_config_recipe_rope";
  std::filesystem::remove_all(dir);
  RunConfig saved;
  saved.model.rope_theta = 500000;
  saved.model.norm_eps = 1e-6;
  // The trainer stores its recipe as the "recipe" blob of metadata.json.
  const std::string ckpt = write_checkpoint(dir / "step_10", {{"recipe", json::parse(to_json(saved))}});
  RunConfig c;
  c.checkpoint.save_last = false;
  c.checkpoint.resume = ckpt;
  ValidationReport r = validate(c, 1);
  CHECK(has(r.errors, "checkpoint.resume: '" + ckpt + "' holds another model (norm_eps 1e-06 vs 1e-05; rope_theta "
                      "500000 vs 10000, checkpoint vs recipe); set model.norm_eps = 1e-06, model.rope_theta = 500000 "
                      "to train the saved model, or resume from a checkpoint of this model, or set "
                      "checkpoint.resume = '' to start fresh"));
  // Fine-tuning from it: norm_eps is an error, rope_theta a warning.
  c.checkpoint.resume = "";
  c.checkpoint.pretrained_checkpoint = ckpt;
  r = validate(c, 1);
  CHECK(has(r.errors, "(norm_eps 1e-06 vs 1e-05, checkpoint vs recipe); set model.norm_eps = 1e-06 to train the "
                      "saved model"));
  CHECK(has(r.warnings, "(rope_theta 500000 vs 10000, checkpoint vs recipe); set model.rope_theta = 500000 to train "
                        "the saved model as it was"));
  c.model.rope_theta = 500000;
  c.model.norm_eps = 1e-6;
  check_silent(c, ckpt);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a checkpoint's experts and routing are compared with the recipe's", "[config][moe]") {
  const auto dir = std::filesystem::temp_directory_path() / "megacore_test_run_config_moe";
  std::filesystem::remove_all(dir);
  RunConfig saved;
  saved.model.num_moe_experts = 4;  // each expert's FFN width: ffn_hidden_size (moe_ffn_hidden_size 0), 256
  const std::string ckpt = write_checkpoint(dir / "step_10", {{"recipe", json::parse(to_json(saved))}});
  RunConfig c;
  c.checkpoint.save_last = false;
  c.model.num_moe_experts = 4;
  check_silent(c, ckpt);
  c.model.moe_ffn_hidden_size = 256;  // the same width, spelled out
  check_silent(c, ckpt);
  // A dense recipe on a MoE checkpoint (and the other way round): the expert count, whichever way it loads.
  RunConfig dense;
  dense.checkpoint.save_last = false;
  dense.checkpoint.pretrained_checkpoint = ckpt;
  CHECK(has(validate(dense, 1).errors, "holds another model (num_moe_experts 4 vs 0, checkpoint vs recipe); set "
                                       "model.num_moe_experts = 4 to train the saved model"));
  // Expert shapes: errors on a fine-tune too.
  c.model.moe_ffn_hidden_size = 128;
  c.model.moe_shared_expert_size = 64;
  c.checkpoint.pretrained_checkpoint = ckpt;
  ValidationReport r = validate(c, 1);
  CHECK(has(r.errors, "holds another model (moe_ffn_hidden_size 256 vs 128; moe_shared_expert_size 0 vs 64, "
                      "checkpoint vs recipe); set model.moe_ffn_hidden_size = 256, model.moe_shared_expert_size = 0"));
  c.model.moe_ffn_hidden_size = 0;
  c.model.moe_shared_expert_size = 0;
  // Routing: no tensor holds it. A fine-tune may change it (a warning); a resume may not.
  c.model.moe_router_topk = 1;
  c.model.moe_router_score_function = model::MoERouterScore::Sigmoid;
  r = validate(c, 1);
  CHECK(r.errors.empty());
  CHECK(has(r.warnings, "was saved with other expert routing (moe_router_topk 2 vs 1; moe_router_score_function "
                        "softmax vs sigmoid, checkpoint vs recipe); set model.moe_router_topk = 2, "
                        "model.moe_router_score_function = softmax to route as the saved model did, or keep these "
                        "values to change the routing on purpose"));
  c.checkpoint.pretrained_checkpoint = "";
  c.checkpoint.resume = ckpt;
  r = validate(c, 1);
  CHECK(has(r.errors, "checkpoint.resume: '" + ckpt + "' holds another model (moe_router_topk 2 vs 1; "
                      "moe_router_score_function softmax vs sigmoid, checkpoint vs recipe); set model.moe_router_topk = "
                      "2, model.moe_router_score_function = softmax to train the saved model, or resume"));
  c.model.moe_router_topk = 2;
  c.model.moe_router_score_function = model::MoERouterScore::Softmax;
  c.model.moe_router_enable_expert_bias = true;
  CHECK(has(validate(c, 1).errors, "(moe_router_enable_expert_bias false vs true, checkpoint vs recipe)"));
  c.model.moe_router_enable_expert_bias = false;
  // Training hyperparameters of the MoE layers (loss coefficients, capacity, dispatcher) may change on a resume.
  c.model.moe_aux_loss_coeff = 0.05;
  c.model.moe_expert_capacity_factor = 1.5;
  check_silent(c, ckpt);
  // An imported config blob: a Mixtral's MoE keys are compared; a dense model's blob has none (0 experts).
  json mixtral = qwen3_config();
  mixtral["qk_layernorm"] = false;
  mixtral["norm_eps"] = 1e-5;
  mixtral["rope_theta"] = 10000.0;
  mixtral.update(json{{"num_moe_experts", 4}, {"moe_router_topk", 2}, {"moe_ffn_hidden_size", 256},
                      {"moe_layer_freq", 1}, {"moe_shared_expert_size", 0}, {"moe_router_score_function", "softmax"},
                      {"moe_router_pre_softmax", false}, {"moe_router_topk_scaling_factor", 1.0},
                      {"moe_router_enable_expert_bias", false}});
  write_checkpoint(dir / "mixtral", {{"config", mixtral}});
  c.checkpoint.resume = "";
  check_silent(c, (dir / "mixtral").string());
  mixtral["moe_router_pre_softmax"] = true;
  write_checkpoint(dir / "mixtral", {{"config", mixtral}});
  c.checkpoint.pretrained_checkpoint = (dir / "mixtral").string();
  CHECK(has(validate(c, 1).warnings, "(moe_router_pre_softmax true vs false, checkpoint vs recipe); set "
                                     "model.moe_router_pre_softmax = true to route as the imported model did"));
  for (const char* k : {"num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
                        "moe_shared_expert_size", "moe_router_score_function", "moe_router_pre_softmax",
                        "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias"})
    mixtral.erase(k);
  write_checkpoint(dir / "mixtral", {{"config", mixtral}});
  CHECK(has(validate(c, 1).errors, "(num_moe_experts 0 vs 4, checkpoint vs recipe); set model.num_moe_experts = 0 "
                                   "to train the imported model"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("a MoE model at TP > 1 without SP needs micro-batches whose tokens TP divides", "[config][moe]") {
  RunConfig c;
  c.resources.num_gpus_per_node = 2;
  c.parallel.tensor_model_parallel_size = 2;
  c.model.num_moe_experts = 4;
  c.data.seq_length = 127;
  c.data.micro_batch_size = 1;
  c.data.global_batch_size = 8;
  CHECK(has(validate(c, 2, {.check_paths = false}).errors,
            "data.seq_length: 127 tokens per micro-batch on each CP rank (seq_length / CP × micro_batch_size = 127 / 1 "
            "× 1) do not split evenly over TP = 2"));
  c.data.micro_batch_size = 2;  // 254 tokens: even
  CHECK_FALSE(has(validate(c, 2, {.check_paths = false}).errors, "do not split evenly"));
  c.data.micro_batch_size = 1;
  c.model.num_moe_experts = 0;  // a dense model splits nothing
  CHECK_FALSE(has(validate(c, 2, {.check_paths = false}).errors, "do not split evenly"));
}

TEST_CASE("validate checks context parallelism: sequence divisibility, comm type, unsupported combinations",
          "[config]") {
  RunConfig c;
  c.resources.num_gpus_per_node = 4;
  c.parallel.tensor_model_parallel_size = 2;
  c.parallel.context_parallel_size = 2;
  c.data.seq_length = 128;
  CHECK(validate(c, 4, {.check_paths = false}).errors.empty());
  CHECK(RunConfig{}.parallel.cp_comm_type == "p2p");
  c.data.seq_length = 126;
  CHECK(has(validate(c, 4, {.check_paths = false}).errors, "data.seq_length: 126 is not divisible by 2·CP = 4"));
  c.parallel.sequence_parallel = true;
  c.data.seq_length = 132;  // a multiple of 2·CP = 4 but not of 2·CP·TP = 8
  CHECK(has(validate(c, 4, {.check_paths = false}).errors, "data.seq_length: 132 is not divisible by 2·CP·TP = 8"));
  c.data.seq_length = 128;
  CHECK(validate(c, 4, {.check_paths = false}).errors.empty());
  c.parallel.cp_comm_type = "all_gather";
  CHECK(validate(c, 4, {.check_paths = false}).errors.empty());
  c.data.sft_path = "x.jsonl";  // packed SFT rows: the p2p ring splits their segments, all_gather does not
  CHECK(has(validate(c, 4, {.check_paths = false}).errors, "need the p2p ring; set cp_comm_type = p2p"));
  c.parallel.cp_comm_type = "p2p";
  CHECK(!has(validate(c, 4, {.check_paths = false}).errors, "packed SFT rows"));
  c.parallel.cp_comm_type = "all_gather";
  c.data.sft_pack = false;
  CHECK(!has(validate(c, 4, {.check_paths = false}).errors, "packed SFT rows"));
  c.parallel.cp_comm_type = "p2p";
  CHECK_THROWS_AS(set_field(c, "parallel.cp_comm_type", "ring"), ConfigError);  // not one of p2p|all_gather
}

TEST_CASE("a damaged newest checkpoint under save_dir is refused before launch with the intact one named",
          "[config][checkpoint]") {
  const auto root = std::filesystem::temp_directory_path() / "megacore_test_run_config_damaged";
  std::filesystem::remove_all(root);
  RunConfig saved;
  const std::string s2 = write_checkpoint(root / "step_2", {{"recipe", json::parse(to_json(saved))}});
  std::filesystem::create_directories(root / "step_4");
  std::ofstream(root / "step_4" / "metadata.json") << "{\"format\": ";  // cut off
  std::ofstream(root / "latest") << "step_4\n";
  RunConfig c;
  c.checkpoint.save_dir = root.string();
  c.checkpoint.resume = "auto";
  ValidationReport r = validate(c, 1);
  CHECK(has(r.errors, "checkpoint.resume: checkpoint '" + (root / "step_4").string() + "' is damaged: metadata.json "
                      "cannot be read or is not valid JSON"));
  CHECK(has(r.errors, "resume from the newest intact one with checkpoint.resume = '" + s2 + "'"));
  // The fix the error names passes.
  c.checkpoint.resume = s2;
  r = validate(c, 1);
  CHECK_FALSE(has(r.errors, "damaged"));
  // An empty save_dir with resume = auto is a fresh start, not an error.
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root);
  c.checkpoint.resume = "auto";
  CHECK_FALSE(has(validate(c, 1).errors, "checkpoint.resume"));
  std::filesystem::remove_all(root);
}
