//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong reading or writing checkpoints.
///
/// Every variant names the file and, where one is involved, the tensor.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    /// Reading the file failed.
    #[error("{path}: I/O error: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file is shorter than the 8-byte header-length prefix.
    #[error("{path}: file is {len} bytes, too short for the 8-byte safetensors header length")]
    FileTooShort {
        /// The file.
        path: PathBuf,
        /// Its length in bytes.
        len: u64,
    },
    /// The header length prefix exceeds the sanity limit.
    #[error("{path}: safetensors header length {header_len} exceeds the limit of {limit} bytes")]
    HeaderTooLarge {
        /// The file.
        path: PathBuf,
        /// The header length the file claims.
        header_len: u64,
        /// The largest accepted header.
        limit: u64,
    },
    /// The header length prefix points past the end of the file.
    #[error("{path}: truncated: header length {header_len} + 8 exceeds the file size {file_len}")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// The header length the file claims.
        header_len: u64,
        /// The file's actual length.
        file_len: u64,
    },
    /// The header is not valid UTF-8 JSON, or not a JSON object.
    #[error("{path}: safetensors header is not a valid JSON object: {reason}")]
    InvalidHeaderJson {
        /// The file.
        path: PathBuf,
        /// What the parser reported.
        reason: String,
    },
    /// `__metadata__` is not a map of strings to strings (or appears twice).
    #[error("{path}: invalid `__metadata__`: {reason}")]
    InvalidMetadata {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A tensor entry lacks `dtype`, `shape` or `data_offsets`, or has one of the wrong type.
    #[error("{path}: tensor `{tensor}`: invalid header entry: {reason}")]
    InvalidTensorEntry {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// What is wrong with the entry.
        reason: String,
    },
    /// A tensor's dtype string is not one we read.
    #[error("{path}: tensor `{tensor}`: unsupported dtype \"{dtype}\"")]
    UnsupportedDtype {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The dtype string found.
        dtype: String,
    },
    /// The same tensor name appears twice in the header.
    #[error("{path}: tensor `{tensor}` appears more than once in the header")]
    DuplicateTensor {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
    },
    /// The element count or byte size of a tensor overflows.
    #[error("{path}: tensor `{tensor}`: shape {shape:?} overflows when computing its byte size")]
    ShapeOverflow {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The shape found.
        shape: Vec<usize>,
    },
    /// `data_offsets` has `end < begin`.
    #[error("{path}: tensor `{tensor}`: data_offsets [{begin}, {end}] end before they begin")]
    InvalidOffsets {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Start offset within the data section.
        begin: usize,
        /// End offset within the data section.
        end: usize,
    },
    /// `data_offsets` span a different number of bytes than dtype and shape require.
    #[error(
        "{path}: tensor `{tensor}`: {dtype} {shape:?} needs {expected} bytes \
         but data_offsets span {actual}"
    )]
    ByteLengthMismatch {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The dtype string.
        dtype: String,
        /// The shape.
        shape: Vec<usize>,
        /// `product(shape) * dtype size`.
        expected: usize,
        /// `end - begin`.
        actual: usize,
    },
    /// A tensor's bytes extend past the end of the data section.
    #[error(
        "{path}: tensor `{tensor}`: data ends at {end}, past the data section's {data_len} \
         bytes (the file is truncated or its header is corrupt)"
    )]
    OffsetsOutOfBounds {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// End offset within the data section.
        end: usize,
        /// Length of the data section.
        data_len: usize,
    },
    /// Two tensors share bytes.
    #[error("{path}: tensors `{first}` and `{second}` overlap in the data section")]
    OverlappingTensors {
        /// The file.
        path: PathBuf,
        /// The tensor that starts first.
        first: String,
        /// The tensor that starts inside it.
        second: String,
    },
    /// Part of the data section belongs to no tensor (the format allows no holes).
    #[error("{path}: data bytes {start}..{end} belong to no tensor (before {next})")]
    DataGap {
        /// The file.
        path: PathBuf,
        /// First uncovered byte (data-section offset).
        start: usize,
        /// End of the uncovered range.
        end: usize,
        /// The tensor after the gap, or "the end of the file".
        next: String,
    },

    /// A tensor name is not present in the file or checkpoint.
    #[error("{path}: no tensor named `{tensor}`")]
    TensorNotFound {
        /// The file or checkpoint directory searched.
        path: PathBuf,
        /// The tensor asked for.
        tensor: String,
    },
    /// A tensor's dtype differs from the one the caller expects.
    #[error("{path}: tensor `{tensor}`: expected dtype {expected}, found {actual}")]
    DtypeMismatch {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The dtype expected.
        expected: String,
        /// The dtype found.
        actual: String,
    },
    /// A tensor's shape differs from the one the caller expects.
    #[error("{path}: tensor `{tensor}`: expected shape {expected:?}, found {actual:?}")]
    ShapeMismatch {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The shape expected.
        expected: Vec<usize>,
        /// The shape found.
        actual: Vec<usize>,
    },
    /// A tensor's data cannot be converted as asked (e.g. `BOOL` to f32, or a bool byte other
    /// than 0 or 1).
    #[error("{path}: tensor `{tensor}`: cannot convert {dtype} data: {reason}")]
    Conversion {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The tensor's dtype.
        dtype: String,
        /// Why not.
        reason: String,
    },
    /// A directory holds neither `model.safetensors` nor `model.safetensors.index.json`.
    #[error("{dir}: no model.safetensors or model.safetensors.index.json")]
    NoCheckpoint {
        /// The directory.
        dir: PathBuf,
    },
    /// `model.safetensors.index.json` is malformed.
    #[error("{path}: invalid safetensors index: {reason}")]
    InvalidIndex {
        /// The index file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A shard named by the index does not exist.
    #[error("{index}: shard {shard} (holding `{tensor}`) does not exist at {path}")]
    MissingShard {
        /// The index file.
        index: PathBuf,
        /// The shard's file name as written in the index.
        shard: String,
        /// One tensor the index places in it.
        tensor: String,
        /// Where the shard was looked for.
        path: PathBuf,
    },
    /// A tensor is stored in two shards of a sharded checkpoint (which copy is meant is
    /// ambiguous).
    #[error("{index}: tensor `{tensor}` is stored in two shards: {first} and {second}")]
    TensorInTwoShards {
        /// The index file.
        index: PathBuf,
        /// The tensor.
        tensor: String,
        /// The shard the index places it in.
        first: PathBuf,
        /// The other shard that also holds it.
        second: PathBuf,
    },
    /// A shard holds a tensor the index does not list.
    #[error("{shard}: tensor `{tensor}` is not listed in {index}")]
    UnindexedTensor {
        /// The index file.
        index: PathBuf,
        /// The shard holding the tensor.
        shard: PathBuf,
        /// The tensor.
        tensor: String,
    },
    /// The index places a tensor in a shard that does not hold it.
    #[error("{index}: tensor `{tensor}` is listed in {shard}, which does not hold it")]
    IndexedTensorMissing {
        /// The index file.
        index: PathBuf,
        /// The shard the index names.
        shard: PathBuf,
        /// The tensor.
        tensor: String,
    },
    /// A weight the model's config requires is absent from the checkpoint.
    #[error("{path}: tensor `{tensor}` (shape {expected:?}, required by {config}) is missing")]
    MissingWeight {
        /// The checkpoint (index file, or the single safetensors file).
        path: PathBuf,
        /// The config that requires the tensor.
        config: PathBuf,
        /// The tensor.
        tensor: String,
        /// The shape the config implies.
        expected: Vec<usize>,
    },
    /// A tensor's shape contradicts the shape the config implies.
    #[error("{path}: tensor `{tensor}` has shape {found:?}, but {config} implies {expected:?}")]
    ConfigMismatch {
        /// The file holding the tensor.
        path: PathBuf,
        /// The config.
        config: PathBuf,
        /// The tensor.
        tensor: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The shape stored.
        found: Vec<usize>,
    },
    /// A JSON file (config.json, generation_config.json) is not valid JSON.
    #[error("{path}: invalid JSON: {reason}")]
    InvalidJson {
        /// The file.
        path: PathBuf,
        /// What the parser reported.
        reason: String,
    },
    /// A config field has an unusable value.
    #[error("{path}: `{field}`: {reason}")]
    InvalidConfig {
        /// The config file.
        path: PathBuf,
        /// The field, dotted (e.g. `quantization_config.weight_block_size`).
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A model id or path resolves to no local directory or hub-cache snapshot.
    #[error(
        "model `{id}` not found locally; looked in: {searched:?} (downloading needs a build \
         with the `hub` feature and HF_HUB_OFFLINE unset)"
    )]
    ModelNotFound {
        /// The id or path given.
        id: String,
        /// The places looked at.
        searched: Vec<PathBuf>,
    },
    /// Downloading a model from the hub failed (`hub` feature).
    #[error("downloading `{id}` from the hub: {file}: {reason}")]
    Download {
        /// The hub id with its revision.
        id: String,
        /// The file being downloaded.
        file: String,
        /// What failed.
        reason: String,
    },
    /// A tensor cannot be dequantised with its scale (rank, scale shape or block size).
    #[error("{path}: tensor `{tensor}`: FP8 dequantisation: {reason}")]
    Dequantize {
        /// The file.
        path: PathBuf,
        /// The quantised tensor.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// An MXFP4 weight (`*_blocks` / `*_scales`) cannot be decoded or encoded.
    #[error("tensor `{tensor}`: MXFP4: {reason}")]
    Mxfp4 {
        /// The weight (its `*_blocks` name, or the weight being packed).
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// Tensors handed to a writer are inconsistent (byte length, duplicate or unplanned name).
    #[error("{path}: tensor `{tensor}`: cannot write: {reason}")]
    InvalidWrite {
        /// The file or directory being written.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// The output path exists and overwriting was not requested.
    #[error("{path}: already exists (pass overwrite to replace it)")]
    TargetExists {
        /// The output path.
        path: PathBuf,
    },
    /// A writer was finished before every planned shard was written.
    #[error("{path}: shard {shard} was never written")]
    ShardNotWritten {
        /// The output directory.
        path: PathBuf,
        /// The shard's file name.
        shard: String,
    },

    /// A mapping rule's two sides do not capture the same wildcards.
    #[error("mapping registry `{registry}`: rule {rule}: {reason}")]
    InvalidRule {
        /// The registry.
        registry: String,
        /// The rule's index.
        rule: usize,
        /// What is inconsistent.
        reason: String,
    },
    /// A checkpoint stores some routed experts per expert and others stacked.
    #[error("{path}: mixes per-expert (`{per_expert}`) and stacked (`{stacked}`) expert tensors")]
    MixedExpertLayout {
        /// The checkpoint.
        path: PathBuf,
        /// One per-expert tensor.
        per_expert: String,
        /// One stacked tensor.
        stacked: String,
    },
    /// `config.json` names a `model_type` that has no mapping table.
    #[error("{path}: unknown model_type \"{model_type}\" (known: {known})")]
    UnknownModelType {
        /// The config file.
        path: PathBuf,
        /// The model type found.
        model_type: String,
        /// The supported types, comma-separated.
        known: String,
    },
    /// A strict load found missing, unexpected, mismatched or duplicate tensors.
    #[error("{path}: checkpoint does not match the model: {summary}")]
    IncompleteCheckpoint {
        /// The checkpoint.
        path: PathBuf,
        /// The loading report, summarised.
        summary: String,
    },

    /// A directory is not a loadable distributed checkpoint (a `.tmp-*` save in progress or
    /// aborted, no `.complete` marker, no index, or a `latest` naming nothing).
    #[error("{path}: not a loadable distributed checkpoint: {reason}")]
    NotACheckpoint {
        /// The directory (or `latest` file).
        path: PathBuf,
        /// Why it is refused.
        reason: String,
    },
    /// `moe_dcp.index.json` or a chunk file's DCP metadata is malformed or inconsistent.
    #[error("{path}: invalid distributed checkpoint index: {reason}")]
    InvalidDistIndex {
        /// The index or chunk file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The chunks of a tensor do not cover its global shape exactly once, or a requested box is
    /// not covered (docs/checkpoints.md §Resharding, §Distributed checkpoint validation).
    #[error("{path}: tensor `{tensor}`: coverage error: {reason}")]
    Coverage {
        /// The checkpoint directory.
        path: PathBuf,
        /// The tensor (fqn).
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// A chunk file disagrees with the index (shape, dtype, offsets or a missing tensor).
    #[error("{path}: tensor `{tensor}`: chunk file disagrees with the index: {reason}")]
    CorruptChunk {
        /// The chunk file.
        path: PathBuf,
        /// The tensor (fqn).
        tensor: String,
        /// What differs.
        reason: String,
    },
    /// A checkpoint tensor holds NaN or infinite values (a diverged run's save).
    #[error(
        "{path}: tensor `{tensor}` holds {count} non-finite value(s) (NaN or ±inf) of {numel}: \
         saved by a diverged run; resume from an earlier checkpoint"
    )]
    NonFinite {
        /// The chunk file (or checkpoint directory).
        path: PathBuf,
        /// The tensor (fqn).
        tensor: String,
        /// NaN or infinite elements.
        count: usize,
        /// Elements checked.
        numel: usize,
    },
    /// A tensor cannot be sharded under a layout (dimension not divisible, bad box).
    #[error("tensor `{tensor}`: cannot shard: {reason}")]
    Sharding {
        /// The tensor (fqn).
        tensor: String,
        /// Why not.
        reason: String,
    },
    /// A distributed save was aborted; the previous checkpoint is untouched.
    #[error("{path}: distributed save aborted: {reason}")]
    SaveAborted {
        /// The temporary checkpoint directory.
        path: PathBuf,
        /// The first failure reported by any rank.
        reason: String,
    },
    /// Training state (parameters, optimizer state, `train_state` object) could not be saved
    /// to or restored from a distributed checkpoint.
    #[error("{path}: training state `{field}`: {reason}")]
    TrainState {
        /// The checkpoint (root or `iter_*` directory).
        path: PathBuf,
        /// The tensor fqn or index field involved.
        field: String,
        /// What went wrong.
        reason: String,
    },

    /// A model directory has no `tokenizer.json`, so text cannot be turned into token ids.
    #[error("{dir}: no tokenizer.json (text in or out needs the model's tokenizer)")]
    MissingTokenizer {
        /// The model directory.
        dir: PathBuf,
    },
    /// `tokenizer.json` is JSON that the `tokenizers` crate cannot load (an unknown model,
    /// normalizer or pre-tokenizer type, a missing or mistyped field, a bad regex).
    #[error("{path}: not a tokenizer the `tokenizers` crate can load: {reason}")]
    InvalidTokenizer {
        /// The tokenizer file.
        path: PathBuf,
        /// What the crate reported.
        reason: String,
    },
    /// Encoding text or decoding token ids failed.
    #[error("{path}: cannot {action}: {reason}")]
    Tokenization {
        /// The tokenizer file.
        path: PathBuf,
        /// `encode` or `decode`, with what.
        action: String,
        /// What failed.
        reason: String,
    },
    /// A chat template was asked for but the model ships none.
    #[error(
        "{path}: no `chat_template` (and no chat_template.jinja beside it): the model ships no \
         chat template"
    )]
    NoChatTemplate {
        /// The tokenizer config looked in (it may not exist).
        path: PathBuf,
    },
    /// A chat template does not parse, raises (`raise_exception`) or fails to render.
    #[error("{path}: chat template{}: {reason}", template_location(.name, .line))]
    ChatTemplate {
        /// The file holding the template (`tokenizer_config.json` or a `.jinja` file).
        path: PathBuf,
        /// The template's name when the file holds several.
        name: Option<String>,
        /// The template line the failure points at (1-based).
        line: Option<usize>,
        /// What went wrong.
        reason: String,
    },
    /// A row of a supervised fine-tuning JSONL file is unusable (not JSON, a missing or
    /// mistyped field, an unknown role, a template that raises on it, no trained token, over
    /// the maximum length when such rows are refused).
    #[error("{path}, line {line}{}: {reason}", field_location(.field))]
    SftRow {
        /// The JSONL file.
        path: PathBuf,
        /// The row's line in the file (1-based).
        line: usize,
        /// The field at fault (`messages[2].role`, `completion`, …), when one is.
        field: Option<String>,
        /// What is wrong with the row.
        reason: String,
    },
    /// Supervised fine-tuning data as a whole is unusable with the options given (no rows,
    /// assistant-only loss on a dataset that is not conversational, a zero length).
    #[error("{path}: {reason}")]
    SftData {
        /// The JSONL file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A record of a TensorBoard event file is truncated or fails its CRC check.
    #[error("{path}: event file record at byte {offset}: {reason}")]
    CorruptEventRecord {
        /// The event file.
        path: PathBuf,
        /// Byte offset of the record's start in the file.
        offset: u64,
        /// What is wrong (truncation or which CRC mismatches).
        reason: String,
    },
    /// A record of a TensorBoard event file does not hold a valid `Event` protobuf message.
    #[error("{path}: event file record at byte {offset}: invalid Event message: {reason}")]
    InvalidEvent {
        /// The event file.
        path: PathBuf,
        /// Byte offset of the record's start in the file.
        offset: u64,
        /// What the decoder found wrong.
        reason: String,
    },
    /// A summary value handed to a TensorBoard event writer cannot be written.
    #[error("{path}: cannot write summary `{tag}`: {reason}")]
    InvalidSummary {
        /// The event file being written.
        path: PathBuf,
        /// The value's tag.
        tag: String,
        /// What is wrong.
        reason: String,
    },

    /// One of the two files of a Megatron indexed dataset (`<prefix>.idx`, `<prefix>.bin`) does
    /// not exist.
    #[error(
        "{path}: no such file (the Megatron indexed dataset `{prefix}` needs both \
         `{prefix}.idx` and `{prefix}.bin`)"
    )]
    MissingDataFile {
        /// The file looked for.
        path: PathBuf,
        /// The dataset prefix given.
        prefix: PathBuf,
    },
    /// A Megatron index file (`.idx`, the `MMIDIDX` format) is malformed: bad magic, unknown
    /// version or dtype code, truncated, counts that do not fit its size, sequence lengths,
    /// pointers or document indices that disagree.
    #[error("{path}: invalid Megatron index (.idx) file: {reason}")]
    InvalidDataIndex {
        /// The `.idx` file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A Megatron token file (`.bin`) disagrees with its index (length) or holds values that
    /// are not token ids (a float dtype holding a non-integral value).
    #[error("{path}: invalid Megatron token (.bin) file: {reason}")]
    InvalidTokenData {
        /// The `.bin` file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A token id of a Megatron dataset lies outside the model's vocabulary.
    #[error(
        "{path}: sequence {sequence}, position {position}: token id {token} is outside the \
         vocabulary 0..{vocab}"
    )]
    TokenOutOfVocab {
        /// The `.bin` file.
        path: PathBuf,
        /// The sequence (0-based index in the `.idx`).
        sequence: usize,
        /// The token's position in the sequence (0-based).
        position: usize,
        /// The token id found.
        token: i64,
        /// The vocabulary size.
        vocab: u64,
    },
    /// A sequence, token range or sample was asked for that the dataset does not hold.
    #[error("{path}: {reason}")]
    DataIndexOutOfRange {
        /// The dataset (`.bin` file, or the prefix of a blended dataset's first component).
        path: PathBuf,
        /// What was asked for and what exists.
        reason: String,
    },
    /// Samples cannot be built from a Megatron dataset (sequence length, an empty dataset, a
    /// blend that oversamples a component, sizes past the index types).
    #[error("{path}: cannot build training samples: {reason}")]
    DataSampling {
        /// The dataset prefix involved.
        path: PathBuf,
        /// Why not.
        reason: String,
    },
    /// A `--data-path` list is malformed (odd count, a weight that is not a positive finite
    /// number, an empty prefix, a zero total weight).
    #[error("--data-path item {position} (`{item}`): {reason}")]
    InvalidDataPath {
        /// The item's position in the list (1-based).
        position: usize,
        /// The item as given.
        item: String,
        /// What is wrong.
        reason: String,
    },
}

impl From<moe_backend::fs::FsError> for BridgeError {
    /// A failed file-system step of [`moe_backend::fs`] as [`BridgeError::Io`], same path.
    fn from(e: moe_backend::fs::FsError) -> Self {
        BridgeError::Io {
            path: e.path,
            source: e.source,
        }
    }
}

/// ` "name"`, `, line N`, both or nothing, for [`BridgeError::ChatTemplate`].
fn template_location(name: &Option<String>, line: &Option<usize>) -> String {
    let mut text = String::new();
    if let Some(name) = name {
        text.push_str(&format!(" \"{name}\""));
    }
    if let Some(line) = line {
        text.push_str(&format!(", line {line}"));
    }
    text
}

/// `, field `f`` or nothing, for [`BridgeError::SftRow`].
fn field_location(field: &Option<String>) -> String {
    field
        .as_ref()
        .map(|f| format!(", field `{f}`"))
        .unwrap_or_default()
}
