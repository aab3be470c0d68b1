//! The `k3` command line.

mod cli;

use clap::Parser;

fn main() {
    // The start-up figure counts from here.
    k3::stats::process_start();
    k3::platform::file_size_signal::ignore_file_size_signal();
    let args = cli::Cli::parse();
    if let Err(e) = cli::log::init().and_then(|()| cli::dispatch(args)) {
        eprintln!("k3: error: {e:#}");
        // Exit 2 tells scripts the machine is too small, not that the input was bad.
        let code = if e
            .downcast_ref::<k3::experts::cache::ram_budget::RamBudgetError>()
            .is_some()
        {
            2
        } else {
            1
        };
        std::process::exit(code);
    }
}
