//! A checkpoint whose chosen routed experts hold their int4 (Q4_0, groups of 32) round trip, so the CPU
//! backend in bf16 computes what an engine with `--expert-dtype int4` computes when some experts live
//! on the GPU: `--expert-dtype` is the format of DRAM experts, GPU experts keep the checkpoint's bf16.
//! Comparing such an engine with the CPU backend in int4 would charge the GPU experts' better precision
//! (12 % rel-L2 on the tiny random fixtures) to the hand-back.

use half::bf16;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::path::Path;

/// llama.cpp's `quantize_row_q4_0_ref` round trip of one row, as the CPU kernels pack `Int4 { group }`:
/// the value of largest magnitude maps to −8, the scale is stored as f16 and the codes are taken
/// against the stored scale; returns `q · d`.
pub fn q4_0_round_trip(row: &mut [f32], group: usize) {
    for part in row.chunks_mut(group) {
        let ext = part
            .iter()
            .fold(0f32, |a, &x| if x.abs() > a.abs() { x } else { a });
        let d = half::f16::from_f32(ext / -8.0).to_f32();
        let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
        for x in part.iter_mut() {
            let q = ((*x * inv).round() + 8.0).clamp(0.0, 15.0) - 8.0;
            *x = q * d;
        }
    }
}

/// Copies the bf16 checkpoint `src` (one `model.safetensors` and its JSON files) to `dst`, replacing the
/// weights of every routed expert `e` with `rounded(e)` by their int4 round trip along the input
/// dimension (rows of `[out, in]`), stored as bf16 (`q · d` rounds to bf16 within 2⁻⁹ relative).
pub fn write_int4_rounded_experts(src: &Path, dst: &Path, rounded: impl Fn(usize) -> bool) {
    std::fs::create_dir_all(dst).unwrap();
    for f in std::fs::read_dir(src).unwrap() {
        let p = f.unwrap().path();
        if p.extension().is_some_and(|e| e == "json") {
            std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
        }
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in st.tensors() {
        let expert = name
            .split(".experts.")
            .nth(1)
            .and_then(|rest| rest.split('.').next())
            .and_then(|e| e.parse::<usize>().ok());
        let data = match expert {
            Some(e) if rounded(e) && t.shape().len() == 2 && name.ends_with(".weight") => {
                assert_eq!(t.dtype(), Dtype::BF16, "{name}: a bf16 checkpoint");
                let width = t.shape()[1];
                let mut w: Vec<f32> = t
                    .data()
                    .chunks_exact(2)
                    .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect();
                for row in w.chunks_mut(width) {
                    q4_0_round_trip(row, 32);
                }
                w.iter()
                    .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
                    .collect()
            }
            _ => t.data().to_vec(),
        };
        tensors.push((name, t.dtype(), t.shape().to_vec(), data));
    }
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dst.join("model.safetensors")).unwrap();
}
