"""The ``statecache`` command.

Exit codes: 0 success; 1 a check failed (conformance case failures, a
required device missing); 2 usage error (bad arguments, unknown backend).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from statecache import __version__

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


def _cmd_backends(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from statecache.registry import BackendRegistry

    registry = BackendRegistry()
    table = Table(title="statecache backends")
    for col in ("backend", "distribution", "status", "devices", "caps"):
        table.add_column(col)
    for entry in registry.entries():
        ok, reason = entry.availability()
        devices = ""
        caps = ""
        if ok and entry.backend is not None:
            try:
                devs = list(entry.backend.devices())
                devices = "\n".join(f"{d.id} {d.name}" for d in devs) or "none"
                if devs:
                    c = devs[0].caps
                    caps = (
                        f"{len(c.ops)} ops; "
                        + ",".join(sorted(d.value for d in c.storage_dtypes))
                        + f"; snap<={c.max_snapshots}"
                    )
            except Exception as exc:  # listing must never crash
                ok, reason = False, f"device listing raised {exc}"
        status = "available" if ok else f"unavailable: {reason}"
        version = entry.backend.version if entry.backend else entry.dist_version
        table.add_row(entry.name, f"{entry.distribution} {version}", status, devices, caps)
    Console(width=args.width).print(table)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="statecache", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"statecache {__version__}")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("backends", help="list backends, their availability, devices and caps")
    p.add_argument("--width", type=int, default=None, help="table width (default: terminal)")
    p.set_defaults(func=_cmd_backends)
    try:
        from statecache.conformance import cli as conformance_cli
    except ImportError:
        conformance_cli = None
    if conformance_cli is not None:
        conformance_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
