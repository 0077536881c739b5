/* Persistent thread pool + runtime ISA selection.
 * mf_parallel_for hands indices [0, n) out through an atomic counter; the caller works too.
 * Workers spin a short while after a job (decode issues ~hundreds of jobs per token), then
 * sleep on a condvar. Calls from inside a task (nested) run inline. */
#include "memfit.h"
#include "quant_common.h"

#include <cpuid.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MF_MAX_THREADS 256
#define MF_SPIN_ITERS 50000 /* ~1-2 ms of pause: covers the Python gap between ops of a decode step */

int mf_isa = MF_ISA_SCALAR;
static int mf_isa_hw = MF_ISA_SCALAR; /* best the CPU + OS support */

/* ---------------- ISA detection ---------------- */

static uint64_t xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

static int detect_isa(void) {
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return MF_ISA_SCALAR;
    int osxsave = (c >> 27) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1, avx = (c >> 28) & 1;
    if (!osxsave || !avx) return MF_ISA_SCALAR;
    uint64_t xcr0 = xgetbv0();
    if ((xcr0 & 0x6) != 0x6) return MF_ISA_SCALAR; /* XMM + YMM state enabled by the OS */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return MF_ISA_SCALAR;
    int avx2 = (b >> 5) & 1;
    if (!(avx2 && fma && f16c)) return MF_ISA_SCALAR;
    int avx512f = (b >> 16) & 1, avx512bw = (b >> 30) & 1, avx512vl = (b >> 31) & 1;
    /* VNNI, VBMI (vpermb) and BMI2 (pdep): Ice Lake, Zen 4 and later */
    int vnni = ((c >> 11) & 1) && ((c >> 1) & 1) && ((b >> 8) & 1);
    int zmm_os = (xcr0 & 0xe6) == 0xe6; /* opmask + ZMM hi256 + hi16 ZMM */
    if (avx512f && avx512bw && avx512vl && zmm_os) return vnni ? MF_ISA_AVX512VNNI : MF_ISA_AVX512;
    return MF_ISA_AVX2;
#else
    return MF_ISA_SCALAR;
#endif
}

/* The IQ grid-row gathers (IQ3: AVX2 8-lane; IQ1: AVX-512 8-lane 64-bit) that
 * this CPU runs slower than scalar loads + inserts: AMD (families 0x17, 0x19, 0x1A). Measured on Zen 3 (docs/NOTES.md session
 * 8): IQ2 lattice rows by vpgatherqq 0.61-0.76x (they keep other code), IQ3_XXS rows by
 * vpgatherdd 1.2x slower; on the Xeon session 7 measured gathers faster. (The AVX-512 IQ3
 * kernels neither gather nor load: they look the rows up in registers, quant_iq3.c.) IQ1_S/IQ1_M's AVX-512 8-lane 64-bit gathers on
 * Zen 4 (session 17, 5 alternated pairs): loads +18% (IQ1_M 3584x3584), +5-10% (IQ1_S, long
 * rows). Both forms compute the same integers.
 * MEMFIT_GATHER=0/1 overrides. */
int mf_slow_gather;

static void cpu_family(int *amd, unsigned *fam, unsigned *model);

static int detect_slow_gather(void) {
    int amd;
    unsigned fam, model;
    cpu_family(&amd, &fam, &model);
    /* Zen 1-3: IQ3_XXS's 8-lane AVX2 gathers (1.19x with loads); Zen 4: IQ1_S/IQ1_M's 8-lane
     * AVX-512 gathers (loads +5-18%, BENCHMARKS.md section 27); Zen 5 unmeasured */
    (void)model;
    return amd && (fam == 0x17 || fam == 0x19 || fam == 0x1A);
}

/* Decode matvec tuning per CPU family (quant_common.h mf_tune_t). The defaults were measured
 * on the Intel Xeons of BENCHMARKS.md (sections 0, 2b, 21); AMD Zen 4/5 rows were measured on
 * the Zen 4 of BENCHMARKS.md section 25 (2 cores, 1 MiB L2 per core, 32 MiB L3). No field
 * changes a result bit. MEMFIT_TUNE="pf_rows=8,k_vd4_min_rb=0,..." overrides any field. */
/* AMD Zen 4 (measured) and Zen 5 (same cache design, not yet measured): no software prefetch
 * for the 1-row kernels and the strided 4/8-row groups. In-process A/B on the Zen 4 of
 * BENCHMARKS.md section 25 (bench --kernels --tune, 2 threads, from DRAM): Q4_K/Q6_K 1-row at
 * the 7B shapes +50-75% without it (16-17 -> 25-29 GB/s), Q5_K/IQ4_XS/Q3_K +10-50%, Q4_0/Q5_0
 * strided +20-40%; the adjacent 4-row kernels on long rows level or better with it (kept).
 * K-quant rows of >= 6 KiB (the 7B's ffn_down) in 8-row groups: Q4_K 3584x18944 +19% (21.5 ->
 * 25.5 GB/s, 9 trials), Q6_K level. Decode tasks of 128 KiB instead of 64: Q4_K/Q6_K at
 * 3584 columns and the output matrix +5-15% (two runs of 7 trials). One stream per task for the
 * 1-row kernels instead of two (the Xeon's choice): Q4_K/Q6_K at the 7B's short rows and the
 * output matrix +45-65% (20-24 -> 31-39 GB/s, 85-95% of the read probe), Q3_K +48%, MXFP4 +22%,
 * Q5_K +13%, the compute-bound IQ types level (5 trials). Session 17 (NOTES), in-process A/B
 * alternated: the strided 4/8-row groups in 512 KiB tasks (task_kib_strided; 64 KiB before):
 * MXFP4 2880x2880 +23%, Q8_0 4096x2880 +13%, Q4_0 4096x4096 +23%, Q5_0 14336x4096 +14%; and rows
 * of up to 4.5 KiB strided (stride_max_rb 4608; 3072 before): Q8_0 at 4096 columns +46-72%
 * (21-22 -> 30-38 GB/s), Q4_0 at 7168 +27%, MXFP4 at 7680 +34%. Longer rows were mixed (Q8_0
 * 14336 +14%, Q4_K 18944 +6%, Q6_K 18944 -12%): they stay adjacent. Session 28 (the Zen 4 of
 * BENCHMARKS.md section 39, bench --kernels --tune, 2 threads, from DRAM, 3-5 trials): the 4/8-row
 * kernels prefetch 1 KiB ahead in each stream in their block loop (pf_dist_multi) instead of the
 * rows-ahead bursts: the long rows' 8-row groups Q4_K 3584x18944 28.2 -> 32.5 GB/s, Q6_K 22.1 ->
 * 30.5, 4096x14336 Q4_K +18%, Q6_K +31%, Q8_0 +13%, Q4_0 +18%, Q5_K +11%, MXFP4 +26%; the
 * strided short rows level; 2 KiB within the noise of 1. The 1-row kernels stay without it
 * (pf_dist 3072 cost them 10-20%). Session 29 (BENCHMARKS.md section 40, bench --kernels --tune,
 * the two settings paired in each of 12 trials): the K-quants' rows of at most 1152 bytes (Q4_K
 * at <= 2048 columns: the 30B-A3B experts) 4 at a time, strided: Q4_K 6144x2048 +1-17% in all
 * 12, 16384x768 ahead in 9; at 4096 columns (2304 bytes) the 1-row kernel stays ahead in 8.
 * Session 30 (section 41), after the one-accumulator K-quant steps made the kernels ~10-20%
 * faster: the 4/8-row kernels 2 KiB ahead instead of 1 (13 trials, 8 of them while the host
 * read 60-66 GB/s): in those, Q6_K 3584x18944 33-39 -> 44-51 GB/s, Q8_0 4096x14336 37-40 ->
 * 54-60, IQ4_XS +8%, Q4_K +2-5%; level or ahead while it read 35-39. 3 and 4 KiB: level with 2;
 * the 1-row kernels still lose with any in-loop prefetch (pf_dist 1024: -0-20%, 2048: -20-45%). */
#define MF_TUNE_AMD_ZEN4 \
    (mf_tune.pf_rows = 0, mf_tune.pf_strided = 0, mf_tune.k_vd8_min_rb = 6144, mf_tune.task_kib = 128, \
     mf_tune.streams = 1, mf_tune.task_kib_strided = 512, mf_tune.stride_max_rb = 4608, mf_tune.pf_dist_multi = 2048, \
     mf_tune.k_vd4_short_rb = 1152)
/* Intel Emerald Rapids (family 6 model 207; the Xeon of BENCHMARKS.md section 30, 2 cores,
 * 2 MiB L2 per core, 260 MiB L3): the decode kernels that prefetch in their block loop
 * (mf_kpf_avx512) 3 KiB ahead in each row's stream, instead of the rows-ahead bursts. In-process
 * A/B (bench --kernels --tune, 2 threads, from DRAM, 3 trials): Q4_K at the 7B shapes 14.3-16.5
 * -> 17.3-22.4 GB/s, Q6_K 15.4-20.2 -> 19.2-23.5, Q8_0 15-21 -> 23-25; 2-8 KiB ahead within the
 * noise of each other, 512 B short of them. The 7B Q4_K_M decode 3.1-3.5 -> 4.2-4.8 tok/s. The
 * 4/8-row kernels, which walk 4-8 streams at once, 1 KiB ahead in each (pf_dist_multi; 3 KiB
 * A/B): Q4_0's strided 8-row groups 16.4-23.5 -> 19.3-25.6 GB/s, MXFP4 at 4096 columns 18.0 ->
 * 20.3, Q6_K 3584x18944 24.0 -> 26.5, the rest level. */
#define MF_TUNE_INTEL_EMR (mf_tune.pf_dist = 3072, mf_tune.pf_dist_multi = 1024)
/* AMD Zen 3 (family 25 models 0x00-0x0F, 0x20-0x2F, 0x40-0x5F; measured on the EPYC Milan,
 * model 1, of BENCHMARKS.md section 31: 2 cores, AVX2 only, 512 KiB L2 per core, 32 MiB L3):
 * the AVX2 decode kernels prefetch in their block loop 2 KiB ahead (1 KiB in each of a 4/8-row
 * group's streams), one stream per 1-row task, no rows-ahead bursts for the kernels that do not
 * prefetch in their loop. In-process A/B (bench --kernels --tune, 2 threads, from DRAM, 3 trials
 * each): Q4_K at the 7B shapes 13.5-20.0 -> 20.4-27.6 GB/s, Q6_K 11-16 -> 19-22, Q8_0 18-20 ->
 * 27-29 (91-107% of the read probe), Q4_0 13-19 -> 19-23, IQ4_XS 13-14 -> 16-20; 1, 2 and 3 KiB
 * ahead within the noise of each other. Without the bursts the compute-bound kernels gain too
 * (IQ3_S, MXFP4, Q3_K, IQ2_XS +5-30%). The 7B Q4_K_M decode 3.7-4.4 -> 5.5-5.9 tok/s.
 * Session 26 (bench --kernels --tune, 2 threads, from DRAM, 5-7 trials alternated): Q4_K/Q6_K
 * rows of at most 2400 bytes 4 at a time in one call (k_vd4_short_rb; the 4 rows one after
 * another, the 1-row kernel's memory order): Q4_K 16384x768 (the 30B-A3B experts' down) +12-15%,
 * 6144x2048 +18%, 152064x2048 +8%, Q6_K level to +3%; longer rows level (kept 1-row). */
#define MF_TUNE_AMD_ZEN3 (mf_tune.pf_dist = 2048, mf_tune.pf_dist_multi = 1024, mf_tune.streams = 1, mf_tune.pf_rows = 0, \
                          mf_tune.k_vd4_short_rb = 2400)
mf_tune_t mf_tune = {.pf_rows = 8, .pf_rows_multi = 8, .pf_strided = 2, .q8_vd4_min_rb = 2048, .k_vd4_min_rb = 6144, .k_vd8_min_rb = 1 << 20,
                     .stride_max_rb = 3072, .streams = 2, .task_kib = 64, .task_kib_multi = 64, .task_kib_strided = 64,
                     .kg_tile_kib = 1024,
                     .fa_heads = 128, .pf_dist = 0, .pf_dist_multi = 0, .k_vd4_short_rb = 0};
const char *mf_tune_source = "default";
static char tune_source_buf[192];

static void cpu_family(int *amd, unsigned *fam, unsigned *model) {
    *amd = 0, *fam = 0, *model = 0;
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return;
    *amd = b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163; /* "AuthenticAMD" */
    if (!__get_cpuid(1, &a, &b, &c, &d)) return;
    *fam = (a >> 8) & 0xF, *model = ((a >> 4) & 0xF) | (((a >> 16) & 0xF) << 4);
    if (*fam == 0xF) *fam += (a >> 20) & 0xFF;
#endif
}

/* CPUID leaf 7's EBX feature bit (BMI1: 3, BMI2: 8) */
static int cpuid7_ebx(int bit) {
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b >> bit) & 1;
#else
    (void)bit;
    return 0;
#endif
}
static int has_bmi1(void) { return cpuid7_ebx(3); }
static int has_bmi2(void) { return cpuid7_ebx(8); }
int mf_has_bmi1;

static mf_tune_t tune_table; /* this CPU's row of the table, before MEMFIT_TUNE */
static const char *tune_table_source;

/* "name=value,..." onto mf_tune; 0, or -1 naming nothing it knows (the fields set so far stay) */
static int tune_apply(const char *spec) {
    static const struct { const char *name; int *field; } names[] = {
        {"pf_rows", &mf_tune.pf_rows}, {"pf_rows_multi", &mf_tune.pf_rows_multi}, {"pf_strided", &mf_tune.pf_strided},
        {"q8_vd4_min_rb", &mf_tune.q8_vd4_min_rb}, {"k_vd4_min_rb", &mf_tune.k_vd4_min_rb}, {"k_vd8_min_rb", &mf_tune.k_vd8_min_rb}, {"k_vd4_short_rb", &mf_tune.k_vd4_short_rb},
        {"stride_max_rb", &mf_tune.stride_max_rb}, {"task_kib", &mf_tune.task_kib}, {"streams", &mf_tune.streams},
        {"task_kib_multi", &mf_tune.task_kib_multi}, {"task_kib_strided", &mf_tune.task_kib_strided},
        {"kg_tile_kib", &mf_tune.kg_tile_kib},
        {"fa_heads", &mf_tune.fa_heads}, {"pf_dist", &mf_tune.pf_dist}, {"pf_dist_multi", &mf_tune.pf_dist_multi},
        {"pdep", &mf_tune.pdep}};
    const char *p = spec;
    int rc = 0;
    while (*p) {
        const char *eq = strchr(p, '='), *end = strchr(p, ',');
        if (!end) end = p + strlen(p);
        int found = 0;
        if (eq && eq < end) {
            char *stop;
            long v = strtol(eq + 1, &stop, 10);
            for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
                if ((size_t)(eq - p) == strlen(names[i].name) && !strncmp(p, names[i].name, (size_t)(eq - p)) &&
                    stop == end && stop > eq + 1 && v >= 0 && v <= (1 << 20)) {
                    *names[i].field = (int)v;
                    found = 1;
                }
        }
        if (!found && end > p) rc = -1;
        p = *end ? end + 1 : end;
    }
    if (mf_tune.task_kib < 4) mf_tune.task_kib = 4;
    if (mf_tune.streams < 1) mf_tune.streams = 1;
    if (mf_tune.streams > 16) mf_tune.streams = 16;
    if (mf_tune.task_kib_multi < 4) mf_tune.task_kib_multi = 4;
    if (mf_tune.task_kib_strided < 4) mf_tune.task_kib_strided = 4;
    if (mf_tune.kg_tile_kib < 16) mf_tune.kg_tile_kib = 16;
    if (mf_tune.fa_heads > MF_FA_HEADS_MAX) mf_tune.fa_heads = MF_FA_HEADS_MAX;
    mf_tune.pdep = mf_tune.pdep && has_bmi2(); /* 0 or 1, never pdep without BMI2 */
    return rc;
}

/* the table's row, then spec (NULL or "" or "default": the row alone) */
static int tune_set(const char *spec) {
    mf_tune = tune_table;
    mf_tune_source = tune_table_source;
    if (!spec || !*spec || !strcmp(spec, "default")) return 0;
    int rc = tune_apply(spec);
    snprintf(tune_source_buf, sizeof tune_source_buf, "%s +%s", tune_table_source, spec);
    mf_tune_source = tune_source_buf;
    return rc;
}

static void tune_init(void) {
    int amd;
    unsigned fam, model;
    cpu_family(&amd, &fam, &model);
    /* family 25 holds Zen 3 (models 0x00-0x0F, 0x20-0x2F, 0x40-0x5F) and Zen 4 (the rest) */
    const int zen3 = amd && fam == 0x19 && (model < 0x10 || (model >= 0x20 && model < 0x30) || (model >= 0x40 && model < 0x60));
    if (amd && (fam == 0x1A || (fam == 0x19 && !zen3))) { /* Zen 4 and Zen 5 */
        MF_TUNE_AMD_ZEN4;
        mf_tune_source = fam == 0x1A ? "amd-zen5 (zen4 row)" : "amd-zen4";
    } else if (zen3) {
        MF_TUNE_AMD_ZEN3;
        mf_tune_source = "amd-zen3";
    } else if (!amd && fam == 6 && model == 0xCF) {
        MF_TUNE_INTEL_EMR;
        mf_tune_source = "intel-emr";
    }
    /* pdep is fast where BMI2 is, except on AMD Zen 1/2 (family 0x17: microcoded) */
    mf_tune.pdep = has_bmi2() && !(amd && fam < 0x19);
    tune_table = mf_tune;
    tune_table_source = mf_tune_source;
    tune_set(getenv("MEMFIT_TUNE")); /* a bad spec is refused by the CLI (cli.py _check_env) */
}

static const char *isa_names[] = {"scalar", "avx2", "avx512", "avx512vnni"};

static int isa_from_name(const char *s) {
    for (int i = 0; i < 4; i++)
        if (strcmp(s, isa_names[i]) == 0) return i;
    return -1;
}

void mf_quant_init(void); /* quant.c: f16 table */

void mf_init_isa(void) {
    mf_quant_init();
    mf_isa_hw = detect_isa();
    mf_isa = mf_isa_hw;
    const char *g = getenv("MEMFIT_GATHER");
    mf_slow_gather = g && (!strcmp(g, "0") || !strcmp(g, "1")) ? !strcmp(g, "0") : detect_slow_gather();
    const char *bm = getenv("MEMFIT_BMI1");
    mf_has_bmi1 = has_bmi1() && !(bm && !strcmp(bm, "0"));
    tune_init();
    const char *env = getenv("MEMFIT_ISA");
    if (env && *env) {
        int want = isa_from_name(env);
        if (want >= 0 && want < mf_isa) mf_isa = want;
    }
}

/* ---------------- thread count ---------------- */

static int physical_cores(void) {
    cpu_set_t set;
    int logical = 0;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) logical = CPU_COUNT(&set);
    if (logical <= 0) logical = (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (logical <= 0) logical = 1;
    /* count distinct SMT sibling groups among the CPUs we may run on */
    char seen[MF_MAX_THREADS][64];
    int nseen = 0, counted = 0;
    for (int cpu = 0; cpu < CPU_SETSIZE && counted < logical; cpu++) {
        if (!CPU_ISSET(cpu, &set)) continue;
        counted++;
        char path[128], buf[64] = {0};
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/thread_siblings_list", cpu);
        FILE *f = fopen(path, "r");
        if (!f) return logical;
        if (!fgets(buf, sizeof buf, f)) buf[0] = 0;
        fclose(f);
        int dup = 0;
        for (int i = 0; i < nseen; i++)
            if (strcmp(seen[i], buf) == 0) dup = 1;
        if (!dup && nseen < MF_MAX_THREADS) memcpy(seen[nseen++], buf, sizeof buf);
    }
    return nseen > 0 ? nseen : logical;
}

/* ---------------- pool ---------------- */

typedef struct {
    mf_task_fn fn;
    void *ctx;
    int64_t n;
    atomic_int_fast64_t next;
    int ranged, nranges; /* mf_parallel_for_ranged: one contiguous range of tasks per thread */
    struct { _Alignas(64) atomic_uint_fast64_t v; } rng[MF_MAX_THREADS]; /* (back << 32) | front */
} job_t;

static struct {
    pthread_mutex_t call_lock; /* serializes concurrent mf_parallel_for callers */
    pthread_mutex_t mu;
    pthread_cond_t wake;
    atomic_uint gen;      /* seqlock-style: odd while the caller rewrites job, even once published */
    atomic_int inflight;  /* workers registered on the current gen */
    atomic_int stop;
    job_t job;
    int n_workers;        /* threads besides the caller */
    pthread_t tid[MF_MAX_THREADS];
    int started;
} P = {.call_lock = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER,
       .wake = PTHREAD_COND_INITIALIZER};

static _Thread_local int in_task;
static _Thread_local int tl_tid; /* 0: the calling thread, i + 1: worker i */
static int n_threads = 1;

/* Profile counters (memfit bench --profile), only touched while mf_prof_on: pool jobs, their
 * wall time, the threads' time inside tasks, and the caller's wait for the last task. */
int mf_prof_on;
static atomic_int_fast64_t prof_jobs, prof_inline, prof_wall_ns, prof_busy_ns, prof_tail_ns;

int64_t mf_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Ranged jobs: a thread takes tasks from the front of its own range (so it streams one
 * contiguous stretch of memory), then steals from the back of the others' ranges. */
static void run_ranged(job_t *j) {
    const int R = j->nranges, own = tl_tid % R;
    for (int k = 0; k < R; k++) {
        const int r = (own + k) % R;
        uint_fast64_t v = atomic_load_explicit(&j->rng[r].v, memory_order_relaxed);
        for (;;) {
            const uint64_t f = v & 0xffffffffu, b = v >> 32;
            if (f >= b) break;
            const uint64_t nv = k == 0 ? (b << 32) | (f + 1) : ((b - 1) << 32) | f;
            if (!atomic_compare_exchange_weak_explicit(&j->rng[r].v, &v, nv, memory_order_relaxed,
                                                       memory_order_relaxed))
                continue; /* v reloaded */
            j->fn(j->ctx, (int64_t)(k == 0 ? f : b - 1));
            v = atomic_load_explicit(&j->rng[r].v, memory_order_relaxed);
        }
    }
}

static void run_job(job_t *j) {
    in_task = 1;
    const int prof = mf_prof_on;
    int64_t t0 = prof ? mf_now_ns() : 0;
    if (j->ranged) run_ranged(j);
    else
        for (;;) {
            int64_t i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
            if (i >= j->n) break;
            j->fn(j->ctx, i);
        }
    if (prof) atomic_fetch_add_explicit(&prof_busy_ns, mf_now_ns() - t0, memory_order_relaxed);
    in_task = 0;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* A worker registers (inflight++) and re-checks gen before touching the job, so the caller
 * only ever waits for workers that are really inside the job: a worker the OS has not yet
 * scheduled costs nothing (important when cores are oversubscribed). */
static void *worker(void *arg) {
    tl_tid = (int)(intptr_t)arg;
    /* the process's asynchronous signals (Ctrl-C's SIGINT, SIGTERM, ...) go to another thread:
     * Python runs their handlers in the main thread, and a main thread waiting in input() sees
     * them only if the signal interrupts it there */
    sigset_t async;
    sigemptyset(&async);
    const int sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGALRM, SIGCHLD, SIGWINCH, SIGUSR1, SIGUSR2, SIGPIPE};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) sigaddset(&async, sigs[i]);
    pthread_sigmask(SIG_BLOCK, &async, NULL);
    unsigned seen = 0;
    for (;;) {
        unsigned g = atomic_load_explicit(&P.gen, memory_order_acquire);
        for (int s = 0; (g == seen || (g & 1)) && s < MF_SPIN_ITERS; s++) {
            cpu_relax();
            g = atomic_load_explicit(&P.gen, memory_order_acquire);
        }
        if (g == seen || (g & 1)) {
            pthread_mutex_lock(&P.mu);
            while (((g = atomic_load(&P.gen)) == seen || (g & 1)) && !atomic_load(&P.stop))
                pthread_cond_wait(&P.wake, &P.mu);
            pthread_mutex_unlock(&P.mu);
        }
        if (atomic_load(&P.stop)) return NULL;
        atomic_fetch_add_explicit(&P.inflight, 1, memory_order_seq_cst);
        if (atomic_load_explicit(&P.gen, memory_order_seq_cst) == g) {
            seen = g;
            run_job(&P.job);
        }
        atomic_fetch_sub_explicit(&P.inflight, 1, memory_order_release);
    }
}

static void wait_inflight(void) {
    for (int s = 0; atomic_load_explicit(&P.inflight, memory_order_acquire) > 0; s++) {
        if (s < 20000) cpu_relax();
        else sched_yield();
    }
}

static void pool_stop(void) {
    if (!P.started) return;
    pthread_mutex_lock(&P.mu);
    atomic_store(&P.stop, 1);
    pthread_cond_broadcast(&P.wake);
    pthread_mutex_unlock(&P.mu);
    for (int i = 0; i < P.n_workers; i++) pthread_join(P.tid[i], NULL);
    P.n_workers = 0;
    P.started = 0;
    atomic_store(&P.stop, 0);
}

static int pool_start(int threads) {
    if (threads < 1) threads = 1;
    if (threads > MF_MAX_THREADS) threads = MF_MAX_THREADS;
    P.n_workers = 0;
    for (int i = 0; i < threads - 1; i++) {
        if (pthread_create(&P.tid[i], NULL, worker, (void *)(intptr_t)(i + 1)) != 0) break;
        P.n_workers++;
    }
    P.started = 1;
    n_threads = P.n_workers + 1;
    return n_threads;
}

/* A forked child has no workers: run inline there until set_threads() starts a new pool. */
static void atfork_child(void) {
    pthread_mutex_init(&P.call_lock, NULL);
    pthread_mutex_init(&P.mu, NULL);
    pthread_cond_init(&P.wake, NULL);
    atomic_store(&P.inflight, 0);
    P.n_workers = 0;
    P.started = 0;
    n_threads = 1;
}

void mf_init_pool(void) {
    pthread_atfork(NULL, NULL, atfork_child);
    int t = 0;
    const char *env = getenv("MEMFIT_THREADS");
    if (env && *env) t = atoi(env);
    if (t <= 0) t = physical_cores();
    pool_start(t);
}

int mf_n_threads(void) { return n_threads; }

static void parallel_for(int64_t n, mf_task_fn fn, void *ctx, int ranged);
void mf_parallel_for(int64_t n, mf_task_fn fn, void *ctx) { parallel_for(n, fn, ctx, 0); }
/* As mf_parallel_for, but thread k first runs tasks [n k / T, n (k + 1) / T) in order (T
 * threads), then helps the others from the back of their ranges: for tasks that are
 * consecutive stretches of one stream (decode matvec rows), each thread reads memory in one
 * ascending sweep instead of jumping every task. Which thread runs a task never changes it. */
void mf_parallel_for_ranged(int64_t n, mf_task_fn fn, void *ctx) { parallel_for(n, fn, ctx, 1); }

static void parallel_for(int64_t n, mf_task_fn fn, void *ctx, int ranged) {
    if (n <= 0) return;
    if (n == 1 || in_task || P.n_workers == 0) {
        if (mf_prof_on && !in_task) atomic_fetch_add_explicit(&prof_inline, 1, memory_order_relaxed);
        for (int64_t i = 0; i < n; i++) fn(ctx, i);
        return;
    }
    const int prof = mf_prof_on;
    int64_t t0 = prof ? mf_now_ns() : 0;
    pthread_mutex_lock(&P.call_lock);
    atomic_fetch_add_explicit(&P.gen, 1, memory_order_seq_cst); /* odd: job being rewritten */
    wait_inflight();                                             /* stale registrants leave */
    P.job.fn = fn;
    P.job.ctx = ctx;
    P.job.n = n;
    atomic_store_explicit(&P.job.next, 0, memory_order_relaxed);
    P.job.ranged = ranged && n < ((int64_t)1 << 32);
    if (P.job.ranged) {
        const int R = P.n_workers + 1;
        P.job.nranges = R;
        for (int r = 0; r < R; r++)
            atomic_store_explicit(&P.job.rng[r].v, ((uint64_t)(n * (r + 1) / R) << 32) | (uint64_t)(n * r / R),
                                  memory_order_relaxed);
    }
    pthread_mutex_lock(&P.mu);
    atomic_fetch_add_explicit(&P.gen, 1, memory_order_seq_cst); /* even: published */
    pthread_cond_broadcast(&P.wake);
    pthread_mutex_unlock(&P.mu);
    run_job(&P.job);
    int64_t t1 = prof ? mf_now_ns() : 0;
    wait_inflight();
    pthread_mutex_unlock(&P.call_lock);
    if (prof) {
        int64_t t2 = mf_now_ns();
        atomic_fetch_add_explicit(&prof_jobs, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&prof_wall_ns, t2 - t0, memory_order_relaxed);
        atomic_fetch_add_explicit(&prof_tail_ns, t2 - t1, memory_order_relaxed);
    }
}

/* ---------------- Python API ---------------- */

static PyObject *py_set_threads(PyObject *self, PyObject *arg) {
    long t = PyLong_AsLong(arg);
    if (t == -1 && PyErr_Occurred()) return NULL;
    if (t <= 0) t = physical_cores();
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&P.call_lock);
    pool_stop();
    pool_start((int)t);
    pthread_mutex_unlock(&P.call_lock);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(n_threads);
}

static PyObject *py_get_threads(PyObject *self, PyObject *unused) { return PyLong_FromLong(n_threads); }

static PyObject *py_isa(PyObject *self, PyObject *unused) { return PyUnicode_FromString(isa_names[mf_isa]); }

static PyObject *py_set_isa(PyObject *self, PyObject *arg) {
    const char *s = PyUnicode_AsUTF8(arg);
    if (!s) return NULL;
    int want = isa_from_name(s);
    if (want < 0) return PyErr_Format(PyExc_ValueError, "unknown ISA %R; use scalar, avx2, avx512, avx512vnni", arg);
    if (want > mf_isa_hw)
        return PyErr_Format(PyExc_ValueError, "ISA %s is not supported by this CPU (best: %s)", s, isa_names[mf_isa_hw]);
    mf_isa = want;
    return PyUnicode_FromString(isa_names[mf_isa]);
}

static PyObject *py_isa_hw(PyObject *self, PyObject *unused) { return PyUnicode_FromString(isa_names[mf_isa_hw]); }

static PyObject *py_tune(PyObject *self, PyObject *unused) {
    return Py_BuildValue("{s:s,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}", "source", mf_tune_source, "pf_rows", mf_tune.pf_rows,
                         "pf_rows_multi", mf_tune.pf_rows_multi,
                         "pf_strided", mf_tune.pf_strided, "q8_vd4_min_rb", mf_tune.q8_vd4_min_rb,
                         "k_vd4_min_rb", mf_tune.k_vd4_min_rb, "k_vd8_min_rb", mf_tune.k_vd8_min_rb, "stride_max_rb", mf_tune.stride_max_rb,
                         "streams", mf_tune.streams, "task_kib", mf_tune.task_kib, "task_kib_multi", mf_tune.task_kib_multi,
                         "task_kib_strided", mf_tune.task_kib_strided,
                         "kg_tile_kib", mf_tune.kg_tile_kib, "fa_heads", mf_tune.fa_heads, "pf_dist", mf_tune.pf_dist, "pf_dist_multi", mf_tune.pf_dist_multi,
                         "pdep", mf_tune.pdep, "k_vd4_short_rb", mf_tune.k_vd4_short_rb);
}

static PyObject *py_set_tune(PyObject *self, PyObject *args) {
    const char *spec;
    if (!PyArg_ParseTuple(args, "s", &spec)) return NULL;
    if (tune_set(spec)) {
        tune_set(NULL);
        return PyErr_Format(PyExc_ValueError, "tuning '%s': expected name=value,... with names pf_rows, pf_rows_multi, pf_strided, "
                            "q8_vd4_min_rb, k_vd4_min_rb, k_vd8_min_rb, stride_max_rb, streams, task_kib, task_kib_multi, task_kib_strided, kg_tile_kib, fa_heads, pf_dist, pf_dist_multi, pdep, k_vd4_short_rb and values 0..1048576", spec);
    }
    return py_tune(self, NULL);
}

/* The ISAs with kernels of their own (avx512 without VNNI runs the avx2 kernels). */
static PyObject *py_isas(PyObject *self, PyObject *unused) {
    return Py_BuildValue("(sss)", "scalar", "avx2", "avx512vnni");
}

void mf_prof_mm_reset(void);          /* quant_mm.c */
PyObject *mf_prof_mm_list(void);      /* quant_mm.c */

static PyObject *py_profile(PyObject *self, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    if (on) {
        atomic_store(&prof_jobs, 0); atomic_store(&prof_inline, 0); atomic_store(&prof_wall_ns, 0);
        atomic_store(&prof_busy_ns, 0); atomic_store(&prof_tail_ns, 0);
        mf_prof_mm_reset();
    }
    mf_prof_on = on;
    Py_RETURN_NONE;
}

static PyObject *py_profile_stats(PyObject *self, PyObject *unused) {
    PyObject *mm = mf_prof_mm_list();
    if (!mm) return NULL;
    return Py_BuildValue("{s:L,s:L,s:L,s:L,s:L,s:i,s:N}", "jobs", (long long)atomic_load(&prof_jobs),
                         "inline_jobs", (long long)atomic_load(&prof_inline),
                         "wall_ns", (long long)atomic_load(&prof_wall_ns),
                         "busy_ns", (long long)atomic_load(&prof_busy_ns),
                         "tail_wait_ns", (long long)atomic_load(&prof_tail_ns), "threads", n_threads,
                         "matmul", mm);
}

PyMethodDef mf_pool_methods[] = {
    {"set_threads", py_set_threads, METH_O, "set_threads(n) -> n: restart the pool with n threads (<=0: physical cores)"},
    {"get_threads", py_get_threads, METH_NOARGS, "get_threads() -> int"},
    {"isa", py_isa, METH_NOARGS, "isa() -> active ISA name"},
    {"isa_hw", py_isa_hw, METH_NOARGS, "isa_hw() -> best ISA this CPU supports"},
    {"set_tune", py_set_tune, METH_VARARGS, "set_tune(spec) -> this CPU's tuning row with spec (name=value,...; '' or 'default': the row)"},
    {"tune", py_tune, METH_NOARGS, "tune() -> the decode matvec tuning in use (CPU table + MEMFIT_TUNE)"},
    {"set_isa", py_set_isa, METH_O, "set_isa(name) -> name: select a kernel ISA the CPU supports (tests)"},
    {"isas", py_isas, METH_NOARGS, "isas() -> the ISA names that have kernels of their own (a CPU runs those <= isa_hw())"},
    {"profile", py_profile, METH_O, "profile(on): reset and start (True) or stop (False) the kernel profile counters"},
    {"profile_stats", py_profile_stats, METH_NOARGS,
     "profile_stats() -> {jobs, inline_jobs, wall_ns, busy_ns, tail_wait_ns, threads, matmul: [...]}"},
    {NULL, NULL, 0, NULL},
};
