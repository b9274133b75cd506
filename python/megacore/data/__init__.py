"""megacore's data pipeline.

* ``IndexedDataset`` / ``IndexedDatasetWriter``: Megatron ``.bin``/``.idx`` files (mmapped, C++).
* ``GPTDataset``: pretraining samples with cached, seeded document/sample/shuffle indices.
* ``BlendedDataset``, ``build_pretrain_datasets``, ``parse_blend``: weighted blends and train/valid/test splits.
* ``build_sft_dataset``: JSONL SFT examples with answer-only loss, packed first-fit-decreasing.
* ``DataLoader``: per-DP-rank micro-batches from a background prefetch thread.
* ``PretrainData``: the config object a recipe holds; ``.loader(...)`` builds everything.
* ``write_default_corpus`` / ``default_corpus``: the built-in synthetic corpus (byte tokens).
* ``preprocess``: JSONL -> indexed dataset (also ``megacore preprocess`` on the command line).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .._C import data as _data
from ..errors import ConfigError
from .preprocess import preprocess
from .sft import PromptTemplate, SFTExamples, build_sft_dataset, load_sft_examples

IndexedDataset = _data.IndexedDataset
IndexedDatasetWriter = _data.IndexedDatasetWriter
SampleSource = _data.SampleSource
GPTDataset = _data.GPTDataset
BlendedDataset = _data.BlendedDataset
PackedSequenceDataset = _data.PackedSequenceDataset
DataLoader = _data.DataLoader
Batch = _data.Batch
build_blending_indices = _data.build_blending_indices
blend_samples_needed = _data.blend_samples_needed
parse_split = _data.parse_split
split_document_ranges = _data.split_document_ranges
pack_first_fit_decreasing = _data.pack_first_fit_decreasing
token_dtype_for_vocab = _data.token_dtype_for_vocab
write_default_corpus = _data.write_default_corpus
default_corpus_document = _data.default_corpus_document


def parse_blend(paths) -> list[tuple[float, str]]:
    """``["a"]``, ``["a", "b"]`` (equal weights) or ``[w1, "a", w2, "b"]`` -> ``[(w1, "a"), (w2, "b")]``."""
    if isinstance(paths, str):
        paths = [paths]
    paths = list(paths)
    if not paths:
        raise ConfigError("no data paths given; pass a prefix or a blend such as [0.3, 'data/a', 0.7, 'data/b']")
    if all(isinstance(p, (str, os.PathLike)) for p in paths):
        return [(1.0, os.fspath(p)) for p in paths]
    if len(paths) % 2:
        raise ConfigError(f"blend {paths!r} has an odd number of entries; alternate weights and prefixes: "
                          "[0.3, 'data/a', 0.7, 'data/b']")
    out = []
    for w, p in zip(paths[0::2], paths[1::2]):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not isinstance(p, (str, os.PathLike)):
            raise ConfigError(f"blend entry ({w!r}, {p!r}) must be (weight, prefix); alternate weights and "
                              "prefixes: [0.3, 'data/a', 0.7, 'data/b']")
        if not w > 0:
            raise ConfigError(f"blend weight {w} for '{p}' must be positive")
        out.append((float(w), os.fspath(p)))
    return out


def default_corpus(directory: str, num_documents: int = 4000, seed: int = 0) -> str:
    """Writes the default corpus into ``directory`` unless it is already there; returns its prefix."""
    prefix = os.path.join(directory, f"megacore_default_corpus_{num_documents}_{seed}")
    if not (os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx")):
        write_default_corpus(prefix, num_documents, seed)
    return prefix


@dataclass
class PretrainData:
    """Pretraining data of a recipe: one dataset prefix or a weighted blend, split into train/valid/test."""

    paths: list
    seq_length: int = 2048
    global_batch_size: int = 8
    micro_batch_size: int = 1
    split: str = "969,30,1"
    seed: int = 1234
    cache_dir: str = ""
    prefetch: int = 4

    def datasets(self, train_samples: int, valid_samples: int = 0, test_samples: int = 0):
        """(train, valid, test) sample sources; None for a split with 0 samples."""
        return _data.build_pretrain_datasets(parse_blend(self.paths), self.split, self.seq_length,
                                             (train_samples, valid_samples, test_samples), self.seed,
                                             self.cache_dir)

    def loader(self, train_iters: int, dp_rank: int = 0, dp_size: int = 1, consumed_samples: int = 0,
               device="cpu") -> DataLoader:
        """The training loader of one DP rank for ``train_iters`` optimizer steps."""
        train, _, _ = self.datasets(train_iters * self.global_batch_size)
        return DataLoader(train, micro_batch_size=self.micro_batch_size, global_batch_size=self.global_batch_size,
                          dp_rank=dp_rank, dp_size=dp_size, consumed_samples=consumed_samples,
                          prefetch=self.prefetch, device=device)


__all__ = [
    "IndexedDataset", "IndexedDatasetWriter", "SampleSource", "GPTDataset", "BlendedDataset",
    "PackedSequenceDataset", "DataLoader", "Batch", "build_blending_indices", "blend_samples_needed", "parse_split",
    "split_document_ranges", "pack_first_fit_decreasing", "token_dtype_for_vocab", "write_default_corpus",
    "default_corpus_document", "default_corpus", "parse_blend", "PretrainData", "preprocess", "PromptTemplate",
    "SFTExamples", "build_sft_dataset", "load_sft_examples",
]
