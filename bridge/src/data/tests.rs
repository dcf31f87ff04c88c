//! Tests against Megatron's own files and values: `tests/fixtures/megatron_data/` was written by
//! megatron-core 0.19.2's `IndexedDatasetBuilder`, and `goldens.json` holds what numpy's
//! `RandomState`, Megatron's `IndexedDataset`, `GPTDataset` and `BlendedDataset` (built by
//! `BlendedMegatronDatasetBuilder`) return for them (`tests/fixtures/make_megatron_data.py`).

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use serde_json::Value;

use super::blend::{build_blending_indices, normalize};
use super::*;
use crate::test_util::TempDir;

fn fixtures() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/megatron_data"
    ))
}

fn goldens() -> &'static Value {
    static GOLDENS: OnceLock<Value> = OnceLock::new();
    GOLDENS.get_or_init(|| {
        let text = std::fs::read_to_string(fixtures().join("goldens.json")).expect("goldens");
        serde_json::from_str(&text).expect("goldens JSON")
    })
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("u64"))
        .collect()
}

fn i64s(v: &Value) -> Vec<i64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_i64().expect("i64"))
        .collect()
}

fn rows(v: &Value) -> Vec<Vec<i64>> {
    v.as_array().expect("array").iter().map(i64s).collect()
}

fn open(name: &str) -> Arc<IndexedDataset> {
    Arc::new(IndexedDataset::open(fixtures().join(name)).expect("open fixture"))
}

// ---------------------------------------------------------------------------------------------
// numpy RandomState

#[test]
fn mt19937_matches_numpy_random_state() {
    let g = &goldens()["mt19937"];
    for case in g["seeds"].as_array().expect("seeds") {
        let seed = case["seed"].as_u64().expect("seed") as u32;
        let mut rng = RandomState::new(seed);
        let draws: Vec<u64> = (0..630).map(|_| u64::from(rng.next_u32())).collect();
        assert_eq!(
            draws[..8],
            u64s(&case["first"])[..],
            "seed {seed}: first draws"
        );
        assert_eq!(
            draws[620..630],
            u64s(&case["from_620"])[..],
            "seed {seed}: draws across the state regeneration"
        );
    }
}

#[test]
fn shuffle_matches_numpy_legacy_shuffle() {
    let g = &goldens()["mt19937"];
    let mut rng = RandomState::new(g["shuffle_seed"].as_u64().expect("seed") as u32);
    for case in g["shuffles"].as_array().expect("shuffles") {
        let n = case["n"].as_u64().expect("n") as u32;
        let mut values: Vec<u32> = (0..n).collect();
        rng.shuffle(&mut values);
        let values: Vec<u64> = values.into_iter().map(u64::from).collect();
        if let Some(expected) = case.get("values") {
            assert_eq!(values, u64s(expected), "shuffle of {n}");
        } else {
            assert_eq!(
                values[..32],
                u64s(&case["head"])[..],
                "head of shuffle of {n}"
            );
            assert_eq!(
                values[values.len() - 32..],
                u64s(&case["tail"])[..],
                "tail of shuffle of {n}"
            );
            let weighted: u128 = values
                .iter()
                .enumerate()
                .map(|(i, &v)| i as u128 * u128::from(v))
                .sum();
            let expected = case["weighted_sum"].as_u64().expect("sum") as u128;
            assert_eq!(weighted, expected, "sum(i * v) of shuffle of {n}");
        }
    }
}

#[test]
fn random_interval_above_32_bits_matches_numpy_randint() {
    let g = &goldens()["mt19937"]["wide"];
    let mut rng = RandomState::new(g["seed"].as_u64().expect("seed") as u32);
    let max = g["max"].as_u64().expect("max");
    let values: Vec<u64> = (0..12).map(|_| rng.random_interval(max)).collect();
    assert_eq!(values, u64s(&g["values"]));
}

// ---------------------------------------------------------------------------------------------
// Indexed datasets

#[test]
fn every_dtype_reads_back_what_megatron_wrote() {
    let dtypes = goldens()["dtypes"].as_object().expect("dtypes");
    assert_eq!(dtypes.len(), 8, "one fixture per Megatron dtype code");
    for (name, golden) in dtypes {
        let ds = open(&format!("dtype_{name}"));
        assert_eq!(ds.dtype().name(), name);
        assert_eq!(
            u64::from(ds.dtype().code()),
            golden["code"].as_u64().expect("code")
        );
        let expected = rows(&golden["sequences"]);
        assert_eq!(ds.num_sequences(), expected.len(), "{name}");
        for (i, sequence) in expected.iter().enumerate() {
            assert_eq!(
                &ds.sequence(i).expect("sequence"),
                sequence,
                "{name} sequence {i}"
            );
            assert_eq!(ds.sequence_length(i).expect("length"), sequence.len());
        }
        assert_eq!(ds.document_indices(), u64s(&golden["document_indices"]));
        assert_eq!(ds.num_documents(), 2);
        assert!(ds.sequence_modes().is_none());
    }
}

#[test]
fn corpora_read_back_as_megatron_reads_them() {
    for name in ["corpus_a", "corpus_b"] {
        let golden = &goldens()[name];
        let ds = open(name);
        assert_eq!(
            ds.dtype(),
            TokenDtype::U16,
            "Megatron's dtype for a small vocabulary"
        );
        let lengths: Vec<u64> = ds.sequence_lengths().into_iter().map(u64::from).collect();
        assert_eq!(lengths, u64s(&golden["sequence_lengths"]), "{name}");
        let documents = u64s(&golden["document_indices"]);
        assert_eq!(ds.document_indices(), documents, "{name}");
        assert_eq!(ds.num_documents(), documents.len() - 1);
        for d in 0..ds.num_documents() {
            let range = ds.document(d).expect("document");
            assert_eq!(
                (range.start as u64, range.end as u64),
                (documents[d], documents[d + 1])
            );
        }
        for (i, sequence) in rows(&golden["sequences"]).iter().enumerate() {
            assert_eq!(
                &ds.sequence(i).expect("sequence"),
                sequence,
                "{name} sequence {i}"
            );
        }
        for get in golden["get"].as_array().expect("get") {
            let i = get["idx"].as_u64().expect("idx") as usize;
            let offset = get["offset"].as_u64().expect("offset") as usize;
            let length = get["length"].as_u64().map(|n| n as usize);
            assert_eq!(
                ds.get(i, offset, length).expect("get"),
                i64s(&get["values"]),
                "{name}.get({i}, {offset}, {length:?})"
            );
        }
    }
}

#[test]
fn multimodal_index_carries_sequence_modes() {
    let golden = &goldens()["modes"];
    let ds = open("modes");
    assert_eq!(ds.dtype(), TokenDtype::I32);
    let modes: Vec<i64> = ds
        .sequence_modes()
        .expect("modes section")
        .into_iter()
        .map(i64::from)
        .collect();
    assert_eq!(modes, i64s(&golden["modes"]));
    for (i, sequence) in rows(&golden["sequences"]).iter().enumerate() {
        assert_eq!(&ds.sequence(i).expect("sequence"), sequence);
    }
    assert_eq!(ds.document_indices(), u64s(&golden["document_indices"]));
}

#[test]
fn out_of_range_requests_are_errors() {
    let ds = open("corpus_a");
    let n = ds.num_sequences();
    let len0 = ds.sequence_length(0).expect("length");
    for result in [
        ds.sequence(n),
        ds.get(0, 0, Some(len0 + 1)),
        ds.get(0, len0 + 1, None),
        ds.get(0, usize::MAX, Some(2)),
    ] {
        let err = result.expect_err("out of range");
        assert!(
            matches!(err, BridgeError::DataIndexOutOfRange { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("corpus_a.bin"), "{err}");
    }
    assert!(ds.get(0, len0, None).expect("empty tail").is_empty());
    assert!(ds.document(ds.num_documents()).is_err());
    assert!(ds.sequence_length(n).is_err());
}

#[test]
fn check_vocab_names_the_first_token_outside() {
    let ds = open("corpus_a");
    let sequences = rows(&goldens()["corpus_a"]["sequences"]);
    let max = sequences.iter().flatten().copied().max().expect("tokens");
    ds.check_vocab(max as u64 + 1)
        .expect("every token below max + 1");
    let vocab = 200u64;
    let (sequence, position, token) = sequences
        .iter()
        .enumerate()
        .find_map(|(i, s)| {
            s.iter()
                .position(|&t| t >= vocab as i64)
                .map(|p| (i, p, s[p]))
        })
        .expect("a token >= 200 in the fixture");
    match ds.check_vocab(vocab) {
        Err(BridgeError::TokenOutOfVocab {
            path,
            sequence: s,
            position: p,
            token: t,
            vocab: v,
        }) => {
            assert!(path.ends_with("corpus_a.bin"));
            assert_eq!((s, p, t, v), (sequence, position, token, vocab));
        }
        other => panic!("expected TokenOutOfVocab, got {other:?}"),
    }
    // int8 holds negative values: never token ids.
    let err = open("dtype_int8").check_vocab(1000).expect_err("negative");
    assert!(
        matches!(
            err,
            BridgeError::TokenOutOfVocab {
                token: -128,
                sequence: 0,
                position: 0,
                ..
            }
        ),
        "{err}"
    );
    open("dtype_uint8")
        .check_vocab(256)
        .expect("uint8 within 256");
    let err = open("dtype_uint8").check_vocab(255).expect_err("255");
    assert!(
        matches!(
            err,
            BridgeError::TokenOutOfVocab {
                token: 255,
                sequence: 0,
                position: 2,
                ..
            }
        ),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------
// Corrupt and mismatched files

/// Byte offsets in corpus_a.idx (20 sequences, 21 document-index entries).
const LENGTHS_AT: usize = 34;
const POINTERS_AT: usize = LENGTHS_AT + 4 * 20;
const DOCUMENTS_AT: usize = POINTERS_AT + 8 * 20;

fn put_i32(bytes: &mut [u8], at: usize, value: i32) {
    bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
}

fn put_i64(bytes: &mut [u8], at: usize, value: i64) {
    bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
}

fn get_i64(bytes: &[u8], at: usize) -> i64 {
    i64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

/// A copy of fixture `name` in a temporary directory, `.idx` and `.bin` edited (`None`: the
/// file is not written).
fn corrupted(
    dir: &TempDir,
    name: &str,
    edit: impl FnOnce(&mut Vec<u8>, &mut Vec<u8>) -> (bool, bool),
) -> PathBuf {
    let mut idx = std::fs::read(fixtures().join(format!("{name}.idx"))).expect("idx");
    let mut bin = std::fs::read(fixtures().join(format!("{name}.bin"))).expect("bin");
    let (write_idx, write_bin) = edit(&mut idx, &mut bin);
    let prefix = dir.path().join(name);
    if write_idx {
        std::fs::write(indexed::idx_path(&prefix), &idx).expect("write idx");
    }
    if write_bin {
        std::fs::write(indexed::bin_path(&prefix), &bin).expect("write bin");
    }
    prefix
}

fn refused(prefix: &Path) -> BridgeError {
    IndexedDataset::open(prefix).expect_err("corrupt dataset must be refused")
}

#[test]
fn corrupt_index_files_are_refused_naming_the_file() {
    type Edit = fn(&mut Vec<u8>, &mut Vec<u8>);
    let cases: Vec<(&str, Edit, &str)> = vec![
        ("bad magic", |idx, _| idx[0] = b'X', "bad magic"),
        (
            "version 2",
            |idx, _| put_i64(idx, 9, 2),
            "unknown version 2",
        ),
        ("dtype code 9", |idx, _| idx[17] = 9, "unknown dtype code 9"),
        ("dtype code 0", |idx, _| idx[17] = 0, "unknown dtype code 0"),
        ("header cut", |idx, _| idx.truncate(20), "truncated"),
        ("arrays cut", |idx, _| idx.truncate(300), "truncated"),
        ("empty", |idx, _| idx.clear(), "truncated"),
        (
            "sequence count too large",
            |idx, _| put_i64(idx, 18, 21),
            "truncated",
        ),
        (
            "sequence count absurd",
            |idx, _| put_i64(idx, 18, i64::MAX),
            "truncated",
        ),
        (
            "document count too small",
            |idx, _| put_i64(idx, 26, 20),
            "do not fit",
        ),
        (
            "trailing bytes",
            |idx, _| idx.extend([0u8; 5]),
            "do not fit",
        ),
        (
            "pointer moved",
            |idx, _| {
                let p = get_i64(idx, POINTERS_AT + 8 * 3);
                put_i64(idx, POINTERS_AT + 8 * 3, p + 2);
            },
            "sequence 3: pointer",
        ),
        (
            "first pointer not 0",
            |idx, _| put_i64(idx, POINTERS_AT, 2),
            "sequence 0: pointer",
        ),
        (
            "negative length",
            |idx, _| put_i32(idx, LENGTHS_AT + 4 * 2, -1),
            "sequence 2 has negative length",
        ),
        (
            "length disagrees with the next pointer",
            |idx, _| {
                let at = LENGTHS_AT + 4 * 5;
                let n = i32::from_le_bytes(idx[at..at + 4].try_into().expect("4"));
                put_i32(idx, at, n + 1);
            },
            "sequence 6: pointer",
        ),
        (
            "first document index not 0",
            |idx, _| put_i64(idx, DOCUMENTS_AT, 1),
            "document index 0 is 1",
        ),
        (
            "document indices decrease",
            |idx, _| put_i64(idx, DOCUMENTS_AT + 8 * 5, 2),
            "decrease",
        ),
        (
            "last document index short",
            |idx, _| put_i64(idx, DOCUMENTS_AT + 8 * 20, 19),
            "not the sequence count",
        ),
        (
            "document index past the sequences",
            |idx, _| put_i64(idx, DOCUMENTS_AT + 8 * 20, 25),
            "past the 20 sequences",
        ),
    ];
    for (what, edit, phrase) in cases {
        let dir = TempDir::new("megatron-bad-idx");
        let prefix = corrupted(&dir, "corpus_a", |idx, bin| {
            edit(idx, bin);
            (true, true)
        });
        let err = refused(&prefix);
        assert!(
            matches!(err, BridgeError::InvalidDataIndex { .. }),
            "{what}: {err}"
        );
        let message = err.to_string();
        assert!(message.contains("corpus_a.idx"), "{what}: {message}");
        assert!(
            message.contains(phrase),
            "{what}: `{phrase}` not in {message}"
        );
    }
}

#[test]
fn token_files_disagreeing_with_the_index_are_refused() {
    type Edit = fn(&mut Vec<u8>, &mut Vec<u8>);
    let cases: Vec<(&str, &str, Edit, &str)> = vec![
        (
            "bin one byte short",
            "corpus_a",
            |_, bin| {
                bin.pop();
            },
            "902 bytes",
        ),
        (
            "bin one token long",
            "corpus_a",
            |_, bin| bin.extend([1, 0]),
            "904 bytes",
        ),
        ("bin empty", "corpus_a", |_, bin| bin.clear(), "0 bytes"),
        (
            "float32 holding 2.5",
            "dtype_float32",
            |_, bin| bin[4..8].copy_from_slice(&2.5f32.to_le_bytes()),
            "sequence 0, position 1: float32 value 2.5 is not an integer",
        ),
        (
            "float64 holding NaN",
            "dtype_float64",
            |_, bin| bin[24..32].copy_from_slice(&f64::NAN.to_le_bytes()),
            "sequence 1, position 0: float64 value NaN",
        ),
        (
            "float64 past i64",
            "dtype_float64",
            |_, bin| bin[0..8].copy_from_slice(&1e19f64.to_le_bytes()),
            "not an integer token id",
        ),
    ];
    for (what, name, edit, phrase) in cases {
        let dir = TempDir::new("megatron-bad-bin");
        let prefix = corrupted(&dir, name, |idx, bin| {
            edit(idx, bin);
            (true, true)
        });
        let err = refused(&prefix);
        assert!(
            matches!(err, BridgeError::InvalidTokenData { .. }),
            "{what}: {err}"
        );
        let message = err.to_string();
        assert!(
            message.contains(&format!("{name}.bin")),
            "{what}: {message}"
        );
        assert!(
            message.contains(phrase),
            "{what}: `{phrase}` not in {message}"
        );
    }
}

#[test]
fn missing_files_are_refused_naming_them() {
    for (missing_idx, missing) in [(true, "corpus_a.idx"), (false, "corpus_a.bin")] {
        let dir = TempDir::new("megatron-missing");
        let prefix = corrupted(&dir, "corpus_a", |_, _| (!missing_idx, missing_idx));
        let err = refused(&prefix);
        assert!(matches!(err, BridgeError::MissingDataFile { .. }), "{err}");
        assert!(err.to_string().contains(missing), "{err}");
    }
    let err = refused(&fixtures().join("no_such_corpus"));
    assert!(err.to_string().contains("no_such_corpus.idx"), "{err}");
}

#[test]
fn a_corrupt_component_stops_the_blend_before_any_sample() {
    let dir = TempDir::new("megatron-bad-blend");
    let bad = corrupted(&dir, "corpus_b", |idx, _| {
        idx[17] = 42;
        (true, true)
    });
    let blend = DataBlend {
        prefixes: vec![fixtures().join("corpus_a"), bad],
        weights: Some(vec![0.5, 0.5]),
    };
    let err = TrainDataset::build(&blend, 8, 1, 10).expect_err("corrupt component");
    assert!(err.to_string().contains("corpus_b.idx"), "{err}");
    assert!(err.to_string().contains("unknown dtype code 42"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// GPTDataset

#[test]
fn gpt_dataset_matches_megatron() {
    for case in goldens()["gpt"].as_array().expect("gpt") {
        let prefix = case["prefix"].as_str().expect("prefix");
        let seq_len = case["seq_len"].as_u64().expect("seq_len") as usize;
        let seed = case["seed"].as_u64().expect("seed") as u32;
        let num_samples = case["num_samples"].as_u64().expect("num_samples");
        let what = format!("{prefix} seq_len {seq_len} seed {seed} num_samples {num_samples}");
        let ds = GptDataset::new(open(prefix), seq_len, seed, num_samples).expect(&what);
        assert_eq!(
            ds.num_epochs(),
            case["num_epochs"].as_u64().expect("epochs"),
            "{what}"
        );
        assert_eq!(
            ds.separate_final_epoch(),
            case["separate_final_epoch"].as_bool().expect("flag"),
            "{what}"
        );
        assert_eq!(
            ds.len() as u64,
            case["len"].as_u64().expect("len"),
            "{what}"
        );
        let documents: Vec<u64> = ds.document_index().iter().map(|&d| u64::from(d)).collect();
        assert_eq!(
            documents,
            u64s(&case["document_index"]),
            "{what}: document index"
        );
        let samples: Vec<Vec<i64>> = ds
            .sample_index()
            .iter()
            .map(|[d, o]| vec![i64::from(*d), i64::from(*o)])
            .collect();
        assert_eq!(samples, rows(&case["sample_index"]), "{what}: sample index");
        let shuffle: Vec<u64> = ds.shuffle_index().iter().map(|&s| u64::from(s)).collect();
        assert_eq!(
            shuffle,
            u64s(&case["shuffle_index"]),
            "{what}: shuffle index"
        );
        for (i, expected) in rows(&case["samples"]).iter().enumerate() {
            assert_eq!(
                &ds.sample(i).expect("sample"),
                expected,
                "{what}: sample {i}"
            );
        }
        assert!(ds.len() as u64 >= num_samples);
    }
    // The goldens exercise both multi-epoch shuffles.
    let flags: Vec<(u64, bool)> = goldens()["gpt"]
        .as_array()
        .expect("gpt")
        .iter()
        .map(|c| {
            (
                c["num_epochs"].as_u64().expect("epochs"),
                c["separate_final_epoch"].as_bool().expect("flag"),
            )
        })
        .collect();
    assert!(
        flags.contains(&(3, true)) && flags.contains(&(3, false)),
        "{flags:?}"
    );
}

#[test]
fn gpt_samples_are_windows_of_the_shuffled_document_stream() {
    // Independent of Megatron's indices: concatenating the sequences in document-index order,
    // window k is tokens k·seq_len ..= k·seq_len + seq_len of that stream.
    let ds = GptDataset::new(open("corpus_b"), 6, 17, 300).expect("dataset");
    let file = ds.dataset();
    let stream: Vec<i64> = ds
        .document_index()
        .iter()
        .flat_map(|&d| file.sequence(d as usize).expect("sequence"))
        .collect();
    for i in 0..ds.len() {
        let k = ds.shuffle_index()[i] as usize;
        assert_eq!(
            ds.sample(i).expect("sample"),
            stream[k * 6..k * 6 + 7],
            "sample {i}"
        );
    }
    assert!(ds.len() * 6 < stream.len());
    assert!(
        (ds.len() + 1) * 6 + 1 > stream.len(),
        "every full window is built"
    );
}

#[test]
fn gpt_dataset_refuses_what_megatron_cannot_sample() {
    for seq_len in [0, 1] {
        let err = GptDataset::new(open("corpus_a"), seq_len, 1, 4).expect_err("seq_len");
        assert!(matches!(err, BridgeError::DataSampling { .. }), "{err}");
        assert!(err.to_string().contains("corpus_a"), "{err}");
    }
    // One token: no sample of 2 tokens can be drawn (Megatron asserts tokens_per_epoch > 1).
    let err = GptDataset::new(open("dtype_uint8"), 2, 1, 1);
    assert!(err.is_ok(), "4 tokens make a 3-token sample");
    let dir = TempDir::new("megatron-one-token");
    let prefix = corrupted(&dir, "dtype_uint8", |idx, bin| {
        // One sequence of one token: S = 1, D = 2 entries.
        idx.truncate(34);
        put_i64(idx, 18, 1);
        put_i64(idx, 26, 2);
        idx.extend(1i32.to_le_bytes());
        idx.extend(0i64.to_le_bytes());
        idx.extend(0i64.to_le_bytes());
        idx.extend(1i64.to_le_bytes());
        bin.truncate(1);
        (true, true)
    });
    let one = Arc::new(IndexedDataset::open(&prefix).expect("valid one-token dataset"));
    assert_eq!(one.sequence(0).expect("sequence"), vec![0]);
    let err = GptDataset::new(one, 2, 1, 1).expect_err("one token");
    assert!(err.to_string().contains("1 tokens"), "{err}");

    let ds = GptDataset::new(open("corpus_a"), 8, 1, 4).expect("dataset");
    let err = ds.sample(ds.len()).expect_err("past the end");
    assert!(
        matches!(err, BridgeError::DataIndexOutOfRange { .. }),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------
// Blends

fn fixture_args(data_path: &Value) -> Vec<String> {
    data_path
        .as_array()
        .expect("data_path")
        .iter()
        .enumerate()
        .map(|(k, item)| {
            let item = item.as_str().expect("item");
            if k % 2 == 1 {
                fixtures().join(item).display().to_string()
            } else {
                item.to_string()
            }
        })
        .collect()
}

#[test]
fn blended_dataset_matches_megatron() {
    for case in goldens()["blend"].as_array().expect("blend") {
        let args = fixture_args(&case["data_path"]);
        let what = format!("{:?}", case["data_path"]);
        let seq_len = case["seq_len"].as_u64().expect("seq_len") as usize;
        let seed = case["seed"].as_u64().expect("seed") as u32;
        let size = case["size"].as_u64().expect("size");
        let blend = parse_data_path(&args).expect("data path");
        let train = TrainDataset::build(&blend, seq_len, seed, size).expect(&what);
        let TrainDataset::Blended(ds) = &train else {
            panic!("{what}: a weighted --data-path builds a BlendedDataset");
        };
        let weight_bits: Vec<u64> = ds.weights().iter().map(|w| w.to_bits()).collect();
        assert_eq!(
            weight_bits,
            u64s(&case["weights_bits"]),
            "{what}: normalised weights"
        );
        let asked: Vec<u64> = ds.datasets().iter().map(GptDataset::num_samples).collect();
        assert_eq!(
            asked,
            u64s(&case["component_num_samples"]),
            "{what}: component sizes"
        );
        let lens: Vec<u64> = ds.datasets().iter().map(|d| d.len() as u64).collect();
        assert_eq!(
            lens,
            u64s(&case["component_len"]),
            "{what}: component lengths"
        );
        assert_eq!(
            ds.len() as u64,
            case["len"].as_u64().expect("len"),
            "{what}"
        );
        assert_eq!(train.len(), ds.len());
        let index: Vec<u64> = ds.dataset_index().iter().map(|&d| u64::from(d)).collect();
        assert_eq!(index, u64s(&case["dataset_index"]), "{what}: dataset index");
        assert_eq!(
            ds.dataset_sample_index(),
            u64s(&case["dataset_sample_index"]),
            "{what}: dataset sample index"
        );
        for (i, expected) in rows(&case["samples"]).iter().enumerate() {
            assert_eq!(
                &train.sample(i).expect("sample"),
                expected,
                "{what}: sample {i}"
            );
            let (d, s) = train.source(i).expect("source");
            assert_eq!(d as u64, index[i]);
            assert_eq!(
                &ds.datasets()[d].sample(s).expect("component sample"),
                expected
            );
        }
        assert!(train.source(train.len()).is_err());
        assert!(train.sample(train.len()).is_err());
    }
}

#[test]
fn long_blend_follows_the_weights() {
    let weights = [0.3, 0.7];
    let n = 20_000usize;
    let blend = DataBlend {
        prefixes: vec![fixtures().join("corpus_a"), fixtures().join("corpus_b")],
        weights: Some(weights.to_vec()),
    };
    let train = TrainDataset::build(&blend, 4, 1234, n as u64).expect("blend");
    assert!(train.len() >= n);
    for prefix_len in [100, 1_000, n] {
        let mut counts = [0usize; 2];
        for i in 0..prefix_len {
            counts[train.source(i).expect("source").0] += 1;
        }
        for (count, w) in counts.iter().zip(weights) {
            let share = *count as f64 / prefix_len as f64;
            let sigma = (w * (1.0 - w) / prefix_len as f64).sqrt();
            assert!(
                (share - w).abs() <= 3.0 * sigma,
                "first {prefix_len}: share {share} for weight {w}"
            );
        }
    }
    // Each component's samples are drawn in order 0, 1, 2, ... .
    let mut next = [0usize; 2];
    for i in 0..n {
        let (d, s) = train.source(i).expect("source");
        assert_eq!(s, next[d]);
        next[d] += 1;
    }
}

#[test]
fn blending_indices_of_exact_weights() {
    // With weights 1/4, 3/4 the greedy rule is exact at every multiple of 4: closed form.
    let (index, sample) = build_blending_indices(&[0.25, 0.75], 4000);
    let mut counts = [0u64; 2];
    for (k, (&d, &s)) in index.iter().zip(&sample).enumerate() {
        assert_eq!(s, counts[usize::from(d)]);
        counts[usize::from(d)] += 1;
        if (k + 1) % 4 == 0 {
            assert_eq!(
                counts,
                [(k as u64 + 1) / 4, 3 * (k as u64 + 1) / 4],
                "after {}",
                k + 1
            );
        }
    }
    // normalize: exact for weights that are powers of two apart.
    assert_eq!(normalize(&[1.0, 3.0]), vec![0.25, 0.75]);
    assert_eq!(normalize(&[2.0; 8]), vec![0.125; 8]);
}

#[test]
fn normalize_matches_megatron_bit_for_bit() {
    for case in goldens()["normalize"].as_array().expect("normalize") {
        let weights: Vec<f64> = u64s(&case["weights_bits"])
            .into_iter()
            .map(f64::from_bits)
            .collect();
        let bits: Vec<u64> = normalize(&weights).iter().map(|w| w.to_bits()).collect();
        assert_eq!(
            bits,
            u64s(&case["normalized_bits"]),
            "{} weights",
            weights.len()
        );
    }
}

#[test]
fn oversampled_component_is_refused() {
    let small = GptDataset::new(open("corpus_a"), 16, 1, 1).expect("dataset");
    let large = GptDataset::new(open("corpus_b"), 16, 1, 1).expect("dataset");
    let size = small.len() + large.len() + 10;
    let err = BlendedDataset::new(vec![small, large], &[1.0, 1.0], size).expect_err("oversampled");
    assert!(matches!(err, BridgeError::DataSampling { .. }), "{err}");
    assert!(err.to_string().contains("more than the"), "{err}");
}

#[test]
fn blend_refuses_bad_weights() {
    for weights in [
        vec![1.0, 0.0],
        vec![1.0, -1.0],
        vec![f64::NAN, 1.0],
        vec![1.0],
    ] {
        let components: Vec<(f64, Arc<IndexedDataset>)> =
            weights.iter().map(|&w| (w, open("corpus_a"))).collect();
        let err = if weights.len() == 1 {
            let ds = GptDataset::new(open("corpus_a"), 8, 1, 4).expect("dataset");
            BlendedDataset::new(vec![ds], &[1.0, 2.0], 4).expect_err("count mismatch")
        } else {
            BlendedDataset::build(&components, 8, 1, 10).expect_err("bad weight")
        };
        assert!(
            matches!(err, BridgeError::DataSampling { .. }),
            "{weights:?}: {err}"
        );
    }
    let err = BlendedDataset::build(&[], 8, 1, 10).expect_err("no component");
    assert!(err.to_string().contains("1 to"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// --data-path

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

#[test]
fn data_path_forms_parse_as_megatron_parses_them() {
    for case in goldens()["data_path"].as_array().expect("data_path") {
        let args: Vec<String> = case["args"]
            .as_array()
            .expect("args")
            .iter()
            .map(|a| a.as_str().expect("arg").to_string())
            .collect();
        let blend = parse_data_path(&args).expect("valid data path");
        let prefixes: Vec<String> = case["prefixes"]
            .as_array()
            .expect("prefixes")
            .iter()
            .map(|p| p.as_str().expect("prefix").to_string())
            .collect();
        let got: Vec<String> = blend
            .prefixes
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        assert_eq!(got, prefixes, "{args:?}");
        let weights = case["weights"].as_array().map(|w| {
            w.iter()
                .map(|x| x.as_f64().expect("weight"))
                .collect::<Vec<_>>()
        });
        assert_eq!(blend.weights, weights, "{args:?}");
    }
}

#[test]
fn malformed_data_paths_are_refused_naming_the_item() {
    let cases: Vec<(Vec<String>, usize, &str, &str)> = vec![
        (vec![], 0, "", "no dataset"),
        (strings(&["0.3", "a", "b"]), 3, "b", "must be even"),
        (strings(&["x", "a", "0.7", "b"]), 1, "x", "not a number"),
        (
            strings(&["0.3", "a", "heavy", "b"]),
            3,
            "heavy",
            "not a number",
        ),
        (strings(&["0.3", "a", "-0.7", "b"]), 3, "-0.7", "negative"),
        (strings(&["0", "a", "0", "b"]), 1, "0", "zero weight"),
        (strings(&["0.5", "a", "0.0", "b"]), 3, "0.0", "zero weight"),
        (strings(&["nan", "a", "1", "b"]), 1, "nan", "not finite"),
        (strings(&["1", "a", "inf", "b"]), 3, "inf", "not finite"),
        (
            strings(&["1e308", "a", "1e308", "b"]),
            1,
            "1e308",
            "sum to inf",
        ),
        (
            strings(&["1", " ", "1", "b"]),
            2,
            " ",
            "empty dataset prefix",
        ),
        (strings(&[""]), 1, "", "empty dataset prefix"),
    ];
    for (args, position, item, phrase) in cases {
        match parse_data_path(&args) {
            Err(BridgeError::InvalidDataPath {
                position: p,
                item: i,
                reason,
            }) => {
                assert_eq!((p, i.as_str()), (position, item), "{args:?}");
                assert!(
                    reason.contains(phrase),
                    "{args:?}: `{phrase}` not in {reason}"
                );
            }
            other => panic!("{args:?}: expected InvalidDataPath, got {other:?}"),
        }
    }
}

#[test]
fn a_lone_prefix_is_one_gpt_dataset_of_exactly_the_samples_asked() {
    let blend =
        parse_data_path(&[fixtures().join("corpus_a").display().to_string()]).expect("data path");
    let train = TrainDataset::build(&blend, 16, 1234, 60).expect("train");
    let TrainDataset::Gpt(ds) = &train else {
        panic!("a lone prefix builds a GPTDataset");
    };
    assert_eq!(ds.num_samples(), 60);
    let golden = &goldens()["gpt"][1];
    assert_eq!(golden["num_samples"].as_u64(), Some(60));
    for (i, expected) in rows(&golden["samples"]).iter().enumerate() {
        assert_eq!(&train.sample(i).expect("sample"), expected);
        assert_eq!(train.source(i).expect("source"), (0, i));
    }
    train.check_vocab(256).expect("tokens below 256");
    assert!(train.check_vocab(100).is_err());
}

// ---------------------------------------------------------------------------------------------
// Sharing between ranks

#[test]
fn datasets_are_shared_across_threads_and_repeatable() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<IndexedDataset>();
    send_sync::<GptDataset>();
    send_sync::<BlendedDataset>();
    send_sync::<TrainDataset>();

    let blend = DataBlend {
        prefixes: vec![fixtures().join("corpus_a"), fixtures().join("corpus_b")],
        weights: Some(vec![1.0, 2.0]),
    };
    let train = TrainDataset::build(&blend, 12, 5, 400).expect("train");
    let serial: Vec<Vec<i64>> = (0..train.len())
        .map(|i| train.sample(i).expect("sample"))
        .collect();
    let rebuilt = TrainDataset::build(&blend, 12, 5, 400).expect("train");
    let threads = 4;
    std::thread::scope(|scope| {
        for t in 0..threads {
            let (train, rebuilt, serial) = (&train, &rebuilt, &serial);
            scope.spawn(move || {
                // Rank t reads rows t, t + 4, ... of every step, in reverse to differ in order.
                for i in (0..train.len()).rev().filter(|i| i % threads == t) {
                    assert_eq!(train.sample(i).expect("sample"), serial[i]);
                    assert_eq!(rebuilt.sample(i).expect("sample"), serial[i]);
                }
            });
        }
    });
}
