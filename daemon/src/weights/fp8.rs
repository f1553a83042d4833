//! FP8 E4M3 (OCP "e4m3fn": no infinities, 0x7F/0xFF are NaN) and the block-scaled weight layout of
//! DeepSeek-V3 / GLM FP8 checkpoints: `W ≈ fp8(W_q) * scale_inv[row / 128][col / 128]`.

/// Decodes one E4M3FN byte.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((b >> 3) & 0x0F) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0x0F && (b & 0x07) == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// Lookup table of all 256 decodings (built once per call site; 1 KiB).
pub fn e4m3_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    for (i, v) in t.iter_mut().enumerate() {
        *v = e4m3_to_f32(i as u8);
    }
    t
}

/// Number of scale blocks along a dimension of `n` elements.
pub fn blocks(n: usize, block: usize) -> usize {
    n.div_ceil(block)
}

/// Dequantises a `rows × cols` FP8 matrix with per-(block × block) scales to f32.
pub fn dequantize_block_scaled(
    bytes: &[u8],
    scale_inv: &[f32],
    rows: usize,
    cols: usize,
    block: usize,
) -> Vec<f32> {
    let table = e4m3_table();
    let col_blocks = blocks(cols, block);
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let srow = &scale_inv[(r / block) * col_blocks..(r / block + 1) * col_blocks];
        for c in 0..cols {
            out.push(table[bytes[r * cols + c] as usize] * srow[c / block]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_known_values() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0); // exp 7, man 0
        assert_eq!(e4m3_to_f32(0xB8), -1.0);
        assert_eq!(e4m3_to_f32(0x7E), 448.0); // largest finite
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
        assert!(e4m3_to_f32(0x7F).is_nan());
    }

    #[test]
    fn block_scales_apply_per_tile() {
        // 2x3 matrix, block 2: column blocks [0,1] and [2]; one row block.
        let bytes = [0x38u8; 6]; // all 1.0
        let scales = [2.0f32, 3.0];
        let out = dequantize_block_scaled(&bytes, &scales, 2, 3, 2);
        assert_eq!(out, vec![2.0, 2.0, 3.0, 2.0, 2.0, 3.0]);
    }
}
