//! Spec validation in Rust: the CEL rules of the CRD (so offline plans and the reconciler reject
//! what the apiserver would) plus checks CEL cannot express (quantities, model shape).

use crate::crd::{AutoOr, AutoscalingProvider, HugepageSize, MoEDeploymentSpec};
use crate::model_shape::ResolvedShape;
use crate::placement::node_facts::CapabilityPattern;
use crate::placement::sizing::check_spec;

/// All problems found, each a sentence naming the field.
pub fn validate_spec(spec: &MoEDeploymentSpec, shape: Option<&ResolvedShape>) -> Vec<String> {
    let mut errors = Vec::new();
    let source = &spec.model.source;
    let set = [
        source.hugging_face.is_some(),
        source.pvc.is_some(),
        source.host_path.is_some(),
        source.url.is_some(),
    ]
    .iter()
    .filter(|s| **s)
    .count();
    if set != 1 {
        errors.push(format!(
            "model.source: exactly one of huggingFace, pvc, hostPath, url must be set ({set} set)"
        ));
    }
    if spec.model.cache.is_some() && source.hugging_face.is_none() && source.url.is_none() {
        errors.push("model.cache is only used with a huggingFace or url source".into());
    }
    if spec.replicas.is_some_and(|r| r < 0) {
        errors.push("replicas must not be negative".into());
    }
    if let Some(a) = &spec.autoscaling {
        if a.min_replicas > a.max_replicas {
            errors.push(format!(
                "autoscaling.minReplicas ({}) must not exceed maxReplicas ({})",
                a.min_replicas, a.max_replicas
            ));
        }
        if a.min_replicas < 1 && !a.scale_to_zero {
            errors.push("autoscaling.minReplicas 0 needs scaleToZero: true".into());
        }
        if a.provider == AutoscalingProvider::Keda && a.prometheus.is_none() {
            errors.push("autoscaling.provider keda needs prometheus.serverAddress".into());
        }
        if a.scale_to_zero && a.provider == AutoscalingProvider::Hpa {
            errors.push("autoscaling.scaleToZero needs provider builtin or keda".into());
        }
        if a.scale_down_delay_seconds > 3600 {
            errors.push(format!(
                "autoscaling.scaleDownDelaySeconds must be at most 3600, the HPA's stabilization window limit (got {})",
                a.scale_down_delay_seconds
            ));
        }
        if a.target_queue_depth == 0 {
            errors.push("autoscaling.targetQueueDepth must be at least 1".into());
        }
    }
    let hp = &spec.placement.hugepages;
    if hp.amount.is_some() && !matches!(hp.size, HugepageSize::OneGi | HugepageSize::TwoMi) {
        errors.push("placement.hugepages.amount needs size 1Gi or 2Mi".into());
    }
    if let Some(r) = &spec.placement.rules {
        if r.inline.is_some() == r.config_map_ref.is_some() {
            errors.push("placement.rules takes exactly one of inline, configMapRef".into());
        }
        if let Some(text) = &r.inline {
            if text.is_empty() || text.len() > crate::crd::MAX_INLINE_RULES_BYTES {
                errors.push(format!(
                    "placement.rules.inline must be 1 to {} bytes (got {})",
                    crate::crd::MAX_INLINE_RULES_BYTES,
                    text.len()
                ));
            }
        }
    }
    let gpu = &spec.resources.gpu;
    if !(1..=16).contains(&gpu.count) {
        errors.push(format!(
            "resources.gpu.count must be within 1..16 (got {})",
            gpu.count
        ));
    }
    if gpu.compute_capabilities.is_empty() {
        errors.push("resources.gpu.computeCapabilities must not be empty".into());
    }
    for cc in &gpu.compute_capabilities {
        if CapabilityPattern::parse(cc).is_none() {
            errors.push(format!(
                "resources.gpu.computeCapabilities: {cc:?} is not major.minor or major.x"
            ));
        }
    }
    if let Some(b) = spec.startup_budget_seconds {
        if !(30..=86_400).contains(&b) {
            errors.push(format!(
                "startupBudgetSeconds must be within 30..86400 (got {b})"
            ));
        }
    }
    if let (Some(shape), AutoOr::Count(n)) = (shape, spec.placement.gpu_experts_per_layer) {
        if n > shape.experts_per_layer {
            errors.push(format!(
                "placement.gpuExpertsPerLayer {n} exceeds the model's {} experts per layer",
                shape.experts_per_layer
            ));
        }
    }
    // The pod's GPUs run the model tensor-parallel: its heads and widths must split over them.
    if let Some(detail) = shape.and_then(|s| s.detail.as_ref()) {
        if (2..=16).contains(&gpu.count) {
            if let Err(e) = moe_sizing::parallel::device_shape(detail, gpu.count as u64) {
                errors.push(format!(
                    "resources.gpu.count {}: the GPUs run the model tensor-parallel, and {e}",
                    gpu.count
                ));
            }
        }
    }
    if let Err(e) = check_spec(spec, shape) {
        errors.push(e.to_string());
    }
    errors
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(yaml: &str) -> MoEDeploymentSpec {
        serde_yaml::from_str(yaml).expect("spec parses")
    }

    #[test]
    fn gpu_count_must_split_the_model() {
        let two = spec("model: {source: {huggingFace: {repo: Qwen/Qwen3-30B-A3B}}}\nresources: {gpu: {count: 2}}");
        let shape = crate::model_shape::resolve_shape(&two.model, "x");
        assert_eq!(validate_spec(&two, shape.as_ref()), Vec::<String>::new());
        let three = spec("model: {source: {huggingFace: {repo: Qwen/Qwen3-30B-A3B}}}\nresources: {gpu: {count: 3}}");
        let errors = validate_spec(&three, shape.as_ref());
        assert_eq!(
            errors,
            vec!["resources.gpu.count 3: the GPUs run the model tensor-parallel, and 32 attention heads do not split over 3 GPUs"]
        );
    }

    #[test]
    fn valid_spec_has_no_errors() {
        let s = spec("model: {source: {huggingFace: {repo: Qwen/Qwen3-30B-A3B}}}");
        let shape = crate::model_shape::resolve_shape(&s.model, "x");
        assert_eq!(validate_spec(&s, shape.as_ref()), Vec::<String>::new());
    }

    #[test]
    fn reports_every_broken_rule() {
        let s = spec(
            r#"
model:
  source: {hostPath: {path: /m}, pvc: {claimName: c}}
  cache: {size: 10Gi}
replicas: -1
placement: {hugepages: {amount: 4Gi}}
resources: {memory: 64Gi, gpu: {count: 0, computeCapabilities: ["9"]}}
autoscaling: {provider: hpa, minReplicas: 0, maxReplicas: 0, scaleToZero: true}
startupBudgetSeconds: 5
"#,
        );
        let errors = validate_spec(&s, None).join("\n");
        for needle in [
            "exactly one of",
            "model.cache",
            "replicas must not be negative",
            "scaleToZero needs provider",
            "hugepages.amount",
            "gpu.count",
            "\"9\"",
            "startupBudgetSeconds",
        ] {
            assert!(errors.contains(needle), "missing {needle:?} in:\n{errors}");
        }
    }

    #[test]
    fn min_above_max_and_keda_without_prometheus() {
        let s = spec(
            "model: {source: {hostPath: {path: /m}}}\nresources: {memory: 8Gi}\nautoscaling: {provider: keda, minReplicas: 5, maxReplicas: 2}",
        );
        let errors = validate_spec(&s, None).join("\n");
        assert!(errors.contains("minReplicas (5) must not exceed maxReplicas (2)"));
        assert!(errors.contains("keda needs prometheus"));
    }

    #[test]
    fn gpu_experts_above_model_experts() {
        let s = spec("model: {source: {huggingFace: {repo: Qwen/Qwen3-30B-A3B}}}\nplacement: {gpuExpertsPerLayer: 200}");
        let shape = crate::model_shape::resolve_shape(&s.model, "x");
        assert_eq!(
            validate_spec(&s, shape.as_ref()),
            vec![
                "placement.gpuExpertsPerLayer 200 exceeds the model's 128 experts per layer"
                    .to_string()
            ]
        );
    }
}
