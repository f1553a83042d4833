//! Reading packed experts back in checkpoint layout (row-major `[out, in]` bf16), for devices that
//! compute with them in that layout: the GPU's layerwise prefill uploads int4 DRAM experts this way
//! (other formats it unpacks on the GPU itself).
use super::packed::unpack_bf16;
use super::CpuExpertSet;

impl CpuExpertSet {
    /// Expert `id` as bf16 bits: gate and up stacked (`[2·inter, hidden]`, gate first) and down
    /// (`[hidden, inter]`), dequantized from whatever format it is packed in. `None` if not held here.
    /// Cost: one pass over the expert's packed bytes, parallel over rows.
    pub fn export_bf16(&self, id: u32) -> Option<(Vec<u16>, Vec<u16>)> {
        let mut gate_up = unpack_bf16(&self.packed_geometry(), self.packed_expert(id)?);
        let down = gate_up.split_off(2 * self.cfg.inter * self.cfg.hidden);
        Some((gate_up, down))
    }
}
