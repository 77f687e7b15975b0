{{/*
Values files written for HAMi's chart and for nvidia-gpu-scheduler's are
accepted unchanged (docs/migrating.md). Their keys that have a vgpu meaning
are copied onto vgpu's own values by vgpu.peerValues.apply, which every
template includes first; a peer key that is given (and not empty) wins over
vgpu's value. NOTES.txt lists the keys so mapped and names every other peer
key that was given as ignored. values.schema.json accepts exactly the keys
listed here (tests/deploy/test_helm_chart.py checks that the two agree).
*/}}

{{/*
The mapped keys, in the order they are applied (a later one onto the same
value wins). from: the peer's key; to: vgpu's; as: how the value converts
(a plain copy when absent); keepEmpty: an empty value is given too.
*/}}
{{- define "vgpu.peerValues.mappings" -}}
# HAMi (and the 4paradigm vGPU scheduler before it)
- {from: resourceName, to: resources.gpu}
- {from: resourceMem, to: resources.memory}
- {from: resourceMemPercentage, to: resources.memoryPercentage}
- {from: resourceCores, to: resources.cores}
- {from: resourcePriority, to: resources.priority}
- {from: schedulerName, to: scheduler.name}
- {from: global.imagePullSecrets, to: imagePullSecrets, as: secret-names}
- {from: scheduler.nodeLabelSelector, to: scheduler.nodeSelector}
- {from: scheduler.defaultSchedulerPolicy.nodeSchedulerPolicy, to: scheduler.extender.nodePolicy}
- {from: scheduler.defaultSchedulerPolicy.gpuSchedulerPolicy, to: scheduler.extender.gpuPolicy}
- {from: scheduler.defaultMem, to: scheduler.extender.defaultMemoryMiB}
- {from: scheduler.defaultCores, to: scheduler.extender.defaultCores}
- {from: scheduler.extenderHTTPTimeout, to: scheduler.extender.httpTimeoutSeconds}
- {from: scheduler.kubeScheduler.imageTag, to: scheduler.kubeScheduler.image.tag}
- {from: scheduler.kubeScheduler.image.registry, to: scheduler.kubeScheduler.image.repository, as: registry}
- {from: scheduler.admissionWebhook.enabled, to: scheduler.webhook.enabled}
- {from: scheduler.admissionWebhook.failurePolicy, to: scheduler.webhook.failurePolicy}
- {from: scheduler.admissionWebhook.whitelistNamespaces, to: scheduler.webhook.ignoreNamespaces}
- {from: scheduler.networkPolicy.enabled, to: networkPolicy.enabled}
- {from: devicePlugin.deviceSplitCount, to: node.devicePlugin.splitCount}
- {from: devicePlugin.deviceMemoryScaling, to: node.devicePlugin.deviceMemoryScaling}
- {from: devicePlugin.nvidiaNodeSelector, to: node.nodeSelector}
- {from: devicePlugin.tolerations, to: node.tolerations}
- {from: devicePlugin.runtimeClassName, to: node.runtimeClassName, keepEmpty: true}
- {from: devicePlugin.service.httpPort, to: node.monitor.port}
- {from: devicePlugin.libPath, to: hostDir}
- {from: devicePlugin.pluginPath, to: node.kubeletDir, as: /device-plugins}
- {from: devicePlugin.resources, to: node.devicePlugin.resources}
- {from: devicePlugin.monitor.resources, to: node.monitor.resources}
- {from: devices.nvidia.gpuCorePolicy, to: node.devicePlugin.corePolicy}
- {from: devicePlugin.disablecorelimit, to: node.devicePlugin.corePolicy, as: disable-when-true}
# nvidia-gpu-scheduler (its gpuserver is the extender, gpuserver-ds the node agent)
- {from: replicaCount, to: scheduler.replicas}
- {from: nodeSelector, to: scheduler.nodeSelector}
- {from: tolerations, to: scheduler.tolerations}
- {from: resources.limits, to: scheduler.extender.resources.limits}
- {from: resources.requests, to: scheduler.extender.resources.requests}
- {from: nodeSelectorDaemonSet, to: node.nodeSelector}
- {from: defaultPodResourcesDir, to: node.kubeletDir, as: /pod-resources}
{{- end -}}

{{/*
Every peer key that is not vgpu's own: the mapped ones above or the
objects holding them, and those with no vgpu meaning. Keys of other
devices' resource names (mluResourceName, hcuResourceMem...) are matched by
vgpu.peerValues.vendorResourceKey instead.
*/}}
{{- define "vgpu.peerValues.keys" -}}
# HAMi
- global
- nameOverride
- fullnameOverride
- namespaceOverride
- version
- platform
- openshift
- selinux
- resourceName
- resourceMem
- resourceMemPercentage
- resourceCores
- resourcePriority
- metaxsGPUTopologyAware
- schedulerName
- podSecurityPolicy
- devicePlugin
- mockDevicePlugin
- devices
- legacyMetrics
- prometheus
- device-config
- scheduler.nodeName
- scheduler.nodeLabelSelector
- scheduler.overwriteEnv
- scheduler.defaultSchedulerPolicy
- scheduler.metricsBindAddress
- scheduler.kubeQPS
- scheduler.kubeBurst
- scheduler.kubeTimeout
- scheduler.nodeLockRetryTimeout
- scheduler.nodeLockExpire
- scheduler.extenderHTTPTimeout
- scheduler.forceOverwriteDefaultScheduler
- scheduler.livenessProbe
- scheduler.leaderElect
- scheduler.podDisruptionBudget
- scheduler.podAnnotations
- scheduler.serviceAccountName
- scheduler.admissionWebhook
- scheduler.certManager
- scheduler.patch
- scheduler.networkPolicy
- scheduler.defaultMem
- scheduler.defaultCores
- scheduler.defaultGPUNum
- scheduler.kubeScheduler.enabled
- scheduler.kubeScheduler.imageTag
- scheduler.kubeScheduler.resources
- scheduler.kubeScheduler.extraArgs
- scheduler.kubeScheduler.extraNewArgs
- scheduler.kubeScheduler.image.registry
- scheduler.kubeScheduler.image.pullPolicy
- scheduler.kubeScheduler.image.pullSecrets
- scheduler.extender.image
- scheduler.extender.extraArgs
- scheduler.service.type
- scheduler.service.httpPort
- scheduler.service.httpTargetPort
- scheduler.service.schedulerPort
- scheduler.service.monitorPort
- scheduler.service.monitorTargetPort
- scheduler.service.labels
# nvidia-gpu-scheduler
- replicaCount
- image.gpuserver
- image.gpuserverds
- defaultPodResourcesDir
- apigroup
- apiversion
- nodeSelectorDaemonSet
- serviceAccount
- podAnnotations
- podSecurityContext
- securityContext
- service
- resources.limits
- resources.requests
- nodeSelector
- tolerations
- affinity
{{- end -}}

{{/* HAMi's resource names of other devices (mluResourceName, ...). */}}
{{- define "vgpu.peerValues.vendorResourceKey" -}}^[a-z]+Resource[A-Za-z]*${{- end -}}

{{/* Whether a value counts as not given: null, "", {} or []. */}}
{{- define "vgpu.peerValues.isEmpty" -}}
{{- if or (kindIs "invalid" .) (and (kindIs "string" .) (eq . "")) (and (or (kindIs "map" .) (kindIs "slice" .)) (eq (len .) 0)) -}}true{{- end -}}
{{- end -}}

{{/* Looks up .path (dotted) in .values; sets .out.value when present. */}}
{{- define "vgpu.peerValues.get" -}}
{{- $node := .values -}}
{{- $found := true -}}
{{- range $key := splitList "." .path -}}
{{- if and $found (kindIs "map" $node) (hasKey $node $key) -}}
{{- $node = index $node $key -}}
{{- else -}}
{{- $found = false -}}
{{- end -}}
{{- end -}}
{{- if $found -}}
{{- $_ := set .out "value" $node -}}
{{- end -}}
{{- end -}}

{{/* Sets .path (dotted) in .values to .value, making maps on the way. */}}
{{- define "vgpu.peerValues.set" -}}
{{- $node := .values -}}
{{- $keys := splitList "." .path -}}
{{- range $key := initial $keys -}}
{{- if not (kindIs "map" (index $node $key)) -}}
{{- $_ := set $node $key dict -}}
{{- end -}}
{{- $node = index $node $key -}}
{{- end -}}
{{- $_ := set $node (last $keys) .value -}}
{{- end -}}

{{/*
Converts mapping .m's given value .value into vgpu's, into .out.value (left
unset when the key changes nothing).
*/}}
{{- define "vgpu.peerValues.convert" -}}
{{- $m := .m -}}
{{- $value := .value -}}
{{- if not $m.as -}}
{{- $_ := set .out "value" $value -}}
{{- else if eq $m.as "registry" -}}
{{- /* HAMi names the registry apart from the repository: it replaces the
     registry host of vgpu's repository, or goes in front of a repository
     that names none. */ -}}
{{- $current := dict -}}
{{- $_ := include "vgpu.peerValues.get" (dict "values" .values "path" $m.to "out" $current) -}}
{{- $parts := splitList "/" $current.value -}}
{{- $host := first $parts -}}
{{- if and (gt (len $parts) 1) (or (contains "." $host) (contains ":" $host) (eq $host "localhost")) -}}
{{- $parts = rest $parts -}}
{{- end -}}
{{- $_ := set .out "value" (printf "%s/%s" (trimSuffix "/" (toString $value)) (join "/" $parts)) -}}
{{- else if eq $m.as "secret-names" -}}
{{- /* HAMi lists the secrets by name; Kubernetes as {name: ...}. */ -}}
{{- $secrets := list -}}
{{- range $value -}}
{{- $secrets = append $secrets (kindIs "string" . | ternary (dict "name" .) .) -}}
{{- end -}}
{{- $_ := set .out "value" $secrets -}}
{{- else if eq $m.as "disable-when-true" -}}
{{- if eq (toString $value) "true" -}}
{{- $_ := set .out "value" "disable" -}}
{{- end -}}
{{- else -}}
{{- /* A directory below kubelet's: kubelet's own is what vgpu takes. */ -}}
{{- $dir := trimSuffix "/" (toString $value) -}}
{{- if not (hasSuffix $m.as $dir) -}}
{{- fail (printf "%s (%s): vgpu takes kubelet's directory from it, so it must end in %s; set node.kubeletDir instead" $m.from $dir $m.as) -}}
{{- end -}}
{{- $_ := set .out "value" (trimSuffix $m.as $dir) -}}
{{- end -}}
{{- end -}}

{{/* Copies the given peer keys onto vgpu's values, once per render. */}}
{{- define "vgpu.peerValues.apply" -}}
{{- if not (hasKey .Values "vgpuPeerValuesApplied") -}}
{{- $_ := set .Values "vgpuPeerValuesApplied" true -}}
{{- range $m := include "vgpu.peerValues.mappings" . | fromYamlArray -}}
{{- $given := dict -}}
{{- $_ := include "vgpu.peerValues.get" (dict "values" $.Values "path" $m.from "out" $given) -}}
{{- if and (hasKey $given "value") (or $m.keepEmpty (not (include "vgpu.peerValues.isEmpty" $given.value))) -}}
{{- $converted := dict -}}
{{- $_ := include "vgpu.peerValues.convert" (dict "m" $m "value" $given.value "values" $.Values "out" $converted) -}}
{{- if hasKey $converted "value" -}}
{{- $_ := include "vgpu.peerValues.set" (dict "values" $.Values "path" $m.to "value" $converted.value) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The given mapped peer keys, as YAML lines "from -> to: value in effect". */}}
{{- define "vgpu.peerValues.mapped" -}}
{{- $lines := list -}}
{{- range $m := include "vgpu.peerValues.mappings" . | fromYamlArray -}}
{{- $given := dict -}}
{{- $_ := include "vgpu.peerValues.get" (dict "values" $.Values "path" $m.from "out" $given) -}}
{{- if and (hasKey $given "value") (or $m.keepEmpty (not (include "vgpu.peerValues.isEmpty" $given.value))) -}}
{{- $now := dict -}}
{{- $_ := include "vgpu.peerValues.get" (dict "values" $.Values "path" $m.to "out" $now) -}}
{{- $lines = append $lines (printf "%s -> %s: %s" $m.from $m.to (toJson $now.value)) -}}
{{- end -}}
{{- end -}}
{{- toYaml $lines -}}
{{- end -}}

{{/* Collects into .acc.paths the keys under .path that no mapping reads. */}}
{{- define "vgpu.peerValues.walk" -}}
{{- $below := printf "%s." .path -}}
{{- $mappedBelow := false -}}
{{- range .mapped -}}
{{- if hasPrefix $below . -}}
{{- $mappedBelow = true -}}
{{- end -}}
{{- end -}}
{{- if has .path .mapped -}}
{{- else if and $mappedBelow (kindIs "map" .value) -}}
{{- range $key, $value := .value -}}
{{- if not (include "vgpu.peerValues.isEmpty" $value) -}}
{{- $_ := include "vgpu.peerValues.walk" (dict "path" (printf "%s%s" $below $key) "value" $value "mapped" $.mapped "acc" $.acc) -}}
{{- end -}}
{{- end -}}
{{- else -}}
{{- $_ := set .acc "paths" (append .acc.paths (printf "%s: %s" .path (toJson .value | trunc 80))) -}}
{{- end -}}
{{- end -}}

{{/* The given peer keys with no vgpu meaning, as YAML lines "key: value". */}}
{{- define "vgpu.peerValues.ignored" -}}
{{- $mapped := list -}}
{{- range include "vgpu.peerValues.mappings" . | fromYamlArray -}}
{{- $mapped = append $mapped .from -}}
{{- end -}}
{{- $acc := dict "paths" list -}}
{{- range $path := include "vgpu.peerValues.keys" . | fromYamlArray -}}
{{- $given := dict -}}
{{- $_ := include "vgpu.peerValues.get" (dict "values" $.Values "path" $path "out" $given) -}}
{{- if and (hasKey $given "value") (not (include "vgpu.peerValues.isEmpty" $given.value)) -}}
{{- $_ := include "vgpu.peerValues.walk" (dict "path" $path "value" $given.value "mapped" $mapped "acc" $acc) -}}
{{- end -}}
{{- end -}}
{{- $pattern := include "vgpu.peerValues.vendorResourceKey" . -}}
{{- range $key, $value := .Values -}}
{{- if and (regexMatch $pattern $key) (not (include "vgpu.peerValues.isEmpty" $value)) -}}
{{- $_ := set $acc "paths" (append $acc.paths (printf "%s: %s" $key (toJson $value | trunc 80))) -}}
{{- end -}}
{{- end -}}
{{- toYaml $acc.paths -}}
{{- end -}}
