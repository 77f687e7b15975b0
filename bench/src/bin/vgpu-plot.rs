//! `vgpu-plot`: draws results saved by `vgpu-accuracy --save` or
//! `vgpu-bench --save` as SVG, or prints their tables, without running the
//! benchmark again.
//!
//! `cargo run --release -p vgpu-bench --bin vgpu-plot -- bench/results/accuracy.json bench/results/accuracy.svg`

use anyhow::{bail, Result};
use std::path::PathBuf;
use vgpu_bench::SavedResults;

const USAGE: &str = "vgpu-plot: draws saved benchmark results as SVG.\n\n\
     Usage:\n  vgpu-plot RESULTS.json OUT.svg   draw the plot\n  \
     vgpu-plot --table RESULTS.json   print the tables and when and how the run was made\n\n\
     RESULTS.json is what vgpu-accuracy --save or vgpu-bench --save wrote.";

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["-h" | "--help"] => println!("{USAGE}"),
        ["--table", results] => {
            let saved = SavedResults::load(&PathBuf::from(results))?;
            let run = saved.run();
            println!(
                "{} (finished {}, {} CPUs)\n",
                run.command, run.finished_utc, run.cpus
            );
            print!("{}", saved.tables());
        }
        [results, out] if !results.starts_with('-') && !out.starts_with('-') => {
            SavedResults::load(&PathBuf::from(results))?.save_plot(&PathBuf::from(out))?;
        }
        _ => bail!("expected RESULTS.json OUT.svg or --table RESULTS.json\n\n{USAGE}"),
    }
    Ok(())
}
