"""The ``safeload`` command line, run as ``python -m safeload`` in a subprocess."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest

import safetensors.numpy

OK_LINE = re.compile(r"^OK (?P<path>.+) \((?P<n>\d+) tensors, (?P<gib>\d+\.\d+) GiB, pread, (?P<rate>\d+\.\d+) GiB/s\)$")


def run(*args: str, cwd: Any = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "safeload", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def header(path: str) -> Dict[str, Any]:
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


@pytest.fixture
def sample(tmp_path) -> str:
    path = str(tmp_path / "sample.safetensors")
    safetensors.numpy.save_file(
        {
            "embed.weight": np.arange(24, dtype=np.float32).reshape(4, 6),
            "bias": np.ones(6, dtype=np.int64),
            "empty": np.zeros((0, 3), dtype=np.float16),
            "scalar": np.array(7, dtype=np.uint8),
        },
        path,
        metadata={"format": "np", "author": "tests"},
    )
    return path


def test_help():
    r = run("--help")
    assert r.returncode == 0
    for command in ("inspect", "verify", "patch-install"):
        assert command in r.stdout
    for command in ("inspect", "verify", "patch-install"):
        r = run(command, "--help")
        assert r.returncode == 0, command
        assert r.stdout.startswith(f"usage: safeload {command}"), r.stdout
    r = run("verify", "--help")
    assert "mmap" in r.stdout and "Exit status" in r.stdout


def test_usage_errors_exit_2(sample):
    assert run().returncode == 2  # no command: help, status 2
    r = run("verify")
    assert r.returncode == 2 and "FILE" in r.stderr
    assert run("verify", "--bogus", sample).returncode == 2
    assert run("verify", "--threads", "0", sample).returncode == 2
    assert run("frobnicate").returncode == 2
    assert run("bench", sample).returncode == 2  # the benchmark is benches/bench.py, not a command


def test_inspect_text(sample):
    r = run("inspect", sample)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"{sample}: 4 tensors")
    assert "  format: np" in lines and "  author: tests" in lines
    head = lines.index(next(line for line in lines if line.startswith("name")))
    assert lines[head].split() == ["name", "dtype", "shape", "begin", "end", "bytes"]
    rows = {line.split()[0]: line for line in lines[head + 2 :]}
    assert set(rows) == {"embed.weight", "bias", "empty", "scalar"}
    h = header(sample)
    for name, row in rows.items():
        begin, end = h[name]["data_offsets"]
        assert row.split()[1] == h[name]["dtype"]
        assert "[" + ", ".join(map(str, h[name]["shape"])) + "]" in row
        assert row.split()[-3:] == [str(begin), str(end), str(end - begin)]


def test_inspect_json(sample):
    r = run("inspect", sample, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    h = header(sample)
    assert info["path"] == sample
    assert info["metadata"] == h["__metadata__"]
    assert info["file_bytes"] == Path(sample).stat().st_size
    assert info["tensor_count"] == 4
    assert info["data_start"] == 8 + struct.unpack("<Q", Path(sample).read_bytes()[:8])[0]
    by_name = {t["name"]: t for t in info["tensors"]}
    for name, t in by_name.items():
        assert t["dtype"] == h[name]["dtype"] and t["shape"] == h[name]["shape"]
        assert [t["begin"], t["end"]] == h[name]["data_offsets"] and t["bytes"] == t["end"] - t["begin"]
    assert [t["begin"] for t in info["tensors"]] == sorted(t["begin"] for t in info["tensors"])  # file order
    assert info["data_bytes"] == sum(t["bytes"] for t in info["tensors"])


def test_inspect_missing_file(tmp_path):
    missing = str(tmp_path / "nope.safetensors")
    r = run("inspect", missing)
    assert r.returncode == 1 and missing in r.stderr and "Traceback" not in r.stderr


def test_verify_ok(sample):
    r = run("verify", sample)
    assert r.returncode == 0, r.stdout + r.stderr
    m = OK_LINE.match(r.stdout.strip())
    assert m, r.stdout
    assert m["path"] == sample and m["n"] == "4"


def _corrupt(tmp_path: Path, sample: str) -> Dict[str, str]:
    raw = Path(sample).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    bad: Dict[str, str] = {}
    bad["truncated"] = str(tmp_path / "truncated.safetensors")
    Path(bad["truncated"]).write_bytes(raw[:-3])
    bad["header"] = str(tmp_path / "bad header.safetensors")  # not JSON any more
    Path(bad["header"]).write_bytes(raw[:8] + b"!" + raw[9:])
    bad["offsets"] = str(tmp_path / "offsets.safetensors")  # a tensor's bytes past the data
    text = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 32]}}).encode()
    Path(bad["offsets"]).write_bytes(struct.pack("<Q", len(text)) + text + bytes(16))
    bad["short"] = str(tmp_path / "short.safetensors")
    Path(bad["short"]).write_bytes(b"\x01\x02")
    return bad


def test_verify_corrupt_files(tmp_path, sample):
    bad = _corrupt(tmp_path, sample)
    for kind, path in bad.items():
        r = run("verify", path)
        assert r.returncode == 1, (kind, r.stdout)
        line = r.stdout.strip()
        assert line.startswith(f"FAIL {path}: ") and len(line) > len(f"FAIL {path}: "), (kind, line)
        assert "Traceback" not in r.stderr


def test_verify_missing_and_mixed(tmp_path, sample):
    missing = str(tmp_path / "missing.safetensors")
    r = run("verify", missing)
    assert r.returncode == 1 and r.stdout.startswith(f"FAIL {missing}: ")
    truncated = str(tmp_path / "t.safetensors")
    Path(truncated).write_bytes(Path(sample).read_bytes()[:-1])
    r = run("verify", sample, missing, truncated, sample)
    assert r.returncode == 1
    lines: List[str] = r.stdout.splitlines()
    assert len(lines) == 4
    assert OK_LINE.match(lines[0]) and OK_LINE.match(lines[3])
    assert lines[1].startswith(f"FAIL {missing}: ") and lines[2].startswith(f"FAIL {truncated}: ")
    r = run("verify", str(tmp_path))
    assert r.returncode == 1 and r.stdout.startswith(f"FAIL {tmp_path}: ")


def test_verify_in_batches(sample, monkeypatch):
    from safeload import cli

    monkeypatch.setattr(cli, "VERIFY_BATCH_BYTES", 1)  # one tensor per batch
    assert OK_LINE.match(cli.verify_file(sample))
    empty = sample + ".empty"
    safetensors.numpy.save_file({}, empty)
    assert cli.verify_file(empty).startswith(f"OK {empty} (0 tensors, 0.000 GiB, pread, ")


def test_patch_install_and_remove(tmp_path):
    from safeload.patch import PTH_LINE, PTH_NAME

    r = run("patch-install", "--target", str(tmp_path))
    assert r.returncode == 0, r.stderr
    hook = tmp_path / PTH_NAME
    assert str(hook) in r.stdout and hook.read_text() == PTH_LINE + "\n"
    r = run("patch-install", "--target", str(tmp_path), "--remove")
    assert r.returncode == 0 and not hook.exists() and str(hook) in r.stdout
    r = run("patch-install", "--target", str(tmp_path), "--remove")
    assert r.returncode == 0 and "no startup hook" in r.stdout


# -- DEBUG logging helper (safeload._logging) ----------------------------------------------------


def test_log_read(sample, caplog):
    import logging

    import safeload
    from safeload._logging import log_read
    from safeload._open import Stats

    stats = Stats("pread", 4, 1 << 20, 3 * 2**30, 1.5, "ext4")
    with caplog.at_level(logging.INFO, logger="safeload"):
        log_read(sample, stats, "get_tensors")
    assert caplog.records == []  # DEBUG off: nothing (and nothing computed)
    with caplog.at_level(logging.DEBUG, logger="safeload"):
        log_read(sample, stats, "get_tensors")
        log_read([sample, sample], {"backend": "direct", "bytes_read": 0, "seconds": 0.0}, "load_checkpoint")
        with safeload.safe_open(sample, "np", backend="pread") as f:
            f.get_tensors()
            log_read(sample, f, "get_tensors")  # a handle: its .stats
    # Each read line is followed by what the pool keeps and under which bound.
    messages = [r.getMessage() for r in caplog.records]
    memory = [m for m in messages if m.startswith("memory: ")]
    assert len(memory) == 4 and all("pool keeps" in m and "available" in m for m in memory)
    reads = [r for r in caplog.records if not r.getMessage().startswith("memory: ")]
    # get_tensors logs its own read too: explicit, explicit, automatic, explicit.
    first, second, automatic, third = (r.getMessage() for r in reads[-4:])
    assert all(r.name == "safeload" and r.levelno == logging.DEBUG for r in caplog.records[-8:])
    assert automatic == third
    assert first == (f"get_tensors {sample}: backend=pread threads=4 chunk=1.00 MiB read=3.00 GiB in 1.500s "
                     "(2.00 GiB/s) storage=ext4")
    assert second.startswith(f"load_checkpoint 2 files ({sample}, ...): backend=direct")
    assert third.startswith(f"get_tensors {sample}: backend=pread threads=") and "read=" in third


def test_bytes_compare_byte_for_byte(sample):
    """verify's pread/mmap check: Bytes from two readers are equal exactly when their bytes are."""
    from safeload._safeload import Handle

    a, b = Handle(sample, "pread"), Handle(sample, "mmap")
    names = a.offset_keys()
    for name in names:
        assert a.read(name)[3] == b.read(name)[3], name
    different = [(x, y) for x in names for y in names if x != y and a.read(x)[3] != b.read(y)[3]]
    assert different, "distinct tensors compared equal"
    assert (a.read(names[0])[3] == b"not bytes") is False
    a.close()
    b.close()
