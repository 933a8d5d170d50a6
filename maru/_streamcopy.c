/* Streaming copies between a KV cache and host memory, and maru's object checksum
 * (maru._streamcopy).
 *
 * A copy larger than the caches is bound by memory traffic. An ordinary store first
 * reads the line it writes (read for ownership), so a copy moves three lines per line
 * copied; a non-temporal store writes the line without reading it: two. glibc's memcpy
 * uses them only above a threshold set once per process (GLIBC_TUNABLES), which a
 * connector loaded into vLLM cannot change, so maru's CPU copies use their own.
 *
 * A load verifies what it copies against the object's checksum. Hashing the bytes in
 * a second pass (XXH3, even while they were in cache) made a hit's loads 35-50%
 * slower, so the checksum is one a copy computes from the registers it copies through
 * (about 10% slower than the bare copy): per 64-byte stripe, eight 64-bit lanes each
 * add the neighbouring word (any change to a word changes a lane) and the product of
 * the halves of the word xor a key unique to its position (so stripes that trade
 * places change the sum); the lanes are scrambled every kilobyte and mixed with the
 * length at the end. It finds corruption; it is no defence against forged bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define STREAMING 1
#else
#define STREAMING 0
#endif

/* --- the checksum ------------------------------------------------------------- */

#define STRIPE 64
#define LANES 8
#define SCRAMBLE_EVERY 16 /* stripes */
static const uint64_t GOLDEN = 0x9E3779B97F4A7C15ULL; /* word p's key: GOLDEN * (p + 1) */
static const uint64_t SCRAMBLE_PRIME = 0x9E3779B1ULL;

/* A running sum, as Python keeps it: a zeroed buffer of this size is a new one. */
typedef struct {
    uint64_t acc[LANES];
    uint64_t stripes; /* whole stripes summed */
    uint64_t length;  /* bytes fed */
    uint8_t pending[STRIPE];
    uint64_t pending_bytes;
} SumState;

static inline uint64_t load_word(const uint8_t *p)
{
    uint64_t word;
    memcpy(&word, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    word = __builtin_bswap64(word);
#endif
    return word;
}

static inline uint64_t scramble(uint64_t lane)
{
    lane ^= lane >> 47;
    return lane * SCRAMBLE_PRIME;
}

/* Add one stripe to the lanes: the reference every faster form matches. */
static void sum_stripe_portable(SumState *s, const uint8_t *stripe)
{
    uint64_t words[LANES];
    for (int i = 0; i < LANES; i++)
        words[i] = load_word(stripe + 8 * i);
    uint64_t key = GOLDEN * (s->stripes * LANES + 1);
    for (int i = 0; i < LANES; i++, key += GOLDEN) {
        uint64_t x = words[i] ^ key;
        s->acc[i] += (x & 0xFFFFFFFFULL) * (x >> 32) + words[i ^ 1];
    }
    if (++s->stripes % SCRAMBLE_EVERY == 0)
        for (int i = 0; i < LANES; i++)
            s->acc[i] = scramble(s->acc[i]);
}

#if STREAMING
/* The lanes in AVX2 registers, four to a register, where the CPU has them. */
#define AVX2 __attribute__((target("avx2")))
static int have_avx2;

typedef struct {
    __m256i acc[2], key[2];
    uint64_t stripes;
} WideLanes;

AVX2 static WideLanes wide_load(const SumState *s)
{
    WideLanes l;
    uint64_t key = GOLDEN * (s->stripes * LANES + 1);
    for (int j = 0; j < 2; j++, key += 4 * GOLDEN) {
        l.acc[j] = _mm256_loadu_si256((const __m256i *)&s->acc[4 * j]);
        l.key[j] = _mm256_set_epi64x((int64_t)(key + 3 * GOLDEN), (int64_t)(key + 2 * GOLDEN),
                                     (int64_t)(key + GOLDEN), (int64_t)key);
    }
    l.stripes = s->stripes;
    return l;
}

AVX2 static void wide_store(const WideLanes *l, SumState *s)
{
    for (int j = 0; j < 2; j++)
        _mm256_storeu_si256((__m256i *)&s->acc[4 * j], l->acc[j]);
    s->stripes = l->stripes;
}

AVX2 static inline void wide_add(WideLanes *l, __m256i a, __m256i b)
{
    const __m256i step = _mm256_set1_epi64x((int64_t)(GOLDEN * LANES)); /* a stripe on */
    __m256i words[2] = {a, b};
    for (int j = 0; j < 2; j++) {
        __m256i x = _mm256_xor_si256(words[j], l->key[j]);
        __m256i product = _mm256_mul_epu32(x, _mm256_srli_epi64(x, 32));
        __m256i neighbour = _mm256_shuffle_epi32(words[j], _MM_SHUFFLE(1, 0, 3, 2));
        l->acc[j] = _mm256_add_epi64(l->acc[j], _mm256_add_epi64(product, neighbour));
        l->key[j] = _mm256_add_epi64(l->key[j], step);
    }
    if (++l->stripes % SCRAMBLE_EVERY == 0) {
        const __m256i prime = _mm256_set1_epi64x((int64_t)SCRAMBLE_PRIME);
        for (int j = 0; j < 2; j++) {
            __m256i lane = _mm256_xor_si256(l->acc[j], _mm256_srli_epi64(l->acc[j], 47));
            __m256i low = _mm256_mul_epu32(lane, prime);
            __m256i high = _mm256_mul_epu32(_mm256_srli_epi64(lane, 32), prime);
            l->acc[j] = _mm256_add_epi64(low, _mm256_slli_epi64(high, 32));
        }
    }
}

AVX2 static void wide_sum_stripes(SumState *s, const uint8_t *data, size_t stripes)
{
    WideLanes l = wide_load(s);
    for (; stripes > 0; stripes--, data += STRIPE)
        wide_add(&l, _mm256_loadu_si256((const __m256i *)data),
                 _mm256_loadu_si256((const __m256i *)(data + 32)));
    wide_store(&l, s);
}

AVX2 static void wide_stream_row_summing(char *dst, const char *src, size_t stripes,
                                         SumState *s)
{
    WideLanes l = wide_load(s);
    for (; stripes > 0; stripes--, dst += 64, src += 64) {
        __m256i a = _mm256_loadu_si256((const __m256i *)src);
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32));
        _mm256_stream_si256((__m256i *)dst, a);
        _mm256_stream_si256((__m256i *)(dst + 32), b);
        wide_add(&l, a, b);
    }
    wide_store(&l, s);
}

#endif

static void sum_stripes(SumState *s, const uint8_t *data, size_t stripes)
{
#if STREAMING
    if (have_avx2) {
        wide_sum_stripes(s, data, stripes);
        return;
    }
#endif
    for (; stripes > 0; stripes--, data += STRIPE)
        sum_stripe_portable(s, data);
}

static void sum_update(SumState *s, const uint8_t *data, size_t n)
{
    s->length += n;
    if (s->pending_bytes > 0) {
        size_t take = STRIPE - s->pending_bytes;
        if (take > n)
            take = n;
        memcpy(s->pending + s->pending_bytes, data, take);
        s->pending_bytes += take, data += take, n -= take;
        if (s->pending_bytes < STRIPE)
            return;
        sum_stripes(s, s->pending, 1);
        s->pending_bytes = 0;
    }
    sum_stripes(s, data, n / STRIPE);
    s->pending_bytes = n % STRIPE;
    memcpy(s->pending, data + n - s->pending_bytes, s->pending_bytes);
}

static inline uint64_t mix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* The sum once every byte fed is in the lanes. */
static uint64_t mix_lanes(const SumState *s)
{
    uint64_t h = mix(s->length * GOLDEN);
    for (int i = 0; i < LANES; i++)
        h = mix(h ^ s->acc[i]);
    return h;
}

/* The sum of everything fed (the state is left as it was): a partial last stripe is
 * summed padded with zeros. */
static uint64_t sum_digest(const SumState *state)
{
    SumState s = *state;
    if (s.pending_bytes > 0) {
        memset(s.pending + s.pending_bytes, 0, STRIPE - s.pending_bytes);
        sum_stripes(&s, s.pending, 1);
    }
    return mix_lanes(&s);
}

/* --- copies ----------------------------------------------------------------- */

#if STREAMING
/* One contiguous copy: memcpy up to the destination's next 64-byte line, 64-byte
 * groups of streaming stores, memcpy of the rest. */
static void stream_row(char *dst, const char *src, size_t n)
{
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 64; dst += 64, src += 64, n -= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, n);
}
#endif

static void copy_row(char *dst, const char *src, size_t n)
{
#if STREAMING
    stream_row(dst, src, n);
#else
    memcpy(dst, src, n);
#endif
}

static void copy_done(void)
{
#if STREAMING
    _mm_sfence(); /* the streamed lines are visible to other threads from here on */
#endif
}

/* Copy rows, summing them where the copies' lines are the sum's stripes. */
static void copy_row_summing(char *dst, const char *src, size_t n, SumState *s)
{
#if STREAMING
    if (have_avx2 && s->pending_bytes == 0 && ((uintptr_t)dst & 63) == 0) {
        size_t stripes = n / STRIPE;
        wide_stream_row_summing(dst, src, stripes, s);
        s->length += stripes * STRIPE;
        dst += stripes * STRIPE, src += stripes * STRIPE, n -= stripes * STRIPE;
    }
#endif
    copy_row(dst, src, n);
    sum_update(s, (const uint8_t *)src, n);
}

/* --- Python ----------------------------------------------------------------- */

static int check_rows(Py_ssize_t row_bytes, Py_ssize_t rows)
{
    if (row_bytes >= 0 && rows >= 0)
        return 0;
    PyErr_Format(PyExc_ValueError, "row_bytes %zd and rows %zd must not be negative",
                 row_bytes, rows);
    return -1;
}

static SumState *state_of(Py_buffer *state)
{
    if (state->len == (Py_ssize_t)sizeof(SumState))
        return (SumState *)state->buf;
    PyErr_Format(PyExc_ValueError, "a sum's state is %zu bytes, not %zd", sizeof(SumState),
                 state->len);
    PyBuffer_Release(state);
    return NULL;
}

static PyObject *copy_rows(PyObject *self, PyObject *args)
{
    unsigned long long dst, src;
    Py_ssize_t dst_stride, src_stride, row_bytes, rows;
    if (!PyArg_ParseTuple(args, "KnKnnn", &dst, &dst_stride, &src, &src_stride, &row_bytes,
                          &rows) ||
        check_rows(row_bytes, rows) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t row = 0; row < rows; row++)
        copy_row((char *)(uintptr_t)dst + row * dst_stride,
                 (const char *)(uintptr_t)src + row * src_stride, (size_t)row_bytes);
    copy_done();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *copy_rows_summing(PyObject *self, PyObject *args)
{
    Py_buffer state;
    unsigned long long dst, src;
    Py_ssize_t dst_stride, row_bytes, rows;
    if (!PyArg_ParseTuple(args, "w*KnKnn", &state, &dst, &dst_stride, &src, &row_bytes,
                          &rows))
        return NULL;
    SumState *s = state_of(&state);
    if (s == NULL)
        return NULL;
    if (check_rows(row_bytes, rows) < 0) {
        PyBuffer_Release(&state);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t row = 0; row < rows; row++)
        copy_row_summing((char *)(uintptr_t)dst + row * dst_stride,
                         (const char *)(uintptr_t)src + row * row_bytes, (size_t)row_bytes, s);
    copy_done();
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&state);
    Py_RETURN_NONE;
}

/* Sums of fewer bytes keep the interpreter's lock: handing it back costs the caller a
 * wait for it of up to the switch interval (5 ms) beside a busy thread, which is what
 * a background load meets (its commits sum each object), while summing 32 MiB takes
 * about that long; shorter work costs the others less than the wait would cost it. */
#define SUM_RELEASES_ABOVE (32u << 20)

static PyObject *sum_feed(PyObject *self, PyObject *args)
{
    Py_buffer state, data;
    if (!PyArg_ParseTuple(args, "w*y*", &state, &data))
        return NULL;
    SumState *s = state_of(&state);
    if (s != NULL && (size_t)data.len < SUM_RELEASES_ABOVE) {
        sum_update(s, (const uint8_t *)data.buf, (size_t)data.len);
        PyBuffer_Release(&state);
    } else if (s != NULL) {
        Py_BEGIN_ALLOW_THREADS
        sum_update(s, (const uint8_t *)data.buf, (size_t)data.len);
        Py_END_ALLOW_THREADS
        PyBuffer_Release(&state);
    }
    PyBuffer_Release(&data);
    if (s == NULL)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *sum_value(PyObject *self, PyObject *args)
{
    Py_buffer state;
    if (!PyArg_ParseTuple(args, "w*", &state))
        return NULL;
    SumState *s = state_of(&state);
    if (s == NULL)
        return NULL;
    uint64_t value = sum_digest(s);
    PyBuffer_Release(&state);
    return PyLong_FromUnsignedLongLong(value);
}

static PyObject *sum_portable(PyObject *self, PyObject *args)
{
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*", &data))
        return NULL;
    SumState s;
    memset(&s, 0, sizeof s);
    const uint8_t *bytes = (const uint8_t *)data.buf;
    for (; s.length + STRIPE <= (uint64_t)data.len; s.length += STRIPE)
        sum_stripe_portable(&s, bytes + s.length);
    if (s.length < (uint64_t)data.len) {
        uint8_t last[STRIPE] = {0};
        memcpy(last, bytes + s.length, (size_t)data.len - s.length);
        sum_stripe_portable(&s, last);
        s.length = (uint64_t)data.len;
    }
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLongLong(mix_lanes(&s));
}

static PyMethodDef methods[] = {
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(dst, dst_stride, src, src_stride, row_bytes, rows): copy `rows` rows of "
     "`row_bytes` bytes between addresses, streaming stores where the CPU has them."},
    {"copy_rows_summing", copy_rows_summing, METH_VARARGS,
     "copy_rows_summing(state, dst, dst_stride, src, row_bytes, rows): copy_rows from "
     "`rows` consecutive rows at `src`, and feed them, in order, to the sum `state`."},
    {"sum_feed", sum_feed, METH_VARARGS,
     "sum_feed(state, data): feed the next bytes to the sum `state` (a writable buffer of "
     "SUM_STATE_BYTES, zeroed to start a sum)."},
    {"sum_value", sum_value, METH_VARARGS,
     "sum_value(state): the 64-bit sum of everything fed to `state` (left unchanged)."},
    {"sum_portable", sum_portable, METH_VARARGS,
     "sum_portable(data): the sum of `data` through the portable code, stripe by stripe "
     "(what the SIMD code must equal)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_streamcopy", NULL, -1, methods,
};

PyMODINIT_FUNC PyInit__streamcopy(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    int sums_as_copied = 0; /* a load's copies compute the checksum */
#if STREAMING
    have_avx2 = __builtin_cpu_supports("avx2") != 0;
    sums_as_copied = have_avx2;
#endif
    if (PyModule_AddIntConstant(m, "STREAMING", STREAMING) < 0 ||
        PyModule_AddIntConstant(m, "SUMS_AS_COPIED", sums_as_copied) < 0 ||
        PyModule_AddIntConstant(m, "SUM_STATE_BYTES", sizeof(SumState)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
