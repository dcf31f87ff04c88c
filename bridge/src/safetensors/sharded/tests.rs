use super::*;
use crate::hf::HfCheckpoint;
use crate::safetensors::Dtype;
use crate::test_util::TempDir;

fn sizes(items: &[(&str, u64)]) -> BTreeMap<String, u64> {
    items.iter().map(|(n, s)| ((*n).to_owned(), *s)).collect()
}

/// `n` F32 tensors `t0..` of `len` elements each, with distinct values.
fn tensors(n: usize, len: usize) -> Vec<OwnedTensor> {
    (0..n)
        .map(|i| {
            let vals: Vec<f32> = (0..len).map(|j| (i * 100 + j) as f32 * 0.5).collect();
            OwnedTensor::from_f32(format!("t{i}"), vec![len], &vals).unwrap()
        })
        .collect()
}

fn dir_entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn greedy_plan_fills_shards_in_sorted_order() {
    let plan = ShardPlan::greedy(&sizes(&[("c", 4), ("a", 4), ("b", 4), ("d", 8)]), 8);
    assert_eq!(plan.num_shards(), 3);
    assert_eq!(plan.keys(0), ["a", "b"]);
    assert_eq!(plan.keys(1), ["c"]);
    assert_eq!(plan.keys(2), ["d"]);
    assert_eq!(plan.file_name(1), Some("model-00002-of-00003.safetensors"));
    assert_eq!(plan.shard_of("d"), Some(2));
    assert!(plan.needs_index());
}

#[test]
fn oversized_tensor_gets_its_own_shard() {
    let plan = ShardPlan::greedy(&sizes(&[("a", 2), ("b", 100), ("c", 2), ("d", 2)]), 10);
    assert_eq!(plan.num_shards(), 3);
    assert_eq!(plan.keys(0), ["a"]);
    assert_eq!(plan.keys(1), ["b"]);
    assert_eq!(plan.keys(2), ["c", "d"]);
    let single = ShardPlan::greedy(&sizes(&[("a", 2), ("b", 3)]), 100);
    assert_eq!(single.num_shards(), 1);
    assert_eq!(single.file_name(0), Some(SINGLE_FILE));
    assert!(!single.needs_index());
    assert_eq!(ShardPlan::greedy(&BTreeMap::new(), 1).num_shards(), 1);
}

#[test]
fn sharded_round_trip_is_bit_identical() {
    let tmp = TempDir::new("sharded-rt");
    let target = tmp.join("out");
    let owned = tensors(5, 4); // 16 bytes each
    let views: Vec<TensorView<'_>> = owned.iter().map(OwnedTensor::view).collect();
    write_hf_checkpoint(&target, &views, 40, false).unwrap();
    assert_eq!(
        dir_entries(&target),
        [
            "model-00001-of-00003.safetensors",
            "model-00002-of-00003.safetensors",
            "model-00003-of-00003.safetensors",
            INDEX_FILE,
        ]
    );
    // Only the target is left in the parent: no temporary directories.
    assert_eq!(dir_entries(tmp.path()), ["out"]);
    let ckpt = HfCheckpoint::open(&target).unwrap();
    assert!(ckpt.verify().unwrap().is_empty());
    for t in &owned {
        let v = ckpt.tensor(&t.name).unwrap();
        assert_eq!(
            (v.dtype, v.shape, v.bytes),
            (t.dtype, &t.shape[..], &t.bytes[..])
        );
    }
    let index = std::fs::read_to_string(target.join(INDEX_FILE)).unwrap();
    let expected = "{\n  \"metadata\": {\n    \"total_parameters\": 20,\n    \"total_size\": 80\n  },\n  \"weight_map\": {\n    \"t0\": \"model-00001-of-00003.safetensors\",\n    \"t1\": \"model-00001-of-00003.safetensors\",\n    \"t2\": \"model-00002-of-00003.safetensors\",\n    \"t3\": \"model-00002-of-00003.safetensors\",\n    \"t4\": \"model-00003-of-00003.safetensors\"\n  }\n}\n";
    assert_eq!(index, expected);
}

#[test]
fn one_shard_is_a_single_model_safetensors() {
    let tmp = TempDir::new("sharded-single");
    let target = tmp.join("out");
    let owned = tensors(3, 2);
    let views: Vec<TensorView<'_>> = owned.iter().map(OwnedTensor::view).collect();
    write_hf_checkpoint(&target, &views, 1 << 30, false).unwrap();
    assert_eq!(dir_entries(&target), [SINGLE_FILE]);
    let ckpt = HfCheckpoint::open(&target).unwrap();
    assert_eq!(ckpt.len(), 3);
}

#[test]
fn existing_target_needs_overwrite() {
    let tmp = TempDir::new("sharded-overwrite");
    let target = tmp.join("out");
    std::fs::create_dir_all(&target).unwrap();
    std::fs::write(target.join("stale.txt"), "old").unwrap();
    let owned = tensors(2, 2);
    let views: Vec<TensorView<'_>> = owned.iter().map(OwnedTensor::view).collect();
    let err = write_hf_checkpoint(&target, &views, 8, false).unwrap_err();
    assert!(matches!(err, BridgeError::TargetExists { .. }));
    write_hf_checkpoint(&target, &views, 8, true).unwrap();
    let entries = dir_entries(&target);
    assert!(!entries.contains(&"stale.txt".to_owned()), "{entries:?}");
    assert_eq!(dir_entries(tmp.path()), ["out"]);
}

#[test]
fn push_writes_each_shard_when_complete() {
    let tmp = TempDir::new("sharded-push");
    let target = tmp.join("out");
    let owned = tensors(4, 2); // 8 bytes each, two per shard
    let sizes: BTreeMap<String, u64> = owned.iter().map(|t| (t.name.clone(), 8)).collect();
    let plan = ShardPlan::greedy(&sizes, 16);
    let mut writer = HfDirWriter::create(&target, plan, false).unwrap();
    let tmp_dir = writer.tmp.clone();
    writer.push(owned[3].clone()).unwrap();
    writer.push(owned[0].clone()).unwrap();
    assert!(dir_entries(&tmp_dir).is_empty());
    writer.push(owned[2].clone()).unwrap();
    assert_eq!(dir_entries(&tmp_dir), ["model-00002-of-00002.safetensors"]);
    assert!(writer.push(owned[2].clone()).is_err());
    let unplanned = OwnedTensor::from_f32("zz", vec![1], &[1.0]).unwrap();
    assert!(matches!(
        writer.push(unplanned),
        Err(BridgeError::InvalidWrite { .. })
    ));
    writer.push(owned[1].clone()).unwrap();
    writer
        .write_json("config.json", &serde_json::json!({"model_type": "qwen3"}))
        .unwrap();
    writer.finish().unwrap();
    let ckpt = HfCheckpoint::open(&target).unwrap();
    assert_eq!(ckpt.len(), 4);
    assert_eq!(ckpt.config_json().unwrap()["model_type"], "qwen3");
}

#[test]
fn unfinished_writer_leaves_nothing_behind() {
    let tmp = TempDir::new("sharded-abort");
    let target = tmp.join("out");
    let owned = tensors(2, 2);
    let sizes: BTreeMap<String, u64> = owned.iter().map(|t| (t.name.clone(), 8)).collect();
    let mut writer = HfDirWriter::create(&target, ShardPlan::greedy(&sizes, 8), false).unwrap();
    writer.write_shard(0, &[owned[0].view()]).unwrap();
    // Wrong keys for shard 1.
    let err = writer.write_shard(1, &[owned[0].view()]).unwrap_err();
    assert!(err.to_string().contains("`t0`"));
    let err = writer.write_shard(1, &[]).unwrap_err();
    assert!(err.to_string().contains("`t1`"));
    assert!(writer.write_shard(0, &[owned[0].view()]).is_err());
    assert!(writer.write_file("../evil", b"x").is_err());
    drop(writer);
    assert!(dir_entries(tmp.path()).is_empty());

    let mut writer = HfDirWriter::create(&target, ShardPlan::greedy(&sizes, 8), false).unwrap();
    writer.write_shard(1, &[owned[1].view()]).unwrap();
    let err = writer.finish().unwrap_err();
    assert!(matches!(err, BridgeError::ShardNotWritten { .. }), "{err}");
    assert!(err.to_string().contains("model-00001-of-00002.safetensors"));
    assert!(dir_entries(tmp.path()).is_empty());
}

#[test]
fn reused_weight_map_keeps_file_names() {
    let map: BTreeMap<String, String> = [("t0", "a.safetensors"), ("t1", "b.safetensors")]
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let plan = ShardPlan::from_weight_map(&map);
    assert_eq!(plan.num_shards(), 2);
    assert_eq!(plan.file_name(1), Some("b.safetensors"));
    let tmp = TempDir::new("sharded-reuse");
    let owned = tensors(2, 3);
    let mut writer = HfDirWriter::create(&tmp.join("o"), plan, false).unwrap();
    for t in &owned {
        writer.push(t.clone()).unwrap();
    }
    let target = writer.finish().unwrap();
    let ckpt = HfCheckpoint::open(&target).unwrap();
    assert!(ckpt.file_of("t1").unwrap().ends_with("b.safetensors"));
    assert_eq!(ckpt.tensor("t1").unwrap().dtype, Dtype::F32);
}
