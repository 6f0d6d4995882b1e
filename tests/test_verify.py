"""verify= on load_file and load_checkpoint: every shard's SHA-256 computed in the same pass as
its read and checked before anything is returned, against a mapping, a sha256sum manifest, the
Hugging Face cache's blob names or a SHA256SUMS beside the files. Digests are the real
`hashlib.sha256` of the bytes on disk; tensors are compared with safetensors 0.8's."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest
import safetensors.numpy as st_numpy
import safetensors.torch as st_torch
import torch
from conftest import assert_tensor_equal

import safeload
import safeload.numpy
import safeload.torch


def _sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@pytest.fixture
def ckpt(tmp_path):
    """Three shards of several dtypes and their index, written by safetensors 0.8; returns the
    folder, 0.8's read of every tensor, and each shard's real digest."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    g = torch.Generator().manual_seed(0)
    weight_map, ref, digests = {}, {}, {}
    for s in range(3):
        shard = f"model-{s + 1:05d}-of-00003.safetensors"
        tensors = {
            f"l{s}.w": torch.randn(64, 300, generator=g),
            f"l{s}.h": torch.randn(40, 7, generator=g).to(torch.float16),
            f"l{s}.b": torch.randn(1000, generator=g).to(torch.bfloat16),
            f"l{s}.i": torch.arange(33, dtype=torch.int64),
        }
        st_torch.save_file(tensors, str(folder / shard))
        weight_map.update({k: shard for k in tensors})
        ref.update(st_torch.load_file(str(folder / shard)))
        digests[shard] = _sha(folder / shard)
    with open(folder / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return folder, ref, digests


def _same(got, ref):
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert_tensor_equal(got[k], ref[k], k)


def _manifest(path, digests, binary=False):
    mark = "*" if binary else " "
    path.write_text("".join(f"{d} {mark}{name}\n" for name, d in digests.items()))
    return path


def test_pinned_digests_load_the_same_tensors_as_0_8(ckpt, tmp_path, caplog):
    folder, ref, digests = ckpt
    with caplog.at_level("INFO", logger="safeload"):
        safeload.torch.load_checkpoint(str(folder), verify=digests)
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("verified ")]
    assert logged == [f"verified {folder / name}: SHA-256 matches the mapping" for name in sorted(digests)], logged
    index = str(folder / "model.safetensors.index.json")
    mapping = {name: f"sha256:{d}" for name, d in digests.items()}
    for at in [str(folder), index]:
        _same(safeload.torch.load_checkpoint(at, verify=mapping), ref)
        _same(safeload.torch.load_checkpoint(at, verify=str(_manifest(tmp_path / "m.txt", digests))), ref)
        _same(safeload.torch.load_checkpoint(at, verify=_manifest(tmp_path / "b.txt", digests, binary=True)), ref)
    for backend in ["auto", "pread", "direct"]:
        _same(safeload.torch.load_checkpoint(str(folder), verify=mapping, backend=backend), ref)
    # Converting on the way: the digest is of the file's bytes, not the converted ones.
    got = safeload.torch.load_checkpoint(str(folder), verify=mapping, dtype=torch.float32)
    for k in ref:
        want = ref[k].to(torch.float32) if ref[k].is_floating_point() else ref[k]
        assert_tensor_equal(got[k], want, k)
    one = folder / "model-00002-of-00003.safetensors"
    _same(safeload.torch.load_file(str(one), verify={one.name: digests[one.name]}),
          st_torch.load_file(str(one)))
    np_got = safeload.numpy.load_file(str(one), verify={one.name: digests[one.name]})
    np_ref = st_numpy.load_file(str(one))
    assert sorted(np_got) == sorted(np_ref) and all(np.array_equal(np_got[k], np_ref[k]) for k in np_ref)


def _flip(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("where", ["header", "first tensor", "last tensor", "truncated", "extended"])
def test_any_changed_byte_fails_before_anything_is_returned(ckpt, where):
    folder, _, digests = ckpt
    shard = folder / "model-00003-of-00003.safetensors"
    size = os.path.getsize(shard)
    with safeload.safe_open(str(shard), "pt") as f:
        start = f._handle.data_start
    if where == "header":
        text = shard.read_bytes()[8:start]
        _flip(shard, 8 + text.index(b'"dtype"') + 2)  # "dtype" -> "etype"-like: still valid JSON
    elif where == "first tensor":
        _flip(shard, start)
    elif where == "last tensor":
        _flip(shard, size - 1)
    elif where == "truncated":
        os.truncate(shard, size - 4)
    else:
        with open(shard, "ab") as f:
            f.write(b"\0" * 8)
    mapping = dict(digests)
    try:
        got = safeload.torch.load_checkpoint(str(folder), verify=mapping)
    except safeload.SafetensorError as e:
        message = str(e)
    else:
        pytest.fail(f"{where}: returned {len(got)} tensors, no error")
    if where in ("first tensor", "last tensor"):
        assert message == (f"{shard}: SHA-256 mismatch: expected {digests[shard.name]} (the mapping), "
                           f"read {_sha(shard)}"), message
    else:
        # A changed header or length may be refused by the header check first; either way an
        # error, never tensors.
        assert str(shard) in message, message


def test_a_wrong_or_missing_pin_is_an_error_naming_it(ckpt, tmp_path):
    folder, _, digests = ckpt
    wrong = dict(digests)
    first = "model-00001-of-00003.safetensors"
    wrong[first] = "0" * 64
    with pytest.raises(safeload.SafetensorError, match=f"expected {'0' * 64} \\(the mapping\\), read {digests[first]}"):
        safeload.torch.load_checkpoint(str(folder), verify=wrong)
    manifest = _manifest(tmp_path / "m.txt", wrong)
    with pytest.raises(safeload.SafetensorError, match=f"\\(the manifest {manifest}\\)"):
        safeload.torch.load_checkpoint(str(folder), verify=str(manifest))
    missing = {k: v for k, v in digests.items() if k != first}
    with pytest.raises(safeload.SafetensorError, match=f'verify= has no digest for "{first}"'):
        safeload.torch.load_checkpoint(str(folder), verify=missing)
    (tmp_path / "bad.txt").write_text("not a manifest\n")
    with pytest.raises(safeload.SafetensorError, match="line 1"):
        safeload.torch.load_checkpoint(str(folder), verify=str(tmp_path / "bad.txt"))
    with pytest.raises(safeload.SafetensorError, match="64 hex digits"):
        safeload.torch.load_checkpoint(str(folder), verify={first: "sha256:abc"})
    with pytest.raises(safeload.SafetensorError, match="verify= takes None, True"):
        safeload.torch.load_checkpoint(str(folder), verify=3)


def test_true_uses_the_digests_the_source_knows(ckpt, tmp_path):
    folder, ref, digests = ckpt
    # A plain folder knows none: strict.
    with pytest.raises(safeload.SafetensorError, match="no SHA-256 is known for this file"):
        safeload.torch.load_checkpoint(str(folder), verify=True)
    # SHA256SUMS beside the files, as `sha256sum *.safetensors > SHA256SUMS` writes it.
    _manifest(folder / "SHA256SUMS", digests)
    _same(safeload.torch.load_checkpoint(str(folder), verify=True), ref)
    os.remove(folder / "SHA256SUMS")
    # The Hugging Face cache: snapshot links into blobs/ named by each file's SHA-256.
    repo = tmp_path / "models--acme--tiny"
    snap = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for name in os.listdir(folder):
        data = (folder / name).read_bytes()
        blob = digests.get(name) or hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), snap / name)
    _same(safeload.torch.load_checkpoint(str(snap), verify=True), ref)
    # A blob whose bytes changed: its name no longer matches.
    blob = repo / "blobs" / digests["model-00002-of-00003.safetensors"]
    _flip(blob, os.path.getsize(blob) - 1)
    with pytest.raises(safeload.SafetensorError, match="the Hugging Face cache's blob name"):
        safeload.torch.load_checkpoint(str(snap), verify=True)


def test_what_verify_cannot_check_yet_is_refused_not_skipped(ckpt, fake_cuda):
    folder, _, digests = ckpt
    with pytest.raises(safeload.SafetensorError, match="not verified yet"):
        safeload.torch.load_checkpoint(str(folder), device="cuda", verify=digests)
    assert fake_cuda == []  # refused before any staging
    with pytest.raises(safeload.SafetensorError, match="use one or the other"):
        safeload.torch.load_checkpoint(str(folder), verify=digests, progress=True)
    with pytest.raises(safeload.SafetensorError, match='backend "mmap" reads none'):
        safeload.torch.load_checkpoint(str(folder), verify=digests, backend="mmap")
    with pytest.raises(TypeError):
        safeload.torch.iter_checkpoint(str(folder), verify=digests).__next__()


def test_the_cli_hash_is_a_pin_load_checkpoint_accepts(ckpt, tmp_path):
    """`safeload hash DIR > SHA256SUMS` writes what verify=True then checks."""
    import subprocess
    import sys

    folder, ref, _ = ckpt
    out = subprocess.run([sys.executable, "-m", "safeload.cli", "hash", str(folder)], capture_output=True,
                         text=True, check=True, cwd=str(folder)).stdout
    (folder / "SHA256SUMS").write_text(out)
    _same(safeload.torch.load_checkpoint(str(folder), verify=True), ref)
    shutil.copy(folder / "SHA256SUMS", tmp_path / "elsewhere.txt")
    _same(safeload.torch.load_checkpoint(str(folder), verify=str(tmp_path / "elsewhere.txt")), ref)


def test_a_server_that_shifts_its_ranges_is_caught(tmp_path):
    """A server answering every data range with the bytes 7 further on, under correct headers:
    nothing in the protocol can tell; the loads without verify= return wrong tensors, verify=
    raises before returning any."""
    from range_server import RangeServer

    path = tmp_path / "m.safetensors"
    g = torch.Generator().manual_seed(3)
    st_torch.save_file({f"t{i}": torch.randn(512, 64, generator=g) for i in range(10)}, str(path))
    ref = st_torch.load_file(str(path))
    digest = _sha(path)
    server = RangeServer(str(tmp_path)).start()
    try:
        server.shift = 7
        url = f"{server.url}/m.safetensors"
        wrong = safeload.torch.load_file(url)  # the failure verify= exists for
        assert sorted(wrong) == sorted(ref) and any(not torch.equal(wrong[k], ref[k]) for k in ref)
        for load in (lambda: safeload.torch.load_file(url, verify={"m.safetensors": digest}),
                     lambda: safeload.torch.load_checkpoint(url, verify={"m.safetensors": digest})):
            with pytest.raises(safeload.SafetensorError, match=f"expected {digest} \\(the mapping\\), read "):
                load()
        server.shift = 0
        _same(safeload.torch.load_file(url, verify={"m.safetensors": digest}), ref)
    finally:
        server.stop()
