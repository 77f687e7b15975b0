// Command simnode is a simulated Kubernetes node for the cluster tests: a
// test peer, not part of the product. It registers a Node, keeps its Lease,
// runs the real kubelet's device-plugin registration server and plugin
// client (k8s.io/kubernetes/pkg/kubelet/cm/devicemanager/plugin/v1beta1),
// allocates devices to the pods bound to it the way kubelet's device
// manager does (containers in order, GetPreferredAllocation then Allocate,
// devices of init containers reused by app containers), and runs each
// container as a process: in a mount namespace of its own over a root
// folder the test prepares (the "image"), with the pod's volumes, the
// device plugins' environment and mounts, and its own PID namespace unless
// the pod asks for the host's. It reports pod status to the API server and
// finishes deletions as kubelet does. It also runs kubelet's DRA manager
// and plugin registry (dra.go): ResourceClaims are prepared through their
// drivers and the CDI specs they write are applied to the containers.
//
// Host paths (hostPath volumes, the paths device plugins answer with, the
// device-plugin folder) are taken relative to --host-root: every node has
// its own, as every real node has its own disk.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
)

// listFlag is a flag that may be given many times.
type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

type config struct {
	name        string
	kubeconfig  string
	address     string
	hostRoot    string
	rootfs      string
	workdir     string
	apiHost     string
	apiPort     string
	cpu         string
	memory      string
	maxPods     int
	labels      listFlag
	mounts      listFlag
	runtimeEnv  listFlag
	visibility  string
	statusEvery int
}

func main() {
	// The container runtime re-executes this binary to set up a
	// container before its program replaces it.
	if len(os.Args) > 1 && os.Args[1] == containerInitCommand {
		os.Exit(containerInit(os.Args[2:]))
	}
	var c config
	flags := flag.NewFlagSet("simnode", flag.ExitOnError)
	flags.Usage = func() {
		fmt.Fprintf(flags.Output(), "usage: simnode --name NODE --kubeconfig FILE --address IP --host-root DIR --rootfs DIR --workdir DIR [options]\n\n"+
			"A simulated node for vgpu's cluster tests (see the package comment).\n\n")
		flags.PrintDefaults()
	}
	flags.StringVar(&c.name, "name", "", "the Node's name")
	flags.StringVar(&c.kubeconfig, "kubeconfig", "", "kubeconfig the node acts with")
	flags.StringVar(&c.address, "address", "", "the node's InternalIP; also every pod's IP (pods share the node's network)")
	flags.StringVar(&c.hostRoot, "host-root", "", "folder that stands for this node's / in host paths")
	flags.StringVar(&c.rootfs, "rootfs", "", "folder every container's root is made from")
	flags.StringVar(&c.workdir, "workdir", "", "folder for pods' volumes, specs and logs")
	flags.StringVar(&c.apiHost, "api-host", "", "KUBERNETES_SERVICE_HOST given to containers (there is no service proxy)")
	flags.StringVar(&c.apiPort, "api-port", "", "KUBERNETES_SERVICE_PORT given to containers")
	flags.StringVar(&c.cpu, "cpu", "32", "the node's cpu capacity")
	flags.StringVar(&c.memory, "memory", "128Gi", "the node's memory capacity")
	flags.IntVar(&c.maxPods, "max-pods", 110, "the node's pods capacity")
	flags.IntVar(&c.statusEvery, "status-seconds", 60, "seconds between node status reports when nothing changed")
	flags.Var(&c.labels, "label", "KEY=VALUE label of the Node (repeatable)")
	flags.Var(&c.mounts, "mount", "the image: bind:SRC:DST[:ro] or tmpfs:DST, applied in order inside --rootfs for every container (repeatable)")
	flags.Var(&c.runtimeEnv, "runtime-env", "KEY=VALUE given to every container, as a GPU container runtime injects its driver (repeatable)")
	flags.StringVar(&c.visibility, "gpu-visibility-env", "", "variable set in every container to its NVIDIA_VISIBLE_DEVICES (\"none\" without one): "+
		"how the simulated driver learns which GPUs the container may see, as the NVIDIA runtime exposes only those")
	klog.InitFlags(flags)
	_ = flags.Parse(os.Args[1:])
	if err := run(&c); err != nil {
		klog.ErrorS(err, "simnode failed")
		os.Exit(1)
	}
}

func (c *config) validate() error {
	for name, value := range map[string]string{
		"--name": c.name, "--kubeconfig": c.kubeconfig, "--address": c.address,
		"--host-root": c.hostRoot, "--rootfs": c.rootfs, "--workdir": c.workdir,
	} {
		if value == "" {
			return fmt.Errorf("%s is required", name)
		}
	}
	for _, dir := range []*string{&c.hostRoot, &c.rootfs, &c.workdir} {
		abs, err := filepath.Abs(*dir)
		if err != nil {
			return err
		}
		*dir = abs
	}
	if _, err := parseMounts(c.mounts); err != nil {
		return err
	}
	for _, kv := range append(append([]string{}, c.labels...), c.runtimeEnv...) {
		if !strings.Contains(kv, "=") {
			return fmt.Errorf("%q is not KEY=VALUE", kv)
		}
	}
	return nil
}

func run(c *config) error {
	if err := c.validate(); err != nil {
		return err
	}
	restConfig, err := clientcmd.BuildConfigFromFlags("", c.kubeconfig)
	if err != nil {
		return fmt.Errorf("kubeconfig %s: %w", c.kubeconfig, err)
	}
	restConfig.QPS = 50
	restConfig.Burst = 100
	client, err := kubernetes.NewForConfig(restConfig)
	if err != nil {
		return err
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer cancel()
	logger := klog.FromContext(ctx).WithValues("node", c.name)
	ctx = klog.NewContext(ctx, logger)

	node := newNodeStatus(c, client)
	// A test holds Allocate calls by creating this folder.
	devices := newDeviceManager(node.devicesChanged, filepath.Join(c.workdir, "hold-allocate"))
	socketDir := filepath.Join(c.hostRoot, "var/lib/kubelet/device-plugins")
	registration, err := startRegistration(logger, socketDir, devices)
	if err != nil {
		return err
	}
	defer func() { _ = registration.Stop(logger) }()
	node.devices = devices
	if err := node.register(ctx); err != nil {
		return err
	}
	go node.run(ctx)
	draNode, err := startDRA(ctx, c, client)
	if err != nil {
		return err
	}
	pods := newPodManager(c, client, devices, draNode)
	if err := servePodResources(ctx, c.hostRoot, pods, devices); err != nil {
		return err
	}
	logger.Info("node up", "address", c.address, "deviceSockets", socketDir)
	pods.run(ctx)
	logger.Info("stopping: containers stay as they are, as when a kubelet stops")
	return nil
}
