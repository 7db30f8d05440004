/* Shared by the compiled modules that read and write Python objects' fields at their slots' offsets (a __slots__
   entry or a msgspec struct's field), where a getattr by name costs several times more. */
#ifndef NARWHAL_SLOT_OFFSET_H
#define NARWHAL_SLOT_OFFSET_H

#include <Python.h>
#include <structmember.h>

/* The offset of type's plain, writable object slot called name, or -1 (no such slot; no exception left set). */
static Py_ssize_t slot_offset(PyObject *type, PyObject *name) {
    PyObject *descr = PyObject_GetAttr(type, name);
    if (descr == NULL) {
        PyErr_Clear();
        return -1;
    }
    Py_ssize_t offset = -1;
    if (Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        if (member->type == T_OBJECT_EX && !(member->flags & READONLY)) offset = member->offset;
    }
    Py_DECREF(descr);
    return offset;
}

#endif
