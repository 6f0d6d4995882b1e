"""One contract on every path: each public entry point, on each destination it serves, against
each argument of the reader it takes (backend, threads, chunk_bytes, drop_cache, dtype,
progress), checked by its effect: the bytes against safetensors 0.8, the dtype returned, the
backend, workers and request size the reader reports (the entry point's stats, or its DEBUG log
line), the page cache after the load. An argument an entry point does not take is refused with
TypeError; a bad value is refused before anything is read. storage_options: test_remote.py
(`test_storage_options_reach_every_entry_point_and_stay_with_their_call`, against S3 on
loopback)."""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import pytest
import safetensors
import safetensors.torch as st_torch
import torch

import safeload
import safeload.numpy
import safeload.torch
from conftest import assert_tensor_equal, run_ranks
from test_mps import fake_mps  # noqa: F401  (the MPS stand-in: a fixture)
from safeload import SafetensorError, distributed
from safeload._safeload import BACKENDS

READER_ARGS = {"backend", "threads", "chunk_bytes", "drop_cache", "dtype", "progress", "storage_options", "verify"}
CHUNK = 8192


# -- the checkpoint -------------------------------------------------------------------------------


def _shards() -> List[Dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        {"a.w": torch.randn(64, 96, generator=g), "a.h": torch.randn(80, 64, generator=g).to(torch.float16),
         "a.ids": torch.randint(0, 99, (700,), generator=g), "a.empty": torch.empty(0, 3)},
        {"b.w": torch.randn(96, 64, generator=g).to(torch.bfloat16), "b.s": torch.tensor(2.5),
         "b.mask": torch.rand(33, 7, generator=g) > 0.5},
    ]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: Any) -> Dict[str, Any]:
    root = tmp_path_factory.mktemp("contract")
    files = []
    for i, tensors in enumerate(_shards()):
        files.append(str(root / f"model-{i}.safetensors"))
        st_torch.save_file(tensors, files[-1])
    ref: Dict[str, torch.Tensor] = {}
    for f in files:
        with safetensors.safe_open(f, "pt") as h:  # copies: views of 0.8's map would pin the pages
            ref.update({k: h.get_tensor(k).clone() for k in h.keys()})
    with safetensors.safe_open(files[0], "pt") as h:
        one = {k: ref[k] for k in h.keys()}
    with safetensors.safe_open(files[0], "np") as h:
        arrays = {k: h.get_tensor(k).copy() for k in h.keys()}
    data = sum(t.nelement() * t.element_size() for t in ref.values())
    return {"dir": str(root), "files": files, "ref": ref, "one": files[0], "one_ref": one, "np_ref": arrays,
            "data_bytes": data}


def _converted(ref: Dict[str, torch.Tensor], dtype: Any) -> Dict[str, torch.Tensor]:
    floats = (torch.float32, torch.float16, torch.bfloat16)
    return {k: v.to(dtype) if dtype is not None and v.dtype in floats else v for k, v in ref.items()}


def _same(got: Dict[str, Any], ref: Dict[str, Any]) -> None:
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert_tensor_equal(got[k], ref[k], k)


# -- what the reader reports ---------------------------------------------------------------------

LINE = re.compile(r"backend=(\w+) threads=(\d+) chunk=(.+?) read=(.+?) in ")


class Report:
    """backend, threads, chunk_bytes, bytes_read of one load: from its Stats or its log line."""

    def __init__(self, backend: str, threads: int, chunk_bytes: Optional[int], bytes_read: Optional[int]):
        self.backend, self.threads, self.chunk_bytes, self.bytes_read = backend, threads, chunk_bytes, bytes_read

    @classmethod
    def of(cls, stats: Any) -> "Report":
        return cls(stats.backend, stats.threads, stats.chunk_bytes, stats.bytes_read)

    @classmethod
    def logged(cls, records: List[logging.LogRecord]) -> "Report":
        lines = [r.getMessage() for r in records if r.name == "safeload" and "backend=" in r.getMessage()]
        assert lines, "the load logged no read"
        m = LINE.search(lines[-1])
        assert m, lines[-1]
        return cls(m.group(1), int(m.group(2)), _bytes(m.group(3)), None)


def _bytes(logged: str) -> Optional[int]:
    """A size as the log line prints it ("8.00 KiB"); None for "-"."""
    if logged == "-":
        return None
    number, unit = logged.split()
    return round(float(number) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit])


# -- the table ------------------------------------------------------------------------------------
# Each entry: how it is called (path, kwargs) -> (tensors, Report); the arguments of the reader
# it takes; where its result lives; which files it reads.


def _safe_open_get_tensors(path: str, kw: Dict[str, Any], device: str = "cpu") -> Any:
    dtype = kw.pop("dtype", None)
    with safeload.safe_open(path, "pt", device=device, **kw) as f:
        out = f.get_tensors(dtype=dtype) if dtype is not None else f.get_tensors()
        return out, Report.of(f.stats)


def _safe_open_loop(path: str, kw: Dict[str, Any]) -> Any:
    with safeload.safe_open(path, "pt", **kw) as f:
        return {k: f.get_tensor(k) for k in f.keys()}, Report.of(f.stats)


def _safe_open_slices(path: str, kw: Dict[str, Any]) -> Any:
    with safeload.safe_open(path, "pt", **kw) as f:
        return {k: f.get_slice(k)[...] for k in f.keys()}, Report.of(f.stats)


def _safe_open_prefetch(path: str, kw: Dict[str, Any]) -> Any:
    with safeload.safe_open(path, "pt", **kw) as f:
        with f.prefetch() as loader:
            out = {k: loader.take(k) for k in reversed(loader.names())}
        return out, Report.of(f.stats)


def _logged(call: Callable[[], Dict[str, Any]], caplog: Any) -> Any:
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="safeload"):
        out = call()
    return out, Report.logged(caplog.records)


def _load_into(path: str, kw: Dict[str, Any], ref: Dict[str, torch.Tensor]) -> Any:
    into = {k: torch.empty_like(v) for k, v in ref.items()}
    stats = safeload.torch.load_into(into, path, **kw)
    return into, Report.of(stats)


def _load_model(path: str, kw: Dict[str, Any], ref: Dict[str, torch.Tensor], caplog: Any) -> Any:
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = torch.nn.Module()
            for k, v in ref.items():
                owner = self
                parts = k.split(".")
                for p in parts[:-1]:
                    if not hasattr(owner, p):
                        owner.add_module(p, torch.nn.Module())
                    owner = getattr(owner, p)
                owner.register_buffer(parts[-1], torch.zeros_like(v))

    model = Model()

    def call() -> Dict[str, Any]:
        assert safeload.torch.load_model(model, path, **kw) == (set(), [])
        return {k: v for k, v in model.state_dict().items() if not k.startswith("m.")}

    return _logged(call, caplog)


ENTRIES: Dict[str, Dict[str, Any]] = {
    # name: (call(ckpt, kwargs, caplog) -> (tensors, Report)), reader arguments taken, scope
    "safe_open.get_tensors": dict(takes={"backend", "threads", "chunk_bytes", "drop_cache", "dtype", "storage_options", "verify"},
                                  call=lambda c, kw, log: _safe_open_get_tensors(c["one"], kw), scope="one"),
    "safe_open.get_tensors(cuda)": dict(takes={"backend", "threads", "chunk_bytes", "drop_cache", "dtype",
                                               "storage_options", "verify"}, device=True,
                                        call=lambda c, kw, log: _safe_open_get_tensors(c["one"], kw, "cuda:0"),
                                        scope="one"),
    "safe_open.get_tensors(mps)": dict(takes={"backend", "threads", "chunk_bytes", "drop_cache", "dtype",
                                              "storage_options", "verify"}, device="mps",
                                       call=lambda c, kw, log: _safe_open_get_tensors(c["one"], kw, "mps"),
                                       scope="one"),
    "safe_open.get_tensor": dict(takes={"backend", "threads", "chunk_bytes", "drop_cache", "storage_options", "verify"},
                                 call=lambda c, kw, log: _safe_open_loop(c["one"], kw), scope="one"),
    "safe_open.get_slice": dict(takes={"backend", "threads", "chunk_bytes", "drop_cache", "storage_options", "verify"},
                                call=lambda c, kw, log: _safe_open_slices(c["one"], kw), scope="one"),
    "safe_open.prefetch": dict(takes={"backend", "threads", "chunk_bytes", "drop_cache", "storage_options"},
                               refuses={"verify"},
                               call=lambda c, kw, log: _safe_open_prefetch(c["one"], kw), scope="one"),
    "torch.load_file": dict(takes={"backend", "dtype", "storage_options", "verify"}, fn=safeload.torch.load_file,
                            call=lambda c, kw, log: _logged(lambda: safeload.torch.load_file(c["one"], **kw), log),
                            scope="one"),
    "torch.load_file(cuda)": dict(takes={"backend", "dtype", "storage_options", "verify"}, device=True,
                                  call=lambda c, kw, log: _logged(
                                      lambda: safeload.torch.load_file(c["one"], device="cuda:0", **kw), log),
                                  scope="one"),
    "numpy.load_file": dict(takes={"backend", "storage_options", "verify"}, fn=safeload.numpy.load_file, numpy=True,
                            call=lambda c, kw, log: _logged(lambda: safeload.numpy.load_file(c["one"], **kw), log),
                            scope="one"),
    "torch.load_checkpoint": dict(takes={"backend", "threads", "chunk_bytes", "drop_cache", "dtype", "progress",
                                         "storage_options", "verify"},
                                  call=lambda c, kw, log: (lambda r: (r[0], Report.of(r[1])))(
                                      safeload.torch.load_checkpoint(c["dir"], return_stats=True, **kw)),
                                  scope="all"),
    "torch.load_checkpoint(cuda)": dict(takes={"backend", "threads", "chunk_bytes", "drop_cache", "dtype", "progress",
                                               "storage_options", "verify"}, device=True,
                                        call=lambda c, kw, log: (lambda r: (r[0], Report.of(r[1])))(
                                            safeload.torch.load_checkpoint(c["dir"], device="cuda:0",
                                                                           return_stats=True, **kw)),
                                        scope="all"),
    "torch.load_checkpoint(mps)": dict(takes={"backend", "threads", "chunk_bytes", "drop_cache", "dtype", "progress",
                                              "storage_options", "verify"}, device="mps",
                                       call=lambda c, kw, log: (lambda r: (r[0], Report.of(r[1])))(
                                           safeload.torch.load_checkpoint(c["dir"], device="mps",
                                                                          return_stats=True, **kw)),
                                       scope="all"),
    "torch.iter_checkpoint": dict(takes={"backend", "threads", "chunk_bytes", "drop_cache", "progress",
                                         "storage_options", "verify"},
                                  call=lambda c, kw, log: _logged(
                                      lambda: dict(safeload.torch.iter_checkpoint(c["dir"], max_inflight_bytes=1 << 14,
                                                                                  **kw)), log),
                                  scope="all"),
    "torch.load_into": dict(takes={"backend", "threads", "chunk_bytes", "drop_cache", "storage_options", "verify"},
                            call=lambda c, kw, log: _load_into(c["dir"], kw, c["ref"]), scope="all", copies=True),
    "torch.load_model": dict(takes={"backend", "storage_options", "verify"}, fn=safeload.torch.load_model,
                             call=lambda c, kw, log: _load_model(c["dir"], kw, c["ref"], log), scope="all",
                             copies=True),
    "distributed.load_checkpoint(plan)": dict(
        takes={"backend", "threads", "chunk_bytes", "drop_cache", "dtype", "storage_options", "verify"},
        fn=distributed.load_checkpoint,
        call=lambda c, kw, log: (lambda r: (r[0], Report.of(r[1])))(
            distributed.load_checkpoint(c["dir"], plan={k: None for k in c["ref"]}, return_stats=True, **kw)),
        scope="all"),
}


def _reference(ckpt: Dict[str, Any], entry: Dict[str, Any], dtype: Any = None) -> Dict[str, torch.Tensor]:
    ref = ckpt["ref"] if entry["scope"] == "all" else ckpt["one_ref"]
    return _converted(ref, dtype)


def _call(name: str, ckpt: Dict[str, Any], caplog: Any, **kw: Any) -> Any:
    return ENTRIES[name]["call"](ckpt, dict(kw), caplog)


def _check_values(name: str, got: Dict[str, Any], ckpt: Dict[str, Any], dtype: Any = None) -> None:
    entry = ENTRIES[name]
    ref = _reference(ckpt, entry, dtype)
    if entry.get("numpy"):
        _same(got, ckpt["np_ref"])
        return
    _same(got, ref)


ALL = list(ENTRIES)


@pytest.fixture
def stand_in(request: Any, fake_cuda: Any) -> None:
    """The device stand-ins: CUDA for every entry (it serves cuda:N only), MPS for the MPS ones
    (it replaces the package's Handle and Checkpoint with recording proxies)."""
    name = request.node.callspec.params.get("name") if hasattr(request.node, "callspec") else None
    if name is not None and ENTRIES[name].get("device") == "mps":
        request.getfixturevalue("fake_mps")


# -- every backend, on every entry point ---------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ALL)
def test_every_backend_reads_the_files_bytes_and_reports_what_read(name, backend, ckpt, caplog, stand_in):
    got, report = _call(name, ckpt, caplog, backend=backend)
    _check_values(name, got, ckpt)
    assert report.backend in ("mmap", "pread", "direct"), report.backend
    if backend == "pread":
        assert report.backend == "pread"
    if backend == "mmap" and (ENTRIES[name].get("copies") or ENTRIES[name].get("device")):
        # Copies into the caller's tensors or a device's staging memory read: strategy::for_purpose.
        assert report.backend == "pread"
    if report.backend in ("pread", "direct") and report.bytes_read is not None and not ENTRIES[name].get("device"):
        assert report.bytes_read > 0


@pytest.mark.parametrize("name", ALL)
def test_a_bad_backend_is_refused_before_any_read(name, ckpt, caplog, stand_in):
    with pytest.raises(SafetensorError, match='backend "fast" is invalid'):
        _call(name, ckpt, caplog, backend="fast")
    with pytest.raises(TypeError, match="not a str"):
        _call(name, ckpt, caplog, backend=3)


# -- threads and chunk_bytes reach the reader ----------------------------------------------------


@pytest.mark.parametrize("name", [n for n in ALL if {"threads", "chunk_bytes"} <= ENTRIES[n]["takes"]])
def test_threads_and_chunk_bytes_reach_the_reader(name, ckpt, caplog, stand_in):
    got, report = _call(name, ckpt, caplog, backend="pread", threads=2, chunk_bytes=CHUNK)
    _check_values(name, got, ckpt)
    assert report.backend == "pread"
    assert report.chunk_bytes == CHUNK
    assert 1 <= report.threads <= 2
    got, report = _call(name, ckpt, caplog, backend="pread", threads=1, chunk_bytes=2 * CHUNK)
    assert report.chunk_bytes == 2 * CHUNK and report.threads == 1


# -- dtype ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", [n for n in ALL if "dtype" in ENTRIES[n]["takes"]])
def test_dtype_converts_the_floating_point_tensors_on_every_path(name, dtype, ckpt, caplog, stand_in):
    for backend in BACKENDS:
        got, _ = _call(name, ckpt, caplog, backend=backend, dtype=dtype)
        _check_values(name, got, ckpt, dtype)
    with pytest.raises(SafetensorError, match="cannot be converted to on load"):
        _call(name, ckpt, caplog, dtype=torch.int8)


# -- progress ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in ALL if "progress" in ENTRIES[n]["takes"]])
def test_progress_reports_every_byte(name, ckpt, caplog, stand_in):
    for backend in BACKENDS:
        calls: List[Any] = []
        got, _ = _call(name, ckpt, caplog, backend=backend, progress=lambda done, total, seen=calls: seen.append(
            (done, total)))
        _check_values(name, got, ckpt)
        assert calls and calls[-1] == (ckpt["data_bytes"], ckpt["data_bytes"]), calls[-3:]
        assert [d for d, _ in calls] == sorted(d for d, _ in calls)


# -- drop_cache ---------------------------------------------------------------------------------


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages stay
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _warm(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass


def _drops(testing, path: str) -> bool:
    """Whether this filesystem lets a file's pages go on request (not tmpfs, not a host cache that
    keeps them): the condition drop_cache's effect can be seen under."""
    _warm(path)
    if _cached(testing, path) < 0.9:
        return False
    _evict(path)
    dropped = _cached(testing, path) < 0.5
    _warm(path)
    return dropped


def _cached(testing, path: str) -> float:
    """The fraction of the file in the page cache (0 where it cannot be told)."""
    fraction = testing.residency(path)[0]
    return 0.0 if fraction is None else fraction


@pytest.mark.parametrize("name", [n for n in ALL if "drop_cache" in ENTRIES[n]["takes"]])
def test_drop_cache_leaves_the_files_out_of_the_page_cache(name, ckpt, caplog, stand_in, testing):
    files = ckpt["files"] if ENTRIES[name]["scope"] == "all" else [ckpt["one"]]
    if not all(_drops(testing, f) for f in files):
        pytest.skip("this filesystem keeps pages the kernel was asked to drop")
    for backend in ("auto", "pread", "direct"):
        for f in files:
            _warm(f)
        got, report = _call(name, ckpt, caplog, backend=backend, drop_cache=True)
        _check_values(name, got, ckpt)
        assert report.backend != "mmap"  # "auto" reads when the pages are to be dropped
        assert all(_cached(testing, f) < 0.5 for f in files), (backend, [_cached(testing, f) for f in files])
    _call(name, ckpt, caplog, backend="pread", drop_cache=False)
    assert all(_cached(testing, f) > 0.9 for f in files)
    with pytest.raises(SafetensorError, match='backend "mmap" reads none'):
        _call(name, ckpt, caplog, backend="mmap", drop_cache=True)


# -- an argument not taken is refused ----------------------------------------------------------


def _pins(ckpt: Dict[str, Any], entry: Dict[str, Any], wrong: bool = False) -> Dict[str, str]:
    import hashlib

    files = ckpt["files"] if entry["scope"] == "all" else [ckpt["one"]]
    pins = {}
    for f in files:
        with open(f, "rb") as fh:
            pins[os.path.basename(f)] = "0" * 64 if wrong else hashlib.file_digest(fh, "sha256").hexdigest()
    return pins


@pytest.mark.parametrize("name", ALL)
def test_verify_checks_every_file_before_any_tensor_is_returned(name, ckpt, caplog, stand_in):
    """verify= on every entry point and destination: the right digests give 0.8's tensors, a
    wrong one raises before any is returned; prefetch refuses it (it reads around the bytes a
    verified handle hashed)."""
    entry = ENTRIES[name]
    if "verify" in entry.get("refuses", ()):
        with pytest.raises(SafetensorError, match="verify="):
            _call(name, ckpt, caplog, verify=_pins(ckpt, entry))
        return
    got, _ = _call(name, ckpt, caplog, verify=_pins(ckpt, entry))
    _check_values(name, got, ckpt)
    with pytest.raises(SafetensorError, match="SHA-256 mismatch: expected 0{64} \\(the mapping\\)"):
        _call(name, ckpt, caplog, verify=_pins(ckpt, entry, wrong=True))


@pytest.mark.parametrize("name", ALL)
def test_an_argument_an_entry_point_does_not_take_is_refused(name, ckpt, caplog, stand_in):
    values = {"backend": "pread", "threads": 2, "chunk_bytes": CHUNK, "drop_cache": True, "dtype": torch.float16,
              "progress": lambda d, t: None, "storage_options": {}}
    for arg in sorted(READER_ARGS - ENTRIES[name]["takes"] - ENTRIES[name].get("refuses", set())):
        with pytest.raises(TypeError, match=arg):
            _call(name, ckpt, caplog, **{arg: values[arg]})


def test_the_table_names_every_reader_argument_of_the_signatures():
    """The table's `takes` is what the functions accept: a new argument added to an entry point
    fails here until the table checks it."""
    for name, entry in ENTRIES.items():
        fn = entry.get("fn")
        if fn is None:
            continue
        params = set(inspect.signature(fn).parameters) & READER_ARGS
        assert params == entry["takes"], (name, params ^ entry["takes"])
    opened = set(inspect.signature(safeload.safe_open.__init__).parameters) & READER_ARGS
    assert opened | {"dtype"} == ENTRIES["safe_open.get_tensors"]["takes"]
    assert opened == ENTRIES["safe_open.prefetch"]["takes"] | ENTRIES["safe_open.prefetch"]["refuses"]
    checkpoint = set(inspect.signature(safeload._checkpoint.load_checkpoint).parameters) & READER_ARGS
    assert checkpoint == ENTRIES["torch.load_checkpoint"]["takes"]
    streamed = set(inspect.signature(safeload._checkpoint.iter_checkpoint).parameters) & READER_ARGS
    assert streamed == ENTRIES["torch.iter_checkpoint"]["takes"]
    into = set(inspect.signature(safeload._inplace.load_into).parameters) & READER_ARGS
    assert into == ENTRIES["torch.load_into"]["takes"]


# -- 2 gloo ranks ---------------------------------------------------------------------------------

JOIN_SECONDS = 180


def _rank(rank: int, world: int, tmp: str, root: str) -> None:
    import torch.distributed as dist

    from safeload import distributed as sd

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    ref: Dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(root)):
        if f.endswith(".safetensors"):
            with safetensors.safe_open(os.path.join(root, f), "pt") as h:
                ref.update({k: h.get_tensor(k) for k in h.keys()})
    res: Dict[str, Any] = {}
    for backend in BACKENDS:
        for dtype in (None, torch.float16):
            state, stats = sd.load_checkpoint(root, process_group=dist.group.WORLD, backend=backend, threads=2,
                                              chunk_bytes=CHUNK, dtype=dtype, return_stats=True)
            want = _converted(ref, dtype)
            res[f"{backend}/{dtype}"] = {
                "equal": sorted(state) == sorted(want) and all(
                    state[k].dtype == want[k].dtype and torch.equal(state[k], want[k]) for k in want),
                "backend": stats.backend, "threads": stats.threads, "chunk_bytes": stats.chunk_bytes,
                "bytes_read": stats.bytes_read}
    try:
        sd.load_checkpoint(root, process_group=dist.group.WORLD, backend="fast")
        res["bad_backend"] = "no error"
    except SafetensorError as e:
        res["bad_backend"] = str(e)
    dist.barrier()
    with open(os.path.join(tmp, f"result-{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def test_two_gloo_ranks_honour_backend_threads_chunk_bytes_and_dtype(ckpt, tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    results = run_ranks(_rank, 2, str(tmp_path), (2, str(tmp_path), ckpt["dir"]), JOIN_SECONDS)
    for res in results:
        assert 'backend "fast" is invalid' in res.pop("bad_backend")
        for key, r in res.items():
            assert r["equal"], key
            assert r["backend"] in ("mmap", "pread", "direct"), key
            if key.startswith("pread/"):
                assert r["backend"] == "pread" and r["chunk_bytes"] == CHUNK and 1 <= r["threads"] <= 2, (key, r)
    for backend in ("pread", "direct"):
        # Each rank reads its share: together they read every byte once.
        assert sum(res[f"{backend}/None"]["bytes_read"] for res in results) == ckpt["data_bytes"]
