// AMX plumbing shared by the kernel files (cpu_decode.cpp: bf16 tiles, cpu_int8.cpp: int8
// tiles): the tile configuration, the CPU's feature bits and the OS's grant of the tile state.
// Header-only; built where the compiler knows AMX (-mamx-*), the kernels check
// __AMX_TILE__ and their own data type's macro.
#pragma once

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace amx {

// LDTILECFG's 64-byte operand (palette 1): per tile register its rows and bytes per row.
struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// CPUID leaf 7 EDX bits.
constexpr unsigned kBf16 = 22, kTile = 24, kInt8 = 25;

inline bool cpu_has(unsigned bit) {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (d & (1u << kTile)) && (d & (1u << bit));
}

// Linux hands out the 8 KB tile register state only on request (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); once per process (an inline function's static: one for all files).
inline bool request_tile_state() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

}  // namespace amx
