"""safeload's safe_open against safetensors 0.8's on the same files: same tensors, keys,
metadata, and the same errors for the same mistakes."""

from __future__ import annotations

import json
import os
import pathlib

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
    ML_DTYPES_CODES,
    NUMPY_CODES,
    TORCH_DTYPES,
    assert_tensor_equal,
    catch,
    make_tensor,
    parse_file,
    raw_bytes,
    read_all_ref,
    write_raw,
)

SHAPES = [(), (0,), (3, 0, 2), (7,), (3, 4), (2, 3, 4), (2, 1, 3, 2), (1, 2, 3, 2, 2)]


def header_of(path):
    return parse_file(pathlib.Path(path).read_bytes())[0]


def assert_offset_order(got, ref, path):
    """``got`` lists the file's tensors by data offset. Zero-size tensors share an offset with
    their neighbour and 0.8 orders such ties at random, so ties are compared as sets."""
    header = header_of(path)
    header.pop("__metadata__", None)
    assert sorted(got) == sorted(header)
    starts = [header[k]["data_offsets"][0] for k in got]
    assert starts == sorted(starts), "offset_keys not in offset order"

    def groups(keys):
        out = {}
        for k in keys:
            out.setdefault(header[k]["data_offsets"][0], set()).add(k)
        return out

    assert groups(got) == groups(ref)


def all_dtype_tensors():
    tensors = {}
    seed = 0
    for code in TORCH_DTYPES:
        for shape in SHAPES:
            if code == "F4" and shape == ():
                continue  # a lone 4-bit value is not a whole byte: the format has no F4 scalar
            seed += 1
            tensors[f"{code}.{'x'.join(map(str, shape)) or 'scalar'}"] = make_tensor(code, shape, seed)
    return tensors


METADATA = {"absent": None, "empty": {}, "present": {"format": "pt", "b": "2", "a": "1"}}


@pytest.fixture(scope="module")
def dtype_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("dtypes")
    tensors = all_dtype_tensors()
    paths = {}
    for label, md in METADATA.items():
        p = d / f"all_{label}.safetensors"
        st_torch.save_file(tensors, str(p), metadata=md)
        paths[label] = str(p)
    return tensors, paths


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("meta", list(METADATA))
def test_all_dtypes_match_reference(dtype_files, backend, meta):
    tensors, paths = dtype_files
    path = paths[meta]
    with safetensors.safe_open(path, "pt") as ref, safeload.safe_open(path, "pt", backend=backend) as f:
        assert f.keys() == ref.keys()
        assert f.keys() == sorted(f.keys())
        assert_offset_order(f.offset_keys(), ref.offset_keys(), path)
        assert f.metadata() == ref.metadata()
        for name in ref.keys():
            expected = ref.get_tensor(name)
            got = f.get_tensor(name)
            assert_tensor_equal(got, expected, name)
            assert_tensor_equal(got, tensors[name], name)
            s, rs = f.get_slice(name), ref.get_slice(name)
            assert s.get_shape() == rs.get_shape(), name
            assert s.get_dtype() == rs.get_dtype(), name
        all_ref = ref.get_tensors()
        all_got = f.get_tensors()
        assert list(all_got) == f.offset_keys()
        assert_offset_order(list(all_ref), ref.offset_keys(), path)
        for name in all_ref:
            assert_tensor_equal(all_got[name], all_ref[name], name)


def test_metadata_values(dtype_files):
    _, paths = dtype_files
    with safeload.safe_open(paths["absent"], "pt") as f:
        assert f.metadata() is None
    with safeload.safe_open(paths["empty"], "pt") as f:
        assert f.metadata() == {}
    with safeload.safe_open(paths["present"], "pt") as f:
        assert f.metadata() == METADATA["present"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_f4_is_packed_pairs(tmp_path, backend):
    t = make_tensor("F4", (3, 4), seed=5)
    path = str(tmp_path / "f4.safetensors")
    st_torch.save_file({"w": t}, path)
    with open(path, "rb") as fh:
        header, _ = parse_file(fh.read())
    assert header["w"]["shape"] == [3, 8]  # the file counts 4-bit values
    with safeload.safe_open(path, "pt", backend=backend) as f:
        assert f.get_slice("w").get_shape() == [3, 8]
        assert f.get_slice("w").get_dtype() == "F4"
        got = f.get_tensor("w")
    assert got.dtype == torch.float4_e2m1fn_x2
    assert tuple(got.shape) == (3, 4)
    assert raw_bytes(got) == raw_bytes(t)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("code", ["F6_E2M3", "F6_E3M2"])
def test_f6_parses_but_has_no_torch_dtype(tmp_path, backend, code):
    # 4 six-bit values = 3 bytes
    header = {code: {"dtype": code, "shape": [2, 4], "data_offsets": [0, 6]}}
    path = write_raw(tmp_path / "f6.safetensors", header, bytes(range(6)))
    with safeload.safe_open(path, "pt", backend=backend) as f:
        assert f.keys() == [code]
        assert f.get_slice(code).get_dtype() == code
        assert f.get_slice(code).get_shape() == [2, 4]
        with pytest.raises(SafetensorError, match="no dtype"):
            f.get_tensor(code)


@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_framework_matches_reference(dtype_files, backend):
    tensors, _ = dtype_files
    arrays = {k: v for k, v in tensors.items() if k.split(".")[0] in NUMPY_CODES}
    np_arrays = {k: v.numpy() for k, v in arrays.items()}
    # write with 0.8's numpy writer as well, to exercise that path
    path = os.path.join(os.path.dirname(dtype_files[1]["absent"]), f"np_{backend}.safetensors")
    st_numpy.save_file(np_arrays, path, metadata={"k": "v"})
    with safetensors.safe_open(path, "np") as ref, safeload.safe_open(path, "np", backend=backend) as f:
        assert f.keys() == ref.keys()
        assert_offset_order(f.offset_keys(), ref.offset_keys(), path)
        assert f.metadata() == ref.metadata()
        for name in ref.keys():
            got = f.get_tensor(name)
            assert isinstance(got, np.ndarray)
            assert_tensor_equal(got, ref.get_tensor(name), name)
            assert_tensor_equal(got, np_arrays[name], name)
    ref_all = st_numpy.load_file(path)
    got_all = safeload.numpy.load_file(path, backend=backend)
    assert sorted(got_all) == sorted(ref_all)
    for k in ref_all:
        assert_tensor_equal(got_all[k], ref_all[k], k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_ml_dtypes_equal_torch_bytes(dtype_files, backend):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    names = {
        "BF16": ml_dtypes.bfloat16,
        "F8_E4M3": ml_dtypes.float8_e4m3fn,
        "F8_E5M2": ml_dtypes.float8_e5m2,
        "F8_E4M3FNUZ": ml_dtypes.float8_e4m3fnuz,
        "F8_E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
        "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    }
    assert set(names) == set(ML_DTYPES_CODES)
    tensors, paths = dtype_files
    with safeload.safe_open(paths["absent"], "np", backend=backend) as f:
        for name, t in tensors.items():
            code = name.split(".")[0]
            if code not in names:
                continue
            got = f.get_tensor(name)
            assert got.dtype == np.dtype(names[code]), name
            assert got.shape == tuple(t.shape), name
            assert got.tobytes() == raw_bytes(t), name


def test_numpy_f4_raises_clean_error(dtype_files):
    _, paths = dtype_files
    with safeload.safe_open(paths["absent"], "np") as f:
        with pytest.raises(SafetensorError):
            f.get_tensor("F4.3x4")


@pytest.fixture(scope="module")
def many_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("many")
    codes = list(TORCH_DTYPES)
    tensors = {}
    for i in range(3000):
        code = codes[i % len(codes)]
        shape = [(), (2,), (1, 3), (0,), (2, 2)][i % 5]
        if code == "F4" and shape == ():
            shape = (1,)
        tensors[f"layer.{i}.w"] = make_tensor(code, shape, seed=i)
    path = str(d / "many.safetensors")
    st_torch.save_file(tensors, path, metadata={"n": "3000"})
    return tensors, path


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_small_tensors(many_file, backend):
    tensors, path = many_file
    ref = read_all_ref(path)
    with safetensors.safe_open(path, "pt") as r:
        ref_offset = r.offset_keys()
    with safeload.safe_open(path, "pt", backend=backend) as f:
        assert f.keys() == sorted(ref)
        assert_offset_order(f.offset_keys(), ref_offset, path)
        assert f.metadata() == {"n": "3000"}
        got = f.get_tensors()
        assert list(got) == f.offset_keys()
        for k in ref:
            assert_tensor_equal(got[k], ref[k], k)
        # spot check single reads too
        for k in f.offset_keys()[::97]:
            assert_tensor_equal(f.get_tensor(k), tensors[k], k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_import_many_splits_what_torch_imports_from_what_it_cannot(dtype_files, backend):
    """get_tensors' torch path: the core imports each tensor's DLPack capsule itself
    (``import_many``), for the dtypes a probe found torch's import makes exactly; an empty tensor
    or another dtype (F4 always, fp8 / unsigned where this torch lacks them) comes back as
    (code, shape, bytes) for ``to_torch``, in its place in file order. A prefetch loader's takes
    make theirs the same way."""
    from safeload._frameworks import _capsule_importer, _dlpack_codes
    from safeload._safeload import Bytes, Importer

    tensors, paths = dtype_files
    codes = _dlpack_codes(torch)
    assert {"F32", "F16", "BF16", "I64", "BOOL"} <= codes and "F4" not in codes
    zeros = Bytes.zeroed(24)
    assert len(zeros) == 24 and bytes(zeros) == bytes(24)
    with pytest.raises(ValueError, match="unknown dtype code F33"):
        Importer(_capsule_importer(torch), ["F32", "F33"])
    importer, nothing = Importer(_capsule_importer(torch), sorted(codes)), Importer(_capsule_importer(torch), [])
    with safeload.safe_open(paths["present"], "pt", backend=backend) as f:
        items = f._handle.read_many()
        out, rest = f._handle.import_many(importer)
        untouched, everything = f._handle.import_many(nothing)
        in_file_order = f.offset_keys()
        with f.prefetch() as loader:
            taken = {name: loader.take(name) for name in reversed(loader.names())}
    names = [n for n, *_ in items]
    assert names == in_file_order == list(out) == list(untouched) == everything
    assert rest == [n for n, code, _, data in items if code not in codes or not len(data)]
    assert any(n.startswith("F4.") for n in rest) and any(n.startswith("F32.") for n in names if n not in rest)
    for name, code, shape, data in items:
        if name in rest:
            assert out[name][:2] == (code, shape) and out[name][2] == data, name
        else:
            assert_tensor_equal(out[name], tensors[name], name)
        assert untouched[name][:2] == (code, shape) and untouched[name][2] == data, name
        assert_tensor_equal(taken[name], tensors[name], name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_file_matches_reference(dtype_files, backend):
    _, paths = dtype_files
    ref = st_torch.load_file(paths["present"])
    got = safeload.torch.load_file(paths["present"], backend=backend)
    assert_offset_order(list(got), list(ref), paths["present"])
    for k in ref:
        assert_tensor_equal(got[k], ref[k], k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pathlike_filename(dtype_files, backend):
    _, paths = dtype_files
    p = pathlib.Path(paths["absent"])
    with safetensors.safe_open(p, "pt") as ref, safeload.safe_open(p, "pt", backend=backend) as f:
        assert f.keys() == ref.keys()


# -- errors -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("small") / "small.safetensors")
    st_torch.save_file({"a": torch.arange(50.0).reshape(10, 5), "b": torch.zeros(3, dtype=torch.int8)}, path)
    return path


def _both(fn_ref, fn_sl):
    ref = catch(fn_ref)
    got = catch(fn_sl)
    return ref, got


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_tensor_error(small_file, backend):
    with safetensors.safe_open(small_file, "pt") as r, safeload.safe_open(small_file, "pt", backend=backend) as f:
        ref, got = _both(lambda: r.get_tensor("X"), lambda: f.get_tensor("X"))
        assert ref == ("SafetensorError", "File does not contain tensor X")
        assert got == ref
        ref, got = _both(lambda: r.get_slice("X"), lambda: f.get_slice("X"))
        assert got == ref
        with pytest.raises(SafetensorError, match="File does not contain tensor X"):
            f.get_tensor("X")


@pytest.mark.parametrize("backend", BACKENDS)
def test_file_not_found_error(tmp_path, backend):
    missing = str(tmp_path / "nope.safetensors")
    ref, got = _both(lambda: safetensors.safe_open(missing, "pt"),
                     lambda: safeload.safe_open(missing, "pt", backend=backend))
    assert ref == ("FileNotFoundError", f"No such file or directory: {missing}")
    assert got == ref
    with pytest.raises(FileNotFoundError):
        safeload.safe_open(missing, "pt", backend=backend)
    with pytest.raises(FileNotFoundError):
        safeload.torch.load_file(missing, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("framework", ["xx", "", "PT", "torchh"])
def test_invalid_framework_error(small_file, backend, framework):
    ref, got = _both(lambda: safetensors.safe_open(small_file, framework),
                     lambda: safeload.safe_open(small_file, framework, backend=backend))
    assert ref[0] == "SafetensorError"
    assert got == ref
    assert got[1] == f"framework {framework} is invalid"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("device", ["foo", "cpu:0", "meta", -1, "mps:1", "mps:2", "gpu", "cuda0"])
def test_invalid_device_same_as_reference(small_file, backend, device):
    ref, got = _both(lambda: safetensors.safe_open(small_file, "pt", device=device),
                     lambda: safeload.safe_open(small_file, "pt", device=device, backend=backend))
    assert ref[0] == "SafetensorError", ref
    assert got == ref


def test_mps_index_message(small_file):
    with pytest.raises(SafetensorError) as e:
        safeload.safe_open(small_file, "pt", device="mps:1")
    assert str(e.value) == "device mps:1 is invalid: only mps or mps:0 is supported"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("device", ["cuda:x", "cuda:", "cuda:-1", "cuda:1a", "npu:x", "xpu:x"])
def test_invalid_device_index_is_safetensor_error(small_file, backend, device):
    # 0.8 lets a Rust integer-parse ValueError escape here; safeload names the device instead.
    with pytest.raises(SafetensorError) as e:
        safeload.safe_open(small_file, "pt", device=device, backend=backend)
    assert str(e.value) == f"device {device} is invalid"


@pytest.mark.parametrize("backend", BACKENDS)
def test_closed_file_errors(small_file, backend):
    with safetensors.safe_open(small_file, "pt") as r:
        pass
    with safeload.safe_open(small_file, "pt", backend=backend) as f:
        pass
    for call in (lambda h: h.keys(), lambda h: h.offset_keys(), lambda h: h.metadata(),
                 lambda h: h.get_tensor("a"), lambda h: h.get_slice("a"), lambda h: h.get_tensors()):
        ref, got = catch(call, r), catch(call, f)
        assert ref == ("SafetensorError", "File is closed")
        assert got == ref


@pytest.mark.parametrize("backend", BACKENDS)
def test_slice_taken_before_close_still_reads(small_file, backend):
    """0.8's slice object keeps the file alive: indexing it after the ``with`` block works."""
    with safetensors.safe_open(small_file, "pt") as r:
        rs = r.get_slice("a")
    with safeload.safe_open(small_file, "pt", backend=backend) as f:
        s = f.get_slice("a")
    ref = rs[1:3]
    got = s[1:3]
    assert_tensor_equal(got, ref)


@pytest.mark.parametrize("backend", ["xyz", "MMAP", "", "io_uring"])
def test_invalid_backend(small_file, backend):
    with pytest.raises(SafetensorError) as e:
        safeload.safe_open(small_file, "pt", backend=backend)
    msg = str(e.value)
    assert msg.startswith(f'backend "{backend}" is invalid (expected one of: '), msg
    for known in ('"auto"', '"mmap"', '"pread"'):
        assert known in msg, msg


# -- memory ownership -----------------------------------------------------------------------


def _elem_size(t):
    return t.dtype.itemsize


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensors_own_distinct_storage_and_alignment(dtype_files, backend):
    _, paths = dtype_files
    with safeload.safe_open(paths["present"], "pt", backend=backend) as f:
        singles = {k: f.get_tensor(k) for k in f.keys()}
        many = f.get_tensors()
    for group in (singles, many):
        ptrs = {}
        for name, t in group.items():
            if t.numel() == 0:
                continue
            p = t.untyped_storage().data_ptr()
            assert p not in ptrs, f"{name} shares storage with {ptrs.get(p)}"
            ptrs[p] = name
            assert t.data_ptr() % _elem_size(t) == 0, f"{name} misaligned: {t.data_ptr():#x}"
            if backend == "pread":
                assert t.data_ptr() % 64 == 0, f"{name} not 64-byte aligned: {t.data_ptr():#x}"
    # a tensor read twice gets two storages, except from a map ("mmap", and "auto" on a local
    # file): 0.8's default hands the same storage back for a name read twice; safeload's too
    with safeload.safe_open(paths["present"], "pt", backend=backend) as f:
        if f.backend == "mmap":
            return
        a, b = f.get_tensor("F32.3x4"), f.get_tensor("F32.3x4")
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    before = raw_bytes(b)
    a.fill_(1.0)
    assert raw_bytes(b) == before


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensors_valid_and_writable_after_close(tmp_path, backend):
    src = {"a": torch.arange(24, dtype=torch.float32).reshape(4, 6), "b": torch.arange(10, dtype=torch.int64)}
    path = str(tmp_path / "w.safetensors")
    st_torch.save_file(src, path)
    before = pathlib.Path(path).read_bytes()
    with safeload.safe_open(path, "pt", backend=backend) as f:
        a = f.get_tensor("a")
        allt = f.get_tensors()
        sl = f.get_slice("a")[1:3]
        mapped = f.backend == "mmap"  # "auto" maps local files, as 0.8's default does
    import gc

    gc.collect()
    assert torch.equal(a, src["a"])
    assert torch.equal(allt["b"], src["b"])
    assert torch.equal(sl, src["a"][1:3])
    a.add_(1)
    allt["b"].mul_(2)
    sl.zero_()
    expect = src["a"] + 1
    if mapped:  # a slice of a map is a view of the tensor's pages, as 0.8's (checked below)
        expect[1:3] = 0
    assert torch.equal(a, expect)
    assert torch.equal(allt["b"], src["b"] * 2)
    if not mapped:  # a map, as 0.8's, may share a name's storage between reads
        assert torch.equal(allt["a"], src["a"])  # a separate copy, untouched
    assert pathlib.Path(path).read_bytes() == before  # writes never reach the file
    # numpy arrays are writable too
    with safeload.safe_open(path, "np", backend=backend) as f:
        arr = f.get_tensor("a")
    arr += 1
    assert np.array_equal(arr, src["a"].numpy() + 1)
    assert pathlib.Path(path).read_bytes() == before


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_survives_handle_deletion(small_file, backend):
    f = safeload.safe_open(small_file, "pt", backend=backend)
    t = f.get_tensor("a")
    f.close()
    del f
    import gc

    gc.collect()
    assert torch.equal(t, torch.arange(50.0).reshape(10, 5))


# -- checkpoints --------------------------------------------------------------------------------


@pytest.fixture
def sharded(tmp_path):
    shards = {
        "model-00001-of-00002.safetensors": {"a": make_tensor("F32", (3, 4), 1), "b": make_tensor("BF16", (5,), 2)},
        "model-00002-of-00002.safetensors": {"c": make_tensor("I64", (2, 2), 3), "d": make_tensor("F4", (2, 2), 4),
                                              "e": make_tensor("U8", (0,), 5)},
    }
    weight_map = {}
    for fname, ts in shards.items():
        st_torch.save_file(ts, str(tmp_path / fname))
        for k in ts:
            weight_map[k] = fname
    with open(tmp_path / "model.safetensors.index.json", "w") as fh:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, fh)
    expected = {}
    for ts in shards.values():
        expected.update(ts)
    return tmp_path, list(shards), expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_checkpoint_forms(sharded, backend):
    d, names, expected = sharded
    forms = [
        [str(d / n) for n in names],
        str(d),
        str(d / "model.safetensors.index.json"),
    ]
    for form in forms:
        got = safeload.torch.load_checkpoint(form, backend=backend)
        assert sorted(got) == sorted(expected), form
        for k in expected:
            assert_tensor_equal(got[k], expected[k], k)
    single = safeload.torch.load_checkpoint(str(d / names[0]), backend=backend)
    assert sorted(single) == ["a", "b"]
    ref = st_torch.load_file(str(d / names[0]))
    for k in ref:
        assert_tensor_equal(single[k], ref[k], k)


def test_iter_checkpoint_order_and_progress(sharded):
    d, names, expected = sharded
    calls = []
    got = list(safeload.torch.iter_checkpoint(str(d / "model.safetensors.index.json"), max_inflight_bytes=16,
                                              progress=lambda done, total: calls.append((done, total))))
    order = []
    for n in names:
        with safetensors.safe_open(str(d / n), "pt") as r:
            order.extend(r.offset_keys())
    assert [k for k, _ in got] == order
    for k, t in got:
        assert_tensor_equal(t, expected[k], k)
    total = sum(len(raw_bytes(t)) for t in expected.values())
    assert calls, "progress never called"
    assert calls[-1] == (total, total)
    assert all(c[1] == total for c in calls)
    assert [c[0] for c in calls] == sorted(c[0] for c in calls)
    assert len(calls) > 1  # 16 bytes in flight forces several batches


def test_load_checkpoint_rejects_name_in_two_shards(tmp_path):
    st_torch.save_file({"a": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    st_torch.save_file({"a": torch.ones(2)}, str(tmp_path / "y.safetensors"))
    with pytest.raises(SafetensorError):
        safeload.torch.load_checkpoint([str(tmp_path / "x.safetensors"), str(tmp_path / "y.safetensors")])
