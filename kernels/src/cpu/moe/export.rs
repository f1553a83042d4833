//! Reading packed experts back in checkpoint layout (row-major `[out, in]` bf16), for devices that
//! compute with them in that layout: the GPU's layerwise prefill streams DRAM experts this way.
use super::pack::f32_to_bf16;
use super::CpuExpertSet;
use rayon::prelude::*;

impl CpuExpertSet {
    /// Expert `id` as bf16 bits: gate and up stacked (`[2·inter, hidden]`, gate first) and down
    /// (`[hidden, inter]`), dequantized from whatever format it is packed in. `None` if not held here.
    /// Cost: one pass over the expert's packed bytes, parallel over rows.
    pub fn export_bf16(&self, id: u32) -> Option<(Vec<u16>, Vec<u16>)> {
        let e = self.local.get(id as usize).copied().flatten()? as usize;
        let [gate, up, down] = self.mats(e);
        let (h, i) = (self.cfg.hidden, self.cfg.inter);
        let mut gate_up = vec![0u16; 2 * i * h];
        gate_up.par_chunks_mut(h).enumerate().for_each(|(r, row)| {
            let m = if r < i { &gate } else { &up };
            let n = r % i;
            for (k, o) in row.iter_mut().enumerate() {
                *o = f32_to_bf16(m.weight(n, k));
            }
        });
        let mut d = vec![0u16; h * i];
        d.par_chunks_mut(i).enumerate().for_each(|(n, row)| {
            for (k, o) in row.iter_mut().enumerate() {
                *o = f32_to_bf16(down.weight(n, k));
            }
        });
        Some((gate_up, d))
    }
}
