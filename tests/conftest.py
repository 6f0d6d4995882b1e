"""Shared helpers for safeload's test suite.

Files are written with safetensors 0.8's own writer (the reference) unless a test is about
safeload's writer; hand-crafted and malformed files are written byte by byte with ``write_raw``.
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any, Dict, Optional, Union

import numpy as np
import pytest
import torch

import safetensors
import safetensors.torch as st_torch

import safeload
from safeload import _device, _safeload, _staging

# tests/support/slowfs.py (the compiled slow/faulty FUSE filesystem) is imported as ``slowfs``.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

from cpu_sink import CpuSink  # noqa: E402 - the staging ring's plain-memory double

# Every safetensors dtype code torch has, with its torch dtype (F4 packs two values per element).
TORCH_DTYPES: Dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2,
}

# dtypes that plain numpy (and so safetensors 0.8's numpy path) has.
NUMPY_CODES = ["F64", "F32", "F16", "I64", "I32", "I16", "I8", "U8", "BOOL", "C64", "U16", "U32", "U64"]
# dtypes numpy only has through ml_dtypes (safeload supports them, 0.8 does not).
ML_DTYPES_CODES = ["BF16", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0"]

BACKENDS = ["mmap", "pread", "auto"]

# The extension's test-only helpers, ``safeload._safeload._testing`` (src/py/testing.rs), are built
# only with cargo feature `testing`: .ci/run installs so; the wheels and a plain install leave them out.
NO_TESTING = (
    "safeload was built without its test helpers (cargo feature `testing`); install as .ci/run does: "
    "pip install -e '.[test]' --config-settings=build-args='--features python,testing'"
)


def require_test_helpers():
    """``safeload._safeload._testing``; skips the test (called at import: its module) without them."""
    helpers = getattr(_safeload, "_testing", None)
    if helpers is None:
        pytest.skip(NO_TESTING, allow_module_level=True)
    return helpers


@pytest.fixture(scope="session")
def testing():
    """``safeload._safeload._testing``: a test that takes it is skipped, saying why, without them."""
    return require_test_helpers()


def make_tensor(code: str, shape, seed: int = 0) -> torch.Tensor:
    """A tensor of dtype ``code`` and ``shape`` filled with deterministic random bytes.

    Bytes are random for every dtype (NaNs included for floats): comparisons are by raw bytes.
    BOOL gets 0/1 bytes only. For F4, ``shape`` is torch's shape (last dim = packed pairs).
    """
    dtype = TORCH_DTYPES[code]
    shape = tuple(shape)
    n = 1
    for s in shape:
        n *= s
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    nbytes = n * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes in row-major order (works for 0-dim, zero-size and float4 tensors)."""
    t = t.detach().cpu()
    if t.numel() == 0:
        return b""
    if t.dtype.itemsize == 1:  # same-size view works for any strides (and for float4)
        return t.view(torch.uint8).numpy().tobytes()
    dense = torch.empty(t.shape, dtype=t.dtype)  # standard strides, even for 1-element views
    dense.copy_(t)
    u = dense.reshape(-1).view(torch.uint8)
    return u.numpy().tobytes()


def assert_tensor_equal(a: Any, b: Any, context: str = "") -> None:
    """Same dtype, same shape, same bytes (torch tensors or numpy arrays)."""
    where = f" [{context}]" if context else ""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), f"types differ{where}: {type(a)} {type(b)}"
        assert a.dtype == b.dtype, f"dtype {a.dtype} != {b.dtype}{where}"
        assert a.shape == b.shape, f"shape {a.shape} != {b.shape}{where}"
        assert a.tobytes() == b.tobytes(), f"bytes differ{where}"
        return
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"types differ{where}: {type(a)} {type(b)}"
    assert a.dtype == b.dtype, f"dtype {a.dtype} != {b.dtype}{where}"
    assert tuple(a.shape) == tuple(b.shape), f"shape {tuple(a.shape)} != {tuple(b.shape)}{where}"
    assert raw_bytes(a) == raw_bytes(b), f"bytes differ{where}"


#: Tensors of the file :func:`file_to_cut` writes, and how many :func:`cut_last_tensors` cuts off.
CUT_TOTAL, CUT_OFF = 8, 3


def file_to_cut(write_st) -> "tuple[str, Dict[str, torch.Tensor]]":
    """Writes :data:`CUT_TOTAL` F32 tensors of 16 KiB; returns (path, safetensors 0.8's read)."""
    path = write_st({f"t{i}": make_tensor("F32", (4096,), i) for i in range(CUT_TOTAL)})
    return path, st_torch.load_file(path)


def cut_last_tensors(path) -> None:
    """Cuts the bytes of the last :data:`CUT_OFF` tensors of a :func:`file_to_cut` file off."""
    os.truncate(path, os.path.getsize(path) - CUT_OFF * 4096 * 4)


def assert_cut_tensors_raise(read, names, ref) -> None:
    """``read(name)`` of a file cut by :func:`cut_last_tensors` (``names`` in file order): the
    tensors before the cut are right, each one past it raises an error naming it."""
    for name in names[:-CUT_OFF]:
        assert_tensor_equal(read(name), ref[name], name)
    for name in names[-CUT_OFF:]:
        with pytest.raises(safeload.SafetensorError, match=name):
            read(name)


def write_raw(path: Union[str, os.PathLike], header: Union[bytes, str, Any], data: bytes = b"",
              *, length: Optional[int] = None) -> str:
    """Writes ``<u64 header length><header><data>``: header may be a JSON-able object, a str, or
    raw bytes; ``length`` overrides the declared header length (for lying files)."""
    if isinstance(header, bytes):
        hb = header
    elif isinstance(header, str):
        hb = header.encode("utf-8")
    else:
        hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    n = len(hb) if length is None else length
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n))
        f.write(hb)
        f.write(data)
    return os.fspath(path)


def parse_file(data: bytes):
    """(header dict, data bytes) of a safetensors file's bytes."""
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


@pytest.fixture
def write_st(tmp_path):
    """Factory: write_st(tensors, name="x.safetensors", metadata=None) -> path, written by 0.8."""

    counter = [0]

    def _write(tensors: Dict[str, torch.Tensor], name: Optional[str] = None,
               metadata: Optional[Dict[str, str]] = None) -> str:
        counter[0] += 1
        path = tmp_path / (name or f"ref{counter[0]}.safetensors")
        st_torch.save_file(tensors, str(path), metadata=metadata)
        return str(path)

    return _write


def read_all_ref(path: str, framework: str = "pt") -> Dict[str, Any]:
    """Every tensor of ``path`` read by safetensors 0.8 (mmap)."""
    with safetensors.safe_open(path, framework) as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def read_all_safeload(path: str, framework: str = "pt", backend: str = "auto") -> Dict[str, Any]:
    with safeload.safe_open(path, framework, backend=backend) as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def catch(fn, *args, **kwargs):
    """(exception type name, message) raised by ``fn``, or ("ok", result)."""
    try:
        return ("ok", fn(*args, **kwargs))
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, str(e))


def mixed_tensors(seed: int = 0, big_rows: int = 70) -> dict:
    """Every torch dtype of the format (bf16, fp8, F4) in random small shapes, scalars, empty
    tensors, odd sizes, and a BF16 tensor of ``big_rows`` x 129 spanning several reads."""
    rng = random.Random(seed)
    tensors = {}
    for i, code in enumerate(TORCH_DTYPES):
        shape = rng.choice([(), (0,), (1,), (3, 0, 2), (7,), (5, 3), (2, 3, 5), (1031,), (64, 33)])
        if code == "F4" and shape == ():
            shape = (3,)
        tensors[f"t{i:02d}_{code}"] = make_tensor(code, shape, seed=seed * 100 + i)
    tensors["big"] = make_tensor("BF16", (big_rows, 129), seed=seed + 7)
    tensors["scalar_f64"] = make_tensor("F64", (), seed=seed + 8)
    tensors["empty_f32"] = make_tensor("F32", (0, 4), seed=seed + 9)
    return tensors


# -- the CUDA stand-in ---------------------------------------------------------------------------


class FakeCudaSink(CpuSink):
    """A CPU sink that stands in for CudaSink (deferred copies, "pinned")."""

    made = []

    def __init__(self, device):
        super().__init__(defer=True, pinned=True)
        self.device = device
        FakeCudaSink.made.append(self)


@pytest.fixture
def fake_cuda(monkeypatch):
    """cuda:N devices accepted, each staged load copying into a FakeCudaSink (a 2 x 4 KiB ring);
    returns the sinks made."""
    real = _device.torch_device

    def torch_device(name):
        if name.startswith("cuda"):
            return torch.device(name)
        return real(name)

    monkeypatch.setattr(_device, "torch_device", torch_device)
    monkeypatch.setattr(_staging, "make_sink", FakeCudaSink)
    monkeypatch.setenv(_staging.RING_ENV, "2x4KiB")
    FakeCudaSink.made = []
    return FakeCudaSink.made


# -- process groups ----------------------------------------------------------------------------


def _rank_then_exit(rank: int, worker: Any, *args: Any) -> None:
    """A spawned rank: ``worker(rank, *args)``, then out of the process at once. Once its group
    is destroyed, a rank that went on into interpreter shutdown has been seen to abort in gloo's
    C++ teardown ("terminate called without an active exception", SIGABRT, once in a few full
    test runs with torch 2.15), after its result was written; that teardown is not what the
    tests check. A worker that raises still fails the rank (spawn reports it)."""
    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(worker: Any, world: int, tmp: str, args: tuple, join_seconds: float) -> list:
    """Starts ``worker(rank, *args)`` on ``world`` spawned processes (gloo on loopback) and returns
    what each wrote to ``tmp/result-{rank}.json``. A join past ``join_seconds`` kills them and
    fails the test (a hang)."""
    import time

    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.start_processes(_rank_then_exit, args=(worker, *args), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + join_seconds
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"{world} ranks did not finish within {join_seconds}s (hang)")
    out = []
    for r in range(world):
        with open(os.path.join(tmp, f"result-{r}.json")) as f:
            out.append(json.load(f))
    return out


@pytest.fixture(scope="module")
def fresh_env(tmp_path_factory) -> Dict[str, str]:
    """A throwaway venv that sees this one's packages, with the hook installed into *its*
    site-packages by ``python -m safeload patch-install``."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = str(root / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    # processed before safeload_autopatch.pth ("_" sorts first): this venv's packages, their .pth
    # files included (an editable safeload's among them)
    Path(site, "_base_for_test.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    env = {k: v for k, v in os.environ.items() if k not in ("SAFELOAD_PATCH", "SAFELOAD_BACKEND")}
    out = subprocess.run([python, "-m", "safeload", "patch-install"], check=True, capture_output=True,
                         text=True, env=env, cwd=str(root)).stdout
    patch_module = sys.modules["safeload.patch"]  # `safeload.patch` is the function
    assert os.path.join(site, patch_module.PTH_NAME) in out
    assert Path(site, patch_module.PTH_NAME).read_text().strip() == patch_module.PTH_LINE
    return {"python": python, "site": site, "env": env}  # type: ignore[dict-item]
