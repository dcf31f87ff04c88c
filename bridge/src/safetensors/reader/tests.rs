use super::*;
use crate::safetensors::Dtype;
use crate::test_util::{TempDir, raw_file, reference_file};

#[test]
fn reads_a_file_written_by_the_safetensors_crate() {
    let dir = TempDir::new("reader-ref");
    let path = dir.join("model.safetensors");
    std::fs::write(&path, reference_file()).unwrap();
    let file = SafetensorsFile::open(&path).unwrap();
    assert_eq!(file.names().collect::<Vec<_>>(), ["a", "b", "c"]);
    assert_eq!(file.len(), 3);
    assert!(file.contains("b") && !file.contains("z"));
    let a = file.tensor("a").unwrap();
    assert_eq!((a.dtype, a.shape), (Dtype::F32, &[2usize, 3][..]));
    assert_eq!(a.to_f32_vec().unwrap(), vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    assert_eq!(a.path, path.as_path());
    assert_eq!(
        file.tensor("b").unwrap().to_f32_vec().unwrap(),
        vec![1.0, -2.0]
    );
    assert_eq!(
        file.tensor("c").unwrap().to_f32_vec().unwrap(),
        vec![1.0, 2.0, 448.0, -1.0]
    );
    assert_eq!(file.info("c").unwrap().dtype, Dtype::F8E4M3);
    let reference = safetensors::SafeTensors::deserialize(&std::fs::read(&path).unwrap())
        .unwrap()
        .tensor("a")
        .unwrap()
        .data()
        .to_vec();
    assert_eq!(a.bytes, reference.as_slice());
    assert_eq!(file.tensors().unwrap().len(), 3);
}

#[test]
fn missing_tensor_is_a_typed_error() {
    let dir = TempDir::new("reader-missing");
    let path = dir.join("m.safetensors");
    std::fs::write(&path, reference_file()).unwrap();
    let file = SafetensorsFile::open(&path).unwrap();
    let err = file.tensor("nope").unwrap_err();
    assert!(matches!(err, BridgeError::TensorNotFound { .. }));
    let msg = err.to_string();
    assert!(
        msg.contains("m.safetensors") && msg.contains("`nope`"),
        "{msg}"
    );
    assert!(file.info("nope").is_err());
}

#[test]
fn truncated_file_is_rejected() {
    let dir = TempDir::new("reader-trunc");
    let bytes = reference_file();
    // Cut inside the data section and inside the header.
    for cut in [bytes.len() - 3, 20, 5] {
        let path = dir.join(&format!("cut{cut}.safetensors"));
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let err = SafetensorsFile::open(&path).unwrap_err();
        assert!(
            matches!(
                err,
                BridgeError::OffsetsOutOfBounds { .. }
                    | BridgeError::Truncated { .. }
                    | BridgeError::FileTooShort { .. }
            ),
            "{cut}: {err}"
        );
        assert!(err.to_string().contains(&format!("cut{cut}")), "{err}");
    }
}

#[test]
fn overlapping_or_out_of_bounds_offsets_are_rejected() {
    let dir = TempDir::new("reader-offsets");
    let overlap = raw_file(
        r#"{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"y":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
        &[0u8; 12],
    );
    let path = dir.join("overlap.safetensors");
    std::fs::write(&path, overlap).unwrap();
    let err = SafetensorsFile::open(&path).unwrap_err();
    assert!(
        matches!(err, BridgeError::OverlappingTensors { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("overlap.safetensors"));

    let beyond = raw_file(
        r#"{"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#,
        &[0u8; 8],
    );
    let path = dir.join("beyond.safetensors");
    std::fs::write(&path, beyond).unwrap();
    let err = SafetensorsFile::open(&path).unwrap_err();
    assert!(
        matches!(err, BridgeError::OffsetsOutOfBounds { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("`x`"));
}

#[test]
fn unreadable_inputs_are_errors() {
    let dir = TempDir::new("reader-bad");
    let err = SafetensorsFile::open(dir.join("absent.safetensors")).unwrap_err();
    assert!(matches!(err, BridgeError::Io { .. }));
    let empty = dir.join("empty.safetensors");
    std::fs::write(&empty, b"").unwrap();
    assert!(matches!(
        SafetensorsFile::open(&empty),
        Err(BridgeError::FileTooShort { len: 0, .. })
    ));
    let junk = dir.join("junk.safetensors");
    std::fs::write(&junk, raw_file("not json", &[])).unwrap();
    assert!(matches!(
        SafetensorsFile::open(&junk),
        Err(BridgeError::InvalidHeaderJson { .. })
    ));
}

#[test]
fn read_box_reads_exactly_the_box() {
    let dir = TempDir::new("reader-box");
    let path = dir.join("model.safetensors");
    std::fs::write(&path, reference_file()).unwrap();
    let file = SafetensorsFile::open(&path).unwrap();
    // `a` is F32 [2, 3] = 0..6: column 1..3 of both rows, then the second row whole.
    let b = file.read_box("a", &[0, 1], &[2, 2]).unwrap();
    assert_eq!(
        (b.dtype, b.shape.as_slice()),
        (Dtype::F32, &[2usize, 2][..])
    );
    assert_eq!(b.to_f32_vec().unwrap(), vec![1.0, 2.0, 4.0, 5.0]);
    let row = file.read_box("a", &[1, 0], &[1, 3]).unwrap();
    assert_eq!(row.to_f32_vec().unwrap(), vec![3.0, 4.0, 5.0]);
    let err = file
        .read_box("a", &[1, 1], &[2, 2])
        .unwrap_err()
        .to_string();
    assert!(err.contains('a'), "{err}");
    assert!(file.read_box("z", &[0], &[1]).is_err());
}
