//! Conversion between the float dtypes F32, F16 and BF16, applied to little-endian bytes as
//! chunks land, so a BF16 checkpoint fills an F32 or F16 module without a BF16 copy.
//!
//! Results are bit-exact with torch's CPU `Tensor.to(dtype)` / `copy_` on x86 (AVX2 and AVX-512
//! kernels, torch 2.x; `tests/test_convert.py` checks every 16-bit pattern and millions of F32
//! ones against torch). Finite values and infinities round to nearest, ties to even, with
//! overflow to ±inf and gradual underflow (subnormals are kept; torch does not flush them on
//! CPU). NaNs are where torch's kernels differ from IEEE's "keep the payload" and from the
//! `half` crate, so each direction is spelled out:
//!
//! | from → to  | a NaN becomes                                            | torch's kernel      |
//! |------------|----------------------------------------------------------|---------------------|
//! | BF16 → F32 | the bits shifted: sign and payload kept, sNaN stays sNaN | 16-bit shift        |
//! | F16 → F32  | sign and payload kept, quiet bit set                     | F16C `vcvtph2ps`    |
//! | F32 → F16  | sign and top 10 payload bits kept, quiet bit set         | F16C `vcvtps2ph`    |
//! | F32 → BF16 | `0xFFFF`, whatever the sign or payload                   | ATen `cvtfp32_bf16` |
//! | F16 → BF16 | `0x7FC0`, whatever the sign or payload                   | `c10::BFloat16`     |
//! | BF16 → F16 | via F32, then as F32 → F16                               | F16C `vcvtps2ph`    |
//!
//! Two places where torch has no single answer, and this module follows its vector kernels:
//! torch's F16 → F32 converts the last `n % 8` elements of each thread's range one at a time
//! and writes `0x7FFF_FFFF` for any NaN there (so which NaNs get which bits depends on the
//! thread count); and torch built without vector kernels (`ATEN_CPU_CAPABILITY=default`, non-x86
//! CPUs) writes `0x7FC0` for F32 → BF16 and `0x7E00 | sign` for BF16 → F16. Only NaN bits
//! differ; every other value is the same everywhere.
//!
//! F16 ↔ F32 use the `half` crate's slice conversions (F16C instructions where the CPU has
//! them, an identical software path where it does not); the BF16 paths are written here
//! because `half` keeps NaN payloads that torch replaces. Everything is safe code: bytes are
//! staged through small stack blocks, so neither slice needs any alignment.

use std::fmt;

use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

use crate::format::dtype::Dtype;

/// Elements staged per block: big enough to amortize the per-call dispatch of `half`'s
/// F16C kernels, small enough (4 KiB of F32) to stay in L1.
const BLOCK: usize = 1024;

/// The bits of every NaN that torch's F32 → BF16 kernel produces.
const BF16_NAN_FROM_F32: u16 = 0xFFFF;
/// The bits of every NaN that torch's F16 → BF16 conversion produces.
const BF16_NAN_FROM_F16: u16 = 0x7FC0;

/// A conversion that cannot be done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConvertError {
    /// One of the dtypes is not F32, F16 or BF16.
    Unsupported { from: Dtype, to: Dtype },
    /// The source is not a whole number of elements, or the destination does not hold exactly
    /// as many elements as the source.
    Length {
        from: Dtype,
        to: Dtype,
        src_bytes: usize,
        dst_bytes: usize,
    },
}

impl fmt::Display for ConvertError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            ConvertError::Unsupported { from, to } => write!(
                f,
                "cannot convert {from} to {to}: only F32, F16 and BF16 convert to one another"
            ),
            ConvertError::Length {
                from,
                to,
                src_bytes,
                dst_bytes,
            } => {
                let (src_size, dst_size) = (element_size(from), element_size(to));
                if !src_bytes.is_multiple_of(src_size) {
                    write!(
                        f,
                        "cannot convert {src_bytes} bytes of {from} to {to}: not a whole number \
                         of {src_size}-byte elements"
                    )
                } else {
                    write!(
                        f,
                        "cannot convert {src_bytes} bytes of {from} ({} elements) into \
                         {dst_bytes} bytes of {to}: expected {} bytes",
                        src_bytes / src_size,
                        src_bytes / src_size * dst_size
                    )
                }
            }
        }
    }
}

impl std::error::Error for ConvertError {}

/// Whether `convert` handles this pair: both of F32, F16, BF16 (the same one is a copy).
pub fn supported(from: Dtype, to: Dtype) -> bool {
    is_float(from) && is_float(to)
}

/// The dtype a tensor of `from` is read as when a load asks for `asked` (`dtype=`): `asked`
/// where [`convert`] handles the pair (the floating-point ones), else `from` (the others keep
/// theirs): the one rule every converting read follows.
pub fn read_as(from: Dtype, asked: Option<Dtype>) -> Dtype {
    match asked {
        Some(to) if supported(from, to) => to,
        _ => from,
    }
}

/// Bytes that `src_bytes` of `from` take once converted to `to`; the caller sizes destinations
/// with it. An error if the pair is unsupported or `src_bytes` is not whole elements.
pub fn converted_len(from: Dtype, to: Dtype, src_bytes: usize) -> Result<usize, ConvertError> {
    if !supported(from, to) {
        return Err(ConvertError::Unsupported { from, to });
    }
    let (src_size, dst_size) = (element_size(from), element_size(to));
    if !src_bytes.is_multiple_of(src_size) {
        return Err(ConvertError::Length {
            from,
            to,
            src_bytes,
            dst_bytes: 0,
        });
    }
    Ok(src_bytes / src_size * dst_size)
}

/// Bytes per element of a dtype this module converts (2 or 4). Work split at multiples of
/// `element_size(from)` in the source and `element_size(to)` in the destination stays on
/// element boundaries, and each piece converts alone with the same result.
pub fn element_size(dtype: Dtype) -> usize {
    dtype.bits() / 8
}

/// Converts the little-endian elements of `src` (dtype `from`) into `dst` (dtype `to`), as
/// torch's `Tensor.to(to)` would. `dst` must hold exactly as many elements as `src`.
///
/// Sequential: the read engine calls it from its workers, one chunk each.
pub fn convert(from: Dtype, to: Dtype, src: &[u8], dst: &mut [u8]) -> Result<(), ConvertError> {
    check_lengths(from, to, src, dst)?;
    convert_unchecked(from, to, src, dst);
    Ok(())
}

fn check_lengths(from: Dtype, to: Dtype, src: &[u8], dst: &[u8]) -> Result<(), ConvertError> {
    let length_error = || ConvertError::Length {
        from,
        to,
        src_bytes: src.len(),
        dst_bytes: dst.len(),
    };
    match converted_len(from, to, src.len()) {
        Ok(expected) if expected == dst.len() => Ok(()),
        Ok(_) | Err(ConvertError::Length { .. }) => Err(length_error()),
        Err(unsupported) => Err(unsupported),
    }
}

/// The kernel for a supported pair on slices of matching lengths.
fn convert_unchecked(from: Dtype, to: Dtype, src: &[u8], dst: &mut [u8]) {
    match (from, to) {
        (Dtype::BF16, Dtype::F32) => bf16_to_f32(src, dst),
        (Dtype::F16, Dtype::F32) => f16_to_f32(src, dst),
        (Dtype::F32, Dtype::BF16) => f32_to_bf16(src, dst),
        (Dtype::F32, Dtype::F16) => f32_to_f16(src, dst),
        (Dtype::F16, Dtype::BF16) => f16_to_bf16(src, dst),
        (Dtype::BF16, Dtype::F16) => bf16_to_f16(src, dst),
        _ => dst.copy_from_slice(src), // from == to: `check_lengths` admits nothing else
    }
}

/// The dtypes `convert` converts between.
pub const CONVERTIBLE: [Dtype; 3] = [Dtype::F32, Dtype::F16, Dtype::BF16];

fn is_float(dtype: Dtype) -> bool {
    CONVERTIBLE.contains(&dtype)
}

/// torch's F32 → BF16 (ATen's vectorized `cvtfp32_bf16`): round to nearest even by integer
/// addition, which also carries overflow into infinity; any NaN becomes `0xFFFF`.
#[inline(always)]
fn bf16_from_f32_bits(bits: u32, nan: u16) -> u16 {
    let rounded = (bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16) as u16;
    if bits & 0x7FFF_FFFF > 0x7F80_0000 {
        nan
    } else {
        rounded
    }
}

/// Applies `f` to each element; the loop over fixed-size arrays vectorizes.
#[inline(always)]
fn map<const S: usize, const D: usize>(src: &[u8], dst: &mut [u8], f: impl Fn([u8; S]) -> [u8; D]) {
    let (src, _) = src.as_chunks::<S>();
    let (dst, _) = dst.as_chunks_mut::<D>();
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f(*s);
    }
}

fn bf16_to_f32(src: &[u8], dst: &mut [u8]) {
    map(src, dst, |b: [u8; 2]| {
        (u32::from(u16::from_le_bytes(b)) << 16).to_le_bytes()
    });
}

fn f32_to_bf16(src: &[u8], dst: &mut [u8]) {
    map(src, dst, |b: [u8; 4]| {
        bf16_from_f32_bits(u32::from_le_bytes(b), BF16_NAN_FROM_F32).to_le_bytes()
    });
}

/// Reads up to `BLOCK` little-endian 16-bit elements into `out`; returns how many.
#[inline(always)]
fn load_u16(src: &[u8], out: &mut [u16; BLOCK]) -> usize {
    let (src, _) = src.as_chunks::<2>();
    for (o, s) in out.iter_mut().zip(src) {
        *o = u16::from_le_bytes(*s);
    }
    src.len()
}

/// Reads up to `BLOCK` little-endian F32 elements into `out`; returns how many.
#[inline(always)]
fn load_f32(src: &[u8], out: &mut [f32; BLOCK]) -> usize {
    let (src, _) = src.as_chunks::<4>();
    for (o, s) in out.iter_mut().zip(src) {
        *o = f32::from_le_bytes(*s);
    }
    src.len()
}

#[inline(always)]
fn store_u16(values: &[u16], dst: &mut [u8]) {
    let (dst, _) = dst.as_chunks_mut::<2>();
    for (d, v) in dst.iter_mut().zip(values) {
        *d = v.to_le_bytes();
    }
}

#[inline(always)]
fn store_f32(values: &[f32], dst: &mut [u8]) {
    let (dst, _) = dst.as_chunks_mut::<4>();
    for (d, v) in dst.iter_mut().zip(values) {
        *d = v.to_le_bytes();
    }
}

fn f16_to_f32(src: &[u8], dst: &mut [u8]) {
    let mut bits = [0u16; BLOCK];
    let mut wide = [0f32; BLOCK];
    for (s, d) in src.chunks(2 * BLOCK).zip(dst.chunks_mut(4 * BLOCK)) {
        let n = load_u16(s, &mut bits);
        bits[..n]
            .reinterpret_cast::<f16>()
            .convert_to_f32_slice(&mut wide[..n]);
        store_f32(&wide[..n], d);
    }
}

fn f32_to_f16(src: &[u8], dst: &mut [u8]) {
    let mut wide = [0f32; BLOCK];
    let mut bits = [0u16; BLOCK];
    for (s, d) in src.chunks(4 * BLOCK).zip(dst.chunks_mut(2 * BLOCK)) {
        let n = load_f32(s, &mut wide);
        bits[..n]
            .reinterpret_cast_mut::<f16>()
            .convert_from_f32_slice(&wide[..n]);
        store_u16(&bits[..n], d);
    }
}

/// F16 → F32 exactly, then torch's scalar BF16 rounding (NaN → `0x7FC0`).
fn f16_to_bf16(src: &[u8], dst: &mut [u8]) {
    let mut bits = [0u16; BLOCK];
    let mut wide = [0f32; BLOCK];
    for (s, d) in src.chunks(2 * BLOCK).zip(dst.chunks_mut(2 * BLOCK)) {
        let n = load_u16(s, &mut bits);
        bits[..n]
            .reinterpret_cast::<f16>()
            .convert_to_f32_slice(&mut wide[..n]);
        for (b, w) in bits[..n].iter_mut().zip(&wide[..n]) {
            *b = bf16_from_f32_bits(w.to_bits(), BF16_NAN_FROM_F16);
        }
        store_u16(&bits[..n], d);
    }
}

/// BF16 → F32 exactly (a shift), then F32 → F16 as torch's F16C kernel rounds it.
fn bf16_to_f16(src: &[u8], dst: &mut [u8]) {
    let mut bits = [0u16; BLOCK];
    let mut wide = [0f32; BLOCK];
    for (s, d) in src.chunks(2 * BLOCK).zip(dst.chunks_mut(2 * BLOCK)) {
        let n = load_u16(s, &mut bits);
        for (w, b) in wide.iter_mut().zip(&bits[..n]) {
            *w = f32::from_bits(u32::from(*b) << 16);
        }
        bits[..n]
            .reinterpret_cast_mut::<f16>()
            .convert_from_f32_slice(&wide[..n]);
        store_u16(&bits[..n], d);
    }
}

#[cfg(test)]
mod tests {
    //! Checked against a reference written independently of the kernels: values computed in
    //! f64 arithmetic and rounded with `round_ties_even`, plus torch's NaN rules (module docs).

    use super::*;

    /// An IEEE binary interchange format: exponent and fraction widths.
    struct Format {
        exp_bits: u32,
        man_bits: u32,
    }

    const F16: Format = Format {
        exp_bits: 5,
        man_bits: 10,
    };
    const BF16: Format = Format {
        exp_bits: 8,
        man_bits: 7,
    };

    impl Format {
        fn bias(&self) -> i32 {
            (1 << (self.exp_bits - 1)) - 1
        }

        fn exp_mask(&self) -> u32 {
            ((1 << self.exp_bits) - 1) << self.man_bits
        }

        fn sign_bit(&self) -> u32 {
            1 << (self.exp_bits + self.man_bits)
        }

        fn is_nan(&self, bits: u32) -> bool {
            bits & self.exp_mask() == self.exp_mask() && bits & ((1 << self.man_bits) - 1) != 0
        }

        /// The value of a non-NaN pattern.
        fn value(&self, bits: u32) -> f64 {
            let sign = if bits & self.sign_bit() != 0 {
                -1.0
            } else {
                1.0
            };
            let exp = ((bits & self.exp_mask()) >> self.man_bits) as i32;
            let man = f64::from(bits & ((1 << self.man_bits) - 1));
            let max_exp = (1 << self.exp_bits) - 1;
            let magnitude = if exp == max_exp {
                f64::INFINITY
            } else if exp == 0 {
                man * 2f64.powi(1 - self.bias() - self.man_bits as i32)
            } else {
                (man + f64::from(1u32 << self.man_bits))
                    * 2f64.powi(exp - self.bias() - self.man_bits as i32)
            };
            sign * magnitude
        }

        /// The nearest pattern to a non-NaN value, ties to even, overflow to infinity.
        fn round(&self, value: f64) -> u32 {
            let sign = if value.is_sign_negative() {
                self.sign_bit()
            } else {
                0
            };
            let a = value.abs();
            if a == 0.0 {
                return sign;
            }
            let min_exp = 1 - self.bias();
            if a.is_infinite() {
                return sign | self.exp_mask();
            }
            let mut exp = (((a.to_bits() >> 52) & 0x7FF) as i32 - 1023).max(min_exp);
            let scaled = a * 2f64.powi(self.man_bits as i32 - exp);
            let mut man = scaled.round_ties_even() as u64;
            if man >= 2u64 << self.man_bits {
                man >>= 1;
                exp += 1;
            }
            if man < 1u64 << self.man_bits {
                return sign | man as u32; // subnormal (or zero)
            }
            let biased = exp + self.bias();
            if biased >= (1 << self.exp_bits) - 1 {
                return sign | self.exp_mask();
            }
            sign | (biased as u32) << self.man_bits | (man as u32 - (1 << self.man_bits))
        }
    }

    fn ref_f32_to_f16(x: u32) -> u16 {
        if f32::from_bits(x).is_nan() {
            return ((x >> 16) & 0x8000 | 0x7E00 | (x >> 13) & 0x3FF) as u16;
        }
        F16.round(f64::from(f32::from_bits(x))) as u16
    }

    fn ref_f32_to_bf16(x: u32) -> u16 {
        if f32::from_bits(x).is_nan() {
            return 0xFFFF;
        }
        BF16.round(f64::from(f32::from_bits(x))) as u16
    }

    fn ref_f16_to_f32(h: u16) -> u32 {
        let h = u32::from(h);
        if F16.is_nan(h) {
            return (h & 0x8000) << 16 | 0x7FC0_0000 | (h & 0x3FF) << 13;
        }
        (F16.value(h) as f32).to_bits()
    }

    fn ref_bf16_to_f32(b: u16) -> u32 {
        let b = u32::from(b);
        if BF16.is_nan(b) {
            return b << 16;
        }
        (BF16.value(b) as f32).to_bits()
    }

    fn ref_f16_to_bf16(h: u16) -> u16 {
        if F16.is_nan(u32::from(h)) {
            return 0x7FC0;
        }
        BF16.round(F16.value(u32::from(h))) as u16
    }

    fn ref_bf16_to_f16(b: u16) -> u16 {
        if BF16.is_nan(u32::from(b)) {
            return ref_f32_to_f16(u32::from(b) << 16);
        }
        F16.round(BF16.value(u32::from(b))) as u16
    }

    fn bytes16(values: &[u16]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    fn bytes32(values: &[u32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    fn run(from: Dtype, to: Dtype, src: &[u8]) -> Vec<u8> {
        let mut dst = vec![0xA5; converted_len(from, to, src.len()).unwrap()];
        convert(from, to, src, &mut dst).unwrap();
        dst
    }

    fn words16(bytes: &[u8]) -> Vec<u16> {
        bytes
            .as_chunks::<2>()
            .0
            .iter()
            .map(|b| u16::from_le_bytes(*b))
            .collect()
    }

    fn words32(bytes: &[u8]) -> Vec<u32> {
        bytes
            .as_chunks::<4>()
            .0
            .iter()
            .map(|b| u32::from_le_bytes(*b))
            .collect()
    }

    fn check16(from: Dtype, to: Dtype, inputs: &[u32], reference: impl Fn(u32) -> u16) {
        let src = if from == Dtype::F32 {
            bytes32(inputs)
        } else {
            bytes16(&inputs.iter().map(|&x| x as u16).collect::<Vec<_>>())
        };
        let got = words16(&run(from, to, &src));
        for (&x, &g) in inputs.iter().zip(&got) {
            assert_eq!(g, reference(x), "{from} {x:#x} -> {to}: got {g:#06x}");
        }
    }

    fn every_16_bit_pattern() -> Vec<u16> {
        (0..=u16::MAX).collect()
    }

    /// splitmix64: reproducible random bits without a dependency.
    fn random_u32s(n: usize, mut state: u64) -> Vec<u32> {
        (0..n)
            .map(|_| {
                state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                (z ^ (z >> 31)) as u32
            })
            .collect()
    }

    /// F32 patterns that test the narrowing: every sign and exponent with the bits below each
    /// target's last kept bit at and around the tie, random bits above; the extremes; NaNs
    /// with payloads; and uniformly random patterns.
    fn f32_test_patterns() -> Vec<u32> {
        let mut out = vec![
            0,
            0x8000_0000,
            1,
            0x8000_0001,
            0x007F_FFFF,
            0x0080_0000,
            0x7F7F_FFFF,
            0xFF7F_FFFF,
            0x7F80_0000,
            0xFF80_0000,
            0x7FC0_0000,
            0xFFC0_0000,
            0x7F80_0001,
            0xFF80_0001,
            0x7FBF_FFFF,
            0x7FFF_FFFF,
            0xFFFF_FFFF,
            0x7FC1_2345,
            0x7F80_2000,
            0x7F80_1FFF,
            // F16: max finite, the overflow tie (65520) and its neighbours, min subnormal ties.
            0x477F_E000,
            0x477F_EFFF,
            0x477F_F000,
            0x477F_F001,
            0x3300_0000,
            0x3300_0001,
            0x32FF_FFFF,
            0x3380_0000,
            0x33C0_0000,
            0x387F_C000,
            0x387F_E000,
            0x387F_F000,
        ];
        let random = random_u32s(1 << 20, 42);
        let lows16 = [0u32, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF];
        let lows13 = [0u32, 1, 0x0FFF, 0x1000, 0x1001, 0x1FFF];
        let mut r = random.iter().cycle();
        for sign_exp in 0..512u32 {
            for _ in 0..32 {
                let high = *r.next().unwrap() & 0x007F_FFFF;
                for low in lows16 {
                    out.push(sign_exp << 23 | (high & !0xFFFF) | low);
                }
                for low in lows13 {
                    out.push(sign_exp << 23 | (high & !0x1FFF) | low);
                }
            }
        }
        out.extend(random);
        out
    }

    #[test]
    fn every_16_bit_pattern_widens_to_f32_exactly() {
        let all = every_16_bit_pattern();
        let f16 = words32(&run(Dtype::F16, Dtype::F32, &bytes16(&all)));
        let bf16 = words32(&run(Dtype::BF16, Dtype::F32, &bytes16(&all)));
        for (i, &x) in all.iter().enumerate() {
            assert_eq!(f16[i], ref_f16_to_f32(x), "F16 {x:#06x}");
            assert_eq!(bf16[i], ref_bf16_to_f32(x), "BF16 {x:#06x}");
        }
    }

    #[test]
    fn every_16_bit_pattern_converts_between_f16_and_bf16() {
        let all: Vec<u32> = every_16_bit_pattern().into_iter().map(u32::from).collect();
        check16(Dtype::F16, Dtype::BF16, &all, |x| ref_f16_to_bf16(x as u16));
        check16(Dtype::BF16, Dtype::F16, &all, |x| ref_bf16_to_f16(x as u16));
    }

    #[test]
    fn every_16_bit_pattern_survives_a_round_trip_through_f32() {
        for (dtype, format) in [(Dtype::F16, &F16), (Dtype::BF16, &BF16)] {
            let all = every_16_bit_pattern();
            let wide = run(dtype, Dtype::F32, &bytes16(&all));
            let back = words16(&run(Dtype::F32, dtype, &wide));
            for (&x, &y) in all.iter().zip(&back) {
                if !format.is_nan(u32::from(x)) {
                    assert_eq!(x, y, "{dtype} {x:#06x}");
                }
            }
        }
    }

    #[test]
    fn f32_narrows_to_f16_and_bf16_like_the_reference() {
        let patterns = f32_test_patterns();
        check16(Dtype::F32, Dtype::F16, &patterns, ref_f32_to_f16);
        check16(Dtype::F32, Dtype::BF16, &patterns, ref_f32_to_bf16);
    }

    #[test]
    fn torch_results_pinned() {
        // Measured with torch 2.15 on AVX-512 and AVX2 (`tensor.to(dtype)`).
        let f32_nans = [
            0x7FC0_0000,
            0xFFC0_0000,
            0x7F80_0001,
            0xFF80_0001,
            0x7FC1_2345,
        ];
        check16(Dtype::F32, Dtype::F16, &f32_nans, |x| match x {
            0x7FC1_2345 => 0x7E09,
            x if x >> 31 == 1 => 0xFE00,
            _ => 0x7E00,
        });
        check16(Dtype::F32, Dtype::BF16, &f32_nans, |_| 0xFFFF);
        check16(
            Dtype::F16,
            Dtype::BF16,
            &[0x7C01, 0xFC01, 0x0001],
            |x| match x {
                0x0001 => 0x3380,
                _ => 0x7FC0,
            },
        );
        check16(
            Dtype::BF16,
            Dtype::F16,
            &[0x7F81, 0xFF81, 0x7FD5],
            |x| match x {
                0x7F81 => 0x7E08,
                0xFF81 => 0xFE08,
                _ => 0x7EA8,
            },
        );
        let bf16 = words32(&run(Dtype::BF16, Dtype::F32, &bytes16(&[0x7F81, 0x0001])));
        assert_eq!(bf16, [0x7F81_0000, 0x0001_0000]);
        let f16 = words32(&run(Dtype::F16, Dtype::F32, &bytes16(&[0x7C01, 0x8001])));
        assert_eq!(f16, [0x7FC0_2000, 0xB380_0000]);
    }

    #[test]
    fn pieces_split_on_element_boundaries_convert_like_the_whole() {
        let values = f32_test_patterns();
        let floats = [Dtype::F32, Dtype::F16, Dtype::BF16];
        for from in floats {
            let size = element_size(from);
            let src: Vec<u8> = bytes32(&values[..5000])
                .into_iter()
                .take(size * 3001)
                .collect();
            for to in floats {
                let whole = run(from, to, &src);
                let mut pieces = Vec::new();
                for piece in src.chunks(size * 7) {
                    pieces.extend(run(from, to, piece));
                }
                assert_eq!(whole, pieces, "{from} -> {to}");
            }
        }
    }

    #[test]
    fn identity_copies_bytes() {
        let src: Vec<u8> = (0..=255).collect();
        for dtype in [Dtype::F32, Dtype::F16, Dtype::BF16] {
            assert_eq!(run(dtype, dtype, &src), src);
        }
    }

    #[test]
    fn empty_source_converts_to_empty_destination() {
        assert_eq!(run(Dtype::BF16, Dtype::F32, &[]), Vec::<u8>::new());
    }

    #[test]
    fn supported_pairs_are_the_float_ones() {
        for from in Dtype::ALL {
            for to in Dtype::ALL {
                let floats = [Dtype::F32, Dtype::F16, Dtype::BF16];
                assert_eq!(
                    supported(from, to),
                    floats.contains(&from) && floats.contains(&to)
                );
            }
        }
    }

    #[test]
    fn errors_say_what_was_expected() {
        let mut dst = [0u8; 8];
        let err = convert(Dtype::F32, Dtype::I32, &[0; 4], &mut dst[..4]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot convert F32 to I32: only F32, F16 and BF16 convert to one another"
        );
        let err = convert(Dtype::BF16, Dtype::F32, &[0; 3], &mut dst[..6]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot convert 3 bytes of BF16 to F32: not a whole number of 2-byte elements"
        );
        let err = convert(Dtype::BF16, Dtype::F32, &[0; 4], &mut dst[..4]).unwrap_err();
        assert_eq!(
            err,
            ConvertError::Length {
                from: Dtype::BF16,
                to: Dtype::F32,
                src_bytes: 4,
                dst_bytes: 4
            }
        );
        assert_eq!(
            err.to_string(),
            "cannot convert 4 bytes of BF16 (2 elements) into 4 bytes of F32: expected 8 bytes"
        );
        assert_eq!(converted_len(Dtype::F32, Dtype::BF16, 12), Ok(6));
        assert!(converted_len(Dtype::F32, Dtype::BF16, 6).is_err());
    }

    /// Every F32 pattern against the reference (about a minute per direction in release:
    /// `cargo test --release --lib convert::tests::every_f32 -- --ignored`).
    #[test]
    #[ignore]
    fn every_f32_pattern_narrows_like_the_reference() {
        let step = 1u64 << 24;
        for start in (0..1u64 << 32).step_by(step as usize) {
            let inputs: Vec<u32> = (start..start + step).map(|x| x as u32).collect();
            check16(Dtype::F32, Dtype::F16, &inputs, ref_f32_to_f16);
            check16(Dtype::F32, Dtype::BF16, &inputs, ref_f32_to_bf16);
        }
    }

    /// Single-thread throughput of each pair on 256 MiB of source:
    /// `cargo test --release --lib convert::tests::throughput -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn throughput() {
        const SOURCE: usize = 256 << 20;
        let floats = [Dtype::F32, Dtype::F16, Dtype::BF16];
        let src: Vec<u8> = bytes32(&random_u32s(SOURCE / 4, 7));
        for from in floats {
            for to in floats {
                let mut dst = vec![0u8; converted_len(from, to, SOURCE).unwrap()];
                convert(from, to, &src, &mut dst).unwrap(); // fault the pages in
                let best = (0..10)
                    .map(|_| {
                        let start = std::time::Instant::now();
                        convert(from, to, &src, &mut dst).unwrap();
                        start.elapsed().as_secs_f64()
                    })
                    .fold(f64::INFINITY, f64::min);
                let gib = |bytes: usize| bytes as f64 / f64::from(1 << 30) / best;
                println!(
                    "{from:>4} -> {to:<4} read {:5.2} GiB/s, write {:5.2} GiB/s, {:4.0} Melem/s",
                    gib(SOURCE),
                    gib(dst.len()),
                    (SOURCE / element_size(from)) as f64 / best / 1e6,
                );
            }
        }
    }
}
