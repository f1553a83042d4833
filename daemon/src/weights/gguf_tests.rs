//! GGUF reader tests on small files written here (a writer for the subset the reader supports).
use super::*;
use half::f16;

/// Builds a GGUF v3 file: metadata (string or u32 values) and tensors (ggml type id, dims, raw bytes).
pub(crate) fn write_gguf(
    meta: &[(&str, GgufValue)],
    tensors: &[(&str, u32, Vec<u64>, Vec<u8>)],
) -> Vec<u8> {
    let mut b = Vec::new();
    let s = |b: &mut Vec<u8>, x: &str| {
        b.extend((x.len() as u64).to_le_bytes());
        b.extend(x.as_bytes());
    };
    b.extend(b"GGUF");
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((meta.len() as u64).to_le_bytes());
    for (k, v) in meta {
        s(&mut b, k);
        match v {
            GgufValue::Str(x) => {
                b.extend(8u32.to_le_bytes());
                s(&mut b, x);
            }
            GgufValue::U64(x) => {
                b.extend(4u32.to_le_bytes());
                b.extend((*x as u32).to_le_bytes());
            }
            GgufValue::F64(x) => {
                b.extend(6u32.to_le_bytes());
                b.extend((*x as f32).to_le_bytes());
            }
            GgufValue::Array(items) => {
                b.extend(9u32.to_le_bytes());
                let elem = match items.first() {
                    Some(GgufValue::Str(_)) => 8u32,
                    _ => 5u32, // i32, as llama.cpp writes token types
                };
                b.extend(elem.to_le_bytes());
                b.extend((items.len() as u64).to_le_bytes());
                for item in items {
                    match item {
                        GgufValue::Str(x) => s(&mut b, x),
                        GgufValue::U64(x) => b.extend((*x as i32).to_le_bytes()),
                        _ => unimplemented!("test writer"),
                    }
                }
            }
            _ => unimplemented!("test writer"),
        }
    }
    let mut offset = 0u64;
    for (name, ty, dims, data) in tensors {
        s(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend(offset.to_le_bytes());
        offset += (data.len() as u64).div_ceil(32) * 32;
    }
    while b.len() % 32 != 0 {
        b.push(0);
    }
    for (_, _, _, data) in tensors {
        b.extend(data);
        while b.len() % 32 != 0 {
            b.push(0);
        }
    }
    b
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn temp_file(name: &str, bytes: &[u8]) -> PathBuf {
    let p = std::env::temp_dir().join(format!("moe-gguf-{}-{name}", std::process::id()));
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn q4_1_and_q8_0_blocks_dequantise_as_ggml_does() {
    // Q4_1: d = 0.5, m = -1; qs[j] low nibble j%16, high nibble 15 - j%16.
    let mut blk = Vec::new();
    blk.extend(f16::from_f32(0.5).to_le_bytes());
    blk.extend(f16::from_f32(-1.0).to_le_bytes());
    blk.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let v = dequantize(GgmlType::Q4_1, &blk);
    assert_eq!(v.len(), 32);
    for j in 0..16 {
        assert_eq!(v[j], j as f32 * 0.5 - 1.0);
        assert_eq!(v[j + 16], (15 - j) as f32 * 0.5 - 1.0);
    }
    let mut blk = Vec::new();
    blk.extend(f16::from_f32(0.25).to_le_bytes());
    blk.extend((0..32i8).map(|j| (j - 16) as u8));
    let v = dequantize(GgmlType::Q8_0, &blk);
    assert_eq!(v[0], -4.0);
    assert_eq!(v[31], 15.0 * 0.25);
}

#[test]
fn unpermute_inverts_llama_cpp_permute() {
    // llama.cpp: w.reshape(heads, 2, d/2, cols).swapaxes(1, 2): HF row h*d + j*d/2 + i -> GGUF h*d + 2i + j.
    let (heads, head_dim, cols) = (3, 8, 2);
    let rows = heads * head_dim;
    let hf: Vec<f32> = (0..rows * cols).map(|x| x as f32).collect();
    let mut gguf = vec![0f32; hf.len()];
    for h in 0..heads {
        for j in 0..2 {
            for i in 0..head_dim / 2 {
                let src = h * head_dim + j * head_dim / 2 + i;
                let dst = h * head_dim + 2 * i + j;
                gguf[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&hf[src * cols..(src + 1) * cols]);
            }
        }
    }
    assert_eq!(unpermute_rotary_rows(&gguf, rows, cols, heads), hf);
}

fn tiny_llama() -> Vec<u8> {
    let meta = [
        ("general.architecture", GgufValue::Str("llama".into())),
        ("llama.attention.head_count", GgufValue::U64(2)),
        ("llama.attention.head_count_kv", GgufValue::U64(1)),
        ("llama.embedding_length", GgufValue::U64(4)),
        ("llama.feed_forward_length", GgufValue::U64(8)),
        ("llama.block_count", GgufValue::U64(1)),
        ("llama.vocab_size", GgufValue::U64(5)),
        ("llama.rope.freq_base", GgufValue::F64(10000.0)),
    ];
    let k: Vec<f32> = (0..8).map(|x| x as f32).collect();
    let tensors = [
        ("token_embd.weight", 0, vec![4, 5], f32_bytes(&[1.0; 20])),
        ("blk.0.attn_k.weight", 0, vec![4, 2], f32_bytes(&k)),
    ];
    write_gguf(&meta, &tensors)
}

#[test]
fn maps_hf_names_config_and_ties_embeddings() {
    let p = temp_file("tiny.gguf", &tiny_llama());
    let g = GgufFile::open(&p).unwrap();
    let cfg = g.hf_config().unwrap();
    assert_eq!(cfg["architectures"][0], "LlamaForCausalLM");
    assert_eq!(cfg["num_key_value_heads"], 1);
    assert_eq!(cfg["head_dim"], 2);
    assert_eq!(cfg["tie_word_embeddings"], true);
    assert!(g.contains("model.embed_tokens.weight"));
    assert!(g.contains("lm_head.weight"));
    assert!(!g.contains("model.layers.0.self_attn.q_proj.weight"));
    let e = g.load("model.embed_tokens.weight").unwrap();
    assert_eq!(e.shape, vec![5, 4]);
    // k: 2 rows (one kv head of dim 2) x 4 cols; with head_dim 2 the interleave is the identity.
    let k = g.load("model.layers.0.self_attn.k_proj.weight").unwrap();
    assert_eq!(k.shape, vec![2, 4]);
    assert_eq!(k.to_f32(), (0..8).map(|x| x as f32).collect::<Vec<_>>());
    let err = g
        .load("model.layers.0.mlp.up_proj.weight")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("blk.0.ffn_up.weight") || err.contains("up_proj"),
        "{err}"
    );
    std::fs::remove_file(p).ok();
}

#[test]
fn truncated_or_foreign_files_are_errors_not_panics() {
    let full = tiny_llama();
    for cut in [3, 10, 40, full.len() - 8] {
        let p = temp_file(&format!("cut{cut}.gguf"), &full[..cut]);
        let err = GgufFile::open(&p).err().expect("truncated file must fail");
        assert!(err.to_string().contains("GGUF"), "{err}");
        std::fs::remove_file(p).ok();
    }
    let p = temp_file("foreign.gguf", b"not a gguf file at all, just text");
    assert!(GgufFile::open(&p).is_err());
    std::fs::remove_file(p).ok();
}

fn open_err(name: &str, bytes: &[u8]) -> String {
    let p = temp_file(name, bytes);
    let e = GgufFile::open(&p).err().map(|e| e.to_string());
    std::fs::remove_file(p).ok();
    e.unwrap_or_else(|| panic!("{name} should not open"))
}

#[test]
fn tensor_byte_length_that_overflows_is_an_error() {
    // Each dim is at most the file size (64 KiB), yet their product (2^63 elements) times Q8_0's
    // 34/32 bytes per element does not fit in usize.
    let meta = [("general.architecture", GgufValue::Str("llama".into()))];
    let tensors = [("big", 8, vec![1 << 16, 1 << 16, 1 << 16, 1 << 15], vec![])];
    let mut bytes = write_gguf(&meta, &tensors);
    bytes.resize(1 << 16, 0);
    let e = open_err("wrap.gguf", &bytes);
    assert!(
        e.contains("not a valid GGUF file") && e.contains("big"),
        "{e}"
    );
}

#[test]
fn alignment_zero_or_not_a_power_of_two_is_refused() {
    for align in [0, 3, 48] {
        let meta = [("general.alignment", GgufValue::U64(align))];
        let tensors = [("t", 0, vec![8], f32_bytes(&[1.0; 8]))];
        let e = open_err(&format!("align{align}.gguf"), &write_gguf(&meta, &tensors));
        assert!(e.contains("general.alignment"), "{e}");
    }
}

#[test]
fn non_finite_weights_are_refused_naming_the_tensor() {
    let meta = [("general.architecture", GgufValue::Str("llama".into()))];
    let tensors = [(
        "token_embd.weight",
        0,
        vec![4],
        f32_bytes(&[1.0, 2.0, f32::NAN, 4.0]),
    )];
    let p = temp_file("nan.gguf", &write_gguf(&meta, &tensors));
    let g = GgufFile::open(&p).unwrap();
    let e = g.load_gguf("token_embd.weight").unwrap_err().to_string();
    assert!(
        e.contains("token_embd.weight") && e.contains("non-finite") && e.contains("element 2"),
        "{e}"
    );
    std::fs::remove_file(p).ok();
}

#[test]
fn a_safetensors_file_is_named_as_such() {
    let mut st = Vec::new();
    let header = br#"{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    st.extend((header.len() as u64).to_le_bytes());
    st.extend(header);
    st.extend(1f32.to_le_bytes());
    let e = open_err("st.gguf", &st);
    assert!(
        e.contains("not a valid GGUF file") && e.contains("safetensors"),
        "{e}"
    );
}

#[test]
fn token_types_longer_than_tokens_are_an_error() {
    let tokens = ["a", "b"].map(|t| GgufValue::Str(t.into())).to_vec();
    let meta = [
        ("tokenizer.ggml.model", GgufValue::Str("gpt2".into())),
        ("tokenizer.ggml.tokens", GgufValue::Array(tokens)),
        (
            "tokenizer.ggml.merges",
            GgufValue::Array(vec![GgufValue::Str("a b".into())]),
        ),
        (
            "tokenizer.ggml.token_type",
            GgufValue::Array(vec![
                GgufValue::U64(1),
                GgufValue::U64(1),
                GgufValue::U64(3),
            ]),
        ),
    ];
    let p = temp_file("types.gguf", &write_gguf(&meta, &[]));
    let g = GgufFile::open(&p).unwrap();
    let e = crate::text::TextTokenizer::from_gguf(&g)
        .err()
        .expect("must fail")
        .to_string();
    assert!(e.contains("token_type"), "{e}");
    std::fs::remove_file(p).ok();
}
