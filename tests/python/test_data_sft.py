"""SFT JSONL (input/output and chat), answer-only loss, packing, bad input."""

import json

import numpy as np
import pytest

import megacore as mc
import megacore.data as D
from megacore.tokenizers import ByteTokenizer


def _jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def test_input_output_loss_only_on_answer(tmp_path):
    p = _jsonl(tmp_path / "s.jsonl", [{"input": "2+2?", "output": "4"}, {"input": "hi", "output": "hello"}])
    ex = D.load_sft_examples(p, "byte", D.PromptTemplate(prompt="Q: {input}\nA: "))
    t = ByteTokenizer()
    first = ex.tokens[ex.offsets[0]:ex.offsets[1]].tolist()
    assert first == t.encode("Q: 2+2?\nA: ") + t.encode("4") + [t.eos_id]
    assert ex.answer_mask[ex.offsets[0]:ex.offsets[1]].tolist() == [0] * 11 + [1, 1]

    ds = D.build_sft_dataset(p, "byte", seq_length=64, pack=False, template=D.PromptTemplate(prompt="Q: {input}\nA: "))
    row = ds.get(0)
    m = row["loss_mask"]
    # Loss where the *label* is an answer token: the label of position 10 is "4", of 11 is EOS.
    assert np.flatnonzero(m).tolist() == [10, 11]
    assert row["labels"][10] == ord("4") and row["labels"][11] == t.eos_id


def test_chat_messages_mask_only_assistant(tmp_path):
    rows = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "yo"}, {"role": "user", "content": "bye"},
                          {"role": "assistant", "content": "ok"}]}]
    ex = D.load_sft_examples(_jsonl(tmp_path / "c.jsonl", rows))
    text = ByteTokenizer().decode(ex.tokens)
    answer = ByteTokenizer().decode(ex.tokens[ex.answer_mask == 1])
    # The loss covers what the assistant says (and the EOS), not the role header the template puts before it.
    assert answer == "yo\nok\n"
    assert text.startswith("<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\nyo\n")


def test_packing_many_examples(tmp_path):
    rows = [{"input": "x" * (i % 17 + 1), "output": "y" * (i % 5 + 1)} for i in range(200)]
    ds = D.build_sft_dataset(_jsonl(tmp_path / "p.jsonl", rows), seq_length=64)
    unpacked = D.build_sft_dataset(_jsonl(tmp_path / "p.jsonl", rows), seq_length=64, pack=False)
    assert len(ds) < len(unpacked) / 2 and ds.fill_ratio > 0.9
    seen = []
    for i in range(len(ds)):
        row = ds.get(i)
        starts = row["seq_starts"].tolist() + [64]
        for a, b in zip(starts, starts[1:]):
            assert row["position_ids"][a:b].tolist() == list(range(b - a))
            # the last position of a segment never predicts across the boundary
            assert row["loss_mask"][b - 1] == 0
        seen += ds.row_sequences(i)
    assert sorted(seen) == list(range(200))


@pytest.mark.parametrize("bad,match", [
    ('{"input": "a", "output": "b"', "malformed JSON"),
    ('{"input": "a"}', "missing key 'output'"),
    ('{"input": "a", "output": ""}', "empty 'output'"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "unknown role 'robot'"),
    ('[1, 2]', "expected a JSON object"),
])
def test_bad_sft_lines(tmp_path, bad, match):
    p = _jsonl(tmp_path / "b.jsonl", [{"input": "a", "output": "b"}, bad])
    with pytest.raises(mc.ValueError, match=match) as e:
        D.load_sft_examples(p)
    assert "b.jsonl:2:" in str(e.value)
    ex = D.load_sft_examples(p, on_error="skip")
    assert len(ex.offsets) == 2 and sum(ex.skipped.values()) == 1


def _toy_attention_loss(tokens, labels, mask, positions, seg_ids, params):
    """Sum of masked next-token losses of a one-layer causal attention model with RoPE, in numpy.

    Attention is allowed only within a segment (seg_ids) and RoPE uses the given position ids: the
    contract the packed batch hands to the real attention kernels."""
    emb, wq, wk, wv, wo = params
    x = emb[tokens]
    q, k, v = x @ wq, x @ wk, x @ wv
    half = q.shape[1] // 2
    freq = 1.0 / (100.0 ** (np.arange(half) / half))
    ang = positions[:, None] * freq[None, :]
    cos, sin = np.cos(ang), np.sin(ang)

    def rope(a):
        a1, a2 = a[:, :half], a[:, half:]
        return np.concatenate([a1 * cos - a2 * sin, a1 * sin + a2 * cos], axis=1)

    q, k = rope(q), rope(k)
    n = len(tokens)
    allowed = (seg_ids[:, None] == seg_ids[None, :]) & (np.arange(n)[:, None] >= np.arange(n)[None, :])
    s = np.where(allowed, q @ k.T / np.sqrt(q.shape[1]), -np.inf)
    s -= s.max(1, keepdims=True)
    a = np.exp(s)
    a /= a.sum(1, keepdims=True)
    logits = (a @ v) @ wo
    logits -= logits.max(1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    return float(-(logp[np.arange(n), labels] * mask).sum())


def test_packed_loss_equals_separate_losses(tmp_path):
    """Data-side half of the packing acceptance check, with a numpy attention model standing in for
    megacore's (the same check against the real GPTModel belongs with the model)."""
    rows = [{"input": "q" * (i % 9 + 2), "output": "a" * (i % 4 + 1)} for i in range(12)]
    p = _jsonl(tmp_path / "p.jsonl", rows)
    packed = D.build_sft_dataset(p, seq_length=48)
    single = D.build_sft_dataset(p, seq_length=48, pack=False)
    rng = np.random.default_rng(0)
    V, H = ByteTokenizer.vocab_size, 16
    params = [rng.normal(0, 0.5, s) for s in ((V, H), (H, H), (H, H), (H, H), (H, V))]

    def loss(ds, i, only_real=False):
        r = ds.get(i)
        seg = np.zeros(48, dtype=np.int64)
        for s in r["seq_starts"][1:]:
            seg[s:] += 1
        n = 48
        if only_real:  # drop the padding segment so the sequence is computed truly on its own
            n = int(r["seq_starts"][-1]) if len(r["seq_starts"]) > 1 else 48
        return _toy_attention_loss(r["tokens"][:n], r["labels"][:n], r["loss_mask"][:n], r["position_ids"][:n],
                                   seg[:n], params)

    packed_total = sum(loss(packed, i) for i in range(len(packed)))
    separate_total = sum(loss(single, i, only_real=True) for i in range(len(single)))
    assert len(packed) < len(single)
    assert packed_total == pytest.approx(separate_total, rel=1e-9)
