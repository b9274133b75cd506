"""The recipe object: nested dataclasses describing one training run, validated as a whole before launch.

A recipe is plain data. Users edit its fields in Python (``recipe.parallel.tensor_model_parallel_size = 2``)
or from the command line (``--set parallel.tp=2``), ``validate()`` checks every constraint that would
otherwise surface mid-run (world size, batch divisibility, layer layout, data files, checkpoint model,
memory), and ``to_json``/``to_yaml``/``from_dict`` round-trip it so a run can be reproduced from the
config it saved. Field names follow NeMo 2.0 / Megatron-Core where one exists.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import typing
from dataclasses import dataclass, field

from ..errors import ConfigError

# --------------------------------------------------------------------------------------------------------
# Sections


@dataclass
class ModelConfig:
    """Mirror of the C++ ``TransformerConfig`` (same field names), plus the preset it started from."""

    name: str = "tiny_llama"
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 256
    kv_channels: int = 0
    vocab_size: int = 259
    max_position_embeddings: int = 256
    make_vocab_size_divisible_by: int = 128
    normalization: str = "RMSNorm"
    norm_eps: float = 1e-5
    activation: str = "SwiGLU"
    add_bias_linear: bool = False
    tie_word_embeddings: bool = False
    position_embedding: str = "RoPE"
    rope_theta: float = 10000.0
    rope_scaling: str = "none"  # "none" or "llama3"
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    init_method_std: float = 0.02
    seed: int = 1234

    @classmethod
    def from_preset(cls, preset: str, **overrides) -> "ModelConfig":
        """A ModelConfig with the fields of a C++ preset (``tiny_llama``, ``llama32_1b``, ...)."""
        from .. import model as m

        fn = getattr(m, preset, None)
        if preset not in m.presets.__dict__ and fn is None:
            raise ConfigError(f"unknown model preset '{preset}'; use one of tiny_llama, tiny_gpt2, llama32_1b, "
                              "llama3_8b, gpt2_124m")
        c = fn()
        rs = c.rope_scaling
        mc = cls(name=preset, num_layers=c.num_layers, hidden_size=c.hidden_size,
                 num_attention_heads=c.num_attention_heads, num_query_groups=c.num_query_groups,
                 ffn_hidden_size=c.ffn_hidden_size, kv_channels=c.kv_channels, vocab_size=c.vocab_size,
                 max_position_embeddings=c.max_position_embeddings,
                 make_vocab_size_divisible_by=c.make_vocab_size_divisible_by,
                 normalization=c.normalization.name, norm_eps=c.norm_eps,
                 activation=c.activation.name, add_bias_linear=c.add_bias_linear,
                 tie_word_embeddings=c.tie_word_embeddings,
                 position_embedding=c.position_embedding.name, rope_theta=c.rope_theta,
                 rope_scaling=rs.type.name.lower(),
                 rope_scaling_factor=rs.factor, rope_low_freq_factor=rs.low_freq_factor,
                 rope_high_freq_factor=rs.high_freq_factor,
                 rope_original_max_position_embeddings=rs.original_max_position_embeddings,
                 init_method_std=c.init_method_std, seed=c.seed)
        for k, v in overrides.items():
            setattr(mc, k, v)
        return mc

    def to_transformer_config(self, params_dtype: str = "f32", sequence_parallel: bool = False,
                              recompute: str = "none"):
        """The C++ ``megacore.model.TransformerConfig`` for this model."""
        from .. import model as m

        c = m.TransformerConfig()
        for f in dataclasses.fields(self):
            if f.name in ("name",) or f.name.startswith("rope_scaling") or f.name.startswith("rope_") and \
                    f.name != "rope_theta":
                continue
            setattr(c, f.name, getattr(self, f.name))
        rs = m.RopeScaling()
        rs.type = "Llama3" if self.rope_scaling.lower() == "llama3" else "None"
        rs.factor = self.rope_scaling_factor
        rs.low_freq_factor = self.rope_low_freq_factor
        rs.high_freq_factor = self.rope_high_freq_factor
        rs.original_max_position_embeddings = self.rope_original_max_position_embeddings
        c.rope_scaling = rs
        c.params_dtype = params_dtype
        c.sequence_parallel = sequence_parallel
        c.recompute_granularity = recompute
        return c


@dataclass
class ParallelConfig:
    """Parallel layout. DP is what the world size leaves: world = TP × PP × CP × DP."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    sequence_parallel: bool = False
    #: Explicit layers per (virtual) pipeline stage in model order, e.g. [5, 6, 6, 5]; empty = even split.
    pipeline_layout: list = field(default_factory=list)
    #: Extra work of the first stage (embedding) and of the last stage (final norm, output layer, loss), in
    #: transformer layers. When either is > 0 (and pipeline_layout is empty) the layers are split to even
    #: out the stages (PipelineLayout.balanced), like Megatron's account-for-embedding/loss options; the
    #: pipeline benchmark measures them (`megacore_bench_pipeline --layout balanced`).
    pipeline_embedding_cost: float = 0.0
    pipeline_head_cost: float = 0.0
    #: ZeRO-1: shard optimizer state over DP.
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = True
    #: ZeRO-1: the parameter all-gathers after a step overlap the next forward (each layer waits for its own).
    overlap_param_gather: bool = False
    #: Gradient buffer bucket size in elements; 0 = Megatron-Core's max(40M, 1M × DP).
    bucket_size: int = 0
    #: Reduce gradients in bf16 instead of f32.
    grad_reduce_in_bf16: bool = False
    #: Overlap the column-parallel layers' backward TP collective with their weight-gradient GEMM (off until
    #: validated on GPUs; bit-identical on CPU ranks).
    tp_comm_overlap: bool = False


@dataclass
class DataConfig:
    """Pretraining data: ``paths`` is a prefix, a list of prefixes or a weighted blend
    ``[0.3, "data/a", 0.7, "data/b"]``; ``["embedded"]`` is the built-in corpus (no files needed)."""

    paths: list = field(default_factory=lambda: ["embedded"])
    tokenizer: str = "byte"
    seq_length: int = 128
    micro_batch_size: int = 4
    global_batch_size: int = 16
    split: str = "969,30,1"
    seed: int = 1234
    cache_dir: str = ""
    #: Documents of the embedded corpus.
    embedded_documents: int = 4000
    #: Micro-batches the data loader prepares ahead of the step (>= 1).
    prefetch: int = 4
    #: SFT: a JSONL file (``input``/``output`` or chat ``messages``); when set, paths is ignored.
    sft_path: str = ""
    sft_pack: bool = True


@dataclass
class OptimizerConfig:
    optimizer: str = "adamw"  # adamw | sgd
    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    #: Global gradient-norm clipping; 0 disables.
    clip_grad: float = 1.0
    lr_warmup_iters: int = 0
    lr_decay_style: str = "cosine"  # constant | linear | cosine | wsd
    #: Steps over which the LR decays; 0 = trainer.max_steps.
    lr_decay_iters: int = 0
    #: WSD: length of the final decay phase (steps).
    lr_wsd_decay_iters: int = 0
    #: f16 only: dynamic loss scaling (the initial scale).
    initial_loss_scale: float = 65536.0
    #: Skip the step (and report it) when a gradient is NaN or Inf.
    skip_nonfinite_steps: bool = True


@dataclass
class TrainerConfig:
    max_steps: int = 100
    #: End this run after this many steps (0 = run to max_steps); the LR schedule and the data order still follow
    #: max_steps, so a later run resumes exactly where this one stopped (time-limited jobs).
    stop_after_steps: int = 0
    #: Validate every N steps (0 = never).
    val_check_interval: int = 0
    limit_val_batches: int = 4
    log_interval: int = 1
    #: Parameter/activation precision: bf16 | f16 | f32 (f32 master weights and grads always).
    precision: str = "f32"
    #: auto (GPUs when present) | cpu | cuda
    device: str = "auto"
    recompute: str = "none"  # none | selective | full
    seed: int = 1234
    #: Peak dense bf16 TFLOP/s per GPU for MFU; 0 = the card's known figure.
    peak_tflops: float = 0.0
    #: After training, rank 0 greedily generates this many tokens from `generate_prompt` (0 = no sample).
    generate_tokens: int = 0
    generate_prompt: str = ""
    #: Seconds a collective may hang before the run fails with CommError.
    comm_timeout_s: float = 300.0


@dataclass
class CheckpointConfig:
    save_dir: str = ""
    save_interval: int = 0
    #: Keep the newest k checkpoints (0 = all).
    keep_last: int = 2
    #: Also keep the k best by validation loss (0 = off).
    keep_top_k: int = 0
    #: "" (start fresh), "auto" (resume from save_dir/latest when there is one) or a checkpoint path.
    resume: str = "auto"
    async_save: bool = False
    #: Save at the end of training.
    save_last: bool = True


@dataclass
class LoggingConfig:
    log_dir: str = ""
    jsonl: bool = True
    tensorboard: bool = True
    #: auto (only on a TTY) | on | off
    progress_bar: str = "auto"


@dataclass
class Resources:
    num_nodes: int = 1
    num_gpus_per_node: int = 1

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_gpus_per_node


@dataclass
class Recipe:
    name: str = "custom"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    resources: Resources = field(default_factory=Resources)

    # ---- serialisation ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self, path: str | None = None) -> str:
        s = json.dumps(self.to_dict(), indent=2)
        if path:
            _write_atomic(path, s + "\n")
        return s

    def to_yaml(self, path: str | None = None) -> str:
        yaml = _yaml()
        s = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path:
            _write_atomic(path, s)
        return s

    @classmethod
    def from_dict(cls, d: dict) -> "Recipe":
        return _from_dict(cls, d, "recipe")

    @classmethod
    def from_file(cls, path: str) -> "Recipe":
        """A recipe saved with to_json / to_yaml (by extension: .yaml/.yml, else JSON)."""
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"cannot read recipe file '{path}': {e.strerror}; pass the path of a saved "
                              "recipe (config.json / config.yaml)") from None
        try:
            d = _yaml().safe_load(text) if path.endswith((".yaml", ".yml")) else json.loads(text)
        except Exception as e:  # noqa: BLE001 - any parse error becomes a ConfigError naming the file
            raise ConfigError(f"recipe file '{path}' is not valid {'YAML' if path.endswith(('yaml', 'yml')) else 'JSON'}:"
                              f" {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"recipe file '{path}' must hold a mapping of sections, got {type(d).__name__}")
        return cls.from_dict(d)

    def copy(self) -> "Recipe":
        return Recipe.from_dict(self.to_dict())

    # ---- overrides -----------------------------------------------------------------------------------
    def set(self, key: str, value) -> "Recipe":
        """Sets a dotted field (``parallel.tp``, ``optim.lr``); strings are converted to the field's type.
        Unknown sections or fields are ConfigError listing the valid names."""
        parts = key.split(".")
        if len(parts) != 2:
            raise ConfigError(f"--set key '{key}' must be section.field (e.g. parallel.tp=2); sections: "
                              f"{', '.join(_section_names())}")
        section, name = parts
        if section not in _section_names():
            raise ConfigError(f"unknown recipe section '{section}' in '{key}'; use one of "
                              f"{', '.join(_section_names())}")
        obj = getattr(self, section)
        name = ALIASES.get(section, {}).get(name, name)
        fields = {f.name: f for f in dataclasses.fields(obj)}
        if name not in fields:
            aliases = ALIASES.get(section, {})
            raise ConfigError(f"unknown field '{name}' in recipe section '{section}'; valid fields: "
                              f"{', '.join(fields)}" + (f" (aliases: {', '.join(aliases)})" if aliases else ""))
        hint = typing.get_type_hints(type(obj))[name]
        setattr(obj, name, _coerce(value, hint, f"{section}.{name}"))
        return self

    def apply_overrides(self, items) -> "Recipe":
        """``["parallel.tp=2", "optim.lr=1e-3"]`` (the CLI's --set values)."""
        for it in items or []:
            if "=" not in it:
                raise ConfigError(f"--set '{it}' must be key=value, e.g. parallel.tp=2")
            k, v = it.split("=", 1)
            self.set(k.strip(), v.strip())
        return self

    # ---- derived sizes -------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.resources.world_size

    @property
    def data_parallel_size(self) -> int:
        p = self.parallel
        mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
        return self.world_size // mp if mp > 0 and self.world_size % mp == 0 else 0

    @property
    def num_microbatches(self) -> int:
        dp = self.data_parallel_size
        d = self.data
        return d.global_batch_size // (d.micro_batch_size * dp) if dp else 0

    def validate(self, check_paths: bool = True) -> list[str]:
        """Raises ConfigError naming the first problems and their fixes; returns warnings (strings)."""
        from .validate import validate_recipe

        return validate_recipe(self, check_paths=check_paths)


# Short names accepted by set() / --set, as in Megatron's command line.
ALIASES = {
    "parallel": {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
                 "vp": "virtual_pipeline_model_parallel_size", "cp": "context_parallel_size",
                 "ep": "expert_model_parallel_size", "sp": "sequence_parallel",
                 "zero": "use_distributed_optimizer"},
    "data": {"seq": "seq_length", "mbs": "micro_batch_size", "gbs": "global_batch_size"},
    "trainer": {"steps": "max_steps"},
    "resources": {"nodes": "num_nodes", "gpus": "num_gpus_per_node", "nproc_per_node": "num_gpus_per_node"},
}


def _section_names():
    return [f.name for f in dataclasses.fields(Recipe) if f.name != "name"]


def _yaml():
    try:
        import yaml
    except ImportError:
        raise ConfigError("YAML recipes need PyYAML (pip install pyyaml); or save and load them as JSON") from None
    return yaml


def _write_atomic(path: str, text: str):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _coerce(value, hint, where: str):
    origin = typing.get_origin(hint)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(str(value), 0)
        except ValueError:
            raise ConfigError(f"{where} must be an integer, got {value!r}") from None
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        try:
            v = float(str(value))
        except ValueError:
            raise ConfigError(f"{where} must be a number, got {value!r}") from None
        if math.isnan(v):
            raise ConfigError(f"{where} must be a number, got NaN")
        return v
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return str(value)
    if hint is list or origin is list:
        if isinstance(value, str):
            s = value.strip()
            if s.startswith("["):
                try:
                    value = json.loads(s)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{where}: '{value}' is not a JSON list ({e})") from None
            else:
                value = [_number_or_str(x) for x in s.split(",") if x.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return value
    return value


def _number_or_str(x: str):
    x = x.strip()
    for t in (int, float):
        try:
            return t(x)
        except ValueError:
            pass
    return x


def _from_dict(cls, d, where):
    if not isinstance(d, dict):
        raise ConfigError(f"{where} must be a mapping, got {d!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in d if k not in names]
    if unknown:
        raise ConfigError(f"unknown field(s) {', '.join(repr(k) for k in unknown)} in {where}; valid fields: "
                          f"{', '.join(sorted(names))}")
    kwargs = {}
    for k, v in d.items():
        h = hints[k]
        if dataclasses.is_dataclass(h):
            kwargs[k] = _from_dict(h, v, f"{where}.{k}")
        else:
            kwargs[k] = _coerce(v, h, f"{where}.{k}")
    return cls(**kwargs)
