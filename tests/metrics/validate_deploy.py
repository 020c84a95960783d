#!/usr/bin/env python3
"""Validates deploy/ and the Dockerfile beyond "it parses".

- grafana/dashboards/ampd.json: JSON, the job variable, the panels the
  operators need (log2 loss-scale axis, heatmap of the log2 buckets, phase
  quantiles), unique ids.
- Every ampd_* name the dashboard and the alert rules query is one that a
  running ServerMetrics actually exports: metrics_fixture_server is started
  and scraped, so renaming a family without updating deploy/ fails here.
- YAML (Grafana provisioning, docker-compose.yml, k8s/*.yaml) with PyYAML
  (Debian's python3-yaml, in scripts/install-deps.sh); no PyYAML is a failure,
  not a skip. The Prometheus files are promtool's job (see CMakeLists.txt).
- The wiring between files: GPU reservation and request, gRPC probes, the
  Prometheus annotations, the state volume, ampd's flags in every launcher,
  Grafana's provisioning path equal to where compose mounts the dashboards.
- The data-parallel deployments (k8s/distributed/, docker-compose.distributed.yml):
  every rank's --peer-address is an address the others reach, rank 0's name
  is stable, each rank has its own state volume, and the unauthenticated
  peer port is reachable only by the ranks.
- The Tinker front (tinker/): its sidecar overlay names files that exist,
  reaches ampd on the pod's loopback, probes /healthz on its port, shares
  the state volume and mounts the models read-only; its Dockerfile runs
  `python -m ampd_tinker` on the port the manifests use.
- Every kustomization (k8s/, k8s/distributed/, secure/k8s/, tinker/k8s/)
  builds with `kubectl kustomize` where kubectl is installed (an overlay
  inside its own base is a cycle kustomize refuses); without kubectl this
  part says it did not run.

Exits non-zero with every problem listed.
"""
import argparse
import json
import os
import re
import select
import shutil
import subprocess
import sys
import urllib.request

AMPD_FLAGS = [
    "--listen=0.0.0.0:50051",
    "--metrics-listen=0.0.0.0:9464",
    "--state-dir=/var/lib/ampd",
    "--device=auto",
]

problems = []


def check(condition, message):
    if not condition:
        problems.append(message)
    return condition


def load_yaml_all(path):
    import yaml  # imported here so a missing module is reported once, clearly

    with open(path, encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def scrape_fixture(fixture, timeout_s=30):
    """Sample names exported by metrics_fixture_server (every family populated)."""
    proc = subprocess.Popen([fixture, "127.0.0.1:0"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        if not ready:
            raise RuntimeError("metrics_fixture_server printed no port within %ds" % timeout_s)
        port = int(proc.stdout.readline().strip())
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=timeout_s) as r:
            text = r.read().decode("utf-8")
    finally:
        proc.stdin.close()  # the fixture serves until its stdin closes
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def ampd_names(expr):
    return set(re.findall(r"\bampd_[a-z0-9_]+", expr))


def check_dashboard(path):
    with open(path, encoding="utf-8") as f:
        dash = json.load(f)
    check(dash.get("uid") and dash.get("title"), "dashboard: uid and title are required")
    variables = {v.get("name"): v for v in dash.get("templating", {}).get("list", [])}
    def variable_query(v):
        query = v.get("query")
        return query.get("query") if isinstance(query, dict) else query

    tenant = variables.get("tenant")
    if check(tenant is not None, "dashboard: no 'tenant' variable"):
        check(variable_query(tenant) == "label_values(ampd_loss_scale, tenant)",
              "dashboard: tenant variable must query label_values(ampd_loss_scale, tenant), got %r"
              % variable_query(tenant))
        # Jobs of an open server have no tenant label: only the regex .* as
        # "All" still matches them.
        check(tenant.get("includeAll") and tenant.get("allValue") == ".*",
              "dashboard: tenant variable needs includeAll with allValue '.*'")
    job = variables.get("job")
    if check(job is not None, "dashboard: no 'job' variable"):
        want = 'label_values(ampd_loss_scale{tenant=~"$tenant"}, job)'
        check(variable_query(job) == want,
              "dashboard: job variable must query %s, got %r" % (want, variable_query(job)))
    exprs = []
    ids = set()
    panels = dash.get("panels", [])
    for p in panels:
        check(p.get("id") not in ids, "dashboard: duplicate panel id %r" % p.get("id"))
        ids.add(p.get("id"))
        g = p.get("gridPos", {})
        check(0 <= g.get("x", -1) and g.get("x", 0) + g.get("w", 0) <= 24,
              "dashboard: panel %r lies outside the 24-column grid" % p.get("title"))
        if p.get("type") == "row":
            continue
        targets = p.get("targets", [])
        check(targets, "dashboard: panel %r has no queries" % p.get("title"))
        for t in targets:
            check(t.get("expr"), "dashboard: panel %r has a query without expr" % p.get("title"))
            exprs.append(t.get("expr", ""))

    def panels_where(pred):
        return [p for p in panels if p.get("type") != "row" and pred(p)]

    def queries(p):
        return " ".join(t.get("expr", "") for t in p.get("targets", []))

    scale = panels_where(lambda p: "ampd_loss_scale{" in queries(p))
    check(any(p.get("fieldConfig", {}).get("defaults", {}).get("custom", {})
              .get("scaleDistribution") == {"type": "log", "log": 2} for p in scale),
          "dashboard: the loss scale panel needs a log2 axis")
    heat = panels_where(lambda p: p.get("type") == "heatmap"
                        and "ampd_grad_magnitude_log2_bucket" in queries(p))
    check(heat and all(t.get("format") == "heatmap" for p in heat for t in p["targets"]),
          "dashboard: needs a heatmap of ampd_grad_magnitude_log2_bucket in heatmap format")
    check(panels_where(lambda p: "histogram_quantile" in queries(p)
                       and "ampd_step_duration_seconds_bucket" in queries(p)
                       and "phase" in queries(p)),
          "dashboard: needs step time by phase through histogram_quantile")
    # Data parallel: communication time per rank and the straggler skew.
    check(panels_where(lambda p: "histogram_quantile" in queries(p)
                       and 'phase="allreduce"' in queries(p) and "instance" in queries(p)),
          "dashboard: needs the all-reduce time per rank (phase=\"allreduce\" by instance)")
    check(panels_where(lambda p: 'phase="wait"' in queries(p) and "max by" in queries(p)),
          "dashboard: needs the straggler wait (phase=\"wait\") with its max over ranks")
    check(any(p.get("type") == "row" and p.get("title") == "Data parallel" for p in panels),
          "dashboard: no 'Data parallel' row")
    for name in ["ampd_skipped_steps_total", "ampd_loss_scale_growths_total",
                 "ampd_loss_scale_backoffs_total", "ampd_loss_scale_growths_deferred_total",
                 "ampd_grad_underflow_fraction", "ampd_loss{", "ampd_grad_norm",
                 "ampd_samples_total", "ampd_jobs", "ampd_device_memory_used_bytes",
                 "ampd_distributed_group_formations_total", "ampd_logprob_mismatch"]:
        check(any(name in e for e in exprs), "dashboard: nothing charts %s" % name)
    for e in exprs:
        check('job=~"$job"' not in e or 'tenant=~"$tenant"' in e,
              "dashboard: a per-job query must also filter by tenant: %s" % e)
    return exprs


def check_alert_exprs(path):
    exprs = []
    for doc in load_yaml_all(path):
        for group in doc.get("groups", []):
            for rule in group.get("rules", []):
                exprs.append(rule.get("expr", ""))
    return exprs


def flags_of(argv):
    return [a for a in argv if isinstance(a, str) and a.startswith("--")]


def check_compose(deploy_dir):
    path = os.path.join(deploy_dir, "docker-compose.yml")
    (compose,) = load_yaml_all(path)
    services = compose.get("services", {})
    for name in ["ampd", "prometheus", "grafana"]:
        check(name in services, "compose: no %s service" % name)
    ampd = services.get("ampd", {})
    devices = (ampd.get("deploy", {}).get("resources", {}).get("reservations", {})
               .get("devices", []))
    check(any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])
              for d in devices), "compose: ampd needs an nvidia GPU reservation")
    check(any(str(v).endswith(":/var/lib/ampd") for v in ampd.get("volumes", [])),
          "compose: ampd needs a state volume at /var/lib/ampd")
    named = set((compose.get("volumes") or {}).keys())
    for svc_name, svc in services.items():
        for v in svc.get("volumes", []):
            source = str(v).split(":")[0]
            if source.startswith("."):
                check(os.path.exists(os.path.normpath(os.path.join(deploy_dir, source))),
                      "compose: %s mounts %s, which does not exist" % (svc_name, source))
            else:
                check(source in named, "compose: %s uses undeclared volume %s" % (svc_name, source))
    # Grafana must find the dashboards where the provisioning file says.
    (provider,) = load_yaml_all(
        os.path.join(deploy_dir, "grafana/provisioning/dashboards/ampd.yml"))
    wanted = provider["providers"][0]["options"]["path"]
    mounts = {str(v).split(":")[1]: str(v).split(":")[0]
              for v in services.get("grafana", {}).get("volumes", [])}
    check(mounts.get(wanted) == "./grafana/dashboards",
          "compose: grafana must mount ./grafana/dashboards at %s" % wanted)
    check(mounts.get("/etc/grafana/provisioning") == "./grafana/provisioning",
          "compose: grafana must mount ./grafana/provisioning")
    prom_mounts = [str(v) for v in services.get("prometheus", {}).get("volumes", [])]
    for f in ["prometheus.yml", "alerts.yml"]:
        check(any(m.startswith("./prometheus/%s:/etc/prometheus/%s" % (f, f)) for m in prom_mounts),
              "compose: prometheus must mount %s into /etc/prometheus" % f)
    # ampd's flags come from the image's ENTRYPOINT; a compose command would
    # be appended to them.
    check("command" not in ampd and "entrypoint" not in ampd,
          "compose: ampd must use the image's ENTRYPOINT flags")


def check_k8s(deploy_dir):
    k8s = os.path.join(deploy_dir, "k8s")
    docs = []
    for name in sorted(os.listdir(k8s)):
        if name.endswith((".yaml", ".yml")):
            docs.extend(load_yaml_all(os.path.join(k8s, name)))
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d.get("kind"), []).append(d)
    for kind in ["Deployment", "Service", "PersistentVolumeClaim"]:
        check(kind in by_kind, "k8s: no %s" % kind)
    if "Deployment" not in by_kind:
        return
    dep = by_kind["Deployment"][0]
    pod = dep["spec"]["template"]
    spec = pod["spec"]
    check(spec.get("terminationGracePeriodSeconds", 30) >= 60,
          "k8s: terminationGracePeriodSeconds must leave time to checkpoint (>= 60)")
    ann = pod.get("metadata", {}).get("annotations", {})
    check(ann.get("prometheus.io/scrape") == "true" and ann.get("prometheus.io/port") == "9464"
          and ann.get("prometheus.io/path") == "/metrics", "k8s: prometheus.io annotations")
    c = spec["containers"][0]
    res = c.get("resources", {})
    check(str(res.get("limits", {}).get("nvidia.com/gpu")) == "1",
          "k8s: ampd must limit nvidia.com/gpu: 1")
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    check(ports.get("grpc") == 50051 and ports.get("metrics") == 9464,
          "k8s: container ports grpc 50051 and metrics 9464")
    for probe in ["livenessProbe", "readinessProbe"]:
        check(c.get(probe, {}).get("grpc", {}).get("port") == 50051,
              "k8s: %s must be a gRPC probe on 50051" % probe)
    argv = list(c.get("command", [])) + list(c.get("args", []))
    check(sorted(flags_of(argv)) == sorted(AMPD_FLAGS),
          "k8s: ampd flags %s, expected %s" % (flags_of(argv), AMPD_FLAGS))
    mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
    claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName")
              for v in spec.get("volumes", [])}
    pvc_names = {p["metadata"]["name"] for p in by_kind.get("PersistentVolumeClaim", [])}
    state = [n for n, path in mounts.items() if path == "/var/lib/ampd"]
    check(state and claims.get(state[0]) in pvc_names,
          "k8s: /var/lib/ampd must be mounted from the PersistentVolumeClaim")
    labels = pod.get("metadata", {}).get("labels", {})
    check(dep["spec"]["selector"]["matchLabels"].items() <= labels.items(),
          "k8s: Deployment selector does not match its pod labels")
    for svc in by_kind.get("Service", []):
        sel = svc["spec"].get("selector", {})
        check(sel and sel.items() <= labels.items(), "k8s: Service selector matches no ampd pod")
        svc_ports = {p.get("port"): p.get("targetPort") for p in svc["spec"].get("ports", [])}
        check(svc_ports.get(50051) in ("grpc", 50051) and svc_ports.get(9464) in ("metrics", 9464),
              "k8s: Service must expose 50051 (grpc) and 9464 (metrics)")


PEER_PORT = 50052


def check_tinker(deploy_dir):
    folder = os.path.join(deploy_dir, "tinker", "k8s")
    (kustomization,) = load_yaml_all(os.path.join(folder, "kustomization.yaml"))
    for name in kustomization.get("resources", []):
        check(os.path.exists(os.path.join(folder, name)), "tinker/k8s: no resource %s" % name)
    for patch in kustomization.get("patches", []):
        check(os.path.exists(os.path.join(folder, patch["path"])),
              "tinker/k8s: no patch %s" % patch["path"])
    docs = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".yaml") and name != "kustomization.yaml":
            docs.extend(load_yaml_all(os.path.join(folder, name)))
    by_kind = {d["kind"]: d for d in docs}
    pod = by_kind.get("Deployment", {}).get("spec", {}).get("template", {}).get("spec", {})
    containers = {c["name"]: c for c in pod.get("containers", [])}
    front = containers.get("ampd-tinker")
    if not check(front is not None, "tinker/k8s: no ampd-tinker container"):
        return
    check("--ampd=127.0.0.1:50051" in front.get("args", []),
          "tinker/k8s: the front must reach ampd on the pod's loopback")
    port = {p["name"]: p["containerPort"] for p in front.get("ports", [])}.get("tinker")
    check(port == 8000, "tinker/k8s: container port tinker 8000")
    for probe in ("readinessProbe", "livenessProbe"):
        get = front.get(probe, {}).get("httpGet", {})
        check(get.get("path") == "/healthz" and get.get("port") == "tinker",
              "tinker/k8s: %s must GET /healthz on port tinker" % probe)
    mounts = {m["mountPath"]: m for m in front.get("volumeMounts", [])}
    check(mounts.get("/var/lib/ampd", {}).get("name") == "state",
          "tinker/k8s: the front keeps its state on ampd's state volume")
    check(mounts.get("/models", {}).get("readOnly") is True,
          "tinker/k8s: /models mounted read-only")
    claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName")
              for v in pod.get("volumes", [])}
    pvcs = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    check(claims.get("models") in pvcs, "tinker/k8s: the models claim is not defined")
    svc = by_kind.get("Service", {})
    check([(p["port"], p["targetPort"]) for p in svc.get("spec", {}).get("ports", [])]
          == [(8000, "tinker")], "tinker/k8s: Service must expose 8000 (tinker)")
    with open(os.path.join(deploy_dir, "tinker", "Dockerfile")) as f:
        dockerfile = f.read()
    check(re.search(r"^EXPOSE 8000$", dockerfile, re.M) is not None,
          "tinker/Dockerfile: EXPOSE 8000")
    check('"-m", "ampd_tinker"' in dockerfile and "--listen=0.0.0.0:8000" in dockerfile,
          "tinker/Dockerfile: the entrypoint runs python -m ampd_tinker on 0.0.0.0:8000")


def is_headless(svc):
    return svc["spec"].get("clusterIP") == "None"


def check_k8s_distributed(deploy_dir):
    k8s = os.path.join(deploy_dir, "k8s", "distributed")
    names = sorted(n for n in os.listdir(k8s) if n.endswith((".yaml", ".yml")))
    docs = []
    for name in names:
        if name != "kustomization.yaml":
            docs.extend(load_yaml_all(os.path.join(k8s, name)))
    (kustomization,) = load_yaml_all(os.path.join(k8s, "kustomization.yaml"))
    check(sorted(kustomization.get("resources", [])) ==
          sorted(n for n in names if n != "kustomization.yaml"),
          "k8s/distributed: kustomization resources %s, files %s"
          % (kustomization.get("resources"), names))
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d.get("kind"), []).append(d)
    for kind in ["StatefulSet", "Service", "NetworkPolicy"]:
        if not check(kind in by_kind, "k8s/distributed: no %s" % kind):
            return
    sts = by_kind["StatefulSet"][0]
    pod = sts["spec"]["template"]
    spec = pod["spec"]
    labels = pod.get("metadata", {}).get("labels", {})
    check(sts["spec"]["selector"]["matchLabels"].items() <= labels.items(),
          "k8s/distributed: StatefulSet selector does not match its pod labels")
    check(sts["spec"].get("replicas", 1) >= 2, "k8s/distributed: fewer than 2 ranks")
    check(spec.get("terminationGracePeriodSeconds", 30) >= 60,
          "k8s/distributed: terminationGracePeriodSeconds must leave time to checkpoint (>= 60)")
    ann = pod.get("metadata", {}).get("annotations", {})
    check(ann.get("prometheus.io/scrape") == "true" and ann.get("prometheus.io/port") == "9464",
          "k8s/distributed: prometheus.io annotations")
    c = spec["containers"][0]
    check(str(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")) == "1",
          "k8s/distributed: every rank must limit nvidia.com/gpu: 1")
    argv = list(c.get("command", [])) + list(c.get("args", []))
    want = AMPD_FLAGS + ["--peer-address=$(POD_IP):%d" % PEER_PORT]
    check(sorted(flags_of(argv)) == sorted(want),
          "k8s/distributed: ampd flags %s, expected %s" % (flags_of(argv), want))
    env = {e["name"]: e for e in c.get("env", [])}
    check(env.get("POD_IP", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
          == "status.podIP", "k8s/distributed: POD_IP must come from status.podIP")
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    check(ports.get("grpc") == 50051 and ports.get("peer") == PEER_PORT
          and ports.get("metrics") == 9464,
          "k8s/distributed: container ports grpc 50051, peer %d, metrics 9464" % PEER_PORT)
    for probe in ["livenessProbe", "readinessProbe"]:
        check(c.get(probe, {}).get("grpc", {}).get("port") == 50051,
              "k8s/distributed: %s must be a gRPC probe on 50051" % probe)
    # Each rank its own state directory: a claim template, not a shared claim.
    templates = {t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates", [])}
    mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
    state = [n for n, path in mounts.items() if path == "/var/lib/ampd"]
    check(state and state[0] in templates,
          "k8s/distributed: /var/lib/ampd must come from a volumeClaimTemplate")
    # Rank 0's rendezvous is <statefulset>-0.<serviceName>: that Service must
    # be headless, publish ranks before they are ready and carry both ports.
    headless = [s for s in by_kind["Service"]
                if s["metadata"]["name"] == sts["spec"].get("serviceName")]
    if check(headless, "k8s/distributed: StatefulSet serviceName names no Service here"):
        svc = headless[0]
        check(is_headless(svc), "k8s/distributed: %s must be headless (clusterIP: None)"
              % svc["metadata"]["name"])
        check(svc["spec"].get("publishNotReadyAddresses") is True,
              "k8s/distributed: %s needs publishNotReadyAddresses: true" % svc["metadata"]["name"])
        sel = svc["spec"].get("selector", {})
        check(sel and sel.items() <= labels.items(),
              "k8s/distributed: %s selects no rank" % svc["metadata"]["name"])
        svc_ports = {p.get("port") for p in svc["spec"].get("ports", [])}
        check({50051, PEER_PORT} <= svc_ports,
              "k8s/distributed: %s must carry 50051 and %d" % (svc["metadata"]["name"], PEER_PORT))
    # The peer network is unauthenticated: only the ranks may reach it.
    def selects_ranks(policy):
        selector = policy["spec"].get("podSelector", {}).get("matchLabels", {})
        return selector.items() <= labels.items()

    policies = [n for n in by_kind["NetworkPolicy"] if selects_ranks(n)]
    if check(policies, "k8s/distributed: no NetworkPolicy selects the ranks"):
        np = policies[0]
        check("Ingress" in np["spec"].get("policyTypes", []),
              "k8s/distributed: the NetworkPolicy must restrict Ingress")
        peers_all_tcp = False
        for rule in np["spec"].get("ingress", []):
            rule_ports = rule.get("ports")
            covers_peer = rule_ports is None or any(
                p.get("port") in (None, PEER_PORT, "peer") for p in rule_ports)
            sources = rule.get("from")
            only_ranks = bool(sources) and all(
                set(f.keys()) == {"podSelector"}
                and f["podSelector"].get("matchLabels", {}).items() <= labels.items()
                and f["podSelector"].get("matchLabels")
                for f in sources)
            check(not covers_peer or only_ranks,
                  "k8s/distributed: an ingress rule opens port %d (or every port) beyond the "
                  "ranks: %s" % (PEER_PORT, rule))
            if only_ranks and rule_ports is not None and any(
                    p.get("port") is None and p.get("protocol", "TCP") == "TCP"
                    for p in rule_ports):
                peers_all_tcp = True
        check(peers_all_tcp, "k8s/distributed: the ranks must reach each other on every TCP "
              "port (Gloo listens on ephemeral ones)")


def check_compose_distributed(deploy_dir, dockerfile):
    path = os.path.join(deploy_dir, "docker-compose.distributed.yml")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    (compose,) = load_yaml_all(path)
    services = compose.get("services", {})
    ranks = sorted(n for n in services if re.fullmatch(r"ampd-\d+", n))
    check(ranks == ["ampd-0", "ampd-1"], "compose.distributed: ranks %s, expected ampd-0, ampd-1"
          % ranks)
    with open(dockerfile, encoding="utf-8") as f:
        entry = [l.strip() for l in f if l.strip().startswith("ENTRYPOINT")]
    binary = json.loads(entry[-1][len("ENTRYPOINT"):].strip())[0] if entry else None
    named = set((compose.get("volumes") or {}).keys())
    state_volumes = []
    for name in ranks:
        svc = services[name]
        argv = list(svc.get("entrypoint", []))
        check(argv and argv[0] == binary,
              "compose.distributed: %s must run %s as the image does" % (name, binary))
        want = [f for f in AMPD_FLAGS if not f.startswith("--device=")] + [
            "--device=cpu", "--peer-address=%s:%d" % (name, PEER_PORT)]
        check(sorted(flags_of(argv)) == sorted(want),
              "compose.distributed: %s flags %s, expected %s" % (name, flags_of(argv), want))
        check("command" not in svc,
              "compose.distributed: %s: a command would be appended to its entrypoint" % name)
        for v in svc.get("volumes", []):
            source, target = str(v).split(":")[:2]
            check(source in named, "compose.distributed: %s uses undeclared volume %s"
                  % (name, source))
            if target == "/var/lib/ampd":
                state_volumes.append(source)
        for port in svc.get("ports", []):
            check(str(port).split(":")[-1] != str(PEER_PORT),
                  "compose.distributed: %s publishes the unauthenticated peer port" % name)
    check(len(state_volumes) == len(ranks) and len(set(state_volumes)) == len(ranks),
          "compose.distributed: each rank needs its own state volume at /var/lib/ampd, got %s"
          % state_volumes)
    # The documented client command meets at rank 0's peer address.
    check("--world-size=%d" % len(ranks) in text and
          "--rendezvous=ampd-0:%d" % PEER_PORT in text,
          "compose.distributed: the comment must show ampctl --world-size=%d "
          "--rendezvous=ampd-0:%d" % (len(ranks), PEER_PORT))


def check_dockerfile(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = [l.strip() for l in text.splitlines()]
    check(any(re.fullmatch(r"EXPOSE\s+50051\s+9464", l) for l in lines), "Dockerfile: EXPOSE 50051 9464")
    check(any(l.startswith("VOLUME") and "/var/lib/ampd" in l for l in lines),
          "Dockerfile: VOLUME /var/lib/ampd")
    check(any(l.startswith("HEALTHCHECK") for l in lines), "Dockerfile: HEALTHCHECK")
    users = [l.split()[1] for l in lines if l.startswith("USER ")]
    check(users and users[-1] not in ("root", "0"), "Dockerfile: the final stage must run as non-root")
    entry = [l for l in lines if l.startswith("ENTRYPOINT")]
    if check(entry, "Dockerfile: ENTRYPOINT"):
        argv = json.loads(entry[-1][len("ENTRYPOINT"):].strip())
        check(sorted(flags_of(argv)) == sorted(AMPD_FLAGS),
              "Dockerfile: ENTRYPOINT flags %s, expected %s" % (flags_of(argv), AMPD_FLAGS))
    froms = [l for l in lines if l.startswith("FROM ")]
    check(len(froms) >= 2 and all("nvidia/cuda:" in l for l in froms),
          "Dockerfile: multi-stage on nvidia/cuda images")


KUSTOMIZATIONS = (("k8s",), ("k8s", "distributed"), ("secure", "k8s"), ("tinker", "k8s"))


def check_kustomize_builds(deploy_dir):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        print("kustomize builds: not checked (no kubectl on PATH)")
        return
    for parts in KUSTOMIZATIONS:
        folder = os.path.join(deploy_dir, *parts)
        built = subprocess.run([kubectl, "kustomize", folder], capture_output=True, text=True,
                               timeout=120)
        check(built.returncode == 0 and "kind:" in built.stdout,
              "%s: kubectl kustomize failed: %s" % ("/".join(parts), built.stderr.strip()[-400:]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--deploy-dir", required=True)
    ap.add_argument("--dockerfile", required=True)
    ap.add_argument("--fixture-server", required=True)
    args = ap.parse_args()
    try:
        import yaml  # noqa: F401
    except ImportError:
        print("validate_deploy: FAIL: PyYAML is not importable by %s; install python3-yaml "
              "(scripts/install-deps.sh)" % sys.executable)
        return 1

    exprs = check_dashboard(os.path.join(args.deploy_dir, "grafana/dashboards/ampd.json"))
    exprs += check_alert_exprs(os.path.join(args.deploy_dir, "prometheus/alerts.yml"))
    exported = scrape_fixture(args.fixture_server)
    check(len(exported) > 20, "fixture exported only %s" % sorted(exported))
    for expr in exprs:
        for name in sorted(ampd_names(expr) - exported):
            problems.append("%s is queried but not exported (in: %s)" % (name, expr))
    for f in ["grafana/provisioning/datasources/prometheus.yml",
              "grafana/provisioning/dashboards/ampd.yml"]:
        check(load_yaml_all(os.path.join(args.deploy_dir, f)),
              "%s is empty" % f)
    check_compose(args.deploy_dir)
    check_k8s(args.deploy_dir)
    check_k8s_distributed(args.deploy_dir)
    check_compose_distributed(args.deploy_dir, args.dockerfile)
    check_dockerfile(args.dockerfile)
    check_tinker(args.deploy_dir)
    check_kustomize_builds(args.deploy_dir)

    if problems:
        for p in problems:
            print("validate_deploy: FAIL: " + p)
        return 1
    print("validate_deploy: OK (%d queries checked against %d exported series names)"
          % (len(exprs), len(exported)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
