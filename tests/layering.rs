//! The layer order of `src/` is data (`amprobe::LAYERS`) and this test is its judge: every
//! `crate::` path of a file may name only its own module, a module of a lower layer, or a
//! sideways neighbour that `amprobe::SIDEWAYS` allows; and no two files import each other,
//! directly or around a circle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") && !p.ends_with("tests.rs") {
            // (a `tests.rs` is a unit-test module, `#[cfg(test)] mod tests;`: unit tests
            // may reach anywhere)
            out.push(p);
        }
    }
}

/// Source lines with comments and string literals blanked (line numbers kept), and the
/// `#[cfg(test)]` module of the file cut off: unit tests may reach anywhere.
fn code_lines(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_block = 0usize;
    for line in text.lines() {
        if line.trim_start().starts_with("#[cfg(test)]") {
            break;
        }
        let mut s = String::new();
        let b: Vec<char> = line.chars().collect();
        let mut i = 0;
        let mut in_str = false;
        while i < b.len() {
            if in_block > 0 {
                if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    in_block -= 1;
                    i += 2;
                } else {
                    i += 1;
                }
                continue;
            }
            if in_str {
                if b[i] == '\\' {
                    i += 2;
                    continue;
                }
                if b[i] == '"' {
                    in_str = false;
                }
                i += 1;
                continue;
            }
            match (b[i], b.get(i + 1)) {
                ('/', Some('/')) => break,
                ('/', Some('*')) => {
                    in_block += 1;
                    i += 2;
                }
                ('"', _) => {
                    in_str = true;
                    i += 1;
                }
                ('\'', _) if b.get(i + 2) == Some(&'\'') => i += 3,
                (c, _) => {
                    s.push(c);
                    i += 1;
                }
            }
        }
        out.push(s);
    }
    out
}

/// The top-level module a file belongs to (`src/ops/cast.rs` → `ops`; the binary's files →
/// `cli`).
fn module_of(rel: &Path) -> String {
    let first = rel.components().next().expect("a path under src");
    let name = first.as_os_str().to_string_lossy();
    let name = name.strip_suffix(".rs").unwrap_or(&name).to_string();
    if name == "main" {
        "cli".to_string()
    } else {
        name
    }
}

/// Every module path a file names, with its 1-based line number: paths that start at
/// `crate::`, `super::` or `self::` (the root kept as the first segment), plain or in a
/// `use` with nested groups (`use crate::{a::b, c::{d, e}}`, which may span lines).
fn crate_paths(lines: &[String]) -> Vec<(usize, Vec<Vec<String>>)> {
    let mut out = Vec::new();
    let joined: Vec<(usize, char)> = lines
        .iter()
        .enumerate()
        .flat_map(|(n, l)| {
            l.chars()
                .chain(std::iter::once('\n'))
                .map(move |c| (n + 1, c))
        })
        .collect();
    let bytes: Vec<char> = joined.iter().map(|&(_, c)| c).collect();
    // Each root as written, and the path it stands for: a child module the file declares
    // (`mod grads;`) is named plainly (`grads::StepGrads`, `use grads::X`).
    let mut roots: Vec<(Vec<char>, Vec<String>)> = ["crate", "super", "self"]
        .iter()
        .map(|r| (format!("{r}::").chars().collect(), vec![r.to_string()]))
        .collect();
    for child in child_modules(lines) {
        roots.push((
            format!("{child}::").chars().collect(),
            vec!["self".to_string(), child],
        ));
    }
    let depth = inline_depths(&bytes);
    let mut i = 0;
    while i < bytes.len() {
        let boundary = i == 0
            || !(bytes[i - 1].is_alphanumeric() || bytes[i - 1] == '_' || bytes[i - 1] == ':');
        // (inside an inline module a plain name is that module's, not a child file)
        let root = roots
            .iter()
            .enumerate()
            .find(|(k, (r, _))| boundary && (*k < 3 || depth[i] == 0) && bytes[i..].starts_with(r));
        if let Some((_, (root, prefix))) = root {
            let line = joined[i].0;
            let mut j = i + root.len();
            let mut paths = Vec::new();
            expand(&bytes, &mut j, prefix.clone(), &mut paths);
            let paths = paths.into_iter().map(|p| lift(p, depth[i])).collect();
            out.push((line, paths));
            i = j.max(i + 1);
        } else {
            i += 1;
        }
    }
    out
}

/// For each character of a file, how many inline modules (`mod x { ... }`) enclose it.
fn inline_depths(b: &[char]) -> Vec<usize> {
    let mut out = Vec::with_capacity(b.len());
    let mut braces = 0usize;
    // the brace depth each open inline module's body starts at
    let mut open: Vec<usize> = Vec::new();
    let mut pending = false;
    let mut i = 0;
    while i < b.len() {
        let boundary = i == 0 || !(b[i - 1].is_alphanumeric() || b[i - 1] == '_');
        if boundary && b[i..].starts_with(&['m', 'o', 'd', ' ']) {
            pending = true;
        }
        match b[i] {
            ';' => pending = false,
            '{' => {
                braces += 1;
                if pending {
                    open.push(braces);
                    pending = false;
                }
            }
            '}' => {
                if open.last() == Some(&braces) {
                    open.pop();
                }
                braces = braces.saturating_sub(1);
            }
            _ => {}
        }
        out.push(open.len());
        i += 1;
    }
    out
}

/// A path written inside `depth` inline modules, as the file itself would write it: the
/// first `depth` `super`s stay in the file.
fn lift(path: Vec<String>, depth: usize) -> Vec<String> {
    let supers = path.iter().take_while(|s| *s == "super").count();
    if depth == 0 || supers == 0 {
        return path;
    }
    let mut out = if supers <= depth {
        vec!["self".to_string()]
    } else {
        vec!["super".to_string(); supers - depth]
    };
    out.extend(path[supers..].iter().cloned());
    out
}

/// The child modules a file declares (`mod x;`, `pub mod x;`, `pub(crate) mod x;`).
fn child_modules(lines: &[String]) -> Vec<String> {
    lines
        .iter()
        .filter_map(|l| {
            let l = l.trim();
            let rest = match l.strip_prefix("pub") {
                Some(r) if r.starts_with('(') => r.split_once(')')?.1.trim_start(),
                Some(r) => r.trim_start(),
                None => l,
            };
            let name = rest.strip_prefix("mod ")?.trim().strip_suffix(';')?.trim();
            name.chars()
                .all(|c| c.is_alphanumeric() || c == '_')
                .then(|| name.to_string())
        })
        .collect()
}

/// The module path a file defines (`ops/cast.rs` → `[ops, cast]`, `ops/mod.rs` → `[ops]`,
/// `lib.rs` and `main.rs` → the crate root).
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().to_string())
        .collect();
    let last = parts.pop().unwrap_or_default();
    let stem = last.strip_suffix(".rs").unwrap_or(&last).to_string();
    if !(stem == "mod" || (parts.is_empty() && (stem == "lib" || stem == "main"))) {
        parts.push(stem);
    }
    parts
}

/// A path as the file names it, made absolute from the crate root: `super::` and `self::`
/// resolved against the file's own module path, `crate::` dropped.
fn absolute(rel: &Path, path: &[String]) -> Vec<String> {
    let mut base = module_path(rel);
    let mut rest = path;
    while let Some((head, tail)) = rest.split_first() {
        match head.as_str() {
            "crate" => base.clear(),
            "self" => {}
            "super" => {
                base.pop();
            }
            _ => break,
        }
        rest = tail;
    }
    base.extend(rest.iter().cloned());
    base
}

/// Reads one path tree starting at `*j` (after `crate::`), pushing every full path.
fn expand(b: &[char], j: &mut usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
    let skip_ws = |j: &mut usize| {
        while *j < b.len() && b[*j].is_whitespace() {
            *j += 1;
        }
    };
    let mut path = prefix;
    loop {
        skip_ws(j);
        if *j < b.len() && b[*j] == '{' {
            *j += 1;
            loop {
                skip_ws(j);
                if *j >= b.len() {
                    return;
                }
                if b[*j] == '}' {
                    *j += 1;
                    return;
                }
                if b[*j] == ',' {
                    *j += 1;
                    continue;
                }
                expand(b, j, path.clone(), out);
            }
        }
        let start = *j;
        while *j < b.len() && (b[*j].is_alphanumeric() || b[*j] == '_') {
            *j += 1;
        }
        if *j == start {
            if !path.is_empty() {
                out.push(path);
            }
            return;
        }
        path.push(b[start..*j].iter().collect());
        if *j + 1 < b.len() && b[*j] == ':' && b[*j + 1] == ':' {
            *j += 2;
            continue;
        }
        out.push(path);
        return;
    }
}

/// The file a `crate::` path lands in: the longest prefix of it that is a file of `src/`.
fn file_of(src: &Path, path: &[String]) -> Option<PathBuf> {
    for n in (1..=path.len()).rev() {
        let rel: PathBuf = path[..n].iter().collect();
        for cand in [rel.with_extension("rs"), rel.join("mod.rs")] {
            if src.join(&cand).is_file() {
                return Some(cand);
            }
        }
    }
    None
}

struct Source {
    rel: PathBuf,
    lines: Vec<String>,
}

fn sources() -> (PathBuf, Vec<Source>) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let sources = files
        .into_iter()
        .map(|p| {
            let text =
                std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            Source {
                rel: p.strip_prefix(&src).expect("under src").to_path_buf(),
                lines: code_lines(&text),
            }
        })
        .collect();
    (src, sources)
}

fn layer_of(module: &str) -> Option<usize> {
    amprobe::LAYERS
        .iter()
        .position(|layer| layer.contains(&module))
}

#[test]
fn every_module_has_a_layer() {
    let (_, sources) = sources();
    let mut missing = BTreeSet::new();
    for s in &sources {
        let m = module_of(&s.rel);
        if m != "lib" && layer_of(&m).is_none() {
            missing.insert(m);
        }
    }
    assert!(
        missing.is_empty(),
        "modules missing from amprobe::LAYERS: {missing:?}"
    );
}

#[test]
fn each_modules_first_doc_line_says_its_layer() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let layers = amprobe::LAYERS;
    let mut wrong = Vec::new();
    for (n, mods) in layers.iter().enumerate() {
        let want = match n {
            0 => "//! Layer 0 of `amprobe::LAYERS`: uses no other module of the crate.".to_string(),
            1 => format!(
                "//! Layer 1 of `amprobe::LAYERS`: may use layer 0 (`{}` … `{}`).",
                layers[0][0],
                layers[0][layers[0].len() - 1]
            ),
            _ => format!(
                "//! Layer {n} of `amprobe::LAYERS`: may use layers 0–{} (`{}` … `{}`).",
                n - 1,
                layers[0][0],
                layers[n - 1][layers[n - 1].len() - 1]
            ),
        };
        for m in *mods {
            let dir = src.join(m).join("mod.rs");
            let file = if dir.is_file() {
                dir
            } else {
                src.join(format!("{m}.rs"))
            };
            let text = std::fs::read_to_string(&file)
                .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            let first = text.lines().next().unwrap_or_default();
            if first != want {
                wrong.push(format!("{}: `{first}`, want `{want}`", file.display()));
            }
        }
    }
    assert!(wrong.is_empty(), "first doc lines:\n{}", wrong.join("\n"));
}

#[test]
fn the_architecture_docs_layer_table_is_layers() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/architecture.md");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    // rows `| N | `a`, `b` | what they hold |`
    let rows: Vec<(usize, Vec<String>)> = text
        .lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let n = cells.get(1)?.parse::<usize>().ok()?;
            let names = cells
                .get(2)?
                .split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_string)
                .collect();
            Some((n, names))
        })
        .collect();
    let want: Vec<(usize, Vec<String>)> = amprobe::LAYERS
        .iter()
        .enumerate()
        .map(|(i, l)| (i, l.iter().map(|m| m.to_string()).collect()))
        .collect();
    assert_eq!(
        rows, want,
        "docs/architecture.md's layer table against amprobe::LAYERS"
    );
}

#[test]
fn imports_point_down_the_layers() {
    let (_, sources) = sources();
    let mut broken = Vec::new();
    for s in &sources {
        let from = module_of(&s.rel);
        let Some(lf) = layer_of(&from) else { continue };
        for (line, paths) in crate_paths(&s.lines) {
            for p in paths {
                let abs = absolute(&s.rel, &p);
                let Some(to) = abs.first().map(String::as_str) else {
                    continue;
                };
                if to == from {
                    continue;
                }
                let Some(lt) = layer_of(to) else {
                    // A re-export of the crate root (`crate::Result`, `crate::DType`).
                    continue;
                };
                let allowed = lt < lf || amprobe::SIDEWAYS.contains(&(from.as_str(), to));
                if !allowed {
                    broken.push(format!(
                        "src/{}:{line}: {from} (layer {lf}) uses crate::{} (layer {lt})",
                        s.rel.display(),
                        abs.join("::")
                    ));
                }
            }
        }
    }
    assert!(
        broken.is_empty(),
        "imports that point up or sideways:\n{}",
        broken.join("\n")
    );
}

#[test]
fn no_import_circle_between_files() {
    let (src, sources) = sources();
    // file -> the files it imports -> the lines that do
    let mut edges: BTreeMap<PathBuf, BTreeMap<PathBuf, BTreeSet<usize>>> = BTreeMap::new();
    for s in &sources {
        let e = edges.entry(s.rel.clone()).or_default();
        for (line, paths) in crate_paths(&s.lines) {
            for p in paths {
                if let Some(f) = file_of(&src, &absolute(&s.rel, &p)) {
                    if f != s.rel && !f.ends_with("lib.rs") {
                        e.entry(f).or_default().insert(line);
                    }
                }
            }
        }
    }
    let nodes: Vec<PathBuf> = edges.keys().cloned().collect();
    let idx: BTreeMap<&PathBuf, usize> = nodes.iter().enumerate().map(|(i, n)| (n, i)).collect();
    let adj: Vec<Vec<usize>> = nodes
        .iter()
        .map(|n| {
            edges[n]
                .keys()
                .filter_map(|m| idx.get(m).copied())
                .collect()
        })
        .collect();
    let circles = Tarjan::components(&adj);
    let text: Vec<String> = circles
        .iter()
        .map(|c| {
            let mut names: Vec<String> = c
                .iter()
                .map(|&i| format!("src/{}", nodes[i].display()))
                .collect();
            names.sort();
            // and the imports that close it
            let mut lines = Vec::new();
            for &i in c {
                for &j in c {
                    if let Some(at) = edges[&nodes[i]].get(&nodes[j]) {
                        let at: Vec<String> = at.iter().map(usize::to_string).collect();
                        lines.push(format!(
                            "    src/{}:{} -> src/{}",
                            nodes[i].display(),
                            at.join(","),
                            nodes[j].display()
                        ));
                    }
                }
            }
            lines.sort();
            format!("{}\n{}", names.join(", "), lines.join("\n"))
        })
        .collect();
    assert!(text.is_empty(), "import circles:\n{}", text.join("\n"));
}

/// Tarjan's strongly connected components: every group of files that reach each other.
struct Tarjan<'a> {
    adj: &'a [Vec<usize>],
    index: Vec<usize>,
    low: Vec<usize>,
    on_stack: Vec<bool>,
    stack: Vec<usize>,
    next: usize,
    circles: Vec<Vec<usize>>,
}

impl Tarjan<'_> {
    /// The components of more than one node.
    fn components(adj: &[Vec<usize>]) -> Vec<Vec<usize>> {
        let n = adj.len();
        let mut t = Tarjan {
            adj,
            index: vec![usize::MAX; n],
            low: vec![0; n],
            on_stack: vec![false; n],
            stack: Vec::new(),
            next: 0,
            circles: Vec::new(),
        };
        for v in 0..n {
            if t.index[v] == usize::MAX {
                t.visit(v);
            }
        }
        t.circles
    }

    fn visit(&mut self, v: usize) {
        self.index[v] = self.next;
        self.low[v] = self.next;
        self.next += 1;
        self.stack.push(v);
        self.on_stack[v] = true;
        for &w in &self.adj[v] {
            if self.index[w] == usize::MAX {
                self.visit(w);
                self.low[v] = self.low[v].min(self.low[w]);
            } else if self.on_stack[w] {
                self.low[v] = self.low[v].min(self.index[w]);
            }
        }
        if self.low[v] == self.index[v] {
            let mut comp = Vec::new();
            loop {
                let w = self.stack.pop().expect("on the stack");
                self.on_stack[w] = false;
                comp.push(w);
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                self.circles.push(comp);
            }
        }
    }
}

#[test]
fn tarjan_finds_circles_only() {
    // 0 → 1 → 2 → 0 is a circle; 3 → 0 and 4 alone are not.
    let adj = vec![vec![1], vec![2], vec![0], vec![0], vec![]];
    let mut c = Tarjan::components(&adj);
    c.iter_mut().for_each(|x| x.sort());
    assert_eq!(c, vec![vec![0, 1, 2]]);
}

/// Every path `crate_paths` finds in `lines`, joined, with its line number.
fn flat_paths(lines: &[String]) -> Vec<(usize, String)> {
    crate_paths(lines)
        .into_iter()
        .flat_map(|(l, ps)| ps.into_iter().map(move |p| (l, p.join("::"))))
        .collect()
}

#[test]
fn the_parser_reads_grouped_and_nested_uses() {
    let lines = code_lines(
        "use crate::{dtype::DType, trace::{record::Phase, io}};\n\
         // crate::report::x in a comment\n\
         let s = \"crate::tui\";\n\
         let x = crate::ops::cast::cast(a);\n\
         use super::super::x::Y;\n",
    );
    let flat = flat_paths(&lines);
    assert_eq!(
        flat,
        vec![
            (1, "crate::dtype::DType".to_string()),
            (1, "crate::trace::record::Phase".to_string()),
            (1, "crate::trace::io".to_string()),
            (4, "crate::ops::cast::cast".to_string()),
            (5, "super::super::x::Y".to_string()),
        ]
    );
}

#[test]
fn the_parser_reads_paths_through_declared_child_modules() {
    let lines = code_lines(
        "mod grads;\n\
         pub(crate) mod cpu;\n\
         use grads::{StepGrads, views::Host};\n\
         let y = cpu::scan(x);\n\
         let z = other::g();\n\
         let w = crate::a::grads::X;\n",
    );
    let flat = flat_paths(&lines);
    assert_eq!(
        flat,
        vec![
            (3, "self::grads::StepGrads".to_string()),
            (3, "self::grads::views::Host".to_string()),
            (4, "self::cpu::scan".to_string()),
            (6, "crate::a::grads::X".to_string()),
        ]
    );
}

#[test]
fn super_inside_an_inline_module_stays_in_the_file() {
    let lines = code_lines(
        "mod grads;\n\
         mod avx2 {\n\
             use super::{Acc, LANES};\n\
             use super::super::x::Y;\n\
             fn f() { let a = grads::g(); }\n\
         }\n\
         use super::z::W;\n",
    );
    let flat = flat_paths(&lines);
    assert_eq!(
        flat,
        vec![
            (3, "self::Acc".to_string()),
            (3, "self::LANES".to_string()),
            (4, "super::x::Y".to_string()),
            (7, "super::z::W".to_string()),
        ]
    );
}

#[test]
fn relative_paths_resolve_from_the_file() {
    let p = |s: &str| s.split("::").map(String::from).collect::<Vec<_>>();
    let rel = Path::new("tui/app.rs");
    assert_eq!(
        absolute(rel, &p("super::ops::OpsView")),
        p("tui::ops::OpsView")
    );
    assert_eq!(absolute(rel, &p("self::inner")), p("tui::app::inner"));
    assert_eq!(
        absolute(Path::new("trace/mod.rs"), &p("super::dtype")),
        p("dtype")
    );
    assert_eq!(absolute(rel, &p("crate::trace::io")), p("trace::io"));
    assert_eq!(module_of(Path::new("main.rs")), "cli");
}
