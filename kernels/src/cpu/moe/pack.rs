//! Weight formats and the packed tile layout every tier reads.
//!
//! A matrix W[n][k] (HF `[out, in]`) is cut into N-tiles of 16 output rows; each N-tile is a contiguous
//! run of K-tiles, each K-tile one AMX B-tile in "VNNI" order: row `kk` holds, for the 16 outputs `j`,
//! the `P` consecutive k values `W[j][kt*KT + P*kk .. +P]` side by side. So one 64-byte load gives 16
//! outputs × P inputs: AVX-512 broadcasts P activations and issues one `vdpbf16ps`/`vpdpbusd` for 16
//! outputs (no horizontal sums), and AMX loads the same bytes as a B tile. One layout, every tier.
//!
//! | format | P | KT (k per tile) | bytes per tile | scales |
//! |---|---|---|---|---|
//! | Bf16 | 2 | 32 | 1024 | none |
//! | F16 (IEEE half, as GGUF F16 stores it) | 2 | 32 | 1024 | none |
//! | Fp8Block (E4M3) | 2 | 32 | 512 | `weight_scale_inv` as stored, `[ceil(n/128)][ceil(k/128)]` |
//! | Int8 (u8 = q + 128) | 4 | 64 | 1024 | per output row |
//! | Int4 group G (u4 = q + 8) | 4 | 64 | 512: rows 2i and 2i+1 share bytes (low/high nibble) | f16 `[n_tile][k/G][16]` |
//! | Int4Min group G (w = u4·d + m) | 4 | 64 | 512, as Int4 | f16 `[n_tile][k/G][d ×16, m ×16]` |
//! | Int8Group group G (u8 = q + 128) | 4 | 64 | 1024, as Int8 | f16 `[n_tile][k/G][16]` |
//! | Int8Min group G (w = u8·d + m) | 4 | 64 | 1024, as Int8 | f16 `[n_tile][k/G][d ×16, m ×16]` |
//!
//! Int4 group 32, Int4Min group 32 and Int8Group group 32 hold llama.cpp's Q4_0, Q4_1 and Q8_0 blocks
//! bit for bit ([`SourceTensor::Ggml`] sources of those types are repacked, not requantized); the
//! K-quants keep every code with their sub-block scales rounded once to f16: Q4_K in Int4Min 32, Q5_K
//! in Int8Min 32, Q6_K in Int8Group 16.
//!
//! Int4 scales are f16 (as llama.cpp's Q4_0): with f32 they would add 25% to the bytes a decode token
//! reads at group 32.
//!
//! Padding rows/columns are zero weights (u8 128, u4 8), so kernels never branch on edges.

use thiserror::Error;

use crate::cpu::ggml::{self, GgmlBlock};

/// How expert weights are stored in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// bf16 as in the checkpoint (or rounded from f32).
    Bf16,
    /// IEEE f16 as in the checkpoint (GGUF F16), read through f32 (or rounded from f32).
    F16,
    /// FP8 E4M3 with 128×128 block scales, bytes and scales used as stored.
    Fp8Block,
    /// int8 symmetric per output channel, quantized at load.
    Int8,
    /// int4 (llama.cpp Q4_0-style: scale = extreme value / -8) per group of `group` inputs, quantized at load.
    Int4 { group: usize },
    /// int4 with an f16 scale and min per group (llama.cpp Q4_1): w = u·d + m, u in 0..16.
    Int4Min { group: usize },
    /// int8 with an f16 scale per group (llama.cpp Q8_0): u8 = q + 128, w = q·d.
    Int8Group { group: usize },
    /// 8-bit codes with an f16 scale and min per group: w = u·d + m, u in 0..256 (Q5_K's five-bit
    /// codes with their sub-block scale and min).
    Int8Min { group: usize },
}

/// How the codes of a grouped int format (Int4 / Int4Min / Int8Group / Int8Min) decode, and where
/// their scales are: `w = (u − off)·d`, or `u·d + m` with a min; per (N-tile, group) 16 f16 scales `d`
/// (one per output of the tile), then with a min 16 f16 mins `m`. Every kernel of these formats
/// starts from this.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GroupedCodes {
    /// Inputs per scale group.
    pub group: usize,
    /// 4-bit codes, two to a byte (low nibbles first); else one byte per code.
    pub int4: bool,
    /// A min per group (`u·d + m`); else the fixed offset `off`.
    pub with_min: bool,
    /// The code of weight zero without a min: 8 (4-bit), 128 (8-bit); 0 with a min.
    pub off: i32,
}

impl GroupedCodes {
    /// The grouped int formats' codes, `None` for the other formats.
    pub(crate) fn of(format: WeightFormat) -> Option<GroupedCodes> {
        let (group, int4, with_min, off) = match format {
            WeightFormat::Int4 { group } => (group, true, false, 8),
            WeightFormat::Int4Min { group } => (group, true, true, 0),
            WeightFormat::Int8Group { group } => (group, false, false, 128),
            WeightFormat::Int8Min { group } => (group, false, true, 0),
            _ => return None,
        };
        Some(GroupedCodes {
            group,
            int4,
            with_min,
            off,
        })
    }

    /// f16 values per (N-tile, group): 16 scales, then 16 mins with a min.
    pub(crate) fn scale_stride(self) -> usize {
        if self.with_min {
            32
        } else {
            16
        }
    }

    /// Index in the f16 scales (`MatRef::s16`) of the first scale of N-tile `nt`, group `g`, when the
    /// matrix has `groups` groups per row (output `j`'s scale is `j` further, its min `16 + j`).
    pub(crate) fn scale_at(self, groups: usize, nt: usize, g: usize) -> usize {
        (nt * groups + g) * self.scale_stride()
    }
}

/// The names `WeightFormat` parses from.
const EXPECTED: &str =
    "expected bf16, f16, fp8, int8, int4, int4g64, int4g128, int4m32, int8g32, int8g16 or int8m32";

impl std::str::FromStr for WeightFormat {
    type Err = String;
    /// `bf16|f16|fp8|int8|int4` (int4 with group 32), `int4g64`, `int4g128`, `int4m32` (Q4_1 layout),
    /// `int8g32` (Q8_0 layout), `int8g16` (Q6_K's codes).
    fn from_str(s: &str) -> Result<WeightFormat, String> {
        Ok(match s {
            "bf16" => WeightFormat::Bf16,
            "f16" => WeightFormat::F16,
            "fp8" => WeightFormat::Fp8Block,
            "int8" => WeightFormat::Int8,
            "int4" | "int4g32" => WeightFormat::Int4 { group: 32 },
            "int4g64" => WeightFormat::Int4 { group: 64 },
            "int4g128" => WeightFormat::Int4 { group: 128 },
            "int4m32" => WeightFormat::Int4Min { group: 32 },
            "int8g32" => WeightFormat::Int8Group { group: 32 },
            "int8g16" => WeightFormat::Int8Group { group: 16 },
            "int8m32" => WeightFormat::Int8Min { group: 32 },
            _ => return Err(format!("unknown expert format {s:?} ({EXPECTED})")),
        })
    }
}

impl WeightFormat {
    /// (P, KT, tile bytes).
    pub(crate) fn tile_geometry(self) -> (usize, usize, usize) {
        match self {
            WeightFormat::Bf16 | WeightFormat::F16 => (2, 32, 1024),
            WeightFormat::Fp8Block => (2, 32, 512),
            WeightFormat::Int8 | WeightFormat::Int8Group { .. } | WeightFormat::Int8Min { .. } => {
                (4, 64, 1024)
            }
            WeightFormat::Int4 { .. } | WeightFormat::Int4Min { .. } => (4, 64, 512),
        }
    }

    /// Inputs per scale group, for the grouped int formats.
    pub fn group(self) -> Option<usize> {
        match self {
            WeightFormat::Int4 { group }
            | WeightFormat::Int4Min { group }
            | WeightFormat::Int8Group { group }
            | WeightFormat::Int8Min { group } => Some(group),
            _ => None,
        }
    }

    /// Checks the group size of the grouped formats: 32, 64 or 128, and 16 for `Int8Group` (Q6_K).
    pub(crate) fn check_group(self) -> Result<(), PackError> {
        match (self, self.group()) {
            (WeightFormat::Int8Group { group: 16 }, _) | (_, None | Some(32 | 64 | 128)) => Ok(()),
            (_, Some(g)) => Err(PackError::Group(g)),
        }
    }

    /// Bytes per weight, for bandwidth figures (scales excluded).
    pub fn bytes_per_weight(self) -> f64 {
        match self {
            WeightFormat::Bf16 | WeightFormat::F16 => 2.0,
            WeightFormat::Fp8Block
            | WeightFormat::Int8
            | WeightFormat::Int8Group { .. }
            | WeightFormat::Int8Min { .. } => 1.0,
            WeightFormat::Int4 { .. } | WeightFormat::Int4Min { .. } => 0.5,
        }
    }
}

/// A source tensor, row-major `[rows][cols]`, little-endian as in safetensors.
#[derive(Clone, Copy, Debug)]
pub enum SourceTensor<'a> {
    F32(&'a [f32]),
    /// bf16 bit patterns.
    Bf16(&'a [u16]),
    /// E4M3 bytes and `weight_scale_inv` `[ceil(rows/128)][ceil(cols/128)]` (value = fp8 · scale).
    Fp8E4M3 {
        data: &'a [u8],
        scale_inv: &'a [f32],
    },
    /// GGML blocks as stored in a GGUF file, each row `cols / block elements` blocks.
    Ggml {
        kind: GgmlBlock,
        data: &'a [u8],
    },
}

#[derive(Debug, Error, PartialEq)]
pub enum PackError {
    #[error("tensor {name}: expected {want} elements for [{rows}, {cols}], got {got}")]
    Shape {
        name: &'static str,
        rows: usize,
        cols: usize,
        want: usize,
        got: usize,
    },
    #[error("tensor {name}: FP8 block scales need {want} values, got {got}")]
    Scales {
        name: &'static str,
        want: usize,
        got: usize,
    },
    #[error("the FP8 weight format needs FP8 E4M3 source tensors ({name} is not)")]
    NotFp8 { name: &'static str },
    #[error("group size {0} not supported (32, 64 or 128; int8 groups also 16)")]
    Group(usize),
    #[error("tensor {name}: {cols} columns are not a whole number of {kind} blocks")]
    GgmlRow {
        name: &'static str,
        kind: &'static str,
        cols: usize,
    },
}

/// Shape and placement of one packed matrix inside an expert buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MatLayout {
    pub format: WeightFormat,
    pub n: usize,
    pub k: usize,
    pub n_tiles: usize,
    pub k_tiles: usize,
    /// k rounded up to the tile (activations are padded to this).
    pub k_pad: usize,
    pub tile_bytes: usize,
    pub w_bytes: usize,
    /// f32 scale count.
    pub s_len: usize,
}

impl MatLayout {
    pub fn new(format: WeightFormat, n: usize, k: usize) -> MatLayout {
        let (_, kt, tile_bytes) = format.tile_geometry();
        let k_pad = match format.group() {
            Some(group) => k.div_ceil(kt.max(group)) * kt.max(group),
            None => k.div_ceil(kt) * kt,
        };
        let n_tiles = n.div_ceil(16);
        let k_tiles = k_pad / kt;
        let s_len = match format {
            WeightFormat::Bf16 | WeightFormat::F16 => 0,
            WeightFormat::Fp8Block => n.div_ceil(128) * k.div_ceil(128),
            WeightFormat::Int8 => n_tiles * 16,
            WeightFormat::Int4 { group } | WeightFormat::Int8Group { group } => {
                (n_tiles * (k_pad / group) * 16).div_ceil(2)
            }
            WeightFormat::Int4Min { group } | WeightFormat::Int8Min { group } => {
                n_tiles * (k_pad / group) * 16
            }
        };
        MatLayout {
            format,
            n,
            k,
            n_tiles,
            k_tiles,
            k_pad,
            tile_bytes,
            w_bytes: n_tiles * k_tiles * tile_bytes,
            s_len,
        }
    }

    /// Bytes of weights + scales, 64-byte rounded.
    pub fn bytes(&self) -> usize {
        (self.w_bytes + self.s_len * 4).div_ceil(64) * 64
    }
}

/// A packed matrix: tiles followed by scales, both inside one expert buffer.
#[derive(Clone, Copy)]
pub(crate) struct MatRef<'a> {
    pub l: MatLayout,
    pub w: &'a [u8],
    pub s: &'a [f32],
}

impl MatRef<'_> {
    /// The scales as f16 bits (grouped int formats).
    #[inline]
    pub fn s16(&self) -> &[u16] {
        // SAFETY: the f32 scale storage reinterpreted as twice as many u16 (alignment 4 ≥ 2).
        unsafe { std::slice::from_raw_parts(self.s.as_ptr().cast::<u16>(), self.s.len() * 2) }
    }

    /// f16 scale number `i` as f32 (Int4: `(nt · groups + g) · 16 + j`; layouts in the module doc).
    #[inline]
    pub fn int4_scale(&self, i: usize) -> f32 {
        half::f16::from_bits(self.s16()[i]).to_f32()
    }

    /// Tiles of N-tile `nt`, `k_tiles * tile_bytes` bytes.
    #[inline]
    pub fn ntile(&self, nt: usize) -> &[u8] {
        let len = self.l.k_tiles * self.l.tile_bytes;
        &self.w[nt * len..(nt + 1) * len]
    }

    /// The dequantized weight W[n][k] (zero in the padding). Reference and export path: slow per element.
    pub fn weight(&self, n: usize, k: usize) -> f32 {
        let l = &self.l;
        let (p, kt, tb) = l.format.tile_geometry();
        let (nt, j) = (n / 16, n % 16);
        let (ti, kin) = (k / kt, k % kt);
        let (kk, q) = (kin / p, kin % p);
        let tile = &self.w[(nt * l.k_tiles + ti) * tb..][..tb];
        match l.format {
            WeightFormat::Bf16 => {
                let o = (kk * 32 + j * 2 + q) * 2;
                bf16_to_f32(u16::from_le_bytes([tile[o], tile[o + 1]]))
            }
            WeightFormat::F16 => {
                let o = (kk * 32 + j * 2 + q) * 2;
                half::f16::from_le_bytes([tile[o], tile[o + 1]]).to_f32()
            }
            WeightFormat::Fp8Block => {
                if n >= l.n || k >= l.k {
                    return 0.0;
                }
                let s = self.s[(n / 128) * l.k.div_ceil(128) + k / 128];
                fp8_e4m3_to_f32(tile[kk * 32 + j * 2 + q]) * s
            }
            WeightFormat::Int8 => (tile[kk * 64 + j * 4 + q] as i32 - 128) as f32 * self.s[n],
            WeightFormat::Int4 { .. }
            | WeightFormat::Int4Min { .. }
            | WeightFormat::Int8Group { .. }
            | WeightFormat::Int8Min { .. } => {
                let c = GroupedCodes::of(l.format).expect("a grouped int format");
                self.grouped_weight(c, tile, (nt, j), (k, kk, q))
            }
        }
    }

    /// Code of output `j`, quad `kk` (4 inputs from `4·kk` of the K-tile or N-tile `tile` starts at),
    /// input `q` of the quad: grouped int formats (4-bit codes two to a byte, low nibbles first).
    #[inline(always)]
    pub(crate) fn grouped_code(c: GroupedCodes, tile: &[u8], kk: usize, j: usize, q: usize) -> u8 {
        if c.int4 {
            let b = tile[(kk / 2) * 64 + j * 4 + q];
            if kk.is_multiple_of(2) {
                b & 15
            } else {
                b >> 4
            }
        } else {
            tile[kk * 64 + j * 4 + q]
        }
    }

    /// The weight of grouped codes `c` at output `j` of N-tile `nt` and input `k` (quad `kk`, `q` in it,
    /// counted from where `tile` starts): `(u − off)·d` or `u·d + m`.
    #[inline(always)]
    pub(crate) fn grouped_weight(
        &self,
        c: GroupedCodes,
        tile: &[u8],
        (nt, j): (usize, usize),
        (k, kk, q): (usize, usize, usize),
    ) -> f32 {
        let u = Self::grouped_code(c, tile, kk, j, q);
        let at = c.scale_at(self.l.k_pad / c.group, nt, k / c.group) + j;
        if c.with_min {
            u as f32 * self.int4_scale(at) + self.int4_scale(at + 16)
        } else {
            (u as i32 - c.off) as f32 * self.int4_scale(at)
        }
    }
}

/// The f32 scale storage of a packed matrix viewed as f16 bits (grouped int formats).
fn s16_mut(s: &mut [f32]) -> &mut [u16] {
    // SAFETY: f32 storage reinterpreted as twice as many u16 (alignment 4 ≥ 2, same bytes).
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<u16>(), s.len() * 2) }
}

/// bf16 bits → f32 (exact).
#[inline]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// f32 → bf16 bits, round to nearest even (NaN stays NaN).
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

/// FP8 E4M3 (fn variant: no infinities, 0x7F/0xFF are NaN) → f32, exact.
#[inline]
pub fn fp8_e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 15) as i32;
    let m = (b & 7) as f32;
    if e == 15 && b & 7 == 7 {
        return f32::NAN;
    }
    if e == 0 {
        sign * m / 8.0 * (2.0f32).powi(-6)
    } else {
        sign * (1.0 + m / 8.0) * (2.0f32).powi(e - 7)
    }
}

/// Row `row` of a source tensor as f32.
pub(crate) fn source_row(src: &SourceTensor<'_>, cols: usize, row: usize, out: &mut [f32]) {
    match src {
        SourceTensor::F32(d) => out.copy_from_slice(&d[row * cols..(row + 1) * cols]),
        SourceTensor::Bf16(d) => {
            for (o, &b) in out.iter_mut().zip(&d[row * cols..(row + 1) * cols]) {
                *o = bf16_to_f32(b);
            }
        }
        SourceTensor::Fp8E4M3 { data, scale_inv } => {
            let kb = cols.div_ceil(128);
            for (c, o) in out.iter_mut().enumerate() {
                *o = fp8_e4m3_to_f32(data[row * cols + c]) * scale_inv[(row / 128) * kb + c / 128];
            }
        }
        SourceTensor::Ggml { kind, data } => {
            let rb = kind.row_bytes(cols).expect("checked by check_source");
            ggml::dequantize(*kind, &data[row * rb..(row + 1) * rb], out);
        }
    }
}

/// Checks a source tensor's length (and FP8 scale count) against `[rows, cols]`.
pub(crate) fn check_source(
    name: &'static str,
    src: &SourceTensor<'_>,
    rows: usize,
    cols: usize,
) -> Result<(), PackError> {
    let want = rows * cols;
    let got = match src {
        SourceTensor::F32(d) => d.len(),
        SourceTensor::Bf16(d) => d.len(),
        SourceTensor::Fp8E4M3 { data, scale_inv } => {
            let ws = rows.div_ceil(128) * cols.div_ceil(128);
            if scale_inv.len() != ws {
                return Err(PackError::Scales {
                    name,
                    want: ws,
                    got: scale_inv.len(),
                });
            }
            data.len()
        }
        SourceTensor::Ggml { kind, data } => {
            let rb = kind.row_bytes(cols).ok_or(PackError::GgmlRow {
                name,
                kind: kind.name(),
                cols,
            })?;
            // Compare in elements: a wrong byte count reads as the element count it would hold.
            data.len() / rb.max(1) * cols + usize::from(!data.len().is_multiple_of(rb.max(1)))
        }
    };
    if got != want {
        return Err(PackError::Shape {
            name,
            rows,
            cols,
            want,
            got,
        });
    }
    Ok(())
}

/// Packs `src` (`[l.n, l.k]`) into `w` (`l.w_bytes`, zeroed) and `s` (`l.s_len`). `src` was checked.
pub(crate) fn pack_matrix(l: &MatLayout, src: &SourceTensor<'_>, w: &mut [u8], s: &mut [f32]) {
    let (p, kt, tb) = l.format.tile_geometry();
    // Padding weights are the format's zero.
    match l.format {
        WeightFormat::Int8 | WeightFormat::Int8Group { .. } => w.fill(128),
        WeightFormat::Int4 { .. } => w.fill(0x88),
        _ => {}
    }
    let zero_code = match l.format {
        WeightFormat::Int4 { .. } => 8,
        WeightFormat::Int4Min { .. } | WeightFormat::Int8Min { .. } => 0,
        _ => 128,
    };
    if let (WeightFormat::Fp8Block, SourceTensor::Fp8E4M3 { scale_inv, .. }) = (l.format, src) {
        s.copy_from_slice(scale_inv);
    }
    let mut row = vec![0f32; l.k];
    let mut codes = vec![0u8; l.k_pad];
    for n in 0..l.n {
        let (nt, j) = (n / 16, n % 16);
        // Codes of this row: one byte per weight (bf16 handled separately).
        match (l.format, src) {
            (_, SourceTensor::Ggml { kind, data }) if keeps_codes(l.format, *kind) => {
                let rb = kind.row_bytes(l.k).expect("checked by the caller");
                let group = ggml::code_group(*kind).expect("types with codes have groups");
                debug_assert_eq!(l.format.group(), Some(group));
                let groups = l.k_pad / group;
                let per_block = kind.block().0 / group;
                let s16 = s16_mut(s);
                codes.fill(zero_code);
                for (blk, b) in data[n * rb..(n + 1) * rb]
                    .chunks_exact(kind.block().1)
                    .enumerate()
                {
                    ggml::block_groups(*kind, b, |gb, c, d, m| {
                        let g = blk * per_block + gb;
                        codes[g * group..(g + 1) * group].copy_from_slice(c);
                        if let WeightFormat::Int4Min { .. } | WeightFormat::Int8Min { .. } =
                            l.format
                        {
                            s16[(nt * groups + g) * 32 + j] = d;
                            s16[(nt * groups + g) * 32 + 16 + j] = m;
                        } else {
                            s16[(nt * groups + g) * 16 + j] = d;
                        }
                    });
                }
            }
            (WeightFormat::Bf16, SourceTensor::Bf16(d)) => {
                place_bf16(l, w, nt, j, |k| d[n * l.k + k]);
                continue;
            }
            (WeightFormat::Bf16, _) => {
                source_row(src, l.k, n, &mut row);
                place_bf16(l, w, nt, j, |k| f32_to_bf16(row[k]));
                continue;
            }
            (
                WeightFormat::F16,
                SourceTensor::Ggml {
                    kind: GgmlBlock::F16,
                    data,
                },
            ) => {
                let d = &data[2 * n * l.k..];
                place_bf16(l, w, nt, j, |k| {
                    u16::from_le_bytes([d[2 * k], d[2 * k + 1]])
                });
                continue;
            }
            (WeightFormat::F16, _) => {
                source_row(src, l.k, n, &mut row);
                place_bf16(l, w, nt, j, |k| half::f16::from_f32(row[k]).to_bits());
                continue;
            }
            (WeightFormat::Fp8Block, SourceTensor::Fp8E4M3 { data, .. }) => {
                codes[..l.k].copy_from_slice(&data[n * l.k..(n + 1) * l.k]);
            }
            (WeightFormat::Fp8Block, _) => unreachable!("checked by the caller"),
            (WeightFormat::Int8, _) => {
                source_row(src, l.k, n, &mut row);
                let amax = row.iter().fold(0f32, |a, &x| a.max(x.abs()));
                let scale = if amax > 0.0 { amax / 127.0 } else { 1.0 };
                s[n] = scale;
                for (c, &x) in codes.iter_mut().zip(&row) {
                    *c = ((x / scale).round().clamp(-127.0, 127.0) as i32 + 128) as u8;
                }
                codes[l.k..].fill(128);
            }
            (WeightFormat::Int4 { group }, _) => {
                source_row(src, l.k, n, &mut row);
                codes.fill(8);
                let groups = l.k_pad / group;
                for g in 0..l.k.div_ceil(group) {
                    let part = &row[g * group..((g + 1) * group).min(l.k)];
                    // Q4_0: the value of largest magnitude maps to -8, using the full signed range.
                    let ext = part
                        .iter()
                        .fold(0f32, |a, &x| if x.abs() > a.abs() { x } else { a });
                    let d16 = half::f16::from_f32(ext / -8.0);
                    // SAFETY: int4 scales are f16 stored in the f32 slots (see `MatRef::s16`).
                    let s16 = unsafe {
                        std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<u16>(), s.len() * 2)
                    };
                    s16[(nt * groups + g) * 16 + j] = d16.to_bits();
                    let d = d16.to_f32(); // quantize against the scale as stored
                    let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
                    for (i, &x) in part.iter().enumerate() {
                        codes[g * group + i] = ((x * inv).round() + 8.0).clamp(0.0, 15.0) as u8;
                    }
                }
            }
            (WeightFormat::Int4Min { group }, _) | (WeightFormat::Int8Min { group }, _) => {
                // ggml's quantize_row_q4_1_ref: 15 steps (4-bit codes; 255 for 8-bit) from the
                // minimum to the maximum.
                let steps = if matches!(l.format, WeightFormat::Int4Min { .. }) {
                    15.0
                } else {
                    255.0
                };
                source_row(src, l.k, n, &mut row);
                codes.fill(0);
                let groups = l.k_pad / group;
                let s16 = s16_mut(s);
                for g in 0..l.k.div_ceil(group) {
                    let part = &row[g * group..((g + 1) * group).min(l.k)];
                    let (lo, hi) = part
                        .iter()
                        .fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
                    let d = (hi - lo) / steps;
                    let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
                    s16[(nt * groups + g) * 32 + j] = half::f16::from_f32(d).to_bits();
                    s16[(nt * groups + g) * 32 + 16 + j] = half::f16::from_f32(lo).to_bits();
                    for (i, &x) in part.iter().enumerate() {
                        codes[g * group + i] = ((x - lo) * inv + 0.5).min(steps) as u8;
                    }
                }
            }
            (WeightFormat::Int8Group { group }, _) => {
                source_row(src, l.k, n, &mut row);
                codes.fill(128);
                let groups = l.k_pad / group;
                let s16 = s16_mut(s);
                for g in 0..l.k.div_ceil(group) {
                    let part = &row[g * group..((g + 1) * group).min(l.k)];
                    // ggml's quantize_row_q8_0_ref: d = amax / 127, codes round(x / d).
                    let amax = part.iter().fold(0f32, |a, &x| a.max(x.abs()));
                    let d = amax / 127.0;
                    let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
                    s16[(nt * groups + g) * 16 + j] = half::f16::from_f32(d).to_bits();
                    for (i, &x) in part.iter().enumerate() {
                        codes[g * group + i] = ((x * inv).round() as i32 + 128) as u8;
                    }
                }
            }
        }
        for ti in 0..l.k_tiles {
            let tile = &mut w[(nt * l.k_tiles + ti) * tb..][..tb];
            for kk in 0..kt / p {
                for q in 0..p {
                    let c = codes[ti * kt + kk * p + q];
                    match l.format {
                        WeightFormat::Int4 { .. } | WeightFormat::Int4Min { .. } => {
                            let b = &mut tile[(kk / 2) * 64 + j * 4 + q];
                            *b = if kk % 2 == 0 {
                                (*b & 0xF0) | c
                            } else {
                                (*b & 0x0F) | (c << 4)
                            };
                        }
                        _ => tile[kk * p * 16 + j * p + q] = c,
                    }
                }
            }
        }
    }
}

/// Whether `format` keeps every code of `kind` blocks (then they are repacked, not requantized): bit
/// for bit for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0, with each sub-block scale rounded once to f16 for Q4_K / Q5_K /
/// Q6_K (see [`ggml::block_groups`]).
fn keeps_codes(format: WeightFormat, kind: GgmlBlock) -> bool {
    matches!(
        (format, kind),
        (WeightFormat::Int4 { group: 32 }, GgmlBlock::Q4_0)
            | (
                WeightFormat::Int4Min { group: 32 },
                GgmlBlock::Q4_1 | GgmlBlock::Q4K
            )
            | (
                WeightFormat::Int8Group { group: 32 },
                GgmlBlock::Q8_0 | GgmlBlock::Q5_0
            )
            | (WeightFormat::Int8Group { group: 16 }, GgmlBlock::Q6K)
            | (
                WeightFormat::Int8Min { group: 32 },
                GgmlBlock::Q5K | GgmlBlock::Q5_1
            )
    )
}

/// The packed format for a GGML type: one that keeps its codes where one exists (Q4_0, Q4_1, Q8_0,
/// Q5_0 → Int8Group 32 and Q5_1 → Int8Min 32 bit
/// for bit; Q4_K → Int4Min 32, Q5_K → Int8Min 32 and Q6_K → Int8Group 16 with each sub-block scale
/// (and min) rounded once to f16), BF16 and F16 as stored; F32 → Bf16.
pub fn format_for_ggml(kind: GgmlBlock) -> WeightFormat {
    match kind {
        GgmlBlock::Q4_0 => WeightFormat::Int4 { group: 32 },
        GgmlBlock::Q4_1 | GgmlBlock::Q4K => WeightFormat::Int4Min { group: 32 },
        GgmlBlock::Q8_0 | GgmlBlock::Q5_0 => WeightFormat::Int8Group { group: 32 },
        GgmlBlock::Q5K | GgmlBlock::Q5_1 => WeightFormat::Int8Min { group: 32 },
        GgmlBlock::Q6K => WeightFormat::Int8Group { group: 16 },
        GgmlBlock::F16 => WeightFormat::F16,
        GgmlBlock::F32 | GgmlBlock::Bf16 => WeightFormat::Bf16,
    }
}

/// Writes row `j` of N-tile `nt` of a 16-bit format (bf16 or f16 bits from `val(k)`).
fn place_bf16(l: &MatLayout, w: &mut [u8], nt: usize, j: usize, val: impl Fn(usize) -> u16) {
    for k in 0..l.k {
        let (ti, kin) = (k / 32, k % 32);
        let o = (nt * l.k_tiles + ti) * 1024 + ((kin / 2) * 32 + j * 2 + kin % 2) * 2;
        w[o..o + 2].copy_from_slice(&val(k).to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_decoding_matches_e4m3_table() {
        assert_eq!(fp8_e4m3_to_f32(0x00), 0.0);
        assert_eq!(fp8_e4m3_to_f32(0x38), 1.0); // e=7, m=0
        assert_eq!(fp8_e4m3_to_f32(0x7E), 448.0); // max normal
        assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9)); // min subnormal
        assert_eq!(fp8_e4m3_to_f32(0xB8), -1.0);
        assert!(fp8_e4m3_to_f32(0x7F).is_nan());
    }

    #[test]
    fn bf16_rounding_is_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3F80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_8000)), 0x3F80); // tie to even
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F81_8000)), 0x3F82);
        assert_eq!(bf16_to_f32(0xC000), -2.0);
    }

    #[test]
    fn pack_then_weight_round_trips() {
        let (n, k) = (37, 200);
        let src: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        for fmt in [
            WeightFormat::Bf16,
            WeightFormat::F16,
            WeightFormat::Int8,
            WeightFormat::Int4 { group: 32 },
            WeightFormat::Int4 { group: 128 },
        ] {
            let l = MatLayout::new(fmt, n, k);
            let mut w = vec![0u8; l.w_bytes];
            let mut s = vec![0f32; l.s_len];
            pack_matrix(&l, &SourceTensor::F32(&src), &mut w, &mut s);
            let m = MatRef { l, w: &w, s: &s };
            let tol = match fmt {
                WeightFormat::Bf16 => 1.0 / 128.0,
                WeightFormat::F16 => 1.0 / 1024.0,
                WeightFormat::Int8 => 1.0 / 127.0,
                _ => 1.0 / 8.0,
            };
            for r in 0..n {
                for c in 0..k {
                    let e = (m.weight(r, c) - src[r * k + c]).abs();
                    assert!(e <= tol, "{fmt:?} ({r},{c}) err {e}");
                }
                for c in k..l.k_pad {
                    assert_eq!(m.weight(r, c), 0.0, "{fmt:?} padding");
                }
            }
        }
    }

    #[test]
    fn fp8_pack_keeps_bytes_and_scales() {
        let (n, k) = (130, 140);
        let data: Vec<u8> = (0..n * k).map(|i| (i * 31 % 251) as u8 & 0x7E).collect();
        let scales: Vec<f32> = (0..4).map(|i| 0.5 + i as f32).collect();
        let src = SourceTensor::Fp8E4M3 {
            data: &data,
            scale_inv: &scales,
        };
        check_source("w", &src, n, k).unwrap();
        let l = MatLayout::new(WeightFormat::Fp8Block, n, k);
        let mut w = vec![0u8; l.w_bytes];
        let mut s = vec![0f32; l.s_len];
        pack_matrix(&l, &src, &mut w, &mut s);
        let m = MatRef { l, w: &w, s: &s };
        for r in [0, 5, 127, 128, 129] {
            for c in [0, 1, 127, 128, 139] {
                let want = fp8_e4m3_to_f32(data[r * k + c]) * scales[(r / 128) * 2 + c / 128];
                assert_eq!(m.weight(r, c), want);
            }
        }
        assert!(check_source("w", &SourceTensor::F32(&[0.0; 3]), 2, 2).is_err());
    }
}
