package main

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/retry"
	"k8s.io/klog/v2"
	podutil "k8s.io/kubernetes/pkg/util/pod"
	"k8s.io/utils/ptr"
)

// The longest a deleted pod's containers get to stop before SIGKILL: the
// tests do not wait out a 30-second default.
const maxGrace = 5 * time.Second

const maxBackoff = 10 * time.Second

// podManager runs the pods bound to this node.
type podManager struct {
	config  *config
	client  kubernetes.Interface
	devices *deviceManager
	dra     *draNode

	mu      sync.Mutex
	workers map[types.UID]*podWorker
	queue   []*v1.Pod // waiting for admission, in arrival order
	wake    chan struct{}
}

func newPodManager(c *config, client kubernetes.Interface, devices *deviceManager, dra *draNode) *podManager {
	return &podManager{config: c, client: client, devices: devices, dra: dra,
		workers: map[types.UID]*podWorker{}, wake: make(chan struct{}, 1)}
}

func (m *podManager) run(ctx context.Context) {
	logger := klog.FromContext(ctx)
	factory := informers.NewSharedInformerFactoryWithOptions(m.client, 0,
		informers.WithTweakListOptions(func(options *metav1.ListOptions) {
			options.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", m.config.name).String()
		}))
	informer := factory.Core().V1().Pods().Informer()
	_, err := informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { m.seen(ctx, obj.(*v1.Pod)) },
		UpdateFunc: func(_, obj any) { m.seen(ctx, obj.(*v1.Pod)) },
		DeleteFunc: func(obj any) {
			if tombstone, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = tombstone.Obj
			}
			if pod, ok := obj.(*v1.Pod); ok {
				m.gone(pod)
			}
		},
	})
	if err != nil {
		logger.Error(err, "watching pods")
		return
	}
	factory.Start(ctx.Done())
	go m.admitLoop(ctx)
	<-ctx.Done()
	m.mu.Lock()
	workers := make([]*podWorker, 0, len(m.workers))
	for _, worker := range m.workers {
		workers = append(workers, worker)
	}
	m.mu.Unlock()
	for _, worker := range workers {
		worker.kill(0)
	}
}

// seen handles a pod's new version.
func (m *podManager) seen(ctx context.Context, pod *v1.Pod) {
	m.mu.Lock()
	worker := m.workers[pod.UID]
	if worker == nil {
		if pod.DeletionTimestamp != nil || pod.Status.Phase == v1.PodSucceeded || pod.Status.Phase == v1.PodFailed {
			m.mu.Unlock()
			if pod.DeletionTimestamp != nil {
				// Nothing runs for it here: finish the deletion.
				go finishDeletion(ctx, m.client, pod)
			}
			return
		}
		worker = newPodWorker(m, pod)
		m.workers[pod.UID] = worker
		m.queue = append(m.queue, pod)
		m.mu.Unlock()
		select {
		case m.wake <- struct{}{}:
		default:
		}
		return
	}
	m.mu.Unlock()
	worker.update(ctx, pod)
}

func (m *podManager) gone(pod *v1.Pod) {
	m.mu.Lock()
	worker := m.workers[pod.UID]
	m.mu.Unlock()
	if worker != nil {
		go worker.kill(0)
	}
}

func (m *podManager) forget(uid types.UID) {
	m.mu.Lock()
	var pod *v1.Pod
	if worker := m.workers[uid]; worker != nil {
		worker.mu.Lock()
		pod = worker.pod
		worker.mu.Unlock()
	}
	delete(m.workers, uid)
	m.mu.Unlock()
	m.devices.release(uid)
	// Kubelet releases a pod's claims once its containers are gone.
	m.dra.unprepare(context.Background(), pod)
}

// admitLoop admits pods one at a time, in arrival order, as kubelet's
// pod admission does: device allocation for every container, then start.
func (m *podManager) admitLoop(ctx context.Context) {
	for {
		m.mu.Lock()
		var pod *v1.Pod
		if len(m.queue) > 0 {
			pod = m.queue[0]
			m.queue = m.queue[1:]
		}
		worker := m.workers[podUID(pod)]
		m.mu.Unlock()
		if pod == nil {
			select {
			case <-ctx.Done():
				return
			case <-m.wake:
			}
			continue
		}
		if worker == nil || worker.stopping() {
			continue
		}
		worker.admit(ctx)
	}
}

func podUID(pod *v1.Pod) types.UID {
	if pod == nil {
		return ""
	}
	return pod.UID
}

func finishDeletion(ctx context.Context, client kubernetes.Interface, pod *v1.Pod) {
	err := client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{
		GracePeriodSeconds: ptr.To(int64(0)), Preconditions: &metav1.Preconditions{UID: &pod.UID},
	})
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		klog.FromContext(ctx).Error(err, "finishing a pod's deletion", "pod", klog.KObj(pod))
	}
}

// containerState is what the node knows of one container.
type containerState struct {
	spec      v1.Container
	isInit    bool
	process   *exec.Cmd
	exited    chan struct{} // closed when process has been reaped
	started   *metav1.Time
	ready     bool
	restarts  int32
	last      *v1.ContainerStateTerminated // the last run's end
	waiting   string                       // reason while not running
	message   string
	exitCode  int32
	done      bool // finished for good (no restart)
	probeStop chan struct{}
}

// podWorker runs one pod.
type podWorker struct {
	manager *podManager
	uid     types.UID

	mu         sync.Mutex
	pod        *v1.Pod
	containers []*containerState
	phase      v1.PodPhase
	reason     string
	message    string
	startTime  *metav1.Time
	terminate  bool
	grace      time.Duration
	stopped    chan struct{} // closed when every process is gone after terminate
	sync       chan struct{}
	wakeup     chan struct{} // interrupts back-off waits
	dir        string
	// admitting: admission has begun. Kubelet takes a pod into its pod
	// manager (which its PodResources API lists) just before admitting
	// it, one pod at a time; pods it has not reached are not listed.
	admitting bool
}

func newPodWorker(m *podManager, pod *v1.Pod) *podWorker {
	w := &podWorker{manager: m, uid: pod.UID, pod: pod, phase: v1.PodPending,
		stopped: make(chan struct{}), sync: make(chan struct{}, 1), wakeup: make(chan struct{}),
		dir: filepath.Join(m.config.workdir, "pods", fmt.Sprintf("%s_%s_%s", pod.Namespace, pod.Name, pod.UID))}
	for _, c := range pod.Spec.InitContainers {
		w.containers = append(w.containers, &containerState{spec: c, isInit: true, waiting: "PodInitializing"})
	}
	for _, c := range pod.Spec.Containers {
		reason := "ContainerCreating"
		if len(pod.Spec.InitContainers) > 0 {
			reason = "PodInitializing"
		}
		w.containers = append(w.containers, &containerState{spec: c, waiting: reason})
	}
	return w
}

func (w *podWorker) stopping() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.terminate
}

func (w *podWorker) update(ctx context.Context, pod *v1.Pod) {
	w.mu.Lock()
	w.pod = pod
	deleting := pod.DeletionTimestamp != nil
	w.mu.Unlock()
	if deleting {
		grace := maxGrace
		if pod.DeletionGracePeriodSeconds != nil && time.Duration(*pod.DeletionGracePeriodSeconds)*time.Second < grace {
			grace = time.Duration(*pod.DeletionGracePeriodSeconds) * time.Second
		}
		go func() {
			w.kill(grace)
			finishDeletion(ctx, w.manager.client, pod)
		}()
	}
}

// kill stops every container (SIGTERM, then SIGKILL after `grace`) and
// frees the pod's devices; it returns when all its processes are gone.
func (w *podWorker) kill(grace time.Duration) {
	w.mu.Lock()
	first := !w.terminate
	w.terminate = true
	w.grace = grace
	type running struct {
		process *exec.Cmd
		exited  chan struct{}
	}
	var processes []running
	for _, c := range w.containers {
		if c.process != nil {
			processes = append(processes, running{c.process, c.exited})
		}
	}
	if first {
		close(w.wakeup)
	}
	w.mu.Unlock()
	for _, r := range processes {
		_ = syscall.Kill(-r.process.Process.Pid, syscall.SIGTERM)
	}
	deadline := time.After(grace)
	for _, r := range processes {
		select {
		case <-r.exited:
		case <-deadline:
			_ = syscall.Kill(-r.process.Process.Pid, syscall.SIGKILL)
		}
	}
	for _, r := range processes {
		_ = syscall.Kill(-r.process.Process.Pid, syscall.SIGKILL)
		<-r.exited
	}
	if first {
		w.manager.forget(w.uid)
		close(w.stopped)
	} else {
		<-w.stopped
	}
}

// waitProcess reaps `process`, closes `exited` and answers its exit code
// (128 + signal for a signalled one, as runtimes report it).
func waitProcess(process *exec.Cmd, exited chan struct{}) int32 {
	err := process.Wait()
	close(exited)
	if err == nil {
		return 0
	}
	if exit, ok := err.(*exec.ExitError); ok {
		if status, ok := exit.Sys().(syscall.WaitStatus); ok && status.Signaled() {
			return 128 + int32(status.Signal())
		}
		return int32(exit.ExitCode())
	}
	return 128
}

// admit allocates the pod's devices; a pod whose allocation fails is
// Failed with UnexpectedAdmissionError, as kubelet does.
func (w *podWorker) admit(ctx context.Context) {
	logger := klog.FromContext(ctx)
	w.mu.Lock()
	pod := w.pod
	w.startTime = ptr.To(metav1.Now())
	w.admitting = true
	w.mu.Unlock()
	go w.statusLoop(ctx)
	if err := w.manager.devices.allocatePod(ctx, pod); err != nil {
		logger.Info("pod refused at admission", "pod", klog.KObj(pod), "err", err.Error())
		w.mu.Lock()
		w.phase = v1.PodFailed
		w.reason = "UnexpectedAdmissionError"
		w.message = fmt.Sprintf("Allocate failed due to %v, which is unexpected", err)
		for _, c := range w.containers {
			c.done = true
			c.waiting = ""
			c.last = &v1.ContainerStateTerminated{ExitCode: 137, Reason: "ContainerStatusUnknown",
				Message: "the pod was refused at admission"}
		}
		w.mu.Unlock()
		w.requestSync()
		w.manager.forget(w.uid)
		return
	}
	w.requestSync()
	go w.runPod(ctx)
}

func (w *podWorker) runPod(ctx context.Context) {
	logger := klog.FromContext(ctx).WithValues("pod", klog.KObj(w.pod))
	ctx = klog.NewContext(ctx, logger)
	if err := os.MkdirAll(w.dir, 0o755); err != nil {
		logger.Error(err, "pod folder")
		return
	}
	var volumes map[string]string
	for attempt := 0; ; attempt++ {
		var err error
		volumes, err = volumeSources(ctx, w.manager.client, w.manager.config, w.pod, w.dir)
		if err == nil {
			break
		}
		w.setWaiting("CreateContainerConfigError", err.Error())
		if !w.sleep(backoff(attempt)) {
			return
		}
	}
	// The pod's ResourceClaims, through their drivers, before any
	// container starts; retried as kubelet retries its pod syncs.
	for attempt := 0; ; attempt++ {
		err := w.manager.dra.prepare(ctx, w.pod)
		if err == nil {
			break
		}
		logger.Info("preparing the pod's claims", "err", err.Error())
		w.setWaiting("ContainerCreating", "prepare dynamic resources: "+err.Error())
		if !w.sleep(backoff(attempt)) {
			return
		}
	}
	for _, c := range w.containers {
		if !c.isInit {
			continue
		}
		if ptr.Deref(c.spec.RestartPolicy, "") == v1.ContainerRestartPolicyAlways {
			// A sidecar: runs beside the others.
			go w.supervise(ctx, c, volumes)
			continue
		}
		if !w.supervise(ctx, c, volumes) {
			return
		}
	}
	var wg sync.WaitGroup
	for _, c := range w.containers {
		if c.isInit {
			continue
		}
		wg.Add(1)
		go func(c *containerState) {
			defer wg.Done()
			w.supervise(ctx, c, volumes)
		}(c)
	}
	wg.Wait()
	w.mu.Lock()
	deleting := w.terminate
	w.mu.Unlock()
	if !deleting {
		// Every container ended for good: the pod is terminal and gives
		// its devices back.
		w.requestSync()
		w.manager.forget(w.uid)
	}
}

func backoff(attempt int) time.Duration {
	delay := time.Second << min(attempt, 4)
	return min(delay, maxBackoff)
}

// sleep waits `d` unless the pod is being stopped; false if it is.
func (w *podWorker) sleep(d time.Duration) bool {
	select {
	case <-time.After(d):
		return !w.stopping()
	case <-w.wakeup:
		return false
	}
}

func (w *podWorker) setWaiting(reason, message string) {
	w.mu.Lock()
	for _, c := range w.containers {
		if c.process == nil && !c.done {
			c.waiting, c.message = reason, message
		}
	}
	w.mu.Unlock()
	w.requestSync()
}

// supervise runs container `c`, restarting it as the pod's restart policy
// says; it returns whether the container ended successfully (init
// containers) or when it will not run again.
func (w *podWorker) supervise(ctx context.Context, c *containerState, volumes map[string]string) bool {
	logger := klog.FromContext(ctx)
	policy := w.pod.Spec.RestartPolicy
	if c.isInit && policy == v1.RestartPolicyAlways {
		policy = v1.RestartPolicyOnFailure // init containers are retried only on failure
	}
	if ptr.Deref(c.spec.RestartPolicy, "") == v1.ContainerRestartPolicyAlways {
		policy = v1.RestartPolicyAlways
	}
	for attempt := 0; ; attempt++ {
		exit, err := w.runContainer(ctx, c, volumes)
		if err != nil {
			logger.Info("container did not start", "container", c.spec.Name, "err", err.Error())
			w.mu.Lock()
			c.waiting, c.message = "CreateContainerError", err.Error()
			w.mu.Unlock()
			w.requestSync()
			if !w.sleep(backoff(attempt)) {
				return false
			}
			continue
		}
		if w.stopping() {
			return false
		}
		restart := policy == v1.RestartPolicyAlways || (policy == v1.RestartPolicyOnFailure && exit != 0)
		if !restart {
			w.mu.Lock()
			c.done = true
			w.mu.Unlock()
			w.requestSync()
			if exit != 0 && c.isInit {
				w.mu.Lock()
				w.phase = v1.PodFailed
				for _, other := range w.containers {
					other.done = true
				}
				w.mu.Unlock()
				w.requestSync()
			}
			return exit == 0
		}
		if exit == 0 && c.isInit {
			w.mu.Lock()
			c.done = true
			w.mu.Unlock()
			return true
		}
		w.mu.Lock()
		c.restarts++
		c.waiting = "CrashLoopBackOff"
		c.message = fmt.Sprintf("back-off restarting failed container %s", c.spec.Name)
		w.mu.Unlock()
		w.requestSync()
		if !w.sleep(backoff(attempt)) {
			return false
		}
	}
}

// runContainer starts the container and waits until it exits.
func (w *podWorker) runContainer(ctx context.Context, c *containerState, volumes map[string]string) (int32, error) {
	w.mu.Lock()
	pod := w.pod
	w.mu.Unlock()
	given := w.manager.devices.given(pod.UID, c.spec.Name)
	if given != nil {
		if err := w.manager.devices.preStart(ctx, given); err != nil {
			return 0, err
		}
	}
	spec, err := w.containerSpec(ctx, pod, c, volumes, given)
	if err != nil {
		return 0, err
	}
	log, err := os.OpenFile(filepath.Join(w.dir, c.spec.Name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return 0, err
	}
	defer log.Close()
	w.mu.Lock()
	if w.terminate {
		w.mu.Unlock()
		return 0, fmt.Errorf("the pod is stopping")
	}
	process, err := startContainer(spec, filepath.Join(w.dir, c.spec.Name+".json"), log, pod.Spec.HostPID)
	if err != nil {
		w.mu.Unlock()
		return 0, err
	}
	c.process = process
	c.exited = make(chan struct{})
	exited := c.exited
	c.started = ptr.To(metav1.Now())
	c.waiting, c.message = "", ""
	c.ready = c.spec.ReadinessProbe == nil && c.spec.StartupProbe == nil
	c.probeStop = make(chan struct{})
	if !c.ready {
		go w.probe(ctx, c, c.probeStop)
	}
	w.mu.Unlock()
	w.requestSync()
	exit := waitProcess(process, exited)
	w.mu.Lock()
	close(c.probeStop)
	reason := "Completed"
	if exit != 0 {
		reason = "Error"
	}
	c.last = &v1.ContainerStateTerminated{ExitCode: exit, Reason: reason, StartedAt: *c.started,
		FinishedAt: metav1.Now(), ContainerID: fmt.Sprintf("simnode://%d", process.Process.Pid)}
	c.process = nil
	c.ready = false
	w.mu.Unlock()
	w.requestSync()
	return exit, nil
}

var variableReference = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)`)

func expand(text string, values map[string]string) string {
	return variableReference.ReplaceAllStringFunc(text, func(ref string) string {
		if value, ok := values[ref[2:len(ref)-1]]; ok {
			return value
		}
		return ref
	})
}

// containerSpec: the container's root, mounts, environment and program.
func (w *podWorker) containerSpec(ctx context.Context, pod *v1.Pod, c *containerState, volumes map[string]string,
	given *containerDevices) (*containerSpec, error) {
	cfg := w.manager.config
	env := newEnvironment()
	env.set("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
	env.set("HOSTNAME", pod.Name)
	if cfg.apiHost != "" {
		env.set("KUBERNETES_SERVICE_HOST", cfg.apiHost)
		env.set("KUBERNETES_SERVICE_PORT", cfg.apiPort)
	}
	for _, kv := range cfg.runtimeEnv {
		key, value, _ := strings.Cut(kv, "=")
		env.set(key, value)
	}
	if given != nil {
		for _, key := range given.envOrder {
			env.set(key, given.envs[key])
		}
	}
	claimEnv, claimMounts, err := w.manager.dra.containerEdits(pod, &c.spec)
	if err != nil {
		return nil, fmt.Errorf("CDI devices of the container's claims: %w", err)
	}
	for _, kv := range claimEnv {
		key, value, _ := strings.Cut(kv, "=")
		env.set(key, value)
	}
	for _, from := range c.spec.EnvFrom {
		var data map[string][]byte
		var err error
		switch {
		case from.ConfigMapRef != nil:
			data, err = configMapFiles(ctx, w.manager.client, pod.Namespace, from.ConfigMapRef.Name, nil,
				ptr.Deref(from.ConfigMapRef.Optional, false))
		case from.SecretRef != nil:
			data, err = secretFiles(ctx, w.manager.client, pod.Namespace, from.SecretRef.Name, nil,
				ptr.Deref(from.SecretRef.Optional, false))
		}
		if err != nil {
			return nil, err
		}
		for key, value := range data {
			env.set(from.Prefix+key, string(value))
		}
	}
	for _, variable := range c.spec.Env {
		value, err := w.envValue(ctx, pod, &variable, env.values)
		if err != nil {
			return nil, fmt.Errorf("env %s: %w", variable.Name, err)
		}
		env.set(variable.Name, value)
	}
	if cfg.visibility != "" {
		visible, ok := env.values["NVIDIA_VISIBLE_DEVICES"]
		if !ok {
			visible = "none"
		}
		env.set(cfg.visibility, visible)
	}
	var argv []string
	for _, arg := range append(append([]string{}, c.spec.Command...), c.spec.Args...) {
		argv = append(argv, expand(arg, env.values))
	}
	if len(c.spec.Command) == 0 {
		return nil, fmt.Errorf("no command: simulated images (%s) have no entrypoint", c.spec.Image)
	}

	image, err := parseMounts(cfg.mounts)
	if err != nil {
		return nil, err
	}
	mounts := []imageMount{
		{Kind: "rbind", Source: "/dev", Target: "/dev"},
		{Kind: "rbind", Source: "/sys", Target: "/sys", ReadOnly: true},
	}
	if pod.Spec.HostPID {
		mounts = append(mounts, imageMount{Kind: "rbind", Source: "/proc", Target: "/proc"})
	}
	mounts = append(mounts, image...)
	for _, mount := range c.spec.VolumeMounts {
		source, ok := volumes[mount.Name]
		if !ok {
			return nil, fmt.Errorf("volume mount %s names no volume", mount.Name)
		}
		if mount.SubPath != "" {
			source = filepath.Join(source, mount.SubPath)
		}
		mounts = append(mounts, imageMount{Kind: "bind", Source: source, Target: mount.MountPath, ReadOnly: mount.ReadOnly})
	}
	if given != nil {
		for _, mount := range given.mounts {
			mounts = append(mounts, imageMount{Kind: "bind", Source: hostSource(cfg.hostRoot, mount.HostPath),
				Target: mount.ContainerPath, ReadOnly: mount.ReadOnly})
		}
		for _, device := range given.devices {
			source := filepath.Join(cfg.hostRoot, device.HostPath)
			if _, err := os.Stat(source); err == nil {
				mounts = append(mounts, imageMount{Kind: "bind", Source: source, Target: device.ContainerPath})
			}
		}
	}
	mounts = append(mounts, claimMounts...)
	hostname := pod.Name
	if pod.Spec.HostNetwork {
		hostname = cfg.name
	}
	spec := &containerSpec{Rootfs: cfg.rootfs, Mounts: mounts, OwnProc: !pod.Spec.HostPID, Hostname: hostname,
		WorkingDir: c.spec.WorkingDir, Argv: argv, Env: env.list()}
	var uid, gid *int64
	if pod.Spec.SecurityContext != nil {
		uid, gid = pod.Spec.SecurityContext.RunAsUser, pod.Spec.SecurityContext.RunAsGroup
	}
	if c.spec.SecurityContext != nil {
		if c.spec.SecurityContext.RunAsUser != nil {
			uid = c.spec.SecurityContext.RunAsUser
		}
		if c.spec.SecurityContext.RunAsGroup != nil {
			gid = c.spec.SecurityContext.RunAsGroup
		}
	}
	spec.UID, spec.GID = uid, gid
	return spec, nil
}

func (w *podWorker) envValue(ctx context.Context, pod *v1.Pod, variable *v1.EnvVar, values map[string]string) (string, error) {
	from := variable.ValueFrom
	switch {
	case from == nil:
		return expand(variable.Value, values), nil
	case from.FieldRef != nil:
		return fieldValue(pod, from.FieldRef.FieldPath, w.manager.config.address)
	case from.ResourceFieldRef != nil:
		name := from.ResourceFieldRef.Resource
		list := w.findContainer(from.ResourceFieldRef.ContainerName).Resources.Limits
		if kind, ok := strings.CutPrefix(name, "requests."); ok {
			list, name = w.findContainer(from.ResourceFieldRef.ContainerName).Resources.Requests, kind
		} else {
			name = strings.TrimPrefix(name, "limits.")
		}
		quantity := list[v1.ResourceName(name)]
		return strconv.FormatInt(quantity.Value(), 10), nil
	case from.ConfigMapKeyRef != nil:
		data, err := configMapFiles(ctx, w.manager.client, pod.Namespace, from.ConfigMapKeyRef.Name, nil,
			ptr.Deref(from.ConfigMapKeyRef.Optional, false))
		return string(data[from.ConfigMapKeyRef.Key]), err
	case from.SecretKeyRef != nil:
		data, err := secretFiles(ctx, w.manager.client, pod.Namespace, from.SecretKeyRef.Name, nil,
			ptr.Deref(from.SecretKeyRef.Optional, false))
		return string(data[from.SecretKeyRef.Key]), err
	}
	return "", fmt.Errorf("this kind of value is not simulated")
}

func (w *podWorker) findContainer(name string) *v1.Container {
	for _, c := range w.containers {
		if c.spec.Name == name {
			return &c.spec
		}
	}
	return &w.containers[0].spec
}

type environment struct {
	values map[string]string
	order  []string
}

func newEnvironment() *environment { return &environment{values: map[string]string{}} }

func (e *environment) set(key, value string) {
	if _, ok := e.values[key]; !ok {
		e.order = append(e.order, key)
	}
	e.values[key] = value
}

func (e *environment) list() []string {
	out := make([]string, 0, len(e.order))
	for _, key := range e.order {
		out = append(out, key+"="+e.values[key])
	}
	return out
}

// probe runs the container's readiness (or startup) probe until it passes
// once; later failures are not simulated.
func (w *podWorker) probe(ctx context.Context, c *containerState, stop chan struct{}) {
	probe := c.spec.ReadinessProbe
	if probe == nil {
		probe = c.spec.StartupProbe
	}
	period := time.Duration(max(probe.PeriodSeconds, 1)) * time.Second
	select {
	case <-time.After(time.Duration(probe.InitialDelaySeconds) * time.Second):
	case <-stop:
		return
	}
	for {
		if w.probeOnce(c, probe) {
			w.mu.Lock()
			c.ready = true
			w.mu.Unlock()
			w.requestSync()
			return
		}
		// Sooner than the period for the first success, so tests need not
		// wait out a 10-second period; kubelet is no slower than this.
		select {
		case <-time.After(min(period, 500*time.Millisecond)):
		case <-stop:
			return
		case <-ctx.Done():
			return
		}
	}
}

func (w *podWorker) probeOnce(c *containerState, probe *v1.Probe) bool {
	address := w.manager.config.address
	port := func(value intstr.IntOrString) (int, bool) {
		if value.Type == intstr.Int {
			return int(value.IntVal), true
		}
		for _, p := range c.spec.Ports {
			if p.Name == value.StrVal {
				return int(p.ContainerPort), true
			}
		}
		return 0, false
	}
	switch {
	case probe.HTTPGet != nil:
		number, ok := port(probe.HTTPGet.Port)
		if !ok {
			return false
		}
		scheme := strings.ToLower(string(probe.HTTPGet.Scheme))
		if scheme == "" {
			scheme = "http"
		}
		client := &http.Client{Timeout: time.Second, Transport: &http.Transport{
			TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}} // #nosec: kubelet does not verify probes either
		response, err := client.Get(fmt.Sprintf("%s://%s%s", scheme, net.JoinHostPort(address, strconv.Itoa(number)), probe.HTTPGet.Path))
		if err != nil {
			return false
		}
		response.Body.Close()
		return response.StatusCode >= 200 && response.StatusCode < 400
	case probe.TCPSocket != nil:
		number, ok := port(probe.TCPSocket.Port)
		if !ok {
			return false
		}
		conn, err := net.DialTimeout("tcp", net.JoinHostPort(address, strconv.Itoa(number)), time.Second)
		if err != nil {
			return false
		}
		conn.Close()
		return true
	}
	return true // exec and gRPC probes are not simulated: pass
}

func (w *podWorker) requestSync() {
	select {
	case w.sync <- struct{}{}:
	default:
	}
}

// statusLoop writes the pod's status whenever it changes, until the pod
// is gone.
func (w *podWorker) statusLoop(ctx context.Context) {
	logger := klog.FromContext(ctx)
	for {
		select {
		case <-ctx.Done():
			return
		case <-w.stopped:
			return
		case <-w.sync:
		}
		err := retry.OnError(retry.DefaultBackoff, func(err error) bool { return !apierrors.IsNotFound(err) }, func() error {
			return w.writeStatus(ctx)
		})
		if err != nil && !apierrors.IsNotFound(err) {
			logger.Error(err, "writing pod status", "pod", klog.KObj(w.pod))
			go func() { time.Sleep(time.Second); w.requestSync() }()
		}
	}
}

func (w *podWorker) writeStatus(ctx context.Context) error {
	w.mu.Lock()
	namespace, name := w.pod.Namespace, w.pod.Name
	w.mu.Unlock()
	current, err := w.manager.client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	if current.UID != w.uid {
		return nil
	}
	// Written as kubelet's status manager writes it: a patch of the status
	// under the pod's UID (kubelet's own function), which a write of the
	// pod's metadata in between does not make conflict, and none at all
	// when nothing changed.
	updated := w.status(*current.Status.DeepCopy())
	_, _, _, err = podutil.PatchPodStatus(ctx, w.manager.client, namespace, name, w.uid, current.Status, updated)
	return err
}

// status: the pod's status from what runs here, keeping what others own
// (QoS class, conditions of other writers).
func (w *podWorker) status(old v1.PodStatus) v1.PodStatus {
	w.mu.Lock()
	defer w.mu.Unlock()
	address := w.manager.config.address
	status := v1.PodStatus{
		QOSClass: old.QOSClass, HostIP: address, HostIPs: []v1.HostIP{{IP: address}},
		PodIP: address, PodIPs: []v1.PodIP{{IP: address}}, StartTime: w.startTime,
		Reason: w.reason, Message: w.message,
		// Not the node's to write: kube-controller-manager records which
		// ResourceClaim it made for each of the pod's claim templates.
		ResourceClaimStatuses: old.ResourceClaimStatuses, ExtendedResourceClaimStatus: old.ExtendedResourceClaimStatus,
	}
	initialized, allReady, anyRunning, allDone, anyFailed := true, true, false, true, false
	for _, c := range w.containers {
		s := v1.ContainerStatus{Name: c.spec.Name, Image: c.spec.Image, ImageID: "simnode://" + c.spec.Image,
			RestartCount: c.restarts, Ready: c.ready, Started: ptr.To(c.process != nil)}
		switch {
		case c.process != nil:
			s.State.Running = &v1.ContainerStateRunning{StartedAt: *c.started}
			s.ContainerID = fmt.Sprintf("simnode://%d", c.process.Process.Pid)
		case c.done && c.last != nil:
			s.State.Terminated = c.last
			s.ContainerID = c.last.ContainerID
		default:
			s.State.Waiting = &v1.ContainerStateWaiting{Reason: c.waiting, Message: c.message}
		}
		if c.last != nil && (c.process != nil || !c.done) {
			s.LastTerminationState.Terminated = c.last
		}
		if c.isInit {
			if !c.done || (c.last != nil && c.last.ExitCode != 0) {
				if ptr.Deref(c.spec.RestartPolicy, "") != v1.ContainerRestartPolicyAlways || c.process == nil {
					initialized = initialized && c.done && c.last != nil && c.last.ExitCode == 0
				}
			}
			status.InitContainerStatuses = append(status.InitContainerStatuses, s)
			continue
		}
		status.ContainerStatuses = append(status.ContainerStatuses, s)
		allReady = allReady && c.ready
		anyRunning = anyRunning || c.process != nil
		allDone = allDone && c.done
		anyFailed = anyFailed || (c.done && c.last != nil && c.last.ExitCode != 0)
	}
	phase := w.phase
	if phase != v1.PodFailed {
		switch {
		case allDone && anyFailed:
			phase = v1.PodFailed
		case allDone:
			phase = v1.PodSucceeded
		case anyRunning || w.anyStartedLocked():
			phase = v1.PodRunning
		default:
			phase = v1.PodPending
		}
	}
	status.Phase = phase
	now := metav1.Now()
	condition := func(kind v1.PodConditionType, ok bool) {
		value := v1.ConditionFalse
		if ok {
			value = v1.ConditionTrue
		}
		transition := now
		for _, previous := range old.Conditions {
			if previous.Type == kind && previous.Status == value {
				transition = previous.LastTransitionTime
			}
		}
		status.Conditions = append(status.Conditions, v1.PodCondition{Type: kind, Status: value, LastTransitionTime: transition})
	}
	for _, previous := range old.Conditions {
		switch previous.Type {
		case v1.PodReadyToStartContainers, v1.PodInitialized, v1.ContainersReady, v1.PodReady:
		default:
			status.Conditions = append(status.Conditions, previous)
		}
	}
	running := phase == v1.PodRunning
	condition(v1.PodReadyToStartContainers, phase != v1.PodFailed || w.reason == "")
	condition(v1.PodInitialized, initialized)
	condition(v1.ContainersReady, running && allReady)
	condition(v1.PodReady, running && allReady)
	return status
}

func (w *podWorker) anyStartedLocked() bool {
	for _, c := range w.containers {
		if !c.isInit && (c.started != nil) {
			return true
		}
	}
	return false
}
