/* redisq._speedups: the read hot path of redisq.records in C.
 *
 * decode_entries() builds the Messages of stream entries written in the layouts of
 * lua/includes/append.lua that carry no headers and no timestamp (the common case), exactly as
 * redisq.records.decode_entries_py does; every other entry (headers, a timestamp, other
 * clients' layouts, anything that breaks a rule, anything unforeseen) is handed to that Python
 * function, one entry at a time, so the two can never disagree on what is malformed.
 *
 * Optional: when this module cannot be built, redisq runs the Python decoder alone. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#define N_FIELDS 11
enum { F_TOPIC, F_PARTITION, F_OFFSET, F_KEY, F_VALUE, F_HEADERS, F_TIMESTAMP, F_PRODUCER,
       F_SEQUENCE, F_MESSAGE_ID, F_ATTEMPT };

static PyTypeObject *message_type = NULL;
static Py_ssize_t slot_offset[N_FIELDS];
static PyObject *slow_decode = NULL; /* redisq.records.decode_entries_py */

#define MAX_ID_FIELD 9223372036854775807ULL

/* set_layout(message_type, names, slow): the Message class, its slot names in the order of
 * the enum above, and the Python decoder for the entries this module does not take. */
static PyObject *set_layout(PyObject *self, PyObject *args) {
    PyObject *type, *names, *slow;
    if (!PyArg_ParseTuple(args, "O!O!O:set_layout", &PyType_Type, &type, &PyTuple_Type, &names,
                          &slow))
        return NULL;
    if (PyTuple_GET_SIZE(names) != N_FIELDS) {
        PyErr_SetString(PyExc_ValueError, "set_layout: wrong number of slot names");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < N_FIELDS; i++) {
        PyObject *descr = PyDict_GetItemWithError(((PyTypeObject *)type)->tp_dict,
                                                  PyTuple_GET_ITEM(names, i));
        if (descr == NULL || Py_TYPE(descr) != &PyMemberDescr_Type) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_TypeError, "set_layout: %R is not a slot", PyTuple_GET_ITEM(names, i));
            return NULL;
        }
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        if (member->type != T_OBJECT_EX || (member->flags & READONLY)) {
            PyErr_Format(PyExc_TypeError, "set_layout: %R is not an object slot", PyTuple_GET_ITEM(names, i));
            return NULL;
        }
        slot_offset[i] = member->offset;
    }
    Py_INCREF(type);
    Py_XSETREF(message_type, (PyTypeObject *)type);
    Py_INCREF(slow);
    Py_XSETREF(slow_decode, slow);
    Py_RETURN_NONE;
}

/* ASCII decimal digits only, at least one and at most `most`; the value, or -1 when the rule
 * is broken or the number is above `limit`. */
static int parse_digits(const char *s, Py_ssize_t n, Py_ssize_t most, unsigned long long limit,
                        unsigned long long *out) {
    if (n == 0 || n > most)
        return -1;
    unsigned long long v = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c < '0' || c > '9')
            return -1;
        unsigned long long d = c - '0';
        if (v > (ULLONG_MAX - d) / 10)
            return -1;
        v = v * 10 + d;
    }
    if (v > limit)
        return -1;
    *out = v;
    return 0;
}

static int is_name(PyObject *o, char name) {
    return PyBytes_CheckExact(o) && PyBytes_GET_SIZE(o) == 1 && PyBytes_AS_STRING(o)[0] == name;
}

/* An id field (producer id or sequence) by parse_id_field's rule; NULL without an exception
 * when it is broken (the entry then goes to the Python decoder). */
static PyObject *id_field(PyObject *raw) {
    unsigned long long v;
    if (!PyBytes_CheckExact(raw) ||
        parse_digits(PyBytes_AS_STRING(raw), PyBytes_GET_SIZE(raw), 19, MAX_ID_FIELD, &v) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(v);
}

#define SET(obj, field, value) \
    (*(PyObject **)((char *)(obj) + slot_offset[field]) = (value))

/* One entry as a Message (a new reference), or NULL: with an exception set when something
 * failed, without one when the entry is for the Python decoder. The caches hold the last
 * millisecond and producer id seen (entries of one read mostly share them). */
typedef struct {
    unsigned long long ms;
    PyObject *ms_obj;  /* owned */
    PyObject *pid_raw; /* owned */
    PyObject *pid_obj; /* owned */
} caches;

static PyObject *decode_one(PyObject *topic, PyObject *partition, PyObject *entry,
                            PyObject *attempt, caches *c) {
    if (!PyTuple_CheckExact(entry) && !PyList_CheckExact(entry))
        return NULL;
    if (PySequence_Fast_GET_SIZE(entry) != 2)
        return NULL;
    PyObject *entry_id = PySequence_Fast_GET_ITEM(entry, 0);
    PyObject *flat = PySequence_Fast_GET_ITEM(entry, 1);
    if (!PyBytes_CheckExact(entry_id) || !PyList_CheckExact(flat))
        return NULL;
    const char *id = PyBytes_AS_STRING(entry_id);
    Py_ssize_t id_len = PyBytes_GET_SIZE(entry_id);
    Py_ssize_t dash = 0;
    while (dash < id_len && id[dash] != '-')
        dash++;
    unsigned long long ms;
    if (dash == id_len || parse_digits(id, dash, 20, ULLONG_MAX, &ms) < 0)
        return NULL;
    for (Py_ssize_t i = dash + 1; i < id_len; i++)
        if ((unsigned char)id[i] >= 0x80)
            return NULL;

    PyObject **f = PySequence_Fast_ITEMS(flat);
    PyObject *key = Py_None, *value, *producer_raw, *sequence_raw = NULL, *message_id = Py_None;
    switch (PyList_GET_SIZE(flat)) {
    case 8:
        if (!is_name(f[0], 'k') || !is_name(f[2], 'v'))
            return NULL;
        key = f[1];
        value = f[3];
        if (is_name(f[4], 'p') && is_name(f[6], 's')) {
            producer_raw = f[5];
            sequence_raw = f[7];
        } else if (is_name(f[4], 'm') && is_name(f[6], 'p')) {
            message_id = f[5];
            producer_raw = f[7];
        } else
            return NULL;
        break;
    case 6:
        if (is_name(f[0], 'k') && is_name(f[2], 'v') && is_name(f[4], 'p')) {
            key = f[1];
            value = f[3];
            producer_raw = f[5];
        } else if (is_name(f[0], 'v') && is_name(f[2], 'p') && is_name(f[4], 's')) {
            value = f[1];
            producer_raw = f[3];
            sequence_raw = f[5];
        } else
            return NULL;
        break;
    case 4:
        if (!is_name(f[0], 'k') || !is_name(f[2], 'v'))
            return NULL;
        key = f[1];
        value = f[3];
        producer_raw = NULL;
        break;
    default:
        return NULL;
    }

    PyObject *producer_id = Py_None, *sequence = Py_None;
    if (producer_raw != NULL) {
        if (c->pid_raw != NULL && (c->pid_raw == producer_raw ||
                                   (PyBytes_CheckExact(producer_raw) &&
                                    PyBytes_GET_SIZE(producer_raw) == PyBytes_GET_SIZE(c->pid_raw) &&
                                    memcmp(PyBytes_AS_STRING(producer_raw), PyBytes_AS_STRING(c->pid_raw),
                                           PyBytes_GET_SIZE(producer_raw)) == 0))) {
            producer_id = c->pid_obj;
        } else {
            PyObject *parsed = id_field(producer_raw);
            if (parsed == NULL)
                return NULL;
            Py_INCREF(producer_raw);
            Py_XSETREF(c->pid_raw, producer_raw);
            Py_XSETREF(c->pid_obj, parsed);
            producer_id = parsed;
        }
    }
    if (sequence_raw != NULL) {
        sequence = id_field(sequence_raw);
        if (sequence == NULL)
            return NULL;
    } else
        Py_INCREF(sequence);
    if (c->ms_obj == NULL || c->ms != ms) {
        PyObject *m = PyLong_FromUnsignedLongLong(ms);
        if (m == NULL)
            goto fail_sequence;
        Py_XSETREF(c->ms_obj, m);
        c->ms = ms;
    }
    PyObject *offset = PyUnicode_DecodeASCII(id, id_len, NULL);
    if (offset == NULL)
        goto fail_sequence;
    PyObject *headers = PyDict_New();
    if (headers == NULL)
        goto fail_offset;
    PyObject *m = message_type->tp_alloc(message_type, 0);
    if (m == NULL)
        goto fail_headers;
    Py_INCREF(topic);
    SET(m, F_TOPIC, topic);
    Py_INCREF(partition);
    SET(m, F_PARTITION, partition);
    SET(m, F_OFFSET, offset);
    Py_INCREF(key);
    SET(m, F_KEY, key);
    Py_INCREF(value);
    SET(m, F_VALUE, value);
    SET(m, F_HEADERS, headers);
    Py_INCREF(c->ms_obj);
    SET(m, F_TIMESTAMP, c->ms_obj);
    Py_INCREF(producer_id);
    SET(m, F_PRODUCER, producer_id);
    SET(m, F_SEQUENCE, sequence);
    Py_INCREF(message_id);
    SET(m, F_MESSAGE_ID, message_id);
    Py_INCREF(attempt);
    SET(m, F_ATTEMPT, attempt);
    return m;
fail_headers:
    Py_DECREF(headers);
fail_offset:
    Py_DECREF(offset);
fail_sequence:
    Py_DECREF(sequence);
    return NULL;
}

/* decode_entries(topic, partition, entries, deliveries=None) -> list[Message] */
static PyObject *decode_entries(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"topic", "partition", "entries", "deliveries", NULL};
    PyObject *topic, *partition, *given, *deliveries = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|O:decode_entries", keywords, &topic,
                                     &partition, &given, &deliveries))
        return NULL;
    if (message_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "decode_entries: set_layout() was not called");
        return NULL;
    }
    PyObject *entries = PySequence_Fast(given, "decode_entries: entries must be a sequence");
    if (entries == NULL)
        return NULL;
    PyObject *seen = NULL;
    if (deliveries != Py_None) {
        seen = PySequence_Fast(deliveries, "decode_entries: deliveries must be a sequence");
        if (seen == NULL) {
            Py_DECREF(entries);
            return NULL;
        }
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(entries);
    PyObject *result = PyList_New(0);
    PyObject *one = PyLong_FromLong(1);
    caches c = {0, NULL, NULL, NULL};
    if (result == NULL || one == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *entry = PySequence_Fast_GET_ITEM(entries, i);
        PyObject *attempt = one;
        int fast = 1;
        if (seen != NULL) {
            if (i >= PySequence_Fast_GET_SIZE(seen))
                fast = 0;
            else {
                attempt = PySequence_Fast_GET_ITEM(seen, i);
                if (!PyLong_CheckExact(attempt))
                    fast = 0;
                else {
                    int overflow;
                    long v = PyLong_AsLongAndOverflow(attempt, &overflow);
                    if (overflow || v < 1)
                        fast = 0; /* max(1, int(...)): the Python decoder says */
                }
            }
        }
        PyObject *m = fast ? decode_one(topic, partition, entry, attempt, &c) : NULL;
        if (m == NULL) {
            if (PyErr_Occurred())
                goto fail;
            PyObject *delivery = seen == NULL ? Py_None : NULL;
            if (seen != NULL) {
                delivery = PyList_New(1);
                if (delivery == NULL)
                    goto fail;
                PyObject *d = i < PySequence_Fast_GET_SIZE(seen) ? PySequence_Fast_GET_ITEM(seen, i) : Py_None;
                Py_INCREF(d);
                PyList_SET_ITEM(delivery, 0, d);
            } else
                Py_INCREF(delivery);
            PyObject *single = PyList_New(1);
            if (single == NULL) {
                Py_DECREF(delivery);
                goto fail;
            }
            Py_INCREF(entry);
            PyList_SET_ITEM(single, 0, entry);
            PyObject *decoded = PyObject_CallFunctionObjArgs(slow_decode, topic, partition, single,
                                                             delivery, NULL);
            Py_DECREF(single);
            Py_DECREF(delivery);
            if (decoded == NULL)
                goto fail;
            int bad = PyList_SetSlice(result, PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, decoded);
            Py_DECREF(decoded);
            if (bad < 0)
                goto fail;
            continue;
        }
        int bad = PyList_Append(result, m);
        Py_DECREF(m);
        if (bad < 0)
            goto fail;
    }
    Py_DECREF(entries);
    Py_XDECREF(seen);
    Py_XDECREF(one);
    Py_XDECREF(c.ms_obj);
    Py_XDECREF(c.pid_raw);
    Py_XDECREF(c.pid_obj);
    return result;
fail:
    Py_DECREF(entries);
    Py_XDECREF(seen);
    Py_XDECREF(one);
    Py_XDECREF(result);
    Py_XDECREF(c.ms_obj);
    Py_XDECREF(c.pid_raw);
    Py_XDECREF(c.pid_obj);
    return NULL;
}

static PyMethodDef methods[] = {
    {"set_layout", set_layout, METH_VARARGS, "set_layout(message_type, slot_names, slow_decode)"},
    {"decode_entries", (PyCFunction)(void (*)(void))decode_entries, METH_VARARGS | METH_KEYWORDS,
     "decode_entries(topic, partition, entries, deliveries=None) -> list of Messages"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "redisq._speedups", "The read hot path of redisq.records in C.", -1,
    methods,
};

#ifndef REDISQ_SOURCE_SHA256
#define REDISQ_SOURCE_SHA256 "" /* compiled by hand: redisq.native does not use it */
#endif

PyMODINIT_FUNC PyInit__speedups(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "SOURCE_SHA256", REDISQ_SOURCE_SHA256) < 0)
        Py_CLEAR(m);
    return m;
}
