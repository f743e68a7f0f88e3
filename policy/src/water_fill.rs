//! Target shares for a set of groups: guaranteed requests first (scaled down if they
//! oversubscribe the GPU), then the spare time split by weight among the groups below their
//! limit (water-filling).

use super::GroupParams;

/// The requests actually guaranteed to `groups`: each `request`, scaled down proportionally
/// when the requests sum to more than 1 (never above the group's `limit`).
pub fn effective_requests(groups: &[GroupParams]) -> Vec<f64> {
    let sum: f64 = groups.iter().map(|g| g.request.max(0.0)).sum();
    let scale = if sum > 1.0 { 1.0 / sum } else { 1.0 };
    groups
        .iter()
        .map(|g| (g.request.max(0.0) * scale).min(g.limit.clamp(0.0, 1.0)))
        .collect()
}

/// Target shares of GPU time for `groups` (the groups that currently want the GPU), in order.
///
/// Each group first gets its [effective request](effective_requests). The rest of the GPU,
/// `1 − Σ requests`, is split by weight: group `i` gets `request_i + weight_i · λ`, except that
/// no group goes above its `limit`; a group that would is held at its limit and what it cannot
/// take goes to the others, again by weight. `λ` is the common level that hands out the whole
/// GPU — or, when the limits sum to less than 1, every group gets its limit and the rest of the
/// GPU stays idle (hard caps). The result sums to `min(1, Σ limit)`.
///
/// Parameters are expected to be valid (see [`GroupParams::validate`]); weights that are not
/// positive are treated as the smallest positive weight.
pub fn water_fill(groups: &[GroupParams]) -> Vec<f64> {
    let base = effective_requests(groups);
    let limits: Vec<f64> = groups
        .iter()
        .zip(&base)
        .map(|(g, &b)| g.limit.clamp(0.0, 1.0).max(b))
        .collect();
    let weights: Vec<f64> = groups
        .iter()
        .map(|g| {
            if g.weight.is_finite() && g.weight > 0.0 {
                g.weight
            } else {
                f64::MIN_POSITIVE
            }
        })
        .collect();
    if limits.iter().sum::<f64>() <= 1.0 {
        return limits;
    }
    // Raise the level λ from 0; group i stops rising (reaches its limit) at its breakpoint
    // (limit_i − base_i) / weight_i. Visit groups in breakpoint order: while the level needed to
    // hand out the whole GPU with the remaining groups lies beyond the next breakpoint, that
    // group is capped and leaves the set.
    let mut order: Vec<usize> = (0..groups.len()).collect();
    let breakpoint = |i: usize| (limits[i] - base[i]) / weights[i];
    order.sort_by(|&a, &b| breakpoint(a).total_cmp(&breakpoint(b)));
    let mut capped_sum = 0.0;
    let mut free_weight: f64 = weights.iter().sum();
    let mut free_base: f64 = base.iter().sum();
    let mut level = f64::INFINITY;
    for &i in &order {
        let needed = (1.0 - capped_sum - free_base) / free_weight;
        if needed <= breakpoint(i) {
            level = needed.max(0.0);
            break;
        }
        capped_sum += limits[i];
        free_weight -= weights[i];
        free_base -= base[i];
    }
    (0..groups.len())
        .map(|i| (base[i] + weights[i] * level).min(limits[i]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn p(request: f64, limit: f64, weight: f64) -> GroupParams {
        GroupParams {
            request,
            limit,
            weight,
            ..GroupParams::default()
        }
    }

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-9)
    }

    #[test]
    fn empty_set_has_no_targets() {
        assert!(water_fill(&[]).is_empty());
    }

    #[test]
    fn requests_summing_to_one_are_the_targets() {
        let t = water_fill(&[p(0.5, 1.0, 1.0), p(0.3, 1.0, 1.0), p(0.2, 1.0, 1.0)]);
        assert!(close(&t, &[0.5, 0.3, 0.2]), "{t:?}");
    }

    #[test]
    fn spare_time_is_split_by_weight() {
        let t = water_fill(&[p(0.2, 1.0, 1.0), p(0.2, 1.0, 3.0)]);
        assert!(close(&t, &[0.35, 0.65]), "{t:?}");
    }

    #[test]
    fn a_lone_group_gets_everything_up_to_its_limit() {
        assert!(close(&water_fill(&[p(0.0, 1.0, 1.0)]), &[1.0]));
        assert!(close(&water_fill(&[p(0.1, 0.3, 1.0)]), &[0.3]));
    }

    #[test]
    fn a_capped_group_gives_its_excess_to_the_others_by_weight() {
        // Weights 10:1:1 would give the first 10/12 of the GPU; it is capped at 0.2 and the other
        // 0.8 is split 1:1.
        let t = water_fill(&[p(0.0, 0.2, 10.0), p(0.0, 1.0, 1.0), p(0.0, 1.0, 1.0)]);
        assert!(close(&t, &[0.2, 0.4, 0.4]), "{t:?}");
        // Cascading caps: the second cap only binds once the first one's excess arrives.
        let t = water_fill(&[p(0.0, 0.1, 4.0), p(0.0, 0.35, 4.0), p(0.0, 1.0, 2.0)]);
        // Level with all three: 0.1 each per unit weight → 0.4 > 0.1 → first capped; remaining
        // 0.9 split 4:2 → 0.6 > 0.35 → second capped; third gets 0.55.
        assert!(close(&t, &[0.1, 0.35, 0.55]), "{t:?}");
    }

    #[test]
    fn oversubscribed_requests_are_scaled_down() {
        let g = [p(0.9, 1.0, 1.0), p(0.6, 1.0, 1.0)];
        assert!(close(&effective_requests(&g), &[0.6, 0.4]));
        assert!(close(&water_fill(&g), &[0.6, 0.4]));
    }

    #[test]
    fn limits_summing_below_one_leave_the_gpu_partly_idle() {
        let t = water_fill(&[p(0.1, 0.2, 1.0), p(0.0, 0.3, 5.0)]);
        assert!(close(&t, &[0.2, 0.3]), "{t:?}");
    }

    #[test]
    fn a_request_equal_to_its_limit_is_exact() {
        let t = water_fill(&[p(0.3, 0.3, 100.0), p(0.1, 1.0, 1.0)]);
        assert!(close(&t, &[0.3, 0.7]), "{t:?}");
    }

    fn arb_params() -> impl Strategy<Value = GroupParams> {
        (0.0..0.6f64, 0.0..1.0f64, 0.05..20.0f64, any::<bool>()).prop_map(|(r, l, w, full)| {
            let limit = if full { 1.0 } else { r + (1.0 - r) * l };
            p(r, limit, w)
        })
    }

    proptest! {
        #[test]
        fn water_fill_invariants(groups in prop::collection::vec(arb_params(), 1..64)) {
            let t = water_fill(&groups);
            let eff = effective_requests(&groups);
            let limit_sum: f64 = groups.iter().map(|g| g.limit).sum();
            let total: f64 = t.iter().sum();
            // Hands out the whole GPU, or every group's limit.
            prop_assert!((total - limit_sum.min(1.0)).abs() < 1e-9, "total {total}");
            for i in 0..groups.len() {
                prop_assert!(t[i] >= eff[i] - 1e-12, "group {i} below request");
                prop_assert!(t[i] <= groups[i].limit + 1e-12, "group {i} above limit");
            }
            // Uncapped groups share one level; capped groups would have risen beyond it.
            let uncapped: Vec<usize> =
                (0..groups.len()).filter(|&i| t[i] < groups[i].limit - 1e-9).collect();
            if let Some(&first) = uncapped.first() {
                let level = (t[first] - eff[first]) / groups[first].weight;
                for &i in &uncapped {
                    let li = (t[i] - eff[i]) / groups[i].weight;
                    prop_assert!((li - level).abs() < 1e-7, "levels {li} vs {level}");
                }
                for i in 0..groups.len() {
                    if t[i] >= groups[i].limit - 1e-9 {
                        prop_assert!(
                            (groups[i].limit - eff[i]) / groups[i].weight <= level + 1e-7,
                            "group {i} capped below the level"
                        );
                    }
                }
            }
        }
    }
}
