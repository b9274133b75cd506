"""megacore.checkpoint from Python: the compiled collective save/load (one rank here; resharding across
ranks is tested under mpirun in tests/cpp/checkpoint/mpi_test_dist_checkpoint.cpp) and the numpy
reader/writer of the same format agree with each other in both directions, the shard files are plain
safetensors (read by the official `safetensors` package when it is installed), and corruption is a
megacore.IOError."""

import json
import os
import shutil
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


def test_crc32c_check_value_and_buffers():
    assert mc._C.checkpoint.crc32c(b"123456789") == 0xE3069283  # the standard CRC-32C check value
    a = np.random.default_rng(1).integers(0, 2**31, 1000, dtype=np.int64)
    whole = mc._C.checkpoint.crc32c(a)
    assert whole == mc._C.checkpoint.crc32c(a.tobytes())
    assert mc._C.checkpoint.crc32c(a[500:], mc._C.checkpoint.crc32c(a[:500])) == whole
    with pytest.raises(mc.ValueError, match="contiguous"):
        mc._C.checkpoint.crc32c(a[::2])


def _dir_bytes(d):
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


def test_async_save_snapshots_and_matches_the_synchronous_files(tmp_path, world):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 33)).astype(np.float32)
    m = rng.standard_normal((64, 33)).astype(np.float32)
    tensors = [("w", mc.from_numpy(w), [64, 33], [0, 0]), ("opt.m", mc.from_numpy(m), [64, 33], [0, 0])]
    sync_dir = ck.save(world, str(tmp_path / "sync"), 5, tensors, json={"data": '{"pos": 3}'})
    saver = ck.async_saver(world)
    assert saver.reserve(tensors) == w.nbytes + m.nbytes == saver.snapshot_bytes  # buffers before the first save
    saver.save(str(tmp_path / "async"), 5, tensors, json={"data": '{"pos": 3}'})
    assert not saver.last_save_was_synchronous and saver.snapshot_bytes == w.nbytes + m.nbytes
    w += 1.0  # a training step: the live arrays change while the save may still be written
    m *= 0.5
    assert saver.wait() == str(tmp_path / "async" / "step_5")
    assert not saver.pending
    assert _dir_bytes(sync_dir) == _dir_bytes(str(tmp_path / "async" / "step_5"))
    # A snapshot larger than the host-memory limit is written synchronously (from the live arrays).
    small = ck.async_saver(world, host_memory_limit=w.nbytes)
    small.save(str(tmp_path / "small"), 6, tensors)
    assert small.last_save_was_synchronous and small.snapshot_bytes == 0
    small.wait()
    t, _ = ck.load_full_checkpoint(str(tmp_path / "small"))
    assert np.array_equal(t["w"], w) and np.array_equal(t["opt.m"], m)


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


# ----------------------------------------------------------------------------- the one safetensors reader

def _raw_safetensors(path, header, data_len, header_bytes=None):
    """A safetensors file with a hand-written header (entries may lie) and data_len bytes of data."""
    import struct

    text = header_bytes if header_bytes is not None else json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + bytes(range(256)) * (data_len // 256) + bytes(data_len % 256))
    return str(path)


def _f32(begin, end, shape):
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


@pytest.mark.parametrize("header,data_len,match", [
    ({"q": _f32(0, 16, [4]), "k": _f32(0, 16, [4])}, 16, "overlaps"),                 # k aliases q
    ({"q": _f32(0, 16, [4]), "k": _f32(8, 24, [4])}, 24, "overlaps"),                 # partial overlap
    ({"q": _f32(0, 16, [4]), "k": _f32(32, 48, [4])}, 48, "belong to no tensor"),     # a hole
    ({"q": _f32(0, 16, [4])}, 24, "belong to no tensor"),                              # trailing bytes
    ({"q": _f32(0, 16, [2, 3])}, 16, "needs 24 bytes"),                                # shape vs size
    ({"q": _f32(0, 32, [4])}, 16, "outside the 16-byte data section"),                 # past the end
    ({"q": {"dtype": "F32", "shape": [4]}}, 16, "no 'data_offsets'"),
])
def test_safetensors_reader_rejects_inconsistent_headers(tmp_path, header, data_len, match):
    path = _raw_safetensors(tmp_path / "bad.safetensors", header, data_len)
    with pytest.raises(mc.IOError, match=match) as e:
        ck.SafetensorsReader(path)
    assert "bad.safetensors" in str(e.value)
    if "q" in str(e.value) or "k" in str(e.value):
        assert "'q'" in str(e.value) or "'k'" in str(e.value)  # the tensor is named
    with pytest.raises(mc.IOError):
        ck.read_safetensors(path)


def test_safetensors_reader_rejects_truncated_and_non_json_files(tmp_path):
    import struct

    p = tmp_path / "long.safetensors"
    p.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(mc.IOError, match="header length 1000 runs past the end") as e:
        ck.SafetensorsReader(str(p))
    assert "long.safetensors" in str(e.value)
    path = _raw_safetensors(tmp_path / "nj.safetensors", None, 0, header_bytes=b"not json at all")
    with pytest.raises(mc.IOError, match="not valid JSON") as e:
        ck.SafetensorsReader(path)
    assert "nj.safetensors" in str(e.value)
    (tmp_path / "short.safetensors").write_bytes(b"abc")
    with pytest.raises(mc.IOError, match="too short"):
        ck.SafetensorsReader(str(tmp_path / "short.safetensors"))


def test_safetensors_reader_views_the_file_and_matches_the_writer(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = ck.BF16Array.from_float32(np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3))
    ck.write_safetensors(str(tmp_path / "ok.safetensors"), {"x": x, "b": b, "e": np.zeros((0, 4), np.float32)},
                         {"k": "v"})
    r = ck.SafetensorsReader(str(tmp_path / "ok.safetensors"))
    assert r.names() == ["x", "b", "e"] and r.metadata == {"k": "v"}
    got = r.get("x")
    assert np.array_equal(got, x) and not got.flags.writeable and not got.flags.owndata  # a view of the mapping
    assert isinstance(r.get("b"), ck.BF16Array) and np.array_equal(r.get("b"), b)
    assert r.get("e").shape == (0, 4)
    with pytest.raises(mc.IOError, match="no tensor 'nope'"):
        r.get("nope")


def test_convert_refuses_a_checkpoint_whose_k_proj_aliases_q_proj(tmp_path, capsys):
    """A Hugging Face file whose k_proj entry points at q_proj's bytes is refused (exit 1, file and tensor named)."""
    from megacore import cli

    h, heads = 8, 2
    names = {"model.embed_tokens.weight": [10, h], "model.norm.weight": [h], "lm_head.weight": [10, h],
             "model.layers.0.input_layernorm.weight": [h], "model.layers.0.post_attention_layernorm.weight": [h],
             "model.layers.0.self_attn.q_proj.weight": [h, h], "model.layers.0.self_attn.k_proj.weight": [h, h],
             "model.layers.0.self_attn.v_proj.weight": [h, h], "model.layers.0.self_attn.o_proj.weight": [h, h],
             "model.layers.0.mlp.gate_proj.weight": [16, h], "model.layers.0.mlp.up_proj.weight": [16, h],
             "model.layers.0.mlp.down_proj.weight": [h, 16]}
    header, off = {}, 0
    for n, shape in names.items():
        nbytes = 4 * int(np.prod(shape))
        if n.endswith("k_proj.weight"):
            header[n] = _f32(*header["model.layers.0.self_attn.q_proj.weight"]["data_offsets"], shape)
            continue
        header[n] = _f32(off, off + nbytes, shape)
        off += nbytes
    d = tmp_path / "hf"
    d.mkdir()
    _raw_safetensors(d / "model.safetensors", header, off)
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": h, "intermediate_size": 16, "num_hidden_layers": 1,
        "num_attention_heads": heads, "num_key_value_heads": heads, "vocab_size": 10, "tie_word_embeddings": False}))
    assert cli.main(["convert", "hf-to-megacore", str(d), str(tmp_path / "mc")]) == 1
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "k_proj" in err and "overlaps" in err


def test_python_resolve_refuses_a_damaged_newest_checkpoint_like_the_loader(tmp_path):
    # megacore.checkpoint.resolve_checkpoint (the restart logic, convert, peft) and the C++ loader's
    # resolve_checkpoint apply one rule: a damaged step_<N> newer than the intact one found is an error naming it.
    root = str(tmp_path)
    s2 = ck.save_full_checkpoint(root, 2, {"x": np.zeros(3, np.float32)})
    s4 = ck.save_full_checkpoint(root, 4, {"x": np.ones(3, np.float32)})
    assert ck.resolve_checkpoint(root) == s4
    with open(os.path.join(s4, "metadata.json"), "w") as f:
        f.write('{"format": ')
    for resolve in (ck.resolve_checkpoint, mc._C.checkpoint.resolve):
        with pytest.raises(mc.IOError) as e:
            resolve(root)
        msg = str(e.value)
        assert msg.startswith(f"checkpoint '{s4}' is damaged: metadata.json cannot be read or is not valid JSON"), msg
        assert f"resume from the newest intact one with checkpoint.resume = '{s2}'" in msg, msg
    os.remove(os.path.join(s4, "metadata.json"))
    with pytest.raises(mc.IOError, match="metadata.json is missing. It is the newest"):
        ck.resolve_checkpoint(root)
    with pytest.raises(mc.IOError, match=f"It cannot be loaded: resume from the newest intact one with "
                                         f"checkpoint.resume = '{s2}'"):
        ck.resolve_checkpoint(s4)
    shutil.rmtree(s4)
    assert ck.resolve_checkpoint(root) == s2
    # A checkpoint root that happens to be named step_<N> (a save_dir, with a crashed first save) is no damaged step.
    named_root = os.path.join(root, "step_1")
    os.makedirs(os.path.join(named_root, ".tmp.step_2"))
    for resolve in (ck.resolve_checkpoint, mc._C.checkpoint.resolve):
        assert resolve(named_root) is None
