//! The `MoEDeployment` custom resource (group `moe.inference.dev`, version `v1alpha1`).
//!
//! Spec and status types with their OpenAPI schema (schemars) and the CEL rules the apiserver
//! enforces (`x-kubernetes-validations`). `crate::validate` mirrors the CEL rules in Rust so that
//! `moe-operator plan` and the reconciler reject the same specs offline.

// `#[kube(printcolumn(..))]` repeats `type_ = ..` per column, which clippy reads as duplicates.
#![allow(clippy::duplicated_attributes)]

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, EnvVar, LocalObjectReference, ResourceRequirements, SecretKeySelector, Toleration,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, CustomResourceExt, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub const API_GROUP: &str = "moe.inference.dev";
/// Accepted GPU compute capabilities when the spec names none: Ada (8.9), Hopper (9.0), Blackwell (12.x).
pub const DEFAULT_COMPUTE_CAPABILITIES: [&str; 3] = ["8.9", "9.0", "12.x"];
/// The daemon image of this release (a fixed tag: `:latest` would let nodes run different builds).
pub const DEFAULT_IMAGE: &str =
    concat!("ghcr.io/moe-hybrid/moe-daemon:", env!("CARGO_PKG_VERSION"));

/// A Mixture-of-Experts model served by `moe-daemon` on CPU+GPU hybrid nodes.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "moe.inference.dev",
    version = "v1alpha1",
    kind = "MoEDeployment",
    plural = "moedeployments",
    shortname = "moed",
    category = "moe",
    namespaced,
    status = "MoEDeploymentStatus",
    derive = "PartialEq",
    doc = "MoEDeployment runs a Mixture-of-Experts model with moe-daemon on nodes that have enough DRAM, AVX-512 and a supported NVIDIA GPU.",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    printcolumn(name = "Model", type_ = "string", json_path = ".spec.model.servedName"),
    printcolumn(name = "Replicas", type_ = "integer", json_path = ".status.replicas"),
    printcolumn(name = "Ready", type_ = "integer", json_path = ".status.readyReplicas"),
    printcolumn(
        name = "Status",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].reason"
    ),
    printcolumn(
        name = "Endpoint",
        type_ = "string",
        json_path = ".status.endpoint",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(
    validation = Rule::new("!has(self.model.cache) || has(self.model.source.huggingFace) || has(self.model.source.url)").message("model.cache is only used with a huggingFace or url source"),
    validation = Rule::new("has(self.model.cache) == has(oldSelf.model.cache)").message("model.cache cannot be added or removed (it is the StatefulSet's volume claim template); create a new MoEDeployment"),
)]
#[serde(rename_all = "camelCase")]
pub struct MoEDeploymentSpec {
    pub model: ModelSpec,
    /// Desired replica count; autoscalers write it through the scale subresource. Defaults to 1 so
    /// that the scale subresource never reads 0 for a new object (an HPA disables itself at 0).
    #[serde(default = "default_replicas", skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0").message("replicas must not be negative"))]
    pub replicas: Option<i32>,
    #[serde(default)]
    pub placement: PlacementSpec,
    #[serde(default)]
    pub resources: ResourceSpec,
    #[serde(default)]
    pub serving: ServingSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<AutoscalingSpec>,
    #[serde(default)]
    pub pod: PodOverrides,
    /// Seconds the pod may take to load the model before the startup probe gives up.
    /// Derived from the checkpoint size when unset (see docs/OPERATOR.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 30 && self <= 86400").message("startupBudgetSeconds must be within 30..86400"))]
    pub startup_budget_seconds: Option<u32>,
}

fn default_replicas() -> Option<i32> {
    Some(1)
}

/// What to serve and where its weights come from.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ModelSpec {
    /// Where the checkpoint lives. Immutable: create a new MoEDeployment to change models.
    #[x_kube(validation = Rule::new("self == oldSelf").message("model.source is immutable"))]
    pub source: ModelSource,
    /// Name clients pass as `model` in OpenAI requests; defaults to the resource name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_name: Option<String>,
    #[serde(default)]
    pub weight_format: WeightFormat,
    /// Model shape used to size placement; a built-in table covers well-known models.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<ModelShape>,
    /// Per-replica cache volume that a download init container fills (huggingFace / url sources).
    /// Immutable, like the StatefulSet volume claim template it becomes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self == oldSelf").message("model.cache is immutable"))]
    pub cache: Option<ModelCache>,
}

/// Exactly one source must be set.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[x_kube(validation = Rule::new("[has(self.huggingFace), has(self.pvc), has(self.hostPath), has(self.url)].filter(x, x).size() == 1").message("exactly one of huggingFace, pvc, hostPath, url must be set"))]
#[serde(rename_all = "camelCase")]
pub struct ModelSource {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hugging_face: Option<HuggingFaceSource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pvc: Option<PvcSource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<HostPathSource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<UrlSource>,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HuggingFaceSource {
    /// Repository id, e.g. `Qwen/Qwen3-30B-A3B`.
    #[schemars(length(min = 3))]
    pub repo: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// Secret key holding a Hugging Face token for gated repositories.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_secret: Option<SecretKeySelector>,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PvcSource {
    #[schemars(length(min = 1))]
    pub claim_name: String,
    /// Directory of the checkpoint inside the volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HostPathSource {
    /// Absolute directory of the checkpoint on every eligible node.
    #[schemars(regex(pattern = r"^/"))]
    pub path: String,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct UrlSource {
    /// HTTP(S) URL of a single-file checkpoint (e.g. a GGUF file).
    #[schemars(regex(pattern = r"^https?://"))]
    pub url: String,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ModelCache {
    /// Cache volume size; derived from the model shape when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<Quantity>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_class_name: Option<String>,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum WeightFormat {
    #[default]
    Safetensors,
    Gguf,
}

impl WeightFormat {
    pub fn as_arg(self) -> &'static str {
        match self {
            WeightFormat::Safetensors => "safetensors",
            WeightFormat::Gguf => "gguf",
        }
    }
}

/// Shape numbers placement needs. Byte counts are for the weights as stored.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ModelShape {
    /// Number of MoE layers.
    #[schemars(range(min = 1))]
    pub moe_layers: u32,
    /// Routed experts per MoE layer.
    #[schemars(range(min = 1))]
    pub experts_per_layer: u32,
    /// Bytes of one routed expert (gate, up and down projections).
    #[schemars(range(min = 1))]
    pub expert_bytes: u64,
    /// Bytes of everything that is not a routed expert (attention, embeddings, shared experts).
    pub dense_bytes: u64,
    /// KV cache bytes per token of context, summed over layers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_bytes_per_token: Option<u64>,
}

/// `auto` or a non-negative integer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum AutoOr {
    #[default]
    Auto,
    Count(u32),
}

impl Serialize for AutoOr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            AutoOr::Auto => s.serialize_str("auto"),
            AutoOr::Count(n) => s.serialize_u32(*n),
        }
    }
}

impl<'de> Deserialize<'de> for AutoOr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Count(u32),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Count(n) => Ok(AutoOr::Count(n)),
            Raw::Text(t) if t == "auto" => Ok(AutoOr::Auto),
            Raw::Text(t) => t.parse().map(AutoOr::Count).map_err(|_| {
                serde::de::Error::custom(format!(
                    "expected \"auto\" or a non-negative integer, got {t:?}"
                ))
            }),
        }
    }
}

impl JsonSchema for AutoOr {
    fn schema_name() -> Cow<'static, str> {
        "AutoOr".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "\"auto\" or a non-negative integer.",
            "x-kubernetes-int-or-string": true,
            "x-kubernetes-validations": [{
                "rule": "string(self) == 'auto' || (int(self) >= 0 && int(self) <= 4294967295)",
                "message": "must be \"auto\" or a non-negative integer"
            }]
        })
    }
}

impl std::fmt::Display for AutoOr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AutoOr::Auto => f.write_str("auto"),
            AutoOr::Count(n) => write!(f, "{n}"),
        }
    }
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PlacementSpec {
    /// Routed experts per layer kept on the GPU, or `auto` to fill the GPU after dense weights and KV.
    #[serde(default)]
    pub gpu_experts_per_layer: AutoOr,
    /// Which experts go to the GPU.
    #[serde(default)]
    pub expert_placement: ExpertPlacementStrategy,
    /// CPU worker threads (= whole CPUs requested minus one), or `auto`.
    #[serde(default)]
    pub cpu_threads: AutoOr,
    #[serde(default)]
    pub numa: NumaPolicy,
    #[serde(default)]
    pub hugepages: HugepagesSpec,
    /// Placement rules for the daemon (`--placement-rules`, docs/PLACEMENT.md): pin experts to the
    /// GPU or DRAM, choose where long prompts compute them and their DRAM format. Read by the daemon at
    /// start; it logs the resulting plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rules: Option<PlacementRulesSpec>,
    /// Move experts between DRAM and the GPU while serving, following the recent routing
    /// (`--live-placement`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub live_placement: bool,
}

/// Longest inline rule set: a rule file is small, and the bound keeps the API server's CEL cost
/// estimate and the pod's environment small.
pub const MAX_INLINE_RULES_BYTES: usize = 65536;

/// Where the rule file comes from: written inline, or a key of a ConfigMap in the namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = Rule::new("has(self.inline) != has(self.configMapRef)").message("placement.rules takes exactly one of inline, configMapRef"))]
#[serde(rename_all = "camelCase")]
pub struct PlacementRulesSpec {
    /// The rule file's text (a YAML list of rules), at most 64 KiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 65536))]
    pub inline: Option<String>,
    /// A ConfigMap in the MoEDeployment's namespace holding the rule file (mounted into the pods;
    /// edits reach the daemon when its pods restart).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map_ref: Option<RulesConfigMapRef>,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RulesConfigMapRef {
    /// ConfigMap name (a DNS-1123 subdomain).
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    )]
    pub name: String,
    /// Key of the rule file in the ConfigMap.
    #[serde(default = "default_rules_key")]
    #[schemars(length(min = 1, max = 253), regex(pattern = r"^[-._a-zA-Z0-9]+$"))]
    pub key: String,
}

fn default_rules_key() -> String {
    "rules.yaml".into()
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum ExpertPlacementStrategy {
    Uniform,
    #[default]
    Frequency,
    FrontLoading,
    Random,
}

impl ExpertPlacementStrategy {
    pub fn as_arg(self) -> &'static str {
        match self {
            Self::Uniform => "uniform",
            Self::Frequency => "frequency",
            Self::FrontLoading => "front-loading",
            Self::Random => "random",
        }
    }
}

/// `none` rather than `off`: YAML 1.1 readers (kubectl, Helm) turn a bare `off` into `false`.
/// A quoted `"off"` is still read, for specs written before the rename.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum NumaPolicy {
    #[default]
    #[serde(rename = "auto")]
    Auto,
    #[serde(rename = "none", alias = "off")]
    Off,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[x_kube(validation = Rule::new("!has(self.amount) || self.size == '1Gi' || self.size == '2Mi'").message("hugepages.amount needs size 1Gi or 2Mi"))]
#[serde(rename_all = "camelCase")]
pub struct HugepagesSpec {
    #[serde(default)]
    pub size: HugepageSize,
    /// Hugepage memory per pod; derived from the CPU-resident expert bytes when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub amount: Option<Quantity>,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum HugepageSize {
    #[default]
    #[serde(rename = "auto")]
    Auto,
    #[serde(rename = "1Gi")]
    OneGi,
    #[serde(rename = "2Mi")]
    TwoMi,
    /// No hugepages (`none`; see [`NumaPolicy`] for why not `off`).
    #[serde(rename = "none", alias = "off")]
    Off,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ResourceSpec {
    /// DRAM per pod (requests = limits), excluding hugepages; derived from the model when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<Quantity>,
    #[serde(default)]
    pub gpu: GpuSpec,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct GpuSpec {
    #[serde(default = "default_gpu_count")]
    #[schemars(range(min = 1, max = 16))]
    pub count: u32,
    /// Accepted compute capabilities as `major.minor` or `major.x`, matched against GPU Feature Discovery labels.
    #[serde(default = "default_compute_capabilities")]
    #[schemars(length(min = 1), inner(regex(pattern = r"^[0-9]+\.([0-9]+|x)$")))]
    pub compute_capabilities: Vec<String>,
    /// Minimum memory per GPU in MiB (label `nvidia.com/gpu.memory`).
    #[serde(
        default,
        rename = "minMemoryMiB",
        skip_serializing_if = "Option::is_none"
    )]
    pub min_memory_mib: Option<u64>,
}

fn default_gpu_count() -> u32 {
    1
}

fn default_compute_capabilities() -> Vec<String> {
    DEFAULT_COMPUTE_CAPABILITIES
        .iter()
        .map(|s| s.to_string())
        .collect()
}

impl Default for GpuSpec {
    fn default() -> Self {
        Self {
            count: default_gpu_count(),
            compute_capabilities: default_compute_capabilities(),
            min_memory_mib: None,
        }
    }
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ServingSpec {
    /// Context length (prompt + output tokens).
    #[serde(default = "default_max_model_len")]
    #[schemars(range(min = 256))]
    pub max_model_len: u32,
    /// Sequences decoded together (max batch).
    #[serde(default = "default_max_num_seqs")]
    #[schemars(range(min = 1, max = 4096))]
    pub max_num_seqs: u32,
    /// Token budget per engine step (prefill chunk size).
    #[serde(default = "default_max_num_batched_tokens")]
    #[schemars(range(min = 16))]
    pub max_num_batched_tokens: u32,
}

fn default_max_model_len() -> u32 {
    32768
}
fn default_max_num_seqs() -> u32 {
    16
}
fn default_max_num_batched_tokens() -> u32 {
    2048
}

impl Default for ServingSpec {
    fn default() -> Self {
        Self {
            max_model_len: default_max_model_len(),
            max_num_seqs: default_max_num_seqs(),
            max_num_batched_tokens: default_max_num_batched_tokens(),
        }
    }
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new("self.minReplicas <= self.maxReplicas").message("autoscaling.minReplicas must not exceed maxReplicas"),
    validation = Rule::new("self.minReplicas >= 1 || self.scaleToZero").message("minReplicas 0 needs scaleToZero: true"),
    validation = Rule::new("self.provider != 'keda' || has(self.prometheus)").message("provider keda needs prometheus.serverAddress"),
    validation = Rule::new("!self.scaleToZero || self.provider != 'hpa'").message("scaleToZero needs provider builtin or keda"),
)]
#[serde(rename_all = "camelCase")]
pub struct AutoscalingSpec {
    #[serde(default)]
    pub provider: AutoscalingProvider,
    #[serde(default = "default_min_replicas")]
    #[schemars(range(min = 0))]
    pub min_replicas: i32,
    #[schemars(range(min = 1))]
    pub max_replicas: i32,
    /// Waiting requests per replica the autoscaler aims for (`moe:num_requests_waiting`).
    #[serde(default = "default_target_queue_depth")]
    #[schemars(range(min = 1))]
    pub target_queue_depth: u32,
    /// Seconds of sustained low demand before removing replicas (at most 3600, the HPA's limit).
    #[serde(default = "default_scale_down_delay")]
    #[schemars(range(max = 3600))]
    pub scale_down_delay_seconds: u32,
    /// Seconds over which the builtin autoscaler averages queue depth.
    #[serde(default = "default_window")]
    #[schemars(range(min = 10, max = 3600))]
    pub window_seconds: u32,
    /// Allow zero replicas when idle (builtin and keda only).
    #[serde(default)]
    pub scale_to_zero: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prometheus: Option<PrometheusSpec>,
}

fn default_min_replicas() -> i32 {
    1
}
fn default_target_queue_depth() -> u32 {
    4
}
fn default_scale_down_delay() -> u32 {
    300
}
fn default_window() -> u32 {
    60
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum AutoscalingProvider {
    #[default]
    Builtin,
    Hpa,
    Keda,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PrometheusSpec {
    /// e.g. `http://prometheus-operated.monitoring:9090`.
    #[schemars(regex(pattern = r"^https?://"))]
    pub server_address: String,
}

/// Pod-level overrides applied to the generated StatefulSet.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PodOverrides {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<LocalObjectReference>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    /// RuntimeClass of the daemon pods, e.g. `nvidia` where the NVIDIA container runtime is not
    /// the node's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_class_name: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,
    /// Resources of the model download init container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downloader_resources: Option<ResourceRequirements>,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct MoEDeploymentStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    #[serde(default)]
    pub replicas: i32,
    #[serde(default)]
    pub ready_replicas: i32,
    /// Label selector of the pods (for the scale subresource).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// Nodes the pods may run on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<String>,
    /// In-cluster OpenAI base URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// The resolved placement (what `auto` became) of the best hardware class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<ResolvedPlacementStatus>,
    /// One entry per hardware class that runs replicas (one StatefulSet each), best first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub classes: Vec<HardwareClassStatus>,
    /// Hardware classes in the cluster that cannot run the model, with the reason.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rejected_classes: Vec<RejectedClassStatus>,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct HardwareClassStatus {
    /// Class id, also the pods' `moe.inference.dev/hardware-class` label.
    pub name: String,
    /// GPU product, compute capability, GPU memory and CPU features.
    pub hardware: String,
    pub stateful_set: String,
    pub nodes: Vec<String>,
    /// This class's share of `spec.replicas`.
    pub replicas: i32,
    pub placement: ResolvedPlacementStatus,
    /// The ConfigMap holding the placement rules written from this class's sizing (mounted into its
    /// pods, tried after `spec.placement.rules`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement_rules: Option<String>,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RejectedClassStatus {
    pub hardware: String,
    /// Scheduler-style line, e.g. "0/1 nodes are available: 1 unsupported GPU compute capability."
    pub reason: String,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ResolvedPlacementStatus {
    pub gpu_experts_per_layer: u32,
    pub cpu_threads: u32,
    pub memory: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hugepages: Option<String>,
}

/// The CRD as YAML, as `moe-operator crd` prints it and `crds/` stores it: keys sorted (so the text
/// does not depend on serde_json's `preserve_order` feature, which workspace builds may turn on) and
/// written by [`crate::yaml_out`] so that enum values such as `1Gi` read the same in YAML 1.1.
pub fn crd_yaml() -> Result<String, serde_json::Error> {
    Ok(crate::yaml_out::to_yaml_sorted(&crd_value()?))
}

/// The CRD as JSON: kube's derive plus the integer bounds and name rule of [`crate::crd_bounds`].
pub fn crd_value() -> Result<serde_json::Value, serde_json::Error> {
    let mut value = serde_json::to_value(MoEDeployment::crd())?;
    crate::crd_bounds::harden(&mut value);
    Ok(value)
}

impl MoEDeployment {
    /// The OpenAI model name the daemon serves.
    pub fn served_name(&self) -> String {
        self.spec
            .model
            .served_name
            .clone()
            .unwrap_or_else(|| self.metadata.name.clone().unwrap_or_default())
    }
}
