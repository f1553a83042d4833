//! Builder tests: Guaranteed QoS, daemon args, volumes, probes, security, and that every rendered
//! object survives a JSON round trip through its k8s-openapi type.

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{ConfigMap, Container, Service, Volume, VolumeMount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use serde::de::DeserializeOwned;

use super::workload::{RULES_ENV, RULES_MOUNT};
use super::*;
use crate::crd::MoEDeployment;
use crate::model_shape::resolve_shape;
use crate::placement::sizing::HugepageKind;
use crate::quantity::GIB;

fn md(yaml: &str) -> MoEDeployment {
    serde_yaml::from_str(yaml).expect("test resource parses")
}

const QWEN: &str = r#"
apiVersion: moe.inference.dev/v1alpha1
kind: MoEDeployment
metadata: {name: qwen, namespace: ai, uid: 0b0e7f2e-1111-2222-3333-444455556666}
spec:
  model:
    source: {huggingFace: {repo: Qwen/Qwen3-30B-A3B, tokenSecret: {name: hf, key: token}}}
    servedName: qwen3
"#;

fn sizing() -> Sizing {
    Sizing {
        gpu_experts_per_layer: Some(15),
        cpus: 30,
        cpu_threads: 29,
        memory_bytes: 8 * GIB,
        hugepages: Some((HugepageKind::OneGi, 48 * GIB)),
        gpu_bytes_per_gpu: 20 * GIB,
        gpu_plan: None,
    }
}

fn input(resource: MoEDeployment) -> BuildInput {
    BuildInput {
        shape: resolve_shape(&resource.spec.model, "x"),
        owner: owner_reference(&resource),
        md: resource,
        namespace: "ai".into(),
        classes: vec![ClassBuild {
            id: "sm90-80g".into(),
            description: "NVIDIA-H100 (SM 9.0, 81559 MiB, AVX-512)".into(),
            sizing: sizing(),
            node_affinity: None,
            nodes: 1,
        }],
        activator_image: "moe-operator:test".into(),
    }
}

fn daemon(sts: &StatefulSet) -> &Container {
    &sts.spec.template.spec.as_ref().unwrap().containers[0]
}

/// The pod volume named `name`.
fn volume<'a>(sts: &'a StatefulSet, name: &str) -> &'a Volume {
    let pod = sts.spec.template.spec.as_ref().unwrap();
    let volumes = pod.volumes.as_ref().unwrap();
    volumes.iter().find(|v| v.name == name).unwrap()
}

/// A container's mount at `path`, if any.
fn mount_at<'a>(c: &'a Container, path: &str) -> Option<&'a VolumeMount> {
    let mounts = c.volume_mounts.as_ref()?;
    mounts.iter().find(|m| m.mount_path == path)
}

/// QWEN with its model source replaced by `source` (flow-style YAML).
fn with_source(source: &str) -> MoEDeployment {
    md(&QWEN.replace(
        "{huggingFace: {repo: Qwen/Qwen3-30B-A3B, tokenSecret: {name: hf, key: token}}}",
        source,
    ))
}

fn roundtrip<K: serde::Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(obj: &K) {
    let json = serde_json::to_string(obj).unwrap();
    let back: K = serde_json::from_str(&json).unwrap();
    assert_eq!(&back, obj);
}

#[test]
fn statefulset_is_guaranteed_qos_with_hugepages_and_gpu() {
    let objects = desired_objects(&input(md(QWEN))).unwrap();
    let c = daemon(&objects.statefulsets[0]);
    let resources = c.resources.as_ref().unwrap();
    assert_eq!(resources.requests, resources.limits, "requests = limits");
    let r = resources.limits.as_ref().unwrap();
    assert_eq!(r["cpu"].0, "30");
    assert_eq!(r["memory"].0, "8Gi");
    assert_eq!(r["hugepages-1Gi"].0, "48Gi");
    assert_eq!(r["nvidia.com/gpu"].0, "1");
    let hp = volume(&objects.statefulsets[0], "hugepages");
    assert_eq!(
        hp.empty_dir.as_ref().unwrap().medium.as_deref(),
        Some("HugePages-1Gi")
    );
    assert!(mount_at(c, "/dev/hugepages").is_some());
}

#[test]
fn daemon_args_follow_spec_and_sizing() {
    let objects = desired_objects(&input(md(QWEN))).unwrap();
    let args = daemon(&objects.statefulsets[0]).args.clone().unwrap();
    let joined = args.join(" ");
    assert!(
        joined.starts_with("serve --model /models/Qwen--Qwen3-30B-A3B --served-model-name qwen3"),
        "{joined}"
    );
    for expected in [
        "--gpu-experts 15",
        "--expert-placement frequency",
        "--cpu-threads 29",
        "--numa auto",
        "--hugepages 1G",
        "--max-model-len 32768",
        "--max-num-seqs 16",
        "--port 8000",
        "--host 0.0.0.0",
        "--device cuda",
        "--tensor-parallel 1",
    ] {
        assert!(joined.contains(expected), "missing {expected} in {joined}");
    }
}

#[test]
fn security_context_is_locked_down() {
    let objects = desired_objects(&input(md(QWEN))).unwrap();
    let sts = &objects.statefulsets[0];
    let pod = sts.spec.template.spec.as_ref().unwrap();
    assert_eq!(
        pod.security_context.as_ref().unwrap().run_as_non_root,
        Some(true)
    );
    for c in pod
        .containers
        .iter()
        .chain(pod.init_containers.iter().flatten())
    {
        let sc = c.security_context.as_ref().unwrap();
        assert_eq!(sc.allow_privilege_escalation, Some(false), "{}", c.name);
        assert_eq!(
            sc.capabilities.as_ref().unwrap().drop,
            Some(vec!["ALL".to_string()])
        );
    }
}

#[test]
fn probes_sized_from_startup_budget() {
    let mut resource = md(QWEN);
    resource.spec.startup_budget_seconds = Some(1200);
    let objects = desired_objects(&input(resource)).unwrap();
    let c = daemon(&objects.statefulsets[0]);
    let startup = c.startup_probe.as_ref().unwrap();
    assert_eq!(
        startup.http_get.as_ref().unwrap().path.as_deref(),
        Some("/ready")
    );
    assert_eq!(
        startup.period_seconds.unwrap() * startup.failure_threshold.unwrap(),
        1200
    );
    assert_eq!(
        c.readiness_probe
            .as_ref()
            .unwrap()
            .http_get
            .as_ref()
            .unwrap()
            .path
            .as_deref(),
        Some("/ready")
    );
    assert_eq!(
        c.liveness_probe
            .as_ref()
            .unwrap()
            .http_get
            .as_ref()
            .unwrap()
            .path
            .as_deref(),
        Some("/health")
    );
    // Derived budget grows with the checkpoint: DeepSeek-V3 gets longer than Qwen3-30B.
    let qwen = workload::startup_budget_seconds(&input(md(QWEN)));
    let ds = workload::startup_budget_seconds(&input(md(
        &QWEN.replace("Qwen/Qwen3-30B-A3B", "deepseek-ai/DeepSeek-V3")
    )));
    assert!(ds > qwen && qwen > 300, "{qwen} {ds}");
}

#[test]
fn huggingface_source_downloads_into_a_cache_claim() {
    let objects = desired_objects(&input(md(QWEN))).unwrap();
    let spec = &objects.statefulsets[0].spec;
    let claim = &spec.volume_claim_templates.as_ref().unwrap()[0];
    assert_eq!(claim.metadata.name.as_deref(), Some(workload::CACHE_VOLUME));
    let pod = spec.template.spec.as_ref().unwrap();
    let init = &pod.init_containers.as_ref().unwrap()[0];
    let script = &init.command.as_ref().unwrap()[2];
    assert!(script.contains("snapshot_download") && script.contains("Qwen/Qwen3-30B-A3B"));
    assert!(init
        .env
        .as_ref()
        .unwrap()
        .iter()
        .any(|e| e.name == "HF_TOKEN"));
    let mount = mount_at(daemon(&objects.statefulsets[0]), "/models").unwrap();
    assert_eq!(mount.read_only, Some(true));
}

#[test]
fn pvc_and_host_path_sources_mount_read_only() {
    let pvc = with_source("{pvc: {claimName: weights, path: /qwen3-30b-a3b}}");
    let objects = desired_objects(&input(pvc)).unwrap();
    let sts = &objects.statefulsets[0];
    let claim = volume(sts, "model").persistent_volume_claim.as_ref();
    assert_eq!(claim.unwrap().read_only, Some(true));
    let pod = sts.spec.template.spec.as_ref().unwrap();
    assert!(pod.init_containers.is_none());
    assert!(daemon(&objects.statefulsets[0])
        .args
        .as_ref()
        .unwrap()
        .contains(&"/models/qwen3-30b-a3b".to_string()));

    let host = with_source("{hostPath: {path: /mnt/models/qwen3-30b-a3b}}");
    let objects = desired_objects(&input(host)).unwrap();
    let host_path = volume(&objects.statefulsets[0], "model").host_path.as_ref();
    assert_eq!(host_path.unwrap().path, "/mnt/models/qwen3-30b-a3b");
}

#[test]
fn services_pdb_and_owner_references() {
    let objects = desired_objects(&input(md(QWEN))).unwrap();
    let port = &objects
        .service
        .spec
        .as_ref()
        .unwrap()
        .ports
        .as_ref()
        .unwrap()[0];
    assert_eq!((port.name.as_deref(), port.port), (Some("http"), 8000));
    assert_eq!(
        objects
            .headless_service
            .spec
            .as_ref()
            .unwrap()
            .cluster_ip
            .as_deref(),
        Some("None")
    );
    assert_eq!(
        objects.statefulsets[0].spec.service_name.as_deref(),
        Some("qwen-pods")
    );
    let owner = &objects.pdb.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.controller),
        ("MoEDeployment", Some(true))
    );
    assert!(objects.hpa.is_none() && objects.keda_scaled_object.is_none());
}

#[test]
fn hpa_targets_the_scale_subresource_on_queue_depth() {
    let resource = md(&format!(
        "{QWEN}  autoscaling: {{provider: hpa, minReplicas: 2, maxReplicas: 6, targetQueueDepth: 3, scaleDownDelaySeconds: 120}}\n"
    ));
    let objects = desired_objects(&input(resource)).unwrap();
    let hpa = objects.hpa.expect("hpa");
    let spec = &hpa.spec;
    assert_eq!(spec.scale_target_ref.kind, "MoEDeployment");
    assert_eq!((spec.min_replicas, spec.max_replicas), (Some(2), 6));
    let pods = spec.metrics.as_ref().unwrap()[0].pods.as_ref().unwrap();
    assert_eq!(pods.metric.name, "moe:num_requests_waiting");
    assert_eq!(pods.target.average_value.as_ref().unwrap().0, "3");
    let down = spec.behavior.as_ref().unwrap().scale_down.as_ref().unwrap();
    assert_eq!(down.stabilization_window_seconds, Some(120));
    assert_eq!(objects.statefulsets[0].spec.replicas, Some(2));
    roundtrip(&hpa);
}

#[test]
fn keda_scaled_object_has_a_prometheus_trigger() {
    let resource = md(&format!(
        "{QWEN}  autoscaling: {{provider: keda, minReplicas: 0, maxReplicas: 4, scaleToZero: true, prometheus: {{serverAddress: 'http://prom:9090'}}}}\n"
    ));
    let objects = desired_objects(&input(resource)).unwrap();
    let so = objects.keda_scaled_object.expect("scaled object");
    let v = serde_json::to_value(&so).unwrap();
    assert_eq!(v["apiVersion"], "keda.sh/v1alpha1");
    assert_eq!(v["kind"], "ScaledObject");
    assert_eq!(v["spec"]["minReplicaCount"], 0);
    let trigger = &v["spec"]["triggers"][0];
    assert_eq!(trigger["type"], "prometheus");
    assert_eq!(
        trigger["metadata"]["query"],
        "sum(moe:num_requests_waiting{namespace=\"ai\",pod=~\"qwen-sm90-80g-[0-9]+|qwen-activator-.+\"}) or vector(0)",
        "the activator's queue depth is what wakes a deployment at zero"
    );
    // A new deployment starts with the schema's default of one replica; idle, it goes to zero.
    assert_eq!(objects.statefulsets[0].spec.replicas, Some(1));
    assert!(objects.activator.is_some() && objects.backend_service.is_some());
}

#[test]
fn replicas_clamped_to_autoscaling_bounds() {
    let mut resource = md(&format!(
        "{QWEN}  replicas: 9\n  autoscaling: {{minReplicas: 1, maxReplicas: 3}}\n"
    ));
    assert_eq!(input(resource.clone()).replicas(), 3);
    resource.spec.autoscaling = None;
    assert_eq!(input(resource).replicas(), 9);
}

#[test]
fn every_object_deserializes_into_its_k8s_openapi_type() {
    let resource = md(&format!(
        "{QWEN}  autoscaling: {{provider: hpa, minReplicas: 1, maxReplicas: 2}}\n"
    ));
    let objects = desired_objects(&input(resource)).unwrap();
    roundtrip(&objects.statefulsets[0]);
    roundtrip(&objects.service);
    roundtrip(&objects.pdb);
    for v in objects.to_values().unwrap() {
        let kind = v["kind"].as_str().unwrap().to_string();
        let text = serde_json::to_string(&v).unwrap();
        match kind.as_str() {
            "StatefulSet" => drop(serde_json::from_str::<StatefulSet>(&text).unwrap()),
            "Service" => drop(serde_json::from_str::<Service>(&text).unwrap()),
            "PodDisruptionBudget" => {
                drop(serde_json::from_str::<PodDisruptionBudget>(&text).unwrap())
            }
            "HorizontalPodAutoscaler" => {
                drop(serde_json::from_str::<HorizontalPodAutoscaler>(&text).unwrap())
            }
            "ConfigMap" => drop(serde_json::from_str::<ConfigMap>(&text).unwrap()),
            other => panic!("unexpected kind {other}"),
        }
        assert!(v["apiVersion"].is_string());
    }
}

#[test]
fn unknown_shape_without_cache_size_is_an_error() {
    let resource = md(&QWEN
        .replace("Qwen/Qwen3-30B-A3B", "someone/custom-moe")
        .replace("servedName: qwen3", "servedName: custom"));
    let mut i = input(resource);
    i.shape = None;
    assert_eq!(
        desired_objects(&i).unwrap_err(),
        BuildError::CacheSizeNeedsShape
    );
}

#[test]
fn statefulset_names_carry_the_class_and_stay_within_52_characters() {
    let mut input = input(md(QWEN));
    let class = input.classes[0].clone();
    assert_eq!(input.statefulset_name(&class), "qwen-sm90-80g");
    let long = "a".repeat(45) + "-b-c-d-e";
    input.md.metadata.name = Some(long.clone());
    let class = ClassBuild {
        id: "sm120-96g-amx-t2".into(),
        ..class
    };
    let name = input.statefulset_name(&class);
    assert!(name.len() <= MAX_STATEFULSET_NAME, "{name}");
    assert!(name.ends_with("-sm120-96g-amx-t2"), "{name}");
    assert!(name.starts_with("aaaa"), "{name}");
    assert!(!name.contains("--"), "{name}");
    // Another long name with the same prefix gets a different StatefulSet name.
    input.md.metadata.name = Some("a".repeat(45) + "-x-y-z-w");
    assert_ne!(input.statefulset_name(&class), name);
}

#[test]
fn placement_rules_reach_the_daemon() {
    // no rules of the user's: only the class's own rule file
    let plain = desired_objects(&input(md(QWEN))).unwrap();
    let c = daemon(&plain.statefulsets[0]);
    let args = c.args.as_ref().unwrap();
    assert!(!args.iter().any(|a| a == "--live-placement"));
    let files: Vec<&String> = args
        .iter()
        .zip(args.iter().skip(1))
        .filter(|(a, _)| *a == "--placement-rules")
        .map(|(_, f)| f)
        .collect();
    assert_eq!(files, ["/etc/moe/class-rules/sm90-80g.yaml"]);
    assert!(!c.env.as_ref().unwrap().iter().any(|e| e.name == RULES_ENV));

    let inline = format!(
        "{QWEN}  placement:\n    livePlacement: true\n    rules:\n      inline: |\n        - match: {{layers: 0-3}}\n          decode: gpu\n"
    );
    let objects = desired_objects(&input(md(&inline))).unwrap();
    let sts = &objects.statefulsets[0];
    let c = daemon(sts);
    let env = c.env.as_ref().unwrap();
    let rules = env.iter().find(|e| e.name == RULES_ENV).expect("rules env");
    assert_eq!(
        rules.value.as_deref(),
        Some("- match: {layers: 0-3}\n  decode: gpu\n")
    );
    let args = c.args.as_ref().unwrap();
    assert!(args.contains(&"--live-placement".to_string()));
    // inline rules travel in the environment, which the daemon tries before any file
    assert_eq!(
        args.iter().filter(|a| *a == "--placement-rules").count(),
        1,
        "{args:?}"
    );

    let from_map = format!(
        "{QWEN}  placement:\n    rules:\n      configMapRef: {{name: qwen-rules, key: hot.yaml}}\n"
    );
    let objects = desired_objects(&input(md(&from_map))).unwrap();
    let sts = &objects.statefulsets[0];
    let c = daemon(sts);
    let joined = c.args.as_ref().unwrap().join(" ");
    // the user's file first, the class's after it
    assert!(
        joined.contains(&format!(
            "--placement-rules {RULES_MOUNT}/rules.yaml --placement-rules /etc/moe/class-rules/sm90-80g.yaml"
        )),
        "{joined}"
    );
    assert!(!c.env.as_ref().unwrap().iter().any(|e| e.name == RULES_ENV));
    let mount = mount_at(c, RULES_MOUNT).expect("rules mount");
    assert_eq!(mount.read_only, Some(true));
    let cm = volume(sts, &mount.name)
        .config_map
        .as_ref()
        .expect("ConfigMap volume");
    assert_eq!(cm.name, "qwen-rules");
    let item = &cm.items.as_ref().unwrap()[0];
    assert_eq!(
        (item.key.as_str(), item.path.as_str()),
        ("hot.yaml", "rules.yaml")
    );
    assert_eq!(cm.optional, Some(false));
    roundtrip(sts);
}

/// `validate_spec` refuses `yaml` with an error that contains `expected`.
fn assert_refused(yaml: &str, expected: &str) {
    let errors = crate::validate::validate_spec(&md(yaml).spec, None);
    assert!(errors.iter().any(|e| e.contains(expected)), "{errors:?}");
}

#[test]
fn placement_rules_take_exactly_one_source() {
    let both = format!(
        "{QWEN}  placement:\n    rules:\n      inline: \"- match: {{layers: 0}}\"\n      configMapRef: {{name: r}}\n"
    );
    assert_refused(&both, "exactly one of inline, configMapRef");
    let neither = format!("{QWEN}  placement:\n    rules: {{}}\n");
    assert_refused(&neither, "exactly one of inline, configMapRef");
    let huge = format!(
        "{QWEN}  placement:\n    rules:\n      inline: \"{}\"\n",
        "x".repeat(crate::crd::MAX_INLINE_RULES_BYTES + 1)
    );
    assert_refused(&huge, "placement.rules.inline");
}

/// The class's rule text for a deployment with `placement` (YAML under `spec.placement`) and
/// `gpu_experts` of Qwen3-30B-A3B's 128 per layer fitting.
fn class_rules_of(placement: &str, gpu_experts: u32) -> String {
    let yaml = format!("{QWEN}  placement:\n{placement}");
    let mut input = input(md(&yaml));
    input.classes[0].sizing.gpu_experts_per_layer = Some(gpu_experts);
    let objects = desired_objects(&input).unwrap();
    let cm = &objects.class_rules[0];
    cm.data.as_ref().unwrap()["sm90-80g.yaml"].clone()
}

/// The rules after the leading comment.
fn rules_only(text: &str) -> String {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| format!("{l}\n"))
        .collect()
}

#[test]
fn each_class_gets_a_rule_file_saying_what_its_sizing_decided() {
    let objects = desired_objects(&input(md(QWEN))).unwrap();
    assert_eq!(objects.class_rules.len(), 1);
    let cm = &objects.class_rules[0];
    assert_eq!(cm.metadata.name.as_deref(), Some("qwen-sm90-80g-placement"));
    let labels = cm.metadata.labels.as_ref().unwrap();
    assert_eq!(labels[LABEL_HARDWARE_CLASS], "sm90-80g");
    assert_eq!(labels[LABEL_DEPLOYMENT], "qwen");
    assert!(cm.metadata.owner_references.is_some());
    roundtrip(cm);
    let text = &cm.data.as_ref().unwrap()["sm90-80g.yaml"];
    for want in [
        "# Written by moe-operator for MoEDeployment ai/qwen, node class sm90-80g:",
        "# NVIDIA-H100 (SM 9.0, 81559 MiB, AVX-512).",
        "# Sizing (gpuExpertsPerLayer auto): 15 of 128 routed experts per layer on the GPU, 48 MoE layers.",
        "# CPU: 29 worker threads on 30 whole CPUs; 8Gi DRAM, 48Gi of hugepages-1Gi.",
        "# Experts: frequency placement picks which experts.",
    ] {
        assert!(text.contains(want), "{want:?} not in\n{text}");
    }
    // the default strategy (frequency) picks the experts: the rules leave it to it
    assert_eq!(
        rules_only(text),
        "- match: {name: \".*\"}\n  decode: auto\n"
    );

    // mounted where the daemon is told to read it, and hashed into the pod template
    let sts = &objects.statefulsets[0];
    let pod = sts.spec.template.spec.as_ref().unwrap();
    let volume = pod
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .find(|v| {
            v.config_map
                .as_ref()
                .is_some_and(|c| c.name == "qwen-sm90-80g-placement")
        })
        .expect("class rules volume");
    let mounts = daemon(sts).volume_mounts.as_ref().unwrap();
    let mount = mounts
        .iter()
        .find(|m| m.name == volume.name)
        .expect("class rules mount");
    assert_eq!(mount.mount_path, "/etc/moe/class-rules");
    let annotations = sts
        .spec
        .template
        .metadata
        .as_ref()
        .unwrap()
        .annotations
        .as_ref();
    let hash = &annotations.unwrap()[class_rules::RULES_HASH_ANNOTATION];
    assert_eq!(hash.len(), 16);

    // (spec.placement, GPU experts per layer that fit, the rules, a note the text must carry)
    let cases: [(&str, u32, &str, &str); 6] = [
        // uniform without rules or live placement: the lowest ids pinned, exactly as uniform places them
        (
            "    expertPlacement: uniform\n",
            15,
            "- match: {experts: \"0-14\"}\n  decode: gpu\n- match: {name: \".*\"}\n  decode: cpu\n",
            "# Experts: these rules pin every routed expert.",
        ),
        (
            "    expertPlacement: uniform\n",
            1,
            "- match: {experts: \"0\"}\n  decode: gpu\n- match: {name: \".*\"}\n  decode: cpu\n",
            "",
        ),
        // live placement moves experts: nothing pinned
        (
            "    expertPlacement: uniform\n    livePlacement: true\n",
            15,
            "- match: {name: \".*\"}\n  decode: auto\n",
            "live re-placement moves experts",
        ),
        // the user's rules come first and the daemon refits around them: nothing pinned
        (
            "    expertPlacement: uniform\n    rules:\n      inline: \"- match: {layers: 0}\\n  decode: gpu\"\n",
            15,
            "- match: {name: \".*\"}\n  decode: auto\n",
            "Tried after the deployment's own rules",
        ),
        // all or none fit: every expert pinned
        (
            "    livePlacement: true\n",
            128,
            "- match: {name: \".*\"}\n  decode: gpu\n",
            "",
        ),
        (
            "    gpuExpertsPerLayer: 0\n",
            0,
            "- match: {name: \".*\"}\n  decode: cpu\n",
            "",
        ),
    ];
    for (placement, gpu_experts, rules, note) in cases {
        let text = class_rules_of(placement, gpu_experts);
        assert_eq!(rules_only(&text), rules, "{placement}, {gpu_experts} fit");
        assert!(text.contains(note), "{note:?} not in\n{text}");
    }
    // same inputs, same text (no node names or counts in it)
    let mut more_nodes = input(md(QWEN));
    more_nodes.classes[0].nodes = 7;
    assert_eq!(
        desired_objects(&more_nodes).unwrap().class_rules,
        objects.class_rules
    );
}

#[test]
fn no_class_rules_when_the_expert_count_is_left_to_the_daemon() {
    let mut input = input(md(QWEN));
    input.classes[0].sizing.gpu_experts_per_layer = None;
    let objects = desired_objects(&input).unwrap();
    assert!(objects.class_rules.is_empty());
    let args = daemon(&objects.statefulsets[0]).args.clone().unwrap();
    assert!(!args.contains(&"--placement-rules".to_string()), "{args:?}");
}
