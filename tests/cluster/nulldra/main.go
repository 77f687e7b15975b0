// nulldra: a DRA driver that prepares nothing, for the pods-per-second
// bench. It publishes a node's GPUs the way vgpu's driver does (shareable,
// with memory and cores as consumable capacity) under its own driver name
// and answers every prepare at once with no CDI device, so a pod that
// claims one of its devices costs only what the control plane and kubelet
// spend on DRA. Test peer only: built from Kubernetes' published modules.
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
)

type nullDriver struct{}

// PrepareResourceClaims answers for every device allocated to a claim,
// preparing nothing.
func (nullDriver) PrepareResourceClaims(_ context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	result := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, claim := range claims {
		var devices []kubeletplugin.Device
		if claim.Status.Allocation != nil {
			for _, allocated := range claim.Status.Allocation.Devices.Results {
				devices = append(devices, kubeletplugin.Device{
					Requests:   []string{allocated.Request},
					PoolName:   allocated.Pool,
					DeviceName: allocated.Device,
					ShareID:    allocated.ShareID,
				})
			}
		}
		result[claim.UID] = kubeletplugin.PrepareResult{Devices: devices}
	}
	return result, nil
}

// UnprepareResourceClaims has nothing to undo.
func (nullDriver) UnprepareResourceClaims(_ context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	result := make(map[types.UID]error, len(claims))
	for _, claim := range claims {
		result[claim.UID] = nil
	}
	return result, nil
}

func (nullDriver) HandleError(ctx context.Context, err error, msg string) {
	klog.FromContext(ctx).Error(err, msg)
}

// gpu is one device as vgpu's driver publishes it: shared by amount.
func gpu(index int, memory int64) resourceapi.Device {
	step := resource.NewQuantity(1<<20, resource.BinarySI)
	return resourceapi.Device{
		Name:                     fmt.Sprintf("gpu-%d", index),
		AllowMultipleAllocations: ptr.To(true),
		Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			"index": {IntValue: ptr.To(int64(index))},
		},
		Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
			"memory": {
				Value: *resource.NewQuantity(memory, resource.BinarySI),
				RequestPolicy: &resourceapi.CapacityRequestPolicy{
					Default:    resource.NewQuantity(memory, resource.BinarySI),
					ValidRange: &resourceapi.CapacityRequestPolicyRange{Min: step, Step: step},
				},
			},
			"cores": {
				Value: *resource.NewQuantity(100, resource.DecimalSI),
				RequestPolicy: &resourceapi.CapacityRequestPolicy{
					Default: resource.NewQuantity(0, resource.DecimalSI),
					ValidRange: &resourceapi.CapacityRequestPolicyRange{
						Min:  resource.NewQuantity(0, resource.DecimalSI),
						Max:  resource.NewQuantity(100, resource.DecimalSI),
						Step: resource.NewQuantity(1, resource.DecimalSI),
					},
				},
			},
		},
	}
}

func main() {
	driver := flag.String("driver-name", "null.vgpu.test", "the DRA driver name it registers and publishes under")
	node := flag.String("node-name", "", "the node it serves (required)")
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig to reach the API server (required)")
	registry := flag.String("registry-dir", "", "kubelet's plugin registration directory (required)")
	data := flag.String("plugin-dir", "", "this plugin's socket directory as kubelet names it (required)")
	hostRoot := flag.String("host-root", "/", "where kubelet's paths are on this machine (a simulated node's root)")
	gpus := flag.Int("gpus", 2, "devices published")
	memory := flag.Int64("memory-bytes", 16<<30, "memory capacity of each device, bytes")
	klog.InitFlags(nil)
	flag.Parse()
	if *node == "" || *kubeconfig == "" || *registry == "" || *data == "" {
		fmt.Fprintln(os.Stderr, "nulldra: --node-name, --kubeconfig, --registry-dir and --plugin-dir are required")
		os.Exit(2)
	}
	if err := run(*driver, *node, *kubeconfig, *registry, *data, *hostRoot, *gpus, *memory); err != nil {
		fmt.Fprintf(os.Stderr, "nulldra: %v\n", err)
		os.Exit(1)
	}
}

func run(driver, node, kubeconfig, registry, data, hostRoot string, gpus int, memory int64) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	config, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return fmt.Errorf("kubeconfig %s: %w", kubeconfig, err)
	}
	// As many writes as the bench's bursts need, not client-go's 5 a second.
	config.QPS, config.Burst = 200, 400
	client, err := kubernetes.NewForConfig(config)
	if err != nil {
		return fmt.Errorf("client: %w", err)
	}
	if err := os.MkdirAll(filepath.Join(hostRoot, data), 0o750); err != nil {
		return fmt.Errorf("plugin directory: %w", err)
	}
	// The socket is named to kubelet by its path under the node's root,
	// and made where that is here.
	listen := func(ctx context.Context, path string) (net.Listener, error) {
		here := filepath.Join(hostRoot, path)
		if err := os.Remove(here); err != nil && !os.IsNotExist(err) {
			return nil, err
		}
		var config net.ListenConfig
		return config.Listen(ctx, "unix", here)
	}
	helper, err := kubeletplugin.Start(ctx, nullDriver{},
		kubeletplugin.DriverName(driver),
		kubeletplugin.NodeName(node),
		kubeletplugin.KubeClient(client),
		kubeletplugin.RegistrarDirectoryPath(registry),
		kubeletplugin.PluginDataDirectoryPath(data),
		kubeletplugin.PluginListener(listen),
	)
	if err != nil {
		return fmt.Errorf("starting the plugin: %w", err)
	}
	defer helper.Stop()
	devices := make([]resourceapi.Device, 0, gpus)
	for index := 0; index < gpus; index++ {
		devices = append(devices, gpu(index, memory))
	}
	resources := resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{
		node: {Slices: []resourceslice.Slice{{Devices: devices}}},
	}}
	if err := helper.PublishResources(ctx, resources); err != nil {
		return fmt.Errorf("publishing the slice: %w", err)
	}
	fmt.Printf("nulldra serving %s on %s with %d device(s)\n", driver, node, gpus)
	<-ctx.Done()
	return nil
}
