//! The packed expert bytes as they sit in memory, for a device that reads them directly: the GPU's
//! layerwise prefill copies a layer's packed experts over PCIe (from pinned, registered memory: no
//! staging copy on the host) and unpacks them there with `unpack_experts` in `cuda/kernels.cu`.
//!
//! [`unpack_bf16`] is the reference for that kernel: the same bytes read by the CPU kernels' own reader.

use super::pack::{f32_to_bf16, MatLayout};
use super::{mat_refs, CpuExpertSet, WeightFormat};
use rayon::prelude::*;

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
    /// The code `unpack_experts` takes for this format; `None` for formats it does not read (f16, int4,
    /// grouped int8).
    pub fn gpu_format_code(&self) -> Option<i32> {
        match self.format {
            WeightFormat::Bf16 => Some(0),
            WeightFormat::Fp8Block => Some(1),
            WeightFormat::Int8 => Some(2),
            WeightFormat::F16
            | WeightFormat::Int4 { .. }
            | WeightFormat::Int4Min { .. }
            | WeightFormat::Int8Group { .. }
            | WeightFormat::Int8Min { .. } => None,
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

/// One expert's packed bytes (as [`CpuExpertSet::packed_expert`] gives them, laid out as `g` says) →
/// dense bf16 bits: `[gate; up]` rows (`[2·inter, hidden]`) then down (`[hidden, inter]`), read with the
/// kernels' own reader (`MatRef::weight`) and rounded to bf16; parallel over rows. What the GPU's
/// `unpack_experts` must reproduce bit for bit (checked by the GPU tests).
pub fn unpack_bf16(g: &PackedGeometry, packed: &[u8]) -> Vec<u16> {
    let gate_l = MatLayout::new(g.format, g.inter, g.hidden);
    let down_l = MatLayout::new(g.format, g.hidden, g.inter);
    let mats = mat_refs(gate_l, down_l, packed);
    let (h, i) = (g.hidden, g.inter);
    let mut out = vec![0u16; g.dense_elems()];
    let (gate_up, down) = out.split_at_mut(2 * i * h);
    gate_up.par_chunks_mut(h).enumerate().for_each(|(r, row)| {
        let (m, n) = (&mats[r / i], r % i);
        for (k, o) in row.iter_mut().enumerate() {
            *o = f32_to_bf16(m.weight(n, k));
        }
    });
    down.par_chunks_mut(i).enumerate().for_each(|(n, row)| {
        for (k, o) in row.iter_mut().enumerate() {
            *o = f32_to_bf16(mats[2].weight(n, k));
        }
    });
    out
}
