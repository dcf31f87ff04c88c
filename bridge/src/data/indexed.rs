//! Megatron's indexed datasets: a `<prefix>.idx` index (the `MMIDIDX` format) and a
//! `<prefix>.bin` of token ids, as written by `tools/preprocess_data.py` through
//! `IndexedDatasetBuilder` and read by `IndexedDataset` (megatron-core 0.19.2,
//! `megatron/core/datasets/indexed_dataset.py`: `_IndexWriter.write`, `_IndexReader`,
//! `IndexedDataset.get`, `DType`).
//!
//! The `.idx` layout, all integers little-endian:
//!
//! | bytes | content |
//! |---|---|
//! | 9 | magic `MMIDIDX\x00\x00` |
//! | 8 | version, u64, always 1 |
//! | 1 | dtype code of the tokens (see [`TokenDtype`]) |
//! | 8 | sequence count `S`, u64 |
//! | 8 | document-index count `D`, u64 (documents + 1) |
//! | 4·S | sequence lengths in tokens, i32 |
//! | 8·S | sequence pointers: byte offsets into `.bin`, i64 |
//! | 8·D | document indices: the first sequence of each document, then `S`, i64 |
//! | S | optional: one i8 mode per sequence (multimodal datasets only) |
//!
//! The file records no flag for the modes section (Megatron's reader is told by its caller
//! whether the dataset is multimodal); here an index exactly `S` bytes longer than the layout
//! without modes is read as carrying them, and any other length is refused.
//!
//! Everything is checked when the dataset is opened, before any sample is built: the header,
//! that the counts fit the file size, sequence lengths non-negative, pointers contiguous from 0
//! (`pointer[i+1] = pointer[i] + length[i]·itemsize`, as the writer computes them), the `.bin`
//! exactly as long as the tokens the index describes, document indices starting at 0,
//! non-decreasing (an empty document repeats an entry, as `end_document` writes it) and ending
//! at `S`, and for float dtypes that every value is an integer within i64.

use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::BridgeError;

/// The `.idx` magic bytes.
pub const INDEX_MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// The only `.idx` version Megatron writes and reads.
pub const INDEX_VERSION: u64 = 1;
/// Bytes before the sequence lengths: magic, version, dtype code, two counts.
const HEADER_LEN: usize = 9 + 8 + 1 + 8 + 8;

/// The token dtype of a `.bin`, by its `.idx` code (Megatron's `DType` enum).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenDtype {
    /// Code 1, `numpy.uint8`.
    U8,
    /// Code 2, `numpy.int8`.
    I8,
    /// Code 3, `numpy.int16`.
    I16,
    /// Code 4, `numpy.int32` (Megatron's choice for vocabularies of 65 500 or more).
    I32,
    /// Code 5, `numpy.int64`.
    I64,
    /// Code 6, `numpy.float64`.
    F64,
    /// Code 7, `numpy.float32`.
    F32,
    /// Code 8, `numpy.uint16` (Megatron's choice for vocabularies under 65 500).
    U16,
}

impl TokenDtype {
    /// The dtype of an `.idx` code, `None` for codes Megatron does not define.
    pub fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => Self::U8,
            2 => Self::I8,
            3 => Self::I16,
            4 => Self::I32,
            5 => Self::I64,
            6 => Self::F64,
            7 => Self::F32,
            8 => Self::U16,
            _ => return None,
        })
    }

    /// The `.idx` code.
    pub fn code(self) -> u8 {
        match self {
            Self::U8 => 1,
            Self::I8 => 2,
            Self::I16 => 3,
            Self::I32 => 4,
            Self::I64 => 5,
            Self::F64 => 6,
            Self::F32 => 7,
            Self::U16 => 8,
        }
    }

    /// Bytes per token.
    pub fn size(self) -> usize {
        match self {
            Self::U8 | Self::I8 => 1,
            Self::I16 | Self::U16 => 2,
            Self::I32 | Self::F32 => 4,
            Self::I64 | Self::F64 => 8,
        }
    }

    /// numpy's name of the dtype.
    pub fn name(self) -> &'static str {
        match self {
            Self::U8 => "uint8",
            Self::I8 => "int8",
            Self::I16 => "int16",
            Self::I32 => "int32",
            Self::I64 => "int64",
            Self::F64 => "float64",
            Self::F32 => "float32",
            Self::U16 => "uint16",
        }
    }

    /// Whether every value of the dtype lies in `0..vocab` (then no token needs checking).
    fn always_within(self, vocab: u64) -> bool {
        match self {
            Self::U8 => vocab >= 1 << 8,
            Self::U16 => vocab >= 1 << 16,
            _ => false,
        }
    }

    /// The token at the start of `bytes` (`bytes` holds at least [`size`](Self::size) bytes;
    /// floats were checked to be integers within i64 when the file was opened).
    fn decode(self, bytes: &[u8]) -> i64 {
        fn le<const K: usize>(bytes: &[u8]) -> [u8; K] {
            let mut out = [0u8; K];
            if let Some(src) = bytes.get(..K) {
                out.copy_from_slice(src);
            }
            out
        }
        match self {
            Self::U8 => i64::from(le::<1>(bytes)[0]),
            Self::I8 => i64::from(i8::from_le_bytes(le(bytes))),
            Self::I16 => i64::from(i16::from_le_bytes(le(bytes))),
            Self::U16 => i64::from(u16::from_le_bytes(le(bytes))),
            Self::I32 => i64::from(i32::from_le_bytes(le(bytes))),
            Self::I64 => i64::from_le_bytes(le(bytes)),
            Self::F32 => f32::from_le_bytes(le(bytes)) as i64,
            Self::F64 => f64::from_le_bytes(le(bytes)) as i64,
        }
    }

    /// For float dtypes, the value at the start of `bytes` if it is not an integer within i64.
    fn non_integral(self, bytes: &[u8]) -> Option<f64> {
        let value = match self {
            Self::F32 => f64::from(f32::from_le_bytes(bytes.get(..4)?.try_into().ok()?)),
            Self::F64 => f64::from_le_bytes(bytes.get(..8)?.try_into().ok()?),
            _ => return None,
        };
        // i64 holds [-2^63, 2^63); both bounds are exact in f64.
        let integral = value.is_finite()
            && value.fract() == 0.0
            && (-9_223_372_036_854_775_808.0..9_223_372_036_854_775_808.0).contains(&value);
        (!integral).then_some(value)
    }
}

/// A read-only file mapping; empty files are not mapped (a zero-length map is refused by the OS).
enum Mapped {
    Map(Mmap),
    Empty,
}

impl Mapped {
    fn open(path: &Path) -> Result<Self, BridgeError> {
        let io = |source| BridgeError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        if file.metadata().map_err(io)?.len() == 0 {
            return Ok(Self::Empty);
        }
        // SAFETY: the file is opened read-only and the mapping is private to this value; like
        // Megatron's numpy.memmap reader, this assumes the file is not modified while open.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Ok(Self::Map(map))
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Self::Map(map) => map,
            Self::Empty => &[],
        }
    }
}

/// A little-endian integer of `K` bytes at `at` (zero past the end: callers only read offsets
/// that [`IndexedDataset::open`] checked to lie inside the file).
fn le_bytes<const K: usize>(bytes: &[u8], at: usize) -> [u8; K] {
    let mut out = [0u8; K];
    if let Some(src) = at.checked_add(K).and_then(|end| bytes.get(at..end)) {
        out.copy_from_slice(src);
    }
    out
}

/// A Megatron indexed dataset (`<prefix>.idx` + `<prefix>.bin`), memory-mapped and validated.
///
/// Token ids are returned as i64 whatever the stored dtype. The dataset is `Send + Sync`:
/// every accessor takes `&self` and reads the mappings.
pub struct IndexedDataset {
    prefix: PathBuf,
    idx_path: PathBuf,
    bin_path: PathBuf,
    dtype: TokenDtype,
    sequence_count: usize,
    /// Entries of the document index (documents + 1).
    document_entries: usize,
    idx: Mapped,
    bin: Mapped,
    /// Byte offsets in `.idx` of the sequence lengths, pointers, document indices and modes.
    lengths_at: usize,
    pointers_at: usize,
    documents_at: usize,
    modes_at: Option<usize>,
}

impl std::fmt::Debug for IndexedDataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexedDataset")
            .field("prefix", &self.prefix)
            .field("dtype", &self.dtype)
            .field("sequences", &self.sequence_count)
            .field("documents", &self.num_documents())
            .field("multimodal", &self.modes_at.is_some())
            .finish()
    }
}

/// The `.idx` path of a prefix (`get_idx_path`: the prefix with `.idx` appended).
pub fn idx_path(prefix: &Path) -> PathBuf {
    let mut path = prefix.as_os_str().to_owned();
    path.push(".idx");
    PathBuf::from(path)
}

/// The `.bin` path of a prefix (`get_bin_path`).
pub fn bin_path(prefix: &Path) -> PathBuf {
    let mut path = prefix.as_os_str().to_owned();
    path.push(".bin");
    PathBuf::from(path)
}

impl IndexedDataset {
    /// Opens `<prefix>.idx` and `<prefix>.bin` and validates them against each other (see the
    /// module docs for every check).
    pub fn open(prefix: impl AsRef<Path>) -> Result<Self, BridgeError> {
        let prefix = prefix.as_ref().to_path_buf();
        let idx_path = idx_path(&prefix);
        let bin_path = bin_path(&prefix);
        for path in [&idx_path, &bin_path] {
            if !path.is_file() {
                return Err(BridgeError::MissingDataFile {
                    path: path.clone(),
                    prefix: prefix.clone(),
                });
            }
        }
        let idx = Mapped::open(&idx_path)?;
        let bin = Mapped::open(&bin_path)?;
        let bad_idx = |reason: String| BridgeError::InvalidDataIndex {
            path: idx_path.clone(),
            reason,
        };
        let bytes = idx.bytes();
        let file_len = bytes.len();
        if file_len < HEADER_LEN {
            return Err(bad_idx(format!(
                "truncated: {file_len} bytes, shorter than the {HEADER_LEN}-byte header"
            )));
        }
        if &bytes[..9] != INDEX_MAGIC {
            return Err(bad_idx(format!(
                "bad magic {:?} (expected {:?})",
                String::from_utf8_lossy(&bytes[..9]),
                String::from_utf8_lossy(INDEX_MAGIC)
            )));
        }
        let version = u64::from_le_bytes(le_bytes(bytes, 9));
        if version != INDEX_VERSION {
            return Err(bad_idx(format!(
                "unknown version {version} (Megatron writes and reads version {INDEX_VERSION})"
            )));
        }
        let code = bytes[17];
        let dtype = TokenDtype::from_code(code).ok_or_else(|| {
            bad_idx(format!(
                "unknown dtype code {code} (Megatron's codes are 1 uint8, 2 int8, 3 int16, \
                 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)"
            ))
        })?;
        let sequences = u64::from_le_bytes(le_bytes(bytes, 18));
        let entries = u64::from_le_bytes(le_bytes(bytes, 26));
        // Layout size without and with the modes section, in u128 so no count can overflow.
        let base = HEADER_LEN as u128 + 12 * u128::from(sequences) + 8 * u128::from(entries);
        let with_modes = base + u128::from(sequences);
        let has_modes = if file_len as u128 == base {
            false
        } else if file_len as u128 == with_modes {
            true
        } else if (file_len as u128) < base {
            return Err(bad_idx(format!(
                "truncated: {sequences} sequences and {entries} document indices need {base} \
                 bytes, the file has {file_len}"
            )));
        } else {
            return Err(bad_idx(format!(
                "{file_len} bytes do not fit {sequences} sequences and {entries} document \
                 indices: they need {base} bytes (or {with_modes} with the sequence-modes \
                 section)"
            )));
        };
        // Both counts are below the file length now, so they fit usize.
        let sequence_count = sequences as usize;
        let document_entries = entries as usize;
        let lengths_at = HEADER_LEN;
        let pointers_at = lengths_at + 4 * sequence_count;
        let documents_at = pointers_at + 8 * sequence_count;
        let modes_at = has_modes.then_some(documents_at + 8 * document_entries);
        let dataset = Self {
            prefix,
            idx_path,
            bin_path,
            dtype,
            sequence_count,
            document_entries,
            idx,
            bin,
            lengths_at,
            pointers_at,
            documents_at,
            modes_at,
        };
        dataset.validate()?;
        Ok(dataset)
    }

    /// Checks lengths, pointers, the `.bin` length, document indices and float values.
    fn validate(&self) -> Result<(), BridgeError> {
        let bad_idx = |reason: String| BridgeError::InvalidDataIndex {
            path: self.idx_path.clone(),
            reason,
        };
        let itemsize = self.dtype.size() as u64;
        let mut expected_pointer: u64 = 0;
        for i in 0..self.sequence_count {
            let length = self.raw_length(i);
            if length < 0 {
                return Err(bad_idx(format!(
                    "sequence {i} has negative length {length}"
                )));
            }
            let pointer = self.raw_pointer(i);
            if pointer < 0 || pointer as u64 != expected_pointer {
                return Err(bad_idx(format!(
                    "sequence {i}: pointer {pointer} disagrees with the lengths before it \
                     (expected byte offset {expected_pointer})"
                )));
            }
            // Saturates only for sizes no .bin can match, which the length check refuses.
            expected_pointer = expected_pointer.saturating_add(length as u64 * itemsize);
        }
        let bin_len = self.bin.bytes().len() as u64;
        if bin_len != expected_pointer {
            return Err(BridgeError::InvalidTokenData {
                path: self.bin_path.clone(),
                reason: format!(
                    "{bin_len} bytes, but {} describes {} {} tokens ({expected_pointer} bytes)",
                    self.idx_path.display(),
                    expected_pointer / itemsize,
                    self.dtype.name()
                ),
            });
        }
        if self.document_entries == 0 {
            return Err(bad_idx(
                "no document indices (Megatron writes at least the leading 0)".into(),
            ));
        }
        let mut previous = 0i64;
        for d in 0..self.document_entries {
            let value = self.raw_document(d);
            if d == 0 && value != 0 {
                return Err(bad_idx(format!("document index 0 is {value}, not 0")));
            }
            if value < previous {
                return Err(bad_idx(format!(
                    "document indices decrease: entry {d} is {value} after {previous}"
                )));
            }
            if value as u64 > self.sequence_count as u64 {
                return Err(bad_idx(format!(
                    "document index entry {d} is {value}, past the {} sequences",
                    self.sequence_count
                )));
            }
            previous = value;
        }
        if previous as u64 != self.sequence_count as u64 {
            return Err(bad_idx(format!(
                "the last document index is {previous}, not the sequence count {}",
                self.sequence_count
            )));
        }
        if matches!(self.dtype, TokenDtype::F32 | TokenDtype::F64) {
            for i in 0..self.sequence_count {
                let range = self.byte_range(i);
                for (position, bytes) in self
                    .bin
                    .bytes()
                    .get(range)
                    .unwrap_or_default()
                    .chunks_exact(self.dtype.size())
                    .enumerate()
                {
                    if let Some(value) = self.dtype.non_integral(bytes) {
                        return Err(BridgeError::InvalidTokenData {
                            path: self.bin_path.clone(),
                            reason: format!(
                                "sequence {i}, position {position}: {} value {value} is not an \
                                 integer token id",
                                self.dtype.name()
                            ),
                        });
                    }
                }
            }
        }
        Ok(())
    }

    fn raw_length(&self, i: usize) -> i32 {
        i32::from_le_bytes(le_bytes(self.idx.bytes(), self.lengths_at + 4 * i))
    }

    fn raw_pointer(&self, i: usize) -> i64 {
        i64::from_le_bytes(le_bytes(self.idx.bytes(), self.pointers_at + 8 * i))
    }

    fn raw_document(&self, d: usize) -> i64 {
        i64::from_le_bytes(le_bytes(self.idx.bytes(), self.documents_at + 8 * d))
    }

    /// The `.bin` bytes of sequence `i` (validated: inside the file).
    fn byte_range(&self, i: usize) -> Range<usize> {
        let start = self.raw_pointer(i) as usize;
        start..start + self.raw_length(i) as usize * self.dtype.size()
    }

    /// The prefix the dataset was opened with.
    pub fn prefix(&self) -> &Path {
        &self.prefix
    }

    /// The `.idx` file.
    pub fn idx_path(&self) -> &Path {
        &self.idx_path
    }

    /// The `.bin` file.
    pub fn bin_path(&self) -> &Path {
        &self.bin_path
    }

    /// The stored token dtype.
    pub fn dtype(&self) -> TokenDtype {
        self.dtype
    }

    /// Number of sequences (`len(IndexedDataset)`).
    pub fn num_sequences(&self) -> usize {
        self.sequence_count
    }

    /// Number of documents (one less than the document-index entries).
    pub fn num_documents(&self) -> usize {
        self.document_entries - 1
    }

    /// Total tokens over all sequences.
    pub fn num_tokens(&self) -> u64 {
        self.bin.bytes().len() as u64 / self.dtype.size() as u64
    }

    /// The document index (`IndexedDataset.document_indices`): the first sequence of each
    /// document, then the sequence count.
    pub fn document_indices(&self) -> Vec<u64> {
        (0..self.document_entries)
            .map(|d| self.raw_document(d) as u64)
            .collect()
    }

    /// The sequences of document `d`.
    pub fn document(&self, d: usize) -> Result<Range<usize>, BridgeError> {
        if d >= self.num_documents() {
            return Err(self.out_of_range(format!(
                "document {d} asked for, the dataset has {}",
                self.num_documents()
            )));
        }
        Ok(self.raw_document(d) as usize..self.raw_document(d + 1) as usize)
    }

    /// All sequence lengths, in tokens (`IndexedDataset.sequence_lengths`).
    pub fn sequence_lengths(&self) -> Vec<u32> {
        (0..self.sequence_count)
            .map(|i| self.raw_length(i) as u32)
            .collect()
    }

    /// The length of sequence `i` in tokens.
    pub fn sequence_length(&self, i: usize) -> Result<usize, BridgeError> {
        self.check_sequence(i)?;
        Ok(self.raw_length(i) as usize)
    }

    /// The per-sequence modes of a multimodal dataset (`None` when the index has no modes
    /// section).
    pub fn sequence_modes(&self) -> Option<Vec<i8>> {
        let at = self.modes_at?;
        let bytes = self.idx.bytes().get(at..at + self.sequence_count)?;
        Some(bytes.iter().map(|&b| b as i8).collect())
    }

    /// The tokens of sequence `i`.
    pub fn sequence(&self, i: usize) -> Result<Vec<i64>, BridgeError> {
        self.get(i, 0, None)
    }

    /// `length` tokens of sequence `i` from token `offset` (to its end when `length` is `None`),
    /// as `IndexedDataset.get(idx, offset, length)`.
    pub fn get(
        &self,
        i: usize,
        offset: usize,
        length: Option<usize>,
    ) -> Result<Vec<i64>, BridgeError> {
        let mut out = Vec::new();
        self.extend_from(i, offset, length, &mut out)?;
        Ok(out)
    }

    /// [`get`](Self::get), appending to `out`.
    pub fn extend_from(
        &self,
        i: usize,
        offset: usize,
        length: Option<usize>,
        out: &mut Vec<i64>,
    ) -> Result<(), BridgeError> {
        self.check_sequence(i)?;
        let total = self.raw_length(i) as usize;
        let length = match length {
            Some(length) => length,
            None => total.saturating_sub(offset),
        };
        if offset.checked_add(length).is_none_or(|end| end > total) {
            return Err(self.out_of_range(format!(
                "tokens {offset}..{offset}+{length} of sequence {i} asked for, it has {total}"
            )));
        }
        let size = self.dtype.size();
        let start = self.raw_pointer(i) as usize + offset * size;
        let bytes = self
            .bin
            .bytes()
            .get(start..start + length * size)
            .unwrap_or_default();
        out.extend(bytes.chunks_exact(size).map(|b| self.dtype.decode(b)));
        Ok(())
    }

    /// Refuses a token id outside `0..vocab`, naming the `.bin`, sequence and position of the
    /// first one.
    pub fn check_vocab(&self, vocab: u64) -> Result<(), BridgeError> {
        if self.dtype.always_within(vocab) {
            return Ok(());
        }
        let size = self.dtype.size();
        for i in 0..self.sequence_count {
            let bytes = self.bin.bytes().get(self.byte_range(i)).unwrap_or_default();
            for (position, b) in bytes.chunks_exact(size).enumerate() {
                let token = self.dtype.decode(b);
                if token < 0 || token as u64 >= vocab {
                    return Err(BridgeError::TokenOutOfVocab {
                        path: self.bin_path.clone(),
                        sequence: i,
                        position,
                        token,
                        vocab,
                    });
                }
            }
        }
        Ok(())
    }

    fn check_sequence(&self, i: usize) -> Result<(), BridgeError> {
        if i >= self.sequence_count {
            return Err(self.out_of_range(format!(
                "sequence {i} asked for, the dataset has {}",
                self.sequence_count
            )));
        }
        Ok(())
    }

    fn out_of_range(&self, reason: String) -> BridgeError {
        BridgeError::DataIndexOutOfRange {
            path: self.bin_path.clone(),
            reason,
        }
    }

    /// The length of sequence `i` without a range check (callers pass `i < num_sequences`).
    pub(crate) fn length_unchecked(&self, i: usize) -> usize {
        self.raw_length(i).max(0) as usize
    }
}
