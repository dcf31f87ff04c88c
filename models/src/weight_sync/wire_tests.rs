//! Tests of the wire format: byte layout against the spec written out by hand, a sync through a
//! byte stream equal bit for bit to the in-process sync, and every refusal naming what.

use burn::module::Module;
use burn::tensor::{DType, Device};
use moe_backend::comm::World;
use moe_backend::parallel::ParallelLayout;

use super::tests::{Zero, tiny};
use super::*;
use crate::export::export_hf_tensors;
use crate::{Qwen3MoeConfig, Qwen3MoeForCausalLM};

/// Runs a one-rank sync of `model` into `receiver`.
fn sync_into(
    model: &Qwen3MoeForCausalLM,
    dtype: SyncDtype,
    experts: ExpertNames,
    receiver: &mut (dyn WeightReceiver + Send),
) -> Result<SyncStats, WeightSyncError> {
    let layout = ParallelLayout::single();
    let layout_ref = &layout;
    let cell = std::sync::Mutex::new(receiver);
    let mut results = World::run(1, |ctx| {
        let pg = ctx.process_groups(layout_ref)?;
        let options = SyncOptions {
            bucket_bytes: 4096,
            dtype,
            experts,
            ..SyncOptions::default()
        };
        let mut guard = cell
            .lock()
            .map_err(|_| moe_backend::BackendError::Replay("poisoned".into()))?;
        let r: &mut dyn WeightReceiver = &mut **guard;
        Ok(sync_weights(model, &pg, options, Some(r)))
    });
    match results.pop() {
        Some(Ok(result)) => result,
        Some(Err(e)) => Err(WeightSyncError::Comm(e)),
        None => Err(WeightSyncError::Unsupported("no rank ran".into())),
    }
}

/// The wire stream of a one-rank sync of `model`.
fn stream_of(model: &Qwen3MoeForCausalLM, dtype: SyncDtype, experts: ExpertNames) -> Vec<u8> {
    let mut sender = WireSender::new(Vec::new());
    let stats = sync_into(model, dtype, experts, &mut sender).unwrap();
    assert!(stats.buckets > 2, "the tests want several buckets");
    assert!(sender.is_finished());
    sender.into_inner()
}

/// Every tensor of `model`'s export as raw bytes.
fn export_bytes(model: &Qwen3MoeForCausalLM) -> Vec<(String, Vec<u8>)> {
    export_hf_tensors(model)
        .expect("export")
        .map(|(n, d)| (n, d.as_bytes().to_vec()))
        .collect()
}

/// A receiver that records the calls it gets.
#[derive(Default)]
struct Recorder {
    manifest: Option<SyncManifest>,
    buckets: Vec<WeightBucket>,
    finished: bool,
}

impl WeightReceiver for Recorder {
    fn begin(&mut self, manifest: &SyncManifest) -> Result<(), WeightSyncError> {
        self.manifest = Some(manifest.clone());
        Ok(())
    }
    fn receive(&mut self, bucket: &WeightBucket) -> Result<(), WeightSyncError> {
        self.buckets.push(bucket.clone());
        Ok(())
    }
    fn finish(&mut self) -> Result<(), WeightSyncError> {
        self.finished = true;
        Ok(())
    }
}

/// Byte ranges of the frames of a stream, parsed by the spec: `(manifest json, [(frame start,
/// data start, data len)], end frame start)`.
fn frames(s: &[u8]) -> (std::ops::Range<usize>, Vec<(usize, usize, usize)>, usize) {
    let u64_at = |at: usize| u64::from_le_bytes(s[at..at + 8].try_into().unwrap()) as usize;
    assert_eq!(s[12], b'M');
    let json_len = u64_at(13);
    let json = 25..25 + json_len;
    let mut at = json.end;
    let mut buckets = Vec::new();
    while s[at] == b'B' {
        let len = u64_at(at + 9);
        buckets.push((at, at + 21, len));
        at += 21 + len;
    }
    assert_eq!(s[at], b'E');
    assert_eq!(at + 17, s.len());
    (json, buckets, at)
}

#[test]
fn byte_layout_follows_the_spec() {
    // One bucket of two tensors, written by hand from the module docs.
    let a: Vec<u8> = [1.5f32, -2.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let b: Vec<u8> = [0x3f80u16, 0xc000, 0x4040]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let data: Vec<u8> = a.iter().chain(&b).copied().collect();
    let t = |name: &str, dtype, shape: Vec<usize>, offset, bytes| SyncedTensor {
        name: name.into(),
        dtype,
        shape,
        offset,
        bytes,
    };
    let tensors = vec![
        t("x.bias", DType::F32, vec![2], 0, 8),
        t("y.weight", DType::BF16, vec![1, 3], 8, 6),
    ];
    let manifest = SyncManifest {
        buckets: vec![BucketMeta {
            tensors: tensors.clone(),
            bytes: 14,
        }],
        dtype: SyncDtype::Bf16,
        experts: ExpertNames::Fused,
    };
    let mut sender = WireSender::new(Vec::new());
    sender.begin(&manifest).unwrap();
    sender
        .receive(&WeightBucket {
            index: 0,
            count: 1,
            tensors,
            data: data.clone(),
        })
        .unwrap();
    sender.finish().unwrap();
    let stream = sender.into_inner();

    let json = br#"{"version":1,"dtype":"BF16","experts":"fused","buckets":[{"index":0,"bytes":14,"tensors":[{"name":"x.bias","dtype":"F32","shape":[2],"offset":0,"bytes":8},{"name":"y.weight","dtype":"BF16","shape":[1,3],"offset":8,"bytes":6}]}]}"#;
    let mut want = b"MOEWSYNC".to_vec();
    want.extend([1, 0, 0, 0]);
    want.push(0x4D);
    want.extend((json.len() as u64).to_le_bytes());
    want.extend(crc32c::crc32c(json).to_le_bytes());
    want.extend(json);
    want.push(0x42);
    want.extend([0u8; 8]);
    want.extend([14, 0, 0, 0, 0, 0, 0, 0]);
    want.extend(crc32c::crc32c(&data).to_le_bytes());
    want.extend(&data);
    want.push(0x45);
    want.extend([1, 0, 0, 0, 0, 0, 0, 0]);
    want.extend([14, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(stream, want);
    // The CRC is the standard CRC32C (its check value).
    assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);

    let mut rec = Recorder::default();
    let stats = receive_wire(stream.as_slice(), &mut rec).unwrap();
    assert_eq!(rec.manifest.as_ref(), Some(&manifest));
    assert_eq!(rec.buckets.len(), 1);
    assert_eq!(rec.buckets[0].data, data);
    assert_eq!((rec.buckets[0].index, rec.buckets[0].count), (0, 1));
    assert!(rec.finished);
    assert_eq!(
        (
            stats.buckets,
            stats.tensors,
            stats.payload_bytes,
            stats.stream_bytes
        ),
        (1, 2, 14, want.len() as u64)
    );
    assert_eq!(
        rec.buckets[0]
            .values_f32(&rec.buckets[0].tensors[1])
            .unwrap(),
        [1., -2., 3.]
    );
}

#[test]
fn wire_sync_equals_the_in_process_sync_bit_for_bit() {
    let device = Device::flex();
    let source = tiny().init(&device).unwrap();
    for (dtype, experts) in [
        (SyncDtype::Bf16, ExpertNames::PerExpert),
        (SyncDtype::F32, ExpertNames::Fused),
    ] {
        let mut direct = tiny().init(&device).unwrap().map(&mut Zero);
        sync_into(
            &source,
            dtype,
            experts,
            &mut ModelReceiver::new(&mut direct, &device),
        )
        .unwrap();

        let stream = stream_of(&source, dtype, experts);
        let mut wired = tiny().init(&device).unwrap().map(&mut Zero);
        let stats = receive_wire(
            stream.as_slice(),
            &mut ModelReceiver::new(&mut wired, &device),
        )
        .unwrap();
        assert_eq!(stats.stream_bytes, stream.len() as u64);
        let (_, buckets, _) = frames(&stream);
        assert_eq!(stats.buckets, buckets.len());

        let want = export_bytes(&direct);
        assert!(export_bytes(&wired) == want, "{dtype:?} {experts:?}");
        if dtype == SyncDtype::F32 {
            assert!(export_bytes(&source) == want, "F32 is the training weights");
        } else {
            assert!(export_bytes(&source) != want, "BF16 rounds");
        }
    }
}

#[cfg(unix)]
#[test]
fn wire_sync_over_a_socket_pair() {
    use std::os::unix::net::UnixStream;

    let device = Device::flex();
    let source = tiny().init(&device).unwrap();
    let mut direct = tiny().init(&device).unwrap().map(&mut Zero);
    sync_into(
        &source,
        SyncDtype::Bf16,
        ExpertNames::PerExpert,
        &mut ModelReceiver::new(&mut direct, &device),
    )
    .unwrap();

    let (tx, rx) = UnixStream::pair().unwrap();
    let mut wired = tiny().init(&device).unwrap().map(&mut Zero);
    let sent = std::thread::scope(|s| {
        let sender = s.spawn(|| {
            let mut sender = WireSender::new(std::io::BufWriter::new(&tx));
            let stats = sync_into(
                &source,
                SyncDtype::Bf16,
                ExpertNames::PerExpert,
                &mut sender,
            )
            .map(|_| sender.stats());
            read_ack(&tx).map(|()| stats)
        });
        let got = receive_wire(&rx, &mut ModelReceiver::new(&mut wired, &device));
        // The answer on the way back.
        write_ack(&rx, got.as_ref()).unwrap();
        (sender.join().unwrap(), got)
    });
    let (sent, got) = (sent.0.unwrap().unwrap(), sent.1.unwrap());
    assert_eq!(sent.stream_bytes, got.stream_bytes);
    assert_eq!(sent.payload_bytes, got.payload_bytes);
    assert_eq!((sent.buckets, sent.tensors), (got.buckets, got.tensors));
    assert!(export_bytes(&wired) == export_bytes(&direct));
}

#[test]
fn corrupt_bucket_is_refused_naming_it() {
    let source = tiny().init(&Device::flex()).unwrap();
    let mut stream = stream_of(&source, SyncDtype::Bf16, ExpertNames::PerExpert);
    let (json, buckets, _) = frames(&stream);
    let manifest: serde_json::Value = serde_json::from_slice(&stream[json]).unwrap();
    let first = manifest["buckets"][1]["tensors"][0]["name"]
        .as_str()
        .unwrap()
        .to_owned();
    let (_, data_at, len) = buckets[1];
    stream[data_at + len / 2] ^= 0x10;
    let mut rec = Recorder::default();
    let err = receive_wire(stream.as_slice(), &mut rec).unwrap_err();
    let WeightSyncError::WireChecksum {
        bucket,
        offset,
        bytes,
        expected,
        found,
    } = &err
    else {
        panic!("{err}");
    };
    assert_eq!(*bucket, format!("bucket 1 (first tensor `{first}`)"));
    assert_eq!((*offset, *bytes), (data_at as u64, len as u64));
    assert_ne!(expected, found);
    assert!(err.to_string().contains(&format!("`{first}`")), "{err}");
    // Bucket 0 was handed on, bucket 1 was not, and the sync never finished.
    assert_eq!(rec.buckets.len(), 1);
    assert!(!rec.finished);

    // A corrupt manifest.
    let mut stream = stream_of(&source, SyncDtype::Bf16, ExpertNames::PerExpert);
    let (json, _, _) = frames(&stream);
    stream[json.start + 5] ^= 0x01;
    let err = receive_wire(stream.as_slice(), &mut Recorder::default()).unwrap_err();
    assert!(
        matches!(&err, WeightSyncError::WireFormat { offset: 25, reason } if reason.contains("manifest is corrupt")),
        "{err}"
    );
}

#[test]
fn truncated_streams_are_refused_never_panic() {
    let source = tiny().init(&Device::flex()).unwrap();
    let stream = stream_of(&source, SyncDtype::Bf16, ExpertNames::PerExpert);
    let (json, buckets, end) = frames(&stream);
    // Every frame boundary and field, and a stride through the data.
    let mut cuts: Vec<usize> = (0..40).collect();
    cuts.extend([json.start, json.start + 1, json.end - 1, json.end]);
    for &(at, data_at, len) in &buckets {
        cuts.extend([at, at + 1, at + 9, at + 17, data_at, data_at + len / 3]);
    }
    cuts.extend((end..stream.len()).chain((0..stream.len()).step_by(251)));
    for cut in cuts {
        let mut rec = Recorder::default();
        let err = receive_wire(&stream[..cut], &mut rec).unwrap_err();
        assert!(
            matches!(&err, WeightSyncError::WireIo { source, offset, .. }
                if source.kind() == std::io::ErrorKind::UnexpectedEof && *offset <= cut as u64),
            "cut at {cut}: {err}"
        );
        assert!(err.to_string().contains("the stream ends inside"), "{err}");
        assert!(!rec.finished, "cut at {cut}");
    }
    // Inside bucket 2's bytes: names the bucket and its first tensor.
    let (_, data_at, len) = buckets[2];
    let err = receive_wire(&stream[..data_at + len - 1], &mut Recorder::default()).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("bucket 2 (first tensor `model.")
            && msg.contains(&format!("at byte {data_at}"))
            && msg.contains(&format!("{} of {len} bytes", len - 1)),
        "{msg}"
    );
    // The whole stream is fine.
    receive_wire(stream.as_slice(), &mut Recorder::default()).unwrap();
}

#[test]
fn wrong_magic_and_version_are_refused() {
    let source = tiny().init(&Device::flex()).unwrap();
    let stream = stream_of(&source, SyncDtype::Bf16, ExpertNames::PerExpert);

    let mut bad = stream.clone();
    bad[..8].copy_from_slice(b"PK\x03\x04xxxx");
    let err = receive_wire(bad.as_slice(), &mut Recorder::default()).unwrap_err();
    assert!(
        matches!(&err, WeightSyncError::WireMagic { found, .. } if found == b"PK\x03\x04xxxx"),
        "{err}"
    );

    let mut bad = stream.clone();
    bad[8..12].copy_from_slice(&2u32.to_le_bytes());
    let mut rec = Recorder::default();
    let err = receive_wire(bad.as_slice(), &mut rec).unwrap_err();
    assert!(
        matches!(
            err,
            WeightSyncError::WireVersion {
                found: 2,
                supported: 1
            }
        ),
        "{err}"
    );
    assert!(rec.manifest.is_none());

    // Not a stream at all.
    let err = receive_wire(&b"{}"[..], &mut Recorder::default()).unwrap_err();
    assert!(
        matches!(err, WeightSyncError::WireIo { offset: 0, .. }),
        "{err}"
    );
}

#[test]
fn buckets_out_of_order_or_of_other_sizes_are_refused() {
    let source = tiny().init(&Device::flex()).unwrap();
    let stream = stream_of(&source, SyncDtype::Bf16, ExpertNames::PerExpert);
    let (_, buckets, _) = frames(&stream);

    // Swap the frames of buckets 1 and 2.
    let (a, _, alen) = buckets[1];
    let (b, _, blen) = buckets[2];
    let mut swapped = stream[..a].to_vec();
    swapped.extend(&stream[b..b + 21 + blen]);
    swapped.extend(&stream[a..a + 21 + alen]);
    swapped.extend(&stream[b + 21 + blen..]);
    assert_eq!(swapped.len(), stream.len());
    let mut rec = Recorder::default();
    let err = receive_wire(swapped.as_slice(), &mut rec).unwrap_err();
    assert!(
        matches!(err, WeightSyncError::WireBucketOrder { offset, expected: 1, found: 2 } if offset == a as u64),
        "{err}"
    );
    assert_eq!(rec.buckets.len(), 1);

    // Bucket 0 skipped.
    let mut skipped = stream[..buckets[0].0].to_vec();
    skipped.extend(&stream[buckets[1].0..]);
    let err = receive_wire(skipped.as_slice(), &mut Recorder::default()).unwrap_err();
    assert!(
        matches!(
            err,
            WeightSyncError::WireBucketOrder {
                expected: 0,
                found: 1,
                ..
            }
        ),
        "{err}"
    );

    // A length other than the manifest's.
    let mut bad = stream.clone();
    bad[a + 9..a + 17].copy_from_slice(&((alen - 2) as u64).to_le_bytes());
    let err = receive_wire(bad.as_slice(), &mut Recorder::default()).unwrap_err();
    assert!(
        matches!(&err, WeightSyncError::WireBucketSize { bucket, expected, found, .. }
            if bucket.starts_with("bucket 1 (first tensor `model.")
                && *expected == alen as u64 && *found == (alen - 2) as u64),
        "{err}"
    );

    // An extra bucket frame where the end frame belongs.
    let (_, _, end) = frames(&stream);
    let mut extra = stream[..end].to_vec();
    extra.extend(&stream[a..a + 21 + alen]);
    extra.extend(&stream[end..]);
    let err = receive_wire(extra.as_slice(), &mut Recorder::default()).unwrap_err();
    assert!(
        matches!(&err, WeightSyncError::WireFormat { offset, reason }
            if *offset == end as u64 && reason.contains("the end frame")),
        "{err}"
    );
}

#[test]
fn a_receiver_of_other_shapes_fails_naming_the_tensor() {
    let device = Device::flex();
    let source = tiny().init(&device).unwrap();
    let stream = stream_of(&source, SyncDtype::Bf16, ExpertNames::PerExpert);
    let other = Qwen3MoeConfig {
        moe_intermediate_size: 12,
        ..tiny()
    };
    let mut target = other.init(&device).unwrap();
    let before = export_bytes(&target);
    let err = receive_wire(
        stream.as_slice(),
        &mut ModelReceiver::new(&mut target, &device),
    )
    .unwrap_err();
    let WeightSyncError::ShapeMismatch {
        name,
        expected,
        found,
    } = &err
    else {
        panic!("{err}");
    };
    assert_eq!(name, "model.layers.1.mlp.experts.0.gate_proj.weight");
    assert_eq!(
        (expected.as_slice(), found.as_slice()),
        (&[12, 16][..], &[8, 16][..])
    );
    assert!(err.to_string().contains(&format!("`{name}`")), "{err}");
    assert!(
        export_bytes(&target) == before,
        "the model is left unchanged"
    );
}

#[test]
fn invalid_manifests_are_refused_naming_the_tensor() {
    // A manifest whose tensor overlaps the next one, sent with a valid CRC.
    let t = |name: &str, offset| SyncedTensor {
        name: name.into(),
        dtype: DType::F32,
        shape: vec![2],
        offset,
        bytes: 8,
    };
    let manifest = SyncManifest {
        buckets: vec![BucketMeta {
            tensors: vec![t("a", 0), t("b", 4)],
            bytes: 16,
        }],
        dtype: SyncDtype::F32,
        experts: ExpertNames::PerExpert,
    };
    let mut sender = WireSender::new(Vec::new());
    sender.begin(&manifest).unwrap();
    let err = receive_wire(sender.into_inner().as_slice(), &mut Recorder::default()).unwrap_err();
    assert!(
        matches!(&err, WeightSyncError::Malformed { name, reason } if name == "b" && reason.contains("offset 4")),
        "{err}"
    );

    // The sender refuses a bucket out of order and a finish before the last bucket.
    let manifest = SyncManifest {
        buckets: vec![
            BucketMeta {
                tensors: vec![t("a", 0)],
                bytes: 8,
            },
            BucketMeta {
                tensors: vec![t("b", 0)],
                bytes: 8,
            },
        ],
        dtype: SyncDtype::F32,
        experts: ExpertNames::PerExpert,
    };
    let mut sender = WireSender::new(Vec::new());
    sender.begin(&manifest).unwrap();
    let second = WeightBucket {
        index: 1,
        count: 2,
        tensors: vec![t("b", 0)],
        data: vec![0; 8],
    };
    let err = sender.receive(&second).unwrap_err();
    assert!(
        err.to_string().contains("bucket 1 (first tensor `b`)"),
        "{err}"
    );
    assert!(sender.finish().is_err());
}

#[test]
fn acknowledgements_round_trip_and_refusals_carry_the_reason() {
    // Loaded: status 0, no message, as the spec writes it.
    let mut ok = Vec::new();
    write_ack(&mut ok, Ok(&WireStats::default())).unwrap();
    assert_eq!(ok, [&[0x41u8, 0, 0, 0, 0][..], &[0u8; 8][..]].concat());
    read_ack(ok.as_slice()).unwrap();

    // Refused: status 1 and the receiver's error.
    let refusal = WeightSyncError::UnknownTensor {
        name: "model.layers.1.mlp.gate.weight".into(),
    };
    let mut bad = Vec::new();
    write_ack(&mut bad, Err(&refusal)).unwrap();
    let text = refusal.to_string();
    assert_eq!(&bad[..5], &[0x41, 1, 0, 0, 0]);
    assert_eq!(&bad[5..13], &(text.len() as u64).to_le_bytes());
    assert_eq!(&bad[13..], text.as_bytes());
    let err = read_ack(bad.as_slice()).unwrap_err();
    assert!(
        matches!(&err, WeightSyncError::WireRejected { message } if *message == text),
        "{err}"
    );
    assert!(err.to_string().contains("`model.layers.1.mlp.gate.weight`"));

    // A long reason is cut at a character boundary.
    let long = WeightSyncError::Unsupported("é".repeat(40_000));
    let mut cut = Vec::new();
    write_ack(&mut cut, Err(&long)).unwrap();
    let len = u64::from_le_bytes(cut[5..13].try_into().unwrap());
    assert!(len <= MAX_ACK_MESSAGE_BYTES && len > MAX_ACK_MESSAGE_BYTES - 2);
    assert!(std::str::from_utf8(&cut[13..]).is_ok());

    // Malformed answers.
    let mut status = ok.clone();
    status[1] = 7;
    let err = read_ack(status.as_slice()).unwrap_err();
    assert!(
        matches!(&err, WeightSyncError::WireFormat { offset: 1, reason } if reason.contains("status 7")),
        "{err}"
    );
    for cut in 0..bad.len() {
        let err = read_ack(&bad[..cut]).unwrap_err();
        assert!(
            matches!(err, WeightSyncError::WireIo { .. }),
            "{cut}: {err}"
        );
    }
    let err = read_ack(&b"MOEWSYNC"[..]).unwrap_err();
    assert!(
        matches!(err, WeightSyncError::WireFormat { offset: 0, .. }),
        "{err}"
    );
}

#[test]
fn every_single_byte_corruption_is_refused() {
    let source = tiny().init(&Device::flex()).unwrap();
    let stream = stream_of(&source, SyncDtype::Bf16, ExpertNames::PerExpert);
    let (json, buckets, end) = frames(&stream);
    // Every byte of the header and framing fields, some of the JSON and of the data.
    let mut at: Vec<usize> = (0..json.start).collect();
    at.extend(json.clone().step_by(7));
    for &(frame, data_at, len) in &buckets {
        at.extend(frame..data_at);
        at.extend((data_at..data_at + len).step_by(61));
    }
    at.extend(end..stream.len());
    let mut bad = stream.clone();
    for i in at {
        bad[i] ^= 0x5A;
        let mut rec = Recorder::default();
        assert!(
            receive_wire(bad.as_slice(), &mut rec).is_err(),
            "a corruption of byte {i} went through"
        );
        assert!(!rec.finished, "byte {i}");
        bad[i] = stream[i];
    }
}
