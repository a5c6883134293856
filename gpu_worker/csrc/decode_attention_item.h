/* One work item of csrc/decode_attention.c, a (row, KV head), as a function template: included once per shape with
 *   ATT_NAME  the function's name
 *   ATT_D     head_dim (a multiple of 16), or `d` for any
 *   ATT_REP   query heads per KV head, or `rep` for any
 *   ATT_BF    1 for bf16 q/k/v/out, 0 for fp32, or `bf16` for either
 *   ATT_DCAP, ATT_REPCAP  array sizes: the constants themselves, or MAXD and MAXREP for the general version.
 * With constant sizes the accumulators are fixed-size arrays indexed by constants, which the compiler keeps in
 * vector registers (a variable-length array would live on the stack).
 * q: REP heads at head stride qsh; k/v: key j at element offset KEY(j) * ks / vs, where KEY(j) is idx[j] (the
 * paged cache's slot of position j) or j when idx is 0; len keys; out: REP heads at stride osh. With part (not 0)
 * the item is one chunk of a longer history: it leaves its unnormalised state there instead (see store_part).
 * next_k, next_v, next_idx, next_len: the next work item's keys, values, slots and length (next_k 0: none), whose
 * first rows are prefetched during this item's last block. */
static void ATT_NAME(const void* q, int64_t qsh, const void* k, int64_t ks, const void* v, int64_t vs,
                     const int64_t* idx, int64_t len, float scale, void* out, int64_t osh, int d, int rep, int bf16,
                     float* part, const void* next_k, const void* next_v, const int64_t* next_idx, int64_t next_len) {
    (void)d, (void)rep, (void)bf16; /* the general version reads them; the constant versions do not */
#define KEY(j) (idx ? idx[j] : (j))
    enum { CC = ATT_DCAP / VW };
    const int D = ATT_D, REP = ATT_REP, BF = ATT_BF, C = D / VW;
    const int dot = HAVE_BF16_DOT && BF && D % 32 == 0; /* q . k on vdpbf16ps straight from bf16 */
    float kf[16 * ATT_DCAP];   /* 16 keys as fp32 (the path without vdpbf16ps) */
    float sc[ATT_REPCAP * BK]; /* scores, then probabilities, of one block of keys */
    v16 qf[ATT_REPCAP][CC], acc[ATT_REPCAP][CC];
    float m[ATT_REPCAP], l[ATT_REPCAP];
    for (int i = 0; i < REP; i++) {
        for (int c = 0; c < C; c++) qf[i][c] = ldx(q, i * qsh + c * VW, BF), acc[i][c] = (v16){0};
        m[i] = -INFINITY, l[i] = 0.f;
    }
    for (int64_t j0 = 0; j0 < len; j0 += BK) {
        const int nb = (int)(len - j0 < BK ? len - j0 : BK);
        int64_t ko[BK], vo[BK]; /* the block's keys' and values' element offsets, looked up once */
        for (int j = 0; j < nb; j++) {
            const int64_t r = KEY(j0 + j);
            ko[j] = r * ks, vo[j] = r * vs;
        }
        for (int jg = 0; jg < nb; jg += 16) { /* scores of 16 keys at a time (keys past the history score 0) */
            const int ng = nb - jg < 16 ? nb - jg : 16;
            if (!dot) {
                for (int jj = 0; jj < ng; jj++)
                    for (int c = 0; c < C; c++) {
                        v16 t = ldx(k, ko[jg + jj] + c * VW, BF);
                        memcpy(kf + jj * D + c * VW, &t, sizeof t);
                    }
                if (ng < 16) memset(kf + ng * D, 0, sizeof(float) * (16 - ng) * D);
            }
            for (int i = 0; i < REP; i++) {
#if SCORES_AVX2
                /* AVX2: the generic 16-lane code below, on 8-lane halves, with reduce16's tree (lane l + l + 8, then
                 * + 4, + 2, + 1) done in ymm shuffles, so the sums are the same bits; reduce16's shuffles on 256-bit
                 * registers compiled to element moves that made scores several times slower */
                const float* qi = (const float*)qf[i];
                for (int h8 = 0; h8 < 2; h8++) {
                    __m256 y[4]; /* y[p]: keys 2p (low 128 bits) and 2p + 1 (high) after levels 1 and 2 */
                    for (int p2 = 0; p2 < 4; p2++) {
                        __m256 x[2];
                        for (int e = 0; e < 2; e++) {
                            const float* kr = kf + (h8 * 8 + 2 * p2 + e) * D;
                            __m256 t0 = _mm256_mul_ps(_mm256_loadu_ps(qi), _mm256_loadu_ps(kr));
                            __m256 t1 = _mm256_mul_ps(_mm256_loadu_ps(qi + 8), _mm256_loadu_ps(kr + 8));
                            for (int c = 16; c < D; c += 16) {
                                t0 = _mm256_fmadd_ps(_mm256_loadu_ps(qi + c), _mm256_loadu_ps(kr + c), t0);
                                t1 = _mm256_fmadd_ps(_mm256_loadu_ps(qi + c + 8), _mm256_loadu_ps(kr + c + 8), t1);
                            }
                            x[e] = _mm256_add_ps(t0, t1); /* level 1: lane l + lane l + 8 */
                        }
                        y[p2] = _mm256_add_ps(_mm256_permute2f128_ps(x[0], x[1], 0x20),
                                              _mm256_permute2f128_ps(x[0], x[1], 0x31)); /* level 2: l + l + 4 */
                    }
                    __m256 z[2]; /* level 3 (l + l + 2): z[0] keys 0, 2 | 1, 3; z[1] keys 4, 6 | 5, 7 (2 lanes each) */
                    for (int e = 0; e < 2; e++)
                        z[e] = _mm256_add_ps(_mm256_shuffle_ps(y[2 * e], y[2 * e + 1], 0x44),
                                             _mm256_shuffle_ps(y[2 * e], y[2 * e + 1], 0xEE));
                    const __m256 r = _mm256_hadd_ps(z[0], z[1]); /* level 4 (l + l + 1): keys 0 2 4 6 | 1 3 5 7 */
                    const __m256 o = _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                    _mm256_storeu_ps(sc + i * BK + jg + 8 * h8, _mm256_mul_ps(o, _mm256_set1_ps(scale)));
                }
                continue;
#endif
                v16 a[16];
#if HAVE_BF16_DOT
                if (dot) {
                    const uint16_t* kh = (const uint16_t*)k;
                    const uint16_t* qh = (const uint16_t*)q + i * qsh;
#define DOT_KEY(jj)                                                                                   \
    do {                                                                                              \
        __m512 t = _mm512_setzero_ps();                                                               \
        for (int c = 0; c < D / 32; c++)                                                              \
            t = _mm512_dpbf16_ps(t, (__m512bh)_mm512_loadu_si512(qh + c * 32),                        \
                                 (__m512bh)_mm512_loadu_si512(kh + ko[jg + (jj)] + c * 32));                       \
        a[jj] = (v16)t;                                                                               \
    } while (0)
                    if (ng == 16)
                        for (int jj = 0; jj < 16; jj++) DOT_KEY(jj);
                    else
                        for (int jj = 0; jj < 16; jj++) {
                            a[jj] = (v16){0};
                            if (jj < ng) DOT_KEY(jj);
                        }
#undef DOT_KEY
                } else
#endif
                    for (int jj = 0; jj < 16; jj++) {
                        v16 t = qf[i][0] * ldf(kf + jj * D);
                        for (int c = 1; c < C; c++) t += qf[i][c] * ldf(kf + jj * D + c * VW);
                        a[jj] = t;
                    }
                v16 s = reduce16(a) * scale;
                memcpy(sc + i * BK + jg, &s, sizeof s);
            }
        }
        const int nv = (nb + 15) & ~15;
        for (int i = 0; i < REP; i++) { /* the block's softmax, folded into the running maximum and sum */
            float* si = sc + i * BK;
            for (int j = nb; j < nv; j++) si[j] = -INFINITY; /* exp -> 0 */
            v16 mx = ldf(si);
            for (int j = VW; j < nv; j += VW) {
                v16 t = ldf(si + j);
                mx = vmax(t, mx);
            }
            float bm = mx[0];
            for (int e = 1; e < VW; e++) bm = mx[e] > bm ? mx[e] : bm;
            float mn = bm > m[i] ? bm : m[i];
            float corr = expf(m[i] - mn); /* 0 on the first block (m = -inf) */
            v16 sum = (v16){0};
            for (int j = 0; j < nv; j += VW) {
                v16 p = vexp(ldf(si + j) - mn);
                memcpy(si + j, &p, sizeof p);
                sum += p;
            }
            l[i] = l[i] * corr + hsum(sum);
            m[i] = mn;
            for (int c = 0; c < C; c++) acc[i][c] *= corr;
        }
#if SCORES_AVX2
        /* AVX2: P.V in passes of 16 dims, whose accumulators for every head (2 x REP ymm) stay in registers (all
         * dims at once are 8 x REP, which spilled); the same fmas in the same order as the generic loop below */
        for (int ch = 0; ch < D / 16; ch++) {
            float* ap[ATT_REPCAP][2];
            __m256 a0[ATT_REPCAP], a1[ATT_REPCAP];
            for (int i = 0; i < REP; i++) {
                if (BF) /* even dims of 32-dim group ch / 2 in acc[2 g], odd in acc[2 g + 1]; this pass: lanes 8 (ch % 2).. */
                    ap[i][0] = (float*)&acc[i][2 * (ch / 2)] + 8 * (ch % 2), ap[i][1] = (float*)&acc[i][2 * (ch / 2) + 1] + 8 * (ch % 2);
                else
                    ap[i][0] = (float*)&acc[i][ch], ap[i][1] = (float*)&acc[i][ch] + 8;
                a0[i] = _mm256_loadu_ps(ap[i][0]), a1[i] = _mm256_loadu_ps(ap[i][1]);
            }
            for (int j = 0; j < nb; j++) {
                if (ch == 0)
                { /* spread over this loop: the next block's key and value rows (in the last block, the next item's) */
                    const char *pk = 0, *pv = 0;
                    int64_t r = 0;
                    if (j0 + BK + j < len)
                        pk = k, pv = v, r = KEY(j0 + BK + j);
                    else if (next_k && j < next_len)
                        pk = next_k, pv = next_v, r = next_idx ? next_idx[j] : j;
                    if (pk)
                        for (int b = 0; b < D * (BF ? 2 : 4); b += 64) {
                            __builtin_prefetch(pk + r * ks * (BF ? 2 : 4) + b, 0, 3);
                            __builtin_prefetch(pv + r * vs * (BF ? 2 : 4) + b, 0, 3);
                        }
                }
                __m256 v0, v1;
                if (BF) {
                    const __m256i x = _mm256_loadu_si256((const __m256i*)((const uint16_t*)v + vo[j] + 16 * ch));
                    v0 = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
                    v1 = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xffff0000u)));
                } else {
                    v0 = _mm256_loadu_ps((const float*)v + vo[j] + 16 * ch);
                    v1 = _mm256_loadu_ps((const float*)v + vo[j] + 16 * ch + 8);
                }
                for (int i = 0; i < REP; i++) {
                    const __m256 p = _mm256_broadcast_ss(sc + i * BK + j);
                    a0[i] = _mm256_fmadd_ps(p, v0, a0[i]), a1[i] = _mm256_fmadd_ps(p, v1, a1[i]);
                }
            }
            for (int i = 0; i < REP; i++) _mm256_storeu_ps(ap[i][0], a0[i]), _mm256_storeu_ps(ap[i][1], a1[i]);
        }
#else
        for (int j = 0; j < nb; j++) { /* P.V */
            { /* spread over this loop: the next block's key and value rows (in the last block, the next item's) */
                const char *pk = 0, *pv = 0;
                int64_t r = 0;
                if (j0 + BK + j < len)
                    pk = k, pv = v, r = KEY(j0 + BK + j);
                else if (next_k && j < next_len)
                    pk = next_k, pv = next_v, r = next_idx ? next_idx[j] : j;
                if (pk)
                    for (int b = 0; b < D * (BF ? 2 : 4); b += 64) {
                        __builtin_prefetch(pk + r * ks * (BF ? 2 : 4) + b, 0, 3);
                        __builtin_prefetch(pv + r * vs * (BF ? 2 : 4) + b, 0, 3);
                    }
            }
            v16 vr[CC];
            if (BF) /* 32 bf16 -> even and odd elements as fp32 in two shifts: acc[i][2c] holds even dims, 2c + 1 odd */
                for (int c = 0; c < C; c += 2) {
                    u32x16 x;
                    memcpy(&x, (const uint16_t*)v + vo[j] + c * VW, sizeof x);
                    vr[c] = (v16)(x << 16), vr[c + 1] = (v16)(x & 0xffff0000u);
                }
            else
                for (int c = 0; c < C; c++) vr[c] = ldf((const float*)v + vo[j] + c * VW);
            for (int i = 0; i < REP; i++) {
                float p = sc[i * BK + j];
                for (int c = 0; c < C; c++) acc[i][c] += p * vr[c];
            }
        }
#endif
    }
    if (part) {
        for (int i = 0; i < REP; i++) store_part(part, i, REP, D, acc[i], m[i], l[i]);
        return;
    }
    for (int i = 0; i < REP; i++) store_head((char*)out + i * osh * (BF ? 2 : 4), acc[i], 1.f / l[i], C, BF);
}

#undef KEY
#undef ATT_NAME
#undef ATT_D
#undef ATT_REP
#undef ATT_BF
#undef ATT_DCAP
#undef ATT_REPCAP
