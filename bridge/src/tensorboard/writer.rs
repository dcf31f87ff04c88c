//! [`EventWriter`]: one new event file per writer, scalars appended and flushed per step.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use super::event::{
    Event, EventPayload, FILE_VERSION, SessionLog, SessionStatus, SummaryData, SummaryValue,
};
use super::record::encode_record;
use crate::BridgeError;

/// `source_metadata.writer` of the files this module writes.
pub const SOURCE_WRITER: &str = "burn-moe";

/// Counts the event files this process created, for the last part of their names (as
/// TensorBoard's `_global_uid` in `event_file_writer.py`).
static FILE_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Writes one TensorBoard event file.
///
/// Each writer creates a new file in its directory, so a resumed run adds a file beside the
/// earlier run's; TensorBoard reads all the files of a directory as one run, in file-name
/// order. Events are buffered until [`flush`](Self::flush) (call it after each step) and
/// flushed when the writer is dropped.
#[derive(Debug)]
pub struct EventWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl EventWriter {
    /// Starts a training session's event file: creates `dir` if needed and a new file in it,
    /// named as TensorBoard's writers name them,
    /// `events.out.tfevents.<unix seconds, 10 digits>.<hostname>.<pid>.<counter>` (an existing
    /// file is never overwritten), and writes and flushes its first two events:
    ///
    /// 1. `file_version: "brain.Event:2"` with `source_metadata.writer: "burn-moe"`, as
    ///    TensorBoard's `EventFileWriter` writes it;
    /// 2. a `SessionLog` `START` at `first_step`, the first step this session logs: 0 or 1 for
    ///    a new run, the checkpoint's step + 1 for a resumed one (as TensorFlow's
    ///    `Supervisor` marked every session start, and `SummaryWriter(purge_step=first_step)`
    ///    marks a resumed one).
    ///
    /// Reading the directory, TensorBoard's Python loaders then drop the values read before a
    /// `START` whose step is `>=` its step, in every tag: what an interrupted session logged
    /// after its last checkpoint, and which the resumed session logs again (the legacy
    /// `EventAccumulator` on every `START`; the server's `plugin_event_accumulator` on every
    /// `START` but a run's first, which is why every session writes one). The Rust loader
    /// reaches the same result per series without it (see the module docs).
    pub fn create(dir: &Path, first_step: i64) -> Result<Self, BridgeError> {
        std::fs::create_dir_all(dir).map_err(|source| BridgeError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let name = format!(
            "events.out.tfevents.{secs:010}.{}.{}.{}",
            hostname().replace(['/', '\\'], "_"),
            std::process::id(),
            FILE_COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let path = dir.join(name);
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|source| BridgeError::Io {
                path: path.clone(),
                source,
            })?;
        let mut writer = Self {
            path,
            out: BufWriter::new(file),
        };
        writer.write_event(&Event {
            wall_time: now(),
            step: 0,
            what: EventPayload::FileVersion(FILE_VERSION.into()),
            source_writer: Some(SOURCE_WRITER.into()),
        })?;
        writer.write_event(&Event {
            wall_time: now(),
            step: first_step,
            what: EventPayload::SessionLog(SessionLog {
                status: SessionStatus::Start,
                checkpoint_path: String::new(),
                msg: String::new(),
            }),
            source_writer: None,
        })?;
        writer.flush()?;
        Ok(writer)
    }

    /// The file this writer writes.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one scalar as `simple_value` (a 32-bit float, as `torch.utils.tensorboard`'s
    /// `add_scalar` and Megatron-LM write it). Not flushed.
    ///
    /// There is no `f64` variant on purpose: TensorBoard's default loader (its Rust data
    /// server, `tensorboard/data/server/data_compat.rs`, `tensor_proto_to_scalar`) shows only
    /// `simple_value`s and `DT_FLOAT` tensors as scalars and drops `DT_DOUBLE` ones; pass
    /// `value as f32`.
    pub fn add_scalar(&mut self, tag: &str, value: f32, step: i64) -> Result<(), BridgeError> {
        self.add_scalars(step, &[(tag, value)])
    }

    /// Writes the scalars of one step as `simple_value`s in one event. Not flushed.
    pub fn add_scalars(&mut self, step: i64, values: &[(&str, f32)]) -> Result<(), BridgeError> {
        let values = values
            .iter()
            .map(|&(tag, value)| self.value(tag, SummaryData::Simple(value)))
            .collect::<Result<Vec<_>, _>>()?;
        self.write_summary(step, values)
    }

    /// Flushes the buffered events to the operating system.
    pub fn flush(&mut self) -> Result<(), BridgeError> {
        self.out.flush().map_err(|source| BridgeError::Io {
            path: self.path.clone(),
            source,
        })
    }

    fn value(&self, tag: &str, value: SummaryData) -> Result<SummaryValue, BridgeError> {
        if tag.is_empty() {
            return Err(BridgeError::InvalidSummary {
                path: self.path.clone(),
                tag: tag.into(),
                reason: "a scalar needs a non-empty tag".into(),
            });
        }
        Ok(SummaryValue {
            tag: tag.into(),
            plugin_name: None,
            value,
        })
    }

    fn write_summary(&mut self, step: i64, values: Vec<SummaryValue>) -> Result<(), BridgeError> {
        self.write_event(&Event {
            wall_time: now(),
            step,
            what: EventPayload::Summary(values),
            source_writer: None,
        })
    }

    fn write_event(&mut self, event: &Event) -> Result<(), BridgeError> {
        self.out
            .write_all(&encode_record(&event.encode()))
            .map_err(|source| BridgeError::Io {
                path: self.path.clone(),
                source,
            })
    }
}

impl Drop for EventWriter {
    fn drop(&mut self) {
        // Errors cannot be reported from `drop`; call `flush` to see them.
        let _ = self.out.flush();
    }
}

/// Seconds since the Unix epoch, as `time.time()` (0 for a clock before the epoch).
fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The host name, as Python's `socket.gethostname()` (`"localhost"` if it cannot be read).
fn hostname() -> String {
    #[cfg(unix)]
    {
        let mut buf = [0u8; 256];
        // SAFETY: `buf` is valid for writes of `buf.len()` bytes; gethostname writes at most
        // that many and nothing else.
        let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
        if rc == 0 {
            let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
            let name = String::from_utf8_lossy(&buf[..end]).into_owned();
            if !name.is_empty() {
                return name;
            }
        }
    }
    std::env::var("HOSTNAME")
        .or_else(|_| std::env::var("COMPUTERNAME"))
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "localhost".into())
}
