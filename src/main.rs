//! The `k3` command line.

mod cli;

use clap::Parser;

fn main() {
    // The start-up figure counts from here.
    k3::stats::process_start();
    k3::platform::file_size_signal::ignore_file_size_signal();
    let args = cli::Cli::parse();
    // MPI starts before anything else runs, and only in a process `mpirun` started.
    #[cfg(feature = "mpi")]
    let ranks = match cli::ranks_start() {
        Ok(g) => g,
        Err(e) => {
            eprintln!("k3: error: {e:#}");
            std::process::exit(1);
        }
    };
    let result = cli::log::init().and_then(|()| cli::dispatch(args));
    if let Err(e) = result {
        if e.is::<k3::ranks::WorkerDone>() {
            return;
        }
        eprintln!("k3: error: {}{e:#}", cli::rank_prefix());
        // Exit 2 tells scripts the machine is too small, not that the input was bad.
        let code = if e
            .downcast_ref::<k3::experts::cache::ram_budget::RamBudgetError>()
            .is_some()
        {
            2
        } else {
            1
        };
        // One rank's error ends the whole job, so no other rank waits on it.
        #[cfg(feature = "mpi")]
        if ranks.is_some() && k3::ranks::world::info().is_some_and(|i| i.size > 1) {
            k3::ranks::world::abort(code);
        }
        std::process::exit(code);
    }
}
