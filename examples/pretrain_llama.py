"""Pretrain a Llama with a recipe, edited in Python, on whatever this machine has.

    python examples/pretrain_llama.py                        # tiny Llama, TP=2 × PP=2, 4 ranks (CPU or GPU)
    python examples/pretrain_llama.py --recipe llama32_1b --gpus 4 --tp 2 --data data/my_corpus_text_document \
        --tokenizer /models/llama-3.2-1b/tokenizer.json --steps 1000

The recipe is validated as a whole before any rank starts; its JSON is saved next to the logs.
"""

import argparse

import megacore as mc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--gpus", type=int, default=4, help="ranks on this machine")
    ap.add_argument("--tp", type=int, default=None)
    ap.add_argument("--pp", type=int, default=None)
    ap.add_argument("--data", nargs="*", default=None, help="dataset prefixes (megacore preprocess output)")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--cpu", action="store_true")
    a = ap.parse_args()

    recipe = mc.recipes.get(a.recipe, num_gpus_per_node=a.gpus)
    if a.tp:
        recipe.parallel.tensor_model_parallel_size = a.tp
    if a.pp:
        recipe.parallel.pipeline_model_parallel_size = a.pp
    if a.data:
        recipe.data.paths = a.data
    if a.tokenizer:
        recipe.data.tokenizer = a.tokenizer
    if a.steps:
        recipe.trainer.max_steps = a.steps
    for w in recipe.validate():
        print("warning:", w)
    raise SystemExit(mc.run(recipe, executor=mc.LocalExecutor(nproc_per_node=a.gpus, cpu=a.cpu)))


if __name__ == "__main__":
    main()
