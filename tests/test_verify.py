"""verify= on load_file and load_checkpoint: every shard's SHA-256 computed in the same pass as
its read and checked before anything is returned, against a mapping, a sha256sum manifest, the
Hugging Face cache's blob names or a SHA256SUMS beside the files. Digests are the real
`hashlib.sha256` of the bytes on disk; tensors are compared with safetensors 0.8's."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time

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
        # Copies: 0.8's load_file maps the file, and tests change files in place.
        ref.update({k: v.clone() for k, v in st_torch.load_file(str(folder / shard)).items()})
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


def _group(tmp_path):
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    return dist.group.WORLD


def _in_place(ref, loader):
    """Zeroed tensors shaped as the checkpoint's, loaded in place by ``loader(model)``; returns
    them (left as they were when the loader raised)."""
    model = torch.nn.Module()
    for k, t in ref.items():
        model.register_buffer(k.replace(".", "_"), torch.zeros_like(t))
    named = {k: getattr(model, k.replace(".", "_")) for k in ref}
    try:
        loader(model, named)
    finally:
        loaded = {k: t.clone() for k, t in named.items()}
    return loaded


def _entry_points(folder, digests, tmp_path):
    """Every entry point that opens a file, with its destinations, as users call it: label ->
    (load(verify_of_the_folder, verify_of_one_file) -> {name: CPU tensor}, the file or folder
    it reads)."""
    one = folder / "model-00003-of-00003.safetensors"

    def opened(framework="pt", device="cpu", take=lambda f, k: f.get_tensor(k)):
        def load(_, pin):
            with safeload.safe_open(str(one), framework, device=device, verify=pin) as f:
                return {k: take(f, k) for k in f.keys()}
        return load

    def into(_, pin_all):
        ref = st_torch.load_file(str(one))
        # load_into takes its own names: the folder's buffers, keyed as the checkpoint.
        got = _in_place(ref, lambda m, named: safeload.torch.load_into(named, str(one), verify=pin_all))
        return got

    def model(pin_all, _):
        ref = safeload.torch.load_checkpoint(str(folder), verify=False)
        model = torch.nn.Module()
        for k, t in ref.items():
            model.register_buffer(k.replace(".", "_"), torch.zeros_like(t))
        # load_model matches names: the model's, written back under the checkpoint's.
        renamed = tmp_path / "renamed"
        if not renamed.exists():
            renamed.mkdir()
            for name in digests:
                st_torch.save_file({k.replace(".", "_"): v for k, v in st_torch.load_file(str(folder / name)).items()},
                                   str(renamed / name))
        pins = {name: _sha(renamed / name) for name in digests} if pin_all is not None else None
        if pins is not None and pin_all.get("_flipped"):
            pins = {k: "0" * 64 for k in pins}
        try:
            safeload.torch.load_model(model, str(renamed), verify=pins)
        finally:
            state = {k.replace("_", ".", 1): v.clone() for k, v in model.state_dict().items()}
        return state

    return {
        "safe_open get_tensor": (opened(), one),
        "safe_open numpy get_tensor": (opened("np"), one),
        "safe_open get_slice[:2]": (opened(take=lambda f, k: f.get_slice(k)[:2]), one),
        "safe_open get_tensors": (lambda _, pin: _open_all(one, pin), one),
        "safe_open cuda": (opened(device="cuda"), one),
        "torch.load_file": (lambda _, pin: safeload.torch.load_file(str(one), verify=pin), one),
        "numpy.load_file": (lambda _, pin: safeload.numpy.load_file(str(one), verify=pin), one),
        "load_checkpoint": (lambda pin, _: safeload.torch.load_checkpoint(str(folder), verify=pin), folder),
        "load_checkpoint progress": (lambda pin, _: safeload.torch.load_checkpoint(
            str(folder), verify=pin, progress=lambda done, total: None), folder),
        "load_checkpoint cuda": (lambda pin, _: safeload.torch.load_checkpoint(
            str(folder), device="cuda", verify=pin), folder),
        "iter_checkpoint": (lambda pin, _: dict(safeload.torch.iter_checkpoint(
            str(folder), verify=pin, max_inflight_bytes=4096)), folder),
        "load_into": (lambda _, pin: into(None, pin), one),
        "distributed": (lambda pin, _: safeload.torch.load_checkpoint(
            str(folder), process_group=_group(tmp_path), verify=pin), folder),
        "distributed plan": (lambda pin, _: safeload.torch.load_checkpoint(
            str(folder), process_group=_group(tmp_path), plan={"l2.w": slice(0, 2)}, verify=pin), folder),
    }


def _open_all(one, pin):
    with safeload.safe_open(str(one), "pt", verify=pin) as f:
        return f.get_tensors()


ENTRY_POINTS = ["safe_open get_tensor", "safe_open numpy get_tensor", "safe_open get_slice[:2]",
                "safe_open get_tensors", "safe_open cuda", "torch.load_file", "numpy.load_file",
                "load_checkpoint", "load_checkpoint progress", "load_checkpoint cuda", "iter_checkpoint",
                "load_into", "distributed", "distributed plan"]


def _expected(label, ref):
    if label == "distributed plan":
        return {"l2.w": ref["l2.w"][:2]}
    if label == "safe_open get_slice[:2]":
        return {k: v[:2] for k, v in ref.items() if k.startswith("l2.")}
    return ref


@pytest.mark.parametrize("label", ENTRY_POINTS)
def test_every_entry_point_verifies_before_it_returns(ckpt, tmp_path, fake_cuda, label):
    """Each entry point and destination returns 0.8's tensors under a right pin, and raises
    before returning any under a wrong one (an in-place load leaves its tensors untouched)."""
    folder, ref, digests = ckpt
    one = "model-00003-of-00003.safetensors"
    load, at = _entry_points(folder, digests, tmp_path)[label]
    if "numpy" in label:
        want = st_numpy.load_file(str(folder / one))
    else:
        want = _expected(label, ref if at == folder else {k: v for k, v in ref.items() if k.startswith("l2.")})
    _same(load(dict(digests), {one: digests[one]}), want)
    wrong = {**digests, one: "0" * 64}
    try:
        got = load(wrong, {one: "0" * 64})
    except safeload.SafetensorError as e:
        assert f"{folder / one}: SHA-256 mismatch: expected {'0' * 64} (the mapping), read {digests[one]}" \
            in str(e), str(e)
    else:
        if label != "load_into":
            pytest.fail(f"{label}: returned {len(got)} tensors under a wrong pin")
        pytest.fail("load_into: no error under a wrong pin")


def test_an_in_place_load_checks_before_it_touches_the_model(ckpt):
    folder, ref, digests = ckpt
    one = "model-00003-of-00003.safetensors"
    mine = {k: v for k, v in ref.items() if k.startswith("l2.")}
    got = _in_place(mine, lambda m, named: safeload.torch.load_into(named, str(folder / one),
                                                                    verify={one: digests[one]}))
    _same(got, mine)
    with pytest.raises(safeload.SafetensorError, match="SHA-256 mismatch"):
        _in_place(mine, lambda m, named: safeload.torch.load_into(named, str(folder / one), verify={one: "0" * 64}))
    untouched = {}
    try:
        _in_place(mine, lambda m, named: (untouched.update(named),
                                          safeload.torch.load_into(named, str(folder / one), verify={one: "1" * 64})))
    except safeload.SafetensorError:
        pass
    assert all(not t.any() for t in untouched.values())  # still zeros: nothing was copied in
    # load_model: every shard checked before the model is touched.
    model = torch.nn.Module()
    model.register_buffer("l2_w", torch.zeros(64, 300))
    renamed = folder.parent / "renamed.safetensors"
    st_torch.save_file({"l2_w": ref["l2.w"]}, str(renamed))
    with pytest.raises(safeload.SafetensorError, match="SHA-256 mismatch"):
        safeload.torch.load_model(model, str(renamed), verify={renamed.name: "0" * 64})
    assert not model.l2_w.any()
    safeload.torch.load_model(model, str(renamed), verify={renamed.name: _sha(renamed)})
    assert torch.equal(model.l2_w, ref["l2.w"])


def test_a_verified_handle_serves_the_bytes_it_hashed(ckpt):
    """safe_open(verify=) reads and hashes the file at open; a write in place after that changes
    nothing it returns (a map would show it); a tensor asked for twice is read and hashed again,
    and the two do not share memory; prefetch (which reads around the hashed bytes) is refused."""
    folder, ref, digests = ckpt
    one = folder / "model-00003-of-00003.safetensors"
    pin = {one.name: digests[one.name]}
    with safeload.safe_open(str(one), "pt", verify=pin) as f:
        assert f.stats.verified_files == 1 and f.stats.verified_bytes == os.path.getsize(one)
        _flip(one, os.path.getsize(one) - 1)  # the last tensor's last byte, after the hash
        first = f.get_tensor("l2.i")
        assert torch.equal(first, ref["l2.i"])
        for k in ("l2.w", "l2.h", "l2.b"):
            assert torch.equal(f.get_tensor(k), ref[k]), k  # the hashed bytes, not the file's now
        # Asked for again: read and hashed again, and the file no longer matches.
        with pytest.raises(safeload.SafetensorError, match="SHA-256 mismatch"):
            f.get_tensor("l2.i")
    with pytest.raises(safeload.SafetensorError, match="SHA-256 mismatch"):
        safeload.safe_open(str(one), "pt", verify=pin)
    _flip(one, os.path.getsize(one) - 1)
    with safeload.safe_open(str(one), "pt", verify=pin) as f:
        first = f.get_tensor("l2.b")
        first += 1
        again = f.get_tensor("l2.b")  # asked for twice: its own memory, read and hashed again
        assert torch.equal(again, ref["l2.b"]) and f.stats.verified_files == 2
        with pytest.raises(safeload.SafetensorError, match="prefetch"):
            f.prefetch()
    with pytest.raises(safeload.SafetensorError, match='backend "mmap" reads none'):
        safeload.safe_open(str(one), "pt", backend="mmap", verify=pin)
    assert again is not None


def test_a_whole_slice_of_a_verified_handle_is_handed_out_as_get_tensor_is(ckpt):
    """get_slice(k)[...] (how transformers materializes every tensor) takes the tensor from the
    hashed bytes without a copy, as get_tensor does: equal to 0.8's, and asked for again it is read
    and hashed again (so a change after the first hash fails it); a part still cuts a copy."""
    folder, ref, digests = ckpt
    one = folder / "model-00003-of-00003.safetensors"
    pin = {one.name: digests[one.name]}
    with safeload.safe_open(str(one), "pt", verify=pin) as f:
        part = f.get_slice("l2.w")[:1]  # cut from the bytes held: a copy
        whole = f.get_slice("l2.w")[...]  # the held bytes themselves: no second hash
        assert torch.equal(whole, ref["l2.w"]) and torch.equal(part, ref["l2.w"][:1])
        assert f.stats.verified_files == 1
        assert torch.equal(f.get_slice("l2.b")[:], ref["l2.b"])
        _flip(one, os.path.getsize(one) - 1)
        with pytest.raises(safeload.SafetensorError, match="SHA-256 mismatch"):
            f.get_slice("l2.w")[...]  # handed out already: read and hashed again
    _flip(one, os.path.getsize(one) - 1)


def test_safeload_verify_in_the_environment(ckpt, monkeypatch, caplog):
    """SAFELOAD_VERIFY=1: what the source knows is checked, files with none load unverified
    (counted, logged); =strict: a file with none is an error; verify=False turns it off."""
    folder, ref, digests = ckpt
    monkeypatch.setenv("SAFELOAD_VERIFY", "1")
    with caplog.at_level("INFO", logger="safeload"):
        got, stats = safeload.torch.load_checkpoint(str(folder), return_stats=True)
    _same(got, ref)
    assert (stats.verified_files, stats.unverified_files) == (0, 3)
    assert sum("unverified" in r.getMessage() for r in caplog.records) == 3
    _manifest(folder / "SHA256SUMS", digests)
    got, stats = safeload.torch.load_checkpoint(str(folder), return_stats=True)
    _same(got, ref)
    assert (stats.verified_files, stats.unverified_files) == (3, 0)
    assert stats.verified_bytes == sum(os.path.getsize(folder / n) for n in digests)
    one = folder / "model-00001-of-00003.safetensors"
    with safeload.safe_open(str(one), "pt") as f:  # SHA256SUMS beside a single file
        assert f.stats.verified_files == 1
    _flip(one, os.path.getsize(one) - 1)
    with pytest.raises(safeload.SafetensorError, match="SHA-256 mismatch"):
        safeload.torch.load_file(str(one))
    with pytest.raises(safeload.SafetensorError, match="SHA-256 mismatch"):
        safeload.safe_open(str(one), "pt", backend="mmap")  # the variable's word over "mmap"
    safeload.torch.load_file(str(one), verify=False)  # off for this call
    os.remove(folder / "SHA256SUMS")
    monkeypatch.setenv("SAFELOAD_VERIFY", "strict")
    with pytest.raises(safeload.SafetensorError, match="no SHA-256 is known"):
        safeload.torch.load_file(str(one))
    monkeypatch.setenv("SAFELOAD_VERIFY", "yes")
    with pytest.raises(safeload.SafetensorError, match='SAFELOAD_VERIFY="yes"'):
        safeload.torch.load_file(str(one))


def _age_entries(record):
    """Dates the record's entries a minute ahead: the record distrusts an entry written within the
    timestamp tick of its file's last change (git's racy-clean rule), which a test that writes a
    file and loads it at once would otherwise meet, by chance."""
    later = time.time() + 60
    for entry in record.iterdir():
        os.utime(entry, (later, later))


def test_the_verified_record_skips_the_hash_of_an_unchanged_file(ckpt, tmp_path, monkeypatch, caplog):
    folder, ref, digests = ckpt
    record = tmp_path / "record"
    got, stats = safeload.torch.load_checkpoint(str(folder), verify=digests, verify_cache=str(record),
                                                return_stats=True)
    _same(got, ref)
    assert (stats.verified_files, stats.recorded_files) == (3, 0)
    assert len(list(record.iterdir())) == 3
    _age_entries(record)
    with caplog.at_level("INFO", logger="safeload"):
        got, stats = safeload.torch.load_checkpoint(str(folder), verify=digests, verify_cache=str(record),
                                                    return_stats=True)
    _same(got, ref)
    assert (stats.verified_files, stats.recorded_files) == (0, 3)
    assert sum("by the verified record" in r.getMessage() for r in caplog.records) == 3
    one = folder / "model-00002-of-00003.safetensors"
    with safeload.safe_open(str(one), "pt", verify={one.name: digests[one.name]}, verify_cache=str(record)) as f:
        assert (f.stats.verified_files, f.stats.recorded_files) == (0, 1)
        _same({k: f.get_tensor(k) for k in f.keys()}, {k: v for k, v in ref.items() if k.startswith("l1.")})
    # Another pin for the same unchanged file: hashed, and a mismatch.
    with pytest.raises(safeload.SafetensorError, match="SHA-256 mismatch"):
        safeload.torch.load_checkpoint(str(folder), verify={**digests, one.name: "0" * 64}, verify_cache=str(record))
    # A file changed in place (a new ctime): hashed again, whatever the record says.
    _flip(one, os.path.getsize(one) - 1)
    with pytest.raises(safeload.SafetensorError, match="SHA-256 mismatch"):
        safeload.torch.load_checkpoint(str(folder), verify=digests, verify_cache=str(record))
    _flip(one, os.path.getsize(one) - 1)
    # The variable names the record for code that passes no verify_cache=.
    monkeypatch.setenv("SAFELOAD_VERIFY_CACHE", str(tmp_path / "from-env"))
    safeload.torch.load_checkpoint(str(folder), verify=digests)
    assert len(list((tmp_path / "from-env").iterdir())) == 3
    with pytest.raises(safeload.SafetensorError, match="nothing to remember"):
        safeload.torch.load_checkpoint(str(folder), verify=False, verify_cache=str(record))


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
