//! Saving distributed checkpoints (docs/checkpoints.md §Distributed checkpoint format): the SPMD
//! entry every rank of a job calls with its own chunks ([`save_spmd`]), and the offline
//! single-process writer that writes the chunks of every virtual rank of a layout
//! ([`OfflineWriter`], [`save_offline`]).
//!
//! SPMD protocol (over the [`Comm`] of all ranks, payloads as `U8` tensors through
//! `all_gather_v`, so it works on any [`moe_backend::comm::Communicator`]):
//! 1. rank 0 removes the stale temporary directories of earlier, dead saves
//!    ([`super::commit::stale`]), creates `<root>/.tmp-iter_{step:07}-{nonce}/` with its owner file
//!    and sends its name to every rank (this exchange doubles as the barrier of
//!    docs/checkpoints.md §Distributed checkpoint format, atomic commit step 1);
//! 2. every rank writes and fsyncs its files there, then all ranks exchange their chunk
//!    records (JSON) or their error; only rank 0 uses them;
//! 3. rank 0 aborts if any rank failed, else validates
//!    (docs/checkpoints.md §Distributed checkpoint validation), writes the index, `config.json`,
//!    `.complete`, renames the directory and updates `latest` ([`commit_save`]);
//! 4. rank 0 sends the outcome, so every rank returns the same `Ok(dir)` or
//!    [`BridgeError::SaveAborted`].
//!
//! A rank that dies mid-save makes the other ranks' collectives fail; the temporary directory
//! is then never committed, `latest` keeps naming the previous checkpoint, and loaders refuse
//! the `.tmp-*` directory; the next save into the root removes it once its owner is dead.
//! Callers that want to log those removals call
//! [`remove_stale_temp_dirs`](super::commit::remove_stale_temp_dirs) on rank 0 before saving.

use std::collections::BTreeMap;
use std::panic::Location;
use std::path::{Path, PathBuf};

use burn::tensor::TensorData;
use moe_backend::comm::Comm;
use moe_backend::parallel::ParallelLayout;
use serde_json::Value;

use super::commit::{
    CleanupReport, StalePolicy, abort_save, begin_save, begin_save_with, commit_save, merge_chunks,
};
use super::files::{RankFiles, SavedChunk, TensorMeta};
use super::index::{DcpIndex, Fp8Record, OptimizerRecord};
use super::region::TensorBox;
use super::sharding::ShardingPlan;
use crate::BridgeError;
use crate::safetensors::TensorView;

/// Everything but the tensors: what goes into the index and next to it.
#[derive(Debug, Clone, PartialEq)]
pub struct SaveMeta {
    /// Training step (the directory is `iter_{step:07}`).
    pub step: u64,
    /// The layout the chunks were produced under.
    pub layout: ParallelLayout,
    /// HF `model_type`.
    pub model_family: Option<String>,
    /// The model's HF `config.json`, written next to the index.
    pub config: Option<Value>,
    /// Optimizer metadata (`None` for model-only checkpoints).
    pub optimizer: Option<OptimizerRecord>,
    /// FP8 storage parameters.
    pub fp8: Option<Fp8Record>,
    /// Small JSON state stored in the index (scheduler, data position, RNG seeds).
    pub objects: BTreeMap<String, Value>,
    /// Further JSON files written next to the index (e.g. `generation_config.json`).
    pub extra_json: BTreeMap<String, Value>,
}

impl SaveMeta {
    /// Metadata of a model-only checkpoint of `step` under `layout`.
    pub fn new(step: u64, layout: &ParallelLayout) -> Self {
        Self {
            step,
            layout: layout.clone(),
            model_family: None,
            config: None,
            optimizer: None,
            fp8: None,
            objects: BTreeMap::new(),
            extra_json: BTreeMap::new(),
        }
    }

    /// The index without tensors.
    fn index(&self) -> DcpIndex {
        let mut index = DcpIndex::new(self.step, &self.layout);
        index.model_family = self.model_family.clone();
        index.optimizer = self.optimizer.clone();
        index.fp8 = self.fp8.clone();
        index.objects = self.objects.clone();
        index
    }
}

/// One chunk a rank saves: the tensor's metadata, the chunk's global offsets and its bytes
/// (shape = the chunk's shape).
#[derive(Debug, Clone)]
pub struct LocalChunk<'a> {
    /// The tensor.
    pub meta: TensorMeta,
    /// Global offsets of the chunk.
    pub offsets: Vec<usize>,
    /// The chunk's data (dtype must equal `meta.dtype`).
    pub data: TensorView<'a>,
}

impl LocalChunk<'_> {
    /// The chunk's box, after checking dtype, rank and bounds.
    fn checked_box(&self) -> Result<TensorBox, BridgeError> {
        let b = TensorBox::new(self.offsets.clone(), self.data.shape.to_vec());
        self.data.validate()?;
        let fail = |reason: String| BridgeError::Sharding {
            tensor: self.meta.fqn.clone(),
            reason,
        };
        if self.data.dtype != self.meta.dtype {
            return Err(fail(format!(
                "chunk is {}, the tensor is {}",
                self.data.dtype, self.meta.dtype
            )));
        }
        if !b.within(&self.meta.global_shape) {
            return Err(fail(format!(
                "chunk at {:?} of shape {:?} lies outside {:?}",
                b.offsets, b.shape, self.meta.global_shape
            )));
        }
        Ok(b)
    }
}

/// Writes `chunks` as rank `rank`'s files in `dir`; returns their records.
pub(super) fn write_rank(
    dir: &Path,
    rank: usize,
    chunks: &[LocalChunk<'_>],
) -> Result<Vec<SavedChunk>, BridgeError> {
    let boxes = chunks
        .iter()
        .map(|c| Ok((c.meta.clone(), c.checked_box()?)))
        .collect::<Result<Vec<_>, BridgeError>>()?;
    let mut files = RankFiles::create(dir, rank, boxes.clone())?;
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for (c, (_, b)) in chunks.iter().zip(&boxes) {
        let j = seen.entry(c.meta.fqn.as_str()).or_insert(0);
        files.write_region(&c.meta.fqn, *j, b, c.data.bytes)?;
        *j += 1;
    }
    files.finish()
}

/// `all_gather_v` of byte strings; every payload is prefixed with one byte so none is empty.
#[track_caller]
fn all_gather_bytes(comm: &Comm, payload: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    let mut bytes = Vec::with_capacity(payload.len() + 1);
    bytes.push(1u8);
    bytes.extend_from_slice(payload);
    let n = bytes.len();
    let (all, counts) = comm
        .communicator()
        .all_gather_v(TensorData::new(bytes, [n]), Location::caller())
        .map_err(|e| e.to_string())?;
    let flat = all.as_bytes();
    let mut out = Vec::with_capacity(counts.len());
    let mut at = 0;
    for count in counts {
        let part = flat.get(at + 1..at + count).unwrap_or_default();
        out.push(part.to_vec());
        at += count;
    }
    Ok(out)
}

/// Rank 0's message to everyone: `Ok(text)` or `Err(reason)`, one collective.
#[track_caller]
pub(super) fn share_from_rank0(
    comm: &Comm,
    mine: Option<Result<String, String>>,
) -> Result<String, String> {
    let payload = match &mine {
        Some(Ok(text)) => format!("ok:{text}"),
        Some(Err(reason)) => format!("err:{reason}"),
        None => String::new(),
    };
    let all = all_gather_bytes(comm, payload.as_bytes())?;
    let first = all.first().map(|b| String::from_utf8_lossy(b).into_owned());
    match first.as_deref().map(|s| s.split_once(':')) {
        Some(Some(("ok", text))) => Ok(text.to_owned()),
        Some(Some(("err", reason))) => Err(reason.to_owned()),
        _ => Err("rank 0 sent no outcome".to_owned()),
    }
}

/// Saves one rank's part of a checkpoint; every rank of `comm` (the world) calls it with its
/// own main-replica chunks (see the module docs for the protocol). Returns the committed
/// `iter_*` directory on every rank, or the same [`BridgeError::SaveAborted`] on every rank
/// whose collectives still work.
pub fn save_spmd(
    comm: &Comm,
    root: &Path,
    meta: &SaveMeta,
    chunks: &[LocalChunk<'_>],
) -> Result<PathBuf, BridgeError> {
    let aborted = |path: &Path, reason: String| BridgeError::SaveAborted {
        path: path.to_path_buf(),
        reason,
    };
    let rank0 = comm.rank() == 0;
    let created = rank0.then(|| {
        begin_save(root, meta.step).map(|tmp| {
            let name = tmp.file_name().map(|n| n.to_string_lossy().into_owned());
            name.unwrap_or_default()
        })
    });
    let created = created.map(|r| r.map_err(|e| e.to_string()));
    let tmp_name = share_from_rank0(comm, created).map_err(|r| aborted(root, r))?;
    let tmp = root.join(&tmp_name);

    let global_rank = comm
        .ranks()
        .get(comm.rank())
        .copied()
        .unwrap_or(comm.rank());
    let written = write_rank(&tmp, global_rank, chunks);
    let payload = match &written {
        Ok(records) => serde_json::to_vec(&Ok::<_, String>(records)),
        Err(e) => serde_json::to_vec(&Err::<Vec<SavedChunk>, _>(format!(
            "rank {global_rank}: {e}"
        ))),
    }
    .map_err(|e| aborted(&tmp, e.to_string()))?;
    let gathered = all_gather_bytes(comm, &payload);
    let outcome = if rank0 {
        let committed = gathered.and_then(|parts| {
            let mut records = Vec::new();
            for part in parts {
                let got: Result<Vec<SavedChunk>, String> =
                    serde_json::from_slice(&part).map_err(|e| e.to_string())?;
                records.extend(got?);
            }
            let mut index = meta.index();
            merge_chunks(&tmp, &mut index, records).map_err(|e| e.to_string())?;
            commit_save(root, &tmp, &index, meta.config.as_ref(), &meta.extra_json)
                .map(|dir| dir.to_string_lossy().into_owned())
                .map_err(|e| e.to_string())
        });
        if committed.is_err() {
            abort_save(&tmp);
        }
        Some(committed)
    } else {
        gathered.map_err(|e| aborted(&tmp, e))?;
        None
    };
    let dir = share_from_rank0(comm, outcome).map_err(|r| aborted(&tmp, r))?;
    Ok(PathBuf::from(dir))
}

/// Writes a checkpoint from a single process, as every virtual rank of a layout (or any finer
/// chunking) would: the files of all ranks are planned and created up front, then filled
/// region by region through [`write_region`](Self::write_region) so no chunk needs to be held
/// whole. Dropped before [`finish`](Self::finish), it removes its temporary directory.
#[derive(Debug)]
pub struct OfflineWriter {
    root: PathBuf,
    tmp: PathBuf,
    meta: SaveMeta,
    ranks: Vec<RankFiles>,
    /// fqn → `(index into ranks, j)` of each chunk.
    routes: BTreeMap<String, Vec<(usize, usize)>>,
    cleanup: CleanupReport,
    done: bool,
}

impl OfflineWriter {
    /// Plans the main-replica chunks of `tensors` under `plan` (which must be for
    /// `meta.layout`) and creates every rank's files.
    pub fn create(
        root: &Path,
        meta: SaveMeta,
        plan: &ShardingPlan,
        tensors: &[TensorMeta],
    ) -> Result<Self, BridgeError> {
        let mut chunks = Vec::new();
        for t in tensors {
            for (rank, b) in plan.main_boxes(&t.fqn, &t.global_shape)? {
                chunks.push((rank, t.clone(), b));
            }
        }
        Self::with_chunks(root, meta, chunks)
    }

    /// Like [`create`](Self::create) with explicit `(writer rank, tensor, box)` chunks.
    pub fn with_chunks(
        root: &Path,
        meta: SaveMeta,
        chunks: Vec<(usize, TensorMeta, TensorBox)>,
    ) -> Result<Self, BridgeError> {
        let mut by_rank: BTreeMap<usize, Vec<(TensorMeta, TensorBox)>> = BTreeMap::new();
        for (rank, t, b) in chunks {
            by_rank.entry(rank).or_default().push((t, b));
        }
        let start = begin_save_with(root, meta.step, &StalePolicy::default())?;
        let mut writer = Self {
            root: root.to_path_buf(),
            tmp: start.tmp,
            meta,
            ranks: Vec::new(),
            routes: BTreeMap::new(),
            cleanup: start.cleanup,
            done: false,
        };
        for (rank, list) in by_rank {
            let fqns: Vec<String> = list.iter().map(|(t, _)| t.fqn.clone()).collect();
            let files = RankFiles::create(&writer.tmp, rank, list)?;
            let at = writer.ranks.len();
            for fqn in fqns {
                let n = writer
                    .routes
                    .get(&fqn)
                    .map_or(0, |r| r.iter().filter(|(i, _)| *i == at).count());
                writer.routes.entry(fqn).or_default().push((at, n));
            }
            writer.ranks.push(files);
        }
        Ok(writer)
    }

    /// The temporary directory being written.
    pub fn tmp_dir(&self) -> &Path {
        &self.tmp
    }

    /// The stale temporary directories of earlier saves removed from the root before this
    /// writer created its own (for the caller to log).
    pub fn cleanup(&self) -> &CleanupReport {
        &self.cleanup
    }

    /// The chunk boxes of `fqn`, in writer order.
    pub fn chunks_of(&self, fqn: &str) -> Vec<TensorBox> {
        let routes = self.routes.get(fqn).map_or(&[][..], Vec::as_slice);
        routes
            .iter()
            .filter_map(|&(i, j)| {
                let boxes = self.ranks[i].boxes_of(fqn);
                boxes
                    .into_iter()
                    .find(|(jj, _)| *jj == j)
                    .map(|(_, b)| b.clone())
            })
            .collect()
    }

    /// Writes the overlap of `region` of `fqn` (row-major bytes `bytes`) into every chunk it
    /// intersects; returns the number of elements written.
    pub fn write_region(
        &mut self,
        fqn: &str,
        region: &TensorBox,
        bytes: &[u8],
    ) -> Result<usize, BridgeError> {
        let Some(routes) = self.routes.get(fqn) else {
            return Err(BridgeError::InvalidWrite {
                path: self.tmp.clone(),
                tensor: fqn.to_owned(),
                reason: "no chunk of this tensor was planned".to_owned(),
            });
        };
        let mut total = 0;
        for &(i, j) in routes {
            total += self.ranks[i].write_region(fqn, j, region, bytes)?;
        }
        Ok(total)
    }

    /// Checks every chunk was filled, fsyncs, validates and commits; returns the checkpoint
    /// directory.
    pub fn finish(mut self) -> Result<PathBuf, BridgeError> {
        let mut records = Vec::new();
        for files in std::mem::take(&mut self.ranks) {
            records.extend(files.finish()?);
        }
        let mut index = self.meta.index();
        merge_chunks(&self.tmp, &mut index, records)?;
        let dir = commit_save(
            &self.root,
            &self.tmp,
            &index,
            self.meta.config.as_ref(),
            &self.meta.extra_json,
        )?;
        self.done = true;
        Ok(dir)
    }
}

impl Drop for OfflineWriter {
    fn drop(&mut self) {
        if !self.done {
            abort_save(&self.tmp);
        }
    }
}

/// Saves whole in-memory tensors `(meta, row-major bytes)` as the main-replica chunks of every
/// virtual rank of `plan`'s layout.
pub fn save_offline(
    root: &Path,
    meta: SaveMeta,
    plan: &ShardingPlan,
    tensors: &[(TensorMeta, &[u8])],
) -> Result<PathBuf, BridgeError> {
    let metas: Vec<TensorMeta> = tensors.iter().map(|(m, _)| m.clone()).collect();
    let mut writer = OfflineWriter::create(root, meta, plan, &metas)?;
    for (m, bytes) in tensors {
        writer.write_region(&m.fqn, &TensorBox::full(&m.global_shape), bytes)?;
    }
    writer.finish()
}
