//! The memory test of the resource-aware GPU scheduler this work builds on (GitHub
//! `aferikoglou/ECE-Diploma`, `cmd/scheduler/main.go`), as its code computes it, for a pod whose
//! request exceeds the GPU's memory left by the requests of the pods on it. From the GPU's
//! memory in use sampled once a second since the last placement (at least the last 20 s):
//!
//! 1. fewer than 20 samples: no;
//! 2. the free memory's coefficient of variation (σ/μ) below 0.5: yes if the request fits in
//!    the capacity minus the 80th percentile of the use (harvesting);
//! 3. else, or if that did not fit: the free memory's lag-10 autocorrelation above 0.35: yes if
//!    the request fits in the free memory forecast 10 s ahead by an AR(1) model fitted at lag 10;
//! 4. else no.
//!
//! Integer truncations are the code's (`int(...)` of the percentile and the forecast).

/// The seed's thresholds.
const COV_MAX: f64 = 0.5;
const HARVEST_PERCENTILE: f64 = 0.8;
const LAG: usize = 10;
const AUTOCORRELATION_MIN: f64 = 0.35;
const MIN_SAMPLES: usize = 20;

/// Whether a pod asking `request` may go on a GPU of `capacity` whose memory in use was `used`.
pub fn admits(request: f64, capacity: f64, used: &[f64]) -> bool {
    if used.len() < MIN_SAMPLES {
        return false;
    }
    let free: Vec<f64> = used.iter().map(|u| capacity - u).collect();
    if cov(&free) < COV_MAX && request <= capacity - harvest(used) {
        return true;
    }
    autocorrelation(&free, LAG) > AUTOCORRELATION_MIN && request <= ar1_forecast(&free, LAG)
}

/// σ/μ, with the population variance (E\[x²\] − μ²) as the seed computes it.
fn cov(x: &[f64]) -> f64 {
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    let variance = x.iter().map(|v| v * v).sum::<f64>() / n - mean * mean;
    variance.sqrt() / mean
}

/// The 80th percentile: the sorted values' element at index ⌊0.8 n⌋, truncated.
fn harvest(used: &[f64]) -> f64 {
    let mut v = used.to_vec();
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 * HARVEST_PERCENTILE) as usize).min(v.len() - 1);
    v[i].trunc()
}

/// Σ (x_i − μ)(x_{i+k} − μ) / Σ (x_i − μ)².
fn autocorrelation(x: &[f64], k: usize) -> f64 {
    let n = x.len();
    let mean = x.iter().sum::<f64>() / n as f64;
    let num: f64 = (0..n.saturating_sub(k))
        .map(|i| (x[i] - mean) * (x[i + k] - mean))
        .sum();
    let den: f64 = x.iter().map(|v| (v - mean) * (v - mean)).sum();
    num / den
}

/// x_{i+k} = φ0 + φ1 x_i by least squares, applied once to the last value, truncated.
fn ar1_forecast(x: &[f64], k: usize) -> f64 {
    let n = x.len();
    let m = (n - k) as f64;
    let (mut sx, mut sy, mut sxy, mut sxx) = (0.0, 0.0, 0.0, 0.0);
    for i in 0..n - k {
        sx += x[i];
        sy += x[i + k];
        sxy += x[i] * x[i + k];
        sxx += x[i] * x[i];
    }
    let (mx, my) = (sx / m, sy / m);
    let phi1 = (sxy - m * mx * my) / (sxx - m * mx * mx);
    let phi0 = my - phi1 * mx;
    (phi0 + phi1 * x[n - 1]).trunc()
}

#[cfg(test)]
mod tests {
    use super::*;

    const V100: f64 = 32_510.0;

    #[test]
    fn too_few_samples_never_admit() {
        assert!(!admits(1.0, V100, &[0.0; 19]));
    }

    #[test]
    fn a_stable_gpu_is_harvested_at_the_80th_percentile() {
        // Two engines at 6994 MiB each for 21 s: free 18522, σ = 0; p80 of use 13988.
        let used = vec![13_988.0; 21];
        assert!(admits(18_522.0, V100, &used));
        assert!(!admits(18_523.0, V100, &used));
        // The percentile is a bet on a growing engine: 16 of 21 samples at 318 MiB put the
        // 80th percentile (index 16) at the first high sample.
        let mut ramp = vec![318.0; 16];
        ramp.extend([6_994.0; 5]);
        assert_eq!(harvest(&ramp), 6_994.0);
        let mut ramp = vec![318.0; 17];
        ramp.extend([6_994.0; 4]);
        assert_eq!(harvest(&ramp), 318.0);
        assert!(admits(24_479.0, V100, &ramp));
    }

    #[test]
    fn a_trending_gpu_is_forecast_by_ar1() {
        // Free memory falling by 50 MiB a second for a minute: σ/μ ≥ 0.5, autocorrelated at lag
        // 10; the lag-10 AR(1) fit is exact on a line: it forecasts 10 s ahead.
        let free: Vec<f64> = (0..60).map(|i| 3_000.0 - 50.0 * i as f64).collect();
        assert!(cov(&free) >= COV_MAX);
        assert!(autocorrelation(&free, LAG) > AUTOCORRELATION_MIN);
        assert_eq!(ar1_forecast(&free, LAG), -450.0);
        let used: Vec<f64> = free.iter().map(|f| V100 - f).collect();
        assert!(!admits(1.0, V100, &used));
        let rising: Vec<f64> = (0..60).map(|i| 100.0 + 50.0 * i as f64).collect();
        let used: Vec<f64> = rising.iter().map(|f| V100 - f).collect();
        assert!(admits(3_550.0, V100, &used));
        assert!(!admits(3_551.0, V100, &used));
    }

    #[test]
    fn a_constant_series_has_no_autocorrelation_to_trust() {
        let used = vec![V100; 25];
        // Free is 0 throughout: σ/μ and the autocorrelation are NaN, so neither path admits.
        assert!(!admits(1.0, V100, &used));
    }
}
