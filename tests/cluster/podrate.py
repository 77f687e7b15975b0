"""Creates pods through the API server and times each from its create
request to the first watch event that shows it Running. Runs where the
control plane runs (its test network): `bench_pods.py` starts it there.

Reads a JSON list of pods on stdin; writes one JSON object on stdout:
`{"sent": {name: t}, "running": {name: t}, "errors": [...], "metrics": {"before": text, "after": text},
"clock": c}`, times in seconds on this process's monotonic clock (`t + c`: wall-clock time). Creation uses
`--parallel` kept-alive connections, so the figure is what the cluster does,
not what starting a client per pod costs."""

from __future__ import annotations

import argparse
import http.client
import json
import queue
import ssl
import sys
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse


def tls(pki: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    context.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    return context


# How many times a closed watch is resumed before the round fails.
WATCH_RESUMES = 5


def connect(server: str, context: ssl.SSLContext) -> http.client.HTTPSConnection:
    url = urlparse(server)
    return http.client.HTTPSConnection(url.hostname, url.port, context=context, timeout=60)


def watch_running(server: str, context: ssl.SSLContext, namespace: str, want: set[str],
                  running: dict[str, float], ready: threading.Event, done: threading.Event,
                  failures: list[str]) -> None:
    """Records when each pod of `want` is first seen Running. A watch the
    API server closes before then (seen once under load) is resumed from
    the last version it showed, so no event is lost; only those of the gap
    arrive late."""
    try:
        version = ""
        for _attempt in range(WATCH_RESUMES + 1):
            connection = connect(server, context)
            since = f"&resourceVersion={version}" if version else ""
            connection.request("GET", f"/api/v1/namespaces/{namespace}/pods?watch=1&allowWatchBookmarks=false{since}")
            response = connection.getresponse()
            if response.status != 200:
                failures.append(f"watch answered {response.status}: {response.read()[:300]!r}")
                return
            ready.set()
            while len(running) < len(want):
                line = response.readline()
                if not line:
                    break
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    failures.append(f"watch: {event.get('object', {}).get('message')}")
                    return
                pod = event.get("object", {})
                version = pod.get("metadata", {}).get("resourceVersion", version)
                name = pod.get("metadata", {}).get("name")
                if name in want and name not in running and pod.get("status", {}).get("phase") == "Running":
                    running[name] = time.monotonic()
            connection.close()
            if len(running) >= len(want):
                return
        failures.append(f"the watch ended early {WATCH_RESUMES + 1} times")
    except (OSError, ValueError) as error:
        failures.append(f"watch: {error}")
    finally:
        ready.set()
        done.set()


def create_all(server: str, context: ssl.SSLContext, namespace: str, pods: list[dict], parallel: int,
               sent: dict[str, float], errors: list[str]) -> None:
    work: queue.Queue = queue.Queue()
    for pod in pods:
        work.put(pod)

    def creator() -> None:
        connection = connect(server, context)
        while True:
            try:
                pod = work.get_nowait()
            except queue.Empty:
                return
            name = pod["metadata"]["name"]
            body = json.dumps(pod).encode()
            # A refusal while a webhook's endpoint moves is retried, as a
            # controller would.
            for _attempt in range(20):
                began = time.monotonic()
                try:
                    connection.request("POST", f"/api/v1/namespaces/{namespace}/pods", body=body,
                                       headers={"Content-Type": "application/json"})
                    response = connection.getresponse()
                    answer = response.read()
                except OSError as error:
                    connection.close()
                    connection = connect(server, context)
                    answer, status = str(error).encode(), 0
                else:
                    status = response.status
                if status == 201:
                    sent[name] = began
                    break
                time.sleep(0.2)
            else:
                errors.append(f"{name}: {status} {answer[:300]!r}")

    threads = [threading.Thread(target=creator) for _ in range(parallel)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def scrape(url: str | None) -> str:
    if not url:
        return ""
    # Plain HTTP (the extender's port for kube-scheduler and metrics).
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True, help="API server URL")
    parser.add_argument("--pki", required=True, type=Path, help="folder with ca.crt, admin.crt, admin.key")
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--parallel", type=int, default=4, help="concurrent creators (default 4)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for Running (default 300)")
    parser.add_argument("--metrics", help="a /metrics URL scraped before and after (the extender's)")
    options = parser.parse_args(argv)
    pods = json.load(sys.stdin)
    context = tls(options.pki)
    want = {pod["metadata"]["name"] for pod in pods}
    sent: dict[str, float] = {}
    running: dict[str, float] = {}
    errors: list[str] = []
    ready, done = threading.Event(), threading.Event()
    watcher = threading.Thread(target=watch_running, daemon=True,
                               args=(options.server, context, options.namespace, want, running, ready, done, errors))
    watcher.start()
    ready.wait(30)
    before = scrape(options.metrics)
    create_all(options.server, context, options.namespace, pods, options.parallel, sent, errors)
    if not done.wait(options.timeout):
        errors.append(f"{len(want) - len(running)} of {len(want)} pods not Running after {options.timeout:.0f} s")
    after = scrape(options.metrics)
    # Monotonic times to wall-clock ones (the audit log's) by adding this.
    clock = time.time() - time.monotonic()
    json.dump({"sent": sent, "running": dict(running), "errors": errors,
               "metrics": {"before": before, "after": after}, "clock": clock}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
