"""The slow/faulty FUSE filesystem the storage tests and the benchmark rely on
(tests/support/slowfs.c, mounted by tests/support/slowfs.py) does what it says."""

import errno
import mmap
import os
import threading
import time

import pytest

import slowfs  # tests/support/slowfs.py, on sys.path through conftest

pytestmark = pytest.mark.skipif(bool(slowfs.fuse_unavailable()), reason=str(slowfs.fuse_unavailable()))

SIZE = 1 << 20


@pytest.fixture
def src(tmp_path):
    root = tmp_path / "src"
    (root / "sub").mkdir(parents=True)
    data = os.urandom(SIZE)
    (root / "a.bin").write_bytes(data)
    (root / "sub" / "b.bin").write_bytes(data[:5000])
    (root / "empty").write_bytes(b"")
    return root, data


@pytest.fixture
def mount(tmp_path, src):
    root, _ = src

    def make(*options):
        return slowfs.mounted(str(root), str(tmp_path / "mnt"), *options)

    return make


def test_mirror_is_byte_identical_and_read_only(mount, src):
    _, data = src
    with mount() as m:
        assert sorted(os.listdir(m)) == ["a.bin", "empty", "sub"]
        assert os.listdir(os.path.join(m, "sub")) == ["b.bin"]
        with open(os.path.join(m, "a.bin"), "rb") as f:
            assert f.read() == data
        with open(os.path.join(m, "sub", "b.bin"), "rb") as f:
            assert f.read() == data[:5000]
        with open(os.path.join(m, "empty"), "rb") as f:
            assert f.read() == b""
        fd = os.open(os.path.join(m, "a.bin"), os.O_RDONLY)
        try:
            assert os.pread(fd, 1000, 123_456) == data[123_456:124_456]
            assert os.pread(fd, 1000, SIZE - 10) == data[-10:]
        finally:
            os.close(fd)
        st = os.stat(os.path.join(m, "a.bin"))
        assert st.st_size == SIZE and st.st_mode & 0o777 == 0o444
        with pytest.raises(OSError) as e:
            os.open(os.path.join(m, "a.bin"), os.O_RDWR)
        assert e.value.errno in (errno.EROFS, errno.EACCES)
        stats = m.stats()
        assert stats["reads"] > 0 and stats["bytes"] >= SIZE and stats["errors"] == 0


def test_unmounts_on_error_and_refuses_a_busy_mount_point(mount, tmp_path):
    with pytest.raises(ZeroDivisionError):
        with mount() as m:
            with pytest.raises(RuntimeError, match="already a mount point"):
                with slowfs.mounted(str(tmp_path), m):
                    pass
            1 / 0
    assert not os.path.ismount(tmp_path / "mnt")
    assert os.listdir(tmp_path / "mnt") == []


def test_latency_is_added_to_each_read_request(mount):
    with mount("--latency", "0.2") as m:
        fd = os.open(os.path.join(m, "a.bin"), os.O_RDONLY)  # fresh open: nothing cached
        try:
            t0 = time.monotonic()
            os.pread(fd, 4096, 0)
            assert time.monotonic() - t0 >= 0.2
        finally:
            os.close(fd)


def test_bandwidth_is_one_link_shared_by_all_requests(mount, src):
    _, data = src
    with mount("--bandwidth", str(8 << 20), "--direct-io") as m:
        path = os.path.join(m, "a.bin")
        got = {}

        def read(off):
            fd = os.open(path, os.O_RDONLY)
            try:
                got[off] = os.pread(fd, SIZE // 2, off)
            finally:
                os.close(fd)

        t0 = time.monotonic()
        threads = [threading.Thread(target=read, args=(off,)) for off in (0, SIZE // 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert time.monotonic() - t0 >= 0.12  # 1 MiB at 8 MiB/s, whatever the parallelism
        assert got[0] + got[SIZE // 2] == data


def test_eio_at_an_offset(mount, src):
    _, data = src
    with mount("--eio", "a.bin:100000", "--direct-io") as m:
        fd = os.open(os.path.join(m, "a.bin"), os.O_RDONLY)
        try:
            assert os.pread(fd, 4096, 0) == data[:4096]
            assert os.pread(fd, 4096, 100001) == data[100001:104097]
            with pytest.raises(OSError) as e:
                os.pread(fd, 4096, 98304)  # covers 100000
            assert e.value.errno == errno.EIO
            assert m.stats()["errors"] == 1
        finally:
            os.close(fd)
        with open(os.path.join(m, "sub", "b.bin"), "rb") as f:
            assert f.read() == data[:5000]  # other files are fine
    with mount("--eio", "a.bin:100000") as m:  # buffered: readahead meets the bad request too
        with pytest.raises(OSError) as e:
            with open(os.path.join(m, "a.bin"), "rb") as f:
                f.read()
        assert e.value.errno == errno.EIO


def test_short_reads_return_half(mount, src):
    _, data = src
    with mount("--short-reads", "--direct-io") as m:
        fd = os.open(os.path.join(m, "a.bin"), os.O_RDONLY)
        try:
            assert os.pread(fd, 65536, 0) == data[:32768]
            assert os.pread(fd, 4096, 8192) == data[8192:12288]  # up to 4096 bytes: whole
            assert os.pread(fd, 3000, SIZE - 1000) == data[-1000:]
        finally:
            os.close(fd)


def test_shrink_after_some_bytes(mount, src):
    _, data = src
    with mount("--shrink", "a.bin:300000:200000", "--direct-io") as m:
        path = os.path.join(m, "a.bin")
        assert os.stat(path).st_size == SIZE
        fd = os.open(path, os.O_RDONLY)
        try:
            assert os.pread(fd, 262144, 0) == data[:262144]  # 262144 >= 200000 served: shrunk now
            assert os.pread(fd, 4096, 400000) == b""
            assert os.pread(fd, 4096, 299000) == data[299000:300000]
        finally:
            os.close(fd)
        deadline = time.monotonic() + 5  # the kernel caches attributes for 1 s
        while os.stat(path).st_size != 300000 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert os.stat(path).st_size == 300000


def test_zero_cut_answers_in_full_with_zeros_until_the_size_is_asked(mount, src):
    _, data = src
    with mount("--zero-cut", "a.bin:300000:200000", "--direct-io", "--attr-timeout", "0") as m:
        path = os.path.join(m, "a.bin")
        fd = os.open(path, os.O_RDONLY)
        try:
            assert os.pread(fd, 4096, 299000) == data[299000:303096]  # 4096 < 200000 served
            assert os.pread(fd, 262144, 0) == data[:262144]  # 200000 served, not past the cut
            assert os.fstat(fd).st_size == SIZE
            # The first request past the cut, and every one after it until the size is asked:
            # answered in full, zeros from the cut on. No byte count tells the reader.
            assert os.pread(fd, 200000, 200000) == data[200000:300000] + bytes(100000)
            assert os.pread(fd, 4096, 500000) == bytes(4096)
            assert os.pread(fd, 4096, 0) == data[:4096]
            assert m.stats()["zeroed"] == 2
            # The size asked now (attr_timeout 0: the kernel asks) is the cut one, and reads end
            # there from then on.
            assert os.lseek(fd, 0, os.SEEK_END) == 300000
            assert os.pread(fd, 4096, 299000) == data[299000:300000]
            assert os.pread(fd, 4096, 400000) == b""
            assert os.fstat(fd).st_size == 300000
            assert m.stats()["zeroed"] == 2
        finally:
            os.close(fd)


def read_direct(path, size, offset=0):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, size)  # page-aligned
        n = os.preadv(fd, [buf], offset)
        return bytes(buf[:n])
    finally:
        os.close(fd)


def test_o_direct_works_unless_refused(mount, src):
    _, data = src
    with mount("--no-direct") as m:
        with pytest.raises(OSError) as info:
            os.open(os.path.join(m, "a.bin"), os.O_RDONLY | os.O_DIRECT)
        assert info.value.errno == errno.EINVAL
        with open(os.path.join(m, "a.bin"), "rb") as f:
            assert f.read() == data  # buffered reads still work
    with mount() as m:
        try:
            got = read_direct(os.path.join(m, "a.bin"), 1 << 18, 1 << 16)
        except OSError as e:
            pytest.skip(f"this kernel refuses O_DIRECT on FUSE: {e}")
        assert got == data[1 << 16 : (1 << 16) + (1 << 18)]


def test_max_read_caps_the_request_size(mount, src):
    _, data = src
    with mount("--max-read", "65536", "--direct-io") as m:
        fd = os.open(os.path.join(m, "a.bin"), os.O_RDONLY)
        try:
            m.stats()
            assert os.pread(fd, SIZE, 0) == data
            stats = m.stats()
            assert 0 < stats["size_max"] <= 65536, stats
        finally:
            os.close(fd)


def test_kernel_limits_are_set_on_the_connection(mount):
    with mount("--max-background", "77", "--congestion-threshold", "50") as m:
        conn = m.connection()
        if conn is None:
            pytest.skip("/sys/fs/fuse/connections is not mounted (mount -t fusectl none /sys/fs/fuse/connections)")
        try:
            with open(os.path.join(conn, "max_background")) as f:
                assert int(f.read()) == 77
            with open(os.path.join(conn, "congestion_threshold")) as f:
                assert int(f.read()) == 50
        except PermissionError as e:
            pytest.skip(f"connection limits not readable: {e}")
