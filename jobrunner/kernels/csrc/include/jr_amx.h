/* The AMX set-up every tile kernel shares (amx_attention.c, amx_gemm.c): the OS permission for the tile state
   and the one tile configuration they use. Include only from sources built with -mamx-tile, or with
   -DJR_TILE_AVX512 -mavx512bf16: then the tile operations run on AVX-512 BF16 instead (jr_tile_avx512.h). */
#ifndef JR_AMX_H
#define JR_AMX_H

#ifdef JR_TILE_AVX512
#include "jr_tile_avx512.h"
#else

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define JR_ARCH_REQ_XCOMP_PERM 0x1023
#define JR_XFEATURE_XTILEDATA 18

typedef struct {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} JrTileConfig;

/* Linux hands out the AMX tile state only on request (once per process; each library asks for itself) */
static int amx_permitted(void) {
  static int state = 0; /* 0 unknown, 1 yes, -1 no */
  if (state == 0) state = syscall(SYS_arch_prctl, JR_ARCH_REQ_XCOMP_PERM, JR_XFEATURE_XTILEDATA) == 0 ? 1 : -1;
  return state == 1;
}

/* all eight tiles 16 rows x 64 bytes (this thread; call inside each parallel region) */
static void configure_tiles(void) {
  JrTileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int i = 0; i < 8; i++) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  _tile_loadconfig(&cfg);
}

#endif /* JR_TILE_AVX512 */
#endif
