"""Storage-aware reading: the auto backend's choices, O_DIRECT, page-cache hygiene, and a real
FUSE mount (tests/support/slowfs.py) that is slow and fails on purpose."""

import os

import pytest
import safetensors
import safetensors.torch as st
import torch

import safeload
import safeload.torch as sl
from conftest import raw_bytes

import slowfs  # tests/support/slowfs.py, on sys.path through conftest

FUSE_SKIP = slowfs.fuse_unavailable()



def evict(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # dirty pages cannot be dropped
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def warm(path):
    with open(path, "rb") as f:
        while f.read(1 << 22):
            pass


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    root = tmp_path_factory.mktemp("storage")
    tensors = {f"w{i}": (torch.arange(300_000 + i, dtype=torch.int32) * (i + 1)) for i in range(12)}
    tensors["small"] = torch.randn(3, 5)
    path = root / "model.safetensors"
    st.save_file(tensors, path)
    evict(path)  # written back, so that later evictions work
    # Owned copies: safetensors' mmap-backed tensors would pin the file's pages in the cache.
    want = {k: v.clone() for k, v in st.load_file(path).items()}
    return root, path, want


def assert_equal(got, want):
    assert set(got) == set(want)
    for k in want:
        assert raw_bytes(got[k]) == raw_bytes(want[k]), k


def test_auto_reads_cold_files_too_big_for_memory_with_o_direct(sample, monkeypatch, testing):
    if testing.residency(__file__)[1] != "local":
        pytest.skip("temporary files are not on a local block filesystem")
    _, path, want = sample
    evict(path)
    assert testing.residency(path)[0] < 0.5
    with safeload.safe_open(path, "pt") as f:
        assert f.backend == "mmap"  # cold but small next to free memory: mapped, as 0.8's default
    monkeypatch.setenv("SAFELOAD_DIRECT_ABOVE", "1000")  # as if the file did not fit in memory
    with safeload.safe_open(path, "pt") as f:
        assert f.backend == "direct"
        assert_equal(f.get_tensors(), want)
        assert f.stats.bytes_read == sum(t.numel() * t.element_size() for t in want.values())
    assert testing.residency(path)[0] < 0.5  # O_DIRECT left the page cache alone
    warm(path)
    with safeload.safe_open(path, "pt") as f:
        assert f.backend == "mmap"  # warm: the page cache, mapped
        assert_equal(f.get_tensors(), want)


def test_backends_agree(sample):
    _, path, want = sample
    for backend in ("pread", "direct", "mmap", "auto"):
        assert_equal(sl.load_file(path, backend=backend), want)
        got = sl.load_checkpoint(path, backend=backend, chunk_bytes=1 << 16)
        assert_equal(got, want)


def test_environment_variable_replaces_the_default(sample, monkeypatch):
    _, path, _ = sample
    monkeypatch.setenv("SAFELOAD_BACKEND", "mmap")
    with safeload.safe_open(path, "pt") as f:
        assert f.backend == "mmap"
    with safeload.safe_open(path, "pt", backend="pread") as f:
        assert f.backend == "pread"  # an explicit choice wins
    monkeypatch.setenv("SAFELOAD_BACKEND", "bogus")
    with pytest.raises(safeload.SafetensorError, match='backend "bogus" is invalid'):
        safeload.safe_open(path, "pt")
    with pytest.raises(safeload.SafetensorError, match='backend "bogus" is invalid'):
        sl.load_checkpoint(path)  # read where every reader reads it: in Rust
    monkeypatch.delenv("SAFELOAD_BACKEND")
    with pytest.raises(TypeError, match="argument 'backend': 'int' object is not a str"):
        safeload.safe_open(path, "pt", backend=1)


def test_drop_cache_leaves_file_uncached(sample, testing):
    _, path, want = sample
    warm(path)
    assert testing.residency(path)[0] > 0.9
    with safeload.safe_open(path, "pt", backend="pread", drop_cache=True) as f:
        assert_equal(f.get_tensors(), want)
    assert testing.residency(path)[0] < 0.5


def test_direct_falls_back_visibly_where_refused(tmp_path, sample):
    _, path, want = sample
    shm = "/dev/shm"
    if not os.path.isdir(shm):
        pytest.skip("no /dev/shm")
    target = os.path.join(shm, f"safeload-test-{os.getpid()}.safetensors")
    try:
        with open(path, "rb") as src, open(target, "wb") as dst:
            dst.write(src.read())
        with safeload.safe_open(target, "pt", backend="direct") as f:
            assert f._handle.storage == "memory"
            assert_equal(f.get_tensors(), want)
            # Either tmpfs took O_DIRECT, or the handle says it fell back to buffered reads.
            assert f.backend in ("direct", "pread")
        with safeload.safe_open(target, "pt") as f:
            assert f.backend == "mmap"  # memory filesystems: mapped, never O_DIRECT
    finally:
        os.unlink(target)


@pytest.fixture
def mount(tmp_path, sample):
    if FUSE_SKIP:
        pytest.skip(FUSE_SKIP)
    root, _, _ = sample

    def make(*options):
        return slowfs.mounted(str(root), str(tmp_path / "mnt"), *options)

    return make


def test_fuse_mount_is_detected_and_read_in_parallel(mount, sample):
    _, _, want = sample
    with mount("--latency", "0.002") as m:
        path = os.path.join(m, "model.safetensors")
        with safeload.safe_open(path, "pt") as f:
            assert f._handle.storage == "fuse"
            # Never mmap on a network filesystem; cold, uncached reads (past FUSE readahead),
            # straight into the tensors: FUSE has no O_DIRECT alignment rule.
            assert f.backend == "direct"
            assert_equal(f.get_tensors(), want)
            assert f.backend == "direct"
            stats = f.stats
            chunks = -(-stats.bytes_read // stats.chunk_bytes)
            assert stats.threads == min(16, chunks)  # network: up to 16 requests in flight
        with safeload.safe_open(path, "pt", chunk_bytes=1 << 20) as f:
            f.get_tensors()
            assert f.stats.threads >= 8
        with safetensors.safe_open(path, "pt") as f:
            assert set(f.keys()) == set(want)


def test_fuse_mount_refusing_o_direct_falls_back_to_buffered(mount, sample):
    _, _, want = sample
    with mount("--latency", "0.001", "--no-direct") as m:
        path = os.path.join(m, "model.safetensors")
        with safeload.safe_open(path, "pt") as f:
            assert f.backend == "direct"  # chosen: the mount is cold
            assert_equal(f.get_tensors(), want)
            assert f.backend == "pread"  # refused at open: read buffered, and says so


def test_fuse_warm_file_is_copied_from_the_cache(mount, sample, testing):
    _, _, want = sample
    with mount("--keep-cache") as m:  # else every open drops the file's pages (FUSE default)
        path = os.path.join(m, "model.safetensors")
        with open(path, "rb") as f:
            while f.read(1 << 20):
                pass
        assert testing.residency(path)[0] > 0.5
        with safeload.safe_open(path, "pt") as f:
            assert f.backend == "pread"
            assert_equal(f.get_tensors(), want)


def test_fuse_short_reads_are_never_silently_wrong(mount, sample):
    """A FUSE daemon answering short means end of file to the kernel: the load must either
    deliver every byte right or fail naming the file, never return wrong bytes."""
    _, _, want = sample
    with mount("--short-reads") as m:
        path = os.path.join(m, "model.safetensors")
        for backend in ("pread", "direct", "auto"):
            try:
                got = sl.load_file(path, backend=backend)
            except safeload.SafetensorError as e:
                assert "model.safetensors" in str(e)
            else:
                assert_equal(got, want)


def test_fuse_io_error_names_file_tensor_and_offset(mount, sample):
    _, path, _ = sample
    with safeload.safe_open(path, "pt") as f:
        start = f._handle.data_start
        info = f._handle.infos()[5]
        name, begin = info.name, info.begin
    bad = start + begin + 1000
    with mount("--eio", f"model.safetensors:{bad}") as m:
        mounted = os.path.join(m, "model.safetensors")
        for backend in ("pread", "direct", "auto"):
            with pytest.raises(safeload.SafetensorError) as info:
                sl.load_file(mounted, backend=backend)
            message = str(info.value)
            assert "model.safetensors" in message and "Input/output error" in message, message
            # The failed request may be a readahead that started in an earlier tensor: the
            # message names the tensor and offset whose read failed, at or before the bad byte.
            assert "tensor " in message, message
            offset = int(message.rsplit("offset ", 1)[1].rstrip(")"))
            assert offset <= bad, (offset, bad, name)


def test_fuse_file_shrinking_during_read_is_an_error(mount, sample):
    _, path, _ = sample
    size = os.path.getsize(path)
    with mount("--shrink", f"model.safetensors:{size // 2}:{size // 4}") as m:
        mounted = os.path.join(m, "model.safetensors")
        with pytest.raises(safeload.SafetensorError, match="ended early|offset"):
            with safeload.safe_open(mounted, "pt", backend="pread", threads=2, chunk_bytes=1 << 16) as f:
                f.get_tensors()
