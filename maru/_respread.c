/* Redis replies read without the interpreter's lock (maru._respread).
 *
 * A background load reads a request's objects from Redis on a thread of its own while
 * the engine's thread runs Python. Read in Python, each system call hands the
 * interpreter's lock back, and taking it again waits for the busy thread to yield it
 * (up to the switch interval, 5 ms): a batched read of a few objects took 34-40 ms
 * beside a busy thread against 2 ms alone. Here a whole batch of bulk-string replies
 * (a pipeline of GETs) is sent and its replies read in one call that holds no lock:
 * replies go from the socket straight into the callers' buffers, each bounded by a deadline that grows
 * with the bytes announced, as the Python reader does (maru/backends/_redis/wire.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define SCRATCH 65536 /* bytes read at a time for headers (a header is far shorter) */

enum { DONE = 0, TIMED_OUT = -1, CLOSED = -2, OS_ERROR = -3, PROTOCOL = -4 };
enum { SIZE, NIL, TOO_SMALL, ERROR_REPLY };

typedef struct {
    int fd;
    double deadline; /* CLOCK_MONOTONIC seconds */
    double per_byte; /* seconds the deadline grows by per byte announced */
    int error;       /* errno, for OS_ERROR */
    size_t start, end;
    char buf[SCRATCH];
} Wire;

typedef struct {
    int kind;
    long long size;  /* SIZE, TOO_SMALL */
    char *message;   /* ERROR_REPLY: malloc'd, NUL-terminated */
} Reply;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Wait until the socket can be read (POLLIN) or written (POLLOUT), by the deadline. */
static int ready(Wire *w, short events)
{
    for (;;) {
        double left = w->deadline - now();
        if (left <= 0)
            return TIMED_OUT;
        struct pollfd p = {w->fd, events, 0};
        int n = poll(&p, 1, (int)(left * 1000.0) + 1);
        if (n > 0)
            return DONE;
        if (n < 0 && errno != EINTR) {
            w->error = errno;
            return OS_ERROR;
        }
    }
}

/* Receive at least one byte and at most `cap` into `dst`: the count, or an error (< 0). */
static long long receive(Wire *w, char *dst, size_t cap)
{
    for (;;) {
        ssize_t n = recv(w->fd, dst, cap, MSG_DONTWAIT);
        if (n > 0)
            return n;
        if (n == 0)
            return CLOSED;
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            w->error = errno;
            return OS_ERROR;
        }
        int waited = ready(w, POLLIN);
        if (waited != DONE)
            return waited;
    }
}

/* Send all of `data`, by the deadline. */
static int send_all(Wire *w, const char *data, size_t n)
{
    while (n > 0) {
        ssize_t sent = send(w->fd, data, n, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (sent > 0) {
            data += sent;
            n -= (size_t)sent;
            continue;
        }
        if (sent < 0 && errno == EINTR)
            continue;
        if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
            w->error = errno;
            return OS_ERROR;
        }
        int waited = ready(w, POLLOUT);
        if (waited != DONE)
            return waited;
    }
    return DONE;
}

/* Read more after what is buffered, moved to the front. */
static int fill(Wire *w)
{
    if (w->start > 0) {
        memmove(w->buf, w->buf + w->start, w->end - w->start);
        w->end -= w->start;
        w->start = 0;
    }
    if (w->end == SCRATCH)
        return PROTOCOL; /* a header longer than any Redis sends */
    long long n = receive(w, w->buf + w->end, SCRATCH - w->end);
    if (n < 0)
        return (int)n;
    w->end += (size_t)n;
    return DONE;
}

/* The next line, without its CRLF, copied into `line` (NUL-terminated, cut at `cap`). */
static int next_line(Wire *w, char *line, size_t cap)
{
    for (;;) {
        char *from = w->buf + w->start;
        char *crlf = memmem(from, w->end - w->start, "\r\n", 2);
        if (crlf != NULL) {
            size_t len = (size_t)(crlf - from);
            size_t kept = len < cap - 1 ? len : cap - 1;
            memcpy(line, from, kept);
            line[kept] = '\0';
            w->start += len + 2;
            return DONE;
        }
        int filled = fill(w);
        if (filled != DONE)
            return filled;
    }
}

/* Fill `out` with the next `n` bytes: what is buffered, then straight from the socket. */
static int exactly(Wire *w, char *out, size_t n)
{
    size_t have = w->end - w->start < n ? w->end - w->start : n;
    memcpy(out, w->buf + w->start, have);
    w->start += have;
    while (have < n) {
        long long got = receive(w, out + have, n - have);
        if (got < 0)
            return (int)got;
        have += (size_t)got;
    }
    return DONE;
}

/* Read and drop the next `n` bytes. */
static int skip(Wire *w, size_t n)
{
    while (n > 0) {
        if (w->start == w->end) {
            w->start = w->end = 0;
            int filled = fill(w);
            if (filled != DONE)
                return filled;
        }
        size_t take = w->end - w->start < n ? w->end - w->start : n;
        w->start += take;
        n -= take;
    }
    return DONE;
}

static int end_of_bulk(Wire *w)
{
    while (w->end - w->start < 2) {
        int filled = fill(w);
        if (filled != DONE)
            return filled;
    }
    if (memcmp(w->buf + w->start, "\r\n", 2) != 0)
        return PROTOCOL;
    w->start += 2;
    return DONE;
}

/* One reply, into `out` where it is a bulk string that fits. */
static int read_reply(Wire *w, Py_buffer *out, Reply *reply)
{
    char line[512];
    int status = next_line(w, line, sizeof line);
    if (status != DONE)
        return status;
    if (line[0] == '-') {
        reply->kind = ERROR_REPLY;
        reply->message = strdup(line + 1);
        return reply->message == NULL ? OS_ERROR : DONE;
    }
    if (line[0] != '$')
        return PROTOCOL;
    char *end;
    errno = 0;
    long long size = strtoll(line + 1, &end, 10);
    if (errno != 0 || end == line + 1 || *end != '\0')
        return PROTOCOL;
    if (size < 0) {
        reply->kind = NIL;
        return DONE;
    }
    w->deadline += (double)size * w->per_byte;
    reply->size = size;
    if (size > (long long)out->len) {
        reply->kind = TOO_SMALL;
        status = skip(w, (size_t)size);
    } else {
        reply->kind = SIZE;
        status = exactly(w, (char *)out->buf, (size_t)size);
    }
    return status != DONE ? status : end_of_bulk(w);
}

/* Send the request, then read every reply, holding no lock; the first failure ends it. */
static int exchange(Wire *w, Py_buffer *request, Py_buffer *outs, Reply *replies,
                    Py_ssize_t count)
{
    int sent = send_all(w, (const char *)request->buf, (size_t)request->len);
    if (sent != DONE)
        return sent;
    for (Py_ssize_t i = 0; i < count; i++) {
        int status = read_reply(w, &outs[i], &replies[i]);
        if (status != DONE)
            return status;
    }
    return w->start == w->end ? DONE : PROTOCOL; /* nothing was asked beyond the batch */
}

static PyObject *raise_for(int status, int error)
{
    switch (status) {
    case TIMED_OUT:
        PyErr_SetString(PyExc_TimeoutError, "the deadline passed");
        break;
    case CLOSED:
        PyErr_SetString(PyExc_ConnectionError, "connection closed by the server");
        break;
    case OS_ERROR:
        errno = error;
        PyErr_SetFromErrno(PyExc_OSError);
        break;
    default:
        PyErr_SetString(PyExc_ValueError, "not a reply to GET");
    }
    return NULL;
}

static PyObject *reply_object(const Reply *reply)
{
    switch (reply->kind) {
    case SIZE:
        return PyLong_FromLongLong(reply->size);
    case NIL:
        Py_RETURN_NONE;
    case TOO_SMALL:
        return Py_BuildValue("(sL)", "too_small", reply->size);
    default:
        return Py_BuildValue("(ss)", "error", reply->message);
    }
}

static PyObject *read_bulks(PyObject *self, PyObject *args)
{
    int fd;
    Py_buffer request;
    PyObject *sequence;
    double seconds, per_byte;
    if (!PyArg_ParseTuple(args, "iy*Odd", &fd, &request, &sequence, &seconds, &per_byte))
        return NULL;
    PyObject *items = PySequence_Fast(sequence, "outs must be a sequence of buffers");
    if (items == NULL) {
        PyBuffer_Release(&request);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(items), held = 0;
    Py_buffer *outs = PyMem_Calloc((size_t)count + 1, sizeof(Py_buffer));
    Reply *replies = PyMem_Calloc((size_t)count + 1, sizeof(Reply));
    Wire *w = PyMem_Malloc(sizeof(Wire));
    PyObject *result = NULL;
    if (outs == NULL || replies == NULL || w == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < count; held++) {
        PyObject *out = PySequence_Fast_GET_ITEM(items, held);
        if (PyObject_GetBuffer(out, &outs[held], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
    }
    *w = (Wire){.fd = fd, .deadline = now() + seconds, .per_byte = per_byte};
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = exchange(w, &request, outs, replies, count);
    Py_END_ALLOW_THREADS
    if (status != DONE) {
        raise_for(status, w->error);
        goto done;
    }
    result = PyList_New(count);
    for (Py_ssize_t i = 0; result != NULL && i < count; i++) {
        PyObject *reply = reply_object(&replies[i]);
        if (reply == NULL)
            Py_CLEAR(result);
        else
            PyList_SET_ITEM(result, i, reply);
    }
done:
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&outs[i]);
    for (Py_ssize_t i = 0; replies != NULL && i < count; i++)
        free(replies[i].message);
    PyMem_Free(outs);
    PyMem_Free(replies);
    PyMem_Free(w);
    Py_DECREF(items);
    PyBuffer_Release(&request);
    return result;
}

static PyMethodDef methods[] = {
    {"read_bulks", read_bulks, METH_VARARGS,
     "read_bulks(fd, request, outs, seconds, per_byte): send `request` (GET commands) on "
     "the socket `fd`, then read len(outs) replies, each bulk string into its buffer, "
     "without the interpreter's lock, within `seconds` plus `per_byte` for every byte "
     "announced. Per reply: its size, "
     "None (nil), ('too_small', size) (read and dropped) or ('error', message). Raises "
     "TimeoutError, ConnectionError (closed), OSError, or ValueError (not such replies, "
     "or bytes beyond them)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_respread", NULL, -1, methods,
};

PyMODINIT_FUNC PyInit__respread(void)
{
    return PyModule_Create(&module);
}
