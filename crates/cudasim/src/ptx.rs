//! What the stand-in needs from PTX text: each `.entry` with the byte size of every
//! parameter, and the static shared memory each entry uses.

use std::collections::HashMap;

/// One kernel entry point of a module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Byte size of each parameter, in order.
    pub params: Vec<usize>,
    /// Bytes of `.shared` variables the entry declares or references.
    pub static_shared: usize,
}

fn scalar_bytes(ty: &str) -> Option<usize> {
    let bits: usize = ty
        .trim_start_matches('.')
        .trim_start_matches(|c: char| c.is_ascii_alphabetic())
        .parse()
        .ok()?;
    Some(bits.div_ceil(8))
}

/// Size of a declaration like `.align 8 .b8 name[144]` or `.u64 name`: (name, bytes).
fn declared(decl: &str) -> Option<(String, usize)> {
    let toks: Vec<&str> = decl.split_whitespace().collect();
    let mut ty = None;
    let mut name = None;
    let mut i = 0;
    while i < toks.len() {
        let t = toks[i];
        if t == ".align" || t == ".ptr" {
            i += 2;
            continue;
        }
        if t.starts_with('.') {
            if scalar_bytes(t).is_some() {
                ty = Some(t);
            }
        } else {
            name = Some(t.trim_end_matches([',', ';']));
        }
        i += 1;
    }
    let elem = scalar_bytes(ty?)?;
    let name = name?;
    if let Some((base, rest)) = name.split_once('[') {
        let n: usize = rest.trim_end_matches(']').parse().ok()?;
        Some((base.to_string(), elem * n))
    } else {
        Some((name.to_string(), elem))
    }
}

/// Every `.entry` of a PTX module.
pub fn entries(ptx: &str) -> HashMap<String, Entry> {
    // Module-scope shared variables, by name.
    let mut module_shared: HashMap<String, usize> = HashMap::new();
    let mut depth = 0i32;
    for line in ptx.lines() {
        let t = line.trim();
        if depth == 0 {
            if let Some(rest) = t.strip_prefix(".shared") {
                if let Some((n, b)) = declared(rest.trim_end_matches(';')) {
                    module_shared.insert(n, b);
                }
            }
        }
        depth += t.matches('{').count() as i32 - t.matches('}').count() as i32;
    }
    let mut out = HashMap::new();
    let mut rest = ptx;
    while let Some(i) = rest.find(".entry ") {
        let after = &rest[i + ".entry ".len()..];
        let Some(open) = after.find('(') else { break };
        let name = after[..open].trim().to_string();
        let Some(close) = after[open..].find(')') else {
            break;
        };
        let plist = &after[open + 1..open + close];
        let params = plist
            .split(".param")
            .skip(1)
            .filter_map(|p| declared(p.trim().trim_end_matches(',')).map(|(_, b)| b))
            .collect();
        // The body: from the first `{` after the parameter list to its matching `}`.
        let body_start = after[open + close..].find('{').map(|j| open + close + j);
        let mut static_shared = 0;
        let mut consumed = open + close;
        if let Some(bs) = body_start {
            let mut d = 0i32;
            let mut end = after.len();
            for (j, c) in after[bs..].char_indices() {
                match c {
                    '{' => d += 1,
                    '}' => {
                        d -= 1;
                        if d == 0 {
                            end = bs + j;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            let body = &after[bs..end];
            for l in body.lines() {
                if let Some(r) = l.trim().strip_prefix(".shared") {
                    if let Some((_, b)) = declared(r.trim_end_matches(';')) {
                        static_shared += b;
                    }
                }
            }
            for (n, b) in &module_shared {
                if body.contains(n.as_str()) {
                    static_shared += b;
                }
            }
            consumed = end;
        }
        out.insert(
            name,
            Entry {
                params,
                static_shared,
            },
        );
        rest = &after[consumed..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_entries_params_and_shared() {
        let ptx = r#"
.shared .align 4 .u32 _ZZ5countE1s;
.visible .entry k(
	.param .u64 k_param_0,
	.param .u32 k_param_1,
	.param .align 8 .b8 k_param_2[144]
)
{
	.shared .align 8 .b8 _ZZ1kE3buf[2048];
	ld.shared.u32 %r1, [_ZZ5countE1s];
	ret;
}
.visible .entry j()
{
	ret;
}
"#;
        let e = entries(ptx);
        assert_eq!(e["k"].params, vec![8, 4, 144]);
        assert_eq!(e["k"].static_shared, 2048 + 4);
        assert_eq!(e["j"].params, Vec::<usize>::new());
        assert_eq!(e["j"].static_shared, 0);
    }
}
