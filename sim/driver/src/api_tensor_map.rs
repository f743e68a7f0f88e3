//! `cuTensorMapEncodeTiled`: the 128-byte descriptor a Hopper kernel's bulk tensor copies (TMA)
//! read, encoded on the host. cuBLASLt encodes one per operand for its sm_90 kernels. The
//! simulated kernels read nothing, so the descriptor's bytes only need to be deterministic: the
//! arguments, checked as the driver documents, are written into it in order.

use crate::ffi::*;
use std::ffi::c_void;

/// Size and alignment of a `CUtensorMap`.
const TENSOR_MAP_BYTES: usize = 128;

/// The documented requirements of a tiled tensor map, for `rank` dimensions of elements of
/// `elem` bytes (`None`: packed sub-byte types, whose inner box is not checked in bytes).
#[allow(clippy::too_many_arguments)]
fn check_tiled(
    elem: Option<u64>,
    rank: usize,
    address: u64,
    dims: &[u64],
    strides: &[u64],
    boxes: &[u32],
    element_strides: &[u32],
    interleave: CUtensorMapInterleave,
    swizzle: CUtensorMapSwizzle,
) -> bool {
    // "tensorRank ... must be non-zero and less than or equal to the maximum supported
    // dimensionality of 5. If interleave is not CU_TENSOR_MAP_INTERLEAVE_NONE, then tensorRank
    // must additionally be greater than or equal to 3."
    let rank_ok = (1..=5).contains(&rank) && (interleave == 0 || rank >= 3);
    // "globalAddress ... must be 16 byte aligned ... 32 byte aligned when interleave is
    // CU_TENSOR_MAP_INTERLEAVE_32B."
    let align = if interleave == CU_TENSOR_MAP_INTERLEAVE_32B {
        32
    } else {
        16
    };
    // "globalDim ... must be non-zero and less than or equal to 2^32"; "globalStrides ... must
    // be a multiple of 16 and less than 2^40"; "boxDim ... must be non-zero and less than or
    // equal to 256"; "elementStrides ... must be non-zero and less than or equal to 8".
    let dims_ok = dims.iter().all(|&d| d > 0 && d <= 1 << 32);
    let strides_ok = strides.iter().all(|&s| s % 16 == 0 && s < 1 << 40);
    let boxes_ok = boxes.iter().all(|&b| b > 0 && b <= 256);
    let element_strides_ok = element_strides.iter().all(|&e| e > 0 && e <= 8);
    // With no interleave, "the inner dimension of the box ... boxDim[0] * elementSizeInBytes
    // must be a multiple of 16 bytes", and at most the swizzle's span (32, 64, 128 bytes).
    let inner = elem.map(|e| u64::from(boxes.first().copied().unwrap_or(0)) * e);
    let inner_ok = interleave != CU_TENSOR_MAP_INTERLEAVE_NONE
        || inner.is_none_or(|bytes| {
            let span = match swizzle {
                CU_TENSOR_MAP_SWIZZLE_32B => 32,
                CU_TENSOR_MAP_SWIZZLE_64B => 64,
                CU_TENSOR_MAP_SWIZZLE_NONE => u64::MAX,
                _ => 128,
            };
            bytes % 16 == 0 && bytes <= span
        });
    rank_ok
        && address.is_multiple_of(align)
        && dims_ok
        && strides_ok
        && boxes_ok
        && element_strides_ok
        && inner_ok
}

/// Bytes of one element of `ty`; `None` for the packed sub-byte types; `Err` if unknown.
fn element_size(ty: CUtensorMapDataType) -> CuResult<Option<u64>> {
    Ok(Some(match ty {
        CU_TENSOR_MAP_DATA_TYPE_UINT8 => 1,
        CU_TENSOR_MAP_DATA_TYPE_UINT16
        | CU_TENSOR_MAP_DATA_TYPE_FLOAT16
        | CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 => 2,
        CU_TENSOR_MAP_DATA_TYPE_UINT32
        | CU_TENSOR_MAP_DATA_TYPE_INT32
        | CU_TENSOR_MAP_DATA_TYPE_FLOAT32
        | CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ
        | CU_TENSOR_MAP_DATA_TYPE_TFLOAT32
        | CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ => 4,
        CU_TENSOR_MAP_DATA_TYPE_UINT64
        | CU_TENSOR_MAP_DATA_TYPE_INT64
        | CU_TENSOR_MAP_DATA_TYPE_FLOAT64 => 8,
        CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN8B
        | CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B
        | CU_TENSOR_MAP_DATA_TYPE_16U6_ALIGN16B => return Ok(None),
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    }))
}

entry!(
    fn cuTensorMapEncodeTiled(
        map: *mut c_void,
        ty: CUtensorMapDataType,
        rank: cuuint32_t,
        address: *mut c_void,
        dims: *const cuuint64_t,
        strides: *const cuuint64_t,
        boxes: *const cuuint32_t,
        element_strides: *const cuuint32_t,
        interleave: CUtensorMapInterleave,
        swizzle: CUtensorMapSwizzle,
        l2: CUtensorMapL2promotion,
        oob: CUtensorMapFloatOOBfill,
    ) {
        let elem = element_size(ty)?;
        let rank = rank as usize;
        if map.is_null() || !(map as usize).is_multiple_of(64) || !(1..=5).contains(&rank) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (dims, strides) = (slice(dims, rank)?, slice(strides, rank - 1)?);
        let (boxes, element_strides) = (slice(boxes, rank)?, slice(element_strides, rank)?);
        let known = interleave <= CU_TENSOR_MAP_INTERLEAVE_32B
            && swizzle <= CU_TENSOR_MAP_SWIZZLE_128B_ATOM_64B
            && l2 <= CU_TENSOR_MAP_L2_PROMOTION_L2_256B
            && oob <= CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA;
        let address = address as u64;
        if !known
            || !check_tiled(
                elem,
                rank,
                address,
                dims,
                strides,
                boxes,
                element_strides,
                interleave,
                swizzle,
            )
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut words: Vec<u64> = vec![address, u64::from(ty), rank as u64];
        words.extend_from_slice(dims);
        words.extend_from_slice(strides);
        let small = boxes.iter().chain(element_strides);
        words.extend(small.map(|&v| u64::from(v)));
        words.extend([interleave, swizzle, l2, oob].map(u64::from));
        let mut bytes = [0u8; TENSOR_MAP_BYTES];
        for (chunk, w) in bytes.chunks_exact_mut(8).zip(&words) {
            chunk.copy_from_slice(&w.to_le_bytes());
        }
        put(map.cast::<[u8; TENSOR_MAP_BYTES]>(), bytes)
    }
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_requirements_are_checked() {
        let ok = |rank, address, boxes: &[u32], swizzle| {
            let dims = vec![1024u64; rank];
            let strides = vec![2048u64; rank - 1];
            let es = vec![1u32; rank];
            check_tiled(
                Some(2),
                rank,
                address,
                &dims,
                &strides,
                boxes,
                &es,
                0,
                swizzle,
            )
        };
        assert!(ok(2, 0x1000, &[64, 64], CU_TENSOR_MAP_SWIZZLE_128B));
        assert!(
            !ok(2, 0x1008, &[64, 64], CU_TENSOR_MAP_SWIZZLE_128B),
            "16-byte alignment"
        );
        assert!(
            !ok(2, 0x1000, &[257, 64], CU_TENSOR_MAP_SWIZZLE_NONE),
            "box at most 256"
        );
        assert!(
            !ok(2, 0x1000, &[4, 64], CU_TENSOR_MAP_SWIZZLE_NONE),
            "inner box of 8 bytes"
        );
        assert!(
            !ok(2, 0x1000, &[64, 64], CU_TENSOR_MAP_SWIZZLE_64B),
            "128 bytes > 64B swizzle"
        );
        let strides = [24u64];
        assert!(!check_tiled(
            Some(2),
            2,
            0x1000,
            &[16, 16],
            &strides,
            &[8, 8],
            &[1, 1],
            0,
            0
        ));
    }
}
