"""DEBUG logging of reads through the ``logging`` logger named ``"safeload"``.

    import logging
    logging.basicConfig()
    logging.getLogger("safeload").setLevel(logging.DEBUG)

Each ``get_tensors`` / ``load_file`` / ``load_checkpoint`` / ``iter_checkpoint`` (once exhausted) /
``load_into`` / ``load_model`` then logs one line: backend, threads, chunk size, bytes read, time
and rate; a ``safe_open`` handle logs its totals (slices and ``get_tensor`` included) when it
closes. The record's ``safeload_read`` attribute holds the same fields as a dict (with ``what``
and ``path``), for handlers that count. Costs one ``isEnabledFor`` check when DEBUG is off.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger("safeload")

_FIELDS = ("backend", "threads", "chunk_bytes", "bytes_read", "seconds", "storage")


def _size(n: Any) -> str:
    n = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def _fields(stats_like: Any) -> dict:
    if not isinstance(stats_like, dict) and not hasattr(stats_like, "bytes_read"):
        stats = getattr(stats_like, "stats", None)
        if stats is not None and not callable(stats):
            stats_like = stats  # a safe_open handle: its totals so far
    if isinstance(stats_like, dict):
        return {k: stats_like.get(k) for k in _FIELDS}
    return {k: getattr(stats_like, k, None) for k in _FIELDS}


def log_read(path: Any, stats_like: Any, what: str = "read") -> None:
    """Log one read at DEBUG. ``path``: a path, or a list of shard paths. ``stats_like``: a
    :class:`safeload._open.Stats`, a dict with its field names, or a ``safe_open`` handle (its
    ``.stats`` is read only when DEBUG is on). ``what``: the operation ("get_tensors", ...)."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    try:
        f = _fields(stats_like)
        if isinstance(path, (list, tuple)):
            where = f"{len(path)} files ({os.fspath(path[0])}, ...)" if len(path) > 1 else os.fspath(path[0])
        else:
            where = os.fspath(path)
        seconds = f["seconds"] or 0.0
        nbytes = f["bytes_read"] or 0
        rate = nbytes / seconds / 2**30 if seconds else 0.0
        chunk = _size(f["chunk_bytes"]) if f["chunk_bytes"] else "-"
        storage = f" storage={f['storage']}" if f["storage"] else ""
        logger.debug(
            "%s %s: backend=%s threads=%s chunk=%s read=%s in %.3fs (%.2f GiB/s)%s",
            what, where, f["backend"], f["threads"], chunk, _size(nbytes), seconds, rate, storage,
            extra={"safeload_read": dict(f, what=what, path=where)},
        )
        log_memory()
    except Exception:  # noqa: BLE001 - logging must never break a load
        logger.debug("%s %s: (stats unavailable)", what, path, exc_info=True)


def log_verified(pinned: Any) -> None:
    """Log at INFO each file a ``verify=`` load checked (``(path, where its digest came
    from)``), and each it loaded unverified (no digest known, under ``SAFELOAD_VERIFY=1``)."""
    for path, source in pinned:
        if source is None:
            logger.info("loaded %s unverified: no SHA-256 is known for it (SAFELOAD_VERIFY=1)", path)
        else:
            logger.info("verified %s: SHA-256 matches %s", path, source)


def log_memory() -> None:
    """Log at DEBUG what the pool of freed memory keeps, under which bound (see docs/backends.md,
    "Repeated loads")."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    from ._safeload import memory_info

    m = memory_info()
    bound = lambda v: _size(v) if v is not None else "-"  # noqa: E731
    logger.debug(
        "memory: pool keeps %s (limit %s); safeload holds %s; available %s (host %s, container "
        "%s, SAFELOAD_MEMORY_LIMIT %s)",
        _size(m["pooled"]), _size(m["pool_limit"]), _size(m["held"]), bound(m["available"]),
        bound(m["host"]), bound(m["container"]), bound(m["user"]),
    )
