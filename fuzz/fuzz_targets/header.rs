//! Fuzzes header parsing and read planning: arbitrary bytes as a whole file. Nothing may panic,
//! abort or allocate from an unvalidated size; whatever parses must plan slices safely.
#![no_main]

use libfuzzer_sys::fuzz_target;
use safeload::header;
use safeload::slice::{self, Index};

fuzz_target!(|data: &[u8]| {
    let Ok(n) = header::header_len(data, data.len() as u64) else { return };
    let Some(json) = data.get(8..8 + n as usize) else { return };
    let Ok(h) = header::parse(json, data.len() as u64) else { return };
    let body = &data[h.data_start() as usize..];
    for (i, t) in h.tensors.iter().enumerate() {
        assert!(t.end <= body.len());
        // A few slice shapes derived from the input bytes.
        let pick = |k: usize| data.get(i + k).copied().unwrap_or(0) as i64 - 128;
        let indices = vec![
            Index::Range { start: Some(pick(0) % 7), stop: None, step: 1 + (pick(1).unsigned_abs() % 3) as i64 },
            Index::Select(pick(2) % 5),
        ];
        for len in 0..=indices.len().min(t.shape.len()) {
            if let Ok(plan) = slice::plan(t.dtype, &t.shape, &indices[..len]) {
                let mut out = vec![0u8; plan.nbytes];
                slice::gather(&plan, &body[t.begin..t.end], &mut out);
            }
        }
    }
});
