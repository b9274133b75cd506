"""The GPT/Llama decoder: ``TransformerConfig`` (validated as a whole, ``megacore.ConfigError`` naming
each fix), ready-made presets, parameter/FLOP counts and ``GPTModel`` with explicit forward/backward.

``GPTModel(cfg, tp_comm, device="cpu")``: ``forward(tokens, labels, loss_mask=None)`` returns the mean
loss as a float (tokens and labels as megacore tensors, numpy arrays or any DLPack tensor);
``logits()``, ``backward()``, ``zero_grad()`` and ``parameters()`` -> ``{name: (data, main_grad)}``.
"""

from ._C import model as _m

TransformerConfig = _m.TransformerConfig
RopeScaling = _m.RopeScaling
NormType = _m.NormType
ActivationType = _m.ActivationType
PositionEmbeddingType = _m.PositionEmbeddingType
RecomputeGranularity = _m.RecomputeGranularity
RopeScalingType = _m.RopeScalingType
GPTModel = _m.GPTModel
validate = _m.validate
padded_vocab_size = _m.padded_vocab_size
parameter_count = _m.parameter_count
flops_per_token = _m.flops_per_token
activation_bytes_per_layer = _m.activation_bytes_per_layer
moe_activation_bytes_per_layer = _m.moe_activation_bytes_per_layer
presets = _m.presets
tiny_llama = _m.tiny_llama
tiny_gpt2 = _m.tiny_gpt2
llama32_1b = _m.llama32_1b
llama3_8b = _m.llama3_8b
gpt2_124m = _m.gpt2_124m
mixtral_8x7b = _m.mixtral_8x7b

__all__ = [
    "TransformerConfig", "RopeScaling", "NormType", "ActivationType", "PositionEmbeddingType",
    "RecomputeGranularity", "RopeScalingType", "GPTModel", "validate", "padded_vocab_size", "parameter_count",
    "flops_per_token", "activation_bytes_per_layer", "moe_activation_bytes_per_layer", "presets", "tiny_llama", "tiny_gpt2", "llama32_1b", "llama3_8b", "gpt2_124m", "mixtral_8x7b",
]
