//! How much memory the groups' caps on a GPU may promise: at most `ratio` times what the GPU
//! holds (`memory_overcommit`; 1: never more than the card).

use super::Bytes;

/// A group's cap as it stands on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Promise {
    pub cap: Bytes,
    /// Lowered from what the group asked for (to what was left, maybe nothing): the caps
    /// before it already promise the rest.
    pub clamped: bool,
}

/// The caps `caps` (in the order the groups came, earliest first) on a GPU of `capacity`
/// bytes when they may promise at most `ratio` × `capacity` together: each group keeps its cap
/// while it fits beside the earlier ones; a later one gets what is left. A group that came
/// first never loses memory to one that came after.
pub fn promise(caps: &[Bytes], capacity: Bytes, ratio: f64) -> Vec<Promise> {
    let total = (capacity as f64 * ratio.max(0.0)).min(u64::MAX as f64) as Bytes;
    let mut left = total;
    caps.iter()
        .map(|&cap| {
            let given = cap.min(left);
            left -= given;
            Promise {
                cap: given,
                clamped: given < cap,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GIB: Bytes = 1 << 30;

    #[test]
    fn without_overcommit_the_caps_hold_no_more_than_the_card() {
        let p = promise(&[40 * GIB, 30 * GIB, 20 * GIB], 80 * GIB, 1.0);
        assert_eq!(
            p,
            vec![
                Promise {
                    cap: 40 * GIB,
                    clamped: false
                },
                Promise {
                    cap: 30 * GIB,
                    clamped: false
                },
                Promise {
                    cap: 10 * GIB,
                    clamped: true
                },
            ]
        );
        assert!(!promise(&[GIB], 80 * GIB, 1.0)[0].clamped);
        let none_left = promise(&[80 * GIB, GIB], 80 * GIB, 1.0);
        assert_eq!(
            none_left[1],
            Promise {
                cap: 0,
                clamped: true
            }
        );
    }

    #[test]
    fn a_ratio_lets_caps_sum_past_the_card() {
        let p = promise(&[40 * GIB; 4], 80 * GIB, 2.0);
        assert!(p.iter().all(|p| !p.clamped && p.cap == 40 * GIB));
        let p = promise(&[40 * GIB; 4], 80 * GIB, 1.5);
        assert_eq!(
            p[3],
            Promise {
                cap: 0,
                clamped: true
            }
        );
    }

    proptest! {
        #[test]
        fn never_more_than_the_ratio_and_earlier_groups_keep_theirs(
            caps in proptest::collection::vec(0u64..100 * GIB, 0..12),
            ratio in 1.0f64..4.0,
        ) {
            let capacity = 80 * GIB;
            let p = promise(&caps, capacity, ratio);
            let sum: u128 = p.iter().map(|p| p.cap as u128).sum();
            prop_assert!(sum as f64 <= capacity as f64 * ratio + 1.0);
            // Once one is clamped, everything before it got all it asked for.
            if let Some(first) = p.iter().position(|p| p.clamped) {
                prop_assert!(p[..first].iter().zip(&caps).all(|(p, &c)| p.cap == c));
                prop_assert!(p[first + 1..].iter().all(|p| p.cap == 0 || !p.clamped));
            }
            for (p, &c) in p.iter().zip(&caps) {
                prop_assert!(p.cap <= c);
                prop_assert_eq!(p.clamped, p.cap < c);
            }
        }
    }
}
