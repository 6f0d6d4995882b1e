"""The parallel reader against safetensors 0.8, byte for byte: chunk boundaries, odd sizes,
empty tensors, subsets, shards with an index, streaming with bounded memory, the GIL and Ctrl-C."""

import json
import os
import signal
import subprocess
import sys

import pytest
import safetensors
import safetensors.torch as st
import torch

import safeload
import safeload.torch as sl
import slowfs  # tests/support/slowfs.py, on sys.path through conftest
from conftest import raw_bytes



def assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert raw_bytes(got[k]) == raw_bytes(v), k


def pattern(n: int, seed: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.int64) * 2654435761 + seed).to(torch.uint8)


@pytest.fixture(scope="module")
def odd_file(tmp_path_factory):
    """Odd sizes around chunk boundaries (chunk_bytes=4096 below), empties and scalars."""
    path = tmp_path_factory.mktemp("engine") / "odd.safetensors"
    sizes = [1, 4095, 4096, 4097, 0, 12_345, 3, 100_000, 8191, 1 << 20, 7, 3 << 20]
    tensors = {f"t{i:02d}": pattern(n, i) for i, n in enumerate(sizes)}
    tensors["f32"] = torch.randn(33, 17)
    tensors["bf16"] = torch.randn(5, 1000).to(torch.bfloat16)
    tensors["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    tensors["empty2d"] = torch.empty(0, 9)
    st.save_file(tensors, path)
    return path


@pytest.mark.parametrize("threads", [1, 2, 7])
@pytest.mark.parametrize("chunk_bytes", [4096, 65536, None])
def test_get_tensors_matches_safetensors(odd_file, threads, chunk_bytes):
    with safetensors.safe_open(odd_file, "pt") as f:
        want = {k: f.get_tensor(k) for k in f.offset_keys()}
    with safeload.safe_open(odd_file, "pt", backend="pread", threads=threads, chunk_bytes=chunk_bytes) as f:
        assert_same(f.get_tensors(), want)
        for k in want:
            assert raw_bytes(f.get_tensor(k)) == raw_bytes(want[k])


def test_large_tensors_are_aligned_and_owned(odd_file):
    loaded = sl.load_file(odd_file, backend="pread")
    ptrs = [t.untyped_storage().data_ptr() for t in loaded.values() if t.numel()]
    assert len(set(ptrs)) == len(ptrs)
    for t in loaded.values():
        if t.numel():
            assert t.data_ptr() % 64 == 0
    big = loaded["t11"]  # 3 MiB: its own huge-page allocation
    assert big.data_ptr() % (2 << 20) == 0
    before = odd_file.read_bytes()
    big += 1  # writable, and independent of the file
    assert odd_file.read_bytes() == before
    assert torch.equal(sl.load_file(odd_file)["t11"], big - 1)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    shards = {
        "model-00001-of-00003.safetensors": {"a": torch.randn(300, 7), "b": pattern(5000, 1)},
        "model-00002-of-00003.safetensors": {"c": torch.randn(2, 3).to(torch.float16), "d": pattern(1, 2)},
        "model-00003-of-00003.safetensors": {"e": torch.arange(999, dtype=torch.int64)},
    }
    weight_map = {}
    for name, tensors in shards.items():
        st.save_file(tensors, root / name)
        weight_map.update({k: name for k in tensors})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    want = {}
    for name in sorted(shards):
        want.update(st.load_file(root / name))
    return root, want


def test_load_checkpoint_forms(sharded):
    root, want = sharded
    files = sorted(str(p) for p in root.glob("*.safetensors"))
    for form in (root, root / "model.safetensors.index.json", files):
        got = sl.load_checkpoint(form, chunk_bytes=4096)
        assert set(got) == set(want)
        for k in want:
            assert raw_bytes(got[k]) == raw_bytes(want[k]), (form, k)
    single = sl.load_checkpoint(files[0])
    assert set(single) == {"a", "b"}
    assert set(sl.load_checkpoint(root, backend="mmap")) == set(want)


def test_iter_checkpoint_bounds_batches(sharded):
    root, want = sharded
    seen = []
    progress = []
    for name, tensor in sl.iter_checkpoint(root, max_inflight_bytes=2000, progress=lambda d, t: progress.append((d, t))):
        assert raw_bytes(tensor) == raw_bytes(want[name])
        seen.append(name)
    assert sorted(seen) == sorted(want)
    total = sum(t.numel() * t.element_size() for t in want.values())
    assert progress[-1] == (total, total)
    assert len(progress) > 3  # batches of at most ~2000 bytes (bigger tensors alone)


def test_subset_read_many(odd_file):
    with safetensors.safe_open(odd_file, "pt") as f:
        want = {k: f.get_tensor(k) for k in ("t10", "t01", "f32")}
    with safeload.safe_open(odd_file, "pt", backend="pread") as f:
        items = f._handle.read_many(["t10", "t01", "f32"])
        assert [i[0] for i in items] == [k for k in f.offset_keys() if k in want]
        for name, code, shape, data in items:
            assert bytes(data) == raw_bytes(want[name])


GIL_SCRIPT = r"""
import json, os, sys, threading
import safeload
mnt, name = sys.argv[1], sys.argv[2]
releases, done = [], threading.Event()


def releaser():
    # Lets the mount's held reads go, one round at a time: it only runs while the reading
    # thread has the GIL released.
    while not done.is_set():
        with open(os.path.join(mnt, ".slowfs-stats"), "rb", buffering=0) as f:
            held = int(f.read(4096).decode().split("held=")[1].split()[0])
        if held:
            with open(os.path.join(mnt, ".slowfs-release"), "rb", buffering=0) as f:
                f.read(16)
            releases.append(held)


t = threading.Thread(target=releaser)
t.start()
with safeload.safe_open(os.path.join(mnt, name), "pt", backend="pread", chunk_bytes=1 << 20) as f:
    n = len(f.get_tensors())
done.set()
t.join()
print(json.dumps({"tensors": n, "releases": len(releases)}))
"""


@pytest.mark.skipif(bool(slowfs.fuse_unavailable()), reason=str(slowfs.fuse_unavailable()))
def test_gil_released_during_reads(tmp_path):
    """Every read request is held at a FUSE mount until another Python thread of the same
    process lets it go: the open and the load can only finish if the GIL is released while they
    wait (held, the process would stop, and the subprocess time out)."""
    src = tmp_path / "src"
    src.mkdir()
    st.save_file({"w": torch.zeros(8 << 20, dtype=torch.uint8), "b": torch.ones(1000)}, src / "m.safetensors")
    with slowfs.mounted(str(src), str(tmp_path / "mnt"), "--hold-after", "0") as mnt:
        proc = subprocess.run([sys.executable, "-c", GIL_SCRIPT, mnt, "m.safetensors"],
                              capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["tensors"] == 2 and out["releases"] >= 2  # the header's reads, then the data's


CTRL_C_SCRIPT = r"""
import signal, sys, time, safeload
# Python leaves SIGINT ignored where its parent ignored it (a shell's background job): Ctrl-C's
# handler, whatever this process inherited.
signal.signal(signal.SIGINT, signal.default_int_handler)
f = safeload.safe_open(sys.argv[1], "pt", backend="pread", threads=2, chunk_bytes=1 << 20)
try:
    print("ready", flush=True)  # inside the try: an interrupt from here on is caught below
    for _ in range(1000):
        f.get_tensors()
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_ctrl_c_interrupts_load(tmp_path):
    path = tmp_path / "big.safetensors"
    st.save_file({"w": torch.zeros(256 << 20, dtype=torch.uint8)}, path)
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", CTRL_C_SCRIPT, str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    # 1000 loads of 256 MiB take minutes: only the interrupt ends them. How promptly, and in
    # the middle of a read, is pinned without timing in test_robustness (reads held at a mount).
    assert out.split()[:1] == ["interrupted"], (proc.returncode, out, err[-2000:])
