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
        "preprocess", help="tokenise a JSONL corpus into a Megatron indexed dataset (.bin/.idx)",
        description="Tokenise a JSONL file (one document per line) into OUTPUT_PREFIX.bin/.idx. Output is "
                    "written to temporary names and renamed at the end, so nothing half-written is left on error.")
    p.add_argument("--input", help="JSONL file, one JSON object per line")
    p.add_argument("--json-key", default="text", help="field holding the document text (default: text)")
    p.add_argument("--tokenizer", default="byte",
                   help="'byte' (built-in, no files) or a path to a Hugging Face tokenizer.json (default: byte)")
    p.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin and OUTPUT_PREFIX.idx")
    p.add_argument("--workers", type=int, default=1, help="tokenising worker processes (default: 1)")
    p.add_argument("--on-error", choices=("fail", "skip"), default="fail",
                   help="bad lines (malformed JSON, missing field, empty document): fail with the line number, "
                        "or skip and count them (default: fail)")
    p.add_argument("--no-append-eod", dest="append_eod", action="store_false",
                   help="do not append the end-of-document token to each document")
    p.add_argument("--dtype", default=None, help="token dtype (default: u16 for vocabularies <= 65536, else i32)")
    p.add_argument("--default-corpus", type=int, metavar="N", default=None,
                   help="instead of --input, write the built-in synthetic corpus of N documents (byte tokens)")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                   help="no progress bar (it is shown only on a terminal anyway)")
    p.set_defaults(func=_run_preprocess, parser=p)


def _run_preprocess(args) -> int:
    from .data import preprocess, write_default_corpus

    if args.default_corpus is not None:
        if args.input:
            args.parser.error("give either --input or --default-corpus, not both")
        info = write_default_corpus(args.output_prefix, args.default_corpus)
        print(f"wrote the default corpus: {info['documents']} documents, {info['tokens']} tokens -> "
              f"{args.output_prefix}.bin/.idx [u16, byte tokenizer]")
        return 0
    if not args.input:
        args.parser.error("--input is required (or --default-corpus N)")
    preprocess(args.input, args.output_prefix, tokenizer=args.tokenizer, json_key=args.json_key,
               workers=args.workers, append_eod=args.append_eod, on_error=args.on_error, dtype=args.dtype,
               progress=args.progress)
    return 0


_COMMANDS = [_add_preprocess]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megacore", description="megacore: Megatron-Core-style training tools")
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
