/* Reading torch-like tensors' geometry through the DLPack C exchange API
 * (dlpack.h 1.2+, __dlpack_c_exchange_api__): for the relaunch path of
 * statecache.tensor_args, which compares a call's tensors with a validated
 * geometry.  Unlike the kernels these touch Python objects: Python calls them
 * through ctypes.PYFUNCTYPE (the GIL held), never through cffi (which drops
 * it); the objects are declared void * so that cffi can take their addresses.
 * Not part of the kernels' ABI (statecache_cpu.h). */
#ifndef SC_DLPACK_H
#define SC_DLPACK_H

#include <stdint.h>

int64_t sc_dlpack_read(void *obj, void *from_py, int64_t *out, int64_t cap);
int32_t sc_dlpack_match(void *given, void *addresses, const int64_t *plan);

#endif
