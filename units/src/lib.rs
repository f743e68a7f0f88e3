//! Units shared by every gpushare part: human-friendly sizes (`80GiB`, `512MiB`, `4096`),
//! Kubernetes quantities of bytes (`4Gi`, `2G`) and durations (`1ms`, `25us`, `5s`) for flags,
//! environment and config (docs/configuration.md), and the
//! `CLOCK_MONOTONIC` nanosecond time base of token deadlines and device traces.

/// CLOCK_MONOTONIC in nanoseconds (vDSO, no syscall). Token deadlines, the device trace and
/// every process on a node share this clock.
#[inline]
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Split `"1.5GiB"` into its non-negative number and its unit; `example` goes in the error.
fn number_and_unit<'a>(s: &'a str, what: &str, example: &str) -> Result<(f64, &'a str), String> {
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    match num.parse::<f64>() {
        Ok(n) if n.is_finite() && n >= 0.0 => Ok((n, unit.trim())),
        _ => Err(format!("{s:?} is not a {what}; use e.g. {example}")),
    }
}

/// Parse a byte size: a number with an optional `B`, `KiB`, `MiB`, `GiB`, `TiB` (or `K`/`M`/`G`/`T`,
/// binary as well; `KB`/`MB`/`GB`/`TB` are decimal).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (n, unit) = number_and_unit(s, "size", "512MiB or 80GiB")?;
    let mult: u64 = match unit {
        "" | "B" => 1,
        "K" | "KiB" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        "T" | "TiB" => 1 << 40,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        u => {
            return Err(format!(
                "unknown size unit {u:?} in {s:?}; use e.g. 512MiB or 80GiB"
            ));
        }
    };
    to_u64((n * mult as f64).round(), s)
}

/// Parse a transfer rate in bytes per second: a size (as [`parse_size`] reads it) per second,
/// above zero, e.g. `25GB/s` or `512MiB/s`.
pub fn parse_rate(s: &str) -> Result<u64, String> {
    let Some(size) = s.trim().strip_suffix("/s") else {
        return Err(format!("{s:?} is not a rate; use e.g. 25GB/s"));
    };
    match parse_size(size)? {
        0 => Err(format!("{s:?} is not above zero")),
        n => Ok(n),
    }
}

/// `x` as a `u64`, or an error where a cast would saturate (a huge value is a typo, not a cap).
fn to_u64(x: f64, s: &str) -> Result<u64, String> {
    if x < u64::MAX as f64 {
        Ok(x as u64)
    } else {
        Err(format!("{s:?} is too large"))
    }
}

/// Parse a duration into nanoseconds: a number with `ns`, `us`, `µs`, `ms` or `s`.
pub fn parse_duration_ns(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (n, unit) = number_and_unit(s, "duration", "1ms or 25us")?;
    let mult = match unit {
        "ns" => 1.0,
        "us" | "µs" => 1e3,
        "ms" => 1e6,
        "s" => 1e9,
        // Zero is zero in any unit.
        "" if n == 0.0 => 0.0,
        "" => return Err(format!("{s:?} needs a unit: ns, us, ms or s (e.g. 1ms)")),
        u => {
            return Err(format!(
                "unknown duration unit {u:?} in {s:?}; use ns, us, ms or s"
            ));
        }
    };
    to_u64((n * mult).round(), s)
}

/// A Kubernetes quantity of bytes: a number with an optional suffix `Ki Mi Gi Ti Pi` (binary)
/// or `k M G T P` (decimal); more than 0.
pub fn parse_quantity(v: &str) -> Result<u64, String> {
    let t = v.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    let mult: f64 = match suffix {
        "" => 1.0,
        "Ki" => 1024.0,
        "Mi" => 1024f64.powi(2),
        "Gi" => 1024f64.powi(3),
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        _ => f64::NAN,
    };
    match plain_number(num).map(|n| (n * mult).round()) {
        Some(b) if b >= 1.0 && b < u64::MAX as f64 => Ok(b as u64),
        _ => Err(format!(
            "{v:?} is not an amount of memory: write a quantity such as \"4Gi\", \"512Mi\" or \"2G\""
        )),
    }
}

/// Digits with at most one decimal point (no sign, exponent, `inf` or `NaN`).
pub fn plain_number(s: &str) -> Option<f64> {
    let ok = !s.is_empty()
        && s.bytes().all(|b| b.is_ascii_digit() || b == b'.')
        && s.bytes().filter(|&b| b == b'.').count() <= 1
        && s.bytes().any(|b| b.is_ascii_digit());
    ok.then(|| s.parse().ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_frame::fuzz;

    #[test]
    fn quantities() {
        assert_eq!(parse_quantity("4Gi"), Ok(4 << 30));
        assert_eq!(parse_quantity("512Mi"), Ok(512 << 20));
        assert_eq!(parse_quantity("1.5Gi"), Ok(3 << 29));
        assert_eq!(parse_quantity("2G"), Ok(2_000_000_000));
        assert_eq!(parse_quantity("1048576"), Ok(1 << 20));
        for bad in ["4GiB", "0", "lots", "-1Gi", "Gi"] {
            assert!(parse_quantity(bad).is_err(), "{bad}");
        }
        assert_eq!(plain_number("1.5"), Some(1.5));
        for bad in ["", ".", "1e3", "-1", "inf", "1.2.3"] {
            assert_eq!(plain_number(bad), None, "{bad}");
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("80GiB"), Ok(80 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("2GB"), Ok(2_000_000_000));
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("GiB").is_err());
    }

    #[test]
    fn rates() {
        assert_eq!(parse_rate("25GB/s"), Ok(25_000_000_000));
        assert_eq!(parse_rate("512MiB/s"), Ok(512 << 20));
        assert!(parse_rate("25GB").is_err(), "a size is not a rate");
        assert!(parse_rate("0GB/s").is_err());
        assert!(parse_rate("fast/s").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration_ns("1ms"), Ok(1_000_000));
        assert_eq!(parse_duration_ns("25us"), Ok(25_000));
        assert_eq!(parse_duration_ns("5s"), Ok(5_000_000_000));
        assert_eq!(parse_duration_ns("0.5ms"), Ok(500_000));
        assert!(parse_duration_ns("10").is_err());
        assert_eq!(parse_duration_ns("0"), Ok(0));
        assert!(parse_duration_ns("10min").is_err());
    }

    #[test]
    fn values_past_u64_are_rejected_not_saturated() {
        assert!(parse_size("99999999999999999999999GiB").is_err());
        assert!(parse_size("18446744073709551616").is_err());
        assert!(parse_duration_ns("18446744074s").is_err());
        assert!(parse_duration_ns("18446744073s").is_ok());
    }

    /// Whatever is accepted is the value its plain form (bytes, ns) also parses to.
    #[test]
    fn hostile_text_is_rejected_without_panicking() {
        let sizes = ["80GiB", "512MiB", "4096", "1.5GiB", "2GB", "7 K", "0.5T"];
        fuzz::texts(41, &sizes, 100_000, |s| match parse_size(s) {
            Ok(v) if v < 1 << 53 => {
                assert_eq!(parse_size(&v.to_string()), Ok(v), "{s:?}");
                true
            }
            Ok(_) => true,
            Err(_) => false,
        })
        .assert_exercised(100_000);
        let durations = ["1ms", "25us", "5s", "0.5ms", "0", "10 µs", "3ns"];
        fuzz::texts(42, &durations, 100_000, |s| match parse_duration_ns(s) {
            Ok(v) if v < 1 << 53 => {
                assert_eq!(parse_duration_ns(&format!("{v}ns")), Ok(v), "{s:?}");
                true
            }
            Ok(_) => true,
            Err(_) => false,
        })
        .assert_exercised(100_000);
    }
}
