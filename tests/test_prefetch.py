"""safetensors 0.9's prefetch API on the CPU: ``get_tensor_meta``, ``prefetch(plan)`` and the
``PrefetchLoader`` (take, iteration, names, len, close, context manager), against the bytes on
disk and safetensors 0.8's tensors; the consumers' call shapes (vLLM's ``yield from loader``,
transformers' per-rank sliced plans); bytes read counted; memory within the budget; errors in
upstream's words. Devices: ``test_mps.py`` (MPS stand-in) and ``test_prefetch_cuda``-style checks
below with a CPU stand-in for CUDA."""

from __future__ import annotations

import json
import random
import struct

import pytest
import torch

import safetensors.torch as st_torch

import safeload
from safeload import SafetensorError, _device, _prefetch

from conftest import (
    CUT_OFF,
    assert_cut_tensors_raise,
    assert_tensor_equal,
    cut_last_tensors,
    file_to_cut,
    make_tensor,
    mixed_tensors,
)

BACKENDS = ["auto", "pread", "mmap", "direct"]


def header_of(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def rows_of(t, rows):
    return t if rows is None else t[rows]


def test_get_tensor_meta_is_the_header(write_st):
    path = write_st(mixed_tensors(1))
    header = header_of(path)
    for backend in BACKENDS:
        with safeload.safe_open(path, "pt", backend=backend) as f:
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                meta = f.get_tensor_meta(name)
                assert meta.dtype == entry["dtype"]
                assert meta.shape == entry["shape"]
                assert meta.data_offsets == tuple(entry["data_offsets"])
            with pytest.raises(SafetensorError, match="does not contain"):
                f.get_tensor_meta("nope")


@pytest.mark.parametrize("backend", BACKENDS)
def test_take_in_any_order_then_iterate_the_rest(write_st, backend):
    tensors = mixed_tensors(2, big_rows=2000)
    path = write_st(tensors)
    ref = st_torch.load_file(path)
    with safeload.safe_open(path, "pt", backend=backend) as f:
        order = f.offset_keys()
        with f.prefetch() as loader:
            assert loader.names() == order and len(loader) == len(order)
            names = list(order)
            random.Random(2).shuffle(names)
            for name in names[: len(names) // 2]:
                assert_tensor_equal(loader.take(name), ref[name], name)
            rest = list(loader)  # the others, in file order
            assert [n for n, _ in rest] == [n for n in order if n not in names[: len(names) // 2]]
            for name, t in rest:
                assert_tensor_equal(t, ref[name], name)
            assert list(loader) == []
        assert loader.closed


def test_vllm_shape_yield_from_loader(write_st):
    """vLLM's iterator: ``safe_open(path, framework="pt").prefetch(device=...)``, ``yield from``."""
    path = write_st(mixed_tensors(3))
    ref = st_torch.load_file(path)

    def weights():
        with safeload.safe_open(path, framework="pt") as f:
            loader = f.prefetch(device="cpu")
            try:
                yield from loader
            finally:
                loader.close()

    got = dict(weights())
    assert sorted(got) == sorted(ref)
    for name in ref:
        assert_tensor_equal(got[name], ref[name], name)


@pytest.mark.parametrize("backend", ["pread", "mmap"])
def test_rank_plans_read_only_their_rows(write_st, backend, testing):
    """transformers' per-device loaders: each rank's rows of the 2-d tensors, the 1-d ones whole.
    Each loader reads exactly the bytes of its plan, and holds no more than its budget."""
    tensors = {f"layer{i}.weight": make_tensor("BF16", (96, 64), i) for i in range(6)}
    tensors.update({f"layer{i}.bias": make_tensor("F32", (64,), 10 + i) for i in range(6)})
    tensors["q"] = make_tensor("F4", (12, 8), 30)  # packed: rows in logical shape
    path = write_st(tensors)
    ref = st_torch.load_file(path)
    world = 3
    with safeload.safe_open(path, "pt", backend=backend) as f:
        for rank in range(world):
            plan = {}
            for name, t in ref.items():
                if name.endswith(".bias"):
                    plan[name] = None
                else:
                    rows = t.shape[0] // world
                    plan[name] = slice(rank * rows, (rank + 1) * rows)
            budget = 20 << 10
            with f.prefetch(plan, budget_bytes=budget) as loader:
                expected = 0
                for name in reversed(loader.names()):
                    want = rows_of(ref[name], plan[name])
                    expected += want.nbytes if ref[name].dtype != torch.float4_e2m1fn_x2 else want.numel()
                    assert_tensor_equal(loader.take(name), want, f"{name} rank {rank}")
                    assert loader.held_bytes <= budget
                # A map of a file in the page cache (this one, just written) reads nothing: its
                # views need no read-ahead, as get_tensors' need none (the handle's stats say 0).
                mapped = f.stats.backend == "mmap" and testing.residency(path)[0] >= 0.99
                assert loader.bytes_read == (0 if mapped else expected)


def test_budget_bounds_what_is_held(write_st):
    tensors = {f"t{i:02d}": make_tensor("F32", (256, 64), i) for i in range(24)}  # 64 KiB each
    path = write_st(tensors)
    ref = st_torch.load_file(path)
    budget = 200 << 10
    with safeload.safe_open(path, "pt", backend="pread") as f:
        with f.prefetch(budget_bytes=budget) as loader:
            assert loader.budget_bytes == budget
            for name, t in loader:
                assert loader.held_bytes <= budget
                assert_tensor_equal(t, ref[name], name)
            assert loader.held_bytes == 0
            assert loader.bytes_read == sum(t.nbytes for t in ref.values())


def test_handle_keeps_working_beside_loaders_and_loaders_outlive_it(write_st):
    path = write_st(mixed_tensors(4))
    ref = st_torch.load_file(path)
    f = safeload.safe_open(path, "pt")
    first = f.prefetch()
    second = f.prefetch({"big": slice(1, 3)})
    assert_tensor_equal(f.get_tensor("big"), ref["big"])
    assert_tensor_equal(f.get_slice("big")[2:4], ref["big"][2:4])
    whole = f.get_tensors()
    f.close()
    assert_tensor_equal(second.take("big"), ref["big"][1:3])
    got = dict(first)
    for name in ref:
        assert_tensor_equal(got[name], ref[name], name)
        assert_tensor_equal(whole[name], ref[name], name)
    first.close()
    second.close()
    with pytest.raises(SafetensorError, match="closed"):
        f.prefetch()


def test_close_releases_what_was_not_taken(write_st):
    tensors = {f"t{i}": make_tensor("F32", (128, 64), i) for i in range(8)}
    path = write_st(tensors)
    with safeload.safe_open(path, "pt", backend="pread") as f:
        loader = f.prefetch()
        kept = loader.take("t0")
        loader.close()
        assert loader.held_bytes == 0 and loader.closed
        assert_tensor_equal(kept, tensors["t0"])
        for call in (lambda: loader.take("t1"), lambda: list(loader)):
            with pytest.raises(SafetensorError, match="closed"):
                call()


def test_errors_in_upstreams_words(write_st):
    path = write_st({"w": make_tensor("F32", (4, 3), 1), "s": make_tensor("F32", (), 2),
                     "b": make_tensor("F16", (5,), 3)})
    with safeload.safe_open(path, "pt") as f:
        cases = [
            ({"nope": None}, "does not contain"),
            ({"w": slice(0, 4, 2)}, "step 1"),
            ({"s": slice(0, 1)}, "0-d"),
            ({"w": 2}, "None or a slice"),
            ({"w": [0, 1]}, "None or a slice"),
            ({"w": slice(0, 5)}, "out of range"),
            ({"w": slice(-5, None)}, "out of range"),
            ({}, "selects no tensors"),
        ]
        for plan, words in cases:
            with pytest.raises(SafetensorError, match=words):
                f.prefetch(plan)
        # Allowed: negative starts, empty ranges.
        with f.prefetch({"w": slice(-1, None), "b": slice(2, 2)}) as loader:
            assert_tensor_equal(loader.take("w"), f.get_tensor("w")[-1:])
            assert loader.take("b").shape == (0,)
        loader = f.prefetch({"w": None})
        for outside in ("b", "no such tensor"):  # in the file but not planned; not in the file
            with pytest.raises(SafetensorError, match="not in the prefetch plan"):
                loader.take(outside)
        loader.take("w")
        with pytest.raises(SafetensorError, match="already delivered"):
            loader.take("w")
        loader.close()


def test_f6_is_refused(tmp_path):
    path = tmp_path / "f6.safetensors"
    header = json.dumps({"e": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x00" * 3)
    with safeload.safe_open(path, "pt") as f:
        with pytest.raises(SafetensorError, match="F6"):
            f.prefetch()


def test_file_cut_short_under_the_loader_raises(write_st):
    path, ref = file_to_cut(write_st)
    with safeload.safe_open(path, "pt", backend="pread") as f:
        names = f.offset_keys()
        cut_last_tensors(path)
        with f.prefetch() as loader:
            assert_cut_tensors_raise(loader.take, names, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_iteration_stops_at_a_tensor_cut_off_and_does_not_skip_it(write_st, backend):
    path, ref = file_to_cut(write_st)
    with safeload.safe_open(path, "pt", backend=backend) as f:
        names = f.offset_keys()
        cut_last_tensors(path)
        with f.prefetch() as loader:
            got = {}
            with pytest.raises(SafetensorError, match=names[-CUT_OFF]):
                for name, t in loader:
                    got[name] = t
            assert list(got) == names[:-CUT_OFF]
            for name, t in got.items():
                assert_tensor_equal(t, ref[name], name)
            # The tensor whose take failed was not handed over: iteration asks for it again.
            with pytest.raises(SafetensorError, match=names[-CUT_OFF]):
                next(iter(loader))


def test_cuda_through_pinned_staging(write_st, monkeypatch):
    """CUDA with a CPU stand-in: each tensor is read into pinned staging memory made for it
    (bounded by the budget), then copied to the device when taken; results byte-exact."""
    events = []
    monkeypatch.setattr(_device, "torch_device", lambda name: torch.device(name))
    real_empty = torch.empty

    def pinned(torch_module, nbytes):
        events.append(("pinned", nbytes))
        return real_empty(nbytes, dtype=torch.uint8)

    def to_device(tensor, device):
        assert device.type == "cuda"
        events.append(("copy", tensor.untyped_storage().data_ptr(), tensor.nbytes))
        return tensor.clone()

    monkeypatch.setattr(_prefetch, "_pinned", pinned)
    monkeypatch.setattr(_prefetch, "_to_device", to_device)
    tensors = mixed_tensors(5, big_rows=1000)
    path = write_st(tensors)
    ref = st_torch.load_file(path)
    budget = 64 << 10
    with safeload.safe_open(path, "pt") as f:
        with f.prefetch(device="cuda:0", budget_bytes=budget) as loader:
            got = {}
            for name in reversed(loader.names()):
                got[name] = loader.take(name)
                assert loader.held_bytes <= max(budget, max(t.nbytes for t in ref.values()))
    assert sorted(e[1] for e in events if e[0] == "pinned") == sorted(t.nbytes for t in ref.values())
    assert len([e for e in events if e[0] == "copy"]) == len(ref)
    for name in ref:
        assert_tensor_equal(got[name], ref[name], name)


def _container_headroom(root, headroom: int) -> None:
    """A cgroup v2 fixture tree under ``root`` whose container has ``headroom`` bytes left."""
    cg = root / "sys/fs/cgroup/ctr"
    cg.mkdir(parents=True)
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text("0::/ctr\n")
    (root / "proc/self/mountinfo").write_text("30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
    (cg / "memory.max").write_text(f"{headroom}\n")
    (cg / "memory.current").write_text("0\n")


@pytest.mark.parametrize("headroom_gib", [2, 6])
def test_default_budgets_staging_and_final_memory(write_st, monkeypatch, tmp_path, headroom_gib, testing):
    """No budget given: 1 GiB of staging for CUDA, 4 GiB of final memory otherwise, each at most
    a quarter of what the process may take (here a container's fixed headroom);
    SAFELOAD_PREFETCH_BYTES replaces both."""
    host = safeload.memory_info()["host"]
    if host is not None and host < (headroom_gib + 2) << 30:
        pytest.skip("the host has less memory available than the container fixture")
    monkeypatch.setattr(_device, "torch_device", lambda name: torch.device(name))
    monkeypatch.delenv("SAFELOAD_PREFETCH_BYTES", raising=False)
    path = write_st(mixed_tensors(7))
    _container_headroom(tmp_path / "root", headroom_gib << 30)
    quarter = (headroom_gib << 30) // 4
    testing.set_cgroup_root(str(tmp_path / "root"))
    try:
        with safeload.safe_open(path, "pt") as f:
            with f.prefetch(device="cuda:0") as cuda, f.prefetch() as cpu:
                assert cuda.budget_bytes == min(1 << 30, quarter)
                assert cpu.budget_bytes == min(4 << 30, quarter)
            monkeypatch.setenv("SAFELOAD_PREFETCH_BYTES", "3MiB")
            with f.prefetch(device="cuda:0") as cuda, f.prefetch() as cpu:
                assert cuda.budget_bytes == cpu.budget_bytes == 3 << 20
    finally:
        testing.set_cgroup_root("/")


def test_patched_safetensors_has_prefetch(write_st):
    """Consumers check ``hasattr(safe_open, "prefetch")``: true once safeload is patched in, and
    the loader works through safetensors' name; unpatching restores 0.8's (which has none)."""
    import safetensors

    path = write_st(mixed_tensors(6))
    ref = st_torch.load_file(path)
    original = safetensors.safe_open
    assert not hasattr(original, "prefetch")
    safeload.patch()
    try:
        assert hasattr(safetensors.safe_open, "prefetch")
        with safetensors.safe_open(path, framework="pt") as f:
            got = dict(f.prefetch())
        for name in ref:
            assert_tensor_equal(got[name], ref[name], name)
    finally:
        safeload.unpatch()
    assert safetensors.safe_open is original
