//! The autocast policy tables against PyTorch's lists transcribed in
//! `tests/golden/autocast_lists.json`, both ways, plus the key facts amprobe relies on.

use std::collections::{BTreeMap, BTreeSet};

use amprobe::amp::policy::{
    autocast_input_dtype, autocast_output_dtype, cross_entropy_dtypes, is_eligible, Category,
    CrossEntropyDtypes, DeviceType, PolicyTable,
};
use amprobe::dtype::DType;
use serde_json::Value;

const GOLDEN: &str = include_str!("golden/autocast_lists.json");

/// The category a PyTorch list maps to in amprobe. `fp32_append_dtype` (norm) has the same
/// observable outcome as `fp32_set_opt_dtype` and shares its category.
fn list_category(list: &str) -> Category {
    match list {
        // _cudnn_rnn casts to float16 by hand (AutocastRNN.cpp); amprobe treats it as
        // lower_precision_fp.
        "lower_precision_fp" | "cudnn_rnn_fp16" => Category::LowerPrecisionFp,
        "fp32" => Category::Fp32,
        "fp32_set_opt_dtype" | "fp32_append_dtype" => Category::Fp32SetOptDtype,
        "promote" => Category::Promote,
        "banned" => Category::Banned,
        other => panic!("golden file has an unknown list `{other}`"),
    }
}

/// Op name → category from the golden lists of one device, overload suffixes stripped.
/// Fails if one op sits in two lists of different categories.
fn golden_ops(device: &str) -> BTreeMap<String, Category> {
    let golden: Value = serde_json::from_str(GOLDEN).expect("golden JSON parses");
    let lists = golden["devices"][device]["lists"]
        .as_object()
        .unwrap_or_else(|| panic!("golden file lacks devices.{device}.lists"));
    let mut ops = BTreeMap::new();
    for (list, entries) in lists {
        let cat = list_category(list);
        for entry in entries.as_array().expect("a list is an array") {
            let entry = entry.as_str().expect("an entry is a string");
            let op = entry
                .split('.')
                .next()
                .expect("split yields one part")
                .to_string();
            if let Some(prev) = ops.insert(op.clone(), cat) {
                assert_eq!(prev, cat, "{device}: {op} is in two lists");
            }
        }
    }
    ops
}

#[test]
fn golden_file_names_its_source() {
    let golden: Value = serde_json::from_str(GOLDEN).unwrap();
    let files = golden["source"]["files"].as_array().unwrap();
    let paths: Vec<&str> = files.iter().map(|f| f["path"].as_str().unwrap()).collect();
    assert!(paths.contains(&"aten/src/ATen/autocast_mode.cpp"));
    assert!(paths.contains(&"aten/src/ATen/autocast_mode.h"));
    for f in files {
        let commit = f["commit"].as_str().unwrap();
        assert_eq!(commit.len(), 40, "commit {commit} is a full hash");
        assert!(commit.chars().all(|c| c.is_ascii_hexdigit()));
    }
}

#[test]
fn every_golden_op_has_its_list_category() {
    for d in DeviceType::ALL {
        let table = PolicyTable::for_device(d);
        let golden = golden_ops(d.name());
        assert!(!golden.is_empty());
        for (op, cat) in &golden {
            assert_eq!(table.category(op), *cat, "{d}: {op}");
        }
    }
}

#[test]
fn table_has_no_op_the_golden_lists_lack() {
    for d in DeviceType::ALL {
        let table = PolicyTable::for_device(d);
        let golden = golden_ops(d.name());
        let table_ops: BTreeSet<&str> = table.entries().iter().map(|(op, _)| *op).collect();
        let golden_ops: BTreeSet<&str> = golden.keys().map(String::as_str).collect();
        let extra: Vec<_> = table_ops.difference(&golden_ops).collect();
        let missing: Vec<_> = golden_ops.difference(&table_ops).collect();
        assert!(
            extra.is_empty(),
            "{d}: table has ops PyTorch does not list: {extra:?}"
        );
        assert!(
            missing.is_empty(),
            "{d}: table lacks ops PyTorch lists: {missing:?}"
        );
        for (op, cat) in table.entries() {
            assert_eq!(Some(&cat), golden.get(op), "{d}: {op}");
            assert_ne!(
                cat,
                Category::Passthrough,
                "{d}: {op} listed as passthrough"
            );
        }
    }
}

#[test]
fn entries_are_sorted_unique_and_for_their_device() {
    for d in DeviceType::ALL {
        let table = PolicyTable::for_device(d);
        assert_eq!(table.device(), d);
        let entries = table.entries();
        assert!(
            entries.windows(2).all(|w| w[0].0 < w[1].0),
            "{d}: not strictly sorted"
        );
    }
}

#[test]
fn cuda_key_facts() {
    let t = PolicyTable::for_device(DeviceType::Cuda);
    use Category::*;
    for (op, cat) in [
        ("linear", LowerPrecisionFp),
        ("matmul", LowerPrecisionFp),
        ("bmm", LowerPrecisionFp),
        ("mm", LowerPrecisionFp),
        ("softmax", Fp32SetOptDtype),
        ("log_softmax", Fp32SetOptDtype),
        ("sum", Fp32SetOptDtype),
        ("cumsum", Fp32SetOptDtype),
        ("norm", Fp32SetOptDtype),
        ("layer_norm", Fp32),
        ("rms_norm", Fp32),
        ("linalg_matrix_sqrth", Fp32),
        ("exp", Fp32),
        ("log", Fp32),
        ("pow", Fp32),
        ("rsqrt", Fp32),
        ("mse_loss", Fp32),
        ("nll_loss", Fp32),
        ("addcmul", Promote),
        ("index_put", Promote),
        ("binary_cross_entropy", Banned),
        // cat natively promotes; CUDA autocast does not list it.
        ("cat", Passthrough),
        ("relu", Passthrough),
        ("add", Passthrough),
        ("mul", Passthrough),
        ("mean", Passthrough),
        ("embedding", Passthrough),
        ("cross_entropy_loss", Passthrough),
        ("gelu", Passthrough),
    ] {
        assert_eq!(t.category(op), cat, "cuda {op}");
    }
}

#[test]
fn cpu_key_facts_and_differences_from_cuda() {
    let cpu = PolicyTable::for_device(DeviceType::Cpu);
    let cuda = PolicyTable::for_device(DeviceType::Cuda);
    use Category::*;
    for (op, cat) in [
        ("linear", LowerPrecisionFp),
        ("matmul", LowerPrecisionFp),
        ("bmm", LowerPrecisionFp),
        ("mm", LowerPrecisionFp),
        ("_addmm_activation", LowerPrecisionFp),
        ("mse_loss", Fp32),
        ("nll_loss", Fp32),
        ("cross_entropy_loss", Fp32),
        ("prod", Fp32),
        ("binary_cross_entropy", Fp32),
        ("cat", Promote),
        ("stack", Promote),
        ("relu", Passthrough),
        ("embedding", Passthrough),
    ] {
        assert_eq!(cpu.category(op), cat, "cpu {op}");
    }
    // Ops that CUDA autocasts but CPU autocast leaves in the input dtype.
    for op in [
        "softmax",
        "log_softmax",
        "layer_norm",
        "rms_norm",
        "exp",
        "log",
        "pow",
        "rsqrt",
        "sum",
    ] {
        assert_eq!(cpu.category(op), Passthrough, "cpu {op}");
        assert_ne!(cuda.category(op), Passthrough, "cuda {op}");
    }
    // Ops in different lists on the two devices.
    for (op, on_cuda, on_cpu) in [
        ("cross_entropy_loss", Passthrough, Fp32),
        ("binary_cross_entropy", Banned, Fp32),
        ("prod", Fp32SetOptDtype, Fp32),
        ("cat", Passthrough, Promote),
        ("grid_sampler", Promote, Fp32),
        ("addmv", LowerPrecisionFp, Passthrough),
    ] {
        assert_eq!(cuda.category(op), on_cuda, "cuda {op}");
        assert_eq!(cpu.category(op), on_cpu, "cpu {op}");
    }
}

#[test]
fn banned_op_is_refused_with_the_remedy() {
    let cuda = PolicyTable::for_device(DeviceType::Cuda);
    let err = cuda
        .checked_category("binary_cross_entropy")
        .unwrap_err()
        .to_string();
    assert!(err.contains("binary_cross_entropy_with_logits"), "{err}");
    assert_eq!(
        cuda.checked_category("linear").unwrap(),
        Category::LowerPrecisionFp
    );
    let cpu = PolicyTable::for_device(DeviceType::Cpu);
    assert_eq!(
        cpu.checked_category("binary_cross_entropy").unwrap(),
        Category::Fp32
    );
}

#[test]
fn device_and_category_names_round_trip() {
    assert_eq!("cuda".parse::<DeviceType>().unwrap(), DeviceType::Cuda);
    assert_eq!(DeviceType::parse("CPU").unwrap(), DeviceType::Cpu);
    let err = DeviceType::parse("mps").unwrap_err().to_string();
    assert!(
        err.contains("mps") && err.contains("cuda") && err.contains("cpu"),
        "{err}"
    );
    assert_eq!(
        serde_json::to_string(&DeviceType::Cuda).unwrap(),
        "\"cuda\""
    );
    assert_eq!(
        serde_json::from_str::<DeviceType>("\"cpu\"").unwrap(),
        DeviceType::Cpu
    );
    for (cat, name) in [
        (Category::LowerPrecisionFp, "lower_precision_fp"),
        (Category::Fp32, "fp32"),
        (Category::Fp32SetOptDtype, "fp32_set_opt_dtype"),
        (Category::Promote, "promote"),
        (Category::Banned, "banned"),
        (Category::Passthrough, "passthrough"),
    ] {
        assert_eq!(serde_json::to_string(&cat).unwrap(), format!("\"{name}\""));
        assert_eq!(name.parse::<Category>().unwrap(), cat);
        assert_eq!(cat.to_string(), name);
    }
    assert!("fp16".parse::<Category>().is_err());
    assert_eq!(DeviceType::Cuda.default_lower_precision(), DType::F16);
    assert_eq!(DeviceType::Cpu.default_lower_precision(), DType::BF16);
}

#[test]
fn eligibility_follows_is_eligible() {
    // Floating point and not float64.
    assert!(is_eligible(DType::F16) && is_eligible(DType::BF16) && is_eligible(DType::F32));
    assert!(!is_eligible(DType::F64) && !is_eligible(DType::I64));
    assert_eq!(autocast_input_dtype(DType::F16, DType::F32), DType::F16);
    assert_eq!(autocast_input_dtype(DType::F32, DType::BF16), DType::F32);
    assert_eq!(autocast_input_dtype(DType::F16, DType::F64), DType::F64);
    assert_eq!(autocast_input_dtype(DType::F32, DType::I64), DType::I64);
}

#[test]
fn output_dtype_per_category() {
    use DType::*;
    let out = |cat, low, ins: &[DType]| autocast_output_dtype(cat, low, ins).unwrap();
    // lower_precision_fp: f32 weights and activations go to the autocast dtype.
    assert_eq!(
        out(Category::LowerPrecisionFp, F16, &[F32, F32, F32]),
        Some(F16)
    );
    assert_eq!(
        out(Category::LowerPrecisionFp, BF16, &[F32, F16]),
        Some(BF16)
    );
    // Only f64 inputs: nothing is cast, the op runs in f64.
    assert_eq!(out(Category::LowerPrecisionFp, F16, &[F64, F64]), None);
    // fp32.
    assert_eq!(out(Category::Fp32, F16, &[F16]), Some(F32));
    assert_eq!(out(Category::Fp32, BF16, &[BF16, I64]), Some(F32));
    assert_eq!(out(Category::Fp32, F16, &[I64]), None);
    // fp32_set_opt_dtype: decided by the first argument alone.
    assert_eq!(out(Category::Fp32SetOptDtype, F16, &[F16]), Some(F32));
    assert_eq!(out(Category::Fp32SetOptDtype, F16, &[F32]), Some(F32));
    assert_eq!(out(Category::Fp32SetOptDtype, F16, &[F64, F16]), None);
    assert_eq!(out(Category::Fp32SetOptDtype, F16, &[I64, F16]), None);
    // promote: f32 wins, all-low stays low, f64 and integers are ignored.
    assert_eq!(out(Category::Promote, F16, &[F16, F32]), Some(F32));
    assert_eq!(out(Category::Promote, F16, &[F16, F16]), Some(F16));
    assert_eq!(out(Category::Promote, BF16, &[BF16, F64, I64]), Some(BF16));
    assert_eq!(out(Category::Promote, F16, &[F64]), None);
    // fp16 under bf16 autocast: PyTorch raises unless a float32 input came first.
    assert!(autocast_output_dtype(Category::Promote, BF16, &[F16, F32]).is_err());
    assert_eq!(out(Category::Promote, BF16, &[F32, F16]), Some(F32));
    // passthrough and banned cast nothing.
    assert_eq!(out(Category::Passthrough, F16, &[F16, F32]), None);
    assert_eq!(out(Category::Banned, F16, &[F16]), None);
    assert_eq!(out(Category::LowerPrecisionFp, F16, &[]), None);
    // The autocast dtype must be a low-precision one.
    for bad in [F32, F64, I64] {
        let err = autocast_output_dtype(Category::Fp32, bad, &[F16])
            .unwrap_err()
            .to_string();
        assert!(err.contains(bad.name()), "{err}");
    }
}

#[test]
fn cross_entropy_rounds_log_probs_to_fp16_on_cuda_only() {
    use DType::*;
    // CUDA: the decomposition's log_softmax keeps its explicit dtype (the logits'), then
    // nll_loss (fp32 list) upcasts.
    let cuda = PolicyTable::for_device(DeviceType::Cuda);
    assert_eq!(cuda.category("cross_entropy_loss"), Category::Passthrough);
    assert_eq!(cuda.category("nll_loss"), Category::Fp32);
    assert_eq!(
        cross_entropy_dtypes(DeviceType::Cuda, F16),
        CrossEntropyDtypes {
            log_probs: F16,
            loss: F32
        }
    );
    assert_eq!(
        cross_entropy_dtypes(DeviceType::Cuda, BF16),
        CrossEntropyDtypes {
            log_probs: BF16,
            loss: F32
        }
    );
    // CPU: cross_entropy_loss is fp32 itself, so the logits are upcast first.
    let cpu = PolicyTable::for_device(DeviceType::Cpu);
    assert_eq!(cpu.category("cross_entropy_loss"), Category::Fp32);
    assert_eq!(
        cross_entropy_dtypes(DeviceType::Cpu, BF16),
        CrossEntropyDtypes {
            log_probs: F32,
            loss: F32
        }
    );
    assert_eq!(
        cross_entropy_dtypes(DeviceType::Cpu, F16),
        CrossEntropyDtypes {
            log_probs: F32,
            loss: F32
        }
    );
    // f32 logits give f32 everywhere; f64 is never cast.
    for d in DeviceType::ALL {
        assert_eq!(
            cross_entropy_dtypes(d, F32),
            CrossEntropyDtypes {
                log_probs: F32,
                loss: F32
            }
        );
        assert_eq!(
            cross_entropy_dtypes(d, F64),
            CrossEntropyDtypes {
                log_probs: F64,
                loss: F64
            }
        );
    }
}
