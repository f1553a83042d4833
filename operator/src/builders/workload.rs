//! The StatefulSet that runs `moe-daemon`: Guaranteed QoS (whole CPUs, requests = limits), hugepages
//! with a HugePages emptyDir, GPUs, the model volume, probes sized from the startup budget, and a
//! locked-down security context.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    StatefulSet, StatefulSetPersistentVolumeClaimRetentionPolicy, StatefulSetSpec,
};
use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource,
    HTTPGetAction, HostPathVolumeSource, PersistentVolumeClaim, PersistentVolumeClaimSpec,
    PersistentVolumeClaimVolumeSource, PodAffinityTerm, PodSecurityContext, PodSpec,
    PodTemplateSpec, Probe, SeccompProfile, SecurityContext, Volume, VolumeMount,
    VolumeResourceRequirements, WeightedPodAffinityTerm,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::class_rules::{class_rules, RULES_HASH_ANNOTATION};
use super::{BuildError, BuildInput, ClassBuild, HTTP_PORT};
use crate::crd::{NumaPolicy, DEFAULT_IMAGE};
use crate::placement::node_facts::RESOURCE_GPU;
use crate::placement::sizing::Sizing;
use crate::placement::{effective_tolerations, merge_node_affinity};
use crate::quantity::{bytes_quantity, GIB};

pub const DAEMON_CONTAINER: &str = "daemon";
pub const MODEL_MOUNT: &str = "/models";
pub const HUGEPAGES_MOUNT: &str = "/dev/hugepages";
pub const CACHE_VOLUME: &str = "model-cache";
pub const DOWNLOADER_IMAGE: &str = "docker.io/library/python:3.12-slim";
/// The downloader's one Python package, pinned so every replica runs the same code.
pub const HF_HUB_VERSION: &str = "2.4.0";
/// Downloader resources when the spec names none: requests = limits, so that the init container
/// does not turn the pod Burstable (QoS counts init containers) and the static CPU manager still
/// gives the daemon exclusive cores.
const DOWNLOADER_CPU: &str = "1";
const DOWNLOADER_MEMORY: &str = "2Gi";
pub(crate) const NON_ROOT_UID: i64 = 65532;
const STARTUP_PROBE_PERIOD_SECONDS: i32 = 10;
/// Load throughput assumed when deriving the startup budget (network volume, cold page cache).
const ASSUMED_LOAD_BYTES_PER_SECOND: u64 = 500_000_000;
const BASE_STARTUP_SECONDS: u64 = 300;
const UNKNOWN_SHAPE_STARTUP_SECONDS: u64 = 1800;

/// Seconds the pod may spend loading before the startup probe restarts it.
pub fn startup_budget_seconds(input: &BuildInput) -> u64 {
    match (input.md.spec.startup_budget_seconds, &input.shape) {
        (Some(explicit), _) => explicit as u64,
        (None, Some(shape)) => (BASE_STARTUP_SECONDS
            + shape.checkpoint_bytes() / ASSUMED_LOAD_BYTES_PER_SECOND)
            .min(86_400),
        (None, None) => UNKNOWN_SHAPE_STARTUP_SECONDS,
    }
}

fn default_downloader_resources() -> k8s_openapi::api::core::v1::ResourceRequirements {
    let r: BTreeMap<String, Quantity> = [
        ("cpu".to_string(), Quantity(DOWNLOADER_CPU.into())),
        ("memory".to_string(), Quantity(DOWNLOADER_MEMORY.into())),
    ]
    .into();
    k8s_openapi::api::core::v1::ResourceRequirements {
        requests: Some(r.clone()),
        limits: Some(r),
        ..Default::default()
    }
}

/// Where the checkpoint appears inside the container, plus the volume (or cache claim) behind it.
struct ModelVolume {
    model_path: String,
    volume: Option<Volume>,
    claim_template: Option<PersistentVolumeClaim>,
    init_container: Option<Container>,
}

fn hf_dir_name(repo: &str) -> String {
    repo.replace('/', "--")
}

/// Python run by the download init container; idempotent through a marker file.
fn download_script(input: &BuildInput) -> Option<(String, String)> {
    let source = &input.md.spec.model.source;
    if let Some(hf) = &source.hugging_face {
        let dir = format!("{MODEL_MOUNT}/{}", hf_dir_name(&hf.repo));
        let revision = hf.revision.clone().unwrap_or_else(|| "main".into());
        let script = format!(
            "set -eu\nif [ -f {dir}/.complete ]; then echo cached; exit 0; fi\n\
             pip install --no-cache-dir --quiet --target /tmp/pylib huggingface_hub=={HF_HUB_VERSION}\n\
             PYTHONPATH=/tmp/pylib python -c 'import sys; from huggingface_hub import snapshot_download; \
             snapshot_download(repo_id=sys.argv[1], revision=sys.argv[2], local_dir=sys.argv[3])' \
             '{}' '{revision}' '{dir}'\ntouch {dir}/.complete\n",
            hf.repo
        );
        return Some((dir, script));
    }
    source.url.as_ref().map(|url| {
        let file = url.url.rsplit('/').next().filter(|f| !f.is_empty()).unwrap_or("model.gguf");
        let dir = format!("{MODEL_MOUNT}/download");
        let script = format!(
            "set -eu\nmkdir -p {dir}\nif [ -f {dir}/.complete ]; then echo cached; exit 0; fi\n\
             python -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' \
             '{}' '{dir}/{file}'\ntouch {dir}/.complete\n",
            url.url
        );
        (format!("{dir}/{file}"), script)
    })
}

fn model_volume(
    input: &BuildInput,
    container_security: &SecurityContext,
) -> Result<ModelVolume, BuildError> {
    let source = &input.md.spec.model.source;
    if let Some(pvc) = &source.pvc {
        let sub = pvc.path.as_deref().unwrap_or("").trim_start_matches('/');
        return Ok(ModelVolume {
            model_path: if sub.is_empty() {
                MODEL_MOUNT.into()
            } else {
                format!("{MODEL_MOUNT}/{sub}")
            },
            volume: Some(Volume {
                name: "model".into(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: pvc.claim_name.clone(),
                    read_only: Some(true),
                }),
                ..Default::default()
            }),
            claim_template: None,
            init_container: None,
        });
    }
    if let Some(host) = &source.host_path {
        return Ok(ModelVolume {
            model_path: MODEL_MOUNT.into(),
            volume: Some(Volume {
                name: "model".into(),
                host_path: Some(HostPathVolumeSource {
                    path: host.path.clone(),
                    type_: Some("Directory".into()),
                }),
                ..Default::default()
            }),
            claim_template: None,
            init_container: None,
        });
    }
    let (model_path, script) = download_script(input).ok_or(BuildError::NoModelSource)?;
    let cache = input
        .md
        .spec
        .model
        .cache
        .clone()
        .unwrap_or(crate::crd::ModelCache {
            size: None,
            storage_class_name: None,
        });
    let size = match (&cache.size, &input.shape) {
        (Some(size), _) => size.clone(),
        // Checkpoint plus 10%, whole GiB.
        (None, Some(shape)) => bytes_quantity(
            (shape.checkpoint_bytes() + shape.checkpoint_bytes() / 10).div_ceil(GIB) * GIB,
        ),
        (None, None) => return Err(BuildError::CacheSizeNeedsShape),
    };
    let claim_template = PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some(CACHE_VOLUME.into()),
            ..Default::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec!["ReadWriteOnce".into()]),
            storage_class_name: cache.storage_class_name.clone(),
            resources: Some(VolumeResourceRequirements {
                requests: Some([("storage".to_string(), size)].into()),
                limits: None,
            }),
            ..Default::default()
        }),
        status: None,
    };
    let mut env = vec![EnvVar {
        name: "HOME".into(),
        value: Some("/tmp".into()),
        value_from: None,
    }];
    if let Some(token) = source
        .hugging_face
        .as_ref()
        .and_then(|h| h.token_secret.clone())
    {
        env.push(EnvVar {
            name: "HF_TOKEN".into(),
            value: None,
            value_from: Some(EnvVarSource {
                secret_key_ref: Some(token),
                ..Default::default()
            }),
        });
    }
    let init = Container {
        name: "fetch-model".into(),
        image: Some(DOWNLOADER_IMAGE.into()),
        command: Some(vec!["/bin/sh".into(), "-c".into(), script]),
        env: Some(env),
        resources: Some(
            input
                .md
                .spec
                .pod
                .downloader_resources
                .clone()
                .unwrap_or_else(default_downloader_resources),
        ),
        security_context: Some(SecurityContext {
            read_only_root_filesystem: Some(false),
            ..container_security.clone()
        }),
        volume_mounts: Some(vec![
            VolumeMount {
                name: CACHE_VOLUME.into(),
                mount_path: MODEL_MOUNT.into(),
                ..Default::default()
            },
            VolumeMount {
                name: "tmp".into(),
                mount_path: "/tmp".into(),
                ..Default::default()
            },
        ]),
        ..Default::default()
    };
    Ok(ModelVolume {
        model_path,
        volume: None,
        claim_template: Some(claim_template),
        init_container: Some(init),
    })
}

/// `moe-daemon serve` arguments; the contract is listed in docs/OPERATOR.md.
pub fn daemon_args(input: &BuildInput, class: &ClassBuild, model_path: &str) -> Vec<String> {
    let spec = &input.md.spec;
    let sizing = &class.sizing;
    // Placement rules are resolved against the model's tensor names by the daemon, which counts the
    // experts they pin to the GPU in its plan: with rules and an `auto` count the daemon fills each
    // layer around the pins within the same budget and KV size (its plan logs the count it chose).
    let rules_pick = spec.placement.rules.is_some()
        && matches!(
            spec.placement.gpu_experts_per_layer,
            crate::crd::AutoOr::Auto
        );
    let gpu_experts = match sizing.gpu_experts_per_layer {
        Some(n) if !rules_pick => n.to_string(),
        _ => "auto".to_string(),
    };
    let hugepages = sizing
        .hugepages
        .map_or("off", |(kind, _)| kind.daemon_arg());
    let numa = match spec.placement.numa {
        NumaPolicy::Auto => "auto",
        NumaPolicy::Off => "off",
    };
    [
        "serve",
        "--model",
        model_path,
        "--served-model-name",
        &input.md.served_name(),
        "--weight-format",
        spec.model.weight_format.as_arg(),
        "--gpu-experts",
        &gpu_experts,
        "--expert-placement",
        spec.placement.expert_placement.as_arg(),
        "--cpu-threads",
        &sizing.cpu_threads.to_string(),
        "--numa",
        numa,
        "--hugepages",
        hugepages,
        "--max-model-len",
        &spec.serving.max_model_len.to_string(),
        "--max-num-seqs",
        &spec.serving.max_num_seqs.to_string(),
        "--max-num-batched-tokens",
        &spec.serving.max_num_batched_tokens.to_string(),
        "--port",
        &HTTP_PORT.to_string(),
        // listen on the pod IP (the daemon defaults to loopback); the GPU runs attention and hot experts
        "--host",
        "0.0.0.0",
        "--device",
        "cuda",
        // the pod's GPUs run the model together (heads and dense projections split, experts spread)
        "--tensor-parallel",
        &spec.resources.gpu.count.max(1).to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .chain(gpu_plan_args(sizing))
    .chain(placement_rule_args(&spec.placement))
    .chain(
        class_rules(input, class)
            .into_iter()
            .flat_map(|r| ["--placement-rules".to_string(), r.path()]),
    )
    .chain(
        spec.placement
            .live_placement
            .then(|| "--live-placement".to_string()),
    )
    .collect()
}

/// The shared memory plan's choices as daemon flags, so the daemon plans exactly what the operator
/// sized (none when the shape is only known by byte counts: the daemon then plans on its own).
fn gpu_plan_args(sizing: &Sizing) -> Vec<String> {
    let Some(p) = &sizing.gpu_plan else {
        return Vec::new();
    };
    vec![
        "--dense-dtype".into(),
        p.dense_dtype.as_str().into(),
        "--host-embeddings".into(),
        if p.host_embeddings { "on" } else { "off" }.into(),
        "--kv-cache-tokens".into(),
        p.kv_tokens.to_string(),
        "--gpu-memory-limit".into(),
        format!("{}MiB", p.gpu_memory_bytes >> 20),
    ]
}

/// Where a ConfigMap's rule file is mounted in the daemon container.
pub const RULES_MOUNT: &str = "/etc/moe/placement";
const RULES_VOLUME: &str = "placement-rules";
/// The daemon reads inline rules from this variable (`moe-daemon --placement-rules-yaml`).
pub const RULES_ENV: &str = "MOE_PLACEMENT_RULES";

/// `--placement-rules` for a ConfigMap's rule file (inline rules travel in [`RULES_ENV`], which the
/// daemon tries first); the class's own rule file comes after it.
fn placement_rule_args(p: &crate::crd::PlacementSpec) -> Vec<String> {
    let mut args = Vec::new();
    if p.rules.as_ref().is_some_and(|r| r.config_map_ref.is_some()) {
        args.push("--placement-rules".to_string());
        args.push(format!("{RULES_MOUNT}/rules.yaml"));
    }
    args
}

/// The rule set's volume, mount and environment (none without rules).
fn placement_rules_plumbing(
    p: &crate::crd::PlacementSpec,
) -> (Option<Volume>, Option<VolumeMount>, Option<EnvVar>) {
    let Some(rules) = &p.rules else {
        return (None, None, None);
    };
    if let Some(cm) = &rules.config_map_ref {
        let volume = Volume {
            name: RULES_VOLUME.into(),
            config_map: Some(k8s_openapi::api::core::v1::ConfigMapVolumeSource {
                name: cm.name.clone(),
                items: Some(vec![k8s_openapi::api::core::v1::KeyToPath {
                    key: cm.key.clone(),
                    path: "rules.yaml".into(),
                    ..Default::default()
                }]),
                // the pod waits (ContainerCreating, with an event) until the ConfigMap exists
                optional: Some(false),
                ..Default::default()
            }),
            ..Default::default()
        };
        let mount = VolumeMount {
            name: RULES_VOLUME.into(),
            mount_path: RULES_MOUNT.into(),
            read_only: Some(true),
            ..Default::default()
        };
        return (Some(volume), Some(mount), None);
    }
    let env = rules.inline.as_ref().map(|text| EnvVar {
        name: RULES_ENV.into(),
        value: Some(text.clone()),
        value_from: None,
    });
    (None, None, env)
}

pub(crate) fn http_probe(path: &str, period: i32, failures: i32, timeout: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::String("http".into()),
            ..Default::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        timeout_seconds: Some(timeout),
        ..Default::default()
    }
}

pub(crate) fn container_security_context() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        privileged: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            add: None,
        }),
        ..Default::default()
    }
}

/// Requests = limits, whole CPUs: the pod lands in the Guaranteed QoS class and, with the static
/// CPU manager policy, gets exclusive cores for the expert worker threads.
fn guaranteed_resources(input: &BuildInput, class: &ClassBuild) -> BTreeMap<String, Quantity> {
    let sizing = &class.sizing;
    let mut r: BTreeMap<String, Quantity> = BTreeMap::new();
    r.insert("cpu".into(), Quantity(sizing.cpus.to_string()));
    r.insert("memory".into(), bytes_quantity(sizing.memory_bytes));
    r.insert(
        RESOURCE_GPU.into(),
        Quantity(input.md.spec.resources.gpu.count.to_string()),
    );
    if let Some((kind, bytes)) = sizing.hugepages {
        r.insert(kind.resource_name().into(), bytes_quantity(bytes));
    }
    r
}

fn affinity(input: &BuildInput, class: &ClassBuild) -> Affinity {
    let user = input.md.spec.pod.affinity.clone().unwrap_or_default();
    // One replica per node is preferred: each pod wants most of a node's DRAM and GPU.
    let spread = WeightedPodAffinityTerm {
        weight: 100,
        pod_affinity_term: PodAffinityTerm {
            label_selector: Some(LabelSelector {
                match_labels: Some(input.selector_labels()),
                match_expressions: None,
            }),
            topology_key: "kubernetes.io/hostname".into(),
            ..Default::default()
        },
    };
    let mut anti = user.pod_anti_affinity.unwrap_or_default();
    anti.preferred_during_scheduling_ignored_during_execution
        .get_or_insert_with(Vec::new)
        .push(spread);
    Affinity {
        node_affinity: merge_node_affinity(
            user.node_affinity.as_ref(),
            class.node_affinity.clone(),
        ),
        pod_affinity: user.pod_affinity,
        pod_anti_affinity: Some(anti),
    }
}

/// The StatefulSet of one hardware class: that class's sizing and node affinity, its share of the
/// replicas, and pods labelled with the class so each StatefulSet selects only its own.
pub fn statefulset(
    input: &BuildInput,
    class: &ClassBuild,
    replicas: i32,
) -> Result<StatefulSet, BuildError> {
    let spec = &input.md.spec;
    let security = container_security_context();
    let model = model_volume(input, &security)?;
    let budget = startup_budget_seconds(input);
    let startup_failures = budget.div_ceil(STARTUP_PROBE_PERIOD_SECONDS as u64).max(1) as i32;

    let mut volumes = vec![Volume {
        name: "tmp".into(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Default::default()
    }];
    let mut mounts = vec![VolumeMount {
        name: "tmp".into(),
        mount_path: "/tmp".into(),
        ..Default::default()
    }];
    volumes.extend(model.volume.clone());
    mounts.push(VolumeMount {
        name: if model.claim_template.is_some() {
            CACHE_VOLUME.into()
        } else {
            "model".into()
        },
        mount_path: MODEL_MOUNT.into(),
        read_only: Some(true),
        ..Default::default()
    });
    if let Some((kind, _)) = class.sizing.hugepages {
        let medium = match kind {
            crate::placement::sizing::HugepageKind::OneGi => "HugePages-1Gi",
            crate::placement::sizing::HugepageKind::TwoMi => "HugePages-2Mi",
        };
        volumes.push(Volume {
            name: "hugepages".into(),
            empty_dir: Some(EmptyDirVolumeSource {
                medium: Some(medium.into()),
                ..Default::default()
            }),
            ..Default::default()
        });
        mounts.push(VolumeMount {
            name: "hugepages".into(),
            mount_path: HUGEPAGES_MOUNT.into(),
            ..Default::default()
        });
    }

    let (rules_volume, rules_mount, rules_env) = placement_rules_plumbing(&spec.placement);
    volumes.extend(rules_volume);
    mounts.extend(rules_mount);
    let class_rules = class_rules(input, class);
    if let Some(r) = &class_rules {
        volumes.push(r.volume());
        mounts.push(r.mount());
    }
    let mut env = vec![EnvVar {
        name: "POD_NAME".into(),
        value: None,
        value_from: Some(EnvVarSource {
            field_ref: Some(k8s_openapi::api::core::v1::ObjectFieldSelector {
                field_path: "metadata.name".into(),
                api_version: None,
            }),
            ..Default::default()
        }),
    }];
    env.extend(rules_env);
    env.extend(spec.pod.env.iter().cloned());

    let resources = guaranteed_resources(input, class);
    let daemon = Container {
        name: DAEMON_CONTAINER.into(),
        image: Some(
            spec.pod
                .image
                .clone()
                .unwrap_or_else(|| DEFAULT_IMAGE.into()),
        ),
        image_pull_policy: spec.pod.image_pull_policy.clone(),
        command: Some(vec!["moe-daemon".into()]),
        args: Some(daemon_args(input, class, &model.model_path)),
        ports: Some(vec![ContainerPort {
            name: Some("http".into()),
            container_port: HTTP_PORT,
            protocol: Some("TCP".into()),
            ..Default::default()
        }]),
        env: Some(env),
        resources: Some(k8s_openapi::api::core::v1::ResourceRequirements {
            requests: Some(resources.clone()),
            limits: Some(resources),
            ..Default::default()
        }),
        startup_probe: Some(http_probe(
            "/ready",
            STARTUP_PROBE_PERIOD_SECONDS,
            startup_failures,
            5,
        )),
        readiness_probe: Some(http_probe("/ready", 5, 3, 5)),
        liveness_probe: Some(http_probe("/health", 10, 3, 5)),
        security_context: Some(security),
        volume_mounts: Some(mounts),
        ..Default::default()
    };

    let mut pod_annotations = spec.pod.annotations.clone();
    if let Some(r) = &class_rules {
        pod_annotations.insert(RULES_HASH_ANNOTATION.into(), r.hash());
    }
    let mut pod_labels = spec.pod.labels.clone();
    pod_labels.extend(input.labels());
    pod_labels.extend(input.class_selector_labels(class));
    let pod_spec = PodSpec {
        containers: vec![daemon],
        init_containers: model.init_container.map(|c| vec![c]),
        volumes: Some(volumes),
        affinity: Some(affinity(input, class)),
        tolerations: Some(effective_tolerations(spec)),
        node_selector: (!spec.pod.node_selector.is_empty()).then(|| spec.pod.node_selector.clone()),
        priority_class_name: spec.pod.priority_class_name.clone(),
        runtime_class_name: spec.pod.runtime_class_name.clone(),
        image_pull_secrets: (!spec.pod.image_pull_secrets.is_empty())
            .then(|| spec.pod.image_pull_secrets.clone()),
        service_account_name: spec.pod.service_account_name.clone(),
        automount_service_account_token: Some(false),
        enable_service_links: Some(false),
        termination_grace_period_seconds: Some(60),
        security_context: Some(PodSecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(NON_ROOT_UID),
            run_as_group: Some(NON_ROOT_UID),
            fs_group: Some(NON_ROOT_UID),
            // Without this the kubelet re-chowns every file of a cache of hundreds of GB at each start.
            fs_group_change_policy: Some("OnRootMismatch".into()),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".into(),
                localhost_profile: None,
            }),
            ..Default::default()
        }),
        ..Default::default()
    };

    Ok(StatefulSet {
        metadata: input.object_meta(input.statefulset_name(class)),
        spec: StatefulSetSpec {
            replicas: Some(replicas),
            service_name: Some(input.headless_service_name()),
            pod_management_policy: Some("Parallel".into()),
            selector: LabelSelector {
                match_labels: Some(input.class_selector_labels(class)),
                match_expressions: None,
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    annotations: (!pod_annotations.is_empty()).then_some(pod_annotations),
                    ..Default::default()
                }),
                spec: Some(pod_spec),
            },
            volume_claim_templates: model.claim_template.map(|c| vec![c]),
            // Download caches belong to the MoEDeployment: delete them with it, keep them on scale-down.
            persistent_volume_claim_retention_policy: Some(
                StatefulSetPersistentVolumeClaimRetentionPolicy {
                    when_deleted: Some("Delete".into()),
                    when_scaled: Some("Retain".into()),
                },
            ),
            ..Default::default()
        },
        status: None,
    })
}
