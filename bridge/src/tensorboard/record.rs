//! TFRecord framing, as TensorFlow's `tensorflow/core/lib/io/record_writer.cc` and
//! TensorBoard's `tensorboard/summary/writer/record_writer.py` (`RecordWriter.write`) write it:
//!
//! ```text
//! u64 LE   length
//! u32 LE   masked CRC32C of the 8 length bytes
//! [u8]     data (length bytes)
//! u32 LE   masked CRC32C of the data
//! ```
//!
//! The mask (`masked_crc32c` in TensorBoard's `compat/tensorflow_stub/pywrap_tensorflow.py`)
//! rotates the CRC right by 15 bits and adds `0xa282ead8` (wrapping). The CRC itself is
//! CRC-32C (Castagnoli) from the `crc32c` crate.

use std::io::{ErrorKind, Read};

/// The constant TensorFlow adds to a rotated CRC.
const MASK_DELTA: u32 = 0xa282_ead8;

/// The masked CRC32C of `data`, as stored in TFRecord headers and footers.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    mask(crc32c::crc32c(data))
}

/// TensorFlow's CRC mask: rotate right by 15 bits, add `0xa282ead8`.
fn mask(crc: u32) -> u32 {
    crc.rotate_right(15).wrapping_add(MASK_DELTA)
}

/// One framed record: length, its masked CRC, the data, the data's masked CRC.
pub(crate) fn encode_record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

/// Why a record could not be read.
#[derive(Debug)]
pub(crate) enum RecordError {
    /// Reading failed.
    Io(std::io::Error),
    /// The record is truncated or fails a CRC check.
    Corrupt(String),
}

/// Reads the next record's data from `input`: `Ok(None)` at a clean end of input (no byte of
/// a further record), [`RecordError::Corrupt`] when the input ends inside a record or a CRC
/// does not match. The data is read as it arrives, so a corrupt length cannot make it
/// allocate more than the input holds.
pub(crate) fn read_record(input: &mut impl Read) -> Result<Option<Vec<u8>>, RecordError> {
    let mut header = [0u8; 12];
    let got = read_full(input, &mut header).map_err(RecordError::Io)?;
    if got == 0 {
        return Ok(None);
    }
    if got < header.len() {
        return Err(RecordError::Corrupt(format!(
            "truncated: the 12-byte record header has only {got} bytes"
        )));
    }
    let (len_bytes, crc_bytes) = header.split_at(8);
    let stored = u32::from_le_bytes([crc_bytes[0], crc_bytes[1], crc_bytes[2], crc_bytes[3]]);
    let computed = masked_crc32c(len_bytes);
    if stored != computed {
        return Err(RecordError::Corrupt(format!(
            "length CRC mismatch (stored {stored:#010x}, computed {computed:#010x})"
        )));
    }
    let len = u64::from_le_bytes([
        len_bytes[0],
        len_bytes[1],
        len_bytes[2],
        len_bytes[3],
        len_bytes[4],
        len_bytes[5],
        len_bytes[6],
        len_bytes[7],
    ]);
    let mut data = Vec::new();
    let got = input
        .take(len)
        .read_to_end(&mut data)
        .map_err(RecordError::Io)? as u64;
    if got < len {
        return Err(RecordError::Corrupt(format!(
            "truncated: the record holds {len} data bytes, the file ends after {got}"
        )));
    }
    let mut footer = [0u8; 4];
    let got = read_full(input, &mut footer).map_err(RecordError::Io)?;
    if got < footer.len() {
        return Err(RecordError::Corrupt(format!(
            "truncated: the 4-byte data CRC has only {got} bytes"
        )));
    }
    let stored = u32::from_le_bytes(footer);
    let computed = masked_crc32c(&data);
    if stored != computed {
        return Err(RecordError::Corrupt(format!(
            "data CRC mismatch (stored {stored:#010x}, computed {computed:#010x})"
        )));
    }
    Ok(Some(data))
}

/// Reads until `buf` is full or the input ends; returns the bytes read.
fn read_full(input: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match input.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}
