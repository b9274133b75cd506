"""Whole-recipe validation, run before any rank starts: every problem is collected and reported at once,
each naming the field and the change that fixes it."""

from __future__ import annotations

import json
import os

from ..errors import ConfigError

_DECAY_STYLES = ("constant", "linear", "cosine", "wsd")
_PRECISIONS = ("f32", "bf16", "f16")
_RECOMPUTE = ("none", "selective", "full")


def validate_recipe(r, check_paths: bool = True) -> list[str]:
    errors: list[str] = []
    warnings: list[str] = []
    p, d, o, t, ck, res = r.parallel, r.data, r.optim, r.trainer, r.checkpoint, r.resources

    def err(field, msg):
        errors.append(f"{field}: {msg}")

    # ---- sizes ------------------------------------------------------------------------------------
    for field, v in (("resources.num_nodes", res.num_nodes), ("resources.num_gpus_per_node", res.num_gpus_per_node),
                     ("parallel.tensor_model_parallel_size", p.tensor_model_parallel_size),
                     ("parallel.pipeline_model_parallel_size", p.pipeline_model_parallel_size),
                     ("parallel.virtual_pipeline_model_parallel_size", p.virtual_pipeline_model_parallel_size),
                     ("parallel.context_parallel_size", p.context_parallel_size),
                     ("parallel.expert_model_parallel_size", p.expert_model_parallel_size),
                     ("data.seq_length", d.seq_length), ("data.micro_batch_size", d.micro_batch_size),
                     ("data.global_batch_size", d.global_batch_size), ("trainer.max_steps", t.max_steps),
                     ("trainer.log_interval", t.log_interval)):
        if not isinstance(v, int) or v < 1:
            err(field, f"must be a positive integer, got {v!r}")
    if errors:
        raise ConfigError("invalid recipe:\n  " + "\n  ".join(errors))

    tp, pp, vp, cp = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                      p.virtual_pipeline_model_parallel_size, p.context_parallel_size)
    world = r.world_size
    mp = tp * pp * cp
    if world % mp:
        err("parallel", f"world size {world} (resources: {res.num_nodes} node(s) × {res.num_gpus_per_node}) is not "
            f"divisible by TP×PP×CP = {tp}×{pp}×{cp} = {mp}; change the parallel sizes or the GPU count so that "
            f"TP×PP×CP divides {world}")
        dp = 0
    else:
        dp = world // mp
    if cp > 1:
        err("parallel.context_parallel_size", "context parallelism is not implemented in the trainer yet; set it to 1")
    if p.expert_model_parallel_size > 1:
        err("parallel.expert_model_parallel_size", "the models of these recipes have no experts; set it to 1")
    if p.sequence_parallel and tp == 1:
        err("parallel.sequence_parallel", "needs tensor_model_parallel_size > 1 (it splits the sequence over the "
            "TP group); set sequence_parallel = false or raise TP")
    if p.sequence_parallel and d.seq_length % tp:
        err("data.seq_length", f"{d.seq_length} is not divisible by TP = {tp}, which sequence parallelism needs; "
            f"use a multiple of {tp}")
    if p.use_distributed_optimizer and o.optimizer != "adamw":
        err("parallel.use_distributed_optimizer", "ZeRO-1 shards AdamW state; set optim.optimizer = adamw or turn "
            "use_distributed_optimizer off")

    # ---- batch ------------------------------------------------------------------------------------
    if dp:
        if d.global_batch_size % (d.micro_batch_size * dp):
            err("data.global_batch_size", f"{d.global_batch_size} is not divisible by micro_batch_size × DP = "
                f"{d.micro_batch_size} × {dp}; use a multiple of {d.micro_batch_size * dp} (DP = world / (TP×PP×CP))")
        else:
            m = d.global_batch_size // (d.micro_batch_size * dp)
            if vp > 1 and m % pp:
                err("data.global_batch_size", f"interleaved 1F1B needs the number of micro-batches ({m}) to be a "
                    f"multiple of PP = {pp}; use a global batch that is a multiple of {d.micro_batch_size * dp * pp}")
            elif pp > 1 and m < pp:
                warnings.append(f"only {m} micro-batches for PP = {pp}: the pipeline bubble is "
                                f"{(pp - 1) / (m + pp - 1):.0%}; raise data.global_batch_size")

    # ---- model and layout -------------------------------------------------------------------------
    mcfg = r.model
    if mcfg.num_layers < 1:
        err("model.num_layers", f"must be positive, got {mcfg.num_layers}")
    elif (p.pipeline_embedding_cost or p.pipeline_head_cost) and not p.pipeline_layout:
        costs = {"parallel.pipeline_embedding_cost": p.pipeline_embedding_cost,
                 "parallel.pipeline_head_cost": p.pipeline_head_cost}
        bad = [k for k, v in costs.items()
               if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == float("inf")]
        for k in bad:
            err(k, f"must be a finite number of layers >= 0, got {costs[k]!r}")
    elif p.pipeline_layout:
        if p.pipeline_embedding_cost or p.pipeline_head_cost:
            err("parallel.pipeline_layout", "is given together with pipeline_embedding_cost/pipeline_head_cost; "
                "give explicit counts or the costs to balance for, not both")
        lay = p.pipeline_layout
        if len(lay) != pp * vp:
            err("parallel.pipeline_layout", f"has {len(lay)} entries but PP×VP = {pp * vp} stages; give one layer "
                "count per (virtual) stage")
        elif any((not isinstance(x, int)) or x < 0 for x in lay):
            err("parallel.pipeline_layout", f"entries must be non-negative integers, got {lay}")
        elif sum(lay) != mcfg.num_layers:
            err("parallel.pipeline_layout", f"sums to {sum(lay)} layers but the model has {mcfg.num_layers}; every "
                "layer must be placed exactly once (fix the counts or model.num_layers)")
    elif mcfg.num_layers % (pp * vp):
        err("model.num_layers", f"{mcfg.num_layers} layers cannot be split evenly over PP×VP = {pp}×{vp} stages; "
            f"choose PP and VP whose product divides {mcfg.num_layers}, give parallel.pipeline_layout, or set "
            "parallel.pipeline_head_cost (layers) to have the split balanced")
    if isinstance(d.prefetch, bool) or not isinstance(d.prefetch, int) or d.prefetch < 1:
        err("data.prefetch", f"must be an integer >= 1 (micro-batches prepared ahead), got {d.prefetch!r}")
    if p.overlap_param_gather and not p.use_distributed_optimizer:
        err("parallel.overlap_param_gather", "needs parallel.use_distributed_optimizer (ZeRO-1): only then are the "
            "parameters all-gathered after the step; set zero=true or overlap_param_gather=false")
    if vp > 1 and pp < 2:
        err("parallel.virtual_pipeline_model_parallel_size", "interleaving needs pipeline_model_parallel_size >= 2")
    if d.seq_length > mcfg.max_position_embeddings:
        err("data.seq_length", f"{d.seq_length} exceeds model.max_position_embeddings {mcfg.max_position_embeddings};"
            " shorten the sequences or raise max_position_embeddings")
    if t.precision not in _PRECISIONS:
        err("trainer.precision", f"'{t.precision}' is not one of {', '.join(_PRECISIONS)}")
    if t.recompute not in _RECOMPUTE:
        err("trainer.recompute", f"'{t.recompute}' is not one of {', '.join(_RECOMPUTE)}")
    if t.device not in ("auto", "cpu", "cuda"):
        err("trainer.device", f"'{t.device}' is not one of auto, cpu, cuda")
    if not errors:
        try:
            cfg = mcfg.to_transformer_config(t.precision, p.sequence_parallel, t.recompute)
            from .. import model as m

            m.validate(cfg, tp)
        except ConfigError as e:
            err("model", str(e))
        except Exception as e:  # noqa: BLE001 - a bad enum string etc. from the C++ side
            err("model", str(e))

    # ---- optimizer --------------------------------------------------------------------------------
    if o.optimizer not in ("adamw", "sgd"):
        err("optim.optimizer", f"'{o.optimizer}' is not one of adamw, sgd")
    if o.lr_decay_style not in _DECAY_STYLES:
        err("optim.lr_decay_style", f"'{o.lr_decay_style}' is not one of {', '.join(_DECAY_STYLES)}")
    if not o.lr > 0:
        err("optim.lr", f"must be positive, got {o.lr}")
    if o.min_lr < 0 or o.min_lr > o.lr:
        err("optim.min_lr", f"{o.min_lr} must be in [0, lr = {o.lr}]")
    if o.lr_warmup_iters < 0 or o.lr_warmup_iters > t.max_steps:
        err("optim.lr_warmup_iters", f"{o.lr_warmup_iters} must be in [0, trainer.max_steps = {t.max_steps}]")
    decay = o.lr_decay_iters or t.max_steps
    if o.lr_decay_style != "constant" and o.lr_warmup_iters > 0 and decay <= o.lr_warmup_iters:
        err("optim.lr_decay_iters", f"the decay ends at step {decay} (lr_decay_iters, or trainer.max_steps when 0), "
            f"not after the {o.lr_warmup_iters} warmup steps; raise lr_decay_iters / max_steps or shorten "
            "lr_warmup_iters")
    if o.clip_grad < 0:
        err("optim.clip_grad", f"must be >= 0 (0 disables clipping), got {o.clip_grad}")

    # ---- data -------------------------------------------------------------------------------------
    if check_paths:
        if d.sft_path:
            if not os.path.isfile(d.sft_path):
                err("data.sft_path", f"'{d.sft_path}' does not exist; give the path of a JSONL file of SFT examples")
        elif d.paths != ["embedded"]:
            from ..data import parse_blend

            try:
                for _, prefix in parse_blend(d.paths):
                    missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
                    if missing:
                        err("data.paths", f"'{prefix}' has no {' or '.join(prefix + x for x in missing)}; give dataset "
                            "prefixes written by `megacore preprocess` (without .bin/.idx), or [\"embedded\"]")
            except ConfigError as e:
                err("data.paths", str(e))
    if d.tokenizer == "byte" and mcfg.vocab_size < 259:
        err("model.vocab_size", f"{mcfg.vocab_size} is smaller than the byte tokenizer's 259 ids; set vocab_size >= 259")

    # ---- checkpoint -------------------------------------------------------------------------------
    if ck.save_interval < 0 or ck.keep_last < 0 or ck.keep_top_k < 0:
        err("checkpoint", "save_interval, keep_last and keep_top_k must be >= 0")
    if (ck.save_interval or ck.save_last) and not ck.save_dir and check_paths:
        warnings.append("checkpoint.save_dir is empty: no checkpoint will be written")
    if ck.keep_top_k and not t.val_check_interval:
        err("checkpoint.keep_top_k", "ranks checkpoints by validation loss; set trainer.val_check_interval > 0")
    if check_paths and ck.resume not in ("", "auto"):
        _check_resume(ck.resume, r, err)
    elif check_paths and ck.resume == "auto" and ck.save_dir:
        latest = os.path.join(ck.save_dir, "latest")
        if os.path.exists(latest):
            try:
                with open(latest) as f:
                    name = f.read().strip()
                _check_resume(os.path.join(ck.save_dir, name), r, err)
            except OSError:
                pass

    if errors:
        raise ConfigError("invalid recipe:\n  " + "\n  ".join(errors))
    return warnings


def _saved_model(path):
    """The model section of the recipe a checkpoint was written with (metadata.json's "recipe" blob, or a
    recipe.json beside it); None when the checkpoint carries no recipe."""
    meta = os.path.join(path, "metadata.json")
    if os.path.isfile(meta):
        with open(meta) as f:
            rec = json.load(f).get("json", {}).get("recipe")
        if isinstance(rec, dict):
            return rec.get("model", {})
    side = os.path.join(path, "recipe.json")
    if os.path.isfile(side):
        with open(side) as f:
            return json.load(f).get("model", {})
    return None


def _check_resume(path, r, err):
    """A checkpoint must exist and hold the same model (its saved recipe's model section)."""
    if not os.path.isdir(path):
        err("checkpoint.resume", f"'{path}' is not a checkpoint directory; give a step_<N> directory, 'auto' or ''")
        return
    if not os.path.isfile(os.path.join(path, "metadata.json")) and os.path.isfile(os.path.join(path, "latest")):
        with open(os.path.join(path, "latest")) as f:
            path = os.path.join(path, f.read().strip())
    try:
        saved = _saved_model(path)
    except (OSError, json.JSONDecodeError) as e:
        err("checkpoint.resume", f"cannot read the checkpoint metadata in '{path}': {e}")
        return
    if saved is None:
        return  # a checkpoint written outside the trainer (e.g. converted): the loader compares tensor shapes
    want = r.to_dict()["model"]
    keys = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size",
            "normalization", "activation", "tie_word_embeddings", "position_embedding", "add_bias_linear")
    diff = [f"{k} {saved.get(k)!r} vs {want.get(k)!r}" for k in keys if saved.get(k) != want.get(k)]
    if diff:
        err("checkpoint.resume", f"'{path}' holds another model ({'; '.join(diff)}, checkpoint vs recipe); resume "
            "from a checkpoint of this model, or set checkpoint.resume = '' to start fresh")
