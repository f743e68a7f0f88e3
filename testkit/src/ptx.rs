//! The PTX module loaded by every test client.
//!
//! It is real PTX (ISA 8.0, `sm_90`) that `ptxas` accepts, so the same workload runs on a real
//! GPU. Entries:
//!
//! - `gpushare_spin(.param .u64 ns)`: spins on `%globaltimer` until `ns` nanoseconds have
//!   passed. The simulator gives a kernel whose name starts with `gpushare_spin` exactly `ns` of
//!   device time (its first `u64` parameter).
//! - `touch(.param .u64 ptr, .param .u32 n)`: thread `i < n` stores `i` into `((u32*)ptr)[i]`.
//!
//! The C clients include the same text as `c/gpushare_spin_ptx.h`; a unit test keeps the two equal.

/// The module text (not NUL-terminated; cudarc adds the terminator).
pub const SPIN_PTX: &str = include_str!("../ptx/gpushare_spin.ptx");

/// Name of the spin entry point.
pub const SPIN_KERNEL: &str = "gpushare_spin";

/// Name of the two-parameter store kernel.
pub const TOUCH_KERNEL: &str = "touch";

#[cfg(test)]
mod tests {
    use super::*;

    /// Decode the C string literal lines of `c/gpushare_spin_ptx.h`.
    fn c_header_text(header: &str) -> String {
        let mut out = String::new();
        for line in header.lines() {
            let line = line.trim();
            let Some(body) = line.strip_prefix('"') else {
                continue;
            };
            let body = body.trim_end_matches(';');
            let body = body
                .strip_suffix('"')
                .expect("literal line ends with a quote");
            let mut chars = body.chars();
            while let Some(c) = chars.next() {
                if c != '\\' {
                    out.push(c);
                    continue;
                }
                match chars.next() {
                    Some('n') => out.push('\n'),
                    Some('t') => out.push('\t'),
                    Some('\\') => out.push('\\'),
                    Some('"') => out.push('"'),
                    other => panic!("unexpected escape \\{other:?} in the C header"),
                }
            }
        }
        out
    }

    #[test]
    fn c_header_matches_ptx_file() {
        let header = include_str!("../c/gpushare_spin_ptx.h");
        assert_eq!(
            c_header_text(header),
            SPIN_PTX,
            "c/gpushare_spin_ptx.h is out of date with ptx/gpushare_spin.ptx"
        );
    }

    #[test]
    fn module_declares_both_entries() {
        assert!(SPIN_PTX.contains(".visible .entry gpushare_spin("));
        assert!(SPIN_PTX.contains(".visible .entry touch("));
        assert!(SPIN_PTX.contains("%globaltimer"));
    }
}
