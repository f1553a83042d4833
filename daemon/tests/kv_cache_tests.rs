//! The scheduler's KV block manager driving the real CPU engine on a cache too small for the load:
//! prefix blocks shared and evicted, sequences preempted and recomputed, and every output equal to the
//! same request alone on a roomy cache (tokens exactly; each token's log-probability within 1e-4, the
//! CPU backend's batch-versus-alone difference).
mod common;

use common::kv_pressure;
use moe_daemon::engine::EngineOptions;

#[test]
fn tight_kv_cache_preempts_and_shares_prefixes_without_changing_outputs() {
    let dir = common::fixtures_root().join("qwen3_moe/model");
    let (alone, pressured, metrics) = kv_pressure::run(&dir, &EngineOptions::default(), 512);
    kv_pressure::check(&alone, &pressured, &metrics, 1e-4);
}
