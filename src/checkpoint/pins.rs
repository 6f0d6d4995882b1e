//! What a checkpoint keeps for its pinned shards (`verify=`): each shard's expected digest, the
//! bytes held for it once hashed, and what its record vouches for. The rules that use them are in
//! `pinned`.

use std::sync::{Mutex, MutexGuard};

use crate::checkpoint::record::Record;
use crate::checkpoint::verify::{Expected, Verified};
use crate::platform::FileIdentity;
use crate::read::buffer::TensorBytes;

/// The pins of a checkpoint's shards and the bytes held for them.
#[derive(Default)]
pub(super) struct Pins {
    /// Per shard: its expected digest; None when the shard is not pinned.
    pub(super) expected: Vec<Option<Expected>>,
    /// Per shard: its tensors (header order) read whole and hashed, None once handed out; None
    /// when not held. The lock also keeps two reads from hashing one shard at once.
    pub(super) held: Vec<Mutex<Option<Vec<Option<TensorBytes>>>>>,
    pub(super) counts: Mutex<Verified>,
    /// Per shard: the verified record vouches for it (see `crate::checkpoint::record`): read as unpinned.
    pub(super) recorded: Vec<bool>,
    /// The record a matching shard is remembered in, and per shard the file's identity read
    /// before its hash began (a file that changes meanwhile is not remembered).
    pub(super) record: Option<Record>,
    pub(super) before: Vec<Option<FileIdentity>>,
}

pub(super) type Held<'a> = MutexGuard<'a, Option<Vec<Option<TensorBytes>>>>;

impl Pins {
    pub(super) fn pinned(&self, shard: usize) -> bool {
        self.expected.get(shard).is_some_and(Option::is_some) && !self.recorded[shard]
    }

    pub(super) fn held(&self, shard: usize) -> Held<'_> {
        self.held[shard].lock().unwrap_or_else(|p| p.into_inner())
    }
}
