//! Property tests of the header parser: every header the writer produces parses back to the same
//! table, and mutated or truncated headers are rejected (or parse to a valid table) without panics.

use proptest::prelude::*;
use safeload::{
    Dtype, Header, HeaderError, TensorIn, byte_size, header_len, parse_header, to_bytes,
};

fn tensor_spec() -> impl Strategy<Value = (String, Dtype, Vec<usize>)> {
    (
        "[a-z._0-9]{1,12}",
        prop::sample::select(Dtype::ALL.to_vec()),
        prop::collection::vec(0usize..5, 0..4),
    )
        .prop_map(|(name, dtype, mut shape)| {
            // Packed dtypes need a whole number of bytes.
            if dtype.bits() < 8 && byte_size(dtype, &shape).is_err() {
                shape.push(4);
            }
            (name, dtype, shape)
        })
        .prop_filter("whole bytes", |(_, d, s)| byte_size(*d, s).is_ok())
}

fn file_of(
    specs: &[(String, Dtype, Vec<usize>)],
    metadata: &Option<Vec<(String, String)>>,
) -> Vec<u8> {
    let datas: Vec<Vec<u8>> = specs
        .iter()
        .map(|(_, d, s)| (0..byte_size(*d, s).unwrap()).map(|i| i as u8).collect())
        .collect();
    let mut tensors: Vec<TensorIn<'_>> = specs
        .iter()
        .zip(&datas)
        .map(|((n, d, s), data)| TensorIn {
            name: n,
            dtype: *d,
            shape: s,
            data,
        })
        .collect();
    to_bytes(&mut tensors, metadata.as_deref()).unwrap()
}

fn parse_file(bytes: &[u8]) -> Result<Header, HeaderError> {
    let n = header_len(bytes, bytes.len() as u64)?;
    parse_header(&bytes[8..8 + n as usize], bytes.len() as u64)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn written_headers_parse_to_the_same_table(
        specs in prop::collection::btree_map("[a-z._0-9]{1,12}", tensor_spec(), 0..20),
        metadata in prop::option::of(prop::collection::vec(("[ -~]{0,8}", "\\PC{0,8}"), 0..4)),
    ) {
        let specs: Vec<_> = specs.into_iter().map(|(name, (_, d, s))| (name, d, s)).collect();
        let metadata = metadata.map(|m| {
            let mut seen = std::collections::BTreeMap::new();
            for (k, v) in m { seen.insert(k, v); }
            seen.into_iter().collect::<Vec<_>>()
        });
        let bytes = file_of(&specs, &metadata);
        let h = parse_file(&bytes).unwrap();
        prop_assert_eq!(h.tensors.len(), specs.len());
        for (name, dtype, shape) in &specs {
            let t = h.get(name).unwrap();
            prop_assert_eq!(t.dtype, *dtype);
            prop_assert_eq!(&t.shape, shape);
            prop_assert_eq!(t.nbytes(), byte_size(*dtype, shape).unwrap());
        }
        prop_assert_eq!(h.metadata, metadata);
    }

    #[test]
    fn mutated_headers_never_panic(
        specs in prop::collection::btree_map("[a-z]{1,6}", tensor_spec(), 1..6),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let specs: Vec<_> = specs.into_iter().map(|(name, (_, d, s))| (name, d, s)).collect();
        let mut bytes = file_of(&specs, &None);
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len()));
        }
        if let Ok(h) = parse_file(&bytes) {
            // Whatever parses must be a consistent table covering the file exactly.
            let mut end = 0usize;
            for t in &h.tensors {
                prop_assert_eq!(t.begin, end);
                prop_assert_eq!(t.nbytes(), byte_size(t.dtype, &t.shape).unwrap());
                end = t.end;
            }
            prop_assert_eq!(h.data_start() + end as u64, bytes.len() as u64);
        }
    }

    #[test]
    fn huge_claims_are_rejected_before_allocation(dim in (1u64 << 40)..(1u64 << 62)) {
        let json = format!(r#"{{"w":{{"dtype":"F32","shape":[{dim},{dim}],"data_offsets":[0,16]}}}}"#);
        let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(json.as_bytes());
        bytes.extend_from_slice(&[0u8; 16]);
        prop_assert!(parse_file(&bytes).is_err());
    }
}
