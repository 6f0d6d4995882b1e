"""The MPS path (safeload._mps) on Linux, with a CPU stand-in for the device: an "mps" device that
resolves, ``torch.empty(..., device=mps)`` played by CPU tensors, ``torch.mps._host_alias_storage``
returning the storage itself (counted), ``torch.mps.synchronize`` counted, and ``.to(mps)`` a no-op
on the fallback path. Checked: bytes equal to safetensors 0.8's CPU ``load_file`` for every dtype,
every byte written once straight into the destinations, no host copy of the tensors, the
synchronize calls around the writes, and the fallback when the alias is missing, raises or lies."""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import safetensors.torch as st_torch

import safeload
import safeload.torch
from safeload import SafetensorError, _checkpoint, _device, _mps, _open, _staging
from safeload._safeload import Handle
from cpu_sink import CpuSink
from safeload._sinks import HostThenToSink

from conftest import (
    TORCH_DTYPES,
    assert_cut_tensors_raise,
    assert_tensor_equal,
    cut_last_tensors,
    file_to_cut,
    make_tensor,
    mixed_tensors,
)



# -- the stand-in -----------------------------------------------------------------------------------


class Recorder:
    """What a load did, in order: ("sync",), ("alias", nbytes, address), ("read_into", address,
    offset, length), ("host_read", method), ("host_alloc", nbytes), ("device_alloc", nbytes),
    ("to",)."""

    def __init__(self) -> None:
        self.events = []
        self.alias_error = None  # an exception the alias raises
        self.alias_result = None  # replaces the alias' result: fn(storage) -> storage
        self.empty_error = None  # fn(nbytes, kwargs) -> exception or None, for device allocations
        self.carve = None  # a CPU uint8 buffer device allocations are carved from, in order
        self._carved = 0

    def clear(self) -> None:
        self.events.clear()

    def kinds(self, kind):
        return [e for e in self.events if e[0] == kind]

    @property
    def writes(self):
        return [e[1:] for e in self.events if e[0] == "read_into"]

    @property
    def max_host_alloc(self):
        return max((e[1] for e in self.kinds("host_alloc")), default=0)


class SpyHandle:
    """A real Handle whose reads are recorded (``Handle`` is a frozen native class)."""

    rec: Recorder = None  # set by the fixture

    def __init__(self, *args, handle=None, **kwargs) -> None:
        self._h = Handle(*args, **kwargs) if handle is None else handle

    def __getattr__(self, name):
        return getattr(self._h, name)

    def read_ranges(self, ranges):
        self.rec.events.append(("read_ranges", len(ranges)))
        for dest, offset in ranges:
            self.rec.events.append(("read_into", dest.data_ptr(), offset, dest.numel()))
        return self._h.read_ranges(ranges)

    def read(self, *a, **k):
        self.rec.events.append(("host_read", "read"))
        return self._h.read(*a, **k)

    def read_many(self, *a, **k):
        self.rec.events.append(("host_read", "read_many"))
        return self._h.read_many(*a, **k)

    def read_slice(self, *a, **k):
        self.rec.events.append(("host_read", "read_slice"))
        return self._h.read_slice(*a, **k)


def _nbytes(args, kwargs):
    size = args[0] if len(args) == 1 else args
    if isinstance(size, int):
        size = (size,)
    n = 1
    for s in size:
        n *= int(s)
    return n * kwargs.get("dtype", torch.get_default_dtype()).itemsize


@pytest.fixture
def fake_mps(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(_mps, "alias_usable", None)

    real_device = _device.torch_device
    monkeypatch.setattr(_device, "torch_device",
                        lambda name: torch.device(name) if name.startswith("mps") else real_device(name))

    real_empty = torch.empty

    def empty(*args, **kwargs):
        device = kwargs.get("device")
        nbytes = _nbytes(args, kwargs)
        if device is not None and torch.device(device).type == "mps":
            rec.events.append(("device_alloc", nbytes))
            if rec.empty_error is not None:
                error = rec.empty_error(nbytes, kwargs)
                if error is not None:
                    raise error
            if rec.carve is not None:
                assert kwargs.get("dtype") == torch.uint8 and len(args) == 1
                start = rec._carved
                rec._carved += nbytes
                return rec.carve[start : start + nbytes]
            kwargs["device"] = "cpu"
            return real_empty(*args, **kwargs)
        rec.events.append(("host_alloc", nbytes))
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)

    def alias(storage):
        rec.events.append(("alias", storage.nbytes(), storage.data_ptr()))
        if rec.alias_error is not None:
            raise rec.alias_error
        return storage if rec.alias_result is None else rec.alias_result(storage)

    monkeypatch.setattr(torch.mps, "_host_alias_storage", alias, raising=False)
    monkeypatch.setattr(torch.mps, "synchronize", lambda: rec.events.append(("sync",)))

    def to_device(self, tensor, index):
        rec.events.append(("to",))
        return tensor

    monkeypatch.setattr(HostThenToSink, "deliver", to_device)

    SpyHandle.rec = rec
    for module in (_open, _staging):
        monkeypatch.setattr(module, "Handle", SpyHandle)
    real_checkpoint = _checkpoint.Checkpoint

    class SpyCheckpoint:
        """Host reads of whole checkpoints (the CPU path) are recorded, and its handles' reads
        (the staged path)."""

        def __init__(self, *a, **k):
            self._c = real_checkpoint(*a, **k)

        def __getattr__(self, name):
            return getattr(self._c, name)

        def read(self, *a, **k):
            rec.events.append(("host_read", "Checkpoint.read"))
            return self._c.read(*a, **k)

        def handles(self):
            return [SpyHandle(handle=h) for h in self._c.handles()]

    for module in (_checkpoint, _staging):
        monkeypatch.setattr(module, "Checkpoint", SpyCheckpoint)
    return rec


# -- helpers ----------------------------------------------------------------------------------------


def every_dtype(seed=0):
    """conftest's mix plus a (3, 5, 7) tensor of every dtype; "big" spans several test chunks."""
    tensors = mixed_tensors(seed, big_rows=300)
    for i, code in enumerate(TORCH_DTYPES):
        tensors[f"u{i:02d}_{code}"] = make_tensor(code, (3, 5, 7) if code != "F4" else (3, 5), seed=i)
    return tensors


def data_bytes(path, names=None):
    h = Handle(path, "pread")
    try:
        return sum(i.nbytes for i in h.infos() if names is None or i.name in names)
    finally:
        h.close()


def assert_same(got, ref):
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert_tensor_equal(got[k], ref[k], k)


def check_alias_load(rec, expected_bytes, chunk_bytes=None):
    """Every byte written once, straight into aliased destinations, between two synchronizes;
    nothing read into host memory, no host buffer above a chunk."""
    assert rec.kinds("alias") or not expected_bytes  # the alias path (not host memory + .to)
    writes = rec.writes
    assert sum(n for _, _, n in writes) == expected_bytes
    for kind in ("host_read", "to"):
        assert not rec.kinds(kind), rec.kinds(kind)
    if chunk_bytes is not None:
        assert rec.max_host_alloc <= chunk_bytes
    # Destinations (and, per file, the file bytes) never overlap.
    dests = sorted((a, a + n) for a, _, n in writes)
    assert all(e <= b for (_, e), (b, _) in zip(dests, dests[1:]))
    # Every write lands inside an allocated device buffer; synchronize before the first, after the last.
    kinds = [e[0] for e in rec.events]
    if writes:
        first = kinds.index("read_into")
        last = len(kinds) - 1 - kinds[::-1].index("read_into")
        assert "sync" in kinds[:first] and "sync" in kinds[last:]
        assert "alias" not in kinds[first:] and "device_alloc" not in kinds[first:]


def check_storages(got):
    ptrs = [t.untyped_storage().data_ptr() for t in got.values() if t.numel()]
    assert len(set(ptrs)) == len(ptrs)


# -- the alias path -----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["pread", "mmap", "auto"])
def test_get_tensors_and_load_file(write_st, fake_mps, backend):
    path = write_st(every_dtype(1))
    ref = st_torch.load_file(path)
    total = data_bytes(path)
    chunk = 64 << 10
    fake_mps.clear()
    with safeload.safe_open(path, "pt", device="mps", backend=backend, chunk_bytes=chunk) as f:
        got = f.get_tensors()
        keys = f.offset_keys()
    assert list(got) == keys
    check_alias_load(fake_mps, total, chunk)
    assert len(fake_mps.kinds("read_ranges")) == 1  # every tensor in one call, read in parallel
    assert f.staging_stats.bytes == f.stats.bytes_read == total
    # No host memory (empty CPU tensors viewing the aliases cost none); checked before the
    # comparison below, which allocates.
    assert [e for e in fake_mps.kinds("host_alloc") if e[1]] == []
    # One alias per non-empty tensor, none for zero-size ones.
    assert len(fake_mps.kinds("alias")) == sum(1 for t in ref.values() if t.nbytes)
    assert_same(got, ref)
    check_storages(got)

    fake_mps.clear()
    got = safeload.torch.load_file(path, device="mps")
    check_alias_load(fake_mps, total, chunk)
    assert_same(got, ref)
    fake_mps.clear()
    got = safeload.torch.load_file(path, device=torch.device("mps", 0))
    check_alias_load(fake_mps, total, chunk)
    assert_same(got, ref)


def test_get_tensor(write_st, fake_mps, monkeypatch):
    """With read-ahead off, each get_tensor is one aliased write of its own."""
    monkeypatch.setenv("SAFELOAD_READAHEAD_BYTES", "0")
    path = write_st(every_dtype(2))
    ref = st_torch.load_file(path)
    with safeload.safe_open(path, "pt", device="mps:0") as f:
        for name in f.keys():
            fake_mps.clear()
            got = f.get_tensor(name)
            check_alias_load(fake_mps, ref[name].nbytes)
            assert_tensor_equal(got, ref[name], name)
            assert len(fake_mps.writes) == (1 if ref[name].nbytes else 0)
        with pytest.raises(SafetensorError, match="File does not contain tensor nope"):
            f.get_tensor("nope")


def check_read_ahead(rec, got, ref):
    """Tensors the read-ahead handed over: each allocated on the device once and written through
    its alias by the reader (no per-tensor read_into, no host read, no host copy, no .to), each
    returned tensor the memory that was aliased, a synchronize before any of it was handed out."""
    for kind in ("host_read", "to", "read_into"):
        assert not rec.kinds(kind), rec.kinds(kind)
    assert [e for e in rec.kinds("host_alloc") if e[1]] == []
    assert sorted(e[1] for e in rec.kinds("device_alloc")) == sorted(t.nbytes for t in ref.values())
    aliased = {e[2] for e in rec.kinds("alias")}
    assert len(aliased) == sum(1 for t in ref.values() if t.nbytes)
    for name, t in got.items():
        if t.nbytes:
            assert t.untyped_storage().data_ptr() in aliased, name
    assert rec.kinds("sync")


@pytest.mark.parametrize("budget,limit", [("96KiB", 96 << 10), ("256MiB", 256 << 20)])
def test_get_tensor_loop_reads_ahead_into_device_memory(write_st, fake_mps, monkeypatch, budget, limit, testing):
    """The seed's loop on MPS (``for name in names: f.get_tensor(name)``), in a shuffled order:
    the read-ahead writes every tensor straight into MPS memory, within its budget."""
    monkeypatch.setenv("SAFELOAD_READAHEAD_BYTES", budget)
    path = write_st(every_dtype(9))
    ref = st_torch.load_file(path)
    names = sorted(ref)
    random.Random(9).shuffle(names)
    got = {}
    biggest = max(t.nbytes for t in ref.values())
    fake_mps.clear()
    with safeload.safe_open(path, "pt", device="mps") as f:
        for name in names:
            got[name] = f.get_tensor(name)
            held = testing.readahead_bytes(f._handle._h)  # the spy's real Handle
            assert held <= max(limit, biggest), held
    check_read_ahead(fake_mps, got, ref)
    assert_same(got, ref)
    check_storages(got)


def test_get_slice_from_four_threads_reads_ahead(write_st, fake_mps, monkeypatch):
    """transformers on Apple silicon: ``get_slice(k)[...]`` for every key from a pool of 4
    threads, on a ``device="mps", backend="pread"`` handle; parts of a tensor still read on the
    host and move to the device."""
    path = write_st(every_dtype(10))
    ref = st_torch.load_file(path)
    fake_mps.clear()
    with safeload.safe_open(path, "pt", device="mps", backend="pread") as f:
        slices = {name: f.get_slice(name) for name in f.keys()}
        with ThreadPoolExecutor(4) as pool:
            got = dict(zip(slices, pool.map(lambda s: s[...], slices.values())))
        check_read_ahead(fake_mps, got, ref)
        assert_same(got, ref)
        fake_mps.clear()
        # A part of a tensor: read on the host, then moved (the stand-in's .to records it).
        monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **k: fake_mps.events.append(("to",)) or t)
        part = slices["big"][2:5]
        assert fake_mps.kinds("to") and not fake_mps.kinds("device_alloc")
        assert_tensor_equal(part, ref["big"][2:5], "big[2:5]")


def test_prefetch_writes_straight_into_mps_memory(write_st, fake_mps):
    """safetensors 0.9's ``prefetch(device="mps")``: every tensor read by the loader straight into
    MPS memory through its alias; a sliced plan allocates only its rows on the device."""
    path = write_st(every_dtype(12))
    ref = st_torch.load_file(path)
    fake_mps.clear()
    with safeload.safe_open(path, "pt", device="mps") as f:
        with f.prefetch(budget_bytes=128 << 10) as loader:
            got = dict(loader)
    check_read_ahead(fake_mps, got, ref)
    assert_same(got, ref)
    fake_mps.clear()
    with safeload.safe_open(path, "pt") as f:  # a CPU handle, loaded onto MPS
        with f.prefetch({"big": slice(1, 4)}, device="mps") as loader:
            rows = loader.take("big")
    assert [e[1] for e in fake_mps.kinds("device_alloc")] == [ref["big"][1:4].nbytes]
    assert not fake_mps.kinds("host_read") and not fake_mps.kinds("to")
    assert_tensor_equal(rows, ref["big"][1:4], "big[1:4]")


def test_read_ahead_falls_back_when_the_alias_raises(write_st, fake_mps):
    path = write_st(every_dtype(11))
    ref = st_torch.load_file(path)
    fake_mps.alias_error = RuntimeError("getHostAliasStorage: storage is not backed by shared memory")
    with safeload.safe_open(path, "pt", device="mps") as f:
        got = {name: f.get_tensor(name) for name in reversed(f.keys())}
    assert fake_mps.kinds("to") and _mps.alias_usable is False
    assert_same(got, ref)


def test_read_ahead_error_raises(write_st, fake_mps):
    """A file cut short under the read-ahead (after open, before the loop): the tensors past
    the cut raise, the others are right; never bad bytes."""
    path, ref = file_to_cut(write_st)
    with safeload.safe_open(path, "pt", device="mps") as f:
        names = f.offset_keys()
        cut_last_tensors(path)
        assert_cut_tensors_raise(f.get_tensor, names, ref)


def test_large_tensor_no_host_copy(write_st, fake_mps):
    """A tensor far above the chunk: written in place by the engine, no host buffer above a chunk
    (and the spy has teeth: the host path allocates the whole tensor on the host)."""
    big = make_tensor("F32", (512, 300), seed=3)  # 600 KiB
    path = write_st({"small": make_tensor("F16", (7,), 1), "big": big})
    chunk = 64 << 10
    fake_mps.clear()
    with safeload.safe_open(path, "pt", device="mps", chunk_bytes=chunk) as f:
        got = f.get_tensors()
    check_alias_load(fake_mps, data_bytes(path), chunk)
    assert_same(got, st_torch.load_file(path))

    fake_mps.clear()
    fake_mps.alias_error = RuntimeError("not a shared-storage MTLBuffer")
    with safeload.safe_open(path, "pt", device="mps", chunk_bytes=chunk) as f:
        got = f.get_tensors()
    assert fake_mps.kinds("to") and fake_mps.max_host_alloc >= big.nbytes
    assert_same(got, st_torch.load_file(path))


def test_zero_size_only(write_st, fake_mps):
    path = write_st({"a": make_tensor("F32", (0,), 1), "b": make_tensor("F4", (2, 0), 2),
                     "c": make_tensor("BF16", (0, 3, 4), 3)})
    fake_mps.clear()
    got = safeload.torch.load_file(path, device="mps")
    check_alias_load(fake_mps, 0)
    assert_same(got, st_torch.load_file(path))
    assert fake_mps.writes == [] and fake_mps.kinds("alias") == []


def test_carved_destinations_written_in_file_order(write_st, fake_mps):
    """Destinations carved in order out of one buffer (storage offsets non-zero): every tensor is
    written once, at its own place, in file order, covering the buffer exactly."""
    tensors = {f"w{i}": make_tensor(code, (5, 3 + i), i) for i, code in
               enumerate(["F32", "U8", "BF16", "F64", "I16", "F8_E4M3", "BOOL"])}
    path = write_st(tensors)
    total = data_bytes(path)
    fake_mps.carve = torch.full((total,), 0xA5, dtype=torch.uint8)
    fake_mps.clear()
    got = safeload.torch.load_file(path, device="mps")
    check_alias_load(fake_mps, total)
    assert_same(got, st_torch.load_file(path))
    at = fake_mps.carve.data_ptr()
    for address, offset, length in fake_mps.writes:
        assert address == at and offset == at - fake_mps.carve.data_ptr()
        at += length
    assert at == fake_mps.carve.data_ptr() + total


def test_load_checkpoint_shards(write_st, fake_mps, tmp_path):
    a = write_st(every_dtype(3), name="model-00001-of-00003.safetensors")
    b = write_st({f"layer{i}": make_tensor("F16", (17, i + 1), i) for i in range(9)},
                 name="model-00002-of-00003.safetensors")
    c = write_st({"head": make_tensor("BF16", (40, 51), 1), "none": make_tensor("I8", (0,), 2)},
                 name="model-00003-of-00003.safetensors")
    ref = {**st_torch.load_file(a), **st_torch.load_file(b), **st_torch.load_file(c)}
    total = sum(data_bytes(p) for p in (a, b, c))
    calls = []
    fake_mps.clear()
    out, stats = safeload.torch.load_checkpoint([a, b, c], device="mps", return_stats=True,
                                                progress=lambda d, t: calls.append((d, t)))
    check_alias_load(fake_mps, total)
    assert_same(out, ref)
    check_storages(out)
    assert stats.bytes_read == total and calls[-1] == (total, total)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    fake_mps.clear()
    out = _checkpoint.load_checkpoint(str(tmp_path), device="mps")
    check_alias_load(fake_mps, total)
    assert_same(out, ref)


def test_load_checkpoint_duplicate_fails_before_reading(write_st, fake_mps):
    a = write_st({"x": make_tensor("F32", (2,))}, name="a.safetensors")
    b = write_st({"x": make_tensor("F32", (2,))}, name="b.safetensors")
    fake_mps.clear()
    with pytest.raises(SafetensorError, match="tensor x appears in more than one shard"):
        safeload.torch.load_checkpoint([a, b], device="mps")
    assert fake_mps.writes == [] and fake_mps.kinds("device_alloc") == []


# -- fallbacks ----------------------------------------------------------------------------------------


def test_fallback_when_alias_raises(write_st, fake_mps):
    path = write_st(every_dtype(4))
    ref = st_torch.load_file(path)
    fake_mps.alias_error = RuntimeError("getHostAliasStorage: storage is not backed by shared memory")
    fake_mps.clear()
    with safeload.safe_open(path, "pt", device="mps") as f:
        got = f.get_tensors()
        assert fake_mps.kinds("to") and _mps.alias_usable is False
        assert len(fake_mps.kinds("alias")) == 1  # probed on the first tensor, then given up
        first_write = [e[0] for e in fake_mps.events].index("read_into")
        assert "alias" not in [e[0] for e in fake_mps.events[first_write:]]
        assert_same(got, ref)
        assert len(fake_mps.kinds("to")) == len(ref)
        # Probed once per process: later loads go straight to the host path.
        fake_mps.clear()
        assert_tensor_equal(f.get_tensor("big"), ref["big"])
        assert fake_mps.kinds("alias") == [] and fake_mps.kinds("to")
    assert_same(safeload.torch.load_checkpoint(path, device="mps"), ref)


def test_fallback_without_alias(write_st, fake_mps, monkeypatch):
    monkeypatch.delattr(torch.mps, "_host_alias_storage")
    path = write_st(every_dtype(5))
    fake_mps.clear()
    got = safeload.torch.load_file(path, device="mps")
    assert_same(got, st_torch.load_file(path))
    assert fake_mps.kinds("to") and fake_mps.kinds("device_alloc") == []


@pytest.mark.parametrize("lie", ["short", "null", "device"])
def test_fallback_when_alias_looks_wrong(write_st, fake_mps, lie):
    def bad(storage):
        if lie == "short":
            return torch.UntypedStorage(max(storage.nbytes() - 1, 0))
        if lie == "null":
            return torch.UntypedStorage(0)
        return torch.empty(storage.nbytes(), dtype=torch.uint8, device="meta").untyped_storage()

    fake_mps.alias_result = bad
    path = write_st(every_dtype(6))
    fake_mps.clear()
    got = safeload.torch.load_file(path, device="mps")
    assert_same(got, st_torch.load_file(path))
    assert fake_mps.kinds("to") and _mps.alias_usable is False


def test_fallback_when_device_allocation_fails(write_st, fake_mps):
    """A dtype or size the device refuses: that load goes through host memory; the alias stays
    in use for later loads."""
    path = write_st(every_dtype(7))
    big = make_tensor("F32", (64, 33), 1).nbytes
    fake_mps.empty_error = lambda n, kw: MemoryError("MPS backend out of memory") if n == big else None
    fake_mps.clear()
    got = safeload.torch.load_file(path, device="mps")
    assert_same(got, st_torch.load_file(path))
    assert fake_mps.kinds("to") and _mps.alias_usable is True
    fake_mps.empty_error = None
    fake_mps.clear()
    got = safeload.torch.load_file(path, device="mps")
    check_alias_load(fake_mps, data_bytes(path))
    assert_same(got, st_torch.load_file(path))


def test_read_error_propagates(write_st, fake_mps, tmp_path):
    """An I/O error during the writes is raised (no fallback, no partial result)."""
    path = write_st({"a": make_tensor("F32", (1000,), 1), "b": make_tensor("F32", (1000,), 2)})
    with safeload.safe_open(path, "pt", device="mps") as f:
        os.truncate(path, os.path.getsize(path) - 100)
        with pytest.raises(Exception):
            f.get_tensors()
    assert not fake_mps.kinds("to")


def test_cpu_and_cuda_untouched(write_st, fake_mps, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("MPS path used")

    monkeypatch.setattr(_mps, "load", boom)
    path = write_st(every_dtype(8))
    assert_same(safeload.torch.load_file(path), st_torch.load_file(path))
    got, _ = _staging.load_to_device(path, None, sink=CpuSink())
    assert_same(got, st_torch.load_file(path))
