#include "megacore/train/run_config.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "megacore/checkpoint/dist_checkpoint.hpp"
#include "megacore/core/error.hpp"

namespace megacore::train {

namespace fs = std::filesystem;
using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------------
// Generic field I/O: every reflected struct is read, written, described and set through these.

namespace {

template <class T>
struct IsVector : std::false_type {};
template <class T>
struct IsVector<std::vector<T>> : std::true_type {};

std::string join(const std::vector<std::string>& v, std::string_view sep = ", ") {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? std::string(sep) : "") + v[i];
  return out;
}

std::string lowered(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return s;
}

std::vector<std::string> split_choices(std::string_view c) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= c.size() && !c.empty()) {
    const size_t bar = c.find('|', start);
    out.emplace_back(c.substr(start, bar == std::string_view::npos ? std::string_view::npos : bar - start));
    if (bar == std::string_view::npos) break;
    start = bar + 1;
  }
  return out;
}

template <class T>
std::vector<std::string> choices_of(const Field& fd) {
  if constexpr (NamedEnum<T>)
    return split_choices(enum_choices<T>());
  else
    return split_choices(fd.choices);
}

template <class T>
std::string type_name() {
  if constexpr (std::is_same_v<T, bool>) return "bool";
  else if constexpr (std::is_integral_v<T>) return "int";
  else if constexpr (std::is_floating_point_v<T>) return "float";
  else if constexpr (std::is_same_v<T, std::string> || NamedEnum<T>) return "str";
  else if constexpr (std::is_same_v<T, BlendList>) return "list[float|str]";
  else if constexpr (std::is_same_v<T, std::vector<int64_t>>) return "list[int]";
  else if constexpr (std::is_same_v<T, std::vector<std::string>>) return "list[str]";
  else if constexpr (Reflected<T>) return "section";
  else static_assert(sizeof(T) == 0, "unsupported config field type");
}

template <class T>
json to_value(const T& v) {
  if constexpr (NamedEnum<T>) {
    return std::string(enum_name(v));
  } else if constexpr (std::is_same_v<T, BlendList>) {
    json a = json::array();
    for (const auto& e : v) std::visit([&](const auto& x) { a.push_back(x); }, e);
    return a;
  } else if constexpr (Reflected<T>) {
    json o = json::object();
    for_each_field(v, [&](const Field& fd, const auto& m) { o[std::string(fd.name)] = to_value(m); });
    return o;
  } else {
    return json(v);
  }
}

[[noreturn]] void wrong(const std::string& where, std::string_view want, const json& got) {
  raise<ConfigError>("{} must be {}, got {}", where, want, got.dump());
}

template <class T>
void read_object(const json& j, T& obj, const std::string& where);

template <class T>
void read_value(const json& j, T& out, const std::string& where, const Field& fd) {
  if constexpr (std::is_same_v<T, bool>) {
    if (!j.is_boolean()) wrong(where, "true or false", j);
    out = j.get<bool>();
  } else if constexpr (std::is_integral_v<T>) {
    if (j.is_boolean() || !j.is_number()) wrong(where, "an integer", j);
    if (j.is_number_float()) {
      const double d = j.get<double>();
      if (d != std::floor(d)) wrong(where, "an integer", j);
      if (std::is_unsigned_v<T> && d < 0) wrong(where, "a non-negative integer", j);
      out = static_cast<T>(d);
    } else if (std::is_unsigned_v<T> && j.is_number_integer() && !j.is_number_unsigned() && j.get<int64_t>() < 0) {
      wrong(where, "a non-negative integer", j);
    } else {
      out = j.get<T>();
    }
  } else if constexpr (std::is_floating_point_v<T>) {
    if (j.is_boolean() || !j.is_number()) wrong(where, "a number", j);
    out = j.get<T>();
  } else if constexpr (NamedEnum<T>) {
    if (!j.is_string()) wrong(where, fmt::format("one of {}", join(choices_of<T>(fd))), j);
    const auto v = enum_from_name<T>(j.get<std::string>());
    if (!v) raise<ConfigError>("{} '{}' is not one of {}", where, j.get<std::string>(), join(choices_of<T>(fd)));
    out = *v;
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!j.is_string()) wrong(where, "a string", j);
    std::string s = j.get<std::string>();
    const auto ok = choices_of<T>(fd);
    if (!ok.empty() && std::find(ok.begin(), ok.end(), s) == ok.end())
      raise<ConfigError>("{} '{}' is not one of {}", where, s, join(ok));
    out = std::move(s);
  } else if constexpr (std::is_same_v<T, BlendList>) {
    if (j.is_string()) {
      out = {j.get<std::string>()};
      return;
    }
    if (!j.is_array()) wrong(where, "a list of prefixes (and weights)", j);
    out.clear();
    for (const auto& e : j) {
      if (e.is_string())
        out.emplace_back(e.get<std::string>());
      else if (e.is_number() && !e.is_boolean())
        out.emplace_back(e.get<double>());
      else
        wrong(where, "a list of prefixes (strings) and weights (numbers)", j);
    }
  } else if constexpr (IsVector<T>::value) {
    if (!j.is_array()) wrong(where, fmt::format("a list ({})", type_name<T>()), j);
    out.clear();
    for (size_t i = 0; i < j.size(); ++i) {
      typename T::value_type v{};
      read_value(j[i], v, fmt::format("{}[{}]", where, i), Field{});
      out.push_back(std::move(v));
    }
  } else if constexpr (Reflected<T>) {
    read_object(j, out, where);
  } else {
    static_assert(sizeof(T) == 0, "unsupported config field type");
  }
}

template <class T>
void read_object(const json& j, T& obj, const std::string& where) {
  if (!j.is_object()) raise<ConfigError>("{} must be a mapping of fields, got {}", where, j.dump());
  std::vector<std::string> names;
  for_each_field(obj, [&](const Field& fd, auto& m) {
    names.emplace_back(fd.name);
    const std::string key(fd.name);
    if (j.contains(key)) read_value(j[key], m, where + "." + key, fd);
  });
  std::vector<std::string> unknown;
  for (const auto& [k, v] : j.items())
    if (std::find(names.begin(), names.end(), k) == names.end()) unknown.push_back("'" + k + "'");
  if (!unknown.empty())
    raise<ConfigError>("unknown field{} {} in {}; valid fields: {}", unknown.size() > 1 ? "s" : "", join(unknown),
                       where, join(names));
}

template <class T>
json describe(const T& obj) {
  json fields = json::array();
  for_each_field(obj, [&](const Field& fd, const auto& m) {
    using M = std::decay_t<decltype(m)>;
    json d = {{"name", std::string(fd.name)}, {"doc", std::string(fd.doc)}, {"type", type_name<M>()}};
    if constexpr (Reflected<M>) {
      d["fields"] = describe(m);
    } else {
      d["default"] = to_value(m);
      d["choices"] = choices_of<M>(fd);
      if (!fd.alias.empty()) d["alias"] = std::string(fd.alias);
    }
    fields.push_back(std::move(d));
  });
  return fields;
}

// The text of `--set key=value` as the JSON value of a field of type T.
template <class T>
json parse_text(const std::string& text, const std::string& where) {
  auto trimmed = [](std::string s) {
    const auto b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
    return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
  };
  const std::string t = trimmed(text);
  if constexpr (std::is_same_v<T, bool>) {
    const std::string l = lowered(t);
    if (l == "1" || l == "true" || l == "yes" || l == "on") return true;
    if (l == "0" || l == "false" || l == "no" || l == "off") return false;
    raise<ConfigError>("{} must be true or false, got '{}'", where, text);
  } else if constexpr (std::is_arithmetic_v<T>) {
    try {
      return json::parse(t);
    } catch (const json::exception&) {
      raise<ConfigError>("{} must be {}, got '{}'", where, std::is_integral_v<T> ? "an integer" : "a number", text);
    }
  } else if constexpr (std::is_same_v<T, std::string> || NamedEnum<T>) {
    return t;
  } else {  // lists: JSON, or comma-separated items (numbers stay numbers)
    if (!t.empty() && t.front() == '[') {
      try {
        return json::parse(t);
      } catch (const json::exception& e) {
        raise<ConfigError>("{}: '{}' is not a JSON list ({})", where, text, e.what());
      }
    }
    json a = json::array();
    std::stringstream ss(t);
    std::string item;
    while (std::getline(ss, item, ',')) {
      item = trimmed(item);
      if (item.empty()) continue;
      try {
        json n = json::parse(item);
        a.push_back(n.is_number() ? n : json(item));
      } catch (const json::exception&) {
        a.push_back(item);
      }
    }
    return a;
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Sections

ModelSection::ModelSection() {
  num_layers = 4;
  hidden_size = 128;
  num_attention_heads = 4;
  num_query_groups = 2;
  ffn_hidden_size = 256;
  vocab_size = 259;  // the byte tokenizer
  max_position_embeddings = 256;
}

ModelSection ModelSection::preset(const std::string& name) {
  model::TransformerConfig t;
  if (name == "tiny_llama") t = model::presets::tiny_llama();
  else if (name == "tiny_gpt2") t = model::presets::tiny_gpt2();
  else if (name == "llama32_1b") t = model::presets::llama32_1b();
  else if (name == "llama3_8b") t = model::presets::llama3_8b();
  else if (name == "mixtral_8x7b") t = model::presets::mixtral_8x7b();
  else if (name == "gpt2_124m") t = model::presets::gpt2_124m();
  else
    raise<ConfigError>("unknown model preset '{}'; use one of tiny_llama, tiny_gpt2, llama32_1b, llama3_8b, gpt2_124m, mixtral_8x7b",
                       name);
  ModelSection m;
  static_cast<model::TransformerConfig&>(m) = t;
  m.name = name;
  return m;
}

parallel::ParallelConfig RunConfig::grid_config() const {
  parallel::ParallelConfig pc;
  pc.tensor = parallel.tensor_model_parallel_size;
  pc.pipeline = parallel.pipeline_model_parallel_size;
  pc.virtual_pipeline = parallel.virtual_pipeline_model_parallel_size;
  pc.context = parallel.context_parallel_size;
  pc.expert = parallel.expert_model_parallel_size;
  pc.expert_tensor = parallel.expert_tensor_parallel_size;
  pc.cp_copy_engine = parallel.cp_comm_copy_engine;
  return pc;
}

model::TransformerConfig RunConfig::transformer_config(bool on_gpu) const {
  model::TransformerConfig t = model;
  const std::string& p = trainer.precision;
  t.params_dtype = p == "bf16" ? DType::BF16 : p == "f16" ? DType::F16 : p == "f32" ? DType::F32
                   : on_gpu    ? DType::BF16
                               : DType::F32;
  t.sequence_parallel = parallel.sequence_parallel;
  t.recompute_granularity = trainer.recompute;
  t.tp_comm_overlap = parallel.tp_comm_overlap;
  t.tp_comm_overlap_forward = parallel.tp_comm_overlap_forward;
  t.tp_comm_stream_priority = parallel.tp_comm_stream_priority;
  return t;
}

pipeline::StageCosts RunConfig::pipeline_stage_costs() const {
  // Block recompute makes each chunk's first N layers dearer; N means nothing without full recompute (validate
  // reports that combination), so the split is priced without it then.
  const bool full = trainer.recompute == model::RecomputeGranularity::Full;
  const int64_t block = full && trainer.recompute_num_layers >= 0 ? trainer.recompute_num_layers : -1;
  return pipeline::resolve_stage_costs({parallel.pipeline_embedding_cost, parallel.pipeline_head_cost, block},
                                       transformer_config(false), data.seq_length, parallel.tensor_model_parallel_size);
}

optim::LRScheduleConfig RunConfig::lr_schedule() const {
  optim::LRScheduleConfig s;
  s.lr = optim.lr;
  s.min_lr = optim.min_lr;
  s.decay_steps = optim.lr_decay_iters > 0 ? optim.lr_decay_iters : trainer.max_steps;
  s.warmup_steps = optim.lr_warmup_fraction > 0 ? int64_t(std::llround(optim.lr_warmup_fraction * double(s.decay_steps)))
                                                : optim.lr_warmup_iters;
  s.style = optim.lr_decay_style;
  s.wsd_decay_steps = optim.lr_wsd_decay_iters;
  if (s.style == optim::LRDecayStyle::WSD && s.wsd_decay_steps == 0)
    s.wsd_decay_steps = std::max<int64_t>(1, (s.decay_steps - s.warmup_steps) / 10);
  return s;
}

// ---------------------------------------------------------------------------------------------------
// JSON, --set and the schema

std::string to_json(const RunConfig& cfg, int indent) { return to_value(cfg).dump(indent); }

RunConfig run_config_from_json(const std::string& text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    raise<ConfigError>("the recipe is not valid JSON: {}", e.what());
  }
  RunConfig c;
  read_object(j, c, "recipe");
  return c;
}

void set_field(RunConfig& cfg, const std::string& key, const std::string& value) {
  if (key == "name") {
    cfg.name = value;
    return;
  }
  const auto dot = key.find('.');
  std::vector<std::string> sections;
  for_each_field(cfg, [&](const Field& fd, auto& m) {
    if constexpr (Reflected<std::decay_t<decltype(m)>>) sections.emplace_back(fd.name);
  });
  if (dot == std::string::npos || key.find('.', dot + 1) != std::string::npos)
    raise<ConfigError>("--set key '{}' must be section.field (e.g. parallel.tp=2) or name; sections: {}", key,
                       join(sections));
  const std::string sec = key.substr(0, dot), name = key.substr(dot + 1);
  bool found_section = false, found_field = false;
  for_each_field(cfg, [&](const Field& sfd, auto& section) {
    using S = std::decay_t<decltype(section)>;
    if constexpr (Reflected<S>) {
      if (sfd.name != sec) return;
      found_section = true;
      std::vector<std::string> names, aliases;
      for_each_field(section, [&](const Field& fd, auto& m) {
        names.emplace_back(fd.name);
        if (!fd.alias.empty()) aliases.push_back(fmt::format("{}={}", fd.alias, fd.name));
        if (fd.name != name && fd.alias != name) return;
        found_field = true;
        const std::string where = fmt::format("{}.{}", sec, fd.name);
        read_value(parse_text<std::decay_t<decltype(m)>>(value, where), m, where, fd);
      });
      if (!found_field)
        raise<ConfigError>("unknown field '{}' in recipe section '{}'; valid fields: {}{}", name, sec, join(names),
                           aliases.empty() ? "" : fmt::format(" (aliases: {})", join(aliases)));
    }
  });
  if (!found_section) raise<ConfigError>("unknown recipe section '{}' in '{}'; use one of {}", sec, key, join(sections));
}

std::string run_config_schema() { return describe(RunConfig{}).dump(); }

std::string model_section_json(const ModelSection& m) { return to_value(m).dump(); }

// ---------------------------------------------------------------------------------------------------
// Validation of the run as a whole

namespace {

// Checks of the files a run reads; each problem goes to `err`.
template <class Err>
void check_files(const RunConfig& r, Err&& err) {
  const DataSection& d = r.data;
  if (!d.sft_path.empty()) {
    if (!fs::is_regular_file(d.sft_path))
      err("data.sft_path", fmt::format("'{}' does not exist; give the path of a JSONL file of SFT examples", d.sft_path));
  } else if (d.paths.empty()) {
    err("data.paths", "is empty and so is data.sft_path: no training data; set data.sft_path to a JSONL file of SFT "
                      "examples, or data.paths to a prefix, a blend such as [0.3, \"data/a\", 0.7, \"data/b\"], or "
                      "[\"embedded\"]");
  } else if (!(d.paths.size() == 1 && std::holds_alternative<std::string>(d.paths[0]) &&
               std::get<std::string>(d.paths[0]) == "embedded")) {
    for (const auto& e : d.paths) {
      if (!std::holds_alternative<std::string>(e)) continue;  // a blend weight
      const std::string& prefix = std::get<std::string>(e);
      std::vector<std::string> missing;
      for (const char* ext : {".bin", ".idx"})
        if (!fs::is_regular_file(prefix + ext)) missing.push_back(prefix + ext);
      if (!missing.empty())
        err("data.paths", fmt::format("'{}' has no {}; give dataset prefixes written by `megacore preprocess` "
                                      "(without .bin/.idx), or [\"embedded\"]",
                                      prefix, join(missing, " or ")));
    }
  }
  if (d.tokenizer != "byte") {
    const fs::path t(d.tokenizer);
    const bool ok = fs::is_regular_file(t) || fs::is_regular_file(t / "tokenizer.json");
    if (!ok)
      err("data.tokenizer",
          fmt::format("'{}' is not a tokenizer.json file or a folder holding one, and megacore downloads nothing; on a "
                      "connected machine run `python -c \"from transformers import AutoTokenizer; "
                      "AutoTokenizer.from_pretrained('{}').save_pretrained('tok')\"` (or fetch tokenizer.json from the "
                      "model's page) and set data.tokenizer to tok/tokenizer.json, or use 'byte'",
                      d.tokenizer, d.tokenizer));
  }
}

// The model a checkpoint was saved from: the model section of the recipe stored with it (metadata.json's
// json.recipe, or a recipe.json beside it), or, for checkpoints written outside the trainer (megacore convert,
// megacore.checkpoint), the whole TransformerConfig of its "config" blob (sizes derived: num_query_groups =
// heads, not 0).
struct SavedModel {
  json model;
  bool whole_config = false;
};

std::optional<SavedModel> saved_model(const fs::path& dir) {
  auto blob = [](json j) { return j.is_string() ? json::parse(j.get<std::string>()) : j; };
  for (const auto& [file, nested] : {std::pair{"metadata.json", true}, std::pair{"recipe.json", false}}) {
    std::ifstream in(dir / file);
    if (!in) continue;
    json j = json::parse(in);
    if (nested) {
      if (!j.contains("json")) return std::nullopt;
      if (!j["json"].contains("recipe")) {
        if (!j["json"].contains("config")) return std::nullopt;
        json c = blob(j["json"]["config"]);
        if (c.is_object()) return SavedModel{std::move(c), true};
        return std::nullopt;
      }
      j = blob(j["json"]["recipe"]);
    }
    if (j.is_object() && j.contains("model")) return SavedModel{j["model"], false};
    return std::nullopt;
  }
  return std::nullopt;
}

// A saved model's flavour settings under the recipe's names. A recipe's model section has them flat
// (rope_scaling, rope_scaling_factor, ...); a converted checkpoint's config blob nests the RoPE scaling
// ({type, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}) and spells its type as
// the Python enum does (None, Llama3), lowered here to the recipe's none / llama3. A field the blob lacks (saved
// before the field existed) is absent.
json saved_flavour(const SavedModel& s) {
  const json& m = s.model;
  json out = json::object();
  for (const char* k : {"normalization", "norm_eps", "activation", "position_embedding", "rope_theta"})
    if (m.contains(k)) out[k] = m[k];
  if (!s.whole_config) {
    for (const char* k : {"rope_scaling", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                          "rope_original_max_position_embeddings"})
      if (m.contains(k)) out[k] = m[k];
  } else if (m.contains("rope_scaling") && m["rope_scaling"].is_object()) {
    const json& rs = m["rope_scaling"];
    if (rs.contains("type") && rs["type"].is_string()) out["rope_scaling"] = lowered(rs["type"].get<std::string>());
    for (const auto& [k, recipe_key] : {std::pair{"factor", "rope_scaling_factor"},
                                        std::pair{"low_freq_factor", "rope_low_freq_factor"},
                                        std::pair{"high_freq_factor", "rope_high_freq_factor"},
                                        std::pair{"original_max_position_embeddings",
                                                  "rope_original_max_position_embeddings"}})
      if (rs.contains(k)) out[recipe_key] = rs[k];
  }
  return out;
}

// Whether two saved settings are the same: numbers within 1e-9 relative (a value that went through Python's
// float or a text form), names case-insensitively (RoPE / rope), anything else exactly.
bool same_setting(const json& a, const json& b) {
  if (a.is_number() && b.is_number()) {
    const double x = a.get<double>(), y = b.get<double>();
    return std::abs(x - y) <= 1e-9 * std::max(std::abs(x), std::abs(y));
  }
  if (a.is_string() && b.is_string()) return lowered(a.get<std::string>()) == lowered(b.get<std::string>());
  return a == b;
}

// A setting as `--set model.KEY=VALUE` takes it: names unquoted, floats in their shortest form (1e-06, 1000000).
std::string setting_text(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number_float()) return fmt::format("{}", v.get<double>());
  return v.dump();
}

// Where a run loads a checkpoint from: its own run (checkpoint.resume), or the weights a fine-tune starts from
// (checkpoint.pretrained_checkpoint).
enum class Load { resume, fine_tune };

// Compares the model stored with the checkpoint at `path` with the recipe's. Every difference is an error,
// except that a fine-tune may change the RoPE (rope_theta, the RoPE scaling) on purpose to extend the context:
// that is a warning naming both values.
template <class Err, class Warn>
void check_resume(const RunConfig& r, fs::path path, Load load, Err&& err, Warn&& warn, bool auto_resume = false) {
  const std::string_view field = load == Load::resume ? "checkpoint.resume" : "checkpoint.pretrained_checkpoint";
  if (!fs::is_directory(path)) {
    err(field,
        fmt::format("'{}' is not a checkpoint directory; give a step_<N> directory, 'auto' or ''", path.string()));
    return;
  }
  // The directory the trainer will load (checkpoint::resolve_checkpoint: `latest`, a newer step_<N>, an error for
  // a damaged newest one).
  try {
    if (auto dir = checkpoint::resolve_checkpoint(path.string())) path = *dir;
    else if (auto_resume) return;  // checkpoint.resume = auto with nothing saved yet: a fresh start
  } catch (const IOError& e) {
    err(field, e.what());
    return;
  }
  std::optional<SavedModel> saved;
  try {
    saved = saved_model(path);
  } catch (const std::exception& e) {
    err(field, fmt::format("cannot read the checkpoint metadata in '{}': {}", path.string(), e.what()));
    return;
  }
  if (!saved) return;  // no model description stored: the loader compares tensor shapes
  // The loader compares the shapes of the tensors the model asks for, but skips a tensor the model does not ask
  // for (the q/k norms of a Qwen3 checkpoint loaded without qk_layernorm) without a word, and settings without a
  // tensor (norm_eps, rope_theta, ...) have no shape at all: the model is compared here first.
  const json& have = saved->model;
  const json want = json::parse(model_section_json(r.model));
  struct Diff {
    std::string key;
    json have, want;
  };
  std::vector<Diff> diff, rope;
  auto differs = [](std::vector<Diff>& to, const char* k, const json& a, const json& b) {
    if (!same_setting(a, b)) to.push_back({k, a, b});
  };
  if (saved->whole_config) {
    const model::TransformerConfig& m = r.model;
    const std::pair<const char*, json> shapes[] = {
        {"num_layers", m.num_layers},           {"hidden_size", m.hidden_size},
        {"num_attention_heads", m.num_attention_heads}, {"num_query_groups", m.query_groups()},
        {"ffn_hidden_size", m.ffn_size()},      {"kv_channels", m.head_dim()},
        {"vocab_size", m.vocab_size},           {"tie_word_embeddings", m.tie_word_embeddings},
        {"add_bias_linear", m.add_bias_linear}};
    for (const auto& [k, v] : shapes)
      if (have.contains(k)) differs(diff, k, have[k], v);
  } else {
    for (const char* k : {"num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                          "vocab_size", "tie_word_embeddings", "add_bias_linear"})
      differs(diff, k, have.value(k, json()), want.value(k, json()));
  }
  const json flavour = saved_flavour(*saved);
  for (const char* k : {"normalization", "norm_eps", "activation", "position_embedding"})
    if (flavour.contains(k)) differs(diff, k, flavour[k], want[k]);
  // The RoPE settings count only when both models rotate (learned positions ignore them), the scaling factors
  // only when both scale with llama3.
  auto is = [](const json& j, const char* k, std::string_view v) {
    return j.contains(k) && j[k].is_string() && lowered(j[k].get<std::string>()) == v;
  };
  const bool both_rope = is(want, "position_embedding", "rope") &&
                         (!flavour.contains("position_embedding") || is(flavour, "position_embedding", "rope"));
  if (both_rope) {
    for (const char* k : {"rope_theta", "rope_scaling"})
      if (flavour.contains(k)) differs(rope, k, flavour[k], want[k]);
    if (is(flavour, "rope_scaling", "llama3") && is(want, "rope_scaling", "llama3"))
      for (const char* k : {"rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                            "rope_original_max_position_embeddings"})
        if (flavour.contains(k)) differs(rope, k, flavour[k], want[k]);
  }
  // Recipes and configs saved before the field existed have no qk_layernorm: false.
  differs(diff, "qk_layernorm", have.value("qk_layernorm", false), want["qk_layernorm"]);
  // Mixture of experts: a blob without num_moe_experts is a dense model. When both are MoE, the experts' shapes
  // (each expert's FFN width as moe_ffn_hidden_size gives it, moe_layer_freq, the shared expert) must match, and so
  // must the routing on a resume (top-k, scores, pre-softmax, top-k scaling, expert bias: no tensor says them); a
  // fine-tune may change the routing on purpose, which is a warning.
  std::vector<Diff> routing;
  auto number = [](const json& j, const char* k, double dflt) {
    return j.contains(k) && j[k].is_number() ? j[k].get<double>() : dflt;
  };
  const int64_t have_experts = int64_t(number(have, "num_moe_experts", 0));
  differs(diff, "num_moe_experts", json(have_experts), json(r.model.num_moe_experts));
  if (have_experts > 0 && r.model.num_moe_experts > 0) {
    const double hidden = number(have, "hidden_size", 0), ffn = number(have, "ffn_hidden_size", 0),
                 moe_ffn = number(have, "moe_ffn_hidden_size", 0);
    const int64_t have_width = int64_t(moe_ffn > 0 ? moe_ffn : ffn > 0 ? ffn : 4 * hidden);
    differs(diff, "moe_ffn_hidden_size", json(have_width), json(r.model.moe_ffn_size()));
    for (const char* k : {"moe_layer_freq", "moe_shared_expert_size"})
      if (have.contains(k)) differs(diff, k, have[k], want[k]);
    for (const char* k : {"moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
                          "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias"})
      if (have.contains(k)) differs(routing, k, have[k], want[k]);
  }

  auto listed = [](const std::vector<Diff>& ds) {
    std::vector<std::string> out;
    for (const Diff& d : ds)
      out.push_back(fmt::format("{} {} vs {}", d.key, setting_text(d.have), setting_text(d.want)));
    return join(out, "; ");
  };
  auto fixes = [](const std::vector<Diff>& ds) {
    std::vector<std::string> out;
    for (const Diff& d : ds) out.push_back(fmt::format("model.{} = {}", d.key, setting_text(d.have)));
    return join(out, ", ");
  };
  const char* origin = saved->whole_config ? "imported" : "saved";
  if (load == Load::resume) {
    diff.insert(diff.end(), rope.begin(), rope.end());
    diff.insert(diff.end(), routing.begin(), routing.end());
  } else {
    if (!rope.empty())
      warn(field, fmt::format("'{}' was saved with other RoPE settings ({}, checkpoint vs recipe); set {} to train "
                              "the {} model as it was, or keep {} to extend the context on purpose",
                              path.string(), listed(rope), fixes(rope), origin,
                              rope.size() == 1 ? "this value" : "these values"));
    if (!routing.empty())
      warn(field, fmt::format("'{}' was saved with other expert routing ({}, checkpoint vs recipe); set {} to route "
                              "as the {} model did, or keep {} to change the routing on purpose",
                              path.string(), listed(routing), fixes(routing), origin,
                              routing.size() == 1 ? "this value" : "these values"));
  }
  if (diff.empty()) return;
  const char* or_else =
      load == Load::resume ? ", or resume from a checkpoint of this model, or set checkpoint.resume = '' to start fresh"
                           : "";
  err(field, fmt::format("'{}' holds another model ({}, checkpoint vs recipe); set {} to train the {} model{}",
                         path.string(), listed(diff), fixes(diff), origin, or_else));
}

}  // namespace

ValidationReport validate(const RunConfig& r, int world, const ValidateOptions& opts) {
  ValidationReport rep;
  auto err = [&](std::string_view field, std::string msg) { rep.errors.push_back(fmt::format("{}: {}", field, msg)); };
  auto warn = [&](std::string_view field, std::string msg) {
    rep.warnings.push_back(fmt::format("{}: {}", field, msg));
  };
  const ParallelSection& p = r.parallel;
  const DataSection& d = r.data;
  const OptimSection& o = r.optim;
  const TrainerSection& t = r.trainer;
  const CheckpointSection& ck = r.checkpoint;

  // ---- sizes: nothing else is meaningful until these are positive
  for (const auto& [name, v] : std::initializer_list<std::pair<const char*, int64_t>>{
           {"resources.num_nodes", r.resources.num_nodes},
           {"resources.num_gpus_per_node", r.resources.num_gpus_per_node},
           {"parallel.tensor_model_parallel_size", p.tensor_model_parallel_size},
           {"parallel.pipeline_model_parallel_size", p.pipeline_model_parallel_size},
           {"parallel.virtual_pipeline_model_parallel_size", p.virtual_pipeline_model_parallel_size},
           {"parallel.context_parallel_size", p.context_parallel_size},
           {"parallel.expert_model_parallel_size", p.expert_model_parallel_size},
           {"data.seq_length", d.seq_length},
           {"data.micro_batch_size", d.micro_batch_size},
           {"data.global_batch_size", d.global_batch_size},
           {"data.prefetch", d.prefetch},
           {"trainer.max_steps", t.max_steps},
           {"trainer.log_interval", t.log_interval}}) {
    if (v < 1) err(name, fmt::format("must be a positive integer, got {}", v));
  }
  if (world < 1) rep.errors.push_back(fmt::format("world size {} must be at least 1", world));
  if (!rep.errors.empty()) return rep;

  // ---- layout
  const int tp = p.tensor_model_parallel_size, pp = p.pipeline_model_parallel_size,
            vp = p.virtual_pipeline_model_parallel_size, cp = p.context_parallel_size;
  const int mp = tp * pp * cp;
  int dp = 0;
  if (world % mp)
    err("parallel", fmt::format("world size {} (resources: {} node(s) × {}) is not divisible by TP×PP×CP = {}×{}×{} = "
                                "{}; change the parallel sizes or the GPU count so that TP×PP×CP divides {}",
                                world, r.resources.num_nodes, r.resources.num_gpus_per_node, tp, pp, cp, mp, world));
  else
    dp = world / mp;
  if (cp > 1) {
    // The ring cuts every sequence into 2·CP chunks (causal load balancing); with SP each rank's part is then
    // split over TP.
    const int64_t unit = int64_t(2) * cp * (p.sequence_parallel ? tp : 1);
    if (d.seq_length % unit)
      err("data.seq_length",
          fmt::format("{} is not divisible by 2·CP{} = {} (context parallelism cuts each sequence into 2·CP = {} "
                      "chunks{}); use a multiple of {}",
                      d.seq_length, p.sequence_parallel ? "·TP" : "", unit, 2 * cp,
                      p.sequence_parallel ? ", then sequence parallelism splits each rank's part over TP" : "", unit));
    if (!d.sft_path.empty() && d.sft_pack && p.cp_comm_type == "all_gather")
      err("parallel.cp_comm_type",
          fmt::format("packed SFT rows with context parallelism (CP = {}) need the p2p ring; set cp_comm_type = p2p "
                      "(or data.sft_pack = false)", cp));
  }
  const int ep = p.expert_model_parallel_size, etp = p.expert_tensor_parallel_size;
  if (etp < 0)
    err("parallel.expert_tensor_parallel_size",
        fmt::format("must be a positive integer, or 0 for the TP size, got {}", etp));
  else if (dp > 0 && r.model.num_moe_experts > 0) {
    // The expert layout carves EP (times expert-TP) out of the ranks of one pipeline stage, as Megatron-Core does.
    if ((etp == 0 || etp == tp) && (int64_t(dp) * cp) % ep)
      err("parallel.expert_model_parallel_size",
          fmt::format("EP = {} does not divide DP×CP = {}×{} = {} (experts are spread over the data- and "
                      "context-parallel ranks); set ep to a divisor of {}, or change the GPU count",
                      ep, dp, cp, dp * cp, dp * cp));
    else if (etp > 0 && etp != tp && (world / pp) % (int64_t(etp) * ep))
      err("parallel.expert_tensor_parallel_size",
          fmt::format("expert-TP×EP = {}×{} = {} does not divide the {} ranks of a pipeline stage; choose etp and ep "
                      "whose product divides {}",
                      etp, ep, etp * ep, world / pp, world / pp));
  }
  if (p.tp_comm_stream_priority > 0)
    err("parallel.tp_comm_stream_priority",
        fmt::format("is {}; CUDA stream priorities are 0 (normal) or negative (higher); use 0 or a negative value",
                    p.tp_comm_stream_priority));
  if (p.tp_comm_overlap_forward && !p.sequence_parallel)
    err("parallel.tp_comm_overlap_forward",
        "overlaps the sequence-parallel all-gathers and reduce-scatters of the forward, so it needs "
        "parallel.sequence_parallel = true (and TP > 1); set sequence_parallel or turn tp_comm_overlap_forward off");
  if (p.sequence_parallel && tp == 1)
    err("parallel.sequence_parallel", "needs tensor_model_parallel_size > 1 (it splits the sequence over the TP "
                                      "group); set sequence_parallel = false or raise TP");
  if (p.sequence_parallel && d.seq_length % tp)
    err("data.seq_length", fmt::format("{} is not divisible by TP = {}, which sequence parallelism needs; use a "
                                       "multiple of {}",
                                       d.seq_length, tp, tp));
  // Without SP each TP rank of a MoE layer routes its share of a micro-batch's tokens (layers/moe.hpp).
  if (r.model.num_moe_experts > 0 && tp > 1 && !p.sequence_parallel && cp > 0 && d.micro_batch_size > 0 &&
      (d.seq_length / cp * d.micro_batch_size) % tp)
    err("data.seq_length",
        fmt::format("{} tokens per micro-batch on each CP rank (seq_length / CP × micro_batch_size = {} / {} × {}) do "
                    "not split evenly over TP = {}, and each TP rank of a MoE layer routes its share of them; use a "
                    "seq_length or micro_batch_size that makes it a multiple of {}",
                    d.seq_length / cp * d.micro_batch_size, d.seq_length, cp, d.micro_batch_size, tp, tp));
  if (p.use_distributed_optimizer && o.optimizer != "adamw")
    err("parallel.use_distributed_optimizer",
        "ZeRO-1 shards AdamW state; set optim.optimizer = adamw or turn use_distributed_optimizer off");
  if (p.overlap_param_gather && !p.use_distributed_optimizer)
    err("parallel.overlap_param_gather", "needs parallel.use_distributed_optimizer (ZeRO-1): only then are the "
                                         "parameters all-gathered after the step; set zero=true or "
                                         "overlap_param_gather=false");
  if (vp > 1 && pp < 2)
    err("parallel.virtual_pipeline_model_parallel_size", "interleaving needs pipeline_model_parallel_size >= 2");
  if (dp > 0 && rep.errors.empty()) {
    try {
      parallel::GridLayout::validate(r.grid_config(), world);
    } catch (const ConfigError& e) {
      err("parallel", e.what());
    }
  }

  // ---- batch
  if (dp) {
    if (d.global_batch_size % (d.micro_batch_size * dp)) {
      err("data.global_batch_size",
          fmt::format("{} is not divisible by micro_batch_size × DP = {} × {}; use a multiple of {} (DP = world / "
                      "(TP×PP×CP))",
                      d.global_batch_size, d.micro_batch_size, dp, d.micro_batch_size * dp));
    } else {
      const int64_t m = d.global_batch_size / (d.micro_batch_size * dp);
      if (vp > 1 && m % pp)
        err("data.global_batch_size",
            fmt::format("interleaved 1F1B needs the number of micro-batches ({}) to be a multiple of PP = {}; use a "
                        "global batch that is a multiple of {}",
                        m, pp, d.micro_batch_size * dp * pp));
      else if (pp > 1 && m < pp)
        rep.warnings.push_back(fmt::format("only {} micro-batches for PP = {}: the pipeline bubble is {:.0f}%; raise "
                                           "data.global_batch_size",
                                           m, pp, 100.0 * (pp - 1) / double(m + pp - 1)));
    }
  }

  // ---- model and layout
  const ModelSection& mc = r.model;
  // Costs: -1 = derived from the model (pipeline_stage_costs), else explicit layers >= 0.
  bool costs_ok = true;
  for (const auto& [k, v] : {std::pair{"parallel.pipeline_embedding_cost", p.pipeline_embedding_cost},
                             std::pair{"parallel.pipeline_head_cost", p.pipeline_head_cost}})
    if (!(v >= 0 || v == pipeline::kAutoStageCost) || std::isinf(v)) {
      err(k, fmt::format("must be a finite number of layers >= 0, or -1 to derive it from the model's shape, got {}",
                         v));
      costs_ok = false;
    }
  const bool explicit_costs = p.pipeline_embedding_cost > 0 || p.pipeline_head_cost > 0;
  if (mc.num_layers >= 1) {
    if (!p.pipeline_layout.empty()) {
      const auto& lay = p.pipeline_layout;
      int64_t sum = 0;
      bool negative = false;
      for (int64_t x : lay) {
        sum += x;
        negative |= x < 0;
      }
      if (explicit_costs)
        err("parallel.pipeline_layout", "is given together with pipeline_embedding_cost/pipeline_head_cost; give "
                                        "explicit counts or the costs to balance for, not both");
      else if (int64_t(lay.size()) != int64_t(pp) * vp)
        err("parallel.pipeline_layout", fmt::format("has {} entries but PP×VP = {} stages; give one layer count per "
                                                    "(virtual) stage",
                                                    lay.size(), pp * vp));
      else if (negative)
        err("parallel.pipeline_layout", "entries must be non-negative integers");
      else if (sum != mc.num_layers)
        err("parallel.pipeline_layout", fmt::format("sums to {} layers but the model has {}; every layer must be "
                                                    "placed exactly once (fix the counts or model.num_layers)",
                                                    sum, mc.num_layers));
    } else if (costs_ok && int64_t(pp) * vp > 1 && mc.num_layers % (int64_t(pp) * vp)) {
      // The costs decide between the balanced split (any layer count) and the even one (divisible only). A model
      // the cost formula cannot read is reported by the model checks below.
      pipeline::StageCosts c{};
      bool known = true;
      try {
        c = r.pipeline_stage_costs();
      } catch (const Error&) {
        known = false;
      }
      if (known && c.embedding == 0 && c.head == 0)
        err("model.num_layers", fmt::format("{} layers cannot be split evenly over PP×VP = {}×{} stages; choose PP and "
                                            "VP whose product divides {}, give parallel.pipeline_layout, or set "
                                            "parallel.pipeline_head_cost to -1 (derived) or a cost in layers to have "
                                            "the split balanced",
                                            mc.num_layers, pp, vp, mc.num_layers));
    }
  }
  if (d.seq_length > mc.max_position_embeddings)
    err("data.seq_length", fmt::format("{} exceeds model.max_position_embeddings {}; shorten the sequences or raise "
                                       "max_position_embeddings",
                                       d.seq_length, mc.max_position_embeddings));
  for (const std::string& e : model::validation_errors(r.transformer_config(false), tp, p.expert_model_parallel_size,
                                                       std::max(p.expert_tensor_parallel_size, 0)))
    err("model", e);
  if (t.recompute_num_layers != -1) {
    if (t.recompute != model::RecomputeGranularity::Full)
      err("trainer.recompute_num_layers",
          fmt::format("{} limits full recompute to the first layers of each model chunk, but trainer.recompute is "
                      "{}; set trainer.recompute = full, or recompute_num_layers = -1",
                      t.recompute_num_layers, model::recompute_granularity_name(t.recompute)));
    else if (t.recompute_num_layers < 0)
      err("trainer.recompute_num_layers",
          fmt::format("must be >= 0 (or -1 = every layer), got {}", t.recompute_num_layers));
    else if (mc.num_layers >= 1) {
      // N counts in each model chunk (pipeline stage, or virtual stage): at most the largest chunk's layers.
      int64_t most = 0;
      try {
        const pipeline::PipelineLayout lay =
            pipeline::choose_layout(mc.num_layers, pp, vp, p.pipeline_layout, r.pipeline_stage_costs());
        for (int s = 0; s < pp; ++s)
          for (int c = 0; c < vp; ++c) most = std::max<int64_t>(most, int64_t(lay.layer_indices(s, c).size()));
      } catch (const Error&) {
        most = -1;  // the layout itself is reported above
      }
      if (most >= 0 && t.recompute_num_layers > most)
        err("trainer.recompute_num_layers",
            fmt::format("{} exceeds the {} layers of the largest model chunk (PP×VP = {}×{} chunks of the {} layers); "
                        "give at most {}, or -1 to recompute every layer",
                        t.recompute_num_layers, most, pp, vp, mc.num_layers, most));
    }
  }
  // A blend alternates weights and prefixes: [0.3, "data/a", 0.7, "data/b"]; a plain list has no weights.
  const bool weighted = std::any_of(d.paths.begin(), d.paths.end(),
                                    [](const auto& e) { return std::holds_alternative<double>(e); });
  if (weighted) {
    bool shape = d.paths.size() % 2 == 0;
    for (size_t i = 0; shape && i < d.paths.size(); i += 2)
      shape = std::holds_alternative<double>(d.paths[i]) && std::holds_alternative<std::string>(d.paths[i + 1]) &&
              std::get<double>(d.paths[i]) > 0;
    if (!shape)
      err("data.paths", "a weighted blend alternates positive weights and prefixes: [0.3, \"data/a\", 0.7, \"data/b\"]");
  }
  if (d.tokenizer == "byte" && mc.vocab_size < 259)
    err("model.vocab_size",
        fmt::format("{} is smaller than the byte tokenizer's 259 ids; set vocab_size >= 259", mc.vocab_size));

  // ---- optimizer and schedule
  if (!(o.lr > 0)) err("optim.lr", fmt::format("must be positive, got {}", o.lr));
  if (o.min_lr < 0 || o.min_lr > o.lr) err("optim.min_lr", fmt::format("{} must be in [0, lr = {}]", o.min_lr, o.lr));
  if (!(o.lr_warmup_fraction >= 0 && o.lr_warmup_fraction < 1))
    err("optim.lr_warmup_fraction", fmt::format("{} must be in [0, 1)", o.lr_warmup_fraction));
  if (o.lr_warmup_fraction > 0 && o.lr_warmup_iters > 0)
    err("optim.lr_warmup_fraction", "is set together with lr_warmup_iters; give one of them (the other 0)");
  // With max_epochs the length is known only once the data is read: the Trainer checks the schedule then.
  const bool length_known = t.max_epochs == 0;
  if (o.lr_warmup_iters < 0 || (length_known && o.lr_warmup_iters > t.max_steps))
    err("optim.lr_warmup_iters",
        fmt::format("{} must be in [0, trainer.max_steps = {}]", o.lr_warmup_iters, t.max_steps));
  const int64_t decay = o.lr_decay_iters ? o.lr_decay_iters : t.max_steps;
  if (length_known && o.lr_decay_style != optim::LRDecayStyle::Constant && o.lr_warmup_iters > 0 &&
      decay <= o.lr_warmup_iters)
    err("optim.lr_decay_iters",
        fmt::format("the decay ends at step {} (lr_decay_iters, or trainer.max_steps when 0), not after the {} warmup "
                    "steps; raise lr_decay_iters / max_steps or shorten lr_warmup_iters",
                    decay, o.lr_warmup_iters));
  // State precision: bf16 masters replace f32 ones only where the parameters are bf16 (f32 parameters would
  // lose precision to no purpose, f16 ones lack the range to take the updates in place).
  if (o.main_params_dtype == "bf16" && t.precision != "bf16" && t.precision != "auto")
    err("optim.main_params_dtype",
        fmt::format("bf16 (no f32 master weights) needs bf16 parameters, but trainer.precision is {}; set "
                    "trainer.precision = bf16, or keep main_params_dtype = f32",
                    t.precision));
  if (o.main_grads_dtype == "bf16" && t.precision != "bf16" && t.precision != "auto")
    err("optim.main_grads_dtype",
        fmt::format("bf16 main gradients need bf16 parameters, but trainer.precision is {}; set trainer.precision = "
                    "bf16, or keep main_grads_dtype = f32",
                    t.precision));
  if (o.optimizer != "adamw")
    for (const auto& [name, v] : {std::pair<const char*, const std::string&>{"optim.main_params_dtype", o.main_params_dtype},
                                  {"optim.exp_avg_dtype", o.exp_avg_dtype},
                                  {"optim.exp_avg_sq_dtype", o.exp_avg_sq_dtype}})
      if (v != "f32")
        err(name, fmt::format("is {}, but only AdamW keeps its state in bf16; set optim.optimizer = adamw or {} = f32",
                              v, name));
  if (o.clip_grad < 0) err("optim.clip_grad", fmt::format("must be >= 0 (0 disables clipping), got {}", o.clip_grad));
  if (o.lr_wsd_decay_iters < 0 || o.lr_decay_iters < 0)
    err("optim", "lr_decay_iters and lr_wsd_decay_iters must be >= 0");
  if (rep.errors.empty() && length_known) {
    try {
      optim::validate(r.lr_schedule());
    } catch (const ConfigError& e) {
      err("optim", e.what());
    }
  }

  // ---- trainer and checkpoints
  if (t.max_epochs < 0) err("trainer.max_epochs", "must be >= 0 (0 = the run is max_steps long)");
  if (t.max_epochs > 0 && d.sft_path.empty())
    err("trainer.max_epochs", "counts passes over SFT rows (data.sft_path); pretraining runs are max_steps long "
                              "(their datasets are built for max_steps x global_batch_size samples): set it to 0");
  if (t.stop_after_steps < 0) err("trainer.stop_after_steps", "must be >= 0 (0 = run to max_steps)");
  if (t.val_check_interval < 0) err("trainer.val_check_interval", "must be >= 0 (0 = never)");
  if (t.val_check_interval > 0 && t.limit_val_batches < 1)
    err("trainer.limit_val_batches", "must be >= 1 when validating (trainer.val_check_interval > 0)");
  if (t.generate_tokens < 0) err("trainer.generate_tokens", "must be >= 0");
  if (!(t.comm_timeout_s > 0)) err("trainer.comm_timeout_s", "must be a positive number of seconds");
  if (t.max_restarts < 0) err("trainer.max_restarts", "must be >= 0 (0 = a failure ends the job)");
  if (t.on_nonfinite != "skip" && t.on_nonfinite != "stop")
    err("trainer.on_nonfinite", fmt::format("'{}' is not skip or stop", t.on_nonfinite));
  if (t.fp8 != "none" && t.fp8 != "delayed" && t.fp8 != "current")
    err("trainer.fp8", fmt::format("'{}' is not none, delayed or current", t.fp8));
  if (t.fp8 != "none") {
    if (t.precision != "bf16" && t.precision != "auto")
      err("trainer.precision", fmt::format("is {}; FP8 training (trainer.fp8 = {}) keeps bf16 parameters and "
                                           "activations: set trainer.precision = bf16", t.precision, t.fp8));
    if (t.device == "cpu" && !t.fp8_emulation)
      err("trainer.fp8", "FP8 on CPU ranks runs only as an emulation (tests and debugging): set "
                         "trainer.fp8_emulation = true, or train on GPUs of compute capability 8.9+");
    if (t.fp8_amax_history_len < 1) err("trainer.fp8_amax_history_len", "must be >= 1 (1024)");
    if (t.fp8_amax_compute_algo != "max" && t.fp8_amax_compute_algo != "most_recent")
      err("trainer.fp8_amax_compute_algo", fmt::format("'{}' is not max or most_recent", t.fp8_amax_compute_algo));
    if (t.fp8_margin < 0 || t.fp8_margin > 32) err("trainer.fp8_margin", "must be in 0..32 (0)");
    if (t.fp8_format != "hybrid" && t.fp8_format != "e4m3")
      err("trainer.fp8_format", fmt::format("'{}' is not hybrid or e4m3", t.fp8_format));
    if (t.fp8_bf16_layers < 0 || 2 * t.fp8_bf16_layers >= r.model.num_layers)
      err("trainer.fp8_bf16_layers", fmt::format("is {}; it must be >= 0 and leave layers in FP8 (2 x {} < "
                                                 "num_layers {})", t.fp8_bf16_layers, t.fp8_bf16_layers,
                                                 r.model.num_layers));
    if (r.peft.scheme == "lora")
      err("trainer.fp8", "LoRA runs keep their adapted layers in bf16; set trainer.fp8 = none for peft.scheme = lora");
  }
  if (t.fp8_param_gather) {
    if (t.fp8 == "none")
      err("trainer.fp8_param_gather", "gathers FP8 weights, but trainer.fp8 = none: set trainer.fp8 = delayed or "
                                      "current, or fp8_param_gather = false");
    if (!r.parallel.use_distributed_optimizer)
      err("trainer.fp8_param_gather", "replaces ZeRO-1's parameter all-gather, but parallel.use_distributed_optimizer "
                                      "is false (every rank updates all weights itself): set it to true, or "
                                      "fp8_param_gather = false");
    if (r.optim.main_params_dtype != "f32")
      err("trainer.fp8_param_gather", fmt::format("needs f32 master weights (the bf16 weights are rewritten from the "
                                                  "gathered FP8 codes), but optim.main_params_dtype = {}: set it to "
                                                  "f32", r.optim.main_params_dtype));
  }
  if (!(t.loss_spike_factor == 0 || t.loss_spike_factor > 1))
    err("trainer.loss_spike_factor", "must be 0 (off) or a factor above 1, e.g. 3");
  if (!(t.straggler_factor == 0 || t.straggler_factor > 1))
    err("trainer.straggler_factor", "must be 0 (off) or a factor above 1, e.g. 1.5");
  for (const auto& [name, v] : {std::pair{"startup_timeout_s", t.startup_timeout_s},
                                {"first_step_timeout_s", t.first_step_timeout_s},
                                {"step_timeout_s", t.step_timeout_s}, {"save_timeout_s", t.save_timeout_s}})
    if (!(v >= 0)) err(fmt::format("trainer.{}", name), "must be 0 (not watched) or a positive number of seconds");
  if (r.logging.metrics_port < 0 || r.logging.metrics_port > 65535)
    err("logging.metrics_port", "must be a TCP port in 1..65535, or 0 for no metrics endpoint");
  if (r.logging.metrics_port > 0 && r.logging.metrics_host.empty())
    err("logging.metrics_host", "is empty; give an address to bind (127.0.0.1: this machine only, 0.0.0.0: any)");
  if (ck.save_interval < 0 || ck.keep_last < 0 || ck.keep_top_k < 0)
    err("checkpoint", "save_interval, keep_last and keep_top_k must be >= 0");
  if (ck.keep_top_k && !t.val_check_interval)
    err("checkpoint.keep_top_k", "ranks checkpoints by validation loss; set trainer.val_check_interval > 0");
  if (r.peft.scheme == "lora") {
    for (const std::string& e : model::lora_problems(r.peft.lora(r.model.seed), r.model))
      rep.errors.push_back(e);
    if (ck.pretrained_checkpoint.empty())
      err("checkpoint.pretrained_checkpoint",
          "is empty but peft.scheme = lora trains adapters on a frozen base model; give the base checkpoint "
          "(`megacore convert hf-to-megacore` makes one from a Hugging Face model)");
  } else if (r.peft.scheme != "none") {
    err("peft.scheme", fmt::format("'{}' is not none or lora", r.peft.scheme));
  }

  if (opts.check_paths) {
    check_files(r, err);
    if ((ck.save_interval || ck.save_last) && ck.save_dir.empty())
      rep.warnings.push_back("checkpoint.save_dir is empty: no checkpoint will be written");
    if (!ck.pretrained_checkpoint.empty()) {
      if (!fs::exists(ck.pretrained_checkpoint))
        err("checkpoint.pretrained_checkpoint",
            fmt::format("'{}' does not exist; give a megacore checkpoint (a step_<N> directory or a root with "
                        "'latest'; `megacore convert hf-to-megacore` makes one from a Hugging Face model)",
                        ck.pretrained_checkpoint));
      else
        check_resume(r, ck.pretrained_checkpoint, Load::fine_tune, err, warn);
    }
    if (ck.resume != "" && ck.resume != "auto") {
      check_resume(r, ck.resume, Load::resume, err, warn);
    } else if (ck.resume == "auto" && !ck.save_dir.empty() && fs::is_directory(ck.save_dir)) {
      check_resume(r, ck.save_dir, Load::resume, err, warn, /*auto_resume=*/true);
    }
  }
  return rep;
}

std::vector<std::string> check(const RunConfig& cfg, int world_size, const ValidateOptions& opts) {
  ValidationReport rep = validate(cfg, world_size, opts);
  if (!rep.errors.empty()) throw ConfigError("invalid recipe:\n  " + join(rep.errors, "\n  "));
  return rep.warnings;
}

}  // namespace megacore::train
