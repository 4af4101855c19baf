#!/usr/bin/env node
// Checks ferry's Kubernetes manifests; run by tools/k8s_check.sh, which
// installs the two npm packages this needs (package-lock.json) first.
//
//   node check.js PATH... [--self-test DIR]
//
// PATHs (files, or directories searched for *.yaml / *.yml) are checked as
// one set: every document must parse and pass
//   1. the Kubernetes API schema of its apiVersion/kind, from the npm package
//      kubernetes-models (JSON-schema validators generated from Kubernetes'
//      OpenAPI spec): types, enums, formats (quantities), required fields;
//   2. no unknown field anywhere: the OpenAPI schemas allow extra fields,
//      and the API server drops them silently (a typo'd `livenesProbe` is
//      then no probe at all), so every field the validator never looked at
//      is reported. The validator reads each field its schema knows, of
//      every object it checks; the document is wrapped in Proxies that
//      record those reads. (A free-form field, x-kubernetes-preserve-
//      unknown-fields, would be reported too; no manifest here has one.)
//   3. what the API server requires beyond the schema (a name, a
//      workload's selector matching its template, mounts naming volumes,
//      unique container names, one handler per probe, ...);
//   4. ferry's own rules for a pod running ferryd: every flag (command line
//      and --flagfile from a ConfigMap) is one ferryd defines
//      (daemon/main.cc), the grace period covers --drain_timeout_ms,
//      ferryctl in probes uses real flags and ferryd's socket, a client
//      container shares ferryd's socket directory, /dev/shm and pids, and
//      a --tls_key from a Secret is readable by ferryd only.
// A kustomization.yaml must list files that exist, and every manifest
// beside it.
//
// --self-test DIR: each *.yaml in DIR is checked on its own and must be
// refused, with every "# expect: TEXT" line of the file found in the
// messages.
//
// Output: one line per manifest file ("ok" or "FAILED", then its objects
// or its problems, indented), then one per self-test file. Exit 0 when all
// is as expected, 1 otherwise, 2 on a usage error.
'use strict';

const fs = require('fs');
const path = require('path');
const yaml = require('js-yaml');

const ROOT = path.resolve(__dirname, '..', '..');

// ---------------------------------------------------------------------------
// YAML, read as Kubernetes reads it.
//
// kubectl parses YAML 1.1 (sigs.k8s.io/yaml), js-yaml 1.2. Two differences
// matter in manifests: 0400 is octal (a file mode) in 1.1 and decimal in
// 1.2, and a plain yes/no/on/off is a boolean in 1.1 and a string in 1.2.
// Octal is read as 1.1 does; a plain yes/no/on/off is an error (quote it).

class Ambiguous {
  constructor(text) {
    this.text = text;
  }
}

// (A tag of its own: js-yaml keeps one type per tag, so another int type
// would replace the standard one rather than come before it.)
const yaml11Octal = new yaml.Type('tag:ferry,k8s-check:yaml11-octal', {
  kind: 'scalar',
  resolve: (s) => s !== null && /^[-+]?0[0-7]+$/.test(s),
  construct: (s) => parseInt(s, 8),
  predicate: () => false,
});

const yaml11Bool = new yaml.Type('tag:ferry,k8s-check:yaml11-bool', {
  kind: 'scalar',
  resolve: (s) => s !== null && /^(y|Y|yes|Yes|YES|n|N|no|No|NO|on|On|ON|off|Off|OFF)$/.test(s),
  construct: (s) => new Ambiguous(s),
  instanceOf: Ambiguous,
});

const t = yaml.types;
const SCHEMA = yaml.FAILSAFE_SCHEMA.extend({
  implicit: [t.null, t.bool, yaml11Octal, t.int, t.float, t.timestamp, t.merge, yaml11Bool],
  explicit: [t.binary, t.omap, t.pairs, t.set],
});

// Replaces Ambiguous scalars by their text and reports each.
function unambiguous(value, where, problems) {
  if (value instanceof Ambiguous) {
    problems.push(`${where.replace(/^\//, '')}: plain '${value.text}' is a boolean to Kubernetes (YAML 1.1); quote it if a string is meant`);
    return value.text;
  }
  if (Array.isArray(value)) return value.map((v, i) => unambiguous(v, `${where}/${i}`, problems));
  if (value !== null && typeof value === 'object' && !(value instanceof Date)) {
    for (const k of Object.keys(value)) value[k] = unambiguous(value[k], `${where}/${k}`, problems);
  }
  return value;
}

// ---------------------------------------------------------------------------
// The Kubernetes API schema (kubernetes-models).

function modelFor(apiVersion, kind) {
  if (typeof apiVersion !== 'string' || typeof kind !== 'string' || !/^[A-Za-z0-9.\/-]+$/.test(apiVersion)) {
    return null;
  }
  let group;
  try {
    group = require(`kubernetes-models/${apiVersion}`);
  } catch (e) {
    return null;
  }
  const Model = group[kind];
  return typeof Model === 'function' && Model.kind === kind ? Model : null;
}

// Wraps `root` so that every property read is recorded: reads.get(object)
// is the set of keys read from that object.
function recordReads(root) {
  const reads = new Map();
  const proxies = new WeakMap();
  const wrap = (value) => {
    if (value === null || typeof value !== 'object') return value;
    if (proxies.has(value)) return proxies.get(value);
    const keys = new Set();
    reads.set(value, keys);
    const proxy = new Proxy(value, {
      get(target, key) {
        if (typeof key === 'string') keys.add(key);
        return wrap(Reflect.get(target, key));
      },
    });
    proxies.set(value, proxy);
    return proxy;
  };
  return { proxy: wrap(root), reads };
}

function validateSchema(doc, Model, problems) {
  const { proxy, reads } = recordReads(doc);
  try {
    Model.prototype.validate.call(proxy);
  } catch (e) {
    const errors = Array.isArray(e.errors) ? e.errors : null;
    if (!errors) throw e;
    // A value that fits no branch of a oneOf (int-or-string, quantity) gets
    // one error per branch: keep those that say more than its type.
    const alternatives = new Set(errors.filter((err) => err.keyword === 'oneOf' || err.keyword === 'anyOf')
      .map((err) => err.instancePath));
    const specific = new Set(errors.filter((err) => !['type', 'oneOf', 'anyOf'].includes(err.keyword))
      .map((err) => err.instancePath));
    for (const err of errors) {
      if (err.keyword === 'oneOf' || err.keyword === 'anyOf') continue;
      if (err.keyword === 'type' && alternatives.has(err.instancePath) && specific.has(err.instancePath)) continue;
      const where = (err.instancePath || '').replace(/^\//, '') || '(top level)';
      let what = err.message || err.keyword;
      if (err.keyword === 'required') what = `missing required field '${err.params.missingProperty}'`;
      if (err.keyword === 'enum') what = `must be one of ${err.params.allowedValues.join(', ')}`;
      problems.push(`${where}: ${what}`);
    }
  }
  // Fields never read: unknown to the schema. Objects the validator never
  // entered (below an unknown field) are not in `reads`.
  const walk = (value, where) => {
    if (value === null || typeof value !== 'object') return;
    if (Array.isArray(value)) {
      value.forEach((v, i) => walk(v, `${where}/${i}`));
      return;
    }
    const keys = reads.get(value);
    if (!keys) return;
    for (const k of Object.keys(value)) {
      const at = where ? `${where}/${k}` : k;
      if (!keys.has(k)) {
        problems.push(`${at}: unknown field`);
      } else {
        walk(value[k], at);
      }
    }
  };
  walk(doc, '');
}

// ---------------------------------------------------------------------------
// What the API server requires beyond the schema.

const DNS_SUBDOMAIN = /^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$/;
const DNS_LABEL = /^[a-z0-9]([-a-z0-9]*[a-z0-9])?$/;

const WORKLOADS = new Set(['Deployment', 'DaemonSet', 'StatefulSet', 'ReplicaSet', 'Job']);

function podSpecOf(doc) {
  const spec = doc.spec || {};
  if (doc.kind === 'Pod') return { spec, where: 'spec' };
  if (WORKLOADS.has(doc.kind)) {
    return { spec: (spec.template || {}).spec || {}, where: 'spec/template/spec' };
  }
  if (doc.kind === 'CronJob') {
    const job = (spec.jobTemplate || {}).spec || {};
    return { spec: (job.template || {}).spec || {}, where: 'spec/jobTemplate/spec/template/spec' };
  }
  return null;
}

function allContainers(podSpec, where) {
  const out = [];
  for (const field of ['initContainers', 'containers']) {
    (podSpec[field] || []).forEach((c, i) => out.push({ c, where: `${where}/${field}/${i}`, init: field === 'initContainers' }));
  }
  return out;
}

function apiServerRules(doc, problems) {
  const meta = doc.metadata || {};
  if (typeof meta.name !== 'string' || meta.name === '') {
    problems.push('metadata/name: missing (every object needs a name)');
  } else {
    const label = doc.kind === 'Service' || doc.kind === 'Namespace';
    const ok = label ? DNS_LABEL.test(meta.name) && meta.name.length <= 63
      : DNS_SUBDOMAIN.test(meta.name) && meta.name.length <= 253;
    if (!ok) problems.push(`metadata/name: '${meta.name}' is not a valid ${label ? 'DNS label' : 'DNS subdomain'} name`);
  }

  if (WORKLOADS.has(doc.kind)) {
    const spec = doc.spec;
    if (!spec) {
      problems.push(`spec: missing (a ${doc.kind} needs a selector and a pod template)`);
      return;
    }
    const selector = (spec.selector || {}).matchLabels || {};
    const labels = ((spec.template || {}).metadata || {}).labels || {};
    if (!spec.template) problems.push('spec/template: missing');
    for (const [k, v] of Object.entries(selector)) {
      if (labels[k] !== v) problems.push(`spec/selector/matchLabels/${k}: the pod template's labels do not have ${k}: ${v}`);
    }
  }
  if (doc.kind === 'Service' && doc.spec && doc.spec.clusterIP !== 'None' && doc.spec.type !== 'ExternalName') {
    if (!Array.isArray(doc.spec.ports) || doc.spec.ports.length === 0) problems.push('spec/ports: a Service that is not headless needs ports');
  }

  const pod = podSpecOf(doc);
  if (!pod) return;
  const { spec, where } = pod;
  if (!Array.isArray(spec.containers) || spec.containers.length === 0) {
    problems.push(`${where}/containers: a pod needs at least one container`);
  }
  const volumes = new Map();
  (spec.volumes || []).forEach((v, i) => {
    if (volumes.has(v.name)) problems.push(`${where}/volumes/${i}/name: '${v.name}' is declared twice`);
    volumes.set(v.name, v);
  });
  const names = new Set();
  for (const { c, where: cw, init } of allContainers(spec, where)) {
    if (names.has(c.name)) problems.push(`${cw}/name: '${c.name}' is used by two containers`);
    names.add(c.name);
    if (typeof c.image !== 'string' || c.image === '') problems.push(`${cw}/image: missing`);
    if (c.restartPolicy !== undefined && (!init || c.restartPolicy !== 'Always')) {
      problems.push(`${cw}/restartPolicy: only an init container may set it, and only to Always (a sidecar)`);
    }
    (c.volumeMounts || []).forEach((m, i) => {
      if (!volumes.has(m.name)) problems.push(`${cw}/volumeMounts/${i}/name: no volume '${m.name}' in ${where}/volumes`);
    });
    (c.ports || []).forEach((p, i) => {
      if (p.name !== undefined && !(DNS_LABEL.test(p.name) && p.name.length <= 15 && /[a-z]/.test(p.name))) {
        problems.push(`${cw}/ports/${i}/name: '${p.name}' must be at most 15 characters of [a-z0-9-] with a letter`);
      }
    });
    for (const probe of ['startupProbe', 'readinessProbe', 'livenessProbe']) {
      if (!c[probe]) continue;
      const handlers = ['exec', 'httpGet', 'tcpSocket', 'grpc'].filter((h) => c[probe][h]);
      if (handlers.length !== 1) problems.push(`${cw}/${probe}: needs exactly one of exec, httpGet, tcpSocket, grpc (has ${handlers.length})`);
      if (init && c.restartPolicy !== 'Always' && probe !== 'startupProbe') {
        problems.push(`${cw}/${probe}: an init container that is not a sidecar cannot have probes`);
      }
    }
    // $(VAR) in command and args: Kubernetes leaves an undefined one as it
    // is, so the program gets the literal text.
    const env = new Set((c.env || []).map((e) => e.name));
    for (const field of ['command', 'args']) {
      (c[field] || []).forEach((arg, i) => {
        const unescaped = String(arg).replace(/\$\$/g, '');
        for (const m of unescaped.matchAll(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g)) {
          if (!env.has(m[1]) && !(c.envFrom || []).length) {
            problems.push(`${cw}/${field}/${i}: $(${m[1]}) is not in the container's env, so it stays literal`);
          }
        }
      });
    }
  }
}

// A Service's named targetPort must be a port of the pods it selects.
function serviceRules(doc, set, problems) {
  if (doc.kind !== 'Service' || !doc.spec || !doc.spec.selector) return;
  const selected = set.filter((o) => {
    const pod = podSpecOf(o.doc);
    if (!pod) return false;
    const labels = o.doc.kind === 'Pod' ? (o.doc.metadata || {}).labels || {}
      : (((o.doc.spec || {}).template || {}).metadata || {}).labels || {};
    return Object.entries(doc.spec.selector).every(([k, v]) => labels[k] === v);
  });
  if (selected.length === 0) return;  // pods defined elsewhere
  (doc.spec.ports || []).forEach((p, i) => {
    if (typeof p.targetPort !== 'string') return;
    const found = selected.some((o) => allContainers(podSpecOf(o.doc).spec, '').some(({ c }) =>
      (c.ports || []).some((cp) => cp.name === p.targetPort)));
    if (!found) problems.push(`spec/ports/${i}/targetPort: no container port named '${p.targetPort}' in the pods it selects`);
  });
}

// ---------------------------------------------------------------------------
// ferry's rules for pods that run ferryd.

function definedFlags(file) {
  const text = fs.readFileSync(path.join(ROOT, file), 'utf8');
  const flags = new Map();
  for (const m of text.matchAll(/DEFINE_(bool|int32|int64|uint64|double|string)\(\s*(\w+)\s*,\s*([^,]+),/g)) {
    flags.set(m[2], { type: m[1], default: m[3].trim() });
  }
  if (flags.size === 0) throw new Error(`no DEFINE_ flags found in ${file}`);
  return flags;
}

// gflags' and glog's own flags, which ferryd and ferryctl accept too.
const LIBRARY_FLAGS = new Map([
  ['flagfile', 'string'], ['fromenv', 'string'], ['tryfromenv', 'string'], ['undefok', 'string'],
  ['help', 'bool'], ['helpfull', 'bool'], ['helpshort', 'bool'], ['version', 'bool'],
  ['logtostderr', 'bool'], ['alsologtostderr', 'bool'], ['colorlogtostderr', 'bool'],
  ['stderrthreshold', 'int32'], ['minloglevel', 'int32'], ['log_dir', 'string'],
  ['v', 'int32'], ['vmodule', 'string'], ['log_prefix', 'bool'],
].map(([name, type]) => [name, { type, default: '' }]));

// ferryctl's commands, as client/ferryctl/ferryctl.cc names them: entries
// of its table of verbs ({"health", "summary", "usage", "details",
// {flags...}, &Health}), or, in the older form, the `command != "health"`
// checks of main(). An empty set is an error here rather than a refusal of
// every probe.
function ferryctlCommands(text) {
  const commands = new Set([...text.matchAll(/command != "(\w+)"/g)].map((m) => m[1]));
  for (const m of text.matchAll(/\{"(\w+)",(?:[^{}]|\{[^{}]*\})*?&\w+\s*\}/g)) commands.add(m[1]);
  if (commands.size === 0) throw new Error('no ferryctl commands found in client/ferryctl/ferryctl.cc (neither a verb table nor command != "..." checks)');
  return commands;
}

let FERRYD_FLAGS = null;
let FERRYCTL_FLAGS = null;
let FERRYCTL_COMMANDS = null;
let DEFAULT_DRAIN_MS = null;

function loadFerryFlags() {
  if (FERRYD_FLAGS) return;
  FERRYD_FLAGS = new Map([...LIBRARY_FLAGS, ...definedFlags('daemon/main.cc')]);
  FERRYCTL_FLAGS = new Map([...LIBRARY_FLAGS, ...definedFlags('client/ferryctl/ferryctl.cc')]);
  FERRYCTL_COMMANDS = ferryctlCommands(fs.readFileSync(path.join(ROOT, 'client/ferryctl/ferryctl.cc'), 'utf8'));
  DEFAULT_DRAIN_MS = Number(FERRYD_FLAGS.get('drain_timeout_ms').default);
}

// gflags' command line: --name=value, --name value (not for bools),
// --name / --noname (bools), one or two dashes. Returns [{name, value}].
function parseFlags(tokens, known, what, problems) {
  const out = [];
  const positional = [];
  for (let i = 0; i < tokens.length; i++) {
    const tok = String(tokens[i]);
    if (!tok.startsWith('-') || tok === '-' || tok === '--') {
      positional.push(tok);
      continue;
    }
    const body = tok.replace(/^--?/, '');
    const eq = body.indexOf('=');
    let name = eq < 0 ? body : body.slice(0, eq);
    let value = eq < 0 ? null : body.slice(eq + 1);
    let flag = known.get(name);
    if (!flag && value === null && name.startsWith('no') && known.has(name.slice(2)) &&
        known.get(name.slice(2)).type === 'bool') {
      name = name.slice(2);
      flag = known.get(name);
      value = 'false';
    }
    if (!flag) {
      problems.push(`${what}: unknown flag --${name}`);
      continue;
    }
    if (value === null) {
      if (flag.type === 'bool') {
        value = 'true';
      } else if (i + 1 < tokens.length) {
        value = String(tokens[++i]);
      } else {
        problems.push(`${what}: --${name} needs a value`);
        continue;
      }
    }
    out.push({ name, value });
  }
  return { flags: out, positional };
}

// The volume and path inside it that a container sees at `file`.
function volumeAt(container, podSpec, file) {
  let best = null;
  for (const m of container.volumeMounts || []) {
    const mp = m.mountPath.replace(/\/+$/, '');
    if (file === mp || file.startsWith(`${mp}/`)) {
      if (!best || mp.length > best.mp.length) best = { m, mp };
    }
  }
  if (!best) return null;
  const volume = (podSpec.volumes || []).find((v) => v.name === best.m.name);
  const rest = file === best.mp ? '' : file.slice(best.mp.length + 1);
  return { volume, mount: best.m, rest: best.m.subPath ? path.posix.join(best.m.subPath, rest) : rest };
}

// The flags of a flagfile held in a ConfigMap of the set.
function flagfileFlags(file, container, podSpec, set, what, problems) {
  const at = volumeAt(container, podSpec, file);
  if (!at || !at.volume || !at.volume.configMap) {
    problems.push(`${what}: --flagfile=${file} is not on a ConfigMap volume of the pod`);
    return [];
  }
  const cmName = at.volume.configMap.name;
  let key = at.rest;
  const item = (at.volume.configMap.items || []).find((it) => it.path === at.rest);
  if (item) key = item.key;
  const cm = set.find((o) => o.doc.kind === 'ConfigMap' && (o.doc.metadata || {}).name === cmName);
  if (!cm) {
    if (!at.volume.configMap.optional) problems.push(`${what}: --flagfile=${file}: ConfigMap '${cmName}' is not among the manifests checked`);
    return [];
  }
  const text = (cm.doc.data || {})[key];
  if (typeof text !== 'string') {
    problems.push(`${what}: --flagfile=${file}: ConfigMap '${cmName}' has no key '${key}'`);
    return [];
  }
  const tokens = [];
  text.split('\n').forEach((raw, n) => {
    const line = raw.trim();
    if (line === '' || line.startsWith('#')) return;
    if (!line.startsWith('-')) {
      // gflags reads such a line as a list of program names the flags after
      // it apply to, and skips those flags for every other program.
      problems.push(`${what}: ConfigMap '${cmName}' ${key} line ${n + 1}: '${line}' is not a flag; gflags would take it as a program-name filter`);
      return;
    }
    tokens.push(line);
  });
  return parseFlags(tokens, FERRYD_FLAGS, `${what}: ConfigMap '${cmName}' ${key}`, problems).flags;
}

function basename(p) {
  return String(p).split('/').pop();
}

// ferryctl command lines in an exec probe: the command itself, or each
// pipeline stage of `sh -c SCRIPT` that runs ferryctl.
function ferryctlInvocations(exec) {
  const cmd = (exec && exec.command) || [];
  if (cmd.length === 0) return [];
  if (basename(cmd[0]) === 'ferryctl') return [cmd.slice(1)];
  if (['sh', 'bash', 'dash'].includes(basename(cmd[0]))) {
    const c = cmd.indexOf('-c') >= 0 ? cmd.indexOf('-c') : cmd.findIndex((a) => /^-[a-z]*c$/.test(a));
    if (c < 0 || c + 1 >= cmd.length) return [];
    return String(cmd[c + 1]).split(/\|\||&&|[|;\n]/).map((stage) => {
      const words = stage.trim().split(/\s+/).map((w) => w.replace(/^['"]|['"]$/g, ''));
      return words.length && basename(words[0]) === 'ferryctl' ? words.slice(1) : null;
    }).filter((w) => w !== null);
  }
  return [];
}

function ferryRules(doc, set, problems) {
  const pod = podSpecOf(doc);
  if (!pod) return;
  const { spec, where } = pod;
  const containers = allContainers(spec, where);
  const daemons = containers.filter(({ c }) => (c.command || []).length && basename(c.command[0]) === 'ferryd');
  if (daemons.length === 0) return;
  loadFerryFlags();

  const sockets = [];
  for (const { c, where: cw } of daemons) {
    const what = `${cw} (ferryd)`;
    const tokens = [...(c.command || []).slice(1), ...(c.args || [])];
    const { flags, positional } = parseFlags(tokens, FERRYD_FLAGS, what, problems);
    if (positional.length) problems.push(`${what}: ferryd takes no arguments besides flags (got ${positional.join(' ')})`);
    // Flags in order, a flagfile's in its place; the last value wins.
    const merged = new Map();
    for (const f of flags) {
      if (f.name === 'flagfile') {
        for (const ff of flagfileFlags(f.value, c, spec, set, what, problems)) merged.set(ff.name, ff.value);
      } else {
        merged.set(f.name, f.value);
      }
    }

    // The grace period covers the drain: ferryd exits at most
    // --drain_timeout_ms + 3 s after SIGTERM (daemon/main.cc); 2 s more for
    // the exit to be seen before the kubelet's SIGKILL.
    const drainMs = merged.has('drain_timeout_ms') ? Number(merged.get('drain_timeout_ms')) : DEFAULT_DRAIN_MS;
    const graceS = spec.terminationGracePeriodSeconds === undefined ? 30 : spec.terminationGracePeriodSeconds;
    if (!Number.isFinite(drainMs) || drainMs < 0) {
      problems.push(`${what}: --drain_timeout_ms=${merged.get('drain_timeout_ms')} is not a number of ms`);
    } else if (graceS * 1000 < drainMs + 5000) {
      problems.push(`${where}/terminationGracePeriodSeconds: ${graceS} s is shorter than ferryd's --drain_timeout_ms=${drainMs} + 5 s; the kubelet would kill it mid-drain`);
    }

    const socket = merged.get('socket');
    if (!socket && merged.get('unix') !== 'false') {
      problems.push(`${what}: set --socket (its default depends on $XDG_RUNTIME_DIR and the uid)`);
    } else if (socket) {
      const at = volumeAt(c, spec, socket);
      if (!at) problems.push(`${what}: --socket=${socket} is not on a volume, so no other container or pod can reach it`);
      sockets.push({ socket, at, c });
    }

    // ferryd refuses a key that is not its uid's, mode 0600 or stricter.
    // Secret files belong to root, and an fsGroup makes them group-readable.
    const key = merged.get('tls_key');
    if (key) {
      const at = volumeAt(c, spec, key);
      const secret = at && at.volume && at.volume.secret;
      if (secret) {
        const item = (secret.items || []).find((it) => it.path === at.rest);
        const mode = item && item.mode !== undefined ? item.mode : secret.defaultMode === undefined ? 0o644 : secret.defaultMode;
        const uid = (c.securityContext || {}).runAsUser !== undefined ? c.securityContext.runAsUser : (spec.securityContext || {}).runAsUser;
        if ((mode & 0o077) !== 0) problems.push(`${what}: --tls_key=${key} is on a Secret volume of mode 0${mode.toString(8)}; ferryd needs 0600 or stricter`);
        if ((spec.securityContext || {}).fsGroup !== undefined) problems.push(`${what}: --tls_key=${key} is on a Secret volume and the pod has an fsGroup, which makes it group-readable; ferryd refuses it`);
        if (uid !== 0) problems.push(`${what}: --tls_key=${key} is on a Secret volume (owned by root) but ferryd does not run as root; copy it (an init container) to a volume of ferryd's uid`);
      }
    }
  }

  // ferryctl in probes: real flags and command, and ferryd's socket.
  for (const { c, where: cw } of containers) {
    for (const probe of ['startupProbe', 'readinessProbe', 'livenessProbe']) {
      for (const words of ferryctlInvocations((c[probe] || {}).exec)) {
        const what = `${cw}/${probe} (ferryctl)`;
        const { flags, positional } = parseFlags(words, FERRYCTL_FLAGS, what, problems);
        if (positional.length !== 1 || !FERRYCTL_COMMANDS.has(positional[0])) {
          problems.push(`${what}: needs one command of ${[...FERRYCTL_COMMANDS].join(', ')} (got ${positional.join(' ') || 'none'})`);
        }
        const daemon = (flags.find((f) => f.name === 'daemon') || {}).value;
        if (!daemon) {
          problems.push(`${what}: set --daemon=unix:PATH (its default depends on the environment)`);
        } else if (daemon.startsWith('unix:') && !sockets.some((s) => s.socket === daemon.slice(5))) {
          problems.push(`${what}: --daemon=${daemon} is not ferryd's --socket in this pod (${sockets.map((s) => s.socket).join(', ') || 'none'})`);
        }
      }
    }
  }

  // Client containers in the pod (those told where ferryd is): the socket
  // directory on the same volume, the same /dev/shm, the same pids.
  for (const { c, where: cw } of containers) {
    const env = (c.env || []).find((e) => e.name === 'FERRY_SOCKET');
    if (!env || env.value === undefined) continue;
    const own = sockets.find((x) => x.c === c);
    if (own) {
      // ferryd's own container: for ferryctl run there (kubectl exec).
      if (env.value !== own.socket) problems.push(`${cw}: FERRY_SOCKET=${env.value} is not this ferryd's --socket=${own.socket}`);
      continue;
    }
    const what = `${cw} (ferry client)`;
    const s = sockets.find((x) => x.socket === env.value);
    if (!s) {
      problems.push(`${what}: FERRY_SOCKET=${env.value} is not ferryd's --socket in this pod (${sockets.map((x) => x.socket).join(', ') || 'none'})`);
      continue;
    }
    const at = volumeAt(c, spec, env.value);
    if (!at || !s.at || at.volume !== s.at.volume) {
      problems.push(`${what}: FERRY_SOCKET=${env.value} is not on the volume ferryd's socket is on`);
    }
    if (!spec.hostIPC) {
      const mine = volumeAt(c, spec, '/dev/shm');
      const its = volumeAt(s.c, spec, '/dev/shm');
      if (!mine || !its || mine.volume !== its.volume || mine.rest !== '' || its.rest !== '') {
        problems.push(`${what}: shares no /dev/shm with ferryd (mount one memory-backed emptyDir at /dev/shm in both, or hostIPC)`);
      }
    }
    if (!spec.shareProcessNamespace && !spec.hostPID) {
      problems.push(`${what}: ferryd cannot see this container's pids (memfd regions, the pid it watches, CUDA IPC): set shareProcessNamespace (or hostPID)`);
    }
  }
}

// ---------------------------------------------------------------------------
// kustomization.yaml

const KUSTOMIZATION_FIELDS = new Set([
  'apiVersion', 'kind', 'metadata', 'resources', 'components', 'namespace', 'namePrefix', 'nameSuffix',
  'labels', 'commonLabels', 'commonAnnotations', 'images', 'replicas', 'patches', 'patchesStrategicMerge',
  'patchesJson6902', 'configMapGenerator', 'secretGenerator', 'generatorOptions', 'replacements', 'vars',
  'crds', 'openapi', 'buildMetadata', 'sortOptions', 'helmCharts', 'transformers', 'generators', 'validators',
]);

function checkKustomization(doc, file, problems) {
  if (doc.apiVersion !== 'kustomize.config.k8s.io/v1beta1' || doc.kind !== 'Kustomization') {
    problems.push('apiVersion/kind: must be kustomize.config.k8s.io/v1beta1 Kustomization');
  }
  for (const k of Object.keys(doc)) {
    if (!KUSTOMIZATION_FIELDS.has(k)) problems.push(`${k}: unknown field`);
  }
  const dir = path.resolve(path.dirname(file));
  const listed = new Set();
  (doc.resources || []).forEach((r, i) => {
    if (typeof r !== 'string') {
      problems.push(`resources/${i}: must be a path`);
      return;
    }
    if (/^[a-z]+:\/\//.test(r)) return;  // remote bases are not checked
    const p = path.resolve(dir, r);
    listed.add(p);
    if (!fs.existsSync(p)) problems.push(`resources/${i}: ${r} does not exist`);
  });
  for (const f of fs.readdirSync(dir)) {
    const p = path.join(dir, f);
    if (/\.ya?ml$/.test(f) && f !== path.basename(file) && fs.statSync(p).isFile() && !listed.has(p)) {
      problems.push(`resources: ${f} is beside this kustomization but not listed (move examples into a subdirectory)`);
    }
  }
}

// ---------------------------------------------------------------------------

function rel(p) {
  return path.relative(process.cwd(), p) || p;
}

function manifestFiles(p) {
  const st = fs.statSync(p);
  if (st.isFile()) return [p];
  const out = [];
  for (const e of fs.readdirSync(p, { withFileTypes: true }).sort((a, b) => a.name.localeCompare(b.name))) {
    const q = path.join(p, e.name);
    if (e.isDirectory()) out.push(...manifestFiles(q));
    else if (/\.ya?ml$/.test(e.name)) out.push(q);
  }
  return out;
}

// Checks the files as one set. Returns [{file, objects, problems}].
function checkSet(files) {
  const results = [];
  const set = [];  // {doc, result}
  for (const file of files) {
    const result = { file, objects: [], problems: [] };
    results.push(result);
    let docs;
    try {
      docs = yaml.loadAll(fs.readFileSync(file, 'utf8'), null, { filename: rel(file), schema: SCHEMA });
    } catch (e) {
      result.problems.push(`YAML does not parse: ${e.message.split('\n')[0]}`);
      continue;
    }
    docs.forEach((raw, i) => {
      if (raw === null || raw === undefined) return;  // an empty document
      const prefix = docs.length > 1 ? `document ${i + 1}: ` : '';
      const problems = [];
      const doc = unambiguous(raw, '', problems);
      if (typeof doc !== 'object' || Array.isArray(doc)) {
        result.problems.push(`${prefix}not a mapping`);
        return;
      }
      const label = doc.kind === 'Kustomization' ? 'Kustomization'
        : `${doc.kind || '?'} ${(doc.metadata || {}).name || '?'}`;
      result.objects.push(label);
      if (doc.kind === 'Kustomization' || path.basename(file) === 'kustomization.yaml') {
        checkKustomization(doc, file, problems);
      } else {
        const Model = modelFor(doc.apiVersion, doc.kind);
        if (!Model) {
          problems.push(`apiVersion/kind: ${doc.apiVersion} ${doc.kind} is not a Kubernetes API kind this validator knows`);
        } else {
          validateSchema(doc, Model, problems);
          apiServerRules(doc, problems);
          set.push({ doc, label, problems, prefix, result });
        }
      }
      for (const p of problems) result.problems.push(`${prefix}${label}: ${p}`);
    });
  }
  // Rules across objects, once every file is read.
  for (const o of set) {
    const problems = [];
    serviceRules(o.doc, set, problems);
    ferryRules(o.doc, set, problems);
    for (const p of problems) o.result.problems.push(`${o.prefix}${o.label}: ${p}`);
  }
  return results;
}

function selfTest(dir) {
  let ok = true;
  for (const file of manifestFiles(dir)) {
    const expects = [...fs.readFileSync(file, 'utf8').matchAll(/^# expect: (.+)$/gm)].map((m) => m[1].trim());
    const [result] = checkSet([file]);
    const text = result.problems.join('\n');
    const missing = expects.filter((e) => !text.includes(e));
    if (result.problems.length === 0) {
      ok = false;
      console.log(`FAILED  ${rel(file)}: accepted, but it is a bad manifest`);
    } else if (expects.length === 0 || missing.length) {
      ok = false;
      console.log(`FAILED  ${rel(file)}: refused, but not ${expects.length ? `for: ${missing.join('; ')}` : 'for a reason given by a "# expect:" line'}`);
      for (const p of result.problems) console.log(`          ${p}`);
    } else {
      console.log(`refused ${rel(file)} (as it should be): ${result.problems[0]}`);
    }
  }
  return ok;
}

function main(argv) {
  const paths = [];
  let selfTestDir = null;
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === '--self-test' && i + 1 < argv.length) selfTestDir = argv[++i];
    else if (argv[i].startsWith('-')) {
      console.error(`usage: node check.js PATH... [--self-test DIR]`);
      return 2;
    } else paths.push(argv[i]);
  }
  if (paths.length === 0 && !selfTestDir) {
    console.error(`usage: node check.js PATH... [--self-test DIR]`);
    return 2;
  }
  let ok = true;
  const files = [];
  for (const p of paths) {
    if (!fs.existsSync(p)) {
      console.log(`FAILED  ${p}: no such file or directory`);
      ok = false;
      continue;
    }
    files.push(...manifestFiles(p));
  }
  if (paths.length && files.length === 0) {
    console.log(`FAILED  ${paths.join(' ')}: no *.yaml manifests`);
    ok = false;
  }
  for (const r of checkSet(files)) {
    if (r.problems.length === 0) {
      console.log(`ok      ${rel(r.file)}: ${r.objects.join(', ') || '(empty)'}`);
    } else {
      ok = false;
      console.log(`FAILED  ${rel(r.file)}:`);
      for (const p of r.problems) console.log(`          ${p}`);
    }
  }
  if (selfTestDir && !selfTest(selfTestDir)) ok = false;
  return ok ? 0 : 1;
}

process.exitCode = main(process.argv.slice(2));
