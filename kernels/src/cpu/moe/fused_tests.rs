//! The fused decode path: its plan covers every tile once in a deadlock-free order, and its results
//! equal the split path's within the f32 summation order of the down parts, deterministically, on one
//! and on several NUMA groups.

use std::time::Duration;

use super::fused::{
    plan_group, DownItems, GroupShape, Item, Targets, MIN_ITEMS_PER_THREAD, STREAM_BYTES, TARGETS,
};
use super::*;
use crate::cpu::pool::WorkerPool;

/// Checks the invariants every plan must hold; returns (gate/up items, down items).
fn check_plan(shape: GroupShape, t: Targets, how: DownItems) -> (usize, usize) {
    let members: Vec<u32> = (0..shape.experts as u32).map(|e| 3 * e + 1).collect();
    let plan = plan_group(shape, &members, t, how);
    let mut gate = vec![0u32; shape.experts * shape.gate_tiles];
    let mut down = vec![0u32; shape.experts * shape.down_tiles];
    let mut seen_down = false;
    let (mut n_gate, mut n_down) = (0, 0);
    let mut parts_of_tile = vec![0usize; shape.down_tiles];
    for item in &plan.items {
        match *item {
            Item::GateUp { ai, nt0, nts } => {
                assert!(
                    !seen_down,
                    "a gate/up item after a down item could deadlock"
                );
                let k = members.iter().position(|&m| m == ai).expect("a member");
                assert!(nts >= 1);
                for nt in nt0..nt0 + nts {
                    gate[k * shape.gate_tiles + nt as usize] += 1;
                }
                n_gate += 1;
            }
            Item::Down {
                part,
                nt0,
                nts,
                e0,
                e1,
            } => {
                seen_down = true;
                assert!(e0 < e1 && (e1 as usize) <= shape.experts && nts >= 1);
                assert!((part as usize) < plan.parts);
                for nt in nt0..nt0 + nts {
                    parts_of_tile[nt as usize] += 1;
                }
                for e in e0..e1 {
                    for nt in nt0..nt0 + nts {
                        down[e as usize * shape.down_tiles + nt as usize] += 1;
                    }
                }
                n_down += 1;
            }
        }
    }
    assert!(gate.iter().all(|&c| c == 1), "every gate/up tile once");
    assert!(
        down.iter().all(|&c| c == 1),
        "every down tile of every expert once"
    );
    if shape.experts > 0 {
        assert!(
            parts_of_tile.iter().all(|&p| p == plan.parts),
            "every down N-tile in each part once"
        );
    }
    let per_expert: Vec<u32> = members
        .iter()
        .map(|&m| {
            plan.items
                .iter()
                .filter(|i| matches!(i, Item::GateUp { ai, .. } if *ai == m))
                .count() as u32
        })
        .collect();
    assert_eq!(plan.gate_up_items, per_expert);
    (n_gate, n_down)
}

/// The item sizes before part 3 (`chained:gu256:dn192`).
const BEFORE: Targets = Targets {
    gate_up: 256 << 10,
    down: 192 << 10,
};

fn shape(experts: usize, hidden: usize, inter: usize, bytes_per_weight: usize) -> GroupShape {
    GroupShape {
        experts,
        gate_tiles: inter / 16,
        gate_tile_bytes: 16 * hidden * bytes_per_weight,
        down_tiles: hidden / 16,
        down_tile_bytes: 16 * inter * bytes_per_weight,
        threads: 16,
        min_items: MIN_ITEMS_PER_THREAD,
    }
}

#[test]
fn plans_cover_every_tile_once_gate_up_first() {
    for experts in [0, 1, 6, 8, 27, 50, 128] {
        for (h, i) in [(2048, 768), (2560, 768), (4096, 2048), (64, 48)] {
            for bpw in [1, 2] {
                for how in [DownItems::AcrossExperts, DownItems::Streams(STREAM_BYTES)] {
                    check_plan(shape(experts, h, i, bpw), TARGETS, how);
                    let tiny = Targets {
                        gate_up: 1,
                        down: 1,
                    };
                    check_plan(shape(experts, h, i, bpw), tiny, how);
                }
            }
        }
    }
}

/// The item counts behind the decode figures: a few hundred KiB per item, at least 4 per thread.
#[test]
fn decode_shapes_get_items_of_a_few_hundred_kib() {
    // Qwen3-30B-A3B, one token, bf16: gate/up items of 4 N-tiles (2 × 4 × 64 KiB; 96 items, the
    // count floor of 4 per thread decides), down items of 2 N-tiles over the first 6 experts
    // (6 × 2 × 24 KiB), then the last 2 experts' (their gate/up items are among the last 16).
    let qwen = shape(8, 2048, 768, 2);
    let members: Vec<u32> = (0..8).collect();
    let across = DownItems::AcrossExperts;
    let p = plan_group(qwen, &members, TARGETS, across);
    assert_eq!(check_plan(qwen, TARGETS, across), (8 * 12, 2 * 64));
    assert_eq!(p.parts, 2);
    assert_eq!(
        p.items.last(),
        Some(&Item::Down {
            part: 1,
            nt0: 126,
            nts: 2,
            e0: 6,
            e1: 8
        })
    );
    // int8: 6 N-tiles per gate/up item (8 per expert), 2 per down item
    let int8 = shape(8, 2048, 768, 1);
    assert_eq!(check_plan(int8, TARGETS, across), (8 * 8, 2 * 64));
    let p = plan_group(int8, &members, TARGETS, across);
    assert!(matches!(
        p.items.last(),
        Some(&Item::Down { e0: 6, e1: 8, .. })
    ));
    // SmallThinker-21B, one token (6 of 64), bf16: an N-tile of gate plus up is 160 KiB, 3 per item
    assert_eq!(
        check_plan(shape(6, 2560, 768, 2), TARGETS, across),
        (6 * 16, 2 * 80)
    );
    // the sizes before (256 / 192 KiB), for the A/B: one N-tile per item at SmallThinker
    assert_eq!(
        check_plan(shape(6, 2560, 768, 2), BEFORE, across),
        (6 * 48, 2 * 160)
    );
    // 8 tokens × top-8 (~50 distinct experts): down chunks of one N-tile in parts of 13 experts
    let many = shape(50, 2048, 768, 2);
    let p = plan_group(many, &(0..50).collect::<Vec<_>>(), TARGETS, across);
    assert_eq!(p.parts, 4);
    assert_eq!(check_plan(many, TARGETS, across).1, 128 * 4);
    // one expert: nothing to split
    let p = plan_group(shape(1, 2048, 768, 2), &[0], TARGETS, across);
    assert_eq!(p.parts, 1);
}

/// The streams plan at the decode shapes (with the item sizes it was timed with, PERF.md part 2):
/// down items of 2 experts × 96 KiB each, the last part's (the experts whose gate/up end last) one
/// N-tile at a time.
#[test]
fn streams_plan_reads_96_kib_per_expert() {
    let streams = DownItems::Streams(STREAM_BYTES);
    let members: Vec<u32> = (0..8).collect();
    // Qwen3-30B-A3B, one token, bf16: 4 N-tiles of 24 KiB per expert, 2 experts per part
    let qwen = shape(8, 2048, 768, 2);
    assert_eq!(check_plan(qwen, BEFORE, streams), (8 * 24, 3 * 32 + 128));
    let p = plan_group(qwen, &members, BEFORE, streams);
    assert_eq!(p.parts, 4);
    let first_down = p.items[8 * 24];
    assert_eq!(
        first_down,
        Item::Down {
            part: 0,
            nt0: 0,
            nts: 4,
            e0: 0,
            e1: 2
        }
    );
    assert!(matches!(
        p.items.last(),
        Some(&Item::Down {
            part: 3,
            nt0: 127,
            nts: 1,
            e0: 6,
            e1: 8
        })
    ));
    // int8: 8 N-tiles of 12 KiB
    let int8 = shape(8, 2048, 768, 1);
    assert_eq!(check_plan(int8, BEFORE, streams).1, 3 * 16 + 128);
    // SmallThinker-21B, one token (6 of 64), bf16
    assert_eq!(
        check_plan(shape(6, 2560, 768, 2), BEFORE, streams).1,
        2 * 40 + 160
    );
    // few N-tiles: the runs shrink until every thread gets 4 items
    let narrow = shape(2, 512, 768, 2);
    let (_, down) = check_plan(narrow, BEFORE, streams);
    assert!(down >= 32, "{down}");
}

struct Experts {
    ids: Vec<u32>,
    w: Vec<[Vec<u16>; 3]>,
}

impl Experts {
    fn new(n: u32, h: usize, i: usize, seed: u32) -> Experts {
        let mut s = seed;
        let mut bits = |len: usize| -> Vec<u16> {
            (0..len)
                .map(|_| {
                    s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    0x3c00 | ((s >> 16) as u16 & 0x807f) // ±[0.0078, 0.0156) in bf16
                })
                .collect()
        };
        let w = (0..n)
            .map(|_| [bits(i * h), bits(i * h), bits(h * i)])
            .collect();
        Experts {
            ids: (0..n).collect(),
            w,
        }
    }

    fn set(&self, cfg: &ExpertSetConfig, pool: &WorkerPool) -> CpuExpertSet {
        let src: Vec<ExpertSource<'_>> = self
            .w
            .iter()
            .map(|m| ExpertSource {
                gate: SourceTensor::Bf16(&m[0]),
                up: SourceTensor::Bf16(&m[1]),
                down: SourceTensor::Bf16(&m[2]),
            })
            .collect();
        CpuExpertSet::new(cfg, &self.ids, &src, pool).unwrap()
    }
}

/// Routing of `t` tokens to `k` distinct experts of `n` each, some ids not held (negative weight
/// rows would be a GPU's share: ids ≥ n).
fn routing(t: usize, k: usize, n: u32, h: usize, call: usize) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
    let x: Vec<f32> = (0..t * h)
        .map(|j| ((j * 7 + call * 13) % 23) as f32 / 11.0 - 1.0)
        .collect();
    let mut ids = Vec::new();
    for tk in 0..t {
        for j in 0..k {
            ids.push(((tk * 5 + j * 3 + call) % (n as usize + 2)) as u32);
        }
    }
    let wts = (0..t * k).map(|j| 0.2 + (j % 5) as f32 * 0.15).collect();
    (x, ids, wts)
}

fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

fn fused_against_split(groups: &[usize], fmt: WeightFormat, act: Activation) {
    let cpus: Vec<Vec<usize>> = groups.iter().map(|&n| vec![0; n]).collect();
    let pool = WorkerPool::new(&cpus, false, Duration::from_micros(200));
    let (h, i, n) = (96usize, 80usize, 9u32);
    let experts = Experts::new(n, h, i, 11);
    let cfg = ExpertSetConfig::new(h, i, fmt).with_activation(act, None);
    let mut split = experts.set(&cfg, &pool);
    split.set_decode_path(DecodePath::SPLIT);
    // every fused plan with the default items, then with one N-tile and one expert per item, and
    // with other kernel prefetch settings (they change no result)
    let tiny = Targets {
        gate_up: 1,
        down: 1,
    };
    let fused_paths = [
        ("fused", None),
        ("chained", None),
        ("streams", None),
        ("fused", Some(tiny)),
        ("streams", Some(tiny)),
        ("chained:pf0", None),
        ("streams:pf64:nta", Some(tiny)),
        ("fused:pf8192:t1", None),
        ("streams:gu64:dn32:st16", None),
        ("chained:gu1024:dn1024", None),
        ("chained:ws64", Some(tiny)),
        ("streams:pf4096:t2:ws1", None),
        ("chained:ip8:tail", None),
        ("streams:ip2:tail", Some(tiny)),
        ("fused:ip1", None),
    ];
    let fused: Vec<(String, CpuExpertSet)> = fused_paths
        .iter()
        .map(|&(path, targets)| {
            let mut set = experts.set(&cfg, &pool);
            set.set_decode_path(path.parse().unwrap());
            if let Some(t) = targets {
                set.fused_targets = t;
            }
            (format!("{path} {targets:?}"), set)
        })
        .collect();
    for call in 0..3 {
        for t in 1..=FUSED_MAX_TOKENS {
            let k = 1 + (t + call) % 4;
            let (x, ids, wts) = routing(t, k, n, h, call);
            let other: Vec<f32> = x.iter().map(|v| -3.0 * v).collect();
            let run = |set: &CpuExpertSet| {
                let mut y = vec![0.25f32; t * h];
                // a call on other inputs first: rows read before they are written would hold its values
                set.forward(&pool, &other, &ids, &wts, k, &mut y).unwrap();
                y.fill(0.25);
                set.forward(&pool, &x, &ids, &wts, k, &mut y).unwrap();
                y
            };
            let want = run(&split);
            assert!(want.iter().any(|&v| v != 0.25));
            let ctx = format!("{fmt:?} {act:?} groups {groups:?} t={t} k={k} call {call}");
            // each set took the path it was given
            let sets = std::iter::once(&split).chain(fused.iter().map(|(_, s)| s));
            for (n, set) in sets.enumerate() {
                let fused_ran = n > 0;
                let mut times = RegionTimes::default();
                let mut y = vec![0f32; t * h];
                set.forward_timed(&pool, &x, &ids, &wts, k, &mut y, Some(&mut times))
                    .unwrap();
                assert_eq!(times.fused_s > 0.0, fused_ran, "{ctx}");
                assert_eq!(times.gate_up_s > 0.0, !fused_ran, "{ctx}");
            }
            // Parts change the f32 summation order only: ~1e-7 relative.
            for (what, set) in &fused {
                let got = run(set);
                let e = rel_l2(&got, &want);
                assert!(e < 1e-6, "{ctx}, {what}: {e}");
                assert_eq!(
                    run(set),
                    got,
                    "{ctx}, {what}: parts are summed in a fixed order"
                );
            }
        }
    }
}

#[test]
fn fused_equals_split_bf16_and_int8() {
    fused_against_split(&[3], WeightFormat::Bf16, Activation::Silu);
    fused_against_split(&[3], WeightFormat::Int8, Activation::Relu);
    fused_against_split(&[2], WeightFormat::Int4 { group: 32 }, Activation::Silu);
}

#[test]
fn fused_equals_split_over_numa_groups() {
    fused_against_split(&[2, 2], WeightFormat::Bf16, Activation::Relu);
    fused_against_split(&[1, 2], WeightFormat::Int8, Activation::Silu);
}

#[test]
fn item_sizes_parse_from_kib() {
    let t = Targets::parse_kib("128, 96").unwrap();
    assert_eq!((t.gate_up, t.down), (128 << 10, 96 << 10));
    // 2^54 KiB is 2^64 bytes: past usize, refused rather than wrapped
    for bad in ["", "128", "0,96", "a,1", "1,-2", "18014398509481984,1"] {
        assert_eq!(Targets::parse_kib(bad), None, "{bad:?}");
    }
}

#[test]
fn decode_path_parses_and_names() {
    assert_eq!("split".parse::<DecodePath>(), Ok(DecodePath::SPLIT));
    assert_eq!("fused".parse::<DecodePath>(), Ok(DecodePath::FUSED));
    assert_eq!("chained".parse::<DecodePath>(), Ok(DecodePath::CHAINED));
    assert_eq!("streams".parse::<DecodePath>(), Ok(DecodePath::STREAMS));
    let p: DecodePath = "streams:pf8192:nta".parse().unwrap();
    assert_eq!(p.plan, DecodePlan::Streams);
    assert_eq!(
        p.prefetch,
        Some(StreamPrefetch {
            distance: 8192,
            hint: PrefetchHint::Nta
        })
    );
    assert_eq!(p.to_string(), "streams:pf8192:nta");
    assert_eq!(p.to_string().parse::<DecodePath>(), Ok(p));
    let p: DecodePath = "streams:st192:dn384:gu512".parse().unwrap();
    assert_eq!(
        (p.items.gate_up, p.items.down, p.items.stream, p.prefetch),
        (Some(512), Some(384), Some(192), None)
    );
    assert_eq!(p.to_string(), "streams:gu512:dn384:st192");
    let p: DecodePath = "chained:ws64:pf4096:t2".parse().unwrap();
    assert_eq!(p.warm_start_kib, Some(64));
    assert_eq!(p.to_string(), "chained:pf4096:t2:ws64");
    assert_eq!(p.to_string().parse::<DecodePath>(), Ok(p));
    // a distance alone keeps the plan's hint: L2 for the chained plans, L1 for fused (no env set)
    if std::env::var_os("MOE_CPU_PREFETCH_HINT").is_none() {
        let hint = |s: &str| s.parse::<DecodePath>().unwrap().prefetch.unwrap().hint;
        assert_eq!(hint("chained:pf4096"), PrefetchHint::T1);
        assert_eq!(hint("fused:pf4096"), PrefetchHint::T0);
    }
    for bad in [
        "fast",
        "",
        "split:pf0",
        "split:dn64",
        "fused:pf",
        "fused:pf-1",
        "chained:t3",
        "fused:",
        "streams:st0",
        "streams:dn",
        "streams:gu18014398509481984",
        "chained:ev2",
        "split:ws8",
        "chained:ws0",
        "chained:ip0",
        "chained:ip65",
        "chained:ipx",
        "split:ip4",
        "fused:tail",
        "split:tail",
    ] {
        assert!(bad.parse::<DecodePath>().is_err(), "{bad:?}");
    }
    assert_eq!(DecodePath::FUSED.to_string(), "fused");
    let p: DecodePath = "chained:tail:ip8:gu256".parse().unwrap();
    assert_eq!((p.min_items, p.tail_claims_off), (Some(8), true));
    assert_eq!(p.to_string(), "chained:gu256:ip8:tail");
    assert_eq!(p.to_string().parse::<DecodePath>(), Ok(p));
}

/// Down items that must wait: the last gate/up item of each call sleeps, so the items after it find
/// its expert not ready (and, on the chained plans, threads hold claimed items while others wait).
/// Every plan finishes and matches the split path.
#[test]
fn down_items_wait_for_a_slow_expert() {
    let pool = WorkerPool::new(&[vec![0; 4]], false, Duration::from_micros(200));
    let (h, i, n) = (96usize, 80usize, 9u32);
    let experts = Experts::new(n, h, i, 5);
    let cfg = ExpertSetConfig::new(h, i, WeightFormat::Int8);
    let mut split = experts.set(&cfg, &pool);
    split.set_decode_path(DecodePath::SPLIT);
    for path in [DecodePath::FUSED, DecodePath::CHAINED, DecodePath::STREAMS] {
        let mut set = experts.set(&cfg, &pool);
        set.set_decode_path(path);
        set.scratch.lock().unwrap().fused.slow_last_gate_up = Some(Duration::from_millis(3));
        for t in [1, 4, 8] {
            let (x, ids, wts) = routing(t, 4, n, h, t);
            let mut want = vec![0f32; t * h];
            split.forward(&pool, &x, &ids, &wts, 4, &mut want).unwrap();
            let mut got = vec![0f32; t * h];
            set.forward(&pool, &x, &ids, &wts, 4, &mut got).unwrap();
            let e = rel_l2(&got, &want);
            assert!(e < 1e-6, "{path} t={t}: {e}");
        }
    }
}

/// The kernels' A/B knobs refuse values they do not take, by name, instead of reading them as the
/// default (`crate::knob`; `moe-daemon` refuses to start on them through `check_env_knobs`).
#[test]
fn kernel_knobs_refuse_unknown_values() {
    use super::fused::{DECODE_PATH_KNOB, ITEM_KIB_KNOB};
    use super::kern_avx512::{PREFETCH_HINT_KNOB, PREFETCH_KNOB};
    let v = |s: &str| Some(std::ffi::OsString::from(s));
    assert_eq!(
        DECODE_PATH_KNOB.parse_value(v("split")),
        Ok(Some(DecodePath::SPLIT))
    );
    let e = DECODE_PATH_KNOB.parse_value(v("fuse")).unwrap_err();
    assert!(e.to_string().starts_with("MOE_CPU_DECODE=\"fuse\""), "{e}");
    let t = ITEM_KIB_KNOB.parse_value(v("128,96")).unwrap().unwrap();
    assert_eq!((t.gate_up, t.down), (128 << 10, 96 << 10));
    assert!(ITEM_KIB_KNOB.parse_value(v("128")).is_err());
    assert_eq!(PREFETCH_KNOB.parse_value(v("0")), Ok(Some(0)));
    assert!(PREFETCH_KNOB.parse_value(v("4k")).is_err());
    assert!(PREFETCH_HINT_KNOB.parse_value(v("nta")).unwrap().is_some());
    assert!(PREFETCH_HINT_KNOB.parse_value(v("t2")).unwrap().is_some());
    assert!(PREFETCH_HINT_KNOB.parse_value(v("t3")).is_err());
    // unset (as where the tests run): every knob passes the start-up check
    let names = [
        DECODE_PATH_KNOB.name,
        ITEM_KIB_KNOB.name,
        PREFETCH_KNOB.name,
        PREFETCH_HINT_KNOB.name,
    ];
    if names.iter().all(|k| std::env::var_os(k).is_none()) {
        assert_eq!(check_env_knobs(), Ok(()));
    }
}

/// A path set on a shared scratch holds for every set computing in it, and only until cleared; a
/// path that only changes which thread runs which item (`:tail`) changes no bit.
#[test]
fn a_shared_decode_path_holds_for_every_set_of_the_scratch() {
    let pool = WorkerPool::new(&[vec![0; 3]], false, Duration::from_micros(200));
    let (h, i, n) = (96usize, 80usize, 9u32);
    let experts = Experts::new(n, h, i, 7);
    let cfg = ExpertSetConfig::new(h, i, WeightFormat::Bf16);
    let first = experts.set(&cfg, &pool);
    let second = experts.set(&cfg, &pool).with_scratch(first.scratch());
    let (x, ids, wts) = routing(2, 3, n, h, 0);
    let run = |set: &CpuExpertSet| {
        let mut times = RegionTimes::default();
        let mut y = vec![0f32; 2 * h];
        set.forward_timed(&pool, &x, &ids, &wts, 3, &mut y, Some(&mut times))
            .unwrap();
        (y, times.fused_s > 0.0)
    };
    let (chained, fused_ran) = run(&second);
    assert!(fused_ran);
    first.set_shared_decode_path(Some(DecodePath::SPLIT));
    assert!(!run(&second).1, "the other set took the shared path");
    first.set_shared_decode_path(Some("chained:tail".parse().unwrap()));
    assert_eq!(run(&second), (chained.clone(), true));
    first.set_shared_decode_path(None);
    assert_eq!(run(&second), (chained, true));
}
