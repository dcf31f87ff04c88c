//! The collective producer: every rank walks the same plan, the ranks holding a tensor's pieces
//! send them to global rank 0, which packs them into buckets.

use std::panic::Location;
use std::time::Instant;

use burn::tensor::{DType, TensorData};
use moe_backend::comm::{Comm, GroupComms};
use moe_backend::parallel::{GroupFamily, GroupTable};

use super::bucket::{SyncManifest, SyncedTensor, WeightBucket};
use super::host::{PieceBox, convert, scatter};
use super::{ExpertNames, SyncDest, SyncOptions, WeightReceiver, WeightSyncError};
use crate::distributed::{ShardRule, shard_rule};
use crate::export::{ExportHf, HfTensorSpec, LazyTensor, keeps_f32};
use crate::param_plan::hf_names;

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
    /// Most bytes of sync buffers (bucket + piece) this rank held at once.
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

/// Which part of a layer's local expert tensors a synced tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ExpertPart {
    /// The fused `gate_up_proj [E, 2·Im, H]`.
    FusedGateUp,
    /// The fused `down_proj [E, H, Im]`.
    FusedDown,
    /// Expert `e`'s `gate_proj [Im, H]`.
    Gate(usize),
    /// Expert `e`'s `up_proj [Im, H]`.
    Up(usize),
    /// Expert `e`'s `down_proj [H, Im]`.
    Down(usize),
}

/// Where a synced tensor's pieces are: `entry` indexes this rank's local (fused) export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// Rank 0's own copy.
    Replicated { entry: usize },
    /// One piece per member of rank 0's `tp` group, concatenated along `dim`.
    Tp { entry: usize, dim: usize },
    /// Routed experts, from the members of rank 0's expert `tp_ep` group.
    Experts { entry: usize, part: ExpertPart },
}

/// One piece of a tensor: how its holder cuts it from its local entry, and where it lands.
struct Piece {
    /// `(dim, start, len)` narrowings of the local entry.
    narrow: Vec<(usize, usize, usize)>,
    /// Shape of the cut (what travels).
    shape: Vec<usize>,
    /// Its box in the synced tensor.
    bx: PieceBox,
}

/// Rank 0's group of one family, seen from one of its members.
struct Group {
    /// The communicator (`None` when the group has one member).
    comm: Option<Comm>,
    /// This rank's member index.
    me: usize,
    /// Rank 0's member index.
    root: usize,
    /// `(ep rank, etp rank)` of every member (expert group), or `(tp rank, 0)`.
    coords: Vec<(usize, usize)>,
}

impl Group {
    /// The group of `family` if it contains global rank 0 (`None` otherwise).
    fn of_rank0(
        groups: &GroupComms,
        family: GroupFamily,
        coords: impl Fn(usize, usize) -> Result<(usize, usize), WeightSyncError>,
    ) -> Result<Option<Self>, WeightSyncError> {
        let comm = groups.comm(family);
        let Some(root) = comm.ranks().iter().position(|&g| g == 0) else {
            return Ok(None);
        };
        let coords = comm
            .ranks()
            .iter()
            .enumerate()
            .map(|(member, &global)| coords(member, global))
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
    rank0: bool,
    tp: Option<Group>,
    experts: Option<Group>,
    /// The broadcast group and rank 0's member index in it (this rank a member).
    broadcast: Option<(Comm, usize)>,
    receives: bool,
    /// Flow control: senders wait for rank 0 at a barrier of their group once the tensors
    /// sent since the last one reach this many bytes (the largest synced tensor).
    window: usize,
    /// Bytes sent over rank 0's `tp` / `tp_ep` group since its last barrier.
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
    /// e.g. `trainer.model().model()`; a full model at `world = 1`). Collective in use: every
    /// rank builds one with the same options and drains it.
    pub fn new<M: ExportHf + ?Sized>(
        shard: &M,
        groups: &GroupComms,
        options: SyncOptions,
    ) -> Result<Self, WeightSyncError> {
        let layout = &groups.groups.layout;
        if layout.pp != 1 || layout.cp != 1 {
            return Err(WeightSyncError::Unsupported(format!(
                "layout {layout}: pipeline and context parallelism are not supported (pp = cp = 1)"
            )));
        }
        if options.bucket_bytes == 0 {
            return Err(WeightSyncError::Unsupported(
                "bucket_bytes must be at least 1".to_owned(),
            ));
        }
        let local = shard.hf_tensors_as(ExpertNames::Fused)?.into_lazy();
        let (tensors, sources) = plan(&local, layout.tp, layout.ep, layout.etp, &options)?;
        let manifest = SyncManifest::pack(
            tensors,
            options.bucket_bytes,
            options.dtype,
            options.experts,
        );

        let rank0 = groups.groups.rank == 0;
        let tp = Group::of_rank0(groups, GroupFamily::Tp, |member, _| Ok((member, 0)))?;
        let table = GroupTable::new(layout)?;
        let experts = Group::of_rank0(groups, GroupFamily::TpEp, |_, global| {
            let pg = table.for_rank(global)?;
            Ok((pg.ep_rank(), pg.get(GroupFamily::ExptTp).index))
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
            rank0,
            tp,
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
            let source = self.sources[first + j];
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
            self.transfer(t, source, region, bytes)?;
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
        source: Source,
        mut region: Option<&mut [u8]>,
        bucket: usize,
    ) -> Result<(), WeightSyncError> {
        let Self {
            local,
            rank0,
            tp,
            experts,
            stats,
            window,
            pending,
            ..
        } = self;
        let (entry, group) = match source {
            Source::Replicated { entry } => (entry, None),
            Source::Tp { entry, .. } => (entry, tp.as_ref()),
            Source::Experts { entry, .. } => (entry, experts.as_ref()),
        };
        let (spec, lazy) = &local[entry];
        let members: Vec<(usize, usize)> = match (source, group) {
            (Source::Replicated { .. }, _) if *rank0 => vec![(0, 0)],
            // Replicated tensors are rank 0's own copies.
            (Source::Replicated { .. }, _) => return Ok(()),
            (_, Some(g)) => g.coords.clone(),
            // Not in rank 0's group: no part in this tensor.
            (_, None) => return Ok(()),
        };
        let (me, root) = group.map_or((0, 0), |g| (g.me, g.root));
        let comm = group.and_then(|g| g.comm.as_ref());
        let no_group = || WeightSyncError::Layout {
            name: t.name.clone(),
            reason: "a remote piece outside any group".to_owned(),
        };
        for (member, &coords) in members.iter().enumerate() {
            let from_me = member == me;
            if !*rank0 && !from_me {
                continue;
            }
            let Some(piece) = piece(t, source, coords, &spec.shape)? else {
                continue;
            };
            let data = if from_me {
                match piece.narrow.split_first() {
                    None => lazy.fetch(),
                    Some((&(dim, start, len), rest)) => {
                        let mut cut = lazy.narrow(dim, start, len);
                        for &(dim, start, len) in rest {
                            cut = cut.narrow(dim, start, len);
                        }
                        cut.fetch()
                    }
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
                        stats.hold(0, piece_bytes + cast.len());
                        TensorData::from_bytes_vec(cast, piece.shape.clone(), t.dtype)
                    };
                    comm.ok_or_else(no_group)?.communicator().send(
                        data,
                        root,
                        Location::caller(),
                    )?
                }
            }
        }
        // Flow control: once the tensors sent over this group since its last barrier reach
        // the largest tensor's size, the senders wait until rank 0 has received them all, so
        // less than two tensors' pieces are ever in flight (every member counts the same plan).
        if let Some(comm) = comm {
            let sent = &mut pending[usize::from(matches!(source, Source::Experts { .. }))];
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

type Planned = (Vec<(String, DType, Vec<usize>)>, Vec<Source>);

/// The synced tensors (name, dtype, full shape) and where each comes from, from this rank's
/// local fused export (the same names and shapes on every rank).
fn plan(
    local: &[(HfTensorSpec, Box<dyn LazyTensor>)],
    tp: usize,
    ep: usize,
    etp: usize,
    options: &SyncOptions,
) -> Result<Planned, WeightSyncError> {
    let mut tensors = Vec::new();
    let mut sources = Vec::new();
    let mut push = |name: String, shape: Vec<usize>, source: Source| {
        let dtype = if keeps_f32(&name) {
            DType::F32
        } else {
            options.dtype.dtype()
        };
        tensors.push((name, dtype, shape));
        sources.push(source);
    };
    let bad = |name: &str, reason: String| WeightSyncError::Layout {
        name: name.to_owned(),
        reason,
    };
    let mut k = 0;
    while k < local.len() {
        let spec = &local[k].0;
        match shard_rule(&spec.name) {
            ShardRule::Replicated => push(
                spec.name.clone(),
                spec.shape.clone(),
                Source::Replicated { entry: k },
            ),
            ShardRule::Tp { dim } => {
                let mut shape = spec.shape.clone();
                let extent = shape.get_mut(dim).ok_or_else(|| {
                    bad(
                        &spec.name,
                        format!("TP splits dim {dim} of {:?}", spec.shape),
                    )
                })?;
                *extent *= tp;
                push(spec.name.clone(), shape, Source::Tp { entry: k, dim });
            }
            ShardRule::Expert { etp_dim } => {
                let prefix = match hf_names::split_stacked(&spec.name) {
                    Some((prefix, true)) => prefix,
                    _ => {
                        return Err(bad(
                            &spec.name,
                            "expected the layer's stacked gate/up projection first".to_owned(),
                        ));
                    }
                };
                let down_name = hf_names::stacked_down(prefix);
                let down = local
                    .get(k + 1)
                    .map(|(s, _)| s)
                    .filter(|s| s.name == down_name)
                    .ok_or_else(|| bad(&spec.name, format!("`{down_name}` does not follow")))?;
                let (&[l, two_iml, h], &[l2, h2, iml]) =
                    (spec.shape.as_slice(), down.shape.as_slice())
                else {
                    return Err(bad(
                        &spec.name,
                        format!("expert shapes {:?} / {:?}", spec.shape, down.shape),
                    ));
                };
                // The pieces below split the FFN width (canonical dim 2 of [E, 2, Im, H]).
                if etp_dim != 2 || l != l2 || h != h2 || two_iml != 2 * iml {
                    return Err(bad(
                        &spec.name,
                        format!(
                            "expert shapes {:?} / {:?} (ETP dim {etp_dim})",
                            spec.shape, down.shape
                        ),
                    ));
                }
                let (e, im) = (l * ep, iml * etp);
                let (gu, dn) = (k, k + 1);
                match options.experts {
                    ExpertNames::Fused => {
                        push(
                            spec.name.clone(),
                            vec![e, 2 * im, h],
                            Source::Experts {
                                entry: gu,
                                part: ExpertPart::FusedGateUp,
                            },
                        );
                        push(
                            down_name,
                            vec![e, h, im],
                            Source::Experts {
                                entry: dn,
                                part: ExpertPart::FusedDown,
                            },
                        );
                    }
                    ExpertNames::PerExpert => {
                        for x in 0..e {
                            for (proj, entry, part, shape) in [
                                (hf_names::GATE_PROJ, gu, ExpertPart::Gate(x), vec![im, h]),
                                (hf_names::UP_PROJ, gu, ExpertPart::Up(x), vec![im, h]),
                                (hf_names::DOWN_PROJ, dn, ExpertPart::Down(x), vec![h, im]),
                            ] {
                                push(
                                    hf_names::expert_proj_weight(prefix, x, proj),
                                    shape,
                                    Source::Experts { entry, part },
                                );
                            }
                        }
                    }
                }
                k += 2;
                continue;
            }
        }
        k += 1;
    }
    Ok((tensors, sources))
}

/// The piece of synced tensor `t` that the group member at `coords` holds (`None`: none),
/// given the local entry's shape (the same on every rank).
fn piece(
    t: &SyncedTensor,
    source: Source,
    (a, b): (usize, usize),
    local: &[usize],
) -> Result<Option<Piece>, WeightSyncError> {
    let whole = || Piece {
        narrow: Vec::new(),
        shape: local.to_vec(),
        bx: PieceBox::whole(local),
    };
    let bad = || WeightSyncError::Layout {
        name: t.name.clone(),
        reason: format!("local shape {local:?} for a {:?} tensor", t.shape),
    };
    Ok(Some(match source {
        Source::Replicated { .. } => whole(),
        Source::Tp { dim, .. } => {
            // `a` is the member's TP rank.
            let extent = *local.get(dim).ok_or_else(bad)?;
            let mut offsets = vec![0; local.len()];
            offsets[dim] = a * extent;
            Piece {
                narrow: Vec::new(),
                shape: local.to_vec(),
                bx: PieceBox {
                    full: t.shape.clone(),
                    offsets,
                    shape: local.to_vec(),
                },
            }
        }
        Source::Experts { part, .. } => {
            // `(a, b)` = the member's (EP rank, ETP rank); `L` local experts of `iml` rows.
            let (ep_rank, etp_rank) = (a, b);
            let &[l, d1, d2] = local else {
                return Err(bad());
            };
            match part {
                ExpertPart::FusedGateUp => {
                    let (iml, h) = (d1 / 2, d2);
                    let (e, im) = (t.shape[0], t.shape[1] / 2);
                    Piece {
                        narrow: Vec::new(),
                        shape: local.to_vec(),
                        bx: PieceBox {
                            full: vec![e, 2, im, h],
                            offsets: vec![ep_rank * l, 0, etp_rank * iml, 0],
                            shape: vec![l, 2, iml, h],
                        },
                    }
                }
                ExpertPart::FusedDown => Piece {
                    narrow: Vec::new(),
                    shape: local.to_vec(),
                    bx: PieceBox {
                        full: t.shape.clone(),
                        offsets: vec![ep_rank * l, 0, etp_rank * d2],
                        shape: local.to_vec(),
                    },
                },
                ExpertPart::Gate(x) | ExpertPart::Up(x) => {
                    if x / l != ep_rank {
                        return Ok(None);
                    }
                    let (iml, h) = (d1 / 2, d2);
                    let rows = if matches!(part, ExpertPart::Gate(_)) {
                        0
                    } else {
                        iml
                    };
                    Piece {
                        narrow: vec![(0, x % l, 1), (1, rows, iml)],
                        shape: vec![1, iml, h],
                        bx: PieceBox {
                            full: t.shape.clone(),
                            offsets: vec![etp_rank * iml, 0],
                            shape: vec![iml, h],
                        },
                    }
                }
                ExpertPart::Down(x) => {
                    if x / l != ep_rank {
                        return Ok(None);
                    }
                    let (h, iml) = (d1, d2);
                    Piece {
                        narrow: vec![(0, x % l, 1)],
                        shape: vec![1, h, iml],
                        bx: PieceBox {
                            full: t.shape.clone(),
                            offsets: vec![0, etp_rank * iml],
                            shape: vec![h, iml],
                        },
                    }
                }
            }
        }
    }))
}
