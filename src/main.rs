//! The amprobe command line.

mod cli;

fn main() {
    amprobe::host_memory::keep_freed_memory();
    let code = match cli::main() {
        Ok(code) => code,
        // The reader of stdout went away (`amprobe ... | head`): it has what it wanted.
        Err(e) if is_broken_pipe(&e) => 0,
        Err(e) => {
            eprintln!("error: {}", error_text(&e));
            2
        }
    };
    std::process::exit(code);
}

/// The error and its causes in one line, each cause once: a message that already ends with
/// its cause's text (the library's errors name their source) does not repeat it.
fn error_text(e: &anyhow::Error) -> String {
    let mut text = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !text.ends_with(&c) {
            text.push_str(": ");
            text.push_str(&c);
        }
    }
    text
}

/// True when `e` comes from an io error of kind `BrokenPipe` anywhere in its chain.
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

#[cfg(test)]
mod tests {
    use super::error_text;

    #[test]
    fn each_cause_is_told_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let lib = amprobe::Error::io("/x.toml", io);
        let e = anyhow::Error::new(lib).context("loading the config");
        assert_eq!(error_text(&e), "loading the config: /x.toml: no such file");
        let plain = anyhow::anyhow!("inner").context("outer");
        assert_eq!(error_text(&plain), "outer: inner");
    }
}
