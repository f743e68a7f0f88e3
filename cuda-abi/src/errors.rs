//! `CUresult` names and descriptions for `cuGetErrorName`/`cuGetErrorString`.
//!
//! This exists so every component reports driver errors with the names and
//! wording of the real headers, and so the C entry points can hand out
//! `'static` NUL-terminated strings without allocating.

use std::ffi::CStr;

use crate::generated::{ERROR_CSTRS, ERRORS};

fn index(code: u32) -> Option<usize> {
    ERRORS
        .binary_search_by_key(&code, |&(value, _, _)| value)
        .ok()
}

/// Enumerator name of a `CUresult`, e.g. `"CUDA_ERROR_OUT_OF_MEMORY"`.
pub fn error_name(code: u32) -> Option<&'static str> {
    index(code).map(|i| ERRORS[i].1)
}

/// Description of a `CUresult` (first sentence of its doc comment in cuda.h).
pub fn error_string(code: u32) -> Option<&'static str> {
    index(code).map(|i| ERRORS[i].2)
}

/// [`error_name`] as a static C string, for `cuGetErrorName`.
pub fn error_name_cstr(code: u32) -> Option<&'static CStr> {
    index(code).map(|i| ERROR_CSTRS[i].1)
}

/// [`error_string`] as a static C string, for `cuGetErrorString`.
pub fn error_string_cstr(code: u32) -> Option<&'static CStr> {
    index(code).map(|i| ERROR_CSTRS[i].2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::result;

    #[test]
    fn names_and_strings() {
        assert_eq!(error_name(0), Some("CUDA_SUCCESS"));
        assert_eq!(error_name(2), Some("CUDA_ERROR_OUT_OF_MEMORY"));
        assert_eq!(
            error_name(result::CUDA_ERROR_UNKNOWN),
            Some("CUDA_ERROR_UNKNOWN")
        );
        assert_eq!(
            error_string(result::CUDA_ERROR_OUT_OF_MEMORY),
            Some(
                "The API call failed because it was unable to allocate enough memory or \
                 other resources to perform the requested operation."
            )
        );
        assert_eq!(
            error_string(0),
            Some("The API call returned with no errors.")
        );
        assert_eq!(error_name(3), Some("CUDA_ERROR_NOT_INITIALIZED"));
        assert_eq!(result::CUDA_ERROR_NOT_FOUND, 500);
    }

    #[test]
    fn unknown_codes() {
        for code in [9, 47, 103, 998, 1000, u32::MAX] {
            assert_eq!(error_name(code), None);
            assert_eq!(error_string(code), None);
            assert_eq!(error_name_cstr(code), None);
            assert_eq!(error_string_cstr(code), None);
        }
    }

    #[test]
    fn every_error_has_a_name_and_description() {
        assert!(ERRORS.len() >= 100);
        assert!(
            ERRORS.windows(2).all(|w| w[0].0 < w[1].0),
            "sorted by value"
        );
        for &(code, name, desc) in ERRORS {
            assert!(!name.is_empty() && name.starts_with("CUDA_"), "{code}");
            assert!(desc.ends_with('.') && desc.len() > 10, "{name}: {desc:?}");
            assert_eq!(desc.split_whitespace().collect::<Vec<_>>().join(" "), desc);
            assert_eq!(error_name(code), Some(name));
            assert_eq!(error_string(code), Some(desc));
        }
    }

    #[test]
    fn c_strings_match() {
        assert_eq!(ERRORS.len(), ERROR_CSTRS.len());
        for (&(code, name, desc), &(ccode, cname, cdesc)) in ERRORS.iter().zip(ERROR_CSTRS) {
            assert_eq!(code, ccode);
            assert_eq!(cname.to_str(), Ok(name));
            assert_eq!(cdesc.to_str(), Ok(desc));
            assert_eq!(error_name_cstr(code), Some(cname));
            assert_eq!(error_string_cstr(code), Some(cdesc));
        }
        assert_eq!(error_name_cstr(0), Some(c"CUDA_SUCCESS"));
    }
}
