//! The amprobe command line.

mod cli;

fn main() {
    let code = match cli::main() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            2
        }
    };
    std::process::exit(code);
}
