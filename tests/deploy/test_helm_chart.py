"""The Helm chart in deploy/helm/vgpu: it lints, renders objects that
Kubernetes' schemas accept, and wires the parts together consistently (the
flags each binary receives are flags it accepts, the resource names and
ports agree across the plugin, the extender and kube-scheduler, and every
account can do what its binary needs)."""

import copy
import json
import os
import pathlib
import re
import subprocess

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "vgpu"
TARGET = pathlib.Path(os.environ.get("VGPU_TARGET_DIR", ROOT / "target" / "debug")).resolve()
KUBE_VERSION = "1.32.0"


def render(values=None, name="vgpu", namespace="kube-system"):
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values or {})
        manifests = chart.render(values or {}, name=name, namespace=namespace)
    objects = []
    for path, text in sorted(manifests.items()):
        if not path.endswith(".yaml"):
            continue
        for document in yaml.safe_load_all(text):
            if document:
                objects.append(document)
    return objects


def find(objects, kind, suffix):
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    assert len(matches) == 1, f"{kind} *{suffix}: {[o['metadata']['name'] for o in matches]}"
    return matches[0]


def container(workload, name):
    spec = workload["spec"]["template"]["spec"]
    for c in spec.get("containers", []) + spec.get("initContainers", []):
        if c["name"] == name:
            return c
    raise AssertionError(f"no container {name}")


def flags(c):
    """The container's `--name=value` arguments as a dict (value None for a
    bare flag)."""
    result = {}
    for arg in c.get("args", []) + c.get("command", [])[1:]:
        if arg.startswith("--"):
            key, _, value = arg[2:].partition("=")
            result[key] = value if "=" in arg else None
    return result


def scheduler_config(objects):
    config_map = find(objects, "ConfigMap", "-scheduler")
    return yaml.safe_load(config_map["data"]["config.yaml"])


def rules_allow(objects, account, group, resource, verb):
    """Whether some ClusterRole bound to `account` grants `verb` on
    `resource` (chart-defined roles only)."""
    roles = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ClusterRole"}
    for binding in (o for o in objects if o["kind"] == "ClusterRoleBinding"):
        if not any(s["name"] == account for s in binding["subjects"]):
            continue
        role = roles.get(binding["roleRef"]["name"])
        for rule in (role or {}).get("rules", []):
            if group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]:
                return True
    return False


def test_chart_lints_without_findings():
    report = helm.lint(str(CHART), strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == [], report
    serious = [m for m in report["messages"] if m["severity"] >= 2]
    assert serious == [], serious


@pytest.mark.parametrize(
    "values",
    [
        {},
        {
            "scheduler": {
                "extender": {"tls": {"secretName": "vgpu-tls"}, "gpuPolicy": "binpack"},
                "webhook": {"caBundle": "Q0E=", "allowPrivileged": True},
            },
            "node": {"devicePlugin": {"swapLimit": "8g", "preload": False, "corePolicy": "force"}},
        },
        {"scheduler": {"webhook": {"enabled": False}, "service": {"enabled": False}}},
        {"node": {"monitor": {"serviceMonitor": {"enabled": True}}}},
        {
            "networkPolicy": {
                "enabled": True,
                "apiServerCIDRs": ["10.0.0.1/32"],
                "metricsFrom": [{"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}],
                "kubeSchedulerFrom": [{"podSelector": {"matchLabels": {"app": "egpu"}}}],
            },
        },
    ],
    ids=["defaults", "tls-swap-force", "no-webhook", "service-monitor", "network-policies"],
)
def test_every_object_matches_the_kubernetes_schema(values):
    objects = render(values)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds.count("DaemonSet") == 1 and kinds.count("Deployment") == 1, kinds
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # an operator's CRD: not in Kubernetes' schemas
        # Strict: an unknown or misplaced field is an error too.
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def _binary(name):
    path = TARGET / name
    if not path.exists():
        pytest.fail(f"{path} is missing: build the workspace first (cargo build --workspace --release)")
    return path


def _accepts(binary, arguments):
    """Runs the binary's own argument parser over `arguments`: with --help
    last, it exits 0 only if every argument before it was valid."""
    result = subprocess.run(
        [str(_binary(binary))] + arguments + ["--help"],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
    )
    return result


@pytest.mark.parametrize(
    "values",
    [
        {},
        {
            "scheduler": {
                "replicas": 2,
                "extender": {"tls": {"secretName": "vgpu-tls"}, "nodePolicy": "spread", "clientCA": "Q0E="},
                "webhook": {"caBundle": "Q0E=", "allowPrivileged": True},
            },
            "node": {
                "devicePlugin": {"swapLimit": "8g", "contextReserve": "128m", "preload": False,
                                 "deviceMemoryScaling": 1.5},
                "monitor": {"arbitration": False, "hamiMetricNames": True},
            },
        },
    ],
    ids=["defaults", "every-optional-flag"],
)
def test_every_binary_accepts_the_arguments_it_is_given(values):
    objects = render(values)
    node = find(objects, "DaemonSet", "-node")
    scheduler = find(objects, "Deployment", "-scheduler")
    for workload, name, binary in [
        (node, "device-plugin", "vgpu-device-plugin"),
        (node, "monitor", "vgpu-monitor"),
        (scheduler, "extender", "vgpu-scheduler"),
    ]:
        c = container(workload, name)
        assert c["command"] == [f"/usr/local/bin/{binary}"]
        result = _accepts(binary, c["args"])
        assert result.returncode == 0, f"{binary} {c['args']}:\n{result.stderr}"


def test_a_broken_argument_is_caught_by_that_check():
    result = _accepts("vgpu-scheduler", ["--gpu-policy=fastest"])
    assert result.returncode != 0
    assert "fastest" in result.stderr


def test_kube_scheduler_reaches_the_extender_with_the_same_names_and_port():
    values = {
        "resources": {"gpu": "example.com/vgpu", "cores": "example.com/vgpu-cores"},
        "scheduler": {"extender": {"port": 40000}, "webhook": {"enabled": False}},
    }
    objects = render(values)
    config = scheduler_config(objects)
    assert config["kind"] == "KubeSchedulerConfiguration"
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["profiles"] == [{"schedulerName": "vgpu-scheduler"}]
    (extender,) = config["extenders"]
    assert extender["urlPrefix"] == "http://127.0.0.1:40000"
    verbs = ("filterVerb", "prioritizeVerb", "bindVerb", "preemptVerb")
    assert tuple(extender[verb] for verb in verbs) == ("filter", "prioritize", "bind", "preempt")
    assert extender["enableHTTPS"] is False
    managed = {m["name"]: m["ignoredByScheduler"] for m in extender["managedResources"]}
    # kube-scheduler counts every amount too (its preemption finds victims
    # only among pods taking what it counts); the priority is no amount.
    assert managed["example.com/vgpu"] is False
    assert managed["example.com/vgpu-cores"] is False
    assert [name for name, ignored in managed.items() if ignored] == ["nvidia.com/priority"]

    deployment = find(objects, "Deployment", "-scheduler")
    extender_flags = flags(container(deployment, "extender"))
    assert extender_flags["port"] == "40000"
    assert extender_flags["resource-gpu"] == "example.com/vgpu"
    assert extender_flags["resource-cores"] == "example.com/vgpu-cores"
    for flag in [
        "resource-memory",
        "resource-memory-percentage",
        "resource-priority",
        "resource-elastic-memory",
        "resource-elastic-cores",
    ]:
        assert extender_flags[flag] in managed, flag
    assert [p["containerPort"] for p in container(deployment, "extender")["ports"]] == [40000]
    plugin_flags = flags(container(find(objects, "DaemonSet", "-node"), "device-plugin"))
    assert plugin_flags["resource-name"] == "example.com/vgpu"
    # The mounted configuration is the one kube-scheduler is told to read.
    ks = container(deployment, "kube-scheduler")
    mount = next(m for m in ks["volumeMounts"] if m["name"] == "config")
    assert f"--config={mount['mountPath']}/config.yaml" in ks["command"]


def test_the_node_agents_read_requests_as_the_extender_does():
    """The plugin checks each decision against what its pod asks for, and
    the monitor restores no more than that, so both must read a pod with
    the extender's resource names and fill in what it leaves out with the
    extender's defaults."""
    objects = render({"resources": {"gpu": "example.com/vgpu", "cores": "example.com/vgpu-cores"},
                      "scheduler": {"extender": {"defaultMemoryMiB": 2048, "defaultCores": 25}}})
    extender = flags(container(find(objects, "Deployment", "-scheduler"), "extender"))
    node = find(objects, "DaemonSet", "-node")
    for agent in (flags(container(node, "device-plugin")), flags(container(node, "monitor"))):
        for flag, value in (("default-memory-mib", "2048"), ("default-cores", "25")):
            assert extender[flag] == agent[flag] == value, flag
        assert extender["resource-cores"] == agent["resource-cores"] == "example.com/vgpu-cores"
        assert agent["resource-name"] == extender["resource-gpu"] == "example.com/vgpu"


def test_https_extender_with_a_given_certificate():
    """HTTPS (for the API server's webhooks) on the secure port with the
    given certificate; kube-scheduler keeps plain HTTP on loopback, and the
    Service offers both (the Elastic GPU Scheduler's stanza calls the plain
    one)."""
    objects = render({"scheduler": {"extender": {"tls": {"secretName": "vgpu-tls"}, "securePort": 40443},
                                    "webhook": {"enabled": False}}})
    (extender,) = scheduler_config(objects)["extenders"]
    assert extender["urlPrefix"] == "http://127.0.0.1:39999"
    assert extender["enableHTTPS"] is False
    deployment = find(objects, "Deployment", "-scheduler")
    c = container(deployment, "extender")
    f = flags(c)
    assert (f["port"], f["secure-port"]) == ("39999", "40443")
    mount = next(m for m in c["volumeMounts"] if m["name"] == "tls")
    assert f["tls-cert"] == f"{mount['mountPath']}/tls.crt"
    assert f["tls-key"] == f"{mount['mountPath']}/tls.key"
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
    assert volume["secret"]["secretName"] == "vgpu-tls"
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"extender": 39999, "webhook": 40443}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "extender", "scheme": "HTTP"}
    service = find(objects, "Service", "-scheduler")
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        "extender": (39999, "extender"), "webhook": (40443, "webhook")}


def test_the_extender_metrics_are_annotated_for_scraping():
    objects = render({"scheduler": {"extender": {"port": 40000}}})
    service = find(objects, "Service", "-scheduler")
    annotations = service["metadata"]["annotations"]
    extender = container(find(objects, "Deployment", "-scheduler"), "extender")
    plain = next(p for p in extender["ports"] if p["name"] == "extender")
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(plain["containerPort"])
    assert annotations["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("values, published", [
    ({}, 31992),
    ({"node": {"monitor": {"port": 40992}}}, 40992),
    ({"node": {"monitor": {"hostPort": False}}}, None),
])
def test_the_monitor_is_reachable_on_the_nodes_own_address(values, published):
    """HAMi's users scrape `<node IP>:31992`: the metrics port is a host
    port too, unless turned off."""
    monitor = container(find(render(values), "DaemonSet", "-node"), "monitor")
    (port,) = [p for p in monitor["ports"] if p["name"] == "metrics"]
    assert port.get("hostPort") == published, port
    assert flags(monitor)["listen"].endswith(f":{port['containerPort']}")


def test_the_webhook_is_called_on_the_secure_port():
    objects = render({"scheduler": {"extender": {"securePort": 40443}}})
    (webhook,) = find(objects, "MutatingWebhookConfiguration", "-webhook")["webhooks"]
    assert webhook["clientConfig"]["service"]["port"] == 40443
    assert flags(container(find(objects, "Deployment", "-scheduler"), "extender"))["secure-port"] == "40443"


def test_node_agent_paths_agree():
    objects = render({"hostDir": "/opt/vgpu", "node": {"devicePlugin": {"corePolicy": "force", "swapLimit": "8Gi",
                                                                        "deviceMemoryScaling": 2}}})
    node = find(objects, "DaemonSet", "-node")
    volumes = {v["name"]: v for v in node["spec"]["template"]["spec"]["volumes"]}
    plugin = container(node, "device-plugin")
    monitor = container(node, "monitor")
    install = container(node, "install-shim")

    def host_path(c, path):
        """The host path a container path maps to through its mounts."""
        for m in sorted(c["volumeMounts"], key=lambda m: -len(m["mountPath"])):
            if path == m["mountPath"] or path.startswith(m["mountPath"] + "/"):
                return volumes[m["name"]]["hostPath"]["path"] + path[len(m["mountPath"]) :]
        raise AssertionError(f"{path} is not on a host mount of {c['name']}")

    pf, mf = flags(plugin), flags(monitor)
    # The plugin answers kubelet with host paths, so it sees them unmapped.
    assert host_path(plugin, pf["containers-dir"]) == pf["containers-dir"] == "/opt/vgpu/containers"
    assert host_path(plugin, pf["library"]) == pf["library"] == "/opt/vgpu/libvgpu.so"
    assert host_path(plugin, pf["preload-file"]) == "/opt/vgpu/ld.so.preload"
    # The monitor reads the regions the plugin creates.
    assert host_path(monitor, mf["containers-dir"]) == "/opt/vgpu/containers"
    # The installer writes the library the plugin hands out.
    script = install["args"][0]
    target = script.split("mv -f ")[1].split()[1]
    assert host_path(install, target) == "/opt/vgpu/libvgpu.so"
    assert host_path(plugin, pf["device-plugin-dir"]) == "/var/lib/kubelet/device-plugins"
    # The monitor restores containers' limits with what the plugin adds.
    for flag in ("core-policy", "swap-limit", "device-memory-scaling"):
        assert mf.get(flag) == pf.get(flag), flag
    assert pf["device-memory-scaling"] == "2"
    # Both read their node from the downward API.
    for c in (plugin, monitor):
        env = {e["name"]: e for e in c["env"]}
        assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # Metrics are served where the service and probes look.
    port = int(mf["listen"].rsplit(":", 1)[1])
    assert port == 31992
    assert [p["containerPort"] for p in monitor["ports"]] == [port]
    service = find(objects, "Service", "-monitor")
    assert service["spec"]["ports"][0]["port"] == port
    assert service["spec"]["selector"].items() <= node["spec"]["template"]["metadata"]["labels"].items()


def bound_roles(objects, account):
    """The names of the roles bound to `account` (ClusterRoleBindings and
    RoleBindings)."""
    return {
        b["roleRef"]["name"]
        for b in objects
        if b["kind"] in ("ClusterRoleBinding", "RoleBinding") and any(s["name"] == account for s in b["subjects"])
    }


def accounts(objects):
    """The accounts the chart's programs run as: the node agent's, the
    extender's (the scheduler pod's own) and kube-scheduler's."""
    node = find(objects, "DaemonSet", "-node")["spec"]["template"]["spec"]["serviceAccountName"]
    extender = find(objects, "Deployment", "-scheduler")["spec"]["template"]["spec"]["serviceAccountName"]
    kube_scheduler = find(objects, "ServiceAccount", "-kube-scheduler")["metadata"]["name"]
    return node, extender, kube_scheduler


def test_accounts_can_do_what_their_binaries_need():
    objects = render()
    node_sa, extender_sa, kube_scheduler_sa = accounts(objects)
    service_accounts = {o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"}
    assert {node_sa, extender_sa, kube_scheduler_sa} <= service_accounts
    assert len({node_sa, extender_sa, kube_scheduler_sa}) == 3
    node = find(objects, "DaemonSet", "-node")
    assert node["spec"]["template"]["spec"]["serviceAccountName"] == node_sa
    # Plugin: list its node's pods, record allocations, publish the inventory.
    # Monitor: watch its node's pods, record Events on them (a process
    # without the shim), and see the host's processes to match NVML's PIDs.
    for resource, verb in [
        ("pods", "list"),
        ("pods", "watch"),
        ("pods", "patch"),
        ("nodes", "patch"),
        ("events", "create"),
    ]:
        assert rules_allow(objects, node_sa, "", resource, verb), (resource, verb)
    assert node["spec"]["template"]["spec"]["hostPID"] is True
    # The backstop kills, in the host's PID namespace, a process past its
    # container's grant, and pauses (SIGSTOP) and resumes one past its
    # share: CAP_KILL and nothing else; with "report" not even that.
    monitor = next(c for c in node["spec"]["template"]["spec"]["containers"] if c["name"] == "monitor")
    assert monitor["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["KILL"]}
    assert "--over-cap-action=kill" in monitor["args"]
    assert "--over-share-tolerance=5" in monitor["args"]
    reporting = render({"node": {"monitor": {"overCapAction": "report", "overShareTolerance": 3}}})
    monitor = next(
        c
        for c in find(reporting, "DaemonSet", "-node")["spec"]["template"]["spec"]["containers"]
        if c["name"] == "monitor"
    )
    assert monitor["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert "--over-cap-action=report" in monitor["args"]
    assert "--over-share-tolerance=3" in monitor["args"]
    # Extender: watch pods, nodes and quotas, record decisions, bind.
    for resource, verb in [
        ("pods", "list"),
        ("pods", "watch"),
        ("pods", "patch"),
        ("pods/binding", "create"),
        ("nodes", "list"),
        ("nodes", "watch"),
        ("resourcequotas", "list"),
        ("resourcequotas", "watch"),
        ("events", "create"),
    ]:
        assert rules_allow(objects, extender_sa, "", resource, verb), (resource, verb)
    # Neither may delete pods or touch secrets.
    for account in (node_sa, extender_sa):
        assert not rules_allow(objects, account, "", "pods", "delete")
        assert not rules_allow(objects, account, "", "secrets", "get")
    # kube-scheduler: the roles every kube-scheduler runs with, and its
    # leader election's Lease.
    assert {
        "system:kube-scheduler",
        "system:volume-scheduler",
        "extension-apiserver-authentication-reader",
        "vgpu-kube-scheduler-leases",
    } <= bound_roles(objects, kube_scheduler_sa)


def test_kube_scheduler_has_an_account_and_a_token_of_its_own():
    """A pod's projected tokens are all of the pod's own account (the
    extender's), so kube-scheduler's comes from a Secret the API server's
    token controller fills for its account; no pod mounts that account."""
    objects = render()
    _, extender_sa, kube_scheduler_sa = accounts(objects)
    account = find(objects, "ServiceAccount", "-kube-scheduler")
    assert account["automountServiceAccountToken"] is False
    token = find(objects, "Secret", "-kube-scheduler-token")
    assert token["type"] == "kubernetes.io/service-account-token"
    assert token["metadata"]["annotations"] == {"kubernetes.io/service-account.name": kube_scheduler_sa}
    assert "data" not in token  # the token controller writes it
    # The extender's own rights are bound to it alone.
    extender_binding = find(objects, "ClusterRoleBinding", "-extender")
    assert [s["name"] for s in extender_binding["subjects"]] == [extender_sa]


def test_kube_scheduler_and_the_extender_run_as_separate_accounts():
    objects = render()
    _, extender_sa, kube_scheduler_sa = accounts(objects)
    deployment = find(objects, "Deployment", "-scheduler")
    spec = deployment["spec"]["template"]["spec"]
    assert spec.get("automountServiceAccountToken") is False
    volumes = {v["name"]: v for v in spec["volumes"]}

    def token_source(name):
        (mount,) = [
            m for m in container(deployment, name).get("volumeMounts", [])
            if m["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount"
        ]
        return volumes[mount["name"]]

    assert token_source("kube-scheduler")["secret"]["secretName"] == find(objects, "Secret", "-kube-scheduler-token")[
        "metadata"
    ]["name"]
    sources = token_source("extender")["projected"]["sources"]
    assert any("serviceAccountToken" in source for source in sources)
    # The extender's account holds none of kube-scheduler's rights (its
    # preemption deletes pods).
    kube_schedulers = bound_roles(objects, kube_scheduler_sa)
    assert not kube_schedulers & bound_roles(objects, extender_sa) - {"vgpu-scheduler-leases"}


def test_our_roles_delete_nothing_but_reclaimed_elastic_gpus():
    """No role the chart defines may delete anything, but the extender's
    ElasticGPUs of deleted claims (Elastic GPU's reclaim policy Delete).
    kube-scheduler keeps system:kube-scheduler's right to delete the pods
    its preemption evicts."""
    objects = render({"dra": {"enabled": True}})
    for role in (o for o in objects if o["kind"] in ("ClusterRole", "Role")):
        for rule in role.get("rules", []):
            deleting = {"delete", "deletecollection", "*"} & set(rule["verbs"])
            if not deleting:
                continue
            assert role["metadata"]["name"].endswith("-extender"), (role["metadata"]["name"], rule)
            assert rule["resources"] == ["elasticgpus"] and deleting == {"delete"}, rule


def policies(objects):
    """The admission policies by name, each with its binding."""
    found = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ValidatingAdmissionPolicy"}
    for binding in (o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding"):
        policy = found[binding["spec"]["policyName"]]
        assert binding["spec"]["validationActions"] == ["Deny"], binding
        policy["bound"] = True
    return found


def expressions(policy):
    spec = policy["spec"]
    return [
        item["expression"]
        for item in spec.get("variables", []) + spec.get("validations", []) + spec.get("matchConditions", [])
    ]


def named_accounts(policy):
    """The service accounts a policy's expressions name."""
    return set(re.findall(r"system:serviceaccount:([a-z0-9-]+:[a-z0-9-]+)", " ".join(expressions(policy))))


def test_admission_policies_keep_vgpus_records_to_vgpus_accounts():
    objects = render({"dra": {"enabled": True}}, namespace="vgpu-system")
    found = policies(objects)
    assert sorted(found) == ["vgpu-binding-records", "vgpu-gpu-variable", "vgpu-namespace-labels",
                             "vgpu-node-agents", "vgpu-pod-phase", "vgpu-pod-records"]
    for policy in found.values():
        assert policy.get("bound"), policy["metadata"]["name"]
        # Refused when an expression cannot be evaluated (too costly, or a
        # field missing), never let through.
        assert policy["spec"]["failurePolicy"] == "Fail"

    def rules(policy):
        return {
            (tuple(r["apiGroups"]), resource, operation)
            for r in policy["spec"]["matchConstraints"]["resourceRules"]
            for resource in r["resources"]
            for operation in r["operations"]
        }

    # Pods on creation and every update, pods/status too (it may change
    # annotations); Bindings, whose annotations go into the pod.
    pod_rules = {(("",), r, op) for r in ("pods", "pods/status") for op in ("CREATE", "UPDATE")}
    assert pod_rules <= rules(found["vgpu-pod-records"])
    assert rules(found["vgpu-binding-records"]) == {(("",), "pods/binding", "CREATE"), (("",), "bindings", "CREATE")}
    # A namespace's vgpu.io/ labels, through every write that carries labels;
    # a pod's phase, through its status.
    assert rules(found["vgpu-namespace-labels"]) == {
        (("",), r, op) for r in ("namespaces", "namespaces/status", "namespaces/finalize")
        for op in ("CREATE", "UPDATE")}
    assert rules(found["vgpu-pod-phase"]) == {(("",), "pods/status", "UPDATE")}
    # Pods naming GPUs themselves: on creation, and ephemeral containers
    # added later; the release's own namespace (its node agents name every
    # GPU) and the ones named are left out.
    assert rules(found["vgpu-gpu-variable"]) == {(("",), "pods", "CREATE"),
                                                 (("",), "pods/ephemeralcontainers", "UPDATE")}
    (left_out,) = found["vgpu-gpu-variable"]["spec"]["matchConstraints"]["namespaceSelector"]["matchExpressions"]
    assert left_out["values"] == ["vgpu-system"]
    named = policies(render({"admissionPolicy": {"gpuVariableNamespaces": ["gpu-operator"]}}, namespace="vgpu-system"))
    (left_out,) = named["vgpu-gpu-variable"]["spec"]["matchConstraints"]["namespaceSelector"]["matchExpressions"]
    assert left_out["values"] == ["vgpu-system", "gpu-operator"]
    # Who may do either is asked of the API server's authorizer with no
    # namespace: a RoleBinding in the tenant's namespace never answers.
    for name in ("vgpu-namespace-labels", "vgpu-pod-phase"):
        checks = " ".join(expressions(found[name]))
        assert "authorizer.group('')" in checks and ".namespace(" not in checks, name
    agents = {(groups, resource) for groups, resource, _ in rules(found["vgpu-node-agents"])}
    assert agents == {
        (("",), "nodes"),
        (("",), "nodes/status"),
        (("coordination.k8s.io",), "leases"),
        (("resource.k8s.io",), "resourceslices"),
    }
    # The accounts they let write are the ones the chart's programs run as.
    node_sa, extender_sa, _ = accounts(objects)
    dra_sa = find(objects, "DaemonSet", "-dra")["spec"]["template"]["spec"]["serviceAccountName"]
    assert named_accounts(found["vgpu-pod-records"]) == {f"vgpu-system:{extender_sa}", f"vgpu-system:{node_sa}"}
    assert named_accounts(found["vgpu-binding-records"]) == {f"vgpu-system:{extender_sa}"}
    assert named_accounts(found["vgpu-node-agents"]) == {f"vgpu-system:{node_sa}", f"vgpu-system:{dra_sa}"}
    # The node a node agent writes for is the one its pod-bound token names.
    for name in ("vgpu-pod-records", "vgpu-node-agents"):
        assert "authentication.kubernetes.io/node-name" in " ".join(expressions(found[name]))
    # Without DRA, no ResourceSlice rule.
    plain = policies(render())["vgpu-node-agents"]
    assert all("resource.k8s.io" not in r["apiGroups"] for r in plain["spec"]["matchConstraints"]["resourceRules"])


# The vgpu.io/ annotation constants of the code that names them
# (cluster/src, scheduler/src/vocabulary), by what they are: set by users
# on their pods, vgpu's own record on a pod, or on something not a pod.
USER_INPUT_ANNOTATIONS = {"GPU_POLICY_ANNOTATION", "NODE_POLICY_ANNOTATION", "GPU_CORES_BURST_ANNOTATION",
                          "RESIZE_ANNOTATION"}
RECORD_ANNOTATIONS = {"DECISION_ANNOTATION", "ALLOCATED_ANNOTATION", "USES_CLAIMS_ANNOTATION",
                      "RESIZE_STATUS_ANNOTATION"}
NOT_ON_PODS = {"NODE_INVENTORY_ANNOTATION", "RECLAIM_POLICY_ANNOTATION", "BINDING_MODE_ANNOTATION",
               "CORDONED_GPUS_ANNOTATION"}


def test_the_policy_knows_every_vgpu_pod_annotation_the_code_names():
    """Every vgpu.io/ pod annotation is vgpu's record (only vgpu's accounts
    write it) unless the policy lists it as a user's input: a new annotation
    in the code must be sorted here, and the policy's list must be exactly
    the users' ones."""
    constants = {}
    for folder in ("cluster/src", "scheduler/src/vocabulary"):
        for source in sorted((ROOT / folder).rglob("*.rs")):
            text = source.read_text()
            for name, value in re.findall(r'pub const (\w+_ANNOTATION): &str = "(vgpu\.io/[^"]+)";', text):
                constants[name] = value
    unsorted = set(constants) - USER_INPUT_ANNOTATIONS - RECORD_ANNOTATIONS - NOT_ON_PODS
    assert not unsorted, f"sort into a user's input or vgpu's record (templates/admission-policy.yaml): {unsorted}"
    assert {"vgpu.io/decision", "vgpu.io/allocated", "vgpu.io/elasticgpu-claims", "vgpu.io/resize-status"} == {
        constants[name] for name in RECORD_ANNOTATIONS
    }
    pod_records = policies(render())["vgpu-pod-records"]
    (user_inputs,) = [v["expression"] for v in pod_records["spec"]["variables"] if v["name"] == "userInputs"]
    assert sorted(re.findall(r"'([^']+)'", user_inputs)) == sorted(constants[name] for name in USER_INPUT_ANNOTATIONS)


def test_the_admission_policies_can_be_switched_off():
    objects = render({"admissionPolicy": {"enabled": False}})
    assert not [o for o in objects if o["kind"].startswith("ValidatingAdmissionPolicy")]


def test_other_releases_accounts_may_write_too():
    """Each release's policies apply to every pod of the cluster, so a
    second release's extender and node agents are named in the first's."""
    found = policies(render({"admissionPolicy": {"otherReleases": ["gpu-b/vgpu-b"]}}, namespace="vgpu-system"))
    assert named_accounts(found["vgpu-pod-records"]) == {
        "vgpu-system:vgpu-scheduler",
        "vgpu-system:vgpu-node",
        "gpu-b:vgpu-b-scheduler",
        "gpu-b:vgpu-b-node",
    }
    assert "gpu-b:vgpu-b-dra" in named_accounts(found["vgpu-node-agents"])


def test_one_scheduler_replica():
    deployment = find(render(), "Deployment", "-scheduler")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"


def test_kube_scheduler_follows_the_cluster_version_unless_pinned():
    deployment = find(render(), "Deployment", "-scheduler")
    image = container(deployment, "kube-scheduler")["image"]
    assert image.startswith("registry.k8s.io/kube-scheduler:v1."), image
    pinned = {"scheduler": {"kubeScheduler": {"image": {"tag": "v1.31.2"}}}}
    deployment = find(render(pinned), "Deployment", "-scheduler")
    assert container(deployment, "kube-scheduler")["image"] == "registry.k8s.io/kube-scheduler:v1.31.2"


@pytest.mark.parametrize(
    "values, words",
    [
        ({"node": {"devicePlugin": {"splitCount": 0}}}, "splitCount"),
        ({"node": {"devicePlugin": {"corePolicy": "always"}}}, "corePolicy"),
        ({"node": {"devicePlugin": {"swapLimit": "lots"}}}, "swapLimit"),
        ({"node": {"devicePlugin": {"deviceMemoryScaling": 0}}}, "deviceMemoryScaling"),
        ({"node": {"devicePlugin": {"deviceMemoryScaling": -1.5}}}, "deviceMemoryScaling"),
        ({"node": {"devicePlugin": {"deviceMemoryScaling": "2"}}}, "deviceMemoryScaling"),
        ({"scheduler": {"extender": {"gpuPolicy": "fastest"}}}, "gpuPolicy"),
        ({"scheduler": {"extender": {"nodePolicy": "nearest"}}}, "nodePolicy"),
        ({"scheduler": {"extender": {"port": 70000}}}, "port"),
        ({"scheduler": {"extender": {"defaultCores": 101}}}, "defaultCores"),
        ({"resources": {"gpu": "not a name"}}, "gpu"),
        ({"hostDir": "relative/path"}, "hostDir"),
        ({"node": {"monitor": {"intervalMs": "fast"}}}, "intervalMs"),
        ({"node": {"devicePluginTypo": {}}}, "devicePluginTypo"),
        ({"opportunistic": {"priorityClass": {"value": 2000000000}}}, "value"),
        ({"scheduler": {"webhook": {"schedulerAlias": "Kube Share"}}}, "schedulerAlias"),
        ({"grafana": {"dashboard": {"label": "grafana dashboard"}}}, "label"),
        ({"grafana": {"dashboard": {"labelValue": "x" * 64}}}, "labelValue"),
        ({"grafana": {"dashboard": {"namespace": "Monitoring"}}}, "namespace"),
        ({"grafana": {"dashboard": {"annotations": {"grafana_folder": 1}}}}, "grafana_folder"),
        ({"grafana": {"dashboard": {"label": "app.kubernetes.io/name"}}}, "grafana.dashboard.label"),
        ({"admissionPolicy": {"otherReleases": ["vgpu-b"]}}, "otherReleases"),
        ({"admissionPolicy": {"enabled": "yes"}}, "enabled"),
    ],
)
def test_bad_values_are_refused_with_their_name(values, words):
    with pytest.raises(Exception) as error:
        render(values)
    assert words in str(error.value), str(error.value)


def test_bind_wait_must_fit_in_kube_schedulers_timeout():
    values = {"scheduler": {"extender": {"bindWaitMs": 6000, "httpTimeoutSeconds": 5}}}
    with pytest.raises(Exception) as error:
        render(values)
    assert "bindWaitMs" in str(error.value)
    # Raising the timeout makes the same wait valid.
    values = copy.deepcopy(values)
    values["scheduler"]["extender"]["httpTimeoutSeconds"] = 10
    (extender,) = scheduler_config(render(values))["extenders"]
    assert extender["httpTimeout"] == "10s"


def _openssl(*args, stdin=None):
    result = subprocess.run(["openssl", *args], input=stdin, capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0, f"openssl {args}: {result.stderr}"
    return result.stdout


def test_webhook_reaches_the_extender_over_a_certificate_it_trusts(tmp_path):
    import base64

    objects = render(namespace="gpu-system")
    webhook_config = find(objects, "MutatingWebhookConfiguration", "-webhook")
    (webhook,) = webhook_config["webhooks"]
    assert webhook["admissionReviewVersions"] == ["v1"]
    assert webhook["sideEffects"] == "None"
    # Fail is safe because only vGPU pods are sent: an outage blocks no other pod.
    assert webhook["failurePolicy"] == "Fail"
    (condition,) = webhook["matchConditions"]
    for name in ("nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpucores", "elasticgpu.io/gpu-memory"):
        assert f"'{name}'" in condition["expression"], condition
    # Pods naming Elastic GPU claims are sent too (the extender reads the
    # claims it is allowed to get), unless the chart leaves that API alone.
    assert "startsWith('egpuc.elasticgpu.io/')" in condition["expression"], condition
    account = find(objects, "Deployment", "-scheduler")["spec"]["template"]["spec"]["serviceAccountName"]
    for resource in ("elasticgpuclaims", "elasticgpuclasses"):
        # The claim controller watches both: a class's change re-places its claims.
        for verb in ("get", "list", "watch"):
            assert rules_allow(objects, account, "elasticgpu.io", resource, verb), (resource, verb)
    without = render({"elasticGPU": {"crds": {"enabled": False}}})
    (other,) = find(without, "MutatingWebhookConfiguration", "-webhook")["webhooks"]
    assert "egpuc.elasticgpu.io" not in other["matchConditions"][0]["expression"]
    assert webhook["rules"] == [
        {
            "operations": ["CREATE"],
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "resources": ["pods"],
            "scope": "Namespaced",
        }
    ]
    client = webhook["clientConfig"]["service"]
    service = find(objects, "Service", "-scheduler")
    assert client["name"] == service["metadata"]["name"]
    assert client["namespace"] == service["metadata"]["namespace"] == "gpu-system"
    webhook_port = next(p for p in service["spec"]["ports"] if p["name"] == "webhook")
    assert client["port"] == webhook_port["port"]
    assert client["path"] == "/webhook/mutate"

    # The extender serves HTTPS with the secret's certificate on the port
    # the Service forwards there, and gives pods the name of the profile
    # that calls it.
    deployment = find(objects, "Deployment", "-scheduler")
    extender = container(deployment, "extender")
    f = flags(extender)
    assert f["scheduler-name"] == scheduler_config(objects)["profiles"][0]["schedulerName"]
    mount = next(m for m in extender["volumeMounts"] if m["name"] == "tls")
    assert f["tls-cert"] == f"{mount['mountPath']}/tls.crt"
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
    secret = find(objects, "Secret", "-scheduler-tls")
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    secure = next(p for p in extender["ports"] if p["name"] == webhook_port["targetPort"])
    assert f["secure-port"] == str(secure["containerPort"])
    (ext,) = scheduler_config(objects)["extenders"]
    assert ext["urlPrefix"].startswith("http://127.0.0.1:")

    # The API server trusts caBundle; the serving certificate must be signed
    # by it, name the service's DNS name, and match its key.
    files = {}
    for name, data in [
        ("ca.pem", webhook["clientConfig"]["caBundle"]),
        ("ca-in-secret.pem", secret["data"]["ca.crt"]),
        ("tls.pem", secret["data"]["tls.crt"]),
        ("tls.key", secret["data"]["tls.key"]),
    ]:
        path = tmp_path / name
        path.write_bytes(base64.b64decode(data))
        files[name] = str(path)
    assert (tmp_path / "ca.pem").read_bytes() == (tmp_path / "ca-in-secret.pem").read_bytes()
    assert "OK" in _openssl("verify", "-CAfile", files["ca.pem"], files["tls.pem"])
    san = _openssl("x509", "-in", files["tls.pem"], "-noout", "-ext", "subjectAltName")
    assert f"DNS:{client['name']}.gpu-system.svc" in san, san
    assert "IP Address:127.0.0.1" in san, "kube-scheduler reaches it on loopback"
    cert_key = _openssl("x509", "-in", files["tls.pem"], "-noout", "-pubkey")
    private_key = _openssl("pkey", "-in", files["tls.key"], "-pubout")
    assert cert_key == private_key


def _days_valid(pem: bytes, tmp_path, name: str) -> float:
    """Days from now to the end of the certificate in `pem`."""
    from datetime import datetime, timezone

    path = tmp_path / name
    path.write_bytes(pem)
    end = _openssl("x509", "-in", str(path), "-noout", "-enddate").strip().split("=", 1)[1]
    ends = datetime.strptime(end, "%b %d %H:%M:%S %Y %Z").replace(tzinfo=timezone.utc)
    return (ends - datetime.now(timezone.utc)).total_seconds() / 86400


def test_the_charts_certificate_is_short_lived_and_renewable_from_its_ca(tmp_path):
    import base64
    from datetime import datetime, timezone

    objects = render()
    secret = find(objects, "Secret", "-scheduler-tls")
    data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    assert set(data) == {"ca.crt", "ca.key", "tls.crt", "tls.key"}
    # A year for the serving certificate, ten for the CA the API server
    # trusts (caBundle), whose key issues the next serving certificate.
    assert 364 < _days_valid(data["tls.crt"], tmp_path, "tls.pem") <= 365
    assert 3649 < _days_valid(data["ca.crt"], tmp_path, "ca.pem") <= 3650
    (tmp_path / "ca.key").write_bytes(data["ca.key"])
    assert _openssl("pkey", "-in", str(tmp_path / "ca.key"), "-pubout") == \
        _openssl("x509", "-in", str(tmp_path / "ca.pem"), "-noout", "-pubkey")
    renew_after = datetime.fromisoformat(secret["metadata"]["annotations"]["vgpu.io/renew-after"])
    days_left = (renew_after - datetime.now(timezone.utc)).total_seconds() / 86400
    assert 274 < days_left <= 275, "renewed by the first upgrade in its last 90 days"
    # The extender's volume: the certificate and its key, not the CA's key,
    # as a directory kubelet updates when the Secret changes.
    deployment = find(objects, "Deployment", "-scheduler")
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
    assert volume["secret"]["items"] == [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}]
    mount = next(m for m in container(deployment, "extender")["volumeMounts"] if m["name"] == "tls")
    assert "subPath" not in mount

    shorter = render({"scheduler": {"webhook": {"certificate": {"days": 30, "renewBeforeDays": 10}}}})
    secret = find(shorter, "Secret", "-scheduler-tls")
    tls = base64.b64decode(secret["data"]["tls.crt"])
    assert 29 < _days_valid(tls, tmp_path, "short.pem") <= 30
    with pytest.raises(Exception) as error:
        render({"scheduler": {"webhook": {"certificate": {"days": 30, "renewBeforeDays": 30}}}})
    assert "renewBeforeDays (30) must be less than days (30)" in str(error.value)


def test_cert_manager_issues_the_extenders_certificate_when_an_issuer_is_named():
    values = {"scheduler": {"webhook": {"certificate": {
        "days": 90, "renewBeforeDays": 30, "certManager": {"issuer": "cluster-ca", "issuerKind": "ClusterIssuer"}}}}}
    objects = render(values, namespace="gpu-system")
    assert not [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-scheduler-tls")], \
        "no chart CA nor certificate: cert-manager writes the Secret"
    certificate = find(objects, "Certificate", "-scheduler-tls")
    assert certificate["apiVersion"] == "cert-manager.io/v1"
    spec = certificate["spec"]
    deployment = find(objects, "Deployment", "-scheduler")
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
    assert volume["secret"]["secretName"] == spec["secretName"], "the extender serves what cert-manager writes"
    service = find(objects, "Service", "-scheduler")["metadata"]["name"]
    assert f"{service}.gpu-system.svc" in spec["dnsNames"], "the name the API server calls"
    assert spec["ipAddresses"] == ["127.0.0.1"], "kube-scheduler reaches it on loopback"
    assert (spec["duration"], spec["renewBefore"]) == ("2160h", "720h")
    assert spec["issuerRef"] == {"name": "cluster-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    injected = f"gpu-system/{certificate['metadata']['name']}"
    webhook_config = find(objects, "MutatingWebhookConfiguration", "-webhook")
    assert webhook_config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == injected
    (webhook,) = webhook_config["webhooks"]
    assert "caBundle" not in webhook["clientConfig"], "set by cert-manager's CA injector, not the chart"
    claims = next(o for o in objects if o["kind"] == "CustomResourceDefinition"
                  and o["metadata"]["name"] == "elasticgpuclaims.elasticgpu.io")
    assert claims["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == injected
    conversion = claims["spec"]["conversion"]["webhook"]["clientConfig"]
    assert "caBundle" not in conversion and conversion["service"]["name"] == service
    assert flags(container(deployment, "extender"))["tls-expiry-warning-days"] == "30"

    # Without it: the chart's own CA, no Certificate, no injection.
    default = render(namespace="gpu-system")
    assert not [o for o in default if o["kind"] == "Certificate"]
    assert "annotations" not in find(default, "MutatingWebhookConfiguration", "-webhook")["metadata"]
    for wrong, message in [
        ({"extender": {"tls": {"secretName": "mine"}}}, "give one"),
        ({"webhook": {"caBundle": "Q0E="}}, "leave caBundle empty"),
    ]:
        both = copy.deepcopy(values)
        for key, value in wrong.items():
            both["scheduler"].setdefault(key, {}).update(value)
        with pytest.raises(Exception) as error:
            render(both)
        assert message in str(error.value), error.value
    with pytest.raises(Exception) as error:
        render({"scheduler": {"webhook": {"certificate": {"certManager": {"issuerKind": "Secret"}}}}})
    assert "issuerKind" in str(error.value), error.value


def test_a_kube_scheduler_elsewhere_reaches_the_verbs_with_a_client_certificate():
    import base64

    pem = (pathlib.Path(__file__).resolve().parents[2] / "scheduler/tests/fixtures/tls/client-ca.pem").read_text()
    objects = render({"scheduler": {"extender": {"clientCA": base64.b64encode(pem.encode()).decode()}}})
    deployment = find(objects, "Deployment", "-scheduler")
    extender = container(deployment, "extender")
    f = flags(extender)
    assert f["address"] == "127.0.0.1", "the plain port stays on loopback"
    mount = next(m for m in extender["volumeMounts"] if m["name"] == "client-ca")
    assert f["client-ca"] == f"{mount['mountPath']}/ca.crt"
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "client-ca")
    config_map = find(objects, "ConfigMap", "-scheduler-client-ca")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert config_map["data"]["ca.crt"].strip() == pem.strip()
    assert "client-ca" not in flags(container(find(render(), "Deployment", "-scheduler"), "extender"))
    with pytest.raises(Exception) as error:
        render({"scheduler": {"extender": {"clientCA": "Q0E="}, "webhook": {"enabled": False}}})
    assert "needs scheduler.webhook.enabled or scheduler.extender.tls.secretName" in str(error.value)


def test_webhook_with_a_given_certificate_needs_its_ca():
    values = {"scheduler": {"extender": {"tls": {"secretName": "mine"}}}}
    with pytest.raises(Exception) as error:
        render(values)
    assert "caBundle" in str(error.value)
    values["scheduler"]["webhook"] = {"caBundle": "Q0E="}
    objects = render(values)
    (webhook,) = find(objects, "MutatingWebhookConfiguration", "-webhook")["webhooks"]
    assert webhook["clientConfig"]["caBundle"] == "Q0E="
    # (The one Secret left is kube-scheduler's account token.)
    assert not [o for o in objects if o["kind"] == "Secret" and o["type"] == "kubernetes.io/tls"], (
        "the given secret is used, none made"
    )
    volume = next(
        v
        for v in find(objects, "Deployment", "-scheduler")["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "tls"
    )
    assert volume["secret"]["secretName"] == "mine"


def test_without_the_webhook_nothing_of_it_is_installed():
    objects = render({"scheduler": {"webhook": {"enabled": False}}})
    kinds = {o["kind"] for o in objects}
    assert "MutatingWebhookConfiguration" not in kinds
    assert not [o for o in objects if o["kind"] == "Secret" and o["type"] == "kubernetes.io/tls"]
    (ext,) = scheduler_config(objects)["extenders"]
    assert ext["urlPrefix"].startswith("http://")
    assert "tls-cert" not in flags(container(find(objects, "Deployment", "-scheduler"), "extender"))


def test_service_monitor_scrapes_the_monitor_service():
    assert not [o for o in render() if o["kind"] == "ServiceMonitor"], "off by default"
    values = {"node": {"monitor": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prom"}}}}}
    objects = render(values)
    monitor = find(objects, "ServiceMonitor", "-monitor")
    service = find(objects, "Service", "-monitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prom"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [service["metadata"]["namespace"]]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"]
    assert endpoint["path"] == "/metrics"
    # The monitor's own namespace/pod/container labels name the workload's
    # container; without honorLabels the agent pod's target labels would
    # replace them.
    assert endpoint["honorLabels"] is True
    # Every series gets the node the dashboard's node variable reads.
    (relabeling,) = endpoint["relabelings"]
    assert relabeling["sourceLabels"] == ["__meta_kubernetes_pod_node_name"]
    assert relabeling["targetLabel"] == dashboard_node_label()
    values["node"]["monitor"]["service"] = {"enabled": False}
    with pytest.raises(Exception) as error:
        render(values)
    assert "serviceMonitor" in str(error.value)


DASHBOARD = CHART / "dashboards" / "vgpu.json"


def dashboard_node_label():
    """The label the dashboard's `node` variable offers the values of."""
    variables = json.loads(DASHBOARD.read_text())["templating"]["list"]
    (node,) = [v for v in variables if v["name"] == "node"]
    query = node["query"]
    assert query.startswith("label_values(") and query.endswith(")"), query
    return query[: -1].rsplit(",", 1)[1].strip()


def dashboard_config_map(objects):
    return find(objects, "ConfigMap", "-dashboard")


def test_the_dashboard_ships_for_grafanas_sidecar():
    # The defaults: in the release's namespace, with the label Grafana's
    # sidecar looks for by default.
    config_map = dashboard_config_map(render(namespace="gpu"))
    metadata = config_map["metadata"]
    assert metadata["namespace"] == "gpu"
    assert metadata["labels"]["grafana_dashboard"] == "1"
    assert "annotations" not in metadata
    (key,) = config_map["data"]
    assert key.endswith(".json"), "the sidecar loads *.json keys"
    shipped = json.loads(config_map["data"][key])
    assert shipped == json.loads(DASHBOARD.read_text())
    assert shipped["uid"] and shipped["title"]

    values = {"grafana": {"dashboard": {
        "namespace": "monitoring",
        "label": "dashboards.example.com/grafana",
        "labelValue": "vgpu",
        "annotations": {"grafana_folder": "GPU"},
    }}}
    metadata = dashboard_config_map(render(values))["metadata"]
    assert metadata["namespace"] == "monitoring"
    assert metadata["labels"]["dashboards.example.com/grafana"] == "vgpu"
    assert "grafana_dashboard" not in metadata["labels"]
    assert metadata["annotations"] == {"grafana_folder": "GPU"}

    values = {"grafana": {"dashboard": {"enabled": False}}}
    assert not [o for o in render(values) if o["metadata"]["name"].endswith("-dashboard")]


ELASTIC_GPU_CRDS = {
    "elasticgpuclaims.elasticgpu.io": ("ElasticGPUClaim", "Namespaced", True),
    "elasticgpuclasses.elasticgpu.io": ("ElasticGPUClass", "Cluster", True),
    "elasticgpus.elasticgpu.io": ("ElasticGPU", "Cluster", False),
    "gpus.elasticgpu.io": ("GPU", "Cluster", False),
}


def elastic_gpu_crds(objects):
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "CustomResourceDefinition"}


def test_elastic_gpu_crds_convert_through_the_extender_with_the_webhooks_ca():
    objects = render(namespace="gpu-system")
    crds = elastic_gpu_crds(objects)
    assert set(crds) == set(ELASTIC_GPU_CRDS)
    (webhook,) = find(objects, "MutatingWebhookConfiguration", "-webhook")["webhooks"]
    secret = find(objects, "Secret", "-scheduler-tls")
    for name, (kind, scope, converted) in ELASTIC_GPU_CRDS.items():
        crd = crds[name]
        assert crd["spec"]["group"] == "elasticgpu.io"
        assert crd["spec"]["names"]["kind"] == kind and crd["spec"]["scope"] == scope
        # Uninstalling the chart leaves users' objects alone.
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        versions = {v["name"]: v for v in crd["spec"]["versions"]}
        assert [v["name"] for v in crd["spec"]["versions"] if v["storage"]] == ["v1alpha1"]
        assert all(v["served"] for v in versions.values())
        if not converted:
            assert list(versions) == ["v1alpha1"] and "conversion" not in crd["spec"]
            continue
        assert set(versions) == {"v1alpha1", "v1alpha"}
        conversion = crd["spec"]["conversion"]
        assert conversion["strategy"] == "Webhook"
        assert conversion["webhook"]["conversionReviewVersions"] == ["v1"]
        client = conversion["webhook"]["clientConfig"]
        # The admission webhook's service, port and CA: one certificate serves both.
        assert client["service"] == dict(webhook["clientConfig"]["service"], path="/convert")
        assert client["caBundle"] == webhook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]

    def schemas(crd: str) -> dict:
        return {v["name"]: v["schema"]["openAPIV3Schema"] for v in crds[crd]["spec"]["versions"]}
    claim = schemas("elasticgpuclaims.elasticgpu.io")
    assert "elasticGPUClassName" in claim["v1alpha1"]["properties"]["spec"]["properties"]
    assert "egpuClassName" in claim["v1alpha"]["properties"]["spec"]["properties"]
    requests = claim["v1alpha1"]["properties"]["spec"]["properties"]["resources"]["properties"]["requests"]
    assert requests["additionalProperties"]["x-kubernetes-int-or-string"] is True
    cls = schemas("elasticgpuclasses.elasticgpu.io")
    assert {"reclaimPolicy", "egpuBindingMode"} <= set(cls["v1alpha"]["properties"])
    assert not {"reclaimPolicy", "egpuBindingMode"} & set(cls["v1alpha1"]["properties"])


@pytest.mark.parametrize(
    "values, served",
    [
        # No HTTPS on the extender: v1alpha cannot be converted, so only v1alpha1.
        ({"scheduler": {"webhook": {"enabled": False}}}, ["v1alpha1"]),
        # A given certificate without its CA: the API server could not trust it.
        ({"scheduler": {"extender": {"tls": {"secretName": "mine"}}, "webhook": {"enabled": False}}}, ["v1alpha1"]),
        (
            {
                "scheduler": {
                    "extender": {"tls": {"secretName": "mine"}},
                    "webhook": {"enabled": False, "caBundle": "Q0E="},
                }
            },
            ["v1alpha1", "v1alpha"],
        ),
    ],
    ids=["plain-http", "own-cert-no-ca", "own-cert-with-ca"],
)
def test_elastic_gpu_v1alpha_is_served_only_where_it_can_be_converted(values, served):
    crds = elastic_gpu_crds(render(values))
    claims = crds["elasticgpuclaims.elasticgpu.io"]
    assert [v["name"] for v in claims["spec"]["versions"]] == served
    assert ("conversion" in claims["spec"]) == (len(served) > 1)
    if len(served) > 1:
        assert claims["spec"]["conversion"]["webhook"]["clientConfig"]["caBundle"] == "Q0E="


def test_elastic_gpu_crds_can_be_left_out():
    assert not elastic_gpu_crds(render({"elasticGPU": {"crds": {"enabled": False}}}))


def test_opportunistic_pods_get_a_class_below_the_default_that_preempts_nobody():
    objects = render({})
    (priority_class,) = [o for o in objects if o["kind"] == "PriorityClass"]
    assert priority_class["metadata"]["name"] == "vgpu-opportunistic"
    assert priority_class["value"] < 0 and priority_class["preemptionPolicy"] == "Never"
    assert priority_class["globalDefault"] is False
    extender_flags = flags(container(find(objects, "Deployment", "-scheduler"), "extender"))
    # The webhook gives that class with the value the API server resolves it to.
    assert extender_flags["opportunistic-priority-class"] == f"vgpu-opportunistic={priority_class['value']}"
    assert extender_flags["scheduler-alias"] == "kubeshare-scheduler"
    # KubeShare pods (labels only, or naming kubeshare-scheduler) reach the webhook.
    webhook = find(objects, "MutatingWebhookConfiguration", "-webhook")["webhooks"][0]
    expression = webhook["matchConditions"][0]["expression"]
    assert "k.startsWith('sharedgpu/')" in expression
    assert "object.spec.schedulerName == 'kubeshare-scheduler'" in expression
    # A class of the user's own: not created, still given.
    objects = render({"opportunistic": {"priorityClass": {"create": False, "name": "batch-low", "value": -5}}})
    assert not [o for o in objects if o["kind"] == "PriorityClass"]
    extender_flags = flags(container(find(objects, "Deployment", "-scheduler"), "extender"))
    assert extender_flags["opportunistic-priority-class"] == "batch-low=-5"


def test_dra_nodes_run_the_driver_instead_of_the_device_plugin():
    """With dra.enabled the nodes labelled vgpu.io/allocation=dra run the
    vgpu-dra driver (with arguments it accepts, and the rights it needs) and
    the node agent's device plugin stays off them; both DeviceClasses are
    there. (The API server itself accepts them in tests/cluster/test_dra.py:
    this schema version has no resource.k8s.io/v1.)"""
    objects = render({"dra": {"enabled": True}})
    classes = {o["metadata"]["name"]: o for o in objects if o["kind"] == "DeviceClass"}
    assert sorted(classes) == ["vgpu.io", "vgpu.io-exclusive"]
    assert classes["vgpu.io"]["spec"]["selectors"] == [{"cel": {"expression": 'device.driver == "vgpu.io"'}}]
    parameters = classes["vgpu.io-exclusive"]["spec"]["config"][0]["opaque"]["parameters"]
    assert parameters == {"apiVersion": "vgpu.io/v1", "kind": "GpuConfig", "exclusive": True}

    driver = find(objects, "DaemonSet", "-dra")
    assert driver["spec"]["template"]["spec"]["nodeSelector"] == {"gpu": "on", "vgpu.io/allocation": "dra"}
    c = container(driver, "dra-driver")
    result = _accepts("vgpu-dra", c["args"])
    assert result.returncode == 0, f"vgpu-dra {c['args']}:\n{result.stderr}"
    mounted = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/var/lib/kubelet/plugins/vgpu.io", "/var/lib/kubelet/plugins_registry", "/var/run/cdi"} <= mounted
    # The node monitor runs beside the driver, as beside the device plugin,
    # and the monitor's Service selects both kinds of node pod.
    monitor = container(driver, "monitor")
    assert monitor == container(find(objects, "DaemonSet", "-node"), "monitor")
    service = find(objects, "Service", "-monitor")
    for daemonset in (driver, find(objects, "DaemonSet", "-node")):
        labels = daemonset["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items(), labels
    account = driver["spec"]["template"]["spec"]["serviceAccountName"]
    for group, resource, verb in [("resource.k8s.io", "resourceslices", "create"),
                                  ("resource.k8s.io", "resourceslices", "patch"),
                                  ("resource.k8s.io", "resourceclaims", "get"), ("", "nodes", "get"),
                                  ("", "nodes", "watch"), ("", "pods", "watch"), ("", "events", "create")]:
        assert rules_allow(objects, account, group, resource, verb), (resource, verb)

    node = find(objects, "DaemonSet", "-node")
    terms = node["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": "vgpu.io/allocation", "operator": "NotIn", "values": ["dra"]}]}]
    for obj in objects:
        if not obj["apiVersion"].startswith("resource.k8s.io/"):
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    # Off by default: no driver, no classes, no affinity.
    plain = render()
    assert not [o for o in plain if o["kind"] == "DeviceClass" or o["metadata"]["name"].endswith("-dra")]
    assert "affinity" not in find(plain, "DaemonSet", "-node")["spec"]["template"]["spec"]


def test_the_image_holds_every_binary_the_chart_runs():
    """Each of our binaries a chart container runs is built and copied
    into the image by deploy/images/Dockerfile."""
    dockerfile = (ROOT / "deploy/images/Dockerfile").read_text()
    objects = render({"dra": {"enabled": True}})
    run = set()
    for obj in objects:
        if obj["kind"] not in ("DaemonSet", "Deployment"):
            continue
        spec = obj["spec"]["template"]["spec"]
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            command = c.get("command", [""])[0]
            if command.startswith("/usr/local/bin/vgpu-"):
                run.add(command.rsplit("/", 1)[1])
    assert {"vgpu-device-plugin", "vgpu-dra", "vgpu-monitor", "vgpu-scheduler"} <= run, run
    for binary in run:
        assert f"-p {binary} " in dockerfile, f"the Dockerfile does not build {binary}"
        assert f"/src/target/release/{binary} " in dockerfile, f"the Dockerfile does not copy {binary}"


def test_the_image_builds_with_the_rust_release_the_tests_run_with():
    """The Dockerfile's build stage uses the Rust release this test run
    compiles with (major.minor), on the Debian release of its runtime stage:
    the image holds what the tests test, not what an older compiler makes."""
    dockerfile = (ROOT / "deploy/images/Dockerfile").read_text()
    build = re.search(r"^FROM rust:(\d+\.\d+)-(\w+) AS build$", dockerfile, re.M)
    assert build, "the build stage names no rust:<major.minor>-<debian> image"
    runtime = re.search(r"^FROM debian:(\w+)-slim$", dockerfile, re.M)
    assert runtime, "the runtime stage names no debian:<release>-slim image"
    version = subprocess.run(["rustc", "--version"], capture_output=True, text=True, check=True).stdout
    tested = re.match(r"rustc (\d+\.\d+)\.", version)
    assert tested, version
    assert build.group(1) == tested.group(1), f"Dockerfile builds with Rust {build.group(1)}, tests with {version}"
    assert build.group(2) == runtime.group(1), "build and runtime stages on different Debian releases"


def test_network_policies_are_off_by_default_and_name_only_the_peers_given():
    assert not [o for o in render() if o["kind"] == "NetworkPolicy"]
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    objects = render({
        "networkPolicy": {
            "enabled": True,
            "apiServerCIDRs": ["10.0.0.1/32"],
            "metricsFrom": [monitoring],
        },
    })
    scheduler = find(objects, "NetworkPolicy", "-scheduler")
    deployment = find(objects, "Deployment", "-scheduler")
    selected = scheduler["spec"]["podSelector"]["matchLabels"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selected.items() <= pod_labels.items(), "it selects the scheduler pod"
    webhook, plain = scheduler["spec"]["ingress"]
    assert webhook["ports"] == [{"port": 39443, "protocol": "TCP"}]
    assert webhook["from"] == [{"ipBlock": {"cidr": "10.0.0.1/32"}}]
    assert plain["ports"] == [{"port": 39999, "protocol": "TCP"}]
    assert plain["from"] == [monitoring], "the plain port only for the peers named"

    monitor = find(objects, "NetworkPolicy", "-monitor")
    daemonset = find(objects, "DaemonSet", "-node")
    selected = monitor["spec"]["podSelector"]["matchLabels"]
    assert selected.items() <= daemonset["spec"]["template"]["metadata"]["labels"].items()
    (rule,) = monitor["spec"]["ingress"]
    assert rule["from"] == [monitoring]
    assert rule["ports"] == [{"port": 31992, "protocol": "TCP"}]

    # Without peers for metrics, nothing reaches the monitors and only the
    # webhook port reaches the scheduler pod.
    objects = render({"networkPolicy": {"enabled": True}})
    assert find(objects, "NetworkPolicy", "-monitor")["spec"]["ingress"] == []
    (webhook,) = find(objects, "NetworkPolicy", "-scheduler")["spec"]["ingress"]
    assert "from" not in webhook


def test_a_network_policy_peer_that_is_not_one_is_refused():
    for bad, words in (
        ({"apiServerCIDRs": ["not-a-cidr"]}, "apiServerCIDRs"),
        ({"metricsFrom": [{}]}, "metricsFrom"),
        ({"metricsFrom": [{"podSelektor": {}}]}, "podSelektor"),
        ({"kubeSchedulerFrom": [{"ipBlock": {}}]}, "cidr"),
    ):
        with pytest.raises(Exception) as error:
            render({"networkPolicy": {"enabled": True, **bad}})
        assert words in str(error.value), str(error.value)


def test_the_extender_listens_on_loopback_unless_its_verbs_are_exposed():
    extender = container(find(render(), "Deployment", "-scheduler"), "extender")
    assert flags(extender)["address"] == "127.0.0.1"
    env = {e["name"]: e for e in extender.get("env", [])}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    exposed = render({"scheduler": {"extender": {"exposeVerbs": True}}})
    assert flags(container(find(exposed, "Deployment", "-scheduler"), "extender"))["address"] == "0.0.0.0"


def test_large_extender_limits_render_as_integers_the_extender_parses():
    values = {"scheduler": {"extender": {
        "maxWatches": 65536, "maxConnections": 65536, "maxConnectionsPerClient": 65536,
        "maxRequestBytes": 1073741824, "readTimeoutSeconds": 3600, "writeTimeoutSeconds": 3600,
        "maxConnectionAgeSeconds": 86400}}}
    extender = container(find(render(values), "Deployment", "-scheduler"), "extender")
    got = flags(extender)
    assert (got["max-watches"], got["max-connections"], got["max-connections-per-client"], got["max-request-bytes"],
            got["read-timeout-seconds"], got["write-timeout-seconds"], got["max-connection-age-seconds"]) == (
        "65536", "65536", "65536", "1073741824", "3600", "3600", "86400")
    defaults = flags(container(find(render(), "Deployment", "-scheduler"), "extender"))
    assert (defaults["max-connections-per-client"], defaults["write-timeout-seconds"],
            defaults["max-connection-age-seconds"]) == ("256", "10", "300")
    with pytest.raises(Exception) as error:
        render({"scheduler": {"extender": {"maxConnectionAgeSeconds": 0}}})
    assert "maxConnectionAgeSeconds" in str(error.value)
    with pytest.raises(Exception) as error:
        render({"scheduler": {"extender": {"writeTimeoutSeconds": 0}}})
    assert "writeTimeoutSeconds" in str(error.value)
    with pytest.raises(Exception) as error:
        render({"scheduler": {"extender": {"maxWatches": 1000000}}})
    assert "maxWatches" in str(error.value)


# Values files of the peers' charts -------------------------------------------

PEER_VALUES = ROOT / "tests" / "deploy" / "peer-values"
PEER_TEMPLATE = CHART / "templates" / "_peer-values.tpl"
APPLY_PEER_VALUES = '{{- include "vgpu.peerValues.apply" . -}}'


def peer_lists():
    """The mappings and the peer keys that _peer-values.tpl names."""
    text = PEER_TEMPLATE.read_text()

    def block(name):
        start = text.index(f'define "{name}" -}}}}\n') + len(f'define "{name}" -}}}}\n')
        return yaml.safe_load(text[start : text.index("{{- end -}}", start)])

    return block("vgpu.peerValues.mappings"), block("vgpu.peerValues.keys")


def notes(values):
    """NOTES.txt's lists: {"mapped": {from: 'to: value'}, "ignored": {key: value}}."""
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)
        manifests = chart.render(values, name="vgpu", namespace="kube-system")
    text = next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))
    lists = {"mapped": {}, "ignored": {}}
    current = None
    for line in text.splitlines():
        if line.startswith("Values of HAMi's"):
            current = lists["mapped"]
        elif line.startswith("WARNING: these values"):
            current = lists["ignored"]
        elif current is not None and line.startswith("  "):
            key, _, value = line.strip().partition(" -> " if current is lists["mapped"] else ": ")
            current[key] = value
    return lists


def peer_file(name):
    return yaml.safe_load((PEER_VALUES / name).read_text())


def test_a_hami_values_file_works_unchanged():
    values = peer_file("hami.yaml")
    objects = render(values)
    node = find(objects, "DaemonSet", "-node")
    pod = node["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu-pool": "shared"}
    assert "runtimeClassName" not in pod, "HAMi's empty runtimeClassName: the node's default runtime"
    assert {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["imagePullSecrets"] == [{"name": "registry-credentials"}]
    plugin, monitor = container(node, "device-plugin"), container(node, "monitor")
    pf = flags(plugin)
    assert pf["split-count"] == "4" and pf["device-memory-scaling"] == "1.5"
    assert pf["containers-dir"] == "/opt/vgpu/containers" and pf["library"] == "/opt/vgpu/libvgpu.so"
    assert plugin["resources"] == {"limits": {"memory": "300Mi"}}
    assert monitor["resources"] == {"limits": {"memory": "200Mi"}}
    assert str(monitor["ports"][0]["containerPort"]) == "31993"
    assert pf["core-policy"] == "force", "devices.nvidia.gpuCorePolicy"
    host_paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert {"/data/kubelet/device-plugins", "/data/kubelet/pod-resources"} <= host_paths, host_paths

    deployment = find(objects, "Deployment", "-scheduler")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["template"]["spec"]["nodeSelector"] == {"scheduler-pool": "on"}
    kube_scheduler = container(deployment, "kube-scheduler")
    assert kube_scheduler["image"] == "mirror.example.com/google_containers/kube-scheduler:v1.32.0"
    ef = flags(container(deployment, "extender"))
    assert (ef["resource-gpu"], ef["resource-memory"], ef["resource-memory-percentage"], ef["resource-cores"],
            ef["resource-priority"]) == ("nvidia.com/vgpu", "nvidia.com/vgpu-memory",
                                         "nvidia.com/vgpu-memory-percentage", "nvidia.com/vgpu-cores",
                                         "nvidia.com/vgpu-priority")
    assert (ef["gpu-policy"], ef["node-policy"]) == ("binpack", "spread")
    assert (ef["default-memory-mib"], ef["default-cores"], ef["scheduler-name"]) == ("2048", "10", "hami-scheduler")
    config = scheduler_config(objects)
    assert config["profiles"][0]["schedulerName"] == "hami-scheduler"
    (extender,) = config["extenders"]
    assert extender["httpTimeout"] == "30s"
    assert "nvidia.com/vgpu" in {r["name"] for r in extender["managedResources"]}
    webhook = find(objects, "MutatingWebhookConfiguration", "-webhook")["webhooks"][0]
    assert webhook["failurePolicy"] == "Fail"
    assert {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system", "istio-system"]} \
        in webhook["namespaceSelector"]["matchExpressions"]
    for workload, name, binary in [(node, "device-plugin", "vgpu-device-plugin"), (node, "monitor", "vgpu-monitor"),
                                   (deployment, "extender", "vgpu-scheduler")]:
        result = _accepts(binary, container(workload, name)["args"])
        assert result.returncode == 0, f"{binary}:\n{result.stderr}"

    listed = notes(values)
    assert listed["mapped"]["devicePlugin.deviceSplitCount"] == "node.devicePlugin.splitCount: 4"
    assert listed["mapped"]["devicePlugin.pluginPath"] == 'node.kubeletDir: "/data/kubelet"'
    assert listed["mapped"]["devicePlugin.runtimeClassName"] == 'node.runtimeClassName: ""'
    assert {"devicePlugin.deviceCoreScaling", "devicePlugin.migStrategy", "devices.amd",
            "devices.nvidia.libCudaLogLevel", "scheduler.extender.image", "scheduler.leaderElect", "global.imageTag",
            "mluResourceName", "hcuResourceMem"} <= set(listed["ignored"]), listed["ignored"]
    # Nothing is both, nothing is lost: every key of the file is vgpu's, mapped or named as ignored.
    assert not set(listed["mapped"]) & set(listed["ignored"])


def test_an_nvidia_gpu_scheduler_values_file_works_unchanged():
    values = peer_file("nvidia-gpu-scheduler.yaml")
    objects = render(values)
    node = find(objects, "DaemonSet", "-node")
    assert node["spec"]["template"]["spec"]["nodeSelector"] == {"nodeinfo": "gpu"}
    host_paths = {v["hostPath"]["path"] for v in node["spec"]["template"]["spec"]["volumes"] if "hostPath" in v}
    assert "/data/kubelet/pod-resources" in host_paths, host_paths
    deployment = find(objects, "Deployment", "-scheduler")
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 2
    assert pod["nodeSelector"] == {"node-role.kubernetes.io/control-plane": ""}
    assert pod["tolerations"][0]["key"] == "node-role.kubernetes.io/control-plane"
    assert container(deployment, "extender")["resources"] == {"limits": {"cpu": "500m", "memory": "256Mi"},
                                                              "requests": {"cpu": "100m", "memory": "128Mi"}}
    # Its `resources` holds container resources; vgpu's resource names stay as they were.
    assert flags(container(deployment, "extender"))["resource-gpu"] == "nvidia.com/gpu"
    listed = notes(values)
    assert set(listed["mapped"]) == {"replicaCount", "nodeSelector", "tolerations", "resources.limits",
                                     "resources.requests", "nodeSelectorDaemonSet", "defaultPodResourcesDir"}
    assert set(listed["ignored"]) == {"image.gpuserver", "image.gpuserverds", "apigroup", "apiversion",
                                      "serviceAccount", "service"}


def test_every_peer_key_is_accepted_and_either_mapped_or_named_as_ignored():
    mappings, keys = peer_lists()
    sources = [m["from"] for m in mappings]
    # Every mapping is shown working by one of the two files above.
    shown = set(notes(peer_file("hami.yaml"))["mapped"]) | set(notes(peer_file("nvidia-gpu-scheduler.yaml"))["mapped"])
    assert shown == set(sources), set(sources) ^ shown
    # Every other peer key (or an unknown key below one holding mapped keys) is accepted and named.
    values, expected = {}, set()
    for key in keys:
        holds_mapped = any(source.startswith(key + ".") for source in sources)
        if key in sources:
            continue
        path = key.split(".") + (["somethingNew"] if holds_mapped else [])
        node = values
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = "x"
        expected.add(".".join(path))
    values["cncfResourceName"] = "example.com/npu"
    expected.add("cncfResourceName")
    assert set(notes(values)["ignored"]) == expected

    # The schema declares the same keys, and a mapped key takes its vgpu key's constraints.
    schema = json.loads((CHART / "values.schema.json").read_text())

    def declared(node, path=()):
        for name, child in node.get("properties", {}).items():
            if child.get("description", "").startswith("Peer chart's key") or "$ref" in child:
                yield ".".join(path + (name,))
            else:
                yield from declared(child, path + (name,))

    assert set(declared(schema)) == set(keys)
    for m in mappings:
        node = schema
        for part in m["from"].split("."):
            node = node["properties"][part]
        if not m.get("as"):
            assert node["$ref"] == "#/properties/" + "/properties/".join(m["to"].split(".")), m


@pytest.mark.parametrize(
    "values, words",
    [
        ({"devicePlugin": {"deviceSplitCount": 0}}, "deviceSplitCount"),
        ({"scheduler": {"defaultSchedulerPolicy": {"gpuSchedulerPolicy": "topology-aware"}}}, "gpuSchedulerPolicy"),
        ({"schedulerName": "HAMi Scheduler"}, "schedulerName"),
        ({"devicePlugin": {"pluginPath": "/var/lib/kubelet/plugins"}}, "must end in /device-plugins"),
        ({"defaultPodResourcesDir": "/var/lib/kubelet"}, "must end in /pod-resources"),
        ({"devicePlugin": {"disablecorelimit": "sometimes"}}, "disablecorelimit"),
        ({"unknownTopLevelKey": 1}, "unknownTopLevelKey"),
    ],
)
def test_bad_peer_values_are_refused_with_their_name(values, words):
    with pytest.raises(Exception) as error:
        render(values)
    assert words in str(error.value), str(error.value)


def test_hamis_core_limit_switch_wins_over_the_policy():
    values = {"devices": {"nvidia": {"gpuCorePolicy": "force"}}, "devicePlugin": {"disablecorelimit": "true"}}
    plugin = container(find(render(values), "DaemonSet", "-node"), "device-plugin")
    assert flags(plugin)["core-policy"] == "disable"


def test_every_template_applies_the_peer_values_first():
    for path in sorted((CHART / "templates").iterdir()):
        if not path.name.startswith("_"):
            assert path.read_text().splitlines()[0] == APPLY_PEER_VALUES, path.name


def test_dra_whole_gpus_are_offered_by_an_extended_resource_name():
    def exclusive(values):
        return next(o for o in render(values) if o["kind"] == "DeviceClass"
                    and o["metadata"]["name"] == "vgpu.io-exclusive")
    assert exclusive({"dra": {"enabled": True}})["spec"]["extendedResourceName"] == "vgpu.io/gpu"
    assert "extendedResourceName" not in exclusive({"dra": {"enabled": True, "extendedResourceName": ""}})["spec"]
    # The device plugin's resource name would be claimed twice.
    with pytest.raises(Exception) as error:
        render({"dra": {"enabled": True, "extendedResourceName": "nvidia.com/gpu"}})
    assert "give DRA's whole GPUs another name" in str(error.value), error.value
    with pytest.raises(Exception) as error:
        render({"dra": {"enabled": True, "extendedResourceName": "not a name"}})
    assert "extendedResourceName" in str(error.value), error.value
