"""The API server's own rules that this operator's objects can hit, in Python.

`kubernetes-validate` checks types and unknown fields against the OpenAPI schemas, but the API
server also runs hand-written validation (pkg/apis/*/validation in kubernetes/kubernetes) that no
schema states. Each check below names the function it mirrors; `problems(obj)` returns sentences.
"""

import re

DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
# StatefulSet pods carry `controller-revision-hash: <name>-<10 char hash>`, a label value (<= 63).
MAX_STATEFULSET_NAME = 52


def _labels(where, labels, out):
    # apimachinery validation.ValidateLabels: qualified-name keys, IsValidLabelValue values.
    for k, v in (labels or {}).items():
        prefix, _, name = k.rpartition("/")
        if prefix and (len(prefix) > 253 or not DNS1123_SUBDOMAIN.match(prefix)):
            out.append(f"{where}: label key prefix {prefix!r} is not a DNS-1123 subdomain")
        if len(name) > 63 or not QUALIFIED_NAME.match(name):
            out.append(f"{where}: label key {k!r} is not a qualified name")
        if not isinstance(v, str) or len(v) > 63 or not LABEL_VALUE.match(v):
            out.append(f"{where}: label value {v!r} of {k!r} is invalid (IsValidLabelValue)")


def _node_selector_requirement(where, req, out):
    # core validation.ValidateNodeSelectorRequirement.
    op, values = req.get("operator"), req.get("values") or []
    if op in ("In", "NotIn") and not values:
        out.append(f"{where}: {op} needs at least one value")
    elif op in ("Exists", "DoesNotExist") and values:
        out.append(f"{where}: {op} takes no values")
    elif op in ("Gt", "Lt"):
        if len(values) != 1:
            out.append(f"{where}: {op} takes exactly one value")
        else:
            try:
                int(values[0])
            except ValueError:
                out.append(f"{where}: {op} value {values[0]!r} is not an integer")
    elif op not in ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"):
        out.append(f"{where}: unknown operator {op!r}")


def _node_field_selector_requirement(where, req, out):
    # core validation.validateNodeFieldSelectorRequirement: metadata.name, In/NotIn, one value.
    if req.get("key") != "metadata.name":
        out.append(f"{where}: matchFields key must be metadata.name")
    if req.get("operator") not in ("In", "NotIn"):
        out.append(f"{where}: matchFields operator must be In or NotIn")
    if len(req.get("values") or []) != 1:
        out.append(f"{where}: matchFields allows exactly one value, got {req.get('values')}")


def _affinity(where, affinity, out):
    node = (affinity or {}).get("nodeAffinity") or {}
    required = node.get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is not None:
        terms = required.get("nodeSelectorTerms") or []
        if not terms:
            out.append(f"{where}: nodeSelectorTerms must not be empty (ValidateNodeSelector)")
        for i, term in enumerate(terms):
            for j, r in enumerate(term.get("matchExpressions") or []):
                _node_selector_requirement(f"{where}.terms[{i}].matchExpressions[{j}]", r, out)
            for j, r in enumerate(term.get("matchFields") or []):
                _node_field_selector_requirement(f"{where}.terms[{i}].matchFields[{j}]", r, out)
    for i, p in enumerate(node.get("preferredDuringSchedulingIgnoredDuringExecution") or []):
        if not 1 <= p.get("weight", 0) <= 100:
            out.append(f"{where}.preferred[{i}]: weight must be within 1..100")


def qos_class(pod_spec):
    """core/helper/qos.GetPodQOS: Guaranteed when every container, init containers included, has
    cpu and memory limits equal to its requests (requests default to limits)."""
    containers = (pod_spec.get("initContainers") or []) + pod_spec.get("containers", [])
    guaranteed, any_set = True, False
    for c in containers:
        res = c.get("resources") or {}
        limits, requests = res.get("limits") or {}, dict(res.get("requests") or {})
        for k, v in limits.items():
            requests.setdefault(k, v)
        if requests or limits:
            any_set = True
        for r in ("cpu", "memory"):
            if r not in limits or str(requests.get(r)) != str(limits[r]):
                guaranteed = False
    if guaranteed and any_set:
        return "Guaranteed"
    return "Burstable" if any_set else "BestEffort"


CONFIG_MAP_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
# core validation.ValidateConfigMap: data and binaryData together at most MaxSecretSize.
MAX_CONFIG_MAP_BYTES = 1024 * 1024


def _config_map(where, obj, out):
    # core validation.ValidateConfigMap: keys are IsConfigMapKey, the total size is bounded.
    data = obj.get("data") or {}
    for k in data:
        if len(k) > 253 or not CONFIG_MAP_KEY.match(k) or k in (".", "..") or k.startswith(".."):
            out.append(f"{where}: data key {k!r} is not a valid ConfigMap key (IsConfigMapKey)")
    size = sum(len(k) + len(v.encode()) for k, v in data.items())
    if size > MAX_CONFIG_MAP_BYTES:
        out.append(f"{where}: data is {size} bytes, above the {MAX_CONFIG_MAP_BYTES} a ConfigMap may hold")


def _volumes(where, spec, out):
    # core validation.ValidateVolumes: unique DNS-1123 label names; configMap items with relative
    # paths and no `..` (validateKeyToPath / validateLocalDescendingPath).
    names = [v["name"] for v in spec.get("volumes") or []]
    for n in names:
        if not DNS1123_LABEL.match(n) or len(n) > 63:
            out.append(f"{where}: volume name {n!r} is not a DNS-1123 label")
    for n in {n for n in names if names.count(n) > 1}:
        out.append(f"{where}: volume {n!r} is declared twice")
    for v in spec.get("volumes") or []:
        for item in (v.get("configMap") or {}).get("items") or []:
            path = item.get("path", "")
            if not path or path.startswith("/") or ".." in path.split("/"):
                out.append(f"{where}: volume {v['name']!r} item path {path!r} must be relative without '..'")
            if not item.get("key"):
                out.append(f"{where}: volume {v['name']!r} item without a key")
    # core validation.ValidateVolumeMounts: mount paths unique within a container.
    for c in (spec.get("initContainers") or []) + spec.get("containers", []):
        paths = [m["mountPath"] for m in c.get("volumeMounts") or []]
        for p in {p for p in paths if paths.count(p) > 1}:
            out.append(f"{where}.{c['name']}: mountPath {p!r} must be unique")


def _pod(where, spec, out):
    _affinity(f"{where}.affinity", spec.get("affinity"), out)
    _volumes(where, spec, out)
    for c in (spec.get("initContainers") or []) + spec.get("containers", []):
        res = c.get("resources") or {}
        requests = res.get("requests") or {}
        # core validation.ValidateResourceRequirements: hugepages need a cpu or memory request.
        if any(k.startswith("hugepages-") for k in requests) and not ("cpu" in requests or "memory" in requests):
            out.append(f"{where}.{c['name']}: hugepages requests need cpu or memory requests")
        if not DNS1123_LABEL.match(c["name"]):
            out.append(f"{where}: container name {c['name']!r} is not a DNS-1123 label")


def problems(obj):
    """Sentences naming every rule `obj` breaks."""
    out = []
    kind, meta = obj.get("kind"), obj.get("metadata", {})
    name = meta.get("name", "")
    where = f"{kind}/{name}"
    _labels(f"{where}.metadata.labels", meta.get("labels"), out)
    if kind == "Service":
        # core validation.ValidateService → ValidateServiceName: DNS-1035 label.
        if not DNS1035_LABEL.match(name) or len(name) > 63:
            out.append(f"{where}: Service names must be DNS-1035 labels")
    elif not DNS1123_SUBDOMAIN.match(name):
        out.append(f"{where}: name is not a DNS-1123 subdomain")
    spec = obj.get("spec") or {}
    if kind == "StatefulSet":
        # apps validation.ValidateStatefulSet + the controller-revision-hash label limit.
        if len(name) > MAX_STATEFULSET_NAME:
            out.append(f"{where}: names above {MAX_STATEFULSET_NAME} characters make invalid pod labels")
        tmpl = spec["template"]
        selector = spec["selector"].get("matchLabels", {})
        labels = tmpl["metadata"].get("labels", {})
        if any(labels.get(k) != v for k, v in selector.items()):
            out.append(f"{where}: selector does not match template labels")
        if spec.get("podManagementPolicy") not in (None, "OrderedReady", "Parallel"):
            out.append(f"{where}: bad podManagementPolicy")
        _labels(f"{where}.template.labels", labels, out)
        _pod(f"{where}.template", tmpl["spec"], out)
        mounts = {m["name"] for c in tmpl["spec"]["containers"] + (tmpl["spec"].get("initContainers") or [])
                  for m in c.get("volumeMounts") or []}
        volumes = {v["name"] for v in tmpl["spec"].get("volumes") or []}
        claims = {c["metadata"]["name"] for c in spec.get("volumeClaimTemplates") or []}
        for m in mounts - volumes - claims:
            out.append(f"{where}: volume mount {m!r} has no volume")
    elif kind == "Deployment":
        tmpl = spec["template"]
        labels = tmpl["metadata"].get("labels", {})
        if any(labels.get(k) != v for k, v in spec["selector"].get("matchLabels", {}).items()):
            out.append(f"{where}: selector does not match template labels")
        _pod(f"{where}.template", tmpl["spec"], out)
    elif kind == "HorizontalPodAutoscaler":
        # autoscaling validation.validateHorizontalPodAutoscalerSpec and validateBehavior.
        lo, hi = spec.get("minReplicas", 1), spec.get("maxReplicas", 0)
        if lo < 1:
            out.append(f"{where}: minReplicas must be at least 1 (without the HPAScaleToZero gate)")
        if hi < lo:
            out.append(f"{where}: maxReplicas must be at least minReplicas")
        for direction in ("scaleUp", "scaleDown"):
            rules = (spec.get("behavior") or {}).get(direction) or {}
            w = rules.get("stabilizationWindowSeconds")
            if w is not None and not 0 <= w <= 3600:
                out.append(f"{where}: {direction}.stabilizationWindowSeconds must be within 0..3600")
    elif kind == "ConfigMap":
        _config_map(where, obj, out)
    elif kind == "PodDisruptionBudget":
        if spec.get("minAvailable") is not None and spec.get("maxUnavailable") is not None:
            out.append(f"{where}: minAvailable and maxUnavailable are exclusive")
    return out
