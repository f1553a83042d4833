//! The host's decode-step switches (`engine::gpu::switches`): the capture walk's mark, the head
//! enqueued with a prelaunched last layer and the all-DRAM layers' CPU half from the routing as it
//! landed change when and how the host does its work, never what the GPU or the CPU experts compute,
//! so the logits stay bit for bit those of the switches off; and the mark does skip the walk. So do
//! the CPU expert pool's switches (which thread runs an item).
use super::common::gpu::gpu;
use super::common::{fixtures_root, step};
use moe_daemon::engine::gpu::switches::DecodeSwitch;
use moe_daemon::engine::placement::PlacementStrategy;
use moe_daemon::engine::sampling::argmax;
use moe_daemon::engine::{Engine, EngineOptions, SeqInput};

const STEPS: usize = 12;

/// A prompt then `STEPS` decode steps of `tokens` (teacher-forced when given, else greedy): the
/// decode steps' logits, the tokens fed, and which steps walked the layers for missing graphs.
fn decode(e: &Engine, forced: Option<&[u32]>) -> (Vec<Vec<f32>>, Vec<u32>, Vec<u64>) {
    let mut cache = e.new_cache();
    let mut next = argmax(&step(e, &mut cache, &[1, 2, 3, 4, 5])) as u32;
    let (mut logits, mut fed, mut walks) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..STEPS {
        let tok = forced.map_or(next, |f| f[i]);
        fed.push(tok);
        let out = e
            .reserve_and_forward(&mut [SeqInput {
                cache: &mut cache,
                tokens: &[tok],
            }])
            .unwrap()
            .remove(0);
        walks.push(e.last_step_times().host.walks);
        next = argmax(&out) as u32;
        logits.push(out);
    }
    (logits, fed, walks)
}

/// Every expert in DRAM, CUDA graphs on: pipelined decode steps whose MoE layers are all prelaunched
/// (the path the switches act on). Walk mark on: at most the first decode step walks (it captures;
/// a warm-up may have walked before), the others skip the walk; off: every step walks. All three
/// switches on, then off: the same logits bit for bit.
#[test]
fn host_switches_keep_the_logits_and_the_mark_skips_the_walk() {
    for name in ["qwen3_moe", "glm4_moe"] {
        let dir = fixtures_root().join(name).join("model_bf16");
        let e = Engine::load(
            &dir,
            &EngineOptions {
                cuda_graphs: true,
                ..gpu(0, PlacementStrategy::Uniform)
            },
        )
        .unwrap();
        assert_eq!(e.decode_switch(DecodeSwitch::WalkMark), Some(true));
        assert_eq!(e.decode_switch(DecodeSwitch::EarlyHead), Some(true));
        assert_eq!(e.decode_switch(DecodeSwitch::DirectHalf), Some(true));
        let (on, fed, walks_on) = decode(&e, None);
        assert!(
            walks_on[0] <= 1 && walks_on[1..].iter().all(|&w| w == 0),
            "{name}: the mark skips the walk after the first decode step: {walks_on:?}"
        );
        for s in [
            DecodeSwitch::WalkMark,
            DecodeSwitch::EarlyHead,
            DecodeSwitch::DirectHalf,
        ] {
            assert!(e.set_decode_switch(s, false));
        }
        let (off, _, walks_off) = decode(&e, Some(&fed));
        assert_eq!(
            walks_off,
            vec![1; STEPS],
            "{name}: without the mark every step walks"
        );
        for (i, (a, b)) in on.iter().zip(&off).enumerate() {
            assert!(a == b, "{name} decode step {i}: switches on and off differ");
        }
        println!(
            "{name}: {STEPS} decode steps, walks {walks_on:?} with the mark, {} without; logits identical with the switches off",
            walks_off.iter().sum::<u64>()
        );
    }
}

/// The CPU expert pool's switches (`caller-works` off: the engine thread takes no expert items;
/// `spare-core` on: one worker kept asleep) change which thread runs an item, never what the items
/// compute or the order their sums are added in: the logits stay bit for bit those of the defaults.
#[test]
fn pool_switches_keep_the_logits() {
    let dir = fixtures_root().join("qwen3_moe").join("model_bf16");
    let e = Engine::load(
        &dir,
        &EngineOptions {
            cuda_graphs: true,
            cpu_threads: 4,
            ..gpu(0, PlacementStrategy::Uniform)
        },
    )
    .unwrap();
    assert_eq!(e.decode_switch(DecodeSwitch::CallerWorks), Some(true));
    assert_eq!(e.decode_switch(DecodeSwitch::SpareCore), Some(false));
    let (base, fed, _) = decode(&e, None);
    for (s, on) in [
        (DecodeSwitch::CallerWorks, false),
        (DecodeSwitch::SpareCore, true),
    ] {
        assert!(e.set_decode_switch(s, on), "{s}");
        assert_eq!(e.decode_switch(s), Some(on));
        let (got, _, _) = decode(&e, Some(&fed));
        assert!(e.set_decode_switch(s, !on));
        for (i, (a, b)) in base.iter().zip(&got).enumerate() {
            assert!(
                a == b,
                "{s} {on}: decode step {i} differs from the defaults"
            );
        }
    }
}
