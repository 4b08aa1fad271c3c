//! Layer 0 of `amprobe::LAYERS`: uses no other module of the crate.
//!
//! The library's one error type.

use std::path::PathBuf;

/// Every failure the library reports. Messages name the file, field or tensor involved
/// and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A configuration value is missing or wrong.
    #[error("config {context}: {message}")]
    Config {
        /// Where: file and field.
        context: String,
        /// What was expected.
        message: String,
    },
    /// A tensor has the wrong shape, dtype or contents.
    #[error("tensor `{name}`: {message}")]
    Tensor {
        /// Tensor name (parameter name, file key or op).
        name: String,
        /// What was expected.
        message: String,
    },
    /// Shapes do not fit an op.
    #[error("{op}: {message}")]
    Shape {
        /// The op.
        op: String,
        /// What was expected.
        message: String,
    },
    /// The loss scaler was used out of order (e.g. unscale_ twice in one step).
    #[error("grad scaler: {0}")]
    Scaler(String),
    /// A trace file could not be parsed.
    #[error("trace {path}: line {line}: {message}")]
    Trace {
        /// The trace file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What was wrong.
        message: String,
    },
    /// The CUDA backend is unavailable or a device call failed.
    #[error("cuda: {0}")]
    Device(String),
    /// Anything else the engine refuses, with its reason.
    #[error("{0}")]
    Invalid(String),
}

/// Result with the library's error.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Builds an [`Error::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
    /// Builds an [`Error::Shape`].
    pub fn shape(op: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Shape {
            op: op.into(),
            message: message.into(),
        }
    }
    /// Builds an [`Error::Tensor`].
    pub fn tensor(name: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Tensor {
            name: name.into(),
            message: message.into(),
        }
    }
    /// Builds an [`Error::Config`].
    pub fn config(context: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Config {
            context: context.into(),
            message: message.into(),
        }
    }
}
