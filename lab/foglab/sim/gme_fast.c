/* The exhaustive GME search of lab/foglab/sim/gme_check.py, compiled: the same DFS, the same
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
 *
 * Two drivers of one expansion (`expand`): the DFS (`gme_search`, the Python search's order, one
 * table for the whole space) and the sweep (`gme_sweep`, in the order of a progress measure,
 * holding only the fingerprints of the states ahead: for spaces larger than the memory).
 */
#include <stdint.h>
#include <stdio.h>
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
enum { OK = 0, E_CALLBACK = 1, E_VIOLATION = 2, E_DEADLOCK = 3, E_FULL = 4, E_MAXSTATES = 5, E_NOMEM = 6, E_IO = 7, E_MEASURE = 8 };

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

/* ---- the visited set: 2^bits 64-bit fingerprints, linear probing --------------------------- */
typedef struct { u64 *slots; u64 mask, size, limit; } table;

static int table_init(table *t, int bits) {
    t->mask = ((u64)1 << bits) - 1;
    t->limit = (t->mask + 1) / 10 * 9;
    t->size = 0;
    t->slots = calloc(t->mask + 1, sizeof(u64));
    return t->slots ? 0 : -1;
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
    /* visited: one table (DFS); the sweep's tables are per sub-layer (gme_sweep) */
    table t;
    i32 *budget;          /* n: the start state's request budgets (the sweep's measure) */
    int2_cb_t counter_cb; vec counter;   /* the sweep's progress counter of (sid, left) */
    double held, peak_held, held_bytes, mem_cap, sublayers, unchecked;
    /* scratch of one expansion */
    i32 *best, *img, *kt, *nxt; struct cand_ *cands;
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
static void hash_key(const i32 *key, int L, u64 *index, u64 *fp) {  /* two independent hashes */
    u64 h1 = 0x6a09e667f3bcc908ULL, h2 = 0xbb67ae8584caa73bULL;
    for (int k = 0; k < L; k++) {
        u64 w = (uint32_t)key[k];
        h1 = mix(h1 ^ (w + 0x9e3779b97f4a7c15ULL));
        h2 = mix(h2 + (w ^ 0xc2b2ae3d27d4eb4fULL) * 0x165667b19e3779f9ULL);
    }
    *index = h1; *fp = h2 | 1;
}
static int visit(table *t, const i32 *key, int L, double *comparisons) {  /* 1 new, 0 seen, -1 full */
    u64 h1, fp;
    hash_key(key, L, &h1, &fp);
    u64 i = h1 & t->mask;
    for (;;) {
        u64 x = t->slots[i];
        if (!x) break;
        *comparisons += 1;
        if (x == fp) return 0;
        i = (i + 1) & t->mask;
    }
    if (t->size >= t->limit) return -1;
    t->slots[i] = fp;
    t->size++;
    return 1;
}

/* ---- one expansion: gme_check.exhaustive_check's loop body, line for line ------------------ */
typedef struct cand_ { int size; u64 mask; i32 members[64]; int nm; } cand;

static int cand_cmp(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->size != y->size) return x->size < y->size ? -1 : 1;
    for (int k = 0; k < x->nm && k < y->nm; k++)
        if (x->members[k] != y->members[k]) return x->members[k] < y->members[k] ? -1 : 1;
    return x->nm < y->nm ? -1 : x->nm > y->nm;
}

/* What a driver does with each successor, in the order the Python search generates them. */
typedef int (*succ_fn)(S *s, const i32 *nxt, void *ctx);

static int expand(S *s, const i32 *st, succ_fn on_succ, void *ctx) {
    int n = s->n, L = s->L;
    i32 ev[64][66]; int nev[64];
    cand *cands = s->cands;
    i32 *nxt = s->nxt;
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
    if (err) return err;
    if (total == 0) {
        s->schedules += 1;
        for (int i = 0; i < n; i++)
            if (st[n + i] || !(flags_of(s, st[i]) & F_IDLE)) { memcpy(s->bad_state, st, L * sizeof(i32)); return E_DEADLOCK; }
        return OK;
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
                    if (!r) return err;
                    if (flags_of(s, r[0]) & F_IN_CS) { ok = 0; break; }
                }
            }
            if (ok) chosen = c;
        }
        if (chosen < 0) s->full_expansions += 1;
        else {  /* the steps left out are computed too: their checks run in Python */
            for (int i = 0; i < n; i++) {
                int in = 0;
                for (int m = 0; m < cands[chosen].nm; m++) if (cands[chosen].members[m] == i) in = 1;
                if (in) continue;
                for (int e = 0; e < nev[i]; e++)
                    if (!step_of(s, i, st[i], ev[i][e], head_of(s, st, i, ev[i][e]))) return err;
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
            if (!r) return err;
            memcpy(nxt, st, L * sizeof(i32));
            nxt[i] = r[0];
            if (code == REQ) nxt[n + i] -= 1;
            else if (code >= 0) { i32 h, rest, k = slot_in(s, i, code); chan_pop(s, nxt[k], &h, &rest); nxt[k] = rest; }
            for (int q = 0; q < r[1]; q++) {
                i32 k = s->out_slot[i * n + r[2 + 2 * q]];
                nxt[k] = chan_push(s, nxt[k], r[3 + 2 * q]);
            }
            if (err) return err;
            if (flags_of(s, r[0]) & F_IN_CS) {
                int g = -1, two = 0;
                for (int j = 0; j < n; j++)
                    if (flags_of(s, nxt[j]) & F_IN_CS) { if (g >= 0 && s->groups[j] != g) two = 1; g = s->groups[j]; }
                if (two) { memcpy(s->bad_state, nxt, L * sizeof(i32)); return E_VIOLATION; }
            }
            int rc = on_succ(s, nxt, ctx);
            if (rc) return rc;
        }
    }
    return OK;
}

static void report(S *s, double top, double layer) {
    if (!s->progress_cb) return;
    double c[8] = { s->states, s->transitions, s->schedules, s->full_expansions, s->comparisons, top,
                    layer, s->t.mask ? (double)s->t.size : s->held };
    s->progress_cb(c);
}

/* ---- the DFS: the Python search's order exactly ------------------------------------------------ */
typedef struct { i32 *a; size_t top, cap; int L; } stack_t_;

static int push(stack_t_ *k, const i32 *st) {
    if (k->top == k->cap) {
        size_t cap = k->cap ? 2 * k->cap : 1 << 16;
        i32 *a = realloc(k->a, cap * k->L * sizeof(i32));
        if (!a) return E_NOMEM;
        k->a = a; k->cap = cap;
    }
    memcpy(k->a + k->top++ * k->L, st, k->L * sizeof(i32));
    return OK;
}

static int dfs_succ(S *s, const i32 *nxt, void *ctx) {
    key_of(s, nxt, s->best, s->img, s->kt);
    if (err) return err;
    int v = visit(&s->t, s->best, s->L, &s->comparisons);
    if (v < 0) return E_FULL;
    if (!v) return OK;
    s->states += 1;
    if (s->states > s->max_states) return E_MAXSTATES;
    return push(ctx, nxt);
}

int gme_search(S *s, const i32 *start) {
    int L = s->L;
    stack_t_ k = { NULL, 0, 0, L };
    i32 *st = malloc(L * sizeof(i32));
    int rc = OK;
    double next_report = s->progress_every;
    if (!st || s->n > 64) { rc = E_NOMEM; goto out; }
    err = 0;
    key_of(s, start, s->best, s->img, s->kt);
    if (err) { rc = err; goto out; }
    visit(&s->t, s->best, L, &s->comparisons);
    s->states = 1;
    if ((rc = push(&k, start))) goto out;
    while (k.top) {
        memcpy(st, k.a + --k.top * L, L * sizeof(i32));
        if ((rc = expand(s, st, dfs_succ, &k))) goto out;
        if (s->states >= next_report) { next_report += s->progress_every; report(s, (double)k.top, -1); }
    }
out:
    free(k.a); free(st);
    return rc;
}

/* ---- the sweep: the same expansion in the order of a progress measure, forgetting the past --
 *
 * The sweep-line method [Christensen, Kristensen and Mailund, TACAS 2001]: given a measure that
 * no transition decreases, explore the states in the order of the measure; once every state of
 * measure p is explored, no state of measure <= p can be reached again, and their fingerprints
 * are dropped. Memory then holds the fingerprints of the states still ahead, not the whole space.
 *
 * The measure here: (m, e), lexicographic. m counts requests and exits, the sum over nodes of
 * 2 * (budget - left) - (not idle): a request adds 1 (made + 1, no longer idle), an exit adds 1
 * (idle again), a delivery adds 0 (entering the CS changes neither). e is the sum of the nodes'
 * progress counters (gme_check._PROGRESS: 2-FGME's epoch, RA2's sum of VF, RA1 none), counting
 * 0 for a node idle with no request left: a delivery never lowers a counter and never makes a
 * node idle, and the one step that makes a counter stop counting (the last exit) raises m. Both
 * are functions of the class key (the classes keep the idle / requesting / in-CS kind and, where
 * it counts, the epoch; the key keeps the budgets), so a class is met at one measure only and the
 * counts are exact. Every successor is checked: m' = m and e' >= e, or m' = m + 1, else
 * E_MEASURE (the search stops: the argument would be wrong).
 *
 * A sub-layer (m, e) has its own table, grown by doubling (12-byte slots: the fingerprint and
 * the home index, to rehash), and its entry states (those reached from an earlier sub-layer)
 * wait in a file of LEB128 varints (~30 bytes a state). Inside a sub-layer the search is a DFS.
 * When the tables reach three quarters of `mem_cap`, a state for a later sub-layer that its
 * table has not seen is written unchecked (so duplicates may wait on disk) and checked against
 * that sub-layer's table when it is explored (delayed duplicate detection): disk instead of
 * memory, the same states and counts. The last quarter is for the sub-layer being explored.
 *
 * Which states are visited: the same classes as the DFS, each explored from the first state
 * found of its class; "first" follows another order here, and the persistent set chosen at a
 * state is not permutation-invariant (ties broken by node id), so with symmetry or merging on
 * the counts can differ a little from the DFS's (another, equally valid reduced graph); without
 * them they are equal (the tests check both). */
enum { MMAX = 130, EMAX = 4096 };

typedef struct { u64 *fp; uint32_t *home; u64 mask, size; } gtable;
typedef struct { gtable t; FILE *f; size_t count; } sublayer;

static int layer_of(S *s, const i32 *st) {
    int m = 0;
    for (int i = 0; i < s->n; i++) m += 2 * (s->budget[i] - st[s->n + i]) - !(flags_of(s, st[i]) & F_IDLE);
    return m;
}
static int counter_of(S *s, const i32 *st) {
    int e = 0;
    for (int i = 0; i < s->n; i++) {
        size_t k = (size_t)st[i] * s->stride + st[s->n + i];
        i32 c = vec_get(&s->counter, k);
        if (c < 0) {
            c = s->counter_cb(st[i], st[s->n + i]);
            if (c < 0 || vec_set(&s->counter, k, c)) { err = E_CALLBACK; return 0; }
        }
        e += c;
    }
    return e;
}

static int gtable_put(gtable *t, u64 h1, u64 fp) {  /* no growth here */
    u64 i = h1 & t->mask;
    while (t->fp[i]) i = (i + 1) & t->mask;
    t->fp[i] = fp; t->home[i] = (uint32_t)h1; t->size++;
    return 0;
}
static int gtable_grow(S *s, gtable *t, double limit) {
    u64 cap = t->fp ? 2 * (t->mask + 1) : 1 << 12;
    if (cap > ((u64)1 << 32)) return E_FULL;
    if (s->held_bytes + cap * 12 > limit) return E_FULL;
    gtable nt = { calloc(cap, sizeof(u64)), malloc(cap * sizeof(uint32_t)), cap - 1, 0 };
    if (!nt.fp || !nt.home) { free(nt.fp); free(nt.home); return E_NOMEM; }
    for (u64 i = 0; t->fp && i <= t->mask; i++) if (t->fp[i]) gtable_put(&nt, t->home[i], t->fp[i]);
    if (t->fp) s->held_bytes -= (t->mask + 1) * 12;
    s->held_bytes += cap * 12;
    free(t->fp); free(t->home);
    *t = nt;
    return OK;
}
/* 1 new, 0 seen, < 0 an error code negated (-E_FULL: not seen, but no room under `limit`) */
static int gvisit(S *s, gtable *t, const i32 *key, double limit) {
    u64 h1, fp;
    hash_key(key, s->L, &h1, &fp);
    if (t->fp) {
        for (u64 i = h1 & t->mask; t->fp[i]; i = (i + 1) & t->mask) {
            s->comparisons += 1;
            if (t->fp[i] == fp && t->home[i] == (uint32_t)h1) return 0;
        }
    }
    if (!t->fp || 10 * (t->size + 1) > 9 * (t->mask + 1)) {
        int rc = gtable_grow(s, t, limit);
        if (rc) return -rc;
    }
    gtable_put(t, h1, fp);
    if (++s->held > s->peak_held) s->peak_held = s->held;
    return 1;
}
static void gtable_free(S *s, gtable *t) {
    if (t->fp) s->held_bytes -= (t->mask + 1) * 12;
    s->held -= t->size;
    free(t->fp); free(t->home);
    memset(t, 0, sizeof *t);
}

static int spool_put(sublayer *w, const i32 *st, int L, int unchecked) {
    unsigned char buf[5 * 65], *p = buf;
    *p++ = (unsigned char)unchecked;
    for (int k = 0; k < L; k++) {
        uint32_t x = (uint32_t)st[k];
        while (x >= 0x80) { *p++ = (unsigned char)(x | 0x80); x >>= 7; }
        *p++ = (unsigned char)x;
    }
    if (fwrite(buf, 1, p - buf, w->f) != (size_t)(p - buf)) return E_IO;
    w->count++;
    return OK;
}
static int spool_get(FILE *f, i32 *st, int L, int *unchecked) {  /* 1 read, 0 end, -1 error */
    int c0 = getc(f);
    if (c0 == EOF) return 0;
    *unchecked = c0;
    for (int k = 0; k < L; k++) {
        uint32_t x = 0; int shift = 0, c;
        do {
            if ((c = getc(f)) == EOF) return -1;
            x |= (uint32_t)(c & 0x7f) << shift; shift += 7;
        } while (c & 0x80);
        st[k] = (i32)x;
    }
    return 1;
}
static void sub_path(char *path, size_t len, const char *dir, int m, int e) {
    snprintf(path, len, "%s/sub-%03d-%04d.bin", dir, m, e);
}

typedef struct { stack_t_ *k; sublayer **grid; const char *dir; int m, e; } sweep_ctx;
static int spool_to(sweep_ctx *c, sublayer *w, int m, int e, const i32 *st, int unchecked, int L);

static sublayer *sub_at(sweep_ctx *c, int m, int e, int create) {
    sublayer **x = &c->grid[(size_t)m * EMAX + e];
    if (!*x && create) *x = calloc(1, sizeof(sublayer));
    return *x;
}

static int sweep_succ(S *s, const i32 *nxt, void *ctx) {
    sweep_ctx *c = ctx;
    int m = layer_of(s, nxt), e = counter_of(s, nxt);
    if (err) return err;
    if (!((m == c->m && e >= c->e) || m == c->m + 1) || m >= MMAX || e >= EMAX) return E_MEASURE;
    key_of(s, nxt, s->best, s->img, s->kt);
    if (err) return err;
    sublayer *w = sub_at(c, m, e, 1);
    if (!w) return E_NOMEM;
    int now = m == c->m && e == c->e;
    /* a later sub-layer's table may not take the last quarter of the memory: past that, its
     * states wait unchecked (duplicates possible) and are checked when it is explored */
    int v = gvisit(s, &w->t, s->best, now ? s->mem_cap : 0.75 * s->mem_cap);
    if (v == -E_FULL && !now) { s->unchecked += 1; return spool_to(c, w, m, e, nxt, 1, s->L); }
    if (v < 0) return -v;
    if (!v) return OK;
    s->states += 1;
    if (s->states > s->max_states) return E_MAXSTATES;
    if (now) return push(c->k, nxt);
    return spool_to(c, w, m, e, nxt, 0, s->L);
}

static int spool_to(sweep_ctx *c, sublayer *w, int m, int e, const i32 *st, int unchecked, int L) {
    if (!w->f) {
        char path[4096];
        sub_path(path, sizeof path, c->dir, m, e);
        if (!(w->f = fopen(path, "wb"))) return E_IO;
        setvbuf(w->f, NULL, _IOFBF, 1 << 16);
    }
    return spool_put(w, st, L, unchecked);
}

int gme_sweep(S *s, const i32 *start, const char *dir) {
    int L = s->L, rc = OK;
    stack_t_ k = { NULL, 0, 0, L };
    i32 *st = malloc(L * sizeof(i32));
    sublayer **grid = calloc((size_t)MMAX * EMAX, sizeof(sublayer *));
    FILE *cur = NULL;
    char path[4096];
    double next_report = s->progress_every;
    if (!st || !grid || s->n > 64) { rc = E_NOMEM; goto out; }
    for (int i = 0; i < s->n; i++) s->budget[i] = start[s->n + i];
    err = 0;
    sweep_ctx c = { &k, grid, dir, layer_of(s, start), counter_of(s, start) };
    key_of(s, start, s->best, s->img, s->kt);
    if (err) { rc = err; goto out; }
    if (c.m >= MMAX || c.e >= EMAX) { rc = E_MEASURE; goto out; }
    sublayer *w = sub_at(&c, c.m, c.e, 1);
    if (!w || gvisit(s, &w->t, s->best, s->mem_cap) != 1) { rc = E_FULL; goto out; }
    s->states = 1;
    if ((rc = push(&k, start))) goto out;
    for (;;) {
        for (;;) {
            while (k.top) {
                memcpy(st, k.a + --k.top * L, L * sizeof(i32));
                if ((rc = expand(s, st, sweep_succ, &c))) goto out;
                if (s->states >= next_report) { next_report += s->progress_every; report(s, (double)k.top, c.m); }
            }
            if (!cur) break;
            int unchecked = 0, got = spool_get(cur, st, L, &unchecked);
            if (got < 0) { rc = E_IO; goto out; }
            if (!got) break;
            if (unchecked) {  /* written when memory was short: a duplicate, or new now */
                key_of(s, st, s->best, s->img, s->kt);
                if (err) { rc = err; goto out; }
                int v = gvisit(s, &sub_at(&c, c.m, c.e, 0)->t, s->best, s->mem_cap);
                if (v < 0) { rc = -v; goto out; }
                if (!v) continue;
                if (++s->states > s->max_states) { rc = E_MAXSTATES; goto out; }
            }
            if ((rc = push(&k, st))) goto out;
        }
        /* sub-layer (m, e) is done: nothing can reach it again */
        w = sub_at(&c, c.m, c.e, 0);
        if (cur) { fclose(cur); cur = NULL; sub_path(path, sizeof path, dir, c.m, c.e); remove(path); }
        gtable_free(s, &w->t);
        free(w);
        grid[(size_t)c.m * EMAX + c.e] = NULL;
        s->sublayers += 1;
        /* the next one: the smallest measure with a table */
        int found = 0;
        for (int m = c.m; m <= c.m + 1 && m < MMAX && !found; m++)
            for (int e = m == c.m ? c.e + 1 : 0; e < EMAX && !found; e++)
                if (grid[(size_t)m * EMAX + e]) { c.m = m; c.e = e; found = 1; }
        if (!found) break;
        w = sub_at(&c, c.m, c.e, 0);
        if (w->f) {
            if (fclose(w->f)) { w->f = NULL; rc = E_IO; goto out; }
            w->f = NULL;
            sub_path(path, sizeof path, dir, c.m, c.e);
            if (!(cur = fopen(path, "rb"))) { rc = E_IO; goto out; }
            setvbuf(cur, NULL, _IOFBF, 1 << 20);
        }
        report(s, 0, c.m);
    }
out:
    if (cur) fclose(cur);
    for (size_t i = 0; grid && i < (size_t)MMAX * EMAX; i++)
        if (grid[i]) {
            if (grid[i]->f) fclose(grid[i]->f);
            gtable_free(s, &grid[i]->t);
            free(grid[i]);
        }
    free(grid); free(k.a); free(st);
    return rc;
}

/* ---- setup, from Python ---------------------------------------------------------------------- */
S *gme_new(int n, int nch, int nperm, int stride, int merge, int reduction, const i32 *groups,
           const i32 *nin, const i32 *in_b, const i32 *in_k, const i32 *out_slot, const i32 *perm,
           const i32 *perm_pos, int table_bits, double mem_cap, double max_states, double progress_every,
           step_cb_t step_cb, int1_cb_t flags_cb, int2_cb_t klass_cb, int2_cb_t rclass_cb,
           int2_cb_t rmsg_cb, int2_cb_t counter_cb, progress_cb_t progress_cb) {
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
    s->budget = calloc(n, sizeof(i32));
    s->best = malloc(L * sizeof(i32)); s->img = malloc(L * sizeof(i32)); s->kt = malloc(L * sizeof(i32));
    s->nxt = malloc(L * sizeof(i32)); s->cands = malloc(64 * sizeof(cand));
    s->counter_cb = counter_cb; s->mem_cap = mem_cap;
    if (table_bits > 0 && table_init(&s->t, table_bits)) return NULL;  /* 0: a sweep, no DFS table */
    s->max_states = max_states; s->progress_every = progress_every;
    s->nchan = 1;  /* 0 = empty */
    vec_set(&s->ch_off, 0, 0); vec_set(&s->ch_len, 0, 0);
    if (!s->budget || !s->best || !s->img || !s->kt || !s->nxt || !s->cands || !s->bad_state || !s->rclass || !s->rmsg || !s->rchan) return NULL;
    return s;
}
void gme_counts(const S *s, double *out) {
    out[0] = s->states; out[1] = s->transitions; out[2] = s->schedules; out[3] = s->full_expansions;
    out[4] = s->comparisons; out[5] = s->t.mask ? (double)s->t.size : s->peak_held; out[6] = s->sublayers; out[7] = s->unchecked;
}
const i32 *gme_bad_state(const S *s) { return s->bad_state; }
const i32 *gme_chan(const S *s, int c, int *len) { *len = s->ch_len.a[c]; return s->chpool.a + s->ch_off.a[c]; }
void gme_free(S *s) {  /* the big parts: the tables (a process may run many searches) */
    if (!s) return;
    free(s->t.slots);
    s->t.slots = NULL;
}
