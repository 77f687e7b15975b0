package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	api "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	plugin "k8s.io/kubernetes/pkg/kubelet/cm/devicemanager/plugin/v1beta1"
)

const kubeletSocket = "kubelet.sock"

// The kubelet's own deadline for a device plugin's Allocate.
const allocateTimeout = 30 * time.Second

// startRegistration runs kubelet's device-plugin registration server on
// <socketDir>/kubelet.sock.
func startRegistration(logger klog.Logger, socketDir string, devices *deviceManager) (plugin.Server, error) {
	server, err := plugin.NewServer(logger, filepath.Join(socketDir, kubeletSocket), devices, devices)
	if err != nil {
		return nil, err
	}
	if err := server.Start(logger); err != nil {
		return nil, fmt.Errorf("starting the device-plugin registration server: %w", err)
	}
	return server, nil
}

type registeredPlugin struct {
	client    plugin.DevicePlugin
	options   *api.DevicePluginOptions
	connected bool
	devices   map[string]bool // ID -> healthy
}

type deviceCount struct{ total, healthy int }

// containerDevices are what one container was given: device IDs per
// resource, and the runtime settings the plugins answered with.
type containerDevices struct {
	ids      map[string][]string
	envs     map[string]string
	envOrder []string
	mounts   []*api.Mount
	devices  []*api.DeviceSpec
}

// deviceManager keeps what kubelet's device manager keeps: the plugins,
// their devices and which pod holds which device.
type deviceManager struct {
	mu        sync.Mutex
	plugins   map[string]*registeredPlugin
	allocated map[types.UID]map[string]*containerDevices // pod -> container -> devices
	changed   func()
	// holdDir: while this folder exists, every Allocate call waits, before
	// it is sent, until the file it creates there (<namespace>_<pod>_<container>)
	// is removed: a test's way to act (freeze or kill a plugin) at the
	// moment a call is about to be in flight.
	holdDir string
}

func newDeviceManager(changed func(), holdDir string) *deviceManager {
	return &deviceManager{
		plugins:   map[string]*registeredPlugin{},
		allocated: map[types.UID]map[string]*containerDevices{},
		changed:   changed,
		holdDir:   holdDir,
	}
}

// holdBeforeAllocate waits while the test holds this call (see holdDir).
func (m *deviceManager) holdBeforeAllocate(ctx context.Context, pod *v1.Pod, container string) error {
	if _, err := os.Stat(m.holdDir); err != nil {
		return nil
	}
	marker := filepath.Join(m.holdDir, pod.Namespace+"_"+pod.Name+"_"+container)
	if err := os.WriteFile(marker, nil, 0o644); err != nil {
		return fmt.Errorf("holding Allocate: %w", err)
	}
	for {
		if _, err := os.Stat(marker); os.IsNotExist(err) {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// CleanupPluginDirectory removes the sockets a previous run left, as
// kubelet does when it starts.
func (m *deviceManager) CleanupPluginDirectory(logger klog.Logger, dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, entry := range entries {
		if entry.Type()&os.ModeSocket != 0 {
			path := filepath.Join(dir, entry.Name())
			if err := os.Remove(path); err != nil {
				logger.Error(err, "removing a stale socket", "path", path)
			}
		}
	}
	return nil
}

func (m *deviceManager) PluginConnected(ctx context.Context, resource string, p plugin.DevicePlugin) error {
	options, err := p.API().GetDevicePluginOptions(ctx, &api.Empty{})
	if err != nil {
		return fmt.Errorf("GetDevicePluginOptions of %s: %w", resource, err)
	}
	m.mu.Lock()
	previous := m.plugins[resource]
	entry := &registeredPlugin{client: p, options: options, connected: true, devices: map[string]bool{}}
	if previous != nil {
		entry.devices = previous.devices
	}
	m.plugins[resource] = entry
	m.mu.Unlock()
	klog.FromContext(ctx).Info("device plugin connected", "resource", resource,
		"preferredAllocation", options.GetPreferredAllocationAvailable, "preStart", options.PreStartRequired)
	return nil
}

func (m *deviceManager) PluginDisconnected(logger klog.Logger, resource string) {
	m.mu.Lock()
	if entry := m.plugins[resource]; entry != nil {
		entry.connected = false
	}
	m.mu.Unlock()
	logger.Info("device plugin disconnected: its devices count as unhealthy", "resource", resource)
	m.changed()
}

func (m *deviceManager) PluginListAndWatchReceiver(logger klog.Logger, resource string, response *api.ListAndWatchResponse) {
	devices := map[string]bool{}
	for _, device := range response.Devices {
		devices[device.ID] = device.Health == api.Healthy
	}
	m.mu.Lock()
	if entry := m.plugins[resource]; entry != nil {
		entry.devices = devices
	}
	m.mu.Unlock()
	logger.V(2).Info("device list", "resource", resource, "devices", len(devices))
	m.changed()
}

func (m *deviceManager) counts() map[string]deviceCount {
	m.mu.Lock()
	defer m.mu.Unlock()
	counts := map[string]deviceCount{}
	for resource, entry := range m.plugins {
		count := deviceCount{total: len(entry.devices)}
		if entry.connected {
			for _, healthy := range entry.devices {
				if healthy {
					count.healthy++
				}
			}
		}
		counts[resource] = count
	}
	return counts
}

// isPluginResource: whether a plugin ever registered this resource; others
// (the extender's own resources) are not the device manager's business.
func (m *deviceManager) isPluginResource(resource string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	_, ok := m.plugins[resource]
	return ok
}

// inUse: device IDs of `resource` held by any pod.
func (m *deviceManager) inUseLocked(resource string) map[string]bool {
	used := map[string]bool{}
	for _, containers := range m.allocated {
		for _, given := range containers {
			for _, id := range given.ids[resource] {
				used[id] = true
			}
		}
	}
	return used
}

// release frees everything pod `uid` holds. The node's status does not
// change: it counts devices, not their holders (kubelet reports no status
// for an allocation or its release either).
func (m *deviceManager) release(uid types.UID) {
	m.mu.Lock()
	delete(m.allocated, uid)
	m.mu.Unlock()
}

// retain frees the devices of every pod not in `active` (kubelet's
// clean-up of pods that are gone).
func (m *deviceManager) retain(active map[types.UID]bool) {
	m.mu.Lock()
	for uid := range m.allocated {
		if !active[uid] {
			delete(m.allocated, uid)
		}
	}
	m.mu.Unlock()
}

func (m *deviceManager) given(uid types.UID, container string) *containerDevices {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.allocated[uid][container]
}

// allocatePod gives every container of `pod` its devices, init containers
// first, in order, one at a time, as kubelet's admission does. On error
// the pod holds nothing.
func (m *deviceManager) allocatePod(ctx context.Context, pod *v1.Pod) error {
	reuse := map[string]map[string]bool{} // resource -> devices of init containers
	for _, container := range pod.Spec.InitContainers {
		if err := m.allocateContainer(ctx, pod, &container, reuse, true); err != nil {
			m.release(pod.UID)
			return err
		}
	}
	for _, container := range pod.Spec.Containers {
		if err := m.allocateContainer(ctx, pod, &container, reuse, false); err != nil {
			m.release(pod.UID)
			return err
		}
	}
	return nil
}

func (m *deviceManager) allocateContainer(ctx context.Context, pod *v1.Pod, container *v1.Container,
	reuse map[string]map[string]bool, isInit bool) error {
	logger := klog.FromContext(ctx)
	resources := make([]string, 0, len(container.Resources.Limits))
	for name := range container.Resources.Limits {
		if m.isPluginResource(string(name)) {
			resources = append(resources, string(name))
		}
	}
	sort.Strings(resources)
	given := &containerDevices{ids: map[string][]string{}, envs: map[string]string{}}
	for _, resource := range resources {
		quantity := container.Resources.Limits[v1.ResourceName(resource)]
		needed := int(quantity.Value())
		if needed == 0 {
			continue
		}
		ids, err := m.choose(ctx, pod, resource, needed, reuse[resource])
		if err != nil {
			return err
		}
		// Taken now, so a concurrent choice cannot take them too.
		m.mu.Lock()
		if m.allocated[pod.UID] == nil {
			m.allocated[pod.UID] = map[string]*containerDevices{}
		}
		given.ids[resource] = ids
		m.allocated[pod.UID][container.Name] = given
		entry := m.plugins[resource]
		m.mu.Unlock()

		if err := m.holdBeforeAllocate(ctx, pod, container.Name); err != nil {
			return err
		}
		logger.Info("calling Allocate", "resource", resource, "pod", klog.KObj(pod), "container", container.Name)
		callCtx, cancel := context.WithTimeout(ctx, allocateTimeout)
		response, err := entry.client.API().Allocate(callCtx, &api.AllocateRequest{
			ContainerRequests: []*api.ContainerAllocateRequest{{DevicesIds: ids}},
		})
		cancel()
		if err != nil {
			return fmt.Errorf("Allocate of %s for container %s: %w", resource, container.Name, err)
		}
		if len(response.ContainerResponses) != 1 {
			return fmt.Errorf("Allocate of %s answered %d container responses for one request", resource, len(response.ContainerResponses))
		}
		answer := response.ContainerResponses[0]
		keys := make([]string, 0, len(answer.Envs))
		for key := range answer.Envs {
			keys = append(keys, key)
		}
		sort.Strings(keys)
		for _, key := range keys {
			if _, seen := given.envs[key]; !seen {
				given.envOrder = append(given.envOrder, key)
			}
			given.envs[key] = answer.Envs[key]
		}
		given.mounts = append(given.mounts, answer.Mounts...)
		given.devices = append(given.devices, answer.Devices...)
		logger.V(2).Info("allocated", "pod", klog.KObj(pod), "container", container.Name, "resource", resource, "devices", ids)
		if reuse[resource] == nil {
			reuse[resource] = map[string]bool{}
		}
		for _, id := range ids {
			if isInit {
				reuse[resource][id] = true
			} else {
				delete(reuse[resource], id)
			}
		}
	}
	return nil
}

// choose picks `needed` devices of `resource`: first those init
// containers of the pod used, then the plugin's preferred ones, then any.
func (m *deviceManager) choose(ctx context.Context, pod *v1.Pod, resource string, needed int, reusable map[string]bool) ([]string, error) {
	m.mu.Lock()
	entry := m.plugins[resource]
	if entry == nil || !entry.connected {
		m.mu.Unlock()
		return nil, fmt.Errorf("no healthy devices of %s: its device plugin is not connected", resource)
	}
	used := m.inUseLocked(resource)
	var chosen, available []string
	for id := range reusable {
		if len(chosen) < needed {
			chosen = append(chosen, id)
		}
	}
	taken := map[string]bool{}
	for _, id := range chosen {
		taken[id] = true
	}
	for id, healthy := range entry.devices {
		if healthy && (!used[id] || reusable[id]) && !taken[id] {
			available = append(available, id)
		}
	}
	sort.Strings(available)
	preferred := entry.options.GetPreferredAllocationAvailable
	m.mu.Unlock()
	if len(chosen) == needed {
		return chosen, nil
	}
	if len(chosen)+len(available) < needed {
		return nil, fmt.Errorf("requested number of devices unavailable for %s. Requested: %d, Available: %d",
			resource, needed, len(chosen)+len(available))
	}
	if preferred {
		callCtx, cancel := context.WithTimeout(ctx, allocateTimeout)
		answer, err := entry.client.API().GetPreferredAllocation(callCtx, &api.PreferredAllocationRequest{
			ContainerRequests: []*api.ContainerPreferredAllocationRequest{{
				AvailableDeviceIDs:   append(append([]string{}, chosen...), available...),
				MustIncludeDeviceIDs: chosen,
				AllocationSize:       int32(needed),
			}},
		})
		cancel()
		if err != nil {
			return nil, fmt.Errorf("GetPreferredAllocation of %s: %w", resource, err)
		}
		if len(answer.ContainerResponses) == 1 {
			free := map[string]bool{}
			for _, id := range available {
				free[id] = true
			}
			for _, id := range answer.ContainerResponses[0].DeviceIDs {
				if len(chosen) < needed && free[id] {
					chosen = append(chosen, id)
					delete(free, id)
				}
			}
			remaining := available[:0]
			for _, id := range available {
				if free[id] {
					remaining = append(remaining, id)
				}
			}
			available = remaining
		}
	}
	for _, id := range available {
		if len(chosen) == needed {
			break
		}
		chosen = append(chosen, id)
	}
	return chosen, nil
}

// preStart calls PreStartContainer where a plugin asks for it.
func (m *deviceManager) preStart(ctx context.Context, given *containerDevices) error {
	for resource, ids := range given.ids {
		m.mu.Lock()
		entry := m.plugins[resource]
		m.mu.Unlock()
		if entry == nil || !entry.options.PreStartRequired {
			continue
		}
		callCtx, cancel := context.WithTimeout(ctx, allocateTimeout)
		_, err := entry.client.API().PreStartContainer(callCtx, &api.PreStartContainerRequest{DevicesIds: ids})
		cancel()
		if err != nil {
			return fmt.Errorf("PreStartContainer of %s: %w", resource, err)
		}
	}
	return nil
}
