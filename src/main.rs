//! The amprobe command line.

mod cli;

fn main() {
    let code = match cli::main() {
        Ok(code) => code,
        // The reader of stdout went away (`amprobe ... | head`): it has what it wanted.
        Err(e) if is_broken_pipe(&e) => 0,
        Err(e) => {
            eprintln!("error: {e:#}");
            2
        }
    };
    std::process::exit(code);
}

/// True when `e` comes from an io error of kind `BrokenPipe` anywhere in its chain.
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}
