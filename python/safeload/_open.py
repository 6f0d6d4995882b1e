"""``safe_open``: safetensors 0.8's handle, on safeload's Rust reader."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from . import _device, _logging, _mps, _prefetch, _staging
from ._frameworks import dtype_code, framework_name, gc_paused, to_dtype, torch_importer, torch_read_many
from ._options import open_options
from ._safeload import Handle, Importer
from ._stats import Stats

#: No backend named: the reader's default ("auto", or ``$SAFELOAD_BACKEND``), decided in Rust.
DEFAULT_BACKEND = None


class safe_open:
    """Opens a safetensors file lazily and returns tensors as asked.

    Args:
        filename: ``str`` or ``os.PathLike``.
        framework: ``"pt"``, ``"np"``, ``"tf"``, ``"flax"``, ``"mlx"`` or ``"paddle"``.
        device: ``"cpu"`` (default), ``"cuda:N"``, ``"mps"``, an int, or a ``torch.device``.
        backend, threads, chunk_bytes, drop_cache, storage_options, verify, verify_cache: the
            reader's options; see :class:`safeload._options.Options`. Under ``verify``, the
            file is read whole and hashed here, and every tensor is served from those bytes.
    """

    def __init__(
        self,
        filename: Any,
        framework: str,
        device: Any = "cpu",
        *,
        backend: Optional[str] = DEFAULT_BACKEND,
        threads: Optional[int] = None,
        chunk_bytes: Optional[int] = None,
        drop_cache: bool = False,
        storage_options: Optional[Dict[str, Any]] = None,
        verify: Any = None,
        verify_cache: Any = None,
    ) -> None:
        if isinstance(filename, bytes) or not isinstance(filename, (str, os.PathLike)):
            raise TypeError(
                f"argument 'filename': expected str or os.PathLike, got {type(filename).__name__}"
            )
        self._framework = framework_name(framework)
        # Slicing bounds: torch's (clamped stops; IndexError for ints out of range) under "pt",
        # 0.8's strict rule under numpy and the rest (its own tests pin it).
        self._bounds = "clamp" if self._framework == "pytorch" else "strict"
        _device.parse(device)  # an invalid device before the file, as 0.8
        options = open_options(backend=backend, threads=threads, chunk_bytes=chunk_bytes, drop_cache=drop_cache,
                               storage_options=storage_options, verify=verify, verify_cache=verify_cache)
        self._handle = Handle(os.fspath(filename), options)
        _logging.log_verified(self._handle.pinned())
        try:  # after the file, as 0.8: a missing file is a FileNotFoundError whatever the device
            self._target = _device.target(self._framework, device)
        except BaseException:
            self._handle.close()
            raise
        self._device: Any = self._target.torch
        #: What this handle's latest staged load to its device did (``StagingStats``), or None.
        self.staging_stats: Any = None

    # -- handle ---------------------------------------------------------------------------

    @property
    def backend(self) -> str:
        """The backend reading this file: "pread", "direct" or "mmap" ("auto" resolved)."""
        return self._handle.backend

    @property
    def stats(self) -> Stats:
        """Totals of this handle's reads so far."""
        return self._handle.stats()

    def __enter__(self) -> "safe_open":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Closes the file; at DEBUG, logs what this handle read in all (its slices included)."""
        if self._handle.closed:
            return
        path = self._handle.path
        self._handle.close()
        _logging.log_read(path, self._handle.stats(), "close")

    def keys(self) -> List[str]:
        """Tensor names, sorted."""
        return self._handle.keys()

    def offset_keys(self) -> List[str]:
        """Tensor names in file (offset) order."""
        return self._handle.offset_keys()

    def metadata(self) -> Optional[Dict[str, str]]:
        """The header's ``__metadata__``, or None."""
        return self._handle.metadata()

    # -- tensors --------------------------------------------------------------------------

    def _tensor(self, name: str, code: str, shape: List[int], data: Any) -> Any:
        return self._target.tensor(code, shape, data, name)

    def get_tensor(self, name: str) -> Any:
        """Reads one tensor into memory it owns."""
        if self._device is not None:
            tensor = self._take_on_device(self._handle, name)
            if tensor is not None:
                return tensor
            # One tensor through the staging ring (CUDA) or its own alias (MPS).
            tensors, self.staging_stats = _staging.load_to_device(self._handle, self._device, names=[name])
            return tensors[name]
        got = self._handle.read(name, self._core_importer())
        if type(got) is not tuple:  # made by the core
            return got
        name, code, shape, data = got
        return self._tensor(name, code, shape, data)

    def _core_importer(self) -> Optional[Importer]:
        """What makes this handle's tensors in the core where it can (torch's DLPack import, for
        the dtypes it makes, on the CPU), else None: the core then returns the bytes."""
        return torch_importer() if self._framework == "pytorch" and self._device is None else None

    def _take_on_device(self, handle: Handle, name: str, key: Any = None) -> Any:
        """A whole tensor (or ``[key]`` that covers it) from the reader's read-ahead straight
        into device memory, where the device allows it (MPS through the host alias); None
        otherwise."""
        if self._device.type == "mps":
            return _mps.take(handle, self._device, name, key, self._bounds)
        return None

    def get_tensors(self, *, dtype: Any = None) -> Dict[str, Any]:
        """Reads every tensor at once with the parallel reader; dict in file order. ``dtype``
        (torch.float32/float16/bfloat16 or "F32"/"F16"/"BF16") converts the floating-point
        tensors on the way, bit-exact with torch's conversion."""
        if self._device is not None:  # accelerator: through the staging ring
            tensors, self.staging_stats = _staging.load_to_device(self._handle, self._device)
            _logging.log_read(self._handle.path, self, "get_tensors")
            return to_dtype(tensors, dtype)
        code = dtype if dtype is None or dtype in ("F32", "F16", "BF16") else dtype_code(dtype)
        with gc_paused():
            if self._framework == "pytorch":
                tensors = torch_read_many(self._handle, code)
            else:
                tensors = self._target.many(self._handle.read_many(dtype=code))
        _logging.log_read(self._handle.path, self, "get_tensors")
        return tensors

    def get_tensor_meta(self, name: str) -> "_prefetch.TensorMeta":
        """dtype, shape and data offsets of one tensor (safetensors 0.9); reads no data."""
        code, shape, begin, end = self._handle.meta(name)
        return _prefetch.TensorMeta(code, shape, (begin, end))

    def prefetch(
        self,
        plan: Optional["_prefetch.PrefetchPlan"] = None,
        *,
        device: Any = None,
        threads: Optional[int] = None,
        budget_bytes: Optional[int] = None,
    ) -> "_prefetch.PrefetchLoader":
        """Starts reading ``plan`` (every tensor when None; else ``name -> None | slice`` of the
        first dimension) in the background, in file order, and returns a
        :class:`~safeload.PrefetchLoader` at once (safetensors 0.9). ``device``: the handle's
        when None. At most ``budget_bytes`` are read and not taken yet
        (``$SAFELOAD_PREFETCH_BYTES``, default 4 GiB; 1 GiB of pinned staging for CUDA).
        ``threads``: the reader's workers; None (upstream's default is 8) picks them from the
        cores and the storage, as every read does."""
        where = self._target if device is None else _device.target(self._framework, device)
        return _prefetch.start(self._handle, where.convert, where.torch, plan, threads, budget_bytes)

    def get_slice(self, name: str) -> "SafeSlice":
        """A lazy view of a tensor; index it to read only the bytes needed."""
        code, shape = self._handle.info(name)
        return SafeSlice(self, self._handle.share(), name, code, shape)


class _safe_open_handle(safe_open):
    """``safe_open`` over an already open file object (uses its ``name``)."""

    def __init__(self, f: Any, framework: str, device: Any = "cpu", *, backend: Optional[str] = DEFAULT_BACKEND) -> None:  # noqa: E501
        f.fileno  # noqa: B018 - 0.8 requires a real file object
        super().__init__(f.name, framework, device, backend=backend)


class SafeSlice:
    """What ``get_slice`` returns: shape and dtype without reading, and ``[...]`` indexing."""

    def __init__(self, owner: safe_open, handle: Handle, name: str, code: str, shape: List[int]) -> None:
        self._owner = owner
        self._handle = handle
        self._name = name
        self._code = code
        self._shape = shape

    def get_shape(self) -> List[int]:
        return list(self._shape)

    def get_dtype(self) -> str:
        return self._code

    def __getitem__(self, key: Any) -> Any:
        if self._owner._device is not None:
            tensor = self._owner._take_on_device(self._handle, self._name, key)
            if tensor is not None:
                return tensor
        got = self._handle.read_slice(self._name, key, self._owner._bounds, self._owner._core_importer())
        if type(got) is not tuple:  # made by the core
            return got
        code, shape, data = got
        return self._owner._tensor(self._name, code, shape, data)

    def __repr__(self) -> str:
        return f"SafeSlice(name={self._name!r}, dtype={self._code}, shape={self._shape})"
