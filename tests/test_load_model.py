"""``load_model`` / ``load_into`` read straight into existing tensors (issue 13): the same
results as safetensors 0.8's ``load_model`` (values, ``(missing, unexpected)``, strict errors,
tied weights), storages unchanged, dtypes converted bit-exact with torch, and a copy (never a
wrong value) for whatever cannot take a direct read."""

import gc

import pytest
import torch
import safetensors.torch as st

import safeload.torch as sl
from safeload import SafetensorError

from conftest import raw_bytes


class Net(torch.nn.Module):
    def __init__(self, dtype=torch.float32, tied=True):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16, dtype=dtype)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 24, dtype=dtype), torch.nn.LayerNorm(24, dtype=dtype),
                                        torch.nn.Linear(24, 16, dtype=dtype))
        self.head = torch.nn.Linear(16, 50, bias=False, dtype=dtype)
        if tied:
            self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.tensor([3, 1, 4], dtype=torch.int64))
        self.register_buffer("mask", torch.tensor([True, False, True]))


def fresh(seed, **kw):
    torch.manual_seed(seed)
    return Net(**kw)


def state_bytes(model):
    return {k: raw_bytes(v) for k, v in model.state_dict().items()}


def pointers(model):
    return {k: v.data_ptr() for k, v in model.state_dict().items()}


@pytest.fixture
def saved(tmp_path):
    src = fresh(1)
    path = str(tmp_path / "model.safetensors")
    st.save_model(src, path)
    return src, path


@pytest.fixture
def no_load_state_dict(monkeypatch):
    """The direct path must not fall back to load_state_dict (which also copies in place)."""
    def refuse(*a, **k):
        raise AssertionError("load_state_dict called")

    monkeypatch.setattr(sl._inplace, "_custom_loading", lambda m: False)
    return refuse


@pytest.mark.parametrize("backend", ["auto", "pread", "mmap", "direct"])
def test_same_results_as_safetensors_in_place(saved, backend, no_load_state_dict):
    src, path = saved
    ours, theirs = fresh(2), fresh(2)
    ours.load_state_dict = no_load_state_dict
    before = pointers(ours)
    got = sl.load_model(ours, path, backend=backend)
    want = st.load_model(theirs, path)
    assert (set(got[0]), sorted(got[1])) == (set(want[0]), sorted(want[1]))
    assert state_bytes(ours) == state_bytes(theirs) == state_bytes(src)
    assert pointers(ours) == before  # read in place: every storage unchanged
    assert ours.head.weight is ours.embed.weight  # still tied


def test_missing_unexpected_and_strict_errors_match(tmp_path):
    path = str(tmp_path / "partial.safetensors")
    full = fresh(3, tied=False).state_dict()
    part = {k: v.contiguous() for k, v in full.items() if not k.startswith("body.2")}
    part["extra.weight"] = torch.ones(2)
    st.save_file(part, path)
    for strict in (False, True):
        outcomes = []
        for lib in (sl, st):
            model = fresh(4, tied=False)
            try:
                missing, unexpected = lib.load_model(model, path, strict=strict)
                outcomes.append(("ok", set(missing), sorted(unexpected), state_bytes(model)))
            except RuntimeError as e:
                outcomes.append(("error", str(e)))
        assert outcomes[0] == outcomes[1], strict


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("file_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtype_converted_on_the_way_bit_exact(tmp_path, model_dtype, file_dtype):
    src = fresh(5, dtype=file_dtype)
    with torch.no_grad():  # values that round differently, subnormals, inf
        src.body[0].weight.view(-1)[:4] = torch.tensor([1e-40, 65520.0, -3.3e38, 1.00048828125]).to(file_dtype)
    path = str(tmp_path / "typed.safetensors")
    st.save_model(src, path)
    ours, theirs = fresh(6, dtype=model_dtype), fresh(6, dtype=model_dtype)
    ours.load_state_dict = None  # never called: read in place
    before = pointers(ours)
    sl.load_model(ours, path)
    st.load_model(theirs, path)  # load_state_dict's copy_ converts
    assert state_bytes(ours) == state_bytes(theirs)
    assert pointers(ours) == before


def test_what_cannot_be_read_in_place_is_copied(tmp_path):
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("t", torch.zeros(6, 4).t())  # not contiguous
            self.register_buffer("i", torch.zeros(5, dtype=torch.int32))  # file has int64
            self.lin = torch.nn.Linear(4, 4)

    path = str(tmp_path / "odd.safetensors")
    st.save_file({"t": torch.arange(24.0).reshape(4, 6), "i": torch.arange(5, dtype=torch.int64),
                  "lin.weight": torch.randn(4, 4), "lin.bias": torch.randn(4)}, path)
    ours, theirs = Odd(), Odd()
    assert sl.load_model(ours, path) == st.load_model(theirs, path)
    assert state_bytes(ours) == state_bytes(theirs)
    assert not ours.t.is_contiguous()


def test_the_reader_decides_what_it_fills_in_place(tmp_path):
    """``Checkpoint.read_into`` fills what it can and names the rest; safeload's load_into then
    copies those: fp8 of the same type in place (DLPack's fp8 codes), fp8 of another type and a
    view sharing another destination's memory copied, with 0.8's values either way."""
    from safeload._safeload import Checkpoint

    path = str(tmp_path / "fp8.safetensors")
    w = {"a": torch.randn(8).to(torch.float8_e4m3fn), "b": torch.randn(8).to(torch.float8_e4m3fn),
         "c": torch.randn(4, 2), "d": torch.randn(8)}
    st.save_file(w, path)
    base = torch.zeros(8)
    dests = {"a": torch.zeros(8, dtype=torch.float8_e4m3fn), "b": torch.zeros(8, dtype=torch.float8_e5m2),
             "c": base.view(4, 2), "d": base, "e": torch.zeros(4, 2).t()}
    ckpt = Checkpoint([path])
    try:
        _, rest = ckpt.read_into(["a", "b", "c", "d", "c"], [dests[k] for k in "abcd"] + [dests["e"]])
    finally:
        ckpt.close()
    assert rest == ["b", "c", "d", "c"]  # another fp8 type; shared memory; not contiguous
    assert raw_bytes(dests["a"]) == raw_bytes(w["a"])
    before = dests["a"].data_ptr()
    for t in dests.values():
        t.zero_()
    sl.load_into({k: dests[k] for k in "abd"}, path)
    assert dests["a"].data_ptr() == before and raw_bytes(dests["a"]) == raw_bytes(w["a"])
    assert raw_bytes(dests["b"]) == raw_bytes(w["b"].to(torch.float8_e5m2))  # torch's copy_
    assert torch.equal(base, w["d"])


def test_shape_mismatch_raises_before_touching_the_model(saved):
    _, path = saved
    model = Net()
    model.body[0] = torch.nn.Linear(16, 25)
    model.body[1] = torch.nn.LayerNorm(25)
    model.body[2] = torch.nn.Linear(25, 16)
    before = state_bytes(model)
    with pytest.raises(RuntimeError, match="size mismatch for body.0.weight"):
        sl.load_model(model, path)
    assert state_bytes(model) == before


@pytest.mark.parametrize("enabled", [True, False])
def test_the_cycle_collector_is_left_as_it_was(saved, enabled):
    """load_model holds Python's cycle collector off while it works (its objects make no
    cycles) and leaves it as the caller had it, after a load and after an error."""
    src, path = saved
    mismatched = Net()
    mismatched.body[0] = torch.nn.Linear(16, 25)
    try:
        gc.enable() if enabled else gc.disable()
        model = fresh(2)
        assert sl.load_model(model, path) == st.load_model(fresh(2), path)
        assert gc.isenabled() == enabled
        assert state_bytes(model) == state_bytes(src)
        with pytest.raises(RuntimeError, match="size mismatch"):
            sl.load_model(mismatched, path)
        assert gc.isenabled() == enabled
    finally:
        gc.enable()


def test_custom_loading_goes_through_load_state_dict(saved):
    src, path = saved
    calls = []

    class Hooked(Net):
        def _load_from_state_dict(self, *args, **kwargs):
            calls.append(1)
            return super()._load_from_state_dict(*args, **kwargs)

    torch.manual_seed(7)
    model = Hooked()
    sl.load_model(model, path)
    assert calls and state_bytes(model) == state_bytes(src)


def test_load_into_tensors_and_errors(tmp_path):
    path = str(tmp_path / "w.safetensors")
    w = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(4)}
    st.save_file(w, path)
    dests = {"a": torch.empty(3, 5), "b": torch.empty(7), "c": torch.empty(4, dtype=torch.int64)}
    stats = sl.load_into(dests, path)
    assert torch.equal(dests["a"], w["a"]) and torch.equal(dests["c"], w["c"])
    assert raw_bytes(dests["b"]) == raw_bytes(w["b"].to(torch.float32))
    assert stats.bytes_read == 15 * 4 + 7 * 2 + 4 * 8
    with pytest.raises(SafetensorError, match="does not contain tensor z"):
        sl.load_into({"z": torch.empty(1)}, path)
    with pytest.raises(SafetensorError, match="shape"):
        sl.load_into({"a": torch.empty(5, 3)}, path)
    # Two destinations sharing memory are not read in parallel into the same bytes: copied.
    base = torch.zeros(15)
    shared = {"a": base.view(3, 5), "b": torch.empty(7)}
    sl.load_into(shared, path)
    assert torch.equal(base.view(3, 5), w["a"])


def test_load_file_dtype_is_bit_exact(tmp_path):
    path = str(tmp_path / "d.safetensors")
    w = {"f": torch.randn(1000) * 1e4, "h": torch.randn(33).half(), "i": torch.arange(3)}
    st.save_file(w, path)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        got = sl.load_file(path, dtype=dtype)
        assert got["i"].dtype == torch.int64
        for k in ("f", "h"):
            assert got[k].dtype == dtype
            assert raw_bytes(got[k]) == raw_bytes(w[k].to(dtype)), (k, dtype)


def test_load_into_views_of_one_buffer_that_are_not_neighbours(tmp_path):
    # "big" overlaps both views; the views do not overlap each other, and sorted by address
    # "v1" lies between "big" and "v2". Every one of them must take the copy path, in order, as
    # copy_ would give: big's values, then each view's over its part.
    path = str(tmp_path / "w.safetensors")
    w = {"big": torch.randn(100), "v1": torch.randn(10), "v2": torch.randn(10)}
    st.save_file(w, path)
    base = torch.zeros(100)
    dests = {"big": base, "v1": base[10:20], "v2": base[30:40]}
    sl.load_into(dests, path)
    want = w["big"].clone()
    want[10:20] = w["v1"]
    want[30:40] = w["v2"]
    assert torch.equal(base, want)
