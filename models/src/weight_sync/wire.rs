//! The weight-sync wire format, version 1: a sync streamed over any byte stream (a TCP socket,
//! a pipe, a file) to a rollout engine in another process.
//!
//! [`WireSender`] is a [`WeightReceiver`] that writes the sync to a [`Write`]; [`receive_wire`]
//! reads one sync from a [`Read`], checks it and hands it to any [`WeightReceiver`] (e.g. a
//! [`ModelReceiver`](super::ModelReceiver)) in the same order the producer would have: `begin`
//! with the manifest, `receive` per bucket, `finish`. This section is the specification an
//! external engine implements; the in-process types it mirrors are [`SyncManifest`] and
//! [`WeightBucket`]. The framing follows the usual length-prefixed, checksummed record style
//! (TFRecord / TensorBoard event files use CRC32C the same way); the payload is what slime's and
//! NeMo-RL's bucketed weight updates hand to their engines: HF-named tensors packed back to back.
//!
//! # Byte layout
//!
//! Every integer is **little-endian**; `u32`/`u64` are unsigned. CRC32C is the Castagnoli CRC
//! (polynomial `0x1EDC6F41`, reflected, init and final XOR `0xFFFFFFFF`: `crc32c("123456789")
//! = 0xE3069283`), unmasked. One stream carries one sync:
//!
//! ```text
//! stream   := header manifest bucket{N} end
//! header   := magic: 8 bytes "MOEWSYNC" | version: u32 = 1
//! manifest := tag: u8 'M' (0x4D) | len: u64 | crc: u32 = CRC32C(json) | json: len bytes
//! bucket   := tag: u8 'B' (0x42) | index: u64 | len: u64 | crc: u32 = CRC32C(data) | data: len bytes
//! end      := tag: u8 'E' (0x45) | buckets: u64 = N | bytes: u64 = Σ len of the buckets
//! ```
//!
//! The manifest's JSON (UTF-8, at most [`MAX_MANIFEST_BYTES`]) lists the whole plan before any
//! data moves:
//!
//! ```text
//! { "version": 1,
//!   "dtype": "BF16" | "F32",                 // the dtype tensors travel in
//!   "experts": "per_expert" | "fused",       // routed-expert naming
//!   "buckets": [ { "index": 0, "bytes": 4096,
//!                  "tensors": [ { "name": "model.embed_tokens.weight", "dtype": "BF16",
//!                                 "shape": [32, 16], "offset": 0, "bytes": 1024 }, … ] }, … ] }
//! ```
//!
//! - `buckets[i].index` is `i`; buckets follow the manifest in that order, each exactly once,
//!   and the `N` of the grammar is `buckets.len()`.
//! - A tensor's `dtype` is a safetensors dtype name: `F32`, `BF16` or `F16` (each HF weight
//!   travels in the sync dtype, `e_score_correction_bias` always in F32). Its bytes are its
//!   values row-major (PyTorch `[out, in]` orientation), little-endian, at
//!   `data[offset .. offset + bytes]` of its bucket, `bytes = product(shape) · dtype size`.
//! - A bucket's tensors are packed back to back from offset 0, and its `bytes` is their sum:
//!   the bucket frame's `len` must equal it.
//! - With `"per_expert"` routed experts are `…mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight`;
//!   with `"fused"` they are HF's `…mlp.experts.gate_up_proj [E, 2·Im, H]` and
//!   `…mlp.experts.down_proj [E, H, Im]`.
//! - Unknown JSON fields are ignored (room for additions within version 1).
//!
//! After the end frame the stream may continue or close; the reader stops there.
//!
//! # Acknowledgement
//!
//! Over a two-way connection (a socket) the reading side answers with one frame on the way
//! back, so that the trainer learns whether the weights were taken:
//!
//! ```text
//! ack := tag: u8 'A' (0x41) | status: u32 (0 = loaded, 1 = refused) | len: u64 | message: len bytes
//! ```
//!
//! `message` is UTF-8 (at most [`MAX_ACK_MESSAGE_BYTES`]): empty when loaded, the reason when
//! refused. The reader sends it once the receiver's `finish` returned, or as soon as it
//! refuses the stream; a refusing reader then keeps reading (and discarding) until the sender
//! closes, so that the sender's remaining writes do not fail before it reads the answer. The
//! sender reads it after its end frame ([`write_ack`], [`read_ack`]).
//!
//! # Errors
//!
//! The reader refuses, naming the byte offset of the offending field (and the bucket, with its
//! first tensor, where there is one): a wrong magic ([`WeightSyncError::WireMagic`]) or
//! version ([`WeightSyncError::WireVersion`]); an unexpected tag, an invalid manifest (bad
//! JSON, an unknown dtype, a tensor whose byte range is not packed as above) or a wrong end frame
//! ([`WeightSyncError::WireFormat`], or [`WeightSyncError::Malformed`] naming the tensor, or
//! [`WeightSyncError::DuplicateTensor`] for a name listed twice); a
//! bucket out of order ([`WeightSyncError::WireBucketOrder`]) or of another length than the
//! manifest's ([`WeightSyncError::WireBucketSize`]); a CRC mismatch
//! ([`WeightSyncError::WireChecksum`]); a stream that ends early or fails to read
//! ([`WeightSyncError::WireIo`]). Errors of the inner receiver (e.g. a tensor the target model
//! does not have, or of another shape) are returned as they are; a [`ModelReceiver`] checks the
//! whole manifest in `begin`, before any bucket is read. No input makes the reader panic.
//!
//! Memory: the sender writes each bucket as it gets it and the reader holds at most one bucket's
//! bytes (read straight into a buffer of exactly its length) besides the manifest.
//!
//! [`ModelReceiver`]: super::ModelReceiver

use std::collections::HashSet;
use std::io::{self, Read, Write};
use std::time::Instant;

use burn::tensor::DType;
use serde::{Deserialize, Serialize};

use super::bucket::{BucketMeta, SyncManifest, SyncedTensor, WeightBucket};
use super::{ExpertNames, SyncDtype, WeightReceiver, WeightSyncError};

/// The 8 bytes a weight-sync stream starts with.
pub const WIRE_MAGIC: [u8; 8] = *b"MOEWSYNC";

/// The version of the wire format this module writes and reads.
pub const WIRE_VERSION: u32 = 1;

/// Largest manifest JSON the reader accepts (1 GiB).
pub const MAX_MANIFEST_BYTES: u64 = 1 << 30;

const TAG_MANIFEST: u8 = b'M';
const TAG_BUCKET: u8 = b'B';
const TAG_END: u8 = b'E';
const TAG_ACK: u8 = b'A';

/// Longest message of an acknowledgement frame the reader of one accepts (64 KiB).
pub const MAX_ACK_MESSAGE_BYTES: u64 = 64 << 10;

/// What one wire transfer moved.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WireStats {
    /// Buckets transferred.
    pub buckets: usize,
    /// Tensors of the sync (the manifest's).
    pub tensors: usize,
    /// Σ bytes of the buckets (tensor data).
    pub payload_bytes: u64,
    /// Bytes of the whole stream (header, frames and payload).
    pub stream_bytes: u64,
    /// Largest bucket in bytes.
    pub max_bucket_bytes: u64,
    /// Wall time (for the reader including the inner receiver).
    pub seconds: f64,
}

// ---------------------------------------------------------------------------------------------
// The manifest's JSON.

#[derive(Serialize, Deserialize)]
struct JsonManifest {
    version: u32,
    dtype: String,
    experts: String,
    buckets: Vec<JsonBucket>,
}

#[derive(Serialize, Deserialize)]
struct JsonBucket {
    index: u64,
    bytes: u64,
    tensors: Vec<JsonTensor>,
}

#[derive(Serialize, Deserialize)]
struct JsonTensor {
    name: String,
    dtype: String,
    shape: Vec<u64>,
    offset: u64,
    bytes: u64,
}

/// The safetensors name of a dtype the wire carries.
fn dtype_name(name: &str, dtype: DType) -> Result<&'static str, WeightSyncError> {
    match dtype {
        DType::F32 => Ok("F32"),
        DType::BF16 => Ok("BF16"),
        DType::F16 => Ok("F16"),
        other => Err(WeightSyncError::UnsupportedDtype {
            name: name.to_owned(),
            dtype: other,
        }),
    }
}

fn parse_dtype(s: &str) -> Option<DType> {
    match s {
        "F32" => Some(DType::F32),
        "BF16" => Some(DType::BF16),
        "F16" => Some(DType::F16),
        _ => None,
    }
}

fn sync_dtype_name(dtype: SyncDtype) -> &'static str {
    match dtype {
        SyncDtype::Bf16 => "BF16",
        SyncDtype::F32 => "F32",
    }
}

fn experts_name(experts: ExpertNames) -> &'static str {
    match experts {
        ExpertNames::PerExpert => "per_expert",
        ExpertNames::Fused => "fused",
    }
}

/// The manifest's JSON (as the sender writes it).
fn manifest_json(manifest: &SyncManifest) -> Result<Vec<u8>, WeightSyncError> {
    let buckets = manifest
        .buckets
        .iter()
        .enumerate()
        .map(|(index, b)| {
            let tensors = b
                .tensors
                .iter()
                .map(|t| {
                    Ok(JsonTensor {
                        name: t.name.clone(),
                        dtype: dtype_name(&t.name, t.dtype)?.to_owned(),
                        shape: t.shape.iter().map(|&d| d as u64).collect(),
                        offset: t.offset as u64,
                        bytes: t.bytes as u64,
                    })
                })
                .collect::<Result<Vec<_>, WeightSyncError>>()?;
            Ok(JsonBucket {
                index: index as u64,
                bytes: b.bytes as u64,
                tensors,
            })
        })
        .collect::<Result<Vec<_>, WeightSyncError>>()?;
    let json = JsonManifest {
        version: WIRE_VERSION,
        dtype: sync_dtype_name(manifest.dtype).to_owned(),
        experts: experts_name(manifest.experts).to_owned(),
        buckets,
    };
    serde_json::to_vec(&json)
        .map_err(|e| WeightSyncError::Unsupported(format!("cannot encode the manifest: {e}")))
}

/// Parses and checks a manifest's JSON; `offset` is where the JSON starts in the stream.
fn parse_manifest(json: &[u8], offset: u64) -> Result<SyncManifest, WeightSyncError> {
    let format = |reason: String| WeightSyncError::WireFormat { offset, reason };
    let m: JsonManifest = serde_json::from_slice(json)
        .map_err(|e| format(format!("the manifest is not valid JSON of the format: {e}")))?;
    if m.version != WIRE_VERSION {
        return Err(format(format!(
            "the manifest says version {}, the stream header {WIRE_VERSION}",
            m.version
        )));
    }
    let dtype = match m.dtype.as_str() {
        "BF16" => SyncDtype::Bf16,
        "F32" => SyncDtype::F32,
        other => return Err(format(format!("unknown sync dtype {other:?}"))),
    };
    let experts = match m.experts.as_str() {
        "per_expert" => ExpertNames::PerExpert,
        "fused" => ExpertNames::Fused,
        other => return Err(format(format!("unknown expert naming {other:?}"))),
    };
    let mut names = HashSet::new();
    let mut buckets = Vec::with_capacity(m.buckets.len());
    for (i, b) in m.buckets.into_iter().enumerate() {
        if b.index != i as u64 {
            return Err(format(format!("manifest bucket {i} has index {}", b.index)));
        }
        let bucket_bytes = usize::try_from(b.bytes)
            .map_err(|_| format(format!("bucket {i} has {} bytes", b.bytes)))?;
        let mut packed = 0usize;
        let mut tensors = Vec::with_capacity(b.tensors.len());
        for t in b.tensors {
            let malformed = |reason: String| WeightSyncError::Malformed {
                name: t.name.clone(),
                reason: format!("manifest bucket {i}: {reason}"),
            };
            let tensor_dtype = parse_dtype(&t.dtype)
                .ok_or_else(|| malformed(format!("unknown dtype {:?}", t.dtype)))?;
            let shape = t
                .shape
                .iter()
                .map(|&d| usize::try_from(d).ok())
                .collect::<Option<Vec<usize>>>()
                .ok_or_else(|| malformed(format!("shape {:?} is too large", t.shape)))?;
            let expected = shape
                .iter()
                .try_fold(tensor_dtype.size(), |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| malformed(format!("shape {shape:?} is too large")))?;
            if t.bytes != expected as u64 {
                return Err(malformed(format!(
                    "{} bytes for a {} {shape:?} tensor ({expected} expected)",
                    t.bytes, t.dtype
                )));
            }
            if t.offset != packed as u64 {
                return Err(malformed(format!(
                    "offset {} where the tensors packed back to back put it at {packed}",
                    t.offset
                )));
            }
            packed = packed
                .checked_add(expected)
                .filter(|&end| end <= bucket_bytes)
                .ok_or_else(|| {
                    malformed(format!(
                        "bytes {}..+{expected} lie outside the bucket's {bucket_bytes} bytes",
                        t.offset
                    ))
                })?;
            if !names.insert(t.name.clone()) {
                return Err(WeightSyncError::DuplicateTensor { name: t.name });
            }
            tensors.push(SyncedTensor {
                name: t.name,
                dtype: tensor_dtype,
                shape,
                offset: t.offset as usize,
                bytes: expected,
            });
        }
        if packed != bucket_bytes {
            return Err(format(format!(
                "manifest bucket {i} says {bucket_bytes} bytes, its tensors fill {packed}"
            )));
        }
        buckets.push(BucketMeta {
            tensors,
            bytes: bucket_bytes,
        });
    }
    Ok(SyncManifest {
        buckets,
        dtype,
        experts,
    })
}

/// `bucket i (first tensor `name`)`, for messages.
fn describe_bucket(index: usize, tensors: &[SyncedTensor]) -> String {
    match tensors.first() {
        Some(t) => format!("bucket {index} (first tensor `{}`)", t.name),
        None => format!("bucket {index}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Sender.

/// A [`WeightReceiver`] that streams the sync to `writer` in the wire format (module docs), so
/// that `sync_weights(…, Some(&mut sender))` feeds a rollout engine in another process.
///
/// It writes the header and manifest in `begin`, each bucket as it arrives in `receive`
/// (nothing is buffered beyond the caller's bucket) and the end frame in `finish`, then flushes.
/// One sender carries one sync; the buckets must come in the manifest's order with the
/// manifest's sizes. A write error names what was being written and the byte offset.
#[derive(Debug)]
pub struct WireSender<W: Write> {
    writer: W,
    /// Byte length of every bucket of the manifest (`None` before `begin`).
    sizes: Option<Vec<usize>>,
    next: usize,
    finished: bool,
    stats: WireStats,
    start: Option<Instant>,
}

impl<W: Write> WireSender<W> {
    /// A sender writing to `writer` (wrap a socket in a [`std::io::BufWriter`] if it should
    /// coalesce the small frame headers; the sender flushes in `finish`).
    pub fn new(writer: W) -> Self {
        Self {
            writer,
            sizes: None,
            next: 0,
            finished: false,
            stats: WireStats::default(),
            start: None,
        }
    }

    /// What has been written so far.
    pub fn stats(&self) -> WireStats {
        let mut stats = self.stats;
        if let Some(start) = self.start {
            stats.seconds = start.elapsed().as_secs_f64();
        }
        stats
    }

    /// Whether the end frame has been written.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// The writer back.
    pub fn into_inner(self) -> W {
        self.writer
    }

    fn write(
        &mut self,
        bytes: &[u8],
        what: impl FnOnce() -> String,
    ) -> Result<(), WeightSyncError> {
        self.writer
            .write_all(bytes)
            .map_err(|source| WeightSyncError::WireIo {
                what: format!("writing {}", what()),
                offset: self.stats.stream_bytes,
                source,
            })?;
        self.stats.stream_bytes += bytes.len() as u64;
        Ok(())
    }
}

impl<W: Write> WeightReceiver for WireSender<W> {
    fn begin(&mut self, manifest: &SyncManifest) -> Result<(), WeightSyncError> {
        if self.sizes.is_some() {
            return Err(WeightSyncError::Unsupported(
                "a wire stream carries one sync; this sender has begun one already".to_owned(),
            ));
        }
        self.start = Some(Instant::now());
        let json = manifest_json(manifest)?;
        let mut header = Vec::with_capacity(8 + 4 + 1 + 8 + 4);
        header.extend_from_slice(&WIRE_MAGIC);
        header.extend_from_slice(&WIRE_VERSION.to_le_bytes());
        header.push(TAG_MANIFEST);
        header.extend_from_slice(&(json.len() as u64).to_le_bytes());
        header.extend_from_slice(&crc32c::crc32c(&json).to_le_bytes());
        self.write(&header, || "the header".to_owned())?;
        self.write(&json, || "the manifest".to_owned())?;
        self.sizes = Some(manifest.buckets.iter().map(|b| b.bytes).collect());
        self.stats.tensors = manifest.num_tensors();
        Ok(())
    }

    fn receive(&mut self, bucket: &WeightBucket) -> Result<(), WeightSyncError> {
        let Some(sizes) = &self.sizes else {
            return Err(WeightSyncError::Unsupported(
                "wire sender: a bucket before `begin`".to_owned(),
            ));
        };
        let what = describe_bucket(bucket.index, &bucket.tensors);
        if self.finished || bucket.index != self.next || self.next >= sizes.len() {
            return Err(WeightSyncError::Unsupported(format!(
                "wire sender: {what} given where bucket {} of {} was next",
                self.next,
                sizes.len()
            )));
        }
        let expected = sizes.get(bucket.index).copied().unwrap_or(0);
        if bucket.data.len() != expected {
            return Err(WeightSyncError::Unsupported(format!(
                "wire sender: {what} has {} bytes, the manifest says {expected}",
                bucket.data.len()
            )));
        }
        let mut header = Vec::with_capacity(1 + 8 + 8 + 4);
        header.push(TAG_BUCKET);
        header.extend_from_slice(&(bucket.index as u64).to_le_bytes());
        header.extend_from_slice(&(bucket.data.len() as u64).to_le_bytes());
        header.extend_from_slice(&crc32c::crc32c(&bucket.data).to_le_bytes());
        self.write(&header, || what.clone())?;
        self.write(&bucket.data, || what.clone())?;
        self.next += 1;
        self.stats.buckets += 1;
        self.stats.payload_bytes += bucket.data.len() as u64;
        self.stats.max_bucket_bytes = self.stats.max_bucket_bytes.max(bucket.data.len() as u64);
        Ok(())
    }

    fn finish(&mut self) -> Result<(), WeightSyncError> {
        let count = self.sizes.as_ref().map(Vec::len);
        if count != Some(self.next) || self.finished {
            return Err(WeightSyncError::Unsupported(format!(
                "wire sender: `finish` after {} of {} buckets",
                self.next,
                count.unwrap_or(0)
            )));
        }
        let mut end = Vec::with_capacity(1 + 8 + 8);
        end.push(TAG_END);
        end.extend_from_slice(&(self.next as u64).to_le_bytes());
        end.extend_from_slice(&self.stats.payload_bytes.to_le_bytes());
        self.write(&end, || "the end frame".to_owned())?;
        let offset = self.stats.stream_bytes;
        self.writer
            .flush()
            .map_err(|source| WeightSyncError::WireIo {
                what: "flushing the stream".to_owned(),
                offset,
                source,
            })?;
        self.finished = true;
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Reader.

/// A reader that counts the bytes it has consumed.
struct Counted<R> {
    inner: R,
    pos: u64,
}

impl<R: Read> Counted<R> {
    /// `N` bytes; `what` names the field for errors.
    fn array<const N: usize>(
        &mut self,
        what: impl FnOnce() -> String,
    ) -> Result<[u8; N], WeightSyncError> {
        let mut buf = [0u8; N];
        let start = self.pos;
        let got = match self.fill(&mut buf) {
            Ok(got) => got,
            Err(source) => {
                return Err(WeightSyncError::WireIo {
                    what: format!("reading {}", what()),
                    offset: start,
                    source,
                });
            }
        };
        if got < N {
            return Err(WeightSyncError::WireIo {
                what: format!("the stream ends inside {} ({got} of {N} bytes)", what()),
                offset: start,
                source: io::ErrorKind::UnexpectedEof.into(),
            });
        }
        Ok(buf)
    }

    fn u32(&mut self, what: impl FnOnce() -> String) -> Result<u32, WeightSyncError> {
        self.array::<4>(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: impl FnOnce() -> String) -> Result<u64, WeightSyncError> {
        self.array::<8>(what).map(u64::from_le_bytes)
    }

    /// Reads into `buf` until it is full or the stream ends; returns the bytes read.
    fn fill(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut got = 0;
        while got < buf.len() {
            let rest = buf.get_mut(got..).unwrap_or_default();
            match self.inner.read(rest) {
                Ok(0) => break,
                Ok(n) => {
                    got += n;
                    self.pos += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(got)
    }

    /// Exactly `len` bytes into a buffer allocated once at that size (`reserve` says whether to
    /// allocate it up front; otherwise it grows as bytes arrive).
    fn bytes(
        &mut self,
        len: u64,
        reserve: bool,
        what: impl Fn() -> String,
    ) -> Result<Vec<u8>, WeightSyncError> {
        let start = self.pos;
        let mut buf = Vec::new();
        if reserve {
            let n = usize::try_from(len).map_err(|_| WeightSyncError::WireFormat {
                offset: start,
                reason: format!("{} of {len} bytes is too large for this machine", what()),
            })?;
            buf.try_reserve_exact(n)
                .map_err(|e| WeightSyncError::WireFormat {
                    offset: start,
                    reason: format!("cannot allocate {len} bytes for {}: {e}", what()),
                })?;
        }
        let got = (&mut self.inner)
            .take(len)
            .read_to_end(&mut buf)
            .map_err(|source| WeightSyncError::WireIo {
                what: format!("reading {}", what()),
                offset: start,
                source,
            })?;
        self.pos += got as u64;
        if (got as u64) < len {
            return Err(WeightSyncError::WireIo {
                what: format!("the stream ends inside {} ({got} of {len} bytes)", what()),
                offset: start,
                source: io::ErrorKind::UnexpectedEof.into(),
            });
        }
        Ok(buf)
    }

    /// A frame tag; `expected` is what the format allows here.
    fn tag(&mut self, expected: u8, what: &str) -> Result<(), WeightSyncError> {
        let offset = self.pos;
        let [tag] = self.array::<1>(|| format!("the tag of {what}"))?;
        if tag != expected {
            return Err(WeightSyncError::WireFormat {
                offset,
                reason: format!(
                    "frame tag {tag:#04x} where {what} (tag {expected:#04x} {:?}) was expected",
                    expected as char
                ),
            });
        }
        Ok(())
    }
}

/// Reads one sync in the wire format (module docs) from `reader`, checking the magic, version,
/// every CRC and the buckets' order and sizes against the manifest, and feeds it to `receiver`:
/// `begin(manifest)`, `receive(bucket)` for every bucket as it arrives, `finish()` once the end
/// frame has been checked. Holds at most one bucket. Stops at the first error (of the stream
/// or of `receiver`) without calling `receiver` further; reads nothing past the end frame.
pub fn receive_wire<R: Read>(
    reader: R,
    receiver: &mut dyn WeightReceiver,
) -> Result<WireStats, WeightSyncError> {
    let start = Instant::now();
    let mut r = Counted {
        inner: reader,
        pos: 0,
    };
    let magic = r.array::<8>(|| "the magic".to_owned())?;
    if magic != WIRE_MAGIC {
        return Err(WeightSyncError::WireMagic {
            found: magic,
            expected: WIRE_MAGIC,
        });
    }
    let version = r.u32(|| "the version".to_owned())?;
    if version != WIRE_VERSION {
        return Err(WeightSyncError::WireVersion {
            found: version,
            supported: WIRE_VERSION,
        });
    }

    r.tag(TAG_MANIFEST, "the manifest")?;
    let len_at = r.pos;
    let len = r.u64(|| "the manifest's length".to_owned())?;
    if len > MAX_MANIFEST_BYTES {
        return Err(WeightSyncError::WireFormat {
            offset: len_at,
            reason: format!("a manifest of {len} bytes (at most {MAX_MANIFEST_BYTES})"),
        });
    }
    let crc = r.u32(|| "the manifest's CRC32C".to_owned())?;
    let json_at = r.pos;
    let json = r.bytes(len, false, || "the manifest".to_owned())?;
    let found = crc32c::crc32c(&json);
    if found != crc {
        return Err(WeightSyncError::WireFormat {
            offset: json_at,
            reason: format!(
                "the manifest is corrupt: CRC32C {found:#010x}, the frame says {crc:#010x}"
            ),
        });
    }
    let manifest = parse_manifest(&json, json_at)?;
    drop(json);
    receiver.begin(&manifest)?;

    let count = manifest.buckets.len();
    let mut stats = WireStats {
        tensors: manifest.num_tensors(),
        ..WireStats::default()
    };
    for (index, meta) in manifest.buckets.iter().enumerate() {
        let what = describe_bucket(index, &meta.tensors);
        let frame_at = r.pos;
        r.tag(TAG_BUCKET, &what)?;
        let found_index = r.u64(|| format!("the index of {what}"))?;
        if found_index != index as u64 {
            return Err(WeightSyncError::WireBucketOrder {
                offset: frame_at,
                expected: index,
                found: found_index,
            });
        }
        let len = r.u64(|| format!("the length of {what}"))?;
        if len != meta.bytes as u64 {
            return Err(WeightSyncError::WireBucketSize {
                bucket: what,
                offset: frame_at,
                expected: meta.bytes as u64,
                found: len,
            });
        }
        let crc = r.u32(|| format!("the CRC32C of {what}"))?;
        let data_at = r.pos;
        let data = r.bytes(len, true, || what.clone())?;
        let found = crc32c::crc32c(&data);
        if found != crc {
            return Err(WeightSyncError::WireChecksum {
                bucket: what,
                offset: data_at,
                bytes: len,
                expected: crc,
                found,
            });
        }
        let bucket = WeightBucket {
            index,
            count,
            tensors: meta.tensors.clone(),
            data,
        };
        receiver.receive(&bucket)?;
        stats.buckets += 1;
        stats.payload_bytes += len;
        stats.max_bucket_bytes = stats.max_bucket_bytes.max(len);
    }

    let end_at = r.pos;
    r.tag(TAG_END, "the end frame")?;
    let buckets = r.u64(|| "the end frame's bucket count".to_owned())?;
    let bytes = r.u64(|| "the end frame's byte count".to_owned())?;
    if buckets != count as u64 || bytes != stats.payload_bytes {
        return Err(WeightSyncError::WireFormat {
            offset: end_at,
            reason: format!(
                "the end frame says {buckets} buckets of {bytes} bytes, the stream carried \
                 {count} of {}",
                stats.payload_bytes
            ),
        });
    }
    receiver.finish()?;
    stats.stream_bytes = r.pos;
    stats.seconds = start.elapsed().as_secs_f64();
    Ok(stats)
}

// ---------------------------------------------------------------------------------------------
// Acknowledgement.

/// Writes the acknowledgement frame (module docs) of `outcome`, the result of
/// [`receive_wire`]: status 0 and no message when it succeeded, status 1 and the error's text
/// (cut to [`MAX_ACK_MESSAGE_BYTES`] at a character boundary) when it failed. Flushes.
pub fn write_ack<W: Write>(
    mut writer: W,
    outcome: Result<&WireStats, &WeightSyncError>,
) -> io::Result<()> {
    let (status, message) = match outcome {
        Ok(_) => (0u32, String::new()),
        Err(e) => {
            let mut text = e.to_string();
            let max = MAX_ACK_MESSAGE_BYTES as usize;
            if text.len() > max {
                let mut cut = max;
                while !text.is_char_boundary(cut) {
                    cut -= 1;
                }
                text.truncate(cut);
            }
            (1u32, text)
        }
    };
    let mut frame = Vec::with_capacity(1 + 4 + 8 + message.len());
    frame.push(TAG_ACK);
    frame.extend_from_slice(&status.to_le_bytes());
    frame.extend_from_slice(&(message.len() as u64).to_le_bytes());
    frame.extend_from_slice(message.as_bytes());
    writer.write_all(&frame)?;
    writer.flush()
}

/// Reads the acknowledgement frame (module docs) the reading side sent back: `Ok` when it
/// loaded the weights, [`WeightSyncError::WireRejected`] with its reason when it refused them;
/// a malformed or missing frame is [`WeightSyncError::WireFormat`] /
/// [`WeightSyncError::WireIo`] (offsets count from the start of the answer).
pub fn read_ack<R: Read>(reader: R) -> Result<(), WeightSyncError> {
    let mut r = Counted {
        inner: reader,
        pos: 0,
    };
    r.tag(TAG_ACK, "the acknowledgement")?;
    let status_at = r.pos;
    let status = r.u32(|| "the acknowledgement's status".to_owned())?;
    let len_at = r.pos;
    let len = r.u64(|| "the acknowledgement's message length".to_owned())?;
    if len > MAX_ACK_MESSAGE_BYTES {
        return Err(WeightSyncError::WireFormat {
            offset: len_at,
            reason: format!(
                "an acknowledgement message of {len} bytes (at most {MAX_ACK_MESSAGE_BYTES})"
            ),
        });
    }
    let message = r.bytes(len, false, || "the acknowledgement's message".to_owned())?;
    let message = String::from_utf8_lossy(&message).into_owned();
    match status {
        0 => Ok(()),
        1 => Err(WeightSyncError::WireRejected { message }),
        other => Err(WeightSyncError::WireFormat {
            offset: status_at,
            reason: format!("acknowledgement status {other} (0 = loaded, 1 = refused)"),
        }),
    }
}
