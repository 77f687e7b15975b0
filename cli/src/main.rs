//! `vgpu`: runs programs under the shim with a memory cap and a compute
//! share on a machine without Kubernetes, and lists, inspects and changes
//! regions; on Kubernetes, cordons single GPUs of a node (see `vgpu
//! --help`).

mod args;
mod cluster_api;
mod cordon;
mod demo;
mod doctor;
mod live;
mod places;
mod resize;
mod run;
mod set;
mod show;
mod top;

use args::{Cli, Command};
use clap::Parser;
use std::process::ExitCode;

/// Exit status for a value or usage error.
const EXIT_USAGE: u8 = 2;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => return usage_error(error),
    };
    tracing_subscriber::fmt()
        .with_max_level(cli.log_level)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .without_time()
        .init();
    let root = cli.root.clone().unwrap_or_else(places::default_root);
    let roots = places::search_roots(cli.root.as_deref());
    let (code, error): (i32, Option<anyhow::Error>) = match cli.command {
        Command::Run(args) => match run::run(&root, args) {
            Ok(code) => (code, None),
            Err(error) => (error.exit_code(), Some(error.into())),
        },
        Command::Ls(args) => {
            let result = show::ls(&roots, args.json, &mut std::io::stdout().lock());
            (i32::from(result.is_err()), result.err().map(Into::into))
        }
        Command::Inspect(args) => {
            let result = places::resolve(&args.target, &roots)
                .map_err(show::ShowError::from)
                .and_then(|path| show::inspect(&path, args.json, &mut std::io::stdout().lock()));
            (i32::from(result.is_err()), result.err().map(Into::into))
        }
        Command::Set(args) => {
            let result = set::validate(&args)
                .and_then(|()| places::resolve(&args.target, &roots).map_err(set::SetError::from))
                .and_then(|path| set::set(&path, &args).map(|now| (path, now)));
            match result {
                Ok((path, now)) => {
                    tracing::info!(region = %path.display(), "limits now {now}");
                    (0, None)
                }
                Err(error) => (error.exit_code(), Some(error.into())),
            }
        }
        Command::Top(args) => {
            let interval = std::time::Duration::from_millis(args.interval_ms);
            if args.once {
                let mut rows = top::sample(&roots, interval);
                top::sort(&mut rows, args.sort);
                let result = top::write(&rows, interval, &mut std::io::stdout().lock());
                (i32::from(result.is_err()), result.err().map(Into::into))
            } else {
                match live::run(&roots, interval, args.sort) {
                    Ok(()) => (0, None),
                    Err(error) => (error.exit_code(), Some(error.into())),
                }
            }
        }
        Command::Demo(args) => match demo::run(&args, &mut std::io::stdout().lock()) {
            Ok(()) => (0, None),
            Err(error) => (1, Some(error.into())),
        },
        Command::Doctor(args) => match doctor::run(&args, &mut std::io::stdout().lock()) {
            Ok(failed) => (i32::from(failed), None),
            Err(error) => (
                1,
                Some(anyhow::Error::new(error).context("writing the report")),
            ),
        },
        Command::Cordon(args) => match cordon::cordon(&args, &mut std::io::stdout().lock()) {
            Ok(()) => (0, None),
            Err(error) => (1, Some(error.into())),
        },
        Command::Uncordon(args) => match cordon::uncordon(&args, &mut std::io::stdout().lock()) {
            Ok(()) => (0, None),
            Err(error) => (1, Some(error.into())),
        },
        Command::Resize(args) => match resize::resize(&args, &mut std::io::stdout().lock()) {
            Ok(()) => (0, None),
            Err(error) => (error.exit_code(), Some(error.into())),
        },
        Command::DoctorProbe => match doctor::probe::child(&mut std::io::stdout().lock()) {
            Ok(()) => (0, None),
            Err(error) => (1, Some(error.into())),
        },
    };
    if let Some(error) = error {
        eprintln!("vgpu: {}", one_line(&error));
    }
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

/// An error and its causes on one line (each cause not already in the
/// message after it).
fn one_line(error: &anyhow::Error) -> String {
    let mut line = error.to_string();
    for cause in error.chain().skip(1) {
        let text = cause.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
    }
    line.replace('\n', " ")
}

/// Help and version go to stdout as usual; any other parse error is one
/// line on stderr (clap's first paragraph, without the usage) and exit 2.
fn usage_error(error: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(
        error.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        let _ = error.print();
        return ExitCode::from(if error.use_stderr() { EXIT_USAGE } else { 0 });
    }
    let rendered = error.render().to_string();
    let first: Vec<&str> = rendered
        .lines()
        .take_while(|line| !line.trim().is_empty())
        .map(str::trim)
        .collect();
    let line = first.join(" ");
    let line = line.strip_prefix("error: ").unwrap_or(&line);
    eprintln!("vgpu: {line}");
    ExitCode::from(EXIT_USAGE)
}
