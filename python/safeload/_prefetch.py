"""safetensors 0.9's prefetch API (PR #859's shape): ``safe_open.get_tensor_meta`` and
``safe_open.prefetch`` -> :class:`PrefetchLoader`, on every device.

The plan is read by the Rust reader's read-ahead (``Handle.prefetch``, ``src/py/prefetch.rs``):
in file order, by its worker pool, from the moment the loader is made, with at most
``budget_bytes`` read and not taken yet. This module only makes tensors of what it hands over:

- CPU: the bytes become framework tensors (owned memory; views of the map where the handle maps).
- MPS (torch's host alias): the reader writes straight into MPS tensors that :mod:`safeload._mps`
  allocates, one write per byte, no host copy.
- CUDA: the reader writes into pinned host tensors (the staging memory, bounded by the budget),
  and each one is copied to the device with ``non_blocking=True`` when it is taken, on the stream
  current then, while the reader goes on with the next ones; torch's pinned allocator keeps each
  staging block until its copy is done, and device memory is each tensor's own (freed when it is
  dropped).
- Other torch devices: host memory, then ``.to(device)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from . import _mps
from ._frameworks import to_torch, torch_dtype, torch_importer, torch_shape
from ._safeload import Prefetch

#: A prefetch plan: tensor name -> None (the whole tensor) or a step-1 slice of its first dimension.
PrefetchPlan = Dict[str, Optional[slice]]

Allocate = Callable[[Sequence[Tuple[str, str, List[int], int]]], Optional[List[Tuple[Any, Any]]]]


@dataclass(frozen=True)
class TensorMeta:
    """What ``get_tensor_meta`` returns: the header entry, no data read."""

    dtype: str
    shape: List[int]
    data_offsets: Tuple[int, int]


def _pinned(torch: Any, nbytes: int) -> Any:
    """Pinned host memory for CUDA staging (tests replace it with plain memory)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _to_device(tensor: Any, device: Any) -> Any:
    """A staged tensor's copy on the device, queued on the current stream (tests replace it)."""
    return tensor.to(device, non_blocking=True)


def _pinned_allocator(torch: Any) -> Allocate:
    """Destinations for CUDA: pinned host tensors, typed as the tensors they stage."""

    def allocate(items: Sequence[Tuple[str, str, List[int], int]]) -> List[Tuple[Any, Any]]:
        pairs = []
        for name, code, shape, nbytes in items:
            raw = _pinned(torch, nbytes)
            pairs.append((raw.view(torch_dtype(code, name)).reshape(torch_shape(code, shape)), raw))
        return pairs

    return allocate


def _converted(convert: Callable[..., Any], device: Any, name: str, code: str, shape: List[int], data: Any) -> Any:
    """The tensor of bytes the core handed over (a dtype its importer does not make)."""
    tensor = convert(code, shape, data, name)
    return tensor if device is None else tensor.to(device)


class PrefetchLoader:
    """Tensors of a prefetch plan as they land: ``take(name)`` (each once), iteration yielding
    ``(name, tensor)`` in file order (skipping taken ones), ``names()``, ``len()``, ``close()``
    and use as a context manager. Outlives its handle; tensors handed out outlive it.

    ``take(name)``: the tensor (or the planned rows of it), waiting for its bytes. Off CUDA it is
    the core's own method (no Python frame a take: the core makes the tensor with the makers it
    was given, see :func:`start`); on CUDA it queues each staged tensor's copy to the device."""

    take: Callable[[str], Any]

    def __init__(self, native: Prefetch, device: Any, staged: bool) -> None:
        self._native = native
        self._device = device  # None: the CPU
        self._staged = staged  # CUDA: provided tensors are pinned staging, copied at take
        self.take = self._take_staged if staged else native.take

    def names(self) -> List[str]:
        """The plan's names, in file order."""
        return self._native.names()

    def __len__(self) -> int:
        return len(self._native)

    @property
    def budget_bytes(self) -> int:
        """The most bytes read ahead and not taken at once."""
        return self._native.budget_bytes

    @property
    def held_bytes(self) -> int:
        """Bytes read ahead and not taken yet."""
        return self._native.held_bytes

    @property
    def bytes_read(self) -> int:
        """Bytes read from the file so far."""
        return self._native.bytes_read

    @property
    def closed(self) -> bool:
        return self._native.closed

    def _take_staged(self, name: str) -> Any:
        return _to_device(self._native.take(name), self._device)

    def __iter__(self) -> Iterator[Tuple[str, Any]]:
        """``(name, tensor)`` in file order, skipping tensors already taken: each step one call
        of the core, with no Python frame between (``iter(callable, None)``)."""
        pairs = iter(self._native.take_next, None)
        if not self._staged:
            return pairs
        return ((name, _to_device(staged, self._device)) for name, staged in pairs)

    def close(self) -> None:
        """Stops reading and frees what was not taken; tensors handed out keep their memory."""
        self._native.close()

    def __enter__(self) -> "PrefetchLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self)} tensors"
        return f"PrefetchLoader({state}, budget_bytes={self.budget_bytes})"


def start(handle: Any, convert: Callable[..., Any], target: Any, plan: Optional[PrefetchPlan],
          threads: Optional[int], budget_bytes: Optional[int]) -> PrefetchLoader:
    """``safe_open.prefetch``: the loader of ``plan``, its tensors made by ``convert`` and moved
    to the ``torch.device`` ``target`` (None: where ``convert`` makes them); see
    ``_device.target``."""
    allocate: Optional[Allocate] = None
    staged = False
    if target is not None and target.type == "mps":
        allocate = _mps.allocator(target)
    elif target is not None and target.type == "cuda":
        import torch

        allocate, staged = _pinned_allocator(torch), True
    # CPU torch tensors are made by the core, one call a take (the dtypes it can make).
    importer = torch_importer() if convert is to_torch and target is None and allocate is None else None
    makers = (allocate, importer, partial(_converted, convert, target))
    native = handle.prefetch(plan, threads=threads, budget_bytes=budget_bytes, staging=staged, makers=makers)
    return PrefetchLoader(native, target, staged)
