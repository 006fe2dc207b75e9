"""The ``statecache`` command.

Exit codes: 0 success; 1 a check failed (conformance case failures, a
required device missing); 2 usage error (bad arguments, unknown backend or
device, a missing file, an environment variable with an unusable value).

Everything printed that comes from data (backend names, reasons, case ids,
paths, exception messages) is printed literally: rich would read
``statecache[opencl]`` or ``get_rows[r32-...]`` as markup and drop the
brackets.  Only the labels we write ourselves carry a style.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import IO, Any

from statecache import __version__

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

#: Columns of output that is not a terminal (a pipe, a CI log): rich would
#: fold every table at 80.  ``--width`` overrides it in both cases.
NON_TERMINAL_WIDTH = 200


def make_console(width: int | None = None, file: IO[str] | None = None) -> Any:
    """A rich console for the commands: ``width`` columns if given, else the
    terminal's, else :data:`NON_TERMINAL_WIDTH`; no automatic highlighting."""
    from rich.console import Console

    stream = file if file is not None else sys.stdout
    isatty = getattr(stream, "isatty", None)
    if width is None and not (isatty is not None and isatty()):
        width = NON_TERMINAL_WIDTH
    return Console(file=file, width=width, highlight=False)


def say(console: Any, text: str, *, label: str = "", style: str = "") -> None:
    """Print one line: an optional styled ``label`` then ``text`` verbatim.

    Lines are not folded at the console width (soft wrap): a reason or a
    path stays one line a reader can copy, and a terminal wraps it anyway."""
    from rich.text import Text

    line = Text()
    if label:
        line.append(label, style=style)
        line.append(" ")
    line.append(text)
    console.print(line, soft_wrap=True)


def usage_error(console: Any, text: str) -> int:
    """Report a usage error in one line and return :data:`EXIT_USAGE`."""
    say(console, text, label="usage error:", style="bold red")
    return EXIT_USAGE


@contextmanager
def reported_warnings(console: Any) -> Iterator[None]:
    """Show statecache's warnings raised inside the block as ``warning:`` lines
    (Python's default format names our source file and line, which tells a
    user nothing)."""
    from statecache.errors import StatecacheWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", StatecacheWarning)
        yield
    for w in caught:
        if issubclass(w.category, StatecacheWarning):
            say(console, str(w.message), label="warning:", style="yellow")
        else:  # anything else keeps its usual route
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def _cmd_backends(args: argparse.Namespace) -> int:
    from rich.table import Table
    from rich.text import Text

    from statecache import settings
    from statecache.registry import BackendRegistry

    console = make_console(args.width)
    with reported_warnings(console):
        registry = BackendRegistry()
    table = Table(title="statecache backends")
    for col in ("backend", "distribution", "status", "devices", "caps"):
        table.add_column(col)
    reasons: list[tuple[str, str]] = []
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
                ok, reason = False, f"listing devices raised {type(exc).__name__}: {exc}"
        status = Text("available", style="green") if ok else Text("unavailable (see below)", style="red")
        if not ok:
            reasons.append((entry.name, reason))
        version = entry.backend.version if entry.backend else entry.dist_version
        table.add_row(Text(entry.name), Text(f"{entry.distribution} {version}"), status, Text(devices), Text(caps))
    console.print(table)
    # Reasons go below the table, whole: inside a cell they were folded (or cut
    # with an ellipsis) to the column's width.
    for name, reason in reasons:
        say(console, reason, label=f"{name}: unavailable:", style="red")
    if not registry.names():
        say(console, registry.why_empty(), label="no backend:", style="yellow")
    problems = settings.problems()
    for problem in problems:
        usage_error(console, problem)
    return EXIT_USAGE if problems else EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="statecache", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"statecache {__version__}")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser(
        "backends",
        help="list backends, their availability, devices and caps",
        description=(
            "List every installed backend (built-in or plugin): the distribution that provides it and its "
            "version, whether it is usable on this machine (and the reason when not), its devices and their "
            "capabilities (primitives, storage dtypes, snapshot planes). Honours STATECACHE_BACKENDS."
        ),
    )
    p.add_argument(
        "--width", type=int, default=None, help=f"table width (default: the terminal's, or {NON_TERMINAL_WIDTH})"
    )
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
