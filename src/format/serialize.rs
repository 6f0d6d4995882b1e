//! Writing: the same bytes safetensors 0.8 writes for the same tensors (order by dtype, largest
//! first, then by name; JSON padded with spaces to a multiple of 8), with `__metadata__` keys in
//! sorted order so the same input always gives the same file. Files are written by
//! `storage::write` (side by side, to temporary siblings renamed when complete).

use crate::error::{Error, Result};
use crate::format::dtype::Dtype;
use crate::format::header::{self, MAX_HEADER_SIZE};

/// One tensor to write; `data` is its little-endian bytes.
#[derive(Clone, Copy)]
pub struct TensorIn<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

/// What the header says of a tensor: its name, dtype, shape and byte length (the bytes
/// themselves may come later: a device's tensors are staged through host buffers).
pub trait Described {
    fn name(&self) -> &str;
    fn dtype(&self) -> Dtype;
    fn shape(&self) -> &[usize];
    fn len(&self) -> usize;
}

impl Described for TensorIn<'_> {
    fn name(&self) -> &str {
        self.name
    }
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        self.shape
    }
    fn len(&self) -> usize {
        self.data.len()
    }
}

/// A tensor described without its bytes.
#[derive(Clone, Debug)]
pub struct TensorLayout {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub len: usize,
}

impl Described for TensorLayout {
    fn name(&self) -> &str {
        &self.name
    }
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn len(&self) -> usize {
        self.len
    }
}

fn json_string(s: &str) -> String {
    serde_json::to_string(s).expect("strings always serialize")
}

/// Sorts `tensors` into file order and returns the 8-byte prefix + padded JSON header.
pub fn header<T: Described>(
    tensors: &mut [T],
    metadata: Option<&[(String, String)]>,
) -> Result<Vec<u8>> {
    tensors.sort_by(|a, b| (b.dtype().cmp(&a.dtype())).then_with(|| a.name().cmp(b.name())));
    let mut json = String::from("{");
    if let Some(metadata) = metadata {
        let mut entries: Vec<&(String, String)> = metadata.iter().collect();
        entries.sort();
        json.push_str("\"__metadata__\":{");
        for (i, (k, v)) in entries.iter().enumerate() {
            if i > 0 {
                json.push(',');
            }
            json.push_str(&json_string(k));
            json.push(':');
            json.push_str(&json_string(v));
        }
        json.push('}');
    }
    let mut offset = 0usize;
    for (i, t) in tensors.iter().enumerate() {
        let need = header::byte_size(t.dtype(), t.shape()).map_err(|_| {
            Error::Serialize(format!(
                "Error while serializing: overflow computing buffer size from shape and/or element type of tensor `{}`",
                t.name()
            ))
        })?;
        if need != t.len() {
            return Err(Error::Serialize(format!(
                "Error while serializing: invalid shape, data type, or offset for tensor `{}`: {} {:?} needs {need} bytes, got {}",
                t.name(),
                t.dtype(),
                t.shape(),
                t.len()
            )));
        }
        if metadata.is_some() || i > 0 {
            json.push(',');
        }
        let shape: Vec<String> = t.shape().iter().map(usize::to_string).collect();
        json.push_str(&format!(
            "{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
            json_string(t.name()),
            t.dtype().code(),
            shape.join(","),
            offset,
            offset + need
        ));
        offset += need;
    }
    json.push('}');
    let mut bytes = json.into_bytes();
    bytes.resize(bytes.len().next_multiple_of(8), b' ');
    if bytes.len() as u64 > MAX_HEADER_SIZE {
        return Err(Error::Serialize(
            "Error while serializing: header too large".into(),
        ));
    }
    let mut out = Vec::with_capacity(8 + bytes.len());
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(&bytes);
    Ok(out)
}

/// The whole file in memory.
pub fn to_bytes(
    tensors: &mut [TensorIn<'_>],
    metadata: Option<&[(String, String)]>,
) -> Result<Vec<u8>> {
    let head = header(tensors, metadata)?;
    let total = head.len() + tensors.iter().map(|t| t.data.len()).sum::<usize>();
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(&head);
    for t in tensors.iter() {
        out.extend_from_slice(t.data);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_format_rules() {
        let a = [0u8; 8];
        let b = [1u8; 2];
        let mut tensors = vec![
            TensorIn {
                name: "b",
                dtype: Dtype::U8,
                shape: &[2],
                data: &b,
            },
            TensorIn {
                name: "a",
                dtype: Dtype::F32,
                shape: &[2],
                data: &a,
            },
        ];
        let meta = vec![
            ("z".to_string(), "1".to_string()),
            ("a".to_string(), "2".to_string()),
        ];
        let bytes = to_bytes(&mut tensors, Some(&meta)).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!(n % 8, 0);
        let json = std::str::from_utf8(&bytes[8..8 + n]).unwrap().trim_end();
        assert_eq!(
            json,
            r#"{"__metadata__":{"a":"2","z":"1"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[2],"data_offsets":[8,10]}}"#
        );
        let h = header::parse(&bytes[8..8 + n], bytes.len() as u64).unwrap();
        assert_eq!(h.tensors.len(), 2);
        assert_eq!(&bytes[8 + n + 8..], &b);
    }

    #[test]
    fn rejects_wrong_data_length() {
        let a = [0u8; 7];
        let mut tensors = vec![TensorIn {
            name: "a",
            dtype: Dtype::F32,
            shape: &[2],
            data: &a,
        }];
        assert!(to_bytes(&mut tensors, None).is_err());
    }
}
