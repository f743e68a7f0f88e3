//! `CUdevice_attribute` names, so `cuDeviceGetAttribute` handling and logs
//! can name attributes without a hand-copied enum.

use crate::generated::DEVICE_ATTRIBUTES;

/// Enumerator name of a `CUdevice_attribute` value (first name where cuda.h
/// has deprecated aliases), e.g. `"CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"`.
pub fn device_attribute_name(attr: u32) -> Option<&'static str> {
    DEVICE_ATTRIBUTES
        .binary_search_by_key(&attr, |&(value, _)| value)
        .ok()
        .map(|i| DEVICE_ATTRIBUTES[i].1)
}

/// Value of a `CUdevice_attribute` enumerator name (aliases not included).
pub fn device_attribute_value(name: &str) -> Option<u32> {
    DEVICE_ATTRIBUTES
        .iter()
        .find(|&&(_, n)| n == name)
        .map(|&(v, _)| v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookups() {
        assert_eq!(
            device_attribute_name(1),
            Some("CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK")
        );
        assert_eq!(
            device_attribute_name(16),
            Some("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT")
        );
        // 8 has a deprecated alias (SHARED_MEMORY_PER_BLOCK); the first name wins.
        assert_eq!(
            device_attribute_name(8),
            Some("CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK")
        );
        assert_eq!(device_attribute_name(0), None);
        assert_eq!(device_attribute_name(100_000), None);
        assert_eq!(
            device_attribute_value("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"),
            Some(75)
        );
        assert_eq!(device_attribute_value("CU_DEVICE_ATTRIBUTE_MAX"), None);
    }

    #[test]
    fn table_is_sorted_and_unique() {
        assert!(DEVICE_ATTRIBUTES.windows(2).all(|w| w[0].0 < w[1].0));
        assert!(
            DEVICE_ATTRIBUTES
                .iter()
                .all(|(_, n)| n.starts_with("CU_DEVICE_ATTRIBUTE_"))
        );
    }
}
