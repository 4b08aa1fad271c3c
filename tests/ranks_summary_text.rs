//! The human summary of a run over several ranks names the rank its figures come from: its
//! first Inf, first NaN and chain lines say which rank recorded them, and a line above its
//! step lines says whose steps they are. A trace read alone keeps its lines as they were.

mod rank_fixture;

use amprobe::diagnose::summary::summary_of_trace;
use amprobe::diagnose::text::{origin_lines, steps_heading};
use amprobe::diagnose::DiagnoseOptions;
use amprobe::trace::io::read_trace;
use rank_fixture::*;

#[test]
fn the_human_summary_names_the_rank_of_the_first_inf_nan_and_chain_and_whose_steps() {
    let d = tempfile::tempdir().unwrap();
    let s = two_ranks(d.path());
    let heading = steps_heading(&s).expect("a heading over several ranks");
    assert!(
        heading.contains("steps of rank 0") && heading.contains("2 ranks"),
        "{heading}"
    );
    assert_eq!(
        origin_lines(&s),
        vec![
            "  first Inf: rank 1, step 2 forward op #6 `mul` in `fc`",
            "  first NaN: rank 1, step 2 forward op #7 `sub` in `fc`",
            "  chain: rank 1, mul@fc -> sub@fc",
        ]
    );
}

#[test]
fn over_several_ranks_no_origin_is_none_on_any_rank() {
    let d = tempfile::tempdir().unwrap();
    let s = clean_ranks(d.path(), 1);
    assert_eq!(
        origin_lines(&s),
        vec![
            "  first Inf: none on any rank",
            "  first NaN: none on any rank"
        ]
    );
}

#[test]
fn a_trace_read_alone_names_no_rank() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("one.jsonl");
    write(&p, &header(0, 1), &[step(0, false), step(1, true)]);
    let s = summary_of_trace(&read_trace(&p).unwrap(), None, DiagnoseOptions::default()).unwrap();
    assert_eq!(steps_heading(&s), None);
    assert_eq!(
        origin_lines(&s),
        vec![
            "  first Inf: step 1 forward op #6 `mul` in `fc`",
            "  first NaN: step 1 forward op #7 `sub` in `fc`",
            "  chain: mul@fc -> sub@fc",
        ]
    );
}
