//! The CRD's CEL rules (x-kubernetes-validations), evaluated client-side with kube's CEL
//! interpreter against the generated schema: what the apiserver would accept or reject.

use kube::core::cel::{validate_cel, validate_cel_update};
use moe_operator::crd::MoEDeployment;

fn md(yaml: &str) -> MoEDeployment {
    serde_yaml::from_str(yaml).expect("test resource parses")
}

const BASE: &str = "apiVersion: moe.inference.dev/v1alpha1\nkind: MoEDeployment\nmetadata: {name: m, namespace: n}\n";

fn with_spec(spec: &str) -> MoEDeployment {
    md(&format!("{BASE}spec:\n{spec}"))
}

fn errors(obj: &MoEDeployment) -> String {
    match validate_cel(obj) {
        Ok(()) => String::new(),
        Err(e) => format!("{e:?}"),
    }
}

#[test]
fn examples_pass_every_rule() {
    for example in [
        "qwen3-30b-a3b.yaml",
        "glm-4.5-air.yaml",
        "deepseek-v3.yaml",
        "glm-5.3-flash.yaml",
    ] {
        let path = format!("{}/../examples/{example}", env!("CARGO_MANIFEST_DIR"));
        let obj = md(&std::fs::read_to_string(path).unwrap());
        assert_eq!(errors(&obj), "", "{example}");
    }
}

#[test]
fn min_replicas_above_max_is_rejected() {
    let obj = with_spec("  model: {source: {hostPath: {path: /m}}}\n  autoscaling: {minReplicas: 5, maxReplicas: 2}\n");
    assert!(
        errors(&obj).contains("must not exceed maxReplicas"),
        "{}",
        errors(&obj)
    );
}

#[test]
fn exactly_one_model_source() {
    let none = with_spec("  model: {source: {}}\n");
    assert!(
        errors(&none).contains("exactly one of"),
        "{}",
        errors(&none)
    );
    let two = with_spec("  model: {source: {hostPath: {path: /m}, pvc: {claimName: c}}}\n");
    assert!(errors(&two).contains("exactly one of"));
}

#[test]
fn mutually_exclusive_and_dependent_fields() {
    let cache_with_pvc =
        with_spec("  model: {source: {pvc: {claimName: c}}, cache: {size: 10Gi}}\n");
    assert!(
        errors(&cache_with_pvc).contains("model.cache is only used"),
        "{}",
        errors(&cache_with_pvc)
    );
    let keda = with_spec("  model: {source: {hostPath: {path: /m}}}\n  autoscaling: {provider: keda, maxReplicas: 2}\n");
    assert!(errors(&keda).contains("keda needs prometheus"));
    let hpa_zero = with_spec("  model: {source: {hostPath: {path: /m}}}\n  autoscaling: {provider: hpa, minReplicas: 0, maxReplicas: 2, scaleToZero: true}\n");
    assert!(errors(&hpa_zero).contains("scaleToZero needs provider"));
    let amount_auto = with_spec(
        "  model: {source: {hostPath: {path: /m}}}\n  placement: {hugepages: {amount: 4Gi}}\n",
    );
    assert!(errors(&amount_auto).contains("hugepages.amount needs size"));
}

#[test]
fn model_source_is_immutable() {
    let old = with_spec("  model: {source: {huggingFace: {repo: Qwen/Qwen3-30B-A3B}}}\n");
    let same_source = with_spec(
        "  model: {source: {huggingFace: {repo: Qwen/Qwen3-30B-A3B}}, servedName: other}\n",
    );
    assert!(validate_cel_update(&same_source, &old).is_ok());
    let new_source = with_spec("  model: {source: {huggingFace: {repo: zai-org/GLM-4.5-Air}}}\n");
    let err = format!("{:?}", validate_cel_update(&new_source, &old).unwrap_err());
    assert!(err.contains("model.source is immutable"), "{err}");
}

#[test]
fn auto_or_count_fields_reject_other_strings() {
    use kube::core::cel::validate_cel_schema;
    use moe_operator::crd::MoEDeploymentSpec;
    let spec = |gpu_experts: serde_json::Value| {
        serde_json::json!({
            "model": {"source": {"hostPath": {"path": "/m"}}},
            "placement": {"gpuExpertsPerLayer": gpu_experts, "cpuThreads": "auto"}
        })
    };
    assert!(validate_cel_schema::<MoEDeploymentSpec>(&spec("auto".into()), None).is_ok());
    assert!(validate_cel_schema::<MoEDeploymentSpec>(&spec(12.into()), None).is_ok());
    assert!(validate_cel_schema::<MoEDeploymentSpec>(&spec("many".into()), None).is_err());
    assert!(validate_cel_schema::<MoEDeploymentSpec>(&spec((-1).into()), None).is_err());
}
