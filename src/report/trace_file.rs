//! A trace loaded for reporting: the records, and the skip causes a writer recorded beside
//! them. A leaf of `report`: every report reads its traces through it.

use crate::error::{Error, Result};
use crate::trace::io::{read_trace_from, Trace};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A trace loaded for reporting, with what the report needs beyond [`Trace`].
#[derive(Debug, Clone)]
pub struct TraceFile {
    /// Where it came from (file path as given).
    pub path: PathBuf,
    /// The records.
    pub trace: Trace,
    /// Skip causes written by the run, per step number: the `skip_cause` field of a step
    /// record when the writer has one (a string, or an object whose `cause`, `kind` or
    /// `message` is shown). Steps without it get a cause derived from their origins (see
    /// [`super::facts::skip_cause`]).
    pub skip_causes: BTreeMap<u64, String>,
}

impl TraceFile {
    /// Reads the trace at `path`. A last line cut mid-record is reported in
    /// `trace.truncated`, not as an error.
    pub fn open(path: impl AsRef<Path>) -> Result<TraceFile> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        TraceFile::from_bytes(&bytes, path)
    }

    /// [`TraceFile::open`] of a file's bytes; `path` names it in errors.
    pub fn from_bytes(bytes: &[u8], path: impl AsRef<Path>) -> Result<TraceFile> {
        let path = path.as_ref();
        let trace = read_trace_from(bytes, path)?;
        let skip_causes = recorded_skip_causes(bytes);
        Ok(TraceFile {
            path: path.to_path_buf(),
            trace,
            skip_causes,
        })
    }

    /// Wraps a trace already in memory (no recorded skip causes).
    pub fn from_trace(path: impl Into<PathBuf>, trace: Trace) -> TraceFile {
        TraceFile {
            path: path.into(),
            trace,
            skip_causes: BTreeMap::new(),
        }
    }
}

/// The `skip_cause` fields of the step lines, by step number. The step record type does
/// not carry such a field (yet), so the lines are looked at directly; only lines that
/// mention the key are parsed a second time.
fn recorded_skip_causes(bytes: &[u8]) -> BTreeMap<u64, String> {
    #[derive(serde::Deserialize)]
    struct Peek {
        step: u64,
        #[serde(default)]
        skip_cause: Option<serde_json::Value>,
    }
    let key = b"\"skip_cause\"";
    let mut out = BTreeMap::new();
    for line in bytes.split(|&b| b == b'\n').skip(1) {
        if !line.windows(key.len()).any(|w| w == key) {
            continue;
        }
        let Ok(p) = serde_json::from_slice::<Peek>(line) else {
            continue;
        };
        let text = match p.skip_cause {
            Some(serde_json::Value::String(s)) => s,
            Some(serde_json::Value::Object(m)) => ["cause", "kind", "message"]
                .iter()
                .find_map(|k| m.get(*k).and_then(|v| v.as_str()).map(str::to_string))
                .unwrap_or_else(|| serde_json::Value::Object(m).to_string()),
            Some(serde_json::Value::Null) | None => continue,
            Some(other) => other.to_string(),
        };
        if !text.is_empty() {
            out.insert(p.step, text);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skip_causes_from_string_and_object_fields() {
        let text = b"{\"type\":\"header\"}\n\
            {\"type\":\"step\",\"step\":3,\"skip_cause\":\"backward overflow\"}\n\
            {\"type\":\"step\",\"step\":4,\"skip_cause\":{\"kind\":\"forward-overflow\",\"op\":7}}\n\
            {\"type\":\"step\",\"step\":5,\"skip_cause\":null}\n\
            {\"type\":\"step\",\"step\":6}\n";
        let m = recorded_skip_causes(text);
        assert_eq!(m.len(), 2);
        assert_eq!(m[&3], "backward overflow");
        assert_eq!(m[&4], "forward-overflow");
    }
}
