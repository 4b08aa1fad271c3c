//! Loading Hugging Face T5 checkpoints: bad directories, configs and tensors fail with
//! messages naming the file and tensor; sharded checkpoints and bf16 weights load.

use std::path::Path;
use std::process::Command;

fn amprobe(args: &[&str]) -> (bool, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .args(args)
        .output()
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stderr).into_owned() + &String::from_utf8_lossy(&o.stdout),
    )
}

fn copy_sample(dir: &Path) {
    for f in ["config.json", "model.safetensors", "inputs.safetensors"] {
        std::fs::copy(Path::new("samples/t5_overflow_small").join(f), dir.join(f)).unwrap();
    }
}

#[test]
fn runs_from_a_directory() {
    let (ok, out) = amprobe(&[
        "run",
        "--hf",
        "samples/t5_overflow_small",
        "--inputs",
        "samples/t5_overflow_small/inputs.safetensors",
        "--precision",
        "fp16",
    ]);
    assert!(ok, "{out}");
    assert!(
        out.contains("encoder.block.3.layer.1.DenseReluDense.wo"),
        "{out}"
    );
}

#[test]
fn missing_weights_file_is_named() {
    let d = tempfile::tempdir().unwrap();
    copy_sample(d.path());
    std::fs::remove_file(d.path().join("model.safetensors")).unwrap();
    let (ok, out) = amprobe(&[
        "run",
        "--hf",
        d.path().to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "4",
    ]);
    assert!(!ok);
    assert!(out.contains("model.safetensors"), "{out}");
}

#[test]
fn missing_config_is_named() {
    let d = tempfile::tempdir().unwrap();
    copy_sample(d.path());
    std::fs::remove_file(d.path().join("config.json")).unwrap();
    let (ok, out) = amprobe(&["run", "--hf", d.path().to_str().unwrap()]);
    assert!(!ok);
    assert!(out.contains("config.json"), "{out}");
}

#[test]
fn unsupported_model_type_is_named() {
    let d = tempfile::tempdir().unwrap();
    copy_sample(d.path());
    let c = std::fs::read_to_string(d.path().join("config.json"))
        .unwrap()
        .replace("\"model_type\": \"t5\"", "\"model_type\": \"mamba\"");
    std::fs::write(d.path().join("config.json"), c).unwrap();
    let (ok, out) = amprobe(&["run", "--hf", d.path().to_str().unwrap()]);
    assert!(!ok);
    assert!(
        out.contains("config.json") && out.contains("mamba") && out.contains("model_type"),
        "{out}"
    );
}

#[test]
fn wrong_shape_names_file_and_tensor() {
    let d = tempfile::tempdir().unwrap();
    copy_sample(d.path());
    let c = std::fs::read_to_string(d.path().join("config.json"))
        .unwrap()
        .replace("\"d_ff\": 128", "\"d_ff\": 64");
    std::fs::write(d.path().join("config.json"), c).unwrap();
    let (ok, out) = amprobe(&["run", "--hf", d.path().to_str().unwrap()]);
    assert!(!ok);
    assert!(
        out.contains("model.safetensors")
            && out.contains("encoder.block.0.layer.1.DenseReluDense.wi.weight")
            && out.contains("[128, 32]")
            && out.contains("[64, 32]"),
        "{out}"
    );
}

#[test]
fn token_id_out_of_range_is_named() {
    let (ok, out) = amprobe(&[
        "run",
        "--hf",
        "samples/t5_overflow_small",
        "--batch",
        "2",
        "--seq",
        "4",
    ]);
    assert!(ok, "synthetic ids are in range: {out}");
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("ids.safetensors");
    let bytes: Vec<u8> = [1i64, 2, 300, 4]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![1, 4], &bytes).unwrap();
    safetensors::tensor::serialize_to_file(vec![("input_ids".to_string(), view)], None, &p)
        .unwrap();
    let (ok, out) = amprobe(&[
        "run",
        "--hf",
        "samples/t5_overflow_small",
        "--inputs",
        p.to_str().unwrap(),
    ]);
    assert!(!ok);
    assert!(
        out.contains("input_ids") && out.contains("300") && out.contains("position 2"),
        "{out}"
    );
}

/// A sharded checkpoint in bf16 loads to the same weights (all fixture weights are exact
/// in bf16) and gives the same loss.
#[test]
fn sharded_bf16_checkpoint_loads() {
    use amprobe::models::weights::load_safetensors;
    let d = tempfile::tempdir().unwrap();
    std::fs::copy(
        "samples/t5_overflow_small/config.json",
        d.path().join("config.json"),
    )
    .unwrap();
    let all = load_safetensors(Path::new("samples/t5_overflow_small/model.safetensors")).unwrap();
    let mut map = serde_json::Map::new();
    let names: Vec<&String> = all.keys().collect();
    for (shard, chunk) in names.chunks(names.len().div_ceil(2)).enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", shard + 1);
        let bufs: Vec<(String, Vec<usize>, Vec<u8>)> = chunk
            .iter()
            .map(|n| {
                let t = &all[*n];
                let b = t
                    .to_f64_vec()
                    .unwrap()
                    .iter()
                    .flat_map(|&v| half::bf16::from_f32(v as f32).to_bits().to_le_bytes())
                    .collect();
                map.insert(n.to_string(), serde_json::Value::String(file.clone()));
                (n.to_string(), t.shape().to_vec(), b)
            })
            .collect();
        let views: Vec<_> = bufs
            .iter()
            .map(|(n, s, b)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, s.clone(), b)
                        .unwrap(),
                )
            })
            .collect();
        safetensors::tensor::serialize_to_file(views, None, &d.path().join(&file)).unwrap();
    }
    std::fs::write(
        d.path().join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    let inputs = "samples/t5_overflow_small/inputs.safetensors";
    let (ok1, a) = amprobe(&[
        "run",
        "--hf",
        d.path().to_str().unwrap(),
        "--inputs",
        inputs,
        "--precision",
        "fp32",
    ]);
    let (ok2, b) = amprobe(&[
        "run",
        "--hf",
        "samples/t5_overflow_small",
        "--inputs",
        inputs,
        "--precision",
        "fp32",
    ]);
    assert!(ok1 && ok2, "{a}\n{b}");
    let loss = |s: &str| {
        s.lines()
            .find(|l| l.contains("step    0"))
            .unwrap()
            .split_whitespace()
            .nth(3)
            .unwrap()
            .to_string()
    };
    assert_eq!(loss(&a), loss(&b));
}
