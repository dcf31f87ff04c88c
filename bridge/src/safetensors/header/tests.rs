use std::collections::HashMap;
use std::path::PathBuf;

use safetensors::Dtype as St;
use safetensors::tensor::TensorView;

use super::*;

fn mem() -> PathBuf {
    PathBuf::from("<memory>")
}

fn parse(bytes: &[u8]) -> Result<SafetensorsHeader, BridgeError> {
    SafetensorsHeader::parse(bytes, &mem())
}

/// A file made of `header` (JSON text) and `data_len` zero bytes of data.
fn file(header: &str, data_len: usize) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.resize(out.len() + data_len, 0);
    out
}

fn view(dtype: St, shape: Vec<usize>, data: &[u8]) -> TensorView<'_> {
    TensorView::new(dtype, shape, data).expect("valid view")
}

/// A valid file written by the reference `safetensors` crate, with FP8 tensors and metadata.
fn reference_file() -> Vec<u8> {
    let f32_data: Vec<u8> = (0..24u8).collect();
    let bf16_data: Vec<u8> = (0..12u8).collect();
    let fp8_data: Vec<u8> = (0..6u8).collect();
    let views = vec![
        ("a.weight", view(St::F32, vec![2, 3], &f32_data)),
        ("b.bf16", view(St::BF16, vec![3, 2], &bf16_data)),
        ("c.fp8", view(St::F8_E4M3, vec![2, 3], &fp8_data)),
        ("d.fp8", view(St::F8_E5M2, vec![6], &fp8_data)),
        ("e.scale", view(St::F8_E8M0, vec![1], &fp8_data[..1])),
        ("f.mask", view(St::BOOL, vec![3], &fp8_data[..3])),
        ("g.scalar", view(St::I64, vec![], &f32_data[..8])),
        ("h.empty", view(St::F32, vec![0, 4], &[])),
    ];
    let metadata = HashMap::from([("format".to_owned(), "pt".to_owned())]);
    safetensors::serialize(views, Some(metadata)).expect("serialize")
}

#[test]
fn parses_a_file_written_by_the_safetensors_crate() {
    let bytes = reference_file();
    let header = parse(&bytes).unwrap();
    let (n, reference) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(header.data_start, 8 + n);
    assert_eq!(header.metadata["format"], "pt");
    assert_eq!(header.tensors.len(), 8);
    assert_eq!(header.data_len(), bytes.len() - header.data_start);
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for (name, info) in &header.tensors {
        let expected = reference.info(name).unwrap();
        assert_eq!(info.dtype.as_str(), expected.dtype.to_string(), "{name}");
        assert_eq!(info.shape, expected.shape, "{name}");
        assert_eq!(info.data_offsets, expected.data_offsets, "{name}");
        let range = header.byte_range(name).unwrap();
        assert_eq!(
            &bytes[range],
            tensors.tensor(name).unwrap().data(),
            "{name}"
        );
    }
    assert_eq!(header.tensors["c.fp8"].dtype, Dtype::F8E4M3);
    assert_eq!(header.tensors["g.scalar"].num_elements(), 1);
    assert_eq!(header.tensors["h.empty"].byte_len(), 0);
}

#[test]
fn empty_and_minimal_headers() {
    let h = parse(&file("{}", 0)).unwrap();
    assert!(h.tensors.is_empty() && h.metadata.is_empty());
    assert_eq!(h.data_start, 10);
    let h = parse(&file(r#"{"__metadata__": null}"#, 0)).unwrap();
    assert!(h.metadata.is_empty());
    // Trailing padding spaces (as writers add for 8-byte alignment) are fine.
    let h = parse(&file(
        r#"{"x":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}    "#,
        2,
    ));
    assert_eq!(h.unwrap().tensors["x"].shape, [2]);
}

#[test]
fn truncated_files() {
    let bytes = reference_file();
    let header = parse(&bytes).unwrap();
    assert!(matches!(
        parse(&bytes[..5]),
        Err(BridgeError::FileTooShort { len: 5, .. })
    ));
    assert!(matches!(
        parse(&[]),
        Err(BridgeError::FileTooShort { len: 0, .. })
    ));
    let in_header = &bytes[..header.data_start - 3];
    assert!(matches!(
        parse(in_header),
        Err(BridgeError::Truncated { .. })
    ));
    let in_data = &bytes[..bytes.len() - 4];
    assert!(matches!(
        parse(in_data),
        Err(BridgeError::OffsetsOutOfBounds { .. })
    ));
}

#[test]
fn header_length_too_large() {
    let mut bytes = reference_file();
    bytes[..8].copy_from_slice(&(MAX_HEADER_LEN + 1).to_le_bytes());
    assert!(matches!(
        parse(&bytes),
        Err(BridgeError::HeaderTooLarge { .. })
    ));
    bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        parse(&bytes),
        Err(BridgeError::HeaderTooLarge { .. })
    ));
    // Within the limit but past the end of the file.
    let file_len = bytes.len() as u64;
    bytes[..8].copy_from_slice(&file_len.to_le_bytes());
    assert!(matches!(parse(&bytes), Err(BridgeError::Truncated { .. })));
}

#[test]
fn bad_json() {
    for header in ["{\"a\": ", "[]", "\"x\"", "{\"a\" 1}", "{} {}"] {
        let r = parse(&file(header, 0));
        assert!(
            matches!(r, Err(BridgeError::InvalidHeaderJson { .. })),
            "{header}: {r:?}"
        );
    }
    let mut bytes = file("{\"\u{e9}\": 1}", 0);
    bytes[10] = 0xff; // break the UTF-8 sequence
    assert!(matches!(
        parse(&bytes),
        Err(BridgeError::InvalidHeaderJson { .. })
    ));
}

#[test]
fn wrong_dtype() {
    let r = parse(&file(
        r#"{"w":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}}"#,
        1,
    ));
    match r {
        Err(BridgeError::UnsupportedDtype { tensor, dtype, .. }) => {
            assert_eq!((tensor.as_str(), dtype.as_str()), ("w", "F4"));
        }
        other => panic!("expected UnsupportedDtype, got {other:?}"),
    }
    let r = parse(&file(
        r#"{"w":{"dtype":7,"shape":[2],"data_offsets":[0,2]}}"#,
        2,
    ));
    assert!(matches!(r, Err(BridgeError::InvalidTensorEntry { .. })));
}

#[test]
fn malformed_entries() {
    for entry in [
        r#""w": 3"#,
        r#""w": {"shape":[2],"data_offsets":[0,2]}"#,
        r#""w": {"dtype":"U8","data_offsets":[0,2]}"#,
        r#""w": {"dtype":"U8","shape":[2]}"#,
        r#""w": {"dtype":"U8","shape":[-2],"data_offsets":[0,2]}"#,
        r#""w": {"dtype":"U8","shape":[2.5],"data_offsets":[0,2]}"#,
        r#""w": {"dtype":"U8","shape":2,"data_offsets":[0,2]}"#,
        r#""w": {"dtype":"U8","shape":[2],"data_offsets":[0,2,4]}"#,
        r#""w": {"dtype":"U8","shape":[2],"data_offsets":[0]}"#,
    ] {
        let r = parse(&file(&format!("{{{entry}}}"), 2));
        match r {
            Err(BridgeError::InvalidTensorEntry { tensor, .. }) => assert_eq!(tensor, "w"),
            other => panic!("{entry}: expected InvalidTensorEntry, got {other:?}"),
        }
    }
}

#[test]
fn shape_and_byte_length_mismatch() {
    let r = parse(&file(
        r#"{"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}}"#,
        20,
    ));
    match r {
        Err(BridgeError::ByteLengthMismatch {
            tensor,
            expected,
            actual,
            ..
        }) => assert_eq!((tensor.as_str(), expected, actual), ("w", 24, 20)),
        other => panic!("expected ByteLengthMismatch, got {other:?}"),
    }
}

#[test]
fn end_before_begin() {
    let r = parse(&file(
        r#"{"w":{"dtype":"U8","shape":[0],"data_offsets":[4,2]}}"#,
        4,
    ));
    assert!(matches!(
        r,
        Err(BridgeError::InvalidOffsets {
            begin: 4,
            end: 2,
            ..
        })
    ));
}

#[test]
fn overlapping_offsets() {
    let header = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                     "b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
    match parse(&file(header, 12)) {
        Err(BridgeError::OverlappingTensors { first, second, .. }) => {
            assert_eq!((first.as_str(), second.as_str()), ("a", "b"));
        }
        other => panic!("expected OverlappingTensors, got {other:?}"),
    }
}

#[test]
fn offsets_beyond_the_end() {
    let header = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                     "b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#;
    match parse(&file(header, 12)) {
        Err(BridgeError::OffsetsOutOfBounds {
            tensor,
            end,
            data_len,
            ..
        }) => assert_eq!((tensor.as_str(), end, data_len), ("b", 16, 12)),
        other => panic!("expected OffsetsOutOfBounds, got {other:?}"),
    }
}

#[test]
fn overflowing_shapes() {
    let big = 1u64 << 40;
    let header =
        format!(r#"{{"w":{{"dtype":"F32","shape":[{big},{big},{big}],"data_offsets":[0,0]}}}}"#);
    assert!(matches!(
        parse(&file(&header, 0)),
        Err(BridgeError::ShapeOverflow { .. })
    ));
    // The element count fits, the byte count does not.
    let n = u64::MAX / 2;
    let header = format!(r#"{{"w":{{"dtype":"F64","shape":[{n}],"data_offsets":[0,0]}}}}"#);
    assert!(matches!(
        parse(&file(&header, 0)),
        Err(BridgeError::ShapeOverflow { .. })
    ));
    // Offsets near usize::MAX do not overflow the bounds check.
    let m = u64::MAX;
    let header = format!(
        r#"{{"w":{{"dtype":"U8","shape":[2],"data_offsets":[{},{m}]}}}}"#,
        m - 2
    );
    let r = parse(&file(&header, 0));
    assert!(
        matches!(r, Err(BridgeError::OffsetsOutOfBounds { .. })),
        "{r:?}"
    );
}

#[test]
fn holes_are_rejected() {
    let gap = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},
                  "b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}}"#;
    match parse(&file(gap, 6)) {
        Err(BridgeError::DataGap {
            start, end, next, ..
        }) => {
            assert_eq!((start, end), (2, 4));
            assert!(next.contains("`b`"));
        }
        other => panic!("expected DataGap, got {other:?}"),
    }
    let trailing = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#;
    assert!(matches!(
        parse(&file(trailing, 5)),
        Err(BridgeError::DataGap {
            start: 2,
            end: 5,
            ..
        })
    ));
}

#[test]
fn duplicate_names_and_bad_metadata() {
    let dup = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},
                  "a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}"#;
    match parse(&file(dup, 4)) {
        Err(BridgeError::DuplicateTensor { tensor, .. }) => assert_eq!(tensor, "a"),
        other => panic!("expected DuplicateTensor, got {other:?}"),
    }
    for meta in [r#"{"format": 1}"#, "[]", r#""pt""#] {
        let header = format!(r#"{{"__metadata__": {meta}}}"#);
        let r = parse(&file(&header, 0));
        assert!(
            matches!(r, Err(BridgeError::InvalidMetadata { .. })),
            "{meta}: {r:?}"
        );
    }
    let twice = r#"{"__metadata__": {}, "__metadata__": {}}"#;
    assert!(matches!(
        parse(&file(twice, 0)),
        Err(BridgeError::InvalidMetadata { .. })
    ));
}

#[test]
fn mutated_files_never_panic() {
    let bytes = reference_file();
    for len in 0..bytes.len() {
        let _ = parse(&bytes[..len]);
    }
    let header_end = parse(&bytes).unwrap().data_start;
    let mut mutated = bytes.clone();
    for i in 0..header_end {
        for v in [0u8, b'"', b'9', b'{', b']', 0xff] {
            let old = mutated[i];
            mutated[i] = v;
            let _ = parse(&mutated);
            mutated[i] = old;
        }
    }
}

#[test]
fn read_header_reads_files_and_names_the_path() {
    let dir = std::env::temp_dir().join(format!("moe-bridge-header-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("model.safetensors");
    let bytes = reference_file();
    std::fs::write(&good, &bytes).unwrap();
    assert_eq!(read_header(&good).unwrap(), parse(&bytes).unwrap());

    let short = dir.join("short.safetensors");
    std::fs::write(&short, &bytes[..bytes.len() - 1]).unwrap();
    let err = read_header(&short).unwrap_err();
    assert!(matches!(err, BridgeError::OffsetsOutOfBounds { .. }));
    assert!(err.to_string().contains("short.safetensors"), "{err}");

    std::fs::write(&short, &bytes[..20]).unwrap();
    assert!(matches!(
        read_header(&short),
        Err(BridgeError::Truncated { .. })
    ));
    std::fs::write(&short, &bytes[..3]).unwrap();
    assert!(matches!(
        read_header(&short),
        Err(BridgeError::FileTooShort { len: 3, .. })
    ));

    let missing = dir.join("missing.safetensors");
    let err = read_header(&missing).unwrap_err();
    assert!(matches!(err, BridgeError::Io { .. }));
    assert!(err.to_string().contains("missing.safetensors"));
    std::fs::remove_dir_all(&dir).unwrap();
}
