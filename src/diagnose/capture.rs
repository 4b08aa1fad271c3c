//! What a captured run's trace header says of the capture itself, as lines for its
//! summary: what the companion's discovery found (and where it was unsure), and a 16-bit
//! precision the training library was asked for that the ops did not run in.

use crate::trace::record::Header;

/// The header's capture notes, in the order the summary prints them.
pub fn notes(h: &Header) -> Vec<String> {
    let Some(src) = h.source.as_ref() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    if let Some(d) = &src.discovery {
        out.push(format!(
            "found as the script made them: {} trained by {}, scaler {}",
            list(&d.models, "no model"),
            list(&d.optimizers, "no optimizer"),
            d.scaler.as_deref().unwrap_or("none")
        ));
        if let Some(note) = d.note.as_deref().filter(|n| !n.is_empty()) {
            out.push(format!("discovery: {note}"));
        }
    }
    if let Some(c) = &src.compiled {
        out.push(compiled_note(c));
    }
    if let Some(r) = &src.requested_precision {
        if let Some(note) = precision_note(&r.precision, &r.by, &h.precision) {
            out.push(note);
        }
    }
    out
}

/// What the summary says of a model `torch.compile` compiled.
fn compiled_note(c: &crate::trace::record::Compiled) -> String {
    let names = c
        .regions
        .iter()
        .map(|r| {
            if r.is_empty() {
                "the model".to_string()
            } else {
                format!("`{r}`")
            }
        })
        .collect::<Vec<_>>()
        .join(", ");
    if c.ran == "eager" {
        format!(
            "torch.compile: {names} ran eagerly while watched (the companion sets Dynamo's stance to \
             force_eager, and puts it back at close): these are eager PyTorch's ops, whose last bits and \
             speed can differ from the compiled kernels'; a failure seen here is eager's"
        )
    } else {
        format!("torch.compile: {names} ran compiled, unseen inside its graphs")
    }
}

fn list(items: &[String], none: &str) -> String {
    if items.is_empty() {
        none.to_string()
    } else {
        items.join(" + ")
    }
}

/// What the summary says where the library was asked for `asked` and the ops ran in `ran`
/// (the header's precision): nothing where they agree.
fn precision_note(asked: &str, by: &str, ran: &str) -> Option<String> {
    let ran_16 = matches!(ran, "fp16" | "bf16" | "half" | "bfloat16-pure");
    if ran_16 && (ran.starts_with(asked) || (asked == "bf16" && ran == "bfloat16-pure")) {
        return None;
    }
    if ran == "fp32" {
        return Some(format!(
            "{by} asked for {asked}, but no matrix product ran in 16 bits: the training ran in fp32 \
             (the library falls back to fp32 without saying so where it cannot run {asked}, as for fp16 on a CPU)"
        ));
    }
    if asked == "fp8" {
        return None;
    }
    Some(format!("{by} asked for {asked}, but the ops ran in {ran}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::record::{Discovery, RequestedPrecision, Source};

    fn header(precision: &str, asked: Option<&str>, discovery: Option<Discovery>) -> Header {
        Header {
            precision: precision.into(),
            source: Some(Source {
                kind: "pytorch".into(),
                torch: None,
                rank: 0,
                world_size: 1,
                sample_every: 0,
                run_id: None,
                transformers: None,
                discovery: discovery.map(Box::new),
                compiled: None,
                requested_precision: asked.map(|a| RequestedPrecision {
                    precision: a.into(),
                    by: "Accelerate (mixed_precision='fp16')".into(),
                }),
            }),
            ..Header::new()
        }
    }

    #[test]
    fn a_16_bit_request_that_ran_in_fp32_is_told() {
        let n = notes(&header("fp32", Some("fp16"), None));
        assert_eq!(n.len(), 1);
        assert!(
            n[0].contains("asked for fp16") && n[0].contains("ran in fp32"),
            "{n:?}"
        );
        assert!(notes(&header("fp16", Some("fp16"), None)).is_empty());
        assert!(notes(&header("bf16", Some("bf16"), None)).is_empty());
        let other = notes(&header("fp16", Some("bf16"), None));
        assert!(
            other[0].contains("asked for bf16, but the ops ran in fp16"),
            "{other:?}"
        );
    }

    #[test]
    fn discovery_says_what_it_found_and_where_it_was_unsure() {
        let d = Discovery {
            models: vec!["Net".into()],
            optimizers: vec!["AdamW".into()],
            scalers: vec!["GradScaler".into(), "GradScaler".into()],
            scaler: Some("GradScaler".into()),
            note: Some("2 enabled GradScalers were made".into()),
        };
        let n = notes(&header("fp16", None, Some(d)));
        assert_eq!(
            n[0],
            "found as the script made them: Net trained by AdamW, scaler GradScaler"
        );
        assert_eq!(n[1], "discovery: 2 enabled GradScalers were made");
        assert!(notes(&Header::new()).is_empty());
    }

    #[test]
    fn a_compiled_model_run_eagerly_is_told() {
        let mut h = header("bf16", None, None);
        h.source.as_mut().unwrap().compiled = Some(Box::new(crate::trace::record::Compiled {
            regions: vec!["".into(), "encoder".into()],
            ran: "eager".into(),
        }));
        let n = notes(&h);
        assert!(
            n[0].starts_with("torch.compile: the model, `encoder` ran eagerly while watched"),
            "{n:?}"
        );
    }
}
