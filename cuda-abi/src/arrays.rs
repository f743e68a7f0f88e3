//! CUDA array descriptors and their memory footprint: the simulator charges arrays to device
//! memory and the hook to a group's memory cap, and both must agree on the size.

use crate::types::{
    CU_AD_FORMAT_FLOAT, CU_AD_FORMAT_HALF, CU_AD_FORMAT_SIGNED_INT8, CU_AD_FORMAT_SIGNED_INT16,
    CU_AD_FORMAT_SIGNED_INT32, CU_AD_FORMAT_UNSIGNED_INT8, CU_AD_FORMAT_UNSIGNED_INT16,
    CU_AD_FORMAT_UNSIGNED_INT32, CUDA_ARRAY_DESCRIPTOR, CUDA_ARRAY3D_DESCRIPTOR, CUarray_format,
};

/// Bytes per channel of a `CUarray_format` (8, 16, 32-bit integers, half, float).
pub fn format_bytes(format: CUarray_format) -> Option<usize> {
    Some(match format {
        CU_AD_FORMAT_UNSIGNED_INT8 | CU_AD_FORMAT_SIGNED_INT8 => 1,
        CU_AD_FORMAT_UNSIGNED_INT16 | CU_AD_FORMAT_SIGNED_INT16 | CU_AD_FORMAT_HALF => 2,
        CU_AD_FORMAT_UNSIGNED_INT32 | CU_AD_FORMAT_SIGNED_INT32 | CU_AD_FORMAT_FLOAT => 4,
        _ => return None,
    })
}

/// Bytes of one array level; `None` for an invalid descriptor.
pub fn array_bytes(
    width: usize,
    height: usize,
    depth: usize,
    format: CUarray_format,
    channels: u32,
) -> Option<usize> {
    if ![1, 2, 4].contains(&channels) || width == 0 {
        return None;
    }
    width
        .checked_mul(height.max(1))?
        .checked_mul(depth.max(1))?
        .checked_mul(format_bytes(format)? * channels as usize)
}

impl CUDA_ARRAY_DESCRIPTOR {
    /// Bytes of the array; `None` for an invalid descriptor.
    pub fn bytes(&self) -> Option<usize> {
        array_bytes(self.Width, self.Height, 1, self.Format, self.NumChannels)
    }
}

impl CUDA_ARRAY3D_DESCRIPTOR {
    /// Bytes of the array; `None` for an invalid descriptor.
    pub fn bytes(&self) -> Option<usize> {
        array_bytes(
            self.Width,
            self.Height,
            self.Depth,
            self.Format,
            self.NumChannels,
        )
    }
}

/// Bytes of a mipmapped array: every level, each half the previous in every dimension.
pub fn mipmapped_bytes(d: &CUDA_ARRAY3D_DESCRIPTOR, levels: u32) -> Option<usize> {
    let (mut w, mut h, mut z) = (d.Width, d.Height, d.Depth);
    let mut total = 0usize;
    for _ in 0..levels.max(1) {
        total = total.checked_add(array_bytes(w, h, z, d.Format, d.NumChannels)?)?;
        (w, h, z) = ((w / 2).max(1), (h / 2).max(1), (z / 2).max(1));
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(array_bytes(1024, 768, 0, 0x20, 4), Some(1024 * 768 * 16));
        assert_eq!(array_bytes(16, 0, 0, 0x01, 1), Some(16));
        assert_eq!(array_bytes(16, 1, 1, 0x99, 1), None);
        assert_eq!(array_bytes(16, 1, 1, 0x01, 3), None);
        let d = CUDA_ARRAY3D_DESCRIPTOR {
            Width: 8,
            Height: 8,
            Depth: 0,
            Format: CU_AD_FORMAT_UNSIGNED_INT8,
            NumChannels: 1,
            Flags: 0,
        };
        assert_eq!(mipmapped_bytes(&d, 4), Some(64 + 16 + 4 + 1));
        assert_eq!(d.bytes(), Some(64));
        let d2 = CUDA_ARRAY_DESCRIPTOR {
            Width: 1024,
            Height: 768,
            Format: CU_AD_FORMAT_FLOAT,
            NumChannels: 4,
        };
        assert_eq!(d2.bytes(), Some(1024 * 768 * 16));
    }
}
