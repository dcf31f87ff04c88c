//! The `Event` protobuf message and the parts of it that scalar logging uses, encoded and
//! decoded by hand.
//!
//! Field numbers are those of TensorBoard 2.21's `tensorboard/compat/proto/event.proto`
//! (`Event`, `SessionLog`, `SourceMetadata`), `summary.proto` (`Summary`, `Summary.Value`,
//! `SummaryMetadata`, `SummaryMetadata.PluginData`), `tensor.proto` (`TensorProto`) and
//! `tensor_shape.proto` (`TensorShapeProto`):
//!
//! | message | fields used |
//! |---|---|
//! | `Event` | `wall_time` 1 (double), `step` 2 (int64), oneof `what`: `file_version` 3, `graph_def` 4, `summary` 5, `log_message` 6, `session_log` 7, `tagged_run_metadata` 8, `meta_graph_def` 9; `source_metadata` 10 |
//! | `SourceMetadata` | `writer` 1 |
//! | `SessionLog` | `status` 1 (`STATUS_UNSPECIFIED` 0, `START` 1, `STOP` 2, `CHECKPOINT` 3), `checkpoint_path` 2, `msg` 3 |
//! | `Summary` | repeated `value` 1 |
//! | `Summary.Value` | `tag` 1, `metadata` 9, oneof `value`: `simple_value` 2 (float), `obsolete_old_style_histogram` 3, `image` 4, `histo` 5, `audio` 6, `tensor` 8 |
//! | `SummaryMetadata` | `plugin_data` 1 → `PluginData.plugin_name` 1 |
//! | `TensorProto` | `dtype` 1 (`DT_FLOAT` 1, `DT_DOUBLE` 2), `tensor_shape` 2, `tensor_content` 4, `float_val` 5, `double_val` 6 |
//! | `TensorShapeProto` | repeated `dim` 2 → `Dim.size` 1 |
//!
//! The writer writes scalars as `simple_value` (what `torch.utils.tensorboard.SummaryWriter.
//! add_scalar` and Megatron-LM write by default). The reader also decodes the tensor-style
//! scalars of `add_scalar(..., new_style=True[, double_precision=True])`: a one-element
//! `DT_FLOAT` (`DT_DOUBLE`) tensor with `plugin_name: "scalars"`.

use super::wire::{Decoder, Encoder, doubles, floats};

/// `file_version` of the first event of every file: TensorBoard purges by `SessionLog.START`
/// only for files of version 2 or later.
pub const FILE_VERSION: &str = "brain.Event:2";

/// One `Event` record of an event file.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Seconds since the Unix epoch when the event was written.
    pub wall_time: f64,
    /// The training step (global step) the event belongs to.
    pub step: i64,
    /// What the event carries (the `what` oneof).
    pub what: EventPayload,
    /// `source_metadata.writer`: the program that wrote the file (first event only).
    pub source_writer: Option<String>,
}

/// The `what` oneof of an [`Event`].
#[derive(Debug, Clone, PartialEq)]
pub enum EventPayload {
    /// None of the oneof's fields is set.
    Empty,
    /// `file_version`, e.g. `"brain.Event:2"` (the first event of a file).
    FileVersion(String),
    /// `summary`: the values logged at this step.
    Summary(Vec<SummaryValue>),
    /// `session_log`: a session start, stop or checkpoint.
    SessionLog(SessionLog),
    /// A payload this module does not decode (`graph_def`, `log_message`,
    /// `tagged_run_metadata`, `meta_graph_def`), by field number.
    Other {
        /// The `Event` field number of the payload.
        field: u32,
    },
}

/// One `Summary.Value`: a tag and its value.
#[derive(Debug, Clone, PartialEq)]
pub struct SummaryValue {
    /// The series name.
    pub tag: String,
    /// `metadata.plugin_data.plugin_name` when the value carries metadata (`"scalars"` for
    /// tensor-style scalars).
    pub plugin_name: Option<String>,
    /// The value.
    pub value: SummaryData,
}

impl SummaryValue {
    /// The value as a scalar, when it is one: `simple_value`, or a one-element `DT_FLOAT` /
    /// `DT_DOUBLE` tensor.
    pub fn scalar(&self) -> Option<f64> {
        match self.value {
            SummaryData::Simple(v) | SummaryData::TensorF32(v) => Some(f64::from(v)),
            SummaryData::TensorF64(v) => Some(v),
            SummaryData::Other { .. } => None,
        }
    }
}

/// The `value` oneof of a [`SummaryValue`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SummaryData {
    /// `simple_value`, a 32-bit float.
    Simple(f32),
    /// A `tensor` of dtype `DT_FLOAT` with one element.
    TensorF32(f32),
    /// A `tensor` of dtype `DT_DOUBLE` with one element.
    TensorF64(f64),
    /// Anything else (an image, a histogram, audio, another tensor, or no value), by the
    /// `Summary.Value` field number (0 when no value field is set).
    Other {
        /// The `Summary.Value` field number of the value.
        field: u32,
    },
}

/// A `SessionLog` message.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionLog {
    /// The status.
    pub status: SessionStatus,
    /// `checkpoint_path` (empty when unset).
    pub checkpoint_path: String,
    /// `msg` (empty when unset).
    pub msg: String,
}

/// `SessionLog.SessionStatus`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionStatus {
    /// `STATUS_UNSPECIFIED` (0).
    Unspecified,
    /// `START` (1): a (re)started run; TensorBoard drops the events before it whose step is
    /// at least this event's step.
    Start,
    /// `STOP` (2).
    Stop,
    /// `CHECKPOINT` (3).
    Checkpoint,
    /// A value the enum does not define (proto3 enums are open).
    Unknown(i32),
}

impl SessionStatus {
    fn from_i32(v: i32) -> Self {
        match v {
            0 => Self::Unspecified,
            1 => Self::Start,
            2 => Self::Stop,
            3 => Self::Checkpoint,
            v => Self::Unknown(v),
        }
    }

    fn to_i32(self) -> i32 {
        match self {
            Self::Unspecified => 0,
            Self::Start => 1,
            Self::Stop => 2,
            Self::Checkpoint => 3,
            Self::Unknown(v) => v,
        }
    }
}

/// `DataType.DT_FLOAT`.
const DT_FLOAT: u64 = 1;
/// `DataType.DT_DOUBLE`.
const DT_DOUBLE: u64 = 2;

impl Event {
    /// The serialised message, byte for byte as the `protobuf` Python runtime serialises the
    /// same message (fields in number order; `wall_time` and `step` left out when zero).
    /// [`EventPayload::Other`] and [`SummaryData::Other`] carry no content and are left out.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::default();
        if self.wall_time.to_bits() != 0 {
            e.double(1, self.wall_time);
        }
        if self.step != 0 {
            e.int64(2, self.step);
        }
        match &self.what {
            EventPayload::Empty | EventPayload::Other { .. } => {}
            EventPayload::FileVersion(v) => e.bytes(3, v.as_bytes()),
            EventPayload::Summary(values) => {
                let mut s = Encoder::default();
                for value in values {
                    s.bytes(1, &encode_value(value));
                }
                e.bytes(5, &s.into_bytes());
            }
            EventPayload::SessionLog(log) => {
                let mut s = Encoder::default();
                if log.status.to_i32() != 0 {
                    s.int64(1, i64::from(log.status.to_i32()));
                }
                if !log.checkpoint_path.is_empty() {
                    s.bytes(2, log.checkpoint_path.as_bytes());
                }
                if !log.msg.is_empty() {
                    s.bytes(3, log.msg.as_bytes());
                }
                e.bytes(7, &s.into_bytes());
            }
        }
        if let Some(writer) = &self.source_writer {
            let mut s = Encoder::default();
            if !writer.is_empty() {
                s.bytes(1, writer.as_bytes());
            }
            e.bytes(10, &s.into_bytes());
        }
        e.into_bytes()
    }

    /// Decodes one serialised `Event`; unknown fields are skipped.
    pub(crate) fn decode(buf: &[u8]) -> Result<Self, String> {
        let mut event = Event {
            wall_time: 0.0,
            step: 0,
            what: EventPayload::Empty,
            source_writer: None,
        };
        let mut d = Decoder::new(buf);
        while let Some((field, value)) = d.next_field()? {
            match field {
                1 => event.wall_time = value.double("Event", "wall_time")?,
                // int64 is the varint's bits as two's complement.
                2 => event.step = value.varint("Event", "step")? as i64,
                3 => event.what = EventPayload::FileVersion(value.string("Event", "file_version")?),
                5 => {
                    let bytes = value.bytes("Event", "summary")?;
                    event.what = EventPayload::Summary(decode_summary(bytes)?);
                }
                7 => {
                    let bytes = value.bytes("Event", "session_log")?;
                    event.what = EventPayload::SessionLog(decode_session_log(bytes)?);
                }
                4 | 6 | 8 | 9 => {
                    value.bytes("Event", "what")?;
                    event.what = EventPayload::Other { field };
                }
                10 => {
                    let bytes = value.bytes("Event", "source_metadata")?;
                    event.source_writer = Some(decode_source_writer(bytes)?);
                }
                _ => {}
            }
        }
        Ok(event)
    }
}

fn encode_value(value: &SummaryValue) -> Vec<u8> {
    let mut v = Encoder::default();
    if !value.tag.is_empty() {
        v.bytes(1, value.tag.as_bytes());
    }
    match value.value {
        SummaryData::Simple(x) => v.float(2, x),
        SummaryData::TensorF32(x) => {
            let mut t = Encoder::default();
            t.int64(1, DT_FLOAT as i64);
            t.bytes(5, &x.to_le_bytes());
            v.bytes(8, &t.into_bytes());
        }
        SummaryData::TensorF64(x) => {
            let mut t = Encoder::default();
            t.int64(1, DT_DOUBLE as i64);
            t.bytes(6, &x.to_le_bytes());
            v.bytes(8, &t.into_bytes());
        }
        SummaryData::Other { .. } => {}
    }
    if let Some(plugin) = &value.plugin_name {
        let mut p = Encoder::default();
        if !plugin.is_empty() {
            p.bytes(1, plugin.as_bytes());
        }
        let mut m = Encoder::default();
        m.bytes(1, &p.into_bytes());
        v.bytes(9, &m.into_bytes());
    }
    v.into_bytes()
}

fn decode_summary(buf: &[u8]) -> Result<Vec<SummaryValue>, String> {
    let mut values = Vec::new();
    let mut d = Decoder::new(buf);
    while let Some((field, value)) = d.next_field()? {
        if field == 1 {
            values.push(decode_value(value.bytes("Summary", "value")?)?);
        }
    }
    Ok(values)
}

fn decode_value(buf: &[u8]) -> Result<SummaryValue, String> {
    let mut out = SummaryValue {
        tag: String::new(),
        plugin_name: None,
        value: SummaryData::Other { field: 0 },
    };
    let mut d = Decoder::new(buf);
    while let Some((field, value)) = d.next_field()? {
        match field {
            1 => out.tag = value.string("Summary.Value", "tag")?,
            2 => out.value = SummaryData::Simple(value.float("Summary.Value", "simple_value")?),
            8 => out.value = decode_tensor(value.bytes("Summary.Value", "tensor")?)?,
            3..=6 => {
                value.bytes("Summary.Value", "value")?;
                out.value = SummaryData::Other { field };
            }
            9 => {
                out.plugin_name = Some(decode_metadata(value.bytes("Summary.Value", "metadata")?)?)
            }
            _ => {}
        }
    }
    Ok(out)
}

/// `SummaryMetadata.plugin_data.plugin_name` (empty when unset).
fn decode_metadata(buf: &[u8]) -> Result<String, String> {
    let mut name = String::new();
    let mut d = Decoder::new(buf);
    while let Some((field, value)) = d.next_field()? {
        if field == 1 {
            let mut p = Decoder::new(value.bytes("SummaryMetadata", "plugin_data")?);
            while let Some((field, value)) = p.next_field()? {
                if field == 1 {
                    name = value.string("SummaryMetadata.PluginData", "plugin_name")?;
                }
            }
        }
    }
    Ok(name)
}

/// A `TensorProto` as a scalar when it has one `DT_FLOAT` / `DT_DOUBLE` element (from
/// `float_val` / `double_val` or little-endian `tensor_content`), else `Other { field: 8 }`.
fn decode_tensor(buf: &[u8]) -> Result<SummaryData, String> {
    const M: &str = "TensorProto";
    let mut dtype = 0u64;
    let mut elements: Option<u64> = Some(1);
    let mut content: &[u8] = &[];
    let mut float_val = Vec::new();
    let mut double_val = Vec::new();
    let mut d = Decoder::new(buf);
    while let Some((field, value)) = d.next_field()? {
        match field {
            1 => dtype = value.varint(M, "dtype")?,
            2 => elements = shape_elements(value.bytes(M, "tensor_shape")?)?,
            4 => content = value.bytes(M, "tensor_content")?,
            5 => float_val.extend(floats(value, M, "float_val")?),
            6 => double_val.extend(doubles(value, M, "double_val")?),
            _ => {}
        }
    }
    let other = SummaryData::Other { field: 8 };
    if elements != Some(1) {
        return Ok(other);
    }
    Ok(match dtype {
        DT_FLOAT => match (<[u8; 4]>::try_from(content), float_val.as_slice()) {
            (Ok(bytes), _) => SummaryData::TensorF32(f32::from_le_bytes(bytes)),
            (Err(_), [v]) if content.is_empty() => SummaryData::TensorF32(*v),
            _ => other,
        },
        DT_DOUBLE => match (<[u8; 8]>::try_from(content), double_val.as_slice()) {
            (Ok(bytes), _) => SummaryData::TensorF64(f64::from_le_bytes(bytes)),
            (Err(_), [v]) if content.is_empty() => SummaryData::TensorF64(*v),
            _ => other,
        },
        _ => other,
    })
}

/// The element count of a `TensorShapeProto` (`None` for an unknown rank, a negative
/// (unknown) dimension or an overflowing product).
fn shape_elements(buf: &[u8]) -> Result<Option<u64>, String> {
    const M: &str = "TensorShapeProto";
    let mut count = Some(1u64);
    let mut d = Decoder::new(buf);
    while let Some((field, value)) = d.next_field()? {
        match field {
            2 => {
                let mut size = 0i64;
                let mut dim = Decoder::new(value.bytes(M, "dim")?);
                while let Some((field, value)) = dim.next_field()? {
                    if field == 1 {
                        size = value.varint("TensorShapeProto.Dim", "size")? as i64;
                    }
                }
                count = count
                    .zip(u64::try_from(size).ok())
                    .and_then(|(c, s)| c.checked_mul(s));
            }
            3 if value.varint(M, "unknown_rank")? != 0 => count = None,
            _ => {}
        }
    }
    Ok(count)
}

fn decode_session_log(buf: &[u8]) -> Result<SessionLog, String> {
    const M: &str = "SessionLog";
    let mut log = SessionLog {
        status: SessionStatus::Unspecified,
        checkpoint_path: String::new(),
        msg: String::new(),
    };
    let mut d = Decoder::new(buf);
    while let Some((field, value)) = d.next_field()? {
        match field {
            // An enum is an int32 on the wire: the low 32 bits of the varint.
            1 => log.status = SessionStatus::from_i32(value.varint(M, "status")? as i32),
            2 => log.checkpoint_path = value.string(M, "checkpoint_path")?,
            3 => log.msg = value.string(M, "msg")?,
            _ => {}
        }
    }
    Ok(log)
}

fn decode_source_writer(buf: &[u8]) -> Result<String, String> {
    let mut writer = String::new();
    let mut d = Decoder::new(buf);
    while let Some((field, value)) = d.next_field()? {
        if field == 1 {
            writer = value.string("SourceMetadata", "writer")?;
        }
    }
    Ok(writer)
}
