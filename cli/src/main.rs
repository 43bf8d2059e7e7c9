//! `kiln`: build, run, benchmark, profile, compare, inspect and generate code for Kiln's bundled
//! models, graph files and engine files, in the manner of `trtexec` and Polygraphy. `kiln --help`
//! lists the commands. A program with its own models embeds the same CLI with
//! `kiln_cli::main_with`.

fn main() -> std::process::ExitCode {
    kiln_cli::main()
}
