"""Tensors pulled one at a time: ``get_slice(k)[...]`` and ``get_tensor`` loops in any order and
from several threads (transformers' and vLLM's patterns), against safetensors 0.8's results.

- ``backend="mmap"``: a whole-tensor index returns a zero-copy view of the map, as 0.8 does.
- ``pread`` / ``direct``: the Rust read-ahead reads the file in file order and hands each tensor
  over when asked; whatever it serves must be the file's bytes.
- Network mounts (a real FUSE mount) are never mapped, even when ``"mmap"`` is asked for.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import time

import pytest
import safetensors
import safetensors.torch as st
import torch

import safeload
import safeload.torch
from conftest import raw_bytes

import slowfs  # tests/support/slowfs.py, on sys.path through conftest

FUSE_SKIP = slowfs.fuse_unavailable()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A Llama-like file: bf16 matrices of several sizes, norms, an int buffer."""
    root = tmp_path_factory.mktemp("lazy")
    g = torch.Generator().manual_seed(5)
    tensors = {}
    for layer in range(6):
        p = f"model.layers.{layer}."
        tensors[p + "self_attn.q_proj.weight"] = torch.randn(256, 256, generator=g).to(torch.bfloat16)
        tensors[p + "mlp.up_proj.weight"] = torch.randn(640, 256, generator=g).to(torch.bfloat16)
        tensors[p + "input_layernorm.weight"] = torch.randn(256, generator=g)
    tensors["model.embed_tokens.weight"] = torch.randn(1000, 256, generator=g).to(torch.bfloat16)
    tensors["positions"] = torch.arange(77, dtype=torch.int64)
    tensors["scalar"] = torch.tensor(3.5)
    tensors["empty"] = torch.zeros(0, 4)
    path = root / "model.safetensors"
    st.save_file(tensors, path)
    with safetensors.safe_open(path, "pt") as f:
        want = {k: f.get_tensor(k).clone() for k in f.keys()}
    return root, str(path), want


def _materialise(f, names, threads=4):
    """transformers 5's pattern: get_slice for every key first, then ``[...]`` from a pool."""
    slices = {k: f.get_slice(k) for k in names}
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return dict(zip(names, pool.map(lambda k: slices[k][...], names)))


def _wait_for_read_ahead(f, deadline_s=60.0):
    """Until the handle's read-ahead has read something (it runs in the background)."""
    end = time.monotonic() + deadline_s
    while f.stats.bytes_read == 0:
        assert time.monotonic() < end, "the read-ahead never read anything"
        time.sleep(0.01)


def _same(got, want):
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert raw_bytes(got[k]) == raw_bytes(want[k]), k


def test_mapped_whole_tensor_index_is_a_view_of_the_map(model):
    _, path, want = model
    name = "model.layers.2.mlp.up_proj.weight"
    with safeload.safe_open(path, "pt", backend="mmap") as f:
        assert f.backend == "mmap"
        full = f.get_slice(name)
        views = [full[...], full[:], full[0:640], full[:, :], f.get_tensor(name)]
        ptrs = {v.untyped_storage().data_ptr() for v in views}
        # Owned memory would give each read its own pointer; views of the one map share it.
        assert len(ptrs) == 1, ptrs
        for v in views:
            assert torch.equal(v, want[name])
        # Parts of a tensor are new memory with the right bytes.
        part = full[10:20]
        assert part.untyped_storage().data_ptr() not in ptrs
        assert torch.equal(part, want[name][10:20])
        # A private map: writing to the view changes neither the file nor the next read.
        views[0].zero_()
    with safetensors.safe_open(path, "pt") as f:
        assert torch.equal(f.get_tensor(name), want[name])


def test_default_backend_returns_views_where_it_maps(model):
    _, path, want = model
    with safeload.safe_open(path, "pt") as f:
        got = _materialise(f, f.keys())
        if f.backend != "mmap":
            pytest.skip(f"auto chose {f.backend} here")
        for k, v in got.items():
            if v.numel():
                assert v.untyped_storage().data_ptr() == f.get_tensor(k).untyped_storage().data_ptr(), k
    _same(got, want)


def _mapped_rss_kib(path):
    """Resident KiB of this process's mappings of ``path`` (``/proc/self/smaps``)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as maps:
        for line in maps:
            head = line.split()
            if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                inside = len(head) >= 6 and head[5] == path
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps")
@pytest.mark.parametrize("call", ["get_tensors", "get_tensor loop", "load_file", "load_checkpoint"])
def test_a_resident_file_is_mapped_and_nothing_is_faulted_in(tmp_path, call):
    """safetensors 0.8's default on a warm file: views of a map, no page touched until the caller
    touches it. safeload's read-ahead makes pages resident only where the file is not in the
    page cache; on a resident file it would fault every page into the process (per call, a cost
    that grows with the file), which /proc/self/smaps shows as the map's Rss."""
    path = str(tmp_path / "warm.safetensors")
    st.save_file({f"t{i}": torch.full((1 << 20,), float(i)) for i in range(6)}, path)
    with open(path, "rb") as f:
        while f.read(1 << 22):  # resident in the page cache
            pass
    if call in ("load_file", "load_checkpoint"):
        if call == "load_file":
            got = safeload.torch.load_file(path)
            backend = "mmap"  # the handle is closed; its views keep the map
        else:
            got, stats = safeload.torch.load_checkpoint(str(tmp_path), return_stats=True)
            backend = stats.backend
    else:
        with safeload.safe_open(path, "pt") as f:
            backend = f.backend
            got = f.get_tensors() if call == "get_tensors" else {k: f.get_tensor(k) for k in f.offset_keys()}
            rss = _mapped_rss_kib(path)
    if backend != "mmap":
        pytest.skip(f"auto chose {backend} here")
    if call in ("load_file", "load_checkpoint"):
        rss = _mapped_rss_kib(path)
    # 24 MiB of tensors; nothing of them touched (the header is read, not mapped).
    assert rss <= 64, f"{rss} KiB of the map faulted in by {call}"
    for i in range(6):
        assert torch.equal(got[f"t{i}"], torch.full((1 << 20,), float(i)))


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="evicts with posix_fadvise")
def test_shards_evicted_from_the_page_cache_are_mapped_and_read_ahead(tmp_path):
    """load_checkpoint of cold shards: views of the maps whose pages a background walk brings in
    while the caller touches them; whatever the race, the tensors are the file's."""
    want = {}
    for shard in range(3):
        part = {f"s{shard}.t{i}": torch.randn(256, 1024) for i in range(4)}
        st.save_file(part, tmp_path / f"model-{shard}.safetensors")
        want.update(part)
    for f in tmp_path.iterdir():
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    got, stats = safeload.torch.load_checkpoint(str(tmp_path), return_stats=True)
    assert stats.backend in ("mmap", "pread", "direct")
    _same(got, want)


@pytest.mark.parametrize("backend", ["pread", "direct"])
@pytest.mark.parametrize("budget", ["64KiB", "1MiB", "256MiB"])
def test_read_ahead_serves_out_of_order_threaded_slices(model, backend, budget, monkeypatch, testing):
    _, path, want = model
    monkeypatch.setenv("SAFELOAD_READAHEAD_BYTES", budget)
    names = list(want)
    random.Random(budget + backend).shuffle(names)
    with safeload.safe_open(path, "pt", backend=backend) as f:
        first = f.get_slice(names[0])[...]
        _wait_for_read_ahead(f)
        got = _materialise(f, names[1:])
        got[names[0]] = first
        assert testing.readahead_bytes(f._handle) <= max(safeload_budget(budget), max(t.nbytes for t in want.values()))
    _same(got, want)


def safeload_budget(text):
    units = {"KiB": 1 << 10, "MiB": 1 << 20}
    for u, scale in units.items():
        if text.endswith(u):
            return int(text[: -len(u)]) * scale
    return int(text)


@pytest.mark.parametrize("backend", ["pread", "direct", "mmap", "auto"])
def test_get_tensor_loop_in_any_order(model, backend, monkeypatch):
    _, path, want = model
    monkeypatch.setenv("SAFELOAD_READAHEAD_BYTES", "512KiB")
    with safeload.safe_open(path, "pt", backend=backend) as f:
        order = f.offset_keys()
        got = {k: f.get_tensor(k) for k in reversed(order)}
        # Asked again: a new tensor each time (owned backends), the same bytes.
        again = {k: f.get_tensor(k) for k in order[:3]}
    _same(got, want)
    for k, v in again.items():
        assert torch.equal(v, want[k])
        if backend in ("pread", "direct") and v.numel():
            assert v.untyped_storage().data_ptr() != got[k].untyped_storage().data_ptr()


def test_tensors_outlive_the_handle_and_its_read_ahead(model):
    _, path, want = model
    f = safeload.safe_open(path, "pt", backend="pread")
    names = f.offset_keys()
    got = {names[0]: f.get_tensor(names[0])}
    _wait_for_read_ahead(f)
    slices = {k: f.get_slice(k) for k in names[1:4]}
    f.__exit__(None, None, None)  # transformers closes this way, slices still alive
    got.update({k: s[...] for k, s in slices.items()})
    with pytest.raises(safeload.SafetensorError, match="closed"):
        f.get_tensor(names[5])
    del slices
    for k, v in got.items():
        assert torch.equal(v, want[k]), k


def test_sub_slices_of_read_ahead_tensors(model, monkeypatch):
    _, path, want = model
    name = "model.embed_tokens.weight"
    with safeload.safe_open(path, "pt", backend="pread") as f:
        f.get_tensor(f.offset_keys()[0])
        _wait_for_read_ahead(f)
        for key in [(slice(3, 9),), (slice(None), slice(10, 20)), (5,), (slice(-4, None), 7)]:
            assert torch.equal(f.get_slice(name)[key], want[name][key]), key
        assert torch.equal(f.get_tensor(name), want[name])


def test_read_ahead_off(model, monkeypatch):
    _, path, want = model
    monkeypatch.setenv("SAFELOAD_READAHEAD_BYTES", "0")
    with safeload.safe_open(path, "pt", backend="pread") as f:
        got = _materialise(f, f.keys())
        # The slices' reads count in the file's stats, each tensor's bytes once: none ahead.
        assert f.stats.bytes_read == sum(v.numel() * v.element_size() for v in want.values())
    _same(got, want)


@pytest.fixture
def fuse_model(model, tmp_path):
    if FUSE_SKIP:
        pytest.skip(FUSE_SKIP)
    root, _, want = model
    with slowfs.mounted(str(root), str(tmp_path / "mnt"), "--latency", "0.0005") as m:
        yield os.path.join(m, "model.safetensors"), want


@pytest.mark.parametrize("backend", ["mmap", "auto", "pread"])
def test_network_mounts_are_never_mapped(fuse_model, backend):
    path, want = fuse_model
    with safeload.safe_open(path, "pt", backend=backend) as f:
        assert f._handle.storage == "fuse"
        assert f.backend in ("direct", "pread")  # the network reader, never "mmap"
        got = _materialise(f, f.keys())
        everything = f.get_tensors()
    _same(got, want)
    _same(everything, want)


def test_file_cut_short_under_the_read_ahead_raises_never_bad_bytes(tmp_path, monkeypatch):
    # 1 MiB tensors and a 1 MiB budget: when the file is cut, the read-ahead holds at most the
    # tensor after the first one, so the tensors past the cut cannot have been read before it.
    monkeypatch.setenv("SAFELOAD_READAHEAD_BYTES", "1MiB")
    tensors = {f"t{i}": torch.full((256, 1024), i, dtype=torch.int32) for i in range(8)}
    path = tmp_path / "model.safetensors"
    st.save_file(tensors, path)
    failed = []
    with safeload.safe_open(path, "pt", backend="pread") as f:
        names = f.offset_keys()
        assert torch.equal(f.get_tensor(names[0]), tensors[names[0]])
        os.truncate(path, os.path.getsize(path) // 2)
        for k in names[1:]:
            try:
                got = f.get_tensor(k)
            except safeload.SafetensorError as e:
                assert str(path) in str(e) and k in str(e), str(e)
                failed.append(k)
            else:
                assert torch.equal(got, tensors[k]), k  # read before the cut: the file's bytes
    assert failed and failed == names[-len(failed):], failed


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_reads_without_the_parents_workers(model, monkeypatch):
    """DataLoader-style fork while the read-ahead runs: the child has no workers, so its requests
    read on demand (never wait on a parent's thread) and get the right bytes."""
    _, path, want = model
    monkeypatch.setenv("SAFELOAD_READAHEAD_BYTES", "256KiB")
    with safeload.safe_open(path, "pt", backend="pread") as f:
        names = f.offset_keys()
        f.get_tensor(names[0])
        _wait_for_read_ahead(f)
        pid = os.fork()
        if pid == 0:  # the child: exit status says what happened; a hang is cut by alarm
            code = 3
            try:
                import signal

                signal.alarm(60)
                # Compared as bytes through numpy: torch's parallel ops (OpenMP, started by the
                # parent) hang in a forked child whatever safeload does.
                def flat(t):
                    return t.reshape(-1).view(torch.uint8).numpy().tobytes()

                ok = all(flat(f.get_tensor(k)) == flat(want[k]) for k in reversed(names))
                f.close()
                code = 0 if ok else 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        for k in names[1:]:
            assert torch.equal(f.get_tensor(k), want[k]), k
