"""Fine-tuning in one call, as NeMo users write it.

    import megacore as mc
    mc.finetune(model_path="Llama-3.2-1B",                 # a Hugging Face model directory or a megacore checkpoint
                data_path="train.jsonl",                   # {"input", "output"} or {"messages": [...]} per line
                peft=mc.peft.LoRA(dim=32, alpha=32, dropout=0.1, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                 "o_proj"]),
                trainer={"devices": 4, "max_epochs": 3, "precision": "bf16"},
                output_path="runs/my_lora")

builds a recipe for that model (``finetune_recipe``), runs it on this machine (``LocalExecutor``) and writes, under
``output_path``: ``base/`` (a Hugging Face model imported into megacore once; reused by later calls),
``checkpoints/`` and ``logs/`` of the run, ``peft/`` (the adapter in Hugging Face PEFT format, Llama-family models)
and, with ``export_hf=True``, ``hf/`` (the fine-tuned model in Hugging Face format: for LoRA the base with the
adapters merged). ``peft=None`` is full-parameter fine-tuning. ``megacore finetune`` is the same on the command
line. Calling it again with the same ``output_path`` resumes the run from its newest checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from . import peft as _peft
from .errors import ConfigError, Error
from .errors import IOError as MegacoreIOError

#: model fields of a recipe filled from the base checkpoint's TransformerConfig (same names).
_SAME = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "kv_channels",
         "vocab_size", "max_position_embeddings", "normalization", "norm_eps", "activation", "add_bias_linear",
         "tie_word_embeddings", "position_embedding", "rope_theta", "init_method_std")


def _is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and not os.path.isfile(os.path.join(path, "metadata.json"))


def _import_hf(model_path: str, output_path: str, log=print) -> str:
    """Imports the Hugging Face directory ``model_path`` into ``output_path/base`` once (a complete import there
    is reused); returns the checkpoint directory."""
    from .checkpoint import resolve_checkpoint
    from .convert import hf_to_megacore

    base_root = os.path.join(output_path, "base")
    d = resolve_checkpoint(base_root)
    if d is None:
        d = hf_to_megacore(model_path, base_root)
        log(f"megacore finetune: imported the Hugging Face model {model_path} -> {d}")
    else:
        log(f"megacore finetune: using the imported base {d}")
    return d


def resolve_base(model_path: str, output_path: str) -> tuple:
    """(megacore checkpoint directory, its TransformerConfig dict, tokenizer spec or None) of ``model_path``. For
    a Hugging Face directory the directory is ``output_path/base`` (where ``_import_hf`` puts it; not written
    here) and the config comes from its config.json."""
    import json

    from .checkpoint import resolve_checkpoint
    from .convert import config_from_checkpoint, config_from_hf

    if _is_hf_dir(model_path):
        tok = os.path.join(model_path, "tokenizer.json")
        with open(os.path.join(model_path, "config.json")) as f:
            c = config_from_hf(json.load(f))
        return (os.path.join(output_path, "base"), c, tok if os.path.isfile(tok) else None)
    d = resolve_checkpoint(model_path)
    if d is None:
        raise MegacoreIOError(f"model_path '{model_path}' is neither a Hugging Face model directory (config.json + "
                              "safetensors) nor a megacore checkpoint (metadata.json, or a root with `latest`)")
    if _peft.is_lora_checkpoint(d):
        raise ConfigError(f"model_path '{model_path}' is a LoRA adapter checkpoint; merge it first "
                          "(megacore.peft.merge) and fine-tune the merged checkpoint")
    from .checkpoint import _metadata

    recipe = _peft._recipe_blob(_metadata(d).get("json") or {})
    return d, config_from_checkpoint(d), (recipe.get("data") or {}).get("tokenizer")


def finetune_recipe(model_path: str, data_path: str, peft=None, trainer: Optional[dict] = None,
                    output_path: str = "runs/finetune", overrides=()):
    """The recipe ``finetune`` runs (nothing is written; a Hugging Face base is read from ``output_path/base``,
    where ``finetune`` imports it after validating this recipe). ``trainer``:
    ``devices`` (ranks on this machine) and any trainer field (``max_epochs``, ``max_steps``, ``precision``, ...);
    ``overrides``: ``--set`` strings applied last. Defaults: TP = PP = 1 (data parallel over the devices),
    sequence length min(2048, the model's), micro-batch 1, global batch 8 × devices, lr 1e-4 with LoRA and
    1e-5 for full fine-tuning, validation on 10 % of the rows every 50 steps."""
    from .convert import MOE_FIELDS
    from .recipes import tiny
    from .recipes._common import finetune_from

    if not data_path or not os.path.isfile(data_path):
        raise MegacoreIOError(f"data_path '{data_path}' does not exist; pass a JSONL file of {{\"input\", \"output\"}} "
                              "(or {\"messages\": [...]}) lines")
    base, c, tokenizer = resolve_base(model_path, output_path)
    lora = _peft.resolve(peft)
    t = dict(trainer or {})
    devices = int(t.pop("devices", 1))
    if devices < 1:
        raise ConfigError(f"trainer devices is {devices}; give at least 1")
    r = finetune_from(tiny.pretrain_recipe(), os.path.abspath(data_path), os.path.abspath(base),
                      lr=1e-4 if lora else 1e-5, dir=output_path, peft=lora)
    r.name = "finetune"
    for k in _SAME + MOE_FIELDS:
        if k in _SAME or k in c:  # MoE fields: only a MoE model's config has them
            setattr(r.model, k, c[k])
    r.model.qk_layernorm = bool(c.get("qk_layernorm", False))  # configs written before the field lack it
    r.model.name = os.path.basename(os.path.normpath(model_path)) or "model"
    r.model.make_vocab_size_divisible_by = int(c.get("make_vocab_size_divisible_by", 128))
    rs = c.get("rope_scaling") or {"type": "None"}
    r.model.rope_scaling = "llama3" if str(rs.get("type")).lower() == "llama3" else "none"
    if r.model.rope_scaling == "llama3":
        r.model.rope_scaling_factor = rs["factor"]
        r.model.rope_low_freq_factor = rs["low_freq_factor"]
        r.model.rope_high_freq_factor = rs["high_freq_factor"]
        r.model.rope_original_max_position_embeddings = rs["original_max_position_embeddings"]
    r.parallel.tensor_model_parallel_size = 1
    r.parallel.pipeline_model_parallel_size = 1
    r.resources.num_gpus_per_node = devices
    r.data.tokenizer = tokenizer or "byte"
    r.data.seq_length = min(2048, int(c["max_position_embeddings"]))
    r.data.micro_batch_size = 1
    r.data.global_batch_size = 8 * devices
    r.trainer.val_check_interval = 50
    r.trainer.limit_val_batches = 4
    fields = {f.name for f in dataclasses.fields(r.trainer)}
    for k, v in t.items():
        if k not in fields:
            raise ConfigError(f"trainer has no setting '{k}'; use devices or one of: {', '.join(sorted(fields))}")
        setattr(r.trainer, k, v)
    return r.apply_overrides(list(overrides))


@dataclasses.dataclass
class FinetuneResult:
    """Where ``finetune`` wrote its outputs (None for what it did not write)."""
    checkpoints: str
    logs: str
    base: str
    adapter: Optional[str] = None
    hf: Optional[str] = None


def finetune(model_path: str, data_path: str, peft=None, trainer: Optional[dict] = None,
             output_path: str = "runs/finetune", overrides=(), cpu: bool = False, export_hf: bool = False,
             base_model_name_or_path: str = "", log=print) -> FinetuneResult:
    """Fine-tunes ``model_path`` on ``data_path`` (see the module doc) and returns where the outputs are. Raises a
    megacore error when the recipe is invalid (before anything runs) or the run fails."""
    from .checkpoint import resolve_checkpoint
    from .convert import megacore_to_hf
    from .executors import LocalExecutor

    r = finetune_recipe(model_path, data_path, peft, trainer, output_path, overrides)
    ex = LocalExecutor(nproc_per_node=r.resources.num_gpus_per_node, cpu=cpu)
    if _is_hf_dir(model_path):  # the whole recipe, and whether it fits the GPUs, is checked before the import writes
        for w in r.validate(check_paths=False):
            log(f"megacore: warning: {w}")
        ex.check_memory(r, warn=lambda m: None)  # a refusal; the launch below warns
        _import_hf(model_path, output_path, log)
    rc = ex.launch(r)
    if rc != 0:
        raise Error(f"the training run failed (exit status {rc}); its output above names the "
                    "failure")
    ckpts = r.checkpoint.save_dir
    out = FinetuneResult(checkpoints=ckpts, logs=r.logging.log_dir, base=r.checkpoint.pretrained_checkpoint)
    if resolve_checkpoint(ckpts) is None:  # checkpoint.save_last = false and no save_interval
        log(f"megacore finetune: the run wrote no checkpoint under {ckpts}, so nothing is exported")
        return out
    if r.peft.scheme == "lora":
        from .convert import _flavour, config_from_checkpoint

        if _flavour(config_from_checkpoint(out.base)) in ("llama", "qwen3", "mixtral"):  # PEFT maps their modules
            name = base_model_name_or_path or (os.path.abspath(model_path) if _is_hf_dir(model_path) else out.base)
            out.adapter = _peft.export_peft(ckpts, os.path.join(output_path, "peft"), base_model_name_or_path=name)
            log(f"megacore finetune: LoRA adapter (Hugging Face PEFT) -> {out.adapter}")
        else:
            log("megacore finetune: no PEFT adapter written (Hugging Face PEFT export covers Llama, Qwen3 and "
                "Mixtral models); the adapter checkpoints are under " + ckpts)
    if export_hf:
        out.hf = megacore_to_hf(ckpts, os.path.join(output_path, "hf"), log=log)
    return out


__all__ = ["finetune", "finetune_recipe", "FinetuneResult", "resolve_base"]
