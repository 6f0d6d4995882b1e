"""Saving at the disk's speed (issue 61): the parallel writer's files equal 0.8's for every dtype
and size whatever its thread count; save_checkpoint writes transformers' layout with a
SHA256SUMS that sha256sum and safeload verify accept; save_pretrained patched writes stock's
files; faults (a full disk, a read-only directory, a directory as target, a name that escapes,
Ctrl-C, a process killed mid-save) leave the earlier files as they were. I/O failures raise the
OSError subclass of their errno where Python has one (else SafetensorError), naming the file."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import safetensors.numpy as st_numpy
import safetensors.torch as st_torch

import safeload
import safeload.numpy
import safeload.torch
from safeload import SafetensorError

from conftest import TORCH_DTYPES, make_tensor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_bytes(path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def sha256(path) -> str:
    return hashlib.sha256(read_bytes(path)).hexdigest()


def mixed_tensors(seed: int = 0):
    """Every dtype at small sizes, plus tensors that span several of the writer's pieces (16 MiB)
    and runs of small ones it gathers."""
    out = {f"{code}/{i}": make_tensor(code, shape, seed + i)
           for i, (code, shape) in enumerate((c, s) for c in TORCH_DTYPES for s in ((3, 5), (0,), ()))
           if not (code == "F4" and shape == ())}
    g = torch.Generator().manual_seed(seed)
    out["big"] = torch.randn(5 << 20, generator=g)  # 20 MiB: two pieces
    out["mid"] = torch.randn(300_000, generator=g).to(torch.bfloat16)
    for i in range(50):
        out[f"small.{i}"] = torch.randn(64 + i, generator=g)
    return out


@pytest.mark.parametrize("threads", ["1", "3"])
def test_save_file_bytes_equal_0_8_for_every_dtype(tmp_path, monkeypatch, threads):
    monkeypatch.setenv("SAFELOAD_WRITE_THREADS", threads)
    tensors = mixed_tensors()
    meta = {"format": "pt"}  # one key: 0.8 writes several in its HashMap's order, safeload sorted
    st_torch.save_file(tensors, tmp_path / "ref.safetensors", metadata=meta)
    safeload.torch.save_file(tensors, tmp_path / "ours.safetensors", metadata=meta, fsync=threads == "1")
    assert read_bytes(tmp_path / "ours.safetensors") == read_bytes(tmp_path / "ref.safetensors")
    arrays = {"a": np.arange(3 << 20, dtype=np.float32), "b": np.ones((2, 3), np.int16), "c": np.zeros((), np.uint8)}
    st_numpy.save_file(arrays, tmp_path / "ref.np.safetensors")
    safeload.numpy.save_file(arrays, tmp_path / "ours.np.safetensors")
    assert read_bytes(tmp_path / "ours.np.safetensors") == read_bytes(tmp_path / "ref.np.safetensors")


def test_save_file_manifest_is_the_digest_of_the_file(tmp_path):
    tensors = mixed_tensors(1)
    safeload.torch.save_file(tensors, tmp_path / "a.safetensors", manifest=True)
    safeload.numpy.save_file({"x": np.arange(10)}, tmp_path / "b.safetensors", manifest=True)
    lines = (tmp_path / "SHA256SUMS").read_text().splitlines()
    assert lines == [f"{sha256(tmp_path / 'a.safetensors')}  a.safetensors",
                     f"{sha256(tmp_path / 'b.safetensors')}  b.safetensors"]
    os.unlink(tmp_path / "b.safetensors")  # a file that is gone loses its line at the next save
    safeload.torch.save_file({"y": torch.ones(2)}, tmp_path / "a.safetensors", manifest=True)
    assert (tmp_path / "SHA256SUMS").read_text() == f"{sha256(tmp_path / 'a.safetensors')}  a.safetensors\n"


def test_a_file_written_again_without_its_digest_leaves_no_stale_line(tmp_path):
    """A manifest never names bytes that are gone: saving over a listed file without
    ``manifest`` drops its line (so ``sha256sum -c`` still passes); without a manifest already
    there, none is made."""
    safeload.torch.save_file({"a": torch.ones(3)}, tmp_path / "a.safetensors", manifest=True)
    safeload.torch.save_file({"b": torch.ones(3)}, tmp_path / "b.safetensors", manifest=True)
    safeload.torch.save_file({"a": torch.zeros(3)}, tmp_path / "a.safetensors")
    assert (tmp_path / "SHA256SUMS").read_text() == f"{sha256(tmp_path / 'b.safetensors')}  b.safetensors\n"
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=tmp_path, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    ckpt = tmp_path / "ckpt"
    safeload.torch.save_checkpoint({"x": torch.ones(4), "y": torch.ones(4)}, ckpt, max_shard_size=20)
    safeload.torch.save_checkpoint({"x": torch.zeros(4), "y": torch.zeros(4)}, ckpt, max_shard_size=20,
                                   manifest=False)
    assert (ckpt / "SHA256SUMS").read_text() == ""
    plain = tmp_path / "plain"
    plain.mkdir()
    safeload.numpy.save_file({"c": np.ones(2)}, plain / "c.safetensors")
    assert os.listdir(plain) == ["c.safetensors"]


def test_save_checkpoint_split_and_index_as_huggingface_hub(tmp_path):
    from huggingface_hub import split_torch_state_dict_into_shards

    g = torch.Generator().manual_seed(3)
    sd = {f"layer.{i}.w": torch.randn(100 + 7 * i, 64, generator=g) for i in range(12)}
    sd["huge"] = torch.randn(200, 1000, generator=g)  # larger than a shard: one of its own
    sd["view"] = torch.randn(40, 64, generator=g)[:10]  # counted at its storage's size, as the hub does
    paths = safeload.torch.save_checkpoint(sd, tmp_path, max_shard_size="200KB", metadata={"format": "pt"})
    split = split_torch_state_dict_into_shards(sd, max_shard_size="200KB")
    assert [os.path.basename(p) for p in paths] == list(split.filename_to_tensors)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index == {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    for name, keys in split.filename_to_tensors.items():
        shard = {k: sd[k].contiguous() for k in keys}
        st_torch.save_file(shard, tmp_path / "ref.safetensors", metadata={"format": "pt"})
        assert read_bytes(tmp_path / name) == read_bytes(tmp_path / "ref.safetensors")
    os.unlink(tmp_path / "ref.safetensors")
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=tmp_path, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    cli = subprocess.run([sys.executable, "-m", "safeload", "verify", "--manifest", str(tmp_path / "SHA256SUMS"),
                          str(tmp_path)], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    loaded = safeload.torch.load_checkpoint(str(tmp_path), verify=True)
    assert all(torch.equal(loaded[k], sd[k]) for k in sd) and set(loaded) == set(sd)


def test_save_checkpoint_one_shard_and_numpy(tmp_path):
    arrays = {"a": np.arange(1000, dtype=np.float64), "b": np.ones((3, 3), np.float16)}
    paths = safeload.numpy.save_checkpoint(arrays, tmp_path)
    assert paths == [str(tmp_path / "model.safetensors")]
    assert sorted(os.listdir(tmp_path)) == ["SHA256SUMS", "model.safetensors"]
    assert read_bytes(paths[0]) == st_numpy.save(arrays)
    # a later save of more shards replaces the single file's checkpoint; one shard again removes the index
    safeload.numpy.save_checkpoint(arrays, tmp_path, max_shard_size=8000)
    assert sorted(os.listdir(tmp_path)) == ["SHA256SUMS", "model-00001-of-00002.safetensors",
                                            "model-00002-of-00002.safetensors", "model.safetensors",
                                            "model.safetensors.index.json"]
    safeload.numpy.save_checkpoint(arrays, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["SHA256SUMS", "model.safetensors"]


def test_save_checkpoint_refuses_names_that_leave_the_directory(tmp_path):
    inside = tmp_path / "ckpt"
    for pattern in ("../escaped{suffix}.safetensors", "/tmp/abs{suffix}.safetensors", "sub/x{suffix}.safetensors"):
        with pytest.raises(SafetensorError, match="not a plain file name"):
            safeload.torch.save_checkpoint({"a": torch.ones(2)}, inside, filename_pattern=pattern)
    assert os.listdir(tmp_path) == ["ckpt"] and os.listdir(inside) == []


def test_save_pretrained_patched_writes_stock_files(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "stock", max_shard_size="100KB")
    monkeypatch.setenv("SAFELOAD_SAVE_MANIFEST", "1")
    with safeload.patched():
        model.save_pretrained(tmp_path / "ours", max_shard_size="100KB")
    stock = sorted(n for n in os.listdir(tmp_path / "stock") if "safetensors" in n)
    ours = sorted(n for n in os.listdir(tmp_path / "ours") if "safetensors" in n)
    assert ours == stock and len(stock) > 2 and stock[-1] == "model.safetensors.index.json"
    for name in stock:
        assert read_bytes(tmp_path / "ours" / name) == read_bytes(tmp_path / "stock" / name), name
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=tmp_path / "ours", capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.count(": OK") == len(stock) - 1, check.stdout
    # and safeload.save_checkpoint writes the same shards from the same state dict
    safeload.torch.save_checkpoint(model.state_dict(), tmp_path / "direct", max_shard_size="100KB",
                                   metadata={"format": "pt"})
    for name in stock[:-1]:
        assert read_bytes(tmp_path / "direct" / name) == read_bytes(tmp_path / "stock" / name), name
    index, ref = (json.loads((tmp_path / d / stock[-1]).read_text()) for d in ("direct", "stock"))
    # transformers adds the model's parameter count, which a state dict does not know
    assert index["weight_map"] == ref["weight_map"] and index["metadata"]["total_size"] == ref["metadata"]["total_size"]


def test_target_that_is_a_directory(tmp_path):
    (tmp_path / "d.safetensors").mkdir()
    with pytest.raises(IsADirectoryError, match=r"target is a directory \(file .*d\.safetensors\)"):
        safeload.torch.save_file({"a": torch.ones(3)}, tmp_path / "d.safetensors")
    assert os.listdir(tmp_path) == ["d.safetensors"] and os.listdir(tmp_path / "d.safetensors") == []


def _root_mount(target, options: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    target.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr!r}")


def test_full_disk_is_a_clear_error_and_keeps_the_earlier_file(tmp_path):
    disk = tmp_path / "small"
    _root_mount(disk, "size=2m")
    try:
        path = disk / "m.safetensors"
        safeload.torch.save_file({"a": torch.arange(100.0)}, path)
        before = read_bytes(path)
        with pytest.raises((SafetensorError, OSError), match=r"No space left on device.*m\.safetensors"):
            safeload.torch.save_file({"a": torch.zeros(1 << 20)}, path)  # 4 MiB into 2
        with pytest.raises((SafetensorError, OSError), match="No space left on device"):
            safeload.torch.save_checkpoint({f"t{i}": torch.zeros(1 << 18) for i in range(4)}, disk,
                                           max_shard_size="1100KB")
        assert read_bytes(path) == before
        assert sorted(os.listdir(disk)) == ["m.safetensors"]
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_read_only_directory(tmp_path):
    disk = tmp_path / "ro"
    _root_mount(disk, "ro,size=1m")
    try:
        with pytest.raises((SafetensorError, OSError), match="Read-only file system"):
            safeload.torch.save_file({"a": torch.ones(2)}, disk / "m.safetensors")
        with pytest.raises((SafetensorError, OSError), match="Read-only file system"):
            safeload.torch.save_checkpoint({"a": torch.ones(2)}, disk)
        assert os.listdir(disk) == []
    finally:
        subprocess.run(["umount", str(disk)], check=False)


# -- a save stopped half-way ---------------------------------------------------------------------

CHILD = textwrap.dedent(r"""
    import os, signal, sys, threading, time
    import torch, safeload._save, safeload.torch
    directory, stop_at, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    g = torch.Generator().manual_seed(seed)
    sd = {f"t{i}": torch.randn(1 << 21, generator=g) for i in range(int(sys.argv[4]))}  # 8 MiB each
    def kill(*_a, **_k):
        os.kill(os.getpid(), signal.SIGKILL)
    if stop_at == "manifest":     # shards renamed into place, SHA256SUMS and index not yet written
        safeload._save.record_digests = kill
    elif stop_at == "index":      # shards and SHA256SUMS written, the index not yet
        real = safeload._save.write_atomic
        safeload._save.write_atomic = lambda p, *a: kill() if p.endswith(".json") else real(p, *a)
    elif stop_at == "writing":  # the third buffer of the shards' bytes: headers and two written
        sys.path.insert(0, sys.argv[5])
        from cpu_sink import CpuSink
        class Killing(CpuSink):
            def copy_fill(self, index, pairs):
                if index == 2:
                    kill()
                super().copy_fill(index, pairs)
        safeload.torch._writer = lambda _: lambda files, fsync, hash: safeload._save.write_staged(
            files, Killing(), fsync=fsync, hash=hash, staging_bytes=4 << 20)
    elif stop_at == "ctrl-c":  # once the writer has made its files (or, by chance, after the save)
        def watch():
            while not any(n.endswith(".tmp") for n in os.listdir(directory)):
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=watch, daemon=True).start()
    try:
        safeload.torch.save_checkpoint(sd, directory, max_shard_size="20MB", fsync=stop_at == "ctrl-c")
    except KeyboardInterrupt:
        print("interrupted", sorted(os.listdir(directory)))
        sys.exit(3)
    print("finished")
""")


def _child(directory, stop_at: str, seed: int, tensors: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, SAFELOAD_WRITE_THREADS="1")
    return subprocess.run([sys.executable, "-c", CHILD, str(directory), stop_at, str(seed), str(tensors),
                           os.path.join(REPO, "tests", "support")],
                          capture_output=True, text=True, env=env, timeout=300)


def _expected(seed: int, tensors: int):
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(1 << 21, generator=g) for i in range(tensors)}


def _loads_as(directory, seed: int, tensors: int) -> bool:
    got = safeload.torch.load_checkpoint(str(directory), verify=True)
    want = _expected(seed, tensors)
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("stop_at", ["writing", "manifest", "index"])
def test_a_killed_save_leaves_the_earlier_checkpoint_loadable(tmp_path, stop_at):
    """The earlier checkpoint has 2 shards (other names than the new 3): whatever point the new
    save is killed at before its index, the earlier one loads, verified, with its own bytes."""
    assert _child(tmp_path, "none", seed=1, tensors=4).stdout.strip() == "finished"
    assert len([n for n in os.listdir(tmp_path) if n.startswith("model-")]) == 2
    killed = _child(tmp_path, stop_at, seed=2, tensors=6)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert _loads_as(tmp_path, seed=1, tensors=4)
    # killed inside the writer, its temporaries are all that is left of the new save
    temporaries = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert len(temporaries) == (3 if stop_at == "writing" else 0), temporaries


def test_same_names_killed_between_renames_and_manifest_is_caught_by_verify(tmp_path):
    """Shards of the same names are replaced when renamed: killed before the new SHA256SUMS, the
    old manifest no longer matches and a verified load says so (never the wrong bytes quietly)."""
    assert _child(tmp_path, "none", seed=1, tensors=6).stdout.strip() == "finished"
    killed = _child(tmp_path, "manifest", seed=2, tensors=6)
    assert killed.returncode == -signal.SIGKILL
    with pytest.raises(SafetensorError, match="SHA-256|sha256|digest"):
        safeload.torch.load_checkpoint(str(tmp_path), verify=True)
    assert _child(tmp_path, "none", seed=2, tensors=6).stdout.strip() == "finished"
    assert _loads_as(tmp_path, seed=2, tensors=6)


def test_ctrl_c_mid_save_removes_the_temporaries(tmp_path):
    assert _child(tmp_path, "none", seed=1, tensors=4).stdout.strip() == "finished"
    before = {n: read_bytes(tmp_path / n) for n in os.listdir(tmp_path)}
    done = _child(tmp_path, "ctrl-c", seed=2, tensors=12)
    assert done.returncode in (0, 3), done.stdout + done.stderr  # 3: KeyboardInterrupt reached the caller
    assert not any(n.endswith(".tmp") for n in os.listdir(tmp_path)), done.stdout
    if done.returncode == 3 and "model-00005-of-00005.safetensors" not in done.stdout:
        # stopped inside the writer: the earlier files as they were
        assert {n: read_bytes(tmp_path / n) for n in os.listdir(tmp_path)} == before
    assert _loads_as(tmp_path, seed=1, tensors=4) or _loads_as(tmp_path, seed=2, tensors=12)


# -- a device's tensors through the staging ring (CpuSink: the device stand-in) ------------------


@pytest.mark.parametrize("defer", [False, True])
def test_staged_save_equals_0_8_and_hashes_what_it_wrote(tmp_path, defer):
    """The ring path (CUDA's: copies into host buffers, each written while the next fills), with
    the plain-memory stand-in; ``defer`` queues each copy until its buffer is waited on, so a
    buffer written before its copy completed would write the previous fill's bytes."""
    from safeload import _save

    sys.path.insert(0, os.path.join(REPO, "tests", "support"))
    from cpu_sink import CpuSink

    tensors = mixed_tensors(7)
    shards = [{k: v for i, (k, v) in enumerate(tensors.items()) if i % 2 == j} for j in range(2)]
    sink = CpuSink(defer=defer)
    paths = [str(tmp_path / f"s{j}.safetensors") for j in range(2)]
    digests = _save.write_staged([(shard, path, {"format": "pt"}) for shard, path in zip(shards, paths)], sink,
                                 fsync=True, hash=True, staging_bytes=1 << 20, slots=2)
    for shard, path, digest in zip(shards, paths, digests):
        assert read_bytes(path) == st_torch.save(shard, metadata={"format": "pt"})
        assert digest == sha256(path)
    assert sink.log.count(("staging", 1 << 20)) == 2  # host memory: the ring
    fills = [e for e in sink.log if e[0] == "fill"]
    assert len(fills) > 20 and {slot for _, _, slot in fills} == {0, 1}
    assert sorted(os.listdir(tmp_path)) == ["s0.safetensors", "s1.safetensors"]


def test_staged_save_that_fails_leaves_nothing(tmp_path):
    from safeload import _save

    sys.path.insert(0, os.path.join(REPO, "tests", "support"))
    from cpu_sink import CpuSink

    class Failing(CpuSink):
        def copy_fill(self, index, pairs):
            if index == 3:
                raise RuntimeError("device lost")
            super().copy_fill(index, pairs)

    path = tmp_path / "m.safetensors"
    path.write_bytes(b"earlier")
    with pytest.raises(RuntimeError, match="device lost"):
        _save.write_staged([({"a": torch.randn(1 << 20)}, str(path), None)], Failing(), fsync=False, hash=True,
                           staging_bytes=1 << 19)
    assert read_bytes(path) == b"earlier" and os.listdir(tmp_path) == ["m.safetensors"]


def test_staged_save_of_a_small_state_dict_takes_a_small_ring(tmp_path):
    from safeload import _save

    sys.path.insert(0, os.path.join(REPO, "tests", "support"))
    from cpu_sink import CpuSink

    sink = CpuSink(defer=True)
    tensors = {"a": torch.arange(10, dtype=torch.float32), "b": torch.ones(3, dtype=torch.int16)}
    _save.write_staged([(tensors, str(tmp_path / "m.safetensors"), None)], sink, fsync=False, hash=False)
    assert read_bytes(tmp_path / "m.safetensors") == st_torch.save(tensors)
    assert [e for e in sink.log if e[0] == "staging"] == [("staging", 46)]  # one buffer, the data's size


def test_staged_writer_refuses_bytes_out_of_order_and_an_unfinished_file(tmp_path):
    from safeload._safeload import Writer

    data = torch.arange(1000, dtype=torch.float32)
    w = Writer([([("a", "float32", [1000], 4000)], str(tmp_path / "a.safetensors"), None)], hash=True)
    (name, start), = w.offsets[0]
    assert name == "a" and start == len(st_torch.save({"a": data})) - 4000
    with pytest.raises(SafetensorError, match="in order"):
        w.write(0, start + 8, data.data_ptr() + 8, 100)
    w.write(0, start, data.data_ptr(), 2000)
    with pytest.raises(SafetensorError, match=r"ended with \d+ of \d+ bytes written"):
        w.finish()  # half the bytes: refused, nothing renamed
    assert os.listdir(tmp_path) == []
