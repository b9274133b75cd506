"""Tokenise a JSONL corpus into a Megatron indexed dataset (``prefix.bin`` / ``prefix.idx``).

Worker processes parse and tokenise chunks of lines; the parent writes them in input order through the
C++ writer, which writes to temporary names and renames them only when everything succeeded, so an error
or interruption leaves no half-written dataset behind.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time

import numpy as np

from .. import _C
from ..errors import IOError, ValueError
from ..tokenizers import load_tokenizer

__all__ = ["preprocess", "tokenizer_from_type", "output_prefix_for", "TOKENIZER_TYPES"]

_CHUNK_LINES = 256

# Per-worker state, set once by _init_worker (a tokenizer is too heavy to send with every chunk).
_W = {}


def _init_worker(tokenizer_spec, json_keys, append_eod):
    _W["tok"] = load_tokenizer(tokenizer_spec)
    _W["keys"] = list(json_keys)
    _W["eod"] = append_eod


def _process_chunk(chunk):
    """(first line number, [raw lines]) -> (bytes read, [(line number, [ids per key] or None, error reason,
    message)]). A line is bad as a whole when any of its keys is, so the outputs of all keys stay aligned."""
    first, lines = chunk
    tok, keys, eod = _W["tok"], _W["keys"], _W["eod"]
    out, texts, where = [], [], []
    for k, raw in enumerate(lines):
        line_no = first + k
        if not raw.strip():
            out.append((line_no, None, "blank line", "blank line"))
            continue
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            detail = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else "not UTF-8"
            out.append((line_no, None, "malformed JSON", f"malformed JSON ({detail})"))
            continue
        if not isinstance(obj, dict):
            out.append((line_no, None, "wrong type", f"the line is a JSON {type(obj).__name__}, not an object with "
                                                     f"key(s) {', '.join(repr(k) for k in keys)}"))
            continue
        bad = None
        for key in keys:
            if key not in obj:
                have = ", ".join(repr(k) for k in obj)
                bad = ("missing field", f"missing key '{key}' (found: {have or 'nothing'}); pick the field with "
                                        "--json-keys")
            elif not isinstance(obj[key], str):
                v = obj[key]
                shown = json.dumps(v)
                shown = shown if len(shown) <= 40 else shown[:37] + "..."
                kind = {bool: "boolean", int: "number", float: "number", list: "list", dict: "object",
                        type(None): "null"}.get(type(v), type(v).__name__)
                bad = ("wrong type", f"key '{key}' holds a {kind} ({shown}), not a string")
            elif not obj[key].strip():
                bad = ("empty document", f"key '{key}' is empty")
            if bad:
                break
        if bad:
            out.append((line_no, None) + bad)
            continue
        out.append(None)
        texts.extend(obj[key] for key in keys)
        where.append((len(out) - 1, line_no))
    encoded = tok.encode_batch(texts) if texts else []
    n = len(keys)
    for j, (slot, line_no) in enumerate(where):
        per_key = []
        for ids in encoded[j * n:(j + 1) * n]:
            if eod:
                ids = list(ids) + [tok.eos_id]
            per_key.append(np.asarray(ids, dtype=np.int64))
        out[slot] = (line_no, per_key, None, None)
    return sum(len(raw) for raw in lines), out


def _chunks(f):
    lines, first = [], 1
    for line_no, raw in enumerate(f, 1):
        lines.append(raw)
        if len(lines) == _CHUNK_LINES:
            yield first, lines
            lines, first = [], line_no + 1
    if lines:
        yield first, lines


class _Progress:
    """A one-line progress display, only when stderr is a terminal (logs and CI stay clean)."""

    def __init__(self, total_bytes, enabled):
        self.total = max(total_bytes, 1)
        self.enabled = enabled
        self.last = 0.0

    def update(self, done_bytes, docs, tokens, t0, final=False):
        now = time.monotonic()
        if not self.enabled or (not final and now - self.last < 0.2):
            return
        self.last = now
        frac = min(done_bytes / self.total, 1.0)
        bar = "#" * int(frac * 30)
        rate = tokens / max(now - t0, 1e-9)
        sys.stderr.write(f"\r[{bar:<30}] {frac * 100:5.1f}%  {docs} docs  {tokens} tokens  {rate:,.0f} tok/s")
        if final:
            sys.stderr.write("\n")
        sys.stderr.flush()


# Megatron-LM's --tokenizer-type names that megacore maps onto its tokenizers (tools/preprocess_data.py).
TOKENIZER_TYPES = {
    "HuggingFaceTokenizer": "a tokenizer.json (or a directory holding one) given with --tokenizer-model",
    "GPT2BPETokenizer": "GPT-2's BPE as a tokenizer.json given with --tokenizer-model (the vocab.json + merges.txt "
                        "pair is not read: save the tokenizer with tokenizers' Tokenizer.save)",
    "ByteTokenizer": "megacore's built-in byte tokenizer (no files)",
}


def tokenizer_from_type(tokenizer_type: str, tokenizer_model: str | None = None) -> str:
    """The ``tokenizer`` argument of ``preprocess`` for a Megatron ``--tokenizer-type`` (and
    ``--tokenizer-model``); ConfigError listing the valid names for any other type."""
    from ..errors import ConfigError

    if tokenizer_type not in TOKENIZER_TYPES:
        valid = "; ".join(f"{k} ({v})" for k, v in TOKENIZER_TYPES.items())
        raise ConfigError(f"--tokenizer-type '{tokenizer_type}' is not supported; valid types: {valid}")
    if tokenizer_type == "ByteTokenizer":
        if tokenizer_model:
            raise ConfigError("--tokenizer-type ByteTokenizer takes no --tokenizer-model")
        return "byte"
    if not tokenizer_model:
        raise ConfigError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model PATH: "
                          f"{TOKENIZER_TYPES[tokenizer_type]}")
    return tokenizer_model


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's naming: ``PREFIX_<key>_document`` (the .bin/.idx pair of one JSON key)."""
    return f"{output_prefix}_{key}_document"


def preprocess(input: str, output_prefix: str, tokenizer="byte", json_key: str = "text", workers: int = 1,
               append_eod: bool = True, on_error: str = "fail", dtype: str | None = None,
               progress: bool | None = None, log=None, json_keys=None) -> dict:
    """Tokenises ``input`` (JSONL, one document per line) into indexed datasets.

    With ``json_keys`` (a list, as Megatron's ``--json-keys``) each key gets its own dataset
    ``output_prefix_<key>_document``.bin/.idx (Megatron's naming; document i of every output comes from line i).
    Without it, the one key ``json_key`` is written to ``output_prefix``.bin/.idx.

    Bad lines (malformed JSON, missing key, a key whose value is not a string, empty document) raise ValueError
    naming the file, line and key when ``on_error="fail"``; with ``"skip"`` they are left out (for every key) and
    counted by reason. Blank lines are always skipped. On any error nothing is left behind: no output file and
    no directory this call created. Returns a summary dict (documents, tokens, seconds, tokens_per_second,
    skipped, outputs, ...) and, unless ``log`` is False, prints it as one line.
    """
    if on_error not in ("fail", "skip"):
        raise ValueError(f"on_error must be 'fail' or 'skip', got '{on_error}'")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if json_keys is not None:
        keys = [json_keys] if isinstance(json_keys, str) else list(json_keys)
        if not keys or len(set(keys)) != len(keys):
            raise ValueError(f"json_keys must be distinct and non-empty, got {keys}")
        prefixes = [output_prefix_for(output_prefix, k) for k in keys]
    else:
        keys, prefixes = [json_key], [output_prefix]
    tok = load_tokenizer(tokenizer)
    if append_eod and tok.eos_id is None:
        raise ValueError(f"tokenizer {tok!r} has no end-of-document token; name one (HFTokenizer(path, eos=...)) or "
                         "turn off append_eod (--no-append-eod)")
    if not os.path.isfile(input):
        raise IOError(f"input '{input}' does not exist; pass a JSONL file with one {{\"{keys[0]}\": ...}} per line")
    dtype = dtype or _C.data.token_dtype_for_vocab(tok.vocab_size)
    total_bytes = os.path.getsize(input)
    show = sys.stderr.isatty() if progress is None else progress
    bar = _Progress(total_bytes, show)

    # Directories that do not exist yet: the writers create them, and a failed run removes them again.
    new_dirs = []
    for pfx in prefixes:
        d = os.path.dirname(os.path.abspath(pfx))
        while d and not os.path.exists(d) and d not in new_dirs:
            new_dirs.append(d)
            d = os.path.dirname(d)
    new_dirs.sort(key=len, reverse=True)  # deepest first, for removal

    docs = tokens = done_bytes = 0
    skipped = {}
    t0 = time.monotonic()
    writers = []
    finalized = []
    pool = None
    try:
        for pfx in prefixes:
            writers.append(_C.data.IndexedDatasetWriter(pfx, dtype))
        with open(input, "rb") as f:
            chunks = _chunks(f)
            if workers > 1:
                # fork would copy the parent's threads and C++ state; spawn-like start is safer with the extension.
                ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
                if not isinstance(getattr(tok, "spec", None), str):
                    raise ValueError(f"tokenizer {tok!r} cannot be sent to worker processes (it has no 'spec' "
                                     "string); pass 'byte' or a tokenizer.json path, or use workers=1")
                pool = ctx.Pool(workers, initializer=_init_worker, initargs=(tok.spec, keys, append_eod))
                results = pool.imap(_process_chunk, chunks, chunksize=1)
            else:
                _init_worker(tok, keys, append_eod)
                results = map(_process_chunk, chunks)
            for nbytes, res in results:
                done_bytes += nbytes
                for line_no, per_key, reason, msg in res:
                    if per_key is None:
                        if reason == "blank line":
                            continue
                        if on_error == "fail":
                            raise ValueError(f"{input}:{line_no}: {msg}; fix the line or pass --on-error skip "
                                             "(on_error='skip') to leave bad lines out")
                        skipped[reason] = skipped.get(reason, 0) + 1
                        continue
                    for w, ids in zip(writers, per_key):
                        w.add_document(ids)
                        tokens += len(ids)
                    docs += 1
                bar.update(done_bytes, docs, tokens, t0)
        if docs == 0:
            raise ValueError(f"{input}: no documents found (skipped: {skipped or 'none'}); check --json-keys "
                             f"(now {', '.join(keys)}) and the file format")
        for w, pfx in zip(writers, prefixes):
            w.finalize()
            finalized.append(pfx)
    except BaseException:
        for w in writers[len(finalized):]:
            w.abort()
        for pfx in finalized:  # another key failed after these were complete: all or nothing
            for ext in (".bin", ".idx"):
                if os.path.exists(pfx + ext):
                    os.unlink(pfx + ext)
        for d in new_dirs:
            try:
                os.rmdir(d)
            except OSError:
                pass
        if pool is not None:
            pool.terminate()
        raise
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    bar.update(total_bytes, docs, tokens, t0, final=True)
    secs = time.monotonic() - t0
    summary = {
        "output_prefix": output_prefix, "outputs": dict(zip(keys, prefixes)), "documents": docs, "tokens": tokens,
        "seconds": secs, "tokens_per_second": tokens / max(secs, 1e-9), "skipped": skipped, "dtype": dtype,
        "tokenizer": repr(tok), "workers": workers,
    }
    if log is not False:
        skip = ", ".join(f"{n} {r}" for r, n in sorted(skipped.items())) or "none"
        outs = ", ".join(f"{p}.bin/.idx" for p in prefixes)
        (log or print)(f"preprocessed {docs} documents, {tokens} tokens in {secs:.2f}s "
                       f"({summary['tokens_per_second']:,.0f} tokens/s) -> {outs} "
                       f"[{dtype}, skipped: {skip}]")
    return summary
