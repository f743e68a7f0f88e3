//! Just enough of a PTX reader for the simulated driver: the ISA version, each kernel's name
//! and parameter sizes (to read launch arguments), and module-scope `.global` variables.

pub use crate::image::{Kernel, Resources};

#[derive(Debug, PartialEq, Eq)]
pub struct Module {
    /// `.version 8.4` → 84.
    pub version: i32,
    pub kernels: Vec<Kernel>,
    pub globals: Vec<(String, usize)>,
}

#[derive(Debug, PartialEq, Eq)]
pub enum PtxError {
    /// Not PTX text at all (e.g. a cubin or fatbin).
    NotPtx,
    /// PTX text the reader cannot make sense of.
    Malformed(String),
}

fn strip_comments(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix("//") {
            rest = r.find('\n').map_or("", |i| &r[i..]);
        } else if let Some(r) = rest.strip_prefix("/*") {
            rest = r.find("*/").map_or("", |i| &r[i + 2..]);
        } else {
            let c = rest.chars().next().expect("non-empty");
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

fn type_size(t: &str) -> Option<usize> {
    Some(match t {
        ".u8" | ".s8" | ".b8" | ".pred" => 1,
        ".u16" | ".s16" | ".b16" | ".f16" | ".bf16" => 2,
        ".u32" | ".s32" | ".b32" | ".f32" | ".f16x2" | ".bf16x2" => 4,
        ".u64" | ".s64" | ".b64" | ".f64" => 8,
        _ => return None,
    })
}

/// Size of a declaration like `.param .align 8 .b8 name[24]` or `.global .u32 x = 1`.
fn decl_size(tokens: &[&str]) -> Option<(String, usize)> {
    let ty = tokens.iter().find_map(|t| type_size(t))?;
    let name_tok = tokens
        .iter()
        .rev()
        .find(|t| !t.starts_with('.') && !t.chars().all(|c| c.is_ascii_digit()))?;
    let (name, count) = match name_tok.split_once('[') {
        Some((n, rest)) => {
            let count = rest.trim_end_matches(']').parse::<usize>().unwrap_or(1);
            (n.to_string(), count)
        }
        None => (name_tok.to_string(), 1),
    };
    Some((name, ty * count))
}

pub fn parse(src: &str) -> Result<Module, PtxError> {
    if !src.contains(".version") || !src.contains(".target") {
        return Err(PtxError::NotPtx);
    }
    let text = strip_comments(src);
    if text.matches('{').count() != text.matches('}').count() {
        return Err(PtxError::Malformed("unbalanced braces".into()));
    }
    let mut version = 0;
    let mut kernels = Vec::new();
    let mut bodies = Vec::new();
    let mut globals = Vec::new();
    let mut depth = 0usize;
    let mut rest = text.as_str();
    while let Some(i) = rest.find(['{', '}', '.']) {
        let c = rest.as_bytes()[i];
        let tail = &rest[i..];
        match c {
            b'{' => {
                depth += 1;
                rest = &tail[1..];
            }
            b'}' => {
                depth = depth.saturating_sub(1);
                rest = &tail[1..];
            }
            _ if depth == 0 && tail.starts_with(".version") => {
                let v = tail[8..].split_whitespace().next().unwrap_or("");
                let (major, minor) = v.split_once('.').unwrap_or((v, "0"));
                version =
                    major.parse::<i32>().unwrap_or(0) * 10 + minor.parse::<i32>().unwrap_or(0);
                rest = &tail[8..];
            }
            _ if depth == 0
                && tail.starts_with(".entry")
                && !tail[6..].starts_with(|c: char| c.is_alphanumeric() || c == '_') =>
            {
                let body = &tail[6..];
                let name: String = body
                    .trim_start()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '$')
                    .collect();
                if name.is_empty() {
                    return Err(PtxError::Malformed("an .entry without a name".into()));
                }
                let header_end = body
                    .find('{')
                    .ok_or_else(|| PtxError::Malformed(format!("entry {name} has no body")))?;
                let header = &body[..header_end];
                let mut params = Vec::new();
                if let (Some(open), Some(close)) = (header.find('('), header.rfind(')')) {
                    for decl in header[open + 1..close]
                        .split(',')
                        .filter(|d| !d.trim().is_empty())
                    {
                        let tokens: Vec<&str> = decl.split_whitespace().collect();
                        let (_, size) = decl_size(&tokens).ok_or_else(|| {
                            PtxError::Malformed(format!("parameter {decl:?} of {name}"))
                        })?;
                        params.push(size);
                    }
                }
                let resources = Resources {
                    local: declared(entry_body(&body[header_end..]), ".local"),
                    ..Resources::default()
                };
                kernels.push(Kernel {
                    name,
                    params,
                    resources,
                });
                bodies.push((
                    kernels.len() - 1,
                    entry_body(&body[header_end..]).to_string(),
                ));
                rest = &body[header_end..];
            }
            _ if depth == 0
                && tail.starts_with(".global")
                && !tail[7..].starts_with(|c: char| c.is_alphanumeric()) =>
            {
                let end = tail.find(';').unwrap_or(tail.len());
                let decl = tail[..end].split('=').next().unwrap_or("");
                let line_start = rest[..i].rfind('\n').map_or(0, |n| n + 1);
                let is_extern = rest[line_start..i].contains("extern");
                let tokens: Vec<&str> = decl.split_whitespace().collect();
                if !is_extern && let Some(g) = decl_size(&tokens) {
                    globals.push(g);
                }
                rest = &tail[end.min(tail.len())..];
            }
            _ => rest = &tail[1..],
        }
    }
    // Module-scope shared and constant variables count for the kernels that use them.
    let module_scope = module_scope(&text);
    for (k, body) in bodies {
        let used = |space: &str| -> usize {
            module_scope
                .iter()
                .filter(|(s, name, _)| s == space && mentions(&body, name))
                .map(|(_, _, size)| size)
                .sum()
        };
        let r = &mut kernels[k].resources;
        r.shared += declared(&body, ".shared") + used(".shared");
        r.constant = used(".const");
    }
    Ok(Module {
        version,
        kernels,
        globals,
    })
}

/// The text of a function body starting at its `{`, braces included.
fn entry_body(from_brace: &str) -> &str {
    let mut depth = 0usize;
    for (i, c) in from_brace.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return &from_brace[..=i];
                }
            }
            _ => {}
        }
    }
    from_brace
}

/// Bytes declared in state space `space` (e.g. `.local`) by the statements of `text`.
fn declared(text: &str, space: &str) -> usize {
    text.split(';')
        .map(|st| st.trim().trim_start_matches('{').trim())
        .filter(|st| st.split_whitespace().next() == Some(space))
        .filter_map(|st| {
            decl_size(
                &st.split('=')
                    .next()
                    .unwrap_or("")
                    .split_whitespace()
                    .collect::<Vec<_>>(),
            )
        })
        .map(|(_, size)| size)
        .sum()
}

/// Module-scope `.shared` and `.const` variables (not `.extern`): state space, name, bytes.
fn module_scope(text: &str) -> Vec<(String, String, usize)> {
    let mut out = Vec::new();
    let mut depth = 0usize;
    let mut statement = String::new();
    for c in text.chars() {
        match c {
            '{' if depth > 0 || !statement.contains('=') => {
                depth += 1;
                statement.clear();
            }
            '}' if depth > 0 => depth -= 1,
            ';' if depth == 0 => {
                let tokens: Vec<&str> = statement
                    .split('=')
                    .next()
                    .unwrap_or("")
                    .split_whitespace()
                    .collect();
                let space = tokens.iter().find(|t| **t == ".shared" || **t == ".const");
                if let (Some(space), false) = (space, tokens.contains(&".extern"))
                    && let Some((name, size)) = decl_size(&tokens)
                {
                    out.push((space.to_string(), name, size));
                }
                statement.clear();
            }
            _ if depth == 0 => statement.push(c),
            _ => {}
        }
    }
    out
}

/// Whether `body` names the identifier `name` (not as part of a longer one).
fn mentions(body: &str, name: &str) -> bool {
    let ident = |c: char| c.is_alphanumeric() || c == '_' || c == '$';
    body.match_indices(name)
        .any(|(i, _)| !body[..i].ends_with(ident) && !body[i + name.len()..].starts_with(ident))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPIN: &str = r#"
//
// Generated by NVIDIA NVVM Compiler
.version 8.4
.target sm_90
.address_size 64

.global .align 4 .u32 counter;
.visible .global .align 8 .b8 table[64] = {0};
.extern .global .align 4 .u32 elsewhere;

	// .globl	gpushare_spin
.visible .entry gpushare_spin(
	.param .u64 gpushare_spin_param_0
)
{
	.reg .pred 	%p<2>;
	.reg .b64 	%rd<6>;
	ld.param.u64 	%rd3, [gpushare_spin_param_0];
	mov.u64 	%rd4, %globaltimer;
$L__BB0_1:
	mov.u64 	%rd5, %globaltimer;
	sub.s64 	%rd2, %rd5, %rd4;
	setp.lt.u64 	%p1, %rd2, %rd3;
	@%p1 bra 	$L__BB0_1;
	ret;
}
.entry touch(.param .u64 .ptr .global .align 4 ptr, .param .u32 n, .param .align 8 .b8 s[24]) { ret; }
.entry noargs { ret; }
"#;

    #[test]
    fn reads_entries_params_globals_and_version() {
        let m = parse(SPIN).unwrap();
        assert_eq!(m.version, 84);
        assert_eq!(
            m.kernels,
            vec![
                Kernel {
                    name: "gpushare_spin".into(),
                    params: vec![8],
                    ..Kernel::default()
                },
                Kernel {
                    name: "touch".into(),
                    params: vec![8, 4, 24],
                    ..Kernel::default()
                },
                Kernel {
                    name: "noargs".into(),
                    params: vec![],
                    ..Kernel::default()
                },
            ]
        );
        assert_eq!(m.globals, vec![("counter".into(), 4), ("table".into(), 64)]);
    }

    #[test]
    fn static_shared_local_and_constant_memory_per_kernel() {
        let src = r#"
.version 8.0
.target sm_90
.visible .shared .align 4 .b8 smem_a[400];
.shared .align 8 .b8 smem_b[64];
.extern .shared .align 16 .b8 dynamic[];
.const .align 8 .b8 table[80] = {1, 2};
.visible .entry uses_a(.param .u64 p) {
    .local .align 16 .b8 __local_depot0[4000];
    .shared .align 4 .u32 inner;
    st.shared.u32 [smem_a], 1;
    ld.const.u64 %rd1, [table];
    ret;
}
.visible .entry uses_b() { st.shared.u32 [smem_b+4], 1; st.shared.u32 [smem_ax], 1; ret; }
"#;
        let m = parse(src).unwrap();
        assert_eq!(
            m.kernels[0].resources,
            Resources {
                shared: 404,
                constant: 80,
                local: 4000
            }
        );
        assert_eq!(
            m.kernels[1].resources,
            Resources {
                shared: 64,
                ..Resources::default()
            }
        );
    }

    #[test]
    fn rejects_what_is_not_ptx() {
        assert_eq!(parse("\x7fELF..."), Err(PtxError::NotPtx));
        assert!(matches!(
            parse(".version 8.0\n.target sm_90\n.entry f( { "),
            Err(PtxError::Malformed(_))
        ));
    }
}
