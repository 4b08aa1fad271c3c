//! `amprobe export --perfetto`: the output is Chrome trace-event JSON (required fields per
//! phase type, numeric counters, monotonic timestamps per track, slices nested properly),
//! and it says what the trace says (one slice per op, origins at their op, scale and loss).

mod report_util;

use amprobe::trace::read_trace;
use amprobe::trace::record::Phase;
use report_util::{inject, mlp_trace};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

fn export(trace: &Path, out: &Path) -> Value {
    let o = Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .args(["export", "--perfetto", trace.to_str().unwrap(), "--out"])
        .arg(out)
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_str(&std::fs::read_to_string(out).unwrap()).unwrap()
}

fn f(v: &Value, k: &str) -> f64 {
    v[k].as_f64()
        .unwrap_or_else(|| panic!("`{k}` is a number in {v}"))
}

/// Checks the trace-event format itself; returns the events.
fn validate(doc: &Value) -> Vec<Value> {
    let obj = doc.as_object().expect("a JSON object");
    let unit = obj.get("displayTimeUnit").and_then(Value::as_str).unwrap();
    assert!(unit == "ms" || unit == "ns");
    let ev = obj["traceEvents"]
        .as_array()
        .expect("traceEvents array")
        .clone();
    let mut last_ts: BTreeMap<(String, String), f64> = BTreeMap::new();
    for e in &ev {
        let ph = e["ph"].as_str().expect("ph");
        assert!(e["name"].is_string(), "name: {e}");
        assert!(e["pid"].is_u64(), "pid: {e}");
        let track = match ph {
            "M" => {
                assert!(e["args"]["name"].is_string(), "{e}");
                continue;
            }
            "X" => {
                assert!(e["tid"].is_u64());
                assert!(f(e, "ts") >= 0.0 && f(e, "dur") >= 0.0);
                assert!(e["args"].is_object());
                format!("thread {}", e["tid"])
            }
            "C" => {
                let args = e["args"].as_object().expect("counter args");
                assert!(!args.is_empty());
                assert!(
                    args.values().all(Value::is_number),
                    "counter values are numbers: {e}"
                );
                format!("counter {}", e["name"])
            }
            "i" => {
                let s = e["s"].as_str().expect("instant scope");
                assert!(["g", "p", "t"].contains(&s));
                if s == "t" {
                    assert!(e["tid"].is_u64());
                }
                format!("instant {}", e["tid"])
            }
            other => panic!("unexpected phase type {other}"),
        };
        let ts = f(e, "ts");
        let k = (e["pid"].to_string(), track);
        if let Some(&prev) = last_ts.get(&k) {
            assert!(ts >= prev, "ts goes back on {k:?}: {prev} then {ts}");
        }
        last_ts.insert(k, ts);
    }
    // Complete slices on a thread nest or are disjoint.
    let mut xs: Vec<(f64, f64)> = ev
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| (f(e, "ts"), f(e, "ts") + f(e, "dur")))
        .collect();
    xs.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.total_cmp(&a.1)));
    let mut stack: Vec<(f64, f64)> = Vec::new();
    for s in xs {
        while stack.last().is_some_and(|p| s.0 >= p.1 - 1e-9) {
            stack.pop();
        }
        if let Some(p) = stack.last() {
            assert!(s.1 <= p.1 + 1e-9, "slice {s:?} crosses its parent {p:?}");
        }
        stack.push(s);
    }
    ev
}

#[test]
fn export_is_valid_trace_event_json_and_matches_the_trace() {
    let dir = tempfile::tempdir().unwrap();
    let t = mlp_trace(
        dir.path(),
        "fwd",
        "fp16",
        3,
        vec![inject(1, "linear", "fc2", Phase::Forward, f32::INFINITY)],
        |_| {},
    );
    let trace = read_trace(&t).unwrap();
    let doc = export(&t, &dir.path().join("out.json"));
    let ev = validate(&doc);

    let slices = |cat: &str| -> Vec<&Value> {
        ev.iter()
            .filter(|e| e["ph"] == "X" && e["cat"] == cat)
            .collect()
    };
    // Steps back to back, each as long as its wall time.
    let steps = slices("step");
    assert_eq!(steps.len(), 3);
    let mut t0 = 0.0;
    for (s, rec) in steps.iter().zip(&trace.steps) {
        assert!((f(s, "ts") - t0).abs() < 1e-6);
        assert!((f(s, "dur") - rec.wall_ms * 1000.0).abs() < 1e-3);
        assert_eq!(s["args"]["skipped"], rec.skipped);
        t0 += f(s, "dur");
    }
    // One slice per op record, in execution order, with its statistics.
    let n_ops: usize = trace
        .steps
        .iter()
        .map(|s| s.ops.as_ref().map_or(0, Vec::len))
        .sum();
    let ops: Vec<&Value> = ["forward", "backward", "optimizer"]
        .iter()
        .flat_map(|c| slices(c))
        .collect();
    assert_eq!(ops.len(), n_ops);
    assert!(trace.steps[2].ops.is_none(), "step 2 has no op records");
    for step in [0u64, 1] {
        let mut mine: Vec<&&Value> = ops.iter().filter(|o| o["args"]["step"] == step).collect();
        mine.sort_by(|a, b| f(a, "ts").total_cmp(&f(b, "ts")));
        let idx: Vec<u64> = mine
            .iter()
            .map(|o| o["args"]["index"].as_u64().unwrap())
            .collect();
        let rec: Vec<u64> = trace.steps[step as usize]
            .ops
            .as_ref()
            .unwrap()
            .iter()
            .map(|o| o.index)
            .collect();
        assert_eq!(idx, rec, "step {step}: ops in execution order");
    }
    let rec_op = &trace.steps[0].ops.as_ref().unwrap()[3];
    let sl = ops
        .iter()
        .find(|o| o["args"]["step"] == 0 && o["args"]["index"] == rec_op.index)
        .unwrap();
    assert_eq!(sl["name"], format!("{} @ {}", rec_op.op, rec_op.module));
    assert_eq!(
        sl["args"]["max_abs"].as_f64().unwrap(),
        rec_op.stats.max_abs
    );
    assert_eq!(sl["args"]["numel"].as_u64().unwrap(), rec_op.stats.numel);
    // The first Inf sits at its op's slice.
    let k = trace.steps[1].origins.first_inf.as_ref().unwrap().op_index;
    let inf = ev
        .iter()
        .find(|e| e["ph"] == "i" && e["cat"] == "origin" && e["args"]["kind"] == "Inf")
        .expect("first Inf instant");
    assert_eq!(inf["name"], "first Inf: linear @ fc2");
    let at = ops
        .iter()
        .find(|o| o["args"]["step"] == 1 && o["args"]["index"] == k)
        .unwrap();
    assert_eq!(f(inf, "ts"), f(at, "ts"));
    // The skipped step, with the cause the run recorded (the injected Inf happens in an fp32
    // re-run too).
    let skip = ev.iter().find(|e| e["cat"] == "skip").unwrap();
    assert_eq!(skip["name"], "step 1 skipped");
    assert_eq!(skip["args"]["cause"], "divergence");
    // Counters: the scale per step and after the last; the loss where finite.
    let counter = |name: &str, key: &str| -> Vec<f64> {
        ev.iter()
            .filter(|e| e["ph"] == "C" && e["name"] == name)
            .map(|e| e["args"][key].as_f64().unwrap())
            .collect()
    };
    let mut scales: Vec<f64> = trace.steps.iter().map(|s| s.scale_before).collect();
    scales.push(trace.steps[2].scale_after);
    assert_eq!(counter("loss scale", "scale"), scales);
    assert_eq!(scales, [65536.0, 65536.0, 32768.0, 32768.0]);
    let losses: Vec<f64> = trace
        .steps
        .iter()
        .filter_map(|s| s.loss.filter(|l| l.is_finite()))
        .collect();
    assert_eq!(losses.len(), 2);
    assert_eq!(counter("loss", "loss"), losses);
    assert_eq!(doc["otherData"]["finished"], true);
}

#[test]
fn export_of_a_cut_trace_and_a_missing_format() {
    let dir = tempfile::tempdir().unwrap();
    let t = mlp_trace(dir.path(), "clean", "bf16", 3, vec![], |_| {});
    let text = std::fs::read(&t).unwrap();
    let cut = dir.path().join("cut.jsonl");
    // Everything up to the middle of the last step's line.
    let lines: Vec<&[u8]> = text.split_inclusive(|&b| b == b'\n').collect();
    let mut b: Vec<u8> = lines[..3].concat();
    b.extend_from_slice(&lines[3][..40]);
    std::fs::write(&cut, b).unwrap();
    let doc = export(&cut, &dir.path().join("cut.json"));
    validate(&doc);
    assert_eq!(doc["otherData"]["truncated"]["line"], 4);
    assert_eq!(doc["otherData"]["finished"], false);
    assert_eq!(
        doc["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["cat"] == "step")
            .count(),
        2
    );
    let o = Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .args(["export", t.to_str().unwrap(), "--out", "x.json"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("choose a format (--perfetto)"));
}
