package main

// The kubelet's PodResources API (v1), served by kubelet's own server
// (k8s.io/kubernetes/pkg/kubelet/apis/podresources) on
// <host-root>/var/lib/kubelet/pod-resources/kubelet.sock, from what this
// node's device manager gave each container. A simulated node has no CPU,
// memory or dynamic resource managers: those report nothing.

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"

	"google.golang.org/grpc"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	podresourcesapi "k8s.io/kubelet/pkg/apis/podresources/v1"
	"k8s.io/kubernetes/pkg/kubelet/apis/podresources"
)

const podResourcesSocket = "var/lib/kubelet/pod-resources/kubelet.sock"

// UpdateAllocatedDevices: the allocations are always current here.
func (m *deviceManager) UpdateAllocatedDevices() {}

// GetDevices lists, per resource, the device IDs container `name` of pod
// `podUID` was given.
func (m *deviceManager) GetDevices(podUID, name string) []*podresourcesapi.ContainerDevices {
	given := m.given(types.UID(podUID), name)
	if given == nil {
		return nil
	}
	var devices []*podresourcesapi.ContainerDevices
	for resource, ids := range given.ids {
		devices = append(devices, &podresourcesapi.ContainerDevices{ResourceName: resource, DeviceIds: ids})
	}
	return devices
}

// GetAllocatableDevices lists every healthy device of every plugin.
func (m *deviceManager) GetAllocatableDevices() []*podresourcesapi.ContainerDevices {
	m.mu.Lock()
	defer m.mu.Unlock()
	var devices []*podresourcesapi.ContainerDevices
	for resource, registered := range m.plugins {
		var ids []string
		for id, healthy := range registered.devices {
			if healthy {
				ids = append(ids, id)
			}
		}
		devices = append(devices, &podresourcesapi.ContainerDevices{ResourceName: resource, DeviceIds: ids})
	}
	return devices
}

// GetPods lists the pods this node runs or is admitting, as kubelet's
// pod manager does: not those still queued for admission.
func (m *podManager) GetPods() []*v1.Pod {
	m.mu.Lock()
	workers := make([]*podWorker, 0, len(m.workers))
	for _, worker := range m.workers {
		workers = append(workers, worker)
	}
	m.mu.Unlock()
	pods := make([]*v1.Pod, 0, len(workers))
	for _, worker := range workers {
		worker.mu.Lock()
		if worker.admitting {
			pods = append(pods, worker.pod)
		}
		worker.mu.Unlock()
	}
	return pods
}

// GetActivePods lists the pods that are not finished.
func (m *podManager) GetActivePods() []*v1.Pod {
	var active []*v1.Pod
	for _, pod := range m.GetPods() {
		if pod.Status.Phase != v1.PodSucceeded && pod.Status.Phase != v1.PodFailed {
			active = append(active, pod)
		}
	}
	return active
}

func (m *podManager) GetPodByName(namespace, name string) (*v1.Pod, bool) {
	for _, pod := range m.GetPods() {
		if pod.Namespace == namespace && pod.Name == name {
			return pod, true
		}
	}
	return nil, false
}

// noManagers stands for the CPU, memory and dynamic resource managers a
// simulated node does not have.
type noManagers struct{}

func (noManagers) GetCPUs(string, string) []int64                              { return nil }
func (noManagers) GetAllocatableCPUs() []int64                                 { return nil }
func (noManagers) GetMemory(string, string) []*podresourcesapi.ContainerMemory { return nil }
func (noManagers) GetAllocatableMemory() []*podresourcesapi.ContainerMemory    { return nil }
func (noManagers) GetDynamicResources(*v1.Pod, *v1.Container) []*podresourcesapi.DynamicResource {
	return nil
}

// servePodResources serves kubelet's PodResources v1 server until ctx ends.
func servePodResources(ctx context.Context, hostRoot string, pods *podManager, devices *deviceManager) error {
	socket := filepath.Join(hostRoot, podResourcesSocket)
	if err := os.MkdirAll(filepath.Dir(socket), 0o755); err != nil {
		return err
	}
	_ = os.Remove(socket)
	listener, err := net.Listen("unix", socket)
	if err != nil {
		return fmt.Errorf("pod-resources socket %s: %w", socket, err)
	}
	server := grpc.NewServer()
	podresourcesapi.RegisterPodResourcesListerServer(server, podresources.NewV1PodResourcesServer(ctx,
		podresources.PodResourcesProviders{Pods: pods, Devices: devices, Cpus: noManagers{},
			Memory: noManagers{}, DynamicResources: noManagers{}}))
	go func() {
		<-ctx.Done()
		server.Stop()
	}()
	go func() {
		if err := server.Serve(listener); err != nil {
			klog.FromContext(ctx).Error(err, "serving the pod-resources API")
		}
	}()
	klog.FromContext(ctx).Info("serving the pod-resources API", "socket", socket)
	return nil
}
