"""The accelerator load path (safeload._staging), driven with CPU sinks so every byte is checked
on a machine without a GPU: the planner, the ring scheduling, tensors split across staging
buffers, completion ordering, bounded staging memory, and the wiring of safe_open /
load_checkpoint to it for CUDA devices."""

from __future__ import annotations

import collections
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import safetensors

import safeload
import safeload.torch
from safeload import SafetensorError, _checkpoint, _device, _safeload, _staging
from safeload._safeload import Handle
from cpu_sink import CpuSink
from safeload._sinks import HostThenToSink

from conftest import TORCH_DTYPES, assert_tensor_equal, make_tensor, mixed_tensors

# (ring buffers, buffer bytes): tiny rings so tensors straddle many fills, odd sizes, one buffer.
RINGS = [(2, 4096), (3, 1000), (1, 777), (4, 1), (2, 64 << 20)]


def ref_load(path, names=None):
    with safetensors.safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in (names if names is not None else f.keys())}


def assert_same(got, ref):
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert_tensor_equal(got[k], ref[k], k)


def check_order(log):
    """A ring buffer is never refilled before every copy of the fill that last used it completed."""
    last_in_slot = {}
    completed = set()
    for entry in log:
        if entry[0] == "fill":
            _, index, slot = entry
            previous = last_in_slot.get(slot)
            assert previous is None or previous in completed, (
                f"fill {index} reused buffer {slot} before fill {previous} completed")
            last_in_slot[slot] = index
        elif entry[0] == "complete":
            completed.add(entry[1])
        elif entry[0] == "copy":
            assert entry[1] not in completed
    assert log[-1] == ("finish",)
    fills = [e[1] for e in log if e[0] == "fill"]
    assert fills == sorted(fills) and sorted(completed) == fills


# -- planner --------------------------------------------------------------------------------------


# A header entry as Handle.infos() gives it (TensorInfo's fields), for plans of made-up layouts.
Info = collections.namedtuple("Info", "name dtype shape begin end")


def plan_spans(testing, infos, buffer_bytes):
    """The reader's staging plan of ``infos`` (what ``staging_plan`` makes per file)."""
    return testing.staging_fills([(i.name, i.begin, i.end) for i in infos], buffer_bytes)


def check_plan(infos, buffer_bytes, fills):
    covered = {name: [] for name, _, _, b, e in infos}
    last_end = -1
    for fill in fills:
        assert 0 < fill.length <= buffer_bytes
        # Reads tile the staging buffer from 0, in increasing data offsets.
        at = 0
        for offset, length, s_off in fill.reads:
            assert s_off == at and length > 0 and offset >= last_end
            at += length
            last_end = offset + length
        assert at == fill.length
        for name, t_off, s_off, n in fill.copies:
            info = next(i for i in infos if i[0] == name)
            # The staged bytes at s_off are the tensor's bytes at t_off.
            read = next(r for r in fill.reads if r[2] <= s_off < r[2] + r[1])
            assert s_off + n <= read[2] + read[1]
            assert read[0] + (s_off - read[2]) == info[3] + t_off
            covered[name].append((t_off, n))
    for name, _, _, begin, end in infos:
        pieces = sorted(covered[name])
        pos = 0
        for t_off, n in pieces:
            assert t_off == pos and n > 0
            pos += n
        assert pos == end - begin, name


@st.composite
def layouts(draw):
    sizes = draw(st.lists(st.integers(0, 300), min_size=0, max_size=25))
    gaps = draw(st.lists(st.integers(0, 50), min_size=len(sizes), max_size=len(sizes)))
    infos, pos = [], 0
    for i, (n, gap) in enumerate(zip(sizes, gaps)):
        pos += gap  # gaps: a subset of the file's tensors
        infos.append(Info(f"t{i}", "U8", [n], pos, pos + n))
        pos += n
    draw(st.randoms()).shuffle(infos)
    return infos


@settings(max_examples=300, deadline=None)
@given(layouts(), st.integers(1, 700))
def test_plan_covers_every_byte_once(testing, infos, buffer_bytes):
    fills = plan_spans(testing, infos, buffer_bytes)
    check_plan(infos, buffer_bytes, fills)
    total = sum(e - b for _, _, _, b, e in infos)
    assert sum(f.length for f in fills) == total
    # Packing: every fill but the last is full.
    assert all(f.length == buffer_bytes for f in fills[:-1])


def test_plan_packs_small_and_splits_large(testing):
    infos = [Info("a", "U8", [10], 0, 10), Info("b", "U8", [10], 10, 20), Info("c", "U8", [250], 20, 270),
             Info("z", "U8", [0], 270, 270), Info("d", "U8", [5], 300, 305)]
    fills = plan_spans(testing, infos, 100)
    assert [f.length for f in fills] == [100, 100, 75]
    assert fills[0].reads == [(0, 100, 0)]
    assert fills[0].copies == [("a", 0, 0, 10), ("b", 0, 10, 10), ("c", 0, 20, 80)]
    assert fills[1].copies == [("c", 80, 0, 100)]
    assert fills[2].reads == [(200, 70, 0), (300, 5, 70)]  # gap: a second read, same buffer
    assert fills[2].copies == [("c", 180, 0, 70), ("d", 0, 70, 5)]
    assert fills[0].offset == 0 and fills[2].offset == 200
    assert plan_spans(testing, [Info("z", "U8", [0], 0, 0)], 100) == []
    with pytest.raises(ValueError):
        plan_spans(testing, infos, 0)


def test_parse_ring_and_env(monkeypatch, testing):
    assert testing.parse_ring("4x64MiB") == (4, 64 << 20)
    assert testing.parse_ring("2 x 256M") == (2, 256 << 20)
    assert testing.parse_ring("8x4096") == (8, 4096)
    assert testing.parse_ring("1x1GiB") == (1, 1 << 30)
    for bad in ("", "4", "0x64MiB", "4x0", "x64MiB", "4x64PB"):
        with pytest.raises(ValueError):
            testing.parse_ring(bad)
    monkeypatch.delenv(_staging.RING_ENV, raising=False)
    assert _safeload.staging_ring() == (4, 64 << 20)
    monkeypatch.setenv(_staging.RING_ENV, "3x1KiB")
    assert _safeload.staging_ring() == (3, 1024)
    assert _safeload.staging_ring(2, None) == (2, 1024)
    monkeypatch.setenv(_staging.RING_ENV, "lots")
    with pytest.raises(SafetensorError, match=_staging.RING_ENV):
        _safeload.staging_ring()
    with pytest.raises(SafetensorError):
        _safeload.staging_ring(0, 10)


# -- loads through CPU sinks ----------------------------------------------------------------------


@pytest.mark.parametrize("defer", [False, True], ids=["sync", "deferred"])
@pytest.mark.parametrize("ring", RINGS, ids=[f"{n}x{b}" for n, b in RINGS])
def test_bytes_equal_every_layout(write_st, ring, defer):
    n, b = ring
    path = write_st(mixed_tensors(seed=n + b))
    sink = CpuSink(defer=defer)
    got, stats = _staging.load_to_device(path, None, sink=sink, ring_buffers=n, buffer_bytes=b)
    assert stats.read.bytes_read == stats.bytes and stats.read.backend == "pread"
    assert_same(got, ref_load(path))
    assert stats.bytes == sum(t.numel() * t.element_size() for t in ref_load(path).values())
    # Bounded staging: at most the ring, whatever the checkpoint size.
    assert stats.staging_bytes <= n * b and stats.peak_in_flight <= n * b
    assert stats.buffers <= n and stats.buffer_bytes <= b
    assert sum(e[1] for e in sink.log if e[0] == "staging") == stats.staging_bytes
    check_order(sink.log)
    # Returned in file order, each tensor with its own storage.
    with safeload.safe_open(path, "pt") as f:
        assert list(got) == f.offset_keys()
    ptrs = [t.untyped_storage().data_ptr() for t in got.values() if t.numel()]
    assert len(set(ptrs)) == len(ptrs)


def test_deferred_sink_catches_early_refill(write_st, monkeypatch):
    """The ordering check has teeth: a loader that skipped ``wait`` would corrupt bytes."""
    path = write_st({"a": make_tensor("U8", (5000,), 1), "b": make_tensor("F32", (999,), 2)})
    sink = CpuSink(defer=True)
    monkeypatch.setattr(sink, "wait", lambda index: None)
    got, stats = _staging.load_to_device(path, None, sink=sink, ring_buffers=2, buffer_bytes=512)
    with pytest.raises(AssertionError):
        check_order(sink.log)
    with pytest.raises(AssertionError):
        assert_same(got, ref_load(path))


def test_large_checkpoint_small_ring(write_st):
    """Staging memory stays at the ring while the checkpoint is 40x larger."""
    tensors = {f"layer{i}.w": make_tensor("BF16", (256, 160 + i), seed=i) for i in range(12)}
    path = write_st(tensors)
    sink = CpuSink(defer=True)
    got, stats = _staging.load_to_device(path, None, sink=sink, ring_buffers=3, buffer_bytes=8192)
    assert_same(got, ref_load(path))
    assert stats.bytes > 40 * 3 * 8192
    assert stats.staging_bytes == 3 * 8192 and stats.peak_in_flight <= 3 * 8192
    assert stats.fills == -(-stats.bytes // 8192)
    check_order(sink.log)


@pytest.mark.parametrize("seed", range(6))
def test_subsets(write_st, seed):
    rng = random.Random(seed)
    tensors = mixed_tensors(seed)
    path = write_st(tensors)
    names = rng.sample(sorted(tensors), rng.randint(1, len(tensors)))
    sink = CpuSink(defer=True)
    got, stats = _staging.load_to_device(path, None, names=names, sink=sink, ring_buffers=2,
                                  buffer_bytes=rng.choice([1, 100, 4096]))
    assert_same(got, ref_load(path, names))
    check_order(sink.log)
    h = Handle(path, "pread")
    _, stats = _staging.load_to_device(h, None, names=names, sink=CpuSink(), buffer_bytes=64)
    wanted = sum(i.nbytes for i in h.infos() if i.name in names)
    assert h.stats().bytes_read == stats.read.bytes_read == wanted  # only the wanted bytes are read
    h.close()


def test_missing_name(write_st):
    path = write_st({"a": make_tensor("F32", (3,))})
    with pytest.raises(SafetensorError, match="File does not contain tensor nope"):
        _staging.load_to_device(path, None, names=["nope"], sink=CpuSink())


@pytest.mark.parametrize("code", list(TORCH_DTYPES))
def test_every_dtype(write_st, code):
    tensors = {"scalar": make_tensor(code, () if code != "F4" else (1,), 1),
               "empty": make_tensor(code, (0, 3), 2),
               "odd": make_tensor(code, (3, 5, 7), 3)}
    path = write_st(tensors)
    sink = CpuSink(defer=True)
    got, stats = _staging.load_to_device(path, None, sink=sink, ring_buffers=2, buffer_bytes=3)
    assert_same(got, ref_load(path))
    check_order(sink.log)


def test_shards_share_one_ring(write_st):
    a = write_st(mixed_tensors(1), name="a.safetensors")
    b = write_st({f"other{i}": make_tensor("F16", (17, i + 1), i) for i in range(9)}, name="b.safetensors")
    sink = CpuSink(defer=True)
    got, stats = _staging.load_to_device([a, b], None, sink=sink, ring_buffers=2, buffer_bytes=256)
    assert_same(got, {**ref_load(a), **ref_load(b)})
    check_order(sink.log)
    assert stats.buffers == 2
    # Selections per shard.
    got, stats = _staging.load_to_device([a, b], None, names=[None, ["other3"]], sink=CpuSink())
    assert sorted(got) == sorted(list(ref_load(a)) + ["other3"])
    with pytest.raises(ValueError):
        _staging.load_to_device([a, b], None, names=[None], sink=CpuSink())


def test_duplicate_across_shards(write_st):
    a = write_st({"x": make_tensor("F32", (2,))}, name="a.safetensors")
    b = write_st({"x": make_tensor("F32", (2,))}, name="b.safetensors")
    with pytest.raises(SafetensorError, match="tensor x appears in more than one shard"):
        _staging.load_to_device([a, b], None, sink=CpuSink())


def test_progress(write_st):
    path = write_st(mixed_tensors(3))
    calls = []
    _, stats = _staging.load_to_device(path, None, sink=CpuSink(), buffer_bytes=500,
                            progress=lambda d, t: calls.append((d, t)))
    total = stats.bytes
    assert calls and calls[-1] == (total, total)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_error_mid_load_aborts(write_st):
    path = write_st({"a": make_tensor("U8", (4000,))})

    class Failing(CpuSink):
        aborted = False

        def copy_fill(self, index, pairs):
            if index == 2:
                raise RuntimeError("device lost")
            super().copy_fill(index, pairs)

        def abort(self):
            Failing.aborted = True
            super().abort()

    with pytest.raises(RuntimeError, match="device lost"):
        _staging.load_to_device(path, None, sink=Failing(defer=True), buffer_bytes=1000)
    assert Failing.aborted


def test_host_then_to_sink(write_st):
    """The MPS / other-device path (here to the CPU): lazy host tensors, then ``.to``."""
    path = write_st(mixed_tensors(4))
    sink = HostThenToSink(torch.device("cpu"))
    assert not sink.eager_dest and not sink.pinned
    got, stats = _staging.load_to_device(path, None, sink=sink, ring_buffers=2, buffer_bytes=333)
    assert_same(got, ref_load(path))
    assert stats.staging_bytes <= 2 * 333


# -- devices this machine lacks ---------------------------------------------------------------------


def test_cuda_unavailable_fails_before_reading(write_st, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    path = write_st({"a": make_tensor("F32", (3,))})
    for device in ("cuda", "cuda:0", torch.device("cuda", 0)):
        with pytest.raises(SafetensorError, match="not available"):
            safeload.safe_open(path, "pt", device=device)
        with pytest.raises(SafetensorError, match="not available"):
            safeload.torch.load_file(path, device=device)
        with pytest.raises(SafetensorError, match="not available"):
            _checkpoint.load_checkpoint(path, device=device)
        h = Handle(path, "pread")
        with pytest.raises(SafetensorError, match="not available"):
            _staging.load_to_device(h, device)
        assert h.stats().bytes_read == 0
        h.close()


# -- integration: safe_open / load_checkpoint on a (pretend) CUDA device ----------------------------


def test_get_tensors_on_cuda_uses_staging(write_st, fake_cuda):
    tensors = {**mixed_tensors(5), "large": make_tensor("BF16", (100, 90), 9)}
    path = write_st(tensors)
    with safeload.safe_open(path, "pt", device="cuda:0", backend="mmap") as f:
        got = f.get_tensors()
        keys = f.offset_keys()
    stats = f.staging_stats
    assert stats.read.bytes_read == stats.bytes == f.stats.bytes_read  # the handle's own count
    assert len(fake_cuda) == 1 and fake_cuda[0].device == torch.device("cuda:0")
    assert list(got) == keys
    assert_same(got, ref_load(path))
    check_order(fake_cuda[0].log)
    assert stats.pinned and stats.pinned_bytes <= 2 * 4096 and stats.peak_in_flight <= 2 * 4096
    assert stats.fills > 2  # the tensors straddled the ring several times


def test_get_tensor_and_load_file_on_cuda_use_staging(write_st, fake_cuda):
    tensors = mixed_tensors(6)
    path = write_st(tensors)
    ref = ref_load(path)
    with safeload.safe_open(path, "pt", device="cuda") as f:
        for k in ref:
            assert_tensor_equal(f.get_tensor(k), ref[k], k)
            # Each load's stats are its own reads: this tensor's bytes, not the handle's total
            # (none for an empty tensor: nothing read).
            read = f.staging_stats.read
            assert (read.bytes_read if read else 0) == ref[k].numel() * ref[k].element_size(), k
        with pytest.raises(SafetensorError, match="File does not contain tensor nope"):
            f.get_tensor("nope")
    assert len(fake_cuda) == len(ref) + 1
    assert f.stats.bytes_read == sum(t.numel() * t.element_size() for t in ref.values())
    got = safeload.torch.load_file(path, device=torch.device("cuda", 0))
    assert_same(got, ref)
    assert len(fake_cuda) == len(ref) + 2


def test_staged_shards_are_one_checkpoint(write_st, fake_cuda, tmp_path):
    """A name in two shards is refused when the checkpoint opens, before any device memory."""
    a = write_st({"x": make_tensor("F32", (4,), 1)}, name="model-1.safetensors")
    b = write_st({"x": make_tensor("F32", (4,), 2)}, name="model-2.safetensors")
    with pytest.raises(SafetensorError, match="tensor x appears in more than one shard"):
        _checkpoint.load_checkpoint([a, b], "pt", device="cuda:0")
    assert all(not sink.log for sink in fake_cuda)  # nothing allocated, nothing copied


def test_load_checkpoint_on_cuda_uses_staging(write_st, fake_cuda, tmp_path):
    a = write_st(mixed_tensors(7), name="model-1.safetensors")
    b = write_st({"head": make_tensor("BF16", (40, 50), 1)}, name="model-2.safetensors")
    calls = []
    out, stats = _checkpoint.load_checkpoint([a, b], "pt", device="cuda:0", return_stats=True,
                                             progress=lambda d, t: calls.append((d, t)))
    assert len(fake_cuda) == 1
    assert_same(out, {**ref_load(a), **ref_load(b)})
    # Every tensor byte of both files, counted by the reader (not copied from another stat).
    on_disk = sum(t.nbytes for p in (a, b) for t in ref_load(p).values())
    assert stats.bytes_read == on_disk and calls[-1] == (on_disk, on_disk)
    out = safeload.torch.load_checkpoint(str(tmp_path), device="cuda")
    assert_same(out, {**ref_load(a), **ref_load(b)})


def test_load_checkpoint_on_cuda_honours_dtype_backend_and_threads(write_st, fake_cuda, tmp_path):
    """The device path takes every argument the CPU path takes: dtype converts the F32/F16/BF16
    tensors as the CPU path does (bit for bit), the backend reaches the reader (a bad one is
    refused), and the result equals the CPU load's."""
    path = write_st(mixed_tensors(9))
    cpu = _checkpoint.load_checkpoint(path, "pt", dtype=torch.float16, backend="pread")
    for backend in ("auto", "pread", "mmap", "direct"):
        got = _checkpoint.load_checkpoint(path, "pt", device="cuda:0", dtype=torch.float16, backend=backend,
                                          threads=2, chunk_bytes=1 << 16)
        assert_same(got, cpu)
        assert any(t.dtype == torch.float16 for t in got.values())
    with pytest.raises(SafetensorError, match="backend \"fast\" is invalid"):
        _checkpoint.load_checkpoint(path, "pt", device="cuda:0", backend="fast")
    with pytest.raises(SafetensorError, match="cannot be converted to on load"):
        _checkpoint.load_checkpoint(path, "pt", device="cuda:0", dtype=torch.int8)


def test_cpu_path_untouched(write_st, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("staging used for a CPU load")

    monkeypatch.setattr(_staging, "make_sink", boom)
    monkeypatch.setattr(_staging, "load_to_device", boom)
    path = write_st(mixed_tensors(8))
    ref = ref_load(path)
    with safeload.safe_open(path, "pt", device="cpu") as f:
        assert_same(f.get_tensors(), ref)
        assert_tensor_equal(f.get_tensor("big"), ref["big"])
    assert_same(_checkpoint.load_checkpoint(path), ref)
