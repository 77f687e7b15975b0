//! The live `vgpu top`: the same table as `top --once`, redrawn every
//! interval in the terminal's alternate screen, sorted by a column the
//! user picks with a key. What is drawn is a pure function of the rows and
//! the sort state ([`render`]), tested against ratatui's `TestBackend`;
//! [`run`] only reads regions, keys and the clock around it.

use crate::top::{self, Row, SortKey, COLUMNS};
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use ratatui::layout::{Alignment, Constraint, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Cell, Paragraph, Row as TableRow, Table};
use ratatui::{DefaultTerminal, Frame};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum LiveError {
    #[error("top: standard output is not a terminal; use `vgpu top --once` for a plain table")]
    NotATerminal,
    #[error("top: the terminal: {0}")]
    Terminal(#[from] std::io::Error),
}

impl LiveError {
    /// Not a terminal is a usage error (2); a terminal that fails is 1.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::NotATerminal => 2,
            Self::Terminal(_) => 1,
        }
    }
}

/// What the live view shows.
#[derive(Clone, Debug)]
pub struct View {
    /// The rows of the last interval; `None` until one has passed.
    pub rows: Option<Vec<Row>>,
    pub sort: SortKey,
    pub interval: Duration,
}

/// What a key asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Quit,
    Sort(SortKey),
    NextSort,
}

/// Bounds of the name column's width; longer names are cut.
const MIN_NAME_WIDTH: usize = 12;
const MAX_NAME_WIDTH: usize = 40;

/// The keys, as the help line names them.
const KEY_HELP: &str = "q quit  s next sort column  n name  m memory  u util  t throttled";

/// The action `key` asks for, if any: `q`, Esc and Ctrl-C quit (the
/// terminal is raw, so Ctrl-C arrives as a key, not a signal).
pub fn action(key: KeyEvent) -> Option<Action> {
    if key.kind != KeyEventKind::Press {
        return None;
    }
    match key.code {
        KeyCode::Char('c') if key.modifiers.contains(KeyModifiers::CONTROL) => Some(Action::Quit),
        KeyCode::Char('q') | KeyCode::Esc => Some(Action::Quit),
        KeyCode::Char('s') => Some(Action::NextSort),
        KeyCode::Char('n') => Some(Action::Sort(SortKey::Name)),
        KeyCode::Char('m') => Some(Action::Sort(SortKey::Memory)),
        KeyCode::Char('u') => Some(Action::Sort(SortKey::Util)),
        KeyCode::Char('t') => Some(Action::Sort(SortKey::Throttled)),
        _ => None,
    }
}

/// The title of the column `key` sorts by, as the header shows it.
fn sort_title(key: SortKey) -> &'static str {
    COLUMNS
        .iter()
        .find(|column| column.sorted_by == Some(key))
        .map_or("?", |column| column.title)
}

/// Draws `view` on the whole frame: a title line, the table (the sorted
/// column's title marked with `*`), and the keys.
pub fn render(frame: &mut Frame, view: &View) {
    let [title_area, table_area, help_area] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Fill(1),
        Constraint::Length(1),
    ])
    .areas(frame.area());

    let title = match &view.rows {
        Some(rows) => format!(
            "vgpu top: {} region GPU(s); UTIL, THROT and LAUNCHES over the last {} ms",
            rows.len(),
            view.interval.as_millis()
        ),
        None => format!(
            "vgpu top: measuring the first {} ms...",
            view.interval.as_millis()
        ),
    };
    frame.render_widget(Paragraph::new(title), title_area);

    let header = TableRow::new(COLUMNS.iter().enumerate().map(|(index, column)| {
        let sorted = column.sorted_by == Some(view.sort);
        let text = if sorted {
            format!("{}*", column.title)
        } else {
            column.title.to_string()
        };
        let style = if sorted {
            Style::new().add_modifier(Modifier::BOLD | Modifier::REVERSED)
        } else {
            Style::new().add_modifier(Modifier::BOLD)
        };
        Cell::from(aligned(text, index)).style(style)
    }));
    let mut rows = view.rows.clone().unwrap_or_default();
    top::sort(&mut rows, view.sort);
    let body = rows.iter().map(|row| {
        TableRow::new(
            top::cells(row)
                .into_iter()
                .enumerate()
                .map(|(index, value)| Cell::from(aligned(value, index))),
        )
    });
    // The name column fits the longest name (within bounds); the others
    // fit their values and their title with the sort mark.
    let longest_name = rows.iter().map(|row| row.name.chars().count()).max();
    let name_width = longest_name
        .unwrap_or(0)
        .clamp(MIN_NAME_WIDTH, MAX_NAME_WIDTH);
    let widths = COLUMNS.iter().enumerate().map(|(index, column)| {
        let width = if index == 0 {
            name_width
        } else {
            column.width.max(column.title.len() + 1)
        };
        Constraint::Length(u16::try_from(width).unwrap_or(u16::MAX))
    });
    frame.render_widget(
        Table::new(body, widths).header(header).column_spacing(1),
        table_area,
    );

    let help = format!("{KEY_HELP}   sorted by {}", sort_title(view.sort));
    frame.render_widget(
        Paragraph::new(help).style(Style::new().add_modifier(Modifier::DIM)),
        help_area,
    );
}

/// The name column reads left to right; numbers line up on the right.
fn aligned(text: String, column: usize) -> Line<'static> {
    let alignment = if column == 0 {
        Alignment::Left
    } else {
        Alignment::Right
    };
    Line::from(text).alignment(alignment)
}

/// The terminal in raw mode on the alternate screen, put back as it was
/// when this is dropped: on return, on error, and while a panic unwinds
/// (ratatui's panic hook also restores it before the message is printed).
struct Screen {
    terminal: DefaultTerminal,
}

impl Screen {
    fn enter() -> Result<Self, LiveError> {
        match ratatui::try_init() {
            Ok(terminal) => Ok(Self { terminal }),
            Err(error) => {
                // Raw mode may be on although the alternate screen failed.
                ratatui::restore();
                Err(error.into())
            }
        }
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        ratatui::restore();
    }
}

/// Runs the live view over the regions under `roots` until a key quits
/// it: every `interval` the regions are listed and read again, so a new
/// region appears and a removed one disappears at the next refresh.
pub fn run(roots: &[PathBuf], interval: Duration, sort: SortKey) -> Result<(), LiveError> {
    if !std::io::stdout().is_terminal() {
        return Err(LiveError::NotATerminal);
    }
    let mut screen = Screen::enter()?;
    let mut view = View {
        rows: None,
        sort,
        interval,
    };
    let mut before = top::read(roots);
    let mut due = before.at() + interval;
    loop {
        screen.terminal.draw(|frame| render(frame, &view))?;
        let now = Instant::now();
        if now < due && event::poll(due - now)? {
            // A resize or any other event just redraws.
            if let Event::Key(key) = event::read()? {
                match action(key) {
                    Some(Action::Quit) => return Ok(()),
                    Some(Action::Sort(key)) => view.sort = key,
                    Some(Action::NextSort) => view.sort = view.sort.next(),
                    None => {}
                }
            }
            continue;
        }
        let reading = top::read(roots);
        view.rows = Some(top::rows_between(&before, &reading));
        due = reading.at() + interval;
        before = reading;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratatui::backend::TestBackend;
    use ratatui::Terminal;

    fn row(name: &str, memory_used: u64, utilization: f64) -> Row {
        Row {
            name: name.into(),
            device: 0,
            memory_used,
            memory_cap: Some(1 << 30),
            swap_used: 0,
            share: Some(30),
            effective: None,
            utilization,
            throttled: 0.0,
            launches: 120,
            oom_events: 0,
        }
    }

    /// The screen `view` draws, one string per terminal line.
    fn screen(view: &View, width: u16, height: u16) -> Vec<String> {
        let mut terminal = Terminal::new(TestBackend::new(width, height)).expect("test terminal");
        terminal
            .draw(|frame| render(frame, view))
            .expect("draw on the test backend");
        let buffer = terminal.backend().buffer();
        (0..height)
            .map(|y| {
                (0..width)
                    .map(|x| buffer[(x, y)].symbol())
                    .collect::<String>()
            })
            .collect()
    }

    /// The index of the first line starting with `name` (after blanks).
    fn line_of(lines: &[String], name: &str) -> usize {
        lines
            .iter()
            .position(|line| line.trim_start().starts_with(name))
            .unwrap_or_else(|| panic!("no line for {name}:\n{}", lines.join("\n")))
    }

    fn view(sort: SortKey) -> View {
        View {
            rows: Some(vec![
                row("alpha", 64 << 20, 10.0),
                row("busy", 0, 30.0),
                row("zeta", 512 << 20, 0.0),
            ]),
            sort,
            interval: Duration::from_millis(1000),
        }
    }

    #[test]
    fn rows_are_drawn_in_the_order_of_the_marked_column() {
        let by_name = screen(&view(SortKey::Name), 120, 10);
        let text = by_name.join("\n");
        assert!(by_name[0].contains("3 region GPU(s)"), "{text}");
        assert!(by_name[0].contains("over the last 1000 ms"), "{text}");
        assert!(by_name[1].contains("NAME*"), "{text}");
        assert!(!by_name[1].contains("UTIL*"), "{text}");
        assert!(line_of(&by_name, "alpha") < line_of(&by_name, "busy"));
        assert!(line_of(&by_name, "busy") < line_of(&by_name, "zeta"));
        let busy = &by_name[line_of(&by_name, "busy")];
        assert!(busy.contains("0B/1GiB"), "{text}");
        assert!(busy.contains("30%") && busy.contains("30.0%"), "{text}");
        assert!(by_name[9].contains("q quit"), "{text}");
        assert!(by_name[9].contains("sorted by NAME"), "{text}");

        let by_memory = screen(&view(SortKey::Memory), 120, 10);
        assert!(
            by_memory[1].contains("MEMORY/CAP*"),
            "{}",
            by_memory.join("\n")
        );
        assert!(line_of(&by_memory, "zeta") < line_of(&by_memory, "alpha"));
        assert!(line_of(&by_memory, "alpha") < line_of(&by_memory, "busy"));

        let by_util = screen(&view(SortKey::Util), 120, 10);
        assert!(by_util[1].contains("UTIL*"), "{}", by_util.join("\n"));
        assert!(line_of(&by_util, "busy") < line_of(&by_util, "alpha"));
        assert!(by_util[9].contains("sorted by UTIL"));
    }

    #[test]
    fn before_the_first_interval_it_says_it_is_measuring() {
        let waiting = View {
            rows: None,
            sort: SortKey::Name,
            interval: Duration::from_millis(500),
        };
        let lines = screen(&waiting, 100, 5);
        assert!(lines[0].contains("measuring the first 500 ms"), "{lines:?}");
        assert!(lines[1].contains("NAME*"), "{lines:?}");
        assert!(lines[2].trim().is_empty(), "no rows yet: {lines:?}");
    }

    #[test]
    fn a_narrow_terminal_still_draws() {
        // Columns that do not fit are cut, not a panic.
        let lines = screen(&view(SortKey::Name), 30, 4);
        assert_eq!(lines.len(), 4);
    }

    #[test]
    fn keys_quit_and_sort() {
        let key = |code| KeyEvent::new(code, KeyModifiers::NONE);
        assert_eq!(action(key(KeyCode::Char('q'))), Some(Action::Quit));
        assert_eq!(action(key(KeyCode::Esc)), Some(Action::Quit));
        assert_eq!(
            action(KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL)),
            Some(Action::Quit)
        );
        assert_eq!(action(key(KeyCode::Char('c'))), None);
        assert_eq!(action(key(KeyCode::Char('s'))), Some(Action::NextSort));
        assert_eq!(
            action(key(KeyCode::Char('m'))),
            Some(Action::Sort(SortKey::Memory))
        );
        assert_eq!(
            action(key(KeyCode::Char('u'))),
            Some(Action::Sort(SortKey::Util))
        );
        let mut release = key(KeyCode::Char('q'));
        release.kind = KeyEventKind::Release;
        assert_eq!(action(release), None);
    }
}
