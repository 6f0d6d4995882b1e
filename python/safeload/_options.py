"""The options every loader takes, in one place: their type, their documentation, and the one call
that turns them into the reader's ``OpenOptions`` (parsed, checked and given its defaults in Rust,
``src/py/options.rs``). Public loaders name the options they take (tests/test_contract.py pins
each one's list) and build one ``OpenOptions`` with :func:`open_options`; what lies beneath takes
that one value, or ``**options`` typed by :class:`Options`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional, TypedDict

from ._safeload import OpenOptions

if TYPE_CHECKING:
    from typing_extensions import Unpack


class Options(TypedDict, total=False):
    """The options of an open, each optional; what is not given is the reader's default.

    backend: ``"auto"`` (the default, when None: chosen per file from the filesystem and the page
        cache), ``"pread"`` (parallel reader), ``"direct"`` (O_DIRECT, around the page cache), or
        ``"mmap"`` (zero-copy private mappings, as safetensors' default). ``$SAFELOAD_BACKEND``
        replaces the default.
    threads, chunk_bytes: tuning of the parallel reader (None: picked from the cores and the
        storage).
    drop_cache: drop the files' pages from the page cache after each read (default False).
    storage_options: for URLs (``s3://``, ``gs://``, ``az://``, ``http(s)://``), the store's
        settings over the environment's (fsspec / obstore keys; see docs/object-storage.md).
    verify: each file's SHA-256, checked before anything of it is returned: ``{file name:
        digest}`` (names relative to the directory or the index's folder; a file's bare name), a
        ``sha256sum`` manifest's path, or True (the digests the source knows: the Hugging Face
        cache's blob names, the Hub's reported digests, a ``SHA256SUMS`` beside the files). A
        verified file is read and hashed whole, and its tensors are served from those bytes.
        None: ``$SAFELOAD_VERIFY`` decides; False: off. See docs/verification.md.
    verify_cache: a directory for the verified record (``$SAFELOAD_VERIFY_CACHE``): a file that
        hashed right is remembered with its identity, and a later load of it unchanged skips the
        hash. See docs/verification.md.
    """

    backend: Optional[str]
    threads: Optional[int]
    chunk_bytes: Optional[int]
    drop_cache: bool
    storage_options: Optional[Dict[str, Any]]
    verify: Any
    verify_cache: Any


def open_options(**options: Unpack[Options]) -> OpenOptions:
    """The reader's options for one open: an unknown name is a ``TypeError``, a bad value the
    reader's error, both raised here, before anything is opened."""
    return OpenOptions(**options)
