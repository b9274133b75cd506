"""Supervised fine-tuning from a checkpoint on a JSONL file of examples ({"input", "output"} or chat
{"messages": [...]}), with the loss on the answers only.

    megacore convert hf-to-megacore /models/Llama-3.2-1B ckpt/llama32_1b         # from Hugging Face
    python examples/finetune_sft.py --recipe llama32_1b --pretrained ckpt/llama32_1b --sft data/train.jsonl --gpus 4

Without arguments it fine-tunes the tiny model: it first pretrains it briefly, writes a small JSONL file of
arithmetic questions, then fine-tunes on them (weights only from the pretraining run, into runs/tiny_finetune).
"""

import argparse
import json
import os

import megacore as mc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--pretrained", default=None, help="megacore checkpoint whose weights the fine-tuning starts from")
    ap.add_argument("--sft", default=None, help="JSONL file of examples")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--cpu", action="store_true")
    a = ap.parse_args()
    ex = mc.LocalExecutor(nproc_per_node=a.gpus, cpu=a.cpu)

    pretrained, sft = a.pretrained, a.sft
    if pretrained is None:  # the tiny demo: pretrain first
        pre = mc.recipes.get(a.recipe, num_gpus_per_node=a.gpus)
        pre.trainer.max_steps, pre.trainer.generate_tokens = 40, 0
        if mc.run(pre, executor=ex):
            raise SystemExit(1)
        pretrained = pre.checkpoint.save_dir
    if sft is None:
        os.makedirs("runs", exist_ok=True)
        sft = "runs/sft_demo.jsonl"
        with open(sft, "w") as f:
            for i in range(2000):
                x, y = i % 9 + 1, (i * 7) % 9 + 1
                f.write(json.dumps({"input": f"what is {x} plus {y}?", "output": f"{x} plus {y} is {x + y}."}) + "\n")

    recipe = mc.recipes.get(f"{a.recipe}_finetune", sft_path=sft, pretrained_checkpoint=pretrained,
                            num_gpus_per_node=a.gpus)
    recipe.trainer.max_epochs = 1  # one pass over the training examples (90 %; 10 % are held out for validation)
    raise SystemExit(mc.run(recipe, executor=ex))


if __name__ == "__main__":
    main()
