/* One pass over a run of whole Kineto events (torch.profiler's JSON layout): for each event, the fields
 * the streamed breakdown needs (category, name, ts, dur, tid), read by a small JSON tokenizer in one
 * sweep of the bytes. Built and loaded by cscan.py; parse.py's numpy reader is the reference and the
 * fallback (a run this scanner will not take returns KSCAN_NOT_MINE and is read there).
 *
 * Only the event's own keys are read: "args" and every other value are skipped whole (strings with
 * their escapes, objects and arrays by depth), so nothing inside args can be taken for a field.
 * Numbers are read as Python's float() reads them: a plain decimal whose digits fit in 2^53 is one
 * correctly rounded division by an exact power of ten; anything else goes through strtod (correctly
 * rounded in glibc). Names are not copied: their offset, length and a 64-bit FNV-1a hash of their raw
 * bytes come back, and the caller interns one name per distinct hash.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KSCAN_NOT_MINE (-1) /* a layout or value this scanner leaves to the numpy reader */
#define KSCAN_FULL (-2)     /* more kept events than the caller's capacity */

/* the kept categories, in parse.KEPT_CATS order */
static const char *CATS[] = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation",
                             "user_annotation", "cpu_op", "cuda_runtime", "cuda_driver"};
#define N_CATS 8

static const double POW10[23] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,  1e8,  1e9,  1e10, 1e11,
                                 1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

static inline const char *skip_ws(const char *p, const char *end) {
    while (p < end && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t')) p++;
    return p;
}

/* p at the opening quote: returns the closing quote, or NULL; *esc set when a backslash is inside */
static inline const char *string_end(const char *p, const char *end, int *esc) {
    p++;
    while (p < end) {
        const char *q = memchr(p, '"', (size_t)(end - p));
        if (!q) return NULL;
        /* an odd run of backslashes before the quote escapes it */
        const char *b = q;
        while (b > p && b[-1] == '\\') b--;
        if (memchr(p, '\\', (size_t)(q - p))) *esc = 1;
        if (((q - b) & 1) == 0) return q;
        p = q + 1;
    }
    return NULL;
}

/* any JSON value at p: returns the byte after it, or NULL */
static const char *skip_value(const char *p, const char *end) {
    int esc = 0;
    if (p >= end) return NULL;
    if (*p == '"') {
        const char *q = string_end(p, end, &esc);
        return q ? q + 1 : NULL;
    }
    if (*p == '{' || *p == '[') {
        int depth = 0;
        while (p < end) {
            char c = *p;
            if (c == '"') {
                const char *q = string_end(p, end, &esc);
                if (!q) return NULL;
                p = q + 1;
                continue;
            }
            if (c == '{' || c == '[') depth++;
            else if (c == '}' || c == ']') {
                if (--depth == 0) return p + 1;
            }
            p++;
        }
        return NULL;
    }
    while (p < end && *p != ',' && *p != '}' && *p != ']' && *p != ' ' && *p != '\n' && *p != '\r' && *p != '\t')
        p++;
    return p;
}

/* a JSON number at p as float() reads it; returns the byte after it, or NULL if it is not a number */
static const char *read_number(const char *p, const char *end, double *out) {
    const char *s = p;
    int neg = 0, digits = 0, frac = 0, dot = 0;
    uint64_t m = 0;
    if (p < end && *p == '-') { neg = 1; p++; }
    while (p < end) {
        char c = *p;
        if (c >= '0' && c <= '9') {
            if (digits < 19) m = m * 10 + (uint64_t)(c - '0');
            digits++;
            if (dot) frac++;
        } else if (c == '.' && !dot) {
            dot = 1;
        } else break;
        p++;
    }
    if (!digits) return NULL;
    if (p < end && (*p == 'e' || *p == 'E')) { /* exponent: strtod reads it */
        char *stop;
        *out = strtod(s, &stop);
        return stop > s ? stop : NULL;
    }
    if (dot && !frac) return NULL; /* "1." is not JSON */
    if (digits <= 19 && m <= (1ULL << 53) && frac <= 22) {
        double v = (double)m / POW10[frac];
        *out = neg ? -v : v;
        return p;
    }
    char *stop;
    *out = strtod(s, &stop);
    return stop > s ? stop : NULL;
}

static inline int key_is(const char *k, long n, const char *want) {
    return (long)strlen(want) == n && memcmp(k, want, (size_t)n) == 0;
}

/* One event of a run, as the scanner reads it. */
typedef struct {
    int is_x, cat, odd;
    int64_t off; /* the name's offset in b, -1: no name */
    int32_t len;
    uint64_t hash;
    double ts, dur;
    int64_t tid;
} kev;

/* The event at *pp (after separators) read into *e: 1, *pp moved past it; 0 at the end of the run;
 * KSCAN_NOT_MINE for text this scanner leaves to the numpy reader (see kscan). */
static inline int next_event(const char **pp, const char *end, const char *b, kev *e) {
    const char *p = *pp;
    while (p < end && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t' || *p == ',')) p++;
    if (p >= end) return 0;
    if (*p != '{') return KSCAN_NOT_MINE;
    p++;
    int have_ph = 0, have_cat = 0, have_name = 0, have_ts = 0, have_dur = 0, have_tid = 0;
    double tidv = -1.0;
    e->is_x = 0; e->cat = -1; e->odd = 0; e->off = -1; e->len = 0; e->hash = 0;
    e->ts = 0.0; e->dur = 0.0; e->tid = -1;
    for (;;) {
        p = skip_ws(p, end);
        if (p >= end) return KSCAN_NOT_MINE;
        if (*p == '}') { p++; break; }
        if (*p != '"') return KSCAN_NOT_MINE;
        int esc = 0;
        const char *kq = string_end(p, end, &esc);
        if (!kq || esc) return KSCAN_NOT_MINE;
        const char *k = p + 1;
        long kn = kq - k;
        p = skip_ws(kq + 1, end);
        if (p >= end || *p != ':') return KSCAN_NOT_MINE;
        p = skip_ws(p + 1, end);
        if (p >= end) return KSCAN_NOT_MINE;
        const char *v = p;
        if (kn == 2 && k[0] == 'p' && k[1] == 'h' && !have_ph) {
            have_ph = 1;
            p = skip_value(v, end);
            if (!p) return KSCAN_NOT_MINE;
            e->is_x = (p - v == 3 && v[0] == '"' && v[1] == 'X' && v[2] == '"');
        } else if (key_is(k, kn, "cat") && !have_cat) {
            have_cat = 1;
            p = skip_value(v, end);
            if (!p) return KSCAN_NOT_MINE;
            if (*v == '"') {
                long vn = (p - v) - 2;
                for (int i = 0; i < N_CATS; i++)
                    if (key_is(v + 1, vn, CATS[i])) { e->cat = i; break; }
            }
        } else if (key_is(k, kn, "name") && !have_name) {
            have_name = 1;
            if (*v != '"') return KSCAN_NOT_MINE;
            int nesc = 0;
            const char *q = string_end(v, end, &nesc);
            if (!q || nesc) return KSCAN_NOT_MINE;
            e->off = (v + 1) - b;
            e->len = (int32_t)(q - v - 1);
            uint64_t h = 1469598103934665603ULL;
            for (const char *s = v + 1; s < q; s++) { h ^= (uint8_t)*s; h *= 1099511628211ULL; }
            e->hash = h;
            p = q + 1;
        } else if (kn == 2 && k[0] == 't' && k[1] == 's' && !have_ts) {
            have_ts = 1;
            p = read_number(v, end, &e->ts);
            if (!p) { e->odd = 1; p = skip_value(v, end); }
        } else if (key_is(k, kn, "dur") && !have_dur) {
            have_dur = 1;
            p = read_number(v, end, &e->dur);
            if (!p) { e->odd = 1; p = skip_value(v, end); }
        } else if (key_is(k, kn, "tid") && !have_tid) {
            have_tid = 1;
            p = read_number(v, end, &tidv);
            if (p) {
                /* an integer as int() reads it; a fraction or one past int64 is odd */
                const char *s = v;
                int neg = (*s == '-');
                s += neg;
                uint64_t u = 0;
                for (; s < p; s++) {
                    if (*s < '0' || *s > '9' || u > 922337203685477580ULL) { e->odd = 1; break; }
                    u = u * 10 + (uint64_t)(*s - '0');
                }
                if (u > 9223372036854775807ULL) e->odd = 1;
                e->tid = neg ? -(int64_t)u : (int64_t)u;
            } else {
                e->odd = 1;  /* a string ("tid": "PyTorch Profiler"): only an event that is kept minds */
                p = skip_value(v, end);
            }
        } else {
            p = skip_value(v, end);
            if (!p) return KSCAN_NOT_MINE;
        }
        if (!p) return KSCAN_NOT_MINE;
        p = skip_ws(p, end);
        if (p < end && *p == ',') { p++; continue; }
        if (p < end && *p == '}') { p++; break; }
        return KSCAN_NOT_MINE;
    }
    *pp = p;
    return 1;
}

/* Reads the events of b[lo:hi] (whole events, each an object at the top level of the run, separated
 * by commas and white space). For each event whose "ph" is "X" and whose "cat" is a kept category:
 * cat id, name offset/length/hash (-1 offset: no name), ts, dur (0.0 when absent), tid (-1 when absent).
 * Returns the number of such events (and *seen: every event), KSCAN_FULL past `cap`, KSCAN_NOT_MINE
 * for an escaped name, a kept event's ts/dur/tid that is not a plain number, or text that is not a run
 * of objects. */
int64_t kscan(const char *b, int64_t lo, int64_t hi, int64_t cap, int8_t *cat, int64_t *name_off,
              int32_t *name_len, uint64_t *name_hash, double *ts, double *dur, int64_t *tid, int64_t *seen) {
    const char *p = b + lo, *end = b + hi;
    int64_t n = 0, events = 0;
    kev e;
    int r;
    while ((r = next_event(&p, end, b, &e)) == 1) {
        events++;
        if (e.is_x && e.cat >= 0) {
            if (e.odd) return KSCAN_NOT_MINE;
            if (n >= cap) return KSCAN_FULL;
            cat[n] = (int8_t)e.cat;
            name_off[n] = e.off;
            name_len[n] = e.len;
            name_hash[n] = e.hash;
            ts[n] = e.ts;
            dur[n] = e.dur;
            tid[n] = e.tid;
            n++;
        }
    }
    if (r < 0) return r;
    *seen = events;
    return n;
}

/* ---- the streamed breakdown, reduced here (creduce.py) -------------------------------------------
 * Per name: GPU work (kernel, memcpy, memset) at its duration; CPU ops (on a CPU trace) at their self
 * time, with counts of (op, enclosing op) name pairs from which the caller counts calls by category.
 * stream.py's numpy reduction is the reference: an op's parent is the latest earlier op of its thread,
 * in (start, longest first) order, still open at its start (ending more than NEST_EPS_US after it):
 * what a stack of open ops holds. Ops of a thread that share a start wait in a group until a later
 * start comes, then go onto the stack longest first (ties in file order). */
#define KR_UNORDERED (-3) /* a CPU op starts before one of its thread already read: the caller reads whole */
#define KR_NOMEM (-4)
#define NEST_EPS_US 1e-9
enum { CAT_KERNEL = 0, CAT_MEMCPY = 1, CAT_MEMSET = 2, CAT_CPU_OP = 5, CAT_RUNTIME = 6, CAT_DRIVER = 7 };

typedef struct { double ts, dur, end, self; int32_t name; } kop;

typedef struct {
    kop *stack; int64_t sn, scap;
    kop *group; int64_t gn, gcap;
    double gts; /* the group's start */
} kthread;

typedef struct { uint64_t key; int64_t val; int64_t used; } kslot;

typedef struct { kslot *s; int64_t cap, n; } kmap;

typedef struct {
    int cpu;
    kmap names;      /* name hash -> name id; another name of the same hash goes on to the next key */
    int64_t n_names, names_cap;
    char *blob; int64_t blob_len, blob_cap;
    int64_t *name_off; int32_t *name_len; uint64_t *name_hash;
    double *gpu_dur, *cpu_self, *cpu_dur;
    int64_t *gpu_rows, *cpu_rows;
    /* events of the categories kept by name (reader.name_rule), per name: the caller applies the rule */
    int64_t *op_rows, *rt_rows;
    int64_t op_nameless, rt_nameless;
    kmap pairs;      /* child << 32 | (parent + 1) -> count */
    kmap tids;       /* tid -> thread index */
    kthread *thr; int64_t n_thr, thr_cap;
    int64_t kernel_rows, kernel_seen, events_seen, kept; /* kept: of the categories kept whatever the name */
    int failed;
} kred;

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
    return x;
}

static int kmap_grow(kmap *m) {
    int64_t cap = m->cap ? m->cap * 2 : 64;
    kslot *s = calloc((size_t)cap, sizeof(kslot));
    if (!s) return -1;
    for (int64_t i = 0; i < m->cap; i++) {
        if (!m->s[i].used) continue;
        uint64_t j = mix64(m->s[i].key) & (uint64_t)(cap - 1);
        while (s[j].used) j = (j + 1) & (uint64_t)(cap - 1);
        s[j] = m->s[i];
    }
    free(m->s);
    m->s = s;
    m->cap = cap;
    return 0;
}

/* the slot of key, made with val = -1 when new; NULL out of memory */
static inline kslot *kmap_at(kmap *m, uint64_t key) {
    if ((m->n + 1) * 2 > m->cap && kmap_grow(m)) return NULL;
    uint64_t j = mix64(key) & (uint64_t)(m->cap - 1);
    while (m->s[j].used && m->s[j].key != key) j = (j + 1) & (uint64_t)(m->cap - 1);
    if (!m->s[j].used) { m->s[j].key = key; m->s[j].val = -1; m->s[j].used = 1; m->n++; }
    return &m->s[j];
}

static int grow(void **p, int64_t *cap, int64_t need, size_t size) {
    if (need <= *cap) return 0;
    int64_t c = *cap ? *cap : 16;
    while (c < need) c *= 2;
    void *q = realloc(*p, (size_t)c * size);
    if (!q) return -1;
    *p = q;
    *cap = c;
    return 0;
}

kred *kr_new(int cpu) {
    kred *r = calloc(1, sizeof(kred));
    if (r) r->cpu = cpu;
    return r;
}

void kr_free(kred *r) {
    if (!r) return;
    free(r->names.s); free(r->pairs.s); free(r->tids.s); free(r->blob);
    free(r->name_off); free(r->name_len); free(r->name_hash);
    free(r->gpu_dur); free(r->cpu_self); free(r->cpu_dur); free(r->gpu_rows); free(r->cpu_rows);
    free(r->op_rows); free(r->rt_rows);
    for (int64_t i = 0; i < r->n_thr; i++) { free(r->thr[i].stack); free(r->thr[i].group); }
    free(r->thr);
    free(r);
}

/* the id of the name at b+off (len bytes, hash h); -1 out of memory. A name whose hash is taken by
 * other bytes is looked up at the next key of its sequence (h, h + g, h + 2g, ...). */
static int32_t name_id(kred *r, const char *b, int64_t off, int32_t len, uint64_t h) {
    for (uint64_t probe = 0;; probe++) {
        kslot *s = kmap_at(&r->names, h + probe * 0x9e3779b97f4a7c15ULL);
        if (!s) return -1;
        if (s->val >= 0) {
            int64_t id = s->val;
            if (r->name_len[id] == len && r->name_hash[id] == h && memcmp(r->blob + r->name_off[id], b + off, (size_t)len) == 0)
                return (int32_t)id;
            continue;
        }
        int64_t id = r->n_names;
        if (id + 1 > r->names_cap) { /* the per-name arrays grow together */
            void **arrays[] = {(void **)&r->name_off, (void **)&r->name_len, (void **)&r->name_hash,
                               (void **)&r->gpu_dur, (void **)&r->cpu_self, (void **)&r->cpu_dur,
                               (void **)&r->gpu_rows, (void **)&r->cpu_rows, (void **)&r->op_rows,
                               (void **)&r->rt_rows};
            size_t sizes[] = {sizeof(int64_t), sizeof(int32_t), sizeof(uint64_t), sizeof(double),
                              sizeof(double), sizeof(double), sizeof(int64_t), sizeof(int64_t),
                              sizeof(int64_t), sizeof(int64_t)};
            int64_t cap = r->names_cap ? r->names_cap * 2 : 64;
            for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
                void *q = realloc(*arrays[i], (size_t)cap * sizes[i]);
                if (!q) return -1;
                *arrays[i] = q;
            }
            r->names_cap = cap;
        }
        if (grow((void **)&r->blob, &r->blob_cap, r->blob_len + len + 1, 1)) return -1;
        memcpy(r->blob + r->blob_len, b + off, (size_t)len);
        r->name_off[id] = r->blob_len;
        r->name_len[id] = len;
        r->name_hash[id] = h;
        r->blob_len += len;
        r->gpu_dur[id] = r->cpu_self[id] = r->cpu_dur[id] = 0.0;
        r->gpu_rows[id] = r->cpu_rows[id] = r->op_rows[id] = r->rt_rows[id] = 0;
        r->n_names++;
        s->val = id;
        return (int32_t)id;
    }
}

static kthread *thread_of(kred *r, int64_t tid) {
    kslot *s = kmap_at(&r->tids, (uint64_t)tid);
    if (!s) return NULL;
    if (s->val < 0) {
        if (grow((void **)&r->thr, &r->thr_cap, r->n_thr + 1, sizeof(kthread))) return NULL;
        memset(&r->thr[r->n_thr], 0, sizeof(kthread));
        s->val = r->n_thr++;
    }
    return &r->thr[s->val];
}

static inline void close_op(kred *r, const kop *o) {
    r->cpu_self[o->name] += o->self > 0.0 ? o->self : 0.0;
    r->cpu_dur[o->name] += o->dur;
    r->cpu_rows[o->name]++;
}

static int push_op(kred *r, kthread *t, const kop *o) {
    double threshold = o->ts + NEST_EPS_US;
    while (t->sn > 0 && t->stack[t->sn - 1].end <= threshold) close_op(r, &t->stack[--t->sn]);
    int32_t parent = -1;
    if (t->sn > 0) {
        kop *p = &t->stack[t->sn - 1];
        p->self -= (o->end < p->end ? o->end : p->end) - o->ts;
        parent = p->name;
    }
    kslot *s = kmap_at(&r->pairs, (((uint64_t)(uint32_t)o->name) << 32) | (uint64_t)(uint32_t)(parent + 1));
    if (!s) return KR_NOMEM;
    s->val = s->val < 0 ? 1 : s->val + 1;
    if (grow((void **)&t->stack, &t->scap, t->sn + 1, sizeof(kop))) return KR_NOMEM;
    t->stack[t->sn++] = *o;
    return 0;
}

/* the group of ops sharing a start onto the stack, longest first, ties in file order */
static int flush_group(kred *r, kthread *t) {
    for (int64_t i = 1; i < t->gn; i++) { /* insertion sort: stable, and groups are small */
        kop x = t->group[i];
        int64_t j = i;
        while (j > 0 && t->group[j - 1].dur < x.dur) { t->group[j] = t->group[j - 1]; j--; }
        t->group[j] = x;
    }
    for (int64_t i = 0; i < t->gn; i++) {
        int rc = push_op(r, t, &t->group[i]);
        if (rc) return rc;
    }
    t->gn = 0;
    return 0;
}

static int add_cpu_op(kred *r, int32_t name, double ts, double dur, int64_t tid) {
    kthread *t = thread_of(r, tid);
    if (!t) return KR_NOMEM;
    if (t->gn > 0) {
        if (ts < t->gts) return KR_UNORDERED;
        if (ts > t->gts) {
            int rc = flush_group(r, t);
            if (rc) return rc;
        }
    }
    if (grow((void **)&t->group, &t->gcap, t->gn + 1, sizeof(kop))) return KR_NOMEM;
    kop o = {ts, dur, ts + dur, dur, name};
    t->group[t->gn++] = o;
    t->gts = ts;
    return 0;
}

/* One run of whole events (as kscan reads them) reduced into r: 0, or KSCAN_NOT_MINE / KR_UNORDERED /
 * KR_NOMEM, after which r is not to be fed again. */
int64_t kr_feed(kred *r, const char *b, int64_t lo, int64_t hi) {
    if (r->failed) return r->failed;
    const char *p = b + lo, *end = b + hi;
    kev e;
    int rc;
    while ((rc = next_event(&p, end, b, &e)) == 1) {
        r->events_seen++;
        if (!e.is_x || e.cat < 0) continue;
        if (e.odd) { rc = KSCAN_NOT_MINE; break; }
        if (e.cat == CAT_KERNEL) r->kernel_seen++;
        int op = e.cat == CAT_CPU_OP, rt = e.cat == CAT_RUNTIME || e.cat == CAT_DRIVER;
        if (!op && !rt) r->kept++;
        else if (e.off < 0) { if (op) r->op_nameless++; else r->rt_nameless++; }
        int gpu = e.cat == CAT_KERNEL || e.cat == CAT_MEMCPY || e.cat == CAT_MEMSET;
        if (e.off < 0 || !(gpu || op || rt)) continue;
        int32_t id = name_id(r, b, e.off, e.len, e.hash);
        if (id < 0) { rc = KR_NOMEM; break; }
        if (gpu) {
            r->gpu_dur[id] += e.dur;
            r->gpu_rows[id]++;
            if (e.cat == CAT_KERNEL) r->kernel_rows++;
        } else if (rt) {
            r->rt_rows[id]++;
        } else {
            r->op_rows[id]++;
            if (r->cpu && (rc = add_cpu_op(r, id, e.ts, e.dur, e.tid)) != 0) break;
        }
    }
    if (rc < 0) {
        r->failed = rc;
        return rc;
    }
    return 0;
}

/* every op still open or waiting closed: the end of the file */
int64_t kr_finish(kred *r) {
    if (r->failed) return r->failed;
    for (int64_t i = 0; i < r->n_thr; i++) {
        kthread *t = &r->thr[i];
        int rc = flush_group(r, t);
        if (rc) return r->failed = rc;
        while (t->sn > 0) close_op(r, &t->stack[--t->sn]);
    }
    return 0;
}

/* sizes: names, bytes of names, pairs, kernel rows, kernel events (named or not), events seen, kept
 * whatever the name, CPU ops and runtime/driver calls with no name */
void kr_sizes(const kred *r, int64_t *out) {
    out[0] = r->n_names; out[1] = r->blob_len; out[2] = r->pairs.n; out[3] = r->kernel_rows;
    out[4] = r->kernel_seen; out[5] = r->events_seen; out[6] = r->kept; out[7] = r->op_nameless;
    out[8] = r->rt_nameless;
}

/* per name: CPU ops, runtime and driver calls (kept by name: reader.name_rule) */
void kr_ruled(const kred *r, int64_t *op_rows, int64_t *rt_rows) {
    memcpy(op_rows, r->op_rows, (size_t)r->n_names * sizeof(int64_t));
    memcpy(rt_rows, r->rt_rows, (size_t)r->n_names * sizeof(int64_t));
}

void kr_names(const kred *r, char *blob, int64_t *off, int32_t *len) {
    memcpy(blob, r->blob, (size_t)r->blob_len);
    memcpy(off, r->name_off, (size_t)r->n_names * sizeof(int64_t));
    memcpy(len, r->name_len, (size_t)r->n_names * sizeof(int32_t));
}

void kr_sums(const kred *r, double *gpu_dur, int64_t *gpu_rows, double *cpu_self, double *cpu_dur, int64_t *cpu_rows) {
    size_t n = (size_t)r->n_names;
    memcpy(gpu_dur, r->gpu_dur, n * sizeof(double));
    memcpy(gpu_rows, r->gpu_rows, n * sizeof(int64_t));
    memcpy(cpu_self, r->cpu_self, n * sizeof(double));
    memcpy(cpu_dur, r->cpu_dur, n * sizeof(double));
    memcpy(cpu_rows, r->cpu_rows, n * sizeof(int64_t));
}

/* (op name, enclosing op name or -1, count) of every pair seen */
void kr_pairs(const kred *r, int32_t *child, int32_t *parent, int64_t *count) {
    int64_t k = 0;
    for (int64_t i = 0; i < r->pairs.cap; i++) {
        if (!r->pairs.s[i].used) continue;
        uint64_t key = r->pairs.s[i].key;
        child[k] = (int32_t)(key >> 32);
        parent[k] = (int32_t)(uint32_t)(key & 0xffffffffULL) - 1;
        count[k] = r->pairs.s[i].val;
        k++;
    }
}

/* ---- the critical path's what-if replay (critpath/whatif.py: replay_step, the same arithmetic in the same
   order, so the two agree to the bit). Indices are global piece positions; `order` holds the step's pieces
   in replay order, and per position in it `first`/`next` chain the members of its collective instance (in
   order; -1: none) and `scale` is its piece's duration factor. A piece's new start and end (s_new, e_new)
   are read only where `placed` says they were set (bit 1: start, bit 2: end), its own otherwise: the
   scratch is touched at the step's pieces only, and `placed` is left all zero. A piece's lane_prev is the
   piece before it where that is on its lane (same lane and rank); its ready, its dependency's end (start,
   for a launch) or its own start where earlier; a collective's entry, its instance's (group_entry). */
static inline double cp_begin(int64_t i, const double *start, const double *end, const int8_t *kind,
                              const int32_t *pred, const int32_t *lane, const int32_t *rank,
                              const int32_t *launch, const double *s_new, const double *e_new,
                              const uint8_t *placed, double gap_scale) {
#define CP_S(j) ((placed[j] & 1) ? s_new[j] : start[j])
#define CP_E(j) ((placed[j] & 2) ? e_new[j] : end[j])
    int64_t k = kind[i], j = pred[i], lp = i > 0 && lane[i - 1] == lane[i] && rank[i - 1] == rank[i] ? i - 1 : -1;
    double t;
    if (k == 0 || j < 0) {
        t = start[i];
    } else {
        double ready = k == 2 ? start[j] : end[j];
        double d = start[i] - (start[i] < ready ? start[i] : ready);
        t = (k == 2 ? CP_S(j) : CP_E(j)) + (d > 0.0 ? d * gap_scale : 0.0);
    }
    if (lp >= 0 && k != 1 && CP_E(lp) > t) t = CP_E(lp);
    if (launch[i] >= 0 && k != 2 && CP_S(launch[i]) > t) t = CP_S(launch[i]);
    return start[i] < t ? start[i] : t;
}

/* A collective member's new end: from its new start, or from the instance's last entry where it waited for
   it (not with skew_free: every rank goes on as if the others had entered when it did), plus its own time
   from the traced entry on, scaled. */
static inline double cp_finish(int64_t g, const double *start, const double *end, const int32_t *group,
                               const double *group_entry, const double *s_new, double last_in, double scale,
                               int skew_free) {
    double entry = group_entry[group[g]];
    int synced = entry <= end[g];
    double from = synced && !skew_free && last_in > s_new[g] ? last_in : s_new[g];
    double from_op = synced && entry > start[g] ? entry : start[g];
    return from + (end[g] - from_op) * scale;
}

/* replay_step (critpath/whatif.py) over `order`: first/next chain each instance's entering members; those
   not placed yet are placed together at the first of them met that waited (an async call that ended before
   the last entry is placed alone at its own turn); a wait member (wait[i], NULL: none) has its instance's
   first entering member in `first` and is placed at its own turn, after them. gap_scale (per row, NULL: 1)
   scales the delay before each piece. */
double cp_replay(int64_t n, const int64_t *order, const int64_t *first, const int64_t *next, const double *start,
                 const double *end, const int8_t *kind, const int32_t *pred, const int32_t *group,
                 const double *group_entry, const int32_t *lane, const int32_t *rank,
                 const int32_t *launch, const double *scale, double *s_new, double *e_new, uint8_t *placed,
                 double w1, const uint8_t *wait, const double *gap_scale, int64_t skew_free) {
#define CP_GS(k) (gap_scale ? gap_scale[k] : 1.0)
#define CP_BEGIN(i, k) cp_begin(i, start, end, kind, pred, lane, rank, launch, s_new, e_new, placed, CP_GS(k))
    for (int64_t k = 0; k < n; k++) {
        int64_t i = order[k];
        if (placed[i] & 2) continue;
        if (group[i] < 0) {
            s_new[i] = CP_BEGIN(i, k);
            e_new[i] = s_new[i] + (end[i] - start[i]) * scale[k];
            placed[i] = 3;
            continue;
        }
        if (!(wait && wait[i]) && group_entry[group[i]] > end[i]) {  /* an async call that did not wait */
            s_new[i] = CP_BEGIN(i, k);
            e_new[i] = s_new[i] + (end[i] - start[i]) * scale[k];
            placed[i] = 3;
            continue;
        }
        int64_t f = first[k];
        double last_in = -1.0 / 0.0;
        for (int64_t m = f; m >= 0; m = next[m]) {  /* the entering members not placed yet, placed together */
            int64_t g = order[m];
            if (placed[g] & 2) continue;
            s_new[g] = CP_BEGIN(g, m);
            placed[g] |= 1;
        }
        for (int64_t m = f; m >= 0; m = next[m])
            if (s_new[order[m]] > last_in) last_in = s_new[order[m]];
        for (int64_t m = f; m >= 0; m = next[m]) {
            int64_t g = order[m];
            if (placed[g] & 2) continue;
            e_new[g] = cp_finish(g, start, end, group, group_entry, s_new, last_in, scale[m], (int)skew_free);
            placed[g] = 3;
        }
        if (wait && wait[i]) {
            s_new[i] = CP_BEGIN(i, k);
            e_new[i] = cp_finish(i, start, end, group, group_entry, s_new, last_in, scale[k], (int)skew_free);
            placed[i] = 3;
        }
    }
#undef CP_BEGIN
#undef CP_GS
#undef CP_S
#undef CP_E
    /* where the step ends: a piece still running at w1 counts to its point at w1, not to its end */
    double mx = -1.0 / 0.0;
    for (int64_t k = 0; k < n; k++) {
        int64_t g = order[k];
        double e = end[g] > w1 ? s_new[g] + (w1 - start[g]) * scale[k] : e_new[g];
        if (e > mx) mx = e;
    }
    for (int64_t k = 0; k < n; k++) placed[order[k]] = 0;  /* for the next replay */
    return mx;
}

/* ---- the critical path's pieces (critpath/pieces.py: cut_nested; its numpy passes are the reference, and
   the fallback). Rows come in `order`, by rank, thread, start, longest first. A row's parent is the latest
   earlier row of its thread still open at its start (ending more than 1e-9 us after it): the rows met on the
   way up from the row before, parent by parent, are a stack of open ops, so the walk up finds it and every
   row it passes is closed. Each op's self time is cut into stretches: its head (its start to its first
   child's start, or its end) and, after each child, the child's end to the next sibling's start (or the op's
   end), a child's end clipped to its parent's. Rows inside a `whole` row (may be NULL) are dropped, the
   row itself kept uncut. Out: the stretches of positive length, thread by thread, by start, a head before an
   after-stretch, heads by position, after-stretches by parent, then child: the order np.lexsort((start, tid,
   rank)) gives cut_nested's concatenation (heads, then after-stretches by parent and child). Returns their
   count (only counted where out_row is NULL), -1 where memory ran out. Finite times only. */
typedef struct { double s, e; int64_t row; } cp_head;
typedef struct { double s, e; int64_t p, c; } cp_after;

typedef struct {
    const int64_t *order;
    const double *ts, *end;
    const uint8_t *whole;
    int64_t *parent;
    uint8_t *drop;
    cp_head *h;
    cp_after *a, *tmp;
    int64_t nh, na, count;
    int64_t *out_row;
    double *out_s, *out_e;
} cp_cutter;

static inline double cp_min(double a, double b) { return b < a ? b : a; }

static inline int cp_after_le(const cp_after *x, const cp_after *y) {
    if (x->s != y->s) return x->s < y->s;
    if (x->p != y->p) return x->p < y->p;
    return x->c <= y->c;
}

/* A stable merge sort of `type` by `le` (insertion below 17 items); tmp holds n / 2 items. */
#define CP_DEFINE_MERGE_SORT(name, type, le)                                              \
    static void name(type *a, type *tmp, int64_t n) {                                     \
        if (n <= 16) {                                                                    \
            for (int64_t i = 1; i < n; i++) {                                             \
                type x = a[i];                                                            \
                int64_t j = i;                                                            \
                for (; j > 0 && !le(&a[j - 1], &x); j--) a[j] = a[j - 1];                 \
                a[j] = x;                                                                 \
            }                                                                             \
            return;                                                                       \
        }                                                                                 \
        int64_t h = n / 2, i = 0, j = h, k = 0;                                           \
        name(a, tmp, h);                                                                  \
        name(a + h, tmp, n - h);                                                          \
        if (le(&a[h - 1], &a[h])) return;                                                 \
        memcpy(tmp, a, (size_t)h * sizeof *a);                                            \
        while (i < h && j < n) a[k++] = le(&tmp[i], &a[j]) ? tmp[i++] : a[j++];           \
        while (i < h) a[k++] = tmp[i++];                                                  \
    }

/* by (start, parent, child): the keys are unique, so any sort gives this order */
CP_DEFINE_MERGE_SORT(cp_sort_afters, cp_after, cp_after_le)

static inline double cp_ts(const cp_cutter *c, int64_t k) { return c->ts[c->order[k]]; }
static inline double cp_end(const cp_cutter *c, int64_t k) { return c->end[c->order[k]]; }

/* a row's end clipped to its parent's */
static inline double cp_clipped(const cp_cutter *c, int64_t k) {
    return c->parent[k] >= 0 ? cp_min(cp_end(c, k), cp_end(c, c->parent[k])) : cp_end(c, k);
}

/* the stretch of parent p after its child k, up to t */
static inline void cp_after_stretch(cp_cutter *c, int64_t k, int64_t p, double t) {
    double s = cp_min(cp_end(c, k), cp_end(c, p));
    if (c->drop[k] || !(t > s)) return;
    if (c->out_row) c->a[c->na++] = (cp_after){s, t, p, k};
    else c->count++;
}

/* row k's head, its first child `first` (-1: none) */
static inline void cp_head_stretch(cp_cutter *c, int64_t k, int64_t first) {
    double s = cp_ts(c, k), e = cp_clipped(c, k);
    if (first >= 0) e = cp_min(cp_ts(c, first), e);
    if (c->drop[k] || !(e > s)) return;
    if (c->out_row) c->h[c->nh++] = (cp_head){s, e, c->order[k]};
    else c->count++;
}

/* the thread [t0, t1) done: every op still open closes, then its stretches go out in order */
static void cp_end_thread(cp_cutter *c, int64_t t1) {
    cp_head_stretch(c, t1 - 1, -1);
    for (int64_t last = t1 - 1, cur = c->parent[last]; cur >= 0; last = cur, cur = c->parent[cur])
        cp_after_stretch(c, last, cur, cp_clipped(c, cur));
    if (!c->out_row) return;
    cp_sort_afters(c->a, c->tmp, c->na);
    int64_t i = 0, j = 0, k = c->count;
    while (i < c->nh || j < c->na) {
        if (j >= c->na || (i < c->nh && c->h[i].s <= c->a[j].s)) {
            c->out_row[k] = c->h[i].row, c->out_s[k] = c->h[i].s, c->out_e[k] = c->h[i].e;
            i++;
        } else {
            c->out_row[k] = c->order[c->a[j].p], c->out_s[k] = c->a[j].s, c->out_e[k] = c->a[j].e;
            j++;
        }
        k++;
    }
    c->count = k;
    c->nh = c->na = 0;
}

int64_t cp_cut(int64_t n, const int64_t *order, const int64_t *rank, const int64_t *tid, const double *ts,
               const double *end, const uint8_t *whole, int64_t *out_row, double *out_s, double *out_e) {
    cp_cutter c = {order, ts, end, whole, malloc((size_t)(n ? n : 1) * sizeof(int64_t)), malloc(n ? n : 1),
                   NULL, NULL, NULL, 0, 0, 0, out_row, out_s, out_e};
    if (out_row) {  /* buffers for one thread at most: pages never touched cost nothing */
        c.h = malloc((size_t)(n ? n : 1) * sizeof(cp_head));
        c.a = malloc((size_t)(n ? n : 1) * sizeof(cp_after));
        c.tmp = malloc((size_t)(n / 2 + 1) * sizeof(cp_after));
    }
    int64_t ret = -1;
    if (!c.parent || !c.drop || (out_row && (!c.h || !c.a || !c.tmp))) goto done;
    for (int64_t k = 0; k < n; k++) {
        int64_t r = order[k];
        if (k == 0 || rank[r] != rank[order[k - 1]] || tid[r] != tid[order[k - 1]]) {
            if (k > 0) cp_end_thread(&c, k);
            c.parent[k] = -1, c.drop[k] = 0;
            continue;
        }
        double thr = ts[r] + 1e-9;
        int64_t cur = k - 1, last = -1;
        for (; cur >= 0 && cp_end(&c, cur) <= thr; last = cur, cur = c.parent[cur])
            if (last >= 0) cp_after_stretch(&c, last, cur, cp_clipped(&c, cur));  /* cur closes */
        if (last >= 0 && cur >= 0) cp_after_stretch(&c, last, cur, ts[r]);  /* k is last's next sibling */
        c.parent[k] = cur;
        c.drop[k] = cur >= 0 && (c.drop[cur] || (whole && whole[order[cur]]));
        cp_head_stretch(&c, k - 1, cur == k - 1 && !c.drop[k] ? k : -1);
    }
    if (n) cp_end_thread(&c, n);
    ret = c.count;
done:
    free(c.parent), free(c.drop), free(c.h), free(c.a), free(c.tmp);
    return ret;
}

/* ---- the critical path's segments (critpath.py: segments, then sorted as critpath_table._label sorts them;
   those numpy passes are the reference, and the fallback). Per step k: its ranges r in [roff[k], roff[k+1])
   (pieces a..i taken whole, the last one's segment ending at t, the first one's starting at lo) and its
   other segments x in [xoff[k], xoff[k+1]]. A range gives each piece's own segment (a transfer where the
   piece is a collective's, else an op) and, before each piece but its first, the gap from the piece before's
   end. Out: the segments of positive length, step by step, by start; at a tie, own segments before gaps
   before the others, each in the order made (what the stable lexsort of the parts, joined, gives). Returns
   their count (only counted where out_step is NULL), -1 where memory ran out. */
typedef struct { double s, e; int64_t piece, pos; int8_t kind, part; } cp_seg;

static inline int cp_seg_le(const cp_seg *x, const cp_seg *y) {
    if (x->s != y->s) return x->s < y->s;
    if (x->part != y->part) return x->part < y->part;
    return x->pos <= y->pos;
}

CP_DEFINE_MERGE_SORT(cp_sort_segs, cp_seg, cp_seg_le)

int64_t cp_segments(int64_t n_steps, int64_t n_pieces, const int64_t *roff, const int64_t *ra, const int64_t *ri,
                    const double *rt, const double *rlo, const int64_t *xoff, const int64_t *xpiece,
                    const int8_t *xkind, const double *xs, const double *xe, const double *start,
                    const double *end, const int32_t *group, const uint8_t *on_cpu, int32_t *out_step,
                    int64_t *out_piece, int8_t *out_kind, double *out_s, double *out_e) {
    int64_t most = 0, count = 0;
    for (int64_t k = 0; k < n_steps; k++) {  /* the most segments one step can make */
        int64_t m = xoff[k + 1] - xoff[k];
        for (int64_t r = roff[k]; r < roff[k + 1]; r++) m += 2 * (ri[r] - ra[r] + 1);
        if (m > most) most = m;
    }
    cp_seg *buf = out_step ? malloc((size_t)(most ? most : 1) * sizeof *buf) : NULL;
    cp_seg *tmp = out_step ? malloc((size_t)(most / 2 + 1) * sizeof *tmp) : NULL;
    if (out_step && (!buf || !tmp)) {
        free(buf), free(tmp);
        return -1;
    }
    int64_t own = 0, gap = 0;  /* positions in the parts, as joined over the steps */
    for (int64_t k = 0; k < n_steps; k++) {
        int64_t m = 0;
#define CP_SEG(S, E, PIECE, KIND, PART, POS)                                                \
    do {                                                                                    \
        double s_ = (S), e_ = (E);                                                          \
        if (e_ > s_) {                                                                      \
            if (buf) buf[m] = (cp_seg){s_, e_, (PIECE), (POS), (int8_t)(KIND), (int8_t)(PART)}; \
            m++;                                                                            \
        }                                                                                   \
    } while (0)
        for (int64_t r = roff[k]; r < roff[k + 1]; r++) {
            for (int64_t j = ra[r]; j <= ri[r]; j++) {
                int64_t nx = j + 1 < n_pieces ? j + 1 : n_pieces - 1;
                double e = j == ri[r] ? rt[r] : (start[nx] < end[j] ? start[nx] : end[j]);
                CP_SEG(j == ra[r] ? rlo[r] : start[j], e, j, group[j] >= 0 ? 1 : 0, 0, own);
                own++;
            }
        }
        for (int64_t r = roff[k]; r < roff[k + 1]; r++) {
            for (int64_t j = ra[r] + 1; j <= ri[r]; j++) {
                CP_SEG(start[j] < end[j - 1] ? start[j] : end[j - 1], start[j], j, on_cpu[j] ? 2 : 4, 1, gap);
                gap++;
            }
        }
        for (int64_t x = xoff[k]; x < xoff[k + 1]; x++) CP_SEG(xs[x], xe[x], xpiece[x], xkind[x], 2, x);
#undef CP_SEG
        if (buf) {
            cp_sort_segs(buf, tmp, m);
            for (int64_t q = 0; q < m; q++) {
                out_step[count + q] = (int32_t)k, out_piece[count + q] = buf[q].piece, out_kind[count + q] = buf[q].kind;
                out_s[count + q] = buf[q].s, out_e[count + q] = buf[q].e;
            }
        }
        count += m;
    }
    free(buf), free(tmp);
    return count;
}
