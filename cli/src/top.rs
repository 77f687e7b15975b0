//! `vgpu top --once`: every region the user can see, with what each GPU of
//! it did over one interval: memory used against the cap, swap, the
//! configured and effective share, the achieved utilization (device time
//! the shim granted over the interval, as the node monitor measures a
//! capped container), the time throttled, launches, out-of-memory events.
//! Read twice, `interval` apart, with the node monitor's own region reader
//! ([`vgpu_node_contract::figures`]).

use crate::places::{self, Origin};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use vgpu_node_contract::figures::{read_figures, DeviceFigures};
use vgpu_node_contract::region::{Region, SHARE_FULL, SHARE_UNLIMITED};
use vgpu_node_contract::size::human_bytes;

/// The column rows are sorted by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SortKey {
    /// Region name, then GPU.
    Name,
    /// Memory used, most first.
    Memory,
    /// Achieved utilization, most first.
    Util,
    /// Time throttled, most first.
    Throttled,
}

/// One GPU of one region over the interval.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    pub name: String,
    pub device: usize,
    pub memory_used: u64,
    /// `None`: uncapped.
    pub memory_cap: Option<u64>,
    pub swap_used: u64,
    /// Percent; `None`: the whole GPU.
    pub share: Option<u32>,
    /// Percent the monitor lets it run at now; `None`: not limited.
    pub effective: Option<f64>,
    /// Percent of the interval.
    pub utilization: f64,
    /// Percent of the interval spent waiting for the share.
    pub throttled: f64,
    pub launches: u64,
    pub oom_events: u64,
}

/// A region's name as `ls` shows it.
fn name_of(path: &std::path::Path) -> String {
    let dir = places::dir_name_of(path);
    match Origin::of_dir(&dir) {
        Origin::Local { name } => name,
        _ => dir,
    }
}

fn percent_of(delta_ns: u64, interval: Duration) -> f64 {
    let interval_ns = interval.as_nanos().max(1) as f64;
    (delta_ns as f64 * 100.0 / interval_ns).min(100.0)
}

/// The rows for the regions under `roots`, read `interval` apart; a
/// region that vanishes or cannot be read in between is left out.
pub fn sample(roots: &[PathBuf], interval: Duration) -> Vec<Row> {
    let regions: Vec<(String, Region)> = roots
        .iter()
        .flat_map(|root| places::list_regions(root))
        .filter_map(|path| {
            let region = crate::show::open(&path).ok()?;
            Some((name_of(&path), region))
        })
        .collect();
    let before: Vec<BTreeMap<usize, DeviceFigures>> = regions
        .iter()
        .map(|(_, region)| by_index(read_figures(region).devices))
        .collect();
    let started = Instant::now();
    std::thread::sleep(interval);
    let elapsed = started.elapsed();
    let mut rows = Vec::new();
    for ((name, region), before) in regions.iter().zip(before) {
        let limits = region.limits();
        for (index, now) in by_index(read_figures(region).devices) {
            let was = before.get(&index);
            let delta = |now: u64, was: Option<u64>| now.saturating_sub(was.unwrap_or(now));
            let share = limits.sm_limit[index];
            let effective = now.sm_effective;
            rows.push(Row {
                name: name.clone(),
                device: index,
                memory_used: region.device_used(index),
                memory_cap: (limits.memory_limit[index] != 0).then_some(limits.memory_limit[index]),
                swap_used: region.device_swap_used(index),
                share: (share != 0).then_some(share),
                effective: (effective != SHARE_UNLIMITED && effective < SHARE_FULL)
                    .then(|| f64::from(effective) * 100.0 / f64::from(SHARE_FULL)),
                utilization: percent_of(delta(now.granted_ns, was.map(|w| w.granted_ns)), elapsed),
                throttled: percent_of(
                    delta(now.throttled_ns, was.map(|w| w.throttled_ns)),
                    elapsed,
                ),
                launches: delta(now.launches, was.map(|w| w.launches)),
                oom_events: now.oom_events,
            });
        }
    }
    rows
}

fn by_index(devices: Vec<DeviceFigures>) -> BTreeMap<usize, DeviceFigures> {
    devices.into_iter().map(|d| (d.index, d)).collect()
}

/// Sorts `rows` by `key`.
pub fn sort(rows: &mut [Row], key: SortKey) {
    let by_name = |a: &Row, b: &Row| a.name.cmp(&b.name).then(a.device.cmp(&b.device));
    rows.sort_by(|a, b| match key {
        SortKey::Name => by_name(a, b),
        SortKey::Memory => b.memory_used.cmp(&a.memory_used).then(by_name(a, b)),
        SortKey::Util => b.utilization.total_cmp(&a.utilization).then(by_name(a, b)),
        SortKey::Throttled => b.throttled.total_cmp(&a.throttled).then(by_name(a, b)),
    });
}

/// A size with no space in it (columns are split at spaces).
fn compact(bytes: u64) -> String {
    human_bytes(bytes).replace(' ', "")
}

/// Writes `rows` as a plain table (for scripts: one line per GPU of a
/// region, columns separated by spaces, a header first).
pub fn write(rows: &[Row], interval: Duration, out: &mut impl Write) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<24} {:>3} {:>21} {:>9} {:>6} {:>6} {:>6} {:>6} {:>9} {:>4}",
        "NAME", "GPU", "MEMORY/CAP", "SWAP", "SHARE", "EFF", "UTIL", "THROT", "LAUNCHES", "OOM"
    )?;
    for row in rows {
        let cap = row.memory_cap.map_or_else(|| "-".to_string(), compact);
        let share = row
            .share
            .map_or_else(|| "100%".to_string(), |s| format!("{s}%"));
        let effective = row
            .effective
            .map_or_else(|| "-".to_string(), |e| format!("{e:.0}%"));
        writeln!(
            out,
            "{:<24} {:>3} {:>21} {:>9} {:>6} {:>6} {:>5.1}% {:>5.1}% {:>9} {:>4}",
            row.name,
            row.device,
            format!("{}/{}", compact(row.memory_used), cap),
            compact(row.swap_used),
            share,
            effective,
            row.utilization,
            row.throttled,
            row.launches,
            row.oom_events
        )?;
    }
    writeln!(
        out,
        "{} region GPU(s); UTIL, THROT and LAUNCHES over {} ms",
        rows.len(),
        interval.as_millis()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(name: &str, memory: u64, utilization: f64) -> Row {
        Row {
            name: name.into(),
            device: 0,
            memory_used: memory,
            memory_cap: Some(1 << 30),
            swap_used: 0,
            share: Some(30),
            effective: None,
            utilization,
            throttled: 0.0,
            launches: 0,
            oom_events: 0,
        }
    }

    #[test]
    fn rows_sort_by_the_chosen_column() {
        let mut rows = vec![row("b", 1, 50.0), row("a", 3, 10.0), row("c", 2, 90.0)];
        let names = |rows: &[Row]| rows.iter().map(|r| r.name.clone()).collect::<Vec<_>>();
        sort(&mut rows, SortKey::Name);
        assert_eq!(names(&rows), ["a", "b", "c"]);
        sort(&mut rows, SortKey::Memory);
        assert_eq!(names(&rows), ["a", "c", "b"]);
        sort(&mut rows, SortKey::Util);
        assert_eq!(names(&rows), ["c", "b", "a"]);
    }

    #[test]
    fn the_table_has_a_header_a_line_per_row_and_the_interval() {
        let mut out = Vec::new();
        write(
            &[row("team", 512 << 20, 29.94)],
            Duration::from_millis(1000),
            &mut out,
        )
        .expect("write");
        let text = String::from_utf8(out).expect("utf8");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines[0].starts_with("NAME"), "{text}");
        assert!(lines[1].starts_with("team"), "{text}");
        assert!(
            lines[1].contains("30%") && lines[1].contains("29.9%"),
            "{text}"
        );
        assert!(lines[2].contains("over 1000 ms"), "{text}");
    }
}
