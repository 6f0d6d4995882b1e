"""Framework adapters: turn (dtype code, shape, bytes) from the Rust core into tensors.

torch and numpy wrap the bytes without a copy, through calls the abi3 build has on every Python
(3.9+): torch imports a DLPack capsule of the tensor's dtype and shape (``Bytes.dlpack``), numpy
reads ``Bytes.__array_struct__``. Every tensor owns a distinct storage that keeps its allocation
alive (DLPack's deleter; numpy's ``base``). Other buffers (``deserialize``'s bytearrays) go
through ``frombuffer``. Other frameworks convert from numpy.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple

from ._safeload import CONVERTIBLE, DTYPES, Bytes, Importer, SafetensorError

FRAMEWORKS = {
    "pt": "pytorch",
    "torch": "pytorch",
    "pytorch": "pytorch",
    "np": "numpy",
    "numpy": "numpy",
    "tf": "tensorflow",
    "tensorflow": "tensorflow",
    "jax": "flax",
    "flax": "flax",
    "mlx": "mlx",
    "paddle": "paddle",
}

_torch_dtypes: Dict[str, Any] = {}
_numpy_dtypes: Dict[str, Any] = {}


def torch_dtype(code: str, name: str = "") -> Any:
    """The torch dtype of a format code, or a SafetensorError naming the tensor."""
    try:
        return _torch_dtypes[code]
    except KeyError:
        pass
    import torch

    dtype = getattr(torch, DTYPES.get(code, (None,))[0] or "", None)
    if dtype is None:
        raise SafetensorError(
            f"tensor {name!r} has dtype {code}, which torch {torch.__version__} has no dtype for"
        )
    _torch_dtypes[code] = dtype
    return dtype


def torch_shape(code: str, shape: Sequence[int]) -> List[int]:
    """torch's float4_e2m1fn_x2 holds two F4 values per element: the last dim is halved."""
    shape = list(shape)
    if code == "F4" and shape:
        shape[-1] //= 2
    return shape


#: Format codes this torch's DLPack import makes into exactly their dtype (probed on first use).
_torch_dlpack: Optional[FrozenSet[str]] = None


def _dlpack_codes(torch: Any) -> FrozenSet[str]:
    """The format codes whose DLPack capsule this torch imports as exactly the dtype the format
    names (torch versions differ on unsigned and fp8 codes; DLPack has none for F4 / F6 and the
    capsule refuses them): each probed once per process with one zero element."""
    global _torch_dlpack
    if _torch_dlpack is None:
        codes = []
        for code, names in DTYPES.items():
            dtype = getattr(torch, names[0] or "", None)
            if dtype is None or code == "F4":  # no dtype; two values per torch element
                continue
            try:
                ok = torch.from_dlpack(Bytes.zeroed(dtype.itemsize).dlpack(code, [1])).dtype == dtype
            except Exception:  # noqa: BLE001 - no DLPack type, or one this torch's import lacks
                ok = False
            if ok:
                codes.append(code)
        _torch_dlpack = frozenset(codes)
    return _torch_dlpack


def _torch_from_bytes(code: str, shape: Sequence[int], data: Any, dtype: Any) -> Any:
    """A tensor over ``Bytes`` through DLPack: in one call where torch's import takes the dtype,
    else as uint8 and a view."""
    import torch

    if code in _dlpack_codes(torch):
        return torch.from_dlpack(data.dlpack(code, shape))
    return torch.from_dlpack(data.dlpack("U8", [len(data)])).view(dtype).view(shape)


def to_torch(code: str, shape: Sequence[int], data: Any, name: str = "") -> Any:
    import torch

    dtype = torch_dtype(code, name)
    shape = torch_shape(code, shape)
    if len(data) == 0:
        return torch.empty(shape, dtype=dtype)
    if type(data) is Bytes:
        return _torch_from_bytes(code, shape, data, dtype)
    if code == "F4":
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)
    return torch.frombuffer(data, dtype=dtype).reshape(shape)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a load builds its thousands of objects (the
    core's tuples, tensors, the dict) and back on after, if it was on. None of them is garbage
    while they are built, yet every 700 allocations the collector would walk them, and every
    tenth walk the process's whole heap (torch's modules included): with thousands of small
    tensors those walks would take more than half of ``get_tensors()``'s time. The collector's
    counts go on, so it resumes where the load left it."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def torch_many(items: Sequence[Tuple[str, str, List[int], Any]]) -> Dict[str, Any]:
    """``to_torch`` over many tensors (``Bytes`` from the core), with the common case inlined:
    a dtype torch's DLPack import takes is one ``torch._C._from_dlpack(data.dlpack(code, shape))``
    (the cheapest way to a tensor: ``torch.from_numpy(np.frombuffer(...).reshape(shape))`` and
    ``torch.frombuffer(...).view(shape)`` cost more per tensor). A whole file's tensors take
    :func:`torch_read_many`, which makes them in Rust."""
    import torch

    from_dlpack = _capsule_importer(torch)
    fast = _dlpack_codes(torch)
    out = {}
    for name, code, shape, data in items:
        if code in fast and len(data):
            out[name] = from_dlpack(data.dlpack(code, shape))
        else:
            out[name] = to_torch(code, shape, data, name)
    return out


def torch_read_many(reader: Any, dtype: Optional[str] = None) -> Dict[str, Any]:
    """Every tensor of a ``Handle`` or a ``Checkpoint`` as torch tensors, file order, ``dtype`` as
    ``read_many`` takes it. The core makes them (``import_many`` with :func:`torch_importer`):
    with thousands of small tensors the per-tensor Python cost is what counts, and making them in
    Rust leaves none of it; empty tensors and the dtypes torch's DLPack import lacks come back as
    bytes for :func:`to_torch`."""
    out, rest = reader.import_many(torch_importer(), dtype=dtype)
    for name in rest:
        code, shape, data = out[name]
        out[name] = to_torch(code, shape, data, name)
    return out


_torch_importer: Optional[Importer] = None


def torch_importer() -> Importer:
    """The core's maker of torch tensors: torch's DLPack import, for the dtypes it makes exactly."""
    global _torch_importer
    if _torch_importer is None:
        import torch

        _torch_importer = Importer(_capsule_importer(torch), sorted(_dlpack_codes(torch)))
    return _torch_importer


def _capsule_importer(torch: Any) -> Any:
    """What ``torch.from_dlpack`` calls for a DLPack capsule (``torch._C._from_dlpack``: the same
    tensor without the Python-level dispatch, which each call would otherwise pay), or
    ``torch.from_dlpack`` itself on a torch that names it otherwise."""
    return getattr(getattr(torch, "_C", None), "_from_dlpack", None) or torch.from_dlpack


def numpy_many(items: Sequence[Tuple[str, str, List[int], Any]]) -> Dict[str, Any]:
    """``to_numpy`` over many arrays (``Bytes`` from the core), the common case inlined."""
    import numpy as np

    asarray = np.asarray
    known = _numpy_dtypes
    out = {}
    for name, code, shape, data in items:
        dtype = known.get(code)
        if dtype is None:
            out[name] = to_numpy(code, shape, data, name)
        else:
            out[name] = asarray(data).view(dtype).reshape(shape)
    return out


def numpy_dtype(code: str, name: str = "") -> Any:
    try:
        return _numpy_dtypes[code]
    except KeyError:
        pass
    import numpy as np

    _, numpy_name, ml_dtypes_name, _ = DTYPES.get(code, (None, None, False, 0))
    if numpy_name is not None and not ml_dtypes_name:
        dtype = np.dtype(numpy_name)
    elif numpy_name is not None:
        try:
            import ml_dtypes
        except ImportError:
            raise SafetensorError(
                f"tensor {name!r} has dtype {code}, which numpy lacks: install the 'ml_dtypes' "
                "package (pip install ml_dtypes) to load it with numpy"
            ) from None
        dtype = np.dtype(getattr(ml_dtypes, numpy_name))
    else:
        raise SafetensorError(
            f"tensor {name!r} has dtype {code}, which has no numpy dtype "
            "(packed sub-byte floats); load it with framework='pt'"
        )
    _numpy_dtypes[code] = dtype
    return dtype


def to_numpy(code: str, shape: Sequence[int], data: Any, name: str = "") -> Any:
    import numpy as np

    dtype = numpy_dtype(code, name)
    if type(data) is Bytes:
        # A uint8 array whose base keeps `data` alive, then a view of the real dtype and shape.
        return np.asarray(data).view(dtype).reshape(shape)
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def _from_numpy(module: str, convert: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    def adapter(code: str, shape: Sequence[int], data: Any, name: str = "") -> Any:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            raise ModuleNotFoundError(
                f"framework needs the '{module}' package, which is not installed"
            ) from None
        return convert(mod, to_numpy(code, shape, data, name))

    return adapter


def _many(convert: Callable[..., Any]) -> Callable[..., Dict[str, Any]]:
    return lambda items: {name: convert(code, shape, data, name) for name, code, shape, data in items}


def _to_paddle(place: Any) -> Callable[..., Any]:
    """paddle tensors made on ``place``, as safetensors 0.8 makes them: ``paddle.to_tensor(array,
    place=...)``, the place named always ("cpu" too: paddle's default may be a GPU)."""
    return _from_numpy("paddle", lambda paddle, a: paddle.to_tensor(a, place=place))


def paddle_place(device: str) -> Any:
    """A parsed device (``_device.parse``) as 0.8 names it to paddle: "gpu:N" for "cuda:N", an
    int for a bare index, the name otherwise."""
    kind, _, index = device.partition(":")
    if kind == "cuda":
        return f"gpu:{index}"
    return int(device) if device.isdigit() else device


CONVERTERS: Dict[str, Callable[..., Any]] = {
    "pytorch": to_torch,
    "numpy": to_numpy,
    "tensorflow": _from_numpy("tensorflow", lambda tf, a: tf.convert_to_tensor(a)),
    "flax": _from_numpy("jax.numpy", lambda jnp, a: jnp.array(a)),
    "mlx": _from_numpy("mlx.core", lambda mx, a: mx.array(a)),
    "paddle": _to_paddle("cpu"),
}

#: Batch converters: a list of (name, code, shape, bytes) -> dict name -> tensor.
MANY: Dict[str, Callable[..., Dict[str, Any]]] = {
    name: {"pytorch": torch_many, "numpy": numpy_many}.get(name) or _many(convert)
    for name, convert in CONVERTERS.items()
}


def framework_name(framework: Any) -> str:
    """The framework's own name ("pytorch", "numpy", ...) for any name 0.8 takes for it;
    another str is a ``SafetensorError``, anything else a ``TypeError``, as 0.8 raises them."""
    if not isinstance(framework, str):
        raise TypeError(f"argument 'framework': {type(framework).__name__!r} object is not a str")
    try:
        return FRAMEWORKS[framework]
    except KeyError:
        raise SafetensorError(f"framework {framework} is invalid") from None


def converters(framework: str, device: str) -> Tuple[Callable[..., Any], Callable[..., Dict[str, Any]]]:
    """One tensor's and many tensors' converter of ``framework`` (its own name) for a parsed
    ``device``: paddle makes its tensors there itself; every other framework's are made on the
    CPU (torch's are moved by the caller, through the staging ring or ``.to``)."""
    if framework == "paddle" and device != "cpu":
        one = _to_paddle(paddle_place(device))
        return one, _many(one)
    return CONVERTERS[framework], MANY[framework]


# torch dtype name -> format code, for the dtypes the reader converts between.
FLOAT_CODES = {DTYPES[code][0]: code for code in CONVERTIBLE}


def float_code(dtype: Any) -> Optional[str]:
    """"F32", "F16" or "BF16" for the torch dtypes the reader converts between, else None."""
    return FLOAT_CODES.get(str(dtype).replace("torch.", ""))


def dtype_code(dtype: Any) -> Optional[str]:
    """The format code of a torch floating dtype the reader converts to ("F32", "F16", "BF16")."""
    if dtype is None:
        return None
    code = float_code(dtype)
    if code is None:
        raise SafetensorError(f"dtype {dtype} cannot be converted to on load (F32, F16 or BF16)")
    return code


def to_dtype(tensors: Dict[str, Any], dtype: Any) -> Dict[str, Any]:
    """The F32/F16/BF16 tensors converted to ``dtype`` (None: as they are), the rest untouched, as
    the reader converts on the way: for tensors that were not (devices, shares). A dtype the
    reader cannot convert to is refused as there."""
    code = dtype if dtype in ("F32", "F16", "BF16") else dtype_code(dtype)
    if code is None:
        return tensors
    import torch

    target = torch_dtype(code)
    convertible = (torch.float32, torch.float16, torch.bfloat16)
    return {n: t.to(target) if t.dtype in convertible else t for n, t in tensors.items()}
