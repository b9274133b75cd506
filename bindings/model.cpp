// Python bindings of the transformer model and the tensor-parallel linear layers: megacore._C.model and
// megacore._C.layers (re-exported as megacore.model and megacore.layers).
#include <cctype>
#include <initializer_list>
#include <memory>
#include <utility>

#include <pybind11/stl.h>

#include "bindings.hpp"
#include "megacore/layers/forward_context.hpp"
#include "megacore/layers/linear.hpp"
#include "megacore/layers/parameter.hpp"
#include "megacore/model/fp8.hpp"
#include "megacore/model/gpt_model.hpp"
#include "megacore/model/memory.hpp"
#include "megacore/model/transformer_config.hpp"

namespace megacore::py {
namespace {

using namespace megacore::model;
namespace ly = megacore::layers;

std::string lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// An enum usable from Python both as a member (NormType.RMSNorm) and as a case-insensitive string.
template <typename E>
void bind_enum(pyb::module_& m, const char* name, std::initializer_list<std::pair<const char*, E>> values) {
  std::vector<std::pair<std::string, E>> table;
  for (const auto& [n, v] : values) table.emplace_back(n, v);
  pyb::enum_<E> e(m, name);
  for (const auto& [n, v] : table) e.value(n.c_str(), v);
  e.def(pyb::init([table, name](const std::string& s) {
    std::string names;
    for (const auto& [n, v] : table) {
      if (lower(n) == lower(s)) return v;
      names += (names.empty() ? "'" : ", '") + n + "'";
    }
    throw ValueError(fmt::format("unknown {} '{}'; use one of {}", name, s, names));
  }));
  pyb::implicitly_convertible<std::string, E>();
}

ly::ForwardContext context_for(Device d, bool training = true) {
  ly::ForwardContext ctx;
  ctx.stream = current_stream(d);
  ctx.training = training;
  return ctx;
}

// One Python property per reflected field of T (core/fields.hpp), named and documented as declared in C++.
// Names in `skip` are bound by hand (TransformerConfig's rope_scaling is the RopeScaling struct in Python,
// while its reflected form is the flattened recipe field).
template <class T>
void bind_fields(pyb::class_<T>& cls, std::initializer_list<std::string_view> skip = {}) {
  T probe{};
  for_each_field(probe, [&](const Field& fd, auto& member) {
    using M = std::decay_t<decltype(member)>;
    for (std::string_view s : skip)
      if (s == fd.name) return;
    const std::string name(fd.name);
    // The member of `self` named `name`, found by visiting self's fields (a property access is not hot).
    auto with = [name](auto& self, auto&& fn) {
      for_each_field(self, [&](const Field& f, auto& m) {
        if constexpr (std::is_same_v<std::decay_t<decltype(m)>, M>)
          if (f.name == name) fn(m);
      });
    };
    cls.def_property(
        name.c_str(),
        [with](const T& self) {
          M out{};
          with(self, [&](const M& m) { out = m; });
          return out;
        },
        [with](T& self, const M& v) { with(self, [&](M& m) { m = v; }); }, std::string(fd.doc).c_str());
  });
}

pyb::dict parameter_count_dict(const ParameterCount& c) {
  pyb::dict d;
  d["embedding"] = c.embedding;
  d["position_embedding"] = c.position_embedding;
  d["per_layer"] = c.per_layer;
  d["per_moe_layer"] = c.per_moe_layer;
  d["per_moe_layer_experts"] = c.per_moe_layer_experts;
  d["layers"] = c.layers;
  d["final_norm"] = c.final_norm;
  d["output_layer"] = c.output_layer;
  d["total"] = c.total;
  d["active"] = c.active;
  return d;
}

pyb::tuple param_tuple(const ly::Parameter& p) { return pyb::make_tuple(p.data, p.main_grad); }

template <typename Layer>
pyb::dict layer_params(Layer& l) {
  pyb::dict d;
  d["weight"] = param_tuple(l.weight());
  if (l.options().bias) d["bias"] = param_tuple(l.bias());
  return d;
}

void bind_config(pyb::module_& m) {
  bind_enum<NormType>(m, "NormType", {{"RMSNorm", NormType::RMSNorm}, {"LayerNorm", NormType::LayerNorm}});
  bind_enum<ActivationType>(m, "ActivationType",
                            {{"SwiGLU", ActivationType::SwiGLU}, {"GELU", ActivationType::GELU}});
  bind_enum<PositionEmbeddingType>(m, "PositionEmbeddingType",
                                   {{"RoPE", PositionEmbeddingType::RoPE}, {"Learned", PositionEmbeddingType::Learned}});
  bind_enum<RecomputeGranularity>(m, "RecomputeGranularity",
                                  {{"none", RecomputeGranularity::None},
                                   {"selective", RecomputeGranularity::Selective},
                                   {"full", RecomputeGranularity::Full}});
  bind_enum<RopeScalingType>(m, "RopeScalingType", {{"none", RopeScalingType::None}, {"llama3", RopeScalingType::Llama3}});
  bind_enum<MoERouterScore>(m, "MoERouterScore", {{"softmax", MoERouterScore::Softmax}, {"sigmoid", MoERouterScore::Sigmoid}});
  bind_enum<MoETokenDispatcher>(m, "MoETokenDispatcher",
                                {{"alltoall", MoETokenDispatcher::AllToAll}, {"allgather", MoETokenDispatcher::AllGather}});

  pyb::class_<RopeScaling>(m, "RopeScaling", "Llama-3.1-style RoPE frequency scaling.")
      .def(pyb::init<>())
      .def_readwrite("type", &RopeScaling::type)
      .def_readwrite("factor", &RopeScaling::factor)
      .def_readwrite("low_freq_factor", &RopeScaling::low_freq_factor)
      .def_readwrite("high_freq_factor", &RopeScaling::high_freq_factor)
      .def_readwrite("original_max_position_embeddings", &RopeScaling::original_max_position_embeddings);

  using C = TransformerConfig;
  pyb::class_<C> tc(m, "TransformerConfig",
                 "Shape and flavour of a GPT/Llama decoder. Zero means derived for num_query_groups, "
                 "ffn_hidden_size and kv_channels.");
  tc.def(pyb::init([](const pyb::kwargs& kw) {
             auto c = std::make_unique<C>();
             pyb::object self = pyb::cast(c.get(), pyb::return_value_policy::reference);
             for (const auto& [k, v] : kw) {
               const std::string key = k.cast<std::string>();
               if (!pyb::hasattr(self, key.c_str()) || key.rfind("_", 0) == 0)
                 throw ValueError(fmt::format("TransformerConfig has no field '{}'", key));
               pyb::setattr(self, key.c_str(), v);
             }
             return c.release();
           }),
           "TransformerConfig(**fields): every field defaults as in C++ (zero sizes).")
      .def_readwrite("rope_scaling", &C::rope_scaling)
      .def_property("params_dtype", [](const C& c) { return std::string(dtype_name(c.params_dtype)); },
                    [](C& c, const pyb::object& d) { c.params_dtype = dtype_arg(d); })
      .def_readwrite("sequence_parallel", &C::sequence_parallel)
      .def_readwrite("recompute_granularity", &C::recompute_granularity)
      .def_readwrite("tp_comm_overlap", &C::tp_comm_overlap)
      .def_readwrite("tp_comm_overlap_forward", &C::tp_comm_overlap_forward)
      .def_readwrite("tp_comm_stream_priority", &C::tp_comm_stream_priority)
      .def_property_readonly("head_dim", &C::head_dim)
      .def_property_readonly("query_groups", &C::query_groups)
      .def_property_readonly("ffn_size", &C::ffn_size)
      .def_property_readonly("attention_width", &C::attention_width)
      .def_property_readonly("qkv_width", &C::qkv_width)
      .def("copy", [](const C& c) { return C(c); })
      .def("validate", [](const C& c, int tp, int ep, int etp) { validate(c, tp, ep, etp); }, pyb::arg("tp_size") = 1,
           pyb::arg("ep_size") = 1, pyb::arg("expert_tp_size") = 0)
      .def("__repr__", [](const C& c) {
        return fmt::format("megacore.model.TransformerConfig(num_layers={}, hidden_size={}, num_attention_heads={}, "
                           "num_query_groups={}, ffn_hidden_size={}, vocab_size={}, normalization={}, activation={}, "
                           "position_embedding={}, params_dtype={})",
                           c.num_layers, c.hidden_size, c.num_attention_heads, c.num_query_groups, c.ffn_hidden_size,
                           c.vocab_size, norm_type_name(c.normalization), activation_type_name(c.activation),
                           position_embedding_type_name(c.position_embedding), dtype_name(c.params_dtype));
      });

  bind_fields(tc, {"rope_scaling"});

  m.def("validate", [](const C& c, int tp, int ep, int etp) { validate(c, tp, ep, etp); }, pyb::arg("config"),
        pyb::arg("tp_size") = 1, pyb::arg("ep_size") = 1, pyb::arg("expert_tp_size") = 0,
        "Raises megacore.ConfigError listing every inconsistency for tp_size-way TP, ep_size-way EP and "
        "expert_tp_size-way expert TP (0 = TP), each with its fix.");
  m.def("padded_vocab_size", [](const C& c, int tp) { return padded_vocab_size(c, tp); }, pyb::arg("config"),
        pyb::arg("tp_size") = 1);
  m.def("parameter_count", [](const C& c, int tp) { return parameter_count_dict(parameter_count(c, tp)); },
        pyb::arg("config"), pyb::arg("tp_size") = 0,
        "Parameters by part (dict); tp_size=0 counts the true vocabulary, >0 the padded one.");
  m.def("flops_per_token", [](const C& c, int64_t seq_len, bool causal) {
    FlopsPerToken f = flops_per_token(c, seq_len, causal);
    pyb::dict d;
    d["dense"] = f.dense;
    d["attention"] = f.attention;
    d["output_layer"] = f.output_layer;
    d["total"] = f.total;
    return d;
  }, pyb::arg("config"), pyb::arg("seq_len"), pyb::arg("causal") = false, "Training FLOPs per token (dict).");
  m.def("activation_bytes_per_layer", [](const C& c, int64_t seq_len, int64_t micro_batch, int tp, bool sp,
                                         int act_bytes, RecomputeGranularity rc) {
    ActivationEstimate e = activation_bytes_per_layer(c, seq_len, micro_batch, tp, sp, act_bytes, rc);
    pyb::dict d;
    d["replicated"] = e.replicated;
    d["sharded"] = e.sharded;
    d["total"] = e.total;
    return d;
  }, pyb::arg("config"), pyb::arg("seq_len"), pyb::arg("micro_batch"), pyb::arg("tp_size") = 1,
     pyb::arg("sequence_parallel") = false, pyb::arg("act_bytes") = 2,
     pyb::arg("recompute") = RecomputeGranularity::Selective,
     "Saved-activation bytes of one layer on one TP rank, counted tensor by tensor (Korthikanti et al.'s method "
     "for megacore's layer; include/megacore/model/memory.hpp).");
  m.def("moe_activation_bytes_per_layer", [](const C& c, int64_t seq_len, int64_t micro_batch, int tp, bool sp,
                                             int act_bytes, RecomputeGranularity rc, int etp) {
    MoEActivationEstimate e = moe_activation_bytes_per_layer(c, seq_len, micro_batch, tp, sp, act_bytes, rc, etp);
    pyb::dict d;
    d["saved"] = e.saved;
    d["dispatch"] = e.dispatch;
    return d;
  }, pyb::arg("config"), pyb::arg("seq_len"), pyb::arg("micro_batch"), pyb::arg("tp_size") = 1,
     pyb::arg("sequence_parallel") = false, pyb::arg("act_bytes") = 2,
     pyb::arg("recompute") = RecomputeGranularity::Selective, pyb::arg("expert_tp_size") = 1,
     "A MoE layer on one rank (dict): 'saved' activation bytes and the dispatcher's transient 'dispatch' bytes "
     "(include/megacore/model/memory.hpp).");

  pyb::module_ p = m.def_submodule("presets", "Ready-made configs.");
  p.def("tiny_llama", &presets::tiny_llama);
  p.def("tiny_gpt2", &presets::tiny_gpt2);
  p.def("llama32_1b", &presets::llama32_1b);
  p.def("llama3_8b", &presets::llama3_8b);
  p.def("gpt2_124m", &presets::gpt2_124m);
  p.def("mixtral_8x7b", &presets::mixtral_8x7b);
  // Also at module level: megacore.model.tiny_llama().
  m.attr("tiny_llama") = p.attr("tiny_llama");
  m.attr("tiny_gpt2") = p.attr("tiny_gpt2");
  m.attr("llama32_1b") = p.attr("llama32_1b");
  m.attr("llama3_8b") = p.attr("llama3_8b");
  m.attr("gpt2_124m") = p.attr("gpt2_124m");
  m.attr("mixtral_8x7b") = p.attr("mixtral_8x7b");
}

void bind_gpt(pyb::module_& m) {
  pyb::class_<GPTModel>(m, "GPTModel", "Decoder-only LM over one TP group, with explicit forward and backward.")
      .def(pyb::init([](const TransformerConfig& cfg, comm::Communicator& tp, const pyb::object& device,
                        float label_smoothing, comm::Communicator* cp) {
             GPTModelOptions o;
             o.device = device_arg(device);
             o.label_smoothing = label_smoothing;
             o.cp = cp;
             pyb::gil_scoped_release nogil;
             return new GPTModel(cfg, tp, o);
           }),
           pyb::arg("config"), pyb::arg("tp"), pyb::arg("device") = "cpu", pyb::arg("label_smoothing") = 0.f,
           pyb::arg("cp") = pyb::none(), pyb::keep_alive<1, 3>(), pyb::keep_alive<1, 6>(),
           "cp: the context-parallel group (grid.cp) or None; with CP > 1 tokens/labels/mask are this rank's local "
           "sequence (chunks r and 2·CP−1−r) and forward returns this rank's share of the mean loss.")
      .def("forward", [](GPTModel& g, const pyb::object& tokens, const pyb::object& labels,
                         const pyb::object& loss_mask, bool training) {
        Tensor t = tensor_arg(tokens, "tokens"), l = tensor_arg(labels, "labels");
        Tensor mask = loss_mask.is_none() ? Tensor() : tensor_arg(loss_mask, "loss_mask");
        pyb::gil_scoped_release nogil;
        ly::ForwardContext ctx = context_for(g.embedding().weight().data.device(), training);
        // Inputs go to the model's device (numpy arrays arrive on the host).
        const Device d = ctx.stream.device();
        if (t.device() != d) t = t.to(d, ctx.stream);
        if (l.device() != d) l = l.to(d, ctx.stream);
        if (mask.defined() && mask.device() != d) mask = mask.to(d, ctx.stream);
        return g.forward(ctx, t, l, mask).item();
      }, pyb::arg("tokens"), pyb::arg("labels"), pyb::arg("loss_mask") = pyb::none(), pyb::arg("training") = true,
         "tokens, labels: int [b, s] (labels -100 ignored); loss_mask: optional f32 [b, s]. Returns the mean loss.")
      .def("backward", [](GPTModel& g) {
        pyb::gil_scoped_release nogil;
        g.backward(context_for(g.embedding().weight().data.device()));
      }, "Accumulates every parameter's main_grad from the last forward's mean loss.")
      .def("logits", &GPTModel::logits, "This rank's vocabulary shard of the last logits, [b, s, padded_vocab/TP].")
      .def("zero_grad", &GPTModel::zero_grad)
      .def("parameters", [](const GPTModel& g) {
        pyb::dict d;
        for (const ly::Parameter* p : g.parameters()) d[pyb::str(p->name)] = param_tuple(*p);
        return d;
      }, "{name: (data, main_grad)} for every trainable parameter (this rank's shards).")
      .def("named_parameters", [](const GPTModel& g) {
        pyb::dict d;
        for (const ly::Parameter* p : g.parameters()) d[pyb::str(p->name)] = param_tuple(*p);
        return d;
      }, "Same as parameters().")
      .def("apply_lora", [](GPTModel& g, int64_t dim, double alpha, double dropout,
                            const std::vector<std::string>& target_modules, uint64_t seed) {
        g.apply_lora(LoRAConfig{.dim = dim, .alpha = alpha, .dropout = dropout, .target_modules = target_modules,
                                .seed = seed});
      }, pyb::arg("dim"), pyb::arg("alpha"), pyb::arg("dropout") = 0.0,
         pyb::arg("target_modules") = std::vector<std::string>{"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"},
         pyb::arg("seed") = 1234,
         "Attaches LoRA adapters (rank dim, scale alpha/dim) to the target modules and freezes the base: parameters() "
         "then lists only the adapters' lora_A/lora_B. ConfigError listing every problem of the settings.")
      .def("merge_lora", [](GPTModel& g) {
        pyb::gil_scoped_release nogil;
        g.merge_lora();
      }, "Folds every adapter into its base weight (W += alpha/r · B A) and unfreezes the model.")
      .def_property_readonly("has_lora", &GPTModel::has_lora)
      .def("enable_fp8", [](GPTModel& g, const std::string& scaling, int64_t amax_history_len,
                            const std::string& amax_compute_algo, int margin, const std::string& format,
                            int64_t bf16_layers) {
        MC_CHECK_AS(ConfigError, amax_compute_algo == "max" || amax_compute_algo == "most_recent",
                    "enable_fp8: amax_compute_algo '{}' is not max or most_recent", amax_compute_algo);
        MC_CHECK_AS(ConfigError, format == "hybrid" || format == "e4m3", "enable_fp8: format '{}' is not hybrid or e4m3",
                    format);
        ly::Fp8Recipe r;
        r.scaling = ly::fp8_scaling_from_name(scaling);
        r.amax_history_len = amax_history_len;
        r.amax_compute_algo = amax_compute_algo == "max" ? ops::Fp8AmaxAlgo::Max : ops::Fp8AmaxAlgo::MostRecent;
        r.margin = margin;
        r.grad_dtype = format == "e4m3" ? DType::F8E4M3 : DType::F8E5M2;
        return model::enable_fp8(g, r, bf16_layers);
      }, pyb::arg("scaling") = "delayed", pyb::kw_only(), pyb::arg("amax_history_len") = 1024,
         pyb::arg("amax_compute_algo") = "max", pyb::arg("margin") = 0, pyb::arg("format") = "hybrid",
         pyb::arg("bf16_layers") = 0,
         "Runs the transformer layers' linears in FP8 (docs/fp8.md); returns how many. Call fp8_begin_step() once per "
         "optimizer step, before its first forward.")
      .def("fp8_begin_step", [](GPTModel& g) { model::fp8_begin_step(g); },
           "Start of an optimizer step for FP8: drops the FP8 weight copies and, with delayed scaling, updates the "
           "scales from the last step's amaxes (reduced over TP).")
      .def("fp8_state", [](GPTModel& g) {
        pyb::dict d;
        for (auto& [name, t] : model::fp8_state(g)) d[pyb::str(name)] = t;
        return d;
      }, "{'<linear>.fp8.<amax_history|scale|scale_inv|counts>': Tensor}: the live FP8 scaling state (slots: input, "
         "weight, output gradient).")
      .def("all_parameters", [](GPTModel& g) {
        pyb::dict d;
        for (const ly::Parameter* p : g.all_parameters()) d[pyb::str(p->name)] = param_tuple(*p);
        return d;
      }, "{name: (data, main_grad)} for every parameter, frozen base weights included.")
      .def("parameter", [](const GPTModel& g, const std::string& name) { return param_tuple(g.parameter(name)); },
           pyb::arg("name"), "(data, main_grad) of one parameter; ValueError listing the names if unknown.")
      .def("partition_dims", [](const GPTModel& g) {
        pyb::dict d;
        for (const ly::Parameter* p : g.parameters()) d[pyb::str(p->name)] = p->partition_dim;
        return d;
      }, "{name: TP partition dim, -1 when replicated}.")
      .def_property_readonly("config", &GPTModel::config, pyb::return_value_policy::copy)
      .def_property_readonly("padded_vocab_size", &GPTModel::padded_vocab_size)
      .def_property_readonly("num_layers", &GPTModel::num_layers);
}

// What the two parallel linear layers share in Python: forward/backward on the tensor's current stream,
// parameters as (data, main_grad) pairs, and the feature sizes.
template <class L>
void bind_linear_methods(pyb::class_<L>& c, const char* forward_doc, const char* backward_doc, const char* weight_doc,
                         const char* bias_doc) {
  c.def("forward", [](L& l, const pyb::object& x) {
     Tensor t = tensor_arg(x, "x");
     pyb::gil_scoped_release nogil;
     return l.forward(context_for(t.device()), t);
   }, pyb::arg("x"), forward_doc)
      .def("backward", [](L& l, const pyb::object& dy) {
        Tensor t = tensor_arg(dy, "dy");
        pyb::gil_scoped_release nogil;
        return l.backward(context_for(t.device()), t);
      }, pyb::arg("dy"), backward_doc)
      .def("zero_grad", &L::zero_grad)
      .def_property_readonly("weight", [](L& l) { return param_tuple(l.weight()); }, weight_doc)
      .def_property_readonly("bias", [](L& l) -> pyb::object {
        if (!l.options().bias) return pyb::none();
        return param_tuple(l.bias());
      }, bias_doc)
      .def("parameters", [](L& l) { return layer_params(l); })
      .def_property_readonly("in_features", &L::in_features)
      .def_property_readonly("out_features", &L::out_features);
}

// The constructor both parallel linear layers share; `flag` is the one option that differs (gather_output for the
// column-parallel layer, input_is_parallel for the row-parallel one).
template <class L, class Options>
void bind_linear_init(pyb::class_<L>& c, const char* flag, bool Options::*flag_member) {
  c.def(pyb::init([flag_member](comm::Communicator& tp, int64_t in, int64_t out, bool bias, bool flag_value,
                                bool sequence_parallel, const pyb::object& dtype, const pyb::object& device,
                                double init_std, uint64_t seed, uint64_t init_offset) {
          Options o;
          o.bias = bias;
          o.*flag_member = flag_value;
          o.sequence_parallel = sequence_parallel;
          o.params_dtype = dtype_arg(dtype);
          o.device = device_arg(device);
          o.init_std = init_std;
          o.seed = seed;
          o.init_offset = init_offset;
          pyb::gil_scoped_release nogil;
          return new L(tp, in, out, o);
        }),
        pyb::arg("tp"), pyb::arg("in_features"), pyb::arg("out_features"), pyb::arg("bias") = true,
        pyb::arg(flag) = false, pyb::arg("sequence_parallel") = false, pyb::arg("params_dtype") = "f32",
        pyb::arg("device") = "cpu", pyb::arg("init_std") = 0.02, pyb::arg("seed") = 1234, pyb::arg("init_offset") = 0,
        pyb::keep_alive<1, 2>());
}

void bind_linear(pyb::module_& m) {
  pyb::class_<ly::ColumnParallelLinear> col(m, "ColumnParallelLinear", "Y = X W^T + b with W's rows split over TP.");
  bind_linear_init(col, "gather_output", &ly::ColumnParallelLinearOptions::gather_output);
  bind_linear_methods(col, "x: [..., in] (or [s/TP, ..., in] with SP) → [..., out/TP] (or [..., out] gathered).",
                      "Accumulates weight/bias main_grad and returns dx.", "(data [out/TP, in], main_grad)",
                      "(data [out/TP], main_grad), or None without bias");
  col.def_property_readonly("out_features_per_rank", &ly::ColumnParallelLinear::out_features_per_rank);

  pyb::class_<ly::RowParallelLinear> row(m, "RowParallelLinear", "Y = X W^T + b with W's columns split over TP.");
  bind_linear_init(row, "input_is_parallel", &ly::RowParallelLinearOptions::input_is_parallel);
  bind_linear_methods(row, "x: [..., in/TP] with input_is_parallel, else [..., in] → [..., out] (summed over TP).",
                      "Accumulates weight/bias main_grad and returns dx in x's layout.", "(data [out, in/TP], main_grad)",
                      "(data [out], main_grad), or None without bias");
  row.def_property_readonly("in_features_per_rank", &ly::RowParallelLinear::in_features_per_rank);
}

}  // namespace

void bind_model(pyb::module_& root) {
  pyb::module_ m = root.def_submodule("model", "TransformerConfig, presets and GPTModel.");
  bind_config(m);
  bind_gpt(m);
  pyb::module_ l = root.def_submodule("layers", "Tensor-parallel layers with explicit forward/backward.");
  bind_linear(l);
}

}  // namespace megacore::py
