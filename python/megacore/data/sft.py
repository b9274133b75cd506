"""Supervised fine-tuning data: JSONL examples, prompt templates, answer-only loss, packing.

Two line formats are accepted (one JSON object per line):

* ``{"input": "...", "output": "..."}``: the prompt template renders ``input`` (and any other fields) and
  the answer template renders ``output``; loss is taken only on the answer tokens (and the EOS after them).
* ``{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}``: each message is
  rendered with its role's template; loss is taken only on what assistant messages say (their content, the
  template's text after it and the EOS), not on the role header the template puts before the content.

Each rendered piece is tokenised on its own and the pieces are concatenated, so the answer mask is exact
(no guessing where the answer starts after tokenisation).
"""

from __future__ import annotations

import builtins
import json
from dataclasses import dataclass, field

import numpy as np

from .. import _C
from ..errors import IOError, ValueError
from ..tokenizers import load_tokenizer

__all__ = ["PromptTemplate", "SFTExamples", "load_sft_examples", "build_sft_dataset", "build_sft_datasets",
           "split_counts"]


@dataclass
class PromptTemplate:
    """How examples become text. Templates are ``str.format`` strings over the example's fields."""

    prompt: str = "{input}\n"
    answer: str = "{output}"
    #: Per-role templates for chat examples; ``{content}`` is the message text.
    roles: dict = field(default_factory=lambda: {
        "system": "<|system|>\n{content}\n",
        "user": "<|user|>\n{content}\n",
        "assistant": "<|assistant|>\n{content}\n",
    })
    #: Roles whose messages carry the loss.
    answer_roles: tuple = ("assistant",)
    #: Append EOS after every answer (and train on it) so the model learns to stop.
    add_eos: bool = True


@dataclass
class SFTExamples:
    """Tokenised examples back to back: ``tokens[offsets[k]:offsets[k+1]]`` is example k."""

    tokens: np.ndarray
    answer_mask: np.ndarray
    offsets: np.ndarray
    skipped: dict
    lines: int


class _BadLine(Exception):
    """A bad input line: ``reason`` is a short category for skip counts, the message names the line and fix."""

    def __init__(self, reason, message):
        super().__init__(message)
        self.reason = reason


def _fail(path, line_no, msg, reason=None):
    raise _BadLine(reason or msg.split(";")[0].split(" (")[0], f"{path}:{line_no}: {msg}")


def _render_example(obj, template: PromptTemplate, tok, path, line_no):
    """(pieces) as a list of (ids, is_answer)."""
    eos = [tok.eos_id] if template.add_eos and tok.eos_id is not None else []
    if not isinstance(obj, dict):
        _fail(path, line_no, f"expected a JSON object, got {type(obj).__name__}; each line needs "
              '{"input": ..., "output": ...} or {"messages": [...]}')
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            _fail(path, line_no, "'messages' must be a non-empty list of {\"role\": ..., \"content\": ...}")
        pieces = []
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                _fail(path, line_no, f"message {j} needs 'role' and 'content' keys")
            role = m["role"]
            if role not in template.roles:
                _fail(path, line_no, f"message {j} has unknown role '{role}'; known roles: "
                      f"{', '.join(template.roles)} (add it to PromptTemplate.roles)")
            if role in template.answer_roles:
                # The header before {content} is given to the model, not predicted by it.
                head, _, tail = template.roles[role].partition("{content}")
                if head:
                    pieces.append((tok.encode(head.format()), False))
                pieces.append((tok.encode(str(m["content"]) + tail.format()) + eos, True))
            else:
                pieces.append((tok.encode(template.roles[role].format(content=m["content"])), False))
        if not any(a for _, a in pieces):
            _fail(path, line_no, "chat example has no assistant message, so there is nothing to train on")
        return pieces
    missing = [k for k in ("input", "output") if k not in obj]
    if missing:
        _fail(path, line_no, f"missing key{'s' if len(missing) > 1 else ''} {', '.join(repr(k) for k in missing)}; "
              'each line needs {"input": ..., "output": ...} or {"messages": [...]}', reason="missing field")
    if not isinstance(obj["output"], str) or not obj["output"].strip():
        _fail(path, line_no, "empty 'output': an example without an answer has nothing to train on",
              reason="empty output")
    try:
        prompt = template.prompt.format(**obj)
        answer = template.answer.format(**obj)
    except KeyError as e:
        _fail(path, line_no, f"the prompt template uses field {e} that this example lacks")
    return [(tok.encode(prompt), False), (tok.encode(answer) + eos, True)]


def load_sft_examples(path: str, tokenizer="byte", template: PromptTemplate | None = None,
                      on_error: str = "fail") -> SFTExamples:
    """Reads and tokenises a JSONL file of SFT examples.

    ``on_error="fail"`` raises ValueError naming the file and line of the first bad example;
    ``"skip"`` leaves bad lines out and counts them in ``skipped`` (by reason).
    """
    if on_error not in ("fail", "skip"):
        raise ValueError(f"on_error must be 'fail' or 'skip', got '{on_error}'")
    tok = load_tokenizer(tokenizer)
    template = template or PromptTemplate()
    tokens, mask, offsets = [], [], [0]
    skipped = {}
    n = 0
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise IOError(f"cannot open SFT data '{path}': {e.strerror}; pass an existing .jsonl file") from e
    with f:
        for line_no, line in enumerate(f, 1):
            n = line_no
            if not line.strip():
                continue
            try:
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    _fail(path, line_no, f"malformed JSON ({e.msg} at column {e.colno}); fix the line, or skip "
                          "bad lines (recipes: --set data.sft_on_error=skip; API: on_error='skip')",
                          reason="malformed JSON")
                pieces = _render_example(obj, template, tok, path, line_no)
                total = sum(len(ids) for ids, _ in pieces)
                if total < 2:
                    _fail(path, line_no, "example has fewer than 2 tokens")
            except _BadLine as e:
                if on_error == "fail":
                    raise ValueError(str(e)) from None
                skipped[e.reason] = skipped.get(e.reason, 0) + 1
                continue
            for ids, is_answer in pieces:
                tokens.extend(ids)
                mask.extend([1 if is_answer else 0] * len(ids))
            offsets.append(len(tokens))
    if len(offsets) == 1:
        raise ValueError(f"{path}: no usable examples in {n} lines; check the file format "
                         '({"input", "output"} or {"messages"} per line)')
    return SFTExamples(np.asarray(tokens, dtype=np.int64), np.asarray(mask, dtype=np.uint8),
                       np.asarray(offsets, dtype=np.int64), skipped, n)


def build_sft_dataset(path: str, tokenizer="byte", seq_length: int = 2048, pack: bool = True,
                      template: PromptTemplate | None = None, on_error: str = "fail", truncate: bool = True):
    """A ``PackedSequenceDataset`` of the examples in ``path``: first-fit-decreasing packed rows (or one
    example per row with ``pack=False``) with answer-only loss mask, restarting position ids and
    per-sequence boundaries. Feed it to ``DataLoader(..., shuffle=True)``."""
    tok = load_tokenizer(tokenizer)
    ex = load_sft_examples(path, tok, template, on_error)
    return _packed(ex, tok, seq_length, pack, truncate)


def _packed(ex: SFTExamples, tok, seq_length, pack, truncate):
    pad = tok.pad_id if tok.pad_id is not None else (tok.eos_id if tok.eos_id is not None else 0)
    return _C.data.PackedSequenceDataset(ex.tokens, ex.answer_mask, ex.offsets, seq_length, pack=pack, pad_id=pad,
                                         truncate=truncate)


def split_counts(n: int, split: str) -> list[int]:
    """Examples per part for Megatron-style split weights ``"969,30,1"`` (train, validation, test): cumulative
    rounding, so the parts add up to n; a part with a positive weight gets at least one example when n allows."""
    try:
        w = [float(x) for x in str(split).replace("/", ",").split(",") if x.strip()]
    except builtins.ValueError:  # float()'s, not megacore's ValueError imported above
        raise ValueError(f"data.split '{split}' must be weights like '969,30,1' (train, validation, test)") from None
    if not w or any(x < 0 for x in w) or sum(w) <= 0:
        raise ValueError(f"data.split '{split}' must be non-negative weights with a positive sum, like '969,30,1'")
    w = (w + [0.0, 0.0])[:3]
    total = sum(w)
    bounds = [0]
    for k in range(3):
        bounds.append(round(n * sum(w[:k + 1]) / total))
    counts = [bounds[k + 1] - bounds[k] for k in range(3)]
    for k in (1, 2):  # a requested validation/test part is never silently empty
        if w[k] > 0 and counts[k] == 0 and counts[0] > 1:
            counts[k], counts[0] = 1, counts[0] - 1
    return counts


def build_sft_datasets(path: str, tokenizer="byte", seq_length: int = 2048, pack: bool = True, split: str = "969,30,1",
                       seed: int = 1234, template: PromptTemplate | None = None, on_error: str = "fail",
                       truncate: bool = True):
    """(train, validation) ``PackedSequenceDataset``s: the examples of ``path`` in a seeded order, cut by the
    ``split`` weights (train, validation, test; the test part is left out), each part packed on its own so no
    row mixes examples of two parts. The validation part is None when its weight is 0."""
    tok = load_tokenizer(tokenizer)
    ex = load_sft_examples(path, tok, template, on_error)
    n = len(ex.offsets) - 1
    counts = split_counts(n, split)
    order = np.random.default_rng(seed).permutation(n)
    parts, start = [], 0
    for c in counts[:2]:
        parts.append(np.sort(order[start:start + c]))
        start += c
    if len(parts[0]) == 0:
        raise ValueError(f"{path}: the split '{split}' leaves no training examples out of {n}; give more examples or "
                         "a larger first weight")
    out = [_packed(_subset(ex, idx), tok, seq_length, pack, truncate) if len(idx) else None for idx in parts]
    return out[0], out[1]


def _subset(ex: SFTExamples, idx: np.ndarray) -> SFTExamples:
    starts, ends = ex.offsets[idx], ex.offsets[idx + 1]
    take = np.concatenate([np.arange(a, b) for a, b in zip(starts, ends)])
    offsets = np.concatenate([[0], np.cumsum(ends - starts)]).astype(np.int64)
    return SFTExamples(ex.tokens[take], ex.answer_mask[take], offsets, ex.skipped, ex.lines)
