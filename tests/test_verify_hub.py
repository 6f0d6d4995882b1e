"""verify=True of files on the Hugging Face Hub (`hf://`, and `resolve` URLs under HF_ENDPOINT):
each file is checked against the SHA-256 the Hub reports of it, the `X-Linked-Etag` of its answer
to the request that opens the file (a redirect to its storage, another host), so verifying costs
no request. The Hub is tests/support/range_server.py on loopback, answering as the real Hub
answers; tensors are compared with safetensors 0.8's read of the same files."""

from __future__ import annotations

import json
import os

import pytest
import safetensors.torch as st_torch
import torch
from conftest import assert_tensor_equal
from range_server import RangeServer

import safeload
import safeload.torch


def _write(path, seed, prefix=""):
    """A file of several dtypes written by safetensors 0.8; returns 0.8's read of it."""
    g = torch.Generator().manual_seed(seed)
    tensors = {
        f"{prefix}w": torch.randn(64, 300, generator=g),
        f"{prefix}h": torch.randn(40, 7, generator=g).to(torch.float16),
        f"{prefix}b": torch.randn(1000, generator=g).to(torch.bfloat16),
        f"{prefix}i": torch.arange(33, dtype=torch.int64) * seed,
    }
    os.makedirs(os.path.dirname(path), exist_ok=True)
    st_torch.save_file(tensors, path)
    return st_torch.load_file(path)


def _same(got, ref):
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert_tensor_equal(got[k], ref[k], k)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The Hub at HF_ENDPOINT (127.0.0.1) redirecting every resolve URL to its storage (another
    host name, localhost, serving the same files); repository acme/tiny with a file at main and a
    sharded folder with its index at v1. Returns the Hub, the storage and 0.8's reads."""
    root = str(tmp_path / "hub")
    repo = os.path.join(root, "acme", "tiny", "resolve")
    ref = _write(os.path.join(repo, "main", "model.safetensors"), seed=1)
    sharded, weight_map = {}, {}
    for s in range(2):
        shard = f"model-{s + 1:05d}-of-00002.safetensors"
        part = _write(os.path.join(repo, "v1", "enc", shard), seed=10 + s, prefix=f"l{s}.")
        sharded.update(part)
        weight_map.update({k: shard for k in part})
    with open(os.path.join(repo, "v1", "enc", "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    server, storage = RangeServer(root).start(), RangeServer(root).start()
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    server.redirect_to = storage.url.replace("127.0.0.1", "localhost")
    try:
        yield server, storage, ref, sharded
    finally:
        server.stop()
        storage.stop()


def test_hub_files_are_verified_against_the_sha256_the_hub_reports(hub):
    """hf:// files, a sharded hf:// folder (by its index) and a resolve URL load verified, the same
    tensors as 0.8's, without a request more than the unverified load (no HEAD, nothing asked of
    the storage for the digest)."""
    server, storage, ref, sharded = hub
    url = "hf://acme/tiny/model.safetensors"
    _same(safeload.torch.load_checkpoint(url), ref)
    unverified = sorted((m, p, r) for m, p, r, *_ in server.requests)
    server.reset()
    server.redirect_to = storage.url.replace("127.0.0.1", "localhost")
    _same(safeload.torch.load_checkpoint(url, verify=True), ref)
    assert sorted((m, p, r) for m, p, r, *_ in server.requests) == unverified
    assert not any(m == "HEAD" for m, *_ in server.requests + storage.requests)
    _same(safeload.torch.load_file(url, verify=True), ref)
    _same(safeload.torch.load_checkpoint("hf://acme/tiny@v1/enc", verify=True), sharded)
    resolve = f"{server.url}/acme/tiny/resolve/main/model.safetensors"
    _same(safeload.torch.load_checkpoint(resolve, verify=True), ref)


def test_a_hub_that_reports_another_sha256_is_a_mismatch(hub):
    """The Hub's X-Linked-Etag names other bytes than the storage serves: the verified load
    raises the mismatch, naming the Hub's header as the expectation; the unverified one loads."""
    server, _, ref, _ = hub
    server.wrong_linked_etag = True
    url = "hf://acme/tiny/model.safetensors"
    _same(safeload.torch.load_checkpoint(url), ref)
    for load in (lambda: safeload.torch.load_checkpoint(url, verify=True),
                 lambda: safeload.torch.load_file(url, verify=True),
                 lambda: safeload.torch.load_checkpoint("hf://acme/tiny@v1/enc", verify=True)):
        with pytest.raises(safeload.SafetensorError) as info:
            load()
        message = str(info.value)
        assert "SHA-256 mismatch" in message and "the Hub's X-Linked-Etag" in message, message


def test_storage_serving_other_bytes_than_the_hub_names_is_caught(hub):
    """The storage the Hub redirects to answers every data range with the bytes 7 further on,
    under correct headers: the Hub's (right) SHA-256 catches it."""
    _, storage, ref, _ = hub
    storage.shift = 7
    url = "hf://acme/tiny/model.safetensors"
    wrong = safeload.torch.load_checkpoint(url)  # what verify= is for
    assert sorted(wrong) == sorted(ref) and any(not torch.equal(wrong[k], ref[k]) for k in ref)
    with pytest.raises(safeload.SafetensorError) as info:
        safeload.torch.load_checkpoint(url, verify=True)
    message = str(info.value)
    assert "SHA-256 mismatch" in message and "the Hub's X-Linked-Etag" in message, message
