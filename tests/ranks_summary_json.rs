//! The summary JSON of a run over several ranks says which rank each of its top-level
//! origins comes from: `first_inf` / `first_nan` are `ranks.first_inf.op` /
//! `ranks.first_nan.op`, whose `rank` names theirs, and `ranks.chain_rank` names the rank
//! whose chain the top-level `chain` is.

mod rank_fixture;

use rank_fixture::*;

#[test]
fn the_top_level_origins_and_chain_have_their_rank_under_ranks() {
    let d = tempfile::tempdir().unwrap();
    let s = two_ranks(d.path());
    let j = serde_json::to_value(&s).unwrap();
    let r = &j["ranks"];
    assert_eq!(r["shown_rank"], 0);
    for what in ["first_inf", "first_nan"] {
        assert_eq!(r[what]["op"], j[what], "{what}");
        assert_eq!(r[what]["rank"], 1, "{what}");
    }
    assert_eq!(j["chain"].as_array().unwrap().len(), 2);
    assert_eq!(r["chain_rank"], 1, "{r}");
}

#[test]
fn a_run_over_ranks_without_a_chain_has_no_chain_rank() {
    let d = tempfile::tempdir().unwrap();
    let s = clean_ranks(d.path(), 2);
    let j = serde_json::to_value(&s).unwrap();
    assert!(j["chain"].as_array().unwrap().is_empty());
    let r = j["ranks"].as_object().unwrap();
    assert!(r.contains_key("chain_rank"), "{r:?}");
    assert!(r["chain_rank"].is_null());
}
