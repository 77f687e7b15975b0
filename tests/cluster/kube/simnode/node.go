package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
)

const leaseSeconds = 40

// nodeStatus owns the Node object and the node's Lease.
type nodeStatus struct {
	config  *config
	client  kubernetes.Interface
	devices *deviceManager
	changed chan struct{}
}

func newNodeStatus(c *config, client kubernetes.Interface) *nodeStatus {
	return &nodeStatus{config: c, client: client, changed: make(chan struct{}, 1)}
}

// devicesChanged asks for a status report soon (device counts changed).
func (n *nodeStatus) devicesChanged() {
	select {
	case n.changed <- struct{}{}:
	default:
	}
}

func (n *nodeStatus) labels() map[string]string {
	labels := map[string]string{
		v1.LabelHostname:   n.config.name,
		v1.LabelOSStable:   "linux",
		v1.LabelArchStable: "amd64",
	}
	for _, kv := range n.config.labels {
		key, value, _ := strings.Cut(kv, "=")
		labels[key] = value
	}
	return labels
}

// register creates the Node (or takes over an existing one, as a
// restarted kubelet does) with its current status.
func (n *nodeStatus) register(ctx context.Context) error {
	node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: n.config.name, Labels: n.labels()}}
	_, err := n.client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("creating Node %s: %w", n.config.name, err)
	}
	if err := n.report(ctx); err != nil {
		return err
	}
	return n.renewLease(ctx)
}

func (n *nodeStatus) run(ctx context.Context) {
	logger := klog.FromContext(ctx)
	leaseTicker := time.NewTicker(leaseSeconds / 4 * time.Second)
	statusTicker := time.NewTicker(time.Duration(n.config.statusEvery) * time.Second)
	defer leaseTicker.Stop()
	defer statusTicker.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-leaseTicker.C:
			if err := n.renewLease(ctx); err != nil {
				logger.Error(err, "renewing the node lease")
			}
		case <-n.changed:
			if err := n.report(ctx); err != nil {
				logger.Error(err, "reporting node status")
				n.devicesChanged() // again later
				time.Sleep(time.Second)
			}
		case <-statusTicker.C:
			if err := n.report(ctx); err != nil {
				logger.Error(err, "reporting node status")
			}
		}
	}
}

// report writes the node's status: addresses, capacity (the device
// plugins' devices included, allocatable counting only healthy ones) and
// the Ready condition.
func (n *nodeStatus) report(ctx context.Context) error {
	capacity := v1.ResourceList{
		v1.ResourceCPU:    resource.MustParse(n.config.cpu),
		v1.ResourceMemory: resource.MustParse(n.config.memory),
		v1.ResourcePods:   *resource.NewQuantity(int64(n.config.maxPods), resource.DecimalSI),
	}
	allocatable := capacity.DeepCopy()
	for name, count := range n.devices.counts() {
		capacity[v1.ResourceName(name)] = *resource.NewQuantity(int64(count.total), resource.DecimalSI)
		allocatable[v1.ResourceName(name)] = *resource.NewQuantity(int64(count.healthy), resource.DecimalSI)
	}
	now := metav1.Now()
	return retry.RetryOnConflict(retry.DefaultBackoff, func() error {
		node, err := n.client.CoreV1().Nodes().Get(ctx, n.config.name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		// Resources this node's device plugins do not offer (extended
		// resources someone else advertised by patching the status) are
		// kept as written, allocatable equal to capacity, as kubelet keeps
		// what it does not manage. (A plugin that went away is still in
		// the device counts, at zero healthy.)
		for name, quantity := range node.Status.Capacity {
			if _, ok := capacity[name]; !ok {
				capacity[name] = quantity
				allocatable[name] = quantity
			}
		}
		node.Status.Capacity = capacity
		node.Status.Allocatable = allocatable
		node.Status.Addresses = []v1.NodeAddress{
			{Type: v1.NodeInternalIP, Address: n.config.address},
			{Type: v1.NodeHostName, Address: n.config.name},
		}
		node.Status.NodeInfo = v1.NodeSystemInfo{
			KubeletVersion:          "v1.36.3",
			OperatingSystem:         "linux",
			Architecture:            "amd64",
			ContainerRuntimeVersion: "simnode://1",
		}
		ready := v1.NodeCondition{
			Type: v1.NodeReady, Status: v1.ConditionTrue, Reason: "KubeletReady",
			Message: "simulated node is posting ready status", LastHeartbeatTime: now, LastTransitionTime: now,
		}
		kept := node.Status.Conditions[:0]
		for _, condition := range node.Status.Conditions {
			if condition.Type == v1.NodeReady {
				if condition.Status == v1.ConditionTrue {
					ready.LastTransitionTime = condition.LastTransitionTime
				}
				continue
			}
			kept = append(kept, condition)
		}
		node.Status.Conditions = append(kept, ready)
		_, err = n.client.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{})
		return err
	})
}

func (n *nodeStatus) renewLease(ctx context.Context) error {
	leases := n.client.CoordinationV1().Leases(v1.NamespaceNodeLease)
	now := metav1.NewMicroTime(time.Now())
	lease, err := leases.Get(ctx, n.config.name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		_, err = leases.Create(ctx, &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{Name: n.config.name, Namespace: v1.NamespaceNodeLease},
			Spec: coordinationv1.LeaseSpec{
				HolderIdentity: ptr.To(n.config.name), LeaseDurationSeconds: ptr.To(int32(leaseSeconds)),
				RenewTime: &now,
			},
		}, metav1.CreateOptions{})
		return err
	}
	if err != nil {
		return err
	}
	lease.Spec.HolderIdentity = ptr.To(n.config.name)
	lease.Spec.LeaseDurationSeconds = ptr.To(int32(leaseSeconds))
	lease.Spec.RenewTime = &now
	_, err = leases.Update(ctx, lease, metav1.UpdateOptions{})
	return err
}
