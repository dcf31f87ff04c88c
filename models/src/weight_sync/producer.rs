//! The collective producer: every rank walks the same plan, the ranks holding a tensor's pieces
//! send them to global rank 0, which packs them into buckets.

use crate::param_plan::ReleaseLayout;
use std::panic::Location;
use std::time::Instant;

use burn::tensor::{DType, TensorData};
use moe_backend::comm::{Comm, GroupComms};
use moe_backend::parallel::{GroupFamily, GroupTable};

use super::bucket::{SyncManifest, SyncedTensor, WeightBucket};
use super::host::{convert, scatter};
use super::plan::{Coords, Source, Split, decode_specs, encode_specs, piece, plan};
use super::{ExpertNames, SyncDest, SyncOptions, WeightReceiver, WeightSyncError};
use crate::export::{ExportHf, HfTensorSpec, LazyTensor};

/// What a sync did on one rank.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SyncStats {
    /// Tensors this rank received (0 on ranks that only send).
    pub tensors: usize,
    /// Buckets this rank received.
    pub buckets: usize,
    /// Bytes of the buckets this rank received.
    pub bytes: u64,
    /// Largest bucket buffer this rank held (assembling or receiving; with
    /// [`SyncDest::Broadcast`] the collective's placeholder and result count twice).
    pub max_bucket_bytes: u64,
    /// Largest host piece this rank held (its own slice of a tensor, or one received from a
    /// peer).
    pub max_piece_bytes: u64,
    /// Most bytes of sync buffers this rank held at once (bucket + piece; a sender's piece
    /// plus its copy cast to the sync dtype).
    pub peak_buffer_bytes: u64,
    /// Wall time of the producer on this rank (receiver time excluded).
    pub seconds: f64,
}

impl SyncStats {
    fn hold(&mut self, bucket: usize, piece: usize) {
        self.max_bucket_bytes = self.max_bucket_bytes.max(bucket as u64);
        self.max_piece_bytes = self.max_piece_bytes.max(piece as u64);
        self.peak_buffer_bytes = self.peak_buffer_bytes.max((bucket + piece) as u64);
    }
}

/// Rank 0's group of one family, seen from one of its members.
struct Group {
    /// The communicator (`None` when the group has one member).
    comm: Option<Comm>,
    /// This rank's member index.
    me: usize,
    /// Rank 0's member index.
    root: usize,
    /// Every member's coordinates.
    coords: Vec<Coords>,
}

impl Group {
    /// The group of `family` if it contains global rank 0 (`None` otherwise).
    fn of_rank0(
        groups: &GroupComms,
        family: GroupFamily,
        coords: impl Fn(usize) -> Result<Coords, WeightSyncError>,
    ) -> Result<Option<Self>, WeightSyncError> {
        let comm = groups.comm(family);
        let Some(root) = comm.ranks().iter().position(|&g| g == 0) else {
            return Ok(None);
        };
        let coords = comm
            .ranks()
            .iter()
            .map(|&global| coords(global))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Some(Self {
            comm: (comm.size() > 1).then(|| comm.clone()),
            me: comm.rank(),
            root,
            coords,
        }))
    }
}

/// The streaming producer of a weight sync (see the [module docs](super)): an iterator over
/// the buckets, driven collectively on every rank. Each item is `Some(bucket)` on the ranks
/// that receive it and `None` on the others; every rank must drain it (or call
/// [`run`](Self::run)).
pub struct WeightSync {
    manifest: SyncManifest,
    /// Per synced tensor, in manifest order.
    sources: Vec<Source>,
    /// This rank's local (fused) HF entries: spec and lazy device handle.
    local: Vec<(HfTensorSpec, Box<dyn LazyTensor>)>,
    /// This rank's pipeline rank.
    stage: usize,
    rank0: bool,
    /// Rank 0's dense `tp-pp` group (tensors of any stage of rank 0's replica, `tp`-split or
    /// replicated).
    dense: Option<Group>,
    /// Rank 0's expert `tp-ep-pp` group (routed experts of any stage).
    experts: Option<Group>,
    /// The broadcast group and rank 0's member index in it (this rank a member).
    broadcast: Option<(Comm, usize)>,
    receives: bool,
    /// Flow control: senders wait for rank 0 at a barrier of their group once the tensors
    /// sent since the last one reach this many bytes (the largest synced tensor).
    window: usize,
    /// Bytes sent over rank 0's dense / expert group since its last barrier.
    pending: [usize; 2],
    next: usize,
    first_tensor: usize,
    failed: bool,
    stats: SyncStats,
}

impl std::fmt::Debug for WeightSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightSync")
            .field("tensors", &self.sources.len())
            .field("buckets", &self.manifest.buckets.len())
            .field("next", &self.next)
            .field("rank0", &self.rank0)
            .finish()
    }
}

impl WeightSync {
    /// The sync of `shard` (this rank's shard of a model trained under the layout of `groups`,
    /// e.g. `trainer.model().model()`: under pipeline parallelism its stage's parts, layers
    /// named by their global index; a full model at `world = 1`). Collective: every rank
    /// builds one with the same options (the pipeline stages exchange their tensor lists
    /// here) and drains it.
    pub fn new<M: ExportHf + ?Sized>(
        shard: &M,
        groups: &GroupComms,
        options: SyncOptions,
    ) -> Result<Self, WeightSyncError> {
        let layout = &groups.groups.layout;
        if options.bucket_bytes == 0 {
            return Err(WeightSyncError::Unsupported(
                "bucket_bytes must be at least 1".to_owned(),
            ));
        }
        let local = shard.hf_tensors_as(ExpertNames::Fused)?.into_lazy();
        let table = GroupTable::new(layout)?;
        let specs: Vec<HfTensorSpec> = local.iter().map(|(s, _)| s.clone()).collect();
        let stages = stage_specs(groups, &table, specs)?;
        let per_expert = shard.hf_tensors_as(ExpertNames::PerExpert)?;
        // The family's expert names and release layouts, from the synced model's own plan.
        let family_plan = shard.export_plan();
        let release = super::plan::streams_release(
            family_plan.as_ref(),
            per_expert.specs().iter().map(|s| s.name.as_str()),
        );
        drop(per_expert);
        let (tensors, sources) = plan(
            &stages,
            layout.tp,
            layout.ep,
            layout.etp,
            &options,
            family_plan.as_ref(),
            release,
        )?;
        let manifest = SyncManifest::pack(
            tensors,
            options.bucket_bytes,
            options.dtype,
            options.experts,
        );

        let rank0 = groups.groups.rank == 0;
        let stage = groups.groups.get(GroupFamily::Pp).index;
        let dense = Group::of_rank0(groups, GroupFamily::Mp, |global| {
            let pg = table.for_rank(global)?;
            Ok(Coords {
                stage: pg.get(GroupFamily::Pp).index,
                a: pg.get(GroupFamily::Tp).index,
                b: 0,
            })
        })?;
        let experts = Group::of_rank0(groups, GroupFamily::TpEpPp, |global| {
            let pg = table.for_rank(global)?;
            Ok(Coords {
                stage: pg.get(GroupFamily::Pp).index,
                a: pg.ep_rank(),
                b: pg.get(GroupFamily::ExptTp).index,
            })
        })?;
        let broadcast = match &options.dest {
            SyncDest::Rank0 => None,
            SyncDest::Broadcast(comm) => {
                let root = comm.ranks().iter().position(|&g| g == 0).ok_or_else(|| {
                    WeightSyncError::Unsupported(format!(
                        "the broadcast group {:?} does not contain global rank 0",
                        comm.ranks()
                    ))
                })?;
                Some((comm.clone(), root))
            }
        };
        let receives = match &options.dest {
            SyncDest::Rank0 => rank0,
            SyncDest::Broadcast(_) => true,
        };
        let window = manifest
            .tensors()
            .map(|t| t.bytes)
            .max()
            .unwrap_or(0)
            .max(1);
        Ok(Self {
            manifest,
            sources,
            local,
            stage,
            rank0,
            dense,
            experts,
            broadcast,
            receives,
            window,
            pending: [0; 2],
            next: 0,
            first_tensor: 0,
            failed: false,
            stats: SyncStats::default(),
        })
    }

    /// The plan: every bucket's tensors (names, dtypes, shapes, offsets), the same on every
    /// rank.
    pub fn manifest(&self) -> &SyncManifest {
        &self.manifest
    }

    /// Whether this rank receives the buckets.
    pub fn receives(&self) -> bool {
        self.receives
    }

    /// What the sync did on this rank so far.
    pub fn stats(&self) -> SyncStats {
        self.stats
    }

    /// Drains the sync, handing every bucket this rank receives to `receiver` (`begin` with
    /// the manifest first, `finish` last; receivers are called only on receiving ranks, and
    /// `None` drops the buckets). A receiver error does not stop the collective: the other
    /// ranks are served to the end, then the first error is returned.
    pub fn run(
        mut self,
        mut receiver: Option<&mut dyn WeightReceiver>,
    ) -> Result<SyncStats, WeightSyncError> {
        let mut first_error = None;
        if self.receives
            && let Some(r) = receiver.as_deref_mut()
            && let Err(e) = r.begin(&self.manifest)
        {
            first_error = Some(e);
        }
        for item in self.by_ref() {
            let bucket = item?;
            if first_error.is_some() {
                continue;
            }
            if let (Some(bucket), Some(r)) = (bucket, receiver.as_deref_mut())
                && let Err(e) = r.receive(&bucket)
            {
                first_error = Some(e);
            }
        }
        if first_error.is_none()
            && self.receives
            && let Some(r) = receiver
            && let Err(e) = r.finish()
        {
            first_error = Some(e);
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(self.stats),
        }
    }

    fn next_bucket(&mut self, index: usize) -> Result<Option<WeightBucket>, WeightSyncError> {
        let start = Instant::now();
        let (bytes, tensors) = {
            let meta = &self.manifest.buckets[index];
            (meta.bytes, meta.tensors.clone())
        };
        let first = self.first_tensor;
        self.first_tensor += tensors.len();
        let mut data = if self.rank0 {
            vec![0u8; bytes]
        } else {
            Vec::new()
        };
        for (j, t) in tensors.iter().enumerate() {
            let source = self.sources[first + j].clone();
            let region = if self.rank0 {
                let end = t.offset + t.bytes;
                Some(
                    data.get_mut(t.offset..end)
                        .ok_or_else(|| WeightSyncError::Malformed {
                            name: t.name.clone(),
                            reason: format!("bytes {}..{end} outside the bucket", t.offset),
                        })?,
                )
            } else {
                None
            };
            self.transfer(t, &source, region, bytes)?;
        }
        let delivered = match &self.broadcast {
            None => self.rank0.then_some(data),
            Some((comm, root)) => {
                let payload = if self.rank0 { data } else { vec![0u8; bytes] };
                self.stats.hold(2 * bytes, 0);
                let out = comm.communicator().broadcast(
                    TensorData::from_bytes_vec(payload, [bytes], DType::U8),
                    *root,
                    Location::caller(),
                )?;
                Some(out.try_into_vec::<u8>().map_err(|e| {
                    WeightSyncError::Unsupported(format!("broadcast bucket unreadable: {e:?}"))
                })?)
            }
        };
        let bucket = delivered.map(|data| {
            self.stats.tensors += tensors.len();
            self.stats.buckets += 1;
            self.stats.bytes += data.len() as u64;
            self.stats.hold(data.len(), 0);
            WeightBucket {
                index,
                count: self.manifest.buckets.len(),
                tensors,
                data,
            }
        });
        self.stats.seconds += start.elapsed().as_secs_f64();
        Ok(bucket)
    }

    /// Moves tensor `t`'s pieces to rank 0, which copies them into `region` (its bytes of the
    /// bucket, `bucket` bytes long).
    fn transfer(
        &mut self,
        t: &SyncedTensor,
        source: &Source,
        mut region: Option<&mut [u8]>,
        bucket: usize,
    ) -> Result<(), WeightSyncError> {
        let Self {
            local,
            stage,
            rank0,
            dense,
            experts,
            stats,
            window,
            pending,
            ..
        } = self;
        let expert = matches!(source.split, Split::Experts { .. });
        let group = if expert { experts } else { dense };
        // Not in rank 0's group: no part in this tensor.
        let Some(group) = group.as_ref() else {
            return Ok(());
        };
        // The members holding the tensor: those on its stage (one for a replicated tensor).
        let mut senders: Vec<(usize, Coords)> = group
            .coords
            .iter()
            .copied()
            .enumerate()
            .filter(|(_, c)| c.stage == source.stage)
            .collect();
        if source.split == Split::Replicated {
            senders.retain(|(_, c)| c.a == 0);
            senders.truncate(1);
        }
        if senders.is_empty() {
            return Err(WeightSyncError::Layout {
                name: t.name.clone(),
                reason: format!(
                    "no rank of pipeline stage {} in global rank 0's group",
                    source.stage
                ),
            });
        }
        let comm = group.comm.as_ref();
        let no_group = || WeightSyncError::Layout {
            name: t.name.clone(),
            reason: "a remote piece outside any group".to_owned(),
        };
        for &(member, coords) in &senders {
            let from_me = member == group.me;
            if !*rank0 && !from_me {
                continue;
            }
            let Some(piece) = piece(t, source, coords)? else {
                continue;
            };
            let data = if from_me {
                let lazy = match local.get(source.entry) {
                    Some((spec, lazy)) if *stage == source.stage && spec.shape == source.local => {
                        lazy
                    }
                    _ => {
                        return Err(WeightSyncError::Layout {
                            name: t.name.clone(),
                            reason: format!(
                                "pipeline rank {stage} does not hold entry {} {:?} of stage {}",
                                source.entry, source.local, source.stage
                            ),
                        });
                    }
                };
                let cut = match piece.narrow.split_first() {
                    None => lazy.fetch(),
                    Some((&(dim, start, len), rest)) => {
                        let mut cut = lazy.narrow(dim, start, len);
                        for &(dim, start, len) in rest {
                            cut = cut.narrow(dim, start, len);
                        }
                        cut.fetch()
                    }
                };
                match piece.release {
                    Some(layout) => to_release(&t.name, layout, cut)?,
                    None => cut,
                }
            } else {
                // Senders cast their pieces to the sync dtype (below).
                comm.ok_or_else(no_group)?.communicator().recv(
                    &piece.shape,
                    t.dtype,
                    member,
                    Location::caller(),
                )?
            };
            let piece_bytes = data.as_bytes().len();
            match region.as_deref_mut() {
                Some(region) => {
                    stats.hold(bucket, piece_bytes);
                    scatter(
                        &t.name,
                        region,
                        t.dtype,
                        data.as_bytes(),
                        data.dtype(),
                        &piece.bx,
                    )?
                }
                None => {
                    // Cast before sending: the senders share the conversion work with rank
                    // 0, and a bf16 piece travels in half the bytes.
                    let data = if data.dtype() == t.dtype {
                        stats.hold(0, piece_bytes);
                        data
                    } else {
                        let numel: usize = piece.shape.iter().product();
                        if piece_bytes != numel * data.dtype().size() {
                            return Err(WeightSyncError::Layout {
                                name: t.name.clone(),
                                reason: format!(
                                    "a {piece_bytes}-byte piece for shape {:?}",
                                    piece.shape
                                ),
                            });
                        }
                        let mut cast = vec![0u8; numel * t.dtype.size()];
                        convert(&t.name, &mut cast, t.dtype, data.as_bytes(), data.dtype())?;
                        stats.hold(0, piece_bytes);
                        stats.peak_buffer_bytes = stats
                            .peak_buffer_bytes
                            .max((piece_bytes + cast.len()) as u64);
                        TensorData::from_bytes_vec(cast, piece.shape.clone(), t.dtype)
                    };
                    comm.ok_or_else(no_group)?.communicator().send(
                        data,
                        group.root,
                        Location::caller(),
                    )?
                }
            }
        }
        // Flow control: once the tensors sent over this group since its last barrier reach
        // the largest tensor's size, the senders wait until rank 0 has received them all, so
        // less than two tensors' pieces are ever in flight (every member counts the same plan;
        // rank 0's own pieces do not travel).
        if let Some(comm) = comm
            && senders.iter().any(|&(member, _)| member != group.root)
        {
            let sent = &mut pending[usize::from(expert)];
            *sent += t.bytes;
            if *sent >= *window {
                *sent = 0;
                comm.communicator().barrier(Location::caller())?;
            }
        }
        Ok(())
    }
}

impl Iterator for WeightSync {
    type Item = Result<Option<WeightBucket>, WeightSyncError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.next >= self.manifest.buckets.len() {
            return None;
        }
        let index = self.next;
        self.next += 1;
        let out = self.next_bucket(index);
        self.failed = out.is_err();
        Some(out)
    }
}

/// Collective: streams the full HF tensors of `shard` (this rank's shard, see
/// [`WeightSync::new`]) into `receiver` on the receiving ranks; returns this rank's stats.
pub fn sync_weights<M: ExportHf + ?Sized>(
    shard: &M,
    groups: &GroupComms,
    options: SyncOptions,
    receiver: Option<&mut dyn WeightReceiver>,
) -> Result<SyncStats, WeightSyncError> {
    WeightSync::new(shard, groups, options)?.run(receiver)
}

/// Every pipeline stage's local (fused) HF entries, indexed by pipeline rank: this rank's
/// `local` exchanged over its `pp` group (names, shapes and dtypes only; every rank of a stage
/// lists the same ones).
fn stage_specs(
    groups: &GroupComms,
    table: &GroupTable,
    local: Vec<HfTensorSpec>,
) -> Result<Vec<Vec<HfTensorSpec>>, WeightSyncError> {
    let comm = groups.comm(GroupFamily::Pp);
    if comm.size() == 1 {
        return Ok(vec![local]);
    }
    let bytes = encode_specs(&local)?;
    let n = bytes.len();
    let (data, counts) = comm.communicator().all_gather_v(
        TensorData::from_bytes_vec(bytes, [n], DType::U8),
        Location::caller(),
    )?;
    let all = data.as_bytes();
    let mut stages = vec![None; comm.size()];
    let mut at = 0;
    for (&global, &count) in comm.ranks().iter().zip(&counts) {
        let stage = table.for_rank(global)?.get(GroupFamily::Pp).index;
        let chunk = all.get(at..at + count).ok_or_else(|| {
            WeightSyncError::Unsupported(format!(
                "the pipeline stages' tensor lists are {} bytes, {} expected",
                all.len(),
                counts.iter().sum::<usize>()
            ))
        })?;
        at += count;
        let specs = decode_specs(chunk, stage)?;
        match stages.get_mut(stage) {
            Some(slot @ None) => *slot = Some(specs),
            _ => {
                return Err(WeightSyncError::Unsupported(format!(
                    "pipeline rank {stage} appears twice in the pp group {:?}",
                    comm.ranks()
                )));
            }
        }
    }
    stages
        .into_iter()
        .enumerate()
        .map(|(stage, specs)| {
            specs.ok_or_else(|| {
                WeightSyncError::Unsupported(format!(
                    "pipeline rank {stage} is missing from the pp group {:?}",
                    comm.ranks()
                ))
            })
        })
        .collect()
}

/// `data` (a holder's local experts, canonical) in release layout `layout`: the same elements
/// permuted (exact: pure data movement, any dtype).
fn to_release(
    name: &str,
    layout: ReleaseLayout,
    data: TensorData,
) -> Result<TensorData, WeightSyncError> {
    let bad = |reason: String| WeightSyncError::Layout {
        name: name.to_owned(),
        reason,
    };
    let shape: Vec<usize> = data.shape().to_vec();
    let dtype = data.dtype();
    let stored = (layout.stored_shape(name, &shape)).map_err(|e| bad(e.to_string()))?;
    let bytes = data.as_bytes();
    let out = match dtype.size() {
        1 => permute::<1>(name, layout, &shape, bytes),
        2 => permute::<2>(name, layout, &shape, bytes),
        4 => permute::<4>(name, layout, &shape, bytes),
        8 => permute::<8>(name, layout, &shape, bytes),
        n => return Err(bad(format!("{n}-byte elements"))),
    }
    .map_err(|e| bad(e.to_string()))?;
    Ok(TensorData::from_bytes_vec(out, stored, dtype))
}

/// [`ReleaseLayout::to_stored`] on `N`-byte elements.
fn permute<const N: usize>(
    name: &str,
    layout: ReleaseLayout,
    shape: &[usize],
    bytes: &[u8],
) -> Result<Vec<u8>, crate::ModelError> {
    let elems: Vec<[u8; N]> = (bytes.chunks_exact(N))
        .map(|c| <[u8; N]>::try_from(c).unwrap_or([0; N]))
        .collect();
    Ok(layout.to_stored(name, shape, &elems)?.concat())
}
