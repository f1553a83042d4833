//! The packed expert bytes as they sit in memory, for a device that reads them directly: the GPU's
//! layerwise prefill copies a layer's packed experts over PCIe (from pinned, registered memory: no
//! staging copy on the host) and unpacks them there with `unpack_experts` in `cuda/kernels.cu`.
//!
//! [`unpack_expert_reference`] is that CUDA kernel written out in Rust, element for element (same index
//! formulas, same dense layout), so the layout contract is tested here on every CPU against the kernels'
//! own reader (`MatRef::weight`); the CUDA copy is a transcription of it.

use super::pack::{bf16_to_f32, f32_to_bf16, fp8_e4m3_to_f32, MatLayout};
use super::{CpuExpertSet, WeightFormat};

/// One packed matrix of an expert: `[n, k]` (HF `[out, in]`), its tiles then its scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackedMat {
    pub n: usize,
    pub k: usize,
    pub k_tiles: usize,
    /// Bytes of tiles; the f32 scales (if any) start right after.
    pub w_bytes: usize,
    /// Bytes of tiles and scales, 64-byte rounded: the next matrix starts here.
    pub bytes: usize,
}

impl From<MatLayout> for PackedMat {
    fn from(l: MatLayout) -> Self {
        PackedMat {
            n: l.n,
            k: l.k,
            k_tiles: l.k_tiles,
            w_bytes: l.w_bytes,
            bytes: l.bytes(),
        }
    }
}

/// How every expert of a set is laid out: gate, up, down back to back (`expert_bytes` in all).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackedGeometry {
    pub format: WeightFormat,
    pub hidden: usize,
    pub inter: usize,
    /// gate and up (`[inter, hidden]` each; up starts at `gate.bytes`).
    pub gate: PackedMat,
    /// down (`[hidden, inter]`, starts at `2 * gate.bytes`).
    pub down: PackedMat,
    pub expert_bytes: usize,
}

impl PackedGeometry {
    /// The code `unpack_experts` takes for this format; `None` for formats it does not read (int4).
    pub fn gpu_format_code(&self) -> Option<i32> {
        match self.format {
            WeightFormat::Bf16 => Some(0),
            WeightFormat::Fp8Block => Some(1),
            WeightFormat::Int8 => Some(2),
            WeightFormat::Int4 { .. } => None,
        }
    }

    /// Elements of one unpacked expert: gate_up `[2·inter, hidden]` then down `[hidden, inter]`.
    pub fn dense_elems(&self) -> usize {
        3 * self.hidden * self.inter
    }
}

impl CpuExpertSet {
    pub fn packed_geometry(&self) -> PackedGeometry {
        PackedGeometry {
            format: self.cfg.format,
            hidden: self.cfg.hidden,
            inter: self.cfg.inter,
            gate: self.gate_l.into(),
            down: self.down_l.into(),
            expert_bytes: self.bytes_per_expert(),
        }
    }

    /// The packed bytes of expert `id` (gate, up, down as [`PackedGeometry`] says), or `None` if this set
    /// does not hold it.
    pub fn packed_expert(&self, id: u32) -> Option<&[u8]> {
        let e = self.local.get(id as usize).copied().flatten()? as usize;
        let s = self.slots[e];
        Some(&self.buffers[s.group][s.offset..s.offset + self.bytes_per_expert()])
    }

    /// The memory holding every packed expert, one region per NUMA group: what a GPU driver pins
    /// (registers) once so copies read it directly.
    pub fn packed_regions(&self) -> Vec<&[u8]> {
        self.buffers.iter().map(|b| &b[..]).collect()
    }
}

/// Weight `[n][k]` of one packed matrix (`m` = its bytes: tiles then scales) as `unpack_experts` reads it.
fn unpack_weight(format: WeightFormat, pm: &PackedMat, m: &[u8], n: usize, k: usize) -> u16 {
    let scale = |i: usize| {
        let o = pm.w_bytes + 4 * i;
        f32::from_le_bytes([m[o], m[o + 1], m[o + 2], m[o + 3]])
    };
    let (nt, j) = (n >> 4, n & 15);
    match format {
        WeightFormat::Bf16 => {
            let (ti, kin) = (k >> 5, k & 31);
            let o = (nt * pm.k_tiles + ti) * 512 + (kin >> 1) * 32 + j * 2 + (kin & 1);
            u16::from_le_bytes([m[2 * o], m[2 * o + 1]])
        }
        WeightFormat::Fp8Block => {
            let (ti, kin) = (k >> 5, k & 31);
            let o = (nt * pm.k_tiles + ti) * 512 + (kin >> 1) * 32 + j * 2 + (kin & 1);
            let s = scale((n / 128) * pm.k.div_ceil(128) + k / 128);
            f32_to_bf16(fp8_e4m3_to_f32(m[o]) * s)
        }
        WeightFormat::Int8 => {
            let (ti, kin) = (k >> 6, k & 63);
            let o = (nt * pm.k_tiles + ti) * 1024 + (kin >> 2) * 64 + j * 4 + (kin & 3);
            f32_to_bf16((m[o] as i32 - 128) as f32 * scale(n))
        }
        WeightFormat::Int4 { .. } => unreachable!("int4 is not unpacked on the GPU"),
    }
}

/// One expert's packed bytes → dense bf16 bits: `[gate; up]` rows (`[2·inter, hidden]`) then down
/// (`[hidden, inter]`). Matrix `mat` (0 gate, 1 up, 2 down) lands at `mat · inter · hidden`.
/// Panics on int4 (see [`PackedGeometry::gpu_format_code`]).
pub fn unpack_expert_reference(g: &PackedGeometry, packed: &[u8]) -> Vec<u16> {
    let (h, i) = (g.hidden, g.inter);
    let mut out = vec![0u16; g.dense_elems()];
    for mat in 0..3 {
        let (pm, off) = match mat {
            0 => (&g.gate, 0),
            1 => (&g.gate, g.gate.bytes),
            _ => (&g.down, 2 * g.gate.bytes),
        };
        let m = &packed[off..off + pm.bytes];
        let dst = &mut out[mat * i * h..mat * i * h + pm.n * pm.k];
        for (idx, o) in dst.iter_mut().enumerate() {
            *o = unpack_weight(g.format, pm, m, idx / pm.k, idx % pm.k);
        }
    }
    out
}

/// bf16 bits → f32, for comparing unpacked experts.
pub fn dense_to_f32(v: &[u16]) -> Vec<f32> {
    v.iter().map(|&b| bf16_to_f32(b)).collect()
}
