"""Distributed checkpoints from Python.

Two halves:

* The compiled, collective API (``save``, ``load``, ``resolve``, ``list_checkpoints``, ``read_full``,
  ``tensor_names``) from ``megacore._C.checkpoint``: every rank writes its own shards in parallel and
  loading reshards to any layout (see docs/checkpoint.md and include/megacore/checkpoint/dist_checkpoint.hpp).
* A small numpy reader/writer of the same on-disk format (``save_full_checkpoint``,
  ``load_full_checkpoint``, ``read_safetensors``, ``write_safetensors``), for single-process tools such as
  ``megacore.convert`` that handle whole tensors. It follows the same crash-safe protocol (temporary
  directory, fsync, rename, atomic ``latest``) and checks every CRC-32 on read. Safetensors headers are
  validated by the C++ reader (``SafetensorsReader``), so Python and C++ accept exactly the same files.

Tensors in the numpy half are numpy arrays; bfloat16 (which numpy lacks) travels as ``BF16Array``, a
uint16 array of the raw bits tagged with its dtype, so conversions are bit-exact.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
import zlib
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from .errors import IOError as MegacoreIOError

try:  # the compiled half is optional for the numpy tools
    from ._C import checkpoint as _ck
except Exception:  # pragma: no cover - only without the extension
    _ck = None

FORMAT = "megacore-distributed-checkpoint"
# The numpy writer writes format 1 (a CRC-32 per entry, zlib's); the compiled saver writes format 2 (CRC-32C).
# The readers of both halves read both.
VERSION = 1

# ----------------------------------------------------------------------------- compiled API

def _need_c():
    if _ck is None:
        raise ImportError("megacore._C is not built; build megacore with -DMEGACORE_BUILD_PYTHON=ON")
    return _ck


def save(world, root, step, tensors, json=None, extra_tensors=None, val_loss=None, verify=False, threads=0):
    """Collective save to ``root/step_<step>``. ``tensors``: ``{name: tensor}`` (whole tensors, written once)
    or a list of ``(name, local, global_shape, global_offsets[, write])``. ``json``: ``{name: JSON text}``.
    ``verify``: also re-read the written files and check their CRCs (the loader checks them either way)."""
    return _need_c().save(world, root, step, tensors, json or {}, extra_tensors, val_loss, verify, threads)


def async_saver(world, verify=False, threads=0, host_memory_limit=-1):
    """An async saver: ``saver.save(root, step, tensors, json=None, extra_tensors=None, val_loss=None)`` returns
    once the tensors are snapshotted in host memory (reused buffers; page-locked for GPU tensors) and writes in
    a background thread; ``saver.wait()`` (or the next save) commits, collectively. The snapshot needs host
    memory for one copy of this rank's tensors; when it does not fit ``host_memory_limit`` (-1: 90% of
    MemAvailable, shared among the ranks on the host) the save is written synchronously instead
    (``saver.last_save_was_synchronous``)."""
    return _need_c().AsyncSaver(world, verify, threads, host_memory_limit)


def load(world, path, tensors, verify=True, allow_missing=False, threads=0):
    """Fills ``tensors`` (same forms as ``save``) in place from the checkpoint at ``path`` (a step directory
    or a root with ``latest``), ``threads`` tensors at a time (0: min(8, CPU threads)). Returns
    ``{dir, step, json, val_loss, bytes_read}``."""
    return _need_c().load(world, path, tensors, verify, allow_missing, threads)


def resolve(path):
    """The checkpoint directory to load from ``path``, or None (pure Python; same rule as the C++ one)."""
    return resolve_checkpoint(path)


def read_full(path, name, verify=True):
    return _need_c().read_full(path, name, verify)


# ----------------------------------------------------------------------------- numpy half

class BF16Array(np.ndarray):
    """Raw bfloat16 bits (uint16) that remember they are bfloat16."""

    def __new__(cls, bits):
        return np.asarray(bits, dtype=np.uint16).view(cls)

    def to_float32(self) -> np.ndarray:
        return (np.asarray(self, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)

    @staticmethod
    def from_float32(x) -> "BF16Array":
        """Round-to-nearest-even, as megacore and torch do."""
        u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
        r = ((u >> 16) & 1) + 0x7FFF
        return BF16Array(((u + r) >> 16).astype(np.uint16))


_NP_OF = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def dtype_name(a: np.ndarray) -> str:
    if isinstance(a, BF16Array):
        return "BF16"
    for name, t in _NP_OF.items():
        if a.dtype == t:
            return name
    raise ValueError(f"numpy dtype {a.dtype} has no safetensors name; use one of {sorted(_NP_OF)} or BF16Array")


def _array_of(dtype: str, buf, shape) -> np.ndarray:
    if dtype == "BF16":
        return BF16Array(np.frombuffer(buf, dtype=np.uint16).reshape(shape))
    if dtype not in _NP_OF:
        raise MegacoreIOError(f"safetensors dtype {dtype} is not supported here; supported: BF16, {sorted(_NP_OF)}")
    return np.frombuffer(buf, dtype=_NP_OF[dtype]).reshape(shape)


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, data: bytes):
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray], metadata: Optional[Mapping[str, str]] = None):
    """Writes a safetensors file atomically (temporary name, fsync, rename). Returns {name: crc32}."""
    header: Dict[str, Any] = {}
    offset = 0
    blobs = []
    crcs = {}
    for name, a in tensors.items():
        dt = dtype_name(a)
        raw = np.ascontiguousarray(a).view(np.uint8).tobytes() if a.size else b""
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
        crcs[name] = zlib.crc32(raw)
    if metadata:
        header["__metadata__"] = dict(metadata)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for b in blobs:
                f.write(b)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    return crcs


class SafetensorsReader:
    """A memory-mapped safetensors file; ``get(name)`` returns a read-only array viewing the file.

    The header is read and validated by the C++ reader (``megacore._C.checkpoint.SafetensorsFile``), the one
    reader both languages share: tensors must tile the data section exactly (no overlap, no hole), each
    tensor's byte count must match its dtype and shape, the header must be a JSON object within the file, and
    names must be unique. Every problem is a ``megacore.IOError`` naming the file and the tensor. The arrays
    handed out view this object's own read-only mapping of the file, so nothing is copied.
    """

    def __init__(self, path: str):
        self.path = path
        self._file = _need_c().SafetensorsFile(path)  # raises megacore.IOError naming the file and the problem
        self.metadata = dict(self._file.metadata)
        self.entries = {n: self._file.info(n) for n in self._file.names()}
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise MegacoreIOError(f"safetensors file '{path}': cannot map ({e})") from e
        self._start = size - self._file.data_size

    def names(self):
        return list(self.entries)

    def _entry(self, name: str) -> dict:
        e = self.entries.get(name)
        if e is None:
            raise MegacoreIOError(f"safetensors file '{self.path}' has no tensor '{name}' (it has "
                                  f"{len(self.entries)}: {', '.join(list(self.entries)[:5])}, ...)")
        return e

    def raw(self, name: str) -> memoryview:
        b, e = self._entry(name)["data_offsets"]
        return memoryview(self._mm)[self._start + b:self._start + e]

    def get(self, name: str) -> np.ndarray:
        e = self._entry(name)
        return _array_of(e["dtype"], self.raw(name), tuple(e["shape"]))


def _entry_crc(shard: dict, raw) -> int:
    """The checksum a metadata.json shard entry carries, of ``raw``: CRC-32C (format 2) or CRC-32 (format 1)."""
    if "crc32c" in shard:
        if _ck is None:
            raise ImportError("checking a format-2 checkpoint's CRC-32C needs megacore._C; build it, or pass "
                              "verify=False")
        return _ck.crc32c(raw)
    return zlib.crc32(raw)


def read_safetensors(path: str) -> Dict[str, np.ndarray]:
    r = SafetensorsReader(path)
    return {n: r.get(n) for n in r.names()}


def _read_metadata(path):
    """(metadata of the checkpoint in `path`, None) or (None, what is wrong with it: the C++ parse_metadata's words)."""
    p = os.path.join(path, "metadata.json")
    if not os.path.isfile(p):
        return None, "metadata.json is missing"
    try:
        with open(p) as f:
            m = json.load(f)
    except (OSError, ValueError) as e:
        return None, f"metadata.json cannot be read or is not valid JSON ({e})"
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        return None, f'metadata.json is not a megacore checkpoint\'s (no "format": "{FORMAT}")'
    return m, None


def _metadata(path):
    return _read_metadata(path)[0]


def checkpoint_step(path: str) -> int:
    """N of a checkpoint directory named ``step_<N>`` (any parent), -1 for another name."""
    name = os.path.basename(os.path.normpath(path)) if path else ""
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else -1


def _metadata_damage(path):
    """Why the step_<N> directory `path` cannot be loaded, or None (the C++ resolve_checkpoint's rule: the save
    protocol renames only complete directories to step_<N>, so one without valid metadata was damaged later)."""
    return _read_metadata(path)[1]


def _holds_checkpoint_files(path):
    """Whether `path` holds a checkpoint's own files (metadata.json or shard_*.safetensors), damaged or not: a
    checkpoint root that happens to be named step_<N> does not."""
    try:
        return any(n == "metadata.json" or (n.startswith("shard_") and n.endswith(".safetensors"))
                   for n in os.listdir(path))
    except OSError:
        return False


def _raise_damaged(root, bad, why, intact, named=False):
    fix = "megacore never loads a damaged checkpoint, and retention does not delete one"
    if intact:
        where = "It cannot be loaded" if named else f"It is the newest under '{root}', where a resume starts"
        raise MegacoreIOError(f"checkpoint '{bad}' is damaged: {why}. {where}: resume from the newest intact one "
                              f"with checkpoint.resume = '{intact}', or move '{bad}' out of '{root}' ({fix})")
    raise MegacoreIOError(f"checkpoint '{bad}' is damaged: {why}, and '{root}' holds no intact checkpoint: start "
                          f"without one (checkpoint.resume = ''), or move '{bad}' out of '{root}' ({fix})")


def _scan_steps(root, after):
    """(newest loadable step_<N> dir newer than `after`, (newest damaged one newer than that, why)) under root."""
    try:
        names = os.listdir(root)
    except OSError:
        return None, None
    dirs = sorted(((checkpoint_step(n), os.path.join(root, n)) for n in names
                   if checkpoint_step(n) > after and os.path.isdir(os.path.join(root, n))), reverse=True)
    damaged = None
    for step, d in dirs:
        why = _metadata_damage(d)
        if why is None:
            return (step, d), damaged
        damaged = damaged or (step, d, why)
    return None, damaged


def resolve_checkpoint(path: str) -> Optional[str]:
    """``path`` if it is a complete checkpoint, else ``path/latest``'s target if complete, else the complete
    ``step_<N>`` with the largest N; None when there is none. A damaged ``step_<N>`` (metadata.json missing or
    invalid) newer than that, or one named by ``path``, is a megacore.IOError naming the newest intact one."""
    if _metadata(path):
        return path
    if checkpoint_step(path) >= 0 and os.path.isdir(path) and _holds_checkpoint_files(path):
        why = _metadata_damage(path)
        if why:
            root = os.path.dirname(os.path.normpath(path))
            intact, _ = _scan_steps(root, -1)
            _raise_damaged(root, path, why, intact[1] if intact else None, named=True)
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        try:
            name = open(latest).read().strip()
        except OSError:
            name = ""
        if checkpoint_step(name) >= 0 and _metadata(os.path.join(path, name)):
            return os.path.join(path, name)  # a user may point it back at an older step
    chosen, damaged = _scan_steps(path, -1)
    if damaged:
        _raise_damaged(path, damaged[1], damaged[2], chosen[1] if chosen else None)
    return chosen[1] if chosen else None


def save_full_checkpoint(root: str, step: int, tensors: Mapping[str, np.ndarray],
                         json_blobs: Optional[Mapping[str, Any]] = None) -> str:
    """Writes whole tensors as a one-writer megacore checkpoint ``root/step_<step>`` (crash-safe like the
    distributed save) and points ``latest`` at it. It loads into any parallel layout. Returns the directory."""
    os.makedirs(root, exist_ok=True)
    for n in os.listdir(root):
        if n.startswith(".tmp.") or n.startswith(".trash."):
            shutil.rmtree(os.path.join(root, n), ignore_errors=True)
    tmp = os.path.join(root, f".tmp.step_{step}")
    os.makedirs(tmp)
    _fsync_dir(root)
    keyed = {f"{n}[{','.join('0' for _ in a.shape)}]": a for n, a in tensors.items()}
    crcs = write_safetensors(os.path.join(tmp, "shard_00000.safetensors"), keyed, {"format": FORMAT, "rank": "0"})
    meta = {"format": FORMAT, "version": VERSION, "step": int(step), "world_size": 1, "val_loss": None,
            "tensors": {}, "json": dict(json_blobs or {})}
    for (name, a), key in zip(tensors.items(), keyed):
        meta["tensors"][name] = {"dtype": dtype_name(a), "shape": list(a.shape), "shards": [
            {"file": "shard_00000.safetensors", "key": key, "offsets": [0] * a.ndim, "shape": list(a.shape),
             "crc32": crcs[key]}]}
    _write_atomic(os.path.join(tmp, "metadata.json"), json.dumps(meta, indent=1).encode())
    final = os.path.join(root, f"step_{step}")
    trash = None
    if os.path.exists(final):
        trash = os.path.join(root, f".trash.step_{step}")
        os.replace(final, trash)
    os.replace(tmp, final)
    _fsync_dir(root)
    _write_atomic(os.path.join(root, "latest"), f"step_{step}\n".encode())
    if trash:
        shutil.rmtree(trash, ignore_errors=True)
    return final


def load_full_checkpoint(path: str, names=None, verify: bool = True) -> Tuple[Dict[str, np.ndarray], dict]:
    """Whole tensors (assembled from every shard, CRC-checked) and the metadata of the checkpoint at ``path``
    (a step directory or a root). ``names`` limits which tensors are read."""
    d = resolve_checkpoint(path)
    if d is None:
        raise MegacoreIOError(f"'{path}' holds no complete megacore checkpoint (no metadata.json, no valid "
                              "`latest`, no complete step_<N>)")
    meta = _metadata(d)
    readers: Dict[str, SafetensorsReader] = {}
    out = {}
    for name, t in meta["tensors"].items():
        if names is not None and name not in names:
            continue
        shape = tuple(t["shape"])
        full = None
        covered = 0
        for s in t["shards"]:
            r = readers.get(s["file"])
            if r is None:
                r = readers[s["file"]] = SafetensorsReader(os.path.join(d, s["file"]))
            if s["key"] not in r.entries:
                raise MegacoreIOError(f"{d}: {s['file']} lacks entry '{s['key']}' listed in metadata.json")
            if verify and _entry_crc(s, r.raw(s["key"])) != s.get("crc32c", s.get("crc32")):
                raise MegacoreIOError(f"{d}: entry '{s['key']}' of {s['file']} fails its CRC check; the file is "
                                      "corrupt")
            piece = r.get(s["key"])
            if full is None:
                full = (BF16Array(np.empty(shape, np.uint16)) if t["dtype"] == "BF16"
                        else np.empty(shape, dtype=piece.dtype))
            sl = tuple(slice(o, o + n) for o, n in zip(s["offsets"], s["shape"]))
            full[sl] = piece
            covered += int(np.prod(s["shape"], dtype=np.int64))
        if covered != int(np.prod(shape, dtype=np.int64)):
            raise MegacoreIOError(f"{d}: the shards of '{name}' cover {covered} of {int(np.prod(shape))} elements")
        out[name] = full
    if names is not None:
        missing = [n for n in names if n not in out]
        if missing:
            raise MegacoreIOError(f"{d}: no tensor(s) {missing}")
    return out, meta


__all__ = ["save", "async_saver", "load", "resolve", "read_full", "BF16Array", "write_safetensors", "read_safetensors",
           "SafetensorsReader", "resolve_checkpoint", "save_full_checkpoint", "load_full_checkpoint", "FORMAT"]
