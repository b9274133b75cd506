"""megacore._C exports exactly one dynamic symbol, PyInit__C (bindings/exports.map).

When the module exported its own copies of libstdc++ template instantiations (and the rest of the static
megacore library), the first cuDNN attention call in a Python process crashed on H100 while the C++
binaries ran it cleanly: docs/kernels.md, "cuDNN inside the Python module". This reads the module's ELF
dynamic symbol table directly (no binutils needed) and fails on any other defined global symbol.
"""
import struct
import sys

import pytest

import megacore as mc


def _defined_dynamic_symbols(path):
    """Names of the defined GLOBAL/WEAK/GNU_UNIQUE symbols in an ELF64 little-endian file's .dynsym."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "expected an ELF64 little-endian file"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _, sh_type, _, _, off, size, link, _, _, entsize in sections:
        if sh_type != 11:  # SHT_DYNSYM
            continue
        stroff = sections[link][4]
        for i in range(1, size // entsize):
            st_name, st_info, _, st_shndx = struct.unpack_from("<IBBH", data, off + i * entsize)
            bind = st_info >> 4
            if st_shndx != 0 and bind in (1, 2, 10):  # defined; GLOBAL, WEAK, GNU_UNIQUE
                end = data.index(b"\0", stroff + st_name)
                names.append(data[stroff + st_name:end].decode())
    return names


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the export list is set for Linux (ELF) builds")
def test_module_exports_only_its_entry_point():
    exported = _defined_dynamic_symbols(mc._C.__file__)
    assert exported == ["PyInit__C"], (
        f"megacore._C exports {len(exported)} symbols ({exported[:8]} ...); only PyInit__C may be exported: "
        "keep bindings/exports.map linked (bindings/CMakeLists.txt)")
