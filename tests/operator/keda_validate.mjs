// Validates KEDA objects (JSON array on stdin) with the validators that @kubernetes-models/keda
// generates from KEDA's own API types (github.com/kedacore/keda/v2/apis/keda/v1alpha1, the source
// of KEDA's CRD schema). MOE_KEDA_MODELS names the node_modules directory holding the package.
// Prints one line per problem and exits 1 when any object is invalid.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const modules = process.env.MOE_KEDA_MODELS;
if (!modules) {
  console.error("MOE_KEDA_MODELS is not set (npm install --prefix DIR @kubernetes-models/keda)");
  process.exit(2);
}
const load = (p) => import(pathToFileURL(join(modules, "@kubernetes-models/keda", p)).href);
const { ScaledObject } = await load("keda.sh/v1alpha1/ScaledObject.js");
const objects = JSON.parse(readFileSync(0, "utf8"));
let failed = false;
for (const obj of objects) {
  try {
    new ScaledObject(obj).validate();
  } catch (e) {
    failed = true;
    console.log(`${obj.metadata?.name}: ${e.message}`);
  }
}
process.exit(failed ? 1 : 0);
