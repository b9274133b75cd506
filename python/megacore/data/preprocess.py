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

__all__ = ["preprocess"]

_CHUNK_LINES = 256

# Per-worker state, set once by _init_worker (a tokenizer is too heavy to send with every chunk).
_W = {}


def _init_worker(tokenizer_spec, json_key, append_eod):
    _W["tok"] = load_tokenizer(tokenizer_spec)
    _W["key"] = json_key
    _W["eod"] = append_eod


def _process_chunk(chunk):
    """(first line number, [raw lines]) -> (bytes read, [(line number, ids or None, error reason, message)])."""
    first, lines = chunk
    tok, key, eod = _W["tok"], _W["key"], _W["eod"]
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
        if not isinstance(obj, dict) or key not in obj:
            have = ", ".join(repr(k) for k in obj) if isinstance(obj, dict) else type(obj).__name__
            out.append((line_no, None, "missing field",
                        f"missing key '{key}' (found: {have or 'nothing'}); pick the field with --json-key"))
            continue
        text = obj[key]
        if not isinstance(text, str):
            out.append((line_no, None, "missing field", f"field '{key}' is a {type(text).__name__}, not a string"))
            continue
        if not text.strip():
            out.append((line_no, None, "empty document", f"field '{key}' is empty"))
            continue
        out.append(None)
        texts.append(text)
        where.append((len(out) - 1, line_no))
    for (slot, line_no), ids in zip(where, tok.encode_batch(texts) if texts else []):
        if eod:
            ids = list(ids) + [tok.eos_id]
        out[slot] = (line_no, np.asarray(ids, dtype=np.int64), None, None)
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


def preprocess(input: str, output_prefix: str, tokenizer="byte", json_key: str = "text", workers: int = 1,
               append_eod: bool = True, on_error: str = "fail", dtype: str | None = None,
               progress: bool | None = None, log=None) -> dict:
    """Tokenises ``input`` (JSONL, one document per line under ``json_key``) into ``output_prefix``.bin/.idx.

    Bad lines (malformed JSON, missing or non-string field, empty document) raise ValueError naming the file
    and line when ``on_error="fail"``; with ``"skip"`` they are left out and counted. Blank lines are always
    skipped. Returns a summary dict (documents, tokens, seconds, tokens_per_second, skipped, ...) and, unless
    ``log`` is False, prints it as one line.
    """
    if on_error not in ("fail", "skip"):
        raise ValueError(f"on_error must be 'fail' or 'skip', got '{on_error}'")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    tok = load_tokenizer(tokenizer)
    if append_eod and tok.eos_id is None:
        raise ValueError(f"tokenizer {tok!r} has no end-of-document token; name one (HFTokenizer(path, eos=...)) or "
                         "turn off append_eod (--no-append-eod)")
    if not os.path.isfile(input):
        raise IOError(f"input '{input}' does not exist; pass a JSONL file with one {{\"{json_key}\": ...}} per line")
    dtype = dtype or _C.data.token_dtype_for_vocab(tok.vocab_size)
    total_bytes = os.path.getsize(input)
    show = sys.stderr.isatty() if progress is None else progress
    bar = _Progress(total_bytes, show)

    docs = tokens = done_bytes = 0
    skipped = {}
    t0 = time.monotonic()
    writer = _C.data.IndexedDatasetWriter(output_prefix, dtype)
    pool = None
    try:
        with open(input, "rb") as f:
            chunks = _chunks(f)
            if workers > 1:
                # fork would copy the parent's threads and C++ state; spawn-like start is safer with the extension.
                ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
                if not isinstance(getattr(tok, "spec", None), str):
                    raise ValueError(f"tokenizer {tok!r} cannot be sent to worker processes (it has no 'spec' "
                                     "string); pass 'byte' or a tokenizer.json path, or use workers=1")
                pool = ctx.Pool(workers, initializer=_init_worker, initargs=(tok.spec, json_key, append_eod))
                results = pool.imap(_process_chunk, chunks, chunksize=1)
            else:
                _init_worker(tok, json_key, append_eod)
                results = map(_process_chunk, chunks)
            for nbytes, res in results:
                done_bytes += nbytes
                for line_no, ids, reason, msg in res:
                    if ids is None:
                        if reason == "blank line":
                            continue
                        if on_error == "fail":
                            raise ValueError(f"{input}:{line_no}: {msg}; fix the line or pass --on-error skip "
                                             "(on_error='skip') to leave bad lines out")
                        skipped[reason] = skipped.get(reason, 0) + 1
                        continue
                    writer.add_document(ids)
                    docs += 1
                    tokens += len(ids)
                bar.update(done_bytes, docs, tokens, t0)
        if docs == 0:
            raise ValueError(f"{input}: no documents found (skipped: {skipped or 'none'}); check --json-key "
                             f"(now '{json_key}') and the file format")
        writer.finalize()
    except BaseException:
        writer.abort()
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
        "output_prefix": output_prefix, "documents": docs, "tokens": tokens, "seconds": secs,
        "tokens_per_second": tokens / max(secs, 1e-9), "skipped": skipped, "dtype": dtype,
        "tokenizer": repr(tok), "workers": workers,
    }
    if log is not False:
        skip = ", ".join(f"{n} {r}" for r, n in sorted(skipped.items())) or "none"
        (log or print)(f"preprocessed {docs} documents, {tokens} tokens in {secs:.2f}s "
                       f"({summary['tokens_per_second']:,.0f} tokens/s) -> {output_prefix}.bin/.idx "
                       f"[{dtype}, skipped: {skip}]")
    return summary
