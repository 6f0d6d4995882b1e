//! Header parsing and validation: (header bytes, file length) -> [`Header`]. No I/O here.
//!
//! Every rule of the format is enforced with checked arithmetic before anything is sized by a
//! header field, so a header claiming a 2^60-byte tensor is rejected, never allocated.

use std::collections::{HashMap, HashSet};
use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, MapAccess, Visitor};

use crate::format::dtype::Dtype;

/// Upper bound on the JSON header, as in safetensors.
pub const MAX_HEADER_SIZE: u64 = 100_000_000;
/// The little-endian u64 that starts every file.
pub const PREFIX_LEN: u64 = 8;

/// Why a header was rejected. Display texts follow safetensors 0.8, with tensor names added.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderError {
    HeaderTooSmall,
    HeaderTooLarge,
    InvalidHeaderLength,
    InvalidUtf8(String),
    InvalidJson(String),
    DuplicateKey(String),
    InvalidOffset(String),
    /// name, dtype, shape, bytes the shape needs, bytes the offsets hold
    SizeMismatch(String, Dtype, Vec<usize>, u128, usize),
    Overflow(String),
    Misaligned(String),
    IncompleteBuffer {
        covered: u64,
        file_len: u64,
    },
}

impl std::error::Error for HeaderError {}

impl fmt::Display for HeaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HeaderError::HeaderTooSmall => f.write_str("header too small"),
            HeaderError::HeaderTooLarge => f.write_str("header too large"),
            HeaderError::InvalidHeaderLength => f.write_str("invalid header length"),
            HeaderError::InvalidUtf8(e) => write!(f, "invalid UTF-8 in header: {e}"),
            HeaderError::InvalidJson(e) => write!(f, "invalid JSON in header: {e}"),
            HeaderError::DuplicateKey(name) => {
                write!(f, "duplicate tensor name `{name}` in header")
            }
            HeaderError::InvalidOffset(name) => write!(f, "invalid offset for tensor `{name}`"),
            HeaderError::SizeMismatch(name, dtype, shape, need, have) => write!(
                f,
                "invalid shape, data type, or offset for tensor `{name}`: {dtype} {shape:?} \
                 needs {need} bytes, data_offsets span {have}"
            ),
            HeaderError::Overflow(name) => write!(
                f,
                "overflow computing buffer size from shape and/or element type of tensor `{name}`"
            ),
            HeaderError::Misaligned(name) => write!(
                f,
                "The slice is slicing for subbytes dtypes, and the slice does not end up at a \
                 byte boundary, this is invalid. (tensor `{name}`)"
            ),
            HeaderError::IncompleteBuffer { covered, file_len } => write!(
                f,
                "incomplete metadata, file not fully covered (tensors end at byte {covered}, \
                 file has {file_len})"
            ),
        }
    }
}

/// One tensor's entry, offsets relative to the start of the data area.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub begin: usize,
    pub end: usize,
}

impl TensorInfo {
    pub fn nbytes(&self) -> usize {
        self.end - self.begin
    }
}

/// A validated header: tensors in file (offset) order, metadata in header order.
#[derive(Debug, Clone)]
pub struct Header {
    /// N, the JSON length from the prefix.
    pub json_len: u64,
    pub metadata: Option<Vec<(String, String)>>,
    pub tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
}

impl Header {
    /// Absolute file offset where tensor data starts.
    pub fn data_start(&self) -> u64 {
        PREFIX_LEN + self.json_len
    }

    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// Position of tensor `name` in [`Header::tensors`] (file order).
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }

    /// Names sorted as `keys()` returns them.
    pub fn sorted_names(&self) -> Vec<&str> {
        let names = keys_order(&self.tensors).into_iter();
        names.map(|i| self.tensors[i].name.as_str()).collect()
    }

    /// Bytes of tensor data.
    pub fn data_len(&self) -> u64 {
        self.tensors.last().map_or(0, |t| t.end as u64)
    }
}

/// Indices of `tensors` in the order `keys()` gives their names (byte order, as safetensors sorts).
pub fn keys_order(tensors: &[TensorInfo]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_unstable_by(|&a, &b| tensors[a].name.cmp(&tensors[b].name));
    order
}

/// Reads the 8-byte prefix; checks N against the cap and the file length.
pub fn header_len(prefix: &[u8], file_len: u64) -> Result<u64, HeaderError> {
    let bytes: [u8; 8] = prefix
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or(HeaderError::HeaderTooSmall)?;
    if file_len < PREFIX_LEN {
        return Err(HeaderError::HeaderTooSmall);
    }
    let n = u64::from_le_bytes(bytes);
    if n > MAX_HEADER_SIZE {
        return Err(HeaderError::HeaderTooLarge);
    }
    if n + PREFIX_LEN > file_len {
        return Err(HeaderError::InvalidHeaderLength);
    }
    Ok(n)
}

/// Parses and validates the JSON header of a file of `file_len` bytes.
pub fn parse(json: &[u8], file_len: u64) -> Result<Header, HeaderError> {
    let json_len = json.len() as u64;
    let text = std::str::from_utf8(json).map_err(|e| HeaderError::InvalidUtf8(e.to_string()))?;
    let raw: RawHeader = serde_json::from_str(text).map_err(|e| {
        // A second `__metadata__` is refused inside serde; surface it as its own rule (tensor
        // names given twice are found below, by the name index).
        let message = e.to_string();
        match message.strip_prefix(DUPLICATE_MARKER) {
            Some(rest) => HeaderError::DuplicateKey(
                rest.split(DUPLICATE_END).next().unwrap_or("").to_string(),
            ),
            None => HeaderError::InvalidJson(message),
        }
    })?;
    let mut tensors = raw.tensors;
    tensors.sort_by_key(|t| (t.begin, t.end));
    // The name index is also the duplicate check (one hash of each name, not two): a name seen
    // twice is refused before the layout is looked at, as when the JSON is read.
    let mut index = HashMap::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        if index.insert(t.name.clone(), i).is_some() {
            return Err(HeaderError::DuplicateKey(t.name.clone()));
        }
    }
    let covered = validate_layout(&tensors)?;
    if covered.checked_add(PREFIX_LEN + json_len) != Some(file_len) {
        return Err(HeaderError::IncompleteBuffer {
            covered: covered.saturating_add(PREFIX_LEN + json_len),
            file_len,
        });
    }
    Ok(Header {
        json_len,
        metadata: raw.metadata,
        tensors,
        index,
    })
}

/// Checks offsets are contiguous from 0 and each span matches shape x dtype.
/// Returns the end of the last tensor.
fn validate_layout(tensors: &[TensorInfo]) -> Result<u64, HeaderError> {
    let mut expected_begin = 0usize;
    for t in tensors {
        if t.begin != expected_begin || t.end < t.begin {
            return Err(HeaderError::InvalidOffset(t.name.clone()));
        }
        expected_begin = t.end;
        let bytes = byte_size(t.dtype, &t.shape).map_err(|e| match e {
            SizeError::Overflow => HeaderError::Overflow(t.name.clone()),
            SizeError::Misaligned => HeaderError::Misaligned(t.name.clone()),
        })?;
        if bytes != t.nbytes() {
            return Err(HeaderError::SizeMismatch(
                t.name.clone(),
                t.dtype,
                t.shape.clone(),
                bytes as u128,
                t.nbytes(),
            ));
        }
    }
    Ok(expected_begin as u64)
}

#[derive(Debug, PartialEq, Eq)]
pub enum SizeError {
    Overflow,
    Misaligned,
}

/// Bytes taken by `shape` elements of `dtype`, with overflow and sub-byte checks.
pub fn byte_size(dtype: Dtype, shape: &[usize]) -> Result<usize, SizeError> {
    let elements = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or(SizeError::Overflow)?;
    let bits = elements
        .checked_mul(dtype.bits())
        .ok_or(SizeError::Overflow)?;
    if bits % 8 != 0 {
        return Err(SizeError::Misaligned);
    }
    Ok(bits / 8)
}

const DUPLICATE_MARKER: &str = "\u{1}duplicate key:";
const DUPLICATE_END: char = '\u{1}';

/// What the JSON holds, before layout validation.
struct RawHeader {
    metadata: Option<Vec<(String, String)>>,
    tensors: Vec<TensorInfo>,
}

#[derive(Deserialize)]
struct RawTensor {
    dtype: Dtype,
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

/// `__metadata__` in the order written; rejects duplicate keys and non-string values.
struct MetadataMap(Vec<(String, String)>);

impl<'de> Deserialize<'de> for MetadataMap {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = MetadataMap;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map of strings to strings")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut seen = HashSet::new();
                let mut entries = Vec::new();
                while let Some((key, value)) = map.next_entry::<String, String>()? {
                    if !seen.insert(key.clone()) {
                        return Err(de::Error::custom(format!(
                            "duplicate key `{key}` in __metadata__"
                        )));
                    }
                    entries.push((key, value));
                }
                Ok(MetadataMap(entries))
            }
        }
        deserializer.deserialize_map(V)
    }
}

impl<'de> Deserialize<'de> for RawHeader {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawHeader;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut metadata = None;
                let mut seen_metadata = false;
                // Tensor names seen twice are refused by `parse`, which indexes them.
                let mut tensors = Vec::with_capacity(map.size_hint().unwrap_or(0));
                while let Some(key) = map.next_key::<String>()? {
                    if key == "__metadata__" {
                        if seen_metadata {
                            return Err(de::Error::custom(format!(
                                "{DUPLICATE_MARKER}__metadata__{DUPLICATE_END}"
                            )));
                        }
                        seen_metadata = true;
                        metadata = map.next_value::<Option<MetadataMap>>()?.map(|m| m.0);
                        continue;
                    }
                    let raw: RawTensor = map.next_value()?;
                    tensors.push(TensorInfo {
                        name: key,
                        dtype: raw.dtype,
                        shape: raw.shape,
                        begin: raw.data_offsets.0,
                        end: raw.data_offsets.1,
                    });
                }
                Ok(RawHeader { metadata, tensors })
            }
        }
        deserializer.deserialize_map(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_len_for(json: &str, data: usize) -> u64 {
        8 + json.len() as u64 + data as u64
    }

    #[test]
    fn parses_valid_header_in_offset_order() {
        let json = r#"{"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"__metadata__":{"x":"y"}}"#;
        let h = parse(json.as_bytes(), file_len_for(json, 12)).unwrap();
        let names: Vec<_> = h.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(h.metadata, Some(vec![("x".into(), "y".into())]));
        assert_eq!(h.get("b").unwrap().shape, vec![2]);
    }

    #[test]
    fn rejects_each_rule() {
        let cases: &[(&str, usize, &str)] = &[
            (
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
                9,
                "incomplete metadata",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,7]}}"#,
                7,
                "invalid shape",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}}"#,
                9,
                "invalid offset",
            ),
            (
                r#"{"a":{"dtype":"X1","shape":[2],"data_offsets":[0,8]}}"#,
                8,
                "unknown variant",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}"#,
                8,
                "invalid JSON",
            ),
            (
                r#"{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,1]}}"#,
                1,
                "byte boundary",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}}"#,
                8,
                "overflow",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#,
                2,
                "duplicate tensor name `a`",
            ),
            // A name given twice is what is reported, before the layout it breaks.
            (
                r#"{"b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#,
                1,
                "duplicate tensor name `b`",
            ),
            (r#"[1,2]"#, 0, "expected a map"),
            (r#"{"__metadata__":{"k":1}}"#, 0, "invalid type"),
        ];
        for (json, data, needle) in cases {
            let err = parse(json.as_bytes(), file_len_for(json, *data)).unwrap_err();
            assert!(err.to_string().contains(needle), "{json}: {err}");
        }
        assert_eq!(
            parse(&[0xff, 0xfe], 10)
                .unwrap_err()
                .to_string()
                .split(':')
                .next(),
            Some("invalid UTF-8 in header")
        );
    }

    #[test]
    fn prefix_rules() {
        assert_eq!(header_len(&[1, 0, 0], 3), Err(HeaderError::HeaderTooSmall));
        let big = (MAX_HEADER_SIZE + 1).to_le_bytes();
        assert_eq!(header_len(&big, u64::MAX), Err(HeaderError::HeaderTooLarge));
        assert_eq!(
            header_len(&100u64.to_le_bytes(), 50),
            Err(HeaderError::InvalidHeaderLength)
        );
        assert_eq!(header_len(&2u64.to_le_bytes(), 10), Ok(2));
    }

    #[test]
    fn empty_and_scalar_tensors() {
        let json = r#"{"s":{"dtype":"F64","shape":[],"data_offsets":[0,8]},"z":{"dtype":"F32","shape":[0,3],"data_offsets":[8,8]}}"#;
        let h = parse(json.as_bytes(), file_len_for(json, 8)).unwrap();
        assert_eq!(h.tensors.len(), 2);
        assert_eq!(h.get("z").unwrap().nbytes(), 0);
    }
}
