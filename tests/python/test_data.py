"""Indexed datasets, GPT samples, blends, splits, packing and the loader through the Python API."""

import os
import struct

import numpy as np
import pytest

import megacore as mc
import megacore.data as D

_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}


def write_megatron_style(prefix, docs, code=8):
    """An independent writer of the documented .bin/.idx layout (one sequence per document)."""
    dt = _CODES[code]
    lengths = np.array([len(d) for d in docs], dtype=np.int32)
    with open(prefix + ".bin", "wb") as f:
        for d in docs:
            f.write(np.asarray(d, dtype=dt).tobytes())
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dt).itemsize)]).astype(np.int64)
    doc_idx = np.arange(len(docs) + 1, dtype=np.int64)
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(docs)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(doc_idx.tobytes())


def read_megatron_style(prefix):
    """An independent reader, the way Megatron's numpy-based reader walks the index."""
    buf = open(prefix + ".idx", "rb").read()
    assert buf[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack("<Q", buf[9:17])
    code = buf[17]
    s, d = struct.unpack("<QQ", buf[18:34])
    off = 34
    lengths = np.frombuffer(buf, np.int32, s, off)
    off += lengths.nbytes
    pointers = np.frombuffer(buf, np.int64, s, off)
    off += pointers.nbytes
    docs = np.frombuffer(buf, np.int64, d, off)
    data = np.fromfile(prefix + ".bin", dtype=_CODES[code])
    item = np.dtype(_CODES[code]).itemsize
    seqs = [data[p // item: p // item + n].tolist() for p, n in zip(pointers, lengths)]
    return version, code, seqs, docs.tolist()


def test_layout_round_trip_both_ways(tmp_path):
    docs = [[1, 2, 3], [60000], [], [7, 8, 9, 10]]
    a = str(tmp_path / "theirs")
    write_megatron_style(a, docs)
    ds = D.IndexedDataset(a)
    assert ds.dtype == "u16" and ds.num_documents == 4 and ds.num_tokens == 8
    assert [ds[i].tolist() for i in range(len(ds))] == docs
    assert ds.document(3).tolist() == [7, 8, 9, 10]

    b = str(tmp_path / "ours")
    with D.IndexedDatasetWriter(b, "u16") as w:
        for d in docs:
            w.add_document(d)
    assert open(a + ".idx", "rb").read() == open(b + ".idx", "rb").read()
    assert open(a + ".bin", "rb").read() == open(b + ".bin", "rb").read()
    version, code, seqs, doc_idx = read_megatron_style(b)
    assert (version, code, seqs, doc_idx) == (1, 8, docs, [0, 1, 2, 3, 4])


def test_writer_context_manager_aborts_on_error(tmp_path):
    p = str(tmp_path / "x")
    with pytest.raises(RuntimeError):
        with D.IndexedDatasetWriter(p, "u16") as w:
            w.add_document([1, 2])
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []
    with pytest.raises(mc.ValueError, match="does not fit"):
        D.IndexedDatasetWriter(p, "u8").add_document([256])


@pytest.mark.parametrize("damage,match", [
    ("magic", "magic"),
    ("dtype", "unknown token dtype code 9"),
    ("truncated_bin", "truncated"),
    ("truncated_idx", "truncated"),
    ("mismatch", "do not mix"),
])
def test_bad_files(tmp_path, damage, match):
    p = str(tmp_path / "d")
    write_megatron_style(p, [[1, 2, 3], [4, 5]])
    idx = bytearray(open(p + ".idx", "rb").read())
    binb = open(p + ".bin", "rb").read()
    if damage == "magic":
        idx[:3] = b"XXX"
    elif damage == "dtype":
        idx[17] = 9
    elif damage == "truncated_idx":
        idx = idx[:-5]
    elif damage == "truncated_bin":
        binb = binb[:-2]
    elif damage == "mismatch":
        binb = binb + b"\x00\x00"
    open(p + ".idx", "wb").write(bytes(idx))
    open(p + ".bin", "wb").write(binb)
    with pytest.raises(mc.IOError, match=match) as e:
        D.IndexedDataset(p)
    assert "d.idx" in str(e.value) or "d.bin" in str(e.value)
    with pytest.raises(OSError):  # megacore.IOError is an OSError too
        D.IndexedDataset(str(tmp_path / "missing"))


def _numbered(tmp_path, name, lengths):
    p = str(tmp_path / name)
    write_megatron_style(p, [[(d * 1000 + t) % 60000 for t in range(n)] for d, n in enumerate(lengths)])
    return p


def test_gpt_dataset_determinism_and_cache(tmp_path):
    p = _numbered(tmp_path, "g", [5 + (d * 11) % 40 for d in range(80)])
    ds = D.IndexedDataset(p)
    a = D.GPTDataset(ds, seq_length=32, num_samples=300, seed=7)
    b = D.GPTDataset(ds, seq_length=32, num_samples=300, seed=7)
    assert not a.loaded_from_cache and b.loaded_from_cache
    assert os.path.dirname(a.cache_path) == str(tmp_path) and a.index_hash in a.cache_path
    assert all((a.sample_tokens(i) == b.sample_tokens(i)).all() for i in range(0, 300, 17))
    c = D.GPTDataset(ds, seq_length=32, num_samples=300, seed=8, use_cache=False)
    assert not (a.shuffle_index == c.shuffle_index).all()
    assert a.sample_index.shape == (301, 2)
    row = a.get(3)
    assert (row["labels"][:-1] == row["tokens"][1:]).all()
    assert row["seq_starts"].tolist() == [0]


def _collect(loader):
    out = {}
    for b in loader:
        toks = np.asarray(b.tokens)
        for r, idx in enumerate(b.sample_indices):
            out[(b.step, idx)] = toks[r].tolist()
    return out


def test_loader_dp1_equals_union_of_dp4(tmp_path):
    p = _numbered(tmp_path, "l", [3 + (d * 7) % 50 for d in range(100)])
    train = D.GPTDataset(D.IndexedDataset(p), seq_length=16, num_samples=128, seed=1, use_cache=False)
    one = _collect(D.DataLoader(train, micro_batch_size=2, global_batch_size=16))
    union = {}
    for r in range(4):
        part = _collect(D.DataLoader(train, micro_batch_size=2, global_batch_size=16, dp_rank=r, dp_size=4))
        assert not set(part) & set(union)  # each rank reads only its own samples
        union.update(part)
    assert union == one and len(one) == 128


def test_loader_refuses_ids_outside_the_vocabulary(tmp_path):
    # documents d hold ids d * 1000 + t: with 40 documents the largest id is 39000 + 19
    p = _numbered(tmp_path, "v", [20] * 40)
    train = D.GPTDataset(D.IndexedDataset(p), seq_length=8, num_samples=64, use_cache=False)
    assert len(list(D.DataLoader(train, micro_batch_size=4, vocab_size=39020))) == 16
    with pytest.raises(mc.ValueError, match=r"token id \d+ at position \d+, outside the model's vocabulary \[0, 1000\)"):
        list(D.DataLoader(train, micro_batch_size=4, vocab_size=1000))


def test_loader_resume(tmp_path):
    p = _numbered(tmp_path, "r", [20] * 50)
    train = D.GPTDataset(D.IndexedDataset(p), seq_length=8, num_samples=64, use_cache=False)
    l = D.DataLoader(train, micro_batch_size=4, global_batch_size=8, dp_rank=1, dp_size=2)
    seen = [b.sample_indices for b in l]
    l2 = D.DataLoader(train, micro_batch_size=4, global_batch_size=8, dp_rank=1, dp_size=2, consumed_samples=24)
    assert [b.sample_indices for b in l2] == seen[3:]
    with pytest.raises(mc.ValueError, match="consumed_samples"):
        D.DataLoader(train, micro_batch_size=4, dp_size=2, consumed_samples=4)
    with pytest.raises(mc.ValueError, match="global_batch_size"):
        D.DataLoader(train, micro_batch_size=4, global_batch_size=6)


def test_blend_proportions_and_splits(tmp_path):
    a = _numbered(tmp_path, "a", [30] * 60)
    b = _numbered(tmp_path, "b", [40] * 40)
    data = D.PretrainData(paths=[0.3, a, 0.7, b], seq_length=16, global_batch_size=10, split="8,2,0")
    train, valid, test = data.datasets(2000, 100)
    assert test is None
    assert isinstance(train, D.BlendedDataset) and len(train) == 2000
    share = (train.dataset_index == 0).mean()
    assert abs(share - 0.3) < 0.01
    idx, _ = D.build_blending_indices([0.5, 0.25, 0.25], 4000)
    counts = np.bincount(idx, minlength=3) / 4000
    assert np.allclose(counts, [0.5, 0.25, 0.25], atol=0.01)
    # valid draws only from the last 20% of documents: dataset a's documents 48..59 have ids >= 48000
    for i in range(len(valid)):
        d, _ = valid.locate(i)
        if d == 0:
            assert valid.get(i)["tokens"].min() >= 48000
    assert D.parse_blend(["x", "y"]) == [(1.0, "x"), (1.0, "y")]
    for bad in ([0.3, "a", 0.7], ["a", 0.5], [0.0, "a"], []):
        with pytest.raises(mc.ConfigError):
            D.parse_blend(bad)
    loader = data.loader(train_iters=5, dp_rank=0, dp_size=2)
    assert loader.num_steps == 5


def test_packing_rows_and_cu_seqlens():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    mask = [0, 1, 1, 0, 0, 1, 0, 1, 1]
    offsets = [0, 3, 6, 9]
    ds = D.PackedSequenceDataset(tokens, mask, offsets, seq_length=7, pad_id=0)
    assert len(ds) == 2
    row = ds.get(0)
    assert row["seq_starts"].tolist() == [0, 3, 6]
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert row["labels"].tolist() == [2, 3, 0, 5, 6, 0, 0]
    assert row["loss_mask"].tolist() == [1, 1, 0, 0, 1, 0, 0]
    loader = D.DataLoader(ds, micro_batch_size=2)
    b = next(iter(loader))
    assert np.asarray(b.cu_seqlens).tolist() == [0, 3, 6, 7, 10, 14]
    assert b.max_seqlen == 4
    assert D.pack_first_fit_decreasing([3, 3, 3, 5], 7) == [[3], [0, 1], [2]]
