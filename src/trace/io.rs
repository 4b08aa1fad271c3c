//! Writing and reading trace files (JSON Lines).
//!
//! The writer puts each record on its own line and hands the whole line to the OS before
//! returning, so a run killed at any moment leaves every finished step readable. The reader
//! accepts a last line cut mid-record (reported as [`Truncation`]) and can follow a file
//! that is still being written ([`TraceReader::read_new`]).

use super::record::{EndRecord, Header, Record, StepRecord, SCHEMA_VERSION};
use crate::error::{Error, Result};
use serde::Serialize;
use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::path::{Path, PathBuf};

/// Borrowed form of [`Record`] for writing without cloning a step.
#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum RecordRef<'a> {
    Header(&'a Header),
    Step(&'a StepRecord),
    End(&'a EndRecord),
}

/// Writes a trace: the header on creation, then one line per step, then the end record.
pub struct TraceWriter<W: Write = File> {
    out: W,
    path: PathBuf,
    line: Vec<u8>,
    steps: u64,
}

impl TraceWriter<File> {
    /// Creates (or truncates) the trace file at `path` and writes `header` to it.
    pub fn create(path: impl AsRef<Path>, header: &Header) -> Result<Self> {
        let path = path.as_ref();
        let file = File::create(path).map_err(|e| Error::io(path, e))?;
        Self::with_label(file, path.to_path_buf(), header)
    }

    /// Asks the OS to put everything written so far on the storage device (`fsync`).
    /// Not needed to survive a killed process, only a crashed machine.
    pub fn sync(&self) -> Result<()> {
        self.out.sync_data().map_err(|e| Error::io(&self.path, e))
    }
}

impl<W: Write> TraceWriter<W> {
    /// Writes a trace to any writer (errors name it `<writer>`), starting with `header`.
    pub fn from_writer(out: W, header: &Header) -> Result<Self> {
        Self::with_label(out, PathBuf::from("<writer>"), header)
    }

    fn with_label(out: W, path: PathBuf, header: &Header) -> Result<Self> {
        if header.schema_version != SCHEMA_VERSION {
            return Err(Error::Invalid(format!(
                "trace {}: header schema_version is {}, but this build writes version {}",
                path.display(),
                header.schema_version,
                SCHEMA_VERSION
            )));
        }
        let mut w = TraceWriter {
            out,
            path,
            line: Vec::with_capacity(4096),
            steps: 0,
        };
        w.write(&RecordRef::Header(header))?;
        Ok(w)
    }

    /// Writes one step as one line and flushes it to the OS before returning.
    pub fn write_step(&mut self, step: &StepRecord) -> Result<()> {
        self.write(&RecordRef::Step(step))?;
        self.steps += 1;
        Ok(())
    }

    /// Writes the end record and flushes.
    pub fn finish(mut self, end: &EndRecord) -> Result<()> {
        self.write(&RecordRef::End(end))
    }

    /// Number of steps written so far.
    pub fn steps_written(&self) -> u64 {
        self.steps
    }

    /// Path (or label) of the trace being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write(&mut self, rec: &RecordRef<'_>) -> Result<()> {
        self.line.clear();
        serde_json::to_writer(&mut self.line, rec).map_err(|e| {
            Error::Invalid(format!(
                "trace {}: cannot encode record: {e}",
                self.path.display()
            ))
        })?;
        self.line.push(b'\n');
        // One write of the whole line: readers of a live file see whole lines or a tail
        // without its newline, never a torn record followed by more data.
        self.out
            .write_all(&self.line)
            .map_err(|e| Error::io(&self.path, e))?;
        self.out.flush().map_err(|e| Error::io(&self.path, e))
    }
}

/// A trace's last line, cut mid-record (the writer was killed while writing it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Truncation {
    /// 1-based number of the cut line.
    pub line: usize,
    /// Bytes of the cut line present in the file.
    pub bytes: usize,
}

/// A whole trace file.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    /// The header.
    pub header: Header,
    /// Steps, in file order.
    pub steps: Vec<StepRecord>,
    /// The end record; `None` when the run did not finish.
    pub end: Option<EndRecord>,
    /// Set when the last line was cut mid-record.
    pub truncated: Option<Truncation>,
}

/// Reads the trace file at `path`.
///
/// A last line without a trailing newline that does not parse is reported in
/// [`Trace::truncated`]. Anything else that is wrong is an [`Error::Trace`] naming the
/// line: no header or an invalid one, a schema version newer than [`SCHEMA_VERSION`], a
/// malformed line, a second header, or a record after the end record.
pub fn read_trace(path: impl AsRef<Path>) -> Result<Trace> {
    let path = path.as_ref();
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    read_trace_from(file, path)
}

/// Reads a trace from any reader; `label` names it in errors.
pub fn read_trace_from(src: impl Read, label: impl Into<PathBuf>) -> Result<Trace> {
    let mut reader = TraceReader::new(src, label);
    let mut header = None;
    let mut steps = Vec::new();
    let mut end = None;
    let mut take = |recs: Vec<Record>| {
        for r in recs {
            match r {
                Record::Header(h) => header = Some(h),
                Record::Step(s) => steps.push(s),
                Record::End(e) => end = Some(e),
            }
        }
    };
    take(reader.read_new()?);
    let mut truncated = None;
    if !reader.pending.is_empty() {
        let line = std::mem::take(&mut reader.pending);
        let complete = serde_json::from_slice::<serde::de::IgnoredAny>(&line).is_ok();
        if complete || reader.line_no == 0 {
            // A whole record cut just before its newline is still a record (and is checked
            // like any other); a cut header is no header.
            take(vec![reader.parse_line(&line)?]);
        } else {
            truncated = Some(Truncation {
                line: reader.line_no + 1,
                bytes: line.len(),
            });
        }
    }
    let Some(header) = header else {
        return Err(reader.error(1, "empty file: expected a header record on line 1".into()));
    };
    Ok(Trace {
        header,
        steps,
        end,
        truncated,
    })
}

/// Reads records from a trace incrementally, e.g. while another process writes it.
///
/// Each [`read_new`](TraceReader::read_new) returns the records whose lines were completed
/// since the last call; a partial last line stays buffered until its newline arrives.
pub struct TraceReader<R: Read = File> {
    src: R,
    path: PathBuf,
    pending: Vec<u8>,
    line_no: usize,
    header_seen: bool,
    end_seen: bool,
}

impl TraceReader<File> {
    /// Opens the trace file at `path` for incremental reading.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        Ok(Self::new(file, path))
    }
}

impl<R: Read> TraceReader<R> {
    /// Reads from `src`; `label` names it in errors.
    pub fn new(src: R, label: impl Into<PathBuf>) -> Self {
        TraceReader {
            src,
            path: label.into(),
            pending: Vec::new(),
            line_no: 0,
            header_seen: false,
            end_seen: false,
        }
    }

    /// Reads to the current end of the source and returns the records of the lines
    /// completed meanwhile. The first record is always the header. A malformed line,
    /// a bad header, a second header or a record after the end is an [`Error::Trace`].
    pub fn read_new(&mut self) -> Result<Vec<Record>> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match self.src.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(Error::io(&self.path, e)),
            };
            let mut data = &buf[..n];
            while let Some(nl) = data.iter().position(|&b| b == b'\n') {
                let rec = if self.pending.is_empty() {
                    self.parse_line(&data[..nl])?
                } else {
                    self.pending.extend_from_slice(&data[..nl]);
                    let line = std::mem::take(&mut self.pending);
                    self.parse_line(&line)?
                };
                out.push(rec);
                data = &data[nl + 1..];
            }
            self.pending.extend_from_slice(data);
        }
        Ok(out)
    }

    /// Bytes of an incomplete last line held back, waiting for its newline.
    pub fn pending_bytes(&self) -> usize {
        self.pending.len()
    }

    /// Complete lines read so far.
    pub fn lines_read(&self) -> usize {
        self.line_no
    }

    /// True once the end record has been read.
    pub fn finished(&self) -> bool {
        self.end_seen
    }

    fn error(&self, line: usize, message: String) -> Error {
        Error::Trace {
            path: self.path.clone(),
            line,
            message,
        }
    }

    /// Parses the next complete line and checks it against what may come next.
    fn parse_line(&mut self, line: &[u8]) -> Result<Record> {
        let n = self.line_no + 1;
        let rec = if self.header_seen {
            let rec: Record = serde_json::from_slice(line).map_err(|e| {
                self.error(
                    n,
                    format!("expected a step or end record (one JSON object): {e}"),
                )
            })?;
            if self.end_seen {
                return Err(self.error(n, "record after the end record".into()));
            }
            match rec {
                Record::Header(_) => {
                    return Err(self.error(n, "second header: expected a step or end record".into()))
                }
                Record::End(_) => self.end_seen = true,
                Record::Step(_) => {}
            }
            rec
        } else {
            let rec = self.parse_header(line).map_err(|m| self.error(n, m))?;
            self.header_seen = true;
            rec
        };
        self.line_no = n;
        Ok(rec)
    }

    fn parse_header(&self, line: &[u8]) -> std::result::Result<Record, String> {
        let v: serde_json::Value = serde_json::from_slice(line)
            .map_err(|e| format!("expected a header record (one JSON object): {e}"))?;
        let ty = v.get("type").and_then(|t| t.as_str());
        if ty != Some("header") {
            return Err(format!(
                "expected a header record (\"type\": \"header\") on line 1, found type {}",
                v.get("type")
                    .map_or("<none>".to_string(), |t| t.to_string())
            ));
        }
        let version = v
            .get("schema_version")
            .and_then(|x| x.as_u64())
            .ok_or("header: expected an unsigned integer field \"schema_version\"")?;
        if version > u64::from(SCHEMA_VERSION) {
            return Err(format!(
                "trace schema_version {version} is newer than this build reads \
                 (up to {SCHEMA_VERSION}); use a newer amprobe"
            ));
        }
        if version == 0 {
            return Err("header: schema_version 0 is not a valid version (expected >= 1)".into());
        }
        serde_json::from_value(v).map_err(|e| format!("invalid header record: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writer_rejects_foreign_schema_version() {
        let h = Header {
            schema_version: 7,
            ..Header::new()
        };
        let mut buf = Vec::new();
        assert!(TraceWriter::from_writer(&mut buf, &h).is_err());
        assert!(buf.is_empty());
    }

    #[test]
    fn cut_header_is_an_error_not_a_truncation() {
        let mut buf = Vec::new();
        TraceWriter::from_writer(&mut buf, &Header::new()).unwrap();
        let cut = &buf[..buf.len() / 2];
        match read_trace_from(cut, "t") {
            Err(Error::Trace { line, .. }) => assert_eq!(line, 1),
            other => panic!("expected a trace error, got {other:?}"),
        }
        match read_trace_from(&b""[..], "t") {
            Err(Error::Trace { line, message, .. }) => {
                assert_eq!(line, 1);
                assert!(message.contains("header"), "{message}");
            }
            other => panic!("expected a trace error, got {other:?}"),
        }
    }

    #[test]
    fn complete_last_line_without_newline_is_checked() {
        let mut buf = Vec::new();
        TraceWriter::from_writer(&mut buf, &Header::new()).unwrap();
        let header_line = buf.clone();
        // A second header lacking only its newline is an error, not a truncation.
        buf.extend_from_slice(&header_line[..header_line.len() - 1]);
        match read_trace_from(&buf[..], "t") {
            Err(Error::Trace { line, message, .. }) => {
                assert_eq!(line, 2);
                assert!(message.contains("second header"), "{message}");
            }
            other => panic!("expected a trace error, got {other:?}"),
        }
    }

    #[test]
    fn step_before_header_is_an_error() {
        let s = "{\"type\":\"end\",\"steps\":0,\"verdict\":\"\",\"wall_ms\":0.0}\n";
        match read_trace_from(s.as_bytes(), "t") {
            Err(Error::Trace { line, message, .. }) => {
                assert_eq!(line, 1);
                assert!(message.contains("\"end\""), "{message}");
            }
            other => panic!("expected a trace error, got {other:?}"),
        }
    }
}
