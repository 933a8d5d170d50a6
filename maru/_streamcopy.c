/* Streaming copies between a KV cache and host memory (maru._streamcopy).
 *
 * A copy larger than the caches is bound by memory traffic. An ordinary store first
 * reads the line it writes (read for ownership), so a copy moves three lines per line
 * copied; a non-temporal store writes the line without reading it: two. glibc's memcpy
 * uses them only above a threshold set once per process (GLIBC_TUNABLES), which a
 * connector loaded into vLLM cannot change, so maru's CPU copies use their own.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#define STREAMING 1
#else
#define STREAMING 0
#endif

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

static PyObject *copy_rows(PyObject *self, PyObject *args)
{
    unsigned long long dst, src;
    Py_ssize_t dst_stride, src_stride, row_bytes, rows;
    if (!PyArg_ParseTuple(args, "KnKnnn", &dst, &dst_stride, &src, &src_stride, &row_bytes,
                          &rows))
        return NULL;
    if (row_bytes < 0 || rows < 0) {
        PyErr_Format(PyExc_ValueError, "row_bytes %zd and rows %zd must not be negative",
                     row_bytes, rows);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t row = 0; row < rows; row++) {
        char *to = (char *)(uintptr_t)dst + row * dst_stride;
        const char *from = (const char *)(uintptr_t)src + row * src_stride;
#if STREAMING
        stream_row(to, from, (size_t)row_bytes);
#else
        memcpy(to, from, (size_t)row_bytes);
#endif
    }
#if STREAMING
    _mm_sfence(); /* the streamed lines are visible to other threads from here on */
#endif
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(dst, dst_stride, src, src_stride, row_bytes, rows): copy `rows` rows of "
     "`row_bytes` bytes between addresses, streaming stores where the CPU has them."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_streamcopy", NULL, -1, methods,
};

PyMODINIT_FUNC PyInit__streamcopy(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMING", STREAMING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
