"""Files written by safeload read back by safetensors 0.8 and the other way round; both writers
produce the same bytes; save_model/load_model; atomic save_file; the bytes APIs."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import safetensors
import safetensors.numpy as st_numpy
import safetensors.torch as st_torch

import safeload
import safeload.numpy
import safeload.torch
from safeload import SafetensorError

from conftest import (
    BACKENDS,
    NUMPY_CODES,
    TORCH_DTYPES,
    assert_tensor_equal,
    catch,
    make_tensor,
    parse_file,
    read_all_ref,
)

SHAPES = [(), (0,), (2, 0), (5,), (3, 4), (2, 3, 2), (1, 2, 1, 3), (2, 1, 2, 1, 2)]


def dtype_tensors(codes=None):
    out = {}
    seed = 100
    for code in codes or TORCH_DTYPES:
        for shape in SHAPES:
            if code == "F4" and shape == ():
                continue
            seed += 1
            out[f"{code}/{'x'.join(map(str, shape)) or 'scalar'}"] = make_tensor(code, shape, seed)
    return out


def read_bytes(path):
    with open(path, "rb") as fh:
        return fh.read()


# -- safeload writes, 0.8 reads ---------------------------------------------------------------


@pytest.mark.parametrize("metadata", [None, {}, {"x": "1"}, {"z": "last", "a": "first", "m": "mid"}])
def test_safeload_torch_writes_reference_reads(tmp_path, metadata):
    tensors = dtype_tensors()
    path = str(tmp_path / "sl.safetensors")
    safeload.torch.save_file(tensors, path, metadata=metadata)
    with safetensors.safe_open(path, "pt") as f:
        assert f.metadata() == metadata
        assert sorted(f.keys()) == sorted(tensors)
        for k in f.keys():
            assert_tensor_equal(f.get_tensor(k), tensors[k], k)
    ref = st_torch.load_file(path)
    for k in tensors:
        assert_tensor_equal(ref[k], tensors[k], k)


def test_safeload_numpy_writes_reference_reads(tmp_path):
    arrays = {k: v.numpy() for k, v in dtype_tensors(NUMPY_CODES).items()}
    arrays["big_endian"] = np.arange(6, dtype=">i4").reshape(2, 3)
    arrays["fortran"] = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    arrays["strided"] = np.arange(20, dtype=np.int16)[::3]
    path = str(tmp_path / "sl_np.safetensors")
    safeload.numpy.save_file(arrays, path, metadata={"k": "v"})
    with safetensors.safe_open(path, "np") as f:
        assert f.metadata() == {"k": "v"}
    ref = st_numpy.load_file(path)
    assert sorted(ref) == sorted(arrays)
    for k, a in arrays.items():
        little = np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<")))
        assert ref[k].dtype == little.dtype, k
        assert ref[k].shape == a.shape, k
        assert ref[k].tobytes() == little.tobytes(), k
    # (0.8's own numpy writer dumps a strided/Fortran array's raw memory: not a reference here)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reference_numpy_writes_safeload_reads(tmp_path, backend):
    arrays = {k: v.numpy() for k, v in dtype_tensors(NUMPY_CODES).items()}
    path = str(tmp_path / "ref_np.safetensors")
    st_numpy.save_file(arrays, path)
    got = safeload.numpy.load_file(path, backend=backend)
    assert sorted(got) == sorted(arrays)
    for k, a in arrays.items():
        assert_tensor_equal(got[k], a, k)
    got_pt = safeload.torch.load_file(path, backend=backend)
    for k, a in arrays.items():
        assert_tensor_equal(got_pt[k], torch.from_numpy(a.copy()), k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reference_torch_writes_safeload_reads(tmp_path, backend):
    tensors = dtype_tensors()
    path = str(tmp_path / "ref.safetensors")
    st_torch.save_file(tensors, path, metadata={"a": "b"})
    got = safeload.torch.load_file(path, backend=backend)
    assert sorted(got) == sorted(tensors)
    for k in tensors:
        assert_tensor_equal(got[k], tensors[k], k)


# -- same bytes from both writers --------------------------------------------------------------


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_written_files_are_byte_identical(tmp_path, metadata):
    tensors = dtype_tensors()
    a, b = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    st_torch.save_file(tensors, a, metadata=metadata)
    safeload.torch.save_file(tensors, b, metadata=metadata)
    assert read_bytes(a) == read_bytes(b)
    assert st_torch.save(tensors, metadata=metadata) == safeload.torch.save(tensors, metadata=metadata)


@pytest.mark.parametrize("n", [1, 2, 7, 40])
def test_written_files_byte_identical_various_sizes(tmp_path, n):
    # header padding depends on the header length: vary names and counts
    tensors = {f"t{'_' * i}{i}": make_tensor("F32" if i % 2 else "I8", (i % 4 + 1,), i) for i in range(n)}
    assert st_torch.save(tensors) == safeload.torch.save(tensors)
    assert st_torch.save(tensors, metadata={"k" * n: "v" * (n % 5)}) == safeload.torch.save(
        tensors, metadata={"k" * n: "v" * (n % 5)}
    )


def test_many_metadata_keys_same_header_and_data(tmp_path):
    tensors = dtype_tensors(["F32", "BF16", "U8"])
    metadata = {f"key{i}": f"value{i}" for i in range(20)}
    ref = st_torch.save(tensors, metadata=metadata)
    got = safeload.torch.save(tensors, metadata=metadata)
    (h_ref, d_ref), (h_got, d_got) = parse_file(ref), parse_file(got)
    assert h_got == h_ref
    assert d_got == d_ref
    assert len(got) == len(ref)
    # safeload writes metadata keys sorted
    assert list(h_got["__metadata__"]) == sorted(metadata)


def test_numpy_scalar_keeps_empty_shape(tmp_path):
    arrays = {"s": np.array(2.5, dtype=np.float32), "i": np.array(7, dtype=np.int64)}
    path = str(tmp_path / "s.safetensors")
    safeload.numpy.save_file(arrays, path)
    header, _ = parse_file(read_bytes(path))
    assert header["s"]["shape"] == []
    assert header["i"]["shape"] == []
    got = st_numpy.load_file(path)
    assert got["s"].shape == () and got["s"] == np.float32(2.5)
    assert parse_file(safeload.numpy.save(arrays))[0]["s"]["shape"] == []


def test_numpy_save_bytes_identical():
    arrays = {k: v.numpy() for k, v in dtype_tensors(NUMPY_CODES).items()}
    assert st_numpy.save(arrays) == safeload.numpy.save(arrays)
    assert st_numpy.save(arrays, metadata={"a": "b"}) == safeload.numpy.save(arrays, metadata={"a": "b"})


# -- load()/save() bytes APIs ------------------------------------------------------------------


def test_torch_load_bytes_equal_reference():
    tensors = dtype_tensors()
    data = st_torch.save(tensors, metadata={"a": "b"})
    got = safeload.torch.load(data)
    assert sorted(got) == sorted(tensors)
    for k in tensors:
        assert_tensor_equal(got[k], tensors[k], k)
    # 0.8's load() has no F8_E8M0 / F4 entries (KeyError): compare the others with it
    subset = {k: v for k, v in tensors.items() if k.split("/")[0] not in ("F8_E8M0", "F4")}
    data = st_torch.save(subset)
    ref = st_torch.load(data)
    got = safeload.torch.load(data)
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert_tensor_equal(got[k], ref[k], k)
    # loaded tensors own writable memory
    t = got["F32/3x4"]
    t.zero_()
    assert_tensor_equal(safeload.torch.load(data)["F32/3x4"], tensors["F32/3x4"])


def test_numpy_load_bytes_equal_reference():
    arrays = {k: v.numpy() for k, v in dtype_tensors(NUMPY_CODES).items()}
    data = st_numpy.save(arrays)
    ref = st_numpy.load(data)
    got = safeload.numpy.load(data)
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert_tensor_equal(got[k], ref[k], k)


def test_load_bytes_rejects_malformed():
    with pytest.raises(SafetensorError):
        safeload.torch.load(b"\x01\x00")
    with pytest.raises(SafetensorError):
        safeload.numpy.load(b"\x05\x00\x00\x00\x00\x00\x00\x00{}")


def test_save_errors_match_reference(tmp_path):
    a = torch.zeros(4)
    cases = [
        {"a": torch.zeros(4, 4).t()},  # non contiguous
        {"a": a, "b": a},  # shared
        {"a": a[:2], "b": a[2:]},  # same storage, no overlap: allowed
        {"a": 1},
        {"s": torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.zeros(0), (3,),
                                      check_invariants=True)},
    ]
    for i, tensors in enumerate(cases):
        if i == 2:
            tensors = {"a": a[:2].clone(), "b": a[2:].clone()}
        ref = catch(st_torch.save, tensors)
        got = catch(safeload.torch.save, tensors)
        if ref[0] == "ok":
            assert got == ref
        else:
            assert got[0] == ref[0], (i, ref, got)
            assert got[1].strip() == ref[1].strip(), i
    with pytest.raises(ValueError):
        safeload.torch.save_file({"a": torch.zeros(4, 4).t()}, str(tmp_path / "x.safetensors"))
    assert os.listdir(tmp_path) == []


def test_serialize_api(tmp_path):
    t = torch.arange(6, dtype=torch.int32)
    u = torch.arange(4, dtype=torch.float16)

    def specs(mod):
        return {
            "t": mod.TensorSpec(dtype="int32", shape=[2, 3], data_ptr=t.data_ptr(), data_len=24),
            "u": mod.TensorSpec(dtype="float16", shape=[4], data_ptr=u.data_ptr(), data_len=8),
        }

    ref = safetensors.serialize(specs(safetensors), metadata={"m": "1"})
    got = safeload.serialize(specs(safeload), metadata={"m": "1"})
    assert bytes(got) == bytes(ref)
    rt = safeload.deserialize(bytes(got))
    ref_rt = safetensors.deserialize(bytes(ref))
    # 0.8 returns entries in hash-map order (random per process); safeload in file order.
    assert [n for n, _ in rt] == ["t", "u"]
    assert sorted((n, v["dtype"], list(v["shape"]), bytes(v["data"])) for n, v in rt) == sorted(
        (n, v["dtype"], list(v["shape"]), bytes(v["data"])) for n, v in ref_rt
    )
    p1, p2 = str(tmp_path / "1.safetensors"), str(tmp_path / "2.safetensors")
    safetensors.serialize_file(specs(safetensors), p1)
    safeload.serialize_file(specs(safeload), p2)
    assert read_bytes(p1) == read_bytes(p2)


# -- save_model / load_model with tied weights -------------------------------------------------


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(7, 4)
        self.mid = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight  # tied


def _fresh(seed):
    torch.manual_seed(seed)
    return Tied()


def test_save_model_same_as_reference(tmp_path):
    model = _fresh(0)
    a, b = str(tmp_path / "ref.safetensors"), str(tmp_path / "sl.safetensors")
    st_torch.save_model(model, a)
    safeload.torch.save_model(model, b)
    ha, da = parse_file(read_bytes(a))
    hb, db = parse_file(read_bytes(b))
    assert ha == hb
    assert da == db
    assert read_bytes(a) == read_bytes(b)  # one tied pair: one metadata key
    with safetensors.safe_open(b, "pt") as f:
        assert len(f.keys()) == len(model.state_dict()) - 1
        assert f.metadata() is not None and len(f.metadata()) == 1


@pytest.mark.parametrize("writer", ["ref", "safeload"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_load_model_tied(tmp_path, writer, backend):
    src = _fresh(1)
    path = str(tmp_path / "m.safetensors")
    (st_torch if writer == "ref" else safeload.torch).save_model(src, path)
    m_ref, m_got = _fresh(2), _fresh(2)
    ref = st_torch.load_model(m_ref, path)
    got = safeload.torch.load_model(m_got, path, backend=backend)
    assert sorted(got[0]) == sorted(ref[0])
    assert sorted(got[1]) == sorted(ref[1])
    sd_src, sd_got = src.state_dict(), m_got.state_dict()
    for k in sd_src:
        assert torch.equal(sd_got[k], sd_src[k]), k
    assert m_got.head.weight.data_ptr() == m_got.emb.weight.data_ptr()  # still tied


def test_load_model_strict_errors_match_reference(tmp_path):
    path = str(tmp_path / "partial.safetensors")
    st_torch.save_file({"mid.weight": torch.zeros(4, 4), "extra": torch.zeros(1)}, path)
    ref = catch(st_torch.load_model, _fresh(3), path)
    got = catch(safeload.torch.load_model, _fresh(3), path)
    assert ref[0] == "RuntimeError"
    assert got == ref
    ref = st_torch.load_model(_fresh(3), path, strict=False)
    got = safeload.torch.load_model(_fresh(3), path, strict=False)
    assert sorted(got[0]) == sorted(ref[0])
    assert sorted(got[1]) == sorted(ref[1])


def test_shared_tensor_helpers_match_reference():
    model = _fresh(4)
    sd = model.state_dict()
    base = torch.zeros(10)
    extra = {"x": base, "y": base[:5], "z": base[5:], "w": torch.zeros(3)}
    tied = torch.zeros(6)
    cases = [
        sd,
        extra,  # a view of part of a storage next to the whole: dropped for the whole
        {"a": tied, "b": tied, "c": torch.zeros(2)},  # tied weights
        {"a": tied, "b": tied.view(2, 3), "meta": torch.zeros(3, device="meta"), "empty": torch.zeros(0)},
        {"half": base[:5]},  # no name covers the storage: RuntimeError
        {"lo": base[:5], "hi": base[5:]},  # disjoint views of one storage, neither whole
    ]
    options = [{}, {"preferred_names": ["b"]}, {"discard_names": ["a"]}, {"preferred_names": ["b"], "discard_names": ["b"]}]
    for d in cases:
        assert safeload.torch._find_shared_tensors(d) == st_torch._find_shared_tensors(d)
        for kw in options:
            ref = catch(st_torch._remove_duplicate_names, d, **kw)
            got = catch(safeload.torch._remove_duplicate_names, d, **kw)
            assert got == ref, (d.keys(), kw)
    for t in (base, base[2:], torch.zeros(0)):
        assert safeload.torch.storage_ptr(t) == st_torch.storage_ptr(t)
        assert safeload.torch.storage_size(t) == st_torch.storage_size(t)


# -- atomic save_file --------------------------------------------------------------------------


@pytest.mark.parametrize("module", ["torch", "numpy"])
def test_save_file_leaves_no_temp_files(tmp_path, module):
    d = tmp_path / "out"
    d.mkdir()
    path = d / "model.safetensors"
    if module == "torch":
        tensors = {"a": torch.arange(10.0), "b": torch.ones(3, 3)}
        for _ in range(3):  # overwrite in place
            safeload.torch.save_file(tensors, str(path))
        got = st_torch.load_file(str(path))
    else:
        tensors = {"a": np.arange(10.0), "b": np.ones((3, 3))}
        for _ in range(3):
            safeload.numpy.save_file(tensors, str(path))
        got = st_numpy.load_file(str(path))
    assert os.listdir(d) == ["model.safetensors"]
    assert sorted(got) == ["a", "b"]


def test_save_file_replaces_existing_and_keeps_mode(tmp_path):
    path = tmp_path / "m.safetensors"
    safeload.torch.save_file({"a": torch.zeros(3)}, str(path))
    safeload.torch.save_file({"b": torch.ones(2)}, str(path))
    assert list(st_torch.load_file(str(path))) == ["b"]
    assert os.listdir(tmp_path) == ["m.safetensors"]


@pytest.mark.parametrize("module", ["torch", "numpy"])
def test_save_file_into_missing_directory(tmp_path, module):
    target = tmp_path / "missing" / "deeper" / "x.safetensors"
    if module == "torch":
        with pytest.raises((SafetensorError, OSError)):
            safeload.torch.save_file({"a": torch.zeros(2)}, str(target))
    else:
        with pytest.raises((SafetensorError, OSError)):
            safeload.numpy.save_file({"a": np.zeros(2)}, str(target))
    assert os.listdir(tmp_path) == []


def test_failed_save_keeps_previous_file(tmp_path):
    path = tmp_path / "keep.safetensors"
    safeload.torch.save_file({"a": torch.arange(4.0)}, str(path))
    before = read_bytes(path)
    a = torch.zeros(4)
    with pytest.raises(RuntimeError):
        safeload.torch.save_file({"x": a, "y": a}, str(path))  # shared: refused
    with pytest.raises(ValueError):
        safeload.torch.save_file({"x": torch.zeros(3, 3).t()}, str(path))
    assert read_bytes(path) == before
    assert os.listdir(tmp_path) == ["keep.safetensors"]


def test_save_file_fsync_flag(tmp_path):
    path = str(tmp_path / "f.safetensors")
    safeload.torch.save_file({"a": torch.arange(3)}, path, fsync=True)
    assert_tensor_equal(read_all_ref(path)["a"], torch.arange(3))
