/* Reading torch-like tensors' geometry through the DLPack C exchange API
 * (dlpack.h 1.2+, __dlpack_c_exchange_api__) for the relaunch path of
 * statecache.tensor_args, which compares a call's tensors with a validated
 * geometry; placing the addresses found into a prepared call's structs
 * (statecache.backends.cpu.device); and all of it plus the kernel in one
 * call (launch).  Unlike the kernels these touch Python objects, so they are
 * Python builtins (called with the GIL held, which a cffi call would drop):
 * sc_dlpack_functions returns a new reference to the tuple
 * (read, match, place, launch, runner, prober, threader: the launch
 * memo's prepared calls, probe and thread count in C), declared void * so that cffi can give its
 * address for ctypes to call once.  Not part of the kernels' ABI
 * (statecache_cpu.h). */
#ifndef SC_DLPACK_H
#define SC_DLPACK_H

#include <stdint.h>

void *sc_dlpack_functions(void);

#endif
