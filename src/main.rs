//! The `k3` command line.

fn main() {
    eprintln!("k3: under construction");
}
