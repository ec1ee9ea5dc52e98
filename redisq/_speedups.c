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

/* The Message class, its slots' offsets and the Python decoder. A call of decode_entries works
 * on its own copy (with references to the class and the decoder): set_layout, called by code
 * the Python decoder or a finalizer runs, changes the next calls only. */
typedef struct {
    PyTypeObject *type;
    Py_ssize_t offset[N_FIELDS];
    PyObject *slow; /* redisq.records.decode_entries_py */
} layout_t;

static layout_t layout = {NULL, {0}, NULL};

#define MAX_ID_FIELD 9223372036854775807ULL

/* set_layout(message_type, names, slow): the Message class, its slot names in the order of
 * the enum above, and the Python decoder for the entries this module does not take. Each name
 * must be a writable object slot of the class itself (a member descriptor in its own dict,
 * defined by the class or a base, inside its instances), each slot named once; on any error
 * the layout in use is kept. */
static PyObject *set_layout(PyObject *self, PyObject *args) {
    PyObject *type_obj, *names, *slow;
    if (!PyArg_ParseTuple(args, "O!O!O:set_layout", &PyType_Type, &type_obj, &PyTuple_Type,
                          &names, &slow))
        return NULL;
    PyTypeObject *type = (PyTypeObject *)type_obj;
    if (PyTuple_GET_SIZE(names) != N_FIELDS) {
        PyErr_SetString(PyExc_ValueError, "set_layout: wrong number of slot names");
        return NULL;
    }
    if (type->tp_itemsize != 0 || type->tp_alloc == NULL) {
        PyErr_SetString(PyExc_TypeError, "set_layout: not a class of fixed-size instances");
        return NULL;
    }
    layout_t new = {type, {0}, slow};
    for (Py_ssize_t i = 0; i < N_FIELDS; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        if (!PyUnicode_CheckExact(name)) {
            PyErr_Format(PyExc_TypeError, "set_layout: slot names must be str, not %R", name);
            return NULL;
        }
        PyObject *descr = PyDict_GetItemWithError(type->tp_dict, name);
        if (descr == NULL || Py_TYPE(descr) != &PyMemberDescr_Type) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_TypeError, "set_layout: %R is not a slot", name);
            return NULL;
        }
        PyMemberDescrObject *member_descr = (PyMemberDescrObject *)descr;
        PyMemberDef *member = member_descr->d_member;
        if (member->type != T_OBJECT_EX || (member->flags & READONLY)) {
            PyErr_Format(PyExc_TypeError, "set_layout: %R is not an object slot", name);
            return NULL;
        }
        if (!PyType_IsSubtype(type, PyDescr_TYPE(member_descr)) ||
            member->offset < (Py_ssize_t)sizeof(PyObject) ||
            member->offset > type->tp_basicsize - (Py_ssize_t)sizeof(PyObject *)) {
            PyErr_Format(PyExc_TypeError, "set_layout: %R is a slot of another class", name);
            return NULL;
        }
        for (Py_ssize_t j = 0; j < i; j++)
            if (new.offset[j] == member->offset) {
                PyErr_Format(PyExc_ValueError, "set_layout: slot %R named twice", name);
                return NULL;
            }
        new.offset[i] = member->offset;
    }
    /* Everything in place before the old class and decoder are released (which may run
     * code). */
    layout_t old = layout;
    Py_INCREF(new.type);
    Py_INCREF(new.slow);
    layout = new;
    Py_XDECREF(old.type);
    Py_XDECREF(old.slow);
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
    (*(PyObject **)((char *)(obj) + lay->offset[field]) = (value))

/* A decoded Message holds strs, bytes, ints, None and a headers dict of bytes: it cannot be part
 * of a reference cycle, so the cycle collector need not track it (CPython untracks tuples and
 * dicts of such values the same way). Untracked, the thousands of Messages a poll() returns,
 * held while the caller handles them, are no longer traced by every collection the reads'
 * allocations set off: measured on 20,000 batch-entry messages decoded at a time, 1.53 us per
 * message tracked against 0.35 us with the collector off. (A caller that puts a Message into its
 * own headers makes a cycle the collector will not free: the memory of that one Message.) */
static void untrack(PyObject *m) {
    if (PyObject_GC_IsTracked(m))
        PyObject_GC_UnTrack(m);
}

/* The caches hold the last millisecond and producer id seen (entries of one read mostly share
 * them). */
typedef struct {
    unsigned long long ms;
    PyObject *ms_obj;  /* owned */
    PyObject *pid_raw; /* owned */
    PyObject *pid_obj; /* owned */
} caches;

/* decode_entries_py's first steps for one entry: `for entry_id, flat in entries`, then
 * entry_id.decode(). When the entry is an exact tuple or list of two whose ID is exact bytes
 * of a stream ID this module takes (ASCII, decimal milliseconds below 2**64 before the first
 * dash), those steps run no Python code and cannot fail: 1, with the ID, the fields (borrowed)
 * and the milliseconds. Else 0: the entry is for the Python decoder, whole. */
static int unpack(PyObject *entry, PyObject **entry_id, PyObject **flat, unsigned long long *ms) {
    if (!PyTuple_CheckExact(entry) && !PyList_CheckExact(entry))
        return 0;
    if (PySequence_Fast_GET_SIZE(entry) != 2)
        return 0;
    PyObject *id_obj = PySequence_Fast_GET_ITEM(entry, 0);
    if (!PyBytes_CheckExact(id_obj))
        return 0;
    const char *id = PyBytes_AS_STRING(id_obj);
    Py_ssize_t id_len = PyBytes_GET_SIZE(id_obj);
    Py_ssize_t dash = 0;
    while (dash < id_len && id[dash] != '-')
        dash++;
    if (dash == id_len || parse_digits(id, dash, 20, ULLONG_MAX, ms) < 0)
        return 0;
    for (Py_ssize_t i = dash + 1; i < id_len; i++)
        if ((unsigned char)id[i] >= 0x80)
            return 0;
    *entry_id = id_obj;
    *flat = PySequence_Fast_GET_ITEM(entry, 1);
    return 1;
}

/* One entry's Message (a new reference), or NULL: with an exception set when something failed,
 * without one when the fields are for the Python decoder. entry_id and flat are held by the
 * caller. The fields picked are held from the moment they are read: the allocations below may
 * run the collector, whose finalizers may run any code (emptying `flat`, say). */
static PyObject *decode_one(const layout_t *lay, PyObject *topic, PyObject *partition,
                            PyObject *entry_id, PyObject *flat, unsigned long long ms,
                            PyObject *attempt, caches *c) {
    if (!PyList_CheckExact(flat))
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
    /* Nothing above or in the parsing below runs Python code or the collector (ints and str
     * are not tracked by it); from PyDict_New on, the fields are held. */
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
    Py_INCREF(producer_id);
    Py_INCREF(key);
    Py_INCREF(value);
    Py_INCREF(message_id);
    PyObject *offset = NULL, *headers = NULL, *m = NULL;
    if (c->ms_obj == NULL || c->ms != ms) {
        PyObject *ms_obj = PyLong_FromUnsignedLongLong(ms);
        if (ms_obj == NULL)
            goto fail;
        Py_XSETREF(c->ms_obj, ms_obj);
        c->ms = ms;
    }
    PyObject *timestamp = Py_NewRef(c->ms_obj);
    offset = PyUnicode_DecodeASCII(PyBytes_AS_STRING(entry_id), PyBytes_GET_SIZE(entry_id), NULL);
    if (offset == NULL)
        goto fail_timestamp;
    headers = PyDict_New();
    if (headers == NULL)
        goto fail_timestamp;
    m = lay->type->tp_alloc(lay->type, 0);
    if (m == NULL)
        goto fail_timestamp;
    SET(m, F_TOPIC, Py_NewRef(topic));
    SET(m, F_PARTITION, Py_NewRef(partition));
    SET(m, F_OFFSET, offset);
    SET(m, F_KEY, key);
    SET(m, F_VALUE, value);
    SET(m, F_HEADERS, headers);
    SET(m, F_TIMESTAMP, timestamp);
    SET(m, F_PRODUCER, producer_id);
    SET(m, F_SEQUENCE, sequence);
    SET(m, F_MESSAGE_ID, message_id);
    SET(m, F_ATTEMPT, Py_NewRef(attempt));
    untrack(m);
    return m;
fail_timestamp:
    Py_DECREF(timestamp);
fail:
    Py_XDECREF(headers);
    Py_XDECREF(offset);
    Py_DECREF(producer_id);
    Py_DECREF(key);
    Py_DECREF(value);
    Py_DECREF(message_id);
    Py_DECREF(sequence);
    return NULL;
}

/* deliveries[i] as decode_entries_py reads it (a new reference, or NULL with the exception it
 * raises). */
static PyObject *delivery_at(PyObject *deliveries, Py_ssize_t i) {
    if ((PyList_CheckExact(deliveries) || PyTuple_CheckExact(deliveries)) &&
        i < PySequence_Fast_GET_SIZE(deliveries))
        return Py_NewRef(PySequence_Fast_GET_ITEM(deliveries, i));
    PyObject *index = PyLong_FromSsize_t(i);
    if (index == NULL)
        return NULL;
    PyObject *d = PyObject_GetItem(deliveries, index);
    Py_DECREF(index);
    return d;
}

/* DeliveryAt(deliveries, i)[0] is deliveries[i], read when the Python decoder reads it: after
 * it unpacked the entry and made its offset (which may run code that changes deliveries, or
 * raise first). */
typedef struct {
    PyObject_HEAD
    PyObject *deliveries;
    Py_ssize_t index;
} DeliveryAt;

static PyObject *delivery_at_getitem(DeliveryAt *self, PyObject *key) {
    return delivery_at(self->deliveries, self->index);
}

static int delivery_at_traverse(DeliveryAt *self, visitproc visit, void *arg) {
    Py_VISIT(self->deliveries);
    return 0;
}

static int delivery_at_clear(DeliveryAt *self) {
    Py_CLEAR(self->deliveries);
    return 0;
}

static void delivery_at_dealloc(DeliveryAt *self) {
    PyObject_GC_UnTrack(self);
    delivery_at_clear(self);
    PyObject_GC_Del(self);
}

static PyMappingMethods delivery_at_mapping = {NULL, (binaryfunc)delivery_at_getitem, NULL};

static PyTypeObject DeliveryAtType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "redisq._speedups.DeliveryAt",
    .tp_basicsize = sizeof(DeliveryAt),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)delivery_at_dealloc,
    .tp_traverse = (traverseproc)delivery_at_traverse,
    .tp_clear = (inquiry)delivery_at_clear,
    .tp_as_mapping = &delivery_at_mapping,
};

/* The Python decoder on one entry, its Messages appended to result: 0, or -1 with an
 * exception. deliveries: None, or what it indexes with 0. */
static int decode_slow(const layout_t *lay, PyObject *topic, PyObject *partition, PyObject *entry,
                       PyObject *deliveries, PyObject *result) {
    PyObject *single = PyList_New(1);
    if (single == NULL)
        return -1;
    PyList_SET_ITEM(single, 0, Py_NewRef(entry));
    PyObject *decoded =
        PyObject_CallFunctionObjArgs(lay->slow, topic, partition, single, deliveries, NULL);
    Py_DECREF(single);
    if (decoded == NULL)
        return -1;
    int bad = PyList_SetSlice(result, PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, decoded);
    Py_DECREF(decoded);
    return bad;
}

/* One entry of decode_entries, in the order decode_entries_py takes its steps: 0, or -1 with an
 * exception. */
static int decode_entry(const layout_t *lay, PyObject *topic, PyObject *partition,
                        PyObject *entry, PyObject *deliveries, Py_ssize_t i, PyObject *one,
                        caches *c, PyObject *result) {
    PyObject *entry_id, *flat;
    unsigned long long ms;
    if (!unpack(entry, &entry_id, &flat, &ms)) {
        /* The Python decoder unpacks it (any code, any error) before it reads deliveries[i]. */
        if (deliveries == Py_None)
            return decode_slow(lay, topic, partition, entry, Py_None, result);
        DeliveryAt *at = PyObject_GC_New(DeliveryAt, &DeliveryAtType);
        if (at == NULL)
            return -1;
        at->deliveries = Py_NewRef(deliveries);
        at->index = i;
        PyObject_GC_Track(at);
        int r = decode_slow(lay, topic, partition, entry, (PyObject *)at, result);
        Py_DECREF(at);
        return r;
    }
    /* Held as the Python decoder's loop variables hold them: reading deliveries[i] may run code
     * that changes the entry. */
    Py_INCREF(entry_id);
    Py_INCREF(flat);
    PyObject *attempt = deliveries == Py_None ? Py_NewRef(one) : delivery_at(deliveries, i);
    int r = -1;
    if (attempt == NULL)
        goto done;
    int fast = 1;
    if (deliveries != Py_None) {
        /* max(1, int(d)) of an int from 1 to LONG_MAX is d; the Python decoder says the rest. */
        int overflow;
        fast = PyLong_CheckExact(attempt) &&
               PyLong_AsLongAndOverflow(attempt, &overflow) >= 1 && !overflow;
    }
    PyObject *m = fast ? decode_one(lay, topic, partition, entry_id, flat, ms, attempt, c) : NULL;
    if (m != NULL) {
        r = PyList_Append(result, m);
        Py_DECREF(m);
    } else if (!PyErr_Occurred()) {
        /* deliveries[i] was read: the Python decoder gets the value read, and the entry as it
         * was unpacked. */
        PyObject *pair = PyTuple_Pack(2, entry_id, flat);
        PyObject *given = deliveries == Py_None ? Py_NewRef(Py_None) : PyList_New(1);
        if (pair != NULL && given != NULL) {
            if (given != Py_None)
                PyList_SET_ITEM(given, 0, Py_NewRef(attempt));
            r = decode_slow(lay, topic, partition, pair, given, result);
        }
        Py_XDECREF(pair);
        Py_XDECREF(given);
    }
    Py_DECREF(attempt);
done:
    Py_DECREF(entry_id);
    Py_DECREF(flat);
    return r;
}

/* Batch entries (redisq.model.batches): big-endian u32 and u64 of the blob. */
static unsigned long long be32(const unsigned char *p) {
    return ((unsigned long long)p[0] << 24) | ((unsigned long long)p[1] << 16) |
           ((unsigned long long)p[2] << 8) | (unsigned long long)p[3];
}

static unsigned long long be64(const unsigned char *p) {
    return (be32(p) << 32) | be32(p + 4);
}

#define B_KEYS 0x01
#define B_HEADERS 0x02
#define B_IDS 0x04
#define B_STAMPS 0x08

/* A column item at `at` of `len` bytes: None when an absent item (len 0) may be None. */
static PyObject *blob_item(const char *data, unsigned long long at, unsigned long long len,
                           int absent_none) {
    if (len == 0 && absent_none)
        Py_RETURN_NONE;
    return PyBytes_FromStringAndSize(data + at, (Py_ssize_t)len);
}

/* batch_messages(messages, topic, partition, blob, n, ms, first_seq, start, stop, producer_id,
 *                base_seq, attempt, bitmap) -> bool
 *
 * The Messages start..stop-1 of a batch entry whose fields redisq.records._decode_batch has
 * checked, appended to messages, as its Python loop builds them; False (nothing appended) when
 * the blob is not one this function takes: a headers column (decoded in Python), or any rule
 * of model.batches.Batch broken, which the Python decoder then names. bitmap: None or the
 * entry's settled bits, whose set bits are left out. */
static PyObject *batch_messages(PyObject *self, PyObject *args) {
    PyObject *messages, *topic, *partition, *blob, *producer_id, *base_seq, *attempt, *bitmap;
    unsigned long long n_field, ms, first_seq;
    Py_ssize_t start, stop;
    if (!PyArg_ParseTuple(args, "O!OOO!KKKnnOOOO:batch_messages", &PyList_Type, &messages, &topic,
                          &partition, &PyBytes_Type, &blob, &n_field, &ms, &first_seq, &start,
                          &stop, &producer_id, &base_seq, &attempt, &bitmap))
        return NULL;
    if (layout.type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "batch_messages: set_layout() was not called");
        return NULL;
    }
    const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(blob);
    unsigned long long size = (unsigned long long)PyBytes_GET_SIZE(blob);
    if (size < 6 || b[0] != 1 || (b[1] & ~0x0F) || (b[1] & B_HEADERS))
        Py_RETURN_FALSE;
    int flags = b[1];
    unsigned long long n = be32(b + 2);
    if (n != n_field || n == 0)
        Py_RETURN_FALSE;
    int columns = 1 + !!(flags & B_KEYS) + !!(flags & B_IDS);
    unsigned long long pos = 6 + 4 * n * (unsigned long long)columns;
    unsigned long long stamps_at = pos;
    if (flags & B_STAMPS)
        pos += 8 * n;
    if (pos > size)
        Py_RETURN_FALSE;
    /* column c's data begins at col_at[c]; the columns are keys?, values, ids? */
    unsigned long long col_at[3], total = pos;
    for (int c = 0; c < columns; c++) {
        col_at[c] = total;
        const unsigned char *lens = b + 6 + 4 * n * (unsigned long long)c;
        for (unsigned long long i = 0; i < n; i++)
            total += be32(lens + 4 * i);
        if (total > size)
            Py_RETURN_FALSE;
    }
    if (total != size)
        Py_RETURN_FALSE;
    if (start < 0)
        start = 0;
    if ((unsigned long long)stop > n)
        stop = (Py_ssize_t)n;
    const char *bits = NULL;
    Py_ssize_t nbits = 0;
    if (bitmap != Py_None) {
        if (!PyBytes_Check(bitmap)) {
            PyErr_SetString(PyExc_TypeError, "batch_messages: bitmap must be bytes or None");
            return NULL;
        }
        bits = PyBytes_AS_STRING(bitmap);
        nbits = PyBytes_GET_SIZE(bitmap);
    }
    unsigned long long base = 0;
    if (base_seq != Py_None) {
        base = PyLong_AsUnsignedLongLong(base_seq);
        if (base == (unsigned long long)-1 && PyErr_Occurred())
            return NULL;
    }
    /* the cursors at message `start` */
    unsigned long long at[3];
    for (int c = 0; c < columns; c++) {
        const unsigned char *lens = b + 6 + 4 * n * (unsigned long long)c;
        at[c] = col_at[c];
        for (Py_ssize_t i = 0; i < start; i++)
            at[c] += be32(lens + 4 * i);
    }
    int key_col = (flags & B_KEYS) ? 0 : -1;
    int value_col = key_col + 1;
    int id_col = (flags & B_IDS) ? value_col + 1 : -1;
    const char *data = (const char *)b;
    PyObject *ms_obj = PyLong_FromUnsignedLongLong(ms);
    if (ms_obj == NULL)
        return NULL;
    layout_t copy = layout; /* as decode_entries: set_layout changes the next calls only */
    const layout_t *lay = &copy;
    Py_INCREF(copy.type);
    char buf[48];
    for (Py_ssize_t i = start; i < stop; i++) {
        unsigned long long len[3];
        for (int c = 0; c < columns; c++)
            len[c] = be32(b + 6 + 4 * n * (unsigned long long)c + 4 * (unsigned long long)i);
        int skip = bits != NULL && (i >> 3) < nbits &&
                   (((const unsigned char *)bits)[i >> 3] & (0x80 >> (i & 7)));
        if (skip) {
            for (int c = 0; c < columns; c++)
                at[c] += len[c];
            continue;
        }
        PyObject *key = key_col < 0 ? Py_NewRef(Py_None) : blob_item(data, at[key_col], len[key_col], 1);
        PyObject *value = blob_item(data, at[value_col], len[value_col], 0);
        PyObject *message_id = id_col < 0 ? Py_NewRef(Py_None) : blob_item(data, at[id_col], len[id_col], 1);
        int w = snprintf(buf, sizeof buf, "%llu-%llu", ms, first_seq + (unsigned long long)i);
        PyObject *offset = PyUnicode_DecodeASCII(buf, w, NULL);
        PyObject *timestamp = (flags & B_STAMPS) ? PyLong_FromUnsignedLongLong(be64(b + stamps_at + 8 * (unsigned long long)i))
                                                 : Py_NewRef(ms_obj);
        PyObject *sequence = base_seq == Py_None ? Py_NewRef(Py_None)
                                                 : PyLong_FromUnsignedLongLong(base + (unsigned long long)i);
        PyObject *headers = PyDict_New();
        PyObject *m = NULL;
        if (key && value && message_id && offset && timestamp && sequence && headers)
            m = lay->type->tp_alloc(lay->type, 0);
        if (m == NULL) {
            Py_XDECREF(key);
            Py_XDECREF(value);
            Py_XDECREF(message_id);
            Py_XDECREF(offset);
            Py_XDECREF(timestamp);
            Py_XDECREF(sequence);
            Py_XDECREF(headers);
            Py_DECREF(ms_obj);
            Py_DECREF(copy.type);
            return NULL;
        }
        SET(m, F_TOPIC, Py_NewRef(topic));
        SET(m, F_PARTITION, Py_NewRef(partition));
        SET(m, F_OFFSET, offset);
        SET(m, F_KEY, key);
        SET(m, F_VALUE, value);
        SET(m, F_HEADERS, headers);
        SET(m, F_TIMESTAMP, timestamp);
        SET(m, F_PRODUCER, Py_NewRef(producer_id));
        SET(m, F_SEQUENCE, sequence);
        SET(m, F_MESSAGE_ID, message_id);
        SET(m, F_ATTEMPT, Py_NewRef(attempt));
        untrack(m);
        int appended = PyList_Append(messages, m);
        Py_DECREF(m);
        if (appended < 0) {
            Py_DECREF(ms_obj);
            Py_DECREF(copy.type);
            return NULL;
        }
        for (int c = 0; c < columns; c++)
            at[c] += len[c];
    }
    Py_DECREF(ms_obj);
    Py_DECREF(copy.type);
    Py_RETURN_TRUE;
}

/* blob_from_resp(layout, count, body, with_ids=False) -> bytes, or (bytes, bytes)
 *
 * redisq.model.batches.blob_from_items(layout, count, resp_items(body)) in one pass: the blob
 * of a sealed batch given as its messages' RESP bulk strings (layout letters k, v, h, m, t, one
 * item each per message; t an ASCII decimal timestamp). ValueError for what the Python version
 * refuses. with_ids: (the blob, the message ids' own bulk strings, in order), the arguments of
 * produce_message_id.lua on a topic of batch entries. */
static PyObject *blob_from_resp(PyObject *self, PyObject *args) {
    const char *layout_s;
    Py_ssize_t stride, count;
    Py_buffer body;
    int with_ids = 0;
    if (!PyArg_ParseTuple(args, "s#ny*|p:blob_from_resp", &layout_s, &stride, &count, &body,
                          &with_ids))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t *starts = NULL, *lens = NULL, *heads = NULL;
    int column_of[8]; /* per layout letter: 0 keys, 1 values, 2 headers, 3 ids, 4 stamps */
    if (stride < 1 || stride > 8) {
        PyErr_Format(PyExc_ValueError, "layout %s has %zd letters", layout_s, stride);
        goto done;
    }
    int seen = 0;
    for (Py_ssize_t j = 0; j < stride; j++) {
        const char *at = strchr("kvhmt", layout_s[j]);
        if (layout_s[j] == 0 || at == NULL || (seen & (1 << (at - "kvhmt")))) {
            PyErr_Format(PyExc_ValueError, "layout %s is not one of letters kvhmt", layout_s);
            goto done;
        }
        column_of[j] = (int)(at - "kvhmt");
        seen |= 1 << column_of[j];
    }
    if (!(seen & 2)) {
        PyErr_Format(PyExc_ValueError, "layout %s has no value", layout_s);
        goto done;
    }
    if (count < 1 || (unsigned long long)count > 0xFFFFFFFFULL) {
        PyErr_Format(PyExc_ValueError, "a batch holds 1 to %llu messages, not %zd",
                     0xFFFFFFFFULL, count);
        goto done;
    }
    Py_ssize_t items = count * stride;
    starts = PyMem_Malloc(sizeof(Py_ssize_t) * items);
    lens = PyMem_Malloc(sizeof(Py_ssize_t) * items);
    heads = PyMem_Malloc(sizeof(Py_ssize_t) * items);
    if (starts == NULL || lens == NULL || heads == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const char *b = body.buf;
    Py_ssize_t pos = 0, end = body.len, got = 0;
    while (pos < end) {
        if (got == items) {
            PyErr_Format(PyExc_ValueError, "%zd messages of layout %s are %zd items", count,
                         layout_s, items);
            goto done;
        }
        if (b[pos] != '$') {
            PyErr_Format(PyExc_ValueError, "not a RESP bulk string at byte %zd", pos);
            goto done;
        }
        Py_ssize_t p = pos + 1, len = 0;
        while (p < end && b[p] >= '0' && b[p] <= '9' && len < ((Py_ssize_t)1 << 40))
            len = len * 10 + (b[p++] - '0');
        if (p == pos + 1 || p + 1 >= end || b[p] != '\r' || b[p + 1] != '\n' ||
            len > end - (p + 2) - 2 || b[p + 2 + len] != '\r' || b[p + 3 + len] != '\n') {
            PyErr_Format(PyExc_ValueError, "not a RESP bulk string at byte %zd", pos);
            goto done;
        }
        heads[got] = pos;
        starts[got] = p + 2;
        lens[got] = len;
        got++;
        pos = p + 4 + len;
    }
    if (got != items) {
        PyErr_Format(PyExc_ValueError, "%zd messages of layout %s are %zd items", count, layout_s,
                     items);
        goto done;
    }
    /* which columns are present (an optional column with no item present is left out) */
    int present[5] = {0, 1, 0, 0, 0};
    Py_ssize_t where[5] = {-1, -1, -1, -1, -1};
    for (Py_ssize_t j = 0; j < stride; j++)
        where[column_of[j]] = j;
    if (with_ids && where[3] < 0) {
        PyErr_Format(PyExc_ValueError, "layout %s has no message id", layout_s);
        goto done;
    }
    for (int c = 0; c < 5; c++) {
        if (where[c] < 0 || c == 1)
            continue;
        if (c == 4) {
            present[4] = 1;
            continue;
        }
        for (Py_ssize_t i = 0; i < count && !present[c]; i++)
            present[c] = lens[i * stride + where[c]] > 0;
    }
    static const int flag_of[4] = {0x01, 0, 0x02, 0x04};
    int flags = 0, columns = 0;
    unsigned long long size = 6, data = 0;
    for (int c = 0; c < 4; c++) {
        if (!present[c])
            continue;
        flags |= flag_of[c];
        columns++;
        for (Py_ssize_t i = 0; i < count; i++) {
            Py_ssize_t l = lens[i * stride + where[c]];
            if ((unsigned long long)l > 0xFFFFFFFFULL) {
                PyErr_SetString(PyExc_ValueError, "an item of 4 GiB or more");
                goto done;
            }
            data += (unsigned long long)l;
        }
    }
    if (present[4])
        flags |= 0x08;
    size += 4ULL * (unsigned long long)count * columns + (present[4] ? 8ULL * count : 0) + data;
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
    if (result == NULL)
        goto done;
    unsigned char *o = (unsigned char *)PyBytes_AS_STRING(result);
    o[0] = 1;
    o[1] = (unsigned char)flags;
    o[2] = (unsigned char)(count >> 24);
    o[3] = (unsigned char)(count >> 16);
    o[4] = (unsigned char)(count >> 8);
    o[5] = (unsigned char)count;
    unsigned char *w = o + 6;
    for (int c = 0; c < 4; c++) {
        if (!present[c])
            continue;
        for (Py_ssize_t i = 0; i < count; i++) {
            unsigned long long l = (unsigned long long)lens[i * stride + where[c]];
            w[0] = (unsigned char)(l >> 24);
            w[1] = (unsigned char)(l >> 16);
            w[2] = (unsigned char)(l >> 8);
            w[3] = (unsigned char)l;
            w += 4;
        }
    }
    if (present[4]) {
        for (Py_ssize_t i = 0; i < count; i++) {
            Py_ssize_t k = i * stride + where[4];
            const char *d = b + starts[k];
            unsigned long long v = 0;
            if (lens[k] < 1 || lens[k] > 19) {
                PyErr_SetString(PyExc_ValueError, "a timestamp is not an ASCII decimal");
                Py_CLEAR(result);
                goto done;
            }
            for (Py_ssize_t q = 0; q < lens[k]; q++) {
                if (d[q] < '0' || d[q] > '9') {
                    PyErr_SetString(PyExc_ValueError, "a timestamp is not an ASCII decimal");
                    Py_CLEAR(result);
                    goto done;
                }
                v = v * 10 + (unsigned long long)(d[q] - '0');
            }
            for (int q = 7; q >= 0; q--) {
                w[q] = (unsigned char)v;
                v >>= 8;
            }
            w += 8;
        }
    }
    for (int c = 0; c < 4; c++) {
        if (!present[c])
            continue;
        for (Py_ssize_t i = 0; i < count; i++) {
            Py_ssize_t k = i * stride + where[c];
            memcpy(w, b + starts[k], (size_t)lens[k]);
            w += lens[k];
        }
    }
    if (with_ids) { /* and the ids' own bulk strings, copied from the body */
        Py_ssize_t ids_size = 0;
        for (Py_ssize_t i = 0; i < count; i++) {
            Py_ssize_t k = i * stride + where[3];
            ids_size += starts[k] + lens[k] + 2 - heads[k];
        }
        PyObject *ids = PyBytes_FromStringAndSize(NULL, ids_size);
        if (ids == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        char *iw = PyBytes_AS_STRING(ids);
        for (Py_ssize_t i = 0; i < count; i++) {
            Py_ssize_t k = i * stride + where[3];
            Py_ssize_t whole = starts[k] + lens[k] + 2 - heads[k];
            memcpy(iw, b + heads[k], (size_t)whole);
            iw += whole;
        }
        Py_SETREF(result, PyTuple_Pack(2, result, ids));
        Py_DECREF(ids);
    }
done:
    PyMem_Free(heads);
    PyMem_Free(starts);
    PyMem_Free(lens);
    PyBuffer_Release(&body);
    return result;
}

/* decode_entries(topic, partition, entries, deliveries=None) -> list[Message]
 *
 * entries is iterated as decode_entries_py iterates it (a list it is given, not a copy: the
 * Python decoder's code may add or remove entries) and deliveries indexed as it indexes them,
 * entry by entry. */
static PyObject *decode_entries(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"topic", "partition", "entries", "deliveries", NULL};
    PyObject *topic, *partition, *given, *deliveries = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|O:decode_entries", keywords, &topic,
                                     &partition, &given, &deliveries))
        return NULL;
    if (layout.type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "decode_entries: set_layout() was not called");
        return NULL;
    }
    layout_t lay = layout;
    Py_INCREF(lay.type);
    Py_INCREF(lay.slow);
    PyObject *result = NULL, *one = NULL;
    caches c = {0, NULL, NULL, NULL};
    PyObject *it = PyObject_GetIter(given);
    if (it == NULL)
        goto fail;
    result = PyList_New(0);
    one = PyLong_FromLong(1);
    if (result == NULL || one == NULL)
        goto fail;
    for (Py_ssize_t i = 0;; i++) {
        PyObject *entry = PyIter_Next(it);
        if (entry == NULL) {
            if (PyErr_Occurred())
                goto fail;
            break;
        }
        int bad = decode_entry(&lay, topic, partition, entry, deliveries, i, one, &c, result);
        Py_DECREF(entry);
        if (bad < 0)
            goto fail;
    }
    goto done;
fail:
    Py_CLEAR(result);
done:
    Py_XDECREF(it);
    Py_XDECREF(one);
    Py_XDECREF(c.ms_obj);
    Py_XDECREF(c.pid_raw);
    Py_XDECREF(c.pid_obj);
    Py_DECREF(lay.type);
    Py_DECREF(lay.slow);
    return result;
}

static PyMethodDef methods[] = {
    {"set_layout", set_layout, METH_VARARGS, "set_layout(message_type, slot_names, slow_decode)"},
    {"decode_entries", (PyCFunction)(void (*)(void))decode_entries, METH_VARARGS | METH_KEYWORDS,
     "decode_entries(topic, partition, entries, deliveries=None) -> list of Messages"},
    {"batch_messages", batch_messages, METH_VARARGS,
     "batch_messages(messages, topic, partition, blob, n, ms, first_seq, start, stop, "
     "producer_id, base_seq, attempt, bitmap) -> bool"},
    {"blob_from_resp", blob_from_resp, METH_VARARGS,
     "blob_from_resp(layout, count, body, with_ids=False) -> bytes, or (blob, the ids' RESP)"},
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
    if (PyType_Ready(&DeliveryAtType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "SOURCE_SHA256", REDISQ_SOURCE_SHA256) < 0)
        Py_CLEAR(m);
    return m;
}
