"""The embedded default corpus: deterministic, and learnable by a tiny model within a few hundred CPU steps."""

import numpy as np

import megacore.data as D
from megacore.tokenizers import ByteTokenizer


def test_corpus_is_deterministic(tmp_path):
    a = D.write_default_corpus(str(tmp_path / "a"), 30, 0)
    D.write_default_corpus(str(tmp_path / "b"), 30, 0)
    assert open(tmp_path / "a.bin", "rb").read() == open(tmp_path / "b.bin", "rb").read()
    assert a["documents"] == 30
    text = ByteTokenizer().decode(D.IndexedDataset(str(tmp_path / "a")).document(0))
    assert text == D.default_corpus_document(0, 0) and text.endswith("\n")
    assert D.default_corpus_document(0, 1) != text
    assert D.default_corpus(str(tmp_path), 30) == D.default_corpus(str(tmp_path), 30)


def test_tiny_model_loss_falls(tmp_path):
    """A bigram model (a 259x259 logit table trained with Adam, no BLAS so CI load does not matter) fed by
    the loader for 300 steps of 8 x 64 tokens."""
    prefix = D.default_corpus(str(tmp_path), 800)
    data = D.PretrainData(paths=[prefix], seq_length=64, global_batch_size=8, micro_batch_size=8, split="1,0,0")
    V = ByteTokenizer.vocab_size
    w = np.zeros((V, V), dtype=np.float32)
    m, v = np.zeros_like(w), np.zeros_like(w)
    losses = []
    for step, batch in enumerate(data.loader(train_iters=300)):
        x = np.asarray(batch.tokens).reshape(-1)
        y = np.asarray(batch.labels).reshape(-1)
        logits = w[x]
        logits -= logits.max(1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(1, keepdims=True)
        rows = np.arange(len(y))
        losses.append(float(-np.log(p[rows, y]).mean()))
        p[rows, y] -= 1
        g = np.zeros_like(w)
        np.add.at(g, x, p / len(y))
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        w -= 0.05 * (m / (1 - 0.9 ** (step + 1))) / (np.sqrt(v / (1 - 0.999 ** (step + 1))) + 1e-8)
    assert len(losses) == 300
    first, last = np.mean(losses[:5]), np.mean(losses[-20:])
    assert first > 5.0  # ln(259) = 5.56 at initialisation
    assert last < 0.55 * first, (first, last)
