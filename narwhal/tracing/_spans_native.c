/* narwhal.tracing._spans_native: spans.py's RequestTrace (a request's spans until its root ends), in C.

   The same behaviour as spans.PythonRequestTrace, method for method: a traced request calls it about a dozen
   times (its start, the placement, each leg opened and ended, the request ended), and in Python those calls
   were about a third of the tracing work. The spans themselves stay spans.Span (a msgspec struct), made by
   calling that type; ``bind`` tells this module which type it is. Optional, as _otlp_native: without it, or with
   NARWHAL_NO_EXTENSIONS set, the Python class runs, and the tests run the tracing suite against both. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include "../_slot_offset.h"
#include <string.h>

static PyObject *span_type;  /* spans.Span, from bind() */
static PyObject *s_trace_id, *s_span_id, *s_sampled, *s_tracestate, *s_ended, *s_end_ns, *s_status_code,
    *s_status_message, *s_end, *s_span_ids, *s_request_name, *s_trace_key, *s_shared_kwnames, *s_hex,
    *b_traceparent;
static PyObject *one, *two, *three;  /* small ints: KIND_INTERNAL (1), KIND_SERVER and STATUS_ERROR (2), a draw */

/* Where, in "\r\ntraceparent: 00-<trace id>-<span id>-<flags>", the value and the span id's hex digits start. */
#define TRACEPARENT_AT 15
#define SPAN_ID_AT (TRACEPARENT_AT + 3 + 32 + 1)
#define TRACEPARENT_LEN 55

typedef struct {
    PyObject_HEAD
    PyObject *context;
    PyObject *response_traceparent;
    PyObject *root;
    PyObject *root_headers;
    PyObject *root_kw;
    PyObject *trace_id;
    PyObject *root_id;
    PyObject *ended;      /* the children ended so far, handed on with the root */
    PyObject *ids;
    PyObject *sink;
    PyObject *span_ids;   /* child span ids drawn ahead, 8 bytes each */
    PyObject *trace_head; /* the header lines up to a span id */
    PyObject *flags_state;
    Py_ssize_t next_id;
    char sampled;
} RequestTrace;

static const char HEX[] = "0123456789abcdef";

static void put_hex(char *out, const char *data, Py_ssize_t size) {
    for (Py_ssize_t i = 0; i < size; i++) {
        unsigned char c = (unsigned char)data[i];
        out[2 * i] = HEX[c >> 4];
        out[2 * i + 1] = HEX[c & 0x0F];
    }
}

/* bytes[start:stop] with Python's clamping (start, stop >= 0). */
static PyObject *slice(PyObject *bytes, Py_ssize_t start, Py_ssize_t stop) {
    Py_ssize_t size = PyBytes_GET_SIZE(bytes);
    if (stop > size) stop = size;
    if (start > stop) start = stop;
    return PyBytes_FromStringAndSize(PyBytes_AS_STRING(bytes) + start, stop - start);
}

static int expect_bytes(PyObject *value, const char *what) {
    if (PyBytes_Check(value)) return 0;
    PyErr_Format(PyExc_TypeError, "%s must be bytes, got %.200s", what, Py_TYPE(value)->tp_name);
    return -1;
}

static int trace_init_fields(RequestTrace *self, PyObject *context, PyObject *parent_span_id, PyObject *start_ns,
                             PyObject *ids, PyObject *sink, PyObject *span_ids) {
    if (span_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_spans_native.bind(Span) was not called");
        return -1;
    }
    if (expect_bytes(span_ids, "span_ids") < 0) return -1;
    PyObject *trace_id = PyObject_GetAttr(context, s_trace_id);
    if (trace_id == NULL) return -1;
    PyObject *root_id = PyObject_GetAttr(context, s_span_id);
    if (root_id == NULL) {
        Py_DECREF(trace_id);
        return -1;
    }
    PyObject *sampled = NULL, *state = NULL, *lines = NULL, *root = NULL;
    int rc = -1;
    if (expect_bytes(trace_id, "trace_id") < 0 || expect_bytes(root_id, "span_id") < 0) goto done;
    if ((sampled = PyObject_GetAttr(context, s_sampled)) == NULL) goto done;
    int is_sampled = PyObject_IsTrue(sampled);
    if (is_sampled < 0) goto done;
    if ((state = PyObject_GetAttr(context, s_tracestate)) == NULL) goto done;
    PyObject *args[6] = {trace_id, root_id, parent_span_id, s_request_name, two, start_ns};
    if ((root = PyObject_Vectorcall(span_type, args, 6, NULL)) == NULL) goto done;

    /* "\r\ntraceparent: 00-" trace id "-" span id "-" flags, then the client's tracestate: the lines of an engine
       call outside a leg; a child's are the same with its own span id. */
    Py_ssize_t trace_size = PyBytes_GET_SIZE(trace_id), root_size = PyBytes_GET_SIZE(root_id);
    Py_ssize_t hexed = 2 * (trace_size + root_size);
    Py_ssize_t cut = hexed < 32 ? hexed : 32;
    const char *state_data = NULL;
    Py_ssize_t state_size = 0;
    PyObject *state_bytes = NULL;
    int has_state = PyObject_IsTrue(state);
    if (has_state < 0) goto done;
    if (has_state) {
        if ((state_bytes = PyUnicode_AsASCIIString(state)) == NULL) goto done;
        state_data = PyBytes_AS_STRING(state_bytes);
        state_size = PyBytes_GET_SIZE(state_bytes);
    }
    Py_ssize_t size = 18 + hexed + 1 + 3 + (has_state ? 14 + state_size : 0);
    lines = PyBytes_FromStringAndSize(NULL, size);
    if (lines == NULL) {
        Py_XDECREF(state_bytes);
        goto done;
    }
    char *p = PyBytes_AS_STRING(lines);
    char *digits = PyMem_Malloc((size_t)hexed + 1);
    if (digits == NULL) {
        Py_XDECREF(state_bytes);
        PyErr_NoMemory();
        goto done;
    }
    put_hex(digits, PyBytes_AS_STRING(trace_id), trace_size);
    put_hex(digits + 2 * trace_size, PyBytes_AS_STRING(root_id), root_size);
    memcpy(p, "\r\ntraceparent: 00-", 18);
    p += 18;
    memcpy(p, digits, (size_t)cut);
    p += cut;
    *p++ = '-';
    memcpy(p, digits + cut, (size_t)(hexed - cut));
    p += hexed - cut;
    PyMem_Free(digits);
    memcpy(p, is_sampled ? "-01" : "-00", 3);
    p += 3;
    if (has_state) {
        memcpy(p, "\r\ntracestate: ", 14);
        memcpy(p + 14, state_data, (size_t)state_size);
        Py_DECREF(state_bytes);
    }
    PyObject *trace_head = slice(lines, 0, SPAN_ID_AT);
    PyObject *flags_state = slice(lines, SPAN_ID_AT + 16, PY_SSIZE_T_MAX);
    PyObject *value = slice(lines, TRACEPARENT_AT, TRACEPARENT_AT + TRACEPARENT_LEN);
    PyObject *response = value == NULL ? NULL : PyTuple_Pack(2, b_traceparent, value);
    Py_XDECREF(value);
    PyObject *root_kw = PyDict_New();
    PyObject *ended = PyList_New(0);
    if (trace_head == NULL || flags_state == NULL || response == NULL || root_kw == NULL || ended == NULL
        || PyDict_SetItem(root_kw, s_trace_key, lines) < 0) {
        Py_XDECREF(trace_head);
        Py_XDECREF(flags_state);
        Py_XDECREF(response);
        Py_XDECREF(root_kw);
        Py_XDECREF(ended);
        goto done;
    }
    Py_INCREF(context);
    Py_INCREF(ids);
    Py_INCREF(sink);
    Py_INCREF(span_ids);
    Py_INCREF(lines);
    Py_XSETREF(self->context, context);
    Py_XSETREF(self->ids, ids);
    Py_XSETREF(self->sink, sink);
    Py_XSETREF(self->span_ids, span_ids);
    Py_XSETREF(self->root_headers, lines);
    Py_XSETREF(self->trace_head, trace_head);
    Py_XSETREF(self->flags_state, flags_state);
    Py_XSETREF(self->response_traceparent, response);
    Py_XSETREF(self->root_kw, root_kw);
    Py_XSETREF(self->ended, ended);
    Py_XSETREF(self->root, root);
    root = NULL;
    Py_XSETREF(self->trace_id, trace_id);
    Py_XSETREF(self->root_id, root_id);
    trace_id = root_id = NULL;
    self->next_id = 0;
    self->sampled = (char)is_sampled;
    rc = 0;
done:
    Py_XDECREF(trace_id);
    Py_XDECREF(root_id);
    Py_XDECREF(sampled);
    Py_XDECREF(state);
    Py_XDECREF(lines);
    Py_XDECREF(root);
    return rc;
}

static PyObject *empty_bytes;

static PyObject *trace_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"context", "parent_span_id", "start_ns", "ids", "sink", "span_ids", NULL};
    PyObject *context, *parent, *start_ns, *ids, *sink, *span_ids = empty_bytes;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO|O:RequestTrace", names, &context, &parent, &start_ns, &ids,
                                     &sink, &span_ids))
        return NULL;
    RequestTrace *self = (RequestTrace *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    if (trace_init_fields(self, context, parent, start_ns, ids, sink, span_ids) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

/* RequestTrace(...) by position, as the tracer builds one a traced request: no argument tuple. */
static PyObject *trace_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames != NULL || nargs < 5 || nargs > 6) {
        PyObject *tuple = PyTuple_New(nargs);
        if (tuple == NULL) return NULL;
        for (Py_ssize_t i = 0; i < nargs; i++) {
            Py_INCREF(args[i]);
            PyTuple_SET_ITEM(tuple, i, args[i]);
        }
        PyObject *kwargs = NULL;
        if (kwnames != NULL) {
            kwargs = PyDict_New();
            for (Py_ssize_t i = 0; kwargs != NULL && i < PyTuple_GET_SIZE(kwnames); i++) {
                if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0) Py_CLEAR(kwargs);
            }
            if (kwargs == NULL) {
                Py_DECREF(tuple);
                return NULL;
            }
        }
        PyObject *result = trace_new((PyTypeObject *)type, tuple, kwargs);
        Py_DECREF(tuple);
        Py_XDECREF(kwargs);
        return result;
    }
    PyTypeObject *tp = (PyTypeObject *)type;
    RequestTrace *self = (RequestTrace *)tp->tp_alloc(tp, 0);
    if (self == NULL) return NULL;
    if (trace_init_fields(self, args[0], args[1], args[2], args[3], args[4], nargs == 6 ? args[5] : empty_bytes) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int trace_traverse(RequestTrace *self, visitproc visit, void *arg) {
    Py_VISIT(self->context);
    Py_VISIT(self->response_traceparent);
    Py_VISIT(self->root);
    Py_VISIT(self->root_headers);
    Py_VISIT(self->root_kw);
    Py_VISIT(self->trace_id);
    Py_VISIT(self->root_id);
    Py_VISIT(self->ended);
    Py_VISIT(self->ids);
    Py_VISIT(self->sink);
    Py_VISIT(self->span_ids);
    Py_VISIT(self->trace_head);
    Py_VISIT(self->flags_state);
    return 0;
}

static int trace_clear(RequestTrace *self) {
    Py_CLEAR(self->context);
    Py_CLEAR(self->response_traceparent);
    Py_CLEAR(self->root);
    Py_CLEAR(self->root_headers);
    Py_CLEAR(self->root_kw);
    Py_CLEAR(self->trace_id);
    Py_CLEAR(self->root_id);
    Py_CLEAR(self->ended);
    Py_CLEAR(self->ids);
    Py_CLEAR(self->sink);
    Py_CLEAR(self->span_ids);
    Py_CLEAR(self->trace_head);
    Py_CLEAR(self->flags_state);
    return 0;
}

static void trace_dealloc(RequestTrace *self) {
    PyObject_GC_UnTrack(self);
    trace_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The next child's span id: cut from the ids drawn ahead, three more drawn when they are used up. */
static PyObject *next_span_id(RequestTrace *self) {
    PyObject *span_id = slice(self->span_ids, self->next_id, self->next_id + 8);
    if (span_id == NULL) return NULL;
    if (PyBytes_GET_SIZE(span_id) == 0) {
        Py_DECREF(span_id);
        PyObject *drawn = PyObject_CallMethodOneArg(self->ids, s_span_ids, three);
        if (drawn == NULL) return NULL;
        if (expect_bytes(drawn, "span_ids(3)") < 0) {
            Py_DECREF(drawn);
            return NULL;
        }
        Py_SETREF(self->span_ids, drawn);
        self->next_id = 0;
        if ((span_id = slice(drawn, 0, 8)) == NULL) return NULL;
    }
    self->next_id += 8;
    return span_id;
}

static int parse_child_args(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, const char *fname,
                            PyObject **name, PyObject **start_ns, PyObject **kind, PyObject **shared) {
    static const char *const keywords[] = {"name", "start_ns", "kind", "shared"};
    PyObject *found[4] = {NULL, NULL, NULL, NULL};
    if (nargs > 4) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most 4 arguments (%zd given)", fname, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) found[i] = args[i];
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int slot = -1;
        for (int j = 0; j < 4; j++) {
            if (PyUnicode_CompareWithASCIIString(key, keywords[j]) == 0) slot = j;
        }
        if (slot < 0 || found[slot] != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected or repeated argument %R", fname, key);
            return -1;
        }
        found[slot] = args[nargs + k];
    }
    if (found[0] == NULL || found[1] == NULL) {
        PyErr_Format(PyExc_TypeError, "%s() needs name and start_ns", fname);
        return -1;
    }
    *name = found[0];
    *start_ns = found[1];
    *kind = found[2] != NULL ? found[2] : one;
    *shared = found[3] != NULL ? found[3] : Py_None;
    return 0;
}

static PyObject *new_child(RequestTrace *self, PyObject *span_id, PyObject *name, PyObject *start_ns, PyObject *kind,
                           PyObject *shared) {
    PyObject *args[7] = {self->trace_id, span_id, self->root_id, name, kind, start_ns, shared};
    return PyObject_Vectorcall(span_type, args, 6, s_shared_kwnames);
}

PyDoc_STRVAR(child_doc, "child(name, start_ns, kind=KIND_INTERNAL, shared=None)\n--\n\n"
                        "A new span under the root (carrying shared); an unsampled trace hands out its root.");

static PyObject *trace_child(RequestTrace *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *name, *start_ns, *kind, *shared;
    if (parse_child_args(args, nargs, kwnames, "child", &name, &start_ns, &kind, &shared) < 0) return NULL;
    if (!self->sampled) return Py_NewRef(self->root);
    PyObject *span_id = next_span_id(self);
    if (span_id == NULL) return NULL;
    PyObject *span = new_child(self, span_id, name, start_ns, kind, shared);
    Py_DECREF(span_id);
    return span;
}

/* {"trace": the header lines of an engine call made within the span whose id is span_id}. */
static PyObject *child_kw(RequestTrace *self, PyObject *span_id) {
    Py_ssize_t head = PyBytes_GET_SIZE(self->trace_head), id_size = PyBytes_GET_SIZE(span_id);
    Py_ssize_t tail = PyBytes_GET_SIZE(self->flags_state);
    PyObject *lines = PyBytes_FromStringAndSize(NULL, head + 2 * id_size + tail);
    if (lines == NULL) return NULL;
    char *p = PyBytes_AS_STRING(lines);
    memcpy(p, PyBytes_AS_STRING(self->trace_head), (size_t)head);
    put_hex(p + head, PyBytes_AS_STRING(span_id), id_size);
    memcpy(p + head + 2 * id_size, PyBytes_AS_STRING(self->flags_state), (size_t)tail);
    PyObject *kw = PyDict_New();
    if (kw == NULL || PyDict_SetItem(kw, s_trace_key, lines) < 0) Py_CLEAR(kw);
    Py_DECREF(lines);
    return kw;
}

PyDoc_STRVAR(open_doc, "open(name, start_ns, kind=KIND_INTERNAL, shared=None)\n--\n\n"
                       "child, with the data pool's keyword for the span's engine calls (engine_kw).");

static PyObject *trace_open(RequestTrace *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *name, *start_ns, *kind, *shared;
    if (parse_child_args(args, nargs, kwnames, "open", &name, &start_ns, &kind, &shared) < 0) return NULL;
    if (!self->sampled) return PyTuple_Pack(2, self->root, self->root_kw);
    PyObject *span_id = next_span_id(self);
    if (span_id == NULL) return NULL;
    PyObject *span = new_child(self, span_id, name, start_ns, kind, shared);
    PyObject *kw = span == NULL ? NULL : child_kw(self, span_id);
    Py_DECREF(span_id);
    if (kw == NULL) {
        Py_XDECREF(span);
        return NULL;
    }
    PyObject *pair = PyTuple_New(2);
    if (pair == NULL) {
        Py_DECREF(span);
        Py_DECREF(kw);
        return NULL;
    }
    PyTuple_SET_ITEM(pair, 0, span);
    PyTuple_SET_ITEM(pair, 1, kw);
    return pair;
}

/* Where spans.Span keeps ended, end_ns, status_code and status_message (``bind``): a span of exactly that type
   is read and written at those slots' offsets, as its own setattr would (a struct outside the garbage collector,
   not frozen: nothing else happens on a write); anything else through getattr and setattr. */
static Py_ssize_t ended_at, end_ns_at, status_code_at, status_message_at;
static int span_slots;

static inline PyObject **slot(PyObject *span, Py_ssize_t offset) {
    return (PyObject **)((char *)span + offset);
}

/* Whether span has ended: 1, 0, or -1 with an exception set. */
static int span_ended(PyObject *span) {
    if (span_slots && Py_TYPE(span) == (PyTypeObject *)span_type) {
        PyObject *ended = *slot(span, ended_at);
        if (ended == Py_True) return 1;
        if (ended == Py_False) return 0;
    }
    PyObject *ended = PyObject_GetAttr(span, s_ended);
    if (ended == NULL) return -1;
    int was = PyObject_IsTrue(ended);
    Py_DECREF(ended);
    return was;
}

static inline void set_slot(PyObject *span, Py_ssize_t offset, PyObject *value) {
    Py_XSETREF(*slot(span, offset), Py_NewRef(value));
}

/* span.end(end_ns, error), inline: the Python method is called only to raise for a span ended twice. */
static int end_span(PyObject *span, PyObject *end_ns, PyObject *error) {
    int was = span_ended(span);
    if (was < 0) return -1;
    if (was) {
        PyObject *args[3] = {span, end_ns, error};
        PyObject *result = PyObject_VectorcallMethod(s_end, args, 3, NULL);
        Py_XDECREF(result);
        if (result != NULL) PyErr_SetString(PyExc_RuntimeError, "a span ended twice");
        return -1;
    }
    if (span_slots && Py_TYPE(span) == (PyTypeObject *)span_type) {
        set_slot(span, ended_at, Py_True);
        set_slot(span, end_ns_at, end_ns);
        if (error != Py_None) {
            set_slot(span, status_code_at, two);
            set_slot(span, status_message_at, error);
        }
        return 0;
    }
    if (PyObject_SetAttr(span, s_ended, Py_True) < 0 || PyObject_SetAttr(span, s_end_ns, end_ns) < 0) return -1;
    if (error != Py_None
        && (PyObject_SetAttr(span, s_status_code, two) < 0 || PyObject_SetAttr(span, s_status_message, error) < 0))
        return -1;
    return 0;
}

static int call_sink(RequestTrace *self, PyObject *spans) {
    PyObject *result = PyObject_CallOneArg(self->sink, spans);
    Py_XDECREF(result);
    return result == NULL ? -1 : 0;
}

PyDoc_STRVAR(finish_doc, "finish(span, end_ns, *, error=None)\n--\n\n"
                         "End span: the root hands every ended span to the sink, a child waits for it (or goes alone "
                         "once the root has ended); nothing when the trace is not sampled.");

static PyObject *trace_finish(RequestTrace *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *error = Py_None;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "finish() takes 2 positional arguments (%zd given)", nargs);
        return NULL;
    }
    for (Py_ssize_t k = 0; k < nkw; k++) {
        if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, k), "error") != 0 || nkw > 1) {
            PyErr_Format(PyExc_TypeError, "finish() got an unexpected argument %R", PyTuple_GET_ITEM(kwnames, k));
            return NULL;
        }
        error = args[nargs + k];
    }
    if (!self->sampled) Py_RETURN_NONE;
    PyObject *span = args[0];
    if (end_span(span, args[1], error) < 0) return NULL;
    if (span == self->root) {
        /* The list handed on is this trace's: it is not touched again. */
        if (PyList_Append(self->ended, span) < 0 || call_sink(self, self->ended) < 0) return NULL;
        Py_RETURN_NONE;
    }
    int after_root = span_ended(self->root);
    if (after_root < 0) return NULL;
    if (after_root) {
        PyObject *alone = PyList_New(1);
        if (alone == NULL) return NULL;
        PyList_SET_ITEM(alone, 0, Py_NewRef(span));
        int rc = call_sink(self, alone);
        Py_DECREF(alone);
        if (rc < 0) return NULL;
        Py_RETURN_NONE;
    }
    if (PyList_Append(self->ended, span) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *span_id_of(PyObject *span) {
    PyObject *span_id = PyObject_GetAttr(span, s_span_id);
    if (span_id != NULL && expect_bytes(span_id, "span_id") < 0) Py_CLEAR(span_id);
    return span_id;
}

PyDoc_STRVAR(engine_kw_doc, "engine_kw(span)\n--\n\n"
                            "The data pool's keyword for an engine call made within span: {\"trace\": engine_headers}.");

static PyObject *trace_engine_kw(RequestTrace *self, PyObject *span) {
    if (span == self->root) return Py_NewRef(self->root_kw);
    PyObject *span_id = span_id_of(span);
    if (span_id == NULL) return NULL;
    PyObject *kw = child_kw(self, span_id);
    Py_DECREF(span_id);
    return kw;
}

PyDoc_STRVAR(engine_headers_doc, "engine_headers(span)\n--\n\n"
                                 "The header lines an engine request made within span carries.");

static PyObject *trace_engine_headers(RequestTrace *self, PyObject *span) {
    PyObject *kw = trace_engine_kw(self, span);
    if (kw == NULL) return NULL;
    PyObject *lines = PyDict_GetItemWithError(kw, s_trace_key);
    Py_XINCREF(lines);
    Py_DECREF(kw);
    return lines;
}

PyDoc_STRVAR(response_header_doc, "response_header()\n--\n\nThe traceparent the client's response carries.");

static PyObject *trace_response_header(RequestTrace *self, PyObject *Py_UNUSED(ignored)) {
    return Py_NewRef(self->response_traceparent);
}

PyDoc_STRVAR(traceparent_for_doc, "traceparent_for(span)\n--\n\n"
                                  "The traceparent an engine request made within span carries.");

static PyObject *trace_traceparent_for(RequestTrace *self, PyObject *span) {
    if (span == self->root) return Py_NewRef(PyTuple_GET_ITEM(self->response_traceparent, 1));
    PyObject *trace_id = PyObject_GetAttr(span, s_trace_id);
    if (trace_id == NULL) return NULL;
    PyObject *span_id = span_id_of(span);
    if (span_id == NULL || expect_bytes(trace_id, "trace_id") < 0) {
        Py_DECREF(trace_id);
        Py_XDECREF(span_id);
        return NULL;
    }
    Py_ssize_t trace_size = PyBytes_GET_SIZE(trace_id), id_size = PyBytes_GET_SIZE(span_id);
    PyObject *value = PyBytes_FromStringAndSize(NULL, 3 + 2 * trace_size + 1 + 2 * id_size + 3);
    if (value != NULL) {
        char *p = PyBytes_AS_STRING(value);
        memcpy(p, "00-", 3);
        put_hex(p + 3, PyBytes_AS_STRING(trace_id), trace_size);
        p += 3 + 2 * trace_size;
        *p++ = '-';
        put_hex(p, PyBytes_AS_STRING(span_id), id_size);
        memcpy(p + 2 * id_size, self->sampled ? "-01" : "-00", 3);
    }
    Py_DECREF(trace_id);
    Py_DECREF(span_id);
    return value;
}

static PyObject *trace_get_sampled(RequestTrace *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(self->sampled);
}

static PyObject *trace_get_trace_id_hex(RequestTrace *self, void *Py_UNUSED(closure)) {
    return PyObject_CallMethodNoArgs(self->trace_id, s_hex);
}

static PyGetSetDef trace_getset[] = {
    {"sampled", (getter)trace_get_sampled, NULL, "Whether the trace is recorded.", NULL},
    {"trace_id_hex", (getter)trace_get_trace_id_hex, NULL, "The trace id as the log line's trace_id shows it.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef trace_members[] = {
    {"context", T_OBJECT, offsetof(RequestTrace, context), READONLY, "The root span's own context."},
    {"response_traceparent", T_OBJECT, offsetof(RequestTrace, response_traceparent), READONLY,
     "The root's traceparent, as the response's header list takes it."},
    {"root", T_OBJECT, offsetof(RequestTrace, root), READONLY, "The narwhal.request span."},
    {"root_headers", T_OBJECT, offsetof(RequestTrace, root_headers), READONLY,
     "The header lines of an engine call outside a leg."},
    {"root_kw", T_OBJECT, offsetof(RequestTrace, root_kw), READONLY, "The data pool's keyword carrying root_headers."},
    {NULL, 0, 0, 0, NULL},
};

static PyMethodDef trace_methods[] = {
    {"child", (PyCFunction)(void (*)(void))trace_child, METH_FASTCALL | METH_KEYWORDS, child_doc},
    {"open", (PyCFunction)(void (*)(void))trace_open, METH_FASTCALL | METH_KEYWORDS, open_doc},
    {"finish", (PyCFunction)(void (*)(void))trace_finish, METH_FASTCALL | METH_KEYWORDS, finish_doc},
    {"engine_kw", (PyCFunction)trace_engine_kw, METH_O, engine_kw_doc},
    {"engine_headers", (PyCFunction)trace_engine_headers, METH_O, engine_headers_doc},
    {"response_header", (PyCFunction)trace_response_header, METH_NOARGS, response_header_doc},
    {"traceparent_for", (PyCFunction)trace_traceparent_for, METH_O, traceparent_for_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RequestTraceType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "narwhal.tracing._spans_native.RequestTrace",
    .tp_doc = PyDoc_STR("One request's spans (spans.PythonRequestTrace, in C)."),
    .tp_basicsize = sizeof(RequestTrace),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = trace_new,
    .tp_vectorcall = trace_vectorcall,
    .tp_dealloc = (destructor)trace_dealloc,
    .tp_traverse = (traverseproc)trace_traverse,
    .tp_clear = (inquiry)trace_clear,
    .tp_methods = trace_methods,
    .tp_members = trace_members,
    .tp_getset = trace_getset,
};

PyDoc_STRVAR(bind_doc, "bind(span_type)\n--\n\nThe type RequestTrace makes its spans of (spans.Span); whether its "
                       "fields are written at their slots.");

static PyObject *bind(PyObject *Py_UNUSED(module), PyObject *type) {
    if (!PyType_Check(type)) {
        PyErr_SetString(PyExc_TypeError, "bind takes the span type");
        return NULL;
    }
    Py_XSETREF(span_type, Py_NewRef(type));
    ended_at = slot_offset(type, s_ended);
    end_ns_at = slot_offset(type, s_end_ns);
    status_code_at = slot_offset(type, s_status_code);
    status_message_at = slot_offset(type, s_status_message);
    /* A span type the collector tracks could need tracking after a write: it keeps setattr. */
    span_slots = ended_at >= 0 && end_ns_at >= 0 && status_code_at >= 0 && status_message_at >= 0
                 && !PyType_HasFeature((PyTypeObject *)type, Py_TPFLAGS_HAVE_GC);
    return PyBool_FromLong(span_slots);
}

static PyMethodDef methods[] = {
    {"bind", (PyCFunction)bind, METH_O, bind_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "narwhal.tracing._spans_native",
    "RequestTrace in C (see narwhal/tracing/spans.py).", -1, methods, NULL, NULL, NULL, NULL,
};

#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC PyInit__spans_native(void) {
    INTERN(s_trace_id, "trace_id");
    INTERN(s_span_id, "span_id");
    INTERN(s_sampled, "sampled");
    INTERN(s_tracestate, "tracestate");
    INTERN(s_ended, "ended");
    INTERN(s_end_ns, "end_ns");
    INTERN(s_status_code, "status_code");
    INTERN(s_status_message, "status_message");
    INTERN(s_end, "end");
    INTERN(s_span_ids, "span_ids");
    INTERN(s_request_name, "narwhal.request");
    INTERN(s_trace_key, "trace");
    INTERN(s_hex, "hex");
    if ((s_shared_kwnames = Py_BuildValue("(s)", "shared")) == NULL) return NULL;
    if ((b_traceparent = PyBytes_FromString("traceparent")) == NULL) return NULL;
    if ((empty_bytes = PyBytes_FromStringAndSize(NULL, 0)) == NULL) return NULL;
    if ((one = PyLong_FromLong(1)) == NULL || (two = PyLong_FromLong(2)) == NULL || (three = PyLong_FromLong(3)) == NULL)
        return NULL;
    if (PyType_Ready(&RequestTraceType) < 0) return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    if (PyModule_AddObjectRef(module, "RequestTrace", (PyObject *)&RequestTraceType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
