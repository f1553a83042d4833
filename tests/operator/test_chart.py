"""Helm chart and example checks, run by scripts/test.sh after `cargo test`.

The chart is linted and rendered with Helm's own engine (PyPI `helm-python-sdk`, Helm's Go SDK as
a shared library) for default and non-default values; every rendered object is then checked by
`moe-operator validate`, which deserializes it into its k8s-openapi type and reports unknown
fields. The examples are validated against the CRD's OpenAPI schema with `jsonschema`.
"""

import os
import subprocess
import tempfile
import unittest
from pathlib import Path

import helm_python
import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "moe-operator"
CRD = ROOT / "crds" / "moedeployment.yaml"
BIN = Path(os.environ.get("MOE_OPERATOR_BIN", ROOT / "target" / "debug" / "moe-operator"))
EXAMPLES = ["qwen3-30b-a3b.yaml", "glm-4.5-air.yaml", "deepseek-v3.yaml"]


def render(values=None, namespace="moe-system"):
    chart = helm_python.Chart.load(str(CHART))
    try:
        rendered = chart.render(values or {}, name="moe", namespace=namespace, is_install=True)
    finally:
        chart.close()
    docs = []
    for path, text in sorted(rendered.items()):
        if not path.endswith((".yaml", ".yml")):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def validate_with_operator(docs):
    """Runs `moe-operator validate` on the documents; returns (exit code, output)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump_all(docs, f)
        path = f.name
    try:
        proc = subprocess.run([str(BIN), "validate", path], capture_output=True, text=True)
        return proc.returncode, proc.stdout + proc.stderr
    finally:
        os.unlink(path)


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def env_of(deployment):
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in container["env"]}


class ChartTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not BIN.exists():
            raise RuntimeError(f"{BIN} missing: run `cargo build -p moe-operator` first")

    def test_lint_is_clean(self):
        report = helm_python.lint(str(CHART), strict=True)
        self.assertEqual(report["errors"], [])
        serious = [m for m in report["messages"] if m["severity"] >= 2]
        self.assertEqual(serious, [])

    def test_default_render_is_valid_and_least_privilege(self):
        docs = render()
        kinds = sorted(d["kind"] for d in docs)
        self.assertEqual(
            kinds,
            sorted(["ServiceAccount", "ClusterRole", "ClusterRole", "ClusterRoleBinding", "ClusterRoleBinding",
                    "Role", "RoleBinding", "Deployment", "Service"]),
        )
        code, out = validate_with_operator(docs)
        self.assertEqual(code, 0, out)
        # No wildcards, no secrets, nodes read-only.
        for role in by_kind(docs, "ClusterRole") + by_kind(docs, "Role"):
            for rule in role["rules"]:
                self.assertNotIn("*", rule["verbs"])
                self.assertNotIn("*", rule["resources"])
                self.assertNotIn("secrets", rule["resources"])
                if "nodes" in rule["resources"]:
                    self.assertEqual(rule["verbs"], ["get", "list", "watch"])
        deployment = by_kind(docs, "Deployment")[0]
        env = env_of(deployment)
        self.assertEqual(env["MOE_OPERATOR_LEADER_ELECTION"], "true")
        self.assertEqual(env["MOE_OPERATOR_AUTOSCALER"], "builtin")
        self.assertEqual(env["MOE_OPERATOR_WATCH_NAMESPACES"], "")
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        self.assertEqual(container["image"], "ghcr.io/moe-hybrid/moe-operator:0.1.0")
        self.assertFalse(container["securityContext"]["allowPrivilegeEscalation"])
        self.assertEqual(container["securityContext"]["capabilities"]["drop"], ["ALL"])
        self.assertEqual(container["livenessProbe"]["httpGet"]["path"], "/healthz")

    def test_non_default_values(self):
        docs = render({
            "image": {"repository": "registry.local/moe-operator", "tag": "dev", "pullPolicy": "Always"},
            "replicaCount": 2,
            "leaderElection": {"enabled": False, "leaseName": "x"},
            "autoscaler": "none",
            "watchNamespaces": ["llm", "research"],
            "metrics": {"port": 9090, "service": {"enabled": True, "annotations": {"prometheus.io/scrape": "true"}}},
            "resources": {"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"cpu": "2", "memory": "512Mi"}},
            "nodeSetup": {"enabled": True, "hugepages1Gi": 200,
                          "image": "docker.io/library/busybox:1.37", "nodeSelector": {"gpu": "true"}, "tolerations": []},
        }, namespace="ops")
        code, out = validate_with_operator(docs)
        self.assertEqual(code, 0, out)
        bindings = by_kind(docs, "RoleBinding")
        self.assertEqual(sorted(b["metadata"]["namespace"] for b in bindings), ["llm", "research"])
        cluster_bindings = [b["roleRef"]["name"] for b in by_kind(docs, "ClusterRoleBinding")]
        self.assertEqual(cluster_bindings, ["moe-moe-operator-nodes"], "only the node reader is cluster-wide")
        self.assertEqual(by_kind(docs, "Role"), [], "no lease Role without leader election")
        deployment = by_kind(docs, "Deployment")[0]
        env = env_of(deployment)
        self.assertEqual(env["MOE_OPERATOR_WATCH_NAMESPACES"], "llm,research")
        self.assertEqual(env["MOE_OPERATOR_LEADER_ELECTION"], "false")
        self.assertEqual(env["MOE_OPERATOR_AUTOSCALER"], "none")
        self.assertEqual(env["MOE_OPERATOR_IMAGE"], "registry.local/moe-operator:dev")
        self.assertEqual(env["MOE_OPERATOR_METRICS_ADDR"], "0.0.0.0:9090")
        self.assertEqual(deployment["spec"]["replicas"], 2)
        self.assertEqual(deployment["spec"]["template"]["spec"]["containers"][0]["image"], "registry.local/moe-operator:dev")
        daemonset = by_kind(docs, "DaemonSet")[0]
        script = daemonset["spec"]["template"]["spec"]["initContainers"][0]["command"][2]
        self.assertIn("echo 200 > /host-sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages", script)
        self.assertNotIn("hugepages-2048kB", script, "an unset pool is left alone, not zeroed")
        service = by_kind(docs, "Service")[0]
        self.assertEqual(service["spec"]["ports"][0]["port"], 9090)

    def test_values_schema_rejects_bad_values(self):
        for bad in ({"autoscaler": "sometimes"}, {"watchNamespaces": ["Not_A_Namespace"]}, {"replicaCount": 0}):
            with self.subTest(bad=bad), self.assertRaises(helm_python.HelmError):
                render(bad)

    def test_validator_catches_a_broken_manifest(self):
        docs = render()
        deployment = by_kind(docs, "Deployment")[0]
        deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
        code, out = validate_with_operator(docs)
        self.assertNotEqual(code, 0)
        self.assertIn("imagePullPolcy", out)

    def test_chart_ships_the_generated_crd(self):
        self.assertEqual((CHART / "crds" / "moedeployment.yaml").read_text(), CRD.read_text())


def to_json_schema(node):
    """OpenAPI v3 (structural, Kubernetes flavour) to JSON Schema for `jsonschema`."""
    if isinstance(node, list):
        return [to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in ("nullable", "x-kubernetes-validations", "x-kubernetes-preserve-unknown-fields", "format"):
            continue
        if key == "x-kubernetes-int-or-string":
            out["type"] = ["integer", "string"]
            continue
        if key == "properties":
            out[key] = {k: to_json_schema(v) for k, v in value.items()}
        else:
            out[key] = to_json_schema(value)
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"] if isinstance(out["type"], str) else out["type"] + ["null"]
    if node.get("type") == "object" and "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


class ExamplesAgainstCrdSchema(unittest.TestCase):
    def setUp(self):
        crd = yaml.safe_load(CRD.read_text())
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        self.spec_schema = to_json_schema(schema["properties"]["spec"])

    def test_examples_match_the_schema(self):
        for name in EXAMPLES:
            with self.subTest(example=name):
                doc = yaml.safe_load((ROOT / "examples" / name).read_text())
                self.assertEqual(doc["apiVersion"], "moe.inference.dev/v1alpha1")
                jsonschema.validate(doc["spec"], self.spec_schema)

    def test_schema_rejects_typos_and_bad_enums(self):
        doc = yaml.safe_load((ROOT / "examples" / EXAMPLES[0]).read_text())
        typo = dict(doc["spec"], placemnt={})
        with self.assertRaises(jsonschema.ValidationError):
            jsonschema.validate(typo, self.spec_schema)
        bad_enum = yaml.safe_load((ROOT / "examples" / EXAMPLES[0]).read_text())["spec"]
        bad_enum["autoscaling"]["provider"] = "magic"
        with self.assertRaises(jsonschema.ValidationError):
            jsonschema.validate(bad_enum, self.spec_schema)


class DockerfileTest(unittest.TestCase):
    """Static checks: no Docker daemon in CI, so the build itself is not run here."""

    def test_stages_bases_and_users(self):
        text = (ROOT / "Dockerfile").read_text()
        stages = {}
        for line in text.splitlines():
            parts = line.split()
            if parts[:1] == ["FROM"] and "AS" in parts:
                stages[parts[parts.index("AS") + 1]] = parts[1]
        self.assertEqual(set(stages), {"build", "daemon", "operator"})
        self.assertIn("CUDA_RUNTIME_IMAGE", stages["daemon"])
        self.assertIn("nvidia/cuda:", text)
        self.assertIn("-runtime-", text.split("CUDA_RUNTIME_IMAGE=")[1].split()[0])
        self.assertTrue(stages["operator"].startswith("gcr.io/distroless/cc"))
        self.assertIn("libhwloc15", text)
        self.assertEqual(text.count("USER 65532:65532"), 2)
        self.assertIn("--locked", text)


if __name__ == "__main__":
    unittest.main()
