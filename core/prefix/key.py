"""What two requests must share, besides their tokens, to share a checkpoint.

A checkpoint is reusable only by a request whose tokens start with its
tokens *and* whose state would have been computed the same way: the same
memory layout (layers, tensor widths, storage dtypes: the layout
fingerprint), the same state format version, and the same extra key (an
adapter, an image hash, a system salt: anything the runtime knows changes
the state without changing the token ids).  :func:`namespace` folds those
into one digest; the tree keeps one root per digest, so requests of
different namespaces never share a node.
"""

from __future__ import annotations

import hashlib

import numpy as np

from statecache.errors import ArgumentError
from statecache.state_io import FORMAT_VERSION

#: What the extra key may be: bytes, text, an integer, or None (no extra key).
ExtraKey = bytes | str | int | None


def _canonical(extra: ExtraKey) -> bytes:
    if extra is None:
        return b"n"
    if isinstance(extra, bool):  # a bool is an int to Python, never a meaningful key here
        raise ArgumentError("extra", "must be bytes, str, int or None, got bool")
    if isinstance(extra, bytes):
        return b"b" + extra
    if isinstance(extra, str):
        return b"s" + extra.encode("utf-8")
    if isinstance(extra, int):
        return b"i" + str(extra).encode()
    raise ArgumentError("extra", f"must be bytes, str, int or None, got {type(extra).__name__}")


def namespace(fingerprint: str, extra: ExtraKey = None, salt: bytes = b"") -> bytes:
    """The digest that roots a request's tokens in the tree.

    :param fingerprint: the memory layout (:attr:`statecache.prefix.store.Layout.fingerprint`).
    :param extra: the request's extra key (``None``: none).
    :param salt: a cache-wide salt (e.g. a deployment id), same for every request.
    """
    h = hashlib.sha256()
    for part in (b"statecache.prefix/1", str(FORMAT_VERSION).encode(), fingerprint.encode(), salt, _canonical(extra)):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()[:16]


#: The largest token id: a batch holds ids that fit int32 (and the cache file writes them as u32).
TOKEN_MAX = 2**31 - 1


def check_tokens(tokens: object, argument: str = "tokens") -> tuple[int, ...]:
    """Token ids as a tuple of ints in ``[0, TOKEN_MAX]``; a clear error otherwise.

    The batch's rule: integer ids that fit int32.  A float id is refused, not
    truncated (``1.5`` keyed as ``1`` would hit another prompt's checkpoint),
    and so is an id no batch can hold (``save`` could not write it either)."""
    if not hasattr(tokens, "__len__"):
        try:
            tokens = list(tokens)  # type: ignore[call-overload]
        except TypeError as exc:
            raise ArgumentError(argument, f"must be a sequence of token ids ({exc})") from exc
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError) as exc:
        raise ArgumentError(argument, f"must be a sequence of token ids ({exc})") from exc
    if arr.size == 0 and arr.ndim == 1:
        return ()
    if arr.ndim != 1:
        raise ArgumentError(argument, f"must be a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ArgumentError(argument, f"token ids must be integers that fit int32, got {arr.dtype} values")
    if int(arr.min()) < 0:
        raise ArgumentError(argument, "token ids must be >= 0")
    if int(arr.max()) > TOKEN_MAX:
        raise ArgumentError(argument, f"token ids must fit int32 (<= {TOKEN_MAX}), got {int(arr.max())}")
    return tuple(arr.tolist())
