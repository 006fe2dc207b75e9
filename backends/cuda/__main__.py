"""``python -m statecache.backends.cuda build|info``.

``build`` compiles (or finds in the cache) libstatecache_cuda.so and prints
its path and the build time; on failure it prints nvcc's output and exits 1.
``info`` prints the backend's availability and its devices.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _build(args: argparse.Namespace) -> int:
    from statecache.backends.cuda import build

    tc = build.toolchain()
    if tc is None:
        print("nvcc not found (PATH, CUDA_HOME, CUDA_PATH, /usr/local/cuda)", file=sys.stderr)
        return 1
    print(tc.version_text.splitlines()[-1] if tc.version_text else tc.nvcc)
    try:
        result = build.ensure_built(args.cache_dir, tc)
    except build.BuildError as exc:
        print(exc, file=sys.stderr)
        return 1
    how = f"built in {result.seconds:.1f} s" if result.built else "found in the cache"
    print(f"{result.path} ({how})")
    from statecache.backends.cuda.device import load_library

    runtime = load_library(result.path)
    count, status = runtime.device_count()
    devices = f"{count} device(s)" if status == 0 else f"no usable device: {runtime.error_text(status)}"
    print(f"ABI version {int(runtime.lib.statecache_cuda_abi_version())}; {devices}")
    return 0


def _info(args: argparse.Namespace) -> int:
    from statecache.backends.cuda.device import CudaBackend

    backend = CudaBackend(args.cache_dir)
    ok, reason = backend.availability()
    print("available" if ok else f"unavailable: {reason}")
    for device in backend.devices():
        print(device.id, device.name, device.properties)
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m statecache.backends.cuda", description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default=None, help="where built libraries go (default: <cache dir>/cuda)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build (or find) the library").set_defaults(func=_build)
    sub.add_parser("info", help="availability and devices").set_defaults(func=_info)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
