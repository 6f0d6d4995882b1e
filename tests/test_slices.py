"""get_slice(name)[key] must equal indexing the full tensor with the same key (torch and numpy).

Where safeload deliberately differs from safetensors 0.8's pread path (negative starts,
start > stop, steps, Ellipsis) the reference is torch / numpy indexing. With framework="pt" every
backend follows torch indexing, as 0.8's default (torch, mmap) does: a slice start or stop past
the end of a dimension is clamped to it, checked against both torch and 0.8's default. With
framework="np" a stop past the end raises with 0.8's message, which 0.8's own tests pin. Ints out
of range and non-empty lists raise under both (for pt the error is also torch's IndexError).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import safetensors
import safetensors.torch as st_torch

import safeload
from safeload import SafetensorError

from conftest import assert_tensor_equal, make_tensor, raw_bytes

SLICE_BACKENDS = ["pread", "mmap", "direct", "auto"]
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """shape -> path of a file holding tensors of that shape (F32 'f', I16 'i', BOOL 'b', BF16 'h')."""
    d = tmp_path_factory.mktemp("slices")
    cache = {}

    def get(shape):
        shape = tuple(shape)
        if shape not in cache:
            n = 1
            for s in shape:
                n *= s
            tensors = {
                "f": torch.arange(n, dtype=torch.float32).reshape(shape),
                "i": (torch.arange(n, dtype=torch.int16) * 7 - 100).reshape(shape),
                "b": (torch.arange(n) % 3 == 0).reshape(shape),
                "h": make_tensor("BF16", shape, seed=n),
            }
            path = d / f"s_{'x'.join(map(str, shape)) or 'scalar'}.safetensors"
            st_torch.save_file(tensors, str(path))
            cache[shape] = (str(path), tensors)
        return cache[shape]

    return get


def _bound(size):
    return st.one_of(st.none(), st.integers(-size - 3, size + 3))


def _stop(size, past_end):
    # numpy: stops past the end raise (0.8's rule, tested separately): stay within [.., size]
    return _bound(size) if past_end else st.one_of(st.none(), st.integers(-size - 3, size))


def dim_index(size, past_end=False):
    slices = st.builds(slice, _bound(size), _stop(size, past_end), st.sampled_from([None, 1, 2, 3]))
    if size == 0:
        return slices
    return st.one_of(st.integers(-size, size - 1), slices)


@st.composite
def shape_and_key(draw, past_end=False):
    shape = draw(st.lists(st.integers(0, 5), min_size=1, max_size=4))
    ndim = len(shape)
    if draw(st.booleans()):
        # leading indices, an Ellipsis for the dims in between, trailing indices
        lead = draw(st.integers(0, ndim))
        trail = draw(st.integers(0, ndim - lead))
        items = [draw(dim_index(shape[i], past_end)) for i in range(lead)]
        items.append(Ellipsis)
        items += [draw(dim_index(shape[i], past_end)) for i in range(ndim - trail, ndim)]
    else:
        k = draw(st.integers(0, ndim))
        items = [draw(dim_index(shape[i], past_end)) for i in range(k)]
    if len(items) == 1 and draw(st.booleans()):
        key = items[0]
    else:
        key = tuple(items)
    name = draw(st.sampled_from(["f", "i", "b", "h"]))
    return tuple(shape), key, name


@pytest.mark.parametrize("backend", SLICE_BACKENDS)
@SETTINGS
@given(case=shape_and_key(past_end=True))
def test_slice_equals_torch_indexing(files, backend, case):
    shape, key, name = case
    path, tensors = files(shape)
    expected = tensors[name][key]
    with safeload.safe_open(path, "pt", backend=backend) as f:
        got = f.get_slice(name)[key]
    assert_tensor_equal(got, expected.contiguous(), f"{shape} {name} [{key!r}]")


@pytest.mark.parametrize("backend", SLICE_BACKENDS)
@SETTINGS
@given(case=shape_and_key(past_end=True))
def test_slice_equals_safetensors_default(files, backend, case):
    """framework="pt": the same result as 0.8's default (mmap), starts and stops past the end included."""
    shape, key, name = case
    path, _ = files(shape)
    with safetensors.safe_open(path, "pt") as f:
        expected = f.get_slice(name)[key].contiguous()
    with safeload.safe_open(path, "pt", backend=backend) as f:
        got = f.get_slice(name)[key]
    assert_tensor_equal(got, expected, f"{shape} {name} [{key!r}]")


@pytest.mark.parametrize("backend", SLICE_BACKENDS)
@SETTINGS
@given(case=shape_and_key())
def test_slice_equals_numpy_indexing(files, backend, case):
    shape, key, name = case
    if name == "h":
        name = "f"  # plain numpy has no bfloat16 to index the reference with
    path, tensors = files(shape)
    full = tensors[name].numpy()
    expected = np.array(full[key])  # np.array keeps 0-d results 0-d
    with safeload.safe_open(path, "np", backend=backend) as f:
        got = f.get_slice(name)[key]
    assert isinstance(got, np.ndarray)
    assert_tensor_equal(np.asarray(got), np.asarray(expected), f"{shape} {name} [{key!r}]")


# -- hand-picked cases of the deliberate differences from 0.8 ---------------------------------

A = torch.arange(50, dtype=torch.float32).reshape(10, 5)

KEYS = [
    slice(-3, None),
    slice(-20, None),
    slice(None, -2),
    slice(-4, -1),
    slice(-1, -10),
    slice(5, 2),
    slice(10, 10),
    slice(10, None),
    slice(12, 5),
    slice(None, None, 2),
    slice(1, None, 3),
    slice(-7, 9, 2),
    (slice(None, None, 3), slice(None, None, 2)),
    (slice(None), slice(1, 4, 2)),
    (Ellipsis, 1),
    (1, Ellipsis),
    (Ellipsis, slice(None, None, 2)),
    Ellipsis,
    (Ellipsis,),
    (Ellipsis, 2, 3),
    (2, Ellipsis, 3),
    (),
    -1,
    (-10, -5),
    (slice(None), -1),
    [],
]

# A stop past the end of a dimension (A is 10 x 5): torch clamps, numpy keeps 0.8's error.
PAST_END_KEYS = [
    slice(None, 20),
    slice(0, 11),
    slice(5, 11),
    slice(3, 100, 2),
    slice(None, 100, 3),
    slice(8, 30, 4),
    slice(20, 30),
    slice(-20, 20),
    slice(-3, 1 << 40),
    (slice(None), slice(2, 50)),
    (slice(1, 3), slice(None, 9, 2)),
    (Ellipsis, slice(4, 6)),
    (slice(9, 15), Ellipsis),
    (slice(None, 20), -1),
    (slice(None, 12, 5), slice(3, 7)),
]


@pytest.mark.parametrize("backend", SLICE_BACKENDS)
@pytest.mark.parametrize("key", KEYS, ids=repr)
def test_known_keys(tmp_path, backend, key):
    path = str(tmp_path / "a.safetensors")
    st_torch.save_file({"a": A}, path)
    with safeload.safe_open(path, "pt", backend=backend) as f:
        got = f.get_slice("a")[key]
    assert_tensor_equal(got, A[key].contiguous(), repr(key))
    with safetensors.safe_open(path, "pt") as f:  # 0.8's default: torch indexing of an mmap
        assert_tensor_equal(got, f.get_slice("a")[key].contiguous(), repr(key))
    with safeload.safe_open(path, "np", backend=backend) as f:
        got_np = f.get_slice("a")[key]
    assert_tensor_equal(got_np, np.array(A.numpy()[key]), repr(key))


@pytest.mark.parametrize("backend", SLICE_BACKENDS)
@pytest.mark.parametrize("key", PAST_END_KEYS, ids=repr)
def test_stop_past_end_pt_clamps_np_raises(tmp_path, backend, key):
    path = str(tmp_path / "a.safetensors")
    st_torch.save_file({"a": A}, path)
    with safeload.safe_open(path, "pt", backend=backend) as f:
        got = f.get_slice("a")[key]
    assert_tensor_equal(got, A[key].contiguous(), repr(key))
    with safetensors.safe_open(path, "pt") as f:
        assert_tensor_equal(got, f.get_slice("a")[key].contiguous(), repr(key))
    with safeload.safe_open(path, "np", backend=backend) as f:
        with pytest.raises(SafetensorError, match="out of bounds for tensor dimension"):
            f.get_slice("a")[key]


@pytest.mark.parametrize("backend", SLICE_BACKENDS)
def test_scalar_and_empty(tmp_path, backend):
    path = str(tmp_path / "s.safetensors")
    s = torch.tensor(3.5)
    z = torch.zeros(0, 3)
    st_torch.save_file({"s": s, "z": z}, path)
    with safeload.safe_open(path, "pt", backend=backend) as f:
        assert_tensor_equal(f.get_slice("s")[()], s)
        assert_tensor_equal(f.get_slice("s")[...], s)
        assert f.get_slice("s").get_shape() == []
        assert_tensor_equal(f.get_slice("z")[:], z)
        assert_tensor_equal(f.get_slice("z")[...], z)
        assert_tensor_equal(f.get_slice("z")[:, 1:], z[:, 1:])
        assert_tensor_equal(f.get_slice("z")[[]], z[[]])


@pytest.mark.parametrize("backend", SLICE_BACKENDS)
def test_slice_dtypes_and_f4_rows(tmp_path, backend):
    from conftest import TORCH_DTYPES

    tensors = {code: make_tensor(code, (6, 4), seed=i) for i, code in enumerate(TORCH_DTYPES)}
    path = str(tmp_path / "d.safetensors")
    st_torch.save_file(tensors, path)
    with safeload.safe_open(path, "pt", backend=backend) as f:
        for code, t in tensors.items():
            for key in [slice(1, 5, 2), slice(-2, None), 3, (Ellipsis,), slice(4, 1)]:
                got = f.get_slice(code)[key]
                exp = t[key]
                assert got.dtype == exp.dtype, (code, key)
                assert tuple(got.shape) == tuple(exp.shape), (code, key)
                assert raw_bytes(got) == raw_bytes(exp), (code, key)


# -- rules kept from 0.8 -----------------------------------------------------------------------


@pytest.fixture
def a_file(tmp_path):
    path = str(tmp_path / "a.safetensors")
    st_torch.save_file({"a": A}, path)
    return path


@pytest.mark.parametrize("backend", SLICE_BACKENDS)
def test_stop_past_end_raises_with_0_8_message_for_numpy(a_file, backend):
    with safeload.safe_open(a_file, "np", backend=backend) as f:
        s = f.get_slice("a")
        cases = [
            (slice(None, 20), "Error during slicing [:20] with shape [10, 5]: index 19 out of bounds for tensor dimension #0 of size 10"),
            ((slice(None), slice(None, 20)), "Error during slicing [:, :20] with shape [10, 5]: index 19 out of bounds for tensor dimension #1 of size 5"),
            ((slice(2, None), 20), "Error during slicing [2:, 20] with shape [10, 5]: index 20 out of bounds for tensor dimension #1 of size 5"),
        ]
        for key, msg in cases:
            with pytest.raises(SafetensorError) as e:
                s[key]
            assert str(e.value) == msg


@pytest.mark.parametrize("backend", SLICE_BACKENDS)
@SETTINGS
@given(data=st.data())
def test_any_stop_past_end_raises(a_file, backend, data):
    dim = data.draw(st.integers(0, 1))
    size = A.shape[dim]
    stop = data.draw(st.integers(size + 1, size + 20))
    start = data.draw(st.one_of(st.none(), st.integers(0, size - 1)))
    step = data.draw(st.sampled_from([None, 1, 2, 3]))
    key = (slice(start, stop, step),) if dim == 0 else (slice(None), slice(start, stop, step))
    with safeload.safe_open(a_file, "np", backend=backend) as f:
        with pytest.raises(SafetensorError, match="out of bounds for tensor dimension"):
            f.get_slice("a")[key]


@pytest.mark.parametrize("backend", SLICE_BACKENDS)
@SETTINGS
@given(data=st.data())
def test_any_stop_past_end_clamps_for_torch(a_file, backend, data):
    dim = data.draw(st.integers(0, 1))
    size = A.shape[dim]
    stop = data.draw(st.integers(size + 1, size + 20))
    start = data.draw(st.one_of(st.none(), st.integers(-size - 5, size + 5)))
    step = data.draw(st.sampled_from([None, 1, 2, 3, 7]))
    key = (slice(start, stop, step),) if dim == 0 else (slice(None), slice(start, stop, step))
    with safeload.safe_open(a_file, "pt", backend=backend) as f:
        got = f.get_slice("a")[key]
    assert_tensor_equal(got, A[key].contiguous(), repr(key))
    with safetensors.safe_open(a_file, "pt") as f:
        assert_tensor_equal(got, f.get_slice("a")[key].contiguous(), repr(key))


@pytest.mark.parametrize("backend", SLICE_BACKENDS)
@pytest.mark.parametrize("framework", ["pt", "np"])
def test_int_index_out_of_range(a_file, backend, framework):
    with safeload.safe_open(a_file, framework, backend=backend) as f:
        s = f.get_slice("a")
        with pytest.raises(SafetensorError) as e:
            s[10]
        assert "out of bounds" in str(e.value)
        with pytest.raises(SafetensorError) as e:
            s[:, 5]
        assert "out of bounds" in str(e.value)
        with pytest.raises(SafetensorError) as e:
            s[2:, -6]
        assert str(e.value) == "Invalid index -6 for dimension 1 of size 5"
        with pytest.raises(SafetensorError) as e:
            s[-11]
        assert str(e.value) == "Invalid index -11 for dimension 0 of size 10"
        with pytest.raises(SafetensorError) as e:
            s[:20, 7]  # the int is out of range, the clamped (pt) or raising (np) stop is not named
        assert str(e.value) == (
            "Error during slicing [:20, 7] with shape [10, 5]: index 7 out of bounds for tensor dimension #1 of size 5"
            if framework == "pt"
            else "Error during slicing [:20, 7] with shape [10, 5]: index 19 out of bounds for tensor dimension #0 of size 10"
        )
        # -size itself is fine
        ref = A if framework == "pt" else A.numpy()
        assert_tensor_equal(s[-10], ref[-10])
        assert_tensor_equal(s[:, -5], np.ascontiguousarray(ref[:, -5]) if framework == "np" else A[:, -5].contiguous())


OUT_OF_RANGE_KEYS = [
    10, -11, 1 << 40, -(1 << 40), (slice(None), 5), (slice(None), -6), (slice(2, None), 20), (slice(None, 20), 7), (0, 0, 0),
]


@pytest.mark.parametrize("backend", SLICE_BACKENDS)
@pytest.mark.parametrize("key", OUT_OF_RANGE_KEYS, ids=repr)
def test_out_of_range_is_index_error_for_torch(a_file, backend, key):
    """0.8's default (torch indexing) raises IndexError: safeload's error is both that and a SafetensorError."""
    with safetensors.safe_open(a_file, "pt") as f:
        with pytest.raises(IndexError):
            f.get_slice("a")[key]
    with safeload.safe_open(a_file, "pt", backend=backend) as f:
        with pytest.raises(IndexError) as e:
            f.get_slice("a")[key]
        assert isinstance(e.value, SafetensorError)


@pytest.mark.parametrize("backend", SLICE_BACKENDS)
def test_lists(a_file, backend):
    with safeload.safe_open(a_file, "pt", backend=backend) as f:
        s = f.get_slice("a")
        with pytest.raises(SafetensorError) as e:
            s[[0, 1]]
        assert str(e.value) == "Non empty lists are not implemented"
        empty = s[[]]
        assert tuple(empty.shape) == (0, 5)
        assert empty.dtype == torch.float32


@pytest.mark.parametrize("backend", SLICE_BACKENDS)
def test_too_many_indices_raise(a_file, backend):
    with safeload.safe_open(a_file, "pt", backend=backend) as f:
        s = f.get_slice("a")
        for key in [(0, 0, 0), (slice(None),) * 3]:
            with pytest.raises((SafetensorError, IndexError)):
                s[key]


@pytest.mark.parametrize("backend", ["pread", "mmap"])
def test_index_like_and_huge_keys(a_file, backend):
    """Keys are read as torch and numpy read them: anything with ``__index__`` (numpy ints), ints past 64 bits (clamped under pt, out of range under np), a step bigger than the
    dimension (one element, as Python and numpy give; 0.8, and torch past 2**62, return none)."""
    full = st_torch.load_file(a_file)["a"]
    keys = [np.int64(3), (slice(np.int32(1), None, 2**40),), slice(-2**40, 2**40), (np.int8(-1), slice(None, None, 2**40))]
    with safeload.safe_open(a_file, "pt", backend=backend) as f:
        for key in keys:
            assert_tensor_equal(f.get_slice("a")[key], full[key])
        for key in (slice(1, None, 2**70), slice(-2**70, 2**70)):  # torch warns and truncates these
            assert np.array_equal(f.get_slice("a")[key].numpy(), full.numpy()[key])
        with pytest.raises(IndexError, match="out of bounds"):
            f.get_slice("a")[2**70]
        with pytest.raises(TypeError, match="not float"):
            f.get_slice("a")[1.5]
        with pytest.raises(TypeError, match="newaxis"):
            f.get_slice("a")[None]
    with safeload.safe_open(a_file, "np", backend=backend) as f:
        assert np.array_equal(f.get_slice("a")[np.int64(3)], full.numpy()[3])
        with pytest.raises(SafetensorError, match="out of bounds") as e:
            f.get_slice("a")[:2**70]
        assert not isinstance(e.value, IndexError)  # numpy's strict rule: 0.8's plain error


@pytest.mark.parametrize("cold", [False, True])
def test_slices_of_a_map_are_views_as_0_8s(tmp_path, cold):
    """Under mmap (0.8's default, and what transformers asks for), a slice is a view of the
    tensor's pages as 0.8's is: the same contiguity and strides, writes seen through the tensor
    read before it, never through to the file; cold (evicted), the same, its pages asked of the
    kernel exactly (counted as read), warm nothing read."""
    src = {"w": make_tensor("F32", (64, 1024), 1), "n": make_tensor("BF16", (1024,), 2)}
    path = str(tmp_path / "v.safetensors")
    st_torch.save_file(src, path)
    before = Path(path).read_bytes()
    keys = [(slice(8, 40),), (slice(None), slice(256, 512)), (Ellipsis,), (3, slice(0, 100))]
    with safetensors.safe_open(path, "pt") as ref:
        want = [(k, ref.get_slice("w")[k]) for k in keys]
    if cold:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    with safeload.safe_open(path, "pt", backend="mmap") as f:
        whole = f.get_tensor("w")
        for key, ref_part in want:
            part = f.get_slice("w")[key]
            assert_tensor_equal(part, ref_part, str(key))
            assert (part.is_contiguous(), part.stride()) == (ref_part.is_contiguous(), ref_part.stride()), key
        norm = f.get_slice("n")[...]
        assert_tensor_equal(norm, src["n"])
        part = f.get_slice("w")[:, 256:512]
        read = f.stats.bytes_read
    part.fill_(7.0)
    assert torch.equal(whole[:, 256:512], part)  # one map, as 0.8's
    assert Path(path).read_bytes() == before
    assert (read > 0) == cold
