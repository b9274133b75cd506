"""Tokenizers: the built-in byte-level tokenizer (no files) and Hugging Face ``tokenizer.json`` files.

Every tokenizer here has the same small surface: ``encode(text) -> list[int]``, ``decode(ids) -> str``,
``vocab_size``, ``eos_id``, ``pad_id`` and ``bos_id`` (``None`` where the vocabulary has no such token),
and ``spec``, a string that ``load_tokenizer`` turns back into an equal tokenizer (what worker processes
receive instead of the object).
"""

from __future__ import annotations

import os

from .errors import ConfigError, IOError

__all__ = ["ByteTokenizer", "HFTokenizer", "load_tokenizer"]


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then ``<eos>`` = 256, ``<pad>`` = 257, ``<bos>`` = 258.

    Identical to the C++ ``megacore::data::ByteTokenizer`` that writes the default corpus.
    """

    eos_id = 256
    pad_id = 257
    bos_id = 258
    vocab_size = 259
    spec = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


# Names under which tokenizer.json files commonly store their special tokens, most specific first.
_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[CLS]")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` loaded with the optional ``tokenizers`` package.

    Special tokens are found by their usual names; pass ``eos``/``bos``/``pad`` to name them explicitly.
    Text is encoded without added special tokens (the data pipeline adds EOS itself).
    """

    def __init__(self, path: str, eos: str | None = None, bos: str | None = None, pad: str | None = None):
        # A missing file is reported first: it is wrong whether or not the optional package is installed.
        if not os.path.isfile(path):
            raise IOError(f"tokenizer file '{path}' does not exist; pass the path of a tokenizer.json "
                          "(or 'byte' for the built-in tokenizer)")
        try:
            from tokenizers import Tokenizer  # optional dependency
        except ImportError as e:
            raise ConfigError(
                f"tokenizer '{path}' needs the optional 'tokenizers' package; install it with "
                "`pip install tokenizers`, or use the built-in byte tokenizer (--tokenizer byte)") from e
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # the Rust library raises its own exception type
            raise IOError(f"cannot load tokenizer '{path}': {e}; it must be a Hugging Face tokenizer.json") from e
        self.path = os.path.abspath(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find(eos, _EOS_NAMES, "eos")
        self.bos_id = self._find(bos, _BOS_NAMES, "bos")
        self.pad_id = self._find(pad, _PAD_NAMES, "pad")
        self.spec = self.path

    def _find(self, explicit, names, what):
        if explicit is not None:
            i = self._tok.token_to_id(explicit)
            if i is None:
                raise ConfigError(f"{what} token '{explicit}' is not in the vocabulary of '{self.path}'")
            return i
        for n in names:
            i = self._tok.token_to_id(n)
            if i is not None:
                return i
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer('{self.path}', vocab_size={self.vocab_size})"


def load_tokenizer(spec) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` for the built-in tokenizer, a path to a ``tokenizer.json`` (or a directory holding one),
    or an already-built tokenizer (returned as is)."""
    if not isinstance(spec, str):
        if hasattr(spec, "encode") and hasattr(spec, "vocab_size"):
            return spec
        raise ConfigError(f"cannot use {spec!r} as a tokenizer; pass 'byte' or a path to a tokenizer.json")
    if spec == "byte":
        return ByteTokenizer()
    path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
    return HFTokenizer(path)
