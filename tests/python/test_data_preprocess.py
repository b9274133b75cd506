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
    ds = D.IndexedDataset(out)
    assert ds.num_documents == 300 and ds.dtype == "u16"
    for i in (0, 17, 299):
        assert ByteTokenizer().decode(ds[i]) == docs[i]
        assert ds[i][-1] == ByteTokenizer.eos_id
    assert sorted(os.listdir(tmp_path / "out")) == ["corpus.bin", "corpus.idx"]


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
