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
    for (;;) {
        while (p < end && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t' || *p == ',')) p++;
        if (p >= end) break;
        if (*p != '{') return KSCAN_NOT_MINE;
        p++;
        events++;
        int is_x = 0, c = -1;
        int have_ph = 0, have_cat = 0, have_name = 0, have_ts = 0, have_dur = 0, have_tid = 0;
        int64_t off = -1;
        int32_t len = 0;
        uint64_t h = 0;
        double t = 0.0, d = 0.0, tidv = -1.0;
        int64_t tid_i = -1;
        int odd = 0; /* a ts, dur or tid that is not a plain number: the numpy reader's business if kept */
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
                is_x = (p - v == 3 && v[0] == '"' && v[1] == 'X' && v[2] == '"');
            } else if (key_is(k, kn, "cat") && !have_cat) {
                have_cat = 1;
                p = skip_value(v, end);
                if (!p) return KSCAN_NOT_MINE;
                if (*v == '"') {
                    long vn = (p - v) - 2;
                    for (int i = 0; i < N_CATS; i++)
                        if (key_is(v + 1, vn, CATS[i])) { c = i; break; }
                }
            } else if (key_is(k, kn, "name") && !have_name) {
                have_name = 1;
                if (*v != '"') return KSCAN_NOT_MINE;
                int nesc = 0;
                const char *q = string_end(v, end, &nesc);
                if (!q || nesc) return KSCAN_NOT_MINE;
                off = (v + 1) - b;
                len = (int32_t)(q - v - 1);
                h = 1469598103934665603ULL;
                for (const char *s = v + 1; s < q; s++) { h ^= (uint8_t)*s; h *= 1099511628211ULL; }
                p = q + 1;
            } else if (kn == 2 && k[0] == 't' && k[1] == 's' && !have_ts) {
                have_ts = 1;
                p = read_number(v, end, &t);
                if (!p) { odd = 1; p = skip_value(v, end); }
            } else if (key_is(k, kn, "dur") && !have_dur) {
                have_dur = 1;
                p = read_number(v, end, &d);
                if (!p) { odd = 1; p = skip_value(v, end); }
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
                        if (*s < '0' || *s > '9' || u > 922337203685477580ULL) { odd = 1; break; }
                        u = u * 10 + (uint64_t)(*s - '0');
                    }
                    if (u > 9223372036854775807ULL) odd = 1;
                    tid_i = neg ? -(int64_t)u : (int64_t)u;
                } else {
                    odd = 1;  /* a string ("tid": "PyTorch Profiler"): only an event that is kept minds */
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
        if (is_x && c >= 0) {
            if (odd) return KSCAN_NOT_MINE;
            if (n >= cap) return KSCAN_FULL;
            cat[n] = (int8_t)c;
            name_off[n] = off;
            name_len[n] = len;
            name_hash[n] = h;
            ts[n] = t;
            dur[n] = d;
            tid[n] = tid_i;
            n++;
        }
    }
    *seen = events;
    return n;
}
