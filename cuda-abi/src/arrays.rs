//! CUDA array descriptors and their memory footprint: the simulator charges arrays to device
//! memory and the hook to a group's memory cap, and both must agree on the size.

/// `CUDA_ARRAY_DESCRIPTOR`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ArrayDesc {
    pub width: usize,
    pub height: usize,
    pub format: u32,
    pub channels: u32,
}

/// `CUDA_ARRAY3D_DESCRIPTOR`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Array3DDesc {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    pub format: u32,
    pub channels: u32,
    pub flags: u32,
}

/// Bytes per channel of a `CUarray_format` (8, 16, 32-bit integers, half, float).
pub fn format_bytes(format: u32) -> Option<usize> {
    Some(match format {
        0x01 | 0x08 => 1,
        0x02 | 0x09 | 0x10 => 2,
        0x03 | 0x0a | 0x20 => 4,
        _ => return None,
    })
}

/// Bytes of one array level; `None` for an invalid descriptor.
pub fn array_bytes(
    width: usize,
    height: usize,
    depth: usize,
    format: u32,
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

/// Bytes of a mipmapped array: every level, each half the previous in every dimension.
pub fn mipmapped_bytes(d: &Array3DDesc, levels: u32) -> Option<usize> {
    let (mut w, mut h, mut z) = (d.width, d.height, d.depth);
    let mut total = 0usize;
    for _ in 0..levels.max(1) {
        total = total.checked_add(array_bytes(w, h, z, d.format, d.channels)?)?;
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
        let d = Array3DDesc {
            width: 8,
            height: 8,
            depth: 0,
            format: 0x01,
            channels: 1,
            flags: 0,
        };
        assert_eq!(mipmapped_bytes(&d, 4), Some(64 + 16 + 4 + 1));
    }
}
