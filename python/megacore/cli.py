"""The ``megacore`` command line.

Each subcommand registers itself through a function ``_add_<name>(subparsers)`` listed in ``_COMMANDS``;
the parser it adds sets ``func`` to the function that runs it. Add ``train``, ``convert``, ``bench``,
``plan`` the same way.
"""

from __future__ import annotations

import argparse
import sys


def _add_preprocess(sub):
    p = sub.add_parser(
        "preprocess", help="tokenise a JSONL corpus into Megatron indexed datasets (.bin/.idx)",
        description="Tokenise a JSONL file (one document per line) into OUTPUT_PREFIX_<key>_document.bin/.idx, one "
                    "dataset per --json-keys key (Megatron-LM's naming and flags). Output is written to temporary "
                    "names and renamed at the end, so nothing half-written (and no new folder) is left on error.")
    p.add_argument("--input", help="JSONL file, one JSON object per line")
    p.add_argument("--json-keys", nargs="+", default=None, metavar="KEY",
                   help="fields holding the document text, one output dataset per key (default: text)")
    p.add_argument("--json-key", default=None, help="one field (same as --json-keys KEY)")
    p.add_argument("--tokenizer-type", default=None,
                   help="Megatron tokenizer type: HuggingFaceTokenizer or GPT2BPETokenizer (with --tokenizer-model "
                        "PATH to a tokenizer.json), or ByteTokenizer (built-in); other types are refused")
    p.add_argument("--tokenizer-model", default=None, help="tokenizer.json (or its directory) for --tokenizer-type")
    p.add_argument("--vocab-file", default=None, help=argparse.SUPPRESS)  # Megatron's GPT-2 pair: refused with the fix
    p.add_argument("--merge-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", default=None,
                   help="'byte' (built-in, no files) or a path to a Hugging Face tokenizer.json (default: byte)")
    p.add_argument("--output-prefix", required=True,
                   help="writes OUTPUT_PREFIX_<key>_document.bin and .idx for each key")
    p.add_argument("--workers", type=int, default=1, help="tokenising worker processes (default: 1)")
    p.add_argument("--on-error", choices=("fail", "skip"), default="fail",
                   help="bad lines (malformed JSON, missing key, non-string value, empty document): fail with the line "
                        "number, or skip and count them (default: fail)")
    p.add_argument("--append-eod", dest="append_eod", action="store_true", default=True,
                   help="append the end-of-document token to each document (the default)")
    p.add_argument("--no-append-eod", dest="append_eod", action="store_false",
                   help="do not append the end-of-document token to each document")
    p.add_argument("--dtype", default=None, help="token dtype (default: u16 for vocabularies <= 65536, else i32)")
    p.add_argument("--default-corpus", type=int, metavar="N", default=None,
                   help="instead of --input, write the built-in synthetic corpus of N documents (byte tokens) to "
                        "OUTPUT_PREFIX.bin/.idx")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                   help="no progress bar (it is shown only on a terminal anyway)")
    p.set_defaults(func=_run_preprocess, parser=p)


def _run_preprocess(args) -> int:
    from .data import preprocess, write_default_corpus
    from .data.preprocess import tokenizer_from_type

    if args.default_corpus is not None:
        if args.input:
            args.parser.error("give either --input or --default-corpus, not both")
        info = write_default_corpus(args.output_prefix, args.default_corpus)
        print(f"wrote the default corpus: {info['documents']} documents, {info['tokens']} tokens -> "
              f"{args.output_prefix}.bin/.idx [u16, byte tokenizer]")
        return 0
    if not args.input:
        args.parser.error("--input is required (or --default-corpus N)")
    if args.json_key and args.json_keys:
        args.parser.error("give --json-keys or --json-key, not both")
    keys = args.json_keys or [args.json_key or "text"]
    if args.vocab_file or args.merge_file:
        from .errors import ConfigError

        raise ConfigError("--vocab-file/--merge-file (GPT-2's vocab.json + merges.txt) are not read; save the "
                          "tokenizer as one tokenizer.json (tokenizers: Tokenizer(models.BPE.from_file(vocab, merges))"
                          "...save(path), or AutoTokenizer.from_pretrained(...).save_pretrained(dir)) and pass "
                          "--tokenizer-type GPT2BPETokenizer --tokenizer-model PATH")
    if args.tokenizer_type:
        if args.tokenizer:
            args.parser.error("give --tokenizer-type (with --tokenizer-model) or --tokenizer, not both")
        tokenizer = tokenizer_from_type(args.tokenizer_type, args.tokenizer_model)
    else:
        if args.tokenizer_model:
            args.parser.error("--tokenizer-model needs --tokenizer-type (e.g. HuggingFaceTokenizer)")
        tokenizer = args.tokenizer or "byte"
    preprocess(args.input, args.output_prefix, tokenizer=tokenizer, json_keys=keys, workers=args.workers,
               append_eod=args.append_eod, on_error=args.on_error, dtype=args.dtype, progress=args.progress)
    return 0


def _add_plan(sub):
    p = sub.add_parser(
        "plan", help="print the parallel layout, group table and per-GPU memory estimate of a model and layout",
        description="Validates a model preset and a parallel layout as a whole (nothing runs), then prints every "
                    "rank's coordinates, the parameters each GPU holds and an estimate of its memory.")
    p.add_argument("--model", default="tiny_llama",
                   help="model preset: tiny_llama, tiny_gpt2, llama32_1b, llama3_8b, gpt2_124m, mixtral_8x7b (default: tiny_llama)")
    p.add_argument("--recipe", help="plan a recipe instead (its model, layout, GPU count, sequence and batch); "
                                    "with --set overrides")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--world-size", type=int, default=None, help="total number of ranks (GPUs)")
    # Layout flags default to None: with --recipe a given flag overrides the recipe's field (as --set would).
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=None, help="pipeline-parallel size (default 1)")
    p.add_argument("--cp", type=int, default=None, help="context-parallel size (default 1)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default 1)")
    p.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default 0 = TP)")
    p.add_argument("--vp", type=int, default=None, help="virtual pipeline stages per rank (interleaving; default 1)")
    p.add_argument("--head-cost", type=float, default=None,
                   help="extra work of the last pipeline stage (output layer + loss), in layers, that the split is "
                        "balanced for (default -1: derived from the model's shape; 0 with no embedding cost: even)")
    p.add_argument("--seq-length", type=int, default=None, help="tokens per sample (default 2048)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="samples per micro-batch (default 1)")
    p.add_argument("--sequence-parallel", action="store_true", default=None, help="sequence parallelism (needs TP > 1)")
    p.add_argument("--zero", action="store_true", default=None, help="shard optimizer state over DP×CP (ZeRO-1)")
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="memory of one GPU in GiB, for the warning and --fit; a recipe whose layout depends on it "
                        "(llama3_8b) is built for it (default 80)")
    p.add_argument("--headroom-gib", type=float, default=None,
                   help="memory per GPU kept for what the estimate does not count (CUDA context, NCCL and library "
                        "workspaces, allocator fragmentation); default max(4, 12 %% of --gpu-memory-gib)")
    p.add_argument("--fit", action="store_true",
                   help="pick the layout: the fastest TP/PP/ZeRO/recompute whose estimate fits --gpu-memory-gib "
                        "(ignores --tp/--pp/--zero/--sequence-parallel)")
    p.add_argument("--no-table", dest="table", action="store_false", help="omit the per-rank table")
    p.set_defaults(func=_run_plan, parser=p)


def plan(model="tiny_llama", world_size=1, tp=1, pp=1, cp=1, ep=1, vp=1, seq_length=2048, micro_batch_size=1,
         sequence_parallel=False, zero=False, gpu_memory_gib=80.0, pipeline_layout=None, pipeline_embedding_cost=-1.0,
         pipeline_head_cost=-1.0, headroom_gib=None, grad_reduce_in_bf16=False, etp=0, main_params_dtype="f32",
         main_grads_dtype="f32", exp_avg_dtype="f32", exp_avg_sq_dtype="f32", fp8="none", fp8_wgrad=True,
         fp8_keep_gathered_input=False, recompute_num_layers=-1):
    """The numbers `megacore plan` prints, as a dict; raises ConfigError for an invalid model or layout.

    Memory per GPU (the pipeline rank that needs the most), in bytes: bf16 weights (2/param), main grads (4/param in
    f32, 2 with ``main_grads_dtype`` bf16), AdamW master weights and two moments (4 + 4 + 4 per param with f32 state;
    ``main_params_dtype`` bf16 keeps no masters, ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` bf16 take 2 each: 4 per param
    with all-bf16 state; divided by DP×CP with ZeRO-1), the gradient reduction's buffers (ZeRO-1: each bucket's
    reduce-scatter output, per param/DP 4 in f32 or 2 in bf16; bf16 reduction of f32 grads: a bf16 copy of the
    gradients, 2/param, and a bf16 output shard), and activations counted
    tensor by tensor for megacore's layer (GQA, SwiGLU, fused attention; Korthikanti et al.'s method, see
    model.activation_bytes_per_layer — measured within 0.2% on an H200) at the model's recompute granularity (none: also
    each attention's LSE and, with CP > 1, its ring's K/V blocks; full: only each
    layer's input; full with ``recompute_num_layers`` N >= 0, trainer.recompute_num_layers: the first N layers of each
    model chunk keep only their input and the others everything, as without recompute), times the PP
    micro-batches rank r of 1F1B holds in flight (PP − r), plus on the last stage the output layer's logits and their
    gradient (bf16, [s/CP·b, padded vocab/TP] each). With CP > 1 activations are those of the local s/CP tokens.
    The ring forward's CP − 1 received K/V blocks (bf16, each [s/CP·b, KV groups/TP, head_dim]) are kept by every
    layer without recompute until its backward (counted in its activations); `cp_ring` adds the ring attention's
    transient buffers, once (one layer's attention runs at a time): its backward, the larger of the two passes,
    holds the f32 dQ accumulator and a bf16 block dQ ([s/CP·b, heads/TP, head_dim]), dK/dV f32 accumulators held and
    in flight, bf16 block dK/dV, and where layers recompute, the CP − 1 K/V blocks their rerun ring brings. It fits when the total stays under the GPU's memory less
    `headroom_gib` (default max(4, 12 % of it)) for what is not counted: the CUDA context, NCCL and cuBLAS/cuDNN
    workspaces, backward temporaries and allocator fragmentation (Llama-3-8B, TP 2 + SP, ZeRO-1 over DP 2, seq 8192
    ran out of memory on an 80 GB H100 at 70.7 GiB allocated: 8.9 GiB of its 79.6 went to such things). Layers per stage: `pipeline_layout` (explicit counts
    per virtual stage), else balanced for the embedding/head costs (in layers; -1 = derived from the model's shape by
    pipeline.stage_costs_from_model, as the trainer does) when either is > 0, else even; with block recompute
    (``recompute_num_layers`` N >= 0) the first N layers of each virtual stage count 4/3 of a layer in that balance
    and the unit is a layer without recompute. The result's ``stage_costs`` are the (embedding, head) costs used and
    ``rank_work`` the estimated work per pipeline rank in layers.

    FP8 (``fp8`` delayed or current): ``fp8_weights`` adds each FP8 linear's cached E4M3 weight and its transpose
    (2 bytes per weight element of the QKV, projection, FC1 and FC2 layers; counted for every layer), and the
    activations change where the layers keep FP8 codes for the weight gradient (``fp8_wgrad``): the projection adds
    its input's transposed codes (the attention keeps the bf16 output anyway, +1 byte per element), FC2 keeps codes in
    place of its bf16 input (−1), QKV and FC1 likewise without sequence parallelism (−1 each), and with it keep their
    bf16 chunk, or with ``fp8_keep_gathered_input`` the gathered input's codes instead (+1 per element of the
    sequence, −2 per element of the chunk).

    MoE models (``num_moe_experts`` > 0): a MoE layer's routed experts are split over EP × expert-TP (``etp``, 0 =
    TP) instead of TP, so a rank holds 1/(EP·expert-TP) of them, and ZeRO-1 shards their optimizer state over
    expert-DP; the rest of the layer (attention, norms, router, shared expert) is counted like a dense layer's.
    A MoE layer's activations are model.moe_activation_bytes_per_layer's: the attention part as a dense layer's, plus
    the router's logits and top-k, the routed rows the experts keep (top-k × tokens rows of the input, fc1 output and
    activation; with a capacity factor c, c × that bound), the expert outputs and the shared expert; ``moe_dispatch``
    adds the dispatcher's transient buffers once (permuted tokens, the all-to-all receive buffer, expert-TP gathered
    rows). The result adds ``moe`` (EP, expert-TP, expert-DP, total and active parameters, expert parameters per
    GPU).
    """
    from . import model as m
    from . import parallel as par
    from . import pipeline as pl
    from .errors import ValueError as McValueError

    presets = {"tiny_llama": m.tiny_llama, "tiny_gpt2": m.tiny_gpt2, "llama32_1b": m.llama32_1b,
               "llama3_8b": m.llama3_8b, "gpt2_124m": m.gpt2_124m, "mixtral_8x7b": m.mixtral_8x7b}
    if isinstance(model, str):
        if model not in presets:
            raise McValueError(f"unknown model preset '{model}'; use one of {', '.join(presets)}")
        cfg = presets[model]()
    else:
        cfg = model.copy()
    cfg.sequence_parallel = sequence_parallel
    layout = par.GridLayout(par.ParallelConfig(tensor=tp, pipeline=pp, context=cp, expert=ep, expert_tensor=etp,
                                               virtual_pipeline=vp), world_size)
    m.validate(cfg, tp, ep, etp)
    granularity = str(cfg.recompute_granularity).lower()
    full = granularity.endswith("full")
    if recompute_num_layers != -1 and (not full or recompute_num_layers < 0):
        raise McValueError(f"recompute_num_layers {recompute_num_layers} needs full recompute and N >= 0 (or -1 = "
                           f"every layer)")
    block = full and recompute_num_layers >= 0
    # Block recompute prices each chunk's first N layers at 4/3 of the others in the split, as the trainer does.
    block_n = recompute_num_layers if block else -1
    stage_costs = pl.resolve_stage_costs(cfg, seq_length, tp, float(pipeline_embedding_cost), float(pipeline_head_cost),
                                         block_n)
    # ConfigError naming the fix when the layout does not cover the model (or is uneven with both costs 0).
    lay = pl.choose_layout(cfg.num_layers, pp, vp, list(pipeline_layout or []), *stage_costs, block_n)
    counts = m.parameter_count(cfg, tp)
    rank_layers = [lay.num_layers_on_rank(r) for r in range(pp)]

    def is_moe(i):
        return cfg.num_moe_experts > 0 and i % cfg.moe_layer_freq == 0

    rank_moe_layers = [sum(1 for c in range(vp) for i in lay.layer_indices(r, c) if is_moe(i)) for r in range(pp)]
    etp_size = etp if etp > 0 else tp
    # Per GPU: dense layers and a MoE layer's non-expert part split over TP, the routed experts over EP × expert-TP.
    moe_rest = counts["per_moe_layer"] - counts["per_moe_layer_experts"]
    expert_params = [k * counts["per_moe_layer_experts"] / (ep * etp_size) for k in rank_moe_layers]
    stage_params = [((n - k) * counts["per_layer"] + k * moe_rest) / tp + e
                    for n, k, e in zip(rank_layers, rank_moe_layers, expert_params)]
    stage_params[0] += (counts["embedding"] + counts["position_embedding"]) / tp
    stage_params[-1] += (counts["output_layer"] + counts["final_norm"]) / tp
    if cfg.tie_word_embeddings and pp > 1:
        stage_params[-1] += counts["embedding"] / tp  # the last stage keeps its own copy of the tied table
    dp_cp = layout.sizes["dp"] * layout.sizes["cp"]
    edp = world_size // (etp_size * ep * pp)
    s, b = seq_length // cp, micro_batch_size
    # Without block recompute every layer is counted at one granularity; with it the first N layers of each chunk
    # at full and the rest at none (Megatron-Core's block method keeps all their activations).
    rc = "full" if full else "none" if granularity.endswith("none") else "selective"
    kept_rc = "none" if block else rc

    def layer_acts(g):
        dense = m.activation_bytes_per_layer(cfg, s, b, tp, sequence_parallel, 2, g)["total"]
        moe = (m.moe_activation_bytes_per_layer(cfg, s, b, tp, sequence_parallel, 2, g, etp_size)
               if cfg.num_moe_experts > 0 else {"saved": 0.0, "dispatch": 0.0})
        return dense, moe

    act_layer, moe_act = layer_acts(kept_rc)
    act_full, moe_full = layer_acts("full") if block else (act_layer, moe_act)

    def chunk_split(r):
        """(dense, MoE) layers of pipeline rank r at full recompute and at kept_rc, over its chunks."""
        n = {"full_dense": 0, "full_moe": 0, "kept_dense": 0, "kept_moe": 0}
        for c in range(vp):
            idx = lay.layer_indices(r, c)
            k = min(recompute_num_layers, len(idx)) if block else 0
            for j, i in enumerate(idx):
                n[("full_" if j < k else "kept_") + ("moe" if is_moe(i) else "dense")] += 1
        return n

    rank_split = [chunk_split(r) for r in range(pp)]
    if fp8 not in ("none", "delayed", "current"):
        raise McValueError(f"fp8 '{fp8}' is not none, delayed or current")
    fp8_on = fp8 != "none"
    h, attn_w = cfg.hidden_size, cfg.attention_width
    fc1_w = cfg.ffn_size * (2 if str(cfg.activation).lower().endswith("swiglu") else 1)
    # Weight elements of a layer's four FP8 linears on one TP rank (a MoE layer: the attention's two).
    lin_moe = (h * cfg.qkv_width + attn_w * h) / tp
    lin_dense = lin_moe + (h * fc1_w + cfg.ffn_size * h) / tp
    fp8_act = 0.0
    if fp8_on and fp8_wgrad:
        t = s * b
        col = -1.0 if not sequence_parallel else ((1.0 - 2.0 / tp) if fp8_keep_gathered_input else 0.0)
        fp8_act = t * attn_w / tp - t * cfg.ffn_size / tp + 2 * col * t * h
    if kept_rc != "full":  # a fully recomputed layer keeps no FP8 codes either, only its input
        act_layer += fp8_act
    logits = 2 * 2 * s * b * m.padded_vocab_size(cfg, tp) / tp  # bf16 logits + their gradient, last stage
    q_elems = s * b * cfg.num_attention_heads / tp * cfg.head_dim
    kv_elems = s * b * cfg.query_groups / tp * cfg.head_dim
    # The ring forward's CP − 1 received K/V blocks (bf16): kept by a layer without recompute until its backward,
    # rebuilt by a recomputing layer's backward.
    kv_blocks = 2 * 2 * (cp - 1) * kv_elems
    if kept_rc == "none" and cp > 1:
        act_layer += kv_blocks
        moe_act = dict(moe_act, saved=moe_act["saved"] + kv_blocks)
    recomputes = kept_rc != "none" or block
    # dQ acc f32 + block dQ bf16; dK, dV f32 held + in flight; block dK, dV bf16; a recomputed ring's K/V blocks.
    cp_ring = ((4 + 2) * q_elems + (2 * 2 * 4 + 2 * 2) * kv_elems + (kv_blocks if recomputes else 0.0)
               if cp > 1 else 0.0)

    for name, v in (("main_params_dtype", main_params_dtype), ("main_grads_dtype", main_grads_dtype),
                    ("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
        if v not in ("f32", "bf16"):
            raise McValueError(f"{name} '{v}' is not f32 or bf16")
    size = {"f32": 4, "bf16": 2}
    grad_bytes = size[main_grads_dtype]
    # Optimizer state per parameter: f32 masters (none with bf16 main params: the bf16 weights are updated in place)
    # and the two moments at their dtypes.
    state_bytes = (4 if main_params_dtype == "f32" else 0) + size[exp_avg_dtype] + size[exp_avg_sq_dtype]
    bf16_reduce = grad_reduce_in_bf16 or main_grads_dtype == "bf16"
    staging = grad_reduce_in_bf16 and main_grads_dtype == "f32"  # bf16 grads are reduced in place

    def reduce_bytes(n):
        # DistributedDataParallel: ZeRO reduce-scatters each bucket into a shard buffer of the reduction dtype;
        # bf16 reduction of f32 gradients first copies them into a bf16 staging buffer.
        shard = (2 if bf16_reduce else 4) * n / dp_cp if zero and dp_cp > 1 else 0.0
        return shard + (2 * n if staging and dp_cp > 1 else 0.0)

    def rank_memory(r, moe_act=moe_act, moe_full=moe_full):
        # 1F1B: pipeline rank r holds up to PP − r micro-batches' activations of its layers.
        return {
            "weights": 2 * stage_params[r],
            "main_grads": grad_bytes * stage_params[r],
            "optimizer": state_bytes * ((stage_params[r] - expert_params[r]) / (dp_cp if zero else 1)
                               + expert_params[r] / (edp if zero else 1)),
            "grad_reduce": reduce_bytes(stage_params[r]),
            "activations": (act_layer * rank_split[r]["kept_dense"] + moe_act["saved"] * rank_split[r]["kept_moe"]
                            + act_full * rank_split[r]["full_dense"]
                            + moe_full["saved"] * rank_split[r]["full_moe"]) * (pp - r),
            "moe_dispatch": moe_act["dispatch"] if rank_moe_layers[r] > 0 else 0.0,
            "logits": logits if r == pp - 1 else 0.0,
            "cp_ring": cp_ring,
            **({"fp8_weights": 2 * ((rank_layers[r] - rank_moe_layers[r]) * lin_dense + rank_moe_layers[r] * lin_moe)}
               if fp8_on else {}),
        }

    def busiest(moe_kept, moe_f):
        """(pipeline rank, its memory) of the rank needing the most, with these MoE layer estimates."""
        r = max(range(pp), key=lambda i: sum(rank_memory(i, moe_kept, moe_f).values()))
        return r, rank_memory(r, moe_kept, moe_f)

    busiest_rank, mem = busiest(moe_act, moe_full)
    total = sum(mem.values())
    # Dropless routing is priced at balanced load. Early in training a router may send one EP rank up to
    # min(EP, E/k) times its share (every token's k experts on that rank's E/EP experts): the same estimate at that
    # load (moe_activation_bytes_per_layer's capacity factor is the received rows' multiple of the balanced share).
    worst = None
    if cfg.num_moe_experts > 0 and cfg.moe_expert_capacity_factor == 0:
        load = min(float(ep), cfg.num_moe_experts / cfg.moe_router_topk)
        if load > 1:
            wcfg = cfg.copy()
            wcfg.moe_expert_capacity_factor = load
            w_kept = m.moe_activation_bytes_per_layer(wcfg, s, b, tp, sequence_parallel, 2, kept_rc, etp_size)
            w_full = (m.moe_activation_bytes_per_layer(wcfg, s, b, tp, sequence_parallel, 2, "full", etp_size)
                      if block else w_kept)
            if kept_rc == "none" and cp > 1:
                w_kept = dict(w_kept, saved=w_kept["saved"] + kv_blocks)
            w_rank, w_mem = busiest(w_kept, w_full)
            worst = {"load": load, "busiest_rank": w_rank, "memory_bytes": w_mem, "total_bytes": sum(w_mem.values())}
    headroom = max(4.0, 0.12 * gpu_memory_gib) if headroom_gib is None else headroom_gib
    return {"config": cfg, "layout": layout, "parameters": counts, "stage_params": stage_params,
            "stage_layers": list(lay.counts), "rank_layers": rank_layers, "busiest_rank": busiest_rank,
            "stage_costs": stage_costs, "rank_work": pl.rank_work(lay, *stage_costs, block_n),
            "layout_text": pl.describe_layout(lay, *stage_costs, block_n),
            "memory_bytes": mem, "total_bytes": total, "headroom_gib": headroom,
            "fits": total <= (gpu_memory_gib - headroom) * 2**30,
            "flops_per_token": m.flops_per_token(cfg, seq_length, True), "seq_length": seq_length,
            "seq_length_per_rank": s,
            "moe": ({"ep": ep, "expert_tp": etp_size, "expert_dp": edp, "total": counts["total"],
                     "active": counts["active"], "expert_params_per_gpu": expert_params,
                     "dropless_worst": worst}
                    if cfg.num_moe_experts > 0 else None)}


#: Block recompute in fitting: at most this fraction of a model chunk's layers (at least 1) is tried before the fit
#: moves to more model parallelism.
BLOCK_RECOMPUTE_MAX_FRACTION = 0.25


def fit_layout(model, world_size, gpu_memory_gib=80.0, seq_length=2048, micro_batch_size=1, headroom_gib=None,
               **plan_kwargs):
    """The first layout, in order of expected speed, whose `plan` fits the GPUs. Model-parallel degrees TP × PP from
    1 up; at each degree, first every (TP, PP) with selective recompute (TP before PP: no pipeline bubble), then the
    same (TP, PP) with full recompute of the fewest first layers of each model chunk that fits
    (``trainer.recompute_num_layers`` N, up to BLOCK_RECOMPUTE_MAX_FRACTION of the chunk's layers); full recompute
    of every layer comes last, after every degree. Sequence parallelism whenever TP > 1, ZeRO-1 whenever DP > 1.

    Why this order: a fully recomputed layer costs about a third of its forward + backward again, so recomputing a
    few of 32 layers costs a few per cent, while one step more model parallelism costs more (Llama-3-8B at seq 8192
    on 4 GPUs: TP 2 -> TP 4 lost 13 % of the throughput, 54.8 -> 47.7 % MFU on H200); recomputing every layer (a
    third more compute) is the last resort.

    Returns ``{"tp", "pp", "sequence_parallel", "zero", "recompute", "recompute_num_layers" (-1 = every layer when
    recompute is full; else N), "plan"}``; ConfigError naming the smallest estimate when none fits."""
    from .errors import ConfigError

    candidates = sorted(((tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8) if world_size % (tp * pp) == 0),
                        key=lambda c: (c[0] * c[1], c[1]))
    best = None

    def attempt(tp, pp, recompute, n=-1):
        nonlocal best
        dp = world_size // (tp * pp)
        if isinstance(model, str):
            cfg = _preset_with_recompute(model, recompute)
        else:
            cfg = model.copy()
            cfg.recompute_granularity = recompute
        try:
            r = plan(cfg, world_size, tp=tp, pp=pp, seq_length=seq_length, micro_batch_size=micro_batch_size,
                     sequence_parallel=tp > 1, zero=dp > 1, gpu_memory_gib=gpu_memory_gib,
                     headroom_gib=headroom_gib, recompute_num_layers=n, **plan_kwargs)
        except ValueError:  # TP not dividing the heads, PP not dividing the layers, ...
            return None
        if best is None or r["total_bytes"] < best["total_bytes"]:
            best = r
        if not r["fits"]:
            return r, None
        return r, {"tp": tp, "pp": pp, "sequence_parallel": tp > 1, "zero": dp > 1, "recompute": recompute,
                   "recompute_num_layers": n, "plan": r}

    for degree in sorted({tp * pp for tp, pp in candidates}):
        group = [c for c in candidates if c[0] * c[1] == degree]
        tried = []
        for tp, pp in group:
            a = attempt(tp, pp, "selective")
            if a is None:
                continue
            if a[1]:
                return a[1]
            tried.append((tp, pp, a[0]))
        for tp, pp, r in tried:
            most = max(1, int(max(r["stage_layers"]) * BLOCK_RECOMPUTE_MAX_FRACTION))
            for n in range(1, most + 1):
                a = attempt(tp, pp, "full", n)
                if a and a[1]:
                    return a[1]
    for tp, pp in candidates:
        a = attempt(tp, pp, "full")
        if a and a[1]:
            return a[1]
    why = (f"the smallest estimate is {best['total_bytes'] / 2**30:.1f} GiB per GPU" if best
           else "no TP × PP layout is valid for this model")
    raise ConfigError(f"no layout of {world_size} GPUs fits {gpu_memory_gib:g} GiB each at seq {seq_length} × "
                      f"micro-batch {micro_batch_size}: {why}; use more GPUs, shorter sequences, or bf16 optimizer "
                      f"state (optim.main_params_dtype and friends)")


def _preset_with_recompute(name, recompute):
    from . import model as m

    presets = {"tiny_llama": m.tiny_llama, "tiny_gpt2": m.tiny_gpt2, "llama32_1b": m.llama32_1b,
               "llama3_8b": m.llama3_8b, "gpt2_124m": m.gpt2_124m, "mixtral_8x7b": m.mixtral_8x7b}
    if name not in presets:
        return name  # plan() names the known presets
    cfg = presets[name]()
    cfg.recompute_granularity = recompute
    return cfg


def plan_recipe(rec, gpu_memory_gib=80.0, headroom_gib=None):
    """`plan` of a recipe: its model with its recompute, layout, GPU count, sequence, micro-batch, gradient reduction
    and optimizer state dtypes."""
    p, o = rec.parallel, rec.optim
    return plan(rec.model.to_transformer_config("bf16", p.sequence_parallel, rec.trainer.recompute), rec.world_size,
                p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size,
                p.expert_model_parallel_size, p.virtual_pipeline_model_parallel_size, rec.data.seq_length,
                rec.data.micro_batch_size, p.sequence_parallel, p.use_distributed_optimizer, gpu_memory_gib,
                p.pipeline_layout, p.pipeline_embedding_cost, p.pipeline_head_cost, headroom_gib,
                p.grad_reduce_in_bf16, p.expert_tensor_parallel_size, o.main_params_dtype, o.main_grads_dtype,
                o.exp_avg_dtype, o.exp_avg_sq_dtype, rec.trainer.fp8, rec.trainer.fp8_wgrad,
                rec.trainer.fp8_keep_gathered_input, rec.trainer.recompute_num_layers)


def fit_recipe(rec, gpu_memory_gib=80.0, headroom_gib=None):
    """`fit_layout` for a recipe: the TP/PP/SP/ZeRO/recompute that fits its model, GPU count, sequence, micro-batch,
    CP/EP, pipeline stage costs, optimizer state and FP8 settings on GPUs of ``gpu_memory_gib``, estimated as
    `plan_recipe` (and so the memory check before launch) estimates the recipe with that layout."""
    p, o, t = rec.parallel, rec.optim, rec.trainer
    return fit_layout(rec.model.to_transformer_config("bf16", False, t.recompute), rec.world_size,
                      gpu_memory_gib, rec.data.seq_length, rec.data.micro_batch_size, headroom_gib,
                      cp=p.context_parallel_size, ep=p.expert_model_parallel_size, etp=p.expert_tensor_parallel_size,
                      pipeline_embedding_cost=p.pipeline_embedding_cost, pipeline_head_cost=p.pipeline_head_cost,
                      grad_reduce_in_bf16=p.grad_reduce_in_bf16, main_params_dtype=o.main_params_dtype,
                      main_grads_dtype=o.main_grads_dtype, exp_avg_dtype=o.exp_avg_dtype,
                      exp_avg_sq_dtype=o.exp_avg_sq_dtype, fp8=t.fp8, fp8_wgrad=t.fp8_wgrad,
                      fp8_keep_gathered_input=t.fp8_keep_gathered_input)


def fit_flags(f) -> str:
    """A `fit_layout` result as the --set flags that select it."""
    return (f"--set parallel.tp={f['tp']} --set parallel.pp={f['pp']} --set "
            f"parallel.sp={str(f['sequence_parallel']).lower()} --set parallel.zero={str(f['zero']).lower()} "
            f"--set trainer.recompute={f['recompute']}"
            + (f" --set trainer.recompute_num_layers={f['recompute_num_layers']}"
               if f["recompute"] == "full" and f["recompute_num_layers"] >= 0 else ""))


#: A layout whose estimate fits but leaves less than this fraction of the GPU's memory beyond plan's headroom gets a
#: warning: the headroom is itself an estimate (8.9 GiB went to uncounted memory in the 8B run it was set from).
TIGHT_FRACTION = 0.05

#: Set to a size in GiB, the GPU memory the memory check assumes instead of asking the device (tests; a submit host
#: whose cluster nodes have other GPUs than its own).
GPU_MEMORY_ENV = "MEGACORE_GPU_MEMORY_GIB"

#: Set by an executor that checked the layout against these GPUs before starting the ranks.
MEMORY_CHECKED_ENV = "MEGACORE_MEMORY_CHECKED"


def gpu_memory_gib(indices=None):
    """Memory of one GPU that ranks here would use, in GiB: ``MEGACORE_GPU_MEMORY_GIB`` when set, else the smallest
    of the visible GPUs ``indices`` (default: all), read from their properties so that no CUDA context is created in
    this process; None when no GPU is visible."""
    import os

    from .errors import ConfigError

    env = os.environ.get(GPU_MEMORY_ENV, "")
    if env:
        try:
            v = float(env)
        except ValueError:
            v = 0.0
        if not v > 0:
            raise ConfigError(f"{GPU_MEMORY_ENV}='{env}' is not a positive size in GiB; unset it to use the GPU's own")
        return v
    import megacore

    n = megacore.cuda_device_count()
    if n == 0:
        return None
    return min(megacore.cuda_device_total_memory(i % n) for i in (indices or range(n))) / 2**30


def check_memory(rec, gpu_gib, headroom_gib=None) -> dict:
    """How the recipe's layout fits GPUs of ``gpu_gib`` GiB by its `plan` estimate (the busiest rank): ``{"plan",
    "gpu_gib", "usable_gib" (less plan's headroom), "fits" (estimate <= usable), "tight" (fits with less than
    TIGHT_FRACTION of the GPU to spare), "summary" (one line: the estimate beside the GPU's memory), "problem" (what
    does not fit and the layout that does, or "")}``. Raises nothing for a layout that does not fit
    (`enforce_memory_check` does)."""
    gib = 2**30
    r = plan_recipe(rec, gpu_gib, headroom_gib)
    est, usable = r["total_bytes"] / gib, gpu_gib - r["headroom_gib"]
    fits, tight = r["fits"], r["fits"] and usable - est < TIGHT_FRACTION * gpu_gib
    summary = (f"memory per GPU: plan estimates {est:.1f} GiB (pipeline rank {r['busiest_rank']}, the busiest) of the "
               f"GPU's {gpu_gib:.1f} GiB, {usable:.1f} GiB usable after {r['headroom_gib']:.1f} GiB headroom; the "
               f"step log's mem allocated/peak GiB is measured")
    problem = ""
    if not fits or tight:
        layout = (f"{recipe_layout(rec)}, seq {rec.data.seq_length} × micro-batch {rec.data.micro_batch_size} on "
                  f"{rec.world_size} GPUs")
        try:
            f = fit_recipe(rec, gpu_gib, headroom_gib)
            fix = (f"the layout `megacore plan --fit` picks ({f['plan']['total_bytes'] / gib:.1f} GiB): {fit_flags(f)}"
                   if (f["plan"]["total_bytes"] < r["total_bytes"]) else "")
        except ValueError as e:  # ConfigError: no layout of these GPUs fits
            fix = str(e)
        if not fits:
            problem = (f"{rec.name}: {layout} needs an estimated {est:.1f} GiB per GPU, more than the {usable:.1f} GiB "
                       f"usable of the GPU's {gpu_gib:.1f} GiB ({r['headroom_gib']:.1f} GiB headroom for the CUDA "
                       f"context, NCCL and library workspaces and fragmentation); use {fix or 'more GPUs'}")
        else:
            problem = (f"{rec.name}: {layout} fits with {usable - est:.1f} GiB to spare beyond the "
                       f"{r['headroom_gib']:.1f} GiB headroom of the GPU's {gpu_gib:.1f} GiB"
                       + (f"; if it runs out of memory, use {fix}" if fix else ""))
    w = r["moe"]["dropless_worst"] if r["moe"] else None
    if fits and w and w["total_bytes"] / gib > usable:
        problem = ((problem + "; ") if problem else "") + (
            f"{rec.name}: dropless MoE routing is estimated at balanced load; if the router sends the busiest EP rank "
            f"{w['load']:g}× its share (early in training it can), that rank needs {w['total_bytes'] / gib:.1f} GiB, "
            f"more than the {usable:.1f} GiB usable: set model.moe_expert_capacity_factor (e.g. 1.5) to bound the "
            f"expert rows, or keep dropless and watch the step log's load max/mean")
    return {"plan": r, "gpu_gib": gpu_gib, "usable_gib": usable, "fits": fits, "tight": tight, "summary": summary,
            "problem": problem}


def enforce_memory_check(rec, gpu_gib, warn=None):
    """Applies ``trainer.memory_check`` for GPUs of ``gpu_gib`` GiB (None: no GPU, nothing checked): ``error``
    raises ConfigError when the layout does not fit and warns when it is tight, ``warn`` only warns, ``off`` skips (as
    do LoRA runs, whose frozen base weights plan does not model). Warnings go to ``warn`` (default: one line on stderr). Returns `check_memory`'s dict, or None when not checked."""
    from .errors import ConfigError

    mode = rec.trainer.memory_check
    # plan counts gradients and optimizer state for every weight; a LoRA run keeps them for its adapters alone, so
    # the estimate would refuse runs that fit.
    if mode == "off" or gpu_gib is None or rec.peft.scheme == "lora":
        return None
    c = check_memory(rec, gpu_gib)
    if not c["fits"] and mode == "error":
        raise ConfigError(f"{c['problem']}; or set trainer.memory_check=warn to launch anyway")
    if c["problem"]:
        (warn or (lambda m: print(m, file=sys.stderr, flush=True)))(f"megacore: warning: {c['problem']}")
    return c


_PLAN_FLAGS = {"tp": "parallel.tp", "pp": "parallel.pp", "cp": "parallel.cp", "ep": "parallel.ep", "etp": "parallel.etp",
               "vp": "parallel.vp",
               "head_cost": "parallel.pipeline_head_cost", "seq_length": "data.seq_length",
               "micro_batch_size": "data.micro_batch_size", "sequence_parallel": "parallel.sp", "zero": "parallel.zero"}


def _run_plan(args) -> int:
    from .recipes._common import DEFAULT_GPU_MEMORY_GIB

    given = args.gpu_memory_gib is not None
    if not given:
        args.gpu_memory_gib = DEFAULT_GPU_MEMORY_GIB
    if args.recipe:
        flags = [f"{key}={getattr(args, a)}" for a, key in _PLAN_FLAGS.items() if getattr(args, a) is not None]
        # --world-size sizes the recipe as `train --nproc-per-node N` would (one node of N GPUs): its layout follows.
        rec, note = build_recipe(args.recipe, None, list(args.set) + flags, args.world_size,
                                 1 if args.world_size else None, args.gpu_memory_gib,
                                 "--gpu-memory-gib" if given else "plan's default; --gpu-memory-gib G fits it for "
                                                                  "other GPUs")
        if note:
            print(note)
        rec.validate(check_paths=False)
        args.model = rec.name
        args.world_size = rec.world_size
        r = plan_recipe(rec, args.gpu_memory_gib, args.headroom_gib)
    else:
        if args.world_size is None:
            from .errors import ConfigError
            raise ConfigError("--world-size is required without --recipe")
        d = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "etp": 0, "vp": 1, "head_cost": -1.0, "seq_length": 2048,
             "micro_batch_size": 1, "sequence_parallel": False, "zero": False}
        v = {k: (getattr(args, k) if getattr(args, k) is not None else d[k]) for k in d}
        r = plan(args.model, args.world_size, v["tp"], v["pp"], v["cp"], v["ep"], v["vp"], v["seq_length"],
                 v["micro_batch_size"], v["sequence_parallel"], v["zero"], args.gpu_memory_gib,
                 pipeline_head_cost=v["head_cost"], headroom_gib=args.headroom_gib, etp=v["etp"])
    if args.fit:
        f = (fit_recipe(rec, args.gpu_memory_gib, args.headroom_gib) if args.recipe
             else fit_layout(args.model, args.world_size, args.gpu_memory_gib, r["seq_length"], v["micro_batch_size"],
                             args.headroom_gib))
        r = f["plan"]
        print(f"fitting layout for {args.gpu_memory_gib:g} GiB GPUs: {fit_flags(f)}")
    L, cfg, gib = r["layout"], r["config"], 2**30
    sz = L.sizes
    print(f"model {args.model}: {r['parameters']['total'] / 1e9:.3f} B parameters, {cfg.num_layers} layers, "
          f"hidden {cfg.hidden_size}, heads {cfg.num_attention_heads}/{cfg.query_groups} (query/KV)")
    print(f"layout: world {args.world_size} = TP {sz['tp']} × CP {sz['cp']} × DP {sz['dp']} × PP {sz['pp']}"
          f" (EP {sz['ep']}, VP {sz['vpp']}), order {L.order}")
    for i, p in enumerate(r["stage_params"]):
        work = f" (work ≈ {r['rank_work'][i]:.1f} layers)" if sz["pp"] > 1 else ""
        print(f"  stage {i}: {r['rank_layers'][i]} layers{work}, {p / 1e6:.1f} M parameters per GPU")
    if sz["pp"] > 1:
        print(f"pipeline {r['layout_text']}")
    if r["moe"]:
        e = r["moe"]
        groups = L.groups("ep")
        shown = ", ".join(str(list(g)) for g in groups[:4]) + (f", … ({len(groups)} groups)" if len(groups) > 4 else "")
        print(f"experts: {cfg.num_moe_experts} per MoE layer (top-{cfg.moe_router_topk}), expert groups EP {e['ep']} × "
              f"expert-TP {e['expert_tp']} × expert-DP {e['expert_dp']}; EP groups (ranks): {shown}")
        print(f"MoE parameters: {e['total'] / 1e9:.3f} B total, {e['active'] / 1e9:.3f} B active per token; experts "
              f"per GPU: " + ", ".join(f"stage {i} {x / 1e6:.1f} M" for i, x in enumerate(e["expert_params_per_gpu"])))
    if sz["cp"] > 1:
        groups = L.groups("cp")
        shown = ", ".join(str(list(g)) for g in groups[:4]) + (f", … ({len(groups)} groups)" if len(groups) > 4 else "")
        print(f"context parallel: CP {sz['cp']}, each rank holds {r['seq_length_per_rank']} of the "
              f"{r['seq_length']} tokens (chunks r and 2·CP−1−r); CP groups (ranks): {shown}")
    mem = r["memory_bytes"]
    print(f"memory per GPU (pipeline rank {r['busiest_rank']}, the largest; estimate): " + ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in mem.items())
          + f" = {r['total_bytes'] / gib:.2f} GiB of {args.gpu_memory_gib:g} GiB")
    w = r["moe"]["dropless_worst"] if r["moe"] else None
    if w:
        print(f"MoE routing is dropless (model.moe_expert_capacity_factor = 0), priced at balanced load; a router that "
              f"sends the busiest EP rank min(EP, experts/top-k) = {w['load']:g}× its share (seen early in training) "
              f"takes it to {w['total_bytes'] / gib:.2f} GiB (activations {w['memory_bytes']['activations'] / gib:.2f} "
              f"GiB, moe_dispatch {w['memory_bytes']['moe_dispatch'] / gib:.2f} GiB); a capacity factor bounds it")
    if not r["fits"]:
        usable = args.gpu_memory_gib - r["headroom_gib"]
        print(f"warning: the estimate ({r['total_bytes'] / gib:.1f} GiB) exceeds the {usable:g} GiB per GPU left after "
              f"{r['headroom_gib']:g} GiB of headroom (context, NCCL and library workspaces, fragmentation) on a "
              f"{args.gpu_memory_gib:g} GiB GPU; raise TP or PP, enable sequence parallelism or ZeRO, use selective "
              f"recompute, or lower the micro-batch size")
    if args.recipe and rec.trainer.fp8 != "none":
        t = rec.trainer
        kept = f", first/last {t.fp8_bf16_layers} layers bf16" if t.fp8_bf16_layers else ""
        print(f"fp8: {t.fp8} scaling, {t.fp8_format} (E4M3 forward, "
              f"{'E5M2' if t.fp8_format == 'hybrid' else 'E4M3'} gradients), amax history {t.fp8_amax_history_len} "
              f"({t.fp8_amax_compute_algo}), margin {t.fp8_margin}{kept}; QKV, projection, FC1 and FC2 in FP8 "
              f"({'forward, input and weight gradients' if t.fp8_wgrad else 'forward and input gradients; weight gradients in bf16'}), "
              f"embedding, norms, attention and output layer in bf16")
        if t.fp8_param_gather:
            dpcp = rec.world_size // (rec.parallel.tensor_model_parallel_size * rec.parallel.pipeline_model_parallel_size)
            print("fp8_param_gather: ZeRO-1 all-gathers the FP8 linears' weights as E4M3 codes (1 byte per element "
                  f"instead of 2){'' if dpcp > 1 else ' (DP x CP = 1: nothing to gather)'}")
    if args.table:
        print(L.table())
    return 0


def _add_train(sub):
    p = sub.add_parser(
        "train", help="train a recipe (locally, on Slurm or on Kubernetes)",
        description="Builds a recipe (--recipe NAME or --config FILE), applies --set overrides, validates the whole "
                    "recipe before any rank starts, and runs it with the chosen executor. Locally the ranks are GPUs, "
                    "or CPU ranks through mpirun when there is no GPU. A named recipe whose layout depends on the GPUs' "
                    "memory (llama3_8b) is fitted for the GPUs the job uses (MEGACORE_GPU_MEMORY_GIB, else the local "
                    "GPUs; CPU ranks: the recipe's default, 80 GiB), and one line says which size.")
    p.add_argument("--recipe", help="recipe name: tiny, tiny_moe, gpt2_124m, llama32_1b, llama3_8b, mixtral_8x7b (+ _finetune), "
                                    "llama32_1b_long")
    p.add_argument("--config", help="a saved recipe (JSON or YAML) instead of --recipe")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a field, e.g. --set parallel.tp=2 --set optim.lr=1e-3 (repeatable)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="ranks per node (default: the recipe's); a named recipe's layout is built for the ranks given")
    p.add_argument("--nodes", type=int, default=None, help="nodes (Slurm/Kubernetes; default: the recipe's)")
    p.add_argument("--cpu", action="store_true", help="CPU ranks even when GPUs are visible")
    p.add_argument("--executor", choices=["local", "slurm", "kubernetes"], default="local")
    p.add_argument("--dryrun", action="store_true", help="print the command / sbatch script / manifest only")
    p.add_argument("--save-config", metavar="FILE", help="write the final recipe (JSON or YAML) and exit")
    p.add_argument("--image", default="megacore:latest", help="container image (Slurm pyxis / Kubernetes)")
    p.add_argument("--account", default="", help="Slurm account")
    p.add_argument("--partition", default="", help="Slurm partition")
    p.add_argument("--namespace", default="default", help="Kubernetes namespace")
    p.set_defaults(func=_run_train, parser=p)


def load_recipe(name=None, config=None, overrides=(), nproc_per_node=None, nodes=None, gpu_memory_gib=None):
    """The recipe the CLI would run: from a name or a file, with overrides and size flags applied; a named recipe
    whose layout depends on the GPUs' memory (llama3_8b) is fitted for ``gpu_memory_gib`` (None: its default)."""
    return build_recipe(name, config, overrides, nproc_per_node, nodes, gpu_memory_gib)[0]


def build_recipe(name=None, config=None, overrides=(), nproc_per_node=None, nodes=None, gpu_memory_gib=None,
                 memory_source=""):
    """`load_recipe`, and one line saying which GPU memory the named recipe's layout was fitted for and where that
    size came from (``memory_source``), with how to pin another layout; "" for a recipe whose layout does not depend
    on memory, or a file. A recipe that runs on CPU ranks (``--set trainer.device=cpu``) keeps its default."""
    from .errors import ConfigError
    from .recipes import Recipe, get, takes_gpu_memory
    from .recipes._common import DEFAULT_GPU_MEMORY_GIB

    if bool(name) == bool(config):
        raise ConfigError("give exactly one of --recipe NAME or --config FILE")
    # A named recipe is built for the GPUs given, so its size-dependent defaults (the layout a large model's recipe
    # fits to its GPUs, a small recipe's TP/PP) follow --nproc-per-node / --nodes instead of the recipe's default size.
    kwargs = {k: v for k, v in (("num_gpus_per_node", nproc_per_node), ("num_nodes", nodes)) if v}
    fitted = bool(name) and takes_gpu_memory(name)
    if fitted and gpu_memory_gib is not None:
        kwargs["gpu_memory_gib"] = gpu_memory_gib
    r = get(name, **kwargs) if name else Recipe.from_file(config)
    if nproc_per_node:
        r.resources.num_gpus_per_node = nproc_per_node
    if nodes:
        r.resources.num_nodes = nodes
    built = recipe_layout(r)
    keys = {o.split("=", 1)[0].strip() for o in overrides}
    if fitted and "trainer.recompute" in keys and "trainer.recompute_num_layers" not in keys:
        r.trainer.recompute_num_layers = -1  # the fitted N belongs to the fitted full recompute, not to a pinned one
    r.apply_overrides(overrides)
    if not fitted:
        return r, ""
    if gpu_memory_gib is not None and r.trainer.device == "cpu":
        return build_recipe(name, None, overrides, nproc_per_node, nodes, None, "CPU ranks: the recipe's default")
    gib = DEFAULT_GPU_MEMORY_GIB if gpu_memory_gib is None else gpu_memory_gib
    now = recipe_layout(r)
    source = memory_source or "the recipe's default"
    note = (f"{r.name}: layout fitted for {gib:.1f} GiB GPUs ({source}): {built}; "
            + (f"--set made it {now}" if now != built else
               f"pin another with --set parallel.tp=N (and parallel.pp, parallel.sp, parallel.zero, trainer.recompute, "
               f"trainer.recompute_num_layers) "
               f"or fit for other GPUs with {GPU_MEMORY_ENV}=GIB"))
    return r, note


def recipe_layout(rec) -> str:
    """A recipe's TP × PP, SP, ZeRO-1 and recompute, in words."""
    p = rec.parallel
    return (f"TP {p.tensor_model_parallel_size} × PP {p.pipeline_model_parallel_size}"
            f"{' + SP' if p.sequence_parallel else ''}{' + ZeRO-1' if p.use_distributed_optimizer else ''}, "
            f"recompute {rec.trainer.recompute}"
            + (f" of the first {rec.trainer.recompute_num_layers} "
               f"layer{'' if rec.trainer.recompute_num_layers == 1 else 's'} per model chunk "
               f"(trainer.recompute_num_layers={rec.trainer.recompute_num_layers})"
               if rec.trainer.recompute == "full" and rec.trainer.recompute_num_layers >= 0 else ""))


def recipe_gpu_memory(cpu=False, local=True, nproc=None):
    """``(GiB, source)``: the GPU memory `megacore train` fits a named recipe's layout for, and where it comes from:
    none (the recipe's default) for CPU ranks; ``MEGACORE_GPU_MEMORY_GIB`` when set; for a local launch the smallest
    of the first ``nproc`` visible GPUs (all when None), the same size the memory check before launch uses; none for
    a machine without GPUs or a cluster executor (its nodes' GPUs are not this machine's)."""
    import os

    if cpu:
        return None, "CPU ranks: the recipe's default"
    if os.environ.get(GPU_MEMORY_ENV):
        return gpu_memory_gib(), GPU_MEMORY_ENV
    if not local:
        return None, f"the recipe's default; {GPU_MEMORY_ENV} gives the nodes' GPU size"
    gib = gpu_memory_gib(range(nproc) if nproc else None)
    return (gib, "this machine's GPUs") if gib is not None else (None, "no GPU visible: the recipe's default")


def _run_train(args) -> int:
    from . import executors

    gib, source = (recipe_gpu_memory(args.cpu, args.executor == "local", args.nproc_per_node) if args.recipe
                   else (None, ""))
    r, note = build_recipe(args.recipe, args.config, args.set, args.nproc_per_node, args.nodes, gib, source)
    if note:
        print(f"megacore: {note}", file=sys.stderr, flush=True)
    if args.save_config:
        r.validate(check_paths=False)
        (r.to_yaml if args.save_config.endswith((".yaml", ".yml")) else r.to_json)(args.save_config)
        print(f"wrote {args.save_config}")
        return 0
    if args.executor == "local":
        ex = executors.LocalExecutor(nproc_per_node=r.resources.num_gpus_per_node, cpu=args.cpu)
        return ex.launch(r, dryrun=args.dryrun)
    if args.executor == "slurm":
        ex = executors.SlurmExecutor(account=args.account, partition=args.partition, dryrun=args.dryrun, cpu=args.cpu,
                                     container_image="" if args.image == "megacore:latest" else args.image)
    else:
        ex = executors.KubernetesExecutor(image=args.image, namespace=args.namespace, dryrun=args.dryrun)
    return ex.launch(r)


def _add_bench(sub):
    p = sub.add_parser(
        "bench", help="run a benchmark suite (kernels, collectives, model) and write JSON results",
        description="Runs one of megacore's benchmark programs from a CMake build tree (benchmarks are not part of "
                    "the wheel): kernels (one GPU), collectives, model (mpirun over the local GPUs). Each prints the "
                    "peer it is compared with and writes JSON to --out.")
    p.add_argument("suite", choices=["kernels", "collectives", "model", "training", "pipeline"])
    p.add_argument("--build-dir", default="build", help="the CMake build tree holding benchmarks/ (default: build)")
    p.add_argument("--np", type=int, default=None, help="ranks for multi-rank suites (default: visible GPUs)")
    p.add_argument("--out", default=None, help="JSON result path")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="arguments passed to the benchmark program")
    p.set_defaults(func=_run_bench, parser=p)


def bench_command(suite, build_dir="build", np=None, out=None, extra=()):
    """The command `megacore bench` runs (a list), or ConfigError naming the missing program."""
    import os
    import shutil

    from .errors import ConfigError

    exe = os.path.join(build_dir, "benchmarks", f"megacore_bench_{suite}")
    if not os.path.isfile(exe):
        raise ConfigError(f"{exe} does not exist; build the benchmarks first: cmake -S . -B {build_dir} "
                          f"-DMEGACORE_BUILD_BENCHMARKS=ON && cmake --build {build_dir} --target megacore_bench_{suite}")
    cmd = [exe] + (["--out", out] if out else []) + list(extra)
    if suite == "kernels":
        return cmd
    if np is None:
        try:
            import megacore

            np = max(1, megacore.cuda_device_count())
        except Exception:  # noqa: BLE001
            np = 1
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise ConfigError("multi-rank benchmarks need Open MPI's mpirun on PATH")
    return [mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(np)] + cmd


def _run_bench(args) -> int:
    import subprocess

    extra = [a for a in args.extra if a != "--"]
    return subprocess.call(bench_command(args.suite, args.build_dir, args.np, args.out, extra))


def _add_convert(sub):
    p = sub.add_parser(
        "convert", help="convert checkpoints between Hugging Face and megacore formats",
        description="hf-to-megacore SRC OUT: a Hugging Face model directory (Llama family, Mixtral or GPT-2) into a "
                    "megacore checkpoint under OUT (loads into any parallel layout). megacore-to-hf SRC OUT: a megacore "
                    "checkpoint (a step_N directory, or a root such as runs/NAME/checkpoints: its latest), including "
                    "every checkpoint `megacore train` writes, into a Hugging Face model directory (config.json, "
                    "generation_config.json, safetensors and the run's tokenizer files); a LoRA run's checkpoint "
                    "exports its base with the adapters merged in. megacore-to-peft SRC OUT: a LoRA run's adapter as "
                    "a Hugging Face PEFT directory (adapter_config.json + adapter_model.safetensors). peft-to-megacore "
                    "SRC OUT --base CKPT: a PEFT LoRA adapter onto a megacore base checkpoint (e.g. one made by "
                    "hf-to-megacore), written as a megacore adapter checkpoint under OUT.")
    p.add_argument("direction", choices=["hf-to-megacore", "megacore-to-hf", "megacore-to-peft", "peft-to-megacore"])
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--max-shard-size", type=int, default=5 * 1024 ** 3,
                   help="megacore-to-hf: bytes per safetensors file before sharding with an index (default 5 GiB)")
    p.add_argument("--tokenizer", default=None,
                   help="megacore-to-hf: 'byte' or the tokenizer.json the run used (default: the run's data.tokenizer "
                        "from the checkpoint's recipe)")
    p.add_argument("--base", default=None,
                   help="LoRA: the base megacore checkpoint (default for a LoRA run: its checkpoint."
                        "pretrained_checkpoint; required for peft-to-megacore)")
    p.add_argument("--base-model-name", default="",
                   help="megacore-to-peft: base_model_name_or_path written into adapter_config.json (default: the "
                        "base checkpoint's path)")

    def run(args):
        from . import convert, peft

        if args.direction == "hf-to-megacore":
            print(convert.hf_to_megacore(args.src, args.out))
        elif args.direction == "megacore-to-hf":
            print(convert.megacore_to_hf(args.src, args.out, max_shard_size=args.max_shard_size,
                                         tokenizer=args.tokenizer, base=args.base))
        elif args.direction == "megacore-to-peft":
            print(peft.export_peft(args.src, args.out, base=args.base, base_model_name_or_path=args.base_model_name))
        else:
            if not args.base:
                args.parser.error("peft-to-megacore needs --base CKPT (the megacore checkpoint of the base model)")
            print(peft.import_peft(args.src, args.base, args.out))
        return 0

    p.set_defaults(func=run, parser=p)


def _add_finetune(sub):
    p = sub.add_parser(
        "finetune", help="fine-tune a Hugging Face model or megacore checkpoint on a JSONL file (LoRA or full)",
        description="megacore.finetune on the command line: imports --model (a Hugging Face directory; a megacore "
                    "checkpoint is used as it is) into OUTPUT/base, trains on --data ({\"input\", \"output\"} or "
                    "{\"messages\": [...]} lines; 10 %% held out for validation) with LoRA adapters (--peft lora) or "
                    "all parameters (--peft none), and writes OUTPUT/checkpoints, OUTPUT/logs, the adapter in Hugging "
                    "Face PEFT format (OUTPUT/peft) and with --export-hf the fine-tuned (merged) model (OUTPUT/hf). "
                    "Running it again with the same --output resumes.")
    p.add_argument("--model", required=True, help="Hugging Face model directory or megacore checkpoint")
    p.add_argument("--data", required=True, help="JSONL training data")
    p.add_argument("--output", required=True, help="output directory")
    p.add_argument("--peft", choices=["lora", "none"], default="lora", help="lora (default) or none (full fine-tuning)")
    p.add_argument("--lora-dim", type=int, default=32, help="LoRA rank r (default 32)")
    p.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA alpha; the scale is alpha / r (default 32)")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input (default 0)")
    p.add_argument("--target-modules", nargs="+", default=None, metavar="NAME",
                   help="modules to adapt: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj or linear_qkv "
                        "linear_proj linear_fc1 linear_fc2; on MoE models the MLP names adapt every expert (also "
                        "Mixtral's w1 w3 w2) (default: all four linear_*)")
    p.add_argument("--devices", type=int, default=1, help="ranks on this machine (GPUs, or CPU ranks with --cpu)")
    p.add_argument("--max-epochs", type=int, default=None, help="passes over the training rows")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (when --max-epochs is not given)")
    p.add_argument("--precision", default=None, help="auto (default), bf16, f16 or f32")
    p.add_argument("--cpu", action="store_true", help="CPU ranks even when GPUs are visible")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override any recipe field, e.g. --set optim.lr=2e-4 --set data.seq_length=1024")
    p.add_argument("--export-hf", action="store_true", help="also write the fine-tuned model in Hugging Face format")
    p.add_argument("--base-model-name", default="", help="base_model_name_or_path for adapter_config.json")
    p.set_defaults(func=_run_finetune, parser=p)


def _run_finetune(args) -> int:
    from . import finetuning, peft

    lora = None
    if args.peft == "lora":
        lora = peft.LoRA(dim=args.lora_dim, alpha=args.lora_alpha, dropout=args.lora_dropout)
        if args.target_modules:
            lora.target_modules = list(args.target_modules)
    trainer = {"devices": args.devices}
    for k in ("max_epochs", "max_steps", "precision"):
        if getattr(args, k) is not None:
            trainer[k] = getattr(args, k)
    res = finetuning.finetune(args.model, args.data, peft=lora, trainer=trainer, output_path=args.output,
                              overrides=args.set, cpu=args.cpu, export_hf=args.export_hf,
                              base_model_name_or_path=args.base_model_name)
    print(f"megacore finetune: checkpoints {res.checkpoints}" + (f", adapter {res.adapter}" if res.adapter else "")
          + (f", Hugging Face model {res.hf}" if res.hf else ""))
    return 0


_COMMANDS = [_add_preprocess, _add_plan, _add_train, _add_bench, _add_convert, _add_finetune]


def _version() -> str:
    import megacore

    return megacore.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megacore", description="megacore: Megatron-Core-style training tools")
    parser.add_argument("--version", action="version", version=f"megacore {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv=None) -> int:
    """Entry point of the ``megacore`` script; returns the exit status."""
    args = build_parser().parse_args(argv)
    from .errors import Error

    try:
        return args.func(args)
    except Error as e:  # megacore errors already say what is wrong and how to fix it: no traceback
        print(f"megacore {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
