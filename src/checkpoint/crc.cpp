// The checksums checkpoint files carry (declared in sharded_tensor.hpp): CRC-32 (IEEE, format 1) and
// CRC-32C (Castagnoli, format 2). Both are reflected CRCs with pre- and post-inversion; the software
// path is slicing-by-8 for either polynomial, and CRC-32C uses SSE4.2's crc32 instruction when the CPU
// has one, in three interleaved streams joined with a carry-less multiply by x^(8·len) mod P.
#include <array>
#include <bit>
#include <cstdint>
#include <cstring>

#include "megacore/checkpoint/sharded_tensor.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define MC_CRC32C_SSE42 1
#else
#define MC_CRC32C_SSE42 0
#endif

namespace megacore::checkpoint {

static_assert(std::endian::native == std::endian::little, "the checkpoint CRC and safetensors assume little-endian");

namespace {

constexpr uint32_t kPolyIeee = 0xEDB88320u;        // reflected 0x04C11DB7
constexpr uint32_t kPolyCastagnoli = 0x82F63B78u;  // reflected 0x1EDC6F41

// table[k][b] is the CRC of byte b followed by k zero bytes, so eight input bytes fold into the state
// with eight lookups.
struct CrcTables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  explicit CrcTables(uint32_t poly) {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ poly : c >> 1;
      t[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; ++b)
      for (int k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFF];
  }
};

const CrcTables& tables(uint32_t poly) {
  static const CrcTables ieee(kPolyIeee), castagnoli(kPolyCastagnoli);
  return poly == kPolyIeee ? ieee : castagnoli;
}

// Advances the raw (uninverted) CRC state `c` over n bytes.
uint32_t slice8(const CrcTables& tab, uint32_t c, const uint8_t* p, size_t n) {
  const auto& t = tab.t;
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    c = (c >> 8) ^ t[0][(c ^ *p++) & 0xFF];
    --n;
  }
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^ t[3][hi & 0xFF] ^
        t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xFF];
  return c;
}

// Polynomials over GF(2) in the reflected order of the CRC (bit 31 is x^0): a·b mod P.
uint32_t gf2_mulmod(uint32_t a, uint32_t b, uint32_t poly) {
  uint32_t prod = 0;
  for (int i = 0; i < 32; ++i) {
    if (a & (0x80000000u >> i)) prod ^= b;
    b = (b & 1) ? (b >> 1) ^ poly : b >> 1;  // b·x
  }
  return prod;
}

// x^(8·nbytes) mod P: what appending nbytes zero bytes multiplies a raw CRC state by.
uint32_t x8n_mod(uint64_t nbytes, uint32_t poly) {
  uint32_t result = 0x80000000u, base = 0x80000000u >> 8;  // 1 and x^8
  for (; nbytes != 0; nbytes >>= 1) {
    if (nbytes & 1) result = gf2_mulmod(result, base, poly);
    base = gf2_mulmod(base, base, poly);
  }
  return result;
}

#if MC_CRC32C_SSE42
constexpr size_t kStream = 8192;  // bytes per stream of one interleaved block

__attribute__((target("sse4.2"))) uint32_t crc32c_hw_1(uint32_t c, const uint8_t* p, size_t n) {
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    c = _mm_crc32_u8(c, *p++);
    --n;
  }
  uint64_t c64 = c;
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c64 = _mm_crc32_u64(c64, v);
  }
  c = uint32_t(c64);
  while (n-- > 0) c = _mm_crc32_u8(c, *p++);
  return c;
}

// The instruction has a latency of three cycles and a throughput of one: three independent streams
// keep it busy, and the streams' states are joined by shifting the earlier ones past the later bytes.
__attribute__((target("sse4.2"))) uint32_t crc32c_hw(uint32_t c, const uint8_t* p, size_t n) {
  static const uint32_t shift = x8n_mod(kStream, kPolyCastagnoli);
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    c = _mm_crc32_u8(c, *p++);
    --n;
  }
  while (n >= 3 * kStream) {
    uint64_t a = c, b = 0, d = 0;
    const uint8_t* q = p;
    for (size_t i = 0; i < kStream; i += 8, q += 8) {
      uint64_t va, vb, vd;
      std::memcpy(&va, q, 8);
      std::memcpy(&vb, q + kStream, 8);
      std::memcpy(&vd, q + 2 * kStream, 8);
      a = _mm_crc32_u64(a, va);
      b = _mm_crc32_u64(b, vb);
      d = _mm_crc32_u64(d, vd);
    }
    c = gf2_mulmod(shift, gf2_mulmod(shift, uint32_t(a), kPolyCastagnoli) ^ uint32_t(b), kPolyCastagnoli) ^ uint32_t(d);
    p += 3 * kStream;
    n -= 3 * kStream;
  }
  return crc32c_hw_1(c, p, n);
}

bool have_sse42() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#endif

}  // namespace

uint32_t crc32(const void* data, size_t n, uint32_t crc) {
  return ~slice8(tables(kPolyIeee), ~crc, static_cast<const uint8_t*>(data), n);
}

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
#if MC_CRC32C_SSE42
  if (have_sse42()) return ~crc32c_hw(~crc, p, n);
#endif
  return ~slice8(tables(kPolyCastagnoli), ~crc, p, n);
}

uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  return gf2_mulmod(x8n_mod(len_b, kPolyCastagnoli), crc_a, kPolyCastagnoli) ^ crc_b;
}

namespace detail {
uint32_t crc32c_software(const void* data, size_t n, uint32_t crc) {
  return ~slice8(tables(kPolyCastagnoli), ~crc, static_cast<const uint8_t*>(data), n);
}
}  // namespace detail

}  // namespace megacore::checkpoint
