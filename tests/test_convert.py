"""dtype conversion on the way (src/format/convert.rs) against torch's CPU ``Tensor.to``, bit for bit:
every F16 and BF16 pattern, and millions of F32 patterns (ties at every rounding position,
overflow, subnormals, signed zeros, infinities, NaNs with payloads)."""

from __future__ import annotations

from typing import Dict

import numpy as np
import pytest
import torch

from conftest import require_test_helpers

convert_bytes = require_test_helpers().convert_bytes  # the module is skipped without the test helpers

FLOATS = ["F32", "F16", "BF16"]
TORCH: Dict[str, torch.dtype] = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
BITS: Dict[str, np.dtype] = {"F32": np.dtype("<u4"), "F16": np.dtype("<u2"), "BF16": np.dtype("<u2")}
SIGNED = {4: np.int32, 2: np.int16}
EXP_MASK = {"F32": 0x7F80_0000, "F16": 0x7C00, "BF16": 0x7F80}
MAN_MASK = {"F32": 0x007F_FFFF, "F16": 0x03FF, "BF16": 0x007F}

# torch's vectorized x86 kernels (what src/format/convert.rs matches) decide the bits of NaNs; built
# without them (ATEN_CPU_CAPABILITY=default, other CPUs) torch writes other NaN bits, so there
# only NaN-ness is compared for NaN results.
VECTOR_KERNELS = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
# One exception even there: torch converts F16 -> F32 8 at a time and the last n % 8 elements of
# each thread's range one at a time, and that scalar path writes 0x7FFFFFFF for every NaN. Where
# that lands depends on the thread count, so torch runs on one thread here and the tails of F16
# -> F32 compare NaN-ness only (safeload writes what the vector body does, everywhere).
F16_TO_F32_BLOCK = 8


def is_nan(bits: np.ndarray, dtype: str) -> np.ndarray:
    return ((bits & EXP_MASK[dtype]) == EXP_MASK[dtype]) & ((bits & MAN_MASK[dtype]) != 0)


def with_torch(bits: np.ndarray, src: str, dst: str) -> np.ndarray:
    signed = bits.astype(BITS[src]).view(SIGNED[BITS[src].itemsize])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = torch.from_numpy(signed).view(TORCH[src]).to(TORCH[dst])
    finally:
        torch.set_num_threads(threads)
    return out.view(torch.int32 if dst == "F32" else torch.int16).numpy().view(BITS[dst])


def with_safeload(bits: np.ndarray, src: str, dst: str) -> np.ndarray:
    assert convert_bytes is not None
    return np.frombuffer(convert_bytes(bits.astype(BITS[src]).tobytes(), src, dst), dtype=BITS[dst])


def assert_same_bits(bits: np.ndarray, src: str, dst: str) -> None:
    want, got = with_torch(bits, src, dst), with_safeload(bits, src, dst)
    assert got.shape == want.shape
    loose = is_nan(want, dst)  # where only NaN-ness is compared
    if VECTOR_KERNELS:
        tail = bits.size % F16_TO_F32_BLOCK if (src, dst) == ("F16", "F32") else 0
        loose[: bits.size - tail] = False
    if loose.any():
        assert is_nan(got[loose], dst).all()
        bits, want, got = bits[~loose], want[~loose], got[~loose]
    differ = np.flatnonzero(got != want)
    if differ.size:
        i = differ[0]
        pytest.fail(f"{src} -> {dst}: {differ.size} of {bits.size} differ, first {int(bits[i]):#x}: "
                    f"torch {int(want[i]):#x}, safeload {int(got[i]):#x}")


def every_16_bit_pattern() -> np.ndarray:
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def f32_patterns() -> np.ndarray:
    rng = np.random.default_rng(0)
    sign_exp = np.arange(512, dtype=np.uint32) << 23
    parts = [np.array([
        0, 0x8000_0000, 1, 0x8000_0001, 0x007F_FFFF, 0x0080_0000, 0x7F7F_FFFF, 0xFF7F_FFFF,
        0x7F80_0000, 0xFF80_0000, 0x7FC0_0000, 0xFFC0_0000, 0x7F80_0001, 0xFF80_0001, 0x7FBF_FFFF,
        0x7FFF_FFFF, 0xFFFF_FFFF, 0x7FC1_2345, 0x477F_E000, 0x477F_EFFF, 0x477F_F000, 0x477F_F001,
        0xC77F_F000, 0x4780_0000, 0x3300_0000, 0x3300_0001, 0x32FF_FFFF, 0x3380_0000, 0x387F_E000,
    ], dtype=np.uint32)]
    # At and around the tie of every rounding position F16 (normal: bit 12; subnormal: bits 13
    # to 23) and BF16 (bit 15) can have, for every sign and exponent, random bits above.
    for bit in range(12, 24):
        tie = np.uint32(1 << bit)
        high = rng.integers(0, 1 << 23, size=(512, 32), dtype=np.uint32) & ~np.uint32((tie << 1) - 1)
        for low in (tie - 1, tie, tie + 1, np.uint32(0), (tie << 1) - 1):
            parts.append((sign_exp[:, None] | high | low).ravel())
    # Every F16 and BF16 value, widened, plus/minus a little: the neighbourhood of each result.
    for dtype, shift in (("F16", 13), ("BF16", 16)):
        wide = with_torch(every_16_bit_pattern(), dtype, "F32")
        for delta in (1, (1 << (shift - 1)) - 1, 1 << (shift - 1), (1 << (shift - 1)) + 1):
            parts += [wide + np.uint32(delta), wide - np.uint32(delta)]
    nan_payloads = rng.integers(1, 1 << 23, size=200_000, dtype=np.uint32)
    parts.append(nan_payloads | 0x7F80_0000 | (rng.integers(0, 2, size=200_000, dtype=np.uint32) << 31))
    parts.append(rng.integers(0, 1 << 32, size=2_000_000, dtype=np.uint32))
    # Magnitudes around F16's range (2^-26 .. 2^18), where its rounding and overflow happen.
    exps = rng.integers(101, 145, size=1_000_000, dtype=np.uint32)
    parts.append(rng.integers(0, 1 << 23, size=1_000_000, dtype=np.uint32) | (exps << 23)
                 | (rng.integers(0, 2, size=1_000_000, dtype=np.uint32) << 31))
    return np.concatenate(parts)


@pytest.mark.parametrize("src", ["F16", "BF16"])
@pytest.mark.parametrize("dst", FLOATS)
def test_every_16_bit_pattern(src: str, dst: str) -> None:
    assert_same_bits(every_16_bit_pattern(), src, dst)


@pytest.mark.parametrize("dst", FLOATS)
def test_f32_patterns(dst: str) -> None:
    assert_same_bits(f32_patterns(), "F32", dst)


def test_bf16_checkpoint_into_f32_module_is_exact() -> None:
    # The target, whatever torch's NaN kernels: a shift, payloads and sNaNs included.
    bits = every_16_bit_pattern()
    got = with_safeload(bits, "BF16", "F32")
    assert (got == bits.astype(np.uint32) << 16).all()
    assert (got == with_torch(bits, "BF16", "F32")).all()


@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", FLOATS)
def test_short_and_odd_lengths(src: str, dst: str) -> None:
    # Torch's kernels take other paths for short tensors and tails; so does the staging here.
    rng = np.random.default_rng(1)
    patterns = f32_patterns() if src == "F32" else every_16_bit_pattern()
    for n in [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 1023, 1024, 1025, 4099]:
        assert_same_bits(rng.choice(patterns, size=n), src, dst)


def test_nan_bits_pinned() -> None:
    if not VECTOR_KERNELS:
        pytest.skip("torch's scalar kernels write other NaN bits")
    f32_nans = np.array([0x7FC0_0000, 0xFFC0_0000, 0x7F80_0001, 0x7FC1_2345], dtype=np.uint32)
    assert with_safeload(f32_nans, "F32", "F16").tolist() == [0x7E00, 0xFE00, 0x7E00, 0x7E09]
    assert with_safeload(f32_nans, "F32", "BF16").tolist() == [0xFFFF] * 4
    assert with_safeload(np.array([0x7C01, 0xFC01]), "F16", "BF16").tolist() == [0x7FC0] * 2
    assert with_safeload(np.array([0x7F81, 0xFF81]), "BF16", "F16").tolist() == [0x7E08, 0xFE08]
    assert with_safeload(np.array([0x7C01]), "F16", "F32").tolist() == [0x7FC0_2000]


def test_errors() -> None:
    assert convert_bytes is not None
    with pytest.raises(ValueError, match='unknown dtype "I32": expected F32, F16 or BF16'):
        convert_bytes(b"\0" * 4, "I32", "F32")
    with pytest.raises(ValueError, match="cannot convert 3 bytes of BF16 to F32: not a whole number of 2-byte"):
        convert_bytes(b"\0" * 3, "BF16", "F32")
    assert convert_bytes(b"", "F16", "BF16") == b""
    assert convert_bytes(b"\x01\x02\x03\x04", "F32", "F32") == b"\x01\x02\x03\x04"
