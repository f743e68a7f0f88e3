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
//!
//! A second module, [`PEER_PTX`] (`ptx/gpushare_peer.ptx`, `c/gpushare_peer_ptx.h`), holds the
//! peer-wait kernels multi-GPU tests use, as NCCL's kernels wait for each other:
//!
//! - `gpushare_wait_flag(.param .u64 flag)`: spins until the `u64` at `flag` is non-zero. The
//!   simulator keeps it on its device (time-sliced, preemptible) until a `gpushare_set_flag`
//!   kernel of the same process, on any GPU, has set that flag; then it runs its own duration.
//! - `gpushare_set_flag(.param .u64 flag)`: stores 1 at `flag`.

/// The module text (not NUL-terminated; cudarc adds the terminator).
pub const SPIN_PTX: &str = include_str!("../ptx/gpushare_spin.ptx");

/// Name of the spin entry point.
pub const SPIN_KERNEL: &str = "gpushare_spin";

/// Name of the two-parameter store kernel.
pub const TOUCH_KERNEL: &str = "touch";

/// The peer-wait module (not NUL-terminated).
pub const PEER_PTX: &str = include_str!("../ptx/gpushare_peer.ptx");

/// Name of the kernel that spins until a flag is set.
pub const WAIT_FLAG_KERNEL: &str = "gpushare_wait_flag";

/// Name of the kernel that sets a flag.
pub const SET_FLAG_KERNEL: &str = "gpushare_set_flag";

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
    fn peer_c_header_matches_ptx_file() {
        let header = include_str!("../c/gpushare_peer_ptx.h");
        assert_eq!(
            c_header_text(header),
            PEER_PTX,
            "c/gpushare_peer_ptx.h is out of date with ptx/gpushare_peer.ptx"
        );
    }

    #[test]
    fn peer_module_declares_the_simulators_flag_kernels() {
        use gpushare_sim_device::model;
        for (name, sim_name) in [
            (WAIT_FLAG_KERNEL, model::WAIT_FLAG_KERNEL),
            (SET_FLAG_KERNEL, model::SET_FLAG_KERNEL),
        ] {
            assert!(name.starts_with(sim_name));
            assert!(PEER_PTX.contains(&format!(".visible .entry {name}(\n\t.param .u64 ")));
        }
    }

    #[test]
    fn module_declares_both_entries() {
        assert!(SPIN_PTX.contains(".visible .entry gpushare_spin("));
        assert!(SPIN_PTX.contains(".visible .entry touch("));
        assert!(SPIN_PTX.contains("%globaltimer"));
    }
}
