package main

// The kubelet's DRA side, from kubelet's own code: its plugin manager
// (pkg/kubelet/pluginmanager) watches the plugin registry for drivers'
// registration sockets and hands DRA drivers to its DRA manager
// (pkg/kubelet/cm/dra), which prepares a pod's ResourceClaims through the
// driver before the pod's containers start, tells each container its CDI
// devices, and releases the claims once the pod is done. There is no
// container runtime, so this node applies the CDI specs itself (env and
// mounts, from <host-root>/var/run/cdi and /etc/cdi).

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	kubeletconfig "k8s.io/kubernetes/pkg/kubelet/config"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager/cache"
)

// hostRootHandler gives kubelet's DRA manager the driver's endpoint as a
// path on this node's disk (drivers answer with paths under /).
type hostRootHandler struct {
	inner    cache.PluginHandler
	hostRoot string
}

func (h hostRootHandler) path(endpoint string) string { return filepath.Join(h.hostRoot, endpoint) }

func (h hostRootHandler) ValidatePlugin(name, endpoint string, versions []string) error {
	return h.inner.ValidatePlugin(name, h.path(endpoint), versions)
}

func (h hostRootHandler) RegisterPlugin(name, endpoint string, versions []string, timeout *time.Duration) error {
	return h.inner.RegisterPlugin(name, h.path(endpoint), versions, timeout)
}

func (h hostRootHandler) DeRegisterPlugin(name, endpoint string) {
	h.inner.DeRegisterPlugin(name, h.path(endpoint))
}

// draNode is the node's DRA manager and where CDI specs are read from.
type draNode struct {
	manager  *dra.Manager
	hostRoot string
	cdiDirs  []string

	mu   sync.Mutex
	pods map[string]*v1.Pod // active pods with claims, by UID
}

func startDRA(ctx context.Context, c *config, client kubernetes.Interface) (*draNode, error) {
	logger := klog.FromContext(ctx)
	manager, err := dra.NewManager(logger, client, filepath.Join(c.workdir, "dra-state"))
	if err != nil {
		return nil, fmt.Errorf("DRA manager: %w", err)
	}
	node := &draNode{manager: manager, hostRoot: c.hostRoot, pods: map[string]*v1.Pod{},
		cdiDirs: []string{filepath.Join(c.hostRoot, "var/run/cdi"), filepath.Join(c.hostRoot, "etc/cdi")}}
	registry := filepath.Join(c.hostRoot, "var/lib/kubelet/plugins_registry")
	if err := os.MkdirAll(registry, 0o755); err != nil {
		return nil, err
	}
	broadcaster := record.NewBroadcaster(record.WithContext(ctx))
	broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: client.CoreV1().Events("")})
	recorder := broadcaster.NewRecorder(scheme.Scheme, v1.EventSource{Component: "kubelet", Host: c.name})
	ready := kubeletconfig.NewSourcesReady(func(sets.Set[string]) bool { return true })
	plugins := pluginmanager.NewPluginManager(registry, recorder)
	getNode := func(ctx context.Context) (*v1.Node, error) {
		return client.CoreV1().Nodes().Get(ctx, c.name, metav1.GetOptions{})
	}
	if err := manager.Start(ctx, node.activePods, getNode, ready); err != nil {
		return nil, err
	}
	plugins.AddHandler(registerapi.DRAPlugin, hostRootHandler{inner: manager.GetWatcherHandler(), hostRoot: c.hostRoot})
	go plugins.Run(ctx, ready, ctx.Done())
	logger.Info("DRA plugin registry watched", "dir", registry)
	return node, nil
}

func (d *draNode) activePods() []*v1.Pod {
	d.mu.Lock()
	defer d.mu.Unlock()
	pods := make([]*v1.Pod, 0, len(d.pods))
	for _, pod := range d.pods {
		pods = append(pods, pod)
	}
	return pods
}

// hasClaims: the pod names claims of its own, or kube-scheduler made one
// for its DRA-backed extended resources (kubelet's DRA manager prepares
// both while the DRAExtendedResource gate is on, as it is by default in
// 1.36).
func hasClaims(pod *v1.Pod) bool {
	return len(pod.Spec.ResourceClaims) > 0 || pod.Status.ExtendedResourceClaimStatus != nil
}

// prepare prepares the pod's claims (kubelet does so before any of the
// pod's containers start, and again, idempotently, on every sync).
func (d *draNode) prepare(ctx context.Context, pod *v1.Pod) error {
	if d == nil || !hasClaims(pod) {
		return nil
	}
	d.mu.Lock()
	d.pods[string(pod.UID)] = pod
	d.mu.Unlock()
	return d.manager.PrepareResources(ctx, pod)
}

// unprepare releases the pod's claims once it is done.
func (d *draNode) unprepare(ctx context.Context, pod *v1.Pod) {
	if d == nil || pod == nil || !hasClaims(pod) {
		return
	}
	d.mu.Lock()
	delete(d.pods, string(pod.UID))
	d.mu.Unlock()
	if err := d.manager.UnprepareResources(ctx, pod); err != nil {
		klog.FromContext(ctx).Error(err, "releasing the pod's claims", "pod", klog.KObj(pod))
	}
}

// cdiSpec is the part of a CDI spec this node applies.
type cdiSpec struct {
	Kind           string      `json:"kind"`
	ContainerEdits cdiEdits    `json:"containerEdits"`
	Devices        []cdiDevice `json:"devices"`
}

type cdiDevice struct {
	Name           string   `json:"name"`
	ContainerEdits cdiEdits `json:"containerEdits"`
}

type cdiEdits struct {
	Env    []string   `json:"env"`
	Mounts []cdiMount `json:"mounts"`
}

type cdiMount struct {
	HostPath      string   `json:"hostPath"`
	ContainerPath string   `json:"containerPath"`
	Options       []string `json:"options"`
}

// containerEdits are the CDI edits for the container's claims: the env
// in order and the mounts (host paths on this node's disk).
func (d *draNode) containerEdits(pod *v1.Pod, container *v1.Container) ([]string, []imageMount, error) {
	if d == nil || !hasClaims(pod) {
		return nil, nil, nil
	}
	info, err := d.manager.GetResources(pod, container)
	if err != nil {
		return nil, nil, err
	}
	var env []string
	var mounts []imageMount
	for _, device := range info.CDIDevices {
		edits, err := d.resolve(device.Name)
		if err != nil {
			return nil, nil, err
		}
		env = append(env, edits.Env...)
		for _, mount := range edits.Mounts {
			readOnly := false
			for _, option := range mount.Options {
				readOnly = readOnly || option == "ro"
			}
			mounts = append(mounts, imageMount{Kind: "bind", Source: hostSource(d.hostRoot, mount.HostPath),
				Target: mount.ContainerPath, ReadOnly: readOnly})
		}
	}
	return env, mounts, nil
}

// resolve finds the CDI device `vendor/class=name` in the spec files, as
// a runtime does, and returns the spec's edits followed by the device's.
func (d *draNode) resolve(qualified string) (cdiEdits, error) {
	kind, name, ok := strings.Cut(qualified, "=")
	if !ok {
		return cdiEdits{}, fmt.Errorf("CDI device %q is not vendor/class=name", qualified)
	}
	for _, dir := range d.cdiDirs {
		files, _ := filepath.Glob(filepath.Join(dir, "*.json"))
		for _, file := range files {
			data, err := os.ReadFile(file)
			if err != nil {
				continue
			}
			var spec cdiSpec
			if err := json.Unmarshal(data, &spec); err != nil {
				return cdiEdits{}, fmt.Errorf("CDI spec %s: %w", file, err)
			}
			if spec.Kind != kind {
				continue
			}
			for _, device := range spec.Devices {
				if device.Name == name {
					edits := spec.ContainerEdits
					edits.Env = append(append([]string{}, edits.Env...), device.ContainerEdits.Env...)
					edits.Mounts = append(append([]cdiMount{}, edits.Mounts...), device.ContainerEdits.Mounts...)
					return edits, nil
				}
			}
		}
	}
	return cdiEdits{}, fmt.Errorf("CDI device %s is in no spec under %v", qualified, d.cdiDirs)
}
