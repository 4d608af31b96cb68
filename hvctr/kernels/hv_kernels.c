/* hvctr's sparse-path hot loops: lazy Adam on rows in place, the batch's unique positions, the
   gather of its rows and the sum of its gradients per row; the window's unique keys; the
   exchange's packing of rows into messages and merging of the copies an owner receives.

   Built at install time by setuptools (setup.py: -O3 -Wall -ffp-contract=off, no -march) into a
   plain shared library that hvctr/kernels/native.py loads with ctypes; nothing is compiled at
   run time. The row layout comes from hv_row.h, generated from hvctr.formats.

   Every kernel walks its inputs in order on one thread: results do not depend on timing. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "hv_row.h"

#ifndef HV_SOURCE_SHA256
#define HV_SOURCE_SHA256 "unknown"
#endif

/* What the loader checks before it binds anything: the sources this library was built from
   (sha256 of hv_kernels.c, a NUL, hv_row.h; setup.py passes it) and the row layout it was
   compiled with, out = [M, V, STEP, WIDTH] offsets for a row of model width c. */
const char *hv_source_sha256(void) { return HV_SOURCE_SHA256; }

void hv_row_layout(int64_t c, int64_t *out)
{
    out[0] = HV_ROW_M(c);
    out[1] = HV_ROW_V(c);
    out[2] = HV_ROW_STEP(c);
    out[3] = HV_ROW_WIDTH(c);
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
   over an open-addressing table (table: cap = 2^bits int32 entries, all -1 on entry; cap >= 2n).
   Keys are mixed again before probing, so keys that share low bits do not share slots. */
int64_t hv_unique_u64(const uint64_t *keys, int64_t n, int32_t *table, int64_t bits,
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
