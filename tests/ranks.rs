//! A run over several ranks read together (`diagnose::ranks`): on small synthetic rank
//! traces, the rank that made the first Inf/NaN is told apart from ranks that received it
//! through a collective, the ranks' found_inf is compared step by step, bad sets of files
//! are refused with the file named, and `amprobe run -- CMD` summarizes the rank files a
//! command wrote.

use amprobe::diagnose::ranks::{
    rank_files, rank_path, read_rank_traces, summary_of_ranks, RanksSummary,
};
use amprobe::diagnose::text::diagnosis_lines;
use amprobe::diagnose::DiagnoseOptions;
use amprobe::trace::record::{
    EndRecord, Header, OpRecord, OpRef, Origins, ParamRecord, Phase, Source, StepRecord, TensorMeta,
};
use amprobe::trace::{TensorStats, TraceWriter};
use amprobe::DType;
use std::path::{Path, PathBuf};

fn header(rank: u32, world: u32, model: &str) -> Header {
    Header {
        model: model.into(),
        precision: "fp16".into(),
        autocast_dtype: Some(DType::F16),
        policy_device: "cpu".into(),
        backend: "cpu".into(),
        command_line: vec!["python".into(), "train.py".into()],
        source: Some(Source {
            kind: "pytorch".into(),
            torch: Some("2.15.0".into()),
            rank,
            world_size: world,
            sample_every: 0,
            run_id: None,
            transformers: None,
            discovery: None,
            requested_precision: None,
            compiled: None,
        }),
        ..Header::new()
    }
}

/// An op whose output holds `bad` non-finite values (NaN) among 8.
fn op(index: u64, phase: Phase, name: &str, module: &str, bad: usize) -> OpRecord {
    let mut data = vec![1.0f32; 8];
    for x in data.iter_mut().take(bad) {
        *x = f32::NAN;
    }
    OpRecord {
        micro: 0,
        index,
        phase,
        op: name.into(),
        module: module.into(),
        inputs: vec![],
        output: TensorMeta {
            dtype: DType::F32,
            shape: vec![8],
        },
        stats: TensorStats::compute(DType::F32, &data),
        rounding: Default::default(),
        forward_op: None,
        wrt: None,
        masked_neg_inf: 0,
        additive_mask: false,
        blame: None,
    }
}

/// A step; `ops` given, its origins are the ops named by `inf` and `nan` (indices into
/// `ops`).
fn step(
    n: u64,
    found_inf: bool,
    ops: Option<Vec<OpRecord>>,
    inf: Option<usize>,
    nan: Option<usize>,
) -> StepRecord {
    let at = |i: Option<usize>| {
        i.map(|i| OpRef::from_op(n, &ops.as_ref().expect("ops for an origin")[i]))
    };
    let first_inf = at(inf);
    let first_nan = at(nan);
    let chain = [first_inf.clone(), first_nan.clone()]
        .into_iter()
        .flatten()
        .collect();
    StepRecord {
        step: n,
        micro_batches: 1,
        loss: Some(2.0),
        scaled_loss: Some(2.0 * 65536.0),
        scale_before: 65536.0,
        scale_after: if found_inf { 32768.0 } else { 65536.0 },
        found_inf,
        skipped: found_inf,
        growth_tracker: 0,
        grad_norm: None,
        clip_coef: None,
        lr: 0.05,
        weight_casts: 0,
        origins: Origins {
            first_inf,
            first_nan,
            chain,
        },
        params: vec![ParamRecord::from_grad(
            "module.embed.weight",
            DType::F32,
            DType::F32,
            &[0.25, -0.5],
            65536.0,
            &[1.0, -1.0],
        )],
        ops,
        op_count: 0,
        events: vec![],
        wall_ms: 1.0,
        skip_cause: None,
    }
}

fn write(path: &Path, h: &Header, steps: &[StepRecord]) {
    let mut w = TraceWriter::create(path, h).unwrap();
    for s in steps {
        w.write_step(s).unwrap();
    }
    w.finish(&EndRecord {
        steps: steps.len() as u64,
        verdict: String::new(),
        wall_ms: 1.0,
    })
    .unwrap();
}

fn clean(n: u64) -> StepRecord {
    step(n, false, None, None, None)
}

/// The ops of a DDP backward on a rank that made the NaN itself (forward op 1) or, with
/// `made` false, on one that only received it: the all-reduce of the gradient bucket
/// (op 3), then the gradients as views of the bucket (op 4).
fn ddp_step_ops(made: bool) -> Vec<OpRecord> {
    let bad = usize::from(made) * 8;
    vec![
        op(0, Phase::Forward, "_to_copy", "module.embed", 0),
        op(1, Phase::Forward, "addmm", "module.embed", bad),
        op(2, Phase::Backward, "mm", "module.embed", bad),
        op(3, Phase::Backward, "allreduce_", "module.embed", 0),
        op(4, Phase::Backward, "as_strided", "", 8),
    ]
}

fn summarize(dir: &Path) -> amprobe::diagnose::summary::RunSummary {
    let ranks = read_rank_traces(&dir.join("t.jsonl")).unwrap();
    summary_of_ranks(&ranks, DiagnoseOptions::default()).unwrap()
}

fn ranks_of(s: &amprobe::diagnose::summary::RunSummary) -> &RanksSummary {
    s.ranks.as_ref().expect("a summary over ranks")
}

#[test]
fn rank_files_are_named_as_the_companion_names_them() {
    assert_eq!(
        rank_path(Path::new("out/t.jsonl"), 1),
        PathBuf::from("out/t.rank1.jsonl")
    );
    assert_eq!(
        rank_path(Path::new("a.b.jsonl"), 0),
        PathBuf::from("a.b.rank0.jsonl")
    );
    assert_eq!(
        rank_path(Path::new("trace"), 3),
        PathBuf::from("trace.rank3")
    );
    assert_eq!(
        rank_path(Path::new(".trace"), 2),
        PathBuf::from(".trace.rank2")
    );
    let d = tempfile::tempdir().unwrap();
    for name in [
        "t.rank0.jsonl",
        "t.rank12.jsonl",
        "t.rankx.jsonl",
        "t.rank1.json",
        "u.rank1.jsonl",
    ] {
        std::fs::write(d.path().join(name), "").unwrap();
    }
    let found = rank_files(&d.path().join("t.jsonl")).unwrap();
    let ranks: Vec<u32> = found.iter().map(|(r, _)| *r).collect();
    assert_eq!(ranks, vec![0, 12]);
    assert_eq!(found[1].1, d.path().join("t.rank12.jsonl"));
}

#[test]
fn the_rank_that_made_the_nan_is_first_and_the_one_that_received_it_is_not() {
    let d = tempfile::tempdir().unwrap();
    let t = d.path().join("t.jsonl");
    // Rank 0 received the NaN through the all-reduce; its origin (the bucket's view, op 4)
    // comes after one collective. Rank 1 made it in the forward pass, before any.
    write(
        &rank_path(&t, 0),
        &header(0, 2, "DistributedDataParallel"),
        &[
            clean(0),
            step(1, true, Some(ddp_step_ops(false)), None, Some(4)),
            // Uninitialized memory that held a NaN (a buffer for a collective's output): no
            // origin.
            step(
                2,
                false,
                Some(vec![op(0, Phase::Backward, "empty_like", "", 8)]),
                None,
                Some(0),
            ),
        ],
    );
    write(
        &rank_path(&t, 1),
        &header(1, 2, "DistributedDataParallel"),
        &[
            clean(0),
            step(1, true, Some(ddp_step_ops(true)), None, Some(1)),
            clean(2),
        ],
    );
    let s = summarize(d.path());
    let r = ranks_of(&s);
    assert_eq!(r.world_size, 2);
    let nan = r.first_nan.as_ref().unwrap();
    assert_eq!((nan.rank, nan.op.step, nan.received), (1, 1, false));
    assert_eq!(
        (nan.op.op.as_str(), nan.op.module.as_str()),
        ("addmm", "embed")
    );
    assert_eq!(nan.collectives_before, 0);
    assert!(r.first_inf.is_none());
    let r0 = r.ranks[0].first_nan.as_ref().unwrap();
    assert!(r0.received && r0.collectives_before == 1 && r0.op.op == "as_strided");
    let f = r.first_failure.as_ref().unwrap();
    assert_eq!(
        (f.step, &f.made_by, &f.received_by),
        (1, &vec![1], &vec![0])
    );
    assert_eq!(f.through, vec!["allreduce_".to_string()]);
    assert!(r.found_inf_agreed);
    assert_eq!(r.found_inf.len(), 1);
    assert_eq!(
        (r.found_inf[0].step, &r.found_inf[0].found),
        (1, &vec![0, 1])
    );
    // The whole summary: the first NaN is rank 1's, names as the user's model names them
    // (the DDP wrapper's `module.` taken out), the worst verdict of the two ranks.
    assert_eq!(s.first_nan.as_ref().unwrap().module, "embed");
    assert_eq!(s.verdict, "forward-nonfinite");
    assert_eq!(s.chain.len(), 1);
    assert!(s.params.contains_key("embed.weight"));
    assert_eq!(r.ranks[0].verdict, "overflow-skips");
    let text = diagnosis_lines(&s).join("\n");
    for want in [
        "first NaN: rank 1, step 1 forward op #1 `addmm` in `embed`, made on rank 1",
        "step 1: made on rank 1; rank 0 received them through a collective (`allreduce_`)",
        "found_inf: the ranks agreed at every step (all found an Inf or NaN at step(s) 1)",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
    let json = serde_json::to_value(&s).unwrap();
    assert_eq!(json["ranks"]["first_nan"]["rank"], 1);
    assert_eq!(json["ranks"]["first_failure"]["received_by"][0], 0);
}

#[test]
fn an_origin_made_after_a_collective_still_comes_before_one_received_earlier_in_the_step() {
    // Rank 1 overflowed in a backward op after the first bucket's all-reduce (op 2); rank 0
    // received it through the second (op 5) and recorded the bucket view (op 6) as its
    // origin, at a lower op index than rank 1's origin. Made comes before received.
    let d = tempfile::tempdir().unwrap();
    let t = d.path().join("t.jsonl");
    let r1 = vec![
        op(0, Phase::Forward, "addmm", "head", 0),
        op(1, Phase::Backward, "mm", "head", 0),
        op(2, Phase::Backward, "allreduce_", "head", 0),
        op(3, Phase::Backward, "mm", "blocks.0", 0),
        op(4, Phase::Backward, "mm", "blocks.0", 0),
        op(5, Phase::Backward, "mm", "blocks.0", 0),
        op(6, Phase::Backward, "mm", "blocks.0", 0),
        op(7, Phase::Backward, "mm", "embed", 8),
        op(8, Phase::Backward, "allreduce_", "embed", 8),
    ];
    let r0 = vec![
        op(0, Phase::Forward, "addmm", "head", 0),
        op(1, Phase::Backward, "mm", "head", 0),
        op(2, Phase::Backward, "allreduce_", "head", 0),
        op(3, Phase::Backward, "mm", "embed", 0),
        op(4, Phase::Backward, "mm", "embed", 0),
        op(5, Phase::Backward, "allreduce_", "embed", 0),
        op(6, Phase::Backward, "as_strided", "", 8),
    ];
    write(
        &rank_path(&t, 0),
        &header(0, 2, "Net"),
        &[step(0, true, Some(r0), Some(6), None)],
    );
    write(
        &rank_path(&t, 1),
        &header(1, 2, "Net"),
        &[step(0, true, Some(r1), Some(7), None)],
    );
    let s = summarize(d.path());
    let r = ranks_of(&s);
    let inf = r.first_inf.as_ref().unwrap();
    assert_eq!((inf.rank, inf.op.op_index, inf.received), (1, 7, false));
    assert_eq!(inf.collectives_before, 1);
    let o0 = r.ranks[0].first_inf.as_ref().unwrap();
    assert_eq!((o0.collectives_before, o0.received), (2, true));
    assert_eq!(s.first_inf.as_ref().unwrap().module, "embed");
    assert_eq!(s.verdict, "overflow-skips");
}

#[test]
fn ranks_that_both_made_one_are_both_named_and_the_lower_op_index_is_first() {
    let d = tempfile::tempdir().unwrap();
    let t = d.path().join("t.jsonl");
    let ops = |bad_at: u64| -> Vec<OpRecord> {
        (0..4)
            .map(|i| {
                op(
                    i,
                    Phase::Forward,
                    "addmm",
                    &format!("l{i}"),
                    if i >= bad_at { 8 } else { 0 },
                )
            })
            .collect()
    };
    write(
        &rank_path(&t, 0),
        &header(0, 2, "Net"),
        &[step(0, true, Some(ops(2)), None, Some(2))],
    );
    write(
        &rank_path(&t, 1),
        &header(1, 2, "Net"),
        &[step(0, true, Some(ops(1)), None, Some(1))],
    );
    let s = summarize(d.path());
    let r = ranks_of(&s);
    let f = r.first_failure.as_ref().unwrap();
    assert_eq!(f.made_by, vec![0, 1]);
    assert!(f.received_by.is_empty());
    let nan = r.first_nan.as_ref().unwrap();
    assert_eq!((nan.rank, nan.op.module.as_str()), (1, "l1"));
    let text = diagnosis_lines(&s).join("\n");
    assert!(text.contains("step 0: made on ranks 0, 1."), "{text}");
}

#[test]
fn ranks_that_disagree_on_found_inf_are_reported_step_by_step() {
    // Rank 1's gradients went non-finite without a collective carrying them (no_sync, say):
    // rank 1 skipped step 1 and rank 0 stepped. Rank 1 stopped before step 3.
    let d = tempfile::tempdir().unwrap();
    let t = d.path().join("t.jsonl");
    let bad = vec![
        op(0, Phase::Forward, "addmm", "embed", 0),
        op(1, Phase::Backward, "mm", "embed", 8),
    ];
    write(
        &rank_path(&t, 0),
        &header(0, 2, "Net"),
        &[clean(0), clean(1), clean(2), clean(3)],
    );
    write(
        &rank_path(&t, 1),
        &header(1, 2, "Net"),
        &[clean(0), step(1, true, Some(bad), None, Some(1)), clean(2)],
    );
    let s = summarize(d.path());
    let r = ranks_of(&s);
    assert!(!r.found_inf_agreed);
    type Row = (u64, Vec<u32>, Vec<u32>, Vec<u32>, bool);
    let by: Vec<Row> = r
        .found_inf
        .iter()
        .map(|f| {
            (
                f.step,
                f.found.clone(),
                f.not_found.clone(),
                f.missing.clone(),
                f.agreed,
            )
        })
        .collect();
    assert_eq!(
        by,
        vec![
            (1, vec![1], vec![0], vec![], false),
            (3, vec![], vec![0], vec![1], false)
        ]
    );
    let nan = r.first_nan.as_ref().unwrap();
    assert_eq!(
        (nan.rank, nan.op.phase, nan.received),
        (1, Phase::Backward, false)
    );
    let text = diagnosis_lines(&s).join("\n");
    assert!(
        text.contains("found_inf: the ranks DISAGREED at step 1 (found by rank 1, not by rank 0)"),
        "{text}"
    );
    assert!(text.contains("their weights differ from here on"), "{text}");
    assert!(
        text.contains("DISAGREED at step 3 (not by rank 0, no record from rank 1)"),
        "{text}"
    );
    assert!(!text.contains("agreed at every step"), "{text}");
}

#[test]
fn a_clean_run_over_ranks_has_no_origin_and_agrees() {
    let d = tempfile::tempdir().unwrap();
    let t = d.path().join("t.jsonl");
    for r in 0..3 {
        // Rank 2's buffer for a collective's output held a NaN before the collective wrote
        // it: uninitialized memory, not an origin.
        let second = if r == 2 {
            step(
                1,
                false,
                Some(vec![op(0, Phase::Backward, "empty_like", "", 8)]),
                None,
                Some(0),
            )
        } else {
            clean(1)
        };
        write(&rank_path(&t, r), &header(r, 3, "Net"), &[clean(0), second]);
    }
    let s = summarize(d.path());
    let r = ranks_of(&s);
    assert_eq!(r.world_size, 3);
    assert!(
        r.first_inf.is_none() && r.first_nan.is_none() && r.first_failure.is_none(),
        "{r:?}"
    );
    assert!(r.found_inf_agreed && r.found_inf.is_empty());
    assert!(s.first_inf.is_none() && s.first_nan.is_none() && s.chain.is_empty());
    assert_eq!(s.verdict, "clean");
    // Not a DDP wrapper's trace: names are left as they are.
    assert!(s.params.contains_key("module.embed.weight"));
    let text = diagnosis_lines(&s).join("\n");
    assert!(
        text.contains("the ranks agreed at every step (none found an Inf or NaN)"),
        "{text}"
    );
}

fn err_text(dir: &Path) -> String {
    match read_rank_traces(&dir.join("t.jsonl")) {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn files_that_do_not_belong_together_are_refused_with_the_file_named() {
    let d = tempfile::tempdir().unwrap();
    let t = d.path().join("t.jsonl");
    let p0 = rank_path(&t, 0);
    let p1 = rank_path(&t, 1);
    // No rank 0.
    write(&p1, &header(1, 2, "Net"), &[clean(0)]);
    let e = err_text(d.path());
    assert!(
        e.contains("t.rank0.jsonl") && e.contains("no such file"),
        "{e}"
    );
    // A missing rank.
    std::fs::remove_file(&p1).unwrap();
    write(&p0, &header(0, 2, "Net"), &[clean(0)]);
    let e = err_text(d.path());
    assert!(
        e.contains("t.rank1.jsonl") && e.contains("2 ranks") && e.contains("rank 1 wrote no trace"),
        "{e}"
    );
    // Another world size.
    write(&p1, &header(1, 4, "Net"), &[clean(0)]);
    let e = err_text(d.path());
    assert!(
        e.contains("t.rank1.jsonl") && e.contains("world_size is 4, expected 2"),
        "{e}"
    );
    // Another run's file: another command line, or another run id.
    let mut other = header(1, 2, "Net");
    other.command_line = vec!["python".into(), "other.py".into()];
    write(&p1, &other, &[clean(0)]);
    let e = err_text(d.path());
    assert!(
        e.contains("t.rank1.jsonl") && e.contains("command_line") && e.contains("other.py"),
        "{e}"
    );
    let with_id = |r: u32, id: &str| {
        let mut h = header(r, 2, "Net");
        h.source.as_mut().unwrap().run_id = Some(id.into());
        h
    };
    write(&p0, &with_id(0, "a"), &[clean(0)]);
    write(&p1, &with_id(1, "b"), &[clean(0)]);
    let e = err_text(d.path());
    assert!(e.contains("run_id is `b`, expected `a`"), "{e}");
    // A file whose header names another rank than its name.
    write(&p0, &header(0, 2, "Net"), &[clean(0)]);
    write(&p1, &header(0, 2, "Net"), &[clean(0)]);
    let e = err_text(d.path());
    assert!(
        e.contains("t.rank1.jsonl") && e.contains("source.rank is 0, expected 1"),
        "{e}"
    );
    // A rank past the world size.
    write(&p1, &header(1, 2, "Net"), &[clean(0)]);
    write(&rank_path(&t, 2), &header(2, 3, "Net"), &[clean(0)]);
    let e = err_text(d.path());
    assert!(
        e.contains("t.rank2.jsonl") && e.contains("run had 2 ranks"),
        "{e}"
    );
    std::fs::remove_file(rank_path(&t, 2)).unwrap();
    // A trace of amprobe's own run (no source).
    let mut own = header(0, 2, "Net");
    own.source = None;
    write(&p0, &own, &[clean(0)]);
    let e = err_text(d.path());
    assert!(
        e.contains("t.rank0.jsonl") && e.contains("no `source`"),
        "{e}"
    );
    // Together again, they read.
    write(&p0, &header(0, 2, "Net"), &[clean(0)]);
    assert_eq!(read_rank_traces(&t).unwrap().len(), 2);
}

#[test]
fn amprobe_run_summarizes_the_rank_traces_a_command_wrote() {
    // A stand-in for torchrun: it writes the two rank traces where AMPROBE_TRACE says.
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    std::fs::create_dir(&src).unwrap();
    let t = src.join("t.jsonl");
    write(
        &rank_path(&t, 0),
        &header(0, 2, "DistributedDataParallel"),
        &[
            clean(0),
            step(1, true, Some(ddp_step_ops(false)), None, Some(4)),
        ],
    );
    write(
        &rank_path(&t, 1),
        &header(1, 2, "DistributedDataParallel"),
        &[
            clean(0),
            step(1, true, Some(ddp_step_ops(true)), None, Some(1)),
        ],
    );
    let out = d.path().join("run").join("captured.jsonl");
    std::fs::create_dir(out.parent().unwrap()).unwrap();
    // A stale rank file of an earlier, bigger run is removed before the command runs.
    write(&rank_path(&out, 2), &header(2, 3, "Net"), &[clean(0)]);
    let json = d.path().join("s.json");
    let script = format!(
        "cp {} \"${{AMPROBE_TRACE%.jsonl}}.rank0.jsonl\" && cp {} \"${{AMPROBE_TRACE%.jsonl}}.rank1.jsonl\"",
        rank_path(&t, 0).display(),
        rank_path(&t, 1).display()
    );
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .args(["run", "--trace"])
        .arg(&out)
        .arg("--summary-json")
        .arg(&json)
        .args(["--fail-on", "nonfinite", "--", "sh", "-c", &script])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(1),
        "{stdout}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(stdout.contains("verdict: forward-nonfinite"), "{stdout}");
    assert!(
        stdout
            .contains("first NaN: rank 1, step 1 forward op #1 `addmm` in `embed`, made on rank 1"),
        "{stdout}"
    );
    assert!(!rank_path(&out, 2).exists());
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(s["ranks"]["first_nan"]["rank"], 1);
    assert_eq!(s["ranks"]["found_inf_agreed"], true);
    assert_eq!(s["first_nan"]["module"], "embed");
    // A command that wrote nothing is told where neither kind of trace was.
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_amprobe"))
        .args(["run", "--trace"])
        .arg(&out)
        .args(["--", "true"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.code() != Some(0) && stderr.contains("captured.rank0.jsonl"),
        "{stderr}"
    );
}
