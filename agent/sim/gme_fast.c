/* The exhaustive GME search of agent/sim/gme_check.py, compiled: the same DFS, the same
 * persistent sets, symmetry and dead-variable classes, in the same order, so that it visits
 * exactly the states the Python search visits (the tests compare the counts).
 *
 * Why: 2-FGME with 2+2 nodes x 2 requests has more than a billion reduced states, hours of
 * PyPy. What stays in Python: everything about the protocol. A local transition, the class of a
 * local state, the renaming of a class or of a message are computed by the real cores in
 * Python (callbacks, each once; the checker's soundness checks run there) and memoized here.
 * This file only combines them: global states, channels, the visited set.
 *
 * Visited set: 2^bits slots of 64-bit fingerprints (linear probing). The slot index comes from
 * one 64-bit hash of the canonical key and the fingerprint from another, so two states are
 * confused only if the fingerprints agree on a slot the probe visits: at most one chance in
 * 2^63 per comparison; the driver reports comparisons / 2^63 as the bound.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int32_t i32;
typedef uint64_t u64;

typedef int (*step_cb_t)(int node, int sid, int code, int mid, i32 *out, int cap);
typedef int (*int2_cb_t)(int a, int b);
typedef int (*int1_cb_t)(int a);
typedef void (*progress_cb_t)(const double *counts);

enum { REQ = -1, EXIT = -2 };
enum { F_IN_CS = 1, F_IDLE = 2 };
enum { OK = 0, E_CALLBACK = 1, E_VIOLATION = 2, E_DEADLOCK = 3, E_FULL = 4, E_MAXSTATES = 5, E_NOMEM = 6 };

/* ---- growable int arrays, -1 = not known yet ---------------------------------------------- */
typedef struct { i32 *a; size_t n; } vec;

static int vec_fit(vec *v, size_t i) {
    if (i < v->n) return 0;
    size_t n = v->n ? v->n : 1024;
    while (n <= i) n *= 2;
    i32 *a = realloc(v->a, n * sizeof(i32));
    if (!a) return -1;
    memset(a + v->n, 0xff, (n - v->n) * sizeof(i32));
    v->a = a; v->n = n;
    return 0;
}
static inline i32 vec_get(const vec *v, size_t i) { return i < v->n ? v->a[i] : -1; }
static int vec_set(vec *v, size_t i, i32 x) { if (vec_fit(v, i)) return -1; v->a[i] = x; return 0; }

/* ---- u64 -> i32 hash map (keys != 0) ------------------------------------------------------- */
typedef struct { u64 *k; i32 *v; size_t cap, n; } map;

static inline u64 mix(u64 x) {  /* murmur3 fmix64 */
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
    return x;
}
static int map_put(map *m, u64 key, i32 val);
static int map_grow(map *m) {
    map old = *m;
    m->cap = old.cap ? old.cap * 2 : 1 << 12;
    m->n = 0;
    m->k = calloc(m->cap, sizeof(u64));
    m->v = malloc(m->cap * sizeof(i32));
    if (!m->k || !m->v) return -1;
    for (size_t i = 0; i < old.cap; i++)
        if (old.k[i]) map_put(m, old.k[i], old.v[i]);
    free(old.k); free(old.v);
    return 0;
}
static i32 map_get(const map *m, u64 key) {
    if (!m->cap) return -1;
    size_t i = mix(key) & (m->cap - 1);
    while (m->k[i]) {
        if (m->k[i] == key) return m->v[i];
        i = (i + 1) & (m->cap - 1);
    }
    return -1;
}
static int map_put(map *m, u64 key, i32 val) {
    if (2 * (m->n + 1) > m->cap && map_grow(m)) return -1;
    size_t i = mix(key) & (m->cap - 1);
    while (m->k[i] && m->k[i] != key) i = (i + 1) & (m->cap - 1);
    if (!m->k[i]) m->n++;
    m->k[i] = key; m->v[i] = val;
    return 0;
}

/* ---- the search ---------------------------------------------------------------------------- */
typedef struct {
    /* system */
    int n, nch, L, nperm, stride, merge, reduction;
    i32 *groups;          /* n */
    i32 *nin, *in_b, *in_k; /* inbound[i]: nin[i] pairs (sender, slot), at i * n */
    i32 *out_slot;        /* n * n, -1 if no channel i -> to */
    i32 *perm;            /* nperm * n */
    i32 *perm_pos;        /* nperm * L: where position k goes */
    /* callbacks */
    step_cb_t step_cb; int1_cb_t flags_cb; int2_cb_t klass_cb, rclass_cb, rmsg_cb; progress_cb_t progress_cb;
    /* memos */
    vec flags, klass;
    vec *rclass, *rmsg, *rchan;   /* per permutation */
    map steps; vec pool;  size_t pool_n;   /* (sid, code, mid) -> offset in pool */
    /* channels: contents interned; 0 is empty */
    vec ch_off, ch_len, chpool; size_t chpool_n, nchan;
    map ch_ids;                  /* hash of contents -> id (chained by probing on equality) */
    vec pop_head, pop_rest; map push;
    /* visited */
    u64 *table; u64 mask, size, limit;
    /* counters */
    double states, transitions, schedules, full_expansions, comparisons, max_states, progress_every;
    i32 *bad_state;  /* L: the state of a violation or deadlock */
} S;

static int err;  /* last error code of a memo lookup */

static i32 flags_of(S *s, i32 sid) {
    i32 f = vec_get(&s->flags, sid);
    if (f < 0) {
        f = s->flags_cb(sid);
        if (f < 0 || vec_set(&s->flags, sid, f)) { err = E_CALLBACK; return 0; }
    }
    return f;
}
static i32 klass_of(S *s, i32 sid, i32 left) {
    size_t k = (size_t)sid * s->stride + left;
    i32 c = vec_get(&s->klass, k);
    if (c < 0) {
        c = s->klass_cb(sid, left);
        if (c < 0 || vec_set(&s->klass, k, c)) { err = E_CALLBACK; return 0; }
    }
    return c;
}
static i32 memo2(vec *v, int2_cb_t cb, i32 x, int p) {
    i32 r = vec_get(v, x);
    if (r < 0) {
        r = cb(x, p);
        if (r < 0 || vec_set(v, x, r)) { err = E_CALLBACK; return 0; }
    }
    return r;
}

/* channels ------------------------------------------------------------------------------------ */
static u64 seq_hash(const i32 *q, size_t len) {
    u64 h = 0x243f6a8885a308d3ULL ^ len;
    for (size_t i = 0; i < len; i++) h = mix(h ^ ((u64)(uint32_t)q[i] + 0x9e3779b97f4a7c15ULL));
    return h | 1;
}
static i32 chan_intern(S *s, const i32 *q, size_t len) {
    if (len == 0) return 0;
    u64 h = seq_hash(q, len);
    for (u64 probe = h;; probe = mix(probe) | 1) {  /* a chain of keys until equal contents or free */
        i32 c = map_get(&s->ch_ids, probe);
        if (c < 0) {
            c = (i32)s->nchan++;
            if (vec_fit(&s->chpool, s->chpool_n + len)) { err = E_NOMEM; return 0; }
            memcpy(s->chpool.a + s->chpool_n, q, len * sizeof(i32));
            if (vec_set(&s->ch_off, c, (i32)s->chpool_n) || vec_set(&s->ch_len, c, (i32)len) ||
                map_put(&s->ch_ids, probe, c)) { err = E_NOMEM; return 0; }
            s->chpool_n += len;
            return c;
        }
        if ((size_t)s->ch_len.a[c] == len && !memcmp(s->chpool.a + s->ch_off.a[c], q, len * sizeof(i32)))
            return c;
    }
}
static void chan_pop(S *s, i32 c, i32 *head, i32 *rest) {
    i32 h = vec_get(&s->pop_head, c);
    if (h < 0) {
        size_t len = s->ch_len.a[c];
        i32 *q = malloc(len * sizeof(i32));  /* a copy: interning may move the pool */
        if (!q) { err = E_NOMEM; *head = *rest = 0; return; }
        memcpy(q, s->chpool.a + s->ch_off.a[c], len * sizeof(i32));
        i32 r = chan_intern(s, q + 1, len - 1);
        h = q[0];
        free(q);
        if (vec_set(&s->pop_head, c, h) || vec_set(&s->pop_rest, c, r)) { err = E_NOMEM; }
    }
    *head = h;
    *rest = s->pop_rest.a[c];
}
static i32 chan_push(S *s, i32 c, i32 m) {
    u64 key = ((u64)(uint32_t)c << 32 | (uint32_t)m) + 1;
    i32 r = map_get(&s->push, key);
    if (r < 0) {
        size_t len = c ? s->ch_len.a[c] : 0;
        i32 *q = malloc((len + 1) * sizeof(i32));
        if (!q) { err = E_NOMEM; return 0; }
        if (len) memcpy(q, s->chpool.a + s->ch_off.a[c], len * sizeof(i32));
        q[len] = m;
        r = chan_intern(s, q, len + 1);
        free(q);
        if (map_put(&s->push, key, r)) err = E_NOMEM;
    }
    return r;
}
static i32 chan_rename(S *s, i32 c, int p) {
    if (!c) return 0;
    i32 r = vec_get(&s->rchan[p], c);
    if (r < 0) {
        size_t len = s->ch_len.a[c];
        i32 *q = malloc(len * sizeof(i32));
        if (!q) { err = E_NOMEM; return 0; }
        for (size_t i = 0; i < len; i++) q[i] = memo2(&s->rmsg[p], s->rmsg_cb, s->chpool.a[s->ch_off.a[c] + i], p);
        r = chan_intern(s, q, len);
        free(q);
        if (vec_set(&s->rchan[p], c, r)) err = E_NOMEM;
    }
    return r;
}

/* local steps ----------------------------------------------------------------------------------- */
static const i32 *step_of(S *s, int node, i32 sid, i32 code, i32 mid) {
    u64 key = ((u64)(uint32_t)sid << 34) ^ ((u64)(uint32_t)(code + 3) << 26) ^ (u64)(uint32_t)(mid + 1);
    key += 1;
    i32 off = map_get(&s->steps, key);
    if (off < 0) {
        i32 buf[2 + 2 * 256];
        int got = s->step_cb(node, sid, code, mid, buf, (int)(sizeof buf / sizeof buf[0]));
        if (got < 2) { err = E_CALLBACK; return NULL; }
        off = (i32)s->pool_n;
        if (vec_fit(&s->pool, s->pool_n + got)) { err = E_NOMEM; return NULL; }
        memcpy(s->pool.a + off, buf, got * sizeof(i32));
        s->pool_n += got;
        if (map_put(&s->steps, key, off)) { err = E_NOMEM; return NULL; }
    }
    return s->pool.a + off;  /* [nsid, nsends, to, mid, ...] */
}
static i32 head_of(S *s, const i32 *st, int i, i32 code) {
    if (code < 0) return -1;
    i32 h, r;
    for (int t = 0; t < s->nin[i]; t++)
        if (s->in_b[i * s->n + t] == code) { chan_pop(s, st[s->in_k[i * s->n + t]], &h, &r); return h; }
    return -1;
}
static i32 slot_in(S *s, int i, i32 b) {
    for (int t = 0; t < s->nin[i]; t++)
        if (s->in_b[i * s->n + t] == b) return s->in_k[i * s->n + t];
    return -1;
}

/* keys and the visited set ------------------------------------------------------------------------ */
static int lex_less(const i32 *a, const i32 *b, int len) {
    for (int k = 0; k < len; k++) if (a[k] != b[k]) return a[k] < b[k];
    return 0;
}
static void key_of(S *s, const i32 *st, i32 *best, i32 *img, i32 *kt) {
    int n = s->n, L = s->L;
    memcpy(kt, st, L * sizeof(i32));
    if (s->merge)
        for (int i = 0; i < n; i++) kt[i] = klass_of(s, st[i], st[n + i]);
    memcpy(best, kt, L * sizeof(i32));
    for (int p = 0; p < s->nperm; p++) {
        const i32 *pp = s->perm + p * n, *pos = s->perm_pos + p * L;
        for (int k = 0; k < n; k++) img[pp[k]] = memo2(&s->rclass[p], s->rclass_cb, kt[k], p);
        /* compare the node part first (the Python search does the same) */
        int cmp = 0;
        for (int k = 0; k < n && !cmp; k++) if (img[k] != best[k]) cmp = img[k] < best[k] ? -1 : 1;
        if (cmp > 0) continue;
        for (int k = n; k < 2 * n; k++) img[pos[k]] = kt[k];
        for (int k = 2 * n; k < L; k++) img[pos[k]] = chan_rename(s, kt[k], p);
        if (lex_less(img, best, L)) memcpy(best, img, L * sizeof(i32));
    }
}
static int visit(S *s, const i32 *key) {  /* 1 new, 0 seen, -1 full */
    u64 h1 = 0x6a09e667f3bcc908ULL, h2 = 0xbb67ae8584caa73bULL;
    for (int k = 0; k < s->L; k++) {
        u64 w = (uint32_t)key[k];
        h1 = mix(h1 ^ (w + 0x9e3779b97f4a7c15ULL));
        h2 = mix(h2 + (w ^ 0xc2b2ae3d27d4eb4fULL) * 0x165667b19e3779f9ULL);
    }
    u64 fp = h2 | 1, i = h1 & s->mask;
    for (;;) {
        u64 x = s->table[i];
        if (!x) break;
        s->comparisons += 1;
        if (x == fp) return 0;
        i = (i + 1) & s->mask;
    }
    if (s->size >= s->limit) return -1;
    s->table[i] = fp;
    s->size++;
    return 1;
}

/* ---- the DFS: gme_check.exhaustive_check's loop, line for line ------------------------------- */
typedef struct { int size; u64 mask; i32 members[64]; int nm; } cand;

static int cand_cmp(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->size != y->size) return x->size < y->size ? -1 : 1;
    for (int k = 0; k < x->nm && k < y->nm; k++)
        if (x->members[k] != y->members[k]) return x->members[k] < y->members[k] ? -1 : 1;
    return x->nm < y->nm ? -1 : x->nm > y->nm;
}

int gme_search(S *s, const i32 *start) {
    int n = s->n, L = s->L;
    size_t cap = 1 << 16, top = 0;
    i32 *stack = malloc(cap * L * sizeof(i32));
    i32 *best = malloc(L * sizeof(i32)), *img = malloc(L * sizeof(i32)), *kt = malloc(L * sizeof(i32));
    i32 *nxt = malloc(L * sizeof(i32));
    i32 ev[64][66]; int nev[64];
    cand *cands = malloc(64 * sizeof(cand));
    int rc = OK;
    double next_report = s->progress_every;
    if (!stack || !best || !img || !kt || !nxt || !cands || n > 64) { rc = E_NOMEM; goto out; }
    err = 0;
    key_of(s, start, best, img, kt);
    if (err) { rc = err; goto out; }
    visit(s, best);
    memcpy(stack, start, L * sizeof(i32)); top = 1;
    s->states = 1;
    while (top) {
        i32 st[L];
        top--;
        memcpy(st, stack + top * L, L * sizeof(i32));
        int total = 0;
        for (int i = 0; i < n; i++) {
            i32 f = flags_of(s, st[i]);
            nev[i] = 0;
            if ((f & F_IDLE) && st[n + i] > 0) ev[i][nev[i]++] = REQ;
            else if (f & F_IN_CS) ev[i][nev[i]++] = EXIT;
            for (int t = 0; t < s->nin[i]; t++)
                if (st[s->in_k[i * n + t]]) ev[i][nev[i]++] = s->in_b[i * n + t];
            total += nev[i];
        }
        if (err) { rc = err; goto out; }
        if (total == 0) {
            s->schedules += 1;
            int bad = 0;
            for (int i = 0; i < n; i++) if (st[n + i] || !(flags_of(s, st[i]) & F_IDLE)) bad = 1;
            if (bad) { memcpy(s->bad_state, st, L * sizeof(i32)); rc = E_DEADLOCK; goto out; }
            continue;
        }
        int chosen = -1, ncand = 0;
        if (s->reduction) {
            for (int i = 0; i < n; i++) {
                if (!nev[i]) continue;
                u64 mask = (u64)1 << i;
                int work[64], nw = 0;
                work[nw++] = i;
                while (nw) {
                    int j = work[--nw];
                    for (int t = 0; t < s->nin[j]; t++) {
                        int b = s->in_b[j * n + t];
                        if (!((mask >> b) & 1) && !st[s->in_k[j * n + t]]) { mask |= (u64)1 << b; work[nw++] = b; }
                    }
                }
                int dup = 0;
                for (int c = 0; c < ncand; c++) if (cands[c].mask == mask) dup = 1;
                if (dup) continue;
                cand c = { 0, mask, {0}, 0 };
                for (int j = 0; j < n; j++) if ((mask >> j) & 1) { c.members[c.nm++] = j; c.size += nev[j]; }
                /* the Python search remembers every mask seen, kept or not: same here */
                c.size = c.size < total ? c.size : -1;
                cands[ncand++] = c;
            }
            int kept = 0;
            for (int c = 0; c < ncand; c++) if (cands[c].size >= 0) cands[kept++] = cands[c];
            qsort(cands, kept, sizeof(cand), cand_cmp);
            for (int c = 0; c < kept && chosen < 0; c++) {
                int ok = 1;
                for (int m = 0; m < cands[c].nm && ok; m++) {
                    int j = cands[c].members[m];
                    if (flags_of(s, st[j]) & F_IN_CS) { ok = 0; break; }
                    for (int e = 0; e < nev[j]; e++) {
                        const i32 *r = step_of(s, j, st[j], ev[j][e], head_of(s, st, j, ev[j][e]));
                        if (!r) { rc = err; goto out; }
                        if (flags_of(s, r[0]) & F_IN_CS) { ok = 0; break; }
                    }
                }
                if (ok) chosen = c;
            }
            if (chosen < 0) s->full_expansions += 1;
            else {
                for (int i = 0; i < n; i++) {
                    int in = 0;
                    for (int m = 0; m < cands[chosen].nm; m++) if (cands[chosen].members[m] == i) in = 1;
                    if (in) continue;
                    for (int e = 0; e < nev[i]; e++)
                        if (!step_of(s, i, st[i], ev[i][e], head_of(s, st, i, ev[i][e]))) { rc = err; goto out; }
                }
            }
        }
        int nmov = chosen >= 0 ? cands[chosen].nm : n;
        for (int mi = 0; mi < nmov; mi++) {
            int i = chosen >= 0 ? cands[chosen].members[mi] : mi;
            for (int e = 0; e < nev[i]; e++) {
                i32 code = ev[i][e];
                s->transitions += 1;
                i32 mid = head_of(s, st, i, code);
                const i32 *r = step_of(s, i, st[i], code, mid);
                if (!r) { rc = err; goto out; }
                memcpy(nxt, st, L * sizeof(i32));
                nxt[i] = r[0];
                if (code == REQ) nxt[n + i] -= 1;
                else if (code >= 0) { i32 h, rest, k = slot_in(s, i, code); chan_pop(s, nxt[k], &h, &rest); nxt[k] = rest; }
                for (int q = 0; q < r[1]; q++) {
                    i32 k = s->out_slot[i * n + r[2 + 2 * q]];
                    nxt[k] = chan_push(s, nxt[k], r[3 + 2 * q]);
                }
                if (err) { rc = err; goto out; }
                if (flags_of(s, r[0]) & F_IN_CS) {
                    int g = -1, two = 0;
                    for (int j = 0; j < n; j++)
                        if (flags_of(s, nxt[j]) & F_IN_CS) { if (g >= 0 && s->groups[j] != g) two = 1; g = s->groups[j]; }
                    if (two) { memcpy(s->bad_state, nxt, L * sizeof(i32)); rc = E_VIOLATION; goto out; }
                }
                key_of(s, nxt, best, img, kt);
                if (err) { rc = err; goto out; }
                int v = visit(s, best);
                if (v < 0) { rc = E_FULL; goto out; }
                if (!v) continue;
                s->states += 1;
                if (s->states > s->max_states) { rc = E_MAXSTATES; goto out; }
                if (top == cap) {
                    i32 *ns = realloc(stack, 2 * cap * L * sizeof(i32));
                    if (!ns) { rc = E_NOMEM; goto out; }
                    stack = ns; cap *= 2;
                }
                memcpy(stack + top * L, nxt, L * sizeof(i32));
                top++;
            }
        }
        if (s->progress_cb && s->states >= next_report) {
            next_report += s->progress_every;
            double c[6] = { s->states, s->transitions, s->schedules, s->full_expansions, s->comparisons, (double)top };
            s->progress_cb(c);
        }
    }
out:
    free(stack); free(best); free(img); free(kt); free(nxt); free(cands);
    return rc;
}

/* ---- setup, from Python ---------------------------------------------------------------------- */
S *gme_new(int n, int nch, int nperm, int stride, int merge, int reduction, const i32 *groups,
           const i32 *nin, const i32 *in_b, const i32 *in_k, const i32 *out_slot, const i32 *perm,
           const i32 *perm_pos, int table_bits, double max_states, double progress_every,
           step_cb_t step_cb, int1_cb_t flags_cb, int2_cb_t klass_cb, int2_cb_t rclass_cb,
           int2_cb_t rmsg_cb, progress_cb_t progress_cb) {
    S *s = calloc(1, sizeof(S));
    if (!s) return NULL;
    int L = 2 * n + nch;
    s->n = n; s->nch = nch; s->L = L; s->nperm = nperm; s->stride = stride; s->merge = merge;
    s->reduction = reduction;
#define COPY(dst, src, len) do { dst = malloc((len) * sizeof(i32) + 1); if (!dst) return NULL; \
                                 memcpy(dst, src, (len) * sizeof(i32)); } while (0)
    COPY(s->groups, groups, n); COPY(s->nin, nin, n); COPY(s->in_b, in_b, n * n); COPY(s->in_k, in_k, n * n);
    COPY(s->out_slot, out_slot, n * n); COPY(s->perm, perm, nperm * n); COPY(s->perm_pos, perm_pos, nperm * L);
    s->bad_state = calloc(L, sizeof(i32));
    s->rclass = calloc(nperm + 1, sizeof(vec)); s->rmsg = calloc(nperm + 1, sizeof(vec));
    s->rchan = calloc(nperm + 1, sizeof(vec));
    s->step_cb = step_cb; s->flags_cb = flags_cb; s->klass_cb = klass_cb; s->rclass_cb = rclass_cb;
    s->rmsg_cb = rmsg_cb; s->progress_cb = progress_cb;
    s->mask = ((u64)1 << table_bits) - 1;
    s->limit = (s->mask + 1) / 10 * 9;
    s->table = calloc(s->mask + 1, sizeof(u64));
    s->max_states = max_states; s->progress_every = progress_every;
    s->nchan = 1;  /* 0 = empty */
    vec_set(&s->ch_off, 0, 0); vec_set(&s->ch_len, 0, 0);
    if (!s->table || !s->bad_state || !s->rclass || !s->rmsg || !s->rchan) return NULL;
    return s;
}
void gme_counts(const S *s, double *out) {
    out[0] = s->states; out[1] = s->transitions; out[2] = s->schedules; out[3] = s->full_expansions;
    out[4] = s->comparisons; out[5] = (double)s->size;
}
const i32 *gme_bad_state(const S *s) { return s->bad_state; }
const i32 *gme_chan(const S *s, int c, int *len) { *len = s->ch_len.a[c]; return s->chpool.a + s->ch_off.a[c]; }
