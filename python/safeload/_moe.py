"""Mixture-of-experts loads in transformers 5.x, under the patch: each fused expert tensor made
once, every expert's bytes read straight into its slot.

Hub MoE checkpoints hold one tensor per expert and projection; transformers fuses them at load
(``conversion_mapping.py``): a ``WeightConverter`` whose operations are ``MergeModulelist(dim=0)``
(``torch.stack`` of the experts) and, for gate and up, ``Concatenate(dim=1)`` (``torch.cat``).
Stock, every expert is materialized on its own (``spawn_materialize``), then stacked, then
concatenated: three copies, a layer's experts alive twice. Here, for exactly those converters:

- ``spawn_materialize`` of one of safeload's slices for a converter's list returns a
  :class:`_Pending` that holds transformers' own job, not started;
- ``WeightConverter.add_tensor`` starts it at once (on transformers' pool, as stock) unless the
  converter is one this module fuses;
- such a converter's fused tensor is made by asking transformers' own sharding op which experts
  this rank owns and which part of each it keeps (expert and tensor parallelism), allocating the
  fused tensor once and reading every expert's byte range into its final offset with one
  ``read_ranges`` per file (the Rust reader: offset-ordered, parallel, GIL released). A dtype or
  device other than the file's is applied to the fused tensor once (``.to``, element by
  element as stock's per-expert ``.to``);
- that read runs ahead of transformers, on two threads of a :class:`_Load` (one per
  ``convert_and_load_state_dict_in_model``), as soon as the converter's lists are complete, while
  transformers' first loop goes on renaming and queueing keys; ``WeightConverter.convert`` takes
  its result (or makes it, when it was not read ahead); Python's cyclic garbage collector is
  paused for the length of that loop (it would walk the whole heap again and again while
  transformers builds tens of objects a key).

Anything else (another converter, a quantizer, synchronous loading, disk offload, a device
handle, a piece that is not whole rows, experts of unequal shape or dtype, a transformers whose
internals differ) goes the stock way, with one DEBUG line per reason: stock's result and stock's
errors. The result is bit-identical to stock's.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

from ._logging import logger

#: The signatures this module was written against (transformers 5.25); others go the stock way.
_SPAWN_PARAMS = ("thread_pool", "tensor", "device", "dtype", "sharding_op", "tensor_idx")
_CONVERT_PARAMS = ("self", "layer_name", "model", "config", "hf_quantizer", "loading_info")
_ADD_PARAMS = ("self", "target_key", "source_key", "source_pattern", "future")
_LOAD_PARAMS = ("model", "state_dict", "load_config", "disk_offload_index")

_said: set = set()
#: (core_model_loading module, original add_tensor or None, original convert) while hooked
_hooked: Optional[Tuple[Any, Any, Any]] = None


def _debug(reason: str) -> None:
    """One DEBUG line per reason, per process."""
    if reason not in _said:
        _said.add(reason)
        logger.debug("experts fused the stock way: %s", reason)


class _Pending(Future):
    """A tensor transformers asked for from one of safeload's slices, for a converter's list, not
    started yet: the converter may read it straight into a fused tensor instead. ``start()``
    submits transformers' own job to its pool; ``result()`` starts it if nobody did."""

    def __init__(self, pool: Any, job: Any, source: Any, device: Any, dtype: Any, sharding_op: Any,
                 tensor_idx: Optional[int]) -> None:
        super().__init__()
        self.pool, self.job, self.source = pool, job, source
        self.device, self.dtype, self.sharding_op, self.tensor_idx = device, dtype, sharding_op, tensor_idx
        self.started: Optional[Future] = None

    def start(self) -> Future:
        if self.started is None:
            self.started = self.pool.submit(self.job)
        return self.started

    def result(self, timeout: Optional[float] = None) -> Any:
        return self.start().result(timeout)


def _spawn(original: Any) -> Any:
    """transformers' ``spawn_materialize``, deferring safeload's slices bound for a converter."""
    from ._open import SafeSlice

    def spawn_materialize(thread_pool: Any, tensor: Any, device: Any = None, dtype: Any = None,
                          sharding_op: Any = None, tensor_idx: Optional[int] = None) -> Any:
        if thread_pool is None or tensor_idx is None or type(tensor) is not SafeSlice:
            if thread_pool is None and tensor_idx is not None:
                _debug("transformers loads synchronously here (HF_DEACTIVATE_ASYNC_LOAD, disk offload or "
                       "quantization on the fly)")
            return original(thread_pool, tensor, device, dtype, sharding_op=sharding_op, tensor_idx=tensor_idx)
        job = original(None, tensor, device, dtype, sharding_op=sharding_op, tensor_idx=tensor_idx)
        return _Pending(thread_pool, job, tensor, device, dtype, sharding_op, tensor_idx)

    spawn_materialize.__wrapped__ = original  # type: ignore[attr-defined]
    return spawn_materialize


# -- which converters are fused --------------------------------------------------------------


def _fusable(conv: Any, cml: Any) -> bool:
    """Whether ``conv`` is a plain converter transformers ships for MoE experts: one list stacked
    (``MergeModulelist(dim=0)``: down_proj, w2), or several stacked, then concatenated
    (``Concatenate(dim=1)``: gate and up, w1 and w3), into one target, with no quantizer's op."""
    if type(conv) is not cml.WeightConverter or conv.quantization_operation is not None:
        return False
    ops, sources = conv.operations, len(conv.source_patterns)
    if len(conv.target_patterns) != 1 or not ops or type(ops[0]) is not cml.MergeModulelist or ops[0].dim != 0:
        return False
    if len(ops) == 1:
        return sources == 1
    return len(ops) == 2 and sources >= 2 and type(ops[1]) is cml.Concatenate and ops[1].dim == 1


# -- the plan: what each expert gives, where it goes -----------------------------------------


class _Cut:
    """What transformers' sharding op asks of a slice: the key, and ``.to`` recorded."""

    def __init__(self, key: Any) -> None:
        self.key = key

    def to(self, *args: Any, **kwargs: Any) -> "_Cut":
        return self


class _Probe:
    """A slice's stand-in for transformers' sharding op: its shape, and ``[key]`` recorded."""

    def __init__(self, shape: List[int]) -> None:
        self.shape = shape

    def get_shape(self) -> List[int]:
        return list(self.shape)

    def __getitem__(self, key: Any) -> _Cut:
        return _Cut(key)


class _Piece:
    """One expert's part: the file's rows ``[row0, row0 + rows)`` of tensor ``name`` (whole rows)."""

    __slots__ = ("handle", "name", "code", "shape", "begin", "row0", "rows", "source")

    def __init__(self, pending: _Pending, key: Any) -> None:
        src = pending.source
        # the file's own handle (each slice holds a share of it): one read per file
        self.source, self.handle, self.name = src, src._owner._handle, src._name
        self.code, shape, self.begin, _ = src._handle.meta(src._name)
        self.shape = list(shape)
        self.row0, self.rows = _rows(key, self.shape)


def _rows(key: Any, shape: List[int]) -> Tuple[int, int]:
    """The rows ``key`` (``...`` or transformers' per-dimension ``slice(start, stop)``) keeps, when
    it keeps whole rows of a contiguous tensor; ValueError otherwise."""
    if not shape:
        raise ValueError("an expert with no dimensions")
    if key is Ellipsis:
        return 0, shape[0]
    key = key if isinstance(key, tuple) else (key,)
    if len(key) != len(shape) or not all(isinstance(k, slice) and k.step in (None, 1) for k in key):
        raise ValueError(f"a part {key!r} that is not whole rows")
    spans = [k.indices(n)[:2] for k, n in zip(key, shape)]
    if any(span != (0, n) for span, n in zip(spans[1:], shape[1:])):
        raise ValueError(f"a part {key!r} that is not whole rows")
    start, stop = spans[0]
    return start, max(stop - start, 0)


def _planned(pending: _Pending) -> Optional[_Piece]:
    """The expert's piece as transformers' sharding op would cut it, or None when this rank does not
    own it (stock drops those before reading)."""
    if pending.sharding_op is None:
        return _Piece(pending, Ellipsis)
    cut = pending.sharding_op.shard_tensor(_Probe(pending.source.get_shape()), tensor_idx=pending.tensor_idx,
                                           device=pending.device, dtype=pending.dtype)
    if cut is None:
        return None
    if not isinstance(cut, _Cut):
        raise ValueError("the sharding op made a tensor of its own")
    return _Piece(pending, cut.key)


class _Stock(Exception):
    """Why a converter goes the stock way."""


def _fused(target: str, patterns: List[str], collected: Dict[str, List[Any]]) -> Any:
    """The fused tensor of a converter's lists (``collected``, by source pattern), every expert read
    into its slot; :class:`_Stock` when it must go the stock way."""
    import torch

    from ._frameworks import torch_dtype, torch_shape

    if set(collected) != set(patterns):
        raise _Stock(f"{target}: the checkpoint has {sorted(collected)} of {patterns}")
    lists = [collected[p] for p in patterns]
    if not all(type(f) is _Pending and f.started is None for futures in lists for f in futures):
        raise _Stock(f"{target}: a tensor that is not one of safeload's slices")
    first = lists[0][0]
    if first.source._owner._device is not None:
        raise _Stock(f"{target}: safe_open on a device ({first.source._owner._device})")
    try:
        pieces = [[p for p in map(_planned, futures) if p is not None] for futures in lists]
    except Exception as exc:  # noqa: BLE001 - whatever the sharding op does, stock does it instead
        raise _Stock(f"{target}: {exc}") from exc
    flat = [p for group in pieces for p in group]
    settings = {(f.device if f.device is None else str(f.device), f.dtype) for futures in lists for f in futures}
    n = len(pieces[0])
    if not flat or any(len(g) != n for g in pieces):
        raise _Stock(f"{target}: lists of unequal length")
    if len({p.code for p in flat}) != 1 or len(settings) != 1 or flat[0].code == "F4":
        raise _Stock(f"{target}: experts of unequal dtype or placement")
    inner = [[[p.rows, *p.shape[1:]] for p in g] for g in pieces]
    if any(any(s != g[0] for s in g) for g in inner) or len({tuple(g[0][1:]) for g in inner}) != 1:
        raise _Stock(f"{target}: experts of unequal shape")
    rows = [g[0][0] for g in inner]
    rest = inner[0][0][1:]
    code = flat[0].code
    fused = torch.empty([n, sum(rows), *torch_shape(code, rest)], dtype=torch_dtype(code, flat[0].name))
    ranges: Dict[int, Tuple[Any, List[Tuple[Any, int]]]] = {}
    row_offset = 0
    for group, height in zip(pieces, rows):
        for e, piece in enumerate(group):
            row_bytes = _bytes_per_row(piece, fused)
            dest = fused[e, row_offset:row_offset + height]
            ranges.setdefault(id(piece.handle), (piece.handle, []))[1].append(
                (dest, piece.begin + piece.row0 * row_bytes))
        row_offset += height
    for handle, wanted in ranges.values():
        handle.read_ranges(wanted)
    logger.debug("experts fused: %s %s from %d tensors in %d files", target, list(fused.shape), len(flat),
                 len(ranges), extra={"safeload_fused": {"target": target, "shape": list(fused.shape),
                                                        "tensors": len(flat)}})
    device, dtype = next(iter(settings))
    if device is not None or dtype is not None:
        fused = fused.to(device=device, dtype=dtype)
    return fused


def _bytes_per_row(piece: _Piece, fused: Any) -> int:
    """Bytes of one row (dimension 0) of the piece's tensor in the file."""
    count = 1
    for n in piece.shape[1:]:
        count *= n
    return count * fused.element_size()


# -- reading ahead of transformers ----------------------------------------------------------


class _Load:
    """One ``convert_and_load_state_dict_in_model``: converters whose lists are complete are read
    on a thread of their own while transformers goes on renaming and queueing the keys after them
    (its first loop spends about as long in Python as the experts' reads take). Keys come sorted
    (``dot_natural_key``), so a converter is complete once the next one of its kind opens (the next
    layer's), and every one once the first ``convert`` is asked. What was read is used only if the
    converter's lists are still exactly those it was read from."""

    def __init__(self, quantized: bool) -> None:
        self.quantized = quantized  # a quantizer may convert the experts: nothing read ahead
        self.open: Dict[Tuple[Tuple[str, ...], Tuple[str, ...]], Any] = {}
        self.started: Dict[int, Tuple[Any, Dict[str, List[Any]], Future]] = {}
        self.worker: Optional[ThreadPoolExecutor] = None

    def opened(self, conv: Any) -> None:
        """``conv`` was given a tensor: the converter of its kind before it is complete."""
        kind = (tuple(conv.source_patterns), tuple(conv.target_patterns))
        previous = self.open.get(kind)
        if previous is not conv:
            self.open[kind] = conv
            if previous is not None:
                self.start(previous)

    def flush(self) -> None:
        """The first loop is over: every converter is complete."""
        for conv in self.open.values():
            self.start(conv)
        self.open.clear()

    def start(self, conv: Any) -> None:
        if self.quantized or id(conv) in self.started:
            return
        snapshot = {p: list(futures) for p, futures in conv.collected_tensors.items()}
        if self.worker is None:
            self.worker = ThreadPoolExecutor(max_workers=2, thread_name_prefix="safeload-experts")
        future = self.worker.submit(_fused, conv.target_patterns[0], list(conv.source_patterns), snapshot)
        self.started[id(conv)] = (conv, snapshot, future)

    def take(self, conv: Any) -> Optional[Any]:
        """The fused tensor read ahead for ``conv`` (or its error), or None when none was, or its
        lists changed since."""
        got = self.started.pop(id(conv), None)
        if got is None:
            return None
        _, snapshot, future = got
        now = conv.collected_tensors
        if set(now) != set(snapshot) or any(len(now[p]) != len(v) or any(a is not b for a, b in zip(now[p], v))
                                            for p, v in snapshot.items()):
            with contextlib.suppress(Exception):
                future.result()  # read from lists that grew since: not used
            return None
        return future.result()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown(wait=True, cancel_futures=True)


_local = threading.local()


def _current() -> Optional[_Load]:
    return getattr(_local, "load", None)


def load_for(original: Any) -> Any:
    """The patch's stand-in for ``core_model_loading.convert_and_load_state_dict_in_model``: the
    original, within a :class:`_Load` and with Python's cyclic garbage collector paused (the
    original itself when this transformers' loader is not the one this module knows). The
    collector's full walks of the heap during transformers' loop took a quarter of a warm
    1.78 GB MoE load (0.75-0.89 s against 0.56-0.59 s paused, 5 alternating runs)."""
    import sys

    from ._frameworks import gc_paused

    why = supported(sys.modules["transformers.core_model_loading"])
    if why is not None:
        return original

    @functools.wraps(original)
    def convert_and_load_state_dict_in_model(model: Any, state_dict: Any, load_config: Any,
                                             disk_offload_index: Any = None) -> Any:
        outer = _current()
        load = _local.load = _Load(getattr(load_config, "hf_quantizer", None) is not None)
        try:
            with gc_paused():  # see gc_paused: transformers' loop builds ~50 objects a key
                return original(model, state_dict, load_config, disk_offload_index)
        finally:
            _local.load = outer
            load.close()

    return convert_and_load_state_dict_in_model


# -- the hooks ------------------------------------------------------------------------------


def _hooks(cml: Any, add_original: Any, convert_original: Any) -> Tuple[Any, Any]:
    def add_tensor(self: Any, target_key: str, source_key: str, source_pattern: str, future: Any) -> Any:
        if type(future) is _Pending:
            load = _current()
            if not _fusable(self, cml):
                future = future.start()
            elif load is not None:
                load.opened(self)
        return add_original(self, target_key, source_key, source_pattern, future)

    def convert(self: Any, layer_name: str, model: Any = None, config: Any = None, hf_quantizer: Any = None,
                loading_info: Any = None) -> Any:
        load = _current()
        if load is not None:
            load.flush()
        fused = None
        if _fusable(self, cml) and any(type(f) is _Pending for fs in self.collected_tensors.values()
                                                  for f in fs):
            if hf_quantizer is not None:
                _debug(f"a quantizer ({type(hf_quantizer).__name__}) converts the experts")
            else:
                try:
                    fused = load.take(self) if load is not None else None
                    if fused is None:
                        fused = _fused(self.target_patterns[0], self.source_patterns, self.collected_tensors)
                except _Stock as why:
                    _debug(str(why))
        if fused is None:
            for futures in self.collected_tensors.values():
                futures[:] = [f.start() if type(f) is _Pending else f for f in futures]
            return convert_original(self, layer_name, model=model, config=config, hf_quantizer=hf_quantizer,
                                    loading_info=loading_info)
        self.collected_tensors.clear()
        return _named({self.target_patterns[0]: fused}, layer_name)

    return add_tensor, convert


def _named(collected: Dict[str, Any], layer_name: str) -> Dict[str, Any]:
    """Target patterns expanded to full names, as ``WeightConverter.convert`` does."""
    full_name = layer_name.replace("*.", "0.") if "*." in layer_name else layer_name
    for k in collected:
        if k in full_name:
            prefix, _, suffix = full_name.partition(k)
            return {prefix + key + suffix: v for key, v in collected.items()}
    return collected


def _names(fn: Any) -> Tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def supported(cml: Any) -> Optional[str]:
    """None when ``transformers.core_model_loading`` is the loader this module knows; else why not."""
    for name in ("spawn_materialize", "convert_and_load_state_dict_in_model", "WeightConverter", "WeightTransform",
                 "MergeModulelist", "Concatenate"):
        if not hasattr(cml, name):
            return f"transformers' core_model_loading has no {name}"
    checks = ((cml.spawn_materialize, _SPAWN_PARAMS), (cml.WeightConverter.convert, _CONVERT_PARAMS),
              (cml.WeightConverter.add_tensor, _ADD_PARAMS),
              (cml.convert_and_load_state_dict_in_model, _LOAD_PARAMS))
    for fn, params in checks:
        if _names(getattr(fn, "__wrapped__", fn)) != params:
            return f"transformers' {getattr(fn, '__qualname__', fn)} is not the one safeload knows"
    return None


def spawn_for(original: Any) -> Any:
    """The patch's stand-in for ``core_model_loading.spawn_materialize`` (the original itself when
    this transformers' loader is not the one this module knows)."""
    import sys

    why = supported(sys.modules["transformers.core_model_loading"])
    if why is not None:
        _debug(why)
        return original
    return _spawn(original)


def hook(cml: Any) -> None:
    """Hooks ``WeightConverter``'s ``add_tensor`` and ``convert`` (idempotent)."""
    global _hooked
    if _hooked is not None or supported(cml) is not None:
        return
    conv = cml.WeightConverter
    own_add = conv.__dict__.get("add_tensor")
    add_tensor, convert = _hooks(cml, conv.add_tensor, conv.convert)
    _hooked = (cml, own_add, conv.convert)
    conv.add_tensor, conv.convert = add_tensor, convert


def unhook() -> None:
    """Puts ``WeightConverter``'s methods back as they were."""
    global _hooked
    if _hooked is None:
        return
    cml, own_add, convert = _hooked
    conv = cml.WeightConverter
    if own_add is None:
        del conv.add_tensor
    else:
        conv.add_tensor = own_add
    conv.convert = convert
    _hooked = None
