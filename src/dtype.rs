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

    /// Parses a header code; `None` for anything the format does not define.
    pub fn from_code(code: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.code() == code)
    }
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
    fn all_is_in_declaration_order() {
        let mut sorted = Dtype::ALL;
        sorted.sort();
        assert_eq!(sorted, Dtype::ALL);
    }
}
