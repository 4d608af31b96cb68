/* hvctr's sparse-path hot loops: lazy Adam on rows in place, the batch's unique positions, the
   gather of its rows and the sum of its gradients per row; the window's unique keys; the
   exchange's packing of rows into messages and merging of the copies an owner receives.

   Built at install time by setuptools (setup.py: -O3 -Wall -ffp-contract=off, no -march) into a
   plain shared library that hvctr/kernels/native.py loads with ctypes; nothing is compiled at
   run time. The row layout comes from hv_row.h, generated from hvctr.formats.

   Every compute kernel walks its inputs in order on one thread: results do not depend on timing.
   The shard's I/O kernels (hv_io_read, hv_io_write, at the end) use a pool of threads to keep
   many reads in flight; each byte still goes to one fixed place, so their results do not depend
   on timing either. */

#define _GNU_SOURCE /* pread, pwrite, posix_fadvise, sync_file_range; before any header */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include "hv_row.h"

#ifndef HV_SOURCE_SHA256
#define HV_SOURCE_SHA256 "unknown"
#endif

/* What the loader checks before it binds anything: the sources this library was built from
   (sha256 of hv_kernels.c, a NUL, hv_row.h; setup.py passes it) and the row layouts it was
   compiled with, out = [M, V, STEP, WIDTH] offsets for a row of model width c, for the layout
   `kind` (hvctr.formats.C_LAYOUTS' order: 0 Adam, 1 row-wise Adam, 2 row-wise Adagrad). */
const char *hv_source_sha256(void) { return HV_SOURCE_SHA256; }

void hv_row_layout(int64_t kind, int64_t c, int64_t *out)
{
    if (kind == 1) {
        out[0] = HV_RWADAM_M(c); out[1] = HV_RWADAM_V(c); out[2] = HV_RWADAM_STEP(c); out[3] = HV_RWADAM_WIDTH(c);
    } else if (kind == 2) {
        out[0] = HV_RWADAGRAD_M(c); out[1] = HV_RWADAGRAD_V(c); out[2] = HV_RWADAGRAD_STEP(c);
        out[3] = HV_RWADAGRAD_WIDTH(c);
    } else {
        out[0] = HV_ROW_M(c); out[1] = HV_ROW_V(c); out[2] = HV_ROW_STEP(c); out[3] = HV_ROW_WIDTH(c);
    }
}

uint64_t hv_empty_key(void) { return HV_EMPTY_KEY; }

/* Rows of a large table sit far apart: the hardware prefetcher cannot guess the next one, so
   ask for the row AHEAD iterations early (4x faster on a 400k-row table than without). */
#define AHEAD 8
static inline void prefetch_row(const float *row, int64_t width, int for_write)
{
    const char *q = (const char *)row;
    for (int64_t b = 0; b < width * 4; b += 64) {
        if (for_write) __builtin_prefetch(q + b, 1); else __builtin_prefetch(q + b, 0);
    }
    if (for_write) __builtin_prefetch(q + width * 4 - 1, 1); else __builtin_prefetch(q + width * 4 - 1, 0);
}

/* Lazy Adam on rows[idx[i]], i < n. Row: hvctr.formats' [p (c) | m (c) | v (c) | step (1)], c = D + 1.
   The same float32 arithmetic as torch.optim.Adam's single-tensor path, with per-row step. */
void hv_sparse_adam(float *rows, int64_t width, const int64_t *idx, int64_t n,
                    const float *grad, int64_t c, double lr, double beta1, double beta2, float eps)
{
    const float w1 = (float)(1.0 - beta1), b2 = (float)beta2, w2 = (float)(1.0 - beta2);
    for (int64_t i = 0; i < n; ++i) {
        float *p = rows + idx[i] * width, *m = p + HV_ROW_M(c), *v = p + HV_ROW_V(c), *st = p + HV_ROW_STEP(c);
        const float *g = grad + i * c;
        if (i + AHEAD < n) prefetch_row(rows + idx[i + AHEAD] * width, width, 1);
        const float step = *st + 1.0f;
        *st = step;
        const float step_size = (float)(lr / (1.0 - pow(beta1, (double)step)));
        const float bc2_sqrt = (float)sqrt(1.0 - pow(beta2, (double)step));
        for (int64_t j = 0; j < c; ++j) {
            const float mj = m[j] + w1 * (g[j] - m[j]);
            const float vj = v[j] * b2 + (w2 * g[j]) * g[j];
            m[j] = mj;
            v[j] = vj;
            p[j] = p[j] - (step_size * mj) / (sqrtf(vj) / bc2_sqrt + eps);
        }
    }
}

/* The mean of g[0:c]^2, summed in order in double (each square is exact there). */
static inline float mean_square(const float *g, int64_t c)
{
    double sq = 0.0;
    for (int64_t j = 0; j < c; ++j) sq += (double)g[j] * (double)g[j];
    return (float)(sq / (double)c);
}

/* Row-wise Adam on rows[idx[i]], i < n (fbgemm's PARTIAL_ROWWISE_ADAM). Row: [p (c) | m (c) |
   v (1) | step (1)]: m per column as Adam's, one v a row from the row's mean squared gradient,
   Adam's bias corrections with the per-row step. */
void hv_sparse_rowwise_adam(float *rows, int64_t width, const int64_t *idx, int64_t n,
                            const float *grad, int64_t c, double lr, double beta1, double beta2, float eps)
{
    const float w1 = (float)(1.0 - beta1), b2 = (float)beta2, w2 = (float)(1.0 - beta2);
    for (int64_t i = 0; i < n; ++i) {
        float *p = rows + idx[i] * width, *m = p + HV_RWADAM_M(c), *v = p + HV_RWADAM_V(c);
        float *st = p + HV_RWADAM_STEP(c);
        const float *g = grad + i * c;
        if (i + AHEAD < n) prefetch_row(rows + idx[i + AHEAD] * width, width, 1);
        const float step = *st + 1.0f;
        *st = step;
        const float step_size = (float)(lr / (1.0 - pow(beta1, (double)step)));
        const float bc2_sqrt = (float)sqrt(1.0 - pow(beta2, (double)step));
        const float vr = *v * b2 + w2 * mean_square(g, c);
        *v = vr;
        const float denom = sqrtf(vr) / bc2_sqrt + eps;
        for (int64_t j = 0; j < c; ++j) {
            const float mj = m[j] + w1 * (g[j] - m[j]);
            m[j] = mj;
            p[j] = p[j] - (step_size * mj) / denom;
        }
    }
}

/* Row-wise Adagrad on rows[idx[i]], i < n (fbgemm's EXACT_ROWWISE_ADAGRAD, TorchRec's fused
   optimiser). Row: [p (c) | acc (1) | step (1)]: acc += the row's mean squared gradient,
   p -= lr * g / (sqrt(acc) + eps); the step only counts (merge.sparse_rule = matched reads it). */
void hv_sparse_rowwise_adagrad(float *rows, int64_t width, const int64_t *idx, int64_t n,
                               const float *grad, int64_t c, double lr, float eps)
{
    const float lr_f = (float)lr;
    for (int64_t i = 0; i < n; ++i) {
        float *p = rows + idx[i] * width, *acc = p + HV_RWADAGRAD_V(c), *st = p + HV_RWADAGRAD_STEP(c);
        const float *g = grad + i * c;
        if (i + AHEAD < n) prefetch_row(rows + idx[i + AHEAD] * width, width, 1);
        *st = *st + 1.0f;
        const float a = *acc + mean_square(g, c);
        *acc = a;
        const float denom = sqrtf(a) + eps;
        for (int64_t j = 0; j < c; ++j) p[j] = p[j] - (lr_f * g[j]) / denom;
    }
}

/* out[inverse[i]] += grad[i] for i < n, in ascending i; out is [*, c] and zeroed by the caller. */
void hv_sum_rows(const int64_t *inverse, int64_t n, const float *grad, int64_t c, float *out)
{
    for (int64_t i = 0; i < n; ++i) {
        float *o = out + inverse[i] * c;
        const float *g = grad + i * c;
        for (int64_t j = 0; j < c; ++j) o[j] += g[j];
    }
}

/* Sorted distinct values of pos[0:n] (each in [0, bound)) into uniq, their count returned, and
   inverse[i] = the index of pos[i] in uniq: torch.unique(sorted=True, return_inverse=True) in
   O(n + bound / 64) instead of a sort. bits: (bound + 63) / 64 zeroed words; slot: int32
   scratch of bound entries, any contents (only the entries of present values are read). */
int64_t hv_batch_unique(const int64_t *pos, int64_t n, int64_t bound, uint64_t *bits, int32_t *slot,
                        int64_t *uniq, int64_t *inverse)
{
    for (int64_t i = 0; i < n; ++i) bits[pos[i] >> 6] |= (uint64_t)1 << (pos[i] & 63);
    int64_t k = 0;
    for (int64_t w = 0; w < (bound + 63) / 64; ++w) {
        for (uint64_t word = bits[w]; word; word &= word - 1) {
            const int64_t p = w * 64 + __builtin_ctzll(word);
            slot[p] = (int32_t)k;
            uniq[k++] = p;
        }
    }
    for (int64_t i = 0; i < n; ++i) inverse[i] = slot[pos[i]];
    return k;
}

/* Distinct keys of keys[0:n] in order of first occurrence: uniq[0:k], first[j] = the index of
   uniq[j]'s first occurrence, inverse[i] = the index of keys[i] in uniq; returns k. One pass
   over an open-addressing table (table: cap = 2^bits int32 entries, all -1 on entry; uniq, first:
   room for `limit` keys, limit <= cap / 2). Returns -1, the outputs partial, where keys holds
   more than `limit` distinct keys: a table sized for the distinct keys, not for n, stays in the
   CPU's caches (a window of 3.7M multi-hot keys holds 260k). Keys are mixed again before
   probing, so keys that share low bits do not share slots. */
int64_t hv_unique_u64(const uint64_t *keys, int64_t n, int32_t *table, int64_t bits, int64_t limit,
                      uint64_t *uniq, int64_t *first, int64_t *inverse)
{
    const uint64_t mask = ((uint64_t)1 << bits) - 1;
    int64_t k = 0;
    for (int64_t i = 0; i < n; ++i) {
        const uint64_t key = keys[i];
        uint64_t s = ((key ^ (key >> 31)) * 0x9E3779B97F4A7C15ULL) >> (64 - bits);
        for (;;) {
            const int32_t e = table[s];
            if (e < 0) {
                if (k == limit)
                    return -1;
                table[s] = (int32_t)k;
                uniq[k] = key;
                first[k] = i;
                inverse[i] = k++;
                break;
            }
            if (uniq[e] == key) { inverse[i] = e; break; }
            s = (s + 1) & mask;
        }
    }
    return k;
}

/* The k-th smallest (0-based, k < n) of v[0:n], by radix selection: four passes of 16 bits, each
   counting, among the values that share the high bits found so far, each value of the next 16
   (hist: 65536 int64 of scratch). O(n) whatever the duplicates, where a quickselect (numpy's
   partition) slows 10-20x on an array mostly of one value, as a cache's scores are: every entry
   that came in one operation has the same (count, tick). */
uint64_t hv_kth_smallest_u64(const uint64_t *v, int64_t n, int64_t k, int64_t *hist)
{
    uint64_t prefix = 0, mask = 0;
    for (int shift = 48; shift >= 0; shift -= 16) {
        memset(hist, 0, 65536 * sizeof(int64_t));
        for (int64_t i = 0; i < n; ++i)  /* no branch: which values share the prefix is data */
            hist[(v[i] >> shift) & 0xFFFF] += (v[i] & mask) == prefix;
        int64_t d = 0;
        while (k >= hist[d])
            k -= hist[d++];
        prefix |= (uint64_t)d << shift;
        mask |= (uint64_t)0xFFFF << shift;
    }
    return prefix;
}

/* One alltoall message row per key: out[i] = [keys[order[i]] (8 bytes) | values[order[i], 0:c]],
   out is [n, c + 2] float32, values [*, ldv]. */
void hv_pack_rows(const uint64_t *keys, const int64_t *order, int64_t n, const float *values, int64_t ldv,
                  int64_t c, float *out)
{
    for (int64_t i = 0; i < n; ++i) {
        float *o = out + i * (c + 2);
        memcpy(o, keys + order[i], 8);
        memcpy(o + 2, values + order[i] * ldv, (size_t)c * 4);
    }
}

/* Message rows msg[i] = [key (8 bytes) | values (c)], row stride ld floats, concatenated in
   ascending source rank: distinct keys in order of first occurrence into uniq (their count
   returned); acc[j] = the sum of key j's values in message order (the first copy assigned,
   later ones added, so a single copy passes bit for bit); count[j] = its copies. With divide,
   acc[j] /= count[j] where count[j] > 1 (x / 1 is x). table: 2^bits int32 entries, all -1 on
   entry, 2^bits >= 2n. */
int64_t hv_merge_messages(const float *msg, int64_t n, int64_t ld, int64_t c, int32_t *table, int64_t bits,
                          int32_t divide, uint64_t *uniq, float *acc, int64_t *count)
{
    const uint64_t mask = ((uint64_t)1 << bits) - 1;
    int64_t k = 0;
    for (int64_t i = 0; i < n; ++i) {
        const float *row = msg + i * ld;
        uint64_t key;
        memcpy(&key, row, 8);  /* rows of an odd width leave keys 4-byte aligned */
        uint64_t s = ((key ^ (key >> 31)) * 0x9E3779B97F4A7C15ULL) >> (64 - bits);
        int64_t e;
        for (;;) {
            const int32_t t = table[s];
            if (t < 0) { table[s] = (int32_t)k; uniq[k] = key; count[k] = 0; e = k++; break; }
            if (uniq[t] == key) { e = t; break; }
            s = (s + 1) & mask;
        }
        float *a = acc + e * c;
        const float *v = row + 2;
        if (count[e]++ == 0) { for (int64_t j = 0; j < c; ++j) a[j] = v[j]; }
        else { for (int64_t j = 0; j < c; ++j) a[j] += v[j]; }
    }
    if (divide) {
        for (int64_t e = 0; e < k; ++e) {
            if (count[e] < 2) continue;
            const float d = (float)count[e];
            float *a = acc + e * c;
            for (int64_t j = 0; j < c; ++j) a[j] = a[j] / d;
        }
    }
    return k;
}

/* out[i] = rows[pos[i], 0:c] for i < n. */
void hv_gather_rows(const float *rows, int64_t width, const int64_t *pos, int64_t n, int64_t c, float *out)
{
    for (int64_t i = 0; i < n; ++i) {
        if (i + AHEAD < n) prefetch_row(rows + pos[i + AHEAD] * width, c, 0);
        const float *r = rows + pos[i] * width;
        float *o = out + i * c;
        for (int64_t j = 0; j < c; ++j) o[j] = r[j];
    }
}

/* --- linear-probing hash tables: the CPU cache's key -> entry table and the shard's index ---

   Both are arrays of 16-byte records {uint64 key, int64 value}; key k starts at slot
   mix64(k ^ salt) % nslots (splitmix64's finaliser, hvctr.formats.mix64) and walks on by one.
   A slot is empty (a lookup stops there) where its value is -1 (empty_by_key = 0: the cache,
   whose dead slots hold the value -2 and a key no real key equals) or its key is HV_EMPTY_KEY
   (empty_by_key = 1: the shard, which never removes an entry). */

typedef struct { uint64_t key; int64_t value; } hv_slot;

static inline uint64_t hv_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static inline int slot_empty(const hv_slot *s, int64_t empty_by_key)
{
    return empty_by_key ? s->key == HV_EMPTY_KEY : s->value == -1;
}

/* out[i] = the value stored with keys[i], or -1 where the key is absent. Homes are hashed a
   block ahead and their slots prefetched: a probe is then one cache miss that overlaps others. */
void hv_probe_find(const hv_slot *table, int64_t nslots, const uint64_t *keys, int64_t n, uint64_t salt,
                   int64_t empty_by_key, int64_t *out)
{
    enum { BLOCK = 64 };
    int64_t home[BLOCK];
    for (int64_t b = 0; b < n; b += BLOCK) {
        const int64_t m = n - b < BLOCK ? n - b : BLOCK;
        for (int64_t i = 0; i < m; ++i) {
            home[i] = (int64_t)(hv_mix64(keys[b + i] ^ salt) % (uint64_t)nslots);
            __builtin_prefetch(table + home[i], 0);
        }
        for (int64_t i = 0; i < m; ++i) {
            const uint64_t key = keys[b + i];
            int64_t s = home[i], value = -1;
            for (int64_t probed = 0; probed < nslots; ++probed) {
                const hv_slot *t = table + s;
                if (t->key == key && !(empty_by_key == 0 && t->value < 0)) { value = t->value; break; }
                if (slot_empty(t, empty_by_key)) break;
                if (++s == nslots) s = 0;
            }
            out[b + i] = value;
        }
    }
}

/* Stores keys[i] -> values[i] (keys absent and unique) in the first free slot from each home,
   in batch order: a free slot is an empty one, or (the cache) a dead one (value -2). Writes
   each key's slot to slots_out. Returns how many dead slots were reused, or -1 - i where key i
   found no free slot (the caller bounds the load factor, so this is a bug). */
int64_t hv_probe_claim(hv_slot *table, int64_t nslots, const uint64_t *keys, const int64_t *values, int64_t n,
                       uint64_t salt, int64_t empty_by_key, int64_t *slots_out)
{
    int64_t reused = 0;
    for (int64_t i = 0; i < n; ++i) {
        int64_t s = (int64_t)(hv_mix64(keys[i] ^ salt) % (uint64_t)nslots), probed = 0;
        if (i + 8 < n) __builtin_prefetch(table + (int64_t)(hv_mix64(keys[i + 8] ^ salt) % (uint64_t)nslots), 1);
        for (;;) {
            hv_slot *t = table + s;
            if (slot_empty(t, empty_by_key)) break;
            if (!empty_by_key && t->value == -2) { ++reused; break; }
            if (++probed == nslots) return -1 - i;
            if (++s == nslots) s = 0;
        }
        table[s].key = keys[i];
        table[s].value = values[i];
        slots_out[i] = s;
    }
    return reused;
}

/* The shard's key filter (hvctr.storage.shard.KeyFilter), a Bloom filter of `bits` bits: key k
   sets (add) or tests (test) bit mix64(k ^ salts[h]) % bits for each of the nsalts salts. add
   ORs them into `table`; test writes out[i] = 1 where every bit of key i is set. One pass over
   the keys, where numpy's bitwise_or.at and the gathers took a pass per salt and array. */
void hv_bloom_add(uint8_t *table, int64_t bits, const uint64_t *salts, int64_t nsalts, const uint64_t *keys, int64_t n)
{
    for (int64_t i = 0; i < n; ++i)
        for (int64_t h = 0; h < nsalts; ++h) {
            const uint64_t b = hv_mix64(keys[i] ^ salts[h]) % (uint64_t)bits;
            table[b >> 3] |= (uint8_t)(1u << (b & 7));
        }
}

void hv_bloom_test(const uint8_t *table, int64_t bits, const uint64_t *salts, int64_t nsalts, const uint64_t *keys,
                   int64_t n, uint8_t *out)
{
    for (int64_t i = 0; i < n; ++i) {
        uint8_t all = 1;
        for (int64_t h = 0; h < nsalts && all; ++h) {
            const uint64_t b = hv_mix64(keys[i] ^ salts[h]) % (uint64_t)bits;
            all = (table[b >> 3] >> (b & 7)) & 1;
        }
        out[i] = all;
    }
}

/* out[i] = rows[idx[i]] where idx[i] >= 0 (rows of width floats); rows with idx[i] < 0 are left
   as they are. The cache's row reads: one pass, rows prefetched ahead, no boolean-mask copies. */
void hv_take_rows(const float *rows, int64_t width, const int64_t *idx, int64_t n, float *out)
{
    for (int64_t i = 0; i < n; ++i) {
        if (i + AHEAD < n && idx[i + AHEAD] >= 0) prefetch_row(rows + idx[i + AHEAD] * width, width, 0);
        if (idx[i] < 0) continue;
        memcpy(out + i * width, rows + idx[i] * width, (size_t)width * 4);
    }
}

/* New rows, as hvctr.formats.init_rows computes them: row i's model columns j < c are
   uniform in [-scale, scale) from mix64(mix64(keys[i] ^ s) + (j + 1) * golden) >> 40 (24 bits),
   k / 2^23 - 1 in double and one rounding to float; the rest of the row (Adam's m, v, step) 0.
   The same operations in the same order as numpy's (no contraction: -ffp-contract=off), so the
   bits are equal; a pure function of (key, s, scale). */
void hv_init_rows(const uint64_t *keys, int64_t n, uint64_t s, int64_t c, int64_t width, double scale,
                  float *out)
{
    const uint64_t golden = 0x9E3779B97F4A7C15ULL;
    for (int64_t i = 0; i < n; ++i) {
        float *row = out + i * width;
        uint64_t base = hv_mix64(keys[i] ^ s);
        for (int64_t j = 0; j < c; ++j) {
            uint64_t bits = hv_mix64(base + (uint64_t)(j + 1) * golden) >> 40;
            double unit = (double)bits * 0x1p-23 - 1.0;
            row[j] = (float)(unit * scale);
        }
        memset(row + c, 0, (size_t)(width - c) * sizeof(float));
    }
}

/* rows[idx[i]] = src[i] where idx[i] >= 0: the cache's row writes, the same way. */
void hv_put_rows(float *rows, int64_t width, const int64_t *idx, int64_t n, const float *src)
{
    for (int64_t i = 0; i < n; ++i) {
        if (i + AHEAD < n && idx[i + AHEAD] >= 0) prefetch_row(rows + idx[i + AHEAD] * width, width, 1);
        if (idx[i] < 0) continue;
        memcpy(rows + idx[i] * width, src + i * width, (size_t)width * 4);
    }
}

/* The embeddings and first-order weights of a batch in one pass over its rows: emb[i] =
   rows[pos[i], 0:dim] and w1[i] = rows[pos[i], dim] (two hv_gather_rows calls read each row
   twice, the second time mostly from memory again). */
void hv_gather_split(const float *rows, int64_t width, const int64_t *pos, int64_t n, int64_t dim,
                     float *emb, float *w1)
{
    for (int64_t i = 0; i < n; ++i) {
        if (i + AHEAD < n) prefetch_row(rows + pos[i + AHEAD] * width, dim + 1, 0);
        const float *r = rows + pos[i] * width;
        memcpy(emb + i * dim, r, (size_t)dim * 4);
        w1[i] = r[dim];
    }
}

/* out[inverse[i] * ld + j] += grad[i * c + j] for i < n, j < c, in ascending i: hv_sum_rows
   into columns of a wider array (the [n, D+1] row gradient), with no buffer to copy from. */
void hv_sum_rows_ld(const int64_t *inverse, int64_t n, const float *grad, int64_t c, float *out, int64_t ld)
{
    for (int64_t i = 0; i < n; ++i) {
        float *o = out + inverse[i] * ld;
        const float *g = grad + i * c;
        for (int64_t j = 0; j < c; ++j) o[j] += g[j];
    }
}

/* Multi-valued fields: bag b (row b / nf, field b % nf) holds positions pos[off[b] .. off[b+1]).
   emb[b] = the sum of its rows' first dim columns, w1[b] = the sum of their column dim, summed
   in the bag's order from 0; a field with mean[b % nf] divides both by the bag's length (an empty
   bag is 0 either way). Exactly what the torch reference (hvctr.optim.pooling) computes. */
void hv_gather_pooled(const float *rows, int64_t width, const int64_t *pos, const int64_t *off, int64_t nbags,
                      int64_t nf, const uint8_t *mean, int64_t dim, float *emb, float *w1)
{
    for (int64_t b = 0; b < nbags; ++b) {
        float *e = emb + b * dim;
        float s1 = 0.0f;
        for (int64_t j = 0; j < dim; ++j) e[j] = 0.0f;
        const int64_t lo = off[b], hi = off[b + 1];
        for (int64_t i = lo; i < hi; ++i) {
            if (i + AHEAD < hi) prefetch_row(rows + pos[i + AHEAD] * width, dim + 1, 0);
            const float *r = rows + pos[i] * width;
            for (int64_t j = 0; j < dim; ++j) e[j] += r[j];
            s1 += r[dim];
        }
        if (mean[b % nf] && hi > lo) {
            const float n = (float)(hi - lo);
            for (int64_t j = 0; j < dim; ++j) e[j] /= n;
            s1 /= n;
        }
        w1[b] = s1;
    }
}

/* The backward of hv_gather_pooled, summed per distinct row: for every value i of bag b (in
   ascending i), out[inverse[i] * ld + j] += g[b * c + j] (divided by the bag's length where its
   field is mean-pooled) for j < c. c = dim writes the embedding's columns, c = 1 at out + dim the
   w1 column: hv_sum_rows_ld with each value's gradient its bag's. */
void hv_sum_pooled_ld(const int64_t *inverse, const int64_t *off, int64_t nbags, int64_t nf, const uint8_t *mean,
                      const float *grad, int64_t c, float *out, int64_t ld)
{
    for (int64_t b = 0; b < nbags; ++b) {
        const int64_t lo = off[b], hi = off[b + 1];
        const float *g = grad + b * c;
        if (mean[b % nf] && hi > lo) {
            const float n = (float)(hi - lo);
            for (int64_t i = lo; i < hi; ++i) {
                float *o = out + inverse[i] * ld;
                for (int64_t j = 0; j < c; ++j) o[j] += g[j] / n;
            }
        } else {
            for (int64_t i = lo; i < hi; ++i) {
                float *o = out + inverse[i] * ld;
                for (int64_t j = 0; j < c; ++j) o[j] += g[j];
            }
        }
    }
}


/* ---- the SSD shard's I/O: many reads in flight, write-behind ---------------------------------

   A window's cold rows and index blocks are read with a pool of threads doing pread, so the
   device sees up to `threads` requests at once (a memmap's page faults are one at a time, and
   each drags in the file's readahead). Items are given as sorted positions: item i lies at
   base + pos[i] * item_bytes. Items whose 4 KiB pages are the same or adjacent are coalesced into
   one read of their page-aligned span (at most HV_IO_MAX_RUN bytes) into a thread's scratch, then
   copied out.

   Writes read-modify-write whole pages: the span of a run of items (pages that hold nothing
   else of this batch are not touched) is read by the pool, patched, and written back whole, so
   the kernel never reads a partly written page itself (buffered writes to one file serialise on
   its inode lock: a page read inside one would be a read at depth 1). Runs of one write never
   share a page. With HV_IO_WRITE_BEHIND the written span is then flushed (sync_file_range) and
   the pages written (the runs, not the span between them) dropped from the page cache: a memory
   cgroup counts page cache, and v1 does not throttle a group's dirty pages. Pages of the span
   this write did not touch (rows and index blocks read earlier, still clean and useful) stay.

   Both return 0, or -errno of the first failed system call (-EIO: an item past the end of the
   file). stats (if not NULL): [runs, bytes moved by system calls, system calls]. */

#define HV_IO_PAGE 4096LL
#define HV_IO_MAX_RUN (256LL * 1024)
#define HV_IO_MAX_THREADS 256
#define HV_IO_WRITE_BEHIND 1

typedef struct { int64_t first, count, lo, hi; } hv_io_run;

typedef struct hv_io_job {
    int fd, write, flags;
    int64_t base, item_bytes;
    const int64_t *pos;
    char *buf;
    const hv_io_run *runs;
    int64_t nruns, next, err, calls, bytes;
    int nowait;                      /* reads with RWF_NOWAIT: -EAGAIN where one would wait on the device */
    char *map;                       /* the file mapped shared from offset 0 (NULL: none), map_len bytes */
    int64_t map_len;
    int64_t helpers_max, helpers_in; /* the pool's threads it may take, and those working on it (io_mu) */
    struct hv_io_job *queued;        /* the next job in io_queue (io_mu) */
} hv_io_job;

static inline int64_t io_floor(int64_t x) { return x & ~(HV_IO_PAGE - 1); }
static inline int64_t io_ceil(int64_t x) { return (x + HV_IO_PAGE - 1) & ~(HV_IO_PAGE - 1); }

/* Sorted items -> runs of page-aligned spans. Reads: an item joins the run when its first page is
   at most the run's last page + 1, and runs are cut at the cap anywhere. Writes: the same, but a
   run is cut only where the next item starts on a fresh page (two runs never share a page). */
static int64_t io_make_runs(const hv_io_job *jb, hv_io_run *runs)
{
    const int64_t *pos = jb->pos, ib = jb->item_bytes, base = jb->base;
    const int64_t n = jb->nruns; /* the item count, passed in here */
    int64_t nr = 0;
    for (int64_t i = 0; i < n;) {
        int64_t at = base + pos[i] * ib, end = at + ib, lo = io_floor(at), j = i + 1;
        while (j < n) {
            int64_t a = base + pos[j] * ib, e = a + ib;
            if (a < end || io_floor(a) > io_floor(end - 1) + HV_IO_PAGE) break;
            int fresh = io_floor(a) > io_floor(end - 1);
            if (io_ceil(e) - lo > HV_IO_MAX_RUN && (!jb->write || fresh)) break;
            end = e;
            ++j;
        }
        runs[nr].first = i;
        runs[nr].count = j - i;
        runs[nr].lo = lo;
        runs[nr].hi = io_ceil(end);
        ++nr;
        i = j;
    }
    return nr;
}

/* pread of [at, at + len): *got bytes before the end of the file (the rest is zeroed). With
   jb->nowait, -EAGAIN where the page cache lacks a page of it, -EOPNOTSUPP where the kernel or the
   file system refuses RWF_NOWAIT. */
static int64_t io_pread(hv_io_job *jb, char *p, int64_t len, int64_t at, int64_t *got)
{
    *got = 0;
    while (len > 0) {
        ssize_t r;
        if (jb->nowait) {
            struct iovec v = {.iov_base = p, .iov_len = (size_t)len};
            r = preadv2(jb->fd, &v, 1, at, RWF_NOWAIT);
        } else {
            r = pread(jb->fd, p, (size_t)len, at);
        }
        __atomic_fetch_add(&jb->calls, 1, __ATOMIC_RELAXED);
        if (r < 0) {
            if (errno == EINTR) continue;
            if (jb->nowait) return errno == EAGAIN ? -EAGAIN : errno == EOPNOTSUPP || errno == EINVAL ? -EOPNOTSUPP : -errno;
            /* O_DIRECT (a read fd opened so): a short read at the end of the file leaves the next
               offset unaligned, which the kernel refuses rather than report the end */
            if (errno == EINVAL && *got > 0) { memset(p, 0, (size_t)len); return 0; }
            return -errno;
        }
        if (r == 0) { memset(p, 0, (size_t)len); return 0; }
        p += r; len -= r; at += r; *got += r;
    }
    return 0;
}

static int64_t io_pwrite(hv_io_job *jb, const char *p, int64_t len, int64_t at)
{
    while (len > 0) {
        ssize_t r = pwrite(jb->fd, p, (size_t)len, at);
        __atomic_fetch_add(&jb->calls, 1, __ATOMIC_RELAXED);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        p += r; len -= r; at += r;
    }
    return 0;
}

/* A pool thread's scratch comes straight from mmap, not malloc: from a thread, malloc takes it
   from one of glibc's per-thread arenas (once freed numpy arrays have raised glibc's mmap
   threshold above its size), and those arenas kept tens of MiB of a rank's memory that
   malloc_trim gave back only in part. munmap hands it back at once, whatever the threshold. */
static char *io_scratch_new(int64_t bytes)
{
    void *p = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : (char *)p;
}

static void io_scratch_free(char *p, int64_t bytes)
{
    if (p) munmap(p, (size_t)bytes);
}

static int64_t io_do_run(hv_io_job *jb, const hv_io_run *r, char **scratch, int64_t *cap)
{
    const int64_t ib = jb->item_bytes, span = r->hi - r->lo;
    const int64_t first_at = jb->base + jb->pos[r->first] * ib;
    const int64_t need = jb->base + jb->pos[r->first + r->count - 1] * ib + ib - r->lo;
    int64_t got = 0, rc;
    if (jb->write && first_at == r->lo && need == r->count * ib && need == span) {
        /* whole pages, items end to end: straight from the caller's buffer */
        rc = io_pwrite(jb, jb->buf + r->first * ib, span, r->lo);
        if (!rc) __atomic_fetch_add(&jb->bytes, span, __ATOMIC_RELAXED);
        return rc;
    }
    if (span > *cap) { /* once for any run of the batch (HV_IO_MAX_RUN), or a longer write's */
        const int64_t want = span > HV_IO_MAX_RUN + 2 * HV_IO_PAGE ? span : HV_IO_MAX_RUN + 2 * HV_IO_PAGE;
        char *bigger = io_scratch_new(want);
        if (!bigger) return -ENOMEM;
        io_scratch_free(*scratch, *cap);
        *scratch = bigger;
        *cap = want;
    }
    const int64_t last_end = jb->base + jb->pos[r->first + r->count - 1] * ib + ib;
    if (jb->write && jb->pos[r->first + r->count - 1] - jb->pos[r->first] + 1 == r->count && span > 2 * HV_IO_PAGE) {
        /* items end to end: only the first and the last page hold bytes of others */
        int64_t g1 = HV_IO_PAGE, g2 = HV_IO_PAGE;
        if (first_at > r->lo && (rc = io_pread(jb, *scratch, HV_IO_PAGE, r->lo, &g1))) return rc;
        if (last_end < r->hi && (rc = io_pread(jb, *scratch + span - HV_IO_PAGE, HV_IO_PAGE, r->hi - HV_IO_PAGE, &g2)))
            return rc;
        got = g2 < HV_IO_PAGE ? span - HV_IO_PAGE + g2 : span; /* the file may end inside the last page */
        memcpy(*scratch + (first_at - r->lo), jb->buf + r->first * ib, (size_t)(r->count * ib));
        const int64_t len = got < span ? (need > got ? need : got) : span;
        rc = io_pwrite(jb, *scratch, len, r->lo);
        if (!rc) __atomic_fetch_add(&jb->bytes, len + (first_at > r->lo) * HV_IO_PAGE + (last_end < r->hi) * HV_IO_PAGE,
                                    __ATOMIC_RELAXED);
        return rc;
    }
    rc = io_pread(jb, *scratch, span, r->lo, &got);
    if (rc) return rc;
    if (!jb->write) {
        if (got < need) return -EIO; /* an item past the end of the file */
        for (int64_t k = 0; k < r->count; ++k) {
            const int64_t i = r->first + k;
            memcpy(jb->buf + i * ib, *scratch + (jb->base + jb->pos[i] * ib - r->lo), (size_t)ib);
        }
        __atomic_fetch_add(&jb->bytes, span, __ATOMIC_RELAXED);
        return 0;
    }
    for (int64_t k = 0; k < r->count; ++k) {
        const int64_t i = r->first + k;
        memcpy(*scratch + (jb->base + jb->pos[i] * ib - r->lo), jb->buf + i * ib, (size_t)ib);
    }
    const int64_t len = got < span ? (need > got ? need : got) : span; /* never grow the file past its items */
    rc = io_pwrite(jb, *scratch, len, r->lo);
    if (!rc) __atomic_fetch_add(&jb->bytes, 2 * len, __ATOMIC_RELAXED);
    return rc;
}

/* The mapped pass (a batch given the file's mapping, hv_io_map): the calling thread copies every
   run whose pages the page cache holds (mincore) straight between the mapping and the caller's
   items, no system call for it and no page copied whole: a 208-byte row costs 208 bytes, where a
   pread or the write's read-modify-write copies its 4 KiB page (twice for a write), and most of
   the out-of-core run's I/O CPU was those page copies (issue 32: 6.25 GB of pages read-modified-
   written for 556 MB of rows a rank). One mincore call covers a run and the runs after it up to
   HV_IO_MINCORE_PAGES pages. A run with a page not held, or past the mapping, goes on to the
   pool. A page dropped between mincore and the copy is faulted in (a read at depth 1: rare, and
   right). Shards map only where their pages are not flushed and dropped (no write-behind). */
#define HV_IO_MINCORE_PAGES 4096

/* Which pages of a mapping the page cache holds, asked of mincore for a window of up to
   HV_IO_MINCORE_PAGES pages at a time. */
typedef struct { unsigned char vec[HV_IO_MINCORE_PAGES]; int64_t lo, hi, calls; } io_residency;

/* 1 where every page of [lo, hi) (page-aligned offsets, at most a window) is in the page cache, 0
   where one is not, -errno where mincore failed. A span outside the window asks mincore anew for
   [lo, reach): `reach`, the end of the spans the caller will ask next, saves their calls. */
static int io_pages_held(io_residency *w, const char *map, int64_t map_len, int64_t lo, int64_t hi, int64_t reach)
{
    if (lo < w->lo || hi > w->hi) {
        const int64_t end = reach < io_ceil(map_len) ? reach : io_ceil(map_len);
        ++w->calls;
        if (mincore((void *)(map + lo), (size_t)(end - lo), w->vec)) {
            w->lo = w->hi = 0;
            return -errno;
        }
        w->lo = lo;
        w->hi = end;
    }
    for (int64_t at = lo; at < hi; at += HV_IO_PAGE)
        if (!(w->vec[(at - w->lo) / HV_IO_PAGE] & 1)) return 0;
    return 1;
}

static int64_t io_mapped_pass(hv_io_job *jb, const hv_io_run *runs, int64_t nruns, hv_io_run *waiting)
{
    const int64_t ib = jb->item_bytes, span_max = HV_IO_MINCORE_PAGES * HV_IO_PAGE;
    io_residency w = {.lo = 0, .hi = 0, .calls = 0};
    int64_t left = 0;
    for (int64_t k = 0; k < nruns; ++k) {
        const hv_io_run *r = &runs[k];
        const int64_t last_end = jb->base + jb->pos[r->first + r->count - 1] * ib + ib;
        int held = last_end <= jb->map_len && r->hi - r->lo <= span_max;
        if (held) {
            int64_t reach = r->hi; /* runs are sorted: the window ends before this one, or holds it */
            for (int64_t j = k + 1; r->hi > w.hi && j < nruns && runs[j].hi - r->lo <= span_max; ++j) reach = runs[j].hi;
            /* a failed mincore: the run goes to the pool, which reports what fails there */
            held = io_pages_held(&w, jb->map, jb->map_len, r->lo, r->hi, reach) == 1;
        }
        if (!held) {
            waiting[left++] = *r;
            continue;
        }
        for (int64_t i = r->first; i < r->first + r->count; ++i) {
            char *m = jb->map + jb->base + jb->pos[i] * ib, *b = jb->buf + i * ib;
            if (jb->write) memcpy(m, b, (size_t)ib); else memcpy(b, m, (size_t)ib);
        }
        jb->bytes += r->count * ib;
    }
    jb->calls += w.calls;
    return left;
}

/* A thread's scratch, kept between batches: runs of scattered rows and index blocks fit it; a
   longer run (up to HV_IO_MAX_RUN) grows it for the rest of the batch. 31 helpers then keep 2 MiB
   (a rank's memory budget counts it), where the whole 264 KiB each would keep 8 MiB. */
#define HV_IO_SCRATCH (64LL * 1024)

static void io_fail(hv_io_job *jb, int64_t rc)
{
    int64_t zero = 0;
    __atomic_compare_exchange_n(&jb->err, &zero, rc, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

/* Takes runs of jb until none is left (or one failed). */
static void io_work_on(hv_io_job *jb, char **scratch, int64_t *cap)
{
    for (;;) {
        if (__atomic_load_n(&jb->err, __ATOMIC_RELAXED)) break;
        const int64_t k = __atomic_fetch_add(&jb->next, 1, __ATOMIC_RELAXED);
        if (k >= jb->nruns) break;
        const int64_t rc = io_do_run(jb, &jb->runs[k], scratch, cap);
        if (rc) {
            io_fail(jb, rc);
            break;
        }
    }
}

/* The pool: threads started once and kept, each with its scratch, waiting for batches. A batch
   used to start its own threads and end them: at a table the page cache holds, the threads'
   starts (their stacks' mmap and mprotect, the munmap at their end) took more CPU than the reads
   (issue 32's out-of-core profile). A batch queues itself for up to threads - 1 helpers and works
   on its runs itself; the helpers that joined it leave once its runs are taken, and the batch
   returns after the last has left. Batches of several threads (the prefetch thread's warm, the
   training thread's pull and write-back) share the pool. In a child of fork() the pool is empty.
   The threads stay blocked on io_wake between batches, their signals blocked. */
static pthread_mutex_t io_mu = PTHREAD_MUTEX_INITIALIZER;
/* Before the pool, the calling thread does every run whose pages the page cache holds (reads with
   RWF_NOWAIT, which fail with EAGAIN where they would wait on the device) and hands the pool only
   the runs that would wait: a table in the page cache is read and written at memcpy's pace by one
   thread, no pool thread woken (on 2 cores, 31 woken threads per batch cost the compute's core
   more than the copies did), and a table far larger than memory pays one failed call a run, until
   HV_IO_NOWAIT_GIVE_UP runs in a row would wait: the rest of the batch goes to the pool untried.
   Where the kernel or the file system refuses RWF_NOWAIT, every run goes to the pool from then on;
   O_DIRECT descriptors (reads under write-behind) always go to the pool. */
#define HV_IO_NOWAIT_GIVE_UP 64
static int io_nowait_refused;
static pthread_cond_t io_wake = PTHREAD_COND_INITIALIZER; /* a batch was queued */
static pthread_cond_t io_left = PTHREAD_COND_INITIALIZER; /* a helper left a batch */
static hv_io_job *io_queue;                               /* batches that may take helpers */
static int64_t io_threads_started;
static int io_atfork_set;

static void io_pool_after_fork(void)
{
    pthread_mutex_init(&io_mu, NULL);
    pthread_cond_init(&io_wake, NULL);
    pthread_cond_init(&io_left, NULL);
    io_queue = NULL;
    io_threads_started = 0;
}

static int io_wants_help(const hv_io_job *jb)
{
    return jb->helpers_in < jb->helpers_max && !__atomic_load_n(&jb->err, __ATOMIC_RELAXED) &&
           __atomic_load_n(&jb->next, __ATOMIC_RELAXED) < jb->nruns;
}

static void *io_pool_thread(void *arg)
{
    (void)arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL); /* signals go to the process's own threads */
    int64_t cap = HV_IO_SCRATCH;
    char *scratch = io_scratch_new(cap);
    pthread_mutex_lock(&io_mu);
    if (!scratch) { /* no memory for it: the pool goes on without this thread */
        --io_threads_started;
        pthread_mutex_unlock(&io_mu);
        return NULL;
    }
    for (;;) {
        hv_io_job *jb = io_queue;
        while (jb && !io_wants_help(jb)) jb = jb->queued;
        if (!jb) {
            pthread_cond_wait(&io_wake, &io_mu);
            continue;
        }
        ++jb->helpers_in;
        pthread_mutex_unlock(&io_mu);
        io_work_on(jb, &scratch, &cap);
        if (cap > HV_IO_SCRATCH) { /* a larger run's scratch is not kept */
            io_scratch_free(scratch, cap);
            cap = HV_IO_SCRATCH;
            scratch = io_scratch_new(cap);
        }
        pthread_mutex_lock(&io_mu);
        if (--jb->helpers_in == 0) pthread_cond_broadcast(&io_left);
        if (!scratch) {
            --io_threads_started;
            pthread_mutex_unlock(&io_mu);
            return NULL;
        }
    }
}

/* Queues jb for up to jb->helpers_max of the pool's threads, starting threads the pool lacks. */
static void io_pool_enter(hv_io_job *jb)
{
    pthread_mutex_lock(&io_mu);
    if (!io_atfork_set) {
        pthread_atfork(NULL, NULL, io_pool_after_fork);
        io_atfork_set = 1;
    }
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    while (io_threads_started < jb->helpers_max && io_threads_started < HV_IO_MAX_THREADS) {
        pthread_t t;
        if (pthread_create(&t, &attr, io_pool_thread, NULL)) break; /* fewer threads, same result */
        ++io_threads_started;
    }
    pthread_attr_destroy(&attr);
    jb->queued = io_queue;
    io_queue = jb;
    pthread_cond_broadcast(&io_wake);
    pthread_mutex_unlock(&io_mu);
}

/* Takes jb off the queue and waits for its helpers to leave it. */
static void io_pool_leave(hv_io_job *jb)
{
    pthread_mutex_lock(&io_mu);
    for (hv_io_job **p = &io_queue; *p; p = &(*p)->queued)
        if (*p == jb) {
            *p = jb->queued;
            break;
        }
    while (jb->helpers_in) pthread_cond_wait(&io_left, &io_mu);
    pthread_mutex_unlock(&io_mu);
}

static int64_t io_batch(int64_t fd, int64_t base, int64_t item_bytes, const int64_t *pos, int64_t n, char *buf,
                        int64_t threads, int64_t flags, int64_t write, int64_t *stats, int64_t map, int64_t map_len)
{
    if (stats) stats[0] = stats[1] = stats[2] = 0;
    if (n <= 0) return 0;
    if (item_bytes <= 0 || item_bytes > HV_IO_MAX_RUN / 2 || base < 0) return -EINVAL;
    for (int64_t i = 0; i < n; ++i)
        if (pos[i] < 0 || (i && pos[i] <= pos[i - 1])) return -EINVAL; /* sorted, unique */
    hv_io_run *runs = malloc(sizeof(hv_io_run) * (size_t)n);
    if (!runs) return -ENOMEM;
    hv_io_job jb = {.fd = (int)fd, .write = (int)write, .flags = (int)flags, .base = base, .item_bytes = item_bytes,
                    .pos = pos, .buf = buf, .runs = runs, .nruns = n};
    const int64_t nruns = jb.nruns = io_make_runs(&jb, runs);
    int64_t cap = HV_IO_SCRATCH;
    char *scratch = io_scratch_new(cap);
    hv_io_run *waiting = NULL; /* the runs the first pass left to the pool */
    if (map && map_len > 0 && !(flags & HV_IO_WRITE_BEHIND) && (waiting = malloc(sizeof(hv_io_run) * (size_t)nruns))) {
        jb.map = (char *)(intptr_t)map;
        jb.map_len = map_len;
        jb.runs = waiting;
        jb.nruns = io_mapped_pass(&jb, runs, nruns, waiting); /* what the page cache lacks: the pool's */
    } else if (scratch && threads > 1 && !__atomic_load_n(&io_nowait_refused, __ATOMIC_RELAXED) &&
        !(fcntl((int)fd, F_GETFL) & O_DIRECT) && (waiting = malloc(sizeof(hv_io_run) * (size_t)nruns))) {
        int64_t left = 0, in_a_row = 0;
        jb.nowait = 1;
        for (int64_t k = 0; k < nruns && !jb.err; ++k) {
            const int64_t rc = in_a_row < HV_IO_NOWAIT_GIVE_UP ? io_do_run(&jb, &runs[k], &scratch, &cap) : -EAGAIN;
            if (rc == -EAGAIN || rc == -EOPNOTSUPP) {
                waiting[left++] = runs[k];
                ++in_a_row;
                if (rc == -EOPNOTSUPP) {
                    __atomic_store_n(&io_nowait_refused, 1, __ATOMIC_RELAXED);
                    in_a_row = HV_IO_NOWAIT_GIVE_UP;
                }
            } else if (rc) {
                io_fail(&jb, rc);
            } else {
                in_a_row = 0;
            }
        }
        jb.nowait = 0;
        jb.runs = waiting;
        jb.nruns = jb.err ? 0 : left;
    }
    int64_t nt = threads < 1 ? 1 : threads;
    if (nt > jb.nruns) nt = jb.nruns;
    if (nt > HV_IO_MAX_THREADS) nt = HV_IO_MAX_THREADS;
    jb.helpers_max = nt > 1 ? nt - 1 : 0;
    if (jb.helpers_max > 0) io_pool_enter(&jb);
    if (scratch) /* the calling thread works too */
        io_work_on(&jb, &scratch, &cap);
    else if (!jb.helpers_max)
        io_fail(&jb, -ENOMEM);
    if (jb.helpers_max > 0) io_pool_leave(&jb);
    io_scratch_free(scratch, cap);
    free(waiting);
    if (!jb.err && __atomic_load_n(&jb.next, __ATOMIC_RELAXED) < jb.nruns) /* no thread could take them */
        jb.err = -ENOMEM;
    int64_t rc = jb.err;
    if (!rc && write && (flags & HV_IO_WRITE_BEHIND)) {
        const int64_t lo = io_floor(base + pos[0] * item_bytes), hi = io_ceil(base + pos[n - 1] * item_bytes + item_bytes);
        if (sync_file_range((int)fd, lo, hi - lo, SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE |
                                                       SYNC_FILE_RANGE_WAIT_AFTER) < 0)
            rc = -errno;
        else
            for (int64_t k = 0; k < nruns;) { /* the runs written, adjacent ones as one range */
                int64_t a = runs[k].lo, b = runs[k].hi;
                for (++k; k < nruns && runs[k].lo <= b; ++k) b = runs[k].hi > b ? runs[k].hi : b;
                posix_fadvise((int)fd, a, b - a, POSIX_FADV_DONTNEED);
            }
    }
    if (stats) { stats[0] = nruns; stats[1] = jb.bytes; stats[2] = jb.calls; }
    free(runs);
    return rc;
}

/* map, map_len: the file's mapping from hv_io_map (0, 0: none): the runs the page cache holds are
   copied through it (the mapped pass, above); ignored with HV_IO_WRITE_BEHIND. */
int64_t hv_io_read(int64_t fd, int64_t base, int64_t item_bytes, const int64_t *pos, int64_t n, void *out,
                   int64_t threads, int64_t flags, int64_t *stats, int64_t map, int64_t map_len)
{
    return io_batch(fd, base, item_bytes, pos, n, (char *)out, threads, flags, 0, stats, map, map_len);
}

int64_t hv_io_write(int64_t fd, int64_t base, int64_t item_bytes, const int64_t *pos, int64_t n, const void *data,
                    int64_t threads, int64_t flags, int64_t *stats, int64_t map, int64_t map_len)
{
    return io_batch(fd, base, item_bytes, pos, n, (char *)data, threads, flags, 1, stats, map, map_len);
}

/* out[i] = 1 where every page of item i (at base + pos[i] * item_bytes, pos sorted) is in the page
   cache and inside the mapping, else 0: the mapped pass's mincore windows. The mincore calls made,
   or -errno. */
int64_t hv_io_held(int64_t map, int64_t map_len, int64_t base, int64_t item_bytes, const int64_t *pos, int64_t n,
                   int8_t *out)
{
    const int64_t span_max = HV_IO_MINCORE_PAGES * HV_IO_PAGE;
    io_residency w = {.lo = 0, .hi = 0, .calls = 0};
    for (int64_t i = 0; i < n; ++i) {
        const int64_t at = base + pos[i] * item_bytes, lo = io_floor(at), hi = io_ceil(at + item_bytes);
        int held = 0;
        if (pos[i] >= 0 && at + item_bytes <= map_len && hi - lo <= span_max) {
            int64_t reach = hi; /* items are sorted: the window ends before this one, or holds it */
            for (int64_t j = i + 1; hi > w.hi && j < n && io_ceil(base + pos[j] * item_bytes + item_bytes) - lo <= span_max; ++j)
                reach = io_ceil(base + pos[j] * item_bytes + item_bytes);
            held = io_pages_held(&w, (const char *)(intptr_t)map, map_len, lo, hi, reach);
            if (held < 0) return held;
        }
        out[i] = (int8_t)held;
    }
    return w.calls;
}

/* fd's first len bytes mapped shared (writable: read and write) for hv_io_read / hv_io_write:
   the address, or -errno. No readahead on a fault (MADV_RANDOM): a fault is one page. */
int64_t hv_io_map(int64_t fd, int64_t len, int64_t writable)
{
    if (len <= 0) return -EINVAL;
    void *p = mmap(NULL, (size_t)len, PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED, (int)fd, 0);
    if (p == MAP_FAILED) return -errno;
    madvise(p, (size_t)len, MADV_RANDOM);
    return (int64_t)(intptr_t)p;
}

int64_t hv_io_unmap(int64_t addr, int64_t len)
{
    return munmap((void *)(intptr_t)addr, (size_t)len) ? -errno : 0;
}

/* Flushes [offset, offset + len) of fd to the device and drops it from the page cache (the
   checkpoint's and the flush's sequential writes, behind them). 0 or -errno. */
int64_t hv_io_write_behind(int64_t fd, int64_t offset, int64_t len)
{
    if (len <= 0) return 0;
    if (sync_file_range((int)fd, offset, len, SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE |
                                                  SYNC_FILE_RANGE_WAIT_AFTER) < 0)
        return -errno;
    posix_fadvise((int)fd, offset, len, POSIX_FADV_DONTNEED);
    return 0;
}

/* ---- the shard's key index over blocks read from the file ------------------------------------

   The index is an open-addressing table of nslots hv_slot entries (empty: HV_EMPTY_KEY), linear
   probing from mix64(key ^ salt) % nslots. Instead of mapping all of it, the shard reads the
   blocks a batch needs (spb slots each; block b holds slots [b * spb, (b + 1) * spb)) and probes
   them here: `ids` are the loaded blocks' numbers, ascending, `blocks` their nb * spb slots.

   hv_index_find: for each key, walks from cur[i] (its home on the first call); found: out[i] =
   its value; an empty slot: out[i] = -1 (absent); a slot in a block not loaded: need[i] = that
   block and cur[i] = the slot, to be called again with it loaded. need[i] = -1 when done.
   hv_index_claim: the same walk for keys known absent, in batch order: the first empty slot
   takes key -> values[i] (in `blocks`; dirty[j] = 1 for each block j written), out[i] = slot.
   Both return how many keys still need a block (-1 - i: key i walked the whole table).
   addr (NULL: the blocks lie end to end in `blocks`): block j's address, for blocks probed where
   they are (in the shard's mapping, where the page cache holds them) beside blocks read. */

static int64_t io_block_of(const int64_t *ids, int64_t nb, int64_t b)
{
    int64_t lo = 0, hi = nb;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (ids[mid] < b) lo = mid + 1; else hi = mid;
    }
    return lo < nb && ids[lo] == b ? lo : -1;
}

static inline hv_slot *io_block_at(hv_slot *blocks, const int64_t *addr, int64_t j, int64_t spb)
{
    return addr ? (hv_slot *)(intptr_t)addr[j] : blocks + j * spb;
}

int64_t hv_index_find(const int64_t *ids, int64_t nb, const hv_slot *blocks, int64_t spb, int64_t nslots,
                      const uint64_t *keys, int64_t n, int64_t *cur, int64_t *out, int64_t *need, const int64_t *addr)
{
    int64_t pending = 0;
    for (int64_t i = 0; i < n; ++i) {
        int64_t s = cur[i], j = io_block_of(ids, nb, s / spb), probed = 0;
        need[i] = -1;
        for (;;) {
            if (j < 0) { need[i] = s / spb; cur[i] = s; ++pending; break; }
            const hv_slot *t = io_block_at((hv_slot *)blocks, addr, j, spb) + (s % spb);
            if (t->key == keys[i]) { out[i] = t->value; break; }
            if (t->key == HV_EMPTY_KEY) { out[i] = -1; break; }
            if (++probed == nslots) return -1 - i;
            if (++s == nslots) s = 0;
            if (s % spb == 0) j = io_block_of(ids, nb, s / spb);
        }
    }
    return pending;
}

int64_t hv_index_claim(const int64_t *ids, int64_t nb, hv_slot *blocks, int64_t spb, int64_t nslots,
                       const uint64_t *keys, const int64_t *values, int64_t n, int64_t *cur, int64_t *out,
                       int64_t *need, int8_t *dirty, const int64_t *addr)
{
    int64_t pending = 0;
    for (int64_t i = 0; i < n; ++i) {
        int64_t s = cur[i], j = io_block_of(ids, nb, s / spb), probed = 0;
        need[i] = -1;
        for (;;) {
            if (j < 0) { need[i] = s / spb; cur[i] = s; ++pending; break; }
            hv_slot *t = io_block_at(blocks, addr, j, spb) + (s % spb);
            if (t->key == HV_EMPTY_KEY) {
                /* the value first, the key after it: a writer killed between the two stores (in
                   the mapping, they are the file's page cache) leaves a slot that reads empty,
                   never a key with the empty row (-1), which would hide the key's row */
                t->value = values[i];
                __atomic_store_n(&t->key, keys[i], __ATOMIC_RELEASE);
                dirty[j] = 1;
                out[i] = s;
                break;
            }
            if (++probed == nslots) return -1 - i;
            if (++s == nslots) s = 0;
            if (s % spb == 0) j = io_block_of(ids, nb, s / spb);
        }
    }
    return pending;
}
