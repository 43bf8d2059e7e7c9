//! `kiln`: build, run, benchmark, profile, compare, inspect and generate code for Kiln's bundled
//! models, in the manner of `trtexec` and Polygraphy. `kiln --help` lists the commands.

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
