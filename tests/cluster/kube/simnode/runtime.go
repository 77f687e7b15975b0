package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
)

const containerInitCommand = "container-init"

// imageMount is one step of making a container's root: a bind mount of a
// host path, or a fresh tmpfs.
type imageMount struct {
	Kind     string `json:"kind"` // "bind", "rbind" or "tmpfs"
	Source   string `json:"source,omitempty"`
	Target   string `json:"target"`
	ReadOnly bool   `json:"readOnly,omitempty"`
}

// containerSpec is what container-init gets: everything it needs to turn
// itself into the container's program.
type containerSpec struct {
	Rootfs     string       `json:"rootfs"`
	Mounts     []imageMount `json:"mounts"`
	OwnProc    bool         `json:"ownProc"` // mount a /proc of the new PID namespace
	Hostname   string       `json:"hostname"`
	WorkingDir string       `json:"workingDir"`
	Argv       []string     `json:"argv"`
	Env        []string     `json:"env"`
	UID        *int64       `json:"uid,omitempty"`
	GID        *int64       `json:"gid,omitempty"`
}

// parseMounts reads the --mount flags: bind:SRC:DST[:ro] or tmpfs:DST.
func parseMounts(flags []string) ([]imageMount, error) {
	var mounts []imageMount
	for _, text := range flags {
		parts := strings.Split(text, ":")
		switch {
		case parts[0] == "tmpfs" && len(parts) == 2:
			mounts = append(mounts, imageMount{Kind: "tmpfs", Target: parts[1]})
		case parts[0] == "bind" && (len(parts) == 3 || (len(parts) == 4 && parts[3] == "ro")):
			mounts = append(mounts, imageMount{Kind: "bind", Source: parts[1], Target: parts[2], ReadOnly: len(parts) == 4})
		default:
			return nil, fmt.Errorf("--mount %q: want bind:SRC:DST[:ro] or tmpfs:DST", text)
		}
	}
	for _, mount := range mounts {
		if !filepath.IsAbs(mount.Target) || (mount.Kind == "bind" && !filepath.IsAbs(mount.Source)) {
			return nil, fmt.Errorf("--mount %s:%s: paths must be absolute", mount.Source, mount.Target)
		}
	}
	return mounts, nil
}

// startContainer starts container-init in new mount and UTS (and, unless
// hostPID, PID) namespaces with `spec`; its output goes to `log`.
func startContainer(spec *containerSpec, specPath string, log *os.File, hostPID bool) (*exec.Cmd, error) {
	data, err := json.Marshal(spec)
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(specPath, data, 0o600); err != nil {
		return nil, err
	}
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self, containerInitCommand, specPath)
	cmd.Stdout = log
	cmd.Stderr = log
	flags := uintptr(syscall.CLONE_NEWNS | syscall.CLONE_NEWUTS)
	if !hostPID {
		flags |= syscall.CLONE_NEWPID
	}
	// Pdeathsig: a container never outlives its node.
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: flags, Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	return cmd, nil
}

// containerInit runs in the container's new namespaces: builds its root,
// enters it, drops to its user and execs its program. Errors go to the
// container's log and make it exit 127, as a runtime's would.
func containerInit(args []string) int {
	if len(args) != 1 {
		fmt.Fprintln(os.Stderr, "container-init: want the spec file")
		return 127
	}
	if err := initContainer(args[0]); err != nil {
		fmt.Fprintf(os.Stderr, "simnode: cannot start the container: %v\n", err)
		return 127
	}
	return 0 // not reached: exec replaced us
}

func initContainer(specPath string) error {
	data, err := os.ReadFile(specPath)
	if err != nil {
		return err
	}
	var spec containerSpec
	if err := json.Unmarshal(data, &spec); err != nil {
		return err
	}
	if err := syscall.Sethostname([]byte(spec.Hostname)); err != nil {
		return fmt.Errorf("hostname: %w", err)
	}
	// Nothing mounted here propagates back to the node.
	if err := syscall.Mount("", "/", "", syscall.MS_REC|syscall.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("making / private: %w", err)
	}
	root := spec.Rootfs
	if err := syscall.Mount(root, root, "", syscall.MS_BIND|syscall.MS_REC, ""); err != nil {
		return fmt.Errorf("bind %s: %w", root, err)
	}
	for _, mount := range spec.Mounts {
		if err := applyMount(root, mount); err != nil {
			return err
		}
	}
	if spec.OwnProc {
		target := filepath.Join(root, "proc")
		if err := os.MkdirAll(target, 0o755); err != nil {
			return err
		}
		if err := syscall.Mount("proc", target, "proc", syscall.MS_NOSUID|syscall.MS_NODEV|syscall.MS_NOEXEC, ""); err != nil {
			return fmt.Errorf("mounting /proc: %w", err)
		}
	}
	if err := syscall.Chroot(root); err != nil {
		return fmt.Errorf("chroot %s: %w", root, err)
	}
	dir := spec.WorkingDir
	if dir == "" {
		dir = "/"
	}
	if err := os.Chdir(dir); err != nil {
		return fmt.Errorf("working directory %s: %w", dir, err)
	}
	if spec.GID != nil {
		if err := syscall.Setgroups([]int{int(*spec.GID)}); err != nil {
			return err
		}
		if err := syscall.Setgid(int(*spec.GID)); err != nil {
			return err
		}
	}
	if spec.UID != nil {
		if spec.GID == nil {
			if err := syscall.Setgroups(nil); err != nil {
				return err
			}
		}
		if err := syscall.Setuid(int(*spec.UID)); err != nil {
			return err
		}
	}
	if len(spec.Argv) == 0 {
		return fmt.Errorf("the container has no command (simulated images have no entrypoint)")
	}
	program, err := lookPath(spec.Argv[0], spec.Env)
	if err != nil {
		return err
	}
	return syscall.Exec(program, spec.Argv, spec.Env)
}

// applyMount performs one mount inside `root`, creating its mount point
// (a file for a file, a folder otherwise) in the root folder.
func applyMount(root string, mount imageMount) error {
	target := filepath.Join(root, mount.Target)
	switch mount.Kind {
	case "tmpfs":
		if err := os.MkdirAll(target, 0o755); err != nil {
			return err
		}
		if err := syscall.Mount("tmpfs", target, "tmpfs", 0, "mode=755"); err != nil {
			return fmt.Errorf("tmpfs on %s: %w", mount.Target, err)
		}
		return nil
	case "bind", "rbind":
		info, err := os.Stat(mount.Source)
		if err != nil {
			return fmt.Errorf("mount source: %w", err)
		}
		if err := makeMountPoint(target, info.IsDir()); err != nil {
			return err
		}
		flags := uintptr(syscall.MS_BIND | syscall.MS_REC)
		if err := syscall.Mount(mount.Source, target, "", flags, ""); err != nil {
			return fmt.Errorf("bind %s on %s: %w", mount.Source, mount.Target, err)
		}
		if mount.ReadOnly {
			flags = syscall.MS_BIND | syscall.MS_REMOUNT | syscall.MS_RDONLY
			if err := syscall.Mount("", target, "", flags, ""); err != nil {
				return fmt.Errorf("read-only %s: %w", mount.Target, err)
			}
		}
		return nil
	}
	return fmt.Errorf("unknown mount kind %q", mount.Kind)
}

func makeMountPoint(target string, dir bool) error {
	if dir {
		return os.MkdirAll(target, 0o755)
	}
	if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
		return err
	}
	if _, err := os.Stat(target); err == nil {
		return nil
	}
	file, err := os.OpenFile(target, os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	return file.Close()
}

// lookPath finds `name` on the container's PATH (inside its root).
func lookPath(name string, env []string) (string, error) {
	if strings.Contains(name, "/") {
		return name, nil
	}
	path := "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	for _, kv := range env {
		if value, ok := strings.CutPrefix(kv, "PATH="); ok {
			path = value
		}
	}
	for _, dir := range filepath.SplitList(path) {
		candidate := filepath.Join(dir, name)
		if info, err := os.Stat(candidate); err == nil && !info.IsDir() && info.Mode()&0o111 != 0 {
			return candidate, nil
		}
	}
	return "", fmt.Errorf("%s: not found on PATH %s", name, path)
}
