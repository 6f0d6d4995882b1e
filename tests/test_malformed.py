"""One hand-built file per header rule: every backend must refuse it with a SafetensorError whose
message starts with 0.8's and names the file; the file must be left untouched."""

from __future__ import annotations

import json
import pathlib
import struct

import pytest

import safetensors

import safeload
import safeload.numpy
import safeload.torch
from safeload import SafetensorError

from conftest import BACKENDS, catch, write_raw


def T(dtype, shape, offsets):
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


# name -> (header (object, str or bytes), data, declared header length or None, how to compare
# with 0.8's message: "prefix" = 0.8's whole message is a prefix of safeload's, "json" = serde's
# wording differs after "invalid JSON in header", None = 0.8 accepts the file)
CASES = {
    "empty_file": (None, b"", None, "prefix"),
    "shorter_than_8": (None, b"\x01\x00\x00", None, "prefix"),
    "header_too_large": (b"{}", b"", 100_000_001, "prefix"),
    "header_len_past_end": (b"{}", b"", 100, "prefix"),
    "invalid_utf8": (b'{"a":"\xff\xfe"}', b"", None, "prefix"),
    "invalid_json": (b'{"a":', b"", None, "prefix"),
    "top_level_array": ([1, 2], b"", None, "json"),
    "top_level_string": (b'"abc"', b"", None, "json"),
    "unknown_dtype": ({"a": T("F99", [1], [0, 4])}, b"\0" * 4, None, "json"),
    "negative_shape": ({"a": T("F32", [-1], [0, 4])}, b"\0" * 4, None, "json"),
    "float_shape": ({"a": T("F32", [1.0], [0, 4])}, b"\0" * 4, None, "json"),
    "tensor_not_object": ({"a": 5}, b"", None, "json"),
    "missing_data_offsets": ({"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, None, "json"),
    "shape_product_overflow": ({"a": T("F32", [2**62, 8], [0, 4])}, b"\0" * 4, None, "prefix"),
    "offsets_hole": ({"a": T("F32", [1], [0, 4]), "b": T("F32", [1], [8, 12])}, b"\0" * 12, None, "prefix"),
    "offsets_overlap": ({"a": T("F32", [2], [0, 8]), "b": T("F32", [2], [4, 12])}, b"\0" * 12, None, "prefix"),
    "offsets_past_end": ({"a": T("F32", [2], [0, 8])}, b"\0" * 4, None, "prefix"),
    "offsets_reversed": ({"a": T("F32", [1], [4, 0])}, b"\0" * 4, None, "prefix"),
    "first_not_at_zero": ({"a": T("F32", [1], [4, 8])}, b"\0" * 8, None, "prefix"),
    "size_mismatch": ({"a": T("F32", [3], [0, 8])}, b"\0" * 8, None, "prefix"),
    "trailing_bytes": ({"a": T("F32", [1], [0, 4])}, b"\0" * 8, None, "prefix"),
    "metadata_non_string": ({"__metadata__": {"x": 1}, "a": T("F32", [1], [0, 4])}, b"\0" * 4, None, "prefix"),
    "metadata_array": ({"__metadata__": ["x"], "a": T("F32", [1], [0, 4])}, b"\0" * 4, None, "json"),
    "duplicate_tensor_key": (
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
        b'"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
        b"\0" * 4,
        None,
        None,  # 0.8 lets the last one win
    ),
    "f4_odd_count": ({"a": T("F4", [3], [0, 2])}, b"\0" * 2, None, "prefix"),
    "f4_single": ({"a": T("F4", [1], [0, 1])}, b"\0", None, "prefix"),
}

HEADER_ERROR = "Error while deserializing header"


def build(tmp_path, name):
    header, data, length, _ = CASES[name]
    path = tmp_path / f"{name}.safetensors"
    if header is None:
        path.write_bytes(data)
    else:
        write_raw(path, header, data, length=length)
    return str(path)


def _json_prefix(msg):
    # "Error while deserializing header: invalid JSON in header: <serde's wording>"
    return ": ".join(msg.split(": ")[:2])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_malformed_rejected(tmp_path, name, backend):
    path = build(tmp_path, name)
    before = pathlib.Path(path).read_bytes()
    mode = CASES[name][3]

    ref = catch(lambda: safetensors.safe_open(path, "pt").keys())
    if mode is None:
        assert ref[0] == "ok", "0.8 accepted this file when the suite was written"
    else:
        assert ref[0] == "SafetensorError", ref

    with pytest.raises(SafetensorError) as e:
        with safeload.safe_open(path, "pt", backend=backend) as f:
            f.keys()
    msg = str(e.value)
    assert msg.startswith(HEADER_ERROR), msg
    assert f"(file {path})" in msg, msg
    if mode == "prefix":
        assert msg.startswith(ref[1]), f"0.8: {ref[1]!r}\nsafeload: {msg!r}"
    elif mode == "json":
        assert _json_prefix(msg) == _json_prefix(ref[1]), f"0.8: {ref[1]!r}\nsafeload: {msg!r}"
        assert "invalid JSON in header" in msg
    else:
        assert "duplicate" in msg.lower(), msg
    assert pathlib.Path(path).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{name}.safetensors"]


@pytest.mark.parametrize("name", list(CASES))
def test_malformed_rejected_by_every_entry_point(tmp_path, name):
    path = build(tmp_path, name)
    before = pathlib.Path(path).read_bytes()
    for call in (
        lambda: safeload.torch.load_file(path),
        lambda: safeload.numpy.load_file(path),
        lambda: safeload.safe_open(path, "np"),
        lambda: safeload.torch.load_checkpoint([path]),
        lambda: list(safeload.torch.iter_checkpoint(path)),
        lambda: safeload.torch.load(before),
        lambda: safeload.numpy.load(before),
    ):
        with pytest.raises(SafetensorError):
            call()
    assert pathlib.Path(path).read_bytes() == before


def test_duplicate_key_message(tmp_path):
    path = build(tmp_path, "duplicate_tensor_key")
    with pytest.raises(SafetensorError, match="duplicate"):
        safeload.safe_open(path, "pt")
    with safetensors.safe_open(path, "pt") as f:  # 0.8 keeps one of them
        assert f.keys() == ["a"]


def test_header_too_large_exact_boundary(tmp_path):
    # 100,000,000 is still allowed by the length rule (then fails only for being past the end)
    p = write_raw(tmp_path / "big.safetensors", b"{}", length=100_000_000)
    with pytest.raises(SafetensorError) as e:
        safeload.safe_open(p, "pt")
    assert "header too large" not in str(e.value)
    assert "invalid header length" in str(e.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_valid_hand_written_files_still_open(tmp_path, backend):
    """Controls: padding spaces, an empty header, zero-size tensors at the end, key order."""
    cases = [
        (b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}     ', struct.pack("<f", 1.5)),
        (b"{}", b""),
        (b"{}        ", b""),
        ({"__metadata__": {}}, b""),
        ({"b": T("U8", [2], [0, 2]), "a": T("U8", [0], [2, 2])}, b"\x01\x02"),
        ({"z": T("I16", [1], [2, 4]), "y": T("I16", [1], [0, 2])}, b"\x01\x00\x02\x00"),
    ]
    for i, (header, data) in enumerate(cases):
        p = write_raw(tmp_path / f"ok{i}.safetensors", header, data)
        with safetensors.safe_open(p, "pt") as ref, safeload.safe_open(p, "pt", backend=backend) as f:
            assert f.keys() == ref.keys()
            assert f.offset_keys() == ref.offset_keys()
            assert f.metadata() == ref.metadata()
            for k in ref.keys():
                a, b = f.get_tensor(k), ref.get_tensor(k)
                assert a.dtype == b.dtype and a.shape == b.shape
                assert a.numpy().tobytes() == b.numpy().tobytes()


def test_header_with_unicode_names(tmp_path):
    header = {"ünïcødé.weight": T("U8", [1], [0, 1]), "日本": T("U8", [1], [1, 2])}
    p = write_raw(tmp_path / "u.safetensors", json.dumps(header, ensure_ascii=False), b"\x05\x06")
    with safetensors.safe_open(p, "pt") as ref, safeload.safe_open(p, "pt") as f:
        assert f.keys() == ref.keys()
        assert f.get_tensor("日本").item() == 6
