"""megacore.checkpoint from Python: the compiled collective save/load (one rank here; resharding across
ranks is tested under mpirun in tests/cpp/checkpoint/mpi_test_dist_checkpoint.cpp) and the numpy
reader/writer of the same format agree with each other in both directions, the shard files are plain
safetensors (read by the official `safetensors` package when it is installed), and corruption is a
megacore.IOError."""

import json
import os
import zlib

import numpy as np
import pytest

import megacore as mc
from megacore import checkpoint as ck


@pytest.fixture(scope="module")
def world():
    return mc.comm.init_from_env("cpu")


def test_crc32_matches_zlib():
    data = os.urandom(1000)
    for n in (0, 1, 7, 8, 9, 999):
        assert mc._C.checkpoint.crc32(data[:n]) == zlib.crc32(data[:n])


def test_compiled_save_reads_back_with_numpy_and_reshards(tmp_path, world):
    rng = np.random.default_rng(0)
    full = rng.standard_normal((6, 4)).astype(np.float32)
    ids = np.arange(5, dtype=np.int64)
    # A piece that leaves part of its tensor unwritten is refused at commit: nothing is published.
    with pytest.raises(mc.IOError, match="cover 8 of its 24"):
        ck.save(world, str(tmp_path), 2, [("w", full[:2], [6, 4], [0, 0])])
    assert ck.resolve(str(tmp_path)) is None
    d = ck.save(world, str(tmp_path), 3, [("w", full, [6, 4], [0, 0]), ("ids", ids, [5], [0])],
                json={"sched": '{"lr": 0.5}'}, val_loss=1.5)
    assert d == str(tmp_path / "step_3")
    assert ck.resolve(str(tmp_path)) == d
    t, meta = ck.load_full_checkpoint(str(tmp_path))
    assert np.array_equal(t["ids"], ids) and np.array_equal(t["w"], full)
    assert meta["json"]["sched"] == {"lr": 0.5} and meta["val_loss"] == 1.5 and meta["step"] == 3
    # Load into a different split: columns instead of rows.
    a = np.zeros((6, 2), np.float32)
    b = np.zeros((6, 2), np.float32)
    d1 = ck.save(world, str(tmp_path / "r"), 1, [("w", full, [6, 4], [0, 0])])
    info = ck.load(world, d1, [("w", mc.from_numpy(a), [6, 4], [0, 0])])
    assert info["step"] == 1
    # from_numpy shares memory, so a holds columns 0..1 of w
    assert np.array_equal(a, full[:, :2])
    ck.load(world, d1, [("w", mc.from_numpy(b), [6, 4], [0, 2])])
    assert np.array_equal(b, full[:, 2:])


def test_numpy_writer_loads_with_compiled_loader(tmp_path, world):
    rng = np.random.default_rng(1)
    t = {"a": rng.standard_normal((3, 5)).astype(np.float32),
         "b": ck.BF16Array.from_float32(rng.standard_normal(7))}
    ck.save_full_checkpoint(str(tmp_path), 9, t, {"config": {"x": 1}})
    out = np.zeros((3, 5), np.float32)
    info = ck.load(world, str(tmp_path), [("a", mc.from_numpy(out), [3, 5], [0, 0])])
    assert info["step"] == 9 and json.loads(info["json"]["config"]) == {"x": 1}
    assert np.array_equal(out, t["a"])
    got = np.asarray(ck.read_full(str(tmp_path), "b").to("f32").numpy())  # bf16 -> f32 is exact
    assert np.array_equal(got.view(np.uint32), t["b"].to_float32().view(np.uint32))


def test_shard_files_are_plain_safetensors(tmp_path, world):
    st = pytest.importorskip("safetensors.numpy")
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    d = ck.save(world, str(tmp_path), 0, {"x": x})
    loaded = st.load_file(os.path.join(d, "shard_00000.safetensors"))
    assert np.array_equal(loaded["x[0,0]"], x)
    # ... and files written by the official writer read with ours.
    st.save_file({"y": x}, str(tmp_path / "o.safetensors"))
    assert np.array_equal(ck.read_safetensors(str(tmp_path / "o.safetensors"))["y"], x)


def test_corruption_is_an_ioerror(tmp_path, world):
    x = np.arange(64, dtype=np.float32)
    d = ck.save(world, str(tmp_path), 0, {"x": x})
    shard = os.path.join(d, "shard_00000.safetensors")
    raw = bytearray(open(shard, "rb").read())
    raw[-5] ^= 1
    open(shard, "wb").write(bytes(raw))
    out = np.zeros(64, np.float32)
    with pytest.raises(mc.IOError, match="CRC"):
        ck.load(world, str(tmp_path), [("x", mc.from_numpy(out), [64], [0])])
    with pytest.raises(mc.IOError, match="CRC"):
        ck.load_full_checkpoint(str(tmp_path))
    with pytest.raises(mc.IOError, match="no tensor"):
        ck.load(world, str(tmp_path), [("nope", mc.from_numpy(out), [64], [0])])
    open(shard, "wb").write(bytes(raw[:100]))
    with pytest.raises(mc.IOError):
        ck.load(world, str(tmp_path), [("x", mc.from_numpy(out), [64], [0])])
