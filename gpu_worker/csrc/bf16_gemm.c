/* out[M, n_out] = x[M, K] @ W^T for bf16 x and W with fp32 accumulation and bf16 out, on CPUs with AVX512-BF16.
 *
 * A bf16 worker uses it where a start-up timing finds it faster than oneDNN's packed GEMM (gpu_worker/bf16_gemm.py;
 * bench/bf16_gemm.py compares the two per shape). A version with a mixed batch's LoRA expand fused in measured no
 * faster than the LoRA kernel after it (branch experiment/fused-lora-gemm; docs/performance.md).
 *
 * The packed layout and the register tiles are in bf16_tiles.h. Threads: OpenMP over panels (torch's libgomp, one
 * pool).
 */
#include "bf16_tiles.h"

/* The entry point: one block of int64 (gpu_worker.native_build.arg_block):
 *   [0] M, [1] K (even), [2] n_out, [3] x (bf16, row stride [4] elements), [5] wp (the packed panels of
 *   ceil(n_out / 48) * 48 columns), [6] out (bf16, row stride [7] elements).
 * Returns 0 = done, 1 = bad arguments (K odd or not positive), 3 = not built with AVX512-BF16. */
int loom_bf16_gemm(const int64_t* a) {
#if HAVE_GEMM
    const int64_t M = a[0], K = a[1], n_out = a[2], xs = a[4], os = a[7];
    const uint16_t* x = (const uint16_t*)a[3];
    const uint16_t* wp = (const uint16_t*)a[5];
    uint16_t* out = (uint16_t*)a[6];
    if (K <= 0 || K % 2 || M < 0 || n_out < 0) return 1;
    const int64_t np = (n_out + NR - 1) / NR;
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (int64_t p = 0; p < np; p++) gemm_panel(p, M, K, n_out, x, xs, wp, out, os, NULL);
    return 0;
#else
    (void)a;
    return 3;
#endif
}
