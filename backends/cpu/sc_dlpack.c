/* See sc_dlpack.h.  Layouts shared with statecache.dlpack.ExchangeReader,
 * all int64:
 *
 * a reading (read's result): address (data + byte_offset), ndim,
 *   dtype word (code | bits << 8 | lanes << 16), device word
 *   (device_type | device_id << 32), shape[ndim], strides[ndim] (in elements;
 *   C order when the producer gives none);
 * a plan (match's, as bytes): n, then per tensor: position in the argument
 *   tuple, address of its exact type object, address of the producer's
 *   dltensor_from_py_object_no_sync, then the reading without its address
 *   (ndim, dtype word, device word, shape, strides); after the tensors, the
 *   checks a matched call must pass on the addresses found (k, m: tensor
 *   numbers in plan order): an alignment mask (no address may have any of its
 *   bits set), the count of tensor pairs and per pair k, m, lo, hi (refused
 *   when lo < address_k - address_m < hi: the two overlap), the count of
 *   pairs with fixed memory and per pair k, lo, hi (refused when
 *   lo < address_k < hi).
 *
 * Only the geometry is compared, never the address: the address is what a
 * relaunch takes from each call.
 *
 * launch's block (a prepared call: its layout is above py_launch) is the
 * third layout shared, with statecache.backends.cpu.device. */
/* The stable ABI of CPython 3.11 (setup.py's LIMITED_API): the module is
 * named and tagged abi3, so nothing here may depend on one CPython's layout. */
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030B0000
#endif
#include <Python.h>
#include <string.h>

#include "sc_dlpack.h"
#include "statecache_cpu.h"

/* dlpack.h, ABI 1.x: the structures are stable across minor versions. */
typedef struct {
    int32_t device_type;
    int32_t device_id;
} sc_dl_device;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} sc_dl_dtype;

typedef struct {
    void *data;
    sc_dl_device device;
    int32_t ndim;
    sc_dl_dtype dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} sc_dl_tensor;

typedef int (*sc_from_py)(void *py_object, sc_dl_tensor *out);

/* Tensors of more dimensions than this are not read here (the caller falls back). */
#define SC_DL_MAX_NDIM 16

static int64_t dtype_word(const sc_dl_tensor *t) {
    return (int64_t)t->dtype.code | ((int64_t)t->dtype.bits << 8) | ((int64_t)t->dtype.lanes << 16);
}

static int64_t device_word(const sc_dl_tensor *t) {
    return (int64_t)(uint32_t)t->device.device_type | ((int64_t)(uint32_t)t->device.device_id << 32);
}

/* The stride of dimension i: the producer's, or C order's when it gives none. */
static int64_t stride_at(const sc_dl_tensor *t, int32_t i) {
    if (t->strides != NULL) return t->strides[i];
    int64_t acc = 1;
    for (int32_t j = t->ndim - 1; j > i; j--) acc *= t->shape[j] > 1 ? t->shape[j] : 1;
    return acc;
}

/* Fill a DLTensor of obj; 0, or -1 with no Python error left set. */
static int fill(void *obj, void *from_py, sc_dl_tensor *t) {
    memset(t, 0, sizeof *t);
    if (((sc_from_py)from_py)(obj, t) != 0) {
        PyErr_Clear(); /* the ordinary path exports the tensor again and says what is wrong */
        return -1;
    }
    if (t->ndim < 0 || t->ndim > SC_DL_MAX_NDIM || (t->ndim > 0 && t->shape == NULL)) return -1;
    return 0;
}

/* Whether obj is a torch tensor with its negative bit set (a lazy negation
 * view, e.g. z.conj().imag): its DLPack export is its memory as it is, the
 * values without their sign, which no DLPack field says.  Such a call must
 * take the ordinary path, which refuses it.  1: negative; 0: not, or a
 * producer without is_neg; -1: a Python error (cleared). */
/* is_neg's C function per exact type, when the type's is_neg is a C method (torch's
 * tensor types): called directly, it costs a few nanoseconds where the method call
 * machinery costs ~50 per tensor, nine tensors per Mamba scan call.  The types are held
 * (an address of a freed type could be reused by another).  A type whose is_neg is not
 * a C method taking no arguments (or varargs) is called the ordinary way. */
#define SC_NEG_TYPES 8
static struct {
    PyObject *type;
    PyCFunction fn; /* NULL: call the method */
    int flags;
} neg_types[SC_NEG_TYPES];
static int n_neg_types = 0;

static int truth(PyObject *r) {
    if (r == NULL) return -1;
    int neg = PyObject_IsTrue(r);
    Py_DECREF(r);
    return neg;
}

static int negative_view(PyObject *obj) {
    static PyObject *name = NULL;
    if (name == NULL && (name = PyUnicode_InternFromString("is_neg")) == NULL) return -1;
    PyObject *type = (PyObject *)Py_TYPE(obj);
    int slot = 0;
    while (slot < n_neg_types && neg_types[slot].type != type) slot++;
    if (slot == n_neg_types && slot < SC_NEG_TYPES) { /* first time: how this type's is_neg is called */
        PyObject *bound = PyObject_GetAttr(obj, name);
        PyCFunction fn = NULL;
        int flags = 0;
        if (bound == NULL) {
            PyErr_Clear();
        } else {
            if (PyCFunction_Check(bound) && PyCFunction_GetSelf(bound) == obj) {
                flags = PyCFunction_GetFlags(bound) & ~METH_COEXIST;
                if (flags == METH_NOARGS || flags == METH_VARARGS || flags == (METH_VARARGS | METH_KEYWORDS))
                    fn = PyCFunction_GetFunction(bound);
            }
            Py_DECREF(bound);
        }
        Py_INCREF(type);
        neg_types[slot].type = type;
        neg_types[slot].fn = fn;
        neg_types[slot].flags = flags;
        n_neg_types = slot + 1;
    }
    PyObject *r;
    if (slot < n_neg_types && neg_types[slot].fn != NULL) {
        PyCFunction fn = neg_types[slot].fn;
        if (neg_types[slot].flags == METH_NOARGS) {
            r = fn(obj, NULL);
        } else {
            PyObject *none = PyTuple_New(0);
            if (none == NULL) return -1;
            r = neg_types[slot].flags == METH_VARARGS ? fn(obj, none) : ((PyCFunctionWithKeywords)(void (*)(void))fn)(obj, none, NULL);
            Py_DECREF(none);
        }
        int neg = truth(r);
        if (neg < 0) PyErr_Clear();
        return neg;
    }
    r = PyObject_CallMethodObjArgs(obj, name, NULL);
    if (r == NULL) {
        int missing = PyErr_ExceptionMatches(PyExc_AttributeError);
        PyErr_Clear();
        return missing ? 0 : -1;
    }
    int neg = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (neg < 0) PyErr_Clear();
    return neg;
}

/* read(obj, from_py): obj's reading (layout above) as a tuple of ints, or
 * None when the producer refuses it. */
static PyObject *py_read(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "read(obj, from_py) takes 2 arguments");
        return NULL;
    }
    void *from_py = PyLong_AsVoidPtr(args[1]);
    if (from_py == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "read: no producer function");
        return NULL;
    }
    sc_dl_tensor t;
    if (fill(args[0], from_py, &t) != 0) Py_RETURN_NONE;
    PyObject *out = PyTuple_New(4 + 2 * (Py_ssize_t)t.ndim);
    if (out == NULL) return NULL;
    int64_t words[4 + 2 * SC_DL_MAX_NDIM];
    words[0] = (int64_t)((uintptr_t)t.data + t.byte_offset);
    words[1] = t.ndim;
    words[2] = dtype_word(&t);
    words[3] = device_word(&t);
    for (int32_t i = 0; i < t.ndim; i++) {
        words[4 + i] = t.shape[i];
        words[4 + t.ndim + i] = stride_at(&t, i);
    }
    for (Py_ssize_t i = 0; i < 4 + 2 * (Py_ssize_t)t.ndim; i++) {
        PyObject *v = PyLong_FromLongLong(words[i]);
        if (v == NULL || PyTuple_SetItem(out, i, v) != 0) { /* SetItem steals v */
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

/* What match_core found: the tensors' addresses (MATCHED), another geometry
 * (match's None), or a failed check (match's False).  It leaves no Python error set. */
enum { MATCHED = 1, OTHER = 0, REFUSED = -1 };

/* Tensors a plan may hold (more: no match). */
#define SC_PLAN_MAX 64

/* match's work (see match below): fixed and shadows may be NULL (not
 * checked); found gets the n (*n_found) addresses when MATCHED. */
static int match_core(PyObject *given, const int64_t *p, PyObject *fixed, PyObject *shadows, int64_t *found,
                      int64_t *n_found) {
    if (fixed != NULL) {
        /* The positions that are not tensors first (fixed: position, expected, ...): None where
         * None was given, else a weak reference to the very Buffer validated there (dead: no
         * match, its id may have been reused).  One Python call less per relaunch than
         * checking them in Python before this one. */
        Py_ssize_t n_fixed = PyTuple_Size(fixed);
        for (Py_ssize_t i = 0; i + 1 < n_fixed; i += 2) {
            Py_ssize_t pos = PyLong_AsSsize_t(PyTuple_GetItem(fixed, i));
            PyObject *obj = pos < 0 ? NULL : PyTuple_GetItem(given, pos);
            if (obj == NULL) {
                PyErr_Clear();
                return OTHER;
            }
            PyObject *ref = PyTuple_GetItem(fixed, i + 1);
            if (ref == Py_None) {
                if (obj != Py_None) return OTHER;
                continue;
            }
            PyObject *expected = PyObject_CallNoArgs(ref); /* a new reference; None when dead */
            if (expected == NULL) {
                PyErr_Clear();
                return OTHER;
            }
            int same = expected == obj && expected != Py_None;
            Py_DECREF(expected);
            if (!same) return OTHER;
        }
    }
    int64_t n = *p++;
    if (n < 0 || n > SC_PLAN_MAX) return OTHER;
    for (int64_t k = 0; k < n; k++) {
        PyObject *obj = PyTuple_GetItem(given, (Py_ssize_t)p[0]);
        if (obj == NULL) {
            PyErr_Clear();
            return OTHER;
        }
        if ((int64_t)(uintptr_t)Py_TYPE(obj) != p[1]) return OTHER;
        if (negative_view(obj) != 0) return OTHER;
        sc_dl_tensor t;
        if (fill(obj, (void *)(uintptr_t)p[2], &t) != 0) return OTHER;
        int32_t ndim = t.ndim;
        if (ndim != p[3] || dtype_word(&t) != p[4] || device_word(&t) != p[5]) return OTHER;
        const int64_t *shape = p + 6, *strides = p + 6 + ndim;
        for (int32_t i = 0; i < ndim; i++) {
            if (t.shape[i] != shape[i] || stride_at(&t, i) != strides[i]) return OTHER;
        }
        found[k] = (int64_t)((uintptr_t)t.data + t.byte_offset);
        p += 6 + 2 * (int64_t)ndim;
    }
    *n_found = n;
    int64_t bits = 0;
    for (int64_t k = 0; k < n; k++) bits |= found[k];
    if (bits & p[0]) return REFUSED;
    int64_t n_pairs = p[1];
    p += 2;
    for (int64_t i = 0; i < n_pairs; i++, p += 4) {
        int64_t d = found[p[0]] - found[p[1]];
        if (p[2] < d && d < p[3]) return REFUSED;
    }
    n_pairs = p[0];
    p += 1;
    for (int64_t i = 0; i < n_pairs; i++, p += 3) {
        if (p[1] < found[p[0]] && found[p[0]] < p[2]) return REFUSED;
    }
    if (shadows != NULL) {
        /* Index Buffers must still hold the host copy they were validated with: their storages'
         * write counts (shadows: the counts dict, then id(storage), count, ...; the launch memo's
         * stamps) are the ones taken then, else False, the ordinary path refreshes them.  A dict
         * lookup each, where reading a Buffer's host copy runs a Python property. */
        Py_ssize_t n_shadows = PyTuple_Size(shadows);
        PyObject *writes = n_shadows > 0 ? PyTuple_GetItem(shadows, 0) : NULL;
        if (n_shadows > 0 && (writes == NULL || !PyDict_Check(writes) || n_shadows % 2 == 0)) {
            PyErr_Clear();
            return REFUSED;
        }
        for (Py_ssize_t i = 1; i + 1 < n_shadows; i += 2) {
            PyObject *now = PyDict_GetItemWithError(writes, PyTuple_GetItem(shadows, i)); /* borrowed */
            int same = now == NULL ? 0 : PyObject_RichCompareBool(now, PyTuple_GetItem(shadows, i + 1), Py_EQ);
            if (same != 1) {
                PyErr_Clear();
                return REFUSED;
            }
        }
    }
    return MATCHED;
}

/* match(given, plan[, fixed, shadows]): with fixed and shadows, first whether
 * every position that is not a tensor holds what it held (else None).  Then
 * whether every tensor of the plan (bytes, layout above) has its geometry in
 * the tuple `given` and the checks pass: a new list of the tensors'
 * addresses; None: a position holds another type or another geometry, a
 * torch negative view, or a producer refused; False: the geometry matched and
 * a check failed (misaligned, written memory overlapping other arguments, an
 * index Buffer's storage written since: shadows is (write counts, id(storage),
 * count, ...), an empty tuple when the call has no index Buffers). */
static PyObject *py_match(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if ((nargs != 2 && nargs != 4) || !PyTuple_Check(args[0]) || !PyBytes_Check(args[1]) ||
        (nargs == 4 && (!PyTuple_Check(args[2]) || !PyTuple_Check(args[3])))) {
        PyErr_SetString(PyExc_TypeError, "match(given: tuple, plan: bytes[, fixed: tuple, shadows: tuple])");
        return NULL;
    }
    const int64_t *p = (const int64_t *)PyBytes_AsString(args[1]);
    if (p == NULL) return NULL;
    int64_t found[SC_PLAN_MAX], n = 0;
    int how = match_core(args[0], p, nargs == 4 ? args[2] : NULL, nargs == 4 ? args[3] : NULL, found, &n);
    if (how == OTHER) Py_RETURN_NONE;
    if (how == REFUSED) Py_RETURN_FALSE;
    PyObject *out = PyList_New((Py_ssize_t)n);
    if (out == NULL) return NULL;
    for (int64_t k = 0; k < n; k++) {
        PyObject *v = PyLong_FromLongLong(found[k]);
        if (v == NULL || PyList_SetItem(out, (Py_ssize_t)k, v) != 0) { /* SetItem steals v */
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

/* place(addresses, targets): for each (k, delta, target) of targets (bytes:
 * n, then n triples of int64), store addresses[k] + delta at the address
 * target (a pointer field of a prepared call's struct).  Returns None. */
static PyObject *py_place(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2 || !PyList_Check(args[0]) || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "place(addresses: list, targets: bytes)");
        return NULL;
    }
    const int64_t *p = (const int64_t *)PyBytes_AsString(args[1]);
    if (p == NULL) return NULL;
    Py_ssize_t n_addresses = PyList_Size(args[0]);
    int64_t n = *p++;
    for (int64_t i = 0; i < n; i++, p += 3) { /* all checked first: nothing written on an error */
        if (p[0] < 0 || p[0] >= n_addresses) {
            PyErr_SetString(PyExc_IndexError, "place: no such address");
            return NULL;
        }
    }
    p -= 3 * n;
    for (int64_t i = 0; i < n; i++, p += 3) {
        long long a = PyLong_AsLongLong(PyList_GetItem(args[0], (Py_ssize_t)p[0]));
        if (a == -1 && PyErr_Occurred()) return NULL;
        *(uintptr_t *)(uintptr_t)p[2] = (uintptr_t)(a + p[1]);
    }
    Py_RETURN_NONE;
}

/* A prepared call as launch() runs it (int64 words; made by
 * statecache.backends.cpu.device, which keeps it and every struct its words
 * point into alive as long as the relaunch):
 *   [0] busy (set while its kernel runs without the GIL), [1] kernel
 *   (SC_LAUNCH_*), [2] number of targets, [3 .. 3 + SC_LAUNCH_ARGS) the
 *   kernel's arguments but n_threads (pointers as addresses, integers as
 *   values), then per target (k, delta, address): store found[k] + delta at
 *   address (a pointer field of a struct, or one of the argument words). */
enum {
    SC_LAUNCH_SSM_CONV = 1,
    SC_LAUNCH_SSM_SCAN = 2,
    SC_LAUNCH_GATED_DELTA_NET = 3,
    SC_LAUNCH_RWKV_WKV6 = 4,
    SC_LAUNCH_RWKV_WKV7 = 5,
    SC_LAUNCH_GATED_LINEAR_ATTN = 6,
    SC_LAUNCH_COPY_ROWS = 7,
    SC_LAUNCH_ZERO_ROWS = 8,
    SC_LAUNCH_LAST = SC_LAUNCH_ZERO_ROWS
};
#define SC_LAUNCH_ARGS 16
#define SC_LAUNCH_HEAD 3

/* A call updating fewer state elements than this (tokens x a pool row's
 * elements: a decode step of a small layer, a microsecond or two) runs with
 * the GIL held, as NumPy runs small operations: releasing and taking it back
 * costs about 0.1 us, a tenth of such a call, and another Python thread
 * would get the GIL for no longer than the kernel runs.  Larger calls
 * release it, as a cffi call does. */
#define SC_LAUNCH_GIL_WORK ((int64_t)1 << 15)

/* A float argument travels as its IEEE-754 bits in the word's low 32 (statecache.backends.cpu.device
 * packs it from the same float32 cffi would pass). */
static float word_float(int64_t w) {
    uint32_t bits = (uint32_t)(uint64_t)w;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The kernel of a block, called with its argument words as its declared
 * types (statecache_cpu.h: the compiler checks these calls against it). */
static void run_kernel(int64_t kernel, const int64_t *a, int n_threads) {
    switch (kernel) {
    case SC_LAUNCH_SSM_CONV:
        sc_ssm_conv((const sc_state *)(uintptr_t)a[0], (const sc_view *)(uintptr_t)a[1], (const float *)(uintptr_t)a[2],
                    (const float *)(uintptr_t)a[3], (void *)(uintptr_t)a[4], (sc_dtype)a[5], a[6], a[7], (int)a[8],
                    n_threads);
        break;
    case SC_LAUNCH_SSM_SCAN:
        sc_ssm_scan((const sc_state *)(uintptr_t)a[0], (const sc_view *)(uintptr_t)a[1], (const sc_view *)(uintptr_t)a[2],
                    (const float *)(uintptr_t)a[3], (int)a[4], (const sc_view *)(uintptr_t)a[5],
                    (const sc_view *)(uintptr_t)a[6], (void *)(uintptr_t)a[7], (sc_dtype)a[8],
                    (const sc_scan_options *)(uintptr_t)a[9], a[10], a[11], a[12], a[13], n_threads);
        break;
    case SC_LAUNCH_GATED_DELTA_NET:
        sc_gated_delta_net((const sc_state *)(uintptr_t)a[0], (const sc_view *)(uintptr_t)a[1],
                           (const sc_view *)(uintptr_t)a[2], (const sc_view *)(uintptr_t)a[3],
                           (const sc_view *)(uintptr_t)a[4], (int)a[5], (const sc_view *)(uintptr_t)a[6],
                           (void *)(uintptr_t)a[7], (sc_dtype)a[8], (const sc_delta_options *)(uintptr_t)a[9], a[10],
                           a[11], a[12], n_threads);
        break;
    case SC_LAUNCH_RWKV_WKV6:
        sc_rwkv_wkv6((const sc_state *)(uintptr_t)a[0], (const sc_view *)(uintptr_t)a[1], (const sc_view *)(uintptr_t)a[2],
                     (const sc_view *)(uintptr_t)a[3], (const sc_view *)(uintptr_t)a[4], (const float *)(uintptr_t)a[5],
                     (void *)(uintptr_t)a[6], (sc_dtype)a[7], word_float(a[8]), a[9], a[10], n_threads);
        break;
    case SC_LAUNCH_RWKV_WKV7:
        sc_rwkv_wkv7((const sc_state *)(uintptr_t)a[0], (const sc_view *)(uintptr_t)a[1], (const sc_view *)(uintptr_t)a[2],
                     (const sc_view *)(uintptr_t)a[3], (const sc_view *)(uintptr_t)a[4], (const sc_view *)(uintptr_t)a[5],
                     (const sc_view *)(uintptr_t)a[6], (void *)(uintptr_t)a[7], (sc_dtype)a[8], word_float(a[9]), a[10],
                     a[11], n_threads);
        break;
    case SC_LAUNCH_GATED_LINEAR_ATTN:
        sc_gated_linear_attn((const sc_state *)(uintptr_t)a[0], (const sc_view *)(uintptr_t)a[1],
                             (const sc_view *)(uintptr_t)a[2], (const sc_view *)(uintptr_t)a[3],
                             (const sc_view *)(uintptr_t)a[4], (void *)(uintptr_t)a[5], (sc_dtype)a[6],
                             word_float(a[7]), a[8], a[9], n_threads);
        break;
    case SC_LAUNCH_COPY_ROWS:
        sc_copy_rows((const void *)(uintptr_t)a[0], (sc_dtype)a[1], (const int32_t *)(uintptr_t)a[2],
                     (void *)(uintptr_t)a[3], (sc_dtype)a[4], (const int32_t *)(uintptr_t)a[5], a[6], a[7], n_threads);
        break;
    case SC_LAUNCH_ZERO_ROWS:
        sc_zero_rows((void *)(uintptr_t)a[0], (sc_dtype)a[1], (const int32_t *)(uintptr_t)a[2], a[3], a[4], n_threads);
        break;
    }
}

/* Elements a block's call moves (its state elements times tokens, or its rows' elements): below
 * SC_LAUNCH_GIL_WORK the call runs with the GIL held. */
static int64_t block_work(int64_t kernel, const int64_t *a) {
    switch (kernel) {
    case SC_LAUNCH_COPY_ROWS:
        return a[6] * a[7];
    case SC_LAUNCH_ZERO_ROWS:
        return a[3] * a[4];
    default: { /* every stateful kernel's first argument */
        const sc_state *st = (const sc_state *)(uintptr_t)a[0];
        return st->n_tokens * st->row_elems;
    }
    }
}

/* launch(given, plan, fixed, shadows, block, n_threads): match (above) and,
 * when the tensors match and every check passes, place their addresses into
 * the block's call and run its kernel (the GIL released, as a cffi call
 * does, unless the call is small: SC_LAUNCH_GIL_WORK): True.  None: another geometry; False: a check failed, or the block
 * is running in another thread (its pointers are in use): nothing done, the
 * ordinary path decides.  One call from Python per relaunch, where match,
 * then place and a cffi call were three (and a Python closure). */
static PyObject *py_launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6 || !PyTuple_Check(args[0]) || !PyBytes_Check(args[1]) || !PyTuple_Check(args[2]) ||
        !PyTuple_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "launch(given: tuple, plan: bytes, fixed: tuple, shadows: tuple, block: int, n_threads: int)");
        return NULL;
    }
    const int64_t *p = (const int64_t *)PyBytes_AsString(args[1]);
    if (p == NULL) return NULL;
    int64_t *block = (int64_t *)PyLong_AsVoidPtr(args[4]);
    if (block == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "launch: no block");
        return NULL;
    }
    long n_threads = PyLong_AsLong(args[5]);
    if (n_threads == -1 && PyErr_Occurred()) return NULL;
    if (n_threads < 1 || n_threads > 1 << 20) {
        PyErr_SetString(PyExc_ValueError, "launch: n_threads must be a positive count");
        return NULL;
    }
    if (block[1] < SC_LAUNCH_SSM_CONV || block[1] > SC_LAUNCH_LAST) {
        PyErr_SetString(PyExc_ValueError, "launch: the block names no kernel");
        return NULL;
    }
    int64_t found[SC_PLAN_MAX], n = 0;
    int how = match_core(args[0], p, args[2], args[3], found, &n);
    if (how == OTHER) Py_RETURN_NONE;
    if (how == REFUSED || block[0] != 0) Py_RETURN_FALSE;
    const int64_t *target = block + SC_LAUNCH_HEAD + SC_LAUNCH_ARGS;
    for (int64_t i = 0; i < block[2]; i++, target += 3) { /* all checked first: nothing written on an error */
        if (target[0] < 0 || target[0] >= n) {
            PyErr_SetString(PyExc_IndexError, "launch: a target names no tensor of the plan");
            return NULL;
        }
    }
    target = block + SC_LAUNCH_HEAD + SC_LAUNCH_ARGS;
    for (int64_t i = 0; i < block[2]; i++, target += 3) {
        *(uintptr_t *)(uintptr_t)target[2] = (uintptr_t)(found[target[0]] + target[1]);
    }
    /* The GIL is held from the check of busy to here, so no other thread can be between them. */
    block[0] = 1;
    if (block_work(block[1], block + SC_LAUNCH_HEAD) < SC_LAUNCH_GIL_WORK) {
        run_kernel(block[1], block + SC_LAUNCH_HEAD, (int)n_threads);
    } else {
        Py_BEGIN_ALLOW_THREADS
        run_kernel(block[1], block + SC_LAUNCH_HEAD, (int)n_threads);
        Py_END_ALLOW_THREADS
    }
    block[0] = 0;
    Py_RETURN_TRUE;
}

/* -- the launch memo's fast path (statecache.launch_memo) ------------------------------------
 *
 * A decode step calls each primitive once per layer with the Buffers of the step before; the
 * launch memo finds the call it validated then (probe) and runs the launch it prepared (a run).
 * Both are the Python code they replace, done in C: about 0.3 us of Python each, several times
 * a one-sequence decode kernel of a small layer. */

/* threads(): statecache.settings.num_threads() without its Python frame, for the runs below.
 * self is (settings' dict, os' dict, num_threads, cores, cache).  The common cases are answered
 * here, reading what num_threads reads: STATECACHE_NUM_THREADS from os.environ's raw mapping
 * (settings._raw_threads_var, while os.environ is the object it was found in), its count as
 * num_threads parsed that value before (cache), else torch.get_num_threads() when torch is in
 * sys.modules and answers a positive int, else the cores.  Anything else (a stand-in
 * os.environ, a value not seen yet or not valid, torch odd or broken) asks num_threads itself,
 * so that answers and errors are its own. */
#define SC_THREADS_CACHE 8

static PyObject *python_threads(PyObject *state, PyObject *cache, PyObject *value) {
    PyObject *n = PyObject_CallNoArgs(PyTuple_GetItem(state, 2));
    if (n != NULL && value != NULL && PyLong_CheckExact(n)) { /* a value's count depends on the value alone */
        if (PyDict_Size(cache) >= SC_THREADS_CACHE) PyDict_Clear(cache);
        if (PyDict_SetItem(cache, value, n) != 0) PyErr_Clear();
    }
    return n;
}

static PyObject *py_threads(PyObject *state, PyObject *unused) {
    (void)unused;
    static PyObject *s_raw = NULL, *s_environ = NULL, *s_torch = NULL, *s_get = NULL;
    if (s_raw == NULL) {
        s_raw = PyUnicode_InternFromString("_raw_threads_var");
        s_environ = PyUnicode_InternFromString("environ");
        s_torch = PyUnicode_InternFromString("torch");
        s_get = PyUnicode_InternFromString("get_num_threads");
        if (s_raw == NULL || s_environ == NULL || s_torch == NULL || s_get == NULL) {
            Py_CLEAR(s_raw);
            return NULL;
        }
    }
    PyObject *settings = PyTuple_GetItem(state, 0), *os = PyTuple_GetItem(state, 1);
    PyObject *cores = PyTuple_GetItem(state, 3), *cache = PyTuple_GetItem(state, 4);
    if (settings == NULL || os == NULL || cores == NULL || cache == NULL) return NULL;
    PyObject *var = PyDict_GetItemWithError(settings, s_raw); /* borrowed */
    PyObject *environ = PyDict_GetItemWithError(os, s_environ);
    if (var == NULL || environ == NULL || !PyTuple_Check(var) || PyTuple_Size(var) != 3 ||
        PyTuple_GetItem(var, 0) != environ) {
        PyErr_Clear();
        return python_threads(state, cache, NULL); /* not looked up yet, or os.environ replaced */
    }
    PyObject *get = PyTuple_GetItem(var, 1), *key = PyTuple_GetItem(var, 2), *value;
    PyObject *data = PyCFunction_Check(get) ? PyCFunction_GetSelf(get) : NULL;
    if (data != NULL && PyDict_CheckExact(data)) { /* the raw mapping's get: look it up directly */
        value = PyDict_GetItemWithError(data, key);
        if (value == NULL && !PyErr_Occurred()) value = Py_None;
        Py_XINCREF(value);
    } else {
        value = PyObject_CallFunctionObjArgs(get, key, NULL);
    }
    if (value == NULL) {
        PyErr_Clear();
        return python_threads(state, cache, NULL);
    }
    int set = PyObject_IsTrue(value);
    if (set != 0) {
        PyObject *n = set < 0 ? NULL : PyDict_GetItemWithError(cache, value);
        if (n != NULL) {
            Py_DECREF(value);
            Py_INCREF(n);
            return n;
        }
        PyErr_Clear();
        n = python_threads(state, cache, set < 0 ? NULL : value);
        Py_DECREF(value);
        return n;
    }
    Py_DECREF(value);
    PyObject *torch = PyDict_GetItemWithError(PyImport_GetModuleDict(), s_torch); /* borrowed */
    if (torch == NULL) {
        if (PyErr_Occurred()) {
            PyErr_Clear();
            return python_threads(state, cache, NULL);
        }
        Py_INCREF(cores);
        return cores;
    }
    Py_INCREF(torch);
    PyObject *torch_get = PyObject_GetAttr(torch, s_get);
    Py_DECREF(torch);
    PyObject *n = torch_get == NULL ? NULL : PyObject_CallNoArgs(torch_get);
    Py_XDECREF(torch_get);
    if (n != NULL && PyLong_CheckExact(n)) {
        long count = PyLong_AsLong(n);
        if (count >= 1) return n;
    }
    Py_XDECREF(n);
    PyErr_Clear();
    return python_threads(state, cache, NULL); /* torch odd, broken or half imported: num_threads decides */
}

static PyMethodDef sc_threads_def = {"threads", (PyCFunction)py_threads, METH_NOARGS,
                                     "statecache.settings.num_threads() in C"};

/* threader(settings_dict, os_dict, num_threads, cores): the threads() of those. */
static PyObject *py_threader(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4 || !PyDict_Check(args[0]) || !PyDict_Check(args[1]) || !PyCallable_Check(args[2]) ||
        !PyLong_CheckExact(args[3])) {
        PyErr_SetString(PyExc_TypeError, "threader(settings_dict, os_dict, num_threads, cores: int)");
        return NULL;
    }
    PyObject *cache = PyDict_New();
    if (cache == NULL) return NULL;
    PyObject *state = PyTuple_Pack(5, args[0], args[1], args[2], args[3], cache);
    Py_DECREF(cache);
    if (state == NULL) return NULL;
    PyObject *threads = PyCFunction_NewEx(&sc_threads_def, state, NULL);
    Py_DECREF(state);
    return threads;
}

/* run(): a prepared call, with the thread count threads() returns.  self is the list
 * [block, threads, keep, kernel, args, build]: kernel(*args, n_threads) is the call through
 * cffi, build() makes its block (bytes: the layout above without targets) or None, keep holds
 * everything the words point into.  The first run (the validated call) goes through cffi and
 * leaves the block to be made by the next one (block None, then True): a call validated every
 * time never pays for it.  With a block (bytes, never written: two threads may run it at once,
 * as two cffi calls of the same arguments could) the kernel is called here, the GIL released
 * unless the call is small (SC_LAUNCH_GIL_WORK); without one (False: build said None) through
 * cffi. */
enum { RUN_BLOCK, RUN_THREADS, RUN_KEEP, RUN_KERNEL, RUN_ARGS, RUN_BUILD, RUN_SLOTS };
#define SC_BLOCK_BYTES ((Py_ssize_t)sizeof(int64_t) * (SC_LAUNCH_HEAD + SC_LAUNCH_ARGS))

static PyObject *run_through_cffi(PyObject *self, PyObject *count) {
    PyObject *args = PyList_GetItem(self, RUN_ARGS);
    if (args == NULL || !PyTuple_Check(args)) return NULL;
    Py_ssize_t n = PyTuple_Size(args);
    PyObject *full = PyTuple_New(n + 1);
    if (full == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GetItem(args, i);
        Py_INCREF(item);
        PyTuple_SetItem(full, i, item); /* steals the reference just taken */
    }
    Py_INCREF(count);
    PyTuple_SetItem(full, n, count);
    PyObject *r = PyObject_Call(PyList_GetItem(self, RUN_KERNEL), full, NULL);
    Py_DECREF(full);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

static PyObject *py_run(PyObject *self, PyObject *unused) {
    (void)unused;
    PyObject *made = PyList_GetItem(self, RUN_BLOCK); /* borrowed */
    if (made == NULL) return NULL;
    PyObject *count = PyObject_CallNoArgs(PyList_GetItem(self, RUN_THREADS));
    if (count == NULL) return NULL; /* the thread count's own error (a bad STATECACHE_NUM_THREADS) */
    long n_threads = PyLong_AsLong(count);
    if ((n_threads == -1 && PyErr_Occurred()) || n_threads < 1 || n_threads > 1 << 20) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "run: the thread count must be a positive count");
        Py_DECREF(count);
        return NULL;
    }
    if (made == Py_True) { /* met again: worth a block */
        PyObject *block = PyObject_CallNoArgs(PyList_GetItem(self, RUN_BUILD));
        if (block == NULL) {
            Py_DECREF(count);
            return NULL;
        }
        if (!PyBytes_Check(block) || PyBytes_Size(block) != SC_BLOCK_BYTES) {
            Py_DECREF(block);
            block = Py_False; /* a call no block carries: cffi from now on */
            Py_INCREF(block);
        }
        if (PyList_SetItem(self, RUN_BLOCK, block) != 0) { /* steals block */
            Py_DECREF(count);
            return NULL;
        }
        made = block;
    }
    if (!PyBytes_Check(made)) {
        if (made == Py_None) { /* the first run: the next one makes the block */
            Py_INCREF(Py_True);
            if (PyList_SetItem(self, RUN_BLOCK, Py_True) != 0) {
                Py_DECREF(count);
                return NULL;
            }
        }
        PyObject *r = run_through_cffi(self, count);
        Py_DECREF(count);
        return r;
    }
    Py_DECREF(count);
    int64_t block[SC_LAUNCH_HEAD + SC_LAUNCH_ARGS]; /* copied: bytes promise no alignment */
    memcpy(block, PyBytes_AsString(made), sizeof block);
    if (block[1] < SC_LAUNCH_SSM_CONV || block[1] > SC_LAUNCH_LAST || block[2] != 0) {
        PyErr_SetString(PyExc_ValueError, "run: the block names no kernel, or has targets");
        return NULL;
    }
    const int64_t *a = block + SC_LAUNCH_HEAD;
    if (block_work(block[1], a) < SC_LAUNCH_GIL_WORK) {
        run_kernel(block[1], a, (int)n_threads);
    } else {
        Py_BEGIN_ALLOW_THREADS
        run_kernel(block[1], a, (int)n_threads);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyMethodDef sc_run_def = {"run", (PyCFunction)py_run, METH_NOARGS, "run a prepared call"};

/* runner(kernel, args, threads, keep, build): the run() of kernel(*args, n_threads) (above), a
 * builtin taking no arguments. */
static PyObject *py_runner(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5 || !PyCallable_Check(args[0]) || !PyTuple_Check(args[1]) || !PyCallable_Check(args[2]) ||
        !PyCallable_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "runner(kernel, args: tuple, threads: callable, keep, build: callable)");
        return NULL;
    }
    PyObject *bound = PyList_New(RUN_SLOTS);
    if (bound == NULL) return NULL;
    PyObject *items[RUN_SLOTS] = {Py_None, args[2], args[3], args[0], args[1], args[4]};
    for (int i = 0; i < RUN_SLOTS; i++) {
        Py_INCREF(items[i]);
        PyList_SetItem(bound, i, items[i]); /* steals the reference just taken */
    }
    PyObject *run = PyCFunction_NewEx(&sc_run_def, bound, NULL);
    Py_DECREF(bound);
    return run;
}

/* probe(key, caps): statecache.launch_memo.LaunchMemo.probe over self = (entries, writes), the
 * memo's dict and STORAGE_WRITES: the entry of key when its capabilities are caps, it is probed
 * (stamps not None), its buffers are alive (live[0]) and every (storage, count) of its stamps
 * is the storage's count in writes; else None (also for an unhashable key). */
static PyObject *py_probe(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    static PyObject *s_caps = NULL, *s_stamps = NULL, *s_live = NULL;
    if (s_caps == NULL) {
        s_caps = PyUnicode_InternFromString("caps");
        s_stamps = PyUnicode_InternFromString("stamps");
        s_live = PyUnicode_InternFromString("live");
        if (s_caps == NULL || s_stamps == NULL || s_live == NULL) {
            Py_CLEAR(s_caps);
            Py_CLEAR(s_stamps);
            Py_CLEAR(s_live);
            return NULL;
        }
    }
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "probe(key, caps) takes 2 arguments");
        return NULL;
    }
    PyObject *entries = PyTuple_GetItem(self, 0), *writes = PyTuple_GetItem(self, 1);
    if (entries == NULL || writes == NULL) return NULL;
    PyObject *entry = PyDict_GetItemWithError(entries, args[0]); /* borrowed */
    if (entry == NULL) {
        if (PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) return NULL;
            PyErr_Clear(); /* an unhashable scalar: validation says what is wrong */
        }
        Py_RETURN_NONE;
    }
    Py_INCREF(entry);
    PyObject *found = NULL, *caps = NULL, *stamps = NULL, *live = NULL;
    if ((caps = PyObject_GetAttr(entry, s_caps)) == NULL) goto done;
    if (caps != args[1]) goto miss;
    if ((stamps = PyObject_GetAttr(entry, s_stamps)) == NULL) goto done;
    if (stamps == Py_None) goto miss; /* not probed: matched by geometry, or index buffers of no known storage */
    if ((live = PyObject_GetAttr(entry, s_live)) == NULL) goto done;
    PyObject *flag = PyList_GetItem(live, 0); /* borrowed */
    if (flag == NULL) goto done;
    int alive = PyObject_IsTrue(flag);
    if (alive < 0) goto done;
    if (!alive) goto miss; /* a buffer died: its id may be another object's now */
    Py_ssize_t n = PyTuple_Size(stamps);
    if (n < 0) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *stamp = PyTuple_GetItem(stamps, i);
        if (stamp == NULL) goto done;
        PyObject *storage = PyTuple_GetItem(stamp, 0), *count = PyTuple_GetItem(stamp, 1);
        if (storage == NULL || count == NULL) goto done;
        PyObject *now = PyDict_GetItemWithError(writes, storage); /* borrowed */
        if (now == NULL) {
            if (PyErr_Occurred()) goto done;
            goto miss; /* None != count */
        }
        int same = PyObject_RichCompareBool(now, count, Py_EQ);
        if (same < 0) goto done;
        if (!same) goto miss; /* written since: validate again */
    }
    found = entry;
    Py_INCREF(found);
    goto done;
miss:
    found = Py_None;
    Py_INCREF(found);
done:
    Py_XDECREF(caps);
    Py_XDECREF(stamps);
    Py_XDECREF(live);
    Py_DECREF(entry);
    return found;
}

static PyMethodDef sc_probe_def = {"probe", (PyCFunction)(void (*)(void))py_probe, METH_FASTCALL,
                                   "probe(key, caps): LaunchMemo.probe in C"};

/* prober(entries, writes): the probe() of a memo's dict (the dict itself, so the memo must keep
 * that dict, not replace it) and STORAGE_WRITES. */
static PyObject *py_prober(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2 || !PyDict_Check(args[0]) || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "prober(entries: dict, writes: dict)");
        return NULL;
    }
    PyObject *bound = PyTuple_Pack(2, args[0], args[1]);
    if (bound == NULL) return NULL;
    PyObject *probe = PyCFunction_NewEx(&sc_probe_def, bound, NULL);
    Py_DECREF(bound);
    return probe;
}

static PyMethodDef sc_dlpack_defs[] = {
    {"read", (PyCFunction)(void (*)(void))py_read, METH_FASTCALL, "read(obj, from_py): a tensor's reading"},
    {"match", (PyCFunction)(void (*)(void))py_match, METH_FASTCALL, "match(given, plan): addresses, None or False"},
    {"place", (PyCFunction)(void (*)(void))py_place, METH_FASTCALL, "place(addresses, targets): set pointer fields"},
    {"launch", (PyCFunction)(void (*)(void))py_launch, METH_FASTCALL, "launch(given, plan, fixed, shadows, block, "
     "n_threads): match, place and run a prepared call"},
    {"runner", (PyCFunction)(void (*)(void))py_runner, METH_FASTCALL, "runner(kernel, args, threads, keep, build): a prepared call's run()"},
    {"prober", (PyCFunction)(void (*)(void))py_prober, METH_FASTCALL, "prober(entries, writes): a memo's probe()"},
    {"threader", (PyCFunction)(void (*)(void))py_threader, METH_FASTCALL,
     "threader(settings_dict, os_dict, num_threads, cores): num_threads() in C"},
};

/* (read, match, place, launch, runner, prober, threader) as Python builtins (called like any builtin: the
 * GIL held, no ctypes conversions per call); made once, kept for the process.  Returns a new
 * reference (ctypes takes a py_object result as one), NULL on failure. */
void *sc_dlpack_functions(void) {
    static PyObject *functions = NULL;
    if (functions == NULL) {
        enum { N = sizeof sc_dlpack_defs / sizeof sc_dlpack_defs[0] };
        PyObject *made[N];
        int ok = 1;
        for (int i = 0; i < N; i++) {
            made[i] = PyCFunction_NewEx(&sc_dlpack_defs[i], NULL, NULL);
            ok = ok && made[i] != NULL;
        }
        if (ok) {
            functions = PyTuple_New(N);
            for (int i = 0; functions != NULL && i < N; i++) {
                Py_INCREF(made[i]);
                PyTuple_SetItem(functions, i, made[i]); /* steals the reference just taken */
            }
        }
        for (int i = 0; i < N; i++) Py_XDECREF(made[i]);
        if (functions == NULL) return NULL;
    }
    Py_INCREF(functions);
    return functions;
}
