"""The sparse path's hot loops in C: lazy Adam on rows in place, the batch's unique positions,
the gather of its rows and the sum of its gradients per row; the window's unique keys; and the
exchange's packing of rows into messages and merging of the copies an owner receives.

Why C: in torch, lazy Adam on the ~24k rows a batch of 4096 x 26 touches is a gather of the
rows, a dozen elementwise ops on strided column views and a scatter back (about 5 ms on one
core, measured by ``python -m bench.sparse``); one pass per row, prefetching rows ahead,
takes about 1.2 ms, and the whole sparse path about 5% of the MLP step. The kernels are plain
C called through ctypes (which releases the GIL), compiled with the system C compiler in about
a second on first use and cached by a hash of the source and flags: no torch headers, no Python
extension build. Without a compiler ``lib()`` is None and callers use their torch or numpy path.

Every kernel walks its inputs in order on one thread: results do not depend on timing.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

from hvctr.dist.log import get_logger
from hvctr.formats import c_header

log = get_logger(__name__)

# -ffp-contract=off: no fused multiply-adds, so every build rounds the same way whatever the
# compiler's default on the target; no -ffast-math, no -march=native (the cache may be shared
# by nodes of different CPU types).
_CFLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno"]

_KERNELS = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

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
"""

# The row layout and key constants come from hvctr.formats, generated, never restated here.
_SRC = c_header() + _KERNELS

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_disabled = 0


def _cache_dir() -> Path:
    base = os.environ.get("HVCTR_NATIVE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hvctr", "native")
    return Path(base)


def _build(cc: str) -> Path:
    tag = hashlib.sha256("\0".join([_SRC, cc, *_CFLAGS, platform.machine()]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"hvctr_sparse_{tag}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build under a private name, then rename: ranks that start together never load a half-written file.
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "hvctr_sparse.c"
        src.write_text(_SRC)
        so = Path(tmp) / out.name
        subprocess.run([cc, *_CFLAGS, "-o", str(so), str(src), "-lm"], check=True, capture_output=True, text=True)
        os.replace(so, out)
    return out


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, f32, f64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_double
    lib.hv_sparse_adam.argtypes = [ptr, i64, ptr, i64, ptr, i64, f64, f64, f64, f32]
    lib.hv_sum_rows.argtypes = [ptr, i64, ptr, i64, ptr]
    lib.hv_gather_rows.argtypes = [ptr, i64, ptr, i64, i64, ptr]
    lib.hv_batch_unique.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr]
    lib.hv_batch_unique.restype = i64
    lib.hv_unique_u64.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr]
    lib.hv_unique_u64.restype = i64
    lib.hv_pack_rows.argtypes = [ptr, ptr, i64, ptr, i64, i64, ptr]
    lib.hv_pack_rows.restype = None
    lib.hv_merge_messages.argtypes = [ptr, i64, i64, i64, ptr, i64, ctypes.c_int32, ptr, ptr, ptr]
    lib.hv_merge_messages.restype = i64
    for f in (lib.hv_sparse_adam, lib.hv_sum_rows, lib.hv_gather_rows):
        f.restype = None


def lib() -> ctypes.CDLL | None:
    """The compiled kernels, built on first call; None where they cannot be built or are disabled.

    HVCTR_NATIVE=0 disables them (the torch path is then used everywhere); CC names the compiler.
    """
    global _lib, _tried
    if _disabled:
        return None
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if os.environ.get("HVCTR_NATIVE", "1") != "0":
                cc = os.environ.get("CC", "cc")
                try:
                    path = _build(cc)
                    _lib = ctypes.CDLL(str(path))
                    _declare(_lib)
                except (OSError, subprocess.CalledProcessError) as e:
                    detail = getattr(e, "stderr", "") or str(e)
                    log.warning("sparse kernels: C build with %r failed, using the slower torch path: %s", cc, detail)
                    _lib = None
            _tried = True
    return _lib


@contextlib.contextmanager
def disabled():
    """Within the block lib() is None: the torch path runs (tests compare it with the kernels)."""
    global _disabled
    _disabled += 1
    try:
        yield
    finally:
        _disabled -= 1
