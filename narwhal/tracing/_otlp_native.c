/* narwhal.tracing._otlp_native: the span encoder of narwhal/tracing/otlp.py (encode_request), in C.

   The same bytes as the Python encoder, made in one buffer: a traced request's spans cost about a fifth of the
   instructions the Python encoder spends on them. Optional: when this module is absent (a build without a C
   compiler) or NARWHAL_NO_EXTENSIONS is set, otlp.py's own encoder runs. The tests hold the two to the same
   bytes. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    char *data;
    Py_ssize_t size;
    Py_ssize_t cap;
} Buf;

static int buf_grow(Buf *b, Py_ssize_t extra) {
    Py_ssize_t cap = b->cap ? b->cap : 1024;
    while (cap - b->size < extra) {
        if (cap > PY_SSIZE_T_MAX / 2) {
            PyErr_NoMemory();
            return -1;
        }
        cap *= 2;
    }
    char *data = PyMem_Realloc(b->data, (size_t)cap);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = data;
    b->cap = cap;
    return 0;
}

static inline int buf_reserve(Buf *b, Py_ssize_t extra) {
    return b->cap - b->size >= extra ? 0 : buf_grow(b, extra);
}

static inline int buf_put(Buf *b, const char *src, Py_ssize_t n) {
    if (buf_reserve(b, n) < 0) return -1;
    memcpy(b->data + b->size, src, (size_t)n);
    b->size += n;
    return 0;
}

static inline int buf_byte(Buf *b, unsigned char c) {
    if (buf_reserve(b, 1) < 0) return -1;
    b->data[b->size++] = (char)c;
    return 0;
}

static inline int varint_size(uint64_t v) {
    int n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static inline void put_varint(char *p, uint64_t v) {
    while (v >= 0x80) {
        *p++ = (char)((v & 0x7F) | 0x80);
        v >>= 7;
    }
    *p = (char)v;
}

static inline int buf_varint(Buf *b, uint64_t v) {
    int n = varint_size(v);
    if (buf_reserve(b, n) < 0) return -1;
    put_varint(b->data + b->size, v);
    b->size += n;
    return 0;
}

static inline int buf_fixed64(Buf *b, uint64_t v) {
    if (buf_reserve(b, 8) < 0) return -1;
    char *p = b->data + b->size;
    for (int i = 0; i < 8; i++) p[i] = (char)(v >> (8 * i));
    b->size += 8;
    return 0;
}

/* A length-delimited field whose length is not known before its content: the tag and one byte for the length,
   then the content; ``close_field`` writes the length, moving the content when it needs more than one byte. */
static inline Py_ssize_t open_field(Buf *b, unsigned char tag) {
    if (buf_reserve(b, 2) < 0) return -1;
    b->data[b->size] = (char)tag;
    b->size += 2;
    return b->size;
}

static int close_field(Buf *b, Py_ssize_t start) {
    uint64_t n = (uint64_t)(b->size - start);
    int width = varint_size(n);
    if (width > 1) {
        if (buf_reserve(b, width - 1) < 0) return -1;
        memmove(b->data + start + width - 1, b->data + start, (size_t)n);
        b->size += width - 1;
    }
    put_varint(b->data + start - 1, n);
    return 0;
}

/* A str's UTF-8 bytes, a lone surrogate replaced by '?' (as str.encode("utf-8", "replace")); ``owned`` holds a
   new reference when the bytes had to be made. */
static int utf8_of(PyObject *text, const char **data, Py_ssize_t *size, PyObject **owned) {
    *owned = NULL;
    *data = PyUnicode_AsUTF8AndSize(text, size);
    if (*data != NULL) return 0;
    if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) return -1;
    PyErr_Clear();
    *owned = PyUnicode_AsEncodedString(text, "utf-8", "replace");
    if (*owned == NULL) return -1;
    *data = PyBytes_AS_STRING(*owned);
    *size = PyBytes_GET_SIZE(*owned);
    return 0;
}

/* A text field: tag, length, UTF-8. */
static int put_text(Buf *b, unsigned char tag, PyObject *text) {
    if (!PyUnicode_Check(text)) {
        PyErr_Format(PyExc_TypeError, "expected str, got %.200s", Py_TYPE(text)->tp_name);
        return -1;
    }
    const char *data;
    Py_ssize_t size;
    PyObject *owned;
    if (utf8_of(text, &data, &size, &owned) < 0) return -1;
    int rc = buf_byte(b, tag);
    if (rc == 0) rc = buf_varint(b, (uint64_t)size);
    if (rc == 0) rc = buf_put(b, data, size);
    Py_XDECREF(owned);
    return rc;
}

/* One ``KeyValue`` (key = 1, value = 2: an ``AnyValue``) under ``tag``: an exact str as string_value, a bool as
   bool_value, an int within int64 as int_value, a float as double_value, anything else as its str(). */
static int put_key_value(Buf *b, unsigned char tag, PyObject *key, PyObject *value) {
    Py_ssize_t outer = open_field(b, tag);
    if (outer < 0) return -1;
    if (put_text(b, 0x0A, key) < 0) return -1;
    if (PyUnicode_CheckExact(value)) {
        Py_ssize_t any = open_field(b, 0x12);
        if (any < 0 || put_text(b, 0x0A, value) < 0 || close_field(b, any) < 0) return -1;
    } else if (value == Py_True || value == Py_False) {
        const char body[4] = {0x12, 0x02, 0x10, value == Py_True ? 0x01 : 0x00};
        if (buf_put(b, body, 4) < 0) return -1;
    } else {
        int overflow = 0;
        long long number = 0;
        int is_int = PyLong_Check(value);
        if (is_int) {
            number = PyLong_AsLongLongAndOverflow(value, &overflow);
            if (number == -1 && PyErr_Occurred()) return -1;
        }
        if (is_int && !overflow) {
            uint64_t wire = (uint64_t)number;  /* two's complement, as int_value's varint takes a negative */
            if (buf_byte(b, 0x12) < 0 || buf_varint(b, 1 + (uint64_t)varint_size(wire)) < 0 || buf_byte(b, 0x18) < 0
                || buf_varint(b, wire) < 0)
                return -1;
        } else if (!is_int && PyFloat_Check(value)) {
            double real = PyFloat_AsDouble(value);
            if (real == -1.0 && PyErr_Occurred()) return -1;
            if (buf_reserve(b, 11) < 0) return -1;
            char *p = b->data + b->size;
            p[0] = 0x12;
            p[1] = 0x09;
            p[2] = 0x21;
            if (PyFloat_Pack8(real, p + 3, 1) < 0) return -1;
            b->size += 11;
        } else {
            /* A str subclass, an int past int64 (its digits rather than wrapped), anything else. */
            PyObject *text = PyObject_Str(value);
            if (text == NULL) return -1;
            Py_ssize_t any = open_field(b, 0x12);
            int rc = any < 0 || put_text(b, 0x0A, text) < 0 || close_field(b, any) < 0 ? -1 : 0;
            Py_DECREF(text);
            if (rc < 0) return -1;
        }
    }
    return close_field(b, outer);
}

static int put_attributes(Buf *b, unsigned char tag, PyObject *attributes) {
    if (PyDict_Check(attributes)) {
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(attributes, &pos, &key, &value)) {
            /* Borrowed: nothing below runs code that could change the dict but a value's __str__. */
            Py_INCREF(key);
            Py_INCREF(value);
            int rc = put_key_value(b, tag, key, value);
            Py_DECREF(key);
            Py_DECREF(value);
            if (rc < 0) return -1;
        }
        return 0;
    }
    PyObject *items = PyMapping_Items(attributes);
    if (items == NULL) return -1;
    Py_ssize_t count = PyList_GET_SIZE(items);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyList_GET_ITEM(items, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            Py_DECREF(items);
            PyErr_SetString(PyExc_TypeError, "attributes must be a mapping");
            return -1;
        }
        if (put_key_value(b, tag, PyTuple_GET_ITEM(item, 0), PyTuple_GET_ITEM(item, 1)) < 0) {
            Py_DECREF(items);
            return -1;
        }
    }
    Py_DECREF(items);
    return 0;
}

static PyObject *s_trace_id, *s_span_id, *s_parent_span_id, *s_name, *s_kind, *s_start_ns, *s_end_ns, *s_attributes,
    *s_shared, *s_events, *s_status_code, *s_status_message, *s_encoded, *s_time_ns;

/* Where a type's fields are (``bind``): Span, SpanEvent and SharedAttributes keep each field in a slot of the
   object (msgspec's structs and __slots__ alike), so an object of exactly that type is read at the slot's offset
   instead of through getattr (about 150 instructions a field). Any other object, or a slot left empty, takes
   getattr, which also raises the AttributeError of an unset field. */
#define MAX_FIELDS 13
typedef struct {
    PyTypeObject *type;
    int count;
    PyObject **names[MAX_FIELDS];
    Py_ssize_t offsets[MAX_FIELDS];
} Layout;

static Layout span_layout, event_layout, shared_layout;

enum { SPAN_TRACE_ID, SPAN_SPAN_ID, SPAN_PARENT, SPAN_NAME, SPAN_KIND, SPAN_START, SPAN_END, SPAN_ATTRIBUTES,
       SPAN_SHARED, SPAN_EVENTS, SPAN_STATUS_CODE, SPAN_STATUS_MESSAGE };
enum { EVENT_NAME, EVENT_TIME, EVENT_ATTRIBUTES };
enum { SHARED_ATTRIBUTES, SHARED_ENCODED };

/* A new reference to field ``i`` of ``obj``, or NULL with an exception set. */
static inline PyObject *field(PyObject *obj, const Layout *layout, int i) {
    if (Py_TYPE(obj) == layout->type) {
        PyObject *value = *(PyObject **)((char *)obj + layout->offsets[i]);
        if (value != NULL) {
            Py_INCREF(value);
            return value;
        }
    }
    return PyObject_GetAttr(obj, *layout->names[i]);
}

/* Learn ``type``'s slot offsets for ``names``; a type whose fields are not all plain object slots keeps getattr. */
static int bind_layout(Layout *layout, PyObject *type, PyObject **const *names, int count) {
    if (!PyType_Check(type)) {
        PyErr_SetString(PyExc_TypeError, "bind takes the span, event and shared-attribute types");
        return -1;
    }
    PyTypeObject *bound = (PyTypeObject *)type;
    layout->count = count;
    for (int i = 0; i < count; i++) {
        layout->names[i] = names[i];
        PyObject *descr = PyObject_GetAttr(type, *names[i]);
        if (descr == NULL) return -1;
        int plain = Py_IS_TYPE(descr, &PyMemberDescr_Type)
                    && ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX;
        if (plain) layout->offsets[i] = ((PyMemberDescrObject *)descr)->d_member->offset;
        Py_DECREF(descr);
        if (!plain) bound = NULL;
    }
    Py_XINCREF(bound);
    Py_XSETREF(layout->type, bound);
    return 0;
}

/* An id of ``width`` bytes, cut or padded with zeros as struct's "16s" and "8s" do. */
static int put_id(Buf *b, PyObject *id, Py_ssize_t width) {
    if (!PyBytes_Check(id)) {
        PyErr_Format(PyExc_TypeError, "a span's ids must be bytes, got %.200s", Py_TYPE(id)->tp_name);
        return -1;
    }
    if (buf_reserve(b, width) < 0) return -1;
    Py_ssize_t size = PyBytes_GET_SIZE(id);
    if (size > width) size = width;
    memcpy(b->data + b->size, PyBytes_AS_STRING(id), (size_t)size);
    memset(b->data + b->size + size, 0, (size_t)(width - size));
    b->size += width;
    return 0;
}

/* A field holding an unsigned int (a time, a kind): as a fixed64 or a varint. */
static int put_uint_field(Buf *b, PyObject *obj, const Layout *layout, int i, int fixed) {
    PyObject *value = field(obj, layout, i);
    if (value == NULL) return -1;
    int overflow = 0;
    /* PyLong_AsUnsignedLongLong goes through a byte array on 3.11; a time in nanoseconds is below 2**63. */
    long long signed_number = PyLong_AsLongLongAndOverflow(value, &overflow);
    uint64_t number = (uint64_t)signed_number;
    if (overflow > 0) {
        number = PyLong_AsUnsignedLongLong(value);
    } else if (signed_number < 0 && !PyErr_Occurred()) {
        PyErr_SetString(PyExc_OverflowError, "a span's times and kind must not be negative");
    }
    Py_DECREF(value);
    if (PyErr_Occurred()) return -1;
    return fixed ? buf_fixed64(b, number) : buf_varint(b, number);
}

/* A shared attribute set's bytes: kept on it (``encoded``) by the first span that carries it. */
static int put_shared(Buf *b, PyObject *shared) {
    PyObject *encoded = field(shared, &shared_layout, SHARED_ENCODED);
    if (encoded == NULL) return -1;
    if (encoded == Py_None) {
        Py_DECREF(encoded);
        PyObject *attributes = field(shared, &shared_layout, SHARED_ATTRIBUTES);
        if (attributes == NULL) return -1;
        Buf own = {NULL, 0, 0};
        int rc = put_attributes(&own, 0x4A, attributes);
        Py_DECREF(attributes);
        if (rc < 0) {
            PyMem_Free(own.data);
            return -1;
        }
        encoded = PyBytes_FromStringAndSize(own.data ? own.data : "", own.size);
        PyMem_Free(own.data);
        if (encoded == NULL || PyObject_SetAttr(shared, s_encoded, encoded) < 0) {
            Py_XDECREF(encoded);
            return -1;
        }
    }
    if (!PyBytes_Check(encoded)) {
        Py_DECREF(encoded);
        PyErr_SetString(PyExc_TypeError, "SharedAttributes.encoded must be bytes or None");
        return -1;
    }
    int rc = buf_put(b, PyBytes_AS_STRING(encoded), PyBytes_GET_SIZE(encoded));
    Py_DECREF(encoded);
    return rc;
}

static int put_event(Buf *b, PyObject *event) {
    Py_ssize_t start = open_field(b, 0x5A);  /* Span.events = 11 */
    if (start < 0 || buf_byte(b, 0x09) < 0 || put_uint_field(b, event, &event_layout, EVENT_TIME, 1) < 0) return -1;
    PyObject *name = field(event, &event_layout, EVENT_NAME);
    if (name == NULL) return -1;
    int rc = put_text(b, 0x12, name);
    Py_DECREF(name);
    if (rc < 0) return -1;
    PyObject *attributes = field(event, &event_layout, EVENT_ATTRIBUTES);
    if (attributes == NULL) return -1;
    rc = PyObject_IsTrue(attributes);
    if (rc > 0) rc = put_attributes(b, 0x1A, attributes);
    Py_DECREF(attributes);
    return rc < 0 ? -1 : close_field(b, start);
}

static int put_span(Buf *b, PyObject *span) {
    PyObject *value;
    int rc;
    /* ScopeSpans.spans = 2; inside: trace_id = 1, span_id = 2, parent_span_id = 4, kind = 6, start and end (fixed64
       7 and 8), name = 5, attributes = 9, events = 11, status = 15, in the order the Python encoder writes them. */
    Py_ssize_t start = open_field(b, 0x12);
    if (start < 0 || buf_byte(b, 0x0A) < 0 || buf_byte(b, 16) < 0) return -1;
    if ((value = field(span, &span_layout, SPAN_TRACE_ID)) == NULL) return -1;
    rc = put_id(b, value, 16);
    Py_DECREF(value);
    if (rc < 0 || buf_byte(b, 0x12) < 0 || buf_byte(b, 8) < 0) return -1;
    if ((value = field(span, &span_layout, SPAN_SPAN_ID)) == NULL) return -1;
    rc = put_id(b, value, 8);
    Py_DECREF(value);
    if (rc < 0) return -1;
    if ((value = field(span, &span_layout, SPAN_PARENT)) == NULL) return -1;
    rc = value == Py_None ? 0 : (buf_byte(b, 0x22) < 0 || buf_byte(b, 8) < 0 ? -1 : put_id(b, value, 8));
    Py_DECREF(value);
    if (rc < 0) return -1;
    if (buf_byte(b, 0x30) < 0 || put_uint_field(b, span, &span_layout, SPAN_KIND, 0) < 0) return -1;
    if (buf_byte(b, 0x39) < 0 || put_uint_field(b, span, &span_layout, SPAN_START, 1) < 0) return -1;
    if (buf_byte(b, 0x41) < 0 || put_uint_field(b, span, &span_layout, SPAN_END, 1) < 0) return -1;

    if ((value = field(span, &span_layout, SPAN_NAME)) == NULL) return -1;
    rc = put_text(b, 0x2A, value);
    Py_DECREF(value);
    if (rc < 0) return -1;
    if ((value = field(span, &span_layout, SPAN_SHARED)) == NULL) return -1;
    rc = value == Py_None ? 0 : put_shared(b, value);
    Py_DECREF(value);
    if (rc < 0) return -1;
    if ((value = field(span, &span_layout, SPAN_ATTRIBUTES)) == NULL) return -1;
    rc = put_attributes(b, 0x4A, value);
    Py_DECREF(value);
    if (rc < 0) return -1;

    if ((value = field(span, &span_layout, SPAN_EVENTS)) == NULL) return -1;
    rc = PyObject_IsTrue(value);
    if (rc > 0) {
        PyObject *events = PySequence_Fast(value, "a span's events must be a sequence");
        if (events == NULL) {
            rc = -1;
        } else {
            Py_ssize_t count = PySequence_Fast_GET_SIZE(events);
            rc = 0;
            for (Py_ssize_t i = 0; i < count && rc == 0; i++) rc = put_event(b, PySequence_Fast_GET_ITEM(events, i));
            Py_DECREF(events);
        }
    }
    Py_DECREF(value);
    if (rc < 0) return -1;

    if ((value = field(span, &span_layout, SPAN_STATUS_CODE)) == NULL) return -1;
    long long code = PyLong_AsLongLong(value);
    Py_DECREF(value);
    if (code == -1 && PyErr_Occurred()) return -1;
    if (code) {
        Py_ssize_t status = open_field(b, 0x7A);
        if (status < 0) return -1;
        if ((value = field(span, &span_layout, SPAN_STATUS_MESSAGE)) == NULL) return -1;
        rc = PyObject_IsTrue(value);
        if (rc > 0) rc = put_text(b, 0x12, value);
        Py_DECREF(value);
        if (rc < 0 || buf_byte(b, 0x18) < 0 || buf_varint(b, (uint64_t)code) < 0 || close_field(b, status) < 0)
            return -1;
    }
    return close_field(b, start);
}

PyDoc_STRVAR(encode_request_doc,
             "encode_request(spans)\n--\n\n"
             "Spans as the bytes of their ScopeSpans.spans fields, one after another (as otlp.encode_request).");

/* The buffer every call writes into (the GIL makes it this call's): no allocation but the result. A call that
   needed more than KEEP_BYTES gives the excess back. */
static Buf scratch = {NULL, 0, 0};
#define KEEP_BYTES (1 << 16)

static PyObject *encode_request(PyObject *Py_UNUSED(module), PyObject *spans) {
    PyObject *items = PySequence_Fast(spans, "spans must be a sequence");
    if (items == NULL) return NULL;
    /* A value's __str__ may run Python code that encodes too (or lets another thread in): that call gets a buffer
       of its own. */
    static int busy = 0;
    Buf own = {NULL, 0, 0};
    Buf *b = busy ? &own : &scratch;
    int outer = !busy;
    busy = 1;
    b->size = 0;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(items);
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (put_span(b, PySequence_Fast_GET_ITEM(items, i)) < 0) goto done;
    }
    result = PyBytes_FromStringAndSize(b->data ? b->data : "", b->size);
done:
    Py_DECREF(items);
    if (outer) busy = 0;
    if (b->cap > KEEP_BYTES || b == &own) {
        PyMem_Free(b->data);
        b->data = NULL;
        b->cap = 0;
    }
    b->size = 0;
    return result;
}

PyDoc_STRVAR(bind_doc,
             "bind(span_type, event_type, shared_type)\n--\n\n"
             "Learn where Span, SpanEvent and SharedAttributes keep their fields (read without getattr).");

static PyObject *bind(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "bind takes the span, event and shared-attribute types");
        return NULL;
    }
    static PyObject **const span_names[] = {&s_trace_id, &s_span_id, &s_parent_span_id, &s_name, &s_kind, &s_start_ns,
                                            &s_end_ns, &s_attributes, &s_shared, &s_events, &s_status_code,
                                            &s_status_message};
    static PyObject **const event_names[] = {&s_name, &s_time_ns, &s_attributes};
    static PyObject **const shared_names[] = {&s_attributes, &s_encoded};
    if (bind_layout(&span_layout, args[0], span_names, 12) < 0 || bind_layout(&event_layout, args[1], event_names, 3) < 0
        || bind_layout(&shared_layout, args[2], shared_names, 2) < 0)
        return NULL;
    return PyBool_FromLong(span_layout.type != NULL && event_layout.type != NULL && shared_layout.type != NULL);
}

static PyMethodDef methods[] = {
    {"encode_request", (PyCFunction)encode_request, METH_O, encode_request_doc},
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL, bind_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "narwhal.tracing._otlp_native",
    "The OTLP span encoder in C (see narwhal/tracing/otlp.py).", -1, methods,
};

#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC PyInit__otlp_native(void) {
    INTERN(s_trace_id, "trace_id");
    INTERN(s_span_id, "span_id");
    INTERN(s_parent_span_id, "parent_span_id");
    INTERN(s_name, "name");
    INTERN(s_kind, "kind");
    INTERN(s_start_ns, "start_ns");
    INTERN(s_end_ns, "end_ns");
    INTERN(s_attributes, "attributes");
    INTERN(s_shared, "shared");
    INTERN(s_events, "events");
    INTERN(s_status_code, "status_code");
    INTERN(s_status_message, "status_message");
    INTERN(s_encoded, "encoded");
    INTERN(s_time_ns, "time_ns");
    return PyModule_Create(&module_def);
}
