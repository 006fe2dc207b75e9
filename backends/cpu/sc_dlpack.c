/* See sc_dlpack.h.  Layouts shared with statecache.backends.cpu.device
 * (DlpackReader), all int64:
 *
 * a reading (sc_dlpack_read's out): address (data + byte_offset), ndim,
 *   dtype word (code | bits << 8 | lanes << 16), device word
 *   (device_type | device_id << 32), shape[ndim], strides[ndim] (in elements;
 *   C order when the producer gives none);
 * a plan (sc_dlpack_match's): n, then per tensor: position in the argument
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
 * relaunch takes from each call. */
#include <Python.h>
#include <string.h>

#include "sc_dlpack.h"

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

/* The reading of obj (layout above) into out[cap]: the number of words
 * written, or -1 (the producer refused, or out is too small). */
int64_t sc_dlpack_read(void *obj, void *from_py, int64_t *out, int64_t cap) {
    sc_dl_tensor t;
    if (fill(obj, from_py, &t) != 0) return -1;
    int64_t n = 4 + 2 * (int64_t)t.ndim;
    if (n > cap) return -1;
    out[0] = (int64_t)((uintptr_t)t.data + t.byte_offset);
    out[1] = t.ndim;
    out[2] = dtype_word(&t);
    out[3] = device_word(&t);
    for (int32_t i = 0; i < t.ndim; i++) {
        out[4 + i] = t.shape[i];
        out[4 + t.ndim + i] = stride_at(&t, i);
    }
    return n;
}

/* Whether every tensor of the plan has its geometry in the tuple `given`
 * and the checks pass (1; their addresses are then stored into the list
 * `addresses`, which has one item per tensor); 0: a position holds another
 * type or another geometry, or a producer refused; 2: the geometry matched
 * and a check failed (misaligned, or written memory overlapping other
 * arguments).  No Python error is left set. */
int32_t sc_dlpack_match(void *given, void *addresses, const int64_t *plan) {
    PyObject *args = (PyObject *)given;
    PyObject *out = (PyObject *)addresses;
    int64_t n = plan[0];
    const int64_t *p = plan + 1;
    int64_t found[64];
    if (n > 64 || !PyTuple_Check(args) || !PyList_Check(out) || PyList_Size(out) != n) return 0;
    for (int64_t k = 0; k < n; k++) {
        PyObject *obj = PyTuple_GetItem(args, (Py_ssize_t)p[0]);
        if (obj == NULL) {
            PyErr_Clear();
            return 0;
        }
        if ((int64_t)(uintptr_t)Py_TYPE(obj) != p[1]) return 0;
        sc_dl_tensor t;
        if (fill(obj, (void *)(uintptr_t)p[2], &t) != 0) return 0;
        int32_t ndim = t.ndim;
        if (ndim != p[3] || dtype_word(&t) != p[4] || device_word(&t) != p[5]) return 0;
        const int64_t *shape = p + 6, *strides = p + 6 + ndim;
        for (int32_t i = 0; i < ndim; i++) {
            if (t.shape[i] != shape[i] || stride_at(&t, i) != strides[i]) return 0;
        }
        found[k] = (int64_t)((uintptr_t)t.data + t.byte_offset);
        p += 6 + 2 * (int64_t)ndim;
    }
    int64_t bits = 0;
    for (int64_t k = 0; k < n; k++) bits |= found[k];
    if (bits & p[0]) return 2;
    int64_t n_pairs = p[1];
    p += 2;
    for (int64_t i = 0; i < n_pairs; i++, p += 4) {
        int64_t d = found[p[0]] - found[p[1]];
        if (p[2] < d && d < p[3]) return 2;
    }
    n_pairs = p[0];
    p += 1;
    for (int64_t i = 0; i < n_pairs; i++, p += 3) {
        if (p[1] < found[p[0]] && found[p[0]] < p[2]) return 2;
    }
    for (int64_t k = 0; k < n; k++) {
        PyObject *value = PyLong_FromLongLong(found[k]);
        if (value == NULL || PyList_SetItem(out, (Py_ssize_t)k, value) != 0) { /* SetItem steals value */
            PyErr_Clear();
            return 0;
        }
    }
    return 1;
}
