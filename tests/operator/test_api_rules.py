"""What a real API server would say about the CRD and about every object `moe-operator plan` prints.

No kube-apiserver is installable here, so this gets as close as the reachable tools allow:
- the text is read as YAML 1.1 twice, by PyYAML and by Helm's own engine (helm-python-sdk,
  `fromYaml`, which is what kubectl and Helm use), and both readings must agree and keep enum
  values such as `1Gi` and `none` strings;
- every built-in object is checked by `kubernetes-validate` in strict mode (unknown fields are
  errors) for Kubernetes 1.30 to 1.35;
- KEDA ScaledObjects are checked against KEDA's released CRD schema (openAPIV3Schema in strict mode
  and its CEL rules, keda_crd.py) and by the validators generated from KEDA's API types
  (npm `@kubernetes-models/keda`, see keda_validate.mjs);
- `api_rules.problems` applies the hand-written API server rules (node selector requirements,
  names, labels, HPA ranges, StatefulSet shape), and daemon pods must be in the Guaranteed QoS class.

Runs for every example on three node fleets: the sample cluster (examples/nodes.yaml), three
identical H100 nodes and a mixed fleet (fleets/).
"""

import json
import os
import shutil
import subprocess
import tempfile
import unittest
from pathlib import Path

import helm_python
import kubernetes_validate
import yaml

import api_rules
import keda_crd

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BIN = Path(os.environ.get("MOE_OPERATOR_BIN", ROOT / "target" / "debug" / "moe-operator"))
CRD = ROOT / "crds" / "moedeployment.yaml"
EXAMPLES = ["qwen3-30b-a3b.yaml", "glm-4.5-air.yaml", "deepseek-v3.yaml"]
FLEETS = {
    "sample": ROOT / "examples" / "nodes.yaml",
    "identical-h100": HERE / "fleets" / "identical-h100.yaml",
    "mixed": HERE / "fleets" / "mixed.yaml",
}
K8S_VERSIONS = ["1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0", "1.35.0"]

HELM_PARSE_TEMPLATE = """{{- range $i, $doc := regexSplit "(?m)^---[ \\t]*$" (.Files.Get "files/input.yaml") -1 }}
{{- if trim $doc }}
{{ $doc | fromYaml | toJson }}
{{- end }}
{{- end }}
"""


def helm_parse(text):
    """Documents of `text` as Helm reads them (sigs.k8s.io/yaml, YAML 1.1), via a throwaway chart."""
    with tempfile.TemporaryDirectory() as d:
        chart = Path(d) / "parse"
        (chart / "templates").mkdir(parents=True)
        (chart / "files").mkdir()
        (chart / "Chart.yaml").write_text("apiVersion: v2\nname: parse\nversion: 0.1.0\n")
        (chart / "files" / "input.yaml").write_text(text)
        (chart / "templates" / "out.yaml").write_text(HELM_PARSE_TEMPLATE)
        c = helm_python.Chart.load(str(chart))
        try:
            rendered = c.render({}, name="parse", namespace="default", is_install=True)
        finally:
            c.close()
    out = [json.loads(line) for line in rendered["parse/templates/out.yaml"].splitlines() if line.strip()]
    for doc in out:
        if set(doc) == {"Error"}:
            raise AssertionError(f"Helm cannot parse a document: {doc['Error']}")
    return out


def plan(example, fleet):
    proc = subprocess.run([str(BIN), "plan", "--deployment", str(ROOT / "examples" / example),
                           "--nodes", str(FLEETS[fleet])], capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssertionError(f"plan {example} on {fleet} failed:\n{proc.stderr}")
    return proc.stdout


def keda_problems(objects):
    modules = os.environ.get("MOE_KEDA_MODELS")
    if not modules or not Path(modules, "@kubernetes-models", "keda").is_dir():
        raise AssertionError("KEDA validators missing: npm install --prefix DIR @kubernetes-models/keda@2.0.0 "
                             "and set MOE_KEDA_MODELS=DIR/node_modules (.ci/run does)")
    proc = subprocess.run(["node", str(HERE / "keda_validate.mjs")], input=json.dumps(objects),
                          capture_output=True, text=True, env={**os.environ, "MOE_KEDA_MODELS": modules})
    if proc.returncode not in (0, 1):
        raise AssertionError(proc.stderr)
    return [line for line in proc.stdout.splitlines() if line]


def enum_values(schema):
    """Every `enum` list in a JSON schema."""
    if isinstance(schema, dict):
        if "enum" in schema:
            yield schema["enum"]
        for v in schema.values():
            yield from enum_values(v)
    elif isinstance(schema, list):
        for v in schema:
            yield from enum_values(v)


class CrdTest(unittest.TestCase):
    def test_enums_survive_yaml_1_1(self):
        text = CRD.read_text()
        pyyaml = yaml.safe_load(text)
        helm = helm_parse(text)[0]
        self.assertEqual(pyyaml, helm, "PyYAML and Helm read the CRD differently")
        enums = list(enum_values(pyyaml))
        self.assertTrue(any("none" in e for e in enums), enums)
        for e in enums:
            self.assertTrue(all(isinstance(v, str) for v in e), f"non-string enum value in {e}")


class PlanOutputTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not BIN.exists():
            raise RuntimeError(f"{BIN} missing: run `cargo test -p moe-operator` first")
        cls.plans = {(e, f): plan(e, f) for e in EXAMPLES for f in FLEETS}

    def objects(self, example, fleet):
        docs = list(yaml.safe_load_all(self.plans[(example, fleet)]))
        return [d for d in docs[1:] if d]

    def test_yaml_1_1_readers_agree(self):
        for (example, fleet), text in self.plans.items():
            with self.subTest(example=example, fleet=fleet):
                pyyaml = [d for d in yaml.safe_load_all(text) if d]
                self.assertEqual(pyyaml, helm_parse(text))

    def test_every_example_places_on_the_fleets_it_targets(self):
        placed = {k for k in self.plans if self.objects(*k)}
        for example in EXAMPLES:
            self.assertIn((example, "identical-h100"), placed, example)
        self.assertIn(("qwen3-30b-a3b.yaml", "mixed"), placed)

    def test_objects_pass_kubernetes_validate_strict(self):
        for (example, fleet) in self.plans:
            for obj in self.objects(example, fleet):
                if obj["apiVersion"].startswith(("keda.sh/", "moe.inference.dev/")):
                    continue
                for version in K8S_VERSIONS:
                    with self.subTest(example=example, fleet=fleet, obj=obj["kind"], version=version):
                        try:
                            kubernetes_validate.validate(obj, version, strict=True)
                        except kubernetes_validate.ValidationError as e:
                            self.fail(f"{obj['kind']}/{obj['metadata']['name']} on {version}: {e.message} "
                                      f"at {list(e.path)}")

    def test_scaled_objects_pass_keda_schema(self):
        scaled = [o for k in self.plans for o in self.objects(*k) if o["kind"] == "ScaledObject"]
        self.assertTrue(scaled, "the deepseek example uses KEDA")
        self.assertEqual(keda_crd.problems(scaled), [])
        self.assertEqual(keda_problems(scaled), [])

    def test_keda_crd_check_rejects_what_keda_rejects(self):
        good = next(o for k in self.plans for o in self.objects(*k) if o["kind"] == "ScaledObject")
        cases = {
            "unknown field": lambda o: o["spec"].update(pollingIntervall=5),
            "min above max": lambda o: o["spec"].update(minReplicaCount=9, maxReplicaCount=2),
            "no triggers": lambda o: o["spec"].pop("triggers"),
            "trigger metadata not strings": lambda o: o["spec"]["triggers"][0]["metadata"].update(x=1),
            "wrong version": lambda o: o.update(apiVersion="keda.sh/v1beta1"),
        }
        for what, breakit in cases.items():
            obj = json.loads(json.dumps(good))
            breakit(obj)
            self.assertNotEqual(keda_crd.problems([obj]), [], what)

    def test_api_server_rules_and_guaranteed_qos(self):
        for (example, fleet) in self.plans:
            for obj in self.objects(example, fleet):
                with self.subTest(example=example, fleet=fleet, obj=f"{obj['kind']}/{obj['metadata']['name']}"):
                    self.assertEqual(api_rules.problems(obj), [])
                    if obj["kind"] == "StatefulSet":
                        self.assertEqual(api_rules.qos_class(obj["spec"]["template"]["spec"]), "Guaranteed")

    def test_the_rules_catch_what_the_api_server_rejects(self):
        """The checks can fail: the shapes that broke on a real cluster are reported."""
        sts = next(o for o in self.objects("qwen3-30b-a3b.yaml", "identical-h100") if o["kind"] == "StatefulSet")
        bad = json.loads(json.dumps(sts))
        term = bad["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
        term["matchFields"] = [{"key": "metadata.name", "operator": "In", "values": ["a", "b"]}]
        bad["spec"]["template"]["spec"]["initContainers"] = [{"name": "fetch", "image": "x"}]
        self.assertTrue(any("exactly one value" in p for p in api_rules.problems(bad)))
        self.assertEqual(api_rules.qos_class(bad["spec"]["template"]["spec"]), "Burstable")
        twice = json.loads(json.dumps(sts))
        pod = twice["spec"]["template"]["spec"]
        pod["volumes"].append(dict(pod["volumes"][0]))
        pod["containers"][0]["volumeMounts"].append(dict(pod["containers"][0]["volumeMounts"][0], name="tmp"))
        found = api_rules.problems(twice)
        self.assertTrue(any("declared twice" in p for p in found), found)
        self.assertTrue(any("must be unique" in p for p in found), found)
        cm = next(o for o in self.objects("qwen3-30b-a3b.yaml", "identical-h100") if o["kind"] == "ConfigMap")
        for bad in ({"a/b.yaml": "x"}, {"..x": "x"}, {"big.yaml": "x" * (1 << 20)}):
            self.assertTrue(api_rules.problems({**cm, "data": bad}), bad)
        svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "glm-4.5"}, "spec": {}}
        self.assertTrue(api_rules.problems(svc))
        hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "x"},
               "spec": {"maxReplicas": 2, "behavior": {"scaleDown": {"stabilizationWindowSeconds": 7200}}}}
        self.assertTrue(api_rules.problems(hpa))
        with self.assertRaises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate({**sts, "spec": {**sts["spec"], "bogus": 1}}, "1.35.0", strict=True)
        if shutil.which("node"):
            so = next(o for k in self.plans for o in self.objects(*k) if o["kind"] == "ScaledObject")
            broken = json.loads(json.dumps(so))
            broken["spec"]["minReplicaCount"] = "0"
            self.assertTrue(keda_problems([broken]))

    def test_mixed_fleet_serves_every_capable_class(self):
        """One StatefulSet per hardware class, each with one required term for exactly its class."""
        report = next(yaml.safe_load_all(self.plans[("qwen3-30b-a3b.yaml", "mixed")]))
        self.assertNotIn("insufficient", report["summary"])
        self.assertEqual({c["name"] for c in report["classes"]}, {"sm89-24g", "sm120-96g-amx", "sm90-140g"})
        sets = [o for o in self.objects("qwen3-30b-a3b.yaml", "mixed") if o["kind"] == "StatefulSet"]
        self.assertEqual(len(sets), 3)
        memories = set()
        for sts in sets:
            terms = sts["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            self.assertEqual(len(terms), 1)
            memory = [r["values"] for r in terms[0]["matchExpressions"] if r["key"] == "nvidia.com/gpu.memory"]
            memories.add(tuple(memory[0]))
        self.assertEqual(memories, {("24564",), ("97887",), ("143771",)})
        experts = {s["metadata"]["name"]: s["spec"]["template"]["spec"]["containers"][0]["args"] for s in sets}
        ws = experts["qwen3-30b-a3b-sm89-24g"]
        self.assertNotEqual(ws[ws.index("--gpu-experts") + 1], "128")

    def test_each_class_reads_its_rule_file_from_its_configmap(self):
        """Every StatefulSet's class rule file is a key of a ConfigMap in the same output, mounted where
        the daemon is told to read it, after the deployment's own rules; the text reads (YAML 1.1, as
        PyYAML) as a list of rules under a comment naming the class."""
        for (example, fleet) in self.plans:
            objs = self.objects(example, fleet)
            maps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"}
            sets = [o for o in objs if o["kind"] == "StatefulSet"]
            self.assertEqual(len(maps), len(sets), (example, fleet))
            for sts in sets:
                with self.subTest(example=example, fleet=fleet, sts=sts["metadata"]["name"]):
                    pod = sts["spec"]["template"]["spec"]
                    args = pod["containers"][0]["args"]
                    files = [args[i + 1] for i, a in enumerate(args) if a == "--placement-rules"]
                    cls = sts["spec"]["template"]["metadata"]["labels"]["moe.inference.dev/hardware-class"]
                    self.assertEqual(files[-1], f"/etc/moe/class-rules/{cls}.yaml")
                    mount = next(m for m in pod["containers"][0]["volumeMounts"]
                                 if m["mountPath"] == "/etc/moe/class-rules")
                    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
                    cm = maps[volume["configMap"]["name"]]
                    self.assertEqual(cm["metadata"]["labels"]["moe.inference.dev/hardware-class"], cls)
                    text = cm["data"][f"{cls}.yaml"]
                    self.assertIn(f"node class {cls}:", text.splitlines()[0])
                    rules = yaml.safe_load(text)
                    self.assertIsInstance(rules, list)
                    self.assertTrue(all(set(r) == {"match", "decode"} for r in rules), rules)
                    self.assertEqual(volume["configMap"]["items"], [{"key": f"{cls}.yaml", "path": f"{cls}.yaml"}])

    def test_hpa_example_starts_above_zero(self):
        sts = next(o for o in self.objects("glm-4.5-air.yaml", "identical-h100") if o["kind"] == "StatefulSet")
        self.assertGreaterEqual(sts["spec"]["replicas"], 1)

    def test_scale_to_zero_example_has_an_activator_in_front(self):
        objs = {(o["kind"], o["metadata"]["name"]): o for o in self.objects("deepseek-v3.yaml", "identical-h100")}
        self.assertIn(("Deployment", "deepseek-v3-activator"), objs)
        svc = objs[("Service", "deepseek-v3")]
        self.assertEqual(svc["spec"]["selector"]["app.kubernetes.io/name"], "moe-activator")
        query = objs[("ScaledObject", "deepseek-v3")]["spec"]["triggers"][0]["metadata"]["query"]
        self.assertIn("deepseek-v3-activator", query)


if __name__ == "__main__":
    unittest.main()
