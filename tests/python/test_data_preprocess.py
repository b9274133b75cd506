"""`megacore preprocess`: output, workers, summary, bad input, nothing half-written; tokenizers."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import megacore as mc
import megacore.data as D
from megacore.cli import main
from megacore.tokenizers import ByteTokenizer, load_tokenizer


def _jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def test_byte_tokenizer_matches_cpp():
    t = ByteTokenizer()
    assert t.encode("hé") == [104, 0xC3, 0xA9]
    assert t.decode(t.encode("hé") + [t.eos_id]) == "hé"
    assert (t.eos_id, t.pad_id, t.bos_id, t.vocab_size) == (mc._C.data.BYTE_EOS, mc._C.data.BYTE_PAD,
                                                            mc._C.data.BYTE_BOS, mc._C.data.BYTE_VOCAB_SIZE)


def test_preprocess_cli_round_trip(tmp_path, capsys):
    docs = [f"document {i}: " + "abc " * (i % 7) for i in range(300)]
    inp = _jsonl(tmp_path / "docs.jsonl", [{"text": d, "id": i} for i, d in enumerate(docs)])
    out = str(tmp_path / "out" / "corpus")
    assert main(["preprocess", "--input", inp, "--output-prefix", out, "--tokenizer", "byte"]) == 0
    line = capsys.readouterr().out
    assert "300 documents" in line and "tokens/s" in line
    ds = D.IndexedDataset(out + "_text_document")
    assert ds.num_documents == 300 and ds.dtype == "u16"
    for i in (0, 17, 299):
        assert ByteTokenizer().decode(ds[i]) == docs[i]
        assert ds[i][-1] == ByteTokenizer.eos_id
    assert sorted(os.listdir(tmp_path / "out")) == ["corpus_text_document.bin", "corpus_text_document.idx"]


def test_preprocess_workers_give_identical_files(tmp_path):
    inp = _jsonl(tmp_path / "d.jsonl", [{"text": f"w{i} " * (1 + i % 13)} for i in range(700)])
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    s1 = D.preprocess(inp, a, workers=1, log=False)
    s2 = D.preprocess(inp, b, workers=2, log=False)
    assert s1["documents"] == s2["documents"] == 700 and s1["tokens"] == s2["tokens"]
    for ext in (".bin", ".idx"):
        assert open(a + ext, "rb").read() == open(b + ext, "rb").read()


@pytest.mark.parametrize("bad,line,match", [
    ('{"text": "ok"', 2, "malformed JSON"),
    ('{"body": "no text field"}', 2, "missing key 'text'"),
    ('{"text": ""}', 2, "empty"),
    ('{"text": 5}', 2, "not a string"),
])
def test_preprocess_bad_lines(tmp_path, bad, line, match):
    inp = _jsonl(tmp_path / "d.jsonl", [{"text": "first"}, bad, {"text": "third"}])
    out = str(tmp_path / "o")
    with pytest.raises(mc.ValueError, match=match) as e:
        D.preprocess(inp, out, log=False)
    assert f"d.jsonl:{line}:" in str(e.value) and "--on-error skip" in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["d.jsonl"]  # nothing half-written
    s = D.preprocess(inp, out, on_error="skip", log=False)
    assert s["documents"] == 2 and sum(s["skipped"].values()) == 1
    assert D.IndexedDataset(out).num_documents == 2


def test_preprocess_cli_errors_are_one_line(tmp_path, capsys):
    inp = _jsonl(tmp_path / "d.jsonl", ["not json"])
    assert main(["preprocess", "--input", inp, "--output-prefix", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "d.jsonl:1: malformed JSON" in err and "Traceback" not in err
    assert main(["preprocess", "--input", str(tmp_path / "nope.jsonl"), "--output-prefix", "x"]) == 1
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["preprocess", "--output-prefix", "x"])


def test_cli_module_entry_point_and_default_corpus(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = str(tmp_path / "c")
    r = subprocess.run([sys.executable, "-m", "megacore.cli", "preprocess", "--default-corpus", "20",
                        "--output-prefix", out], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "20 documents" in r.stdout
    assert "\r" not in r.stderr  # no progress bar when not on a terminal
    assert D.IndexedDataset(out).num_documents == 20


def test_hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>", "<pad>"])
    text = ["the cat sat on the mat", "two plus two is four", "the dog ran"] * 20
    tok.train_from_iterator(text, trainer)
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)

    t = load_tokenizer(path)
    assert t.eos_id == tok.token_to_id("</s>") and t.pad_id == tok.token_to_id("<pad>")
    assert t.encode("the cat") == tok.encode("the cat").ids
    inp = _jsonl(tmp_path / "d.jsonl", [{"text": s} for s in text])
    out = str(tmp_path / "hf")
    s = D.preprocess(inp, out, tokenizer=path, workers=2, log=False)
    ds = D.IndexedDataset(out)
    assert s["documents"] == 60 and ds.dtype == "u16"
    assert ds[1].tolist() == tok.encode(text[1]).ids + [t.eos_id]
    assert load_tokenizer(str(tmp_path)).vocab_size == t.vocab_size  # a directory holding tokenizer.json


def test_tokenizer_errors(tmp_path):
    with pytest.raises(mc.IOError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing.json"))
    with pytest.raises(mc.ConfigError):
        load_tokenizer(42)
    try:
        import tokenizers  # noqa: F401
    except ImportError:  # an existing file without the optional package: say which package to install
        f = tmp_path / "tokenizer.json"
        f.write_text("{}")
        with pytest.raises(mc.ConfigError, match="pip install tokenizers"):
            load_tokenizer(str(f))


def test_preprocess_megatron_flags_write_one_dataset_per_key(tmp_path, capsys):
    rows = [{"text": f"body {i} " * (1 + i % 5), "title": f"title {i}", "id": i} for i in range(40)]
    inp = _jsonl(tmp_path / "d.jsonl", rows)
    out = str(tmp_path / "out" / "wiki")
    assert main(["preprocess", "--input", inp, "--output-prefix", out, "--json-keys", "text", "title",
                 "--tokenizer-type", "ByteTokenizer", "--append-eod", "--workers", "2"]) == 0
    printed = capsys.readouterr().out
    assert "wiki_text_document.bin/.idx" in printed and "wiki_title_document.bin/.idx" in printed
    assert sorted(os.listdir(tmp_path / "out")) == ["wiki_text_document.bin", "wiki_text_document.idx",
                                                    "wiki_title_document.bin", "wiki_title_document.idx"]
    text, title = D.IndexedDataset(out + "_text_document"), D.IndexedDataset(out + "_title_document")
    assert text.num_documents == title.num_documents == 40
    for i in (0, 13, 39):  # document i of every output comes from line i
        assert ByteTokenizer().decode(text[i]) == rows[i]["text"] and text[i][-1] == ByteTokenizer.eos_id
        assert ByteTokenizer().decode(title[i]) == rows[i]["title"] and title[i][-1] == ByteTokenizer.eos_id
    # The old single-key flags still work (and name the output the same way).
    assert main(["preprocess", "--input", inp, "--output-prefix", str(tmp_path / "old"), "--json-key", "title",
                 "--tokenizer", "byte", "--no-append-eod"]) == 0
    old = D.IndexedDataset(str(tmp_path / "old_title_document"))
    assert ByteTokenizer().decode(old[3]) == rows[3]["title"] and old[3][-1] != ByteTokenizer.eos_id


def test_preprocess_tokenizer_types(tmp_path, capsys):
    inp = _jsonl(tmp_path / "d.jsonl", [{"text": "hello"}])
    out = str(tmp_path / "o")
    assert main(["preprocess", "--input", inp, "--output-prefix", out, "--tokenizer-type",
                 "SentencePieceTokenizer"]) == 1
    err = capsys.readouterr().err
    assert "'SentencePieceTokenizer' is not supported" in err
    for valid in ("HuggingFaceTokenizer", "GPT2BPETokenizer", "ByteTokenizer"):
        assert valid in err
    for t in ("HuggingFaceTokenizer", "GPT2BPETokenizer"):
        assert main(["preprocess", "--input", inp, "--output-prefix", out, "--tokenizer-type", t]) == 1
        assert "needs --tokenizer-model" in capsys.readouterr().err
        assert main(["preprocess", "--input", inp, "--output-prefix", out, "--tokenizer-type", t,
                     "--tokenizer-model", str(tmp_path / "missing.json")]) == 1
        assert "does not exist" in capsys.readouterr().err
    assert main(["preprocess", "--input", inp, "--output-prefix", out, "--tokenizer-type", "GPT2BPETokenizer",
                 "--vocab-file", "vocab.json", "--merge-file", "merges.txt"]) == 1
    assert "save the tokenizer as one tokenizer.json" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["d.jsonl"]


def test_preprocess_wrong_type_is_not_a_missing_field(tmp_path, capsys):
    inp = _jsonl(tmp_path / "d.jsonl", [{"text": "ok", "title": "t"}, {"text": "fine", "title": 42}])
    out = str(tmp_path / "new" / "deeper" / "o")
    assert main(["preprocess", "--input", inp, "--output-prefix", out, "--json-keys", "text", "title"]) == 1
    err = capsys.readouterr().err
    assert "d.jsonl:2: key 'title' holds a number (42), not a string" in err
    assert "missing" not in err
    assert sorted(os.listdir(tmp_path)) == ["d.jsonl"]  # no output folder, nothing partial
    s = D.preprocess(inp, out, json_keys=["text", "title"], on_error="skip", log=False)
    assert s["skipped"] == {"wrong type": 1} and s["documents"] == 1
    assert D.IndexedDataset(out + "_title_document").num_documents == 1


def test_failed_run_leaves_no_folder_even_after_documents_were_written(tmp_path):
    rows = [{"text": f"doc {i}"} for i in range(600)] + ['{"text": 1.5}']  # fails in the third chunk
    inp = _jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(mc.ValueError, match="d.jsonl:601: key 'text' holds a number"):
        D.preprocess(inp, str(tmp_path / "a" / "b" / "o"), json_keys=["text"], log=False)
    assert sorted(os.listdir(tmp_path)) == ["d.jsonl"]
