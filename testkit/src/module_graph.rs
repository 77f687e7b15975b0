//! The import graph of one crate's modules, read from its source files,
//! and the circles in it.
//!
//! Generic over a crate's `src` folder, and self-contained (the standard
//! library only), so that it can check every crate of the workspace.
//!
//! A module is a file: `lib.rs` (or `main.rs` for a crate without a
//! library) is the crate root, `a.rs` and `a/mod.rs` are `a`, `a/b.rs` is
//! `a::b`. Inline modules (`mod tests { ... }`) belong to their file. An
//! edge `a -> b` is any path of `a`'s code that names something in `b`:
//! - `use` declarations, braces expanded (`use crate::x::{y, z::W}`);
//! - paths in code starting with `crate::`, `super::` or `self::`, or with
//!   the name of a child module (`routes::router()`) or of a module that a
//!   `use` brought in (`use crate::cache; cache::state::Foo`).
//!
//! `mod` declarations are not edges: a folder's `mod.rs` that only declares
//! its files, and files that import their siblings, make no circle; a
//! `mod.rs` that re-exports a child's item (`pub use child::Item`) while
//! that child imports the parent (`use super::Thing`) does.
//!
//! Comments, string and character literals are skipped, so a path in a
//! doc comment or a message is no import.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// The root module's name in reports.
pub const ROOT: &str = "crate";

/// Where one module names another: file, line and the path as written
/// (use trees expanded).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Import {
    pub file: PathBuf,
    pub line: usize,
    pub path: String,
}

/// A crate's modules and which import which.
#[derive(Debug, Default)]
pub struct ModuleGraph {
    /// Module name (`a::b`, or [`ROOT`]) to its file.
    modules: BTreeMap<String, PathBuf>,
    /// `from` to `to` to the imports that make the edge.
    edges: BTreeMap<String, BTreeMap<String, Vec<Import>>>,
}

/// A circle: modules in order, each importing the next and the last the
/// first, with one import per step; and every module of its group (those
/// that all reach each other), of which the circle is the shortest
/// through the first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Circle {
    pub modules: Vec<String>,
    pub steps: Vec<Import>,
    pub group: Vec<String>,
}

impl fmt::Display for Circle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} -> {}", self.modules.join(" -> "), self.modules[0])?;
        if self.group.len() > self.modules.len() {
            write!(
                f,
                " (one circle among {} modules that reach each other: {})",
                self.group.len(),
                self.group.join(", ")
            )?;
        }
        for (module, step) in self.modules.iter().zip(&self.steps) {
            write!(
                f,
                "\n    {module}: {}:{} names {}",
                step.file.display(),
                step.line,
                step.path
            )?;
        }
        Ok(())
    }
}

impl ModuleGraph {
    /// Reads every `.rs` file under `src` (a crate's source folder).
    /// Binaries beside a library (`main.rs`, `bin/`) are other crates and
    /// are left out.
    pub fn read(src: &Path) -> io::Result<Self> {
        let mut files = Vec::new();
        collect_rust_files(src, &mut files)?;
        let has_library = src.join("lib.rs").is_file();
        let mut graph = Self::default();
        for file in &files {
            let relative = file.strip_prefix(src).unwrap_or(file);
            if let Some(name) = module_name(relative, has_library) {
                graph.modules.insert(name, file.clone());
            }
        }
        let modules: BTreeSet<String> = graph.modules.keys().cloned().collect();
        for (name, file) in graph.modules.clone() {
            let text = std::fs::read_to_string(&file)?;
            for (target, import) in imports_of(&name, &file, &text, &modules) {
                if target != name {
                    graph
                        .edges
                        .entry(name.clone())
                        .or_default()
                        .entry(target)
                        .or_default()
                        .push(import);
                }
            }
        }
        Ok(graph)
    }

    /// Every module's name.
    pub fn modules(&self) -> impl Iterator<Item = &str> {
        self.modules.keys().map(String::as_str)
    }

    /// The modules `module` imports.
    pub fn imports_of(&self, module: &str) -> Vec<&str> {
        self.edges
            .get(module)
            .map(|targets| targets.keys().map(String::as_str).collect())
            .unwrap_or_default()
    }

    /// One circle per group of modules that reach each other (a strongly
    /// connected component of more than one module), shortest first within
    /// the group, groups in name order.
    pub fn circles(&self) -> Vec<Circle> {
        strongly_connected(&self.modules, &self.edges)
            .into_iter()
            .filter(|group| group.len() > 1)
            .filter_map(|group| self.shortest_circle(&group))
            .collect()
    }

    /// The shortest circle through the first module of `group`, walking
    /// only inside the group.
    fn shortest_circle(&self, group: &BTreeSet<String>) -> Option<Circle> {
        let start = group.iter().next()?;
        let mut previous: BTreeMap<&str, &str> = BTreeMap::new();
        let mut queue = VecDeque::from([start.as_str()]);
        let mut closing = None;
        while let Some(module) = queue.pop_front() {
            for target in self.imports_of(module) {
                if !group.contains(target) {
                    continue;
                }
                if target == start {
                    closing = Some(module);
                    break;
                }
                if target != start && !previous.contains_key(target) {
                    previous.insert(target, module);
                    queue.push_back(target);
                }
            }
            if closing.is_some() {
                break;
            }
        }
        let mut modules = vec![closing?.to_string()];
        while let Some(&before) = previous.get(modules[0].as_str()) {
            modules.insert(0, before.to_string());
        }
        if modules[0] != *start {
            modules.insert(0, start.clone());
        }
        let steps = modules
            .iter()
            .zip(modules.iter().skip(1).chain([start]))
            .filter_map(|(from, to)| self.edges.get(from)?.get(to)?.first().cloned())
            .collect();
        Some(Circle {
            modules,
            steps,
            group: group.iter().cloned().collect(),
        })
    }
}

fn collect_rust_files(folder: &Path, files: &mut Vec<PathBuf>) -> io::Result<()> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(folder)?
        .map(|entry| entry.map(|e| e.path()))
        .collect::<io::Result<_>>()?;
    entries.sort();
    for path in entries {
        if path.is_dir() {
            collect_rust_files(&path, files)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    Ok(())
}

/// The module a file under `src` is, `None` for a binary beside the
/// library.
fn module_name(relative: &Path, has_library: bool) -> Option<String> {
    let mut parts: Vec<String> = relative
        .iter()
        .map(|part| part.to_string_lossy().into_owned())
        .collect();
    let file = parts.pop()?;
    let stem = file.strip_suffix(".rs")?;
    if parts.is_empty() {
        match stem {
            "lib" => return Some(ROOT.to_string()),
            "main" if has_library => return None,
            "main" => return Some(ROOT.to_string()),
            _ => {}
        }
    }
    if has_library && parts.first().is_some_and(|p| p == "bin") {
        return None;
    }
    if stem != "mod" {
        parts.push(stem.to_string());
    }
    Some(parts.join("::"))
}

/// `text` with comments, string and character literals blanked out
/// (newlines kept, so lines still count).
fn code_only(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let blank = |out: &mut String, c: char| out.push(if c == '\n' { '\n' } else { ' ' });
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, chars[i]);
                    i += 1;
                }
            }
        } else if let Some(length) = raw_string_start(&chars, i) {
            // r"..", r#".."#, br#".."#: ends at a quote and as many hashes.
            let hashes = length - if c == 'b' { 3 } else { 2 };
            for _ in 0..length {
                out.push(' ');
            }
            i += length;
            while i < chars.len() {
                let closes =
                    chars[i] == '"' && (1..=hashes).all(|k| chars.get(i + k) == Some(&'#'));
                if closes {
                    for _ in 0..=hashes {
                        out.push(' ');
                    }
                    i += hashes + 1;
                    break;
                }
                blank(&mut out, chars[i]);
                i += 1;
            }
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while i < chars.len() {
                match chars[i] {
                    '\\' => {
                        out.push(' ');
                        if let Some(&escaped) = chars.get(i + 1) {
                            blank(&mut out, escaped);
                        }
                        i += 2;
                    }
                    '"' => {
                        out.push(' ');
                        i += 1;
                        break;
                    }
                    other => {
                        blank(&mut out, other);
                        i += 1;
                    }
                }
            }
        } else if c == '\'' {
            // A character literal ('a', '\n', '\u{1F600}'), not a lifetime.
            let end = if next == Some('\\') {
                (i + 2..chars.len()).find(|&k| chars[k] == '\'')
            } else if chars.get(i + 2) == Some(&'\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(end) => {
                    for _ in i..=end {
                        out.push(' ');
                    }
                    i = end + 1;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// The length of the opening of a raw string at `i` (`r"`, `r#"`,
/// `br##"`, ...), if one starts there.
fn raw_string_start(chars: &[char], i: usize) -> Option<usize> {
    let after_word = i == 0 || !is_ident_char(chars[i - 1]);
    if !after_word {
        return None;
    }
    let mut k = i;
    if chars.get(k) == Some(&'b') {
        k += 1;
    }
    if chars.get(k) != Some(&'r') {
        return None;
    }
    k += 1;
    while chars.get(k) == Some(&'#') {
        k += 1;
    }
    (chars.get(k) == Some(&'"')).then_some(k + 1 - i)
}

fn is_ident_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// A token of code: an identifier (or keyword), `::`, or one punctuation
/// character; with its line.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Token {
    text: String,
    line: usize,
}

fn tokens(code: &str) -> Vec<Token> {
    let chars: Vec<char> = code.chars().collect();
    let mut tokens = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if is_ident_char(c) {
            let start = i;
            while i < chars.len() && is_ident_char(chars[i]) {
                i += 1;
            }
            // `r#type`: a raw identifier is the identifier.
            let text: String = chars[start..i].iter().collect();
            tokens.push(Token { text, line });
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            tokens.push(Token {
                text: "::".into(),
                line,
            });
            i += 2;
        } else {
            tokens.push(Token {
                text: c.to_string(),
                line,
            });
            i += 1;
        }
    }
    tokens
}

/// Expands a use tree (the tokens between `use` and `;`) into paths.
fn expand_use_tree(tokens: &[Token]) -> Vec<(Vec<String>, Option<String>)> {
    let mut paths = Vec::new();
    let mut position = 0;
    expand_into(tokens, &mut position, &[], &mut paths);
    paths
}

/// Reads one tree at `position` below `prefix`: `a::b`, `a::{..}`, `a::*`,
/// `a as b`, `{..}`; each path with its `as` name.
fn expand_into(
    tokens: &[Token],
    position: &mut usize,
    prefix: &[String],
    paths: &mut Vec<(Vec<String>, Option<String>)>,
) {
    let mut path: Vec<String> = prefix.to_vec();
    // A leading `::` (an external crate) changes nothing here.
    if tokens.get(*position).is_some_and(|t| t.text == "::") {
        *position += 1;
    }
    while let Some(token) = tokens.get(*position) {
        match token.text.as_str() {
            "{" => {
                *position += 1;
                loop {
                    match tokens.get(*position).map(|t| t.text.as_str()) {
                        None => return,
                        Some("}") => {
                            *position += 1;
                            return;
                        }
                        Some(",") => *position += 1,
                        Some(_) => expand_into(tokens, position, &path, paths),
                    }
                }
            }
            "*" => {
                *position += 1;
                paths.push((path, None));
                return;
            }
            "self" if path.len() > prefix.len() || !prefix.is_empty() => {
                // `a::{self}` is `a` itself.
                *position += 1;
            }
            text if is_ident_char(text.chars().next().unwrap_or(' ')) && text != "as" => {
                path.push(text.to_string());
                *position += 1;
            }
            _ => break,
        }
        match tokens.get(*position).map(|t| t.text.as_str()) {
            Some("::") => *position += 1,
            Some("as") => {
                let alias = tokens.get(*position + 1).map(|t| t.text.clone());
                *position += 2;
                paths.push((path, alias));
                return;
            }
            _ => {
                paths.push((path, None));
                return;
            }
        }
    }
}

/// `segments` (as written in module `current`, `current` being the file's
/// module plus any inline modules) made absolute, or `None` when they name
/// something outside the crate.
fn absolute(
    current: &[String],
    file_module: &[String],
    segments: &[String],
    modules: &BTreeSet<String>,
    aliases: &BTreeMap<String, Vec<String>>,
) -> Option<Vec<String>> {
    let mut rest = segments;
    let mut base: Vec<String> = match rest.first().map(String::as_str) {
        Some("crate") => {
            rest = &rest[1..];
            Vec::new()
        }
        Some("self") => {
            rest = &rest[1..];
            current.to_vec()
        }
        Some("super") => {
            let mut base = current.to_vec();
            while rest.first().is_some_and(|s| s == "super") {
                base.pop()?;
                rest = &rest[1..];
            }
            base
        }
        Some(first) => {
            // A child module of this file's module, or a module a `use`
            // brought in.
            let mut child = file_module.to_vec();
            child.push(first.to_string());
            if modules.contains(&join(&child)) {
                rest = &rest[1..];
                child
            } else if let Some(module) = aliases.get(first) {
                rest = &rest[1..];
                module.clone()
            } else {
                return None;
            }
        }
        None => return None,
    };
    base.extend(rest.iter().cloned());
    Some(base)
}

/// The deepest module `path` (absolute) names or lies in.
fn owning_module(path: &[String], modules: &BTreeSet<String>) -> String {
    (0..=path.len())
        .rev()
        .map(|length| join(&path[..length]))
        .find(|name| modules.contains(name))
        .unwrap_or_else(|| ROOT.to_string())
}

fn join(segments: &[String]) -> String {
    if segments.is_empty() {
        ROOT.to_string()
    } else {
        segments.join("::")
    }
}

fn segments_of(module: &str) -> Vec<String> {
    if module == ROOT {
        Vec::new()
    } else {
        module.split("::").map(str::to_string).collect()
    }
}

/// Every module file `module` (at `file`, with source `text`) names, with
/// where.
fn imports_of(
    module: &str,
    file: &Path,
    text: &str,
    modules: &BTreeSet<String>,
) -> Vec<(String, Import)> {
    let tokens = tokens(&code_only(text));
    let file_module = segments_of(module);
    let mut found = Vec::new();
    let mut aliases: BTreeMap<String, Vec<String>> = BTreeMap::new();
    // Inline modules open at a brace depth: (depth, name).
    let mut inline: Vec<(usize, String)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    let record = |segments: &[String],
                  line: usize,
                  current: &[String],
                  aliases: &BTreeMap<String, Vec<String>>,
                  found: &mut Vec<(String, Import)>|
     -> Option<Vec<String>> {
        let path = absolute(current, &file_module, segments, modules, aliases)?;
        let target = owning_module(&path, modules);
        found.push((
            target,
            Import {
                file: file.to_path_buf(),
                line,
                path: segments.join("::"),
            },
        ));
        Some(path)
    };
    while i < tokens.len() {
        let current: Vec<String> = file_module
            .iter()
            .cloned()
            .chain(inline.iter().map(|(_, name)| name.clone()))
            .collect();
        let token = &tokens[i];
        let previous = i.checked_sub(1).map(|k| tokens[k].text.as_str());
        match token.text.as_str() {
            "{" => {
                depth += 1;
                i += 1;
            }
            "}" => {
                if inline.last().is_some_and(|(open, _)| *open == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
                i += 1;
            }
            "mod" if tokens.get(i + 2).is_some_and(|t| t.text == "{") => {
                // An inline module: its paths are relative to it.
                depth += 1;
                inline.push((depth, tokens[i + 1].text.clone()));
                i += 3;
            }
            "use" if previous != Some("::") => {
                let end = (i + 1..tokens.len())
                    .find(|&k| tokens[k].text == ";")
                    .unwrap_or(tokens.len());
                for (segments, alias) in expand_use_tree(&tokens[i + 1..end]) {
                    if let Some(path) =
                        record(&segments, token.line, &current, &aliases, &mut found)
                    {
                        if modules.contains(&join(&path)) && !path.is_empty() {
                            let name = alias.or_else(|| path.last().cloned());
                            if let Some(name) = name.filter(|n| n != "_") {
                                aliases.insert(name, path);
                            }
                        }
                    }
                }
                i = end + 1;
            }
            text if is_ident_char(text.chars().next().unwrap_or(' '))
                && tokens.get(i + 1).is_some_and(|t| t.text == "::")
                && previous != Some("::")
                && previous != Some("in") =>
            {
                // A path in code: its segments up to the last `::` name.
                let mut segments = vec![text.to_string()];
                let mut k = i + 1;
                while tokens.get(k).is_some_and(|t| t.text == "::")
                    && tokens
                        .get(k + 1)
                        .is_some_and(|t| is_ident_char(t.text.chars().next().unwrap_or(' ')))
                {
                    segments.push(tokens[k + 1].text.clone());
                    k += 2;
                }
                record(&segments, token.line, &current, &aliases, &mut found);
                i = k;
            }
            _ => i += 1,
        }
    }
    found
}

/// Tarjan's strongly connected components.
fn strongly_connected(
    modules: &BTreeMap<String, PathBuf>,
    edges: &BTreeMap<String, BTreeMap<String, Vec<Import>>>,
) -> Vec<BTreeSet<String>> {
    struct Walk<'a> {
        edges: &'a BTreeMap<String, BTreeMap<String, Vec<Import>>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        next: usize,
        groups: Vec<BTreeSet<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, module: &'a str) {
            self.index.insert(module, self.next);
            self.low.insert(module, self.next);
            self.next += 1;
            self.stack.push(module);
            self.on_stack.insert(module);
            let targets: Vec<&'a str> = self
                .edges
                .get(module)
                .map(|t| t.keys().map(String::as_str).collect())
                .unwrap_or_default();
            for target in targets {
                if !self.index.contains_key(target) {
                    self.visit(target);
                    let low = self.low[module].min(self.low[target]);
                    self.low.insert(module, low);
                } else if self.on_stack.contains(target) {
                    let low = self.low[module].min(self.index[target]);
                    self.low.insert(module, low);
                }
            }
            if self.low[module] == self.index[module] {
                let mut group = BTreeSet::new();
                while let Some(member) = self.stack.pop() {
                    self.on_stack.remove(member);
                    group.insert(member.to_string());
                    if member == module {
                        break;
                    }
                }
                self.groups.push(group);
            }
        }
    }
    let mut walk = Walk {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        groups: Vec::new(),
    };
    for module in modules.keys() {
        if !walk.index.contains_key(module.as_str()) {
            walk.visit(module);
        }
    }
    walk.groups.sort();
    walk.groups
}
