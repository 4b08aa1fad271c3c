//! Command output on stdout. `println!` panics when stdout is a pipe whose reader has gone
//! (`amprobe run ... | head`); `out!` and `outln!` return the write error instead, and
//! `main` ends quietly on a broken pipe.

use std::io::{self, Write};

/// Writes `args` to stdout and flushes, so a closed pipe is seen here and not at exit.
/// An error keeps its kind (`main` looks for `BrokenPipe`) and names stdout.
pub fn write(args: std::fmt::Arguments<'_>) -> io::Result<()> {
    let mut stdout = io::stdout().lock();
    stdout
        .write_fmt(args)
        .and_then(|()| stdout.flush())
        .map_err(|e| io::Error::new(e.kind(), format!("writing to stdout: {e}")))
}

/// `print!` that returns an `io::Result` instead of panicking.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::out::write(format_args!($($arg)*))
    };
}

/// `println!` that returns an `io::Result` instead of panicking.
macro_rules! outln {
    () => {
        $crate::cli::out::write(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::cli::out::write(format_args!("{}\n", format_args!($($arg)*)))
    };
}

pub(crate) use {out, outln};
