//! The placement rule set the operator writes for each hardware class: what its sizing decided, in the
//! daemon's `--placement-rules` format (docs/PLACEMENT.md), delivered as a ConfigMap mounted into the
//! class's pods. The daemon tries it after the deployment's own rules (`spec.placement.rules`: first
//! match wins, the user's first) and prints, at start, each rule with its source and the file's
//! leading comment, which names the node class and the sizing figures that produced it.
//!
//! What the rules say follows from the sizing and from what the daemon may still change:
//! - every routed expert fits on the GPU: `decode: gpu` for all;
//! - none fits: `decode: cpu` for all;
//! - some fit, `uniform` placement, no rules of the user's and no live placement: the lowest `N` expert
//!   ids of every MoE layer on the GPU, the rest in DRAM (exactly what `uniform` places, now pinned and
//!   named in the plan);
//! - otherwise `decode: auto`: the strategy (frequency, front-loading, random, live re-placement, or a
//!   refit around the user's pins) picks which experts, as many as the sizing allows.
//!
//! Pure: the same deployment, class and sizing always give the same text (no node names or counts, so
//! that a node joining the class does not change the file of running pods).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use k8s_openapi::api::core::v1::{
    ConfigMap, ConfigMapVolumeSource, KeyToPath, Volume, VolumeMount,
};

use super::{BuildInput, ClassBuild, LABEL_HARDWARE_CLASS};
use crate::crd::{AutoOr, ExpertPlacementStrategy};
use crate::placement::sizing::Sizing;
use crate::quantity::{format_bytes, MIB};

/// Where the class's rule file is mounted in the daemon container (`<dir>/<class id>.yaml`, so the
/// daemon's plan names the class in each rule's source).
pub const CLASS_RULES_MOUNT: &str = "/etc/moe/class-rules";
const CLASS_RULES_VOLUME: &str = "class-placement-rules";
/// Pod-template annotation holding a hash of the class's rule file: a changed file rolls the pods,
/// so that what a daemon logs at start is what its class's ConfigMap says.
pub const RULES_HASH_ANNOTATION: &str = "moe.inference.dev/class-rules-hash";

/// The rendered rule set of one class.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClassRules {
    pub config_map_name: String,
    /// The ConfigMap key and file name: `<class id>.yaml`.
    pub key: String,
    pub text: String,
}

impl ClassRules {
    /// Where the daemon reads the file.
    pub fn path(&self) -> String {
        format!("{CLASS_RULES_MOUNT}/{}", self.key)
    }

    /// FNV-1a of the text, hex (stable across builds, as the StatefulSet name hash).
    pub fn hash(&self) -> String {
        let h = self.text.bytes().fold(0xcbf29ce484222325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100000001b3)
        });
        format!("{h:016x}")
    }

    pub fn volume(&self) -> Volume {
        Volume {
            name: CLASS_RULES_VOLUME.into(),
            config_map: Some(ConfigMapVolumeSource {
                name: self.config_map_name.clone(),
                items: Some(vec![KeyToPath {
                    key: self.key.clone(),
                    path: self.key.clone(),
                    ..Default::default()
                }]),
                optional: Some(false),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    pub fn mount(&self) -> VolumeMount {
        VolumeMount {
            name: CLASS_RULES_VOLUME.into(),
            mount_path: CLASS_RULES_MOUNT.into(),
            read_only: Some(true),
            ..Default::default()
        }
    }
}

/// What the class's rules decide for the routed experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    AllGpu,
    AllDram,
    /// The lowest `n` expert ids of each MoE layer on the GPU, the rest in DRAM.
    LowestOnGpu(u32),
    /// `n` per layer, chosen by the placement strategy.
    Strategy(u32),
}

fn layout(input: &BuildInput, sizing: &Sizing, experts: u32) -> Option<Layout> {
    let n = sizing.gpu_experts_per_layer?.min(experts);
    let p = &input.md.spec.placement;
    Some(if n == experts {
        Layout::AllGpu
    } else if n == 0 {
        Layout::AllDram
    } else if p.expert_placement == ExpertPlacementStrategy::Uniform
        && p.rules.is_none()
        && !p.live_placement
    {
        Layout::LowestOnGpu(n)
    } else {
        Layout::Strategy(n)
    })
}

/// The class's rule set; `None` when the sizing fixed no expert count or the model's experts are not
/// known (the daemon then sizes alone, from `--gpu-experts auto`).
pub fn class_rules(input: &BuildInput, class: &ClassBuild) -> Option<ClassRules> {
    let shape = input.shape.as_ref()?;
    let experts = shape.experts_per_layer;
    if experts == 0 || shape.moe_layers == 0 {
        return None;
    }
    let layout = layout(input, &class.sizing, experts)?;
    let mut text = header(input, class, layout, experts, shape.moe_layers);
    let rule = |text: &mut String, matcher: &str, decode: &str| {
        let _ = writeln!(text, "- match: {matcher}\n  decode: {decode}");
    };
    match layout {
        Layout::AllGpu => rule(&mut text, "{name: \".*\"}", "gpu"),
        Layout::AllDram => rule(&mut text, "{name: \".*\"}", "cpu"),
        Layout::LowestOnGpu(n) => {
            let ids = if n == 1 {
                "0".to_string()
            } else {
                format!("0-{}", n - 1)
            };
            rule(&mut text, &format!("{{experts: \"{ids}\"}}"), "gpu");
            rule(&mut text, "{name: \".*\"}", "cpu");
        }
        Layout::Strategy(_) => rule(&mut text, "{name: \".*\"}", "auto"),
    }
    Some(ClassRules {
        config_map_name: format!("{}-placement", input.statefulset_name(class)),
        key: format!("{}.yaml", class.id),
        text,
    })
}

/// The leading comment: which deployment and node class, and the sizing figures behind the rules.
fn header(
    input: &BuildInput,
    class: &ClassBuild,
    layout: Layout,
    experts: u32,
    moe_layers: u32,
) -> String {
    let spec = &input.md.spec;
    let sizing = &class.sizing;
    let mut h = String::new();
    let _ = writeln!(
        h,
        "# Written by moe-operator for MoEDeployment {}/{}, node class {}:",
        input.namespace,
        input.name(),
        class.id
    );
    let _ = writeln!(h, "# {}.", class.description);
    let asked = match spec.placement.gpu_experts_per_layer {
        AutoOr::Auto => "gpuExpertsPerLayer auto".to_string(),
        AutoOr::Count(n) => format!("gpuExpertsPerLayer {n}"),
    };
    let n = match layout {
        Layout::AllGpu => experts,
        Layout::AllDram => 0,
        Layout::LowestOnGpu(n) | Layout::Strategy(n) => n,
    };
    let _ = writeln!(
        h,
        "# Sizing ({asked}): {n} of {experts} routed experts per layer on the GPU, {moe_layers} MoE layers."
    );
    if let Some(p) = &sizing.gpu_plan {
        let embeddings = if p.host_embeddings {
            "in host memory"
        } else {
            "on the GPU"
        };
        let _ = writeln!(
            h,
            "# GPU plan: {} MiB of {} MiB per GPU; dense weights {}, embeddings {embeddings}, KV cache {} positions.",
            sizing.gpu_bytes_per_gpu.div_ceil(MIB),
            p.gpu_memory_bytes / MIB,
            p.dense_dtype.as_str(),
            p.kv_tokens
        );
    }
    let hugepages = sizing
        .hugepages
        .map_or("no hugepages".to_string(), |(k, b)| {
            format!("{} of {}", format_bytes(b), k.resource_name())
        });
    let _ = writeln!(
        h,
        "# CPU: {} worker threads on {} whole CPUs; {} DRAM, {hugepages}.",
        sizing.cpu_threads,
        sizing.cpus,
        format_bytes(sizing.memory_bytes)
    );
    let who = match layout {
        Layout::AllGpu | Layout::AllDram | Layout::LowestOnGpu(_) => {
            "these rules pin every routed expert".to_string()
        }
        Layout::Strategy(_) if spec.placement.live_placement => {
            "live re-placement moves experts with the traffic".to_string()
        }
        Layout::Strategy(_) if spec.placement.rules.is_some() => format!(
            "the daemon refits the count around the deployment's rules ({} placement)",
            spec.placement.expert_placement.as_arg()
        ),
        Layout::Strategy(_) => format!(
            "{} placement picks which experts",
            spec.placement.expert_placement.as_arg()
        ),
    };
    let _ = writeln!(h, "# Experts: {who}.");
    if spec.placement.rules.is_some() {
        let _ = writeln!(
            h,
            "# Tried after the deployment's own rules (spec.placement.rules): the first match wins."
        );
    }
    h
}

/// The ConfigMap carrying a class's rule file, labelled with the deployment and class.
pub fn config_map(input: &BuildInput, class: &ClassBuild, rules: &ClassRules) -> ConfigMap {
    let mut meta = input.object_meta(rules.config_map_name.clone());
    if let Some(labels) = meta.labels.as_mut() {
        labels.insert(LABEL_HARDWARE_CLASS.into(), class.id.clone());
    }
    ConfigMap {
        metadata: meta,
        data: Some(BTreeMap::from([(rules.key.clone(), rules.text.clone())])),
        ..Default::default()
    }
}
