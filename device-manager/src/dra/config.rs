//! A claim's gpushare settings beyond its capacity: the `parameters` of an opaque device
//! configuration whose `driver` is `gpushare.io`, in the claim or its DeviceClass. Pure.
//!
//! ```yaml
//! config:
//!   - opaque:
//!       driver: gpushare.io
//!       parameters:
//!         apiVersion: gpushare.io/v1alpha1
//!         kind: GpuShareConfig
//!         limit: "0.6"     # hard cap on GPU time, in (0, 1] ("60%" too)
//!         weight: 2        # share of the time nobody is guaranteed, in (0, 1000]
//!         memory: 4Gi      # memory cap, only where the allocation has no memory capacity
//! ```
//!
//! Values are checked as the pod annotations of the device plugin are ([`crate::annotations`]),
//! with the same messages; but a claim whose configuration is invalid is not prepared at all.

use crate::annotations;
use serde::Deserialize;
use serde_json::Value;

/// `apiVersion` of the parameters.
pub const API_VERSION: &str = "gpushare.io/v1alpha1";
/// `kind` of the parameters.
pub const KIND: &str = "GpuShareConfig";

/// What one configuration sets (`None`: not set).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ClaimConfig {
    pub limit: Option<f64>,
    pub weight: Option<f64>,
    pub memory: Option<u64>,
}

impl ClaimConfig {
    /// `self` with what `later` sets on top (a claim's configuration over its class's).
    pub fn then(self, later: ClaimConfig) -> ClaimConfig {
        ClaimConfig {
            limit: later.limit.or(self.limit),
            weight: later.weight.or(self.weight),
            memory: later.memory.or(self.memory),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Raw {
    api_version: Option<String>,
    kind: Option<String>,
    limit: Option<Value>,
    weight: Option<Value>,
    memory: Option<Value>,
}

/// A number or a string, as the parsers of annotations take it.
fn text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// Parse and check `parameters`; the error says what is wrong and how to write it.
pub fn parse(parameters: &Value) -> Result<ClaimConfig, String> {
    let how = format!(
        "write {{apiVersion: {API_VERSION}, kind: {KIND}, limit: \"0.6\", weight: 2, memory: 4Gi}} (each of limit, weight, memory optional)"
    );
    let raw: Raw = serde_json::from_value(parameters.clone()).map_err(|e| {
        format!(
            "the {} configuration is malformed: {e}; {how}",
            super::DRIVER
        )
    })?;
    if raw.api_version.as_deref() != Some(API_VERSION) || raw.kind.as_deref() != Some(KIND) {
        return Err(format!(
            "the {} configuration has apiVersion {:?} and kind {:?}, not {API_VERSION} and {KIND}; {how}",
            super::DRIVER,
            raw.api_version.unwrap_or_default(),
            raw.kind.unwrap_or_default()
        ));
    }
    let field = |name: &str, v: &Option<Value>, parse: &dyn Fn(&str) -> Result<f64, String>| {
        v.as_ref()
            .map(|v| {
                let t = text(v).ok_or_else(|| format!("{v} is not a number or a string"))?;
                parse(&t)
            })
            .transpose()
            .map_err(|e| format!("{name}: {e}"))
    };
    Ok(ClaimConfig {
        limit: field("limit", &raw.limit, &annotations::parse_fraction)?,
        weight: field("weight", &raw.weight, &annotations::parse_weight)?,
        memory: field("memory", &raw.memory, &|t| {
            gpushare_units::parse_quantity(t).map(|m| m as f64)
        })?
        .map(|m| m as u64),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_frame::fuzz;
    use serde_json::json;

    fn p(extra: Value) -> Value {
        let mut v = json!({"apiVersion": API_VERSION, "kind": KIND});
        v.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        v
    }

    #[test]
    fn the_documented_forms() {
        assert_eq!(
            parse(&p(json!({"limit": "0.6", "weight": 2, "memory": "4Gi"}))),
            Ok(ClaimConfig {
                limit: Some(0.6),
                weight: Some(2.0),
                memory: Some(4 << 30)
            })
        );
        assert_eq!(parse(&p(json!({"limit": "60%"}))).unwrap().limit, Some(0.6));
        assert_eq!(parse(&p(json!({"limit": 0.25}))).unwrap().limit, Some(0.25));
        assert_eq!(parse(&p(json!({}))), Ok(ClaimConfig::default()));
    }

    #[test]
    fn mistakes_are_explained() {
        let cases = [
            (
                p(json!({"limit": "1.5"})),
                "limit: \"1.5\" is not a share of GPU time",
            ),
            (p(json!({"weight": -1})), "weight: \"-1\" is not a weight"),
            (
                p(json!({"memory": "4GiB"})),
                "memory: \"4GiB\" is not an amount of memory",
            ),
            (
                p(json!({"limit": [1]})),
                "limit: [1] is not a number or a string",
            ),
            (p(json!({"limt": "0.5"})), "unknown field `limt`"),
            (
                json!({"limit": "0.5"}),
                "not gpushare.io/v1alpha1 and GpuShareConfig",
            ),
            (
                json!({"apiVersion": "gpushare.io/v2", "kind": KIND}),
                "apiVersion \"gpushare.io/v2\"",
            ),
            (json!("limit=0.5"), "malformed"),
        ];
        for (v, want) in cases {
            let e = parse(&v).unwrap_err();
            assert!(e.contains(want), "{v}: {e}");
            // A bad value says how to write the value; a bad shape, how to write the whole.
            let field = ["limit: ", "weight: ", "memory: "]
                .iter()
                .any(|f| e.starts_with(f));
            assert!(
                field || e.contains("write {apiVersion: gpushare.io/v1alpha1"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_claims_configuration_wins_over_its_classs() {
        let class = ClaimConfig {
            limit: Some(0.5),
            weight: Some(3.0),
            memory: None,
        };
        let claim = ClaimConfig {
            limit: Some(0.2),
            ..Default::default()
        };
        assert_eq!(
            class.then(claim),
            ClaimConfig {
                limit: Some(0.2),
                weight: Some(3.0),
                memory: None
            }
        );
    }

    /// Parameters as users mistype them: whatever parses is in range.
    #[test]
    fn hostile_parameters_are_rejected_without_panicking() {
        let samples = [
            r#"{"apiVersion":"gpushare.io/v1alpha1","kind":"GpuShareConfig","limit":"0.6","weight":2,"memory":"4Gi"}"#,
            r#"{"apiVersion":"gpushare.io/v1alpha1","kind":"GpuShareConfig","limit":0.3}"#,
            r#"{"apiVersion":"gpushare.io/v1alpha1","kind":"GpuShareConfig","memory":1048576}"#,
        ];
        let n = 100_000;
        fuzz::texts(64, &samples, n, |s| {
            let Ok(v) = serde_json::from_str::<Value>(s) else {
                return false;
            };
            parse(&v)
                .inspect(|c| {
                    assert!(c.limit.is_none_or(|l| l > 0.0 && l <= 1.0), "{s}");
                    assert!(
                        c.weight
                            .is_none_or(|w| w > 0.0 && w <= annotations::MAX_WEIGHT),
                        "{s}"
                    );
                    assert!(c.memory.is_none_or(|m| m >= 1), "{s}");
                })
                .is_ok()
        })
        .assert_exercised(n);
    }
}
