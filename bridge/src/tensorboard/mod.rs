//! TensorBoard event files: a writer for training scalars and a checking reader.
//!
//! `moe train --tensorboard-dir DIR` on rank 0: [`EventWriter::create`]`(dir, first_step)` at
//! start (and on resume, with the checkpoint's step + 1: a new file beside the earlier
//! ones), [`EventWriter::add_scalars`] and [`EventWriter::flush`] each step.
//!
//! An event file is a sequence of TFRecords (framing: length, masked CRC32C of the length,
//! data, masked CRC32C of the data), each holding one serialised `Event` protobuf message.
//! This module follows TensorBoard 2.21 and torch 2.x:
//!
//! - file names, the first event and the framing as `tensorboard/summary/writer/
//!   event_file_writer.py` (`EventFileWriter.__init__`) and `record_writer.py`
//!   (`RecordWriter.write`) write them, the CRC mask as `compat/tensorflow_stub/
//!   pywrap_tensorflow.py` (`masked_crc32c`); messages byte for byte as the `protobuf`
//!   runtime serialises them (checked against a file TensorBoard wrote);
//! - scalars as `simple_value`, as `torch.utils.tensorboard.summary.scalar` encodes them by
//!   default (and so Megatron-LM's `--tensorboard-dir` logging);
//! - sessions and resumed runs as TensorFlow's `Supervisor` and
//!   `torch.utils.tensorboard.SummaryWriter(purge_step=…)` mark them: a `SessionLog` `START`
//!   event at the first step a session logs ([`EventWriter::create`]). TensorBoard's Python
//!   loaders (`backend/event_processing/event_accumulator.py` and
//!   `plugin_event_accumulator.py`, `_MaybePurgeOrphanedData`) then drop every value read
//!   before a `START` with a step `>=` its step, in every tag, when the files have
//!   `file_version` 2 (`plugin_event_accumulator`, the server's loader, skips a run's first
//!   `START`); without a version, a summary whose step is below the latest step seen drops its
//!   own tags' values at or after its step. [`read_scalars_dir`] applies these rules as
//!   `event_accumulator.py` does. TensorBoard's default Rust loader
//!   (`tensorboard/data/server/reservoir.rs`, `preempt`) ignores `START` events and drops, per
//!   series, the values whose step is `>=` the step of a newly read value: the same result for
//!   every series the resumed run logs again.
//!
//! The format is written by hand rather than with a crate: of the crates.io crates that write
//! event files, `tfrecord` (0.15.0, last released 2023-09) pulls in `prost` 0.12,
//! `itertools`, `num`, `noisy_float`, `hostname`, `crc` and more for a few messages, and
//! `tensorboard-rs` (0.5.9, last released 2022-03) depends on `protobuf` 2 and `image` 0.23;
//! neither is maintained. The messages used are a handful of fields (field numbers in
//! [`Event`]'s module, `event.rs`) and the CRC is the `crc32c` crate's.
//!
//! Reading checks both CRCs of every record and refuses truncated or corrupt records, naming
//! the file and the record's byte offset ([`BridgeError::CorruptEventRecord`],
//! [`BridgeError::InvalidEvent`]); TensorBoard itself stops quietly at a truncated last
//! record (it may still be being written).

mod event;
mod record;
mod wire;
mod writer;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

pub use event::{
    Event, EventPayload, FILE_VERSION, SessionLog, SessionStatus, SummaryData, SummaryValue,
};
pub use record::masked_crc32c;
pub use writer::{EventWriter, SOURCE_WRITER};

use crate::BridgeError;
use record::{RecordError, read_record};

/// Reads the events of one file in order, checking every record.
///
/// Yields an error and then stops at the first record that is truncated, fails a CRC check
/// or does not decode.
#[derive(Debug)]
pub struct EventReader {
    path: PathBuf,
    input: BufReader<File>,
    /// Byte offset of the next record.
    offset: u64,
    done: bool,
}

impl EventReader {
    /// Opens an event file.
    pub fn open(path: &Path) -> Result<Self, BridgeError> {
        let file = File::open(path).map_err(|source| BridgeError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            input: BufReader::new(file),
            offset: 0,
            done: false,
        })
    }

    /// The file being read.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Iterator for EventReader {
    type Item = Result<Event, BridgeError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let offset = self.offset;
        let result = match read_record(&mut self.input) {
            Ok(None) => {
                self.done = true;
                return None;
            }
            Ok(Some(data)) => {
                self.offset += data.len() as u64 + 16;
                Event::decode(&data).map_err(|reason| BridgeError::InvalidEvent {
                    path: self.path.clone(),
                    offset,
                    reason,
                })
            }
            Err(RecordError::Io(source)) => Err(BridgeError::Io {
                path: self.path.clone(),
                source,
            }),
            Err(RecordError::Corrupt(reason)) => Err(BridgeError::CorruptEventRecord {
                path: self.path.clone(),
                offset,
                reason,
            }),
        };
        self.done = result.is_err();
        Some(result)
    }
}

/// All events of one event file, every record checked.
pub fn read_events(path: &Path) -> Result<Vec<Event>, BridgeError> {
    EventReader::open(path)?.collect()
}

/// One logged value of a scalar series.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScalarPoint {
    /// The step it was logged at.
    pub step: i64,
    /// When it was written (seconds since the Unix epoch).
    pub wall_time: f64,
    /// The value: `simple_value`s and `DT_FLOAT` tensors widened exactly from `f32`,
    /// `DT_DOUBLE` tensors as stored.
    pub value: f64,
}

/// The event files of `dir` as TensorBoard finds them: regular files whose name contains
/// `tfevents`, in file-name order (subdirectories are other runs and are not listed).
pub fn event_files(dir: &Path) -> Result<Vec<PathBuf>, BridgeError> {
    let io = |source| BridgeError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let entry = entry.map_err(io)?;
        let is_file = entry.file_type().map_err(io)?.is_file();
        if is_file && entry.file_name().to_string_lossy().contains("tfevents") {
            files.push(entry.path());
        }
    }
    files.sort_by(|a, b| a.file_name().cmp(&b.file_name()));
    Ok(files)
}

/// Every scalar series of the run in `dir` (all its [`event_files`], in file-name order), by
/// tag, as TensorBoard's `EventAccumulator` reads it: resumed runs' stale values purged (see
/// the module docs), `simple_value`s and one-element `DT_FLOAT` / `DT_DOUBLE` tensors counted
/// (TensorBoard's Rust loader drops `DT_DOUBLE` ones), values in the order read (no reservoir
/// sampling drops any).
pub fn read_scalars_dir(dir: &Path) -> Result<BTreeMap<String, Vec<ScalarPoint>>, BridgeError> {
    let mut run = RunScalars {
        series: BTreeMap::new(),
        file_version: None,
        most_recent_step: -1,
    };
    for path in event_files(dir)? {
        for event in EventReader::open(&path)? {
            run.add(&event?);
        }
    }
    Ok(run.series)
}

/// The scalars of one run as `EventAccumulator` (with `purge_orphaned_data=True`) keeps them.
struct RunScalars {
    series: BTreeMap<String, Vec<ScalarPoint>>,
    /// The latest `file_version`, parsed as `event_util.ParseFileVersion` does.
    file_version: Option<f64>,
    /// The step of the latest event that purged nothing (used for files of version < 2; -1
    /// before the first).
    most_recent_step: i64,
}

impl RunScalars {
    fn add(&mut self, event: &Event) {
        if let EventPayload::FileVersion(version) = &event.what {
            let number = version.rsplit("brain.Event:").next().unwrap_or_default();
            self.file_version = Some(number.trim().parse().unwrap_or(-1.0));
        }
        // Python's `if self.file_version and self.file_version >= 2`.
        if self.file_version.is_some_and(|v| v != 0.0 && v >= 2.0) {
            if let EventPayload::SessionLog(log) = &event.what
                && log.status == SessionStatus::Start
            {
                for points in self.series.values_mut() {
                    points.retain(|p| p.step < event.step);
                }
            }
        } else if event.step < self.most_recent_step
            && let EventPayload::Summary(values) = &event.what
        {
            for value in values {
                if let Some(points) = self.series.get_mut(&value.tag) {
                    points.retain(|p| p.step < event.step);
                }
            }
        } else {
            self.most_recent_step = event.step;
        }
        if let EventPayload::Summary(values) = &event.what {
            for value in values {
                if let Some(v) = value.scalar() {
                    self.series
                        .entry(value.tag.clone())
                        .or_default()
                        .push(ScalarPoint {
                            step: event.step,
                            wall_time: event.wall_time,
                            value: v,
                        });
                }
            }
        }
    }
}
