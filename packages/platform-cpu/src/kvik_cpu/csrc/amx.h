// What kvik_cpu's AMX kernels share: the process's permission to use the tiles, and their layout.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define KVIK_HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace kvik_cpu {

// Linux hands out AMX's 8 KB of tile state only to processes that ask for it; asked once.
inline bool request_amx() {
  static const bool granted = [] {
    constexpr int kArchReqXcompPerm = 0x1023;
    constexpr int kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// The LDTILECFG operand (palette 1). A tile's configuration is per thread: a kernel loads its own
// in each thread before its first tile instruction and releases the tiles when done.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  void set(int tile, int rows_, int bytes_per_row) {
    rows[tile] = static_cast<uint8_t>(rows_);
    colsb[tile] = static_cast<uint16_t>(rows_ ? bytes_per_row : 0);
  }
};

}  // namespace kvik_cpu
#endif
