"""``safeload.numpy``: safetensors 0.8's ``safetensors.numpy``, on safeload's reader."""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Optional, Union

import numpy as np

from . import _save
from ._frameworks import to_numpy
from ._open import safe_open
from ._safeload import TensorSpec, deserialize, serialize

__all__ = ["load", "load_file", "save", "save_file", "save_checkpoint"]


def _is_little_endian(tensor: np.ndarray) -> bool:
    order = tensor.dtype.byteorder
    if order == "=":
        return sys.byteorder == "little"
    if order in ("|", "<"):
        return True
    if order == ">":
        return False
    raise ValueError(f"Unexpected byte order {order}")


def _flatten(tensor_dict: Dict[str, np.ndarray], keep_alive: List[Any]) -> Dict[str, TensorSpec]:
    specs = {}
    for name, array in tensor_dict.items():
        if not _is_little_endian(array):
            array = array.byteswap(inplace=False)
        # ascontiguousarray would turn a 0-d array into shape (1,).
        array = np.ascontiguousarray(array).reshape(array.shape)
        keep_alive.append(array)
        specs[name] = TensorSpec(
            dtype=array.dtype.name,
            shape=array.shape,
            data_ptr=array.ctypes.data,
            data_len=array.nbytes,
        )
    return specs


def _writer() -> _save.Write:
    keep_alive: List[Any] = []
    return _save.host_writer(lambda arrays: _flatten(arrays, keep_alive))


def save(tensor_dict: Dict[str, np.ndarray], metadata: Optional[Dict[str, str]] = None) -> bytes:
    """The bytes of a safetensors file holding ``tensor_dict``."""
    keep_alive: List[Any] = []
    return bytes(serialize(_flatten(tensor_dict, keep_alive), metadata=metadata))


def save_file(
    tensor_dict: Dict[str, np.ndarray],
    filename: Union[str, "os.PathLike[str]"],
    metadata: Optional[Dict[str, str]] = None,
    *,
    fsync: bool = False,
    manifest: bool = False,
) -> None:
    """Writes ``tensor_dict`` to ``filename`` atomically (temporary file + rename); ``fsync`` and
    ``manifest`` as :func:`safeload.torch.save_file`'s."""
    _save.save_file(_writer(), tensor_dict, filename, metadata, fsync, manifest)


def save_checkpoint(
    tensor_dict: Dict[str, np.ndarray],
    directory: Union[str, "os.PathLike[str]"],
    *,
    max_shard_size: Union[int, str] = _save.MAX_SHARD_SIZE,
    metadata: Optional[Dict[str, str]] = None,
    manifest: bool = True,
    filename_pattern: str = _save.FILENAME_PATTERN,
    fsync: bool = False,
) -> List[str]:
    """:func:`safeload.torch.save_checkpoint` for arrays (split by ``nbytes``, as
    ``huggingface_hub.split_numpy_state_dict_into_shards``)."""
    return _save.save_checkpoint(_writer(), tensor_dict, directory,
                                 (lambda n: int(tensor_dict[n].nbytes), lambda n: None),
                                 max_shard_size=max_shard_size, metadata=metadata, manifest=manifest,
                                 filename_pattern=filename_pattern, fsync=fsync)


def load(data: bytes) -> Dict[str, np.ndarray]:
    """Loads arrays from the bytes of a whole file."""
    return {name: to_numpy(v["dtype"], v["shape"], v["data"], name) for name, v in deserialize(data)}


def load_file(filename: Union[str, "os.PathLike[str]"], *, backend: Optional[str] = None,
              storage_options: Optional[Dict[str, Any]] = None, verify: Any = None,
              verify_cache: Any = None) -> Dict[str, np.ndarray]:
    """Loads every array of ``filename`` (in parallel, into memory each array owns). backend,
    storage_options, verify, verify_cache: the reader's options (see
    :class:`safeload._options.Options`); under ``verify``, the file's SHA-256 is checked in the
    same pass before anything is returned."""
    with safe_open(filename, framework="np", backend=backend, storage_options=storage_options, verify=verify,
                   verify_cache=verify_cache) as f:
        return f.get_tensors()
