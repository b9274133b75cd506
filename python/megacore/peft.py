"""Parameter-efficient fine-tuning settings (LoRA), as NeMo users write them.

``LoRA(dim, alpha, dropout, target_modules)`` fills a recipe's ``peft`` section (declared in C++,
``train::PeftSection``): the base model is frozen and only low-rank adapters on the target modules are
trained (``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj`` or ``linear_qkv linear_proj linear_fc1
linear_fc2``). The base weights come from ``checkpoint.pretrained_checkpoint``; checkpoints then hold only
the adapters and their optimizer state.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import numpy as np

from .errors import ConfigError
from .errors import IOError as IOError_

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "linear_qkv",
                  "linear_proj", "linear_fc1", "linear_fc2", "w1", "w2", "w3")


@dataclasses.dataclass
class LoRA:
    """LoRA adapters: rank ``dim``, output scale ``alpha / dim``, ``dropout`` on the adapters' input."""
    dim: int = 32
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list = dataclasses.field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])

    def apply(self, recipe) -> None:
        """Sets ``recipe.peft`` (validated with the rest of the recipe by ``recipe.validate()``)."""
        recipe.peft.scheme = "lora"
        recipe.peft.dim = int(self.dim)
        recipe.peft.alpha = float(self.alpha)
        recipe.peft.dropout = float(self.dropout)
        recipe.peft.target_modules = list(self.target_modules)


def resolve(peft) -> LoRA | None:
    """``None``/``"none"`` → None; ``"lora"`` → LoRA(); a LoRA → itself; anything else is a ConfigError."""
    if peft is None or peft == "none":
        return None
    if peft == "lora":
        return LoRA()
    if isinstance(peft, LoRA):
        return peft
    raise ConfigError(f"peft must be None, 'none', 'lora' or megacore.peft.LoRA(...), got {peft!r}")


# ----------------------------------------------------------------------------- adapters on disk
#
# An adapter is held as whole tensors under megacore's names (what a LoRA run's checkpoints store, TP shards
# already assembled by the checkpoint reader): "layers.<i>.self_attention.linear_qkv.q_proj.lora_A.weight"
# [r, in] and "...lora_B.weight" [out, r]. Their rows are in Hugging Face order: a q/k/v segment's B rows are
# the rows of HF's q_proj/k_proj/v_proj (megacore's RoPE rotates halves as HF Llama does, so q/k need no
# permutation, exactly as for the base weights in megacore.convert), and gate/up B rows are those of
# gate_proj/up_proj. PEFT export is therefore a renaming; merging places B·A into the fused layouts.

PEFT_PREFIX = "base_model.model."

# (megacore linear, segment) ↔ the Hugging Face Llama module holding it.
_LLAMA_MODULES = {("self_attention.linear_qkv", "q_proj"): "self_attn.q_proj",
                  ("self_attention.linear_qkv", "k_proj"): "self_attn.k_proj",
                  ("self_attention.linear_qkv", "v_proj"): "self_attn.v_proj",
                  ("self_attention.linear_proj", ""): "self_attn.o_proj",
                  ("mlp.linear_fc1", "gate_proj"): "mlp.gate_proj",
                  ("mlp.linear_fc1", "up_proj"): "mlp.up_proj",
                  ("mlp.linear_fc2", ""): "mlp.down_proj"}
_HF_MODULES = {v: k for k, v in _LLAMA_MODULES.items()}
# (megacore expert linear, segment) ↔ the Mixtral expert module (per expert e: block_sparse_moe.experts.<e>.<w>).
_MIXTRAL_EXPERTS = {("mlp.experts.linear_fc1", "gate_proj"): "w1", ("mlp.experts.linear_fc1", "up_proj"): "w3",
                    ("mlp.experts.linear_fc2", ""): "w2"}
_HF_EXPERTS = {v: k for k, v in _MIXTRAL_EXPERTS.items()}
_MC_NAME = re.compile(r"^layers\.(\d+)\.(self_attention\.linear_qkv|self_attention\.linear_proj|mlp\.linear_fc1|"
                      r"mlp\.linear_fc2|mlp\.experts\.linear_fc1|mlp\.experts\.linear_fc2|"
                      r"mlp\.shared_experts\.linear_fc1|mlp\.shared_experts\.linear_fc2)\."
                      r"(?:(q_proj|k_proj|v_proj|gate_proj|up_proj)\.)?lora_([AB])\.weight$")
_HF_NAME = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.gate_proj|"
                      r"mlp\.up_proj|mlp\.down_proj|block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3))"
                      r"\.lora_([AB])(?:\.default)?\.weight$")


@dataclasses.dataclass
class Adapter:
    """LoRA adapter weights (whole tensors, megacore names) with their settings and base model.

    ``tensors``: {"layers.<i>.<linear>[.<segment>].lora_{A,B}.weight": array}; ``base``: the base megacore
    checkpoint (``checkpoint.pretrained_checkpoint`` of the run) or ""; ``config``: the model's TransformerConfig
    dict (``megacore.convert.config_dict`` form) when known."""
    lora: LoRA
    tensors: dict
    base: str = ""
    config: dict = None

    @property
    def scale(self) -> float:
        return self.lora.alpha / self.lora.dim

    def modules(self):
        """{(layer, linear, segment): (A, B)} of every adapter pair."""
        out = {}
        for name, a in self.tensors.items():
            m = _MC_NAME.match(name)
            if m is None:
                raise IOError_(f"'{name}' is not a LoRA adapter tensor name (layers.<i>.<linear>[.<segment>]."
                               "lora_A/lora_B.weight)")
            key = (int(m.group(1)), m.group(2), m.group(3) or "")
            out.setdefault(key, [None, None])[0 if m.group(4) == "A" else 1] = a
        for key, (a, b) in out.items():
            if a is None or b is None:
                raise IOError_(f"layer {key[0]} {key[1]} {key[2]}: the adapter has lora_{'A' if a is None else 'B'} "
                               "missing")
        return {k: tuple(v) for k, v in out.items()}


def _f32(a) -> np.ndarray:
    from .checkpoint import BF16Array

    return a.to_float32() if isinstance(a, BF16Array) else np.asarray(a, dtype=np.float32)


def _like(x: np.ndarray, like):
    from .checkpoint import BF16Array

    if isinstance(like, BF16Array):
        return BF16Array.from_float32(x)
    return np.ascontiguousarray(x.astype(np.asarray(like).dtype))


def _recipe_blob(blobs) -> dict:
    r = blobs.get("recipe")
    return (json.loads(r) if isinstance(r, str) else r) or {}


def is_lora_checkpoint(ckpt: str) -> bool:
    """Whether the megacore checkpoint at ``ckpt`` holds LoRA adapters instead of a model's weights."""
    from .checkpoint import _metadata, resolve_checkpoint

    d = resolve_checkpoint(ckpt)
    meta = _metadata(d) if d else None
    return bool(meta) and any(_MC_NAME.match(n) for n in meta["tensors"])


def read_adapter(ckpt: str, base: str | None = None) -> Adapter:
    """The adapter of a LoRA run's checkpoint (a step directory, or a root: its ``latest``), or of one written by
    ``import_peft``. ``base`` overrides the base checkpoint the run recorded (``checkpoint.pretrained_checkpoint``,
    a path relative to where the run was started)."""
    from .checkpoint import _metadata, load_full_checkpoint, resolve_checkpoint

    d = resolve_checkpoint(ckpt)
    if d is None:
        raise IOError_(f"'{ckpt}' holds no complete megacore checkpoint (no metadata.json, no valid `latest`, no "
                       "complete step_<N>)")
    meta = _metadata(d)
    names = [n for n in meta["tensors"] if _MC_NAME.match(n)]
    if not names:
        raise ConfigError(f"{d} holds no LoRA adapters (no layers.<i>....lora_A.weight tensors); it is a full model "
                          "checkpoint: export it with `megacore convert megacore-to-hf`")
    blobs = dict(meta.get("json") or {})
    recipe = _recipe_blob(blobs)
    p = recipe.get("peft") or _recipe_blob({"recipe": blobs.get("peft")})
    if str(p.get("scheme", "")).lower() != "lora":
        raise ConfigError(f"{d} has adapter tensors but no LoRA settings (the recipe's peft section or a 'peft' blob)")
    lora = LoRA(dim=int(p["dim"]), alpha=float(p["alpha"]), dropout=float(p.get("dropout", 0.0)),
                target_modules=list(p["target_modules"]))
    tensors, _ = load_full_checkpoint(d, names=names)
    config = None
    if "config" in blobs:
        config = json.loads(blobs["config"]) if isinstance(blobs["config"], str) else blobs["config"]
    return Adapter(lora, tensors, base or (recipe.get("checkpoint") or {}).get("pretrained_checkpoint", "")
                   or p.get("pretrained_checkpoint", ""), config)


def _base_dir(adapter: Adapter) -> str:
    from .checkpoint import resolve_checkpoint

    d = resolve_checkpoint(adapter.base) if adapter.base else None
    if d is None:
        raise IOError_(f"the LoRA adapter's base checkpoint '{adapter.base}' (checkpoint.pretrained_checkpoint of the "
                       "run, relative to where it was started) holds no megacore checkpoint here; pass the base "
                       "checkpoint's path (--base PATH, base=...)")
    return d


def _io(c) -> dict:
    """{(linear, segment): (fan_in, fan_out, experts or None)} of the model ``c`` (a config dict)."""
    heads, groups, h = c["num_attention_heads"], c["num_query_groups"], c["hidden_size"]
    d, f = c["kv_channels"], c["ffn_hidden_size"]
    io = {("self_attention.linear_qkv", "q_proj"): (h, heads * d), ("self_attention.linear_qkv", "k_proj"): (h, groups * d),
          ("self_attention.linear_qkv", "v_proj"): (h, groups * d), ("self_attention.linear_proj", ""): (heads * d, h)}
    widths = [("mlp", f, None)]
    e = int(c.get("num_moe_experts", 0) or 0)
    if e > 0:
        widths.append(("mlp.experts", int(c.get("moe_ffn_hidden_size") or 0) or f, e))
        if int(c.get("moe_shared_expert_size", 0) or 0) > 0:
            widths.append(("mlp.shared_experts", int(c["moe_shared_expert_size"]), None))
    out = {k: v + (None,) for k, v in io.items()}
    for pre, w, n in widths:
        out.update({(pre + ".linear_fc1", "gate_proj"): (h, w, n), (pre + ".linear_fc1", "up_proj"): (h, w, n),
                    (pre + ".linear_fc1", ""): (h, w, n), (pre + ".linear_fc2", ""): (w, h, n)})
    return out


def check_adapter(adapter: Adapter, c) -> None:
    """ConfigError when an adapter tensor's shape does not fit the model ``c`` (a config dict): another base."""
    io = _io(c)
    r = adapter.lora.dim
    for (layer, linear, seg), (a, b) in adapter.modules().items():
        where = f"layer {layer} {linear}{'.' + seg if seg else ''}"
        if layer >= c["num_layers"]:
            raise ConfigError(f"{where}: the base model has only {c['num_layers']} layers; the adapter was made for "
                              "another model")
        if (linear, seg) not in io:
            raise ConfigError(f"{where}: the base model has no such linear (a MoE adapter on a dense model, or the "
                              "reverse); the adapter was made for another model")
        fan_in, fan_out, experts = io[(linear, seg)]
        lead = () if experts is None else (experts,)
        if tuple(a.shape) != lead + (r, fan_in) or tuple(b.shape) != lead + (fan_out, r):
            raise ConfigError(f"{where}: adapter A {list(a.shape)} / B {list(b.shape)} do not fit this base model "
                              f"(expected A {list(lead + (r, fan_in))}, B {list(lead + (fan_out, r))} for r = {r}); the "
                              "adapter was made for another model")


def merge_state(tensors: dict, adapter: Adapter, c) -> dict:
    """megacore whole tensors with every adapter folded in: W += alpha/r · B A (computed in f32, stored in W's
    dtype), B A placed in the fused layouts (linear_qkv's grouped rows, fc1's [gate; up])."""
    from .convert import fuse_qkv

    check_adapter(adapter, c)
    out = dict(tensors)
    heads, groups = c["num_attention_heads"], c["num_query_groups"]
    by_linear = {}
    for (layer, linear, seg), (a, b) in adapter.modules().items():
        by_linear.setdefault((layer, linear), {})[seg] = adapter.scale * (_f32(b) @ _f32(a))
    for (layer, linear), parts in by_linear.items():
        name = f"layers.{layer}.{linear}.weight"
        if name not in out:
            raise IOError_(f"the base checkpoint lacks '{name}'")
        w = _f32(out[name]).copy()
        if linear == "self_attention.linear_qkv":
            h = w.shape[1]
            d = w.shape[0] // (heads + 2 * groups)
            z = {"q_proj": np.zeros((heads * d, h), np.float32), "k_proj": np.zeros((groups * d, h), np.float32),
                 "v_proj": np.zeros((groups * d, h), np.float32)}
            z.update(parts)
            w += fuse_qkv(z["q_proj"], z["k_proj"], z["v_proj"], heads, groups)
        elif linear.endswith("linear_fc1") and "" not in parts:  # [gate; up] rows (per expert: dim 1)
            half = w.shape[-2] // 2
            if "gate_proj" in parts:
                w[..., :half, :] += parts["gate_proj"]
            if "up_proj" in parts:
                w[..., half:, :] += parts["up_proj"]
        else:
            w += parts[""]
        out[name] = _like(w, out[name])
    return out


def load_base(adapter: Adapter):
    """(whole model tensors, config dict, checkpoint directory) of the adapter's base checkpoint."""
    from .checkpoint import _metadata, load_full_checkpoint
    from .convert import config_from_checkpoint

    d = _base_dir(adapter)
    names = [n for n in _metadata(d)["tensors"] if not n.startswith("optimizer.")]
    if any(_MC_NAME.match(n) for n in names):
        raise ConfigError(f"the base checkpoint {d} is itself a LoRA adapter checkpoint; merge it first "
                          "(megacore.peft.merge) and use the merged checkpoint as the base")
    tensors, _ = load_full_checkpoint(d, names=names)
    return tensors, dict(config_from_checkpoint(d)), d


def merge(ckpt: str, out_root: str, base: str | None = None, dtype: str | None = None) -> str:
    """Folds the LoRA adapter of ``ckpt`` into its base checkpoint and writes the merged model as a megacore
    checkpoint ``out_root/step_0`` (loads into any parallel layout). ``dtype`` "f32" stores every weight in f32
    (no rounding of W + B A back to a bf16 base's dtype); default: the base's dtype. Returns its directory."""
    from .checkpoint import save_full_checkpoint

    adapter = read_adapter(ckpt, base)
    tensors, c, _ = load_base(adapter)
    if dtype not in (None, "f32"):
        raise ConfigError(f"merge dtype '{dtype}': use None (the base's dtype) or 'f32'")
    if dtype == "f32":
        tensors = {n: _f32(a) for n, a in tensors.items()}
        c = dict(c, params_dtype="f32")
    return save_full_checkpoint(out_root, 0, merge_state(tensors, adapter, c), {"config": c})


# ----------------------------------------------------------------------------- Hugging Face PEFT format

def _llama_only(c, what: str) -> None:
    from .convert import _flavour

    f = _flavour(c) if c is not None else None
    if f == "qwen3_moe":
        hint = (" (export the merged model with `megacore convert megacore-to-hf`, which writes Qwen3MoeForCausalLM)"
                if "export" in what else "")
        raise ConfigError(f"{what}: megacore maps Hugging Face PEFT adapters of Llama-family models (Llama, Qwen3, "
                          f"Mixtral), not of a Qwen3-MoE model{hint}")
    if f is not None and f not in ("llama", "mixtral", "qwen3"):
        raise ConfigError(f"{what}: Hugging Face PEFT adapters are written for Llama-family (Llama, Qwen3, Mixtral) "
                          "models only; GPT-2's "
                          "c_attn fuses q, k and v into one Conv1D whose single LoRA pair cannot hold megacore's "
                          "separate q/k/v adapters (export the merged model with `megacore convert megacore-to-hf`)")


def _peft_module_names(adapter: Adapter) -> list:
    """The PEFT target_modules (leaf names) of the adapter's modules."""
    out = set()
    for (_, lin, seg) in adapter.modules():
        out.add(_MIXTRAL_EXPERTS[(lin, seg)] if (lin, seg) in _MIXTRAL_EXPERTS else _LLAMA_MODULES[(lin, seg)].split(".")[1])
    return sorted(out)


def to_peft_tensors(adapter: Adapter) -> dict:
    """{PEFT tensor name: array}: base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight [r, in], ...;
    expert adapters one pair per expert: ...layers.<i>.block_sparse_moe.experts.<e>.w1.lora_A.weight."""
    out = {}
    for (layer, linear, seg), (a, b) in sorted(adapter.modules().items()):
        w = _MIXTRAL_EXPERTS.get((linear, seg))
        if w is not None:
            for e in range(a.shape[0]):
                p = f"{PEFT_PREFIX}model.layers.{layer}.block_sparse_moe.experts.{e}.{w}."
                out[p + "lora_A.weight"], out[p + "lora_B.weight"] = _expert(a, e), _expert(b, e)
            continue
        mod = _LLAMA_MODULES.get((linear, seg))
        if mod is None:
            raise ConfigError(f"layer {layer}: an adapter on {linear}{'.' + seg if seg else ''} (a GELU MLP's whole "
                              "fc1, or a shared expert) has no Hugging Face Llama/Mixtral module; PEFT export needs a "
                              "Llama- or Mixtral-shaped model")
        p = f"{PEFT_PREFIX}model.layers.{layer}.{mod}."
        out[p + "lora_A.weight"], out[p + "lora_B.weight"] = a, b
    return out


def _expert(a, e: int):
    """Expert e's [r, in] / [out, r] slice of a stacked [E, ...] adapter tensor (copy keeps a BF16Array's type)."""
    return a[e].copy()


def save_peft(adapter: Adapter, out_dir: str, base_model_name_or_path: str = "") -> str:
    """Writes ``adapter`` as a Hugging Face PEFT adapter directory (``adapter_config.json`` +
    ``adapter_model.safetensors``), loadable with ``peft.PeftModel.from_pretrained(hf_model, out_dir)``."""
    from .checkpoint import write_safetensors

    _llama_only(adapter.config, "PEFT export")
    tensors = to_peft_tensors(adapter)
    modules = _peft_module_names(adapter)
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path or None,
           "r": int(adapter.lora.dim), "lora_alpha": float(adapter.lora.alpha),
           "lora_dropout": float(adapter.lora.dropout), "target_modules": modules, "bias": "none",
           "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
           "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
           "rank_pattern": {}, "alpha_pattern": {}, "revision": None}
    os.makedirs(out_dir, exist_ok=True)
    write_safetensors(os.path.join(out_dir, "adapter_model.safetensors"), tensors, {"format": "pt"})
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return out_dir


def export_peft(ckpt: str, out_dir: str, base: str | None = None, base_model_name_or_path: str = "") -> str:
    """The LoRA adapter of a megacore checkpoint as a Hugging Face PEFT directory. The base model's config is
    read from the base checkpoint when it is reachable (to check shapes and the flavour), else from the run's
    recipe."""
    from .convert import config_from_checkpoint, config_from_recipe

    adapter = read_adapter(ckpt, base)
    if adapter.config is None:
        from .checkpoint import resolve_checkpoint

        d = resolve_checkpoint(adapter.base) if adapter.base else None
        if d is not None:
            adapter.config = dict(config_from_checkpoint(d))
        else:
            from .checkpoint import _metadata

            adapter.config = config_from_recipe(_recipe_blob(_metadata(resolve_checkpoint(ckpt))["json"]))
    check_adapter(adapter, adapter.config)
    return save_peft(adapter, out_dir, base_model_name_or_path or adapter.base)


def load_peft(peft_dir: str) -> Adapter:
    """A Hugging Face PEFT LoRA adapter directory as an Adapter (megacore names). Refuses what megacore's LoRA
    does not compute (DoRA, rsLoRA, per-module ranks, biases, modules_to_save, non-Llama module names)."""
    from .checkpoint import read_safetensors

    cfg_path, st = os.path.join(peft_dir, "adapter_config.json"), os.path.join(peft_dir, "adapter_model.safetensors")
    if not os.path.isfile(cfg_path) or not os.path.isfile(st):
        raise IOError_(f"{peft_dir}: a PEFT adapter directory needs adapter_config.json and adapter_model.safetensors "
                       "(PyTorch .bin adapters are not read; re-save with safe_serialization=True)")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type") != "LORA":
        raise ConfigError(f"{peft_dir}: peft_type is {cfg.get('peft_type')!r}; only LORA adapters are imported")
    for key, ok in (("use_dora", False), ("use_rslora", False), ("fan_in_fan_out", False)):
        if bool(cfg.get(key, False)) != ok:
            raise ConfigError(f"{peft_dir}: {key} = {cfg[key]} is not supported (megacore LoRA is plain LoRA with "
                              "scale alpha / r)")
    if cfg.get("bias", "none") != "none" or cfg.get("modules_to_save") or cfg.get("rank_pattern") or \
            cfg.get("alpha_pattern"):
        raise ConfigError(f"{peft_dir}: bias training, modules_to_save and per-module rank/alpha patterns are not "
                          "supported; megacore LoRA has one r and alpha and trains no biases")
    tensors, experts = {}, {}
    for name, a in read_safetensors(st).items():
        m = _HF_NAME.match(name)
        if m is None or (m.group(3) is None and m.group(2) not in _HF_MODULES):
            raise ConfigError(f"{peft_dir}: tensor '{name}' is not a LoRA weight of a Llama attention or MLP projection "
                              f"or a Mixtral expert (supported modules: "
                              f"{', '.join([m.split('.')[1] for m in _HF_MODULES] + sorted(_HF_EXPERTS))})")
        if m.group(3) is not None:  # a Mixtral expert: stacked over the experts below
            linear, seg = _HF_EXPERTS[m.group(4)]
            key = f"layers.{m.group(1)}.{linear}.{seg + '.' if seg else ''}lora_{m.group(5)}.weight"
            experts.setdefault(key, {})[int(m.group(3))] = np.array(a)
            continue
        linear, seg = _HF_MODULES[m.group(2)]
        tensors[f"layers.{m.group(1)}.{linear}.{seg + '.' if seg else ''}lora_{m.group(5)}.weight"] = np.array(a)
    for key, per in experts.items():
        if sorted(per) != list(range(len(per))):
            missing = sorted(set(range(max(per) + 1)) - set(per))
            raise ConfigError(f"{peft_dir}: {key} lacks the adapters of experts {missing}; megacore adapts every "
                              "expert of a layer (target w1/w2/w3 for all of them)")
        tensors[key] = np.stack([per[e] for e in range(len(per))])
    modules = _peft_module_names(Adapter(LoRA(), tensors))
    lora = LoRA(dim=int(cfg["r"]), alpha=float(cfg.get("lora_alpha", cfg["r"])),
                dropout=float(cfg.get("lora_dropout", 0.0)), target_modules=modules)
    return Adapter(lora, tensors, "", None)


def import_peft(peft_dir: str, base: str, out_root: str) -> str:
    """Imports a Hugging Face PEFT LoRA adapter onto the megacore checkpoint ``base`` (e.g. the model imported with
    ``megacore convert hf-to-megacore``): checks every adapter shape against the base model and writes a megacore
    adapter checkpoint ``out_root/step_0`` (adapter tensors, the LoRA settings and the base's path in a "peft" blob,
    the base's model config), which ``merge``, ``export_peft`` and ``megacore convert megacore-to-hf`` read like a
    LoRA run's checkpoint. Returns its directory."""
    from .checkpoint import resolve_checkpoint, save_full_checkpoint
    from .convert import config_from_checkpoint

    adapter = load_peft(peft_dir)
    d = resolve_checkpoint(base)
    if d is None:
        raise IOError_(f"the base checkpoint '{base}' holds no megacore checkpoint; import the Hugging Face base model "
                       "first (megacore convert hf-to-megacore HF_DIR OUT) and pass OUT")
    c = dict(config_from_checkpoint(d))
    _llama_only(c, "PEFT import")
    check_adapter(adapter, c)
    peft_blob = {"scheme": "lora", "dim": adapter.lora.dim, "alpha": adapter.lora.alpha,
                 "dropout": adapter.lora.dropout, "target_modules": adapter.lora.target_modules,
                 "pretrained_checkpoint": os.path.abspath(d)}
    return save_full_checkpoint(out_root, 0, adapter.tensors, {"peft": peft_blob, "config": c})
