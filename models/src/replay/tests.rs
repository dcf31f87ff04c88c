use burn::tensor::{Device, Int, Tensor};

use super::*;
use crate::{DeepseekV3Config, Qwen3MoeConfig};
use crate::{DeepseekV3ForCausalLM, Qwen3MoeForCausalLM};

fn qwen() -> Qwen3MoeForCausalLM {
    Qwen3MoeConfig {
        vocab_size: 32,
        hidden_size: 16,
        intermediate_size: 24,
        moe_intermediate_size: 8,
        num_hidden_layers: 3,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        num_experts: 4,
        num_experts_per_tok: 2,
        norm_topk_prob: true,
        mlp_only_layers: vec![0],
        ..Qwen3MoeConfig::default()
    }
    .init(&Device::flex())
    .unwrap()
}

fn deepseek() -> DeepseekV3ForCausalLM {
    DeepseekV3Config {
        vocab_size: 32,
        hidden_size: 16,
        intermediate_size: 24,
        moe_intermediate_size: 8,
        num_hidden_layers: 3,
        first_k_dense_replace: 1,
        num_attention_heads: 2,
        n_routed_experts: 8,
        num_experts_per_tok: 2,
        n_group: 4,
        topk_group: 2,
        q_lora_rank: None,
        kv_lora_rank: 8,
        qk_nope_head_dim: 4,
        qk_rope_head_dim: 4,
        v_head_dim: 4,
        ..DeepseekV3Config::default()
    }
    .init(&Device::flex())
    .unwrap()
}

fn ids() -> Tensor<2, Int> {
    Tensor::from_data([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], &Device::flex())
}

fn host(t: Tensor<3>) -> Vec<f32> {
    t.into_data().try_into_vec_as::<f32>().unwrap()
}

fn host_ids(t: &Tensor<2, Int>) -> Vec<i32> {
    t.clone().into_data().try_into_vec_as::<i32>().unwrap()
}

/// Record → file bytes → replay gives the recorded routing and bit-identical logits; a
/// different forced assignment is honoured and changes the logits.
fn record_replay_force<M: RouterReplayModel>(model: &M, num_experts: i32) {
    let (logits, recorded) = record_routing(model, ids()).unwrap();
    let spec = model.replay_spec();
    assert_eq!(
        recorded.layers.keys().copied().collect::<Vec<_>>(),
        spec.moe_layers
    );
    assert_eq!((recorded.num_tokens, recorded.topk), (10, 2));
    let reread = RouterReplayFile::from_bytes(&recorded.to_bytes().unwrap()).unwrap();
    assert_eq!(reread, recorded);

    let (replayed, routing) = replay_routing(model, ids(), &reread).unwrap();
    assert_eq!(host(replayed), host(logits.clone()), "bit-identical logits");
    for (layer, idx) in spec.moe_layers.iter().zip(&routing) {
        assert_eq!(&host_ids(idx), &recorded.layers[layer]);
    }

    // Force a different assignment: rotate every id by one expert.
    let mut forced = recorded.clone();
    for ids in forced.layers.values_mut() {
        for row in ids.chunks_mut(2) {
            row[0] = (row[0] + 1) % num_experts;
            row[1] = (row[0] + 1) % num_experts;
        }
    }
    let (changed, routing) = replay_routing(model, ids(), &forced).unwrap();
    for (layer, idx) in spec.moe_layers.iter().zip(&routing) {
        assert_eq!(&host_ids(idx), &forced.layers[layer], "forced ids honoured");
    }
    let diff = host(changed)
        .iter()
        .zip(host(logits))
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        diff > 1e-6,
        "forcing other experts changes the logits ({diff})"
    );
}

#[test]
fn qwen3_moe_record_replay_and_force() {
    record_replay_force(&qwen(), 4);
}

#[test]
fn deepseek_v3_record_replay_and_force() {
    record_replay_force(&deepseek(), 8);
}

#[test]
fn malformed_replays_are_rejected_with_clear_errors() {
    let model = qwen();
    let (_, good) = record_routing(&model, ids()).unwrap();
    let err =
        |file: &RouterReplayFile| replay_routing(&model, ids(), file).unwrap_err().to_string();

    let mut missing = good.clone();
    missing.layers.remove(&2);
    let msg = err(&missing);
    assert!(
        msg.contains("1 layers [1]") && msg.contains("2 MoE layers [1, 2]"),
        "{msg}"
    );

    let mut k3 = RouterReplayFile::new("qwen3_moe", 3, 10);
    for l in [1, 2] {
        k3.insert_layer(l, [0, 1, 2].repeat(10)).unwrap();
    }
    let msg = err(&k3);
    assert!(
        msg.contains("k = 3") && msg.contains("num_experts_per_tok = 2"),
        "{msg}"
    );

    let short = ids().narrow(1, 0, 4);
    let msg = replay_routing(&model, short, &good)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("10 tokens recorded") && msg.contains("B·S = 8"),
        "{msg}"
    );

    let mut out_of_range = good.clone();
    out_of_range.layers.get_mut(&1).unwrap()[3] = 4;
    let msg = err(&out_of_range);
    assert!(
        msg.contains("layers.1.topk_indices") && msg.contains("row 1"),
        "{msg}"
    );

    let mut twice = good.clone();
    let l2 = twice.layers.get_mut(&2).unwrap();
    l2[1] = l2[0];
    assert!(err(&twice).contains("selected twice"));

    let mut wrong_type = good.clone();
    wrong_type.model_type = "deepseek_v3".into();
    assert!(err(&wrong_type).contains("model_type"));

    assert!(good.clone().insert_layer(1, vec![0; 3]).is_err());
}

#[test]
fn malformed_files_are_rejected_when_read() {
    let (_, good) = record_routing(&qwen(), ids()).unwrap();
    let bytes = good.to_bytes().unwrap();
    let dir = std::env::temp_dir().join(format!("moe-replay-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.safetensors");

    std::fs::write(&path, &bytes[..6]).unwrap();
    let msg = RouterReplayFile::read(&path).unwrap_err().to_string();
    assert!(
        msg.contains("bad.safetensors") && msg.contains("too short"),
        "{msg}"
    );

    // Truncated data section.
    std::fs::write(&path, &bytes[..bytes.len() - 4]).unwrap();
    let msg = RouterReplayFile::read(&path).unwrap_err().to_string();
    assert!(
        msg.contains("layers.2.topk_indices") && msg.contains("data_offsets"),
        "{msg}"
    );

    // `k` metadata disagreeing with the shapes.
    let mut patched = bytes.clone();
    let at = patched
        .windows(7)
        .position(|w| w == b"\"k\":\"2\"")
        .unwrap();
    patched[at + 5] = b'3';
    std::fs::write(&path, &patched).unwrap();
    let msg = RouterReplayFile::read(&path).unwrap_err().to_string();
    assert!(msg.contains("k = 2 in the shape"), "{msg}");

    // Header lengths past the file or past the limit.
    for (claimed, needle) in [
        (bytes.len() as u64, "exceeds the file"),
        (u64::MAX, "limit"),
    ] {
        let mut patched = bytes.clone();
        patched[..8].copy_from_slice(&claimed.to_le_bytes());
        let msg = RouterReplayFile::from_bytes(&patched)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("header length") && msg.contains(needle),
            "{msg}"
        );
    }

    // Offsets that do not span the shape: the crate's error, with the tensor named.
    let mut patched = bytes.clone();
    let at = patched.windows(6).position(|w| w == b"[10,2]").unwrap();
    patched[at + 4] = b'3';
    let msg = RouterReplayFile::from_bytes(&patched)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("layers.1.topk_indices") && msg.contains("data_offsets"),
        "{msg}"
    );

    // Trailing bytes after the last tensor.
    let mut longer = bytes.clone();
    longer.extend_from_slice(&[0; 4]);
    let msg = RouterReplayFile::from_bytes(&longer)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("data section is longer"), "{msg}");

    // A tensor of another dtype.
    let mut patched = bytes.clone();
    let at = patched.windows(5).position(|w| w == b"\"I32\"").unwrap();
    patched[at + 1..at + 4].copy_from_slice(b"U32");
    let msg = RouterReplayFile::from_bytes(&patched)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("topk_indices") && msg.contains("dtype U32"),
        "{msg}"
    );

    good.write(&path).unwrap();
    assert_eq!(RouterReplayFile::read(&path).unwrap(), good);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A layer edited to the wrong length is an error naming it, not a panic or a corrupt file.
#[test]
fn serialising_a_layer_of_the_wrong_length_is_an_error() {
    let mut file = RouterReplayFile::new("qwen3_moe", 2, 3);
    file.insert_layer(0, vec![0, 1, 1, 2, 2, 3]).unwrap();
    file.layers.insert(1, vec![0, 1, 2]);
    let err = file.to_bytes().unwrap_err().to_string();
    assert!(err.contains("layers.1.topk_indices"), "{err}");
}

/// DeepSeek-V3's MTP modules (decoder layers `N + j`) may follow the main MoE layers in a file
/// (as a training forward records them); the single-rank forward replays the main layers and
/// ignores them, and no other layer set is accepted.
#[test]
fn mtp_layers_may_follow_the_main_layers() {
    let mut config = deepseek().config().clone();
    config.num_nextn_predict_layers = 1;
    let model = config.init(&Device::flex()).unwrap();
    let spec = model.replay_spec();
    assert_eq!(
        (spec.moe_layers.clone(), spec.mtp_layers.clone()),
        (vec![1, 2], vec![3])
    );
    let (logits, main) = record_routing(&model, ids()).unwrap();
    let mut with_mtp = main.clone();
    with_mtp.insert_layer(3, [0, 5].repeat(10)).unwrap();
    let reread = RouterReplayFile::from_bytes(&with_mtp.to_bytes().unwrap()).unwrap();
    assert_eq!(reread, with_mtp);
    let (replayed, routing) = replay_routing(&model, ids(), &reread).unwrap();
    assert_eq!(routing.len(), 2, "the main layers' routing");
    assert_eq!(host(replayed), host(logits));
    // Through the sharded format and back, the MTP layer last.
    let routed = crate::distributed::replay::RoutedExperts::from_replay_file(&reread, 2).unwrap();
    assert_eq!((routed.layers, routed.covers_mtp(&spec)), (3, true));
    assert_eq!(routed.token(1, 4, 2), &[0, 5]);
    assert_eq!(routed.to_replay_file(&spec).unwrap(), with_mtp);
    // An MTP layer without the main layers, or a layer the model lacks, is refused.
    let mut skipped = with_mtp.clone();
    skipped.layers.remove(&2);
    let msg = replay_routing(&model, ids(), &skipped)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("then MTP layers [3]"), "{msg}");
    let mut extra = with_mtp;
    extra.insert_layer(4, [0, 5].repeat(10)).unwrap();
    assert!(replay_routing(&model, ids(), &extra).is_err());
}
