//! KV cache of one sequence on the CPU backend: per layer, two row-major f32 arrays growing with the
//! sequence (GQA: keys and values, `kv_heads × head_dim` wide; MLA: the normalised latent and the roped
//! shared key). Cloning a cache and truncating it is how prefixes are shared (prefix caching).

#[derive(Clone, Debug, Default)]
pub struct LayerKv {
    pub a: Vec<f32>,
    pub b: Vec<f32>,
    pub a_width: usize,
    pub b_width: usize,
}

impl LayerKv {
    pub fn append(&mut self, a: &[f32], b: &[f32]) {
        self.a.extend_from_slice(a);
        self.b.extend_from_slice(b);
    }
    pub fn a_row(&self, pos: usize) -> &[f32] {
        &self.a[pos * self.a_width..(pos + 1) * self.a_width]
    }
    pub fn b_row(&self, pos: usize) -> &[f32] {
        &self.b[pos * self.b_width..(pos + 1) * self.b_width]
    }
}

/// Cache of one sequence: every layer (CPU backend) or a block table in the GPU pool (CUDA backend),
/// plus the number of positions it holds.
#[derive(Debug)]
pub struct SeqCache {
    pub(crate) layers: Vec<LayerKv>,
    len: usize,
    pub(crate) gpu: Option<super::gpu::kv::GpuSeqKv>,
}

impl Clone for SeqCache {
    fn clone(&self) -> Self {
        let gpu = self.gpu.clone();
        // A full GPU pool can leave the copy with fewer blocks: it then holds a shorter prefix.
        let len = match &gpu {
            Some(g) => self.len.min(g.blocks.len() * super::gpu::kv::BLOCK),
            None => self.len,
        };
        Self {
            layers: self.layers.clone(),
            len,
            gpu,
        }
    }
}

impl SeqCache {
    pub(crate) fn new(widths: &[(usize, usize)]) -> Self {
        Self {
            layers: widths
                .iter()
                .map(|&(a_width, b_width)| LayerKv {
                    a_width,
                    b_width,
                    ..Default::default()
                })
                .collect(),
            len: 0,
            gpu: None,
        }
    }

    pub(crate) fn new_gpu(kv: super::gpu::kv::GpuSeqKv) -> Self {
        Self {
            layers: vec![],
            len: 0,
            gpu: Some(kv),
        }
    }

    /// Positions cached so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keeps the first `n` positions (no-op if it holds fewer).
    pub fn truncate(&mut self, n: usize) {
        if n >= self.len {
            return;
        }
        if let Some(g) = &mut self.gpu {
            g.truncate(n);
        }
        for l in &mut self.layers {
            l.a.truncate(n * l.a_width);
            l.b.truncate(n * l.b_width);
        }
        self.len = n;
    }

    /// Bytes held (for KV usage metrics).
    pub fn bytes(&self) -> usize {
        if let Some(g) = &self.gpu {
            let pool = g.pool.lock().unwrap_or_else(|e| e.into_inner());
            return g.blocks.len()
                * super::gpu::kv::BLOCK
                * (pool.width + pool.v_width)
                * 4
                * pool.k.len();
        }
        self.layers
            .iter()
            .map(|l| (l.a.len() + l.b.len()) * 4)
            .sum()
    }

    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }
}
