package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	authenticationv1 "k8s.io/api/authentication/v1"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
)

// volumeSources makes the pod's volumes on the node and answers where each
// one's content is (for hostPath: the node's host path).
func volumeSources(ctx context.Context, client kubernetes.Interface, c *config, pod *v1.Pod, podDir string) (map[string]string, error) {
	sources := map[string]string{}
	for _, volume := range pod.Spec.Volumes {
		dir := filepath.Join(podDir, "volumes", volume.Name)
		var err error
		switch {
		case volume.HostPath != nil:
			dir, err = hostPathVolume(c, volume.HostPath)
		case volume.EmptyDir != nil:
			err = os.MkdirAll(dir, 0o777)
		case volume.ConfigMap != nil:
			var files map[string][]byte
			files, err = configMapFiles(ctx, client, pod.Namespace, volume.ConfigMap.Name, volume.ConfigMap.Items,
				ptr.Deref(volume.ConfigMap.Optional, false))
			if err == nil {
				err = writeFiles(dir, files, modeOf(volume.ConfigMap.DefaultMode))
			}
		case volume.Secret != nil:
			var files map[string][]byte
			files, err = secretFiles(ctx, client, pod.Namespace, volume.Secret.SecretName, volume.Secret.Items,
				ptr.Deref(volume.Secret.Optional, false))
			if err == nil {
				err = writeFiles(dir, files, modeOf(volume.Secret.DefaultMode))
			}
		case volume.Projected != nil:
			err = projectedVolume(ctx, client, pod, volume.Projected, dir)
		case volume.DownwardAPI != nil:
			files := map[string][]byte{}
			for _, item := range volume.DownwardAPI.Items {
				if item.FieldRef == nil {
					return nil, fmt.Errorf("volume %s: only fieldRef items are simulated", volume.Name)
				}
				value, ferr := fieldValue(pod, item.FieldRef.FieldPath, "")
				if ferr != nil {
					return nil, ferr
				}
				files[item.Path] = []byte(value)
			}
			err = writeFiles(dir, files, modeOf(volume.DownwardAPI.DefaultMode))
		default:
			err = fmt.Errorf("this kind of volume is not simulated")
		}
		if err != nil {
			return nil, fmt.Errorf("volume %s: %w", volume.Name, err)
		}
		sources[volume.Name] = dir
	}
	return sources, nil
}

func modeOf(mode *int32) os.FileMode {
	if mode == nil {
		return 0o644
	}
	return os.FileMode(*mode)
}

// hostSource is where the node's host path `path` lies on this machine:
// under the node's host root, but for devices (`/dev/...`), which a
// simulated node shares with the machine (vgpu's grants mount /dev/null at
// each GPU's device-list path, as NVIDIA's toolkit reads them).
func hostSource(hostRoot, path string) string {
	clean := filepath.Clean("/" + path)
	if strings.HasPrefix(clean, "/dev/") {
		return clean
	}
	return filepath.Join(hostRoot, path)
}

func hostPathVolume(c *config, source *v1.HostPathVolumeSource) (string, error) {
	path := hostSource(c.hostRoot, source.Path)
	kind := ptr.Deref(source.Type, v1.HostPathUnset)
	info, err := os.Stat(path)
	switch kind {
	case v1.HostPathCharDev:
		if err != nil || info.Mode()&os.ModeCharDevice == 0 {
			return "", fmt.Errorf("hostPath type check failed: %s is not a character device", source.Path)
		}
	case v1.HostPathDirectoryOrCreate:
		if os.IsNotExist(err) {
			return path, os.MkdirAll(path, 0o755)
		}
	case v1.HostPathFileOrCreate:
		if os.IsNotExist(err) {
			return path, makeMountPoint(path, false)
		}
	case v1.HostPathDirectory:
		if err != nil || !info.IsDir() {
			return "", fmt.Errorf("hostPath type check failed: %s is not a directory", source.Path)
		}
	case v1.HostPathFile:
		if err != nil || info.IsDir() {
			return "", fmt.Errorf("hostPath type check failed: %s is not a file", source.Path)
		}
	case v1.HostPathUnset:
		if os.IsNotExist(err) {
			// A runtime creates a missing bind source as a folder.
			return path, os.MkdirAll(path, 0o755)
		}
	}
	return path, nil
}

func keyFiles(data map[string][]byte, items []v1.KeyToPath) (map[string][]byte, error) {
	files := map[string][]byte{}
	if len(items) == 0 {
		for key, value := range data {
			files[key] = value
		}
		return files, nil
	}
	for _, item := range items {
		value, ok := data[item.Key]
		if !ok {
			return nil, fmt.Errorf("key %s is missing", item.Key)
		}
		files[item.Path] = value
	}
	return files, nil
}

func configMapFiles(ctx context.Context, client kubernetes.Interface, namespace, name string, items []v1.KeyToPath, optional bool) (map[string][]byte, error) {
	cm, err := client.CoreV1().ConfigMaps(namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		if optional {
			return map[string][]byte{}, nil
		}
		return nil, fmt.Errorf("configmap %s: %w", name, err)
	}
	data := map[string][]byte{}
	for key, value := range cm.Data {
		data[key] = []byte(value)
	}
	for key, value := range cm.BinaryData {
		data[key] = value
	}
	return keyFiles(data, items)
}

func secretFiles(ctx context.Context, client kubernetes.Interface, namespace, name string, items []v1.KeyToPath, optional bool) (map[string][]byte, error) {
	secret, err := client.CoreV1().Secrets(namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		if optional {
			return map[string][]byte{}, nil
		}
		return nil, fmt.Errorf("secret %s: %w", name, err)
	}
	return keyFiles(secret.Data, items)
}

func projectedVolume(ctx context.Context, client kubernetes.Interface, pod *v1.Pod, projected *v1.ProjectedVolumeSource, dir string) error {
	files := map[string][]byte{}
	add := func(more map[string][]byte) {
		for path, value := range more {
			files[path] = value
		}
	}
	for _, source := range projected.Sources {
		switch {
		case source.ServiceAccountToken != nil:
			token, err := serviceAccountToken(ctx, client, pod, source.ServiceAccountToken)
			if err != nil {
				return err
			}
			files[source.ServiceAccountToken.Path] = []byte(token)
		case source.ConfigMap != nil:
			more, err := configMapFiles(ctx, client, pod.Namespace, source.ConfigMap.Name, source.ConfigMap.Items,
				ptr.Deref(source.ConfigMap.Optional, false))
			if err != nil {
				return err
			}
			add(more)
		case source.Secret != nil:
			more, err := secretFiles(ctx, client, pod.Namespace, source.Secret.Name, source.Secret.Items,
				ptr.Deref(source.Secret.Optional, false))
			if err != nil {
				return err
			}
			add(more)
		case source.DownwardAPI != nil:
			for _, item := range source.DownwardAPI.Items {
				if item.FieldRef == nil {
					return fmt.Errorf("only fieldRef downward API items are simulated")
				}
				value, err := fieldValue(pod, item.FieldRef.FieldPath, "")
				if err != nil {
					return err
				}
				files[item.Path] = []byte(value)
			}
		default:
			return fmt.Errorf("this projected source is not simulated")
		}
	}
	return writeFiles(dir, files, modeOf(projected.DefaultMode))
}

// serviceAccountToken asks the API server for a token bound to the pod, as
// kubelet does for a projected token.
func serviceAccountToken(ctx context.Context, client kubernetes.Interface, pod *v1.Pod, source *v1.ServiceAccountTokenProjection) (string, error) {
	account := pod.Spec.ServiceAccountName
	if account == "" {
		account = "default"
	}
	request := &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{
		ExpirationSeconds: source.ExpirationSeconds,
		BoundObjectRef:    &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
	}}
	if source.Audience != "" {
		request.Spec.Audiences = []string{source.Audience}
	}
	answer, err := client.CoreV1().ServiceAccounts(pod.Namespace).CreateToken(ctx, account, request, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("token for service account %s/%s: %w", pod.Namespace, account, err)
	}
	return answer.Status.Token, nil
}

func writeFiles(dir string, files map[string][]byte, mode os.FileMode) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for path, content := range files {
		target := filepath.Join(dir, path)
		if !strings.HasPrefix(target, dir+string(filepath.Separator)) {
			return fmt.Errorf("file %q leaves its volume", path)
		}
		if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(target, content, mode); err != nil {
			return err
		}
		if err := os.Chmod(target, mode); err != nil {
			return err
		}
	}
	return nil
}

// fieldValue answers a downward-API field path.
func fieldValue(pod *v1.Pod, path, podIP string) (string, error) {
	switch path {
	case "metadata.name":
		return pod.Name, nil
	case "metadata.namespace":
		return pod.Namespace, nil
	case "metadata.uid":
		return string(pod.UID), nil
	case "spec.nodeName":
		return pod.Spec.NodeName, nil
	case "spec.serviceAccountName":
		return pod.Spec.ServiceAccountName, nil
	case "status.hostIP", "status.podIP":
		return podIP, nil
	}
	for prefix, values := range map[string]map[string]string{"metadata.labels": pod.Labels, "metadata.annotations": pod.Annotations} {
		if rest, ok := strings.CutPrefix(path, prefix+"['"); ok {
			return values[strings.TrimSuffix(rest, "']")], nil
		}
	}
	return "", fmt.Errorf("field %s is not simulated", path)
}
