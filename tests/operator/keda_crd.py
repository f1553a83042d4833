"""KEDA ScaledObjects checked against KEDA's own CRD (keda/keda.sh_scaledobjects.yaml, as released), the
schema the API server validates them with once KEDA is installed:

- the served version's openAPIV3Schema, read as JSON Schema, in strict mode: an object schema that lists
  `properties` and neither `additionalProperties` nor `x-kubernetes-preserve-unknown-fields` rejects
  unknown fields (what `kubectl apply --validate=strict` reports; the API server would drop them);
- the CRD's CEL rules (`x-kubernetes-validations`), mirrored here one by one; a rule this file does not
  mirror fails the check, so a KEDA update that adds one cannot pass unnoticed.
"""

import copy
from pathlib import Path

import jsonschema
import yaml

CRD = Path(__file__).resolve().parent / "keda" / "keda.sh_scaledobjects.yaml"

MIN_LE_MAX = ("!has(self.minReplicaCount) || self.minReplicaCount <= (has(self.maxReplicaCount) "
              "? self.maxReplicaCount : 100)")


def _min_le_max(spec):
    """KEDA's spec rule: minReplicaCount <= maxReplicaCount (maxReplicaCount defaults to 100)."""
    if "minReplicaCount" not in spec:
        return True
    return spec["minReplicaCount"] <= spec.get("maxReplicaCount", 100)


# CEL rule text (whitespace-normalised) -> Python twin, keyed by where it sits in the schema.
MIRRORED = {("spec",): {MIN_LE_MAX: _min_le_max}}


def _strict(schema):
    """JSON Schema of an openAPIV3Schema with unknown fields rejected where the schema lists fields."""
    s = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (node.get("type") == "object" and "properties" in node
                    and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(s)
    return s


def _cel_rules(schema, path=()):
    """(path, rule text) of every x-kubernetes-validations rule in the schema."""
    if isinstance(schema, dict):
        for r in schema.get("x-kubernetes-validations", []):
            yield path, " ".join(r["rule"].split())
        for key, child in schema.get("properties", {}).items():
            yield from _cel_rules(child, path + (key,))
        if isinstance(schema.get("items"), dict):
            yield from _cel_rules(schema["items"], path + ("[]",))


def load_schema():
    crd = next(d for d in yaml.safe_load_all(CRD.read_text()) if d)
    version = next(v for v in crd["spec"]["versions"] if v.get("served") and v.get("storage"))
    return version["name"], version["schema"]["openAPIV3Schema"]


def problems(objects):
    """One line per problem found in `objects` (ScaledObjects as dicts)."""
    version, schema = load_schema()
    validator = jsonschema.Draft7Validator(_strict(schema))
    out = []
    unmirrored = [(p, r) for p, r in _cel_rules(schema) if r not in MIRRORED.get(p, {})]
    for p, r in unmirrored:
        out.append(f"KEDA CRD rule at {'.'.join(p)} is not mirrored in keda_crd.py: {r}")
    for obj in objects:
        name = obj.get("metadata", {}).get("name", "?")
        if obj.get("apiVersion") != f"keda.sh/{version}":
            out.append(f"{name}: apiVersion {obj.get('apiVersion')} is not keda.sh/{version}")
        for e in sorted(validator.iter_errors(obj), key=lambda e: list(e.path)):
            out.append(f"{name}: {'.'.join(str(x) for x in e.path) or '<root>'}: {e.message}")
        for path, rules in MIRRORED.items():
            node = obj
            for key in path:
                node = node.get(key, {}) if isinstance(node, dict) else {}
            for rule, check in rules.items():
                if isinstance(node, dict) and node and not check(node):
                    out.append(f"{name}: {'.'.join(path)}: violates `{rule}`")
    return out
