//! `moe-daemon generate` as a user runs it: logits dump against the oracle, and clear errors for bad flags.
use std::path::PathBuf;
use std::process::Command;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name)
}

fn daemon() -> Command {
    Command::new(env!("CARGO_BIN_EXE_moe-daemon"))
}

#[test]
fn logits_out_matches_oracle_without_tokenizer() {
    let oracle: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("glm4_moe").join("oracle.json")).unwrap(),
    )
    .unwrap();
    let prompt: Vec<String> = oracle["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    let out = tempfile::NamedTempFile::new().unwrap();
    let status = daemon()
        .args(["generate", "--model"])
        .arg(fixture("glm4_moe").join("model_bf16"))
        .args([
            "--prompt-ids",
            &prompt.join(","),
            "--max-tokens",
            "5",
            "--logits-out",
        ])
        .arg(out.path())
        .args(["--json"])
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    let got: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path()).unwrap()).unwrap();
    let steps = got["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 5);
    for (i, (s, o)) in steps
        .iter()
        .zip(oracle["steps"].as_array().unwrap())
        .enumerate()
    {
        assert_eq!(s["token"], o["argmax"], "step {i}");
        let a: Vec<f64> = s["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let b: Vec<f64> = o["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(a.len(), 512);
        let num: f64 = a.iter().zip(&b).map(|(x, y)| (x - y).powi(2)).sum();
        let den: f64 = b.iter().map(|y| y * y).sum();
        assert!((num / den).sqrt() < 1e-3, "step {i}");
    }
    assert_eq!(report["token_ids"].as_array().unwrap().len(), 5);
}

#[test]
fn same_seed_same_output() {
    let run = |seed: &str| {
        let o = daemon()
            .args(["generate", "--model"])
            .arg(fixture("mixtral").join("model"))
            .args([
                "--prompt-ids",
                "1,2,3",
                "--max-tokens",
                "12",
                "--temperature",
                "1.0",
            ])
            .args(["--top-p", "0.9", "--seed", seed, "--ignore-eos"])
            .output()
            .unwrap();
        assert!(o.status.success());
        String::from_utf8(o.stdout).unwrap()
    };
    assert_eq!(run("5"), run("5"));
    assert_ne!(run("5"), run("6"));
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--prompt-ids", "1,x"], "invalid digit"),
        (vec!["--prompt-ids", "1,99999"], "outside the vocabulary"),
        (vec!["--prompt", "hello"], "tokenizer.json"),
        (vec!["--prompt-ids", "1", "--top-p", "0"], "top_p"),
        (
            vec!["--prompt-ids", "1", "--temperature", "-1"],
            "temperature",
        ),
        (
            vec!["--prompt-ids", "1", "--tensor-parallel", "2"],
            "--tensor-parallel needs --device cuda",
        ),
        (
            vec!["--prompt-ids", "1", "--tensor-parallel", "0"],
            "--tensor-parallel",
        ),
    ];
    for (args, want) in cases {
        let o = daemon()
            .args(["generate", "--model"])
            .arg(fixture("qwen3").join("model"))
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// What the daemon prints at start when its placement rules come from several sources (a user's text in
/// MOE_PLACEMENT_RULES, then a node class's file as the operator writes it): each source in the order
/// tried, the file's leading comment, each rule with the routed experts it decided, and every run of
/// experts labelled with the `SOURCE:LINE` of its rule. A mistake in the second source names that file.
#[test]
fn placement_rule_sources_are_printed_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let class = dir.path().join("sm90-140g.yaml");
    std::fs::write(
        &class,
        "# Written by moe-operator for MoEDeployment llm/glm, node class sm90-140g:\n\
         # NVIDIA-H200 (SM 9.0, 143771 MiB, AVX-512).\n\
         - match: {name: \".*\"}\n  decode: cpu\n",
    )
    .unwrap();
    let run = |class_file: &std::path::Path| {
        daemon()
            .args(["generate", "--model"])
            .arg(fixture("glm4_moe").join("model_bf16"))
            .args([
                "--prompt-ids",
                "1,2,3",
                "--max-tokens",
                "1",
                "--placement-rules",
            ])
            .arg(class_file)
            .env(
                "MOE_PLACEMENT_RULES",
                "- match: {layers: 2, experts: 0-3}\n  decode: cpu\n",
            )
            .env("RUST_LOG", "off")
            .output()
            .unwrap()
    };
    let o = run(&class);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let f = class.display();
    for want in [
        format!(
            "placement plan (MOE_PLACEMENT_RULES + {f}): 0 routed experts on the GPU, 32 in DRAM"
        ),
        "  rules, first match wins:".to_string(),
        "    1. MOE_PLACEMENT_RULES (1 rule)".to_string(),
        "         line 1    {layers: 2, experts: 0-3} decode cpu -> 4 routed experts".to_string(),
        format!("    2. {f} (1 rule)"),
        "         # Written by moe-operator for MoEDeployment llm/glm, node class sm90-140g:"
            .to_string(),
        "         # NVIDIA-H200 (SM 9.0, 143771 MiB, AVX-512).".to_string(),
        "         line 3    {name: '.*'} decode cpu -> 28 routed experts".to_string(),
        format!("rule {f}:3"),
        "rule MOE_PLACEMENT_RULES:1".to_string(),
    ] {
        assert!(
            err.lines().any(|l| l.contains(&want)),
            "{want:?} not in\n{err}"
        );
    }
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "# sizing\n- match: {layers: 7}\n  decode: cpu\n").unwrap();
    let o = run(&bad);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains(&format!("{}:2:", bad.display())) && err.contains("layer 7 is beyond"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}
