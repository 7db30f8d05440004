/* narwhal.http1._relay_native: the relay pump's per-read path (pump.py's _Stream.on_engine), in C.

   One read of a pumped decode stream's engine socket, its chunk framing parsed (httptools, as
   EngineConnection.relay_body_ready does), the SSE check of a read that is one whole event
   (SSEWatch.one_event), the plain relay's bookkeeping (pump.RelayBook), the chunk framed and written to
   the client: in Python that path was about 24,000 instructions a token, most of a paced token's
   user-space cost. This is its twin for the usual read, and hands everything else to the Python path
   before it has consumed anything that path would not find where it looks (the body bytes in the
   connection's list), or through the Python helpers the error paths share (UpstreamStream.relay_failed,
   _Stream._end, _park, _client_failed). Optional, as the tracing modules: without it, or with
   NARWHAL_NO_EXTENSIONS set, the Python path runs alone; the tests run the pump's suites against both.

   Also the readiness hub's round (readiness.py's _poll_round and _dispatch, idle_rounds.py's loop of them): at one
   token a wake-up its seven Python calls were about a third of a token's user-space work; and the SSE check of a
   read of several events (classify.py's SSEWatch.feed), whose byte counts were 8% of an unpaced request. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include "../_slot_offset.h"
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <limits.h>
#include <string.h>
#include <sys/epoll.h>
#include <time.h>
#include <unistd.h>

static PyObject *book_type;    /* pump.RelayBook, from bind() */
static PyObject *parse_errors; /* httptools' parser errors (a tuple), from bind() */
static PyObject *s_pending, *s_again, *s_end, *s_park, *s_client_failed, *s_on_engine, *s_closed, *s_finished,
    *s_saw_terminal, *s_started, *s_took, *s_relay_failed, *s_drained, *s_complete, *s_interrupted, *s_wire_limit,
    *s_head, *s_received, *s_waiting_since, *s_event, *s_valid, *s_after_newline, *s_data_events, *s_disconnected,
    *s_gone_error, *s_last_at, *s_held, *s_bounds, *s_counts, *s_total, *s_marker, *s_strip, *s_upstream,
    *s_handler, *s_task, *s_ready, *s_later_list, *s_pump_rounds;
static PyObject *empty_bytes, *one, *inf;

#define READ_BUFFER 65536
/* The reads land here and are copied out at their size (os.read allocates its whole size and shrinks it). */
static char read_buffer[READ_BUFFER];
/* A framed write of up to this many bytes is built here; a longer one gets its own buffer. */
#define WRITE_BUFFER (READ_BUFFER + 32)
static char write_buffer[WRITE_BUFFER];
static int write_busy;

static const char DONE_EVENT[] = "data: [DONE]\n\n";
#define DONE_EVENT_LEN 14

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *stream;   /* pump._Stream: its fall-backs and its ends */
    PyObject *upstream; /* pools.data.UpstreamStream */
    PyObject *conn;     /* http1.client.EngineConnection */
    PyObject *feed;     /* the response parser's feed_data */
    PyObject *body;     /* the connection's body list (the parser's on_body appends to it) */
    PyObject *sse;      /* the stream's SSEWatch */
    PyObject *watch;    /* the engine socket's readiness Watch */
    PyObject *client;   /* the front's Connection */
    PyObject *on_chunk; /* a RelayBook, or any OnChunk */
    PyObject *clock;    /* the caller's clock when it is not trio's, else NULL */
    PyObject *trio_now; /* trio's clock's current_time */
    PyObject *later;    /* the readiness hub's later */
    double offset;      /* trio's SystemClock offset (perf_counter + offset is its time); NaN: call trio_now */
    Py_ssize_t read_size;
    int engine_fd;
    int client_fd;
    char chunked;
    char book;          /* on_chunk is exactly a RelayBook */
} Step;

/* An attribute read and written at its slot's offset when its type has one (the types the relay touches all
   do), else by name; each field learns its offset once per type it meets. */
typedef struct {
    PyObject **name;
    PyObject *type;
    Py_ssize_t offset;
} Field;

static Field f_book_bounds = {&s_bounds, NULL, -1};
static Field f_book_counts = {&s_counts, NULL, -1};
static Field f_book_held = {&s_held, NULL, -1};
static Field f_book_last_at = {&s_last_at, NULL, -1};
static Field f_book_marker = {&s_marker, NULL, -1};
static Field f_book_strip = {&s_strip, NULL, -1};
static Field f_book_total = {&s_total, NULL, -1};
static Field f_book_upstream = {&s_upstream, NULL, -1};
static Field f_client_disconnected = {&s_disconnected, NULL, -1};
static Field f_conn_complete = {&s_complete, NULL, -1};
static Field f_conn_drained = {&s_drained, NULL, -1};
static Field f_conn_head = {&s_head, NULL, -1};
static Field f_conn_interrupted = {&s_interrupted, NULL, -1};
static Field f_conn_received = {&s_received, NULL, -1};
static Field f_conn_waiting_since = {&s_waiting_since, NULL, -1};
static Field f_conn_wire_limit = {&s_wire_limit, NULL, -1};
static Field f_sse_after_newline = {&s_after_newline, NULL, -1};
static Field f_sse_data_events = {&s_data_events, NULL, -1};
static Field f_sse_event = {&s_event, NULL, -1};
static Field f_sse_saw_terminal = {&s_saw_terminal, NULL, -1};
static Field f_sse_valid = {&s_valid, NULL, -1};
static Field f_stream_again = {&s_again, NULL, -1};
static Field f_stream_pending = {&s_pending, NULL, -1};
static Field f_up_finished = {&s_finished, NULL, -1};
static Field f_up_saw_terminal = {&s_saw_terminal, NULL, -1};
static Field f_up_started = {&s_started, NULL, -1};
static Field f_watch_closed = {&s_closed, NULL, -1};
static Field f_watch_handler = {&s_handler, NULL, -1};
static Field f_watch_ready = {&s_ready, NULL, -1};
static Field f_watch_task = {&s_task, NULL, -1};

static inline PyObject **field_slot(Field *field, PyObject *obj) {
    if ((PyObject *)Py_TYPE(obj) != field->type) {
        Py_XSETREF(field->type, Py_NewRef((PyObject *)Py_TYPE(obj)));
        field->offset = slot_offset(field->type, *field->name);
    }
    return field->offset >= 0 ? (PyObject **)((char *)obj + field->offset) : NULL;
}

static PyObject *get(Field *field, PyObject *obj) {
    PyObject **slot = field_slot(field, obj);
    if (slot != NULL && *slot != NULL) return Py_NewRef(*slot);
    return PyObject_GetAttr(obj, *field->name);
}

static int put(Field *field, PyObject *obj, PyObject *value) {
    PyObject **slot = field_slot(field, obj);
    if (slot == NULL) return PyObject_SetAttr(obj, *field->name, value);
    Py_XSETREF(*slot, Py_NewRef(value));
    return 0;
}

/* The exception being raised, normalized, with its traceback (PyErr_GetRaisedException before 3.12). */
static PyObject *raised(void) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != NULL && value != NULL) PyException_SetTraceback(value, traceback);
    Py_XDECREF(type);
    Py_XDECREF(traceback);
    return value;
}

static int truth(Field *field, PyObject *obj) {
    PyObject *value = get(field, obj);
    if (value == NULL) return -1;
    int result = PyObject_IsTrue(value);
    Py_DECREF(value);
    return result;
}

static int set_bool(Field *field, PyObject *obj, int value) {
    return put(field, obj, value ? Py_True : Py_False);
}

/* time.perf_counter() as CPython computes it (CLOCK_MONOTONIC to a double, _PyTime_AsSecondsDouble's way). */
static double perf_counter(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    long long ns = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    volatile double d;
    if (ns % 1000000000LL == 0) {
        d = (double)(ns / 1000000000LL);
    } else {
        d = (double)ns;
        d /= 1e9;
    }
    return d;
}

/* trio's time, as a new float. */
static PyObject *trio_time(Step *self) {
    if (!isnan(self->offset)) return PyFloat_FromDouble(self->offset + perf_counter());
    return PyObject_CallNoArgs(self->trio_now);
}

/* The relay waits for the engine from now (the silence watchdog's mark). */
static int waiting_from(Step *self, PyObject *now) {
    PyObject *at = now != NULL ? Py_NewRef(now) : trio_time(self);
    if (at == NULL) return -1;
    int result = put(&f_conn_waiting_since, self->conn, at);
    Py_DECREF(at);
    return result;
}

/* Where ``needle`` first occurs in ``data`` (NULL: nowhere): a memchr for its first byte, then a compare. glibc's
   memmem costs several times more on these short reads and needles. */
static const char *find(const char *data, Py_ssize_t size, const char *needle, Py_ssize_t length) {
    if (length == 0) return data;
    if (size < length) return NULL;
    /* The needle's second byte when it has three or more: the KV field's first is a quote, of which a JSON event
       has dozens. */
    Py_ssize_t pivot = length > 2 ? 1 : 0;
    const char *first = data + pivot;
    const char *last = data + size - length + pivot; /* the pivot's last possible place */
    const char *at = first;
    while (at <= last) {
        at = memchr(at, needle[pivot], (size_t)(last - at + 1));
        if (at == NULL) return NULL;
        if (memcmp(at - pivot, needle, (size_t)length) == 0) return at - pivot;
        at++;
    }
    return NULL;
}

/* "%zx\r\n" of ``size`` into ``out`` (room for 20 bytes); its length. */
static int size_line(char *out, Py_ssize_t size) {
    static const char hex[] = "0123456789abcdef";
    char digits[16];
    int count = 0;
    size_t value = (size_t)size;
    do {
        digits[count++] = hex[value & 0xF];
        value >>= 4;
    } while (value != 0);
    for (int i = 0; i < count; i++) out[i] = digits[count - 1 - i];
    out[count] = '\r';
    out[count + 1] = '\n';
    return count + 2;
}

/* A read that is one whole `data: ` event where an event starts: SSEWatch.one_event, side effects and all.
   1 taken, 0 not (nothing changed), -1 error. *terminal says whether it was `data: [DONE]`. */
static int one_event(Step *self, PyObject *chunk, int *terminal) {
    const char *data = PyBytes_AS_STRING(chunk);
    Py_ssize_t size = PyBytes_GET_SIZE(chunk);
    if (size < 6 || memcmp(data, "data: ", 6) != 0) return 0;
    /* The first blank line ends the read, and no carriage return is in it. */
    const char *blank = find(data, size, "\n\n", 2);
    if (blank == NULL || blank - data != size - 2) return 0;
    if (memchr(data, '\r', (size_t)size) != NULL) return 0;
    PyObject *event = get(&f_sse_event, self->sse);
    if (event == NULL) return -1;
    int pending = PyObject_IsTrue(event);
    Py_DECREF(event);
    if (pending != 0) return pending < 0 ? -1 : 0;
    int valid = truth(&f_sse_valid, self->sse);
    if (valid <= 0) return valid;
    *terminal = size == DONE_EVENT_LEN && memcmp(data, DONE_EVENT, DONE_EVENT_LEN) == 0;
    if (set_bool(&f_sse_after_newline, self->sse, 1) < 0 || set_bool(&f_sse_saw_terminal, self->sse, *terminal) < 0)
        return -1;
    PyObject *count = get(&f_sse_data_events, self->sse);
    if (count == NULL) return -1;
    PyObject *more = PyNumber_Add(count, one);
    Py_DECREF(count);
    if (more == NULL) return -1;
    int result = put(&f_sse_data_events, self->sse, more);
    Py_DECREF(more);
    return result < 0 ? -1 : 1;
}

/* bisect.bisect_left over a sequence of numbers. */
static Py_ssize_t bisect_left(PyObject *bounds, double value) {
    PyObject *fast = PySequence_Fast(bounds, "bounds must be a sequence");
    if (fast == NULL) return -1;
    Py_ssize_t lo = 0, hi = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        double bound = PyFloat_AsDouble(items[mid]);
        if (bound == -1.0 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        if (bound < value) lo = mid + 1;
        else hi = mid;
    }
    Py_DECREF(fast);
    return lo;
}

/* RelayBook.__call__(chunk, now), without the call: a new reference to what to write, Py_None to hold it. */
static PyObject *book_read(Step *self, PyObject *chunk, PyObject *now, int terminal) {
    PyObject *book = self->on_chunk;
    PyObject *last = get(&f_book_last_at, book);
    if (last == NULL) return NULL;
    double gap_value = PyFloat_AsDouble(now) - PyFloat_AsDouble(last);
    Py_DECREF(last);
    if (PyErr_Occurred()) return NULL;
    PyObject *bounds = get(&f_book_bounds, book);
    if (bounds == NULL) return NULL;
    Py_ssize_t at = bisect_left(bounds, gap_value);
    Py_DECREF(bounds);
    if (at < 0) return NULL;
    PyObject *counts = get(&f_book_counts, book);
    if (counts == NULL) return NULL;
    PyObject *count = PySequence_GetItem(counts, at);
    PyObject *more = count != NULL ? PyNumber_Add(count, one) : NULL;
    Py_XDECREF(count);
    int failed = more == NULL || PySequence_SetItem(counts, at, more) < 0;
    Py_XDECREF(more);
    Py_DECREF(counts);
    if (failed) return NULL;
    PyObject *total = get(&f_book_total, book);
    if (total == NULL) return NULL;
    PyObject *sum = PySequence_GetItem(total, 0);
    PyObject *gap = sum != NULL ? PyFloat_FromDouble(gap_value) : NULL;
    PyObject *summed = gap != NULL ? PyNumber_Add(sum, gap) : NULL;
    Py_XDECREF(sum);
    Py_XDECREF(gap);
    failed = summed == NULL || PySequence_SetItem(total, 0, summed) < 0;
    Py_XDECREF(summed);
    Py_DECREF(total);
    if (failed || put(&f_book_last_at, book, now) < 0) return NULL;
    PyObject *marker = get(&f_book_marker, book);
    if (marker == NULL) return NULL;
    if (!PyBytes_Check(marker)) {
        PyErr_SetString(PyExc_TypeError, "RelayBook.marker must be bytes");
        Py_DECREF(marker);
        return NULL;
    }
    int marked = find(PyBytes_AS_STRING(chunk), PyBytes_GET_SIZE(chunk), PyBytes_AS_STRING(marker),
                      PyBytes_GET_SIZE(marker)) != NULL;
    Py_DECREF(marker);
    Py_INCREF(chunk);
    if (marked) {
        PyObject *strip = get(&f_book_strip, book);
        if (strip == NULL) {
            Py_DECREF(chunk);
            return NULL;
        }
        Py_SETREF(chunk, PyObject_CallOneArg(strip, chunk));
        Py_DECREF(strip);
        if (chunk == NULL) return NULL;
    }
    if (terminal) {
        int result = put(&f_book_held, book, chunk);
        Py_DECREF(chunk);
        return result < 0 ? NULL : Py_NewRef(Py_None);
    }
    return chunk;
}

/* Ends the stream through _Stream._end(result, error). */
static int end_stream(Step *self, PyObject *result, PyObject *error) {
    PyObject *args[3] = {self->stream, result, error};
    PyObject *done = PyObject_VectorcallMethod(s_end, args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (done == NULL) return -1;
    Py_DECREF(done);
    return 1;
}

static int call_method(PyObject *obj, PyObject *name, PyObject *arg) {
    PyObject *done = PyObject_CallMethodOneArg(obj, name, arg);
    if (done == NULL) return -1;
    Py_DECREF(done);
    return 1;
}

/* Write ``out`` (framed when chunked) to the client: 1 written whole, 0 the stream was handed to the Python path
   (parked, or ended by a failed write), -1 error. */
static int write_out(Step *self, PyObject *out) {
    Py_buffer view;
    if (PyObject_GetBuffer(out, &view, PyBUF_SIMPLE) < 0) return -1;
    char head[24];
    int head_len = self->chunked ? size_line(head, view.len) : 0;
    Py_ssize_t total = head_len + view.len + (self->chunked ? 2 : 0);
    /* The shared buffer unless in use (a signal handler run at EINTR could relay too). */
    int shared = total <= WRITE_BUFFER && !write_busy;
    char *buffer = shared ? write_buffer : PyMem_Malloc((size_t)total);
    if (buffer == NULL) {
        PyBuffer_Release(&view);
        PyErr_NoMemory();
        return -1;
    }
    if (shared) write_busy = 1;
    memcpy(buffer, head, (size_t)head_len);
    memcpy(buffer + head_len, view.buf, (size_t)view.len);
    if (self->chunked) memcpy(buffer + head_len + view.len, "\r\n", 2);
    PyBuffer_Release(&view);
    Py_ssize_t sent;
    int result = 1;
    PyObject *error = NULL;
    for (;;) {
        sent = write(self->client_fd, buffer, (size_t)total);
        if (sent >= 0) break;
        if (errno == EINTR) {
            if (PyErr_CheckSignals() < 0) {
                result = -1;
                break;
            }
            continue;
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            sent = 0;
            break;
        }
        /* A reset or a broken pipe: the OSError os.write would raise, for _client_failed. */
        PyErr_SetFromErrno(PyExc_OSError);
        error = raised();
        break;
    }
    PyObject *rest = NULL;
    if (result > 0 && error == NULL && sent != total) {
        /* The client's socket is full: the rest waits for EPOLLOUT (_park keeps a view of the whole write). */
        rest = PyBytes_FromStringAndSize(buffer, total);
        if (rest == NULL) result = -1;
    }
    if (shared) write_busy = 0;
    else PyMem_Free(buffer);
    if (result < 0) return -1;
    if (error != NULL) {
        result = call_method(self->stream, s_client_failed, error);
        Py_DECREF(error);
        return result < 0 ? -1 : 0;
    }
    if (rest == NULL) return 1;
    PyObject *at = PyLong_FromSsize_t(sent);
    if (at == NULL) {
        Py_DECREF(rest);
        return -1;
    }
    PyObject *args[3] = {self->stream, rest, at};
    PyObject *done = PyObject_VectorcallMethod(s_park, args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(rest);
    Py_DECREF(at);
    if (done == NULL) return -1;
    Py_DECREF(done);
    return 0;
}

/* The relay of one read after _took: on_chunk, the write, the silence mark. Steals nothing. */
static int relay_chunk(Step *self, PyObject *chunk, int terminal) {
    if (PyBytes_GET_SIZE(chunk) == 0) return end_stream(self, empty_bytes, Py_None);
    PyObject *now = self->clock == NULL ? trio_time(self) : PyObject_CallNoArgs(self->clock);
    if (now == NULL) return -1;
    PyObject *out;
    if (self->book && PyFloat_CheckExact(now)) {
        out = book_read(self, chunk, now, terminal);
    } else {
        PyObject *args[2] = {chunk, now};
        out = PyObject_Vectorcall(self->on_chunk, args, 2, NULL);
    }
    if (out == NULL) goto failed;
    if (out == Py_None) {
        Py_DECREF(out);
        Py_DECREF(now);
        return end_stream(self, chunk, Py_None);
    }
    Py_ssize_t size = PyObject_Length(out);
    if (size < 0) {
        Py_DECREF(out);
        goto failed;
    }
    if (size > 0) {
        int gone = truth(&f_client_disconnected, self->client);
        if (gone != 0) {
            Py_DECREF(out);
            Py_DECREF(now);
            if (gone < 0) return -1;
            PyObject *error = PyObject_CallMethodNoArgs(self->client, s_gone_error);
            if (error == NULL) return -1;
            int result = end_stream(self, empty_bytes, error);
            Py_DECREF(error);
            return result;
        }
        int written = write_out(self, out);
        Py_DECREF(out);
        if (written <= 0) {
            Py_DECREF(now);
            return written < 0 ? -1 : 1;
        }
    } else {
        Py_DECREF(out);
    }
    /* conn.drained (the watch is not closed: checked before the read). */
    int drained = truth(&f_conn_drained, self->conn);
    if (drained < 0) goto failed;
    if (drained && PyList_GET_SIZE(self->body) == 0) {
        int complete = truth(&f_conn_complete, self->conn);
        if (complete < 0) goto failed;
        drained = !complete;
    } else {
        drained = 0;
    }
    int result;
    if (drained) {
        result = waiting_from(self, self->clock == NULL ? now : NULL);
    } else {
        result = put(&f_conn_waiting_since, self->conn, inf);
        if (result == 0) result = set_bool(&f_stream_again, self->stream, 1);
        if (result == 0) {
            PyObject *done = PyObject_CallOneArg(self->later, self->watch);
            result = done == NULL ? -1 : 0;
            Py_XDECREF(done);
        }
    }
    Py_DECREF(now);
    return result < 0 ? -1 : 1;
failed:
    Py_DECREF(now);
    return -1;
}

/* What read_ready's caller does with the outcome of a read or parse that raised ``exc``. */
static int read_failed(Step *self, PyObject *exc) {
    PyObject *chunk = PyObject_CallMethodOneArg(self->upstream, s_relay_failed, exc);
    if (chunk == NULL) return -1;
    if (chunk == Py_None) {
        /* A parse error after the response's end: relay_body_ready reads on; so does the Python path. */
        Py_DECREF(chunk);
        return 0;
    }
    if (!PyBytes_Check(chunk)) {
        Py_DECREF(chunk);
        PyErr_SetString(PyExc_TypeError, "relay_failed must return bytes or None");
        return -1;
    }
    PyObject *saw = get(&f_up_saw_terminal, self->upstream);
    int terminal = saw != NULL ? PyObject_IsTrue(saw) : -1;
    Py_XDECREF(saw);
    int result = terminal < 0 ? -1 : relay_chunk(self, chunk, terminal);
    Py_DECREF(chunk);
    return result;
}

/* One call of the hub: 1 done, 0 for the Python path (nothing it would look for consumed), -1 error. *read_done
   says a read was made (the Python path then runs as for a call without an edge). */
static int step(Step *self, long events, int *read_done) {
    if (events == -1) return 0; /* HUB_STOPPED */
    PyObject *pending = get(&f_stream_pending, self->stream);
    if (pending == NULL) return -1;
    int waits = pending != Py_None;
    Py_DECREF(pending);
    if (waits) return 0;
    int closed = truth(&f_watch_closed, self->watch);
    if (closed != 0) return closed < 0 ? -1 : 0;
    int finished = truth(&f_up_finished, self->upstream);
    if (finished != 0) return finished < 0 ? -1 : 0;
    if (events != 0 && set_bool(&f_conn_drained, self->conn, 0) < 0) return -1;
    PyObject *body = self->body;
    if (PyList_GET_SIZE(body) != 0) return 0;
    /* The usual read: the head long parsed, no wire bound (only httptools can refuse it). */
    PyObject *limit = get(&f_conn_wire_limit, self->conn);
    if (limit == NULL) return -1;
    int unbounded = PyFloat_Check(limit) && isinf(PyFloat_AS_DOUBLE(limit)) && PyFloat_AS_DOUBLE(limit) > 0;
    Py_DECREF(limit);
    if (!unbounded) return 0;
    PyObject *head = get(&f_conn_head, self->conn);
    if (head == NULL) return -1;
    int headed = head != Py_None;
    Py_DECREF(head);
    if (!headed) return 0;
    while (PyList_GET_SIZE(body) == 0) {
        int complete = truth(&f_conn_complete, self->conn);
        if (complete != 0) return complete < 0 ? -1 : 0;
        PyObject *interrupted = get(&f_conn_interrupted, self->conn);
        if (interrupted == NULL) return -1;
        int cut = interrupted != Py_None;
        Py_DECREF(interrupted);
        if (cut) return 0;
        int drained = truth(&f_conn_drained, self->conn);
        if (drained < 0) return -1;
        if (drained) return waiting_from(self, NULL) < 0 ? -1 : 1;
        char *buffer = self->read_size <= READ_BUFFER ? read_buffer : PyMem_Malloc((size_t)self->read_size);
        if (buffer == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        Py_ssize_t size;
        for (;;) {
            size = read(self->engine_fd, buffer, (size_t)self->read_size);
            if (size >= 0 || errno != EINTR) break;
            if (PyErr_CheckSignals() < 0) {
                if (buffer != read_buffer) PyMem_Free(buffer);
                return -1;
            }
        }
        if (size < 0) {
            int error = errno;
            if (buffer != read_buffer) PyMem_Free(buffer);
            if (error == EAGAIN || error == EWOULDBLOCK) {
                if (set_bool(&f_conn_drained, self->conn, 1) < 0) return -1;
                return waiting_from(self, NULL) < 0 ? -1 : 1;
            }
            errno = error;
            PyErr_SetFromErrno(PyExc_OSError);
            PyObject *exc = raised();
            int result = read_failed(self, exc);
            Py_DECREF(exc);
            *read_done = 1;
            return result;
        }
        if (size == 0) {
            /* The end of the file stays readable: the Python path reads it again and ends as it does. */
            if (buffer != read_buffer) PyMem_Free(buffer);
            return 0;
        }
        PyObject *data = PyBytes_FromStringAndSize(buffer, size);
        if (buffer != read_buffer) PyMem_Free(buffer);
        if (data == NULL) return -1;
        *read_done = 1;
        if (set_bool(&f_conn_drained, self->conn, size < self->read_size) < 0) goto data_failed;
        PyObject *received = get(&f_conn_received, self->conn);
        if (received == NULL) goto data_failed;
        PyObject *count = PyLong_FromSsize_t(size);
        PyObject *sum = count != NULL ? PyNumber_Add(received, count) : NULL;
        Py_DECREF(received);
        Py_XDECREF(count);
        if (sum == NULL) goto data_failed;
        int set = put(&f_conn_received, self->conn, sum);
        Py_DECREF(sum);
        if (set < 0) goto data_failed;
        PyObject *fed = PyObject_CallOneArg(self->feed, data);
        Py_DECREF(data);
        if (fed == NULL) {
            if (!PyErr_ExceptionMatches(parse_errors)) return -1;
            PyObject *exc = raised();
            int result = read_failed(self, exc);
            Py_DECREF(exc);
            return result;
        }
        Py_DECREF(fed);
        continue;
    data_failed:
        Py_DECREF(data);
        return -1;
    }
    Py_ssize_t parts = PyList_GET_SIZE(body);
    PyObject *chunk = parts == 1 ? Py_NewRef(PyList_GET_ITEM(body, 0)) : _PyBytes_Join(empty_bytes, body);
    if (chunk == NULL) return -1;
    if (PyList_SetSlice(body, 0, parts, NULL) < 0) {
        Py_DECREF(chunk);
        return -1;
    }
    int terminal = 0;
    int taken = PyBytes_CheckExact(chunk) ? one_event(self, chunk, &terminal) : 0;
    if (taken < 0) {
        Py_DECREF(chunk);
        return -1;
    }
    if (taken) {
        if (set_bool(&f_up_saw_terminal, self->upstream, terminal) < 0 ||
            set_bool(&f_up_started, self->upstream, 1) < 0) {
            Py_DECREF(chunk);
            return -1;
        }
    } else {
        /* Any other read: UpstreamStream._took's general path (a cut at [DONE], the whole SSE check). */
        Py_SETREF(chunk, PyObject_CallMethodOneArg(self->upstream, s_took, chunk));
        if (chunk == NULL) return -1;
        if (!PyBytes_Check(chunk)) {
            Py_DECREF(chunk);
            PyErr_SetString(PyExc_TypeError, "_took must return bytes");
            return -1;
        }
        PyObject *saw = get(&f_up_saw_terminal, self->upstream);
        terminal = saw != NULL ? PyObject_IsTrue(saw) : -1;
        Py_XDECREF(saw);
        if (terminal < 0) {
            Py_DECREF(chunk);
            return -1;
        }
    }
    int result = relay_chunk(self, chunk, terminal);
    Py_DECREF(chunk);
    return result;
}

/* The hub's call with ``events`` (``events_obj``: the same as an int, or NULL to make it when needed). */
static PyObject *step_call(Step *self, long events, PyObject *events_obj) {
    int read_done = 0;
    int result = step(self, events, &read_done);
    if (result > 0) Py_RETURN_NONE;
    if (result == 0) {
        /* The Python path, as if the read made here had been its own (no edge left to report). */
        PyObject *arg = read_done ? PyLong_FromLong(0)
                                  : (events_obj != NULL ? Py_NewRef(events_obj) : PyLong_FromLong(events));
        if (arg == NULL) return NULL;
        PyObject *done = PyObject_CallMethodOneArg(self->stream, s_on_engine, arg);
        Py_DECREF(arg);
        return done;
    }
    /* As on_engine's own ``except Exception``: the error goes to the request task, never into the hub. */
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
    PyObject *exc = raised();
    int ended = end_stream(self, empty_bytes, exc);
    Py_DECREF(exc);
    if (ended < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *step_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "a relay step takes the events only");
        return NULL;
    }
    long events = PyLong_AsLong(args[0]);
    if (events == -1 && PyErr_Occurred()) return NULL;
    return step_call((Step *)callable, events, args[0]);
}

static PyObject *step_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"stream", "upstream", "conn", "feed", "body", "sse", "watch", "client", "on_chunk",
                            "clock", "trio_now", "offset", "later", "read_size", "engine_fd", "client_fd",
                            "chunked", NULL};
    PyObject *stream, *upstream, *conn, *feed, *body, *sse, *watch, *client, *on_chunk, *clock, *trio_now, *offset,
        *later;
    Py_ssize_t read_size;
    int engine_fd, client_fd, chunked;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO!OOOOOOOOniip:Step", names, &stream, &upstream, &conn,
                                     &feed, &PyList_Type, &body, &sse, &watch, &client, &on_chunk, &clock, &trio_now,
                                     &offset, &later, &read_size, &engine_fd, &client_fd, &chunked))
        return NULL;
    if (book_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_relay_native.bind() was not called");
        return NULL;
    }
    if (read_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "read_size must be positive");
        return NULL;
    }
    double clock_offset = NAN;
    if (offset != Py_None) {
        clock_offset = PyFloat_AsDouble(offset);
        if (clock_offset == -1.0 && PyErr_Occurred()) return NULL;
    }
    Step *self = (Step *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->vectorcall = step_vectorcall;
    self->stream = Py_NewRef(stream);
    self->upstream = Py_NewRef(upstream);
    self->conn = Py_NewRef(conn);
    self->feed = Py_NewRef(feed);
    self->body = Py_NewRef(body);
    self->sse = Py_NewRef(sse);
    self->watch = Py_NewRef(watch);
    self->client = Py_NewRef(client);
    self->on_chunk = Py_NewRef(on_chunk);
    self->clock = clock == Py_None ? NULL : Py_NewRef(clock);
    self->trio_now = Py_NewRef(trio_now);
    self->later = Py_NewRef(later);
    self->offset = clock_offset;
    self->read_size = read_size;
    self->engine_fd = engine_fd;
    self->client_fd = client_fd;
    self->chunked = (char)chunked;
    /* The book's own work only for a book of this stream (its [DONE] is this stream's saw_terminal). */
    self->book = 0;
    if (Py_IS_TYPE(on_chunk, (PyTypeObject *)book_type)) {
        PyObject *owner = get(&f_book_upstream, on_chunk);
        if (owner == NULL) {
            Py_DECREF(self);
            return NULL;
        }
        self->book = owner == upstream;
        Py_DECREF(owner);
    }
    return (PyObject *)self;
}

static int step_traverse(Step *self, visitproc visit, void *arg) {
    Py_VISIT(self->stream);
    Py_VISIT(self->upstream);
    Py_VISIT(self->conn);
    Py_VISIT(self->feed);
    Py_VISIT(self->body);
    Py_VISIT(self->sse);
    Py_VISIT(self->watch);
    Py_VISIT(self->client);
    Py_VISIT(self->on_chunk);
    Py_VISIT(self->clock);
    Py_VISIT(self->trio_now);
    Py_VISIT(self->later);
    return 0;
}

static int step_clear(Step *self) {
    Py_CLEAR(self->stream);
    Py_CLEAR(self->upstream);
    Py_CLEAR(self->conn);
    Py_CLEAR(self->feed);
    Py_CLEAR(self->body);
    Py_CLEAR(self->sse);
    Py_CLEAR(self->watch);
    Py_CLEAR(self->client);
    Py_CLEAR(self->on_chunk);
    Py_CLEAR(self->clock);
    Py_CLEAR(self->trio_now);
    Py_CLEAR(self->later);
    return 0;
}

static void step_dealloc(Step *self) {
    PyObject_GC_UnTrack(self);
    step_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject StepType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "narwhal.http1._relay_native.Step",
    .tp_doc = PyDoc_STR("A pumped stream's per-read path (pump._Stream.on_engine's usual read, in C)."),
    .tp_basicsize = sizeof(Step),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Step, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = step_new,
    .tp_dealloc = (destructor)step_dealloc,
    .tp_traverse = (traverseproc)step_traverse,
    .tp_clear = (inquiry)step_clear,
};

/* ---- the readiness hub's round (readiness.py's _poll_round / _dispatch, idle_rounds.py's _rounds) ---- */

/* The most ready descriptors a round takes (readiness.py's _BATCH is passed in and must not exceed it). */
#define MAX_BATCH 256
/* What makes readiness.py's _saw_closed run: the peer's FIN, a hang-up, an error (its _CLOSED). */
#define CLOSED_EVENTS (EPOLLRDHUP | EPOLLHUP | EPOLLERR)

/* select.epoll.poll's wait: the GIL released while it may sleep, a signal's handlers run at EINTR and the wait
   resumed for what is left of ``timeout`` (PEP 475); a negative timeout waits for ever. The events taken, or -1. */
static int wait_ready(int epoll_fd, struct epoll_event *events, int batch, double timeout) {
    int ms = -1;
    double deadline = 0.0;
    if (timeout >= 0) {
        double ceiling = ceil(timeout * 1e3);
        ms = ceiling > (double)INT_MAX ? INT_MAX : (int)ceiling;
        deadline = perf_counter() + timeout;
    }
    for (;;) {
        int taken, error;
        if (ms == 0) {
            taken = epoll_wait(epoll_fd, events, batch, 0);
            error = errno;
        } else {
            Py_BEGIN_ALLOW_THREADS
            taken = epoll_wait(epoll_fd, events, batch, ms);
            error = errno;
            Py_END_ALLOW_THREADS
        }
        if (taken >= 0) return taken;
        if (error != EINTR) {
            errno = error;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        if (PyErr_CheckSignals() < 0) return -1;
        if (ms > 0) {
            double left = deadline - perf_counter();
            if (left < 0) return 0;
            double ceiling = ceil(left * 1e3);
            ms = ceiling > (double)INT_MAX ? INT_MAX : (int)ceiling;
        }
    }
}

/* A watch's handler called with ``events``: a relay step directly, anything else through a call. */
static int call_handler(PyObject *handler, long events) {
    PyObject *done;
    if (Py_IS_TYPE(handler, &StepType)) {
        done = step_call((Step *)handler, events, NULL);
    } else {
        PyObject *arg = PyLong_FromLong(events);
        if (arg == NULL) return -1;
        done = PyObject_CallOneArg(handler, arg);
        Py_DECREF(arg);
    }
    if (done == NULL) return -1;
    Py_DECREF(done);
    return 0;
}

/* readiness.py's _dispatch for one ready watch: the close seen (by the Python helper), then its handler, its waiting
   task woken, or the edge kept for the next wait. */
static int deliver(PyObject *watch, long events, PyObject *saw_closed, PyObject *reschedule) {
    if (events & CLOSED_EVENTS) {
        PyObject *arg = PyLong_FromLong(events);
        if (arg == NULL) return -1;
        PyObject *args[2] = {watch, arg};
        PyObject *done = PyObject_Vectorcall(saw_closed, args, 2, NULL);
        Py_DECREF(arg);
        if (done == NULL) return -1;
        Py_DECREF(done);
    }
    PyObject *handler = get(&f_watch_handler, watch);
    if (handler == NULL) return -1;
    if (handler != Py_None) {
        int result = call_handler(handler, events);
        Py_DECREF(handler);
        return result;
    }
    Py_DECREF(handler);
    PyObject *task = get(&f_watch_task, watch);
    if (task == NULL) return -1;
    if (task == Py_None) {
        Py_DECREF(task);
        return set_bool(&f_watch_ready, watch, 1);
    }
    int result = put(&f_watch_task, watch, Py_None);
    if (result == 0) {
        PyObject *done = PyObject_CallOneArg(reschedule, task);
        result = done == NULL ? -1 : 0;
        Py_XDECREF(done);
    }
    Py_DECREF(task);
    return result;
}

/* Each ready descriptor to its watch: 1 ``other_fd`` was among them (and is not watched), 0 not, -1 error. */
static int dispatch(struct epoll_event *events, int taken, PyObject *watches, int other_fd, PyObject *saw_closed,
                    PyObject *reschedule) {
    int other = 0;
    for (int i = 0; i < taken; i++) {
        int fd = events[i].data.fd;
        PyObject *key = PyLong_FromLong(fd);
        if (key == NULL) return -1;
        PyObject *watch = PyDict_GetItemWithError(watches, key);
        Py_DECREF(key);
        if (watch == NULL) {
            if (PyErr_Occurred()) return -1;
            if (fd == other_fd) other = 1;
            continue;
        }
        /* A handler may forget it (its dict entry gone) while it runs. */
        Py_INCREF(watch);
        int result = deliver(watch, (long)events[i].events, saw_closed, reschedule);
        Py_DECREF(watch);
        if (result < 0) return -1;
    }
    return other;
}

/* An int argument (PyLong_AsInt is 3.13's). */
static int as_int(PyObject *value) {
    long result = PyLong_AsLong(value);
    if (result == -1 && PyErr_Occurred()) return -1;
    if (result > INT_MAX || result < INT_MIN) {
        PyErr_SetString(PyExc_OverflowError, "an int argument is out of range");
        return -1;
    }
    return (int)result;
}

static int check_batch(int batch) {
    if (batch < 1 || batch > MAX_BATCH) {
        PyErr_Format(PyExc_ValueError, "batch must be 1 to %d", MAX_BATCH);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(poll_round_doc, "poll_round(epoll_fd, timeout, batch, watches, other_fd, saw_closed, reschedule)\n--\n\n"
                             "readiness.py's poll and dispatch of one round: (other_fd was ready, events taken).");

static PyObject *poll_round(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "poll_round takes 7 arguments");
        return NULL;
    }
    int epoll_fd = as_int(args[0]);
    double timeout = PyFloat_AsDouble(args[1]);
    int batch = as_int(args[2]);
    int other_fd = as_int(args[4]);
    if (PyErr_Occurred() || check_batch(batch) < 0) return NULL;
    if (!PyDict_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "watches must be a dict");
        return NULL;
    }
    struct epoll_event events[MAX_BATCH];
    int taken = wait_ready(epoll_fd, events, batch, timeout);
    if (taken < 0) return NULL;
    int other = dispatch(events, taken, args[3], other_fd, args[5], args[6]);
    if (other < 0) return NULL;
    return Py_BuildValue("(Oi)", other ? Py_True : Py_False, taken);
}

/* hub._later's length, or -1. */
static Py_ssize_t later_size(PyObject *hub) {
    PyObject *later = PyObject_GetAttr(hub, s_later_list);
    if (later == NULL) return -1;
    Py_ssize_t size = PyObject_Length(later);
    Py_DECREF(later);
    return size;
}

/* One of the hub's pump rounds (Readiness.pump_round): 1 trio's set was ready, 0 not, -1 error; *short_out says
   whether it stopped short (a handler asked ``later``, or a full batch). */
static int pump_round(PyObject *hub, int epoll_fd, int trio_fd, PyObject *watches, PyObject *saw_closed,
                      PyObject *reschedule, int batch, double timeout, int *short_out) {
    PyObject *count = PyObject_GetAttr(hub, s_pump_rounds);
    PyObject *more = count != NULL ? PyNumber_Add(count, one) : NULL;
    Py_XDECREF(count);
    int failed = more == NULL || PyObject_SetAttr(hub, s_pump_rounds, more) < 0;
    Py_XDECREF(more);
    if (failed) return -1;
    /* The handlers that asked ``later``, called after this round's edges; a ``later`` in this round is for the next. */
    PyObject *again = PyObject_GetAttr(hub, s_later_list);
    if (again == NULL) return -1;
    if (!PyList_Check(again)) {
        Py_DECREF(again);
        PyErr_SetString(PyExc_TypeError, "Readiness._later must be a list");
        return -1;
    }
    if (PyList_GET_SIZE(again) != 0) {
        PyObject *fresh = PyList_New(0);
        failed = fresh == NULL || PyObject_SetAttr(hub, s_later_list, fresh) < 0;
        Py_XDECREF(fresh);
        if (failed) {
            Py_DECREF(again);
            return -1;
        }
    } else {
        Py_CLEAR(again);
    }
    struct epoll_event events[MAX_BATCH];
    int taken = wait_ready(epoll_fd, events, batch, timeout);
    int other = taken < 0 ? -1 : dispatch(events, taken, watches, trio_fd, saw_closed, reschedule);
    if (other < 0) {
        Py_XDECREF(again);
        return -1;
    }
    if (again != NULL) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(again); i++) {
            PyObject *handler = get(&f_watch_handler, PyList_GET_ITEM(again, i));
            int result = handler == NULL ? -1 : (handler == Py_None ? 0 : call_handler(handler, 0));
            Py_XDECREF(handler);
            if (result < 0) {
                Py_DECREF(again);
                return -1;
            }
        }
        Py_DECREF(again);
    }
    Py_ssize_t left = later_size(hub);
    if (left < 0) return -1;
    *short_out = left > 0 || taken == batch;
    return other;
}

PyDoc_STRVAR(pump_rounds_doc,
             "pump_rounds(hub, epoll_fd, trio_fd, watches, saw_closed, reschedule, runq, end, short, batch)\n--\n\n"
             "idle_rounds.py's loop of pump rounds until trio's set is ready (1), a task is runnable (2) or "
             "time.monotonic() reaches end (0): (outcome, short).");

static PyObject *pump_rounds(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "pump_rounds takes 10 arguments");
        return NULL;
    }
    PyObject *hub = args[0], *watches = args[3], *saw_closed = args[4], *reschedule = args[5], *runq = args[6];
    int epoll_fd = as_int(args[1]);
    int trio_fd = as_int(args[2]);
    double end = PyFloat_AsDouble(args[7]);
    int short_round = PyObject_IsTrue(args[8]);
    int batch = as_int(args[9]);
    if (PyErr_Occurred() || short_round < 0 || check_batch(batch) < 0) return NULL;
    if (!PyDict_Check(watches)) {
        PyErr_SetString(PyExc_TypeError, "watches must be a dict");
        return NULL;
    }
    int outcome;
    for (;;) {
        /* ``end`` is time.monotonic()'s: on Linux the same CLOCK_MONOTONIC as perf_counter. */
        double wait = end - perf_counter();
        if (wait <= 0) {
            /* trio's deadline: its own epoll_wait would sleep the whole timeout again. */
            outcome = 0;
            break;
        }
        int trio_ready = pump_round(hub, epoll_fd, trio_fd, watches, saw_closed, reschedule, batch,
                                    short_round ? 0.0 : wait, &short_round);
        if (trio_ready < 0) return NULL;
        if (trio_ready) {
            outcome = 1;
            break;
        }
        Py_ssize_t runnable = PyObject_Length(runq);
        if (runnable < 0) return NULL;
        if (runnable > 0) {
            outcome = 2;
            break;
        }
    }
    return Py_BuildValue("(iO)", outcome, short_round ? Py_True : Py_False);
}

/* ---- the SSE check of a read of several events (classify.py's SSEWatch.feed) ---- */

PyDoc_STRVAR(whole_data_events_doc, "whole_data_events(data, /)\n--\n\n"
             "The events in ``data`` when it is whole one-line `data:` events (it starts with `data:`, and every "
             "newline is one of a blank line followed by `data:` or the end), else 0.");

static PyObject *whole_data_events(PyObject *Py_UNUSED(module), PyObject *data) {
    if (!PyBytes_Check(data)) {
        PyErr_SetString(PyExc_TypeError, "whole_data_events takes bytes");
        return NULL;
    }
    const char *at = PyBytes_AS_STRING(data);
    const char *end = at + PyBytes_GET_SIZE(data);
    if (end - at < 7 || memcmp(at, "data:", 5) != 0) return PyLong_FromLong(0);
    Py_ssize_t events = 0;
    for (;;) {
        /* memchr is glibc's vector scan: an event's bytes cost a fraction of an instruction each. */
        const char *newline = memchr(at, '\n', (size_t)(end - at));
        if (newline == NULL || newline + 1 == end || newline[1] != '\n') return PyLong_FromLong(0);
        events++;
        at = newline + 2;
        if (at == end) return PyLong_FromSsize_t(events);
        if (end - at < 5 || memcmp(at, "data:", 5) != 0) return PyLong_FromLong(0);
    }
}

PyDoc_STRVAR(bind_doc, "bind(book_type, parse_errors)\n--\n\nThe RelayBook type whose work Step does itself, and the "
                       "parser's errors that UpstreamStream.relay_failed translates.");

static PyObject *bind(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *type, *errors;
    if (!PyArg_ParseTuple(args, "O!O!:bind", &PyType_Type, &type, &PyTuple_Type, &errors)) return NULL;
    Py_XSETREF(book_type, Py_NewRef(type));
    Py_XSETREF(parse_errors, Py_NewRef(errors));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"bind", (PyCFunction)bind, METH_VARARGS, bind_doc},
    {"poll_round", (PyCFunction)(void (*)(void))poll_round, METH_FASTCALL, poll_round_doc},
    {"pump_rounds", (PyCFunction)(void (*)(void))pump_rounds, METH_FASTCALL, pump_rounds_doc},
    {"whole_data_events", (PyCFunction)whole_data_events, METH_O, whole_data_events_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "narwhal.http1._relay_native",
    "The relay pump's per-read path, the readiness hub's round and the SSE check of whole events in C (see "
    "narwhal/http1/pump.py, readiness.py, narwhal/pools/classify.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC PyInit__relay_native(void) {
    INTERN(s_pending, "pending");
    INTERN(s_again, "again");
    INTERN(s_end, "_end");
    INTERN(s_park, "_park");
    INTERN(s_client_failed, "_client_failed");
    INTERN(s_on_engine, "on_engine");
    INTERN(s_closed, "closed");
    INTERN(s_finished, "_finished");
    INTERN(s_saw_terminal, "saw_terminal");
    INTERN(s_started, "_started");
    INTERN(s_took, "_took");
    INTERN(s_relay_failed, "relay_failed");
    INTERN(s_drained, "_drained");
    INTERN(s_complete, "_complete");
    INTERN(s_interrupted, "_interrupted");
    INTERN(s_wire_limit, "_wire_limit");
    INTERN(s_head, "_head");
    INTERN(s_received, "_received");
    INTERN(s_waiting_since, "waiting_since");
    INTERN(s_event, "_event");
    INTERN(s_valid, "valid");
    INTERN(s_after_newline, "_after_newline");
    INTERN(s_data_events, "data_events");
    INTERN(s_disconnected, "disconnected");
    INTERN(s_gone_error, "gone_error");
    INTERN(s_last_at, "last_at");
    INTERN(s_held, "held");
    INTERN(s_bounds, "bounds");
    INTERN(s_counts, "counts");
    INTERN(s_total, "total");
    INTERN(s_marker, "marker");
    INTERN(s_strip, "strip");
    INTERN(s_upstream, "upstream");
    INTERN(s_handler, "handler");
    INTERN(s_task, "task");
    INTERN(s_ready, "ready");
    INTERN(s_later_list, "_later");
    INTERN(s_pump_rounds, "pump_rounds");
    if ((empty_bytes = PyBytes_FromStringAndSize(NULL, 0)) == NULL) return NULL;
    if ((one = PyLong_FromLong(1)) == NULL || (inf = PyFloat_FromDouble(INFINITY)) == NULL) return NULL;
    if (PyType_Ready(&StepType) < 0) return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    if (PyModule_AddObjectRef(module, "Step", (PyObject *)&StepType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
