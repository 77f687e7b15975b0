//! `vgpu top`'s figures: every region the user can see, with what each GPU
//! of it did over one interval: memory used against the cap, swap, the
//! configured and effective share, the achieved utilization (device time
//! the shim granted over the interval, as the node monitor measures a
//! capped container), the time throttled, launches, out-of-memory events.
//! Measured between two readings with the node monitor's own region reader
//! ([`vgpu_node_contract::figures`]); `--once` prints them as a plain table
//! (here), the live view draws them in the terminal (`live.rs`).

use crate::places::{self, Origin};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use vgpu_node_contract::figures::read_figures;
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

impl SortKey {
    /// The next key in the order of the columns, back to the first after
    /// the last (the live view's `s`).
    pub fn next(self) -> Self {
        match self {
            Self::Name => Self::Memory,
            Self::Memory => Self::Util,
            Self::Util => Self::Throttled,
            Self::Throttled => Self::Name,
        }
    }
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
fn name_of(path: &Path) -> String {
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

/// One GPU of one region as read at one instant.
#[derive(Clone, Debug, PartialEq)]
struct DeviceReading {
    index: usize,
    memory_used: u64,
    memory_cap: Option<u64>,
    swap_used: u64,
    share: Option<u32>,
    effective: Option<f64>,
    /// Running totals: rates are their differences between two readings.
    granted_ns: u64,
    throttled_ns: u64,
    launches: u64,
    oom_events: u64,
}

/// One region as read at one instant.
#[derive(Clone, Debug, PartialEq)]
struct RegionReading {
    path: PathBuf,
    name: String,
    devices: Vec<DeviceReading>,
}

/// Every region under some roots, as read at one instant.
#[derive(Clone, Debug)]
pub struct Reading {
    at: Instant,
    regions: Vec<RegionReading>,
}

impl Reading {
    /// When it was read.
    pub fn at(&self) -> Instant {
        self.at
    }
}

/// Reads every region under `roots` now. A region that vanishes or cannot
/// be read while the roots are listed is left out: it is not there.
pub fn read(roots: &[PathBuf]) -> Reading {
    let at = Instant::now();
    let regions = roots
        .iter()
        .flat_map(|root| places::list_regions(root))
        .filter_map(|path| {
            let region = crate::show::open(&path).ok()?;
            Some(read_region(path, &region))
        })
        .collect();
    Reading { at, regions }
}

fn read_region(path: PathBuf, region: &Region) -> RegionReading {
    let limits = region.limits();
    let devices = read_figures(region)
        .devices
        .into_iter()
        .map(|figures| {
            let index = figures.index;
            let share = limits.sm_limit[index];
            let effective = figures.sm_effective;
            DeviceReading {
                index,
                memory_used: region.device_used(index),
                memory_cap: (limits.memory_limit[index] != 0).then_some(limits.memory_limit[index]),
                swap_used: region.device_swap_used(index),
                share: (share != 0).then_some(share),
                effective: (effective != SHARE_UNLIMITED && effective < SHARE_FULL)
                    .then(|| f64::from(effective) * 100.0 / f64::from(SHARE_FULL)),
                granted_ns: figures.granted_ns,
                throttled_ns: figures.throttled_ns,
                launches: figures.launches,
                oom_events: figures.oom_events,
            }
        })
        .collect();
    RegionReading {
        name: name_of(&path),
        path,
        devices,
    }
}

/// The rows for the regions in `now`, their rates measured since `before`.
/// A region or GPU that `before` lacks (it appeared in between) shows no
/// use yet; one that `now` lacks (it vanished) has no row.
pub fn rows_between(before: &Reading, now: &Reading) -> Vec<Row> {
    let elapsed = now.at.saturating_duration_since(before.at);
    let earlier: BTreeMap<(&Path, usize), &DeviceReading> = before
        .regions
        .iter()
        .flat_map(|region| {
            region
                .devices
                .iter()
                .map(move |device| ((region.path.as_path(), device.index), device))
        })
        .collect();
    let mut rows = Vec::new();
    for region in &now.regions {
        for device in &region.devices {
            let was = earlier.get(&(region.path.as_path(), device.index));
            let delta = |now: u64, then: fn(&DeviceReading) -> u64| {
                now.saturating_sub(was.map_or(now, |was| then(was)))
            };
            rows.push(Row {
                name: region.name.clone(),
                device: device.index,
                memory_used: device.memory_used,
                memory_cap: device.memory_cap,
                swap_used: device.swap_used,
                share: device.share,
                effective: device.effective,
                utilization: percent_of(delta(device.granted_ns, |d| d.granted_ns), elapsed),
                throttled: percent_of(delta(device.throttled_ns, |d| d.throttled_ns), elapsed),
                launches: delta(device.launches, |d| d.launches),
                oom_events: device.oom_events,
            });
        }
    }
    rows
}

/// The rows for the regions under `roots`, read `interval` apart.
pub fn sample(roots: &[PathBuf], interval: Duration) -> Vec<Row> {
    let before = read(roots);
    std::thread::sleep(interval);
    rows_between(&before, &read(roots))
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

/// A column of the table: its title, its width in the plain table, and
/// the sort key that orders rows by it, if any.
pub struct Column {
    pub title: &'static str,
    pub width: usize,
    pub sorted_by: Option<SortKey>,
}

const fn column(title: &'static str, width: usize, sorted_by: Option<SortKey>) -> Column {
    Column {
        title,
        width,
        sorted_by,
    }
}

/// The table's columns, in order; [`cells`] gives a row's values for them.
pub const COLUMNS: [Column; 10] = [
    column("NAME", 24, Some(SortKey::Name)),
    column("GPU", 3, None),
    column("MEMORY/CAP", 21, Some(SortKey::Memory)),
    column("SWAP", 9, None),
    column("SHARE", 6, None),
    column("EFF", 6, None),
    column("UTIL", 6, Some(SortKey::Util)),
    column("THROT", 6, Some(SortKey::Throttled)),
    column("LAUNCHES", 9, None),
    column("OOM", 4, None),
];

/// A row's values for [`COLUMNS`], as the plain table and the live view
/// both show them.
pub fn cells(row: &Row) -> [String; 10] {
    let cap = row.memory_cap.map_or_else(|| "-".to_string(), compact);
    [
        row.name.clone(),
        row.device.to_string(),
        format!("{}/{}", compact(row.memory_used), cap),
        compact(row.swap_used),
        row.share
            .map_or_else(|| "100%".to_string(), |share| format!("{share}%")),
        row.effective
            .map_or_else(|| "-".to_string(), |effective| format!("{effective:.0}%")),
        format!("{:.1}%", row.utilization),
        format!("{:.1}%", row.throttled),
        row.launches.to_string(),
        row.oom_events.to_string(),
    ]
}

/// Writes `rows` as a plain table (for scripts: one line per GPU of a
/// region, columns separated by spaces, a header first).
pub fn write(rows: &[Row], interval: Duration, out: &mut impl Write) -> std::io::Result<()> {
    let line = |values: [&str; 10]| {
        let mut line = String::new();
        for (index, (column, value)) in COLUMNS.iter().zip(values).enumerate() {
            if index == 0 {
                line.push_str(&format!("{value:<width$}", width = column.width));
            } else {
                line.push_str(&format!(" {value:>width$}", width = column.width));
            }
        }
        line
    };
    writeln!(out, "{}", line(COLUMNS.map(|column| column.title)))?;
    for row in rows {
        let values = cells(row);
        writeln!(out, "{}", line(values.each_ref().map(String::as_str)))?;
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

    fn region(name: &str, granted_ns: u64, launches: u64) -> RegionReading {
        RegionReading {
            path: PathBuf::from(format!("/regions/local-{name}/region.cache")),
            name: name.into(),
            devices: vec![DeviceReading {
                index: 0,
                memory_used: 0,
                memory_cap: None,
                swap_used: 0,
                share: Some(30),
                effective: None,
                granted_ns,
                throttled_ns: 0,
                launches,
                oom_events: 0,
            }],
        }
    }

    #[test]
    fn rates_are_measured_between_two_readings_of_the_same_region() {
        let start = Instant::now();
        let before = Reading {
            at: start,
            regions: vec![region("steady", 1_000_000_000, 7), region("gone", 0, 0)],
        };
        let now = Reading {
            at: start + Duration::from_secs(2),
            regions: vec![
                region("steady", 1_600_000_000, 67),
                region("new", 9_000_000_000, 500),
            ],
        };
        let rows = rows_between(&before, &now);
        let names: Vec<&str> = rows.iter().map(|row| row.name.as_str()).collect();
        assert_eq!(names, ["steady", "new"], "a vanished region has no row");
        assert!((rows[0].utilization - 30.0).abs() < 1e-9, "{rows:?}");
        assert_eq!(rows[0].launches, 60);
        assert_eq!(rows[1].utilization, 0.0, "no earlier reading: no use yet");
        assert_eq!(rows[1].launches, 0);
    }

    #[test]
    fn the_sort_key_cycles_through_every_sortable_column() {
        let sortable: Vec<SortKey> = COLUMNS
            .iter()
            .filter_map(|column| column.sorted_by)
            .collect();
        let mut key = SortKey::Name;
        let mut seen = Vec::new();
        for _ in 0..sortable.len() {
            seen.push(key);
            key = key.next();
        }
        assert_eq!(seen, sortable);
        assert_eq!(key, SortKey::Name);
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
