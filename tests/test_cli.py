"""The ``safeload`` command line, run as ``python -m safeload`` in a subprocess."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
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
    for command in ("inspect", "verify", "hash", "patch-install"):
        assert command in r.stdout
    for command in ("inspect", "verify", "hash", "patch-install"):
        r = run(command, "--help")
        assert r.returncode == 0, command
        assert r.stdout.startswith(f"usage: safeload {command}"), r.stdout
    r = run("verify", "--help")
    assert "mmap" in r.stdout and "Exit status" in r.stdout and "--manifest" in r.stdout and "--sha256" in r.stdout
    r = run("hash", "--help")
    assert "sha256sum -c" in r.stdout and "Exit status" in r.stdout


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
    # A directory stands for its files, as `safeload hash` takes it: the truncated one fails.
    r = run("verify", str(tmp_path))
    lines = r.stdout.splitlines()
    assert r.returncode == 1 and len(lines) == 2, r.stdout
    assert OK_LINE.match(lines[0]) and lines[1].startswith(f"FAIL {truncated}: ")


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
    assert len(memory) == 5 and all("pool keeps" in m and "available" in m for m in memory)
    reads = [r for r in caplog.records if not r.getMessage().startswith("memory: ")]
    # get_tensors logs its own read too, and the handle its totals when it closes: explicit,
    # explicit, automatic, explicit, close.
    first, second, automatic, third, closed = (r.getMessage() for r in reads[-5:])
    assert all(r.name == "safeload" and r.levelno == logging.DEBUG for r in caplog.records[-10:])
    assert automatic == third
    assert closed.startswith(f"close {sample}: backend=pread") and "read=" in closed
    # The record carries the fields too, for handlers that count.
    record = reads[-1].safeload_read
    assert record["what"] == "close" and record["bytes_read"] == f.stats.bytes_read > 0
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


# -- SHA-256: hash, verify --manifest / --sha256 -------------------------------------------------

SHA_OK = re.compile(r"^OK (?P<path>.+) \(\d+ tensors, \d+\.\d+ GiB, pread, \d+\.\d+ GiB/s, sha256 matches (?P<by>.+)\)$")


def sha256sum(*files: str, cwd: Any = None) -> str:
    """What the ``sha256sum`` command prints for ``files``."""
    if shutil.which("sha256sum") is None:
        pytest.skip("sha256sum is not installed")
    r = subprocess.run(["sha256sum", "--", *files], capture_output=True, text=True, cwd=cwd, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture
def sharded(tmp_path) -> Path:
    """A 3-shard checkpoint written by safetensors 0.8 (``safetensors.torch.save_file``), with its index."""
    import safetensors.torch
    import torch

    folder = tmp_path / "checkpoint"
    folder.mkdir()
    weight_map: Dict[str, str] = {}
    for i in range(3):
        name = f"model-0000{i + 1}-of-00003.safetensors"
        tensors = {
            f"layers.{i}.weight": torch.randn(256, 300 + i),
            f"layers.{i}.bias": torch.randn(300).to(torch.bfloat16),
            f"layers.{i}.steps": torch.arange(5 + i),
        }
        safetensors.torch.save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def shard_names(folder: Path) -> List[str]:
    return sorted(p.name for p in folder.glob("*.safetensors"))


def test_hash_prints_what_sha256sum_prints(sharded):
    names = shard_names(sharded)
    want = sha256sum(*names, cwd=sharded)
    # A directory or its index: the shards, named relative to that directory.
    for target in (str(sharded), str(sharded / "model.safetensors.index.json")):
        r = run("hash", target)
        assert (r.returncode, r.stdout, r.stderr) == (0, want, ""), target
    # Files: named as given, several in one call; relative ones from the working directory.
    files = [str(sharded / n) for n in names]
    r = run("hash", *files)
    assert (r.returncode, r.stdout) == (0, sha256sum(*files))
    r = run("hash", "--threads", "1", names[2], names[0], cwd=sharded)
    assert (r.returncode, r.stdout) == (0, sha256sum(names[2], names[0], cwd=sharded))


def test_sha256sum_checks_what_hash_writes(sharded):
    r = run("hash", str(sharded))
    assert r.returncode == 0, r.stderr
    (sharded / "SHA256SUMS").write_text(r.stdout)
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], capture_output=True, text=True, cwd=sharded, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.splitlines() == [f"{n}: OK" for n in shard_names(sharded)]


def test_hash_reads_in_bounded_rounds(sharded, monkeypatch):
    """Rounds smaller than a tensor: every file's bytes still hashed once, in order."""
    import io

    from safeload import cli

    monkeypatch.setattr(cli, "VERIFY_BATCH_BYTES", 10_000)
    out = io.StringIO()
    assert cli.hash_files([str(sharded)], out=out) == 0
    assert out.getvalue() == sha256sum(*shard_names(sharded), cwd=sharded)


def test_hash_reports_a_file_it_cannot_read_and_prints_the_others(sharded, tmp_path):
    names = shard_names(sharded)
    missing = str(tmp_path / "missing.safetensors")
    truncated = str(tmp_path / "truncated.safetensors")
    Path(truncated).write_bytes((sharded / names[0]).read_bytes()[:-1])
    good = str(sharded / names[1])
    r = run("hash", missing, good, truncated)
    assert r.returncode == 1 and r.stdout == sha256sum(good)
    assert missing in r.stderr and truncated in r.stderr and "Traceback" not in r.stderr
    assert run("hash").returncode == 2 and run("hash", "--threads", "0", good).returncode == 2


def _manifest(folder: Path) -> Path:
    manifest = folder / "SHA256SUMS"
    manifest.write_text(sha256sum(*shard_names(folder), cwd=folder))
    return manifest


def test_verify_against_a_manifest_and_a_digest(sharded):
    manifest = _manifest(sharded)
    # No FILE: every file the manifest names, resolved against its folder.
    r = run("verify", "--manifest", str(manifest))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert [SHA_OK.match(line)["path"] for line in lines] == [str(sharded / n) for n in shard_names(sharded)]
    assert all(SHA_OK.match(line)["by"] == f"the manifest {manifest}" for line in lines)
    # Named files, from another working directory: found in the manifest by their real path.
    names = shard_names(sharded)
    r = run("verify", "--manifest", str(manifest), names[1], cwd=sharded)
    assert r.returncode == 0 and SHA_OK.match(r.stdout.strip())["path"] == names[1]
    digest = manifest.read_text().split()[0]
    for given in (digest, f"sha256:{digest.upper()}"):
        r = run("verify", "--sha256", given, str(sharded / names[0]))
        assert r.returncode == 0 and SHA_OK.match(r.stdout.strip())["by"] == "--sha256", r.stdout


def test_verify_checks_what_the_source_knows_without_a_manifest(tmp_path, sharded):
    """No --manifest, no --sha256: a file in the Hugging Face cache layout (a snapshot link to
    blobs/<sha256>) is checked against its blob name, a file with a SHA256SUMS beside it against
    that; a file with neither is verified as before, with no digest."""
    name = shard_names(sharded)[0]
    data = (sharded / name).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    repo = tmp_path / "models--acme--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (repo / "blobs" / digest).write_bytes(data)
    os.symlink(os.path.join("..", "..", "blobs", digest), snap / name)
    r = run("verify", str(snap / name))
    assert r.returncode == 0 and SHA_OK.match(r.stdout.strip())["by"] == "the Hugging Face cache's blob name", r.stdout
    raw = bytearray(data)
    raw[-1] ^= 1
    (repo / "blobs" / digest).write_bytes(bytes(raw))
    r = run("verify", str(snap / name))
    assert r.returncode == 1 and "SHA-256 mismatch" in r.stdout, r.stdout
    _manifest(sharded)
    r = run("verify", str(sharded / name))
    assert r.returncode == 0 and SHA_OK.match(r.stdout.strip())["by"] == str(sharded / "SHA256SUMS"), r.stdout
    plain = tmp_path / name
    shutil.copy(sharded / name, plain)
    r = run("verify", str(plain))
    assert r.returncode == 0 and "sha256" not in r.stdout, r.stdout


def _flipped(tmp_path: Path, sharded: Path, where: str, at: int) -> Path:
    """A copy of the first shard with the byte at ``at`` flipped, beside a copy of the manifest."""
    folder = tmp_path / where.replace(" ", "-")
    folder.mkdir()
    name = shard_names(sharded)[0]
    raw = bytearray((sharded / name).read_bytes())
    raw[at] ^= 0x01
    (folder / name).write_bytes(bytes(raw))
    shutil.copy(sharded / "SHA256SUMS", folder / "SHA256SUMS")
    return folder / name


def test_verify_manifest_catches_one_flipped_byte(tmp_path, sharded):
    manifest = _manifest(sharded)
    name = shard_names(sharded)[0]
    raw = (sharded / name).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    in_name = raw.index(b"layers.0.weight") + len("layers.")  # '0' -> '1': still a valid header
    expected = hashlib.sha256(raw).hexdigest()
    for where, at in (("header", in_name), ("first tensor", 8 + n), ("last tensor", len(raw) - 1)):
        path = _flipped(tmp_path, sharded, where, at)
        r = run("verify", "--manifest", str(path.parent / "SHA256SUMS"), str(path))
        actual = hashlib.sha256(path.read_bytes()).hexdigest()
        assert r.returncode == 1, (where, r.stdout)
        assert r.stdout.strip() == (f"FAIL {path}: SHA-256 mismatch: expected {expected} "
                                    f"(the manifest {path.parent / 'SHA256SUMS'}), got {actual}"), where
        r = run("verify", "--sha256", expected, str(path))
        assert r.returncode == 1 and f"expected {expected} (--sha256), got {actual}" in r.stdout, where
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / name).write_bytes(raw[:-1])
    shutil.copy(manifest, truncated / "SHA256SUMS")
    r = run("verify", "--manifest", str(truncated / "SHA256SUMS"))
    lines = r.stdout.splitlines()
    assert r.returncode == 1 and lines[0].startswith(f"FAIL {truncated / name}: ")
    assert all(line.startswith("FAIL ") for line in lines)  # the other two are not there either


def test_verify_manifest_errors(tmp_path, sharded):
    names = shard_names(sharded)
    good = sha256sum(names[0], cwd=sharded)
    # A malformed line: the manifest and the line named, nothing verified.
    manifest = sharded / "BAD.SUMS"
    manifest.write_text(good + "\n" + good.split()[0] + " " + names[1] + "\n")
    r = run("verify", "--manifest", str(manifest))
    assert r.returncode == 1 and r.stdout == "" and "Traceback" not in r.stderr
    assert f"manifest {manifest}, line 3: expected" in r.stderr, r.stderr
    # A file the manifest does not name.
    manifest.write_text(good)
    r = run("verify", "--manifest", str(manifest), str(sharded / names[0]), str(sharded / names[1]))
    lines = r.stdout.splitlines()
    assert r.returncode == 1 and SHA_OK.match(lines[0])
    assert lines[1] == f"FAIL {sharded / names[1]}: not in the manifest {manifest} (no line names this file)"
    r = run("verify", "--manifest", str(tmp_path / "nope"))
    assert r.returncode == 1 and str(tmp_path / "nope") in r.stderr
    # Usage: --sha256 names one file, with a digest; not both pins at once.
    one, two = str(sharded / names[0]), str(sharded / names[1])
    digest = good.split()[0]
    assert run("verify", "--sha256", digest, one, two).returncode == 2
    assert run("verify", "--sha256", digest[:-1], one).returncode == 2
    assert run("verify", "--sha256", digest, "--manifest", str(manifest), one).returncode == 2


def test_verify_hashes_in_the_same_batches(sharded, monkeypatch):
    """The digest is computed by the batches that read the tensors (one tensor each here)."""
    from safeload import cli

    monkeypatch.setattr(cli, "VERIFY_BATCH_BYTES", 1)
    path = str(sharded / shard_names(sharded)[2])
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    assert SHA_OK.match(cli.verify_file(path, expected=(digest, "a test")))["by"] == "a test"
    with pytest.raises(Exception, match=f"SHA-256 mismatch: expected {'0' * 64} \\(a test\\), got {digest}"):
        cli.verify_file(path, expected=("0" * 64, "a test"))


@pytest.mark.parametrize("kind", ["file", "directory", "index", "url"])
def test_hash_then_verify_round_trips(tmp_path, sharded, kind):
    """``safeload hash X > M && safeload verify --manifest M X`` exits 0 for X a file, a
    directory, an index and a URL (a loopback HTTP server), with M beside X or elsewhere; and 1
    once one byte of X changes."""
    names = shard_names(sharded)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    server = None
    if kind == "url":
        sys.path.insert(0, str(Path(__file__).parent / "support"))
        from range_server import RangeServer

        server = RangeServer(str(sharded.parent)).start()
    try:
        x = {"file": str(sharded / names[0]), "directory": str(sharded),
             "index": str(sharded / "model.safetensors.index.json"),
             "url": f"{server.url}/{sharded.name}/model.safetensors.index.json" if server else ""}[kind]
        files = 1 if kind == "file" else len(names)
        for manifest in (sharded / "SHA256SUMS.saved", elsewhere / "checkpoint.sha256"):
            r = run("hash", x)
            assert r.returncode == 0, r.stderr
            manifest.write_text(r.stdout)
            r = run("verify", "--manifest", str(manifest), x, cwd=tmp_path)
            assert r.returncode == 0, (manifest, r.stdout, r.stderr)
            oks = [line for line in r.stdout.splitlines() if line.startswith("OK ")]
            assert len(oks) == files and all("sha256 matches the manifest" in line for line in oks), r.stdout
        shard = sharded / names[0]
        raw = bytearray(shard.read_bytes())
        raw[-1] ^= 1
        shard.write_bytes(bytes(raw))
        r = run("verify", "--manifest", str(elsewhere / "checkpoint.sha256"), x, cwd=tmp_path)
        assert r.returncode == 1 and r.stdout.count("SHA-256 mismatch") == 1, r.stdout
    finally:
        if server is not None:
            server.stop()
