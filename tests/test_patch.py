"""safeload.patch(): safetensors' loaders, and every name imported from them, through safeload."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
import torch

import safetensors
import safetensors.numpy
import safetensors.torch

import safeload
import safeload._open
import safeload.torch

patch_module = sys.modules["safeload.patch"]  # `safeload.patch` is the function

# Held in a dict, never as module globals: patching rewrites module attributes that are these.
ORIG: Dict[str, Any] = {
    "safe_open": safetensors.safe_open,
    "torch.load_file": safetensors.torch.load_file,
    "torch.load": safetensors.torch.load,
    "torch.load_model": safetensors.torch.load_model,
    "numpy.load_file": safetensors.numpy.load_file,
    "torch.save_file": safetensors.torch.save_file,
    "numpy.save_file": safetensors.numpy.save_file,
}
REPO = Path(__file__).resolve().parent.parent


def _current() -> Dict[str, Any]:
    return {
        "safe_open": safetensors.safe_open,
        "torch.load_file": safetensors.torch.load_file,
        "torch.load": safetensors.torch.load,
        "torch.load_model": safetensors.torch.load_model,
        "numpy.load_file": safetensors.numpy.load_file,
        "torch.save_file": safetensors.torch.save_file,
        "numpy.save_file": safetensors.numpy.save_file,
    }


@pytest.fixture(autouse=True)
def _always_unpatch():
    assert not patch_module.is_patched()
    yield
    safeload.unpatch()
    assert all(_current()[k] is ORIG[k] for k in ORIG)


@pytest.fixture
def handle_spy(monkeypatch) -> List[str]:
    """Backends safeload's reader (``safeload._open.Handle``) was asked for, one per file opened,
    after the overrides the reader applies (a forced backend, ``$SAFELOAD_BACKEND``)."""
    calls: List[str] = []
    real = safeload._open.Handle

    def spy(*args: Any, **kwargs: Any) -> Any:
        handle = real(*args, **kwargs)
        calls.append(handle.asked_backend)
        return handle

    monkeypatch.setattr(safeload._open, "Handle", spy)
    return calls


@pytest.fixture
def sample(tmp_path) -> str:
    path = str(tmp_path / "sample.safetensors")
    tensors = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(4, dtype=torch.int64)}
    safetensors.torch.save_file(tensors, path, metadata={"k": "v"})
    return path


def test_patch_replaces_and_unpatch_restores_identity(sample, handle_spy):
    safeload.patch()
    assert patch_module.is_patched()
    for key in ORIG:
        assert _current()[key] is not ORIG[key], key
    assert issubclass(safetensors.safe_open, safeload.safe_open)
    assert safetensors.safe_open is not safeload.safe_open  # a distinct stand-in
    with safetensors.safe_open(sample, "pt") as f:
        assert f.metadata() == {"k": "v"}
        assert torch.equal(f.get_tensor("w"), torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert handle_spy == ["auto"]
    safeload.unpatch()
    assert not patch_module.is_patched()
    for key in ORIG:
        assert _current()[key] is ORIG[key], key
    with safetensors.safe_open(sample, "pt") as f:
        f.get_tensor("w")
    assert handle_spy == ["auto"]  # unpatched: safeload's reader not used
    # (transformers' hf-mount check is there too when an earlier test imported transformers)
    assert {k for k in patch_module.originals() if k.startswith("safetensors")} == {f"safetensors.{k}" for k in ORIG}


def test_patch_is_idempotent():
    safeload.patch()
    first = _current()
    records = len(patch_module._records)
    safeload.patch()
    assert _current() == first and all(_current()[k] is first[k] for k in first)
    assert len(patch_module._records) == records
    safeload.unpatch()
    safeload.unpatch()
    assert safetensors.safe_open is ORIG["safe_open"]
    safeload.patch()  # again after unpatch: the same stand-ins
    assert all(_current()[k] is first[k] for k in first)


def test_names_imported_elsewhere_are_patched_and_restored(monkeypatch):
    consumer = types.ModuleType("consumer_for_test")
    consumer.safe_open = ORIG["safe_open"]
    consumer.load = ORIG["torch.load_file"]  # any name: found by identity
    consumer.np_load = ORIG["numpy.load_file"]
    consumer.other = len
    own = types.ModuleType("safeload._own_for_test")  # safeload's modules are left alone
    own.safe_open = ORIG["safe_open"]
    monkeypatch.setitem(sys.modules, "consumer_for_test", consumer)
    monkeypatch.setitem(sys.modules, "safeload._own_for_test", own)
    safeload.patch()
    assert consumer.safe_open is safetensors.safe_open is not ORIG["safe_open"]
    assert consumer.load is safetensors.torch.load_file
    assert consumer.np_load is safetensors.numpy.load_file
    assert consumer.other is len
    assert own.safe_open is ORIG["safe_open"]
    late = types.ModuleType("late_for_test")  # imported while patched: gets the stand-in
    late.so = safetensors.safe_open
    monkeypatch.setitem(sys.modules, "late_for_test", late)
    safeload.unpatch()
    assert consumer.safe_open is ORIG["safe_open"]
    assert consumer.load is ORIG["torch.load_file"]
    assert consumer.np_load is ORIG["numpy.load_file"]
    assert late.so is ORIG["safe_open"]


def test_unpatch_leaves_later_replacements_alone(monkeypatch):
    consumer = types.ModuleType("consumer2_for_test")
    consumer.safe_open = ORIG["safe_open"]
    monkeypatch.setitem(sys.modules, "consumer2_for_test", consumer)
    safeload.patch()
    mine = object()
    consumer.safe_open = mine
    safeload.unpatch()
    assert consumer.safe_open is mine


def test_backend_default_auto_explicit_kept_forced(sample, handle_spy):
    safeload.patch()
    safetensors.safe_open(sample, "pt").close()
    with safetensors.safe_open(sample, "pt", backend="mmap") as f:
        assert f.backend == "mmap"
    safetensors.safe_open(sample, "np", "cpu", backend="pread").close()
    assert handle_spy == ["auto", "mmap", "pread"]
    handle_spy.clear()
    safeload.patch(backend="pread")  # forced, even over explicit backend= arguments
    with safetensors.safe_open(sample, "pt", backend="mmap") as f:
        assert f.backend == "pread"
    safetensors.torch.load_file(sample, backend="mmap")
    safetensors.numpy.load_file(sample, backend="mmap")
    assert handle_spy == ["pread"] * 3
    with pytest.raises(ValueError):
        safeload.patch(backend="bogus")


def test_loaders_through_safeload(sample, handle_spy):
    want_pt = ORIG["torch.load_file"](sample)
    want_np = ORIG["numpy.load_file"](sample)
    data = Path(sample).read_bytes()
    safeload.patch()
    got = safetensors.torch.load_file(sample)
    assert got.keys() == want_pt.keys() and all(torch.equal(got[k], want_pt[k]) for k in got)
    got_np = safetensors.numpy.load_file(sample)
    assert all(np.array_equal(got_np[k], want_np[k]) for k in want_np)
    got_b = safetensors.torch.load(data)
    assert all(torch.equal(got_b[k], want_pt[k]) for k in want_pt)
    model = torch.nn.Linear(4, 3)
    safetensors.torch.save_model(model, sample)
    fresh = torch.nn.Linear(4, 3)
    assert safetensors.torch.load_model(fresh, sample) == (set(), [])
    assert torch.equal(fresh.weight, model.weight)
    assert handle_spy == ["auto", "auto"]  # load_file (pt, np); load_model reads through a Checkpoint
    assert safetensors.torch.load_file.__name__ == "load_file"
    assert safetensors.torch.load_file.__doc__ == safeload.torch.load_file.__doc__


def test_patched_context_manager(sample):
    with safeload.patched():
        assert safetensors.safe_open is not ORIG["safe_open"]
        with safeload.patched(backend="pread"):
            with safetensors.safe_open(sample, "pt", backend="mmap") as f:
                assert f.backend == "pread"
        assert patch_module.is_patched()  # the outer block still holds
        with safetensors.safe_open(sample, "pt", backend="mmap") as f:
            assert f.backend == "mmap"
    assert safetensors.safe_open is ORIG["safe_open"]
    with pytest.raises(RuntimeError):
        with safeload.patched():
            raise RuntimeError
    assert safetensors.safe_open is ORIG["safe_open"]


def test_shipped_pth_is_the_hook_line():
    shipped = (REPO / "python" / patch_module.PTH_NAME).read_text().strip()
    assert shipped == patch_module.PTH_LINE
    from safeload import cli

    assert cli.PTH_NAME == patch_module.PTH_NAME


# -- SAFELOAD_PATCH at interpreter start --------------------------------------------------------


def _run(fresh_env: Dict[str, Any], code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([fresh_env["python"], "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**fresh_env["env"], **env}, cwd=fresh_env["site"], timeout=120)


def test_from_pretrained_verifies_under_safeload_verify(fresh_env, tiny_bert, tmp_path):
    """SAFELOAD_PATCH=1 SAFELOAD_VERIFY=strict at interpreter start: transformers' own
    from_pretrained, unmodified, loads a model whose file matches its SHA256SUMS (logged), and
    refuses one whose file changed by one byte."""
    import hashlib
    import shutil

    _, saved, _ = tiny_bert
    path = tmp_path / "bert"
    shutil.copytree(saved, path)
    files = sorted(path.glob("*.safetensors"))
    sums = "".join(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}\n" for f in files)
    (path / "SHA256SUMS").write_text(sums)
    code = f"""
        import logging, transformers
        logging.basicConfig(level=logging.WARNING)
        logging.getLogger("safeload").setLevel(logging.INFO)
        m = transformers.BertModel.from_pretrained({str(path)!r})
        print("loaded", len(m.state_dict()))
    """
    env = {"SAFELOAD_PATCH": "1", "SAFELOAD_VERIFY": "strict", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    r = _run(fresh_env, code, **env)
    assert r.returncode == 0 and "loaded" in r.stdout, r.stderr[-3000:]
    assert f"verified {files[0]}: SHA-256 matches {path / 'SHA256SUMS'}" in r.stderr, r.stderr[-3000:]
    with open(files[0], "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    r = _run(fresh_env, code, **env)
    assert r.returncode != 0 and "SHA-256 mismatch" in r.stderr, (r.stdout, r.stderr[-3000:])


def test_env_unset_costs_nothing(fresh_env):
    r = _run(fresh_env, """
        import sys
        assert "safeload" not in sys.modules, "the hook imported safeload"
        import safetensors
        assert not safetensors.safe_open.__module__.startswith("safeload"), safetensors.safe_open
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok" and r.stderr == "", r.stderr
    r = _run(fresh_env, "import sys; assert 'safeload' not in sys.modules", SAFELOAD_PATCH="0")
    assert r.returncode == 0, r.stderr


def test_env_patches_at_start(fresh_env, sample):
    r = _run(fresh_env, f"""
        import sys
        assert "safeload.patch" in sys.modules
        import safetensors, safeload
        assert sys.modules["safeload.patch"].is_patched()
        assert issubclass(safetensors.safe_open, safeload.safe_open)
        assert safetensors.safe_open.__module__ == "safeload.patch"
        import safetensors.torch  # imported after the patch: patched as it loads
        assert safetensors.torch.load_file.__module__ == "safeload.torch"
        assert list(safetensors.torch.load_file({sample!r})) == ["b", "w"]
        from safetensors.torch import load_file  # a name taken while patched ...
        assert load_file.__module__ == "safeload.torch"
        safeload.unpatch()
        assert load_file is safetensors.torch.load_file  # ... is restored too
        assert load_file.__module__ == "safetensors.torch"
        print("ok")
    """, SAFELOAD_PATCH="1")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_imports_while_patched_leave_no_original_behind(fresh_env):
    """A module imported while patched is patched where only it and what it imported can hold its
    objects; no module is left holding an original (transformers imports safetensors.torch, and
    modeling_utils defines the hf-mount check, inside from_pretrained)."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    r = _run(fresh_env, """
        import sys
        import transformers.modeling_utils, safetensors.torch, safetensors.numpy
        originals = sys.modules["safeload.patch"].originals()
        want = {"safe_open", "torch.load_file", "torch.save_file", "numpy.load_file"}
        assert {f"safetensors.{k}" for k in want} <= set(originals), sorted(originals)
        assert "transformers.modeling_utils._is_on_hf_mount" in originals, sorted(originals)
        held = [(n, k) for n, m in list(sys.modules.items()) if m is not None and not n.startswith("safeload")
                for k, v in list(getattr(m, "__dict__", {}).items())
                if any(v is o for o in originals.values())]
        assert held == [], held
        print("ok")
    """, SAFELOAD_PATCH="1", HF_HUB_OFFLINE="1")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_env_backend_value_forces_it(fresh_env, sample):
    code = f"""
        import safetensors
        with safetensors.safe_open({sample!r}, "np", backend="mmap") as f:
            print(f.backend)
    """
    r = _run(fresh_env, code, SAFELOAD_PATCH="pread")
    assert r.returncode == 0 and r.stdout.strip() == "pread", r.stderr
    r = _run(fresh_env, "import sys; assert 'safeload' in sys.modules and "
                        "not sys.modules['safeload.patch'].is_patched()", SAFELOAD_PATCH="maybe")
    assert r.returncode == 0 and "ignoring SAFELOAD_PATCH='maybe'" in r.stderr, r.stderr


# -- transformers -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    import transformers.modeling_utils  # noqa: F401

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=37)
    model = transformers.BertModel(config)
    path = tmp_path_factory.mktemp("bert")
    model.save_pretrained(str(path))
    assert list(path.glob("*.safetensors")), "save_pretrained wrote no safetensors file"
    return transformers, str(path), {k: v.clone() for k, v in model.state_dict().items()}


def _mu_names(mu: types.ModuleType) -> Dict[str, Any]:
    """modeling_utils' names bound to the patched objects (transformers 5: safe_open and
    ``load as _safe_load_bytes``; older: also ``load_file as safe_load_file``)."""
    return {n: v for n, v in vars(mu).items() if any(v is o for o in ORIG.values())}


def _same_weights(plain: Any, patched: Any, saved: Dict[str, Any]) -> None:
    """The model loaded through safeload has the stock load's weights, and the saved ones."""
    a, b = plain.state_dict(), patched.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
        if k in saved:
            assert torch.equal(b[k], saved[k]), k


def test_transformers_from_pretrained(tiny_bert, handle_spy):
    transformers, path, saved = tiny_bert
    mu = sys.modules["transformers.modeling_utils"]
    imported = _mu_names(mu)
    assert "safe_open" in imported

    plain = transformers.BertModel.from_pretrained(path)
    assert handle_spy == []  # unpatched: safetensors' reader, not safeload's

    safeload.patch()
    assert mu.safe_open is safetensors.safe_open is not ORIG["safe_open"]
    for name, original in imported.items():
        assert getattr(mu, name) is not original, name
    patched = transformers.BertModel.from_pretrained(path)
    assert handle_spy, "from_pretrained did not go through safeload"
    assert set(handle_spy) <= {"mmap", "auto"}  # transformers passes backend="mmap" itself
    safeload.unpatch()

    for name, original in imported.items():
        assert getattr(mu, name) is original, name
    assert mu.safe_open is ORIG["safe_open"]
    _same_weights(plain, patched, saved)


def test_transformers_forced_backend(tiny_bert, handle_spy):
    transformers, path, saved = tiny_bert
    with safeload.patched(backend="pread"):
        model = transformers.BertModel.from_pretrained(path)
    assert handle_spy and set(handle_spy) == {"pread"}
    for k, v in model.state_dict().items():
        if k in saved:
            assert torch.equal(v, saved[k]), k


def test_transformers_hf_mount_goes_through_safeload(tiny_bert, handle_spy, tmp_path):
    """On a FUSE mount named hf-mount transformers skips safe_open and reads each shard with one
    ``read()``; patched, its mount check says no (safeload never maps network mounts) and the
    shards go through safeload's reader; unpatch() restores the check."""
    sys.path.insert(0, str(REPO / "tests" / "support"))
    import slowfs

    if slowfs.fuse_unavailable():
        pytest.skip(slowfs.fuse_unavailable())
    transformers, path, saved = tiny_bert
    mu = sys.modules["transformers.modeling_utils"]
    check = mu._is_on_hf_mount
    with slowfs.mounted(path, str(tmp_path / "mnt"), "--fsname", "hf-mount", "--latency", "0.0005") as m:
        shard = os.path.join(m, "model.safetensors")
        assert check(shard), "transformers does not take the slowfs mount for hf-mount"
        plain = transformers.BertModel.from_pretrained(m)
        assert handle_spy == []

        safeload.patch()
        assert mu._is_on_hf_mount is not check and not mu._is_on_hf_mount(shard)
        patched = transformers.BertModel.from_pretrained(m)
        assert handle_spy, "the hf-mount shard did not go through safe_open"
        with safeload.safe_open(shard, "pt", backend="mmap") as f:
            assert f.backend in ("direct", "pread")  # what transformers' "mmap" gets there
        safeload.unpatch()

        assert mu._is_on_hf_mount is check and check(shard)
    _same_weights(plain, patched, saved)
