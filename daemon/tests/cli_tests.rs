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
