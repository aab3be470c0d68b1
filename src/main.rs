//! The `k3` command line.

mod cli;

use clap::Parser;

fn main() {
    let args = cli::Cli::parse();
    if let Err(e) = cli::dispatch(args) {
        eprintln!("k3: error: {e:#}");
        std::process::exit(1);
    }
}
