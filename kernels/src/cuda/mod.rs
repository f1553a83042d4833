//! CUDA backend primitives: device discovery, the NVRTC-compiled kernels of `kernels.cu`, cuBLAS GEMMs,
//! and typed launch wrappers. CUDA libraries are opened at run time (cudarc dynamic loading), so this
//! compiles and the CPU path runs on machines without a GPU; [`GpuDevice::open`] says clearly why a GPU
//! cannot be used.
use cudarc::cublas::{sys as cublas_sys, CudaBlas};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
};
use half::bf16;
use std::sync::Arc;

pub use cudarc::driver::DriverError;

pub mod dense;
pub mod gemm_path;
pub mod graph;
mod grouped;
pub use gemm_path::{ExpertGemmPath, GemmUse};
pub mod hybrid;
pub mod hyper;
pub mod indexer;
pub mod kv_q8;
pub mod linear_attention;
pub mod ops;
pub mod quant;
pub mod routed;

/// `kernels.cu`, then `dense_quant.cu`, `handoff.cu`, `kv_q8.cu`, `grouped_gemm.cu` and `segment.cu`
/// (which use the helpers of those before them), one NVRTC module.
const SOURCE: &str = concat!(
    include_str!("common.cuh"),
    include_str!("kernels.cu"),
    include_str!("dense_quant.cu"),
    include_str!("handoff.cu"),
    include_str!("kv_q8.cu"),
    include_str!("grouped_gemm.cu"),
    include_str!("segment.cu")
);

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no usable CUDA driver: {0}")]
    NoDriver(String),
    #[error("GPU {name} has compute capability {major}.{minor}; supported: 8.9 (Ada), 9.0 (Hopper), 12.x (Blackwell)")]
    Unsupported {
        name: String,
        major: i32,
        minor: i32,
    },
    #[error("CUDA: {0}")]
    Driver(#[from] DriverError),
    #[error("NVRTC could not compile the kernels: {0}")]
    Compile(String),
    #[error("cuBLAS: {0}")]
    Blas(String),
    #[error("{0}")]
    Shape(String),
}

/// Compute capabilities the backend is built for.
pub fn supported_capability(major: i32, minor: i32) -> bool {
    matches!((major, minor), (8, 9) | (9, 0)) || major == 12
}

/// Loaded kernels, by name. Launched only through the typed ops of [`ops`] and [`dense`].
#[derive(Clone)]
pub(crate) struct Kernels {
    pub rms_norm: CudaFunction,
    pub qk_norm_rope: CudaFunction,
    pub kv_append: CudaFunction,
    pub mla_split_latent: CudaFunction,
    pub mla_attention: CudaFunction,
    pub paged_attention: CudaFunction,
    pub gated_mul: CudaFunction,
    pub add_inplace: CudaFunction,
    pub add_bias: CudaFunction,
    pub embed_rows: CudaFunction,
    pub gather_rows: CudaFunction,
    pub scatter_add_weighted: CudaFunction,
    pub sigmoid_gate_rows: CudaFunction,
    pub router_topk: CudaFunction,
    pub router_topk_serial: CudaFunction,
    pub f32_to_bf16: CudaFunction,
    pub gather_kv_bf16: CudaFunction,
    pub causal_softmax_rows: CudaFunction,
    pub unpack_experts: CudaFunction,
    pub gemv_w4a16: CudaFunction,
    pub gemv_w8a16: CudaFunction,
    pub dense_dequant_w4: CudaFunction,
    pub dense_dequant_w8: CudaFunction,
    pub handoff_publish: CudaFunction,
    pub handoff_wait_add: CudaFunction,
    pub kv_append_q8: CudaFunction,
    pub paged_attention_q8: CudaFunction,
    pub gather_kv_q8: CudaFunction,
    pub grouped_gemm_bf16: CudaFunction,
    pub gemv_bf16: CudaFunction,
    pub gemv_bf16_1: CudaFunction,
    pub gemv_bf16_2: CudaFunction,
    pub gemv_bf16_norm: CudaFunction,
    pub gemv_bf16_norm_1: CudaFunction,
    pub gemv_bf16_norm_2: CudaFunction,
    pub qk_norm_rope_append: CudaFunction,
    pub paged_attention_warps: CudaFunction,
    pub paged_attention_warps_q8: CudaFunction,
    pub router_gemv_topk: CudaFunction,
    pub l2_prefetch: CudaFunction,
}

/// The NVRTC architecture for a GPU of compute capability `(major, minor)`: `sm_89` (Ada), `sm_90`
/// (Hopper), `sm_120` (Blackwell and anything newer that [`supported_capability`] lets through).
pub fn nvrtc_arch((major, minor): (i32, i32)) -> &'static str {
    match (major, minor) {
        (8, 9) => "sm_89",
        (9, 0) => "sm_90",
        _ => "sm_120",
    }
}

/// Compiles `source` with NVRTC for a GPU of `capability` and loads it into `ctx`: the start-up
/// module and the modules loaded on demand (`hybrid`, `routed`) all come through here.
pub(crate) fn load_source(
    ctx: &Arc<CudaContext>,
    capability: (i32, i32),
    source: &str,
) -> Result<Arc<CudaModule>, GpuError> {
    let ptx = nvrtc_compile(source, nvrtc_arch(capability)).map_err(GpuError::Compile)?;
    Ok(ctx.load_module(ptx)?)
}

/// Compiles one CUDA C++17 source with NVRTC for `arch`.
pub(crate) fn nvrtc_compile(
    source: &str,
    arch: &'static str,
) -> Result<cudarc::nvrtc::Ptx, String> {
    cudarc::nvrtc::compile_ptx_with_opts(
        source,
        cudarc::nvrtc::CompileOptions {
            arch: Some(arch),
            options: vec!["--std=c++17".into()],
            ..Default::default()
        },
    )
    .map_err(|e| format!("{e:?}"))
}

/// One GPU: context, the engine's stream, cuBLAS and the kernels (the expert stream makes its own copy
/// stream).
pub struct GpuDevice {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub blas: CudaBlas,
    pub(crate) k: Kernels,
    pub name: String,
    pub capability: (i32, i32),
    /// How the expert GEMMs of each use are computed (measured on their first calls).
    pub(crate) expert_gemm: gemm_path::PathChooser,
    /// The fused long-prompt attention's modules, one per head dim, compiled on first use.
    pub(crate) flash: ops::flash_attention::FlashModules,
    /// Finished-block counter of `router_gemv_topk` (0 between its launches, which run one after the
    /// other on the engine stream).
    pub(crate) router_blocks_done: CudaSlice<u32>,
    /// Streaming multiprocessors (sizes the grids of launches that keep every block resident).
    pub sm_count: usize,
    /// Bytes of the L2 cache (bounds what `l2_prefetch` is asked to keep there).
    pub l2_bytes: usize,
}

/// One product of [`GpuDevice::gemm_bf16_items`]: `rows` bf16 activation rows at `x`, a bf16 weight at
/// `w`, f32 output rows at `y` (raw device addresses).
#[derive(Clone, Copy, Debug)]
pub struct GemmItem {
    pub x: u64,
    pub w: u64,
    pub y: u64,
    pub rows: usize,
}

impl GpuDevice {
    /// Opens GPU `ordinal`, checks its architecture, compiles the kernels for it (~150 ms).
    pub fn open(ordinal: usize) -> Result<Self, GpuError> {
        // SAFETY: only probes whether the shared libraries can be opened.
        let present = unsafe {
            cudarc::driver::sys::is_culib_present()
                && cudarc::nvrtc::sys::is_culib_present()
                && cublas_sys::is_culib_present()
        };
        if !present {
            return Err(GpuError::NoDriver(
                "libcuda, libnvrtc or libcublas not found (install the NVIDIA driver and CUDA 12/13 runtime libraries)".into(),
            ));
        }
        let count = CudaContext::device_count().map_err(|e| GpuError::NoDriver(e.to_string()))?;
        if ordinal as i32 >= count {
            return Err(GpuError::NoDriver(format!(
                "GPU {ordinal} requested, {count} visible"
            )));
        }
        let ctx = CudaContext::new(ordinal)?;
        let name = ctx.name()?;
        let (major, minor) = ctx.compute_capability()?;
        if !supported_capability(major, minor) {
            return Err(GpuError::Unsupported { name, major, minor });
        }
        let module = load_source(&ctx, (major, minor), SOURCE)?;
        let f = |n: &str| module.load_function(n);
        let k = Kernels {
            rms_norm: f("rms_norm")?,
            qk_norm_rope: f("qk_norm_rope")?,
            kv_append: f("kv_append")?,
            mla_split_latent: f("mla_split_latent")?,
            mla_attention: f("mla_attention")?,
            paged_attention: f("paged_attention")?,
            gated_mul: f("gated_mul")?,
            add_inplace: f("add_inplace")?,
            add_bias: f("add_bias")?,
            embed_rows: f("embed_rows")?,
            gather_rows: f("gather_rows")?,
            scatter_add_weighted: f("scatter_add_weighted")?,
            sigmoid_gate_rows: f("sigmoid_gate_rows")?,
            router_topk: f("router_topk")?,
            router_topk_serial: f("router_topk_serial")?,
            f32_to_bf16: f("f32_to_bf16")?,
            gather_kv_bf16: f("gather_kv_bf16")?,
            causal_softmax_rows: f("causal_softmax_rows")?,
            unpack_experts: f("unpack_experts")?,
            gemv_w4a16: f("gemv_w4a16")?,
            gemv_w8a16: f("gemv_w8a16")?,
            dense_dequant_w4: f("dense_dequant_w4")?,
            dense_dequant_w8: f("dense_dequant_w8")?,
            handoff_publish: f("handoff_publish")?,
            handoff_wait_add: f("handoff_wait_add")?,
            kv_append_q8: f("kv_append_q8")?,
            paged_attention_q8: f("paged_attention_q8")?,
            gather_kv_q8: f("gather_kv_q8")?,
            grouped_gemm_bf16: f("grouped_gemm_bf16")?,
            gemv_bf16: f("gemv_bf16")?,
            gemv_bf16_1: f("gemv_bf16_1")?,
            gemv_bf16_2: f("gemv_bf16_2")?,
            gemv_bf16_norm: f("gemv_bf16_norm")?,
            gemv_bf16_norm_1: f("gemv_bf16_norm_1")?,
            gemv_bf16_norm_2: f("gemv_bf16_norm_2")?,
            qk_norm_rope_append: f("qk_norm_rope_append")?,
            paged_attention_warps: f("paged_attention_warps")?,
            paged_attention_warps_q8: f("paged_attention_warps_q8")?,
            router_gemv_topk: f("router_gemv_topk")?,
            l2_prefetch: f("l2_prefetch")?,
        };
        // All work goes through one stream in order, so cudarc's per-argument event tracking (meant for
        // buffers shared across streams) is pure launch overhead here.
        // SAFETY: no buffer of this context is used on another stream.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| GpuError::Blas(e.to_string()))?;
        let router_blocks_done = stream.alloc_zeros::<u32>(1)?;
        use cudarc::driver::sys::CUdevice_attribute as A;
        let sm_count = ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            .max(1) as usize;
        let l2_bytes = ctx.attribute(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?.max(0) as usize;
        let dev = Self {
            ctx,
            stream,
            blas,
            k,
            name,
            capability: (major, minor),
            expert_gemm: gemm_path::PathChooser::from_env(),
            flash: Default::default(),
            router_blocks_done,
            sm_count,
            l2_bytes,
        };
        dev.keep_pool_memory()?;
        Ok(dev)
    }

    /// Another handle on this device whose launches, copies and GEMMs go to a stream of its own (the
    /// same compiled kernels, its own cuBLAS handle): work beside the engine stream, ordered against
    /// it by events only (the decode split's GPU share of a layer's DRAM experts).
    pub fn fork(&self) -> Result<GpuDevice, GpuError> {
        let stream = self.ctx.new_stream()?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| GpuError::Blas(e.to_string()))?;
        let router_blocks_done = stream.alloc_zeros::<u32>(1)?;
        Ok(GpuDevice {
            ctx: self.ctx.clone(),
            stream,
            blas,
            k: self.k.clone(),
            name: self.name.clone(),
            capability: self.capability,
            expert_gemm: gemm_path::PathChooser::from_env(),
            flash: Default::default(),
            router_blocks_done,
            sm_count: self.sm_count,
            l2_bytes: self.l2_bytes,
        })
    }

    /// Free and total device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize), GpuError> {
        Ok(self.ctx.mem_get_info()?)
    }

    /// Bytes of this process's stream-ordered allocations on the device (cudarc allocates every
    /// buffer from the device's default memory pool when the driver supports it): in use now and
    /// the most in use since the start (or the last [`GpuDevice::reset_pool_peak`]). `None` when the
    /// driver has no memory pools (then allocations are synchronous and not counted here).
    pub fn pool_usage(&self) -> Result<Option<(u64, u64)>, GpuError> {
        use cudarc::driver::sys::{self, CUmemPool_attribute as A};
        let Some(pool) = self.default_pool()? else {
            return Ok(None);
        };
        let read = |attr: A| -> Result<u64, GpuError> {
            let mut v = 0u64;
            // SAFETY: `pool` is the device's default pool; the attribute is a u64 (cuuint64_t).
            unsafe { sys::cuMemPoolGetAttribute(pool, attr, (&mut v) as *mut u64 as *mut _) }
                .result()?;
            Ok(v)
        };
        Ok(Some((
            read(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            read(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
        )))
    }

    /// Lets the default memory pool keep what it grew to instead of returning it to the driver at
    /// every synchronisation (the pool's release threshold is 0 by default, so a long prompt's
    /// scratch would be unmapped after each step and mapped again, page by page, by the next). The
    /// memory plan budgets the peak a step may use, which is what the pool then holds.
    pub fn keep_pool_memory(&self) -> Result<(), GpuError> {
        use cudarc::driver::sys::{self, CUmemPool_attribute as A};
        if let Some(pool) = self.default_pool()? {
            let mut keep = u64::MAX;
            // SAFETY: `pool` is the device's default pool; the release threshold is a u64.
            unsafe {
                sys::cuMemPoolSetAttribute(
                    pool,
                    A::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    (&mut keep) as *mut u64 as *mut _,
                )
            }
            .result()?;
        }
        Ok(())
    }

    /// Restarts the high-water mark of [`GpuDevice::pool_usage`] at the current use.
    pub fn reset_pool_peak(&self) -> Result<(), GpuError> {
        use cudarc::driver::sys::{self, CUmemPool_attribute as A};
        if let Some(pool) = self.default_pool()? {
            let mut zero = 0u64;
            // SAFETY: as above; resetting the high-water mark takes the value 0.
            unsafe {
                sys::cuMemPoolSetAttribute(
                    pool,
                    A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                    (&mut zero) as *mut u64 as *mut _,
                )
            }
            .result()?;
        }
        Ok(())
    }

    fn default_pool(&self) -> Result<Option<cudarc::driver::sys::CUmemoryPool>, GpuError> {
        use cudarc::driver::sys;
        self.ctx.bind_to_thread()?;
        let mut pool = std::ptr::null_mut();
        // SAFETY: writes the device's default pool handle into `pool`.
        let r = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device()) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Ok(None);
        }
        Ok(Some(pool))
    }

    /// `y[n, m] (=|+=) x[n, k] · w[m, k]ᵀ`: bf16 inputs, f32 output and accumulation (cuBLAS GemmEx).
    pub fn gemm_bf16(
        &self,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<f32>,
        n: usize,
        m: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<(), GpuError> {
        self.gemm_ex(
            x,
            w,
            y,
            n,
            m,
            k,
            accumulate,
            cudarc::cublas::sys::cudaDataType_t::CUDA_R_16BF,
        )
    }

    /// Same contract in f32 (routers).
    pub fn gemm_f32(
        &self,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<f32>,
        y: &mut impl DevicePtrMut<f32>,
        n: usize,
        m: usize,
        k: usize,
    ) -> Result<(), GpuError> {
        self.gemm_ex(
            x,
            w,
            y,
            n,
            m,
            k,
            false,
            cudarc::cublas::sys::cudaDataType_t::CUDA_R_32F,
        )
    }

    fn gemm_ex<T>(
        &self,
        x: &impl DevicePtr<T>,
        w: &impl DevicePtr<T>,
        y: &mut impl DevicePtrMut<f32>,
        n: usize,
        m: usize,
        k: usize,
        accumulate: bool,
        in_type: cublas_sys::cudaDataType_t,
    ) -> Result<(), GpuError> {
        self.gemm_ex_into_columns(x, w, y, (n, m, k), (0, m), accumulate, in_type)
    }

    /// `y[:, c0..c0+m] (=|+=) x[n, k] · w[m, k]ᵀ` where y is row-major `[n, ld]`, inputs of
    /// `in_type`, f32 output and accumulation. The caller guarantees x holds n·k, w m·k and y n·ld
    /// elements, with c0 + m ≤ ld.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm_ex_into_columns<T>(
        &self,
        x: &impl DevicePtr<T>,
        w: &impl DevicePtr<T>,
        y: &mut impl DevicePtrMut<f32>,
        (n, m, k): (usize, usize, usize),
        (c0, ld): (usize, usize),
        accumulate: bool,
        in_type: cublas_sys::cudaDataType_t,
    ) -> Result<(), GpuError> {
        // Row-major y[n,m] = x[n,k]·wᵀ is column-major yᵀ[m,n] = op(W)[m,k] · xᵀ[k,n] with W read transposed.
        let alpha = 1.0f32;
        let beta = if accumulate { 1.0f32 } else { 0.0 };
        let (xp, _rx) = x.device_ptr(&self.stream);
        let (wp, _rw) = w.device_ptr(&self.stream);
        let (yp, _ry) = y.device_ptr_mut(&self.stream);
        let yp = yp + (c0 * std::mem::size_of::<f32>()) as u64;
        // SAFETY: the caller guarantees x holds n·k and w m·k elements, y n·ld with c0 + m ≤ ld, so
        // the column-major view yᵀ (m × n, leading dimension ld) starting at column c0 stays inside
        // y; the pointers stay valid (and their stream dependencies recorded) for the call through
        // the _r guards.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                cublas_sys::cublasOperation_t::CUBLAS_OP_T,
                cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                (&alpha) as *const f32 as *const _,
                wp as *const _,
                in_type,
                k as i32,
                xp as *const _,
                in_type,
                k as i32,
                (&beta) as *const f32 as *const _,
                yp as *mut _,
                cublas_sys::cudaDataType_t::CUDA_R_32F,
                ld as i32,
                cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| GpuError::Blas(e.to_string()))
    }

    /// The raw device address of a buffer (event tracking is off: nothing to synchronise on).
    pub fn addr<T>(&self, x: &impl DevicePtr<T>) -> u64 {
        x.device_ptr(&self.stream).0
    }

    /// cuBLAS strided-batched GEMM in cuBLAS's column-major terms, bf16 inputs, f32 accumulation:
    /// `C_b = alpha · op(A_b) · op(B_b)` (C is m × n), `X_b = X + b · stride_x` elements, for
    /// b in 0..batch. C is bf16 when `c_bf16`, else f32. Used for long-prefill attention, where the
    /// operands are views into larger buffers (a head's columns of the Q/K/V rows).
    ///
    /// # Safety
    /// The addresses (from [`GpuDevice::addr`], possibly offset in bytes) must cover every element the
    /// strides and leading dimensions reach, and stay allocated until the stream has run the GEMM.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_bf16_batched_raw(
        &self,
        trans_a: bool,
        trans_b: bool,
        (m, n, k): (usize, usize, usize),
        alpha: f32,
        (a, lda, stride_a): (u64, usize, usize),
        (b, ldb, stride_b): (u64, usize, usize),
        (c, ldc, stride_c): (u64, usize, usize),
        batch: usize,
        c_bf16: bool,
    ) -> Result<(), GpuError> {
        use cublas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        use cublas_sys::cudaDataType_t::{CUDA_R_16BF, CUDA_R_32F};
        let beta = 0.0f32;
        let op = |t: bool| if t { CUBLAS_OP_T } else { CUBLAS_OP_N };
        // SAFETY: the caller's contract above.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *self.blas.handle(),
                op(trans_a),
                op(trans_b),
                m as i32,
                n as i32,
                k as i32,
                (&alpha) as *const f32 as *const _,
                a as *const _,
                CUDA_R_16BF,
                lda as i32,
                stride_a as i64,
                b as *const _,
                CUDA_R_16BF,
                ldb as i32,
                stride_b as i64,
                (&beta) as *const f32 as *const _,
                c as *mut _,
                if c_bf16 { CUDA_R_16BF } else { CUDA_R_32F },
                ldc as i32,
                stride_c as i64,
                batch as i32,
                cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| GpuError::Blas(e.to_string()))
    }

    /// `y_i[rows_i, m] = x_i[rows_i, k] · w_iᵀ` for every item (bf16 in, f32 out and accumulation), as
    /// one grouped launch for all items or one cuBLAS batched call per distinct row count (not one
    /// GEMM per item), the path [`gemm_path`] gives this use. For MoE experts on the GPU: at batch-1
    /// decode every chosen expert sees one row, so a layer's gate/up (or down) projections of all its
    /// experts are one batched launch; in a long prompt every expert has its own row count and the
    /// grouped launch replaces one batched call per expert. Costs one small upload of the pointer
    /// table into `table` (the caller's device buffer, at least [`table_len`] entries: reused call
    /// after call, since each upload is ordered after the previous call's GEMMs on the stream).
    ///
    /// # Safety
    /// Each item's addresses (from [`GpuDevice::addr`], possibly offset in bytes) must cover
    /// `rows·k`, `m·k` and `rows·m` elements and stay allocated until the stream has run the GEMMs.
    pub unsafe fn gemm_bf16_items(
        &self,
        items: &[GemmItem],
        m: usize,
        k: usize,
        table: &mut CudaSlice<u64>,
    ) -> Result<ExpertGemmPath, GpuError> {
        let path = self.expert_gemm.path(items_use(items, m, k));
        // SAFETY: the caller's contract.
        unsafe { self.gemm_bf16_items_via(items, m, k, table, path) }
    }

    /// The expert GEMMs' uses so far: calls per use and path, and the path `MOE_GROUPED_GEMM` forces.
    pub fn expert_gemm_uses(&self) -> (Vec<gemm_path::UseCount>, Option<ExpertGemmPath>) {
        (self.expert_gemm.uses(), self.expert_gemm.forced())
    }

    /// [`GpuDevice::gemm_bf16_items`] on `path` chosen by the caller (counted in the uses).
    ///
    /// # Safety
    /// As [`GpuDevice::gemm_bf16_items`].
    pub unsafe fn gemm_bf16_items_on(
        &self,
        items: &[GemmItem],
        m: usize,
        k: usize,
        table: &mut CudaSlice<u64>,
        path: ExpertGemmPath,
    ) -> Result<ExpertGemmPath, GpuError> {
        self.expert_gemm.count(items_use(items, m, k), path);
        // SAFETY: the caller's contract.
        unsafe { self.gemm_bf16_items_via(items, m, k, table, path) }
    }

    /// The path `MOE_GROUPED_GEMM` forces for every expert GEMM, if it does.
    pub fn expert_gemm_forced(&self) -> Option<ExpertGemmPath> {
        self.expert_gemm.forced()
    }

    /// [`GpuDevice::gemm_bf16_items`] on the path given; the grouped launch falls back to the batched
    /// calls for shapes it does not take (k not a multiple of 8, odd m, addresses not 16-byte
    /// aligned). Returns the path that ran.
    ///
    /// # Safety
    /// As [`GpuDevice::gemm_bf16_items`].
    pub unsafe fn gemm_bf16_items_via(
        &self,
        items: &[GemmItem],
        m: usize,
        k: usize,
        table: &mut CudaSlice<u64>,
        path: ExpertGemmPath,
    ) -> Result<ExpertGemmPath, GpuError> {
        use cublas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        use cublas_sys::cudaDataType_t::{CUDA_R_16BF, CUDA_R_32F};
        let mut order: Vec<usize> = (0..items.len()).filter(|&i| items[i].rows > 0).collect();
        if order.is_empty() {
            return Ok(ExpertGemmPath::Batched);
        }
        order.sort_by_key(|&i| items[i].rows);
        if path == ExpertGemmPath::Grouped && grouped::takes(items, &order, m, k) {
            // SAFETY: the caller's contract; `takes` checked the kernel's shape and alignment needs.
            unsafe { self.gemm_bf16_grouped(items, &order, (m, k), table) }?;
            return Ok(ExpertGemmPath::Grouped);
        }
        let n = order.len();
        // Device pointer table: all weights, then all inputs, then all outputs, each in `order`.
        let host_table: Vec<u64> = [|g: &GemmItem| g.w, |g: &GemmItem| g.x, |g: &GemmItem| g.y]
            .iter()
            .flat_map(|field| order.iter().map(|&i| field(&items[i])))
            .collect();
        let base = self.output("gemm_bf16_items", "table", table, host_table.len())?;
        // from pageable memory: the driver stages the bytes before returning, so `host_table` may go
        self.stream
            .memcpy_htod(&host_table, &mut table.slice_mut(..host_table.len()))?;
        let at = |part: usize, j: usize| base + 8 * (part * n + j) as u64;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let mut start = 0;
        while start < n {
            let rows = items[order[start]].rows;
            let count = order[start..]
                .iter()
                .take_while(|&&i| items[i].rows == rows)
                .count();
            // Row-major y[rows,m] = x·wᵀ is column-major yᵀ[m,rows] = op(W)[m,k]·xᵀ, as in `gemm_ex`.
            // SAFETY: the table (checked to hold 3·n entries) is the caller's, alive for the step;
            // the caller guarantees every address it holds.
            unsafe {
                cublas_sys::cublasGemmBatchedEx(
                    *self.blas.handle(),
                    CUBLAS_OP_T,
                    CUBLAS_OP_N,
                    m as i32,
                    rows as i32,
                    k as i32,
                    (&alpha) as *const f32 as *const _,
                    at(0, start) as *const *const _,
                    CUDA_R_16BF,
                    k as i32,
                    at(1, start) as *const *const _,
                    CUDA_R_16BF,
                    k as i32,
                    (&beta) as *const f32 as *const _,
                    at(2, start) as *const *mut _,
                    CUDA_R_32F,
                    m as i32,
                    count as i32,
                    cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .result()
            .map_err(|e| GpuError::Blas(e.to_string()))?;
            start += count;
        }
        Ok(ExpertGemmPath::Batched)
    }
}

/// Entries of the table `gemm_bf16_items` needs for up to `items` items of `rows` rows in all.
pub fn table_len(items: usize, rows: usize) -> usize {
    grouped::table_len(items, rows)
}

/// The use an expert GEMM call makes: its shape and the sorted row counts of its non-empty items.
fn items_use(items: &[GemmItem], m: usize, k: usize) -> GemmUse {
    let mut rows: Vec<usize> = items.iter().map(|g| g.rows).filter(|&r| r > 0).collect();
    rows.sort_unstable();
    GemmUse::of(m, k, rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capability_filter() {
        assert!(supported_capability(8, 9));
        assert!(supported_capability(9, 0));
        assert!(supported_capability(12, 0));
        assert!(!supported_capability(8, 6));
        assert!(!supported_capability(8, 0));
    }

    /// NVRTC compiles the kernels for every supported architecture. Needs libnvrtc (the build machine
    /// has no GPU but CI installs the `nvidia-cuda-nvrtc` wheel and sets `MOE_REQUIRE_NVRTC=1`, so a
    /// kernel source that does not compile fails CI rather than the first start on a GPU).
    #[test]
    fn kernels_compile_with_nvrtc_for_every_supported_arch() {
        // SAFETY: only probes whether the shared library can be opened.
        let present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
        if !present {
            assert!(
                std::env::var_os("MOE_REQUIRE_NVRTC").is_none(),
                "MOE_REQUIRE_NVRTC is set but libnvrtc cannot be loaded (LD_LIBRARY_PATH?)"
            );
            eprintln!("libnvrtc not found: NVRTC compile check skipped");
            return;
        }
        // every module for the architecture of each supported capability: the start-up module, the
        // hybrid-attention module and the device-routed experts' module (both loaded on demand)
        let flash = ops::flash_attention::source(128);
        let modules: [(&str, &str, &[&str]); 4] = [
            ("kernels.cu", SOURCE, &STARTUP_ENTRIES_CHECKED),
            ("hybrid.cu", hybrid::SOURCE, &hybrid::ENTRIES),
            ("routed.cu", routed::SOURCE, &routed::ENTRIES),
            (
                "flash_attention.cu d128",
                &flash,
                &ops::flash_attention::ENTRIES,
            ),
        ];
        // the other head dims' flash modules, for one architecture (each module takes seconds)
        for dh in ops::FLASH_HEAD_DIMS.into_iter().filter(|&d| d != 128) {
            let src = nvrtc_compile(&ops::flash_attention::source(dh), "sm_90")
                .unwrap_or_else(|e| panic!("flash_attention.cu d{dh}: {e}"))
                .to_src();
            for entry in ops::flash_attention::ENTRIES {
                assert!(src.contains(&format!(".entry {entry}")), "d{dh}: {entry}");
            }
        }
        for capability in [(8, 9), (9, 0), (12, 0)] {
            let arch = nvrtc_arch(capability);
            for (file, source, entries) in modules {
                let src = nvrtc_compile(source, arch)
                    .unwrap_or_else(|e| panic!("{file} {arch}: {e}"))
                    .to_src();
                for entry in entries {
                    assert!(
                        src.contains(&format!(".entry {entry}")),
                        "{file} {arch}: {entry}"
                    );
                }
            }
        }
    }

    /// Entries of the start-up module that the NVRTC check looks for in its PTX.
    const STARTUP_ENTRIES_CHECKED: [&str; 22] = [
        "gated_mul",
        "paged_attention",
        "gemv_w4a16",
        "gemv_w8a16",
        "dense_dequant_w4",
        "handoff_publish",
        "handoff_wait_add",
        "kv_append_q8",
        "paged_attention_q8",
        "gather_kv_q8",
        "grouped_gemm_bf16",
        "gemv_bf16",
        "gemv_bf16_1",
        "gemv_bf16_2",
        "gemv_bf16_norm",
        "gemv_bf16_norm_1",
        "gemv_bf16_norm_2",
        "qk_norm_rope_append",
        "paged_attention_warps",
        "paged_attention_warps_q8",
        "router_gemv_topk",
        "l2_prefetch",
    ];

    #[test]
    fn arch_of_each_capability() {
        assert_eq!(nvrtc_arch((8, 9)), "sm_89");
        assert_eq!(nvrtc_arch((9, 0)), "sm_90");
        assert_eq!(nvrtc_arch((12, 0)), "sm_120");
        assert_eq!(nvrtc_arch((12, 1)), "sm_120");
    }

    #[test]
    fn kernel_source_declares_every_loaded_function() {
        for name in [
            "rms_norm",
            "qk_norm_rope",
            "kv_append",
            "mla_split_latent",
            "mla_attention",
            "paged_attention",
            "gated_mul",
            "add_inplace",
            "add_bias",
            "embed_rows",
            "gather_rows",
            "scatter_add_weighted",
            "sigmoid_gate_rows",
            "router_topk",
            "router_topk_serial",
            "f32_to_bf16",
            "gather_kv_bf16",
            "causal_softmax_rows",
            "unpack_experts",
            "gemv_w4a16",
            "gemv_w8a16",
            "dense_dequant_w4",
            "dense_dequant_w8",
            "handoff_publish",
            "handoff_wait_add",
            "kv_append_q8",
            "paged_attention_q8",
            "gather_kv_q8",
            "grouped_gemm_bf16",
            "gemv_bf16",
            "gemv_bf16_1",
            "gemv_bf16_2",
            "gemv_bf16_norm",
            "gemv_bf16_norm_1",
            "gemv_bf16_norm_2",
            "qk_norm_rope_append",
            "paged_attention_warps",
            "paged_attention_warps_q8",
            "router_gemv_topk",
            "l2_prefetch",
        ] {
            // (a kernel's declaration line, launch bounds allowed between `__global__` and `void`)
            let declared = SOURCE
                .lines()
                .any(|l| l.contains("__global__") && l.contains(&format!(" void {name}(")));
            assert!(declared, "{name} missing from kernels.cu");
        }
    }
}
