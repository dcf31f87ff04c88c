//! Tests of the event files: CRC test vectors, TensorBoard-written goldens
//! (`tests/fixtures/tensorboard/`, made by `tests/fixtures/make_tensorboard_golden.py` with
//! TensorBoard 2.21 / torch 2.x), write → read round trips, resume purging, and corrupt or
//! truncated files refused without panics.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use super::event::{Event, EventPayload, SessionLog, SessionStatus, SummaryData, SummaryValue};
use super::record::{encode_record, masked_crc32c, read_record};
use super::wire::Decoder;
use super::*;
use crate::test_util::TempDir;
use moe_backend::testing::SplitMix;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tensorboard")
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs_f64()
}

/// The raw records of a file: (byte offset, data), parsed here from the framing's length
/// fields alone (no CRC checks).
fn raw_records(bytes: &[u8]) -> Vec<(usize, Vec<u8>)> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let len = u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes")) as usize;
        out.push((at, bytes[at + 12..at + 12 + len].to_vec()));
        at += 16 + len;
    }
    assert_eq!(at, bytes.len());
    out
}

fn simple(tag: &str, v: f32) -> SummaryValue {
    SummaryValue {
        tag: tag.into(),
        plugin_name: None,
        value: SummaryData::Simple(v),
    }
}

fn summary(step: i64, values: Vec<SummaryValue>) -> (i64, EventPayload) {
    (step, EventPayload::Summary(values))
}

// ---------------------------------------------------------------------------------------------
// CRC

#[test]
fn crc32c_matches_rfc3720_vectors_and_tensorboard_masks() {
    // RFC 3720 appendix B.4 (iSCSI CRC32C examples) and the CRC-32C check value of
    // "123456789"; masked values from TensorBoard 2.21's
    // `compat.tensorflow_stub.pywrap_tensorflow.masked_crc32c`.
    let incrementing: Vec<u8> = (0..32).collect();
    let decrementing: Vec<u8> = (0..32).rev().collect();
    let cases: [(&[u8], u32, u32); 7] = [
        (&[0u8; 32], 0x8a91_36aa, 0x0fd7_fffa),
        (&[0xffu8; 32], 0x62a8_ab43, 0xf909_b029),
        (&incrementing, 0x46dd_794e, 0x951f_7892),
        (&decrementing, 0x113f_db5c, 0x593b_0d57),
        (b"123456789", 0xe306_9283, 0xc78a_b0e5),
        (b"", 0, 0xa282_ead8),
        (&[0u8; 8], 0x8c28_b28a, 0x0798_0329),
    ];
    for (data, crc, masked) in cases {
        assert_eq!(crc32c::crc32c(data), crc, "crc32c of {data:02x?}");
        assert_eq!(masked_crc32c(data), masked, "masked crc32c of {data:02x?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Golden file written by TensorBoard / torch

/// `tests/fixtures/make_tensorboard_golden.py`'s `write_golden`, in closed form.
fn golden_expected() -> Vec<(i64, EventPayload)> {
    let mut events = Vec::new();
    for step in 0..5i64 {
        let s = step as f64;
        events.push(summary(step, vec![simple("loss", (2.5 - 0.3 * s) as f32)]));
        let lr = 3e-4 * (step + 1) as f64 / 5.0;
        events.push(summary(step, vec![simple("lr", lr as f32)]));
    }
    events.push(summary(1, vec![simple("neg", (-1.0f64 / 3.0) as f32)]));
    events.push(summary(1, vec![simple("nonfinite", f32::INFINITY)]));
    events.push(summary(2, vec![simple("nonfinite", f32::NEG_INFINITY)]));
    events.push(summary(3, vec![simple("nonfinite", f32::NAN)]));
    events.push(summary((1 << 40) + 3, vec![simple("big_step", 7.0)]));
    let scalars = Some("scalars".to_string());
    events.push(summary(
        4,
        vec![SummaryValue {
            tag: "tensor/f32".into(),
            plugin_name: scalars.clone(),
            value: SummaryData::TensorF32(0.1),
        }],
    ));
    events.push(summary(
        4,
        vec![SummaryValue {
            tag: "tensor/f64".into(),
            plugin_name: scalars,
            value: SummaryData::TensorF64(1.0 / 3.0),
        }],
    ));
    events.push(summary(
        5,
        vec![simple("pair/a", 1.5), simple("pair/b", -2.25)],
    ));
    events.push(summary(
        5,
        vec![SummaryValue {
            tag: "note/text_summary".into(),
            plugin_name: Some("text".into()),
            value: SummaryData::Other { field: 8 },
        }],
    ));
    events.push(summary(
        5,
        vec![SummaryValue {
            tag: "hist".into(),
            plugin_name: None,
            value: SummaryData::Other { field: 5 },
        }],
    ));
    events.push((
        6,
        EventPayload::SessionLog(SessionLog {
            status: SessionStatus::Start,
            checkpoint_path: String::new(),
            msg: String::new(),
        }),
    ));
    events.push(summary(6, vec![simple("loss", 0.75)]));
    events
}

#[test]
fn golden_file_from_tensorboard_decodes() {
    let path = fixtures().join("golden.tfevents");
    let events = read_events(&path).expect("golden file reads");
    let (first, rest) = events.split_first().expect("events");
    assert_eq!(first.what, EventPayload::FileVersion(FILE_VERSION.into()));
    assert_eq!(
        first.source_writer.as_deref(),
        Some("tensorboard.summary.writer.event_file_writer")
    );
    assert_eq!(first.step, 0);
    assert!(first.wall_time > 1.7e9, "wall time {}", first.wall_time);

    let expected = golden_expected();
    assert_eq!(rest.len(), expected.len());
    for (event, (step, what)) in rest.iter().zip(&expected) {
        assert_eq!(event.step, *step);
        // The script's fixed wall times: 1700000000 + step / 8.
        assert_eq!(event.wall_time, 1_700_000_000.0 + *step as f64 / 8.0);
        assert_eq!(event.source_writer, None);
        // Debug strings so that the NaN value compares equal to itself.
        assert_eq!(format!("{:?}", event.what), format!("{what:?}"));
    }
    // f32 values bit-exact (not just equal as printed).
    let EventPayload::Summary(values) = &rest[2].what else {
        panic!("summary")
    };
    assert_eq!(values[0].value, SummaryData::Simple(2.2f64 as f32));
    assert_eq!(values[0].scalar(), Some(f64::from(2.2f64 as f32)));
}

#[test]
fn our_encoding_is_byte_identical_to_tensorboards() {
    // Every golden event that this module represents in full re-encodes to the exact bytes
    // the protobuf Python runtime wrote.
    let bytes = std::fs::read(fixtures().join("golden.tfevents")).expect("read golden");
    let mut compared = 0;
    for (offset, data) in raw_records(&bytes) {
        let event = Event::decode(&data).expect("decodes");
        let modeled = match &event.what {
            EventPayload::Summary(values) => values
                .iter()
                .all(|v| !matches!(v.value, SummaryData::Other { .. })),
            EventPayload::Other { .. } => false,
            _ => true,
        };
        if modeled {
            assert_eq!(event.encode(), data, "event at byte {offset}: {event:?}");
            assert_eq!(
                encode_record(&data),
                bytes[offset..offset + data.len() + 16]
            );
            compared += 1;
        }
    }
    // 23 events: the version event and 22 summaries and logs, less the text and histogram.
    assert_eq!(compared, 21, "all but the text and histogram events");
}

fn expected_json() -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures().join("expected.json")).expect("expected.json");
    serde_json::from_str(&text).expect("json")
}

/// `read_scalars_dir(dir)` as `[step, f32 bits, f64 wall-time bits]` per tag, the form of
/// `expected.json`.
fn scalars_as_bits(dir: &Path) -> BTreeMap<String, Vec<[u64; 3]>> {
    read_scalars_dir(dir)
        .expect("reads")
        .into_iter()
        .map(|(tag, points)| {
            let bits = points
                .iter()
                .map(|p| {
                    assert_eq!(f64::from(p.value as f32), p.value, "{tag}: an f32 value");
                    [
                        p.step as u64,
                        u64::from((p.value as f32).to_bits()),
                        p.wall_time.to_bits(),
                    ]
                })
                .collect();
            (tag, bits)
        })
        .collect()
}

fn json_as_bits(value: &serde_json::Value) -> BTreeMap<String, Vec<[u64; 3]>> {
    serde_json::from_value(value.clone()).expect("tag -> [[step, bits, bits]]")
}

#[test]
fn resumed_directory_purges_like_tensorboards_event_accumulator() {
    let expected = json_as_bits(&expected_json()["resumed"]);
    let got = scalars_as_bits(&fixtures().join("resumed"));
    assert_eq!(got, expected);
    // What that means: steps 1..3 of the first run, 4..8 of the resumed one (loss = 10 i +
    // step / 4 for run i).
    let loss: Vec<(u64, f32)> = got["loss"]
        .iter()
        .map(|p| (p[0], f32::from_bits(p[1] as u32)))
        .collect();
    let want: Vec<(u64, f32)> = (1..=8u64)
        .map(|s| (s, if s < 4 { 0.0 } else { 10.0 } + s as f32 / 4.0))
        .collect();
    assert_eq!(loss, want);
}

#[test]
fn versionless_file_purges_out_of_order_tags_like_tensorboard() {
    let expected = json_as_bits(&expected_json()["legacy"]);
    assert_eq!(scalars_as_bits(&fixtures().join("legacy")), expected);
}

// ---------------------------------------------------------------------------------------------
// Writer

/// A value that is not exact in f32 (rounded once, by `as f32`).
fn tokens(step: i64) -> f32 {
    (step as f64 * 4096.0 + 0.1) as f32
}

#[test]
fn writer_round_trip() {
    let dir = TempDir::new("tb-roundtrip");
    let run = dir.join("nested/run");
    let before = now();
    let mut w = EventWriter::create(&run, 1).expect("create");
    let name = w
        .path()
        .file_name()
        .and_then(|n| n.to_str())
        .expect("name")
        .to_string();
    // events.out.tfevents.<10-digit seconds>.<host>.<pid>.<counter>
    let rest = name.strip_prefix("events.out.tfevents.").expect("prefix");
    let (secs, rest) = rest.split_at(10);
    let secs: u64 = secs.parse().expect("seconds");
    assert!(secs.abs_diff(before as u64) <= 1, "{name}");
    let parts: Vec<&str> = rest.rsplitn(3, '.').collect();
    assert_eq!(parts.len(), 3, "{name}");
    parts[0].parse::<u64>().expect("counter");
    assert_eq!(parts[1], std::process::id().to_string());
    assert!(parts[2].len() > 1 && parts[2].starts_with('.'), "{name}");

    let mut rng = SplitMix::new(7);
    let mut logged = Vec::new();
    for step in 1..=20i64 {
        let loss = rng.uniform(0.5, 12.0) as f32;
        let lr = rng.uniform(0.0, 3e-4) as f32;
        w.add_scalars(step, &[("train/loss", loss), ("train/lr", lr)])
            .expect("add");
        if step % 5 == 0 {
            w.add_scalar("eval/loss", loss * 1.5, step).expect("add");
        }
        w.add_scalar("tokens", tokens(step), step).expect("add");
        w.flush().expect("flush");
        logged.push((step, loss, lr));
    }
    w.add_scalar("non-finite", f32::NAN, 21)
        .expect("nan is written");
    w.flush().expect("flush");

    // Readable while the writer is still open: flush pushed everything out.
    let events = read_events(w.path()).expect("read");
    let after = now();
    assert_eq!(
        events[0].what,
        EventPayload::FileVersion("brain.Event:2".into())
    );
    assert_eq!(events[0].source_writer.as_deref(), Some(SOURCE_WRITER));
    assert_eq!(events[1].step, 1);
    assert_eq!(
        events[1].what,
        EventPayload::SessionLog(SessionLog {
            status: SessionStatus::Start,
            checkpoint_path: String::new(),
            msg: String::new(),
        })
    );
    let mut wall = before;
    for e in &events {
        assert!(
            e.wall_time >= wall && e.wall_time <= after,
            "wall times monotone"
        );
        wall = e.wall_time;
    }
    let scalars = read_scalars_dir(&run).expect("scalars");
    assert_eq!(
        scalars.keys().collect::<Vec<_>>(),
        [
            "eval/loss",
            "non-finite",
            "tokens",
            "train/loss",
            "train/lr"
        ]
    );
    let series =
        |tag: &str| -> Vec<(i64, f64)> { scalars[tag].iter().map(|p| (p.step, p.value)).collect() };
    let want_loss: Vec<(i64, f64)> = logged.iter().map(|&(s, l, _)| (s, f64::from(l))).collect();
    let want_lr: Vec<(i64, f64)> = logged.iter().map(|&(s, _, r)| (s, f64::from(r))).collect();
    let want_eval: Vec<(i64, f64)> = logged
        .iter()
        .filter(|(s, _, _)| s % 5 == 0)
        .map(|&(s, l, _)| (s, f64::from(l * 1.5)))
        .collect();
    let want_tokens: Vec<(i64, f64)> = (1..=20).map(|s| (s, f64::from(tokens(s)))).collect();
    assert_eq!(series("train/loss"), want_loss);
    assert_eq!(series("train/lr"), want_lr);
    assert_eq!(series("eval/loss"), want_eval);
    assert_eq!(series("tokens"), want_tokens);
    assert_eq!(scalars["non-finite"].len(), 1);
    assert!(scalars["non-finite"][0].value.is_nan());
    // The two values of a step share one event.
    let two = events
        .iter()
        .find(|e| e.step == 3 && matches!(&e.what, EventPayload::Summary(v) if v.len() == 2));
    assert!(two.is_some());
    drop(w);
}

#[test]
fn two_writers_make_two_files() {
    let dir = TempDir::new("tb-two");
    let a = EventWriter::create(dir.path(), 0).expect("a");
    let b = EventWriter::create(dir.path(), 0).expect("b");
    assert_ne!(a.path(), b.path());
    assert_eq!(event_files(dir.path()).expect("list").len(), 2);
}

#[test]
fn empty_tag_is_refused() {
    let dir = TempDir::new("tb-empty-tag");
    let mut w = EventWriter::create(dir.path(), 0).expect("create");
    let err = w.add_scalar("", 1.0, 1).expect_err("empty tag");
    assert!(matches!(err, BridgeError::InvalidSummary { .. }), "{err}");
    assert!(err.to_string().contains("events.out.tfevents."), "{err}");
}

#[test]
fn create_in_a_file_path_names_it() {
    let dir = TempDir::new("tb-not-a-dir");
    let file = dir.join("plain");
    std::fs::write(&file, b"x").expect("write");
    let err = EventWriter::create(&file, 0).expect_err("not a directory");
    assert!(
        matches!(err, BridgeError::Io { ref path, .. } if path == &file),
        "{err}"
    );
}

/// Writes steps `steps` of run `run` (values `100 run + step`).
fn log_steps(w: &mut EventWriter, run: i64, steps: std::ops::RangeInclusive<i64>) {
    for step in steps {
        let v = (100 * run + step) as f32;
        w.add_scalars(step, &[("loss", v), ("grad_norm", v / 8.0)])
            .expect("add");
        w.flush().expect("flush");
    }
}

/// Waits until the wall clock's second differs from the one in `w`'s file name, so that the
/// next file sorts after it (file names order runs at one-second resolution, as TensorBoard's).
fn next_second(w: &EventWriter) {
    let name = w.path().file_name().and_then(|n| n.to_str()).expect("name");
    let secs: u64 = name["events.out.tfevents.".len()..][..10]
        .parse()
        .expect("seconds");
    while (now() as u64) <= secs {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn resumed_run_replaces_the_steps_after_its_checkpoint() {
    let dir = TempDir::new("tb-resume");
    // The first run logs steps 1..=10, its last checkpoint is at step 6.
    let mut first = EventWriter::create(dir.path(), 1).expect("first");
    log_steps(&mut first, 1, 1..=10);
    next_second(&first);
    drop(first);
    // The resumed run restarts after the checkpoint: it logs 7..=12 again.
    let mut second = EventWriter::create(dir.path(), 7).expect("second");
    log_steps(&mut second, 2, 7..=12);
    drop(second);

    let scalars = read_scalars_dir(dir.path()).expect("scalars");
    let loss: Vec<(i64, f64)> = scalars["loss"].iter().map(|p| (p.step, p.value)).collect();
    let want: Vec<(i64, f64)> = (1..=12)
        .map(|s| (s, if s < 7 { 100 + s } else { 200 + s } as f64))
        .collect();
    assert_eq!(loss, want);
    assert_eq!(scalars["grad_norm"].len(), 12);

    // Each file's START event sits right after its version event, at the session's first step.
    let files = event_files(dir.path()).expect("files");
    assert_eq!(files.len(), 2);
    for (file, first_step) in files.iter().zip([1, 7]) {
        let events = read_events(file).expect("read");
        assert_eq!(events[1].step, first_step);
        assert!(matches!(
            &events[1].what,
            EventPayload::SessionLog(SessionLog {
                status: SessionStatus::Start,
                ..
            })
        ));
    }
}

#[test]
fn event_files_skips_other_entries_and_sorts_by_name() {
    let dir = TempDir::new("tb-list");
    for name in [
        "events.out.tfevents.1700000002.h.1.0",
        "notes.txt",
        "events.out.tfevents.1700000001.h.9.3",
    ] {
        std::fs::write(dir.join(name), b"").expect("write");
    }
    std::fs::create_dir(dir.join("sub.tfevents")).expect("mkdir");
    let names: Vec<String> = event_files(dir.path())
        .expect("list")
        .iter()
        .map(|p| p.file_name().expect("name").to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        [
            "events.out.tfevents.1700000001.h.9.3",
            "events.out.tfevents.1700000002.h.1.0"
        ]
    );
    // Empty event files hold no events.
    assert!(
        read_scalars_dir(dir.path())
            .expect("empty files")
            .is_empty()
    );
}

// ---------------------------------------------------------------------------------------------
// Corrupt and truncated input

/// A small file written by the writer, its bytes and its records' start offsets.
fn small_file(dir: &TempDir) -> (PathBuf, Vec<u8>, Vec<usize>) {
    let mut w = EventWriter::create(dir.path(), 3).expect("create");
    w.add_scalars(3, &[("a", 1.0), ("b", -2.0)]).expect("add");
    w.add_scalar("c", 0.25, 4).expect("add");
    w.flush().expect("flush");
    let path = w.path().to_path_buf();
    drop(w);
    let bytes = std::fs::read(&path).expect("read");
    let starts = raw_records(&bytes).iter().map(|(at, _)| *at).collect();
    (path, bytes, starts)
}

#[test]
fn every_truncation_is_refused_at_its_record() {
    let dir = TempDir::new("tb-truncate");
    let (path, bytes, starts) = small_file(&dir);
    assert_eq!(starts.len(), 4);
    let cut_path = dir.join("cut.tfevents");
    for cut in 0..bytes.len() {
        std::fs::write(&cut_path, &bytes[..cut]).expect("write");
        let result = read_events(&cut_path);
        // Records that start before the cut; the last of them is cut unless the cut is at a
        // record boundary.
        let started = starts.iter().filter(|&&s| s < cut).count();
        if starts.contains(&cut) || cut == 0 {
            let events = result.expect("a cut between records leaves whole records");
            assert_eq!(events.len(), started);
        } else {
            let err = result.expect_err("truncated");
            let record = starts[started - 1];
            match &err {
                BridgeError::CorruptEventRecord {
                    path,
                    offset,
                    reason,
                } => {
                    assert_eq!(path, &cut_path);
                    assert_eq!(*offset, record as u64, "cut at {cut}");
                    assert!(reason.contains("truncated"), "{reason}");
                }
                other => panic!("cut at {cut}: {other}"),
            }
            let text = err.to_string();
            assert!(text.contains("cut.tfevents") && text.contains(&format!("byte {record}")));
        }
    }
    assert_eq!(read_events(&path).expect("whole").len(), 4);
}

#[test]
fn every_flipped_bit_is_caught_by_a_crc() {
    let dir = TempDir::new("tb-flip");
    let (_, bytes, starts) = small_file(&dir);
    let bad = dir.join("bad.tfevents");
    for i in 0..bytes.len() {
        for bit in [0u8, 3, 7] {
            let mut copy = bytes.clone();
            copy[i] ^= 1 << bit;
            std::fs::write(&bad, &copy).expect("write");
            let record = *starts.iter().rev().find(|&&s| s <= i).expect("record");
            match read_events(&bad) {
                Err(BridgeError::CorruptEventRecord { offset, reason, .. }) => {
                    assert_eq!(offset, record as u64, "byte {i} bit {bit}");
                    assert!(
                        reason.contains("CRC") || reason.contains("truncated"),
                        "{reason}"
                    );
                }
                other => panic!("byte {i} bit {bit}: {other:?}"),
            }
        }
    }
}

#[test]
fn a_record_that_is_not_an_event_is_refused() {
    let dir = TempDir::new("tb-not-event");
    let (_, bytes, _) = small_file(&dir);
    let path = dir.join("garbage.tfevents");
    // A valid first record, then a well-framed record whose varint runs off its end.
    let mut file = bytes[..raw_records(&bytes)[1].0].to_vec();
    let second = file.len();
    file.extend(encode_record(&[0x10, 0xff, 0xff]));
    std::fs::write(&path, &file).expect("write");
    let err = read_events(&path).expect_err("invalid event");
    match &err {
        BridgeError::InvalidEvent { offset, reason, .. } => {
            assert_eq!(*offset, second as u64);
            assert!(reason.contains("varint"), "{reason}");
        }
        other => panic!("{other}"),
    }
    // The iterator yields the good event, then the error, then stops.
    let mut reader = EventReader::open(&path).expect("open");
    assert!(reader.next().expect("first").is_ok());
    assert!(reader.next().expect("second").is_err());
    assert!(reader.next().is_none());
}

#[test]
fn missing_file_is_an_io_error_naming_it() {
    let dir = TempDir::new("tb-missing");
    let path = dir.join("events.out.tfevents.missing");
    let err = read_events(&path).expect_err("missing");
    assert!(
        matches!(&err, BridgeError::Io { path: p, .. } if p == &path),
        "{err}"
    );
    assert!(read_scalars_dir(&dir.join("no-such-dir")).is_err());
}

#[test]
fn huge_claimed_length_does_not_allocate_it() {
    // A length of u64::MAX with a valid length CRC: refused as truncated after reading the
    // few bytes that exist.
    let len = u64::MAX.to_le_bytes();
    let mut bytes = len.to_vec();
    bytes.extend(masked_crc32c(&len).to_le_bytes());
    bytes.extend([1, 2, 3]);
    let err = read_record(&mut bytes.as_slice()).expect_err("truncated");
    assert!(matches!(err, record::RecordError::Corrupt(ref r) if r.contains("truncated")));
}

// ---------------------------------------------------------------------------------------------
// Protobuf wire format

#[test]
fn negative_step_is_a_ten_byte_varint() {
    // Protobuf encodes int64 -1 as the varint of 2^64 - 1: nine 0xff bytes and 0x01.
    let event = Event {
        wall_time: 0.0,
        step: -1,
        what: EventPayload::Empty,
        source_writer: None,
    };
    let bytes = event.encode();
    assert_eq!(
        bytes,
        [
            0x10, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01
        ]
    );
    assert_eq!(Event::decode(&bytes).expect("decode"), event);
}

#[test]
fn malformed_messages_are_errors() {
    let cases: [(&[u8], &str); 7] = [
        // Varint longer than 10 bytes.
        (
            &[
                0x10, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01,
            ],
            "varint",
        ),
        // Tenth varint byte above 1 overflows 64 bits.
        (
            &[
                0x10, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02,
            ],
            "overflows",
        ),
        // Field number 0.
        (&[0x00, 0x01], "field number 0"),
        // A group (wire type 3).
        (&[0x0b], "wire type 3"),
        // Length past the end.
        (&[0x1a, 0x05, b'a'], "claims 5 bytes"),
        // wall_time with the wrong wire type.
        (&[0x08, 0x01], "Event.wall_time has wire type varint"),
        // file_version that is not UTF-8.
        (&[0x1a, 0x01, 0xff], "UTF-8"),
    ];
    for (bytes, needle) in cases {
        let err = Event::decode(bytes).expect_err("malformed");
        assert!(err.contains(needle), "{bytes:02x?}: {err}");
    }
}

#[test]
fn random_and_cut_messages_never_panic() {
    let golden = std::fs::read(fixtures().join("golden.tfevents")).expect("golden");
    let records = raw_records(&golden);
    let mut rng = SplitMix::new(11);
    for (_, data) in &records {
        for cut in 0..data.len() {
            let _ = Event::decode(&data[..cut]);
        }
        for _ in 0..50 {
            let mut copy = data.clone();
            let i = rng.below(copy.len());
            copy[i] = rng.next_u64() as u8;
            let _ = Event::decode(&copy);
        }
    }
    for _ in 0..2000 {
        let n = rng.below(40);
        let bytes: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
        let _ = Event::decode(&bytes);
        let mut d = Decoder::new(&bytes);
        while let Ok(Some(_)) = d.next_field() {}
        let _ = read_record(&mut bytes.as_slice());
    }
}

// ---------------------------------------------------------------------------------------------
// A directory for TensorBoard itself to read

/// Writes a run and a resumed run into `$MOE_TENSORBOARD_CHECK_DIR` for
/// `tests/check_tensorboard.py`, which reads it with TensorBoard's `EventAccumulator`:
///
/// ```text
/// MOE_TENSORBOARD_CHECK_DIR=/tmp/tb-check cargo test -p moe-bridge --lib \
///     tensorboard::tests::write_check_directory -- --ignored
/// benches/.venv/bin/python tests/check_tensorboard.py /tmp/tb-check
/// ```
///
/// Run 1 (`create(dir, 1)`) logs steps 1..=10, run 2 resumes at step 7 (`create(dir, 7)`) and
/// logs 7..=12; tags `train/loss`
/// (`100 run + step / 4`), `train/lr` (`run · 1e-4 + step · 1e-6`) and `tokens_per_s`
/// (`run · 1e5 + step · 4096 + 1/3`), each rounded once to f32.
#[test]
#[ignore = "writes $MOE_TENSORBOARD_CHECK_DIR for tests/check_tensorboard.py"]
fn write_check_directory() {
    let dir = PathBuf::from(
        std::env::var_os("MOE_TENSORBOARD_CHECK_DIR").expect("set MOE_TENSORBOARD_CHECK_DIR"),
    );
    let runs: [(i64, std::ops::RangeInclusive<i64>); 2] = [(1, 1..=10), (2, 7..=12)];
    for (run, steps) in runs {
        let mut w = EventWriter::create(&dir, *steps.start()).expect("create");
        for step in steps {
            let loss = (100 * run) as f32 + step as f32 / 4.0;
            let lr = (run as f64 * 1e-4 + step as f64 * 1e-6) as f32;
            w.add_scalars(step, &[("train/loss", loss), ("train/lr", lr)])
                .expect("add");
            let tokens = run as f64 * 1e5 + step as f64 * 4096.0 + 1.0 / 3.0;
            w.add_scalar("tokens_per_s", tokens as f32, step)
                .expect("add");
            w.flush().expect("flush");
        }
        next_second(&w);
    }
    let files = event_files(&dir).expect("files");
    println!("wrote {files:?}");
}
