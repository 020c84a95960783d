#!/usr/bin/env python3
"""Runs the secured deployments' own command lines against the real ampd.

deploy/docker-compose.secure.yml and deploy/secure/k8s/deployment-tls.yaml
name files (compose secrets, Kubernetes Secret mounts), give ampd flags and
probe it with ampctl. This test makes the files with scripts/make-dev-certs.sh,
lays them out where each manifest expects them (under a temporary root), and
then, for each manifest:

- starts ampd with the image's ENTRYPOINT flags plus the manifest's (only the
  addresses, the state directory and the device are changed for the test);
- runs the manifest's health probe exactly as written (the ampctl path and
  port substituted): it must print SERVING and exit 0;
- trains through the secured server as the compose file's comment tells a
  client to (alice's certificate and token), and checks that a client with
  no token is refused with UNAUTHENTICATED and that plaintext fails.

So a flag renamed in ampd or ampctl, a path that no mount provides, or a
probe that cannot pass TLS fails here, not in a cluster.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

problems = []


def check(condition, message):
    if not condition:
        problems.append(message)
    return condition


def entrypoint_flags(dockerfile):
    with open(dockerfile, encoding="utf-8") as f:
        lines = [l.strip() for l in f if l.strip().startswith("ENTRYPOINT")]
    return json.loads(lines[-1][len("ENTRYPOINT"):].strip())[1:]


def for_test(flags, state_dir):
    """The deployment's flags with the test's addresses, state and device."""
    out = []
    for flag in flags:
        name = flag.split("=", 1)[0]
        if name == "--listen":
            flag = "--listen=127.0.0.1:0"
        elif name == "--metrics-listen":
            flag = "--metrics-listen=127.0.0.1:0"
        elif name == "--state-dir":
            flag = "--state-dir=" + state_dir
        elif name == "--device":
            flag = "--device=cpu"
        out.append(flag)
    return out


def start_ampd(ampd, flags, log_path):
    log = open(log_path, "w", encoding="utf-8")
    proc = subprocess.Popen([ampd] + flags, stdout=subprocess.PIPE, stderr=log, text=True)
    port = None
    for line in proc.stdout:
        m = re.match(r"ampd: listening on [^:]+:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    if port is None:
        proc.wait(timeout=30)
        log.close()
        with open(log_path, encoding="utf-8") as f:
            raise RuntimeError("ampd did not start (exit %s): %s" % (proc.returncode, f.read()))
    return proc, port


def stop_ampd(proc):
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run(argv, env=None, timeout=120):
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


def at_port(argv, ampctl, port):
    """A probe's argv with the real ampctl and the test server's port."""
    out = []
    for a in argv:
        if a == "ampctl":
            a = ampctl
        a = a.replace("127.0.0.1:50051", "127.0.0.1:%d" % port)
        out.append(a)
    return out


def exercise(label, ampd, ampctl, flags, probe, secrets, work):
    """Starts ampd with `flags`, runs `probe`, trains as alice, checks refusals."""
    proc, port = start_ampd(ampd, flags, os.path.join(work, label + ".log"))
    try:
        probed = run(at_port(probe, ampctl, port))
        check(probed.returncode == 0 and "SERVING" in probed.stdout,
              "%s: the health probe failed (exit %d): %s %s"
              % (label, probed.returncode, probed.stdout, probed.stderr))
        client = [ampctl, "--server=localhost:%d" % port,
                  "--tls-ca=" + os.path.join(secrets, "ca.crt"),
                  "--tls-cert=" + os.path.join(secrets, "alice.crt"),
                  "--tls-key=" + os.path.join(secrets, "alice.key")]
        with open(os.path.join(secrets, "alice.token"), encoding="utf-8") as f:
            token = f.read().strip()
        env = dict(os.environ, AMPD_TOKEN=token)
        trained = run(client + ["train", "--steps=3", "--precision=fp16"], env=env)
        check(trained.returncode == 0,
              "%s: alice could not train (exit %d): %s %s"
              % (label, trained.returncode, trained.stdout, trained.stderr))
        env.pop("AMPD_TOKEN")
        refused = run(client + ["jobs", "list"], env=env)
        check(refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr,
              "%s: a call without a token was not refused: %s %s"
              % (label, refused.stdout, refused.stderr))
        plaintext = run([ampctl, "--server=127.0.0.1:%d" % port, "--deadline-ms=3000", "health"])
        check(plaintext.returncode != 0, "%s: a plaintext health call succeeded" % label)
    finally:
        stop_ampd(proc)


def compose_case(deploy_dir, dockerfile, secrets, work):
    (compose,) = [d for d in yaml.safe_load_all(open(
        os.path.join(deploy_dir, "docker-compose.secure.yml"), encoding="utf-8")) if d]
    ampd_svc = compose["services"]["ampd"]
    # Compose mounts secret NAME at /run/secrets/NAME from its `file`.
    run_secrets = os.path.join(work, "compose", "run", "secrets")
    os.makedirs(run_secrets)
    for name in ampd_svc.get("secrets", []):
        source = compose["secrets"][name]["file"]
        check(source.startswith("./secrets/"),
              "compose: secret %s must come from ./secrets/ (make-dev-certs.sh's output)" % name)
        path = os.path.join(secrets, source[len("./secrets/"):])
        if check(os.path.exists(path), "compose: secret %s: make-dev-certs.sh makes no %s"
                 % (name, source)):
            shutil.copy(path, os.path.join(run_secrets, name))

    def rooted(a):
        return a.replace("/run/secrets/", run_secrets + "/")

    flags = [rooted(a) for a in entrypoint_flags(dockerfile) + list(ampd_svc["command"])]
    test = list(ampd_svc["healthcheck"]["test"])
    check(test[0] == "CMD", "compose: the healthcheck must be an exec-form CMD")
    probe = [rooted(a) for a in test[1:]]
    return flags, probe


def k8s_case(deploy_dir, secrets, work):
    secure = os.path.join(deploy_dir, "secure", "k8s")
    (kustomization,) = [d for d in yaml.safe_load_all(open(
        os.path.join(secure, "kustomization.yaml"), encoding="utf-8")) if d]
    check("../../k8s" in kustomization.get("resources", []),
          "secure/k8s: must build on the base deploy/k8s")
    patch_paths = [p["path"] for p in kustomization.get("patches", [])]
    check(patch_paths == ["deployment-tls.yaml"], "secure/k8s: patches %s" % patch_paths)
    (patch,) = [d for d in yaml.safe_load_all(open(
        os.path.join(secure, "deployment-tls.yaml"), encoding="utf-8")) if d]
    spec = patch["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    # The Secrets' keys, as the kustomization's comment creates them.
    secret_files = {
        "ampd-tls": {"tls.crt": "server.crt", "tls.key": "server.key", "ca.crt": "ca.crt",
                     "client-ca.crt": "ca.crt", "probe.crt": "probe.crt",
                     "probe.key": "probe.key"},
        "ampd-tenants": {"tenants": "tenants"},
    }
    volumes = {v["name"]: v.get("secret", {}).get("secretName") for v in spec.get("volumes", [])}
    root = os.path.join(work, "k8s")
    mounts = {}
    for m in container.get("volumeMounts", []):
        secret = volumes.get(m["name"])
        if not check(secret in secret_files, "secure/k8s: mount %s is no known Secret" % m["name"]):
            continue
        check(m.get("readOnly") is True, "secure/k8s: mount %s must be readOnly" % m["name"])
        target = os.path.join(root, m["mountPath"].lstrip("/"))
        os.makedirs(target)
        for key, source in secret_files[secret].items():
            shutil.copy(os.path.join(secrets, source), os.path.join(target, key))
        mounts[m["mountPath"]] = target

    def rooted(a):
        for path, target in mounts.items():
            a = a.replace(path + "/", target + "/")
        return a

    flags = [rooted(a) for a in container["args"]]
    for a in flags:
        if "=/etc/" in a:
            problems.append("secure/k8s: %s names a file no Secret mount provides" % a)
    probes = {}
    for name in ["startupProbe", "livenessProbe", "readinessProbe"]:
        probe = container.get(name, {})
        # A strategic merge keeps the base's grpc probe unless it is nulled.
        check("grpc" in probe and probe["grpc"] is None,
              "secure/k8s: %s must null the base's grpc probe (grpc: null)" % name)
        probes[name] = [rooted(a) for a in probe.get("exec", {}).get("command", [])]
    check(probes["startupProbe"] == probes["livenessProbe"] == probes["readinessProbe"],
          "secure/k8s: the three probes should run the same command")
    return flags, probes["livenessProbe"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--deploy-dir", required=True)
    ap.add_argument("--dockerfile", required=True)
    ap.add_argument("--make-certs", required=True)
    ap.add_argument("--ampd", required=True)
    ap.add_argument("--ampctl", required=True)
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="ampd_secure_deploy_")
    try:
        secrets = os.path.join(work, "secrets")
        made = run(["bash", args.make_certs, secrets])
        if made.returncode != 0:
            print("secure_deploy_test: FAIL: make-dev-certs.sh: %s %s" % (made.stdout, made.stderr))
            return 1
        cases = [("compose",) + compose_case(args.deploy_dir, args.dockerfile, secrets, work),
                 ("k8s",) + k8s_case(args.deploy_dir, secrets, work)]
        for label, flags, probe in cases:
            os.makedirs(os.path.join(work, label, "state"), exist_ok=True)
            exercise(label, args.ampd, args.ampctl,
                     for_test(flags, os.path.join(work, label, "state")), probe, secrets, work)
    finally:
        if not problems:
            shutil.rmtree(work, ignore_errors=True)
    if problems:
        for p in problems:
            print("secure_deploy_test: FAIL: " + p)
        print("secure_deploy_test: logs under " + work)
        return 1
    print("secure_deploy_test: OK (compose and k8s: probe SERVING, alice trained, "
          "tokenless and plaintext calls refused)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
