//! Trace files: round trip, truncation at every byte of the last line, corruption, schema
//! versions, and incremental reading of a growing file.

use amprobe::dtype::RoundCounts;
use amprobe::probe::TensorStats;
use amprobe::trace::{
    read_trace, read_trace_from, EndRecord, Header, OpRecord, OpRef, Origins, ParamRecord, Phase,
    Record, StepRecord, TensorMeta, Trace, TraceReader, TraceWriter, Truncation, SCHEMA_VERSION,
};
use amprobe::{DType, Error};
use std::io::Write;

fn header() -> Header {
    Header {
        model: "tiny-gpt".into(),
        precision: "fp16-amp".into(),
        autocast_dtype: Some(DType::F16),
        policy_device: "cuda".into(),
        policy: serde_json::json!({"lower_precision_fp": ["matmul", "linear"]}),
        scaler: serde_json::json!({"init_scale": 65536.0, "growth_interval": 2000}),
        optimizer: serde_json::json!({"kind": "adamw", "lr": 0.001}),
        backend: "cpu-emulated".into(),
        seed: 42,
        command_line: vec!["amprobe".into(), "run".into(), "--steps".into(), "4".into()],
        config: serde_json::json!({"steps": 4}),
        ..Header::new()
    }
}

fn op(index: u64, phase: Phase, name: &str, data: &[f32]) -> OpRecord {
    OpRecord {
        micro: 0,
        index,
        phase,
        op: name.into(),
        module: "blocks.0.attn".into(),
        inputs: vec![
            TensorMeta {
                dtype: DType::F16,
                shape: vec![2, 3],
            },
            TensorMeta {
                dtype: DType::F16,
                shape: vec![3, 4],
            },
        ],
        output: TensorMeta {
            dtype: DType::F16,
            shape: vec![2, 4],
        },
        stats: TensorStats::compute(DType::F16, data),
        rounding: RoundCounts {
            overflow: 1,
            underflow: 2,
        },
        forward_op: (phase == Phase::Backward).then_some(0),
        wrt: (phase == Phase::Backward).then(|| "weight".to_string()),
        masked_neg_inf: 3,
        additive_mask: false,
        blame: None,
    }
}

/// Steps whose floats all have short decimal forms (see `arbitrary_floats_round_trip`).
fn step(n: u64) -> StepRecord {
    let ops = vec![
        op(
            0,
            Phase::Forward,
            "matmul",
            &[1.5, -2.25, 0.0, 1024.0, f32::NAN, f32::INFINITY],
        ),
        op(1, Phase::Backward, "matmul_backward", &[0.5, -0.75]),
    ];
    let origin = OpRef::from_op(n, &ops[0]);
    StepRecord {
        step: n,
        micro_batches: 2,
        loss: Some(2.5 + n as f64),
        scaled_loss: Some(163840.0),
        scale_before: 65536.0,
        scale_after: if n == 2 { 32768.0 } else { 65536.0 },
        found_inf: n == 2,
        skipped: n == 2,
        growth_tracker: n as i64,
        grad_norm: if n == 2 { None } else { Some(0.75) },
        clip_coef: Some(1.0),
        lr: 0.001,
        weight_casts: 12,
        origins: Origins {
            first_inf: (n == 2).then(|| origin.clone()),
            first_nan: None,
            chain: if n == 2 { vec![origin] } else { vec![] },
        },
        params: vec![ParamRecord::from_grad(
            "blocks.0.attn.w",
            DType::F32,
            DType::F32,
            &[0.25, 0.0, -0.5, 0.0],
            1024.0,
            &[1.0, -3.0],
        )],
        ops: n.is_multiple_of(2).then_some(ops),
        op_count: 2,
        events: match n {
            2 => vec!["scale halved → 32768 (inf in grads)".into()],
            // Multi-byte characters in the last line: cuts inside them are truncations too.
            3 => vec!["grad norm ↑ 4× — ünusual".into()],
            _ => vec![],
        },
        wall_ms: 12.5,
        skip_cause: None,
    }
}

/// A finished trace of `steps` steps, as bytes, and the offset where each line starts.
fn trace_bytes(steps: u64, finish: bool) -> (Vec<u8>, Vec<usize>) {
    let mut buf = Vec::new();
    let mut w = TraceWriter::from_writer(&mut buf, &header()).unwrap();
    for n in 0..steps {
        w.write_step(&step(n)).unwrap();
    }
    assert_eq!(w.steps_written(), steps);
    if finish {
        w.finish(&EndRecord {
            steps,
            verdict: "ok".into(),
            wall_ms: 100.25,
        })
        .unwrap();
    }
    let mut starts = vec![0];
    for (i, &b) in buf.iter().enumerate() {
        if b == b'\n' && i + 1 < buf.len() {
            starts.push(i + 1);
        }
    }
    (buf, starts)
}

fn trace_error(r: amprobe::Result<Trace>) -> (usize, String) {
    match r {
        Err(Error::Trace { line, message, .. }) => (line, message),
        Err(e) => panic!("expected a trace error, got {e}"),
        Ok(t) => panic!(
            "expected a trace error, got a trace of {} steps",
            t.steps.len()
        ),
    }
}

#[test]
fn write_then_read_back_equal() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.trace.jsonl");
    let mut w = TraceWriter::create(&path, &header()).unwrap();
    for n in 0..4 {
        w.write_step(&step(n)).unwrap();
    }
    w.sync().unwrap();
    let end = EndRecord {
        steps: 4,
        verdict: "overflow in blocks.0.attn".into(),
        wall_ms: 50.5,
    };
    w.finish(&end).unwrap();

    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(text.lines().count(), 6);
    assert!(text.ends_with('\n'));
    assert!(text.starts_with(r#"{"type":"header","schema_version":1,"tool":"amprobe""#));

    let t = read_trace(&path).unwrap();
    assert_eq!(t.header, header());
    assert_eq!(t.steps, (0..4).map(step).collect::<Vec<_>>());
    assert_eq!(t.end, Some(end));
    assert_eq!(t.truncated, None);
    // The op stats survived with their NaN/inf counts and histogram.
    let st = &t.steps[0].ops.as_ref().unwrap()[0].stats;
    assert_eq!((st.nan, st.pos_inf, st.zeros), (1, 1, 1));
    assert_eq!(st.exp_hist.get(10), 1);
}

#[test]
fn nonfinite_step_values_round_trip() {
    let mut s = step(2);
    s.loss = Some(f64::NAN);
    s.scaled_loss = Some(f64::INFINITY);
    s.grad_norm = Some(f64::NEG_INFINITY);
    let mut buf = Vec::new();
    let mut w = TraceWriter::from_writer(&mut buf, &header()).unwrap();
    w.write_step(&s).unwrap();
    drop(w);
    let t = read_trace_from(&buf[..], "mem").unwrap();
    let back = &t.steps[0];
    assert!(back.loss.unwrap().is_nan());
    assert_eq!(back.scaled_loss, Some(f64::INFINITY));
    assert_eq!(back.grad_norm, Some(f64::NEG_INFINITY));
    assert_eq!(back.params, s.params);
    assert_eq!(t.end, None);
}

#[test]
fn truncation_at_every_byte_of_the_last_line() {
    for finish in [false, true] {
        let (buf, starts) = trace_bytes(4, finish);
        let last = *starts.last().unwrap();
        let full_steps = if finish { 4 } else { 3 };
        for cut in last..buf.len() {
            let t =
                read_trace_from(&buf[..cut], "mem").unwrap_or_else(|e| panic!("cut at {cut}: {e}"));
            assert_eq!(t.header, header());
            // Cut only the newline: the record is whole and counts.
            let whole = cut == buf.len() - 1;
            let n = if whole && !finish { 4 } else { full_steps };
            assert!(
                t.steps == (0..n).map(step).collect::<Vec<_>>(),
                "cut at {cut}"
            );
            assert_eq!(t.end.is_some(), whole && finish, "cut at {cut}");
            let want = (cut != last && !whole).then_some(Truncation {
                line: starts.len(),
                bytes: cut - last,
            });
            assert_eq!(t.truncated, want, "cut at {cut}");
        }
    }
    // Through a real file as well.
    let (buf, starts) = trace_bytes(3, false);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cut.jsonl");
    let cut = starts[3] + 17;
    std::fs::write(&path, &buf[..cut]).unwrap();
    let t = read_trace(&path).unwrap();
    assert_eq!(t.steps.len(), 2);
    assert_eq!(t.truncated, Some(Truncation { line: 4, bytes: 17 }));
}

#[test]
fn corrupt_middle_line_names_the_line() {
    let (buf, starts) = trace_bytes(4, true);
    // Line 3 is step 1: break its JSON.
    let mut bad = buf.clone();
    bad[starts[2] + 5] = b'#';
    let (line, msg) = trace_error(read_trace_from(&bad[..], "mem"));
    assert_eq!(line, 3);
    assert!(msg.contains("expected a step or end record"), "{msg}");

    // A well-formed object with a wrong field is malformed too.
    let text = String::from_utf8(buf.clone()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let mut edited = lines.clone();
    let broken = lines[4].replacen("\"found_inf\":false", "\"found_inf\":\"no\"", 1);
    assert_ne!(broken, lines[4]);
    edited[4] = &broken;
    let joined = edited.join("\n") + "\n";
    let (line, _) = trace_error(read_trace_from(joined.as_bytes(), "mem"));
    assert_eq!(line, 5);

    // A malformed last line that has its newline is corruption, not truncation.
    let mut tail = buf.clone();
    let n = tail.len();
    tail[n - 3] = b'!';
    let (line, _) = trace_error(read_trace_from(&tail[..], "mem"));
    assert_eq!(line, 6);

    // A second header, and records after the end.
    let mut twice = buf[..starts[1]].to_vec();
    twice.extend_from_slice(&buf[..starts[1]]);
    let (line, msg) = trace_error(read_trace_from(&twice[..], "mem"));
    assert_eq!(line, 2);
    assert!(msg.contains("second header"), "{msg}");
    let mut after = buf.clone();
    after.extend_from_slice(&buf[starts[1]..starts[2]]);
    let (line, msg) = trace_error(read_trace_from(&after[..], "mem"));
    assert_eq!(line, 7);
    assert!(msg.contains("after the end"), "{msg}");
}

#[test]
fn header_problems_are_errors() {
    let (buf, starts) = trace_bytes(2, false);
    let text = String::from_utf8(buf.clone()).unwrap();

    let newer = text.replacen(
        &format!("\"schema_version\":{SCHEMA_VERSION}"),
        &format!("\"schema_version\":{}", SCHEMA_VERSION + 1),
        1,
    );
    assert_ne!(newer, text);
    let (line, msg) = trace_error(read_trace_from(newer.as_bytes(), "mem"));
    assert_eq!(line, 1);
    assert!(msg.contains("newer"), "{msg}");

    // A newer header is refused even if its other fields changed shape.
    let future = "{\"type\":\"header\",\"schema_version\":9,\"tool\":{\"name\":\"x\"}}\n";
    let (_, msg) = trace_error(read_trace_from(future.as_bytes(), "mem"));
    assert!(msg.contains("newer"), "{msg}");

    // No header: the file starts with a step.
    let (line, msg) = trace_error(read_trace_from(&buf[starts[1]..], "mem"));
    assert_eq!(line, 1);
    assert!(msg.contains("header"), "{msg}");

    // A header missing a field.
    let missing = text.replacen("\"backend\":\"cpu-emulated\",", "", 1);
    assert_ne!(missing, text);
    let (line, msg) = trace_error(read_trace_from(missing.as_bytes(), "mem"));
    assert_eq!(line, 1);
    assert!(msg.contains("backend"), "{msg}");

    // A missing file is an I/O error naming it.
    match read_trace("/nonexistent/amprobe/trace.jsonl") {
        Err(Error::Io { path, .. }) => assert!(path.ends_with("trace.jsonl")),
        other => panic!("expected an I/O error, got {other:?}"),
    }
}

#[test]
fn incremental_reader_follows_a_growing_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("live.jsonl");
    let appender = || {
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
    };
    std::fs::File::create(&path).unwrap();

    let mut reader = TraceReader::open(&path).unwrap();
    assert!(reader.read_new().unwrap().is_empty());

    let mut w = TraceWriter::from_writer(appender(), &header()).unwrap();
    let got = reader.read_new().unwrap();
    assert_eq!(got, vec![Record::Header(header())]);

    w.write_step(&step(0)).unwrap();
    w.write_step(&step(1)).unwrap();
    assert_eq!(
        reader.read_new().unwrap(),
        vec![Record::Step(step(0)), Record::Step(step(1))]
    );
    assert!(reader.read_new().unwrap().is_empty());

    // A line arriving in pieces is held back until its newline.
    let mut line = serde_json::to_vec(&Record::Step(step(2))).unwrap();
    line.push(b'\n');
    let mut raw = appender();
    raw.write_all(&line[..10]).unwrap();
    assert!(reader.read_new().unwrap().is_empty());
    assert_eq!(reader.pending_bytes(), 10);
    raw.write_all(&line[10..line.len() - 1]).unwrap();
    assert!(reader.read_new().unwrap().is_empty());
    raw.write_all(b"\n").unwrap();
    assert_eq!(reader.read_new().unwrap(), vec![Record::Step(step(2))]);
    assert_eq!(reader.pending_bytes(), 0);
    assert_eq!(reader.lines_read(), 4);

    let end = EndRecord {
        steps: 3,
        verdict: "ok".into(),
        wall_ms: 1.0,
    };
    w.finish(&end).unwrap();
    assert!(!reader.finished());
    assert_eq!(reader.read_new().unwrap(), vec![Record::End(end)]);
    assert!(reader.finished());

    let t = read_trace(&path).unwrap();
    assert_eq!(t.steps.len(), 3);
}

/// Needs serde_json's `float_roundtrip` feature: without it, JSON numbers with many digits
/// parse to a neighbouring f64 about one time in seven.
#[test]
fn arbitrary_floats_round_trip() {
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut s = step(1);
    let mut buf = Vec::new();
    let mut w = TraceWriter::from_writer(&mut buf, &header()).unwrap();
    let mut want = Vec::new();
    for _ in 0..2000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.loss = Some(f64::from_bits(x));
        s.lr = (x >> 11) as f64 / (1u64 << 53) as f64 * 1e-3;
        w.write_step(&s).unwrap();
        want.push((s.loss.unwrap().to_bits(), s.lr.to_bits()));
    }
    drop(w);
    let t = read_trace_from(&buf[..], "mem").unwrap();
    for (got, want) in t.steps.iter().zip(&want) {
        let l = got.loss.unwrap();
        if l.is_nan() {
            assert!(f64::from_bits(want.0).is_nan());
        } else {
            assert_eq!(l.to_bits(), want.0);
        }
        assert_eq!(got.lr.to_bits(), want.1);
    }
}
