/* Attention kernels over a K/V cache of element type KV_T, included twice by csrc/ops.c:
 * float32 K/V (KV_T float) and float16 K/V (KV_T uint16_t, converted to f32 on load with
 * F16C, or through mf_f16_table on the scalar path). The arithmetic after the load is the
 * same, so an f16 cache gives exactly the result of the same values stored as f32.
 * Needs: KV_T, KV_FN(name) (a name suffix), KV_LD8(p) (8 values as __m256), KV_LD1(p). */
static void KV_FN(attn_task_scalar)(const mf_attn_args *a, int64_t i, int64_t h) {
    const int64_t D = a->D, Dv = a->Dv, g = h / (a->Hq / a->Hkv), qp = a->q_pos[i];
    const float *q = a->q + (i * a->Hq + h) * D;
    float *o = a->out + (i * a->Hq + h) * Dv;
    float acc[MF_ATTN_MAX_DIM], s[KB];
    float m = a->sinks ? a->sinks[h] : -INFINITY, l = a->sinks ? 1.0f : 0.0f; /* the sink: e^(s_h - m) */
    memset(acc, 0, (size_t)Dv * sizeof(float));
    for (int64_t t0 = 0; t0 < a->T; t0 += KB) {
        const int64_t nb = a->T - t0 < KB ? a->T - t0 : KB;
        float mb = -INFINITY;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t t = t0 + b;
            if (!visible(a, qp, t)) { s[b] = -INFINITY; continue; }
            const KV_T *k = (const KV_T *)a->k + (t * a->Hkv + g) * D;
            float d = 0.0f;
            for (int64_t j = 0; j < D; j++) d += q[j] * KV_LD1(k + j);
            s[b] = cap(a, d * a->scale);
            mb = s[b] > mb ? s[b] : mb;
        }
        if (mb == -INFINITY) continue;
        if (mb > m) {
            const float corr = expf(m - mb); /* 0 on the first visible block */
            for (int64_t j = 0; j < Dv; j++) acc[j] *= corr;
            l *= corr;
            m = mb;
        }
        for (int64_t b = 0; b < nb; b++) {
            if (s[b] == -INFINITY) continue;
            const float p = expf(s[b] - m);
            const KV_T *v = (const KV_T *)a->v + ((t0 + b) * a->Hkv + g) * Dv;
            l += p;
            for (int64_t j = 0; j < Dv; j++) acc[j] += p * KV_LD1(v + j);
        }
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int64_t j = 0; j < Dv; j++) o[j] = acc[j] * inv;
}

/* Paged: query row i of pa, heads of sub (shapes, scale, softcap); keys through the row's block
 * table, on the same KB grid from position 0 as above so an identity table matches it bit for
 * bit. */
static inline int64_t KV_FN(paged_lo)(const mf_paged_args *pa, int64_t qp) {
    return pa->window > 0 && qp - pa->window + 1 > 0 ? qp - pa->window + 1 : 0;
}

static void KV_FN(paged_task_scalar)(const mf_paged_args *pa, int64_t i, int64_t h) {
    const int64_t D = pa->D, Dv = pa->Dv, Hkv = pa->Hkv, g = h / (pa->Hq / Hkv), qp = pa->q_pos[i];
    const int64_t bs = pa->bs, lo = KV_FN(paged_lo)(pa, qp);
    const int32_t *tab = pa->tables + pa->q_tab[i];
    const float *q = pa->q + (i * pa->Hq + h) * D;
    float *o = pa->out + (i * pa->Hq + h) * Dv;
    float acc[MF_ATTN_MAX_DIM], s[KB];
    int64_t row[KB];
    float m = pa->sinks ? pa->sinks[h] : -INFINITY, l = pa->sinks ? 1.0f : 0.0f;
    memset(acc, 0, (size_t)Dv * sizeof(float));
    for (int64_t t0 = lo / KB * KB; t0 <= qp; t0 += KB) {
        const int64_t nb = qp + 1 - t0 < KB ? qp + 1 - t0 : KB;
        float mb = -INFINITY;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t t = t0 + b;
            if (t < lo) { s[b] = -INFINITY; continue; }
            row[b] = (int64_t)tab[t / bs] * bs + t % bs;
            const KV_T *k = (const KV_T *)pa->k + (row[b] * Hkv + g) * D;
            float d = 0.0f;
            for (int64_t j = 0; j < D; j++) d += q[j] * KV_LD1(k + j);
            s[b] = d * pa->scale;
            if (pa->softcap > 0.0f) s[b] = pa->softcap * tanhf(s[b] / pa->softcap);
            mb = s[b] > mb ? s[b] : mb;
        }
        if (mb == -INFINITY) continue;
        if (mb > m) {
            const float corr = expf(m - mb);
            for (int64_t j = 0; j < Dv; j++) acc[j] *= corr;
            l *= corr;
            m = mb;
        }
        for (int64_t b = 0; b < nb; b++) {
            if (s[b] == -INFINITY) continue;
            const float p = expf(s[b] - m);
            const KV_T *v = pa->v ? (const KV_T *)pa->v + (row[b] * Hkv + g) * Dv
                                  : (const KV_T *)pa->k + (row[b] * Hkv + g) * D; /* V inside K */
            l += p;
            for (int64_t j = 0; j < Dv; j++) acc[j] += p * KV_LD1(v + j);
        }
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int64_t j = 0; j < Dv; j++) o[j] = acc[j] * inv;
}

#ifdef MF_X86
/* 4 dot products of q with 4 key rows, reduced into one __m128 [d0, d1, d2, d3]. */
MF_AVX2 static inline __m128 KV_FN(dot4_avx2)(const float *q, const KV_T *k0, const KV_T *k1,
                                       const KV_T *k2, const KV_T *k3, int64_t D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t j = 0;
    for (; j + 8 <= D; j += 8) {
        const __m256 vq = _mm256_loadu_ps(q + j);
        a0 = _mm256_fmadd_ps(vq, KV_LD8(k0 + j), a0);
        a1 = _mm256_fmadd_ps(vq, KV_LD8(k1 + j), a1);
        a2 = _mm256_fmadd_ps(vq, KV_LD8(k2 + j), a2);
        a3 = _mm256_fmadd_ps(vq, KV_LD8(k3 + j), a3);
    }
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    if (j < D) {
        float t[4] = {0, 0, 0, 0};
        for (; j < D; j++) {
            t[0] += q[j] * KV_LD1(k0 + j);
            t[1] += q[j] * KV_LD1(k1 + j);
            t[2] += q[j] * KV_LD1(k2 + j);
            t[3] += q[j] * KV_LD1(k3 + j);
        }
        r = _mm_add_ps(r, _mm_loadu_ps(t));
    }
    return r;
}

MF_AVX2 static inline float KV_FN(dot1_avx2)(const float *q, const KV_T *k, int64_t D) {
    __m256 a0 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= D; j += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), KV_LD8(k + j), a0);
    float d = hsum_ps(a0);
    for (; j < D; j++) d += q[j] * KV_LD1(k + j);
    return d;
}

/* One key block for one q head: scores of the nv visible keys idx[], online-softmax update of
 * (m, l, acc). s is scratch [KB]. vs: V's row stride over t in elements (Hkv * Dv, or K's
 * Hkv * D when V is inside K). */
MF_AVX2 static void KV_FN(attn_block_avx2)(const mf_attn_args *a, const float *q, const KV_T *kb, const KV_T *vb,
                                    int64_t vs, const int32_t *idx, int nv, float *s, float *pm, float *pl,
                                    float *acc) {
    const int64_t D = a->D, Dv = a->Dv, ks = a->Hkv * D; /* K's row stride over t */
    int b = 0;
    for (; b + 4 <= nv; b += 4) {
        __m128 d = KV_FN(dot4_avx2)(q, kb + idx[b] * ks, kb + idx[b + 1] * ks, kb + idx[b + 2] * ks,
                             kb + idx[b + 3] * ks, D);
        _mm_storeu_ps(s + b, _mm_mul_ps(d, _mm_set1_ps(a->scale)));
    }
    for (; b < nv; b++) s[b] = KV_FN(dot1_avx2)(q, kb + idx[b] * ks, D) * a->scale;
    if (a->softcap > 0.0f)
        for (b = 0; b < nv; b++) s[b] = cap(a, s[b]);
    __m256 vmb = _mm256_set1_ps(-INFINITY);
    for (b = 0; b + 8 <= nv; b += 8) vmb = _mm256_max_ps(vmb, _mm256_loadu_ps(s + b));
    float mb = hmax_ps(vmb), m = *pm, l = *pl;
    for (; b < nv; b++) mb = s[b] > mb ? s[b] : mb;
    if (mb > m) {
        const float corr = expf(m - mb); /* 0 on the first visible block */
        const __m256 vc = _mm256_set1_ps(corr);
        int64_t j = 0;
        for (; j + 8 <= Dv; j += 8) _mm256_storeu_ps(acc + j, _mm256_mul_ps(_mm256_loadu_ps(acc + j), vc));
        for (; j < Dv; j++) acc[j] *= corr;
        l *= corr;
        m = mb;
    }
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vl = _mm256_setzero_ps();
    for (b = 0; b + 8 <= nv; b += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + b), vm));
        _mm256_storeu_ps(s + b, e);
        vl = _mm256_add_ps(vl, e);
    }
    l += hsum_ps(vl);
    for (; b < nv; b++) {
        s[b] = expf(s[b] - m);
        l += s[b];
    }
    /* acc += sum_b p_b * v_b, 4 value rows per pass over acc */
    for (b = 0; b + 4 <= nv; b += 4) {
        const KV_T *v0 = vb + idx[b] * vs, *v1 = vb + idx[b + 1] * vs;
        const KV_T *v2 = vb + idx[b + 2] * vs, *v3 = vb + idx[b + 3] * vs;
        const __m256 p0 = _mm256_set1_ps(s[b]), p1 = _mm256_set1_ps(s[b + 1]);
        const __m256 p2 = _mm256_set1_ps(s[b + 2]), p3 = _mm256_set1_ps(s[b + 3]);
        int64_t j = 0;
        for (; j + 8 <= Dv; j += 8) {
            __m256 r = _mm256_loadu_ps(acc + j);
            r = _mm256_fmadd_ps(p0, KV_LD8(v0 + j), r);
            r = _mm256_fmadd_ps(p1, KV_LD8(v1 + j), r);
            r = _mm256_fmadd_ps(p2, KV_LD8(v2 + j), r);
            r = _mm256_fmadd_ps(p3, KV_LD8(v3 + j), r);
            _mm256_storeu_ps(acc + j, r);
        }
        for (; j < Dv; j++) acc[j] += s[b] * KV_LD1(v0 + j) + s[b + 1] * KV_LD1(v1 + j) + s[b + 2] * KV_LD1(v2 + j) + s[b + 3] * KV_LD1(v3 + j);
    }
    for (; b < nv; b++) {
        const KV_T *v0 = vb + idx[b] * vs;
        const __m256 p0 = _mm256_set1_ps(s[b]);
        int64_t j = 0;
        for (; j + 8 <= Dv; j += 8)
            _mm256_storeu_ps(acc + j, _mm256_fmadd_ps(p0, KV_LD8(v0 + j), _mm256_loadu_ps(acc + j)));
        for (; j < Dv; j++) acc[j] += s[b] * KV_LD1(v0 + j);
    }
    *pm = m;
    *pl = l;
}

/* Query row i, q heads h0 .. h0+nh-1 (nh <= HG, one kv head): each key block is compacted once
 * and its K/V rows serve all nh heads while they are in cache. */
MF_AVX2 static void KV_FN(attn_task_avx2)(const mf_attn_args *a, int64_t i, int64_t h0, int64_t nh) {
    const int64_t D = a->D, Dv = a->Dv, g = h0 / (a->Hq / a->Hkv), qp = a->q_pos[i];
    const KV_T *kb = (const KV_T *)a->k + g * D, *vb = (const KV_T *)a->v + g * Dv;
    float acc[HG][MF_ATTN_MAX_DIM], s[KB], m[HG], l[HG];
    int32_t idx[KB];
    for (int64_t hh = 0; hh < nh; hh++) {
        m[hh] = a->sinks ? a->sinks[h0 + hh] : -INFINITY;
        l[hh] = a->sinks ? 1.0f : 0.0f;
        memset(acc[hh], 0, (size_t)Dv * sizeof(float));
    }
    for (int64_t t0 = 0; t0 < a->T; t0 += KB) {
        const int64_t nb = a->T - t0 < KB ? a->T - t0 : KB;
        int nv = 0; /* visible keys of this block, compacted into idx */
        for (int64_t b = 0; b < nb; b++)
            if (visible(a, qp, t0 + b)) idx[nv++] = (int32_t)(t0 + b);
        if (nv == 0) continue;
        for (int64_t hh = 0; hh < nh; hh++)
            KV_FN(attn_block_avx2)(a, a->q + (i * a->Hq + h0 + hh) * D, kb, vb, a->Hkv * Dv, idx, nv, s, &m[hh],
                                   &l[hh], acc[hh]);
    }
    for (int64_t hh = 0; hh < nh; hh++) {
        float *o = a->out + (i * a->Hq + h0 + hh) * Dv;
        const float inv = l[hh] > 0.0f ? 1.0f / l[hh] : 0.0f;
        const __m256 vi = _mm256_set1_ps(inv);
        int64_t j = 0;
        for (; j + 8 <= Dv; j += 8) _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_loadu_ps(acc[hh] + j), vi));
        for (; j < Dv; j++) o[j] = acc[hh][j] * inv;
    }
}
/* Paged (see paged_task_scalar): each key block's physical rows are gathered into idx once and
 * serve the nh heads of one kv head. */
MF_AVX2 static void KV_FN(paged_task_avx2)(const mf_paged_args *pa, const mf_attn_args *a, int64_t i,
                                           int64_t h0, int64_t nh) {
    const int64_t D = a->D, Dv = a->Dv, g = h0 / (a->Hq / a->Hkv), qp = pa->q_pos[i];
    const int64_t bs = pa->bs, lo = KV_FN(paged_lo)(pa, qp);
    const int32_t *tab = pa->tables + pa->q_tab[i];
    /* V inside K (pa->v NULL): each K row's first Dv values, with K's row stride */
    const KV_T *kb = (const KV_T *)pa->k + g * D;
    const KV_T *vb = pa->v ? (const KV_T *)pa->v + g * Dv : kb;
    const int64_t vs = pa->v ? a->Hkv * Dv : a->Hkv * D;
    float acc[HG][MF_ATTN_MAX_DIM], s[KB], m[HG], l[HG];
    int32_t idx[KB];
    for (int64_t hh = 0; hh < nh; hh++) {
        m[hh] = pa->sinks ? pa->sinks[h0 + hh] : -INFINITY;
        l[hh] = pa->sinks ? 1.0f : 0.0f;
        memset(acc[hh], 0, (size_t)Dv * sizeof(float));
    }
    for (int64_t t0 = lo / KB * KB; t0 <= qp; t0 += KB) {
        const int64_t t1 = qp + 1 - t0 < KB ? qp + 1 : t0 + KB;
        int nv = 0;
        for (int64_t t = t0 < lo ? lo : t0; t < t1; t++) idx[nv++] = (int32_t)(tab[t / bs] * bs + t % bs);
        for (int64_t hh = 0; hh < nh; hh++)
            KV_FN(attn_block_avx2)(a, pa->q + (i * a->Hq + h0 + hh) * D, kb, vb, vs, idx, nv, s, &m[hh], &l[hh],
                                   acc[hh]);
    }
    for (int64_t hh = 0; hh < nh; hh++) {
        float *o = pa->out + (i * a->Hq + h0 + hh) * Dv;
        const float inv = l[hh] > 0.0f ? 1.0f / l[hh] : 0.0f;
        const __m256 vi = _mm256_set1_ps(inv);
        int64_t j = 0;
        for (; j + 8 <= Dv; j += 8) _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_loadu_ps(acc[hh] + j), vi));
        for (; j < Dv; j++) o[j] = acc[hh][j] * inv;
    }
}
#endif
