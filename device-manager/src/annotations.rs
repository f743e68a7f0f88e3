//! The pod annotations that set a container's quota, parsed and checked. Pure.
//!
//! | annotation | value | invalid → |
//! |---|---|---|
//! | `gpushare.io/gpu-limit` | hard cap, `"0.6"` or `"60%"`, in (0, 1]; below the units' share it lowers the guarantee to itself | no cap (limit 1) |
//! | `gpushare.io/gpu-weight` | weight for spare time, a number > 0 (at most 1000) | 1 |
//! | `gpushare.io/gpu-class` | `"latency"` for a request server whose tail latency matters, or `"standard"` | standard |
//! | `gpushare.io/gpu-memory` | memory cap, a quantity (`"4Gi"`, `"512Mi"`, `"2G"`) > 0 | units/100 × the GPU's memory; above the GPU's memory: the GPU's memory |
//!
//! Each applies to every gpushare container of the pod; `<annotation>.<container>` (e.g.
//! `gpushare.io/gpu-limit.worker`) applies to that container only and takes precedence.

use gpushare_policy::GroupClass;
use gpushare_units::{parse_quantity, plain_number};
use std::collections::BTreeMap;

pub const LIMIT: &str = "gpushare.io/gpu-limit";
pub const WEIGHT: &str = "gpushare.io/gpu-weight";
pub const MEMORY: &str = "gpushare.io/gpu-memory";
pub const CLASS: &str = "gpushare.io/gpu-class";

/// Largest weight accepted.
pub const MAX_WEIGHT: f64 = 1000.0;

/// A container's quota as the annotations set it (`None`: not set, or invalid).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Quota {
    pub limit: Option<f64>,
    pub weight: Option<f64>,
    pub memory: Option<u64>,
    /// The latency class (`gpushare.io/gpu-class: latency`).
    pub latency: bool,
}

/// An annotation that could not be used as written.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Problem {
    /// The annotation key as written on the pod.
    pub annotation: String,
    pub value: String,
    /// What is wrong and what was used instead.
    pub message: String,
}

impl Problem {
    pub fn new(annotation: &str, value: &str, message: String) -> Problem {
        Problem {
            annotation: annotation.to_string(),
            value: value.to_string(),
            message,
        }
    }
}

/// The quota of `container` from the pod's annotations, and what was wrong with them.
pub fn quota(
    annotations: &BTreeMap<String, String>,
    container: &str,
    problems: &mut Vec<Problem>,
) -> Quota {
    let pick = |base: &str| pick(annotations, base, container);
    let mut q = Quota {
        latency: latency_class(annotations, container, problems),
        ..Quota::default()
    };
    if let Some((key, v)) = pick(LIMIT) {
        match parse_fraction(v) {
            Ok(l) => q.limit = Some(l),
            Err(e) => problems.push(Problem::new(
                &key,
                v,
                format!("{e}; running without a cap (limit 1) until it is fixed"),
            )),
        }
    }
    if let Some((key, v)) = pick(WEIGHT) {
        match parse_weight(v) {
            Ok(w) => q.weight = Some(w),
            Err(e) => problems.push(Problem::new(
                &key,
                v,
                format!("{e}; using weight 1 until it is fixed"),
            )),
        }
    }
    if let Some((key, v)) = pick(MEMORY) {
        match parse_quantity(v) {
            Ok(m) => q.memory = Some(m),
            Err(e) => problems.push(Problem::new(
                &key,
                v,
                format!("{e}; using the default cap (the container's units / 100 × the GPU's memory) until it is fixed"),
            )),
        }
    }
    q
}

/// `"0.6"` or `"60%"` → 0.6, in (0, 1].
pub fn parse_fraction(v: &str) -> Result<f64, String> {
    let t = v.trim();
    let (num, scale) = match t.strip_suffix('%') {
        Some(p) => (p.trim(), 100.0),
        None => (t, 1.0),
    };
    let bad = || {
        format!(
            "{v:?} is not a share of GPU time: write a fraction in (0, 1] or a percentage, e.g. \"0.6\" or \"60%\""
        )
    };
    let x = plain_number(num).ok_or_else(bad)? / scale;
    if x > 0.0 && x <= 1.0 {
        Ok(x)
    } else {
        Err(bad())
    }
}

/// The annotation `base` for `container`: its own (`base.container`) or the pod's, as written.
fn pick<'a>(
    annotations: &'a BTreeMap<String, String>,
    base: &str,
    container: &str,
) -> Option<(String, &'a String)> {
    let own = format!("{base}.{container}");
    annotations
        .get(&own)
        .map(|v| (own, v))
        .or_else(|| annotations.get(base).map(|v| (base.to_string(), v)))
}

/// Whether `container` is in the latency class (`gpushare.io/gpu-class`); an invalid value is
/// a problem and leaves it standard.
pub fn latency_class(
    annotations: &BTreeMap<String, String>,
    container: &str,
    problems: &mut Vec<Problem>,
) -> bool {
    let Some((key, v)) = pick(annotations, CLASS, container) else {
        return false;
    };
    GroupClass::parse(v.trim())
        .map(|c| c == GroupClass::Latency)
        .unwrap_or_else(|e| {
            problems.push(Problem::new(
                &key,
                v,
                format!("{e}; using the standard class until it is fixed"),
            ));
            false
        })
}

/// A weight: a number in (0, [`MAX_WEIGHT`]].
pub fn parse_weight(v: &str) -> Result<f64, String> {
    match plain_number(v.trim()) {
        Some(w) if w > 0.0 && w <= MAX_WEIGHT => Ok(w),
        _ => Err(format!(
            "{v:?} is not a weight: write a number greater than 0 and at most {MAX_WEIGHT}, e.g. \"2\""
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_frame::fuzz;
    use proptest::prelude::*;

    fn ann(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn documented_forms() {
        assert_eq!(parse_fraction("0.6"), Ok(0.6));
        assert_eq!(parse_fraction("60%"), Ok(0.6));
        assert_eq!(parse_fraction(" 1 "), Ok(1.0));
        for bad in [
            "0", "1.5", "150%", "-0.2", "abc", "", "%", "0.5.5", "1e-1", "NaN", "inf",
        ] {
            assert!(parse_fraction(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_weight("2"), Ok(2.0));
        for bad in ["0", "-1", "1001", "two"] {
            assert!(parse_weight(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn container_keys_override_pod_keys_and_problems_are_explained() {
        let a = ann(&[
            (LIMIT, "0.5"),
            ("gpushare.io/gpu-limit.worker", "20%"),
            (WEIGHT, "heavy"),
            (MEMORY, "2Gi"),
        ]);
        let mut p = Vec::new();
        let main = quota(&a, "main", &mut p);
        assert_eq!(
            main,
            Quota {
                limit: Some(0.5),
                weight: None,
                memory: Some(2 << 30),
                latency: false,
            }
        );
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].annotation, WEIGHT);
        assert!(p[0].message.contains("weight 1"), "{}", p[0].message);
        let worker = quota(&a, "worker", &mut Vec::new());
        assert_eq!(worker.limit, Some(0.2));
    }

    #[test]
    fn the_class_annotation_sets_the_latency_class_or_is_explained() {
        let a = BTreeMap::from([
            (CLASS.to_string(), "latency".to_string()),
            (
                "gpushare.io/gpu-class.batch".to_string(),
                "fast".to_string(),
            ),
        ]);
        let mut p = Vec::new();
        assert!(quota(&a, "server", &mut p).latency);
        assert!(p.is_empty());
        assert!(!quota(&a, "batch", &mut p).latency);
        assert_eq!(p.len(), 1);
        assert!(p[0].message.contains("\"latency\""), "{}", p[0].message);
    }

    /// Annotation values as users mistype them: each parser accepts only its range.
    #[test]
    fn hostile_values_are_rejected_without_panicking() {
        let n = 100_000;
        let fractions = ["0.6", "60%", " 1 ", "0.05", "100 %"];
        fuzz::texts(61, &fractions, n, |s| {
            parse_fraction(s)
                .inspect(|x| assert!(*x > 0.0 && *x <= 1.0, "{s:?}"))
                .is_ok()
        })
        .assert_exercised(n);
        let weights = ["2", "0.5", "1000", " 7 "];
        fuzz::texts(62, &weights, n, |s| {
            parse_weight(s)
                .inspect(|w| assert!(*w > 0.0 && *w <= MAX_WEIGHT, "{s:?}"))
                .is_ok()
        })
        .assert_exercised(n);
        let quantities = ["4Gi", "512Mi", "1.5Gi", "2G", "1048576", "3Pi", "7k"];
        fuzz::texts(63, &quantities, n, |s| {
            parse_quantity(s)
                .inspect(|m| assert!(*m >= 1, "{s:?}"))
                .is_ok()
        })
        .assert_exercised(n);
    }

    proptest! {
        #[test]
        fn percentages_and_fractions_agree(p in 1u32..=100) {
            let a = parse_fraction(&format!("{p}%")).unwrap();
            let b = parse_fraction(&format!("{}", p as f64 / 100.0)).unwrap();
            prop_assert!((a - b).abs() < 1e-12);
        }
    }
}
