//! The element types of the safetensors format: their codes, sizes and write order.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Every dtype code the format defines.
///
/// The declaration order is the format's own: `safetensors` writes tensors sorted by this
/// order, largest first, and byte-identical files need the same order here (derived `Ord`).
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Dtype {
    BOOL,
    F4,
    F6_E2M3,
    F6_E3M2,
    U8,
    I8,
    F8_E5M2,
    F8_E4M3,
    F8_E8M0,
    F8_E4M3FNUZ,
    F8_E5M2FNUZ,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    C64,
    F64,
    I64,
    U64,
}

impl Dtype {
    /// All codes, in declaration order.
    pub const ALL: [Dtype; 22] = [
        Dtype::BOOL,
        Dtype::F4,
        Dtype::F6_E2M3,
        Dtype::F6_E3M2,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8_E5M2,
        Dtype::F8_E4M3,
        Dtype::F8_E8M0,
        Dtype::F8_E4M3FNUZ,
        Dtype::F8_E5M2FNUZ,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::C64,
        Dtype::F64,
        Dtype::I64,
        Dtype::U64,
    ];

    /// Size of one element in bits (4 and 6 for the packed micro-float codes).
    pub fn bits(self) -> usize {
        match self {
            Dtype::F4 => 4,
            Dtype::F6_E2M3 | Dtype::F6_E3M2 => 6,
            Dtype::BOOL
            | Dtype::U8
            | Dtype::I8
            | Dtype::F8_E5M2
            | Dtype::F8_E4M3
            | Dtype::F8_E8M0
            | Dtype::F8_E4M3FNUZ
            | Dtype::F8_E5M2FNUZ => 8,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 16,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 32,
            Dtype::C64 | Dtype::F64 | Dtype::I64 | Dtype::U64 => 64,
        }
    }

    /// The code as written in headers (`"F32"`, `"F8_E4M3"` ...).
    pub fn code(self) -> &'static str {
        match self {
            Dtype::BOOL => "BOOL",
            Dtype::F4 => "F4",
            Dtype::F6_E2M3 => "F6_E2M3",
            Dtype::F6_E3M2 => "F6_E3M2",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8_E5M2 => "F8_E5M2",
            Dtype::F8_E4M3 => "F8_E4M3",
            Dtype::F8_E8M0 => "F8_E8M0",
            Dtype::F8_E4M3FNUZ => "F8_E4M3FNUZ",
            Dtype::F8_E5M2FNUZ => "F8_E5M2FNUZ",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::C64 => "C64",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
        }
    }

    /// How the frameworks name this dtype: the one table the binding and the Python package
    /// use (torch dtype attributes, numpy's or ml_dtypes' names, DLPack's element type).
    pub fn names(self) -> Names {
        // DLPack codes: kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLComplex 5, kDLBool 6,
        // and DLPack 1.1's fp8 codes (kDLFloat8_e4m3fn 10 ... kDLFloat8_e8m0fnu 14).
        let (torch, numpy, dlpack): (Option<&str>, Option<&str>, Option<u8>) = match self {
            Dtype::BOOL => (Some("bool"), Some("bool"), Some(6)),
            Dtype::U8 => (Some("uint8"), Some("uint8"), Some(1)),
            Dtype::I8 => (Some("int8"), Some("int8"), Some(0)),
            Dtype::I16 => (Some("int16"), Some("int16"), Some(0)),
            Dtype::U16 => (Some("uint16"), Some("uint16"), Some(1)),
            Dtype::F16 => (Some("float16"), Some("float16"), Some(2)),
            Dtype::BF16 => (Some("bfloat16"), Some("bfloat16"), Some(4)),
            Dtype::I32 => (Some("int32"), Some("int32"), Some(0)),
            Dtype::U32 => (Some("uint32"), Some("uint32"), Some(1)),
            Dtype::F32 => (Some("float32"), Some("float32"), Some(2)),
            Dtype::C64 => (Some("complex64"), Some("complex64"), Some(5)),
            Dtype::F64 => (Some("float64"), Some("float64"), Some(2)),
            Dtype::I64 => (Some("int64"), Some("int64"), Some(0)),
            Dtype::U64 => (Some("uint64"), Some("uint64"), Some(1)),
            Dtype::F8_E5M2 => (Some("float8_e5m2"), Some("float8_e5m2"), Some(12)),
            Dtype::F8_E4M3 => (Some("float8_e4m3fn"), Some("float8_e4m3fn"), Some(10)),
            Dtype::F8_E8M0 => (Some("float8_e8m0fnu"), Some("float8_e8m0fnu"), Some(14)),
            Dtype::F8_E4M3FNUZ => (Some("float8_e4m3fnuz"), Some("float8_e4m3fnuz"), Some(11)),
            Dtype::F8_E5M2FNUZ => (Some("float8_e5m2fnuz"), Some("float8_e5m2fnuz"), Some(13)),
            Dtype::F4 => (Some("float4_e2m1fn_x2"), None, None),
            Dtype::F6_E2M3 | Dtype::F6_E3M2 => (None, None, None),
        };
        Names {
            torch,
            numpy,
            // numpy itself has no bfloat16 or fp8: the ml_dtypes package provides them.
            ml_dtypes: matches!(self, Dtype::BF16) || self.is_fp8(),
            dlpack: dlpack.map(|code| (code, self.bits() as u8)),
        }
    }

    fn is_fp8(self) -> bool {
        matches!(
            self,
            Dtype::F8_E5M2
                | Dtype::F8_E4M3
                | Dtype::F8_E8M0
                | Dtype::F8_E4M3FNUZ
                | Dtype::F8_E5M2FNUZ
        )
    }

    /// The dtype torch names `name` (`"float32"`, `"float8_e4m3fn"` ...).
    pub fn from_torch_name(name: &str) -> Option<Dtype> {
        Dtype::ALL
            .into_iter()
            .find(|d| d.names().torch == Some(name))
    }

    /// The dtype of a DLPack element type (code, bits), where the format has one.
    pub fn from_dlpack(code: u8, bits: u8) -> Option<Dtype> {
        Dtype::ALL
            .into_iter()
            .find(|d| d.names().dlpack == Some((code, bits)))
    }

    /// Parses a header code; `None` for anything the format does not define.
    pub fn from_code(code: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.code() == code)
    }
}

/// A dtype's names in the frameworks (see [`Dtype::names`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Names {
    /// `torch.<name>`; None where torch has no such dtype (F6).
    pub torch: Option<&'static str>,
    /// numpy's dtype name, or ml_dtypes' where `ml_dtypes` is set; None: no numpy dtype.
    pub numpy: Option<&'static str>,
    pub ml_dtypes: bool,
    /// DLPack's (type code, bits): None for fp8 and the packed floats, which it lacks.
    pub dlpack: Option<(u8, u8)>,
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for d in Dtype::ALL {
            assert_eq!(Dtype::from_code(d.code()), Some(d));
            let json = serde_json::to_string(&d).unwrap();
            assert_eq!(json, format!("\"{}\"", d.code()));
        }
        assert_eq!(Dtype::from_code("f32"), None);
    }

    #[test]
    fn names_round_trip_and_agree_with_sizes() {
        for d in Dtype::ALL {
            let names = d.names();
            if let Some(t) = names.torch {
                assert_eq!(Dtype::from_torch_name(t), Some(d));
            }
            if let Some((code, bits)) = names.dlpack {
                assert_eq!(usize::from(bits), d.bits());
                assert_eq!(Dtype::from_dlpack(code, bits), Some(d));
            }
            assert!(!names.ml_dtypes || names.numpy.is_some());
        }
        assert!(Dtype::BF16.names().ml_dtypes && !Dtype::F16.names().ml_dtypes);
        assert_eq!(Dtype::F4.names().numpy, None);
        assert_eq!(Dtype::F6_E2M3.names().torch, None);
    }

    #[test]
    fn all_is_in_declaration_order() {
        let mut sorted = Dtype::ALL;
        sorted.sort();
        assert_eq!(sorted, Dtype::ALL);
    }
}
