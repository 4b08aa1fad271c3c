//! The live feed: records arriving while the UI runs, from a run on a worker thread or
//! from a trace file another process is writing.

use super::app::{App, Outcome};
use crate::error::{Error, Result};
use crate::trace::io::TraceReader;
use crate::trace::record::Record;
use std::path::PathBuf;
use std::sync::mpsc::{self, Receiver, TryRecvError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Records arriving while the UI runs: from a training run on a worker thread, or from a
/// trace file another process is writing.
pub struct Feed {
    rx: Receiver<Record>,
    worker: Option<JoinHandle<Outcome>>,
    done: bool,
}

fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

impl Feed {
    /// Runs `work` on a worker thread with the sending end of the feed; what it returns
    /// (a verdict, or the error that stopped it) ends the feed once its records are taken.
    pub fn spawn(
        work: impl FnOnce(mpsc::Sender<Record>) -> Outcome + Send + 'static,
    ) -> Result<Feed> {
        let (tx, rx) = mpsc::channel();
        let worker = std::thread::Builder::new()
            .name("amprobe-run".into())
            .spawn(move || work(tx))
            .map_err(|e| Error::Invalid(format!("cannot start the training thread: {e}")))?;
        Ok(Feed {
            rx,
            worker: Some(worker),
            done: false,
        })
    }

    /// Follows the trace file at `path` as it grows, checking for new lines every `poll`,
    /// until its end record arrives.
    pub fn follow(path: PathBuf, poll: Duration) -> Result<Feed> {
        let mut reader = TraceReader::open(&path)?;
        let (tx, rx) = mpsc::channel();
        let worker = std::thread::Builder::new()
            .name("amprobe-follow".into())
            .spawn(move || loop {
                let recs = reader.read_new().map_err(|e| e.to_string())?;
                for r in recs {
                    if tx.send(r).is_err() {
                        return Ok(None);
                    }
                }
                if reader.finished() {
                    return Ok(None);
                }
                std::thread::sleep(poll);
            })
            .map_err(|e| Error::Invalid(format!("cannot start the reader thread: {e}")))?;
        Ok(Feed {
            rx,
            worker: Some(worker),
            done: false,
        })
    }

    /// True once the run (or the followed trace) ended and every record was taken.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Moves arrived records into the app, for at most `budget`; when the source has ended
    /// and everything is taken, records how it ended. Returns true if anything changed.
    pub fn pump(&mut self, app: &mut App, budget: Duration) -> bool {
        if self.done {
            return false;
        }
        let t0 = Instant::now();
        let mut changed = false;
        loop {
            match self.rx.try_recv() {
                Ok(r) => {
                    app.push(r);
                    changed = true;
                    if t0.elapsed() >= budget {
                        return true;
                    }
                }
                Err(TryRecvError::Empty) => return changed,
                Err(TryRecvError::Disconnected) => {
                    // The sender lives as long as the worker's run: every record is in.
                    let outcome = match self.worker.take().map(JoinHandle::join) {
                        Some(Ok(o)) => o,
                        Some(Err(p)) => Err(format!("the run panicked: {}", panic_text(p))),
                        None => Ok(None),
                    };
                    app.finish(outcome);
                    self.done = true;
                    return true;
                }
            }
        }
    }
}
