//! Export of a trace to the Chrome trace-event format (JSON), which Perfetto and
//! chrome://tracing open.
//!
//! Layout (one process, one thread):
//! - each step is an `X` slice lasting its measured wall time, steps back to back;
//! - inside it, one `X` slice per run of ops of the same micro-batch and phase, and inside
//!   those one `X` slice per op, with the op's statistics as args. A trace records no
//!   per-op time, so the step's time is split evenly over its ops, in execution order (the
//!   order and nesting are real, the op durations are not);
//! - `C` counters `loss scale` and `loss`, one value per step;
//! - `i` instant events for the first Inf / first NaN origins (at their op), skipped steps
//!   (with the cause) and step events.

use super::facts::{self, module_name};
use super::trace_file::TraceFile;
use crate::error::{Error, Result};
use crate::trace::record::{OpRecord, OpRef, StepRecord};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::path::Path;

const PID: u64 = 1;
const TID: u64 = 1;

/// A float as a JSON value: a number when finite, else `"NaN"`, `"inf"`, `"-inf"` (as in
/// the trace).
fn num(x: f64) -> Value {
    if x.is_finite() {
        json!(x)
    } else if x.is_nan() {
        json!("NaN")
    } else if x > 0.0 {
        json!("inf")
    } else {
        json!("-inf")
    }
}

/// Nanoseconds to the format's microseconds.
fn us(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

fn op_args(s: &StepRecord, o: &OpRecord) -> Value {
    let st = &o.stats;
    let mut a = Map::new();
    a.insert("step".into(), json!(s.step));
    a.insert("index".into(), json!(o.index));
    a.insert("micro".into(), json!(o.micro));
    a.insert("phase".into(), json!(o.phase.name()));
    a.insert("op".into(), json!(o.op));
    a.insert("module".into(), json!(module_name(&o.module)));
    a.insert(
        "output".into(),
        json!(format!("{}{:?}", o.output.dtype, o.output.shape)),
    );
    a.insert(
        "inputs".into(),
        json!(o
            .inputs
            .iter()
            .map(|i| format!("{}{:?}", i.dtype, i.shape))
            .collect::<Vec<_>>()),
    );
    if let Some(f) = o.forward_op {
        a.insert("forward_op".into(), json!(f));
    }
    if let Some(w) = &o.wrt {
        a.insert("wrt".into(), json!(w));
    }
    a.insert("numel".into(), json!(st.numel));
    a.insert("nan".into(), json!(st.nan));
    a.insert("pos_inf".into(), json!(st.pos_inf));
    a.insert("neg_inf".into(), json!(st.neg_inf));
    a.insert("zeros".into(), json!(st.zeros));
    a.insert("subnormal".into(), json!(st.subnormal));
    a.insert("max_abs".into(), num(st.max_abs));
    a.insert(
        "min_abs_nonzero".into(),
        st.min_abs_nonzero.map_or(Value::Null, num),
    );
    a.insert("l2".into(), num(st.l2()));
    a.insert(
        "fp16_headroom_pct".into(),
        num(facts::headroom_ratio(s, o) * 100.0),
    );
    a.insert("rounding_overflow".into(), json!(o.rounding.overflow));
    a.insert("rounding_underflow".into(), json!(o.rounding.underflow));
    a.insert("to_f16_overflow".into(), json!(st.to_f16.overflow));
    a.insert("to_f16_underflow".into(), json!(st.to_f16.underflow));
    a.insert("to_bf16_overflow".into(), json!(st.to_bf16.overflow));
    a.insert("to_bf16_underflow".into(), json!(st.to_bf16.underflow));
    if o.masked_neg_inf > 0 {
        a.insert("masked_neg_inf".into(), json!(o.masked_neg_inf));
    }
    Value::Object(a)
}

fn origin_args(kind: &str, o: &OpRef) -> Value {
    json!({
        "kind": kind,
        "step": o.step,
        "micro": o.micro,
        "phase": o.phase.name(),
        "op_index": o.op_index,
        "op": o.op,
        "module": module_name(&o.module),
    })
}

/// The trace as a Chrome trace-event JSON document (`{"traceEvents": [...], ...}`).
pub fn to_trace_events(tf: &TraceFile) -> Value {
    let t = &tf.trace;
    let h = &t.header;
    let mut ev: Vec<Value> = vec![
        json!({"ph": "M", "name": "process_name", "pid": PID, "tid": 0,
               "args": {"name": format!("amprobe: {} ({})", h.model, h.precision)}}),
        json!({"ph": "M", "name": "thread_name", "pid": PID, "tid": TID,
               "args": {"name": "training steps (op durations: even shares of the step)"}}),
    ];
    let mut counters: Vec<Value> = Vec::new();
    let mut instants: Vec<Value> = Vec::new();
    let mut t0: u64 = 0;
    for s in &t.steps {
        let n_ops = s.ops.as_ref().map_or(0, Vec::len) as u64;
        // Whole nanoseconds, at least one per op, so the nesting is exact.
        let wall = if s.wall_ms.is_finite() && s.wall_ms > 0.0 {
            (s.wall_ms * 1e6).round() as u64
        } else {
            0
        };
        let dur = wall.max(n_ops).max(1);
        ev.push(step_event(s, n_ops, t0, dur));
        let op_ts = op_events(&mut ev, s, n_ops, t0, dur);
        step_counters(&mut counters, s, t0);
        step_instants(&mut instants, tf, s, t0, &op_ts);
        t0 += dur;
    }
    if let Some(last) = t.steps.last() {
        counters.push(
            json!({"ph": "C", "name": "loss scale", "pid": PID, "ts": us(t0),
                             "args": {"scale": num(last.scale_after)}}),
        );
    }
    // Per track in time order: origins sit at their op, skips and events at the step start.
    instants.sort_by(|a, b| {
        let ts = |v: &Value| v["ts"].as_f64().unwrap_or(0.0);
        ts(a).total_cmp(&ts(b))
    });
    ev.extend(counters);
    ev.extend(instants);
    json!({"traceEvents": ev, "displayTimeUnit": "ms", "otherData": other_data(tf)})
}

/// Step `s` as one slice from `t0`, `dur` long, its figures as arguments.
fn step_event(s: &StepRecord, n_ops: u64, t0: u64, dur: u64) -> Value {
    let mut step_args = json!({
        "step": s.step,
        "loss": s.loss.map_or(Value::Null, num),
        "scale_before": num(s.scale_before),
        "scale_after": num(s.scale_after),
        "skipped": s.skipped,
        "found_inf": s.found_inf,
        "grad_norm": s.grad_norm.map_or(Value::Null, num),
        "op_count": s.op_count,
        "op_records": n_ops > 0,
        "wall_ms": num(s.wall_ms),
    });
    if !s.events.is_empty() {
        step_args["events"] = json!(s.events);
    }
    json!({"ph": "X", "name": format!("step {}", s.step), "cat": "step",
           "pid": PID, "tid": TID, "ts": us(t0), "dur": us(dur), "args": step_args})
}

/// A slice per run of ops of one micro-batch and phase, and one per op inside it, each op
/// an even share of the step; returns each op's start by (micro-batch, index).
fn op_events(
    ev: &mut Vec<Value>,
    s: &StepRecord,
    n_ops: u64,
    t0: u64,
    dur: u64,
) -> BTreeMap<(u32, u64), u64> {
    let mut op_ts = BTreeMap::new();
    let Some(ops) = &s.ops else { return op_ts };
    let d = dur / n_ops.max(1);
    let mut i = 0usize;
    while i < ops.len() {
        let (micro, phase) = (ops[i].micro, ops[i].phase);
        let mut j = i;
        while j < ops.len() && ops[j].micro == micro && ops[j].phase == phase {
            j += 1;
        }
        let start = t0 + i as u64 * d;
        ev.push(
            json!({"ph": "X", "name": format!("{} (micro-batch {micro})", phase.name()),
                       "cat": "phase", "pid": PID, "tid": TID, "ts": us(start),
                       "dur": us((j - i) as u64 * d), "args": {"ops": j - i}}),
        );
        for (k, o) in ops[i..j].iter().enumerate() {
            let ts = start + k as u64 * d;
            op_ts.insert((o.micro, o.index), ts);
            ev.push(json!({"ph": "X",
                           "name": format!("{} @ {}", o.op, module_name(&o.module)),
                           "cat": o.phase.name(), "pid": PID, "tid": TID,
                           "ts": us(ts), "dur": us(d), "args": op_args(s, o)}));
        }
        i = j;
    }
    op_ts
}

/// The loss scale and (finite) loss of step `s` at its start.
fn step_counters(counters: &mut Vec<Value>, s: &StepRecord, t0: u64) {
    counters.push(
        json!({"ph": "C", "name": "loss scale", "pid": PID, "ts": us(t0),
                         "args": {"scale": num(s.scale_before)}}),
    );
    if let Some(l) = s.loss.filter(|l| l.is_finite()) {
        counters.push(json!({"ph": "C", "name": "loss", "pid": PID, "ts": us(t0),
                             "args": {"loss": l}}));
    }
}

/// Step `s`'s first Inf and NaN at their ops (`op_ts`), its skip and its events.
fn step_instants(
    instants: &mut Vec<Value>,
    tf: &TraceFile,
    s: &StepRecord,
    t0: u64,
    op_ts: &BTreeMap<(u32, u64), u64>,
) {
    for (kind, o) in [("Inf", &s.origins.first_inf), ("NaN", &s.origins.first_nan)] {
        if let Some(o) = o {
            let ts = op_ts.get(&(o.micro, o.op_index)).copied().unwrap_or(t0);
            instants.push(
                json!({"ph": "i", "s": "t", "pid": PID, "tid": TID, "ts": us(ts),
                "name": format!("first {kind}: {} @ {}", o.op, module_name(&o.module)),
                "cat": "origin", "args": origin_args(kind, o)}),
            );
        }
    }
    if let Some(cause) = facts::skip_cause(s, tf.skip_causes.get(&s.step).map(String::as_str)) {
        instants.push(
            json!({"ph": "i", "s": "t", "pid": PID, "tid": TID, "ts": us(t0),
            "name": format!("step {} skipped", s.step), "cat": "skip",
            "args": {"cause": cause, "scale_before": num(s.scale_before),
                     "scale_after": num(s.scale_after)}}),
        );
    }
    for e in &s.events {
        instants.push(
            json!({"ph": "i", "s": "t", "pid": PID, "tid": TID, "ts": us(t0),
            "name": e, "cat": "event", "args": {"step": s.step}}),
        );
    }
}

/// The document's `otherData`: the tool, the run, and how op times were made.
fn other_data(tf: &TraceFile) -> Value {
    let t = &tf.trace;
    let h = &t.header;
    let mut other = json!({
        "tool": format!("{} {}", h.tool, h.tool_version),
        "model": h.model,
        "precision": h.precision,
        "trace": tf.path.display().to_string(),
        "steps": t.steps.len(),
        "finished": t.end.is_some(),
        "op_timing": "not recorded: each step's wall time is split evenly over its ops",
    });
    if let Some(c) = &t.truncated {
        other["truncated"] = json!({"line": c.line, "bytes": c.bytes});
    }
    other
}

/// Writes the trace-event JSON of `tf` to `out`.
pub fn write_perfetto(tf: &TraceFile, out: &Path) -> Result<()> {
    let v = to_trace_events(tf);
    let text = serde_json::to_string(&v).map_err(|e| {
        Error::Invalid(format!(
            "{}: cannot encode trace events: {e}",
            out.display()
        ))
    })?;
    std::fs::write(out, text).map_err(|e| Error::io(out, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_numbers_become_strings() {
        assert_eq!(num(1.5), json!(1.5));
        assert_eq!(num(f64::NAN), json!("NaN"));
        assert_eq!(num(f64::NEG_INFINITY), json!("-inf"));
        assert_eq!(us(1_234_567), 1234.567);
    }
}
