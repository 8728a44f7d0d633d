// Checks one rendered overlay (the output of `kustomize build`), offline:
//   node check_manifests.js RENDERED.yaml BIN_DIR WORK_DIR
// 1. every object validates against the Kubernetes API schemas
//    (kubernetes-models);
// 2. the pods follow the deployment rules of issue 7: non-root, read-only
//    root filesystem, all capabilities dropped, no privilege escalation,
//    requests and limits, readiness and liveness probes;
// 3. the job's config agrees with the manifests (shards = StatefulSet
//    replicas = names in --servers; workers = the Job's completions);
// 4. the binaries accept the args and config the manifests pass: each
//    container's command runs here with --check_config, with the ConfigMap
//    and Secret written where the pod would mount them (under WORK_DIR);
//    a worker that runs a Python script (the torch-script overlay) gets its
//    MORSE_* environment checked against the config and the mounts, and the
//    script, from its ConfigMap, compiled and checked to use morse.torch;
//    a worker pod that runs morse-run for a node (the multinode overlay:
//    one pod per node) gets morse-run --check-config with its args, node 0's
//    and the last node's, its topology checked against the config (nodes x
//    ranks per node = workers, the Job's pods = nodes, one GPU per rank) and
//    its rendezvous address against the pods' headless Service.
// Prints what it checked; exits 1 with every problem listed otherwise.
"use strict";
const fs = require("fs");
const path = require("path");
const { spawnSync } = require("child_process");
const YAML = require("yaml");

const [rendered, binDir, workDir] = process.argv.slice(2);
if (!rendered || !binDir || !workDir) {
  console.error("usage: node check_manifests.js RENDERED.yaml BIN_DIR WORK_DIR");
  process.exit(2);
}
const problems = [];
const fail = (what) => problems.push(what);

const docs = YAML.parseAllDocuments(fs.readFileSync(rendered, "utf8"))
  .map((d) => d.toJSON())
  .filter((d) => d);
const name = (o) => `${o.kind}/${o.metadata && o.metadata.name}`;

// 1. Schemas.
for (const o of docs) {
  const group = o.apiVersion.includes("/") ? o.apiVersion : `${o.apiVersion}`;
  let module;
  try {
    module = require(`kubernetes-models/${group}`);
  } catch (e) {
    fail(`${name(o)}: no schema for apiVersion ${o.apiVersion}`);
    continue;
  }
  const Model = module[o.kind];
  if (!Model) {
    fail(`${name(o)}: no schema for kind ${o.kind} in ${o.apiVersion}`);
    continue;
  }
  // kustomize wraps long base64 values over lines; the API server's decoder
  // ignores the newlines, the schema's "byte" format does not.
  if (o.kind === "Secret" && o.data) {
    for (const k of Object.keys(o.data)) o.data[k] = o.data[k].replace(/\s+/g, "");
  }
  try {
    new Model(o).validate();
  } catch (e) {
    fail(`${name(o)}: ${e.message}`);
  }
}
console.log(`schemas: ${docs.length} objects (${docs.map(name).join(", ")})`);

// 2. Pod rules.
const workloads = docs.filter((o) => o.kind === "StatefulSet" || o.kind === "Job");
for (const w of workloads) {
  const pod = w.spec.template.spec;
  const psc = pod.securityContext || {};
  if (psc.runAsNonRoot !== true) fail(`${name(w)}: pod securityContext.runAsNonRoot is not true`);
  if (!(psc.runAsUser > 0)) fail(`${name(w)}: pod securityContext.runAsUser is not a non-root uid`);
  for (const c of pod.containers) {
    const where = `${name(w)} container ${c.name}`;
    const sc = c.securityContext || {};
    if (sc.readOnlyRootFilesystem !== true) fail(`${where}: readOnlyRootFilesystem is not true`);
    if (sc.allowPrivilegeEscalation !== false) fail(`${where}: allowPrivilegeEscalation is not false`);
    if (!((sc.capabilities || {}).drop || []).includes("ALL")) fail(`${where}: capabilities do not drop ALL`);
    const r = c.resources || {};
    for (const k of ["requests", "limits"]) {
      if (!r[k] || !r[k].cpu || !r[k].memory) fail(`${where}: resources.${k} lacks cpu or memory`);
    }
    if (!c.readinessProbe) fail(`${where}: no readinessProbe`);
    if (!c.livenessProbe) fail(`${where}: no livenessProbe`);
  }
}
for (const kind of ["PodDisruptionBudget", "NetworkPolicy", "Service", "ConfigMap", "Secret"]) {
  if (!docs.some((o) => o.kind === kind)) fail(`no ${kind}`);
}
const job = docs.find((o) => o.kind === "Job");
const sts = docs.find((o) => o.kind === "StatefulSet");
if (!job || job.spec.completionMode !== "Indexed") fail("the workers are not an Indexed Job");
if (!sts) fail("no server StatefulSet");

// Selectors must select the pods they are meant for (the schemas cannot
// tell): the Service, the PDB and the server NetworkPolicy select the server
// pods; the NetworkPolicies' peers select worker pods; each workload's own
// selector matches its template.
const podLabels = (w) => (w && w.spec.template.metadata && w.spec.template.metadata.labels) || {};
const selects = (selector, labels) =>
  !!selector && Object.entries(selector).every(([k, v]) => labels[k] === v);
const stsLabels = podLabels(docs.find((o) => o.kind === "StatefulSet"));
const jobLabels = podLabels(docs.find((o) => o.kind === "Job"));
const nodesService = job && job.spec.template.spec.subdomain;  // the node pods' DNS (morse-run --rdzv)
for (const o of docs) {
  if (o.kind === "Service" && o.metadata.name === nodesService) {
    if (!selects(o.spec.selector, jobLabels)) fail(`${name(o)}: selector misses the worker pods it names`);
  } else if (o.kind === "Service" && !selects(o.spec.selector, stsLabels)) fail(`${name(o)}: selector misses the server pods`);
  if (o.kind === "PodDisruptionBudget" && !selects(o.spec.selector.matchLabels, stsLabels)) {
    fail(`${name(o)}: selector misses the server pods`);
  }
  if (o.kind === "StatefulSet" && !selects(o.spec.selector.matchLabels, stsLabels)) fail(`${name(o)}: selector misses its pods`);
  if (o.kind === "NetworkPolicy") {
    const target = o.metadata.name.endsWith("server") ? stsLabels : jobLabels;
    if (!selects(o.spec.podSelector.matchLabels, target)) fail(`${name(o)}: podSelector misses its pods`);
    for (const rule of o.spec.ingress || []) {
      for (const peer of rule.from || []) {
        if (peer.podSelector && !selects(peer.podSelector.matchLabels, jobLabels)) {
          fail(`${name(o)}: an ingress podSelector ${JSON.stringify(peer.podSelector.matchLabels)} selects no worker pod`);
        }
      }
    }
  }
}

// 3. Config against manifests.
const configMap = docs.find((o) => o.kind === "ConfigMap");
const secret = docs.find((o) => o.kind === "Secret");
const config = configMap ? configMap.data["job.textproto"] || "" : "";
const field = (f) => {
  const m = config.match(new RegExp(`^\\s*${f}:\\s*(\\d+)`, "m"));
  return m ? Number(m[1]) : NaN;
};
const shards = field("shards"), workers = field("workers");
// morse-run as the container (python3 -m morse.run): a pod per node, each
// running --nproc-per-node ranks.
const isLauncher = (c) => (c.command || []).includes("morse.run") || path.basename(c.command[0]) === "morse-run";
const flagOf = (c, f) => {
  const a = (c.args || []).find((x) => x.startsWith(`--${f}=`));
  return a === undefined ? undefined : a.slice(f.length + 3);
};
const launcher = job ? isLauncher(job.spec.template.spec.containers[0]) : false;
const pods = launcher ? Number(flagOf(job.spec.template.spec.containers[0], "nnodes")) : workers;
if (sts && sts.spec.replicas !== shards) fail(`StatefulSet replicas ${sts.spec.replicas} != config shards ${shards}`);
if (job && (job.spec.completions !== pods || job.spec.parallelism !== pods)) {
  fail(`Job completions/parallelism ${job.spec.completions}/${job.spec.parallelism} != ` +
       (launcher ? `morse-run --nnodes ${pods}` : `config workers ${workers}`));
}
const isScript = (c) => path.basename(c.command[0]).startsWith("python") && !isLauncher(c);
const envOf = (c) => Object.fromEntries((c.env || []).filter((e) => "value" in e).map((e) => [e.name, e.value]));
if (job) {
  const c = job.spec.template.spec.containers[0];
  const expected = Array.from({ length: shards }, (_, s) => `morse-server-${s}.morse-server:7000`).join(",");
  if (launcher) {
    const nproc = Number(flagOf(c, "nproc-per-node"));
    if (flagOf(c, "servers") !== expected) fail(`morse-run --servers=${flagOf(c, "servers")} != ${expected}`);
    // --node-aggregation: one Morse worker per node (pod).
    const aggregated = (c.args || []).includes("--node-aggregation");
    if (aggregated && pods !== workers) fail(`morse-run --node-aggregation with --nnodes ${pods} != config workers ${workers}`);
    if (!aggregated && pods * nproc !== workers) fail(`morse-run --nnodes ${pods} x --nproc-per-node ${nproc} != config workers ${workers}`);
    if (flagOf(c, "node-rank") !== "$(JOB_COMPLETION_INDEX)") fail(`morse-run --node-rank is not $(JOB_COMPLETION_INDEX)`);
    const gpus = (c.resources.limits || {})["nvidia.com/gpu"];
    if (gpus !== undefined && Number(gpus) !== nproc) fail(`${gpus} nvidia.com/gpu per pod but --nproc-per-node ${nproc}`);
    const service = docs.find((o) => o.kind === "Service" && o.metadata.name === nodesService);
    const [host, port] = (flagOf(c, "rdzv") || "").split(":");
    if (!service) fail(`the Job's subdomain ${nodesService} is no headless Service`);
    else {
      if (service.spec.clusterIP !== "None") fail(`${name(service)} is not headless`);
      if (host !== `${job.metadata.name}-0.${nodesService}`) fail(`morse-run --rdzv host ${host} is not node 0's pod, ${job.metadata.name}-0.${nodesService}`);
      if (!service.spec.ports.some((p) => String(p.port) === port)) fail(`${name(service)} does not expose the rendezvous port ${port}`);
    }
    const rdzvPolicy = docs.some((o) => o.kind === "NetworkPolicy" && selects(o.spec.podSelector.matchLabels, jobLabels) &&
      (o.spec.ingress || []).some((r) => (r.ports || []).some((p) => String(p.port) === port) &&
        (r.from || []).some((peer) => peer.podSelector && selects(peer.podSelector.matchLabels, jobLabels))));
    if (!rdzvPolicy) fail(`no NetworkPolicy lets the worker pods reach each other on the rendezvous port ${port}`);
  } else if (isScript(c)) {
    const env = envOf(c);
    if (env.MORSE_SERVERS !== expected) fail(`worker MORSE_SERVERS ${env.MORSE_SERVERS} != ${expected}`);
    for (const k of ["MORSE_WORLD_SIZE", "WORLD_SIZE"]) {
      if (Number(env[k]) !== workers) fail(`worker ${k} ${env[k]} != config workers ${workers}`);
    }
    const rank = (c.env || []).find((e) => e.name === "MORSE_RANK");
    const index = "metadata.annotations['batch.kubernetes.io/job-completion-index']";
    if (!rank || !rank.valueFrom || rank.valueFrom.fieldRef.fieldPath !== index) {
      fail(`worker MORSE_RANK does not come from ${index}`);
    }
    if (env.RANK !== "$(MORSE_RANK)") fail(`worker RANK is ${env.RANK}, not $(MORSE_RANK)`);
  } else {
    const servers = (c.args || []).find((a) => a.startsWith("--servers="));
    if (servers !== `--servers=${expected}`) fail(`worker ${servers} != --servers=${expected}`);
  }
}
if (job && sts) {
  const gpu = (job.spec.template.spec.containers[0].resources.limits || {})["nvidia.com/gpu"];
  console.log(`config: ${shards} shards = StatefulSet replicas, ${workers} workers = ` +
              (launcher ? `${pods} pods (nodes) x --nproc-per-node` : "Job completions") +
              (gpu ? `, ${gpu} nvidia.com/gpu per ${launcher ? "pod" : "worker"}` : ", CPU workers"));
}

// 4. The binaries accept what the manifests pass.
const mounts = {};  // mountPath -> local directory holding the volume's files
function materialize(w) {
  const pod = w.spec.template.spec;
  for (const v of pod.volumes || []) {
    let files = null;
    if (v.configMap) {
      const cm = docs.find((o) => o.kind === "ConfigMap" && o.metadata.name === v.configMap.name);
      if (!cm) { fail(`${name(w)}: volume ${v.name} names a missing ConfigMap ${v.configMap.name}`); continue; }
      files = Object.entries(cm.data).map(([k, text]) => [k, Buffer.from(text)]);
    } else if (v.secret) {
      const s = docs.find((o) => o.kind === "Secret" && o.metadata.name === v.secret.secretName);
      if (!s) { fail(`${name(w)}: volume ${v.name} names a missing Secret ${v.secret.secretName}`); continue; }
      const items = v.secret.items || Object.keys(s.data).map((k) => ({ key: k, path: k }));
      files = items.map((it) => {
        if (!(it.key in s.data)) fail(`${name(w)}: Secret ${s.metadata.name} has no key ${it.key}`);
        return [it.path, Buffer.from(s.data[it.key] || "", "base64")];
      });
    }
    const dir = path.join(workDir, w.metadata.name, v.name);
    fs.mkdirSync(dir, { recursive: true });
    for (const [file, bytes] of files || []) fs.writeFileSync(path.join(dir, file), bytes, { mode: 0o600 });
  }
  for (const c of pod.containers) {
    for (const m of c.volumeMounts || []) mounts[`${w.metadata.name}:${m.mountPath}`] = path.join(workDir, w.metadata.name, m.name);
  }
}
// A Python worker: every path its environment and command name is mounted
// (ConfigMap or Secret), the config is the servers' one, and the script
// compiles and uses morse.torch.
// A path inside the pod -> the local file holding it (null if unmounted).
function resolveIn(w, p) {
  let best = null;
  for (const [key, dir] of Object.entries(mounts)) {
    const [owner, mountPath] = key.split(":");
    if (owner === w.metadata.name && (p === mountPath || p.startsWith(`${mountPath}/`)) &&
        (!best || mountPath.length > best[0].length)) {
      best = [mountPath, dir];
    }
  }
  return best ? best[1] + p.slice(best[0].length) : null;  // a mounted file, or the mount itself
}
function checkPythonFile(w, inPod) {
  const script = resolveIn(w, inPod || "");
  if (!script || !fs.existsSync(script)) {
    fail(`${name(w)}: the script ${inPod} is not in a mounted volume`);
    return false;
  }
  const r = spawnSync("/usr/bin/python3", ["-c", "import ast, sys; ast.parse(open(sys.argv[1]).read(), sys.argv[1])", script],
                      { encoding: "utf8" });
  if (r.status !== 0) fail(`${name(w)}: ${inPod} does not compile: ${r.stderr}`);
  if (!/import morse\.torch|from morse/.test(fs.readFileSync(script, "utf8"))) {
    fail(`${name(w)}: ${inPod} does not use morse.torch`);
  }
  return true;
}
// A container arg as it runs here: $(VAR) from env, and a --flag=PATH
// inside a mounted volume pointed at the local copy.
function localArg(w, env, arg) {
  const out = arg.replace(/\$\((\w+)\)/g, (_, v) => (v in env ? env[v] : `$(${v})`));
  const eq = out.indexOf("=");
  const local = eq < 0 ? null : resolveIn(w, out.slice(eq + 1));
  return local ? out.slice(0, eq + 1) + local : out;
}
// morse-run for one node: its own --check-config with the pod's args (the
// mounted files found here, the node rank filled in), then the script.
function checkLauncher(w, env) {
  const c = w.spec.template.spec.containers[0];
  const split = c.args.indexOf("--");
  const own = (split < 0 ? c.args : c.args.slice(0, split)).map((a) => localArg(w, env, a));
  const command = split < 0 ? [] : c.args.slice(split + 1);
  const r = spawnSync("/usr/bin/python3", ["-m", "morse.run", ...own, "--check-config", "--", ...command],
                      { encoding: "utf8", timeout: 30000,
                        env: { ...process.env, PYTHONPATH: path.join(binDir, "python"), MORSE_BIN_DIR: binDir } });
  const text = `${r.stdout || ""}${r.stderr || ""}`.trim();
  if (r.status !== 0) fail(`${name(w)} ${JSON.stringify(env)}: morse-run --check-config exited ${r.status}: ${text}`);
  else console.log(`check_config ${name(w)} ${JSON.stringify(env)}: ${text}`);
  const script = command.find((a) => a.endsWith(".py"));
  if (checkPythonFile(w, script)) console.log(`script ${name(w)}: ${script} compiles and uses morse.torch`);
}
function checkScript(w) {
  const c = w.spec.template.spec.containers[0];
  const env = envOf(c);
  for (const k of ["MORSE_CONFIG", "MORSE_TLS_CA", "MORSE_TLS_CERT", "MORSE_TLS_KEY", "MORSE_TOKEN_FILE"]) {
    const local = env[k] && resolveIn(w, env[k]);
    if (!local || !fs.existsSync(local)) fail(`${name(w)}: ${k}=${env[k]} is not a mounted file`);
  }
  if (!checkPythonFile(w, c.command[1])) return;
  console.log(`script ${name(w)}: ${c.command.join(" ")} compiles and uses morse.torch; MORSE_* files mounted`);
}
function checkConfig(w, env) {
  const c = w.spec.template.spec.containers[0];
  if (isLauncher(c)) return checkLauncher(w, env);
  if (isScript(c)) return checkScript(w);
  const binaries = { "morse-server": "server/morse-server", "morse-worker": "worker/morse-worker" };
  const binary = path.join(binDir, binaries[path.basename(c.command[0])] || c.command[0]);
  const args = (c.args || []).map((a) => localArg(w, env, a)).concat(["--check_config"]);
  const r = spawnSync(binary, args, { encoding: "utf8", timeout: 30000 });
  const text = `${r.stdout || ""}${r.stderr || ""}`.trim();
  if (r.status !== 0) fail(`${name(w)} ${JSON.stringify(env)}: ${path.basename(binary)} --check_config exited ${r.status}: ${text}`);
  else console.log(`check_config ${name(w)} ${JSON.stringify(env)}: ${text}`);
}
if (sts && job) {
  materialize(sts);
  materialize(job);
  for (const shard of [0, shards - 1]) checkConfig(sts, { SHARD: String(shard) });
  for (const rank of [0, pods - 1]) checkConfig(job, { JOB_COMPLETION_INDEX: String(rank) });
}

if (problems.length) {
  console.error(`${rendered}: ${problems.length} problem(s):\n  ${problems.join("\n  ")}`);
  process.exit(1);
}
console.log(`${rendered}: OK`);
