//! The shipped examples validate and plan against the sample cluster; the CLI turns bad input into
//! clear errors (exit code 1, no panic).

use std::path::{Path, PathBuf};
use std::process::Command;

use moe_operator::manifests::validate_yaml_stream;
use moe_operator::plan::{plan, PlanError};

fn repo_file(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo_file(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

const EXAMPLES: [&str; 5] = [
    "examples/qwen3-30b-a3b.yaml",
    "examples/glm-4.5-air.yaml",
    "examples/deepseek-v3.yaml",
    "examples/smallthinker-21b.yaml",
    "examples/glm-5.3-flash.yaml",
];

#[test]
fn examples_are_valid_moedeployments() {
    for example in EXAMPLES {
        assert_eq!(
            validate_yaml_stream(&read(example), example),
            Ok(vec!["MoEDeployment".to_string()]),
            "{example}"
        );
    }
    assert!(validate_yaml_stream(&read("examples/nodes.yaml"), "nodes").is_ok());
}

#[test]
fn examples_plan_against_the_sample_cluster() {
    let nodes = read("examples/nodes.yaml");
    let qwen = plan(&read(EXAMPLES[0]), &nodes).unwrap();
    assert!(
        qwen.contains("summary: \"2/6 nodes are available"),
        "{qwen}"
    );
    assert!(qwen.contains("GPU compute capability 8.6 is not accepted"));
    assert!(qwen.contains("kind: StatefulSet") && qwen.contains("kind: PodDisruptionBudget"));
    let deepseek = plan(&read(EXAMPLES[2]), &nodes).unwrap();
    assert!(
        deepseek.contains("- name: spr-h100-1\n  qualifies: true"),
        "{deepseek}"
    );
    assert!(deepseek.contains("kind: ScaledObject"));
    // Every object the plan prints is itself a valid manifest.
    let objects: String = deepseek
        .split_once("---\n")
        .map(|(_, rest)| rest.to_string())
        .unwrap();
    validate_yaml_stream(&objects, "plan output").unwrap_or_else(|problems| {
        // KEDA's ScaledObject is not a k8s-openapi type; everything else must pass.
        assert!(
            problems.iter().all(|p| p.message.contains("ScaledObject")),
            "{problems:?}"
        );
        vec![]
    });
}

#[test]
fn plan_reports_bad_input_clearly() {
    let nodes = read("examples/nodes.yaml");
    let err = plan("kind: [unclosed", &nodes).unwrap_err();
    assert!(matches!(err, PlanError::Yaml { .. }), "{err}");
    let err = plan("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n", &nodes).unwrap_err();
    assert!(
        err.to_string().contains("expected kind MoEDeployment"),
        "{err}"
    );
    let err = plan(&read(EXAMPLES[0]), "apiVersion: v1\nkind: Pod\n").unwrap_err();
    assert!(err.to_string().contains("expected Node objects"), "{err}");
    let invalid = read(EXAMPLES[0]).replace("minReplicas: 1", "minReplicas: 9");
    let err = plan(&invalid, &nodes).unwrap_err();
    assert!(
        err.to_string().contains("must not exceed maxReplicas"),
        "{err}"
    );
    let wrong_type = read(EXAMPLES[0]).replace("maxNumSeqs: 32", "maxNumSeqs: lots");
    assert!(plan(&wrong_type, &nodes).is_err());
}

#[test]
fn binary_exits_nonzero_without_panicking() {
    let dir = std::env::temp_dir().join(format!("moe-operator-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.yaml");
    std::fs::write(&bad, "apiVersion: moe.inference.dev/v1alpha1\nkind: MoEDeployment\nmetadata: {name: x}\nspec: {model: 7}\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_moe-operator"))
        .args(["plan", "--deployment"])
        .arg(&bad)
        .arg("--nodes")
        .arg(repo_file("examples/nodes.yaml"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("deployment") && !stderr.contains("panicked"),
        "{stderr}"
    );

    let missing = Command::new(env!("CARGO_BIN_EXE_moe-operator"))
        .args(["validate", "/nonexistent/file.yaml"])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("cannot read /nonexistent/file.yaml"));

    let crd = Command::new(env!("CARGO_BIN_EXE_moe-operator"))
        .arg("crd")
        .output()
        .unwrap();
    assert!(crd.status.success());
    assert!(String::from_utf8_lossy(&crd.stdout).contains("kind: CustomResourceDefinition"));

    // `run` without any cluster configuration fails with a message, not a panic.
    let run = Command::new(env!("CARGO_BIN_EXE_moe-operator"))
        .args(["run", "--metrics-addr", "127.0.0.1:0"])
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("KUBECONFIG")
        .env("HOME", &dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("connecting to the Kubernetes API") && !stderr.contains("panicked"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// GLM-5.3-Flash (hybrid: linear-attention and indexed MLA layers) planned end to end against the
/// sample cluster: the model is recognised by its hub id, sized from its config.json by layer kind,
/// and placed on the node whose GPU and DRAM hold it.
#[test]
fn glm53_flash_example_plans_by_layer_kind() {
    let nodes = read("examples/nodes.yaml");
    let out = plan(&read("examples/glm-5.3-flash.yaml"), &nodes).unwrap();
    println!("{out}");
    assert!(
        out.contains("- name: spr-h100-1\n  qualifies: true"),
        "{out}"
    );
    assert!(out.contains("kind: StatefulSet") && out.contains("kind: PodDisruptionBudget"));
    // The daemon's plan by layer kind (the contract test checks it is the daemon's own): 22 of the
    // 288 experts per layer beside bf16 dense weights, the KV rows of the 11 indexed layers (latent +
    // f32 indexer keys, 22 KiB per position) for two 128K sequences and more, and the recurrent states.
    assert!(
        out.contains("22 of 288 routed experts per layer on the GPU, 42 MoE layers"),
        "{out}"
    );
    assert!(out.contains("KV cache 312256 positions"), "{out}");
    // The other 266 experts of each layer stay FP8 in hugepages: 266 × 25.2 MB = 6.24 GiB per layer,
    // mapped per layer on 7 pages of 1 GiB (12 % empty): 42 × 7.
    assert!(out.contains("294Gi of hugepages-1Gi"), "{out}");
}
