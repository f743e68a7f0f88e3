//! Expected (target) shares: the benchmark's own reading of the share rules
//! (docs/scheduling.md#targets, #caps), written independently of
//! the scheduler's policy code, so that the system under test does not grade itself.
//!
//! Per GPU, over a window in which each tenant needs `demand` of the GPU:
//! 1. a tenant's cap is `min(limit, demand)` (the hard cap; a tenant needing less than its target
//!    gets what it needs, the rest goes to the others);
//! 2. each tenant is guaranteed `min(request, cap)`, all scaled down together when these sum to
//!    more than 1;
//! 3. the rest of the GPU is split by weight among the tenants below their cap, a tenant reaching
//!    its cap passing what it cannot take on to the others, again by weight; when every
//!    tenant is at its cap the rest stays idle.
//!
//! The computation is progressive filling: raise the level of every tenant still below its cap
//! in proportion to its weight until the spare time is used up, freeze the tenants that reach
//! their cap, and repeat with the others.

use crate::scenario::Scenario;

/// What one tenant on a GPU is entitled to and needs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Claim {
    pub request: f64,
    pub limit: f64,
    pub weight: f64,
    /// Share of the GPU it would use alone in the window (1 for an always-busy tenant).
    pub demand: f64,
}

/// Spare time below this is none (rounding).
const EPSILON: f64 = 1e-12;

/// Target shares of the tenants `claims` sharing one GPU, in order (see the module docs).
pub fn water_fill(claims: &[Claim]) -> Vec<f64> {
    let caps: Vec<f64> = claims
        .iter()
        .map(|c| c.limit.min(c.demand).clamp(0.0, 1.0))
        .collect();
    let mut shares: Vec<f64> = claims
        .iter()
        .zip(&caps)
        .map(|(c, &cap)| c.request.clamp(0.0, 1.0).min(cap))
        .collect();
    let promised: f64 = shares.iter().sum();
    if promised > 1.0 {
        for s in &mut shares {
            *s /= promised;
        }
        return shares;
    }
    let mut spare = 1.0 - promised;
    let mut rising: Vec<usize> = (0..claims.len()).filter(|&i| shares[i] < caps[i]).collect();
    while spare > EPSILON && !rising.is_empty() {
        let weights: f64 = rising.iter().map(|&i| claims[i].weight).sum();
        let level = spare / weights;
        let (capped, below): (Vec<usize>, Vec<usize>) = rising
            .iter()
            .partition(|&&i| shares[i] + claims[i].weight * level >= caps[i]);
        if capped.is_empty() {
            for &i in &below {
                shares[i] += claims[i].weight * level;
            }
            break;
        }
        // Those reaching their cap take less than `weight · level`: the level of the others
        // can only rise, so they never fall back under their cap.
        for i in capped {
            spare -= caps[i] - shares[i];
            shares[i] = caps[i];
        }
        rising = below;
    }
    shares
}

/// Target share of each tenant of `sc` on its GPU, tenant `i` needing `demand(i)` of it.
pub fn targets(sc: &Scenario, demand: impl Fn(usize) -> f64) -> Vec<f64> {
    let mut out = vec![0.0; sc.tenants.len()];
    for gpu in 0..sc.gpus {
        let on_gpu: Vec<usize> = (0..sc.tenants.len())
            .filter(|&i| sc.tenants[i].gpu == gpu)
            .collect();
        let claims: Vec<Claim> = on_gpu
            .iter()
            .map(|&i| {
                let t = &sc.tenants[i];
                Claim {
                    request: t.request,
                    limit: t.limit,
                    weight: t.weight,
                    demand: demand(i),
                }
            })
            .collect();
        for (&i, share) in on_gpu.iter().zip(water_fill(&claims)) {
            out[i] = share;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// An always-busy tenant.
    fn busy(request: f64, limit: f64, weight: f64) -> Claim {
        Claim {
            request,
            limit,
            weight,
            demand: 1.0,
        }
    }

    fn assert_shares(got: &[f64], want: &[f64]) {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-9, "got {got:?}, want {want:?}");
        }
    }

    #[test]
    fn requests_that_fill_the_gpu_are_the_shares() {
        let c = [
            busy(0.5, 1.0, 1.0),
            busy(0.3, 1.0, 1.0),
            busy(0.2, 1.0, 1.0),
        ];
        assert_shares(&water_fill(&c), &[0.5, 0.3, 0.2]);
    }

    #[test]
    fn spare_time_goes_by_weight() {
        // 0.2 + 0.2 guaranteed, 0.6 spare split 1 : 3 → 0.15 / 0.45.
        let c = [busy(0.2, 1.0, 1.0), busy(0.2, 1.0, 3.0)];
        assert_shares(&water_fill(&c), &[0.35, 0.65]);
        // No requests, weights 1 : 2.
        let c = [busy(0.0, 1.0, 1.0), busy(0.0, 1.0, 2.0)];
        assert_shares(&water_fill(&c), &[1.0 / 3.0, 2.0 / 3.0]);
    }

    #[test]
    fn a_cap_holds_alone_and_passes_its_excess_on() {
        assert_shares(&water_fill(&[busy(0.1, 0.3, 1.0)]), &[0.3]);
        // 0.5 each by weight, the capped one held at 0.4, the other takes 0.6.
        let c = [busy(0.0, 0.4, 1.0), busy(0.0, 1.0, 1.0)];
        assert_shares(&water_fill(&c), &[0.4, 0.6]);
        // Caps summing below 1: each at its cap, the rest idle.
        let c = [busy(0.0, 0.2, 1.0), busy(0.1, 0.3, 5.0)];
        assert_shares(&water_fill(&c), &[0.2, 0.3]);
    }

    #[test]
    fn caps_reached_in_two_rounds() {
        // Level 1/3 each: the first reaches 0.2; then 0.4 each for the others, the second at
        // its cap of 0.4 exactly.
        let c = [
            busy(0.0, 0.2, 1.0),
            busy(0.0, 0.4, 1.0),
            busy(0.0, 1.0, 1.0),
        ];
        assert_shares(&water_fill(&c), &[0.2, 0.4, 0.4]);
        // Requests 0.3 / 0 / 0.1, weights 1 / 1 / 2, the first capped at 0.35: spare 0.6 at
        // level 0.15 puts it at 0.45 > 0.35; it takes 0.05, leaving 0.55 for weights 3:
        // 0.55 / 3 each unit of weight.
        let c = [
            busy(0.3, 0.35, 1.0),
            busy(0.0, 1.0, 1.0),
            busy(0.1, 1.0, 2.0),
        ];
        let l = 0.55 / 3.0;
        assert_shares(&water_fill(&c), &[0.35, l, 0.1 + 2.0 * l]);
    }

    #[test]
    fn oversubscribed_requests_are_scaled_down() {
        let c = [busy(0.8, 1.0, 1.0), busy(0.6, 1.0, 1.0)];
        assert_shares(&water_fill(&c), &[0.8 / 1.4, 0.6 / 1.4]);
    }

    #[test]
    fn a_tenant_needing_less_gets_what_it_needs_and_the_rest_goes_to_others() {
        // idle-share: a bursty tenant busy 30 % alone with request 0.5 next to a busy one.
        let bursty = Claim {
            demand: 0.3,
            ..busy(0.5, 1.0, 1.0)
        };
        assert_shares(&water_fill(&[busy(0.5, 1.0, 1.0), bursty]), &[0.7, 0.3]);
        // latency-vs-train: 40 requests/s of 4 × 1 ms kernels need 0.16.
        let latency = Claim {
            demand: 0.16,
            ..busy(0.5, 1.0, 1.0)
        };
        assert_shares(&water_fill(&[latency, busy(0.5, 1.0, 1.0)]), &[0.16, 0.84]);
        // Nobody needs the GPU: all shares 0.
        let idle = Claim {
            demand: 0.0,
            ..busy(0.5, 1.0, 1.0)
        };
        assert_shares(&water_fill(&[idle, idle]), &[0.0, 0.0]);
    }

    #[test]
    fn every_gpu_is_filled_on_its_own() {
        let sc = Scenario::parse(
            r#"
name = "two"
duration = "1s"
gpus = 2
[[tenant]]
name = "a"
workload = "train"
request = 0.7
[[tenant]]
name = "b"
workload = "train"
gpu = 1
limit = 0.4
[[tenant]]
name = "c"
workload = "train"
[[tenant]]
name = "d"
workload = "train"
gpu = 1
"#,
        )
        .unwrap();
        // GPU 0: 0.7 guaranteed to a, the spare 0.3 split evenly; GPU 1: b capped at 0.4.
        let t = targets(&sc, |_| 1.0);
        assert_shares(&t, &[0.85, 0.4, 0.15, 0.6]);
    }

    fn claim() -> impl Strategy<Value = Claim> {
        (0.0..=1.0f64, 0.0..=1.0f64, 0.1..=4.0f64, 0.0..=1.0f64).prop_map(|(a, b, weight, d)| {
            Claim {
                request: a.min(b),
                limit: a.max(b),
                weight,
                demand: d,
            }
        })
    }

    proptest! {
        /// The GPU is handed out up to what the tenants can take, nobody above its cap, nobody
        /// below its (scaled) guarantee, and two uncapped tenants' gains over their guarantee
        /// are in the ratio of their weights.
        #[test]
        fn shares_respect_caps_guarantees_and_weights(c in prop::collection::vec(claim(), 1..8)) {
            let s = water_fill(&c);
            let caps: Vec<f64> = c.iter().map(|c| c.limit.min(c.demand)).collect();
            let guaranteed: Vec<f64> = c.iter().zip(&caps).map(|(c, &cap)| c.request.min(cap)).collect();
            let promised: f64 = guaranteed.iter().sum();
            let scale = if promised > 1.0 { 1.0 / promised } else { 1.0 };
            let total: f64 = s.iter().sum();
            prop_assert!((total - caps.iter().sum::<f64>().min(1.0)).abs() < 1e-9, "{s:?}");
            for i in 0..c.len() {
                prop_assert!(s[i] <= caps[i] + 1e-9);
                prop_assert!(s[i] >= guaranteed[i] * scale - 1e-9);
            }
            for i in 0..c.len() {
                for j in 0..c.len() {
                    if s[i] < caps[i] - 1e-9 && s[j] < caps[j] - 1e-9 && promised <= 1.0 {
                        let (gi, gj) = (s[i] - guaranteed[i], s[j] - guaranteed[j]);
                        prop_assert!((gi * c[j].weight - gj * c[i].weight).abs() < 1e-9, "{s:?}");
                    }
                }
            }
        }
    }
}
