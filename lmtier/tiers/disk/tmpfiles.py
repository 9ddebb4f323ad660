"""Names of the disk tier's temporary record files, and which of them a starting tier may delete.

A record is written to a temporary file in its shard directory and renamed into place
(:class:`lmtier.tiers.disk.DiskTier`)::

    <root>/<kk>/.<key hex>.<pid>.<token>.<n>.tmp

``pid``: the writing process; ``token``: 16 hex digits drawn at random for each tier instance
(:class:`TmpNames`); ``n``: that instance's counter. A tier that starts removes the temporary files
left by crashed writers (:func:`is_stale`) but never one a live writer may still own, even when
several tier instances — in several processes, or in this one — share a directory:

* another process's file: stale only when that process is gone (``kill(pid, 0)``: no such process);
* a file of this process: stale unless its token is one of a live instance here (instances register
  their token while open: :meth:`TmpNames.release` at ``close()``, or when the instance is garbage
  collected). An unknown token is an earlier process that had this pid (a container restarted with
  the same pid), or an instance here that is closed;
* an older lmtier's ``.<key hex>.<pid>.<n>.tmp`` (no token) follows the same rules, and is always
  stale when the pid is this process's (no live writer here names files that way);
* a ``.tmp`` name of neither form in a shard directory is stale.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref

__all__ = ["TMP_SUFFIX", "TmpNames", "is_stale"]

TMP_SUFFIX = ".tmp"

_live_tokens: set[str] = set()
_live_lock = threading.Lock()


def _release(token: str) -> None:
    with _live_lock:
        _live_tokens.discard(token)


class TmpNames:
    """Temporary file names of one tier instance; its token counts as live until :meth:`release`
    (or until this object is garbage collected).

    Attributes:
        token: 16 lower-case hex digits, random, unique among the live instances of this process.
    """

    def __init__(self) -> None:
        with _live_lock:
            token = os.urandom(8).hex()
            while token in _live_tokens:
                token = os.urandom(8).hex()
            _live_tokens.add(token)
        self.token = token
        self._seq = itertools.count()
        self._finalizer = weakref.finalize(self, _release, token)

    def record(self, key_hex: str) -> str:
        """The file name (no directory) of a new temporary record for the key ``key_hex``."""
        return f".{key_hex}.{os.getpid()}.{self.token}.{next(self._seq)}{TMP_SUFFIX}"

    def probe(self, what: str) -> str:
        """The file name of a short-lived probe file (e.g. ``what="odirect-probe"``)."""
        return f".{what}.{os.getpid()}.{self.token}{TMP_SUFFIX}"

    def release(self) -> None:
        """This instance writes no more: its leftovers are stale to the next tier that starts."""
        self._finalizer()


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def is_stale(name: str) -> bool:
    """Whether the temporary file ``name`` (a shard directory's ``*.tmp``) belongs to no live writer
    (the rules in the module doc)."""
    parts = name.split(".")  # "", key hex, pid, [token,] n, "tmp"
    if len(parts) not in (5, 6) or parts[0] or not (parts[2].isascii() and parts[2].isdigit()):
        return True
    pid = int(parts[2])
    if pid <= 0:
        return True
    if pid != os.getpid():
        return not _process_alive(pid)
    if len(parts) == 5:
        return True
    with _live_lock:
        return parts[3] not in _live_tokens
